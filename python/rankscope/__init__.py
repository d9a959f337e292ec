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

from ._built_with import TORCH_VERSION as _BUILT_TORCH

if _torch.__version__ != _BUILT_TORCH:
    raise ImportError(
        f"rankscope was built against torch {_BUILT_TORCH} but torch "
        f"{_torch.__version__} is installed: install torch=={_BUILT_TORCH.split('+')[0]} "
        "or rebuild rankscope against this torch (make setup)"
    )

from ._native import ConfigError, Report  # noqa: E402
from ._agent import PHASES, Agent, InertAgent, init  # noqa: E402

__all__ = ["init", "Agent", "InertAgent", "ConfigError", "Report", "PHASES"]
__version__ = "0.1.0"
