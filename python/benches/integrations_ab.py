"""Each integration's per-step cost against the same framework without rankscope,
side by side in one run (``make bench``, BENCHMARKS.md "Integrations").

For the Hugging Face ``Trainer``, Lightning and an Accelerate loop, a tiny GPT-2
(``integrations_worker.py``) on 2 DDP ranks (gloo, one intra-op thread each) in
three configurations: bare, bare again (the noise floor: two identical
configurations differ by this much in the same run), and with rankscope (its
defaults: sampling every 10 steps, the 2 % overhead budget). The configurations
run in interleaved rounds with a rotating order, each in processes of its own;
each run times its optimizer steps at their end after a warm-up, and the figure
is the median over rounds of the median step time, as a ratio to bare.

    python python/benches/integrations_ab.py --rounds 5 --steps 60
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
WORKER = HERE / "integrations_worker.py"
FRAMEWORKS = ["transformers", "lightning", "accelerate"]
CONFIGS = [("bare", False), ("bare again (noise floor)", False), ("rankscope", True)]


def cpu_name() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.machine()


def start_collector(out: Path) -> tuple:
    proc = subprocess.Popen(
        [sys.executable, "-m", "rankscope", "collector", "--listen", "127.0.0.1:0", "--out", str(out)],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "RANKSCOPE_LOG": "warn"},
    )
    line = proc.stdout.readline()
    return proc, next(w for w in line.split() if w.startswith("127.0.0.1:")).rstrip(",")


def one_run(framework: str, with_rankscope: bool, steps: int, addr: str, tmp: Path, run: int) -> float:
    result = tmp / "result.json"
    result.unlink(missing_ok=True)
    worker = [str(WORKER), "--framework", framework, "--steps", str(steps), "--result", str(result)]
    worker += ["--workdir", str(tmp)] + (["--rankscope"] if with_rankscope else [])
    if framework == "lightning":
        command = [sys.executable, *worker]  # Lightning launches its second rank itself
    else:
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", *worker]
    env = {
        **os.environ,
        "RANKSCOPE_COLLECTOR": addr,
        "RANKSCOPE_RUN_ID": f"bench-{framework}-{run}",
        "RANKSCOPE_LOG": "error",
        "OMP_NUM_THREADS": "1",
        "TOKENIZERS_PARALLELISM": "false",
    }
    for attempt in (1, 2):
        done = subprocess.run(command, env=env, cwd=tmp, capture_output=True, text=True)
        if done.returncode == 0 and result.exists():
            return json.loads(result.read_text())["step_ms"]
        tail = "\n".join(done.stderr.splitlines()[-15:])
        print(f"{framework} run failed (exit {done.returncode}, attempt {attempt}):\n{tail}", file=sys.stderr)
    raise SystemExit(f"failed twice: {' '.join(command)}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=60, help="optimizer steps per run (5 of them warm-up)")
    p.add_argument("--frameworks", default=",".join(FRAMEWORKS))
    args = p.parse_args()
    frameworks = args.frameworks.split(",")
    tmp = Path(tempfile.mkdtemp(prefix="rankscope-integrations-ab-"))
    collector, addr = start_collector(tmp / "out")
    times = {(f, name): [] for f in frameworks for name, _ in CONFIGS}
    run = 0
    try:
        for round_ in range(args.rounds):
            order = CONFIGS[round_ % len(CONFIGS):] + CONFIGS[: round_ % len(CONFIGS)]
            for framework in frameworks:
                for name, with_rankscope in order:
                    run += 1
                    times[(framework, name)].append(one_run(framework, with_rankscope, args.steps, addr, tmp, run))
            print(f"round {round_ + 1}/{args.rounds} done", file=sys.stderr, flush=True)
    finally:
        collector.send_signal(signal.SIGTERM)
        collector.wait(timeout=60)
        shutil.rmtree(tmp, ignore_errors=True)
    print(
        f"\nIntegrations: tiny GPT-2 (2 layers, d = 64, sequence 32, batch 8 per rank), 2 DDP ranks on "
        f"{os.cpu_count()} cores ({cpu_name()}), gloo, 1 intra-op thread per "
        f"rank, {args.steps} steps per run, {args.rounds} interleaved rounds; median over rounds of the "
        f"median step time\n"
    )
    print("| framework | bare, ms/step | bare again (noise floor) | with rankscope, ms/step | with rankscope / bare |")
    print("|---|---|---|---|---|")
    for f in frameworks:
        bare = statistics.median(times[(f, "bare")])
        again = statistics.median(times[(f, "bare again (noise floor)")])
        ours = statistics.median(times[(f, "rankscope")])
        print(f"| {f} | {bare:.2f} | {again:.2f} ({again / bare:.3f}×) | {ours:.2f} | {ours / bare:.3f}× |")


if __name__ == "__main__":
    main()
