"""rankscope for the Hugging Face ``Trainer``: one callback records every optimizer
step of every rank.

    from rankscope.integrations.transformers import RankscopeCallback
    trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[RankscopeCallback()])

Launch as usual (``torchrun``, ``accelerate launch`` or ``python``): rank, world
size and run id come from the launcher's variables, everything else from
``RANKSCOPE_*`` or the callback's keywords, which are :func:`rankscope.init`'s.

A step is one optimizer step (``state.global_step``). Under gradient accumulation
its row covers every micro-batch, and the layers are sampled on the first
micro-batch of a sampled step (a layer is sampled once per step). Phases, from the
callback events and a hook on the model: ``forward`` is the model's forward of
each micro-batch; ``backward`` runs from the end of a forward to the end of its
micro-batch (``on_substep_end``), or for the last micro-batch to
``on_pre_optimizer_step``, so it holds the gradient clipping too; ``optimizer`` is
``on_pre_optimizer_step`` to ``on_optimizer_step``. The input pipeline runs before
``on_step_begin`` (the Trainer fetches a step's micro-batches ahead), outside the
step: ``data`` is not recorded. ``loss``, ``lr`` and ``grad_norm`` are the
Trainer's logs (``logging_steps``: the loss is its mean since the last log) on
the steps where it logs; those steps end after the log, the others at
``on_step_end``. ``samples`` counts the examples of the step's micro-batches.
"""

from __future__ import annotations

import sys
from typing import Any, Optional

try:
    from transformers import TrainerCallback
except ImportError as error:  # pragma: no cover: depends on the environment
    raise ImportError(
        f"rankscope.integrations.transformers needs the transformers package ({error}): "
        "pip install transformers"
    ) from error

import torch

import rankscope

from ._events import EventStep, batch_size

__all__ = ["RankscopeCallback"]


