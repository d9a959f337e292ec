"""FSDP2 and the ``comm`` table under the real ``torchrun`` (gloo on CPU), into the
real collector, read with the real DuckDB CLI: ``rankscope.examples.fsdp_train``
and a loop of hand-written collectives."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from torch import nn

from rankscope.examples.ddp_train import GPT
from test_api import clean_env, collector, duckdb, table  # noqa: F401 (fixtures)

TORCHRUN = shutil.which("torchrun") or str(Path(sys.executable).parent / "torchrun")


def torchrun(collector, run_id: str, ranks: int, args: list, tmp_path: Path, sample_every: int = 2) -> None:
    env = {
        **os.environ,
        "RANKSCOPE_COLLECTOR": collector.addr,
        "RANKSCOPE_RUN_ID": run_id,
        "RANKSCOPE_SAMPLE_EVERY": str(sample_every),
        "OMP_NUM_THREADS": "1",
    }
    done = subprocess.run(
        [TORCHRUN, "--standalone", f"--nproc-per-node={ranks}", *args],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout + done.stderr


def padded_bytes(module: nn.Module, world: int, element: int) -> int:
    """What one all-gather (or reduce-scatter) of ``module``'s own FSDP2 group
    moves: each parameter's first dimension padded to a multiple of the world
    size, times the element size."""
    total = 0
    for p in module.parameters():
        rows = -(-p.shape[0] // world) * world
        total += rows * (p.numel() // p.shape[0])
    return total * element


def gpt_groups(world: int, element: int, layers: int = 2) -> int:
    """Bytes of one all-gather of every FSDP2 group of the example's GPT (each block,
    then the root's own parameters)."""
    model = GPT(128, 32, 64, layers, 4)
    blocks = sum(padded_bytes(b, world, element) for b in model.blocks)
    root = sum(padded_bytes(m, world, element) for m in (model.tok, model.pos, model.ln_f, model.head))
    return blocks + root


def expected_layers(layers: int = 2) -> list:
    names = ["tok", "pos", "ln_f", "head"]
    for i in range(layers):
        names += [f"blocks.{i}.{n}" for n in ("ln1", "attn.qkv", "attn.proj", "ln2", "mlp.0", "mlp.2")]
    return sorted(names)


def test_fsdp2_on_four_ranks_fills_the_layer_grid_and_times_every_gather_and_scatter(collector, tmp_path):
    steps, world = 6, 4
    result = tmp_path / "result.json"
    torchrun(
        collector,
        "fsdp-4",
        world,
        ["-m", "rankscope.examples.fsdp_train", "--steps", str(steps), "--result", str(result)],
        tmp_path,
    )
    assert json.loads(result.read_text())["state_in_sync"] is True
    assert collector.stop() == 0
    out = collector.out
    layers = expected_layers()
    # A complete (step, layer) grid on every rank: sampled steps 0, 2, 4, once each.
    grid = duckdb(
        f"select rank, step, string_agg(layer, ',' order by layer), count(*) from {table(out, 'layers')} "
        f"group by rank, step order by rank, step"
    ).splitlines()
    assert grid == [f"{r},{s},\"{','.join(layers)}\",{len(layers)}" for r in range(world) for s in (0, 2, 4)]
    # Every step of every rank: each group all-gathered in forward and again in
    # backward (every group reshards after forward), and reduce-scattered once.
    gather = gpt_groups(world, 4)
    rows = duckdb(
        f"select rank, step, kind, count, bytes, comm_ms > 0 from {table(out, 'comm')} "
        f"where step is not null and kind in ('all_gather', 'reduce_scatter') order by rank, step, kind"
    ).splitlines()
    groups = 2 + 1
    assert rows == [
        line
        for r in range(world)
        for s in range(steps)
        for line in (f"{r},{s},all_gather,{2 * groups},{2 * gather},true", f"{r},{s},reduce_scatter,{groups},{gather},true")
    ]
    # The profile's forward and the final state dict gather run outside steps.
    assert duckdb(f"select count(*) > 0 from {table(out, 'comm')} where step is null and kind = 'all_gather'") == "true"
    # Sharded parameters: whole layers in `params`, this rank's shard in the bytes.
    head = 128 * 64
    assert duckdb(
        f"select distinct params, param_bytes from {table(out, 'model')} where layer = 'head'"
    ) == f"{head},{head // world * 4}"


