"""What the first activation sample of a run costs against a later one, and what a
short run gets from the overhead budget (``make bench`` runs it from ``ddp_ab.py``;
BENCHMARKS.md, "Agent overhead (Rust)", short runs).

The metrics thread warms up at ``init`` (it prepares and measures a small synthetic
sample, so libtorch's one-time set-up is paid then, off the training thread), and that
time is left out of the budget. This benchmark checks the result from the product's own
tables: each run is a fresh process (one-time set-up is per process) training the MLP
of ``rankscope train --model mlp`` (5 → 64 → 64 → 64 → 1 with SiLU, 8,769 parameters,
batch 64, AdamW, its four linear layers watched) with one intra-op thread,
``sample_every=10`` and the default budget (2 %), for 60 and for 1,000 steps. Per run:

- the first sampled step's ``overhead_ms`` and its layers' ``compute_ms`` (summed), against
  the median of the later sampled steps;
- the planned and the sampled steps, and the agent's CPU share (the ``overhead_share``
  event), which the budget holds to 2 %;
- what the budget buys: 2 % of the process's CPU time over the cost of one sampled step
  (its training-thread and metrics-thread time, the later steps' median);
- the agent's threads' set-up at ``init`` (as the ``overhead_share`` event names it: the
  metrics thread's warm-up, the transport thread's start and first connection), which
  the budget leaves out: one-time costs that the first sample, or the budget of a short
  run, paid before.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
from pathlib import Path

from accounting import _duckdb  # beside this file

SAMPLE_EVERY = 10
LENGTHS = (60, 1000)


def one_run(args: argparse.Namespace) -> None:
    """In a process of its own: one run of the block."""
    import torch

    torch.set_num_threads(1)
    from collections import OrderedDict

    import rankscope

    torch.manual_seed(0)
    layers = [("fc1", torch.nn.Linear(5, 64)), ("act1", torch.nn.SiLU()), ("fc2", torch.nn.Linear(64, 64))]
    layers += [("act2", torch.nn.SiLU()), ("fc3", torch.nn.Linear(64, 64)), ("act3", torch.nn.SiLU())]
    model = torch.nn.Sequential(OrderedDict([*layers, ("head", torch.nn.Linear(64, 1))]))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x, y = torch.randn(64, 5), torch.randn(64, 1)
    agent = rankscope.init(
        collector=args.collector, run_id=args.run_id, sample_every=SAMPLE_EVERY, workload="mlp-first-sample"
    )
    agent.watch(model)
    for i in range(args.steps):
        with agent.step(i) as s:
            loss = (model(x) - y).square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            s.record(loss=loss.detach())
    agent.finish()


def run(collector: str, out: Path, rounds: int, stop_collector) -> list[str]:  # type: ignore[no-untyped-def]
    """Runs the rounds (interleaving the two lengths), then, once ``stop_collector()``
    has committed every row, reads the tables and returns the report's lines."""
    runs = []
    for r in range(rounds):
        for steps in LENGTHS if r % 2 == 0 else LENGTHS[::-1]:
            run_id = f"first-sample-{steps}-{r}"
            cmd = [
                sys.executable, str(Path(__file__).resolve()), "--collector", collector,
                "--run-id", run_id, "--steps", str(steps),
            ]
            subprocess.run(cmd, check=True, env={**os.environ, "RANKSCOPE_LOG": "error", "OMP_NUM_THREADS": "1"})
            runs.append((steps, run_id))
        print(f"first sample: round {r + 1}/{rounds} done", file=sys.stderr, flush=True)
    stop_collector()
    table = f"read_parquet('{out}/%s/*/*.parquet', hive_partitioning=true, union_by_name=true)"
    overhead = {
        (run_id, int(step)): float(ms)
        for run_id, step, ms in _duckdb(
            f"select run_id, step, overhead_ms from {table % 'steps'} where run_id like 'first-sample-%'"
        )
    }
    compute = {
        (run_id, int(step)): float(ms)
        for run_id, step, ms in _duckdb(
            f"select run_id, step, sum(compute_ms) from {table % 'layers'} "
            "where run_id like 'first-sample-%' group by all"
        )
    }
    share, set_up, threads = {}, {}, {}
    for run_id, value, set_up_ms, training, metrics, transport, process in _duckdb(
        f"select run_id, value, regexp_extract(message, 'set-up at init \\(([0-9.]+) ms', 1), "
        "unnest(regexp_extract(message, 'training thread ([0-9.]+), metrics thread ([0-9.]+), "
        "transport thread ([0-9.]+), device-side thread [0-9.]+\\) of the process.s ([0-9.]+) ms', "
        "['t', 'm', 'x', 'p'])) "
        f"from {table % 'events'} where run_id like 'first-sample-%' and kind = 'overhead_share'"
    ):
        share[run_id] = int(value) / 1e4
        set_up[run_id] = set_up_ms
        threads[run_id] = f"{training} / {metrics} / {transport} of {process} ms"

    process_ms = {
        run_id: float(ms)
        for run_id, ms in _duckdb(
            f"select run_id, sum(step_ms) from {table % 'steps'} where run_id like 'first-sample-%' group by all"
        )
    }

    lines = [
        "",
        f"The first sample of a run: the MLP of `rankscope train --model mlp` (batch 64, AdamW), 1 intra-op "
        f"thread, sample_every={SAMPLE_EVERY}, the default budget (2 %), a fresh process per run, {rounds} "
        f"rounds of each length; {os.cpu_count()} cores",
        "",
        "| steps | run | sampled / planned steps | first sampled step: overhead_ms, compute_ms | later sampled steps (median): overhead_ms, compute_ms | first / later | agent CPU share | steps the budget buys | set-up at init | agent CPU: training / metrics / transport thread, of the process's |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for steps, run_id in sorted(runs):
        sampled = sorted(s for (r, s) in compute if r == run_id)
        planned = len(range(0, steps, SAMPLE_EVERY))
        if not sampled:
            lines.append(
                f"| {steps} | {run_id} | 0 / {planned} | | | | {share.get(run_id, float('nan')):.2f} % | "
                f"| {set_up.get(run_id, '')} ms | {threads.get(run_id, '')} |"
            )
            continue
        first = (overhead[(run_id, sampled[0])], compute[(run_id, sampled[0])])
        later = [(overhead[(run_id, s)], compute[(run_id, s)]) for s in sampled[1:]]
        if later:
            med = (statistics.median(v[0] for v in later), statistics.median(v[1] for v in later))
            ratio = f"{(first[0] + first[1]) / (med[0] + med[1]):.2f}"
            buys = f"{0.02 * process_ms[run_id] / (med[0] + med[1]):.1f}"
            later_cell = f"{med[0]:.3f}, {med[1]:.3f}"
        else:
            ratio, buys, later_cell = "", f"{0.02 * process_ms[run_id] / (first[0] + first[1]):.1f}", ""
        lines.append(
            f"| {steps} | {run_id} | {len(sampled)} / {planned} | {first[0]:.3f}, {first[1]:.3f} | {later_cell} "
            f"| {ratio} | {share.get(run_id, float('nan')):.2f} % | {buys} | {set_up.get(run_id, '')} ms "
            f"| {threads.get(run_id, '')} |"
        )
    lines.append(
        "\n(steps the budget buys: 2 % of the run's summed step_ms over a sampled step's cost, its overhead_ms "
        "plus its layers' compute_ms, the later steps' median)"
    )
    return lines


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--collector", required=True)
    p.add_argument("--run-id", required=True)
    p.add_argument("--steps", type=int, default=60)
    one_run(p.parse_args())
    return 0


if __name__ == "__main__":
    sys.exit(main())
