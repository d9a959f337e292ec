"""Type stubs for the Rust extension ``rankscope._native`` (pyo3)."""

from typing import Any, Callable, List, Optional, Tuple, Union

import torch

BUILT_TORCH: str

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
    def profile(
        self,
        parameters: List[Tuple[str, torch.Tensor, Optional[List[int]]]],
        optimizer: str,
        forward: Callable[[], None],
    ) -> List[dict]: ...
    def samples(self) -> Tuple[int, int, int]: ...
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
) -> NativeAgent: ...
def empty_report() -> Report: ...
