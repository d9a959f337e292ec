"""The device side of a sample on a GPU, done by the user's own torch.

The extension links no libtorch, so what runs where the activation lives is written
here, in torch operations:

1. on the training stream, a copy of the agent's own: the activation's matrix (the
   table of ``docs/metrics.md``, as the extension plans it), whole. Training may
   change its activation in place later; this copy is the one device operation the
   training stream runs for the agent, and the one torch operation a sample costs the
   training thread (the rows past the row cap are drawn later, off that thread). The
   copies wait for the step's end, up to ``HELD_BYTES`` of them (on the GPT of
   BENCHMARKS.md a step's 51 copies come to about 1.2 GB): past it, those taken so far
   go on at once;
2. at the step's end (``launch``), the training thread records an event on the
   training stream and hands the step's samples to the agent's thread
   (``RANKSCOPE_DEVICE_THREAD=0``: issues their reductions itself), which reduces them
   together: each one's rows past the row cap drawn by the extension's seed
   (``choose_rows``, the host path's draw; a pinned index tensor, copied without
   blocking), those alike in device, shape, type, centring and method stacked into one
   batch (at most ``GROUP_BYTES`` of float32 each, ``SKETCH_GROUP_BYTES`` for the
   sketch), on a side stream of the lowest priority, which waits for that event (the
   training stream never waits for the agent): cast to float32 (bfloat16 and float16
   are measured, never refused), the health sums over the finite elements, centring
   when asked, and the Gram matrix of the smaller side; then copies of the sums and the
   Gram matrices into pinned host memory, without blocking, and an event. A batch
   issues about twenty torch operations (issued one sample at a time on the training
   thread, they cost it 0.9 ms a sample on an H200: BENCHMARKS.md, "GPU"); on the
   agent's thread they cost the training thread only the interpreter lock they hold.
   Where the sketch measures a sample (``RANKSCOPE_SPECTRUM``, ``docs/metrics.md``),
   the side stream runs the sketch's Krylov process on the sample's matrix instead
   of its Gram matrix (:func:`krylov`: about 360 torch calls a batch where its layers
   vouch at the schedule's first depth, 760 to its last; each layer runs as deep as its
   last sample needed), and only that process's small matrices, 0.2 to 1 MiB a
   sample, are copied to the host (the Gram matrix is 64 MiB at 4,096 × 4,096): the
   metrics thread then does only the sketch's small dense algebra;
3. when that event has completed (a non-blocking query: the agent's thread looks
   every ``HAND_OVER_POLL_S`` while reductions are pending; without it, ``poll`` at a
   later step's end), the pinned buffers go to the extension, whose metrics thread
   measures them (eigenvalues in float64 on the host, or the sketch's analysis). With
   the agent's thread, a sampled step costs the training thread its copies, an event
   and a hand-off (``python/benches/device_handover.py``).

An error in a reduction (out of device memory, say) does not reach the training loop:
its samples are handed over as failed, counted as dropped with the error's first line.

The side stream's work of each batch lies between two timing events; once both have
completed, their elapsed time (read without a wait) is the agent's device time: the
step rows' ``overhead_device_ms`` and the overhead budget's device share. Without a
stream (a CPU tensor, the extension's tests) the reduction's own time stands in.

No ``synchronize`` runs on the training thread, and no float64 eigen-solver on the
device. The agent's thread's CPU time is the agent's (the overhead budget's CPU
share). The products run in float32; where the user allowed TF32 for float32
products (``torch.set_float32_matmul_precision``, a process-wide switch that the
agent never touches), it runs in float64 instead, so its precision is the same.

Pinned memory comes from torch's caching host allocator, held in a bounded pool:
``RANKSCOPE_PINNED_POOL_BYTES`` (default 1 GiB) bounds the bytes of samples on the
device side and in the extension's queue together. A sample that would pass it is
skipped and counted (``samples_dropped``, with a ``sample_unreadable`` event naming
the pool). A batch's Gram matrices share one pinned buffer, freed when the metrics
thread is done with its last sample, so the memory held can pass the bound by at most
one batch's.

The agent's copies of sampled activations are bounded too, on the device:
``RANKSCOPE_DEVICE_COPY_BYTES`` (default 2 % of the GPU's memory: 2.8 GB on an H200)
bounds the bytes of copies taken and not yet reduced. A sample whose copy would pass it
is skipped before the copy and counted like the pool's. Besides the copies the side
stream needs the working memory of the one batch it reduces (its float32 samples are
at most ``SKETCH_GROUP_BYTES``, and the casts and products beside them).
"""

