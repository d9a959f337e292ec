#!/usr/bin/env python3
"""Throughput of 1 vs 2 collectors, side by side in one run (BENCHMARKS.md).

Each round runs `rankscope loadgen` against one collector, then against two
(`--collector A,B`: rank r goes to entry r % 2), alternating, each collector on a
fresh output directory. Reported per setup (median over rounds):

- rows per second of wall time (loadgen start to its exit, every row durable);
- rows per second of collector CPU time (user + system of the collector
  processes, from wait4 after a clean SIGTERM, so the final commit is counted);
- the loadgen's own CPU time, which shares the machine.

Usage: python3 collector/benches/sharding.py [--bin target/release/rankscope]
       [--rounds 3] [--ranks 64] [--steps 500] [--layers 48]
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


def start_collector(binary, out):
    proc = subprocess.Popen(
        [binary, "collector", "--listen", "127.0.0.1:0", "--out", out],
        stdout=subprocess.PIPE,
        env={**os.environ, "RANKSCOPE_LOG": "warn"},
        text=True,
    )
    first = proc.stdout.readline()
    addr = re.search(r"127\.0\.0\.1:\d+", first)
    if not addr:
        sys.exit(f"no address in the collector's first line: {first!r}")
    return proc, addr.group(0)


def cpu_of(pid):
    """Waits for `pid` and returns its user + system CPU seconds."""
    _, status, usage = os.wait4(pid, 0)
    if status != 0:
        sys.exit(f"process {pid} exited with status {status}")
    return usage.ru_utime + usage.ru_stime


def one_run(args, shards, tmp):
    collectors = [start_collector(args.bin, os.path.join(tmp, f"out-{i}")) for i in range(shards)]
    listen = ",".join(addr for _, addr in collectors)
    started = time.perf_counter()
    loadgen = subprocess.Popen(
        [args.bin, "loadgen", "--collector", listen, "--run-id", f"shards-{shards}",
         "--ranks", str(args.ranks), "--steps", str(args.steps), "--layers", str(args.layers)],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        env={**os.environ, "RANKSCOPE_LOG": "error"},
        text=True,
    )
    output = loadgen.stdout.read()
    loadgen_cpu = cpu_of(loadgen.pid)
    wall = time.perf_counter() - started
    rows = int(re.search(r"(\d+) acknowledged", output).group(1))
    collector_cpu = 0.0
    for proc, _ in collectors:
        proc.send_signal(signal.SIGTERM)
        collector_cpu += cpu_of(proc.pid)
    return rows, wall, collector_cpu, loadgen_cpu


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--bin", default="target/release/rankscope")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--ranks", type=int, default=64)
    p.add_argument("--steps", type=int, default=500)
    p.add_argument("--layers", type=int, default=48)
    args = p.parse_args()
    results = {1: [], 2: []}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for shards in (1, 2):
                run_dir = os.path.join(tmp, f"round-{r}-shards-{shards}")
                os.makedirs(run_dir)
                results[shards].append(one_run(args, shards, run_dir))
                rows, wall, ccpu, lcpu = results[shards][-1]
                print(f"round {r}: {shards} collector(s): {rows} rows, {wall:.2f} s wall, "
                      f"{ccpu:.2f} s collector CPU, {lcpu:.2f} s loadgen CPU", file=sys.stderr)
    print(f"\n`{os.path.basename(args.bin)} loadgen --ranks {args.ranks} --steps {args.steps} "
          f"--layers {args.layers}`, {args.rounds} interleaved rounds, medians, "
          f"{os.cpu_count()} CPU(s):\n")
    print("| collectors | rows | wall s | rows / wall s | collector CPU s | rows / collector CPU s | loadgen CPU s |")
    print("|---|---|---|---|---|---|---|")
    base = None
    for shards in (1, 2):
        runs = results[shards]
        rows = runs[0][0]
        wall = statistics.median(r[1] for r in runs)
        ccpu = statistics.median(r[2] for r in runs)
        lcpu = statistics.median(r[3] for r in runs)
        print(f"| {shards} | {rows:,} | {wall:.2f} | {rows / wall:,.0f} | {ccpu:.2f} | "
              f"{rows / ccpu:,.0f} | {lcpu:.2f} |")
        if base is None:
            base = (rows / wall, rows / ccpu)
        else:
            print(f"\n2 vs 1 collector: {rows / wall / base[0]:.2f}x rows per wall second, "
                  f"{rows / ccpu / base[1]:.2f}x rows per collector CPU second")


if __name__ == "__main__":
    main()
