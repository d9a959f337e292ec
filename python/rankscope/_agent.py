"""The agent handle of one rank: module hooks, the DDP communication hook, and the
step context managers. Measuring, batching, spilling and sending are the Rust
agent's (``rankscope._native``); this module only attaches it to PyTorch."""

from __future__ import annotations

import atexit
import os
import warnings
import weakref
from time import perf_counter_ns
from typing import Any, Callable, Dict, Iterable, List, Optional, Tuple, Union

import torch
from torch import nn

from . import _collectives, _device, _native
from ._modules import _compiled_paths, _is_ddp, _keep_hook, _layers, _profiled, _unwrap, layer_name
from ._native import NativeStep, Report

PHASES = ("data", "forward", "backward", "optimizer")
"""The phases a step can be split into; any other name is a ValueError."""

METRICS_THREADS_VARIABLE = "RANKSCOPE_METRICS_THREADS"
# Metrics threads on a rank whose torch sees a CUDA GPU, where RANKSCOPE_METRICS_THREADS
# is unset. A GPU step is short and its device hands over small reductions, so the host's
# analysis of them is what bounds the samples measured (BENCHMARKS.md, "GPU"); a GPU
# node has cores to spare, and the overhead budget holds the threads' CPU time together.
GPU_METRICS_THREADS = 2


def _default_metrics_threads() -> Optional[int]:
    """The metrics threads this rank starts where ``RANKSCOPE_METRICS_THREADS`` is unset:
    :data:`GPU_METRICS_THREADS` where torch sees a CUDA GPU, else ``None`` (the agent's
    default, one)."""
    if METRICS_THREADS_VARIABLE in os.environ or not torch.cuda.is_available():
        return None
    return GPU_METRICS_THREADS

def init(
    *,
    collector: Optional[str] = None,
    run_id: Optional[str] = None,
    mode: Optional[str] = None,
    sample_every: Optional[int] = None,
    layers: Optional[Union[str, Iterable[str]]] = None,
    max_rows: Optional[int] = None,
    workload: Optional[str] = None,
    overhead_budget: Optional[Union[str, float]] = None,
) -> Union["Agent", "InertAgent"]:
    """Starts the agent of this rank and returns its handle.

    Rank, world size and node come from torchrun (``RANK``, ``LOCAL_RANK``,
    ``WORLD_SIZE``, ``GROUP_RANK``) or SLURM; everything else from ``RANKSCOPE_*``
    variables, which these keywords override:

    - ``collector``: ``host:port`` of the collector (``RANKSCOPE_COLLECTOR``,
      default ``127.0.0.1:50051``);
    - ``run_id``: the run's id (``RANKSCOPE_RUN_ID``, else torchrun's run id);
    - ``mode``: ``full``, ``rank0`` (only rank 0 records), ``steps`` (no layer
      sampling) or ``off`` (``RANKSCOPE_MODE``, default ``full``);
    - ``sample_every``: sample layer activations every N steps (default 10);
    - ``layers``: layer name patterns with ``*`` wildcards, as a comma-separated
      string or a list (default: all watched layers);
    - ``max_rows``: row cap of each activation matrix (default 4096);
    - ``overhead_budget``: the agent's share of the process's CPU time, of the
      GPU's time and of the observed step time, as a fraction (``0.02``) or a
      percentage string (``"2%"``); planned samples it has no room for are
      skipped and counted, and one sampled step every 100 steps is taken within
      2.5 times the budget (``RANKSCOPE_OVERHEAD_BUDGET``, default ``2%``;
      ``1.0`` or ``"100%"`` takes them all);
    - ``workload``: a label for the ``runs`` table.

    Where this rank records nothing (``mode="off"``, or ``rank0`` on another rank)
    the result is an :class:`InertAgent` whose calls cost nothing.

    Strings, whole numbers (``sample_every``, ``max_rows``, at least 1) and the
    budget are checked as given: a wrong type raises ``TypeError`` and a value out
    of range :class:`rankscope.ConfigError`, each naming the keyword, the value and
    the fix. A wrong setting raises :class:`rankscope.ConfigError` naming the
    variable and the fix; with ``RANKSCOPE_ON_CONFIG_ERROR=disable`` it warns once and returns an
    inert agent instead. A missing or dead collector never raises: rows wait in the
    agent's spill and are sent when it is back.

    The agent is finished at interpreter exit if :meth:`Agent.finish` was not
    called. ``with rankscope.init() as agent:`` finishes it on leaving the block.
    One agent runs in a process at a time: ``init`` raises ``RuntimeError`` while
    another is running (not finished, not collected).
    """
    if layers is not None and not isinstance(layers, str):
        try:
            patterns = list(layers)
        except TypeError:
            patterns = None
        if patterns is None or not all(isinstance(p, str) for p in patterns):
            raise TypeError(
                f"layers={layers!r} is not a pattern string or a list of them: "
                'e.g. layers="blocks.*" or layers=["fc1", "blocks.*.mlp"]'
            )
        layers = ",".join(patterns)
    global _running
    running = _running()
    if running is not None and running._report is None:
        raise RuntimeError(
            f"{running!r} is already running in this process, and a second agent would claim "
            "the same rank: use that one (the integrations take agent=), or call its finish() "
            "before init() starts another"
        )
    native = _native.init(
        collector=collector,
        run_id=run_id,
        mode=mode,
        sample_every=sample_every,
        layers=layers,
        max_rows=max_rows,
        workload=workload,
        overhead_budget=overhead_budget,
        metrics_threads=_default_metrics_threads(),
    )
    if not native.active:
        return InertAgent()
    agent = Agent(native)
    _running = weakref.ref(agent)
    return agent


