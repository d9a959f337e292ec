#!/usr/bin/env python3
"""Freshness of the live view (BENCHMARKS.md, "The live view"): how long after a
rank records a step that step is visible in `/live`.

A collector with `--http` on loopback takes a real PyTorch DDP job (the package's
example under torchrun). This script reads `/live/runs/<run>?steps=16` every
`--poll-ms`; each (rank, step) seen for the first time counts
`seen - time`, where `time` is the step's own end (the `steps.time` column,
the rank's clock: the same machine's). A poll's own delay adds at most
`--poll-ms` to each figure. Reported: count, median, p95 and max, in ms.

Usage: python3 collector/benches/live_freshness.py [--bin target/release/rankscope]
       [--ranks 2] [--steps 300]
"""

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request


def start_collector(binary, out):
    proc = subprocess.Popen(
        [binary, "collector", "--listen", "127.0.0.1:0", "--out", out, "--http", "127.0.0.1:0"],
        stdout=subprocess.PIPE,
        env={**os.environ, "RANKSCOPE_LOG": "warn"},
        text=True,
    )
    grpc = re.search(r"127\.0\.0\.1:\d+", proc.stdout.readline())
    http = re.search(r"http://(127\.0\.0\.1:\d+)", proc.stdout.readline())
    if not grpc or not http:
        sys.exit("the collector did not print its addresses")
    return proc, grpc.group(0), http.group(1)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--bin", default="target/release/rankscope")
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--poll-ms", type=float, default=20.0)
    args = p.parse_args()
    venv = os.path.join(os.path.dirname(__file__), "..", "..", ".venv", "bin")
    torchrun = os.path.join(venv, "torchrun")
    example = os.path.join(os.path.dirname(__file__), "..", "..", "python", "rankscope", "examples", "ddp_train.py")
    with tempfile.TemporaryDirectory() as tmp:
        collector, grpc, http = start_collector(args.bin, os.path.join(tmp, "out"))
        env = {
            **os.environ,
            "RANKSCOPE_COLLECTOR": grpc,
            "RANKSCOPE_RUN_ID": "fresh",
            "RANKSCOPE_SPILL_DIR": os.path.join(tmp, "spill"),
            "RANKSCOPE_LOG": "warn",
            "OMP_NUM_THREADS": "1",
        }
        job = subprocess.Popen(
            [torchrun, "--standalone", "--nproc-per-node", str(args.ranks), example, "--steps", str(args.steps)],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        seen = {}
        ages_ms = []
        while job.poll() is None:
            try:
                with urllib.request.urlopen(f"http://{http}/live/runs/fresh?steps=16", timeout=5) as answer:
                    run = json.load(answer)
                now_us = time.time() * 1e6
                for rank in run["ranks"]:
                    for s in rank["steps"]:
                        key = (rank["rank"], s["step"])
                        if key not in seen and s.get("time_us"):
                            seen[key] = True
                            ages_ms.append((now_us - s["time_us"]) / 1000.0)
            except OSError:
                pass  # the run is not there yet
            time.sleep(args.poll_ms / 1000.0)
        collector.send_signal(signal.SIGTERM)
        collector.wait()
    if not ages_ms:
        sys.exit("no step was seen: did the job run? (make setup installs the package)")
    ages_ms.sort()
    p95 = ages_ms[min(len(ages_ms) - 1, int(0.95 * len(ages_ms)))]
    print(f"steps seen: {len(ages_ms)} ({args.ranks} ranks), poll every {args.poll_ms:.0f} ms")
    print(f"age when first visible, ms: median {statistics.median(ages_ms):.0f}, p95 {p95:.0f}, max {ages_ms[-1]:.0f}")


if __name__ == "__main__":
    main()
