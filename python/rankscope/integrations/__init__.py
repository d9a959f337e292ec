"""rankscope where users train: one module per framework, each imported only when
asked for, so rankscope requires none of the frameworks.

- ``rankscope.integrations.transformers``: ``RankscopeCallback`` for the Hugging
  Face ``Trainer``;
- ``rankscope.integrations.lightning``: ``RankscopeCallback`` for the Lightning
  ``Trainer``;
- ``rankscope.integrations.accelerate``: ``watch`` for a model that
  ``Accelerator.prepare`` returned, and the recipe of a loop.

Each uses only the public API (``rankscope.init``, ``Agent.watch``,
``Agent.step``); docs/integrations.md says what each records and what it does not.
"""