def _nothing() -> None:
    return None


# The process's running agent, if any (one rank, one agent); not kept alive by this.
_running: Callable[[], Optional["Agent"]] = _nothing


class Agent:
    """The agent of one rank. Made by :func:`rankscope.init`."""

    def __init__(self, native: "_native.NativeAgent") -> None:
        self._native = native
        self._watched: List[Tuple[str, nn.Module, Optional[str]]] = []
        self._cuda = torch.cuda.is_available()
        self._deferred: Optional[_Deferred] = _Deferred(native) if self._cuda else None
        self._device: Optional[_device.DeviceSide] = None
        if self._cuda:
            self._device = _device.DeviceSide(
                native, _device.pool_bytes_from_env(), copy_bytes=_device.copy_bytes_from_env()
            )
            native._set_device_side(self._device)
            native._set_device_memory(_device.device_memory(_local_device()))
        self._report: Optional[Report] = None
        _collectives.install(native, self._deferred)
        # Finish at exit without keeping the agent alive just for that.
        ref = weakref.ref(self)
        atexit.register(lambda: ref() is not None and ref().finish())

    def __repr__(self) -> str:
        n = self._native
        return f"rankscope.Agent(run_id={n.run_id!r}, rank={n.rank}, mode={n.mode!r})"

    def __enter__(self) -> "Agent":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.finish()

    @property
    def active(self) -> bool:
        """True: this agent records (an :class:`InertAgent` is False)."""
        return True

    @property
    def rank(self) -> int:
        return self._native.rank

    @property
    def run_id(self) -> str:
        return self._native.run_id

    # -- layers -----------------------------------------------------------------

    def watch(self, model: nn.Module, *, comm: bool = True) -> List[str]:
        """Observes the output of every leaf module that has parameters (and of
        every ``nn.MultiheadAttention``), named by its module path. A
        ``DistributedDataParallel`` model is unwrapped, so names carry no
        ``module.`` prefix, and (with ``comm=True``) a communication hook that
        times the gradient all-reduce is registered: ``steps.comm_ms``.

        Hooks are put in place only for sampled steps, so other steps cost nothing.
        Returns the watched layer names, after the ``layers`` filter.
        """
        if not isinstance(model, nn.Module):
            raise TypeError(
                f"watch({model!r}): {type(model).__name__} is not a torch.nn.Module: pass the model "
                "(e.g. agent.watch(model)), or observe tensors with agent.observe(name, tensor)"
            )
        inner = _unwrap(model)
        compiled = _compiled_paths(inner)
        layers = _layers(inner, skip=compiled)
        if not layers and not compiled:
            warnings.warn(
                f"rankscope found no layer to watch in this {type(inner).__name__}: a layer is a "
                "module with parameters and no children, or an nn.MultiheadAttention, named by "
                "its path in the model, and a model that is one layer itself has no path. Wrap "
                "it (nn.Sequential(model)) or observe its output with agent.observe(name, tensor)",
                RuntimeWarning,
                stacklevel=2,
            )
        added = []
        for name, module, kind in layers:
            if self._native.wants_layer(name) and not any(w[1] is module for w in self._watched):
                self._watched.append((name, module, kind))
                _keep_hook(self._native, name, module, kind)
                added.append(name)
        if comm and _is_ddp(model):
            self._register_comm_hook(model)
        return added

    def observe(self, name: str, tensor: torch.Tensor) -> None:
        """Observes an activation of layer ``name`` (from hand-written forward code).
        Costs one call on steps that are not sampled."""
        self._native.observe(name, tensor)

    def profile(
        self,
        model: nn.Module,
        example_input: Any,
        optimizer: Optional[torch.optim.Optimizer] = None,
    ) -> List[dict]:
        """Records the static model profile (the ``model`` table): per layer its
        kind, parameters, parameter, gradient and optimizer-state bytes, and
        forward FLOPs for ``example_input``'s batch. Runs one forward pass with
        gradients off (on the unwrapped module, so no DDP collective runs; an
        FSDP2 model all-gathers its parameters for it). Sharded (FSDP2)
        parameters count whole in ``params`` and the FLOPs, and as this rank's
        shard in the byte columns. A tuple
        input is passed as positional arguments, a dict as keywords. Returns the
        rows."""
        inner = _unwrap(model)
        params = [_profiled(layer_name(name), p) for name, p in inner.named_parameters()]
        layers = self._watched or [
            (n, m, k) for n, m, k in _layers(inner) if self._native.wants_layer(n)
        ]
        # A compiled model's shapes are seen on its original module (no compile).
        inner = getattr(inner, "_orig_mod", inner)

        def forward() -> None:
            native = self._native
            handles = [m.register_forward_hook(native.hook(n, k)) for n, m, k in layers]
            try:
                with torch.no_grad():
                    if isinstance(example_input, tuple):
                        inner(*example_input)
                    elif isinstance(example_input, dict):
                        inner(**example_input)
                    else:
                        inner(example_input)
            finally:
                for h in handles:
                    h.remove()

        return self._native.profile(params, _optimizer_kind(optimizer), forward)

    # -- steps --------------------------------------------------------------------

    def step(self, step: int) -> NativeStep:
        """Begins step ``step``: ``with agent.step(i) as s:`` records the ``steps``
        row on exit. Inside, ``with s.phase("data" | "forward" | "backward" |
        "optimizer"):`` times a phase, and ``s.record(loss=, lr=, grad_norm=,
        samples=)`` takes floats or 0-d tensors."""
        s = self._native.step(step)
        if self._deferred is not None and self._device is not None:
            return _CudaStep(s, self._deferred, self._device)
        return s

    def event(self, kind: str, message: str, value: Optional[int] = None) -> None:
        """Records a row in the ``events`` table; ``value`` is a whole number (its
        column is Int64) or ``None``."""
        for keyword, text in (("kind", kind), ("message", message)):
            if not isinstance(text, str):
                raise TypeError(
                    f"{keyword}={text!r} has type {type(text).__name__}, not str: "
                    'e.g. agent.event("checkpoint", "saved step 1000", value=1000)'
                )
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
            raise TypeError(
                f"value={value!r} has type {type(value).__name__}, not a whole number: the events "
                "table's value is Int64; e.g. value=3, or put the number in message"
            )
        if value is not None and not -(2**63) <= value < 2**63:
            raise ValueError(f"value={value} is outside Int64, the events table's value: put it in message")
        self._native.event(kind, message, value)

    def samples(self) -> Tuple[int, int, int]:
        """``(activations sampled, of which dropped, planned but skipped)`` so
        far. Skipped samples were not taken, to stay within the overhead budget
        or because the metrics thread's queue was full."""
        return self._native.samples()

    def overhead(self) -> Optional[Dict[str, Any]]:
        """What the agent has cost so far, by share of its overhead budget
        (``docs/metrics.md``, "Which steps are sampled"): ``budget`` (a fraction),
        ``cpu_share`` (the agent's share of the process's CPU time) and the CPU
        times behind it (``agent_cpu_ms``, ``training_thread_ms``,
        ``metrics_thread_ms``, ``transport_thread_ms``, ``device_thread_ms`` (the
        thread that issues the device side's work on a GPU), ``process_cpu_ms``); the
        device time of its sample work (``device_ms`` over ``device_samples``); the
        observed slowdown of the steps (``observed_ms`` over ``observed_steps``
        sampled steps, ``observed_per_step_ms`` the recent median); the planned
        samples skipped per share (``skipped_cpu``, ``skipped_device``,
        ``skipped_observed``, ``skipped_queue_full``) and the steps the floor
        sampled over the budget (``steps_floor``). ``None`` on an inert agent."""
        return self._native.overhead()

    def finish(self) -> Report:
        """Sends everything and waits (at most 10 s) for the collector to
        acknowledge it. Returns a :class:`rankscope.Report`: ``rows_unsent`` rows
        did not reach the collector (``rows_spilled`` of them wait on disk for a
        later process or ``rankscope replay``). Callable more than once; also runs
        at interpreter exit."""
        if self._report is None:
            _collectives.stop(self._native)
            if self._deferred is not None:
                self._deferred.flush()
            if self._device is not None:
                self._device.flush()
            self._report = self._native.finish()
        return self._report

    # -- communication -------------------------------------------------------------

    def time_collectives(self, on: bool = True) -> None:
        """Times every ``torch.distributed`` collective into the ``comm`` table
        (on by default from :func:`rankscope.init`): per step and kind
        (``all_reduce``, ``all_gather``, ``reduce_scatter``, ``broadcast``,
        ``other``) their count, bytes and time from launch to completion. FSDP2's
        all-gathers and reduce-scatters are among them. ``on=False`` stops it; the
        collectives then run without any wrapper work."""
        if on:
            _collectives.install(self._native, self._deferred)
        else:
            _collectives.stop(self._native)

    def wrap_comm_hook(self, hook: Callable) -> Callable:
        """Wraps a DDP communication hook ``hook(state, bucket) -> Future`` so its
        time from launch to completion is added to the step's ``comm_ms``. For a
        model with a hook of your own: ``ddp.register_comm_hook(state,
        agent.wrap_comm_hook(my_hook))``. Without a device sync: CUDA events on
        GPU, the future's completion on gloo."""
        native = self._native
        native.enable_comm()
        deferred = self._deferred

        # No annotations: DDP checks them against dist.GradBucket and Future[Tensor].
        # The wrapper's own time on the thread that calls it (not `hook`'s) is the
        # agent's: handed over around the call of `hook`.
        def timed(state, bucket):  # type: ignore[no-untyped-def]
            entered = perf_counter_ns()
            if deferred is not None and bucket.buffer().is_cuda:
                start = torch.cuda.Event(enable_timing=True)
                start.record()
                native.add_overhead_since(entered)
                fut = hook(state, bucket)
                returned = perf_counter_ns()

                def done_cuda(f: torch.futures.Future) -> Any:
                    end = torch.cuda.Event(enable_timing=True)
                    end.record()
                    deferred.comm_events.append((start, end))
                    return _bucket_result(f)

                chained = fut.then(done_cuda)
                native.add_overhead_since(returned)
                return chained
            native.add_overhead_since(entered)
            started = perf_counter_ns()
            fut = hook(state, bucket)
            returned = perf_counter_ns()

            def done(f: torch.futures.Future) -> Any:
                native.add_comm_ms((perf_counter_ns() - started) / 1e6)
                return _bucket_result(f)

            chained = fut.then(done)
            native.add_overhead_since(returned)
            return chained

        return timed

    def _register_comm_hook(self, ddp: nn.Module) -> None:
        try:
            ddp.register_comm_hook(None, self.wrap_comm_hook(_allreduce))
        except RuntimeError as error:
            warnings.warn(
                f"rankscope cannot time the all-reduce ({error}); to record comm_ms with "
                "a communication hook of your own, register agent.wrap_comm_hook(hook) "
                "instead of hook, and call agent.watch(model, comm=False)",
                RuntimeWarning,
                stacklevel=3,
            )


