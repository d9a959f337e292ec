"""The agent's cost on a GPU, as the user feels it: wall time per step of a GPT
(d 1024, 8 blocks, sequence 512, batch 16, bf16 autocast, fused AdamW; 52 watched
layers) in eight arms, each its own process, interleaved over rounds so drifts of the
machine hit every arm alike:

- ``none``: no agent;
- ``steps``: ``mode="steps"`` (timing, memory, no layer sampling);
- ``full@10``: every 10th step sampled, budget 100 % (every planned sample taken);
- ``full@10-inline``: the same with ``RANKSCOPE_DEVICE_THREAD=0``: the training thread,
  not the agent's thread, issues the device side's reductions;
- ``full@10-1thread``: ``full@10`` with one metrics thread (``RANKSCOPE_METRICS_THREADS=1``;
  a CUDA rank starts two by default);
- ``full@10-deepest``: ``full@10`` with every sketched batch's Krylov process run to the
  schedule's last depth, as before each layer's ran only as deep as its last sample
  needed (``agent/src/sampling/depths.rs``);
- ``full@1``: every step sampled, budget 100 %;
- ``default``: every 10th step at the default budget (2 %).

A step's time is wall time over a window of steps with one CUDA synchronize at each
end of the window (never inside it). It prints each arm's median step time, its
ratio to ``none``, and the share of planned samples that were measured (layers rows
over planned ones, from the agent's own counters), and what the agent recorded of
its own cost (``Agent.overhead()``: the device time of its side stream and the
observed slowdown of the sampled steps) against the slowdown measured here (the arm's
step time less ``none``'s, over the steps). ``full@1`` has no unsampled step to
compare with, so its observed slowdown reads 0 and its recorded cost is the device
time alone. Per arm it also prints where a sample's cost went: the device time and
the metrics thread's CPU time per sample, the planned samples skipped per share, and
the sketched batches by the depths of the sketch's schedule their Krylov process ran.

With ``--profile`` the ``none`` and ``full@10`` arms of the first round also run 20
steps under ``torch.profiler`` (``full@10`` once its metrics thread has caught up, so
that the window's planned steps are sampled) and count the synchronize calls (``cudaStreamSynchronize``,
``cudaEventSynchronize``, ``cudaDeviceSynchronize``) and blocking ``cudaMemcpy`` calls on
the training thread and off it: the agent adds none where ``full@10`` counts what
``none`` counts. ``--profile-out DIR`` writes each profiled arm's kernel table there.
``--max-rows N`` gives every agent arm that row cap (the agent's default is 4096).

    python python/benches/gpu_overhead.py [--rounds 3] [--steps 200] [--profile]

Needs one CUDA GPU; no collector (rows wait in the agent's spill, which is
removed). ``--smoke`` runs the same arms with a tiny GPT on the CPU, to check the
script itself where there is no GPU (``make test`` does); its figures mean nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

ARMS = {
    "none": None,
    "steps": {"mode": "steps"},
    "full@10": {"sample_every": 10, "overhead_budget": 1.0},
    "full@10-inline": {"sample_every": 10, "overhead_budget": 1.0, "env": {"RANKSCOPE_DEVICE_THREAD": "0"}},
    "full@10-1thread": {"sample_every": 10, "overhead_budget": 1.0, "env": {"RANKSCOPE_METRICS_THREADS": "1"}},
    "full@10-deepest": {"sample_every": 10, "overhead_budget": 1.0, "deepest": True},
    "full@1": {"sample_every": 1, "overhead_budget": 1.0},
    "default": {"sample_every": 10},
}


# The longest the profiled arm waits for its metrics thread to catch up before its window
# (the window then may hold no sampled step, and says how many samples it took).
DRAIN_S = 20
SYNCS = ("cudaStreamSynchronize", "cudaEventSynchronize", "cudaDeviceSynchronize", "cudaMemcpy")


def child(arm: str, steps: int, warmup: int, profile: bool, smoke: bool, max_rows: int, profile_out: str) -> dict:
    import torch
    import torch.nn.functional as F
    from torch import nn

    torch.manual_seed(0)
    if smoke:
        device = torch.device("cpu")
        d, blocks, heads, seq, batch, vocab = 64, 2, 4, 32, 4, 256

        def synchronize() -> None:
            pass
    else:
        device = torch.device("cuda", 0)
        torch.cuda.set_device(device)
        d, blocks, heads, seq, batch, vocab = 1024, 8, 16, 512, 16, 8192
        synchronize = torch.cuda.synchronize

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.ln1 = nn.LayerNorm(d)
            self.qkv = nn.Linear(d, 3 * d)
            self.proj = nn.Linear(d, d)
            self.ln2 = nn.LayerNorm(d)
            self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            b, t, _ = x.shape
            q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
            q, k, v = (z.view(b, t, heads, d // heads).transpose(1, 2) for z in (q, k, v))
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
            return x + self.mlp(self.ln2(x))

    class GPT(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(vocab, d)
            self.blocks = nn.Sequential(*[Block() for _ in range(blocks)])
            self.ln = nn.LayerNorm(d)
            self.head = nn.Linear(d, vocab)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(self.ln(self.blocks(self.embed(x))))

    model = GPT().to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=not smoke)
    data = torch.randint(0, vocab, (batch, seq + 1), device=device)
    agent = None
    # Sketched batches by the depths of the schedule their Krylov process ran.
    krylov_depths: dict = {}
    spill = tempfile.mkdtemp(prefix="rankscope-gpu-bench-")
    if ARMS[arm] is not None:
        import rankscope

        os.environ["RANKSCOPE_SPILL_DIR"] = spill
        options = dict(ARMS[arm], **({"max_rows": max_rows} if max_rows else {}))
        os.environ.update(options.pop("env", {}))
        from rankscope import _device

        if options.pop("deepest", False):
            # Every batch to the last depth, whatever its layers needed before.
            _device._batch_depths = lambda items: None
        chosen = _device._batch_depths

        def counted(items):
            depths = chosen(items)
            if items[0].sketch:
                key = str(depths or len(_device._native.SKETCH_SCHEDULE))
                krylov_depths[key] = krylov_depths.get(key, 0) + 1
            return depths

        _device._batch_depths = counted
        agent = rankscope.init(collector="127.0.0.1:9", run_id=f"gpu-{arm.replace('@', '-every-')}", **options)
        agent.watch(model)

    def one(i: int) -> None:
        x, y = data[:, :-1], data[:, 1:]
        ctx = agent.step(i) if agent is not None else None
        if ctx is not None:
            ctx.__enter__()
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if ctx is not None:
            ctx.record(loss=loss.detach())
            ctx.__exit__(None, None, None)

    for i in range(warmup):
        one(i)
    synchronize()
    windows = []
    window = 20
    i = warmup
    while i < warmup + steps:
        started = time.perf_counter()
        for _ in range(window):
            one(i)
            i += 1
        synchronize()
        windows.append((time.perf_counter() - started) * 1e3 / window)
    result = {"arm": arm, "step_ms": statistics.median(windows), "timed_steps": steps}
    if profile:
        from torch.profiler import ProfilerActivity, profile as torch_profile

        activities = [ProfilerActivity.CPU] + ([] if smoke else [ProfilerActivity.CUDA])
        if agent is not None:
            # The window starts at a planned step (i is a multiple of 10) once the
            # metrics thread has caught up, so that its steps are sampled.
            waited = time.perf_counter()
            while agent._native.queued_samples() and time.perf_counter() - waited < DRAIN_S:
                time.sleep(0.05)
            result["drain_s"] = round(time.perf_counter() - waited, 2)
            taken_before = agent.samples()[0]
        with torch_profile(activities=activities) as prof:
            for _ in range(20):
                one(i)
                i += 1
            synchronize()
        events = prof.events()
        syncs = [e for e in events if e.name in SYNCS]
        # The training thread: the one that ran the model's first operator.
        main = next(e.thread for e in events if e.name.startswith("aten::"))
        result["syncs_total"] = len(syncs)
        result["syncs_other_threads"] = sum(1 for e in syncs if e.thread != main)
        result["syncs_by_name"] = {n: sum(1 for e in syncs if e.name == n) for n in SYNCS}
        if agent is not None:
            result["profiled_samples"] = agent.samples()[0] - taken_before
        if profile_out:
            sort = "self_cpu_time_total" if smoke else "self_cuda_time_total"
            table = prof.key_averages().table(sort_by=sort, row_limit=30)
            with open(os.path.join(profile_out, f"profile-{arm.replace('@', '-every-')}.txt"), "w") as f:
                f.write(table)
    if agent is not None:
        # After finish: the samples its wait for the metrics thread measured count,
        # those it dropped do not.
        agent.finish()
        taken, dropped, skipped = agent.samples()
        overhead = agent.overhead() or {}
        result.update(
            device_ms=overhead.get("device_ms", 0.0),
            observed_ms=overhead.get("observed_ms", 0.0),
            steps_run=i,
            limits={k: overhead.get(k, 0) for k in ("skipped_cpu", "skipped_device", "skipped_observed", "skipped_queue_full")},
            device_samples=overhead.get("device_samples", 0),
            metrics_thread_ms=overhead.get("metrics_thread_ms", 0.0),
            training_thread_ms=overhead.get("training_thread_ms", 0.0),
            krylov_depths=krylov_depths,
        )
        planned_steps = len(range(0, i, ARMS[arm].get("sample_every", 10))) if arm != "steps" else 0
        layers = len(agent._watched)
        result.update(taken=taken, dropped=dropped, skipped=skipped, planned=planned_steps * layers)
    return result


def report(results: dict, rounds: int, final: bool) -> None:
    """Prints the table (after every round, so that a run cut short by a time limit
    still reports the rounds it finished), then the details."""
    arms = list(results)
    if not final:
        print(f"after round {rounds}:")
    base = statistics.median(x["step_ms"] for x in results["none"]) if "none" in results else None
    print(f"| arm | step ms (median of {rounds}) | vs none | planned samples measured | recorded (device + observed) / measured slowdown |")
    print("|---|---|---|---|---|")
    for arm in arms:
        ms = statistics.median(x["step_ms"] for x in results[arm])
        ratio = f"{ms / base:.3f}" if base else "-"
        last = results[arm][-1]
        share = (
            f"{(last['taken'] - last['dropped']) / last['planned']:.0%} ({last['taken'] - last['dropped']} of {last['planned']})"
            if last.get("planned")
            else "-"
        )
        recorded = "-"
        if base and "device_ms" in last and ms > base:
            # The agent's figures cover every step it ran (warm-up and profile
            # included); the measured slowdown is per timed step, scaled to those.
            measured = (ms - base) * last["steps_run"]
            mine = last["device_ms"] + last["observed_ms"]
            recorded = f"{mine / measured:.0%} ({last['device_ms']:.0f} + {last['observed_ms']:.0f} of {measured:.0f} ms)"
        print(f"| {arm} | {ms:.2f} | {ratio} | {share} | {recorded} |")
    for arm in arms:
        last = results[arm][-1]
        if last.get("device_samples") or last.get("taken"):
            per = max(last.get("device_samples", 0), 1)
            taken = max(last.get("taken", 0), 1)
            print(
                f"per sample ({arm}, last round): device {last['device_ms'] / per:.2f} ms over {last['device_samples']},"
                f" metrics thread {last['metrics_thread_ms'] / taken:.1f} ms CPU over {last['taken']};"
                f" training thread {last['training_thread_ms']:.0f} ms in {last['steps_run']} steps"
            )
        if any(last.get("limits", {}).values()):
            print(f"skipped by share ({arm}): {last['limits']}")
        if last.get("krylov_depths"):
            print(f"sketched batches by the depths of the schedule they ran ({arm}, last round): {last['krylov_depths']}")
    for arm in arms:
        for x in results[arm]:
            if "syncs_total" in x:
                print(
                    f"profiled window ({arm}): {x['syncs_total']} synchronize calls,"
                    f" {x['syncs_other_threads']} off the training thread; {x['syncs_by_name']}"
                    + (f"; {x['profiled_samples']} samples taken in it (after {x['drain_s']} s for the metrics thread to catch up)" if "profiled_samples" in x else "")
                )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--arms", default=",".join(ARMS))
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--profile-out", default="", help="write the profiled arms' kernel tables into this folder")
    parser.add_argument("--max-rows", type=int, default=0, help="the agent arms' row cap (default: the agent's)")
    parser.add_argument("--smoke", action="store_true", help="a tiny GPT on the CPU: checks the script, measures nothing")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.steps, args.warmup, args.profile, args.smoke, args.max_rows, args.profile_out)))
        return
    arms = args.arms.split(",")
    unknown = [a for a in arms if a not in ARMS]
    if unknown:
        parser.error(f"--arms: unknown arm(s) {', '.join(unknown)}; the arms are {', '.join(ARMS)}")
    results: dict = {arm: [] for arm in arms}
    failed: set = set()
    for r in range(args.rounds):
        for arm in arms:
            cmd = [sys.executable, __file__, "--child", arm, "--steps", str(args.steps), "--warmup", str(args.warmup)]
            if args.profile and arm in ("none", "full@10") and r == 0:
                cmd.append("--profile")
                if args.profile_out:
                    os.makedirs(args.profile_out, exist_ok=True)
                    cmd += ["--profile-out", args.profile_out]
            if args.max_rows:
                cmd += ["--max-rows", str(args.max_rows)]
            if args.smoke:
                cmd.append("--smoke")
            done = subprocess.run(cmd, capture_output=True, text=True)
            if done.returncode != 0:
                # One failing arm (an environment variable this torch rejects, say)
                # must not cost the others their figures on a machine lent briefly.
                tail = "\n".join(done.stderr.splitlines()[-20:])
                print(f"arm {arm} (round {r + 1}) failed with exit code {done.returncode}:\n{tail}", file=sys.stderr)
                failed.add(arm)
                continue
            results[arm].append(json.loads(done.stdout.strip().splitlines()[-1]))
            print(f"round {r + 1} {arm}: {results[arm][-1]}", file=sys.stderr)
        report({arm: runs for arm, runs in results.items() if runs}, r + 1, final=r + 1 == args.rounds)
    if failed:
        sys.exit(f"arms that failed: {', '.join(sorted(failed))}")


if __name__ == "__main__":
    main()
