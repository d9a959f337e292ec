"""The device side of a sample on a GPU, done by the user's own torch.

The extension links no libtorch, so what runs where the activation lives is written
here, in torch operations:

1. on the training stream, a copy of the agent's own: the activation's matrix (the
   table of ``docs/metrics.md``, as the extension plans it) with its rows drawn by the
   extension's seed (a pinned index tensor, copied without blocking). Training may
   change its activation in place later; this copy is the one device operation the
   training stream runs for the agent. The copies wait for the step's end, up to
   ``HELD_BYTES`` of them (on the GPT of BENCHMARKS.md at the default row cap, a step's
   51 copies come to about 1 GB): past it, those taken so far go on at once;
2. at the step's end (``launch``), the step's samples reduced together: those alike in
   device, shape, type and centring stacked into one batch (at most ``GROUP_BYTES`` of
   float32 each), on a side stream of the lowest priority, which waits for the
   training stream there (the training stream never waits for the agent): cast to
   float32 (bfloat16 and float16 are measured, never refused), the health sums over
   the finite elements, centring when asked, and the Gram matrix of the smaller side;
   then copies of the sums and the Gram matrices into pinned host memory, without
   blocking, and an event. The training thread issues about twenty operations per
   batch rather than per sample (issued one sample at a time, they cost it 0.9 ms a
   sample on an H200: BENCHMARKS.md, "GPU");
   Where the sketch measures a sample (``RANKSCOPE_SPECTRUM``, ``docs/metrics.md``),
   the side stream goes on to run the sketch's Krylov process on its Gram matrix
   (:func:`krylov`), and only that process's small matrices, about 1 MiB a sample,
   are copied to the host instead of the Gram matrix (64 MiB at 4,096 × 4,096): the
   metrics thread then does only the sketch's small dense algebra;
3. when that event has completed (``poll``, at a later step's end, a non-blocking
   query), the pinned buffers go to the extension, whose metrics thread measures
   them (eigenvalues in float64 on the host, or the sketch's analysis).

An error in a reduction (out of device memory, say) does not reach the training loop:
its samples are handed over as failed, counted as dropped with the error's first line.

The side stream's work of each batch lies between two timing events; once both have
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
the pool). A batch's Gram matrices share one pinned buffer, freed when the metrics
thread is done with its last sample, so the memory held can pass the bound by at most
one batch's (``GROUP_BYTES``).
"""

from __future__ import annotations

import os
from collections import deque
from time import perf_counter_ns
from typing import Any, Deque, Dict, List, Optional, Sequence, Tuple

import torch

from . import _native

POOL_BYTES_VARIABLE = "RANKSCOPE_PINNED_POOL_BYTES"
DEFAULT_POOL_BYTES = 1 << 30
# The most float32 bytes of samples one reduction stacks (a chunk holds at least one):
# 64 MiB is one 4,096 × 4,096 sample, so the side stream's working memory stays what
# one sample of the default row cap needs.
GROUP_BYTES = 64 << 20
# The most bytes of row copies that wait for the step's end before their reduction starts.
HELD_BYTES = 256 << 20


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


class _Taken:
    """A sample's rows, copied on the training stream, waiting for the step's end."""

    __slots__ = ("token", "matrix", "centered", "nbytes", "sketch", "seed")

    def __init__(
        self, token: Any, matrix: torch.Tensor, centered: bool, nbytes: int, sketch: bool = False, seed: int = 0
    ) -> None:
        self.token = token
        self.matrix = matrix
        self.centered = centered
        self.nbytes = nbytes
        self.sketch = sketch
        self.seed = seed


class _Pending:
    """One group's reduction, launched: its samples' tokens and pinned results."""

    __slots__ = ("tokens", "nbytes", "started", "event", "health", "gram", "device_ns", "trace")

    def __init__(
        self,
        tokens: List[Any],
        nbytes: List[int],
        started: Any,
        event: Any,
        health: torch.Tensor,
        gram: torch.Tensor,
        device_ns: int = 0,
        trace: Optional[torch.Tensor] = None,
    ):
        self.tokens = tokens
        self.nbytes = nbytes
        # The timing events around the side stream's work (None without a stream).
        self.started = started
        self.event = event
        # One row of sums and one Gram matrix per sample, in the order of `tokens`; for
        # a sketched batch, one packed Krylov summary per sample instead, and each
        # one's Σλ in `trace`.
        self.health = health
        self.gram = gram
        self.trace = trace
        # Without a stream: the reduction's own time.
        self.device_ns = device_ns