class InertAgent:
    """The agent of a rank that records nothing (``mode="off"``, ``rank0`` mode on
    another rank, or a disabled configuration). Every call returns at once."""

    active = False
    rank = None
    run_id = None

    def __repr__(self) -> str:
        return "rankscope.InertAgent()"

    def __enter__(self) -> "InertAgent":
        return self

    def __exit__(self, *exc: Any) -> None:
        pass

    def watch(self, model: nn.Module, *, comm: bool = True) -> List[str]:
        return []

    def observe(self, name: str, tensor: torch.Tensor) -> None:
        pass

    def profile(self, model: nn.Module, example_input: Any, optimizer: Any = None) -> List[dict]:
        return []

    def step(self, step: int) -> "_InertStep":
        return _INERT_STEP

    def event(self, kind: str, message: str, value: Optional[int] = None) -> None:
        pass

    def samples(self) -> Tuple[int, int, int]:
        return (0, 0, 0)

    def overhead(self) -> Optional[Dict[str, Any]]:
        return None

    def wrap_comm_hook(self, hook: Callable) -> Callable:
        return hook

    def time_collectives(self, on: bool = True) -> None:
        pass

    def finish(self) -> Report:
        return _EMPTY_REPORT


class _InertStep:
    """A step and phase context manager that does nothing."""

    index = None
    sampled = False

    def __enter__(self) -> "_InertStep":
        return self

    def __exit__(self, *exc: Any) -> None:
        pass

    def phase(self, name: str) -> "_InertStep":
        if name not in PHASES:
            raise ValueError(
                f'phase "{name}" is not a phase: use data, forward, backward or optimizer'
            )
        return self

    def record(self, **values: Any) -> None:
        pass


