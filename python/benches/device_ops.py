"""What the device side's reduction of one batch issues: torch calls from Python (each
costs the thread that issues it a few microseconds of interpreter and launch time on a
GPU) and the aten operations behind them (kernels, on a GPU), for a batch the exact path
measures and one the sketch measures (to each depth of its schedule, where the version
stops its Krylov process at a layer's learnt depth), with the reduction's time here (on
the CPU, where it runs without a stream). With ``--against FILE`` the same counts for another version
of ``rankscope/_device.py`` (``git show REV:python/rankscope/_device.py > FILE``), side by
side in one run.

    python python/benches/device_ops.py [--rows 4096] [--cols 1024] [--batch 4] [--against FILE]
"""

from __future__ import annotations

import argparse
import importlib.util
import inspect
import statistics
import sys
from time import perf_counter_ns
from typing import Any, Callable, List, Tuple

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

import rankscope._device as current


class _Calls(TorchFunctionMode):
    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.count += 1
        return func(*args, **(kwargs or {}))


class _Ops(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += 1
        return func(*args, **(kwargs or {}))


def _load(path: str) -> Any:
    spec = importlib.util.spec_from_file_location("rankscope._device_against", path)
    module = importlib.util.module_from_spec(spec)
    module.__package__ = "rankscope"
    spec.loader.exec_module(module)
    return module


def _reductions(module: Any, batch: torch.Tensor) -> List[Tuple[str, Callable[[], Any]]]:
    """The exact path's reduction and the sketch's, as that version runs them."""
    exact = ("exact (Gram matrix)", lambda: module.reduce(batch, False))
    if hasattr(module, "reduce_for_sketch") and "depths" in inspect.signature(module.reduce_for_sketch).parameters:
        schedule = module._native.SKETCH_SCHEDULE
        return [exact] + [
            (f"sketch to depth {q}", lambda n=n: module.reduce_for_sketch(batch, False, 7, n))
            for n, q in enumerate(schedule, start=1)
        ]
    if hasattr(module, "reduce_for_sketch"):
        sketch = lambda: module.reduce_for_sketch(batch, False, 7)  # noqa: E731
    elif hasattr(module, "health_and_matrix"):
        sketch = lambda: module.krylov(module.health_and_matrix(batch, False)[1], 7)  # noqa: E731
    else:
        sketch = lambda: module.krylov(module.reduce(batch, False)[1], 7)  # noqa: E731
    return [exact, ("sketch (Krylov process)", sketch)]


def measure(module: Any, batch: torch.Tensor, repeat: int) -> List[Tuple[str, int, int, float]]:
    found = []
    for name, run in _reductions(module, batch):
        with _Calls() as calls:
            run()
        with _Ops() as ops:
            run()
        times = []
        for _ in range(repeat):
            started = perf_counter_ns()
            run()
            times.append((perf_counter_ns() - started) / 1e6)
        found.append((name, calls.count, ops.count, statistics.median(times)))
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=4096)
    parser.add_argument("--cols", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=4, help="samples stacked in the batch")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--against", help="another version of rankscope/_device.py")
    args = parser.parse_args()
    if min(args.rows, args.cols, args.batch, args.repeat) < 1:
        sys.exit("--rows, --cols, --batch and --repeat must be at least 1")
    g = torch.Generator().manual_seed(1)
    scale = torch.arange(1, args.cols + 1, dtype=torch.float32) ** -0.5
    batch = torch.randn(args.batch, args.rows, args.cols, generator=g) * scale
    versions = [("this", current)]
    if args.against:
        versions.append((args.against, _load(args.against)))
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; batch {args.batch} × {args.rows} × {args.cols}")
    print(f"{'version':<24} {'reduction':<26} {'torch calls':>11} {'aten ops':>9} {'CPU ms':>9}")
    for label, module in versions:
        for name, calls, ops, ms in measure(module, batch, args.repeat):
            print(f"{label[-24:]:<24} {name:<26} {calls:>11} {ops:>9} {ms:>9.1f}")


if __name__ == "__main__":
    main()
