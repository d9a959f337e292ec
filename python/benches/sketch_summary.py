"""What the metrics thread spends on a sample the sketch measures, when a device hands
over its Gram matrix (the host runs the sketch's products and algebra on it) against
when the device runs the sketch's Krylov process and hands over its summary (the host
runs only the analysis): the `layers` rows' `compute_ms`, side by side in one run, and
each path's stable_rank against the exact path's.

    python python/benches/sketch_summary.py [--sides 1024,4096] [--rows 4096] [--repeat 3]

The device side runs without a stream here (on the CPU, as the extension's tests run it);
on a GPU the same reduction runs on the side stream, and only the host's part is
compared here. Needs the collector (the `rankscope` command) and the DuckDB CLI, as the
package's tests do.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from test_api import Collector, duckdb, table, through_device_side  # noqa: E402

import rankscope  # noqa: E402


def run(out: Path, spectrum: str, summary: bool, inputs: dict, repeat: int, rows: int) -> dict:
    """One agent: each input observed `repeat` times; median compute_ms and stable_rank
    per input."""
    collector = Collector(out)
    os.environ["RANKSCOPE_SPECTRUM"] = spectrum
    agent = rankscope.init(collector=collector.addr, run_id="bench", max_rows=rows, sample_every=1)
    side = through_device_side(agent)
    if not summary:
        # The Gram matrix handed over, as before the device ran the Krylov process.
        submit = side.submit
        side.submit = lambda *args, **kwargs: submit(*args[:7])
    for step in range(repeat):
        with agent.step(step):
            for name, x in inputs.items():
                agent.observe(name, x)
        side.poll()
    assert agent.finish().complete
    del os.environ["RANKSCOPE_SPECTRUM"]
    assert collector.stop() == 0
    found: dict = {}
    sql = f"select layer, compute_ms, stable_rank, method from {table(out, 'layers')}"
    for line in duckdb(sql).splitlines():
        layer, ms, stable, method = line.split(",")
        found.setdefault(layer, []).append((float(ms), float(stable) if stable else float("nan"), method))
    return {
        layer: (statistics.median(v[0] for v in values), values[0][1], values[0][2])
        for layer, values in found.items()
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sides", default="1024,4096", help="the sample's columns (its smaller side)")
    parser.add_argument("--rows", type=int, default=4096, help="rows per sample (the default row cap)")
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    g = torch.Generator().manual_seed(1)
    inputs = {}
    for side in (int(s) for s in args.sides.split(",")):
        scale = torch.arange(1, side + 1).float() ** -0.5
        inputs[f"side_{side}"] = torch.randn(args.rows, side, generator=g) * scale
    with tempfile.TemporaryDirectory() as tmp:
        exact = run(Path(tmp) / "exact", "exact", False, inputs, 1, args.rows)
        gram = run(Path(tmp) / "gram", "sketch", False, inputs, args.repeat, args.rows)
        summary = run(Path(tmp) / "summary", "sketch", True, inputs, args.repeat, args.rows)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} intra-op threads; rows {args.rows}")
    print("sample       host ms: Gram  summary  ratio | stable_rank: exact  Gram  summary")
    for layer in inputs:
        a, b, e = gram[layer], summary[layer], exact[layer]
        print(
            f"{layer:<12} {a[0]:>13.1f} {b[0]:>8.1f} {a[0] / b[0]:>6.1f}x | "
            f"{e[1]:>17.4f} {a[1]:>6.4f} {b[1]:>8.4f}  ({a[2]}, {b[2]})"
        )


if __name__ == "__main__":
    main()