_INERT_STEP = _InertStep()
_EMPTY_REPORT = _native.empty_report()


class _CudaStep:
    """A step on a CUDA machine: loss and grad-norm tensors are copied to pinned
    host memory without blocking, and the row is sent once a CUDA event says the
    copies (and the step's all-reduce timings) are complete, at a later step or at
    finish, so the training thread never waits for the device."""

    __slots__ = ("_s", "_deferred", "_device", "_tensors")

    def __init__(self, s: NativeStep, deferred: "_Deferred", device: "_device.DeviceSide") -> None:
        self._s = s
        self._deferred = deferred
        self._device = device
        self._tensors: dict = {}

    @property
    def index(self) -> int:
        return self._s.index

    @property
    def sampled(self) -> bool:
        return self._s.sampled

    def __enter__(self) -> "_CudaStep":
        return self

    def __exit__(self, *exc: Any) -> None:
        # The step's samples start their reduction: a sampled step's own cost, in its
        # row. stop() counts its own time (the step's hooks out) in this step's row;
        # the hand-over below is counted in the next step's.
        self._device.launch()
        self._s.stop()
        self._deferred.hold(self._s, self._tensors)
        # Samples whose device reduction has completed go to the metrics thread.
        self._device.poll()

    def phase(self, name: str) -> Any:
        return self._s.phase(name)

    def record(self, **values: Any) -> None:
        entered = perf_counter_ns()
        rest = {}
        for key, value in values.items():
            if value is None:
                continue
            if isinstance(value, torch.Tensor) and value.is_cuda:
                host = torch.empty(value.shape, dtype=value.dtype, pin_memory=True)
                host.copy_(value.detach(), non_blocking=True)
                self._tensors[key] = host
            else:
                rest[key] = value
        self._deferred.native.add_overhead_since(entered)
        # record() counts its own time.
        self._s.record(**rest)


