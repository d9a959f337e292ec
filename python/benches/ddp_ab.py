"""The Python agent's overhead, measured side by side in one run (``make bench``).

1. An A/B of ``examples/ddp_train.py`` with 2 DDP ranks under the real torchrun,
   in interleaved rounds with a rotating order: off, off again (the noise floor),
   sampling every 10 steps, and every step. Each run reports the training loop's
   wall time after a warm-up; the figure is the median over rounds of the step
   time, relative to the first "off".
2. The Python-side cost of a step that is not sampled (step, four phases,
   record), for models with few and many watched modules, against the same loop
   without the agent.
3. ``overhead_ms`` against what a sampled step costs the training thread, before
   and after the agent counted its Python side and reused its sample buffers
   (``accounting.py``).
4. The first sample of a run against later ones, and the samples a 60-step and a
   1,000-step run get from the default budget (``first_sample.py``).

``--against DIR`` adds another build of the package to the A/B, side by side in the
same rounds: its sampling arms run with ``DIR`` first on ``PYTHONPATH``. Install it
there with ``pip install --no-deps --target DIR rankscope-*.whl`` (an older release,
say, to compare a change before and after).

Every rank gets one intra-op thread, so with 2 ranks on a 2-core machine every
core is given to training. The collector runs out of process.
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
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import accounting  # noqa: E402  (beside this file)
import first_sample  # noqa: E402  (beside this file)

EXAMPLE = HERE.parent / "rankscope" / "examples" / "ddp_train.py"

RETRIES: list[int] = []

CONFIGS = [
    ("off", {"RANKSCOPE_MODE": "off"}),
    ("off again (noise floor)", {"RANKSCOPE_MODE": "off"}),
    ("every 10 steps", {"RANKSCOPE_SAMPLE_EVERY": "10"}),
    ("every step", {"RANKSCOPE_SAMPLE_EVERY": "1"}),
]


def start_collector(out: Path) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "rankscope", "collector", "--listen", "127.0.0.1:0", "--out", str(out)],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "RANKSCOPE_LOG": "warn"},
    )
    line = proc.stdout.readline()
    addr = next(w for w in line.split() if w.startswith("127.0.0.1:")).rstrip(",")
    return proc, addr


def one_run(args, nproc: int, env_extra: dict, collector: str, result: Path) -> dict:
    env = {
        **os.environ,
        "RANKSCOPE_COLLECTOR": collector,
        "RANKSCOPE_LOG": "error",
        "OMP_NUM_THREADS": "1",
        **env_extra,
    }
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone",
        "--nproc-per-node", str(nproc), str(EXAMPLE),
        "--steps", str(args.steps), "--result", str(result),
    ]
    for attempt in (1, 2):
        done = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if done.returncode == 0:
            return json.loads(result.read_text())
        # Say what failed, and try once more: a benchmark round is not a test.
        tail = "\n".join(done.stderr.splitlines()[-15:])
        print(f"run failed (exit {done.returncode}, attempt {attempt}):\n{tail}", file=sys.stderr)
        RETRIES.append(done.returncode)
    raise SystemExit(f"torchrun failed twice: {' '.join(cmd)}")


def configs(against: str | None) -> list[tuple[str, dict]]:
    """The arms of the A/B: `CONFIGS`, and with `against` its sampling arms again
    with the package installed in that folder."""
    if not against:
        return CONFIGS
    path = os.pathsep.join(p for p in (against, os.environ.get("PYTHONPATH")) if p)
    return CONFIGS + [
        (f"{name} ({Path(against).name})", {**env, "PYTHONPATH": path})
        for name, env in CONFIGS
        if env.get("RANKSCOPE_MODE") != "off"
    ]


def ab(args, nproc: int, addr: str, tmp: Path) -> list[str]:
    lines = [""]
    arms = configs(args.against)
    times: dict[str, list[float]] = {name: [] for name, _ in arms}
    for round_ in range(args.rounds):
        order = arms[round_ % len(arms):] + arms[: round_ % len(arms)]
        for name, env in order:
            r = one_run(args, nproc, env, addr, tmp / "result.json")
            times[name].append(r["loop_s"] / r["steps_timed"] * 1e3)
        print(f"{nproc} rank(s): round {round_ + 1}/{args.rounds} done", file=sys.stderr, flush=True)
    base = statistics.median(times["off"])
    lines.append(
        f"DDP example, {nproc} rank(s) on {os.cpu_count()} cores ({max(os.cpu_count() - nproc, 0)} "
        f"left for the agent and collector; gloo, 1 intra-op thread per rank), {args.steps} steps "
        f"per run, {args.rounds} interleaved rounds; median over rounds of the step time"
    )
    lines.append("")
    lines.append("| configuration | median step ms | vs off |")
    lines.append("|---|---|---|")
    for name, _ in arms:
        m = statistics.median(times[name])
        lines.append(f"| {name} | {m:.3f} | {100 * (m / base - 1):+.2f} % |")
    if RETRIES:
        lines.append(f"\n(runs that failed and were run again so far: {len(RETRIES)}, exit codes {RETRIES})")
    return lines


def unsampled_step_cost(args, addr: str) -> list[str]:
    import torch
    from torch import nn

    import rankscope

    n = args.micro_steps

    def bare() -> float:
        t = time.perf_counter()
        for i in range(n):
            pass
        return (time.perf_counter() - t) / n

    def with_agent(agent) -> float:
        loss = torch.tensor(1.0)
        t = time.perf_counter()
        for i in range(1, n + 1):
            with agent.step(i) as s:
                with s.phase("data"):
                    pass
                with s.phase("forward"):
                    pass
                with s.phase("backward"):
                    pass
                with s.phase("optimizer"):
                    pass
                s.record(loss=loss, lr=0.1, samples=32)
        return (time.perf_counter() - t) / n

    lines = ["", "Python-side cost of a step that is not sampled (step, 4 phases, record):", ""]
    lines.append("| watched modules | µs per step, agent | µs per step, bare loop | agent − bare |")
    lines.append("|---|---|---|---|")
    for modules in (4, 1000):
        model = nn.Sequential(*[nn.Linear(4, 4) for _ in range(modules)])
        agent = rankscope.init(collector=addr, run_id=f"bench-{modules}", sample_every=10**9)
        agent.watch(model)
        with_agent(agent)  # warm-up
        a = min(with_agent(agent) for _ in range(5)) * 1e6
        b = min(bare() for _ in range(5)) * 1e6
        lines.append(f"| {modules} | {a:.2f} | {b:.3f} | {a - b:.2f} |")
        agent.finish()
    lines.append("")
    lines.append(
        "(no step in the timed loops is sampled; each step queues its row for the "
        "transport thread, which is part of the cost)"
    )
    return lines


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument(
        "--nproc",
        default="2,1",
        help="comma-separated rank counts, one A/B each (default: 2 = every core of a 2-core "
        "machine to training, then 1 = a core to spare)",
    )
    p.add_argument(
        "--against",
        metavar="DIR",
        help="another build of the package (pip install --no-deps --target DIR): its sampling "
        "arms run in the same rounds, with DIR first on PYTHONPATH",
    )
    p.add_argument("--micro-steps", type=int, default=20000)
    p.add_argument("--accounting-rounds", type=int, default=4)
    p.add_argument("--accounting-steps", type=int, default=2000)
    p.add_argument("--first-sample-rounds", type=int, default=3)
    p.add_argument(
        "--parts",
        default="ab,unsampled,accounting,first",
        help="which parts to run, comma-separated (default: all four)",
    )
    args = p.parse_args()
    if args.against and not (Path(args.against) / "rankscope" / "__init__.py").is_file():
        p.error(f"--against {args.against}: no rankscope package there; install one with "
                f"pip install --no-deps --target {args.against} rankscope-*.whl")
    parts = set(args.parts.split(","))
    with tempfile.TemporaryDirectory() as tmp:
        proc, addr = start_collector(Path(tmp) / "out")

        def stop_collector() -> None:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                proc.wait(timeout=60)

        try:
            lines = []
            if "ab" in parts:
                for nproc in (int(n) for n in args.nproc.split(",")):
                    lines += ab(args, nproc, addr, Path(tmp))
            if "unsampled" in parts:
                lines += unsampled_step_cost(args, addr)
            # These two read the tables once the collector has stopped and committed
            # them, so each has a collector of its own (`stop_collector` stops the
            # one started last).
            if "accounting" in parts:
                lines += accounting.run(
                    addr, Path(tmp) / "out", Path(tmp), args.accounting_rounds, args.accounting_steps, stop_collector
                )
            if "first" in parts:
                stop_collector()
                proc, addr = start_collector(Path(tmp) / "out-first")
                lines += first_sample.run(addr, Path(tmp) / "out-first", args.first_sample_rounds, stop_collector)
        finally:
            stop_collector()
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
