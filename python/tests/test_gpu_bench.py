"""The GPU benchmark (``python/benches/gpu_overhead.py``) runs where a GPU is lent for
minutes only, so its code is exercised here first: ``--smoke`` runs every arm with a
tiny GPT on the CPU, profiled window included. Its figures mean nothing; what is
checked is that each arm ran, that the sampled arms measured their planned samples,
and that every part of the report printed."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "benches" / "gpu_overhead.py"
ARMS = ("none", "steps", "full@10", "full@10-deepest", "full@1", "default")


def bench_env() -> dict:
    """The environment without RANKSCOPE_ variables: each arm sets its own budget."""
    return {k: v for k, v in os.environ.items() if not k.startswith("RANKSCOPE_")}


def test_gpu_overhead_smoke():
    done = subprocess.run(
        [sys.executable, str(BENCH), "--smoke", "--rounds", "1", "--steps", "20", "--warmup", "2", "--profile"],
        capture_output=True,
        text=True,
        timeout=600,
        env=bench_env(),
    )
    assert done.returncode == 0, done.stderr[-3000:]
    rows = {line.split("|")[1].strip(): line for line in done.stdout.splitlines() if line.startswith("| ")}
    for arm in ARMS:
        assert arm in rows, done.stdout
    # Budget 100 %: every planned sample is measured (full@10: steps 0 to 40 of the warm-up,
    # timed and profiled steps; full@1: every step).
    for arm in ("full@10", "full@1"):
        cells = [c.strip() for c in rows[arm].split("|")]
        assert cells[4].startswith("100%"), rows[arm]
    assert "profiled window (full@10):" in done.stdout, done.stdout


def test_gpu_overhead_names_an_unknown_arm():
    done = subprocess.run(
        [sys.executable, str(BENCH), "--smoke", "--arms", "none,fast"],
        capture_output=True,
        text=True,
        timeout=60,
        env=bench_env(),
    )
    assert done.returncode == 2
    assert "unknown arm(s) fast" in done.stderr