class _Deferred:
    """Steps whose values are still being computed on the device."""

    def __init__(self, native: "_native.NativeAgent") -> None:
        self.native = native
        self.comm_events: list = []
        # (kind, bytes, start event, end event) of the collectives timed on CUDA.
        self.collectives: list = []
        self.pending: list = []

    # The Python work here is the agent's time on the training thread, handed to the
    # extension around the calls that count their own (record, send).

    def hold(self, s: NativeStep, tensors: dict) -> None:
        entered = perf_counter_ns()
        done = torch.cuda.Event()
        done.record()
        self.pending.append((s, tensors, (self.comm_events, self.collectives), done))
        self.comm_events = []
        self.collectives = []
        self.poll(entered)

    def poll(self, entered: int) -> None:
        while self.pending and self.pending[0][3].query():
            entered = self._send(*self.pending.pop(0)[:3], entered)
        self.native.add_overhead_since(entered)

    def flush(self) -> None:
        if self.pending:
            torch.cuda.synchronize()
        while self.pending:
            self._send(*self.pending.pop(0)[:3], perf_counter_ns())

    def _send(self, s: NativeStep, tensors: dict, events: tuple, entered: int) -> int:
        buckets, collectives = events
        values = {k: float(v.reshape(-1)[0]) for k, v in tensors.items()}
        comm = sum(a.elapsed_time(b) for a, b in buckets) if buckets else None
        kinds: dict = {}
        for kind, nbytes, start, end in collectives:
            count, total, ms = kinds.get(kind, (0, 0, 0.0))
            # An end event recorded after the step's own (a late completion) may
            # not be complete yet: it counts, without its time.
            done = end.query()
            kinds[kind] = (count + 1, total + nbytes, ms + (start.elapsed_time(end) if done else 0.0))
        self.native.add_overhead_since(entered)
        s.record(**values)
        if comm is not None:
            s.set_comm_ms(comm)
        for kind, (count, total, ms) in kinds.items():
            s.add_comm(kind, count, total, ms)
        s.send()
        return perf_counter_ns()


