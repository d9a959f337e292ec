"""The cost of timing collectives (the ``comm`` table), measured side by side in one
run (``make bench``).

1. An A/B of ``examples/fsdp_train.py`` with 2 FSDP2 ranks under the real
   torchrun, in interleaved rounds with a rotating order: the agent without
   collective timing (``--no-collectives``), the same again (the noise floor), and
   with it. Each run reports the training loop's wall time after a warm-up; the
   figure is the median over rounds of the step time, relative to the first.
2. The wrapper's cost per collective: a blocking ``all_reduce`` of a small tensor
   in a one-rank gloo group, with and without the agent timing it, and that cost
   times the collectives of one FSDP step as a share of the step.

Every rank gets one intra-op thread. The collector runs out of process.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from ddp_ab import start_collector  # noqa: E402  (beside this file)

EXAMPLE = HERE.parent / "rankscope" / "examples" / "fsdp_train.py"

CONFIGS = [
    ("agent, collectives not timed", ["--no-collectives"]),
    ("the same again (noise floor)", ["--no-collectives"]),
    ("agent, collectives timed", []),
]

PER_CALL = textwrap.dedent(
    """
    import json, os, sys, tempfile, time, torch, torch.distributed as dist, rankscope
    store = tempfile.mktemp(prefix="rankscope-bench-store-")
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    agent = rankscope.init(collector=sys.argv[1], run_id="bench-collectives")
    t = torch.ones(16)
    n = int(sys.argv[2])

    def loop():
        start = time.perf_counter()
        for _ in range(n):
            dist.all_reduce(t)
        return (time.perf_counter() - start) / n

    out = {}
    for on in (False, True, False, True):
        agent.time_collectives(on)
        loop()
        out.setdefault(on, []).append(min(loop() for _ in range(5)))
    agent.finish()
    print(json.dumps({"off": min(out[False]) * 1e6, "on": min(out[True]) * 1e6}))
    """
)


def one_run(args, extra: list, collector: str, result: Path) -> dict:
    env = {
        **os.environ,
        "RANKSCOPE_COLLECTOR": collector,
        "RANKSCOPE_LOG": "error",
        "RANKSCOPE_SAMPLE_EVERY": "10",
        "OMP_NUM_THREADS": "1",
    }
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone",
        "--nproc-per-node", str(args.nproc), str(EXAMPLE),
        "--steps", str(args.steps), "--result", str(result), *extra,
    ]
    for attempt in (1, 2):
        done = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if done.returncode == 0:
            return json.loads(result.read_text())
        tail = "\n".join(done.stderr.splitlines()[-15:])
        print(f"run failed (exit {done.returncode}, attempt {attempt}):\n{tail}", file=sys.stderr)
    raise SystemExit(f"torchrun failed twice: {' '.join(cmd)}")


def ab(args, addr: str, tmp: Path) -> tuple[list[str], float]:
    times: dict[str, list[float]] = {name: [] for name, _ in CONFIGS}
    for round_ in range(args.rounds):
        order = CONFIGS[round_ % len(CONFIGS):] + CONFIGS[: round_ % len(CONFIGS)]
        for name, extra in order:
            r = one_run(args, extra, addr, tmp / "result.json")
            times[name].append(r["loop_s"] / r["steps_timed"] * 1e3)
        print(f"fsdp: round {round_ + 1}/{args.rounds} done", file=sys.stderr, flush=True)
    base = statistics.median(times[CONFIGS[0][0]])
    lines = [
        "",
        f"FSDP2 example, {args.nproc} ranks on {os.cpu_count()} cores (gloo, 1 intra-op thread per "
        f"rank), {args.steps} steps per run, {args.rounds} interleaved rounds; median over rounds "
        "of the step time",
        "",
        "| configuration | median step ms | vs not timed |",
        "|---|---|---|",
    ]
    for name, _ in CONFIGS:
        m = statistics.median(times[name])
        lines.append(f"| {name} | {m:.3f} | {100 * (m / base - 1):+.2f} % |")
    return lines, base


def per_call(args, addr: str, step_ms: float) -> list[str]:
    done = subprocess.run(
        [sys.executable, "-c", PER_CALL, addr, str(args.calls)],
        capture_output=True,
        text=True,
        env={**os.environ, "RANKSCOPE_LOG": "error", "OMP_NUM_THREADS": "1"},
        check=True,
    )
    r = json.loads(done.stdout.strip().splitlines()[-1])
    cost = r["on"] - r["off"]
    # One FSDP step of the example: each of its 3 groups all-gathered twice and
    # reduce-scattered once.
    per_step = 9
    share = f"{100 * cost * per_step / (step_ms * 1e3):.3f} %" if step_ms > 0 else "-"
    return [
        "",
        "The wrapper's cost per collective (a blocking all_reduce of 16 floats, one gloo rank):",
        "",
        "| µs per call, not timed | µs per call, timed | cost per collective | × 9 collectives of one step, share of the step |",
        "|---|---|---|---|",
        f"| {r['off']:.2f} | {r['on']:.2f} | {cost:.2f} µs | {share} |",
    ]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--calls", type=int, default=20000)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        proc, addr = start_collector(Path(tmp) / "out")
        try:
            lines, step_ms = ab(args, addr, Path(tmp))
            lines += per_call(args, addr, step_ms)
        finally:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                proc.wait(timeout=60)
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
