"""rankscope: activation dimensionality, step timing, memory and communication
telemetry for PyTorch training, from every rank of a torchrun (or SLURM) job.

The agent is Rust (the same core a Rust tch program links); this package is a thin
layer over it that links no libtorch. The quick start, a complete script that runs as
written on CPU or GPU, ships as ``rankscope/examples/train.py``::

    rankscope demo --script train.py      # or: torchrun --nproc-per-node 2 train.py

In short: ``agent = rankscope.init()``, ``agent.watch(model)``, then each step in
``with agent.step(i) as s:`` (phases with ``s.phase("forward")``, values with
``s.record(loss=...)``), and ``agent.finish()``. Hugging Face, Lightning and Accelerate
users add one line instead (``rankscope.integrations``, docs/integrations.md).

Rows go to a collector (``python -m rankscope collector --out DIR``) that writes
Parquet for DuckDB. See ``help(rankscope.init)`` for the settings.
"""

import torch as _torch

# The oldest torch tested (python/tests/test_wheel.py); pyproject.toml requires it.
_TORCH_FLOOR = (2, 11)


def _torch_release(version: str) -> tuple:
    """``(major, minor)`` of a torch version, local suffixes (``+cu130``) and
    pre-releases (``2.16.0a0``) allowed."""
    parts = version.split("+")[0].split(".")
    try:
        return int(parts[0]), int("".join(c for c in parts[1] if c.isdigit()) or 0)
    except (IndexError, ValueError):
        return (0, 0)


if _torch_release(_torch.__version__) < _TORCH_FLOOR:
    raise ImportError(
        f"rankscope needs torch {_TORCH_FLOOR[0]}.{_TORCH_FLOOR[1]} or newer, but torch "
        f"{_torch.__version__} is installed: upgrade torch "
        f"(pip install 'torch>={_TORCH_FLOOR[0]}.{_TORCH_FLOOR[1]}')"
    )

from ._native import ConfigError, Report  # noqa: E402
from ._agent import PHASES, Agent, InertAgent, init  # noqa: E402

__all__ = ["init", "Agent", "InertAgent", "ConfigError", "Report", "PHASES"]
__version__ = "0.1.0"