def _local_device() -> int:
    """This rank's CUDA device: ``LOCAL_RANK`` modulo the devices it sees (torchrun,
    SLURM), else the current one."""
    import os

    local = os.environ.get("LOCAL_RANK", os.environ.get("SLURM_LOCALID"))
    if local is not None and local.isdigit():
        return int(local) % max(torch.cuda.device_count(), 1)
    return torch.cuda.current_device()


def _allreduce(state, bucket):  # type: ignore[no-untyped-def]
    """DDP's default all-reduce (average over the group) without its own Python
    callback: the timing callback returns the bucket's tensor instead, so the hook
    adds one Python callback per bucket, not two."""
    group = state if state is not None else torch.distributed.group.WORLD
    tensor = bucket.buffer()
    tensor.div_(group.size())
    return torch.distributed.all_reduce(tensor, group=group, async_op=True).get_future()


def _bucket_result(f: torch.futures.Future) -> torch.Tensor:
    """The bucket's tensor from a hook's future: a tensor, or the list that a
    collective's future holds."""
    value = f.value()
    return value[0] if isinstance(value, list) else value


def _optimizer_kind(optimizer: Optional[torch.optim.Optimizer]) -> str:
    if optimizer is None:
        return "sgd"
    name = type(optimizer).__name__
    if name in ("Adam", "AdamW", "Adamax", "NAdam", "RAdam", "SparseAdam"):
        return "adam"
    if name == "SGD":
        momentum = any(g.get("momentum", 0) for g in optimizer.param_groups)
        return "sgd_momentum" if momentum else "sgd"
    warnings.warn(
        f"rankscope does not know the state size of optimizer {name}; the model "
        "profile counts 0 optimizer-state bytes for it",
        RuntimeWarning,
        stacklevel=3,
    )
    return "sgd"
