"""`overhead_ms` against what a sampled step costs the training thread, before and
after the agent counted its Python side and reused its sample buffers, side by side
in one run (``make bench`` runs it from ``ddp_ab.py``; BENCHMARKS.md, "`overhead_ms`
told truly").

The workload is the pre-norm block of the DDP example (d = 64, 4 heads, sequence 16,
batch 64, AdamW) in one process with one intra-op thread, ``sample_every=10`` and
``overhead_budget="100%"``. Each round is a process of its own, "before" and "after"
alternating, with a rotating order; all stream to one collector, and the figures
come from the product's own ``steps`` table (and ``layers``, for which steps were
sampled), from step 100 on:

- the sampled step's extra time: median ``step_ms`` of sampled steps minus that of
  the others;
- what the agent recorded of it: the same difference of ``overhead_ms``;
- the extra training-thread CPU time of a sampled step (``time.thread_time_ns``
  around each step), which other processes on a loaded machine do not inflate, as
  they do wall time;
- the share recorded, and where the extra time goes: each part of the step (begin,
  forward, backward, optimizer, exit) timed around the calls, in wall time, in the
  training thread's CPU time, and in its page faults.

"before" is the mechanism as it was: a Python closure per watched module, registered
with ``register_forward_hook`` at each sampled step and removed at its end, calling
``observe``, with none of that time handed to the agent, and each sample copied into a
new allocation. "after" is the package as it is (``agent.watch``).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

CONFIGS = ("before", "after")
SEGMENTS = ("begin", "forward", "backward", "optimizer", "exit")
WARMUP = 100
SAMPLE_EVERY = 10


class _BeforeStep:
    """A sampled step of the "before" mechanism: its hooks come out on exit, before
    the step's own exit (as the old ``set_on_exit`` callback did)."""

    __slots__ = ("s", "handles")

    def __init__(self, s, handles) -> None:  # type: ignore[no-untyped-def]
        self.s = s
        self.handles = handles

    def __enter__(self):  # type: ignore[no-untyped-def]
        return self.s

    def __exit__(self, *exc):  # type: ignore[no-untyped-def]
        for h in self.handles:
            h.remove()
        return self.s.__exit__(*exc)


def _before_step(native, layers, tensor):  # type: ignore[no-untyped-def]
    """``agent.step`` as it was: closures installed for sampled steps only."""

    def hook_of(name, kind):  # type: ignore[no-untyped-def]
        def hook(module, inputs, output):  # type: ignore[no-untyped-def]
            t = output if isinstance(output, tensor) else _first_tensor(output, tensor)
            if t is not None:
                native.observe(name, t, kind)

        return hook

    def step(i):  # type: ignore[no-untyped-def]
        s = native.step(i)
        if not s.sampled:
            return s
        return _BeforeStep(s, [m.register_forward_hook(hook_of(n, k)) for n, m, k in layers])

    return step


def _first_tensor(output, tensor):  # type: ignore[no-untyped-def]
    if isinstance(output, (tuple, list)):
        for item in output:
            if isinstance(item, tensor):
                return item
    return None


def one_round(args: argparse.Namespace) -> None:
    """In a process of its own: one run of the block, its step parts written as JSON."""
    import torch

    torch.set_num_threads(1)
    import rankscope
    from rankscope._agent import _layers
    from rankscope.examples.ddp_train import Block

    torch.manual_seed(0)
    model = Block(64, 4)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randn(64, 16, 64)
    agent = rankscope.init(
        collector=args.collector,
        run_id=args.run_id,
        sample_every=SAMPLE_EVERY,
        overhead_budget="100%",
        workload="block-accounting",
    )
    if args.round == "before":
        agent._native._reuse_sample_buffers(False)
        step = _before_step(agent._native, _layers(model), torch.Tensor)
    else:
        agent.watch(model)
        step = agent.step
    wall, cpu = time.perf_counter_ns, time.thread_time_ns

    def faults() -> int:
        return resource.getrusage(resource.RUSAGE_THREAD).ru_minflt

    parts = []
    for i in range(args.steps):
        marks = [(wall(), cpu(), faults())]
        s = step(i)
        marks.append((wall(), cpu(), faults()))
        with s as st:
            loss = model(x).square().mean()
            marks.append((wall(), cpu(), faults()))
            loss.backward()
            marks.append((wall(), cpu(), faults()))
            opt.step()
            opt.zero_grad(set_to_none=True)
            marks.append((wall(), cpu(), faults()))
            st.record(loss=loss.detach())
        marks.append((wall(), cpu(), faults()))
        parts.append([[b[k] - a[k] for k in range(3)] for a, b in zip(marks, marks[1:])])
    agent.finish()
    Path(args.result).write_text(json.dumps(parts))


def _duckdb(sql: str) -> list[list[str]]:
    duckdb = shutil.which("duckdb") or str(Path(sys.executable).parent / "duckdb")
    out = subprocess.run([duckdb, "-csv", "-noheader", "-c", sql], check=True, capture_output=True, text=True)
    return [line.split(",") for line in out.stdout.split()]


def _median_diff(values: dict, sampled: set, index=lambda v: v) -> float:  # type: ignore[no-untyped-def]
    on = [index(v) for s, v in values.items() if s >= WARMUP and s in sampled]
    off = [index(v) for s, v in values.items() if s >= WARMUP and s not in sampled]
    return statistics.median(on) - statistics.median(off)


