#!/usr/bin/env python3
"""Time to visible in `delta_scan` (BENCHMARKS.md, "Delta Lake output"): how long
after a rank records a step that step's row is visible to DuckDB reading the
collector's Delta table.

A collector writes `--out delta:DIR` (a local disk) or `--out s3://BUCKET/runs`
(moto, a local S3 server, started here on a free loopback port). `rankscope
loadgen` ranks send steps to it. A reader polls `delta_scan('<root>/steps')`
every `--poll-ms` with DuckDB 1.5.5 and its delta extension (the one `make
delta-readers` installs); each (rank, step) seen for the first time counts
`seen - time`, where `time` is the step's own record time (`steps.time`, the
rank's clock: the same machine's). A poll's own duration adds to the figures;
its median is printed beside them. The collector commits a file once it is
`--max-file-age` old (or full), so each age is measured in turn. With `--collectors N`, N sharded
collectors commit to the same tables (the ranks spread over them), and the
figures are over all of them: they show whether commits of many collectors
starve each other.

Usage: .venv/bin/python collector/benches/delta_visible.py
       [--bin target/release/rankscope] [--store local,s3] [--ages 1s,10s]
       [--ranks 4] [--steps 1500] [--step-interval 20ms]
"""

import argparse
import os
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
READERS = os.path.join(ROOT, ".venv", "delta-readers")
DUCKDB_VERSION = "1.5.5"


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_s3():
    """moto on a free loopback port with bucket `rankscope`; returns (proc, port)."""
    port = free_port()
    moto = os.path.join(ROOT, ".venv", "bin", "moto_server")
    proc = subprocess.Popen(
        [moto, "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.time() + 60
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            break
        except OSError:
            if time.time() > deadline:
                sys.exit("moto_server did not start")
            time.sleep(0.05)
    import boto3

    boto3.client(
        "s3",
        endpoint_url=f"http://127.0.0.1:{port}",
        aws_access_key_id="test",
        aws_secret_access_key="test",
        region_name="us-east-1",
    ).create_bucket(Bucket="rankscope")
    return proc, port


def reader(s3_port):
    """A DuckDB connection with the delta extension (and the S3 secret)."""
    sys.path.insert(0, READERS)
    import duckdb

    if duckdb.__version__ != DUCKDB_VERSION:
        sys.exit(f"DuckDB {duckdb.__version__} found, {DUCKDB_VERSION} needed: run `make delta-readers`")
    con = duckdb.connect()
    con.execute("SET autoinstall_known_extensions = false; SET autoload_known_extensions = false")
    for name in ("httpfs", "delta"):
        path = os.path.join(
            READERS, f"duckdb_extension_{name}", "extensions", f"v{DUCKDB_VERSION}", f"{name}.duckdb_extension"
        )
        con.execute(f"LOAD '{path}'")
    if s3_port:
        con.execute(
            "CREATE SECRET (TYPE s3, KEY_ID 'test', SECRET 'test', REGION 'us-east-1', "
            f"ENDPOINT '127.0.0.1:{s3_port}', URL_STYLE 'path', USE_SSL false)"
        )
    return con


def commit_buckets(http):
    """The collector's commit_duration_seconds histogram: (upper bound, count) per
    bucket, cumulative."""
    import urllib.request

    text = urllib.request.urlopen(f"http://{http}/metrics", timeout=10).read().decode()
    return [
        (float(m.group(1)), float(m.group(2)))
        for m in re.finditer(r'commit_duration_seconds_bucket\{le="([^"]+)"\} (\S+)', text)
    ]


def quantiles(histograms):
    """(count, p50, p99) over the collectors' histograms (the same buckets): the
    upper bound of the bucket each quantile falls in."""
    buckets = [(le, sum(h[i][1] for h in histograms)) for i, (le, _) in enumerate(histograms[0])]
    total = buckets[-1][1] if buckets else 0
    if not total:
        return 0, None, None
    q = lambda f: next(le for le, n in buckets if n >= f * total)
    return int(total), q(0.5), q(0.99)


def measure(args, store, age, tmp):
    s3 = None
    env = {**os.environ, "RANKSCOPE_LOG": "warn,deltalake_core=error"}
    if store == "s3":
        s3, port = start_s3()
        env.update(
            AWS_ACCESS_KEY_ID="test",
            AWS_SECRET_ACCESS_KEY="test",
            AWS_REGION="us-east-1",
            AWS_ENDPOINT_URL=f"http://127.0.0.1:{port}",
            AWS_ALLOW_HTTP="true",
        )
        out = root = f"s3://rankscope/runs-{age}"
    else:
        port = None
        root = os.path.join(tmp, f"delta-{age}")
        out = f"delta:{root}"
    collectors = []
    for _ in range(args.collectors):
        proc = subprocess.Popen(
            [args.bin, "collector", "--listen", "127.0.0.1:0", "--out", out, "--max-file-age", age]
            + ["--http", "127.0.0.1:0"],
            stdout=subprocess.PIPE,
            env=env,
            text=True,
        )
        grpc = re.search(r"127\.0\.0\.1:\d+", proc.stdout.readline() or "")
        http = re.search(r"http://(127\.0\.0\.1:\d+)", proc.stdout.readline() or "")
        if not grpc or not http:
            sys.exit("a collector did not print its addresses")
        collectors.append((proc, grpc.group(0), http.group(1)))
    con = reader(port)
    loadgen = subprocess.Popen(
        [args.bin, "loadgen", "--run-id", "visible", "--collector", ",".join(c[1] for c in collectors)]
        + ["--ranks", str(args.ranks), "--steps", str(args.steps)]
        + ["--step-interval", args.step_interval, "--layers", "2", "--finish-timeout", "120s"],
        stdout=subprocess.DEVNULL,
        env={**env, "RANKSCOPE_SPILL_DIR": os.path.join(tmp, f"spill-{store}-{age}")},
    )
    seen = {}
    latencies = []
    polls = []
    table = f"{root}/steps"
    done_at = None
    while True:
        start = time.time()
        floor = min(seen.values(), default=-1) if len(seen) == args.ranks else -1
        try:
            rows = con.execute(
                f"select rank, step, epoch_us(time) from delta_scan('{table}') where step > {floor}"
            ).fetchall()
        except Exception as e:  # the table has no data file yet
            if "No files" not in str(e) and "does not exist" not in str(e) and "not found" not in str(e):
                print(f"  poll failed: {str(e).splitlines()[0]}", file=sys.stderr)
            rows = []
        now = time.time()
        polls.append(now - start)
        fresh = [(r, s, t) for r, s, t in rows if s > seen.get(r, -1)]
        for rank, step, recorded_us in fresh:
            latencies.append(now - recorded_us / 1e6)
        for rank, step, _ in fresh:
            seen[rank] = max(seen.get(rank, -1), step)
        if all(seen.get(r, -1) >= args.steps - 1 for r in range(args.ranks)):
            break
        if loadgen.poll() is not None and done_at is None:
            done_at = time.time()
        if done_at is not None and time.time() - done_at > 60:
            print("  not every step became visible within 60 s of the end", file=sys.stderr)
            break
        time.sleep(max(0.0, args.poll_ms / 1000 - (time.time() - start)))
    loadgen.wait()
    commits = quantiles([commit_buckets(http) for _, _, http in collectors])
    cpu = 0.0
    for proc, _, _ in collectors:
        proc.terminate()
        _, _, usage = os.wait4(proc.pid, 0)
        cpu += usage.ru_utime + usage.ru_stime
    if s3:
        s3.terminate()
        s3.wait()
    return latencies, polls, cpu, commits


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--bin", default=os.path.join(ROOT, "target", "release", "rankscope"))
    p.add_argument("--store", default="local,s3", help="comma-separated: local (delta:DIR), s3 (moto)")
    p.add_argument("--ages", default="1s,10s", help="comma-separated --max-file-age values")
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--collectors", type=int, default=1, help="sharded collectors on one table (rank r to the r %% N-th)")
    p.add_argument("--steps", type=int, default=1500)
    p.add_argument("--step-interval", default="20ms")
    p.add_argument("--poll-ms", type=float, default=200.0)
    args = p.parse_args()
    rows = args.ranks * args.steps * 3  # a steps row and 2 layers rows per step
    print(f"{args.collectors} collector(s), {args.ranks} ranks, {args.steps} steps at {args.step_interval}, 2 layers: {rows:,} steps + layers rows")
    print("| store | --max-file-age | steps seen | visible p50 s | p95 s | max s | poll p50 s "
          "| collectors' CPU s | rows / CPU s | commits | commit p50 ≤ s | p99 ≤ s |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        for store in args.store.split(","):
            for age in args.ages.split(","):
                latencies, polls, cpu, (commits, p50, p99) = measure(args, store, age, tmp)
                latencies.sort() if latencies else latencies.append(float("nan"))
                q = lambda f: latencies[min(len(latencies) - 1, int(f * len(latencies)))]
                print(
                    f"| {store} | {age} | {len(latencies)} | {statistics.median(latencies):.2f} | "
                    f"{q(0.95):.2f} | {latencies[-1]:.2f} | {statistics.median(polls):.3f} | "
                    f"{cpu:.2f} | {rows / cpu:,.0f} | {commits} | {p50} | {p99} |",
                    flush=True,
                )


if __name__ == "__main__":
    main()
