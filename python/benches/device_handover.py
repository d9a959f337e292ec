"""The training thread's time per sampled step on the device path, in its three parts:
the hooks (each sample's copy and its submission), the step end's launch (with the
device side's own thread, a hand-off), and ``poll`` at a later step's end (which hands
completed reductions to the extension where no device-side thread does it). Here on
the CPU the device side runs without a stream, on its thread, and ``poll`` is timed
once that thread is done, so the reductions' own cost is left out: what remains is
what a GPU job's training thread pays.

    python python/benches/device_handover.py [--samples 12] [--rows 600] [--cols 560] [--spectrum sketch]

To compare builds, run it once per build in one sitting, e.g. with ``PYTHONPATH`` set
to another install of the package (``pip install --no-deps --target DIR WHEEL``).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from test_api import through_device_side  # noqa: E402

import rankscope  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", type=int, default=12, help="layers observed per step")
    parser.add_argument("--rows", type=int, default=600)
    parser.add_argument("--cols", type=int, default=560)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--spectrum", choices=("sketch", "exact"), default="sketch")
    args = parser.parse_args()
    if min(args.samples, args.rows, args.cols, args.steps) < 1:
        sys.exit("--samples, --rows, --cols and --steps must be at least 1")
    os.environ["RANKSCOPE_SPECTRUM"] = args.spectrum
    os.environ["RANKSCOPE_SPILL_DIR"] = tempfile.mkdtemp()
    agent = rankscope.init(
        collector="127.0.0.1:9", run_id="handover", max_rows=4096, sample_every=1, overhead_budget="100%"
    )
    side = through_device_side(agent, threaded=True)
    g = torch.Generator().manual_seed(1)
    inputs = {f"layer{i}": torch.randn(args.rows, args.cols, generator=g) for i in range(args.samples)}
    parts: dict = {"hooks": [], "launch": [], "poll": []}
    for step in range(args.steps):
        with agent.step(step):
            started = time.perf_counter_ns()
            for name, x in inputs.items():
                agent.observe(name, x)
            parts["hooks"].append(time.perf_counter_ns() - started)
            # The step's end: its row copies go to the device side's thread.
            started = time.perf_counter_ns()
            side.launch()
            parts["launch"].append(time.perf_counter_ns() - started)
        side._work.join()
        started = time.perf_counter_ns()
        side.poll()
        parts["poll"].append(time.perf_counter_ns() - started)
        # The next step starts with the metrics thread idle, as in a run that keeps up.
        while agent._native.queued_samples():
            time.sleep(0.02)
    agent.finish()
    print(
        f"{rankscope.__file__}: {args.samples} samples of {args.rows} × {args.cols} ({args.spectrum}) a step, "
        f"median of {args.steps} steps, training thread:"
    )
    for name, values in parts.items():
        ms = statistics.median(values) / 1e6
        print(f"  {name:<10} {ms:8.2f} ms a step, {ms * 1e3 / args.samples:8.1f} µs a sample")


if __name__ == "__main__":
    main()
