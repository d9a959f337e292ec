"""rankscope: activation dimensionality, step timing, memory and communication
telemetry for PyTorch training, from every rank of a torchrun (or SLURM) job.

The agent is Rust (the same library a Rust tch program links); this package is a
thin layer over it. Quick start::

    import rankscope

    agent = rankscope.init()              # torchrun/SLURM/RANKSCOPE_* variables
    agent.watch(model)                    # every leaf module with parameters
    agent.profile(model, example_input, optimizer)
    for step, (x, y) in enumerate(loader):
        with agent.step(step) as s:
            with s.phase("forward"):
                loss = loss_fn(model(x), y)
            with s.phase("backward"):
                loss.backward()
            with s.phase("optimizer"):
                opt.step(); opt.zero_grad()
            s.record(loss=loss, lr=lr, samples=len(x))
    report = agent.finish()

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
