"""One run of ``integrations_ab.py``: a tiny GPT-2 (built from a config) trained by
one framework on 2 DDP ranks (gloo, CPU), with or without rankscope, timing each
optimizer step at its end. Rank 0 writes the median step time after a warm-up.

    torchrun --standalone --nproc-per-node 2 integrations_worker.py --framework transformers --rankscope --steps 60 --result r.json
    python integrations_worker.py --framework lightning --steps 60 --result r.json   # Lightning launches rank 1
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

GPT2 = dict(n_layer=2, n_head=4, n_embd=64, vocab_size=256, n_positions=64)
SEQ = 32
BATCH = 8
WARMUP = 5


class Tokens(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 1_000_000

    def __getitem__(self, i: int) -> dict:
        ids = torch.randint(0, GPT2["vocab_size"], (SEQ,), generator=torch.Generator().manual_seed(i))
        return {"input_ids": ids, "labels": ids}


def gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(**GPT2))


def write(args, ends: list) -> None:
    if dist.is_initialized() and dist.get_rank() != 0:
        return
    gaps = [(b - a) * 1e3 for a, b in zip(ends[WARMUP:], ends[WARMUP + 1 :])]
    with open(args.result, "w") as f:
        json.dump({"step_ms": statistics.median(gaps), "steps_timed": len(gaps)}, f)


def transformers_run(args) -> None:
    from transformers import Trainer, TrainerCallback, TrainingArguments

    ends: list = []

    class Clock(TrainerCallback):
        def on_step_end(self, a, state, control, **kwargs):  # type: ignore[no-untyped-def]
            ends.append(time.perf_counter())

    callbacks = [Clock()]
    if args.rankscope:
        from rankscope.integrations.transformers import RankscopeCallback

        callbacks.insert(0, RankscopeCallback())
    training = TrainingArguments(
        output_dir=args.workdir, max_steps=args.steps, per_device_train_batch_size=BATCH, logging_steps=1,
        save_strategy="no", report_to=[], use_cpu=True, ddp_backend="gloo", disable_tqdm=True,
        log_level="error",
    )
    Trainer(model=gpt2(), args=training, train_dataset=Tokens(), callbacks=callbacks).train()
    write(args, ends)


def lightning_run(args) -> None:
    import lightning.pytorch as pl

    ends: list = []

    class Clock(pl.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):  # type: ignore[no-untyped-def]
            ends.append(time.perf_counter())

    class Model(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = gpt2()

        def training_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
            return self.model(**batch).loss

        def configure_optimizers(self):  # type: ignore[no-untyped-def]
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    callbacks = [Clock()]
    if args.rankscope:
        from rankscope.integrations.lightning import RankscopeCallback

        callbacks.insert(0, RankscopeCallback())
    trainer = pl.Trainer(
        strategy="ddp", accelerator="cpu", devices=2, max_steps=args.steps, callbacks=callbacks, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )
    trainer.fit(Model(), torch.utils.data.DataLoader(Tokens(), batch_size=BATCH))
    write(args, ends)


def accelerate_run(args) -> None:
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True)
    model = gpt2()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loader = torch.utils.data.DataLoader(Tokens(), batch_size=BATCH)
    model, opt, loader = accelerator.prepare(model, opt, loader)
    batches = iter(loader)
    ends: list = []
    if args.rankscope:
        import rankscope
        from rankscope.integrations.accelerate import watch

        agent = rankscope.init(workload="accelerate")
        watch(agent, model)
        for step in range(args.steps):
            with agent.step(step) as s:
                with s.phase("data"):
                    batch = next(batches)
                with accelerator.accumulate(model):
                    with s.phase("forward"):
                        loss = model(**batch).loss
                    with s.phase("backward"):
                        accelerator.backward(loss)
                with s.phase("optimizer"):
                    opt.step()
                    opt.zero_grad()
                s.record(loss=loss.detach(), lr=opt.param_groups[0]["lr"])
            ends.append(time.perf_counter())
        agent.finish()
    else:
        for step in range(args.steps):
            batch = next(batches)
            with accelerator.accumulate(model):
                loss = model(**batch).loss
                accelerator.backward(loss)
            opt.step()
            opt.zero_grad()
            ends.append(time.perf_counter())
    write(args, ends)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--framework", choices=["transformers", "lightning", "accelerate"], required=True)
    p.add_argument("--rankscope", action="store_true", help="with rankscope's integration")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--result", required=True)
    p.add_argument("--workdir", default=".")
    args = p.parse_args()
    torch.set_num_threads(1)
    {"transformers": transformers_run, "lightning": lightning_run, "accelerate": accelerate_run}[args.framework](args)
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # torch's teardown at exit can abort a DDP rank (docs/python.md)


if __name__ == "__main__":
    main()
