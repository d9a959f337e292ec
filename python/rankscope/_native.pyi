"""Type stubs for the Rust extension ``rankscope._native`` (pyo3)."""

from typing import Any, Callable, Dict, List, Optional, Tuple, Union

import torch

SKETCH_BLOCK: int
"""The sketch's block size (``agent/src/sampling/sketch.rs``)."""
SKETCH_PROBES: int
"""The sketch's Rademacher probes."""
SKETCH_SCHEDULE: List[int]
"""The Krylov depths at which the sketch checks its estimates."""
SKETCH_PACKED_LENS: List[int]
"""The float64 values of one packed Krylov summary (``hand_over_sketched``) by the depths
of ``SKETCH_SCHEDULE`` it holds: index 0 for the first depth alone, the last for all."""

class ConfigError(ValueError):
    """A wrong rankscope setting: the message names the variable or keyword and the fix."""

class Report:
    """What ``finish()`` returns."""

    rows_sent: int
    rows_acked: int
    rows_dropped: int
    rows_unsent: int
    rows_spilled: int
    spill_dir: Optional[str]
    connected: bool
    complete: bool

class NativePhase:
    def __enter__(self) -> None: ...
    def __exit__(self, *exc: Any) -> bool: ...

class NativeStep:
    @property
    def index(self) -> Optional[int]: ...
    @property
    def sampled(self) -> bool: ...
    def __enter__(self) -> "NativeStep": ...
    def __exit__(self, *exc: Any) -> bool: ...
    def phase(self, name: str) -> NativePhase:
        """Times one phase: ``data``, ``forward``, ``backward`` or ``optimizer``."""
    def record(
        self,
        *,
        loss: Optional[Any] = None,
        lr: Optional[Any] = None,
        grad_norm: Optional[Any] = None,
        samples: Optional[Any] = None,
    ) -> None:
        """Records floats, ints or 0-d tensors."""
    def stop(self) -> None:
        """Ends the step's clock (and takes its hooks out) without sending the row."""
    def send(self) -> None: ...
    def set_comm_ms(self, ms: float) -> None: ...
    def add_comm(self, kind: str, count: int, nbytes: int, ms: float) -> None:
        """Adds collectives to this step's ``comm`` rows after its clock stopped."""

class NativePending:
    """A sample taken on the training thread whose reduction runs on a GPU."""

class TorchSide:
    """``torch.Tensor`` and the device side, which the hooks share."""

class NativeHook:
    """A watched module's forward hook: observes its output as one layer."""

    def __call__(self, module: Any, inputs: Any, output: Any) -> None: ...

class NativeAgent:
    @property
    def active(self) -> bool: ...
    @property
    def rank(self) -> Optional[int]: ...
    @property
    def run_id(self) -> Optional[str]: ...
    @property
    def mode(self) -> Optional[str]: ...
    @property
    def sample_every(self) -> Optional[int]: ...
    def wants_layer(self, name: str) -> bool: ...
    def step(self, step: int) -> NativeStep: ...
    def hook(self, name: str, kind: Optional[str] = None) -> NativeHook: ...
    def watch_hook(self, hooks: dict, key: int, hook: NativeHook) -> None:
        """Puts ``hook`` in ``hooks`` under ``key`` for every sampled step."""
    def observe(self, name: str, tensor: torch.Tensor, kind: Optional[str] = None) -> None: ...
    def add_overhead_since(self, since_ns: int, sampling: bool = False) -> None:
        """Counts the time since ``since_ns`` (``time.perf_counter_ns()``) as the agent's."""
    def enable_comm(self) -> None: ...
    def add_comm_ms(self, ms: float) -> None: ...
    def add_comm(self, kind: str, count: int, nbytes: int, ms: float) -> None:
        """Adds ``count`` collectives of ``kind`` (``all_reduce``, ``all_gather``,
        ``reduce_scatter``, ``broadcast`` or ``other``) to the running step's
        ``comm`` rows. Callable from any thread."""
    def event(self, kind: str, message: str, value: Optional[int] = None) -> None: ...
    def _set_device_side(self, device_side: Any) -> None:
        """Sets the device side that reduces samples on a GPU (once)."""
    def _set_device_memory(self, read: Callable[[], Optional[Tuple[int, int, int]]]) -> None:
        """Sets what reads ``(allocated, reserved, peak)`` device bytes for each step row."""
    def _host_to_device_side(self, on: bool) -> None:
        """Tests only: host tensors go to the device side too (no stream)."""
    def hand_over_reduced(
        self,
        token: NativePending,
        finite: int,
        nonfinite: int,
        sum: float,
        sum_sq: float,
        zeros: int,
        gram: Optional[torch.Tensor],
    ) -> None:
        """Hands over a sample the device side reduced (its event has completed)."""
    def hand_over_sketched(
        self,
        token: NativePending,
        finite: int,
        nonfinite: int,
        sum: float,
        sum_sq: float,
        zeros: int,
        trace: float,
        packed: Optional[torch.Tensor],
    ) -> None:
        """Hands over a sample whose Krylov process the device ran (its event has
        completed): ``packed`` in ``KrylovSummary::from_packed``'s order."""
    def hand_over_failed(self, token: NativePending, why: str) -> None:
        """Hands over a sample the device side could not reduce (counted as dropped)."""
    def pinned_bytes_held(self) -> int:
        """Bytes of device reductions in pinned memory that the metrics thread holds."""
    def add_device_ns(self, ns: int, samples: int) -> None:
        """Adds device time of samples' side-stream work (the next step row's
        ``overhead_device_ms`` and the budget's device share)."""
    def add_thread_ns(self, ns: int) -> None:
        """Adds CPU time of the device side's own thread (the budget's CPU share)."""
    def _inject_sampled_step_delay(self, ms: float) -> None:
        """Tests only: sleeps ``ms`` at the end of every sampled step, unseen by the
        agent's clocks."""
    def profile(
        self,
        parameters: List[Tuple[str, List[int], int, bool, Optional[List[int]]]],
        optimizer: str,
        forward: Callable[[], None],
    ) -> List[dict]: ...
    def samples(self) -> Tuple[int, int, int]: ...
    def overhead(self) -> Optional[Dict[str, Any]]: ...
    def queued_samples(self) -> int:
        """Samples handed to the metrics thread and not yet measured."""
    def finish(self) -> Report: ...

def init(
    *,
    collector: Optional[str] = None,
    run_id: Optional[str] = None,
    mode: Optional[str] = None,
    sample_every: Optional[int] = None,
    layers: Optional[str] = None,
    max_rows: Optional[int] = None,
    workload: Optional[str] = None,
    overhead_budget: Optional[Union[str, float]] = None,
    metrics_threads: Optional[int] = None,
) -> NativeAgent: ...
def empty_report() -> Report: ...