from __future__ import annotations

import os
import queue
import threading
from collections import deque
from time import perf_counter_ns, thread_time_ns
from typing import Any, Deque, Dict, List, Optional, Sequence, Tuple

import torch

from . import _native

POOL_BYTES_VARIABLE = "RANKSCOPE_PINNED_POOL_BYTES"
DEFAULT_POOL_BYTES = 1 << 30
COPY_BYTES_VARIABLE = "RANKSCOPE_DEVICE_COPY_BYTES"
# The default bound on the copies: this share of the GPU's memory.
DEFAULT_COPY_SHARE = 0.02
THREAD_VARIABLE = "RANKSCOPE_DEVICE_THREAD"
# The most float32 bytes of samples one reduction stacks (a chunk holds at least one):
# 64 MiB is one 4,096 × 4,096 sample, so the side stream's working memory stays what
# one sample of the default row cap needs.
GROUP_BYTES = 64 << 20
# The same for samples the sketch measures: their Krylov process issues a few hundred
# operations a batch whatever its size, so fewer, larger batches (four 4,096 × 4,096
# samples, sixteen 4,096 × 1,024).
SKETCH_GROUP_BYTES = 256 << 20
# The most bytes of row copies that wait for the step's end before their reduction starts.
HELD_BYTES = 256 << 20
# How often the agent's thread looks for completed reductions while some are pending.
HAND_OVER_POLL_S = 0.001
# What stops the agent's thread (after every launch before it).
_STOP = object()


def threaded_from_env() -> bool:
    """Whether an agent thread, rather than the training thread, issues the reductions
    (``RANKSCOPE_DEVICE_THREAD``: ``1``, the default, or ``0``)."""
    text = os.environ.get(THREAD_VARIABLE, "").strip()
    if text in ("", "1"):
        return True
    if text == "0":
        return False
    from ._native import ConfigError

    raise ConfigError(f"{THREAD_VARIABLE}={text!r} is not 0 or 1: give 1 (the default) or 0")


def pool_bytes_from_env() -> int:
    """The pinned-memory pool's bound from ``RANKSCOPE_PINNED_POOL_BYTES``."""
    value = _bytes_from_env(POOL_BYTES_VARIABLE, f"{DEFAULT_POOL_BYTES}, 1 GiB")
    return DEFAULT_POOL_BYTES if value is None else value


def copy_bytes_from_env() -> Optional[int]:
    """The bound on the device copies from ``RANKSCOPE_DEVICE_COPY_BYTES`` (``None``: the
    default, 2 % of each GPU's memory)."""
    return _bytes_from_env(COPY_BYTES_VARIABLE, "2 % of the GPU's memory")


def _bytes_from_env(variable: str, default: str) -> Optional[int]:
    """A byte count from ``variable`` (``None`` where it is unset or blank)."""
    text = os.environ.get(variable)
    if text is None or text.strip() == "":
        return None
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 1:
        from ._native import ConfigError

        raise ConfigError(
            f"{variable}={text!r} is not a byte count: give a whole number of bytes, at least 1 (default {default})"
        )
    return value


class _Taken:
    """A sample's matrix, copied on the training stream, waiting for the step's end;
    ``keep`` of its rows, drawn from ``seed``, are reduced (``None``: all)."""

    __slots__ = ("token", "matrix", "centered", "nbytes", "sketch", "seed", "keep", "depths", "copy_bytes")

    def __init__(
        self,
        token: Any,
        matrix: torch.Tensor,
        centered: bool,
        nbytes: int,
        sketch: bool = False,
        seed: int = 0,
        keep: Optional[int] = None,
        depths: Optional[int] = None,
    ) -> None:
        self.token = token
        self.matrix = matrix
        self.centered = centered
        self.nbytes = nbytes
        self.sketch = sketch
        self.seed = seed
        self.keep = keep
        # How many depths of the sketch's schedule its Krylov process runs (None: all).
        self.depths = depths
        # The copy's bytes on its device, held until its reduction has completed.
        self.copy_bytes = matrix.numel() * matrix.element_size()

    def shape(self) -> Tuple[int, int]:
        """The shape of what is reduced: the kept rows."""
        rows, cols = self.matrix.shape
        return (rows if self.keep is None else self.keep, cols)

    def rows(self) -> torch.Tensor:
        """The kept rows (on the reducing thread and stream): those the extension's
        ``choose_rows`` draws from the seed, as the host path does."""
        if self.keep is None:
            return self.matrix
        chosen = _native.choose_rows(self.matrix.shape[0], self.keep, self.seed)
        index = torch.frombuffer(bytearray(chosen), dtype=torch.int64)
        if self.matrix.is_cuda:
            index = index.pin_memory().to(self.matrix.device, non_blocking=True)
        return self.matrix.index_select(0, index)


