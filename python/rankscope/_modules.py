"""Which modules of a model are watched, and by what name: DDP unwrapping, the
parts wrappers add to module paths, ``torch.compile``d modules, FSDP2's sharded
parameters in the profile, and the hook a sampled step puts in place."""

from __future__ import annotations

import warnings
from typing import Iterable, List, Optional, Tuple

import torch
from torch import nn

from . import _native

_DDP_PREFIX = "module."

_WRAPPER_PARTS = ("_fsdp_wrapped_module", "_checkpoint_wrapped_module", "_orig_mod")
"""Module-path parts that wrappers add (FSDP1, activation checkpointing,
torch.compile) and layer names leave out."""


def _profiled(name: str, p: torch.Tensor) -> Tuple[str, List[int], int, bool, Optional[List[int]]]:
    """A parameter for the profile: the shape, element size and trainability of this
    rank's tensor, and the whole parameter's shape where it is a shard (an FSDP2
    ``DTensor``)."""
    to_local = getattr(p, "to_local", None)
    if to_local is None:
        return name, list(p.shape), p.element_size(), p.requires_grad, None
    local = to_local()
    return name, list(local.shape), local.element_size(), p.requires_grad, list(p.shape)


def _unwrap(model: nn.Module) -> nn.Module:
    return model.module if _is_ddp(model) else model


def _is_ddp(model: nn.Module) -> bool:
    return isinstance(model, torch.nn.parallel.DistributedDataParallel)


def _compiled_paths(model: nn.Module) -> List[str]:
    """The module paths of ``torch.compile``d modules in ``model``, with a warning
    that their layers are not watched: a compiled graph does not run forward hooks
    added or removed after it was traced (it keeps what it traced, or recompiles),
    so their samples would be wrong or missing."""
    try:
        from torch._dynamo.eval_frame import OptimizedModule
    except ImportError:  # pragma: no cover: torch without dynamo
        return []
    paths = [path for path, m in model.named_modules() if isinstance(m, OptimizedModule)]
    if paths:
        shown = ", ".join(repr(p or "the model") for p in paths[:3])
        warnings.warn(
            f"rankscope does not watch the layers of torch.compile'd modules ({shown}): "
            "a compiled graph does not run forward hooks put in place per step. Steps, "
            "phases, collectives and the profile are recorded as usual; to sample their "
            "layers, watch and train the model without torch.compile",
            RuntimeWarning,
            stacklevel=3,
        )
    return paths


def _layers(
    model: nn.Module, skip: Iterable[str] = ()
) -> List[Tuple[str, nn.Module, Optional[str]]]:
    """Leaf modules with parameters, and attention modules, by module path,
    except those under the module paths in ``skip``."""
    skip = tuple(skip)
    out = []
    for path, module in model.named_modules():
        if skip and any(path == s or path.startswith(s + ".") or not s for s in skip):
            continue
        name = layer_name(path)
        if not name:
            continue
        if isinstance(module, nn.MultiheadAttention):
            out.append((name, module, "attention"))
            continue
        leaf = next(module.children(), None) is None
        has_params = next(module.parameters(recurse=False), None) is not None
        if leaf and has_params:
            out.append((name, module, None))
    return out


def layer_name(path: str) -> str:
    """A module path as a layer name: without DDP's leading ``module.`` and
    without the parts wrappers add (``_fsdp_wrapped_module``,
    ``_checkpoint_wrapped_module``, ``_orig_mod``), so a layer is named the same
    however the model is wrapped."""
    if path.startswith(_DDP_PREFIX):
        path = path[len(_DDP_PREFIX):]
    if not any(part in path for part in _WRAPPER_PARTS):
        return path
    return ".".join(p for p in path.split(".") if p not in _WRAPPER_PARTS)


def _inert(module: nn.Module, inputs: object, output: object) -> None:
    """The forward hook a copy of a model holds where the agent's was (below)."""
    return None


def inert_hook():
    """What a copy of a model made during a sampled step (``copy.deepcopy``, or
    ``torch.save`` of the whole model) holds in place of the agent's hook, which
    belongs to this process's agent: a hook that does nothing (the extension's
    ``NativeHook.__reduce__``)."""
    return _inert


def _keep_hook(native: "_native.NativeAgent", name: str, module: nn.Module, kind: Optional[str]) -> None:
    """Gives the extension the module's hook for sampled steps. The hook (a Rust
    object) is registered once, for the id torch gives it, and removed; a sampled
    step puts it back in ``module._forward_hooks`` under that id and takes it out
    at its end, as ``register_forward_hook`` and the handle's ``remove()`` would,
    without a handle, a closure or a Python frame."""
    hook = native.hook(name, kind)
    handle = module.register_forward_hook(hook)
    handle.remove()
    native.watch_hook(module._forward_hooks, handle.id, hook)
