"""Where users train: the Hugging Face ``Trainer``, Lightning and Accelerate, each a
real 2-rank DDP job on CPU (gloo) with a model built from a config, into the real
collector, read with the real DuckDB CLI; and the README's quick start
(``rankscope/examples/train.py``) run as written, alone and through ``rankscope
demo --script``.

Each job's rows must land: one ``steps`` row per rank and optimizer step, each with
``comm_ms``, and a complete ``layers`` grid (every watched layer on every rank at
every sampled step, once)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from torch import nn

from test_api import clean_env, collector, duckdb, table  # noqa: F401 (fixtures)

TORCHRUN = shutil.which("torchrun") or str(Path(sys.executable).parent / "torchrun")
EXAMPLES = Path(__file__).resolve().parents[1] / "rankscope" / "examples"
SAMPLE_EVERY = 2


def needs(module: str) -> None:
    """The frameworks are test requirements (the Makefile's venv has them), not
    rankscope's: without one, its test says what to install."""
    pytest.importorskip(module, reason=f"{module} is not installed: make setup installs it (Makefile)")


def run(collector, run_id: str, command: list, tmp_path: Path, **env: str) -> str:
    done = subprocess.run(
        command,
        env={
            **os.environ,
            "RANKSCOPE_COLLECTOR": collector.addr,
            "RANKSCOPE_RUN_ID": run_id,
            "RANKSCOPE_SAMPLE_EVERY": str(SAMPLE_EVERY),
            "OMP_NUM_THREADS": "1",
            "TOKENIZERS_PARALLELISM": "false",
            **env,
        },
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout + done.stderr


def torchrun(ranks: int, script: Path, *args: str) -> list:
    return [TORCHRUN, "--standalone", f"--nproc-per-node={ranks}", str(script), *args]


def leaf_layers(model: nn.Module) -> list:
    """What ``Agent.watch`` watches: leaf modules with parameters, by path."""
    return sorted(
        name
        for name, m in model.named_modules()
        if name and next(m.children(), None) is None and next(m.parameters(recurse=False), None) is not None
    )


def check_job(out: Path, run_id: str, world: int, steps: int, layers: list) -> None:
    """Rows landed for every rank and step, each with comm_ms, and the layer grid
    is complete."""
    steps_table = table(out, "steps")
    assert duckdb(
        f"select rank, count(*), count(distinct step), min(step), max(step), count(comm_ms) "
        f"from {steps_table} where run_id = '{run_id}' group by rank order by rank"
    ).splitlines() == [f"{r},{steps},{steps},0,{steps - 1},{steps}" for r in range(world)]
    assert duckdb(f"select count(*) from {steps_table} where run_id = '{run_id}' and comm_ms <= 0") == "0"
    sampled = [s for s in range(steps) if s % SAMPLE_EVERY == 0]
    grid = duckdb(
        f"select rank, step, count(*), count(distinct layer), string_agg(distinct layer, ',' order by layer) "
        f"from {table(out, 'layers')} where run_id = '{run_id}' group by rank, step order by rank, step"
    ).splitlines()
    names = ",".join(layers)
    assert grid == [f'{r},{s},{len(layers)},{len(layers)},"{names}"' for r in range(world) for s in sampled]


# -- Hugging Face Trainer --------------------------------------------------------------

GPT2 = dict(n_layer=2, n_head=2, n_embd=32, vocab_size=128, n_positions=32)
HF_SCRIPT = textwrap.dedent(
    f"""
    import os, sys, torch, torch.distributed as dist
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments
    from rankscope.integrations.transformers import RankscopeCallback

    steps, accumulation, batch = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])

    class Tokens(torch.utils.data.Dataset):
        def __len__(self):
            return 100_000

        def __getitem__(self, i):
            ids = torch.randint(0, 128, (16,), generator=torch.Generator().manual_seed(i))
            return {{"input_ids": ids, "labels": ids}}

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(**{GPT2!r}))
    args = TrainingArguments(
        output_dir="hf-out", max_steps=steps, per_device_train_batch_size=batch,
        gradient_accumulation_steps=accumulation, logging_steps=1, save_strategy="no",
        report_to=[], use_cpu=True, ddp_backend="gloo", disable_tqdm=True, learning_rate=1e-3,
    )
    callback = RankscopeCallback()
    Trainer(model=model, args=args, train_dataset=Tokens(), callbacks=[callback]).train()
    report = callback.agent.finish()
    assert report.complete and report.rows_unsent == 0, report
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)  # torch's teardown at exit can abort a DDP rank (docs/python.md)
    """
)


def test_hf_trainer_with_gradient_accumulation_on_two_ranks(collector, tmp_path):
    needs("transformers")
    from transformers import GPT2Config, GPT2LMHeadModel

    steps, accumulation, batch, world = 6, 2, 4, 2
    script = tmp_path / "hf_train.py"
    script.write_text(HF_SCRIPT)
    run(collector, "hf-trainer", torchrun(world, script, str(steps), str(accumulation), str(batch)), tmp_path)
    assert collector.stop() == 0
    out = collector.out
    layers = leaf_layers(GPT2LMHeadModel(GPT2Config(**GPT2)))
    assert "transformer.h.0.attn.c_attn" in layers
    check_job(out, "hf-trainer", world, steps, layers)
    # A step is an optimizer step: both micro-batches' examples, the Trainer's logged
    # values (logging_steps=1), and the phases the callback events bound.
    assert duckdb(
        f"select distinct samples, count(loss) = count(*), count(lr) = count(*), count(grad_norm) = count(*), "
        f"min(forward_ms) > 0, min(backward_ms) > 0, min(optimizer_ms) > 0, count(data_ms) "
        f"from {table(out, 'steps')} group by samples"
    ) == f"{batch * accumulation},true,true,true,true,true,true,0"
    # Layers are sampled on one micro-batch (the first): its batch × 16 tokens (the
    # position embedding's output is one sequence's 16, broadcast over the batch).
    assert duckdb(
        f"select distinct rows from {table(out, 'layers')} where layer <> 'transformer.wpe'"
    ) == str(batch * 16)
    assert duckdb(f"select workload from {table(out, 'runs')}") == "transformers"


def test_hf_trainer_exception_ends_the_step_and_finishes_the_agent(collector, tmp_path):
    needs("transformers")
    script = tmp_path / "hf_fails.py"
    script.write_text(
        textwrap.dedent(
            """
            import torch
            from transformers import Trainer, TrainingArguments, TrainerCallback
            from rankscope.integrations.transformers import RankscopeCallback

            class Fail(TrainerCallback):
                def on_optimizer_step(self, args, state, control, **kwargs):
                    if state.global_step == 2:
                        raise RuntimeError("boom at step 2")

            data = [{"x": torch.randn(4), "labels": torch.randn(1)} for _ in range(64)]

            class Net(torch.nn.Module):
                def __init__(self):
                    super().__init__()
                    self.fc = torch.nn.Linear(4, 1)

                def forward(self, x, labels):
                    return {"loss": ((self.fc(x) - labels) ** 2).mean()}

            args = TrainingArguments(output_dir="out", max_steps=5, per_device_train_batch_size=4,
                                     logging_steps=1, save_strategy="no", report_to=[], use_cpu=True,
                                     disable_tqdm=True)
            Trainer(model=Net(), args=args, train_dataset=data, callbacks=[RankscopeCallback(), Fail()]).train()
            """
        )
    )
    done = subprocess.run(
        [sys.executable, str(script)],
        env={**os.environ, "RANKSCOPE_COLLECTOR": collector.addr, "RANKSCOPE_RUN_ID": "hf-fails"},
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode != 0 and "boom at step 2" in done.stderr, done.stderr
    assert collector.stop() == 0
    out = collector.out
    # Steps 0 and 1 whole, step 2 ended by the exception, and the event with it.
    assert duckdb(f"select string_agg(step::varchar, ' ' order by step) from {table(out, 'steps')}") == "0 1 2"
    assert duckdb(f"select message from {table(out, 'events')} where kind = 'exception'") == (
        "RuntimeError: boom at step 2"
    )
    assert duckdb(f"select count(*) from {table(out, 'ranks')} where finished_at is not null") == "1"


# -- Lightning --------------------------------------------------------------------------

LIGHTNING_SCRIPT = textwrap.dedent(
    """
    import sys, os, torch, torch.distributed as dist
    import lightning.pytorch as pl
    from rankscope.integrations.lightning import RankscopeCallback

    steps = int(sys.argv[1])

    class Model(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))

        def training_step(self, batch, batch_idx):
            x, y = batch
            return torch.nn.functional.cross_entropy(self.net(x), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.05)

    g = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(2048, 16, generator=g), torch.randint(0, 4, (2048,), generator=g))
    loader = torch.utils.data.DataLoader(data, batch_size=8)
    trainer = pl.Trainer(
        strategy="ddp", accelerator="cpu", devices=2, max_steps=steps, callbacks=[RankscopeCallback()],
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )
    trainer.fit(Model(), loader)
    # Every rank's agent finished at on_train_end; the barrier lets none exit before all have.
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)  # torch's teardown at exit can abort a DDP rank (docs/python.md)
    """
)


def test_lightning_ddp_on_two_cpu_devices(collector, tmp_path, monkeypatch):
    needs("lightning")
    # Lightning launches its second process itself (no torchrun): the ranks and the
    # run id come from its strategy, not from any variable of ours.
    monkeypatch.delenv("RANKSCOPE_RUN_ID", raising=False)
    steps, world = 6, 2
    script = tmp_path / "lightning_train.py"
    script.write_text(LIGHTNING_SCRIPT)
    env = {**os.environ, "RANKSCOPE_COLLECTOR": collector.addr, "RANKSCOPE_SAMPLE_EVERY": str(SAMPLE_EVERY), "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, str(script), str(steps)], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert collector.stop() == 0
    out = collector.out
    run_id = duckdb(f"select distinct run_id from {table(out, 'steps')}")
    assert run_id.startswith("lightning-"), run_id
    check_job(out, run_id, world, steps, ["net.0", "net.2"])
    assert duckdb(
        f"select distinct samples, count(loss) = count(*), count(lr) = count(*), min(forward_ms) > 0, "
        f"min(backward_ms) > 0, min(optimizer_ms) > 0 from {table(out, 'steps')} group by samples"
    ) == "8,true,true,true,true,true"
    assert duckdb(f"select distinct world_size from {table(out, 'runs')}") == str(world)


# -- Accelerate -------------------------------------------------------------------------

ACCELERATE_SCRIPT = textwrap.dedent(
    """
    import os, sys, torch, torch.distributed as dist, rankscope
    from accelerate import Accelerator
    from rankscope.integrations.accelerate import watch

    steps, accumulation = int(sys.argv[1]), int(sys.argv[2])
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=accumulation)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(4096, 16, generator=g), torch.randint(0, 4, (4096,), generator=g))
    loader = torch.utils.data.DataLoader(data, batch_size=8)
    model, opt, loader = accelerator.prepare(model, opt, loader)
    agent = rankscope.init(workload="accelerate")
    assert watch(agent, model) == ["0", "2"]

    # The recipe of rankscope/integrations/accelerate.py, as written there.
    batches = iter(loader)
    for step in range(steps):
        with agent.step(step) as s:
            for _ in range(accelerator.gradient_accumulation_steps):
                with s.phase("data"):
                    x, y = next(batches)
                with accelerator.accumulate(model):
                    with s.phase("forward"):
                        loss = torch.nn.functional.cross_entropy(model(x), y)
                    with s.phase("backward"):
                        accelerator.backward(loss)
            with s.phase("optimizer"):
                opt.step(); opt.zero_grad()
            s.record(loss=loss.detach(), lr=opt.param_groups[0]["lr"])
    report = agent.finish()
    assert report.complete and report.rows_unsent == 0, report
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)  # torch's teardown at exit can abort a DDP rank (docs/python.md)
    """
)


def test_accelerate_loop_with_gradient_accumulation_under_torchrun(collector, tmp_path):
    needs("accelerate")
    steps, accumulation, world = 6, 2, 2
    script = tmp_path / "accelerate_train.py"
    script.write_text(ACCELERATE_SCRIPT)
    run(collector, "accelerate", torchrun(world, script, str(steps), str(accumulation)), tmp_path)
    assert collector.stop() == 0
    out = collector.out
    check_job(out, "accelerate", world, steps, ["0", "2"])
    assert duckdb(
        f"select count(loss) = count(*), min(data_ms) > 0, min(forward_ms) > 0, min(backward_ms) > 0, "
        f"min(optimizer_ms) > 0 from {table(out, 'steps')}"
    ) == "true,true,true,true,true"


def test_rankscope_imports_none_of_the_frameworks():
    code = "import sys, rankscope, rankscope.integrations; print(sorted({'transformers', 'lightning', 'accelerate'} & set(sys.modules)))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]", done.stdout + done.stderr


# -- The quick start ---------------------------------------------------------------------


def test_the_quick_start_runs_as_written(collector, tmp_path):
    script = EXAMPLES / "train.py"
    assert len(script.read_text().splitlines()) <= 30
    steps, world = 6, 2
    run(collector, "quick-start", torchrun(world, script, "--steps", str(steps)), tmp_path)
    assert collector.stop() == 0
    out = collector.out
    check_job(out, "quick-start", world, steps, ["0", "2"])
    assert duckdb(f"select count(loss), sum(samples) from {table(out, 'steps')}") == f"{world * steps},{world * steps * 64}"


@pytest.mark.parametrize("page, section", [("README.md", "## Quick start"), ("docs/python.md", "## A training script")])
def test_the_docs_show_the_quick_start_that_runs(page, section):
    text = (Path(__file__).resolve().parents[2] / page).read_text()
    shown = text.split(section, 1)[1].split("```python\n", 1)[1].split("```", 1)[0]
    assert shown == (EXAMPLES / "train.py").read_text()


def test_rankscope_demo_script_runs_the_quick_start(tmp_path):
    # The command a newcomer runs first: an embedded collector, 2 ranks of the quick
    # start under torchrun, then the summary and the report.
    shutil.copy(EXAMPLES / "train.py", tmp_path / "train.py")
    done = subprocess.run(
        [sys.executable, "-m", "rankscope", "demo", "--script", "train.py", "--nproc-per-node", "2", "--steps", "20"],
        cwd=tmp_path,
        env={**os.environ, "RANKSCOPE_LOG": "warn"},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "report: rankscope-out/report-" in done.stdout, done.stdout
    page = next((tmp_path / "rankscope-out").glob("report-*.html"))
    assert page.stat().st_size > 0
    run_id = page.stem.removeprefix("report-")
    assert duckdb(
        f"select count(*), count(comm_ms) from {table(tmp_path / 'rankscope-out', 'steps')} where run_id = '{run_id}'"
    ) == "40,40"
    missing = subprocess.run(
        [sys.executable, "-m", "rankscope", "demo", "--script", "nope.py"], cwd=tmp_path, capture_output=True, text=True
    )
    assert missing.returncode != 0 and "--script nope.py: no such file" in missing.stderr, missing.stderr