class _Pending:
    """One group's reduction, launched: its samples' tokens and pinned results."""

    __slots__ = ("tokens", "nbytes", "started", "event", "health", "gram", "device_ns", "trace", "copy_bytes")

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
        copy_bytes: int = 0,
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
        # The device copies its samples held, free once the reduction has completed.
        self.copy_bytes = copy_bytes


class _Launch:
    """A launch's samples, and per CUDA device an event on the training stream after
    their row copies: where the side stream starts."""

    __slots__ = ("taken", "ready")

    def __init__(self, taken: List[_Taken], ready: Dict[Any, Any]) -> None:
        self.taken = taken
        self.ready = ready


class DeviceSide:
    """Reduces samples of GPU activations on a side stream (see the module)."""

    def __init__(
        self, native: Any, pool_bytes: int, threaded: Optional[bool] = None, copy_bytes: Optional[int] = None
    ) -> None:
        self._native = native
        self._pool_bytes = pool_bytes
        # The bound on the device copies (None: 2 % of each GPU's memory, none on a CPU),
        # per device, and the bytes they hold now (guarded by _lock).
        self._copy_bound = copy_bytes
        self._copy_bounds: Dict[Any, Optional[int]] = {}
        self._copies_held = 0
        self._streams: Dict[int, Any] = {}
        self._taken: List[_Taken] = []
        self._taken_bytes = 0
        self._pending: Deque[_Pending] = deque()
        # Held while handing over: the agent's thread and, without it, poll() do.
        self._handing_over = threading.Lock()
        # Guards _pending_bytes, changed by the training thread and the agent's thread.
        self._lock = threading.Lock()
        self._pending_bytes = 0
        # The device types whose reductions the agent's thread issues (the tests add
        # "cpu" to run that path without a GPU).
        self.threaded_devices = {"cuda"} if (threaded_from_env() if threaded is None else threaded) else set()
        self._work: "queue.Queue[Any]" = queue.Queue()
        self._thread: Optional[threading.Thread] = None

    def _stream(self, device: torch.device) -> Any:
        index = device.index if device.index is not None else torch.cuda.current_device()
        stream = self._streams.get(index)
        if stream is None:
            # The lowest priority: higher numbers are lower priorities.
            low, _high = torch.cuda.Stream.priority_range()
            stream = torch.cuda.Stream(device=index, priority=low)
            self._streams[index] = stream
        return stream

    def _add_pending_bytes(self, nbytes: int, copy_bytes: int = 0) -> None:
        with self._lock:
            self._pending_bytes += nbytes
            self._copies_held += copy_bytes

    def _copy_bound_of(self, device: torch.device) -> Optional[int]:
        """The bound on the copies on ``device`` (read once per device)."""
        if device not in self._copy_bounds:
            bound = self._copy_bound
            if bound is None and device.type == "cuda":
                bound = int(torch.cuda.get_device_properties(device).total_memory * DEFAULT_COPY_SHARE)
            self._copy_bounds[device] = bound
        return self._copy_bounds[device]

    def submit(
        self,
        tensor: torch.Tensor,
        token: Any,
        order: Sequence[int],
        rows: int,
        cols: int,
        keep: Optional[int],
        centered: bool,
        sketch: bool = False,
        seed: int = 0,
        depths: Optional[int] = None,
    ) -> None:
        """Copies one sample's matrix (called by the extension's hook on the training
        thread: one copy, nothing else on the device); its reduction starts at the
        step's end (:meth:`launch`). ``keep``: how many of its rows the reduction keeps,
        drawn from ``seed`` there, off the training thread (``None``: all). ``sketch``:
        the sketch measures it, so the device runs its Krylov process (:func:`krylov`),
        drawing its random vectors from ``seed`` too, to ``depths`` depths of the sketch's
        schedule (``None``: all; the extension tells each layer's, learnt from its last
        sample). The pool counts a sketched sample at its longest summary's bytes."""
        kept = keep if keep is not None else rows
        side = min(kept, cols)
        nbytes = (_native.SKETCH_PACKED_LENS[-1] * 8 if sketch else side * side * 4) + 48
        if self._pending_bytes + self._native.pinned_bytes_held() + nbytes > self._pool_bytes:
            self._native.hand_over_failed(
                token,
                f"skipped: the pinned-memory pool ({POOL_BYTES_VARIABLE}={self._pool_bytes}) "
                f"has no room for this sample's {nbytes} bytes",
            )
            return
        copy_bytes = tensor.numel() * tensor.element_size()
        bound = self._copy_bound_of(tensor.device)
        if bound is not None and self._copies_held + copy_bytes > bound:
            self._native.hand_over_failed(
                token,
                f"skipped: the agent's device copies ({COPY_BYTES_VARIABLE}={bound}) "
                f"have no room for this sample's {copy_bytes} bytes",
            )
            return
        # 1. The training stream: the agent's own copy of the matrix (a reshape that
        # could not be a view has copied it already).
        matrix = tensor.detach().permute(*order).reshape(rows, cols)
        if matrix._is_view():
            matrix = matrix.clone()
        taken = _Taken(token, matrix, centered, nbytes, sketch, seed, keep, depths)
        self._taken.append(taken)
        self._add_pending_bytes(nbytes, taken.copy_bytes)
        self._taken_bytes += taken.copy_bytes
        if self._taken_bytes > HELD_BYTES:
            self._launch()

    def _launch(self) -> None:
        """Starts the reduction of the samples taken since the last launch: on the
        agent's thread where their device's type is threaded, else here."""
        taken, self._taken = self._taken, []
        self._taken_bytes = 0
        if not taken:
            return
        ready: Dict[Any, Any] = {}
        threaded = []
        inline = []
        for t in taken:
            device = t.matrix.device
            if device.type == "cuda" and device not in ready:
                # Where the side stream starts: after the copies, on the training stream.
                event = torch.cuda.Event()
                event.record(torch.cuda.current_stream(device))
                ready[device] = event
            (threaded if device.type in self.threaded_devices else inline).append(t)
        if threaded:
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="rankscope-device", daemon=True)
                self._thread.start()
            self._work.put(_Launch(threaded, ready))
        if inline:
            self._reduce_all(_Launch(inline, ready))

    def _run(self) -> None:
        """The agent's thread: issues each launch's reductions in order, and hands
        completed ones to the extension (looking every ``HAND_OVER_POLL_S`` while some
        are pending; a non-blocking query, no wait on the device). Its CPU time is the
        agent's (the overhead budget's CPU share)."""
        while True:
            try:
                launch = self._work.get(timeout=HAND_OVER_POLL_S if self._pending else None)
            except queue.Empty:
                launch = None
            started = thread_time_ns()
            try:
                if launch is _STOP:
                    return
                if launch is not None:
                    # Hands every sample over, reduced or failed; raises nothing of its own.
                    self._reduce_all(launch)
                self._hand_over_completed()
            finally:
                if launch is not None:
                    self._work.task_done()
                self._native.add_thread_ns(thread_time_ns() - started)

    def _reduce_all(self, launch: _Launch) -> None:
        """One reduction per group of samples alike in device, shape, type, centring and
        method, in chunks of at most ``GROUP_BYTES`` (``SKETCH_GROUP_BYTES``) of
        float32; a chunk that fails hands its samples over as failed."""
        try:
            groups: Dict[Tuple[Any, ...], List[_Taken]] = {}
            for t in launch.taken:
                key = (t.matrix.device, t.shape(), t.matrix.dtype, t.centered, t.sketch)
                groups.setdefault(key, []).append(t)
            chunks = []
            for items in groups.values():
                rows, cols = items[0].shape()
                limit = SKETCH_GROUP_BYTES if items[0].sketch else GROUP_BYTES
                per_chunk = max(1, limit // max(1, rows * cols * 4))
                chunks += [items[first : first + per_chunk] for first in range(0, len(items), per_chunk)]
        except Exception as error:  # noqa: BLE001 - no sample goes unaccounted for
            self._fail(launch.taken, error)
            return
        for chunk in chunks:
            try:
                self._reduce(chunk, launch.ready.get(chunk[0].matrix.device))
            except Exception as error:  # noqa: BLE001 - training goes on; the samples are counted
                self._fail(chunk, error)

    def _fail(self, items: List[_Taken], error: BaseException) -> None:
        why = str(error).splitlines()[0] if str(error) else type(error).__name__
        for t in items:
            self._add_pending_bytes(-t.nbytes, -t.copy_bytes)
            self._native.hand_over_failed(t.token, f"the device side failed: {why}")

    def _reduce(self, items: List[_Taken], ready: Any) -> None:
        tokens = [t.token for t in items]
        nbytes = [t.nbytes for t in items]
        device = items[0].matrix.device
        centered = items[0].centered
        sketch = items[0].sketch
        # A batch runs as deep as its deepest sample needs (its summaries hold every depth
        # up to there, the analysis stops at each one's own).
        depths = _batch_depths(items)
        copy_bytes = sum(t.copy_bytes for t in items)
        if device.type != "cuda":
            # The same reduction without a stream (the extension's tests run it on CPU).
            reducing = perf_counter_ns()
            batch = torch.stack([t.rows() for t in items])
            health, trace, gram = _reduction(batch, centered, sketch, items[0].seed, depths)
            gram = gram.contiguous()
            spent = perf_counter_ns() - reducing
            self._pending.append(_Pending(tokens, nbytes, None, None, health, gram, spent, trace, copy_bytes))
            return
        stream = self._stream(device)
        # 2. The side stream, from where the training stream recorded `ready`; on the
        # agent's thread the current device is that thread's own, so it is set here.
        with torch.cuda.device(device), torch.cuda.stream(stream):
            stream.wait_event(ready)
            started = torch.cuda.Event(enable_timing=True)
            started.record(stream)
            batch = torch.stack([t.rows() for t in items]) if len(items) > 1 else items[0].rows().unsqueeze(0)
            health, trace, gram = _reduction(batch, centered, sketch, items[0].seed, depths)
            host_trace = None
            if trace is not None:
                host_trace = torch.empty(trace.shape, dtype=torch.float64, pin_memory=True)
                host_trace.copy_(trace, non_blocking=True)
            host_gram = torch.empty(gram.shape, dtype=gram.dtype, pin_memory=True)
            host_gram.copy_(gram, non_blocking=True)
            host_health = torch.empty(health.shape, dtype=torch.float64, pin_memory=True)
            host_health.copy_(health, non_blocking=True)
            event = torch.cuda.Event(enable_timing=True)
            event.record(stream)
        # The copies were made on the training stream and are read on the side stream.
        for t in items:
            t.matrix.record_stream(stream)
        self._pending.append(
            _Pending(tokens, nbytes, started, event, host_health, host_gram, 0, host_trace, copy_bytes)
        )

    def launch(self) -> None:
        """At a step's end, before its row is made: starts the reduction of the
        step's samples, counted as the sampled step's overhead (on the agent's thread,
        only the hand-off is)."""
        if self._taken:
            entered = perf_counter_ns()
            self._launch()
            self._native.add_overhead_since(entered, True)

    def poll(self) -> None:
        """After a step's end: starts the reduction of samples not yet started
        (:meth:`launch`); without the agent's thread, which does it otherwise, hands
        every completed reduction to the extension, in order, without waiting for the
        device."""
        self.launch()
        if self._thread is None:
            entered = perf_counter_ns()
            self._hand_over_completed()
            self._native.add_overhead_since(entered)

    def _hand_over_completed(self) -> None:
        with self._handing_over:
            while self._pending and (self._pending[0].event is None or self._pending[0].event.query()):
                self._hand_over(self._pending.popleft())

    def flush(self) -> None:
        """At finish: waits for the agent's thread and the reductions still running
        (the only waits, after the last step) and hands them over."""
        self._launch()
        if self._thread is not None:
            # After every launch before it; what the thread left is handed over here.
            self._work.put(_STOP)
            self._thread.join()
            self._thread = None
        while self._pending:
            item = self._pending.popleft()
            if item.event is not None:
                item.event.synchronize()
            self._hand_over(item)

    def _hand_over(self, item: _Pending) -> None:
        self._add_pending_bytes(-sum(item.nbytes), -item.copy_bytes)
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


def health_and_matrix(batch: torch.Tensor, centered: bool) -> Tuple[torch.Tensor, torch.Tensor]:
    """Of k sample matrices alike (k × rows × cols, any float type), on their device:
    each one's health sums over its finite elements (k × 5, float64: finite count,
    non-finite count, Σx, Σx², exact zeros), and the matrices in float32 with their
    non-finite elements zeroed, centred when asked (meaningless where an element is
    not finite, and then not used)."""
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
    return health, clean


def _product_type(matrix: torch.Tensor) -> torch.dtype:
    """float32, or float64 where the user allowed TF32 for float32 products: TF32 is a
    process-wide switch, so the agent's products avoid it rather than turn it off."""
    tf32 = matrix.is_cuda and torch.get_float32_matmul_precision() != "highest"
    return torch.float64 if tf32 else torch.float32


# Whether torch multiplies bfloat16 or float16 matrices with float32 results here
# (``torch.bmm``'s ``out_dtype``), by device type and element type: learnt at the first
# sample that asks.
_LOW_PRECISION_GRAM: Dict[Tuple[str, torch.dtype], bool] = {}


def low_precision_gram(x: torch.Tensor) -> torch.Tensor:
    """The Gram matrix of the smaller side of k bfloat16 or float16 matrices alike, in
    float32, from the elements as they are: each product of two such elements is exact
    in float32, and the tensor cores accumulate in float32, so it is the float32 Gram
    matrix of the same values (in another order of summation), at a tenth of its
    device time and without a float32 copy of the batch."""
    _, rows, cols = x.shape
    if cols <= rows:
        return torch.bmm(x.transpose(1, 2), x, out_dtype=torch.float32)
    return torch.bmm(x, x.transpose(1, 2), out_dtype=torch.float32)


def _gram_as_is(batch: torch.Tensor, centered: bool) -> Optional[torch.Tensor]:
    """:func:`low_precision_gram` of a batch with its non-finite elements zeroed, where
    the batch is bfloat16 or float16, uncentred (centring leaves that type), and torch
    can do it on its device; ``None`` otherwise."""
    key = (batch.device.type, batch.dtype)
    if centered or batch.dtype not in (torch.bfloat16, torch.float16) or not _LOW_PRECISION_GRAM.get(key, True):
        return None
    clean = batch.nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)
    try:
        gram = low_precision_gram(clean)
    except (RuntimeError, TypeError, NotImplementedError):
        # Older torch, or no such kernel on this device: the float32 path, from now on.
        _LOW_PRECISION_GRAM[key] = False
        return None
    _LOW_PRECISION_GRAM[key] = True
    return gram