class DeviceSide:
    """Reduces samples of GPU activations on a side stream (see the module)."""

    def __init__(self, native: Any, pool_bytes: int) -> None:
        self._native = native
        self._pool_bytes = pool_bytes
        self._streams: Dict[int, Any] = {}
        self._taken: List[_Taken] = []
        self._taken_bytes = 0
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
        sketch: bool = False,
        seed: int = 0,
    ) -> None:
        """Copies one sample's rows (called by the extension's hook on the training
        thread); its reduction starts at the step's end (:meth:`launch`). ``chosen``:
        the rows to keep, little-endian int64, or ``None`` for all. ``sketch``: the
        sketch measures it, so the device runs its Krylov process (:func:`krylov`),
        drawing its random vectors from ``seed``."""
        kept = len(chosen) // 8 if chosen is not None else rows
        side = min(kept, cols)
        nbytes = (_native.SKETCH_PACKED_LEN * 8 if sketch else side * side * 4) + 48
        if self._pending_bytes + self._native.pinned_bytes_held() + nbytes > self._pool_bytes:
            self._native.hand_over_failed(
                token,
                f"skipped: the pinned-memory pool ({POOL_BYTES_VARIABLE}={self._pool_bytes}) "
                f"has no room for this sample's {nbytes} bytes",
            )
            return
        x = tensor.detach()
        # 1. The training stream: the agent's own copy of the rows it samples.
        matrix = x.permute(*order).reshape(rows, cols)
        if chosen is not None:
            index = torch.frombuffer(bytearray(chosen), dtype=torch.int64)
            if x.is_cuda:
                index = index.pin_memory().to(x.device, non_blocking=True)
            matrix = matrix.index_select(0, index)
        else:
            matrix = matrix.clone()
        self._taken.append(_Taken(token, matrix, centered, nbytes, sketch, seed))
        self._pending_bytes += nbytes
        self._taken_bytes += matrix.numel() * matrix.element_size()
        if self._taken_bytes > HELD_BYTES:
            self._launch()

    def _launch(self) -> None:
        """Starts the reduction of the samples taken since the last launch: one per
        group of samples alike in device, shape, type and centring, in chunks of at
        most ``GROUP_BYTES`` of float32."""
        groups: Dict[Tuple[Any, ...], List[_Taken]] = {}
        for t in self._taken:
            key = (t.matrix.device, tuple(t.matrix.shape), t.matrix.dtype, t.centered, t.sketch)
            groups.setdefault(key, []).append(t)
        self._taken = []
        self._taken_bytes = 0
        for items in groups.values():
            rows, cols = items[0].matrix.shape
            per_chunk = max(1, GROUP_BYTES // max(1, rows * cols * 4))
            for first in range(0, len(items), per_chunk):
                chunk = items[first : first + per_chunk]
                try:
                    self._reduce(chunk)
                except Exception as error:  # noqa: BLE001 - training goes on; the samples are counted
                    why = str(error).splitlines()[0] if str(error) else type(error).__name__
                    for t in chunk:
                        self._pending_bytes -= t.nbytes
                        self._native.hand_over_failed(t.token, f"the device side failed: {why}")

    def _reduce(self, items: List[_Taken]) -> None:
        tokens = [t.token for t in items]
        nbytes = [t.nbytes for t in items]
        device = items[0].matrix.device
        centered = items[0].centered
        sketch = items[0].sketch
        if device.type != "cuda":
            # The same reduction without a stream (the extension's tests run it on CPU).
            reducing = perf_counter_ns()
            health, gram = reduce(torch.stack([t.matrix for t in items]), centered)
            trace = None
            if sketch:
                trace, gram = krylov(gram, items[0].seed)
            else:
                gram = gram.float().contiguous()
            spent = perf_counter_ns() - reducing
            self._pending.append(_Pending(tokens, nbytes, None, None, health, gram, spent, trace))
            return
        stream = self._stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        # 2. The side stream.
        with torch.cuda.stream(stream):
            started = torch.cuda.Event(enable_timing=True)
            started.record(stream)
            batch = torch.stack([t.matrix for t in items]) if len(items) > 1 else items[0].matrix.unsqueeze(0)
            health, gram = reduce(batch, centered)
            host_trace = None
            if sketch:
                trace, gram = krylov(gram, items[0].seed)
                host_trace = torch.empty(trace.shape, dtype=torch.float64, pin_memory=True)
                host_trace.copy_(trace, non_blocking=True)
            else:
                gram = gram.float()
            host_gram = torch.empty(gram.shape, dtype=gram.dtype, pin_memory=True)
            host_gram.copy_(gram, non_blocking=True)
            host_health = torch.empty(health.shape, dtype=torch.float64, pin_memory=True)
            host_health.copy_(health, non_blocking=True)
            event = torch.cuda.Event(enable_timing=True)
            event.record(stream)
        # The copies were made on the training stream and are read on the side stream.
        for t in items:
            t.matrix.record_stream(stream)
        self._pending.append(_Pending(tokens, nbytes, started, event, host_health, host_gram, 0, host_trace))

    def launch(self) -> None:
        """At a step's end, before its row is made: starts the reduction of the
        step's samples, counted as the sampled step's overhead."""
        if self._taken:
            entered = perf_counter_ns()
            self._launch()
            self._native.add_overhead_since(entered, True)

    def poll(self) -> None:
        """After a step's end: starts the reduction of samples not yet started
        (:meth:`launch`), then hands every completed reduction to the extension, in
        order, without waiting for the device."""
        self.launch()
        entered = perf_counter_ns()
        while self._pending and (self._pending[0].event is None or self._pending[0].event.query()):
            self._hand_over(self._pending.popleft())
        self._native.add_overhead_since(entered)

    def flush(self) -> None:
        """At finish: waits for the reductions still running (the only wait, after
        the last step) and hands them over."""
        if self._taken:
            self._launch()
        while self._pending:
            item = self._pending.popleft()
            if item.event is not None:
                item.event.synchronize()
            self._hand_over(item)

    def _hand_over(self, item: _Pending) -> None:
        self._pending_bytes -= sum(item.nbytes)
        # Both events have completed: reading their elapsed time does not wait.
        device_ns = item.device_ns
        if item.started is not None:
            device_ns = int(item.started.elapsed_time(item.event) * 1e6)
        self._native.add_device_ns(device_ns, len(item.tokens))
        traces = item.trace.tolist() if item.trace is not None else None
        for i, (token, sums, gram) in enumerate(zip(item.tokens, item.health.tolist(), item.gram)):
            finite, nonfinite, total, total_sq, zeros = sums
            if traces is not None:
                self._native.hand_over_sketched(
                    token,
                    int(finite),
                    int(nonfinite),
                    total,
                    total_sq,
                    int(zeros),
                    traces[i],
                    gram if nonfinite == 0 else None,
                )
                continue
            self._native.hand_over_reduced(
                token, int(finite), int(nonfinite), total, total_sq, int(zeros), gram if nonfinite == 0 else None
            )


def reduce(batch: torch.Tensor, centered: bool) -> Tuple[torch.Tensor, torch.Tensor]:
    """What the host needs of k sample matrices alike (k × rows × cols, any float
    type), on their device: each one's health sums over its finite elements (k × 5,
    float64: finite count, non-finite count, Σx, Σx², exact zeros) and the Gram matrix
    of its smaller side (centred when asked; meaningless when an element is not
    finite, and then not used)."""
    a = batch.float()
    k = a.shape[0]
    finite = torch.isfinite(a)
    n_finite = finite.sum(dim=(1, 2))
    clean = torch.where(finite, a, torch.zeros((), dtype=a.dtype, device=a.device))
    flat = clean.reshape(k, -1)
    health = torch.stack(
        [
            n_finite.double(),
            (a[0].numel() - n_finite).double(),
            flat.sum(dim=1).double(),
            (flat * flat).sum(dim=1).double(),
            (a == 0).sum(dim=(1, 2)).double(),
        ],
        dim=1,
    )
    if centered:
        clean = clean - clean.mean(dim=1, keepdim=True)
    # TF32 is a process-wide switch: where the user turned it on, the product runs in
    # float64 rather than in TF32.
    tf32 = a.is_cuda and torch.get_float32_matmul_precision() != "highest"
    operand = clean.double() if tf32 else clean
    _, rows, cols = a.shape
    gram = operand.transpose(1, 2) @ operand if cols <= rows else operand @ operand.transpose(1, 2)
    return health, gram


def krylov(gram: torch.Tensor, seed: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """The sketch's Krylov process for k Gram matrices alike (k × r × r), on their
    device: what the extension's ``KrylovSummary`` needs (``agent/src/sampling/
    sketch.rs`` analyses it; ``docs/metrics.md``, "Sketch mode", states the method).
    Returns each one's Σλ (k, float64) and its packed summary (k ×
    ``SKETCH_PACKED_LEN``, float64, in ``KrylovSummary::from_packed``'s order).

    The same process as the host's sketch, in G / Σλ: products with G in float32 (in
    float64 where the user allowed TF32), everything else in float64; a block Krylov
    space from ``SKETCH_BLOCK`` orthonormalized Gaussian vectors and ``SKETCH_PROBES``
    Rademacher probes (the extension's constants), drawn from ``seed`` by torch's
    generator on the device. It runs to the
    schedule's last depth, since the device does not stop to ask; the host reads the
    depths in order and stops at the first that vouches. Every new block is projected
    out of the space twice and orthonormalized by Cholesky QR twice (no branch on the
    device, no wait, no eigen-solver); a space that lost orthogonality all the same
    makes its round-off NaN, which the host reads as a sample it cannot measure.
    """
    k, r, _ = gram.shape
    device = gram.device
    b, m, schedule = _native.SKETCH_BLOCK, _native.SKETCH_PROBES, _native.SKETCH_SCHEDULE
    deepest = max(schedule)
    f64 = torch.float64
    trace = gram.diagonal(dim1=1, dim2=2).to(f64).sum(dim=1)
    tf32 = gram.is_cuda and torch.get_float32_matmul_precision() != "highest"
    product_type = f64 if tf32 else torch.float32
    g = (gram.to(f64) / trace[:, None, None]).to(product_type)

    def times(v: torch.Tensor) -> torch.Tensor:
        return torch.bmm(g, v.to(product_type)).to(f64)

    def project_out(y: torch.Tensor, basis: torch.Tensor) -> torch.Tensor:
        for _ in range(2):
            y = y - basis @ (basis.transpose(1, 2) @ y)
        return y

    def orthonormal(y: torch.Tensor) -> torch.Tensor:
        eye = torch.eye(y.shape[2], dtype=f64, device=device)
        gram_y = y.transpose(1, 2) @ y
        # A shift at round-off level keeps the factorization defined where the block
        # is (nearly) rank deficient; the second pass restores orthonormality.
        shift = 1e-13 * gram_y.diagonal(dim1=1, dim2=2).sum(dim=1) + 1e-300
        lower, _ = torch.linalg.cholesky_ex(gram_y + shift[:, None, None] * eye)
        return torch.linalg.solve_triangular(lower, y.transpose(1, 2), upper=False).transpose(1, 2)

    generator = torch.Generator(device=device)
    generator.manual_seed(seed % (1 << 64))
    omega = torch.randn(k, r, b, generator=generator, device=device, dtype=f64)
    z = torch.randint(0, 2, (k, r, m), generator=generator, device=device).to(f64) * 2 - 1
    q = orthonormal(orthonormal(omega))
    first = times(torch.cat([q, z], dim=2))
    gz, product = first[:, :, b:], first[:, :, :b]
    basis, products = q, product
    residual = project_out(product, basis)
    residuals = {}
    for step in range(1, deepest + 1):
        nxt = orthonormal(project_out(orthonormal(residual), basis))
        product = times(nxt)
        basis = torch.cat([basis, nxt], dim=2)
        products = torch.cat([products, product], dim=2)
        residual = project_out(product, basis)
        if step in schedule:
            residuals[step] = residual
    projected = basis.transpose(1, 2) @ products
    projected = 0.5 * (projected + projected.transpose(1, 2))
    squares = products.transpose(1, 2) @ products
    # A smaller depth's T, K and G·K are the leading blocks of the deepest's.
    depths = [_depth(projected, basis, products, residuals[q], z, gz, (q + 1) * b) for q in schedule]
    # Orthonormality of the space, checked once: past 1e-8 the analysis would not hold.
    size = basis.shape[2]
    defect = torch.linalg.matrix_norm(basis.transpose(1, 2) @ basis - torch.eye(size, dtype=f64, device=device))
    lost = (defect > 1e-8) | ~torch.isfinite(defect)
    parts = [projected.reshape(k, -1), squares.reshape(k, -1)]
    for residual_gram, off, outside, control in depths:
        off = torch.where(lost, torch.full_like(off, float("nan")), off)
        parts += [residual_gram.reshape(k, -1), off[:, None], outside, control]
    packed = torch.cat(parts, dim=1).contiguous()
    if packed.shape[1] != _native.SKETCH_PACKED_LEN:
        raise ValueError(
            f"the packed sketch summary has {packed.shape[1]} values, not {_native.SKETCH_PACKED_LEN}"
        )
    return trace, packed


def _depth(
    projected: torch.Tensor,
    basis: torch.Tensor,
    products: torch.Tensor,
    residual: torch.Tensor,
    z: torch.Tensor,
    gz: torch.Tensor,
    size: int,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """One checked depth (its space the first ``size`` columns of the deepest) and its
    last block's residual: RᵀR, the Krylov relation's round-off ‖GK − KT − R·E_qᵀ‖_F,
    and per probe ‖G(I − P)z‖² and zᵀ(I − P)G(I − P)z (the extension's ``Depth``)."""
    b = residual.shape[2]
    projected = projected[:, :size, :size]
    basis, products = basis[:, :, :size], products[:, :, :size]
    off_blocks = products - basis @ projected
    off_blocks[:, :, -b:] -= residual
    coefficients = basis.transpose(1, 2) @ z
    g_outside = gz - products @ coefficients
    outside = z - basis @ coefficients
    return (
        residual.transpose(1, 2) @ residual,
        torch.linalg.matrix_norm(off_blocks),
        (g_outside * g_outside).sum(dim=1),
        (g_outside * outside).sum(dim=1),
    )


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
