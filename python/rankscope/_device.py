"""The device side of a sample on a GPU, done by the user's own torch.

The extension links no libtorch, so what runs where the activation lives is written
here, in torch operations:

1. on the training stream, a copy of the agent's own: the activation's matrix (the
   table of ``docs/metrics.md``, as the extension plans it) with its rows drawn by the
   extension's seed (a pinned index tensor, copied without blocking). Training may
   change its activation in place later; this copy is the one device operation the
   training stream runs for the agent;
2. on a side stream of the lowest priority, which waits for that copy (the training
   stream never waits for the agent): cast to float32 (bfloat16 and float16 are
   measured, never refused), the health sums over the finite elements, centring when
   asked, and the Gram matrix of the smaller side; then copies of the sums and the
   Gram matrix into pinned host memory, without blocking, and an event;
3. when that event has completed (``poll``, at the next sampled hook or step end, a
   non-blocking query), the pinned buffers go to the extension, whose metrics thread
   measures them (eigenvalues in float64 on the host, or the sketch).

The side stream's work of each sample lies between two timing events; once both have
completed, their elapsed time (read without a wait) is the agent's device time: the
step rows' ``overhead_device_ms`` and the overhead budget's device share. Without a
stream (a CPU tensor, the extension's tests) the reduction's own time stands in.

No ``synchronize`` runs on the training thread, and no float64 eigen-solver on the
device. The Gram product runs in float32; where the user allowed TF32 for float32
products (``torch.set_float32_matmul_precision``, a process-wide switch that the
agent never touches), it runs in float64 instead, so its precision is the same.

Pinned memory comes from torch's caching host allocator, held in a bounded pool:
``RANKSCOPE_PINNED_POOL_BYTES`` (default 1 GiB) bounds the bytes of samples on the
device side and in the extension's queue together. A sample that would pass it is
skipped and counted (``samples_dropped``, with a ``sample_unreadable`` event naming
the pool).
"""

from __future__ import annotations

import os
from collections import deque
from time import perf_counter_ns
from typing import Any, Deque, Dict, Optional, Sequence, Tuple

import torch

POOL_BYTES_VARIABLE = "RANKSCOPE_PINNED_POOL_BYTES"
DEFAULT_POOL_BYTES = 1 << 30


def pool_bytes_from_env() -> int:
    """The pinned-memory pool's bound from ``RANKSCOPE_PINNED_POOL_BYTES``."""
    text = os.environ.get(POOL_BYTES_VARIABLE)
    if text is None or text.strip() == "":
        return DEFAULT_POOL_BYTES
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 1:
        from ._native import ConfigError

        raise ConfigError(
            f"{POOL_BYTES_VARIABLE}={text!r} is not a byte count: give a whole number of "
            f"bytes, at least 1 (default {DEFAULT_POOL_BYTES}, 1 GiB)"
        )
    return value


class _Pending:
    __slots__ = ("token", "started", "event", "health", "gram", "nbytes", "device_ns")

    def __init__(
        self,
        token: Any,
        started: Any,
        event: Any,
        health: torch.Tensor,
        gram: torch.Tensor,
        nbytes: int,
        device_ns: int = 0,
    ):
        self.token = token
        # The timing events around the side stream's work (None without a stream).
        self.started = started
        self.event = event
        self.health = health
        self.gram = gram
        self.nbytes = nbytes
        # Without a stream: the reduction's own time.
        self.device_ns = device_ns