def _health_beside(batch: torch.Tensor, gram: torch.Tensor) -> torch.Tensor:
    """:func:`health_and_matrix`'s sums for a batch whose Gram matrix (of its finite
    elements) is known: Σx² is its trace, and the other sums read the batch once each,
    accumulating in float32, without a float32 copy."""
    finite = torch.isfinite(batch)
    n_finite = finite.sum(dim=(1, 2))
    total = torch.where(finite, batch, torch.zeros((), dtype=batch.dtype, device=batch.device)).sum(
        dim=(1, 2), dtype=torch.float32
    )
    return torch.stack(
        [
            n_finite.double(),
            (batch[0].numel() - n_finite).double(),
            total.double(),
            gram.diagonal(dim1=1, dim2=2).double().sum(dim=1),
            (batch == 0).sum(dim=(1, 2)).double(),
        ],
        dim=1,
    )


def reduce(batch: torch.Tensor, centered: bool) -> Tuple[torch.Tensor, torch.Tensor]:
    """What the host needs of k sample matrices alike for the exact path: their health
    sums (:func:`health_and_matrix`) and the Gram matrix of each one's smaller side
    (from the elements as they are where they are bfloat16 or float16:
    :func:`low_precision_gram`)."""
    gram = _gram_as_is(batch, centered)
    if gram is not None:
        return _health_beside(batch, gram), gram
    health, clean = health_and_matrix(batch, centered)
    operand = clean.to(_product_type(clean))
    _, rows, cols = operand.shape
    gram = operand.transpose(1, 2) @ operand if cols <= rows else operand @ operand.transpose(1, 2)
    return health, gram


