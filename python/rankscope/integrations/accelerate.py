"""rankscope for Accelerate: watch the model ``Accelerator.prepare`` returned, and
write the loop with steps and phases.

    from rankscope.integrations.accelerate import watch
    model, opt, loader = accelerator.prepare(model, opt, loader); agent = rankscope.init()
    watch(agent, model)          # layers by their paths in your model, and DDP's all-reduce

Launch with ``accelerate launch`` or ``torchrun``: the agent reads the rank, world
size and run id they set (``RANK``, ``WORLD_SIZE``, ``TORCHELASTIC_RUN_ID``).

A loop, where a step is one optimizer step and each micro-batch of gradient
accumulation is timed in its phases (layers are sampled on the first)::

    batches = iter(loader)
    for step in range(steps):
        with agent.step(step) as s:
            for _ in range(accelerator.gradient_accumulation_steps):
                with s.phase("data"):
                    batch = next(batches)
                with accelerator.accumulate(model):
                    with s.phase("forward"):
                        loss = model(**batch).loss
                    with s.phase("backward"):
                        accelerator.backward(loss)
            with s.phase("optimizer"):
                opt.step(); opt.zero_grad()
            s.record(loss=loss.detach(), lr=opt.param_groups[0]["lr"])
"""

from __future__ import annotations

import warnings
from typing import Any, List

try:
    from accelerate.utils import extract_model_from_parallel
except ImportError as error:  # pragma: no cover: depends on the environment
    raise ImportError(
        f"rankscope.integrations.accelerate needs the accelerate package ({error}): "
        "pip install accelerate"
    ) from error

import torch

__all__ = ["watch"]


def watch(agent: Any, model: torch.nn.Module, *, comm: bool = True) -> List[str]:
    """``agent.watch`` for a model that ``Accelerator.prepare`` returned.

    Accelerate wraps the model by its configuration: in
    ``DistributedDataParallel`` (multi-process CPU or GPU), in DeepSpeed's engine or
    FSDP, and in ``torch.compile`` with a dynamo backend. Layers are named by their
    paths in your model whatever the wrapper. Under DDP, ``comm=True`` also times the
    gradient all-reduce into ``steps.comm_ms``. Returns the watched layer names.
    """
    compiled = getattr(model, "_orig_mod", None)
    ddp = compiled if compiled is not None else model
    if isinstance(ddp, torch.nn.parallel.DistributedDataParallel):
        if compiled is None:
            return agent.watch(ddp, comm=comm)
        # A compiled DDP model: the agent warns that compiled layers are not
        # watched; the all-reduce runs outside the graph and is timed.
        names = agent.watch(model, comm=False)
        if comm and agent.active:
            from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

            ddp.register_comm_hook(None, agent.wrap_comm_hook(allreduce_hook))
        return names
    inner = extract_model_from_parallel(model, keep_torch_compile=True)
    if comm and inner is not model:
        warnings.warn(
            f"rankscope times the gradient all-reduce of DistributedDataParallel only; "
            f"this model is wrapped in {type(model).__name__}: its collectives are in the "
            "comm table, and steps.comm_ms is not recorded",
            RuntimeWarning,
            stacklevel=2,
        )
    return agent.watch(inner, comm=False)