class DeviceSide:
    """Reduces samples of GPU activations on a side stream (see the module)."""

    def __init__(self, native: Any, pool_bytes: int) -> None:
        self._native = native
        self._pool_bytes = pool_bytes
        self._streams: Dict[int, Any] = {}
        self._pending: Deque[_Pending] = deque()
        self._pending_bytes = 0

    def _stream(self, device: torch.device) -> Any:
        index = device.index if device.index is not None else torch.cuda.current_device()
        stream = self._streams.get(index)
        if stream is None:
            # The lowest priority: higher numbers are lower priorities.
            low, _high = torch.cuda.Stream.priority_range()
            stream = torch.cuda.Stream(device=index, priority=low)
            self._streams[index] = stream
        return stream

    def submit(
        self,
        tensor: torch.Tensor,
        token: Any,
        order: Sequence[int],
        rows: int,
        cols: int,
        chosen: Optional[bytes],
        centered: bool,
    ) -> None:
        """Starts the reduction of one sample (called by the extension's hook on the
        training thread). ``chosen``: the rows to keep, little-endian int64, or
        ``None`` for all."""
        kept = len(chosen) // 8 if chosen is not None else rows
        side = min(kept, cols)
        nbytes = side * side * 4 + 40
        if self._pending_bytes + self._native.pinned_bytes_held() + nbytes > self._pool_bytes:
            self._native.hand_over_failed(
                token,
                f"skipped: the pinned-memory pool ({POOL_BYTES_VARIABLE}={self._pool_bytes}) "
                f"has no room for this sample's {nbytes} bytes",
            )
            return
        x = tensor.detach()
        device = x.device
        cuda = device.type == "cuda"
        # 1. The training stream: the agent's own copy of the rows it samples.
        matrix = x.permute(*order).reshape(rows, cols)
        if chosen is not None:
            index = torch.frombuffer(bytearray(chosen), dtype=torch.int64)
            if cuda:
                index = index.pin_memory().to(device, non_blocking=True)
            matrix = matrix.index_select(0, index)
        else:
            matrix = matrix.clone()
        if not cuda:
            # The same reduction without a stream (the extension's tests run it on CPU).
            reducing = perf_counter_ns()
            health, gram = reduce(matrix, centered)
            gram = gram.float().contiguous()
            spent = perf_counter_ns() - reducing
            self._pending.append(_Pending(token, None, None, health, gram, nbytes, spent))
            self._pending_bytes += nbytes
            return
        stream = self._stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        # 2. The side stream.
        with torch.cuda.stream(stream):
            started = torch.cuda.Event(enable_timing=True)
            started.record(stream)
            health, gram = reduce(matrix, centered)
            host_gram = torch.empty((side, side), dtype=torch.float32, pin_memory=True)
            host_gram.copy_(gram.float(), non_blocking=True)
            host_health = torch.empty(5, dtype=torch.float64, pin_memory=True)
            host_health.copy_(health, non_blocking=True)
            event = torch.cuda.Event(enable_timing=True)
            event.record(stream)
        # The copy was made on the training stream and is read on the side stream.
        matrix.record_stream(stream)
        self._pending.append(_Pending(token, started, event, host_health, host_gram, nbytes))
        self._pending_bytes += nbytes

    def poll(self) -> None:
        """Hands every completed reduction to the extension, in order, without
        waiting for the device."""
        entered = perf_counter_ns()
        while self._pending and (self._pending[0].event is None or self._pending[0].event.query()):
            self._hand_over(self._pending.popleft())
        self._native.add_overhead_since(entered)

    def flush(self) -> None:
        """At finish: waits for the reductions still running (the only wait, after
        the last step) and hands them over."""
        while self._pending:
            item = self._pending.popleft()
            if item.event is not None:
                item.event.synchronize()
            self._hand_over(item)

    def _hand_over(self, item: _Pending) -> None:
        self._pending_bytes -= item.nbytes
        # Both events have completed: reading their elapsed time does not wait.
        device_ns = item.device_ns
        if item.started is not None:
            device_ns = int(item.started.elapsed_time(item.event) * 1e6)
        self._native.add_device_ns(device_ns, 1)
        finite, nonfinite, total, total_sq, zeros = item.health.tolist()
        gram = item.gram if nonfinite == 0 else None
        self._native.hand_over_reduced(
            item.token, int(finite), int(nonfinite), total, total_sq, int(zeros), gram
        )


def reduce(matrix: torch.Tensor, centered: bool) -> Tuple[torch.Tensor, torch.Tensor]:
    """What the host needs of a sample matrix (rows × cols, any float type), on its
    device: the health sums over its finite elements (finite count, non-finite count,
    Σx, Σx², exact zeros; float64) and the Gram matrix of its smaller side (centred
    when asked; meaningless when an element is not finite, and then not used)."""
    a = matrix.float()
    finite = torch.isfinite(a)
    n_finite = finite.sum()
    clean = torch.where(finite, a, torch.zeros((), dtype=a.dtype, device=a.device))
    flat = clean.reshape(-1)
    health = torch.stack(
        [
            n_finite.double(),
            (a.numel() - n_finite).double(),
            flat.sum().double(),
            flat.dot(flat).double(),
            (a == 0).sum().double(),
        ]
    )
    if centered:
        clean = clean - clean.mean(dim=0, keepdim=True)
    # TF32 is a process-wide switch: where the user turned it on, the product runs in
    # float64 rather than in TF32.
    tf32 = a.is_cuda and torch.get_float32_matmul_precision() != "highest"
    operand = clean.double() if tf32 else clean
    rows, cols = a.shape
    gram = operand.T @ operand if cols <= rows else operand @ operand.T
    return health, gram


def device_memory(index: int) -> Any:
    """A reader of torch's CUDA allocator counters for the step rows: no device work,
    no wait."""

    def read() -> Tuple[int, int, int]:
        return (
            torch.cuda.memory_allocated(index),
            torch.cuda.memory_reserved(index),
            torch.cuda.max_memory_allocated(index),
        )

    return read