def test_activation_checkpointing_samples_once_and_mixed_precision_gathers_bfloat16(collector, tmp_path):
    world = 2
    torchrun(
        collector,
        "fsdp-ckpt",
        world,
        ["-m", "rankscope.examples.fsdp_train", "--steps", "4", "--checkpoint", "--mixed-precision"],
        tmp_path,
    )
    assert collector.stop() == 0
    out = collector.out
    layers = expected_layers()
    assert duckdb(
        f"select count(*), count(distinct (rank, step, layer)), count(distinct layer) from {table(out, 'layers')}"
    ) == f"{world * 2 * len(layers)},{world * 2 * len(layers)},{len(layers)}"
    gather = gpt_groups(world, 2)
    scatter = gpt_groups(world, 4)
    assert duckdb(
        f"select distinct kind, bytes from {table(out, 'comm')} where step is not null "
        f"and kind in ('all_gather', 'reduce_scatter') order by kind"
    ) == f"all_gather,{2 * gather}\nreduce_scatter,{scatter}"


LOOP = textwrap.dedent(
    """
    import os, torch, torch.distributed as dist, rankscope
    dist.init_process_group("gloo")
    agent = rankscope.init()
    t = torch.ones(1000)
    for step in range(3):
        with agent.step(step):
            dist.all_reduce(t)
            dist.all_reduce(t, async_op=True).wait()
            dist.broadcast(t, src=0)
    agent.finish()
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)
    """
)


def test_a_loop_of_all_reduce_and_broadcast_records_both_kinds(collector, tmp_path):
    (tmp_path / "loop.py").write_text(LOOP)
    torchrun(collector, "loop", 2, ["loop.py"], tmp_path)
    assert collector.stop() == 0
    out = collector.out
    # Blocking collectives complete inside their step.
    assert duckdb(
        f"select rank, step, kind, count >= 1 from {table(out, 'comm')} "
        f"where step is not null order by rank, step, kind"
    ).splitlines() == [
        line for r in range(2) for s in range(3) for line in (f"{r},{s},all_reduce,true", f"{r},{s},broadcast,true")
    ]
    # An asynchronous one may complete after its step's clock stopped: then it is
    # in a row without a step. Each is counted once, with its bytes.
    assert duckdb(
        f"select rank, kind, sum(count), sum(bytes) from {table(out, 'comm')} group by rank, kind order by rank, kind"
    ).splitlines() == [line for r in range(2) for line in (f"{r},all_reduce,6,24000", f"{r},broadcast,3,12000")]


@pytest.mark.parametrize("path", ["_fsdp_wrapped_module.blocks.0._checkpoint_wrapped_module.mlp", "_orig_mod.fc", "module.fc"])
def test_layer_names_leave_out_wrapper_parts(path):
    from rankscope._modules import layer_name

    assert layer_name(path) in ("blocks.0.mlp", "fc")


def report(out: Path, run_id: str) -> dict:
    done = subprocess.run(
        [sys.executable, "-m", "rankscope", "report", str(out), "--run", run_id, "--json", "-"],
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(done.stdout)


@pytest.mark.parametrize("slow", [True, False], ids=["a slow rank", "an even run"])
def test_the_straggler_diagnosis_reads_fsdp_collectives(collector, tmp_path, monkeypatch, slow):
    monkeypatch.setenv("RANKSCOPE_MODE", "steps")
    run_id = "fsdp-slow" if slow else "fsdp-even"
    extra = ["--slow-rank", "1", "--slow-ms", "60"] if slow else []
    torchrun(collector, run_id, 2, ["-m", "rankscope.examples.fsdp_train", "--steps", "30", *extra], tmp_path)
    assert collector.stop() == 0
    r = report(collector.out, run_id)
    stragglers = [d for d in r["diagnoses"] if d["kind"] == "straggler"]
    if slow:
        assert [(d["rank"], d["signal"]) for d in stragglers] == [(1, "comm_ms")], r["diagnoses"]
    else:
        assert stragglers == [], stragglers
    # The report shows each rank's collectives by kind, with bandwidth.
    for rank in r["ranks"]:
        assert set(rank["comm"]) >= {"all_gather", "reduce_scatter"}, rank
        assert all(c["mb_per_s"] > 0 for c in rank["comm"].values()), rank


def test_compiled_modules_are_not_watched_and_a_warning_says_why(collector):
    import torch

    import rankscope

    agent = rankscope.init(collector=collector.addr, run_id="compiled")
    model = nn.Sequential(nn.Linear(4, 4), torch.compile(nn.Sequential(nn.Linear(4, 4))))
    with pytest.warns(RuntimeWarning, match="torch.compile'd modules .*'1'"):
        assert agent.watch(model) == ["0"]
    agent.finish()
