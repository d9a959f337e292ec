"""The device side of a sample against the float64 oracle, on a GPU: fixed activations
on CUDA (float32, bfloat16, float16, float32 with TF32 allowed, 3-D, and the same
float32 matrix on the CPU for the host path) go through the agent to a collector, and
each `layers` row's six spectral columns are compared with the singular values of the
same values in float64 (the wheel test's oracle, python/tests/oracle.py). A CUDA tensor
DLPack cannot read (sparse) must give an `events` row, not a crash.

    python python/benches/gpu_accuracy.py [--command rankscope] [--out DIR]

Prints one line per input (method, the largest relative difference and its column) and
exits 1 when a row is missing, or when the wheel test's fixed input (300 × 40, singular
values 0.9^i) differs by more than 1e-5 on the exact path. The larger inputs have steeper
spectra (0.99^i over 1,024 values: a condition number of about 3·10⁴): the float32 Gram
squares it, so their smallest singular values, and the columns that sum them, move more.
Needs one CUDA GPU and pyarrow; ``--cpu`` runs the same inputs on the CPU.
"""

from __future__ import annotations

import argparse
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

# The oracle of the wheel's test (written from docs/metrics.md, independently of rankscope).
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from oracle import COLUMNS, oracle  # noqa: E402

REL_TOL = 1e-5


def decaying(rows: int, cols: int, rate: float, seed: int):
    import torch

    g = torch.Generator().manual_seed(seed)
    u = torch.linalg.qr(torch.randn(rows, cols, generator=g, dtype=torch.float64))[0]
    v = torch.linalg.qr(torch.randn(cols, cols, generator=g, dtype=torch.float64))[0]
    s = torch.tensor([rate**i for i in range(cols)], dtype=torch.float64)
    return ((u * s) @ v.T).float()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--command", default="rankscope", help="the rankscope command (the collector)")
    parser.add_argument("--out", default="", help="the collector's folder (default: a temporary one)")
    parser.add_argument("--cpu", action="store_true", help="the same inputs on the CPU: checks the script where there is no GPU")
    args = parser.parse_args()

    import pyarrow.dataset as ds
    import torch

    import rankscope

    if not args.cpu and not torch.cuda.is_available():
        sys.exit("gpu_accuracy.py needs a CUDA GPU (--cpu checks the script on the CPU)")
    command = shutil.which(args.command) or args.command
    out = Path(args.out or tempfile.mkdtemp(prefix="rankscope-gpu-accuracy-"))
    collector = subprocess.Popen(
        [command, "collector", "--listen", "127.0.0.1:0", "--out", str(out)],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "RANKSCOPE_LOG": "warn"},
    )
    line = collector.stdout.readline()
    addr = next(w for w in line.split() if w.startswith("127.0.0.1:")).rstrip(",")

    cuda = torch.device("cpu") if args.cpu else torch.device("cuda", 0)
    fixed = decaying(300, 40, 0.9, 7)
    wide = decaying(1024, 1024, 0.995, 8)[:512]
    inputs = {
        "fixed_cpu": fixed,
        "fixed": fixed.to(cuda),
        "fixed_bf16": fixed.to(cuda).bfloat16(),
        "fixed_fp16": fixed.to(cuda).half(),
        "fixed_tf32": fixed.to(cuda),
        "tall_4096x1024": decaying(4096, 1024, 0.99, 9).to(cuda),
        "wide_512x1024": wide.to(cuda),
        "seq_bf16_8x512x1024": decaying(4096, 1024, 0.99, 10).reshape(8, 512, 1024).to(cuda).bfloat16(),
    }
    agent = rankscope.init(collector=addr, run_id="gpu-accuracy", sample_every=1, overhead_budget=1.0)
    precision = torch.get_float32_matmul_precision()
    with agent.step(0):
        for name, x in inputs.items():
            torch.set_float32_matmul_precision("high" if name == "fixed_tf32" else precision)
            agent.observe(name, x)
        torch.set_float32_matmul_precision(precision)
        agent.observe("sparse_cuda", fixed.to(cuda).to_sparse())
    report = agent.finish()
    collector.send_signal(signal.SIGTERM)
    collector.wait(timeout=60)

    layers = ds.dataset(out / "layers", format="parquet", partitioning="hive").to_table().to_pylist()
    events = ds.dataset(out / "events", format="parquet", partitioning="hive").to_table().to_pylist()
    rows = {r["layer"]: r for r in layers if r["run_id"] == "gpu-accuracy"}
    failed = not report.complete
    where = "the CPU" if args.cpu else torch.cuda.get_device_name(0)
    print(f"torch {torch.__version__} on {where}; agent report complete: {report.complete}")
    print("| input | method | largest relative difference to float64 | column |")
    print("|---|---|---|---|")
    for name, x in inputs.items():
        row = rows.get(name)
        if row is None:
            print(f"| {name} | missing | - | - |")
            failed = True
            continue
        expected = oracle(x)
        worst, column = 0.0, "-"
        for c in COLUMNS:
            got = row[c]
            if got is None:
                worst, column = math.inf, f"{c} (null)"
                break
            diff = abs(got - expected[c]) / abs(expected[c])
            if diff > worst:
                worst, column = diff, c
        print(f"| {name} | {row['method']} | {worst:.2e} | {column} |")
        if name.startswith("fixed") and row["method"] == "exact" and worst > REL_TOL:
            failed = True
    unreadable = [e["message"] for e in events if e["run_id"] == "gpu-accuracy" and e["kind"] == "sample_unreadable"]
    print(f"sample_unreadable events: {unreadable}")
    if not any("sparse_cuda" in m for m in unreadable):
        failed = True
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
