#!/usr/bin/env python3
"""Two builds of the `rankscope` command as a collector, side by side
(BENCHMARKS.md, "Any torch"): the release build against the wheel's, built for
size, say.

Each round starts each build's collector on loopback in turn (the order rotating)
and streams the same `rankscope loadgen` job into it (always from the first
build, so the sender is the same). The collector's CPU time is its own (user +
system, from `wait4` once it has committed its files and exited). Reported per
build: the median over rounds of rows per collector CPU second and of the wall
time, and the second build against the first.

Usage: python3 collector/benches/command_ab.py BIN_A BIN_B [--rounds 5]
       [--ranks 64] [--steps 200] [--layers 48]
"""

import argparse
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time


def one_round(binary, sender, args, out):
    proc = subprocess.Popen(
        [binary, "collector", "--listen", "127.0.0.1:0", "--out", out],
        stdout=subprocess.PIPE,
        env={**os.environ, "RANKSCOPE_LOG": "warn"},
        text=True,
    )
    addr = re.search(r"127\.0\.0\.1:\d+", proc.stdout.readline())
    if not addr:
        proc.kill()
        sys.exit(f"{binary}: the collector did not print its address")
    start = time.perf_counter()
    subprocess.run(
        [sender, "loadgen", "--ranks", str(args.ranks), "--steps", str(args.steps),
         "--layers", str(args.layers), "--collector", addr.group(0)],
        check=True,
        stdout=subprocess.DEVNULL,
    )
    wall = time.perf_counter() - start
    proc.send_signal(signal.SIGTERM)
    _, status, usage = os.wait4(proc.pid, 0)
    if status != 0:
        sys.exit(f"{binary}: the collector exited with status {status}")
    rows = args.ranks * (1 + args.layers + args.steps + args.steps * args.layers) + 1
    return rows / (usage.ru_utime + usage.ru_stime), wall


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("bin_a")
    p.add_argument("bin_b")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--ranks", type=int, default=64)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--layers", type=int, default=48)
    args = p.parse_args()
    for b in (args.bin_a, args.bin_b):
        if not os.access(b, os.X_OK):
            p.error(f"{b}: not an executable; give the path of a built `rankscope` command")
    builds = [args.bin_a, args.bin_b]
    rate = {b: [] for b in builds}
    wall = {b: [] for b in builds}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for i, b in enumerate(builds[r % 2:] + builds[: r % 2]):
                rt, w = one_round(b, args.bin_a, args, os.path.join(tmp, f"out-{r}-{i}"))
                rate[b].append(rt)
                wall[b].append(w)
            print(f"round {r + 1}/{args.rounds} done", file=sys.stderr, flush=True)
    print(f"loadgen: {args.ranks} ranks x {args.steps} steps x {args.layers} layers, "
          f"{args.rounds} interleaved rounds, medians")
    print("| build | rows per collector CPU second | wall s | size MB |")
    print("|---|---|---|---|")
    for b in builds:
        print(f"| {b} | {statistics.median(rate[b]):,.0f} | {statistics.median(wall[b]):.2f} | "
              f"{os.path.getsize(b) / 1e6:.1f} |")
    ratio = statistics.median(rate[args.bin_b]) / statistics.median(rate[args.bin_a])
    print(f"second against first, rows per CPU second: {ratio:.2f}x")


if __name__ == "__main__":
    main()
