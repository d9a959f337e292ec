"""Every ``torch.distributed`` collective timed: the ``comm`` table.

The public collective functions of ``torch.distributed`` are replaced, once per
process, by wrappers that call the original with the same arguments and return its
result unchanged, and note per call its kind, its bytes (the larger of its input
and output buffers) and its time from launch to completion:

- a blocking call (``async_op=False``, which is how FSDP2 calls its all-gathers and
  reduce-scatters on gloo): the call's own time, since it returns complete;
- an asynchronous call (a ``Work`` returned): until its future completes, noted by a
  done-callback on the process group's thread, not by waiting;
- on CUDA: two CUDA events around the launch (the end one once the work's future
  completes), read later by the agent's deferral without a device sync.

FSDP2 (``fully_shard``) calls ``dist.all_gather_single`` and
``dist.reduce_scatter_single`` (torch 2.13; ``all_gather_into_tensor`` and
``reduce_scatter_tensor`` before) through the ``torch.distributed`` module, so it
is seen; so are user loops and DDP's communication hook. Not seen: functional
collectives (``torch.distributed._functional_collectives``, used by DTensor
redistribution and compiled graphs), collectives inside a graph that
``torch.compile`` traces (the wrapper steps aside there, so dynamo sees the original),
object collectives, and functions imported by name before :func:`install` ran.

Nothing here may stop training: the original runs even if our own bookkeeping
fails, and a failure there is warned about once and then ignored.
"""

from __future__ import annotations

import functools
import warnings
from time import perf_counter_ns
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

KINDS: Dict[str, str] = {
    "all_reduce": "all_reduce",
    "all_reduce_coalesced": "all_reduce",
    "all_gather": "all_gather",
    "all_gather_single": "all_gather",
    "all_gather_into_tensor": "all_gather",
    "all_gather_coalesced": "all_gather",
    "reduce_scatter": "reduce_scatter",
    "reduce_scatter_single": "reduce_scatter",
    "reduce_scatter_tensor": "reduce_scatter",
    "broadcast": "broadcast",
    "reduce": "other",
    "gather": "other",
    "scatter": "other",
    "all_to_all": "other",
    "all_to_all_single": "other",
    "barrier": "other",
}
"""The ``torch.distributed`` functions timed, and the ``comm.kind`` each counts as."""

# The agent the wrappers report to (None: call straight through), and where CUDA
# events go (the agent's deferral, or None on a machine without CUDA).
_native: Any = None
_deferred: Any = None
_originals: Dict[str, Callable] = {}
_warned = False


def install(native: Any, deferred: Any) -> bool:
    """Makes the wrappers report to ``native`` (installing them on first use).
    Returns False where ``torch.distributed`` is not available."""
    global _native, _deferred
    dist = _dist()
    if dist is None:
        return False
    if not _originals:
        for name, kind in KINDS.items():
            original = getattr(dist, name, None)
            if callable(original):
                _originals[name] = original
                setattr(dist, name, _wrap(original, kind))
    _native, _deferred = native, deferred
    return True


def stop(native: Any) -> None:
    """Stops reporting to ``native`` (the wrappers then call straight through)."""
    global _native, _deferred
    if _native is native:
        _native, _deferred = None, None


def original(name: str) -> Callable:
    """The untimed ``torch.distributed`` function ``name``."""
    dist = _dist()
    return _originals.get(name) or getattr(dist, name)


def _compiling() -> bool:
    is_compiling = getattr(getattr(torch, "compiler", None), "is_compiling", None)
    return bool(is_compiling()) if is_compiling is not None else False


def _dist() -> Any:
    try:
        import torch.distributed as dist
    except ImportError:  # pragma: no cover: torch built without distributed
        return None
    return dist if dist.is_available() else None


def _wrap(fn: Callable, kind: str) -> Callable:
    @functools.wraps(fn)
    def timed(*args: Any, **kwargs: Any) -> Any:
        native = _native
        # Inside a graph torch.compile traces, the original alone: dynamo then
        # sees the collective it knows (and maps to a functional one) as before.
        if native is None or _compiling():
            return fn(*args, **kwargs)
        entered = perf_counter_ns()
        try:
            nbytes, cuda = _payload(args, kwargs)
            start = None
            if cuda and _deferred is not None:
                start = torch.cuda.Event(enable_timing=True)
                start.record()
        except Exception as error:  # our bookkeeping only: the collective still runs
            _warn(error)
            native.add_overhead_since(entered)
            return fn(*args, **kwargs)
        native.add_overhead_since(entered)
        started = perf_counter_ns()
        result = fn(*args, **kwargs)
        returned = perf_counter_ns()
        try:
            _note(native, kind, nbytes, start, started, returned, result)
        except Exception as error:
            _warn(error)
        native.add_overhead_since(returned)
        return result

    timed.__rankscope_original__ = fn  # type: ignore[attr-defined]
    return timed


def _note(
    native: Any,
    kind: str,
    nbytes: int,
    start: Optional["torch.cuda.Event"],
    started: int,
    returned: int,
    result: Any,
) -> None:
    """Notes one collective's completion: now (it returned complete), or when its
    work's future completes."""
    work = result if result is not None and hasattr(result, "get_future") else None
    if start is not None:
        events = _deferred.collectives
        if work is None:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            events.append((kind, nbytes, start, end))
            return

        def cuda_done(_: Any) -> None:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            events.append((kind, nbytes, start, end))

        work.get_future().add_done_callback(cuda_done)
        return
    if work is None:
        native.add_comm(kind, 1, nbytes, (returned - started) / 1e6)
        return
    try:
        future = work.get_future()
    except RuntimeError:
        # A work without a future (inside a coalescing block): launched, not timed.
        native.add_comm(kind, 1, nbytes, 0.0)
        return

    def done(_: Any) -> None:
        try:
            native.add_comm(kind, 1, nbytes, (perf_counter_ns() - started) / 1e6)
        except Exception as error:
            _warn(error)

    future.add_done_callback(done)


def _payload(args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Tuple[int, bool]:
    """The larger of a collective's tensor arguments (a tensor, or a list of
    them) in bytes, and whether they are on CUDA."""
    largest = 0
    cuda = False
    for value in _arguments(args, kwargs):
        if isinstance(value, torch.Tensor):
            size = value.numel() * value.element_size()
            cuda = cuda or value.is_cuda
        elif isinstance(value, (list, tuple)) and value and isinstance(value[0], torch.Tensor):
            size = 0
            for t in value:
                if isinstance(t, torch.Tensor):
                    size += t.numel() * t.element_size()
                    cuda = cuda or t.is_cuda
        else:
            continue
        largest = max(largest, size)
    return largest, cuda


def _arguments(args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> List[Any]:
    return [*args, *kwargs.values()] if kwargs else list(args)


def _warn(error: BaseException) -> None:
    global _warned
    if not _warned:
        _warned = True
        warnings.warn(
            f"rankscope stopped timing a collective ({error!r}); the collective ran "
            "as usual. Later failures of the timing are not reported",
            RuntimeWarning,
            stacklevel=3,
        )