def run(collector: str, out: Path, tmp: Path, rounds: int, steps: int, stop_collector) -> list[str]:  # type: ignore[no-untyped-def]
    """Runs the rounds, then (after ``stop_collector()`` has committed every row) reads
    the tables and returns the report's lines."""
    segments: dict[tuple[str, int], list] = {}
    for r in range(rounds):
        order = CONFIGS if r % 2 == 0 else CONFIGS[::-1]
        for config in order:
            result = tmp / f"accounting-{config}-{r}.json"
            cmd = [
                sys.executable, str(Path(__file__).resolve()), "--round", config,
                "--collector", collector, "--run-id", f"accounting-{config}-{r}",
                "--steps", str(steps), "--result", str(result),
            ]
            subprocess.run(cmd, check=True, env={**os.environ, "RANKSCOPE_LOG": "error", "OMP_NUM_THREADS": "1"})
            segments[(config, r)] = json.loads(result.read_text())
        print(f"accounting: round {r + 1}/{rounds} done", file=sys.stderr, flush=True)
    stop_collector()
    table = f"read_parquet('{out}/%s/*/*.parquet', hive_partitioning=true, union_by_name=true)"
    rows: dict[str, dict[int, tuple[float, float]]] = {}
    for run_id, step, step_ms, overhead_ms in _duckdb(
        f"select run_id, step, step_ms, overhead_ms from {table % 'steps'} where run_id like 'accounting-%'"
    ):
        rows.setdefault(run_id, {})[int(step)] = (float(step_ms), float(overhead_ms))
    sampled: dict[str, set] = {}
    for run_id, step in _duckdb(f"select distinct run_id, step from {table % 'layers'} where run_id like 'accounting-%'"):
        sampled.setdefault(run_id, set()).add(int(step))

    figures: dict[str, dict[str, list[float]]] = {c: {} for c in CONFIGS}
    for (config, r), parts in segments.items():
        run_id = f"accounting-{config}-{r}"
        steps_rows, on = rows[run_id], sampled.get(run_id, set())
        f = figures[config]
        f.setdefault("step", []).append(_median_diff(steps_rows, on, lambda v: v[0]))
        f.setdefault("overhead", []).append(_median_diff(steps_rows, on, lambda v: v[1]))
        f.setdefault("sampled", []).append(len([s for s in on if s >= WARMUP]))
        by_step = dict(enumerate(parts))
        for k, name in enumerate(SEGMENTS):
            for m, measure in enumerate(("wall", "cpu", "faults")):
                scale = 1.0 if measure == "faults" else 1e-3
                f.setdefault(f"{name} {measure}", []).append(
                    _median_diff(by_step, on, lambda v, k=k, m=m: v[k][m]) * scale
                )
        for m, measure in enumerate(("wall", "cpu", "faults")):
            scale = 1.0 if measure == "faults" else 1e-3
            f.setdefault(f"total {measure}", []).append(
                _median_diff(by_step, on, lambda v, m=m: sum(p[m] for p in v)) * scale
            )

    def med(config: str, key: str) -> float:
        return statistics.median(figures[config][key])

    lines = [
        "",
        f"overhead_ms against the sampled step's extra time: the pre-norm block (d = 64, sequence 16, "
        f"batch 64, AdamW), 1 intra-op thread, sample_every={SAMPLE_EVERY}, overhead_budget=100%, "
        f"{steps} steps per run, {rounds} rounds of each configuration in alternating order, "
        f"{os.cpu_count()} cores; medians from step {WARMUP} on, sampled steps against the others, "
        "then the median over rounds",
        "",
        "| configuration | sampled steps per run | extra step_ms of a sampled step | extra training-thread CPU | extra overhead_ms | recorded share of step_ms / of CPU |",
        "|---|---|---|---|---|---|",
    ]
    for c in CONFIGS:
        step, over, cpu = med(c, "step"), med(c, "overhead"), med(c, "total cpu") / 1e3
        lines.append(
            f"| {c} | {med(c, 'sampled'):.0f} | {step:.3f} ms | {cpu:.3f} ms | {over:.3f} ms "
            f"| {100 * over / step:.0f} % / {100 * over / cpu:.0f} % |"
        )
    lines.append(
        f"\nafter / before: the sampled step's extra time x{med('after', 'step') / med('before', 'step'):.2f}, "
        f"the recorded share x{(med('after', 'overhead') / med('after', 'step')) / (med('before', 'overhead') / med('before', 'step')):.2f}"
    )
    lines += [
        "",
        "Where the extra time of a sampled step goes (sampled minus unsampled, medians; wall µs / "
        "training-thread CPU µs / page faults):",
        "",
        "| part of the step | before | after |",
        "|---|---|---|",
    ]
    labels = {
        "begin": "begin (`agent.step`: budget, hooks in)",
        "forward": "forward (hooks, samples taken)",
        "backward": "backward",
        "optimizer": "optimizer",
        "exit": "exit (`record`, hooks out, the row)",
        "total": "whole step",
    }
    for name in (*SEGMENTS, "total"):
        cells = [
            f"{med(c, f'{name} wall'):+.0f} / {med(c, f'{name} cpu'):+.0f} / {med(c, f'{name} faults'):+.0f}"
            for c in CONFIGS
        ]
        lines.append(f"| {labels[name]} | {cells[0]} | {cells[1]} |")
    return lines


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--round", choices=CONFIGS, required=True)
    p.add_argument("--collector", required=True)
    p.add_argument("--run-id", required=True)
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--result", required=True)
    one_round(p.parse_args())
    return 0


if __name__ == "__main__":
    sys.exit(main())