class RankscopeCallback(TrainerCallback):
    """Records the Trainer's optimizer steps, the layers of its model and the
    gradient all-reduce (``steps.comm_ms``) under DDP.

    ``RankscopeCallback()`` starts the agent at ``on_train_begin`` with
    ``rankscope.init(**init_keywords)`` (``workload="transformers"`` unless given)
    and finishes it at ``on_train_end``, or on an exception that ends the program.
    ``RankscopeCallback(agent=agent)`` uses an agent you started, and leaves
    finishing it to you.
    """

    def __init__(self, agent: Any = None, **init_keywords: Any) -> None:
        if agent is not None and init_keywords:
            raise TypeError(
                f"RankscopeCallback got agent= and init keywords {sorted(init_keywords)}: "
                "give the keywords to rankscope.init() instead, or leave out agent="
            )
        self._agent = agent
        self._owns_agent = agent is None
        self._init_keywords = {"workload": "transformers", **init_keywords}
        self._steps: Optional[EventStep] = None
        self._handles: list = []
        self._samples = 0
        self._log_pending = False
        self._comm_checked = False
        self._previous_excepthook: Any = None
        self._finished = False

    @property
    def agent(self) -> Any:
        """The rank's agent (None before training begins)."""
        return self._agent

    # -- the run --------------------------------------------------------------

    def on_train_begin(self, args, state, control, model=None, **kwargs):  # type: ignore[no-untyped-def]
        if self._agent is None or (self._owns_agent and self._finished):
            self._agent = rankscope.init(**self._init_keywords)
            self._finished = False
        if not self._agent.active:
            return  # mode off, or rank0 mode on another rank: nothing to record here
        self._steps = EventStep(self._agent)
        self._comm_checked = False
        if model is not None:
            # The Trainer hands callbacks its unwrapped model: layer names carry no
            # wrapper prefix. The DDP wrapper, for comm_ms, is found at its forward.
            self._agent.watch(model, comm=False)
            self._handles = [
                model.register_forward_pre_hook(self._forward_begins, with_kwargs=True),
                model.register_forward_hook(self._forward_ends),
            ]
        self._previous_excepthook = sys.excepthook
        sys.excepthook = self._excepthook

    def on_train_end(self, args, state, control, **kwargs):  # type: ignore[no-untyped-def]
        self._close(None)

    # -- a step -----------------------------------------------------------------

    def on_step_begin(self, args, state, control, **kwargs):  # type: ignore[no-untyped-def]
        if self._steps is None:
            return
        self._steps.begin(state.global_step)
        self._samples = 0
        self._log_pending = False

    def on_substep_end(self, args, state, control, **kwargs):  # type: ignore[no-untyped-def]
        if self._steps is not None:
            self._steps.end_phase()

    def on_pre_optimizer_step(self, args, state, control, **kwargs):  # type: ignore[no-untyped-def]
        if self._steps is not None:
            self._steps.switch("optimizer")

    def on_optimizer_step(self, args, state, control, **kwargs):  # type: ignore[no-untyped-def]
        if self._steps is not None:
            self._steps.end_phase()

    def on_step_end(self, args, state, control, **kwargs):  # type: ignore[no-untyped-def]
        steps = self._steps
        if steps is None or not steps.open:
            return
        steps.end_phase()
        steps.record(samples=self._samples or None)
        # The Trainer's default flow callback, called before this one, has decided
        # whether this step logs: then the step ends with its log.
        if control.should_log:
            self._log_pending = True
        else:
            steps.end()

    def on_log(self, args, state, control, logs=None, **kwargs):  # type: ignore[no-untyped-def]
        steps = self._steps
        if steps is None or not steps.open or not self._log_pending:
            return
        logs = logs or {}
        steps.record(
            loss=_number(logs.get("loss")),
            lr=_number(logs.get("learning_rate")),
            grad_norm=_number(logs.get("grad_norm")),
        )
        self._log_pending = False
        steps.end()

    def on_epoch_end(self, args, state, control, **kwargs):  # type: ignore[no-untyped-def]
        if self._steps is not None:
            self._steps.end()

    # -- the model's forward ------------------------------------------------------

    def _forward_begins(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        steps = self._steps
        if steps is None or not steps.open or not module.training:
            return
        steps.switch("forward")
        self._samples += batch_size(kwargs) or batch_size(args) or 0
        if not self._comm_checked:
            self._comm_checked = True
            self._time_allreduce()

    def _forward_ends(self, module: torch.nn.Module, args: tuple, output: Any) -> None:
        steps = self._steps
        if steps is not None and steps.phase_name == "forward":
            steps.switch("backward")

    def _time_allreduce(self) -> None:
        """Registers the timed all-reduce on the DDP wrapper that is running this
        forward, the one the Trainer built around the model (callbacks are not
        given it)."""
        if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
            return
        ddp = torch.nn.parallel.DistributedDataParallel._get_active_ddp_module()
        if ddp is None:
            return
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

        try:
            ddp.register_comm_hook(None, self._agent.wrap_comm_hook(allreduce_hook))
        except RuntimeError as error:
            import warnings

            warnings.warn(
                f"rankscope cannot time the Trainer's all-reduce ({error}): steps.comm_ms "
                "is not recorded; to record it with a communication hook of your own, "
                "register agent.wrap_comm_hook(hook) instead of hook",
                RuntimeWarning,
                stacklevel=2,
            )

    # -- the end ------------------------------------------------------------------

    def _excepthook(self, kind, error, traceback):  # type: ignore[no-untyped-def]
        # An exception that ends the program: its step ends with it, and the agent
        # sends what it has before the interpreter goes.
        try:
            if self._agent is not None:
                self._agent.event("exception", f"{kind.__name__}: {error}")
            self._close(error)
        finally:
            previous = self._previous_excepthook or sys.__excepthook__
            previous(kind, error, traceback)

    def _close(self, error: Optional[BaseException]) -> None:
        if self._steps is not None:
            self._steps.end(error)
        for handle in self._handles:
            handle.remove()
        self._handles = []
        if sys.excepthook == self._excepthook:
            sys.excepthook = self._previous_excepthook or sys.__excepthook__
        if self._owns_agent and self._agent is not None and not self._finished:
            self._agent.finish()
            self._finished = True


def _number(value: Any) -> Optional[float]:
    if isinstance(value, torch.Tensor):
        return float(value.detach().reshape(-1)[0]) if value.numel() == 1 else None
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    return None