def _batch_depths(items: List[_Taken]) -> Optional[int]:
    """The depths a batch's Krylov process runs: its deepest sample's (``None``: all)."""
    if any(t.depths is None for t in items):
        return None
    return max(t.depths for t in items)


def _reduction(
    batch: torch.Tensor, centered: bool, sketch: bool, seed: int, depths: Optional[int] = None
) -> Tuple[torch.Tensor, Optional[torch.Tensor], torch.Tensor]:
    """A batch's health sums, and for the sketch its Σλ and packed Krylov summaries to
    ``depths`` depths (:func:`reduce_for_sketch`), else no Σλ and its float32 Gram
    matrices (:func:`reduce`)."""
    if sketch:
        return reduce_for_sketch(batch, centered, seed, depths)
    health, gram = reduce(batch, centered)
    return health, None, gram.float()


def reduce_for_sketch(
    batch: torch.Tensor, centered: bool, seed: int, depths: Optional[int] = None
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """What the host needs of k sample matrices alike that the sketch measures: their
    health sums, Σλ and packed Krylov summaries. Where the batch is bfloat16 or float16
    and its Gram matrix comes from the elements as they are (:func:`low_precision_gram`),
    the Krylov process runs on that matrix (:func:`krylov_on_gram`: each product reads
    G, a quarter of a 4,096 × 1,024 sample's float32 bytes); otherwise on the float32
    matrix itself, G never formed (:func:`krylov`). Either runs to ``depths`` depths of
    the sketch's schedule (``None``: all)."""
    gram = _gram_as_is(batch, centered)
    if gram is not None:
        health = _health_beside(batch, gram)
        trace, packed = krylov_on_gram(gram, seed, depths)
        return health, trace, packed
    health, matrix = health_and_matrix(batch, centered)
    trace, packed = krylov(matrix, seed, depths)
    return health, trace, packed


def krylov(matrix: torch.Tensor, seed: int, depths: Optional[int] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """The sketch's Krylov process for k sample matrices alike (k × rows × cols, float32,
    from :func:`health_and_matrix`, which it scales in place), on their device: what the
    extension's ``KrylovSummary`` needs (``agent/src/sampling/sketch.rs`` analyses it;
    ``docs/metrics.md``, "Sketch mode", states the method). Returns each one's
    Σλ = ‖X‖²_F (k, float64) and its packed summary to ``depths`` depths of the schedule
    (``None``: all; k × ``SKETCH_PACKED_LENS[depths - 1]``, float64, in
    ``KrylovSummary::from_packed``'s order).

    G, the Gram matrix of the smaller side (r × r), is never formed: a product G·V is
    Xᵀ(X·V) (or X(Xᵀ·V)), in float32 (float64 where the user allowed TF32), on X scaled
    by 1/√Σλ. For a 4,096 × 4,096 sample that is about 19 GFLOP instead of the Gram
    matrix's 137, and no 64 MiB matrix. The space: :func:`_krylov_space`.
    """
    _, rows, cols = matrix.shape
    f64 = torch.float64
    product_type = _product_type(matrix)
    x = matrix.to(product_type)
    trace = torch.linalg.vector_norm(x, dim=2).to(f64).square().sum(dim=1)
    # In place: the caller's matrix is not read again (one batch's memory less).
    x.mul_(trace.rsqrt().to(product_type)[:, None, None])
    xt = x.transpose(1, 2)
    # G·V = (first @ (second @ V)) / Σλ, with G the smaller side's Gram matrix.
    first_factor, second_factor = (xt, x) if cols <= rows else (x, xt)

    def times(v: torch.Tensor) -> torch.Tensor:
        return torch.bmm(first_factor, torch.bmm(second_factor, v.to(product_type))).to(f64)

    return trace, _krylov_space(times, matrix.shape[0], min(rows, cols), matrix.device, seed, depths)


def krylov_on_gram(gram: torch.Tensor, seed: int, depths: Optional[int] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """:func:`krylov` for k Gram matrices alike (k × r × r, float32, which it scales in
    place), on their device: products G·V / Σλ in float32 (float64 where the user
    allowed TF32), Σλ its trace."""
    f64 = torch.float64
    trace = gram.diagonal(dim1=1, dim2=2).to(f64).sum(dim=1)
    product_type = _product_type(gram)
    g = gram.to(product_type)
    g.mul_(trace.reciprocal().to(product_type)[:, None, None])

    def times(v: torch.Tensor) -> torch.Tensor:
        return torch.bmm(g, v.to(product_type)).to(f64)

    return trace, _krylov_space(times, gram.shape[0], gram.shape[1], gram.device, seed, depths)


def _krylov_space(
    times: Any, k: int, r: int, device: torch.device, seed: int, depths: Optional[int] = None
) -> torch.Tensor:
    """The sketch's block Krylov space of k operators G / Σλ (each r × r, applied by
    ``times`` to k × r × c float64 blocks, in float64), and its packed summaries.

    The same process as the host's sketch: a block Krylov space from ``SKETCH_BLOCK``
    orthonormalized Gaussian vectors and ``SKETCH_PROBES`` Rademacher probes (the
    extension's constants), drawn from ``seed`` by torch's generator on the device,
    everything but the products in float64. It runs to the schedule's ``depths``-th
    depth (``None``: the last), since the device does not stop to ask; the host reads
    the depths in order and stops at the first that vouches. A smaller ``depths`` gives
    the leading blocks of a deeper run's summary, to round-off: the extension runs each
    layer as deep as its last sample needed (``agent/src/sampling/depths.rs``). Every new block is projected out of the space twice and
    orthonormalized by Cholesky QR twice (no branch on the device, no wait, no
    eigen-solver); a space that lost orthogonality all the same makes its round-off
    NaN, which the host reads as a sample it cannot measure. The space and its products
    are filled in place: a batch issues about 760 torch calls and 880 kernels to the
    last depth, 360 and 410 to the first, whatever its size
    (``python/benches/device_ops.py``).
    """
    b, m, schedule = _native.SKETCH_BLOCK, _native.SKETCH_PROBES, _native.SKETCH_SCHEDULE
    depths = len(schedule) if depths is None else depths
    if not 1 <= depths <= len(schedule):
        raise ValueError(f"depths={depths} is not 1 to {len(schedule)}, the depths of the sketch's schedule {schedule}")
    schedule = schedule[:depths]
    deepest = max(schedule)
    width = (deepest + 1) * b
    f64 = torch.float64

    def project_out(y: torch.Tensor, basis: torch.Tensor) -> torch.Tensor:
        across = basis.transpose(1, 2)
        for _ in range(2):
            y = torch.baddbmm(y, basis, torch.bmm(across, y), alpha=-1)
        return y

    def orthonormal(y: torch.Tensor) -> torch.Tensor:
        gram_y = torch.bmm(y.transpose(1, 2), y)
        diagonal = gram_y.diagonal(dim1=1, dim2=2)
        # A shift at round-off level keeps the factorization defined where the block
        # is (nearly) rank deficient; the second pass restores orthonormality.
        diagonal.add_(diagonal.sum(dim=1, keepdim=True).mul_(1e-13).add_(1e-300))
        lower, _ = torch.linalg.cholesky_ex(gram_y)
        # y·L⁻ᵀ, whose Gram matrix is the identity.
        return torch.linalg.solve_triangular(lower.transpose(1, 2), y, upper=True, left=False)

    generator = torch.Generator(device=device)
    generator.manual_seed(seed % (1 << 64))
    omega = torch.randn(k, r, b, generator=generator, device=device, dtype=f64)
    z = torch.randint(0, 2, (k, r, m), generator=generator, device=device).to(f64) * 2 - 1
    basis = torch.empty(k, r, width, dtype=f64, device=device)
    products = torch.empty(k, r, width, dtype=f64, device=device)
    q = orthonormal(orthonormal(omega))
    basis[:, :, :b] = q
    start = times(torch.cat([q, z], dim=2))
    products[:, :, :b] = start[:, :, :b]
    gz = start[:, :, b:]
    residual = project_out(start[:, :, :b], q)
    residuals = {}
    for step in range(1, deepest + 1):
        end = (step + 1) * b
        nxt = orthonormal(project_out(orthonormal(residual), basis[:, :, : end - b]))
        basis[:, :, end - b : end] = nxt
        products[:, :, end - b : end] = times(nxt)
        residual = project_out(products[:, :, end - b : end], basis[:, :, :end])
        if step in schedule:
            residuals[step] = residual
    projected = basis.transpose(1, 2) @ products
    projected = 0.5 * (projected + projected.transpose(1, 2))
    squares = products.transpose(1, 2) @ products
    # A smaller depth's T, K and G·K are the leading blocks of the deepest's.
    checked = [_depth(projected, basis, products, residuals[q], z, gz, (q + 1) * b) for q in schedule]
    # Orthonormality of the space, checked once: past 1e-8 the analysis would not hold.
    defect = torch.linalg.matrix_norm(basis.transpose(1, 2) @ basis - torch.eye(width, dtype=f64, device=device))
    lost = (defect > 1e-8) | ~torch.isfinite(defect)
    parts = [projected.reshape(k, -1), squares.reshape(k, -1)]
    for residual_gram, off, outside, control in checked:
        off = torch.where(lost, torch.full_like(off, float("nan")), off)
        parts += [residual_gram.reshape(k, -1), off[:, None], outside, control]
    packed = torch.cat(parts, dim=1).contiguous()
    expected = _native.SKETCH_PACKED_LENS[depths - 1]
    if packed.shape[1] != expected:
        raise ValueError(f"the packed sketch summary has {packed.shape[1]} values, not {expected}")
    return packed


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
