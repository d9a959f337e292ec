"""The GPT of ``rankscope.examples.ddp_train`` trained with FSDP2 (``fully_shard``),
watched by rankscope. Run it under torchrun:

    rankscope collector --out ./rankscope-out &
    RANKSCOPE_COLLECTOR=127.0.0.1:50051 \
        torchrun --standalone --nproc-per-node 4 -m rankscope.examples.fsdp_train --steps 50

Each block is sharded on its own, then the root (embeddings, final norm, head), so
every step all-gathers each block's parameters in forward and again in backward,
and reduce-scatters its gradients: the ``comm`` table shows both kinds per step.
At the end every rank gathers the full state dict and checks it equals rank 0's,
and exits 3 if it does not.

Options: ``--checkpoint`` wraps each block in activation checkpointing;
``--mixed-precision`` all-gathers parameters in bfloat16 and reduces gradients in
float32 (``MixedPrecisionPolicy``). Test knobs as in ``ddp_train``: ``--slow-rank R
--slow-ms M``, ``--result FILE``, ``--no-agent``; ``--no-collectives`` keeps the
agent but does not time collectives (the overhead baseline of the timing).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from rankscope.examples.ddp_train import GPT, batches


def shard(model: GPT, *, checkpoint: bool, mixed_precision: bool) -> None:
    """FSDP2 as in torchtitan: each block, then the root. Every group reshards
    after forward, so backward all-gathers it again."""
    mp = (
        MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        if mixed_precision
        else MixedPrecisionPolicy()
    )
    if checkpoint:
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

        for i, block in enumerate(model.blocks):
            model.blocks[i] = checkpoint_wrapper(block)
    for block in model.blocks:
        fully_shard(block, mp_policy=mp, reshard_after_forward=True)
    fully_shard(model, mp_policy=mp, reshard_after_forward=True)


def full_state(model: torch.nn.Module) -> torch.Tensor:
    """The full state dict, gathered from the shards, as one float64 vector."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    return torch.cat([state[k].detach().reshape(-1).double().cpu() for k in sorted(state)])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--seq", type=int, default=32)
    p.add_argument("--d-model", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=128)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--threads", type=int, default=1, help="intra-op threads per rank")
    p.add_argument("--checkpoint", action="store_true", help="activation checkpointing per block")
    p.add_argument("--mixed-precision", action="store_true", help="bfloat16 parameters, float32 reduction")
    p.add_argument("--slow-rank", type=int, default=-1)
    p.add_argument("--slow-ms", type=float, default=0.0)
    p.add_argument("--result", help="write rank 0's result as JSON here")
    p.add_argument("--no-agent", action="store_true", help="train without rankscope")
    p.add_argument("--no-collectives", action="store_true", help="do not time collectives")
    args = p.parse_args()

    torch.set_num_threads(args.threads)
    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)

    agent = None
    if not args.no_agent:
        import rankscope

        agent = rankscope.init(workload="fsdp_gpt")
        if args.no_collectives:
            agent.time_collectives(False)

    torch.manual_seed(0)  # the same initial weights on every rank before sharding
    model = GPT(args.vocab, args.seq, args.d_model, args.layers, args.heads).to(device)
    if rank == args.slow_rank:
        model.slow_ms = args.slow_ms
    shard(model, checkpoint=args.checkpoint, mixed_precision=args.mixed_precision)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    data = batches(args.vocab, args.seq, args.batch_size, seed=1000 + rank, device=device)

    if agent is not None:
        agent.watch(model)
        agent.profile(model, next(data)[0], opt)

    first_loss = last_loss = math.nan
    warmup = min(5, args.steps - 1)
    loop_started = time.perf_counter()
    for step in range(args.steps):
        if step == warmup:
            loop_started = time.perf_counter()
        if agent is None:
            x, y = next(data)
            loss = F.cross_entropy(model(x).flatten(0, 1).float(), y.flatten())
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        else:
            with agent.step(step) as s:
                with s.phase("data"):
                    x, y = next(data)
                with s.phase("forward"):
                    loss = F.cross_entropy(model(x).flatten(0, 1).float(), y.flatten())
                with s.phase("backward"):
                    loss.backward()
                with s.phase("optimizer"):
                    opt.step()
                    opt.zero_grad(set_to_none=True)
                s.record(loss=loss.detach(), lr=args.lr, samples=len(x))
        if step in (0, args.steps - 1):
            last_loss = loss.item()
        if step == 0:
            first_loss = last_loss
    loop_s = time.perf_counter() - loop_started

    # The ranks agree when the full state dict each gathers equals rank 0's.
    full = full_state(model).to(device)
    reference = full.clone()
    dist.broadcast(reference, src=0)
    agreed = torch.tensor([1.0 if torch.equal(full, reference) else 0.0], device=device)
    dist.all_reduce(agreed, op=dist.ReduceOp.MIN)
    in_sync = bool(agreed.item() == 1.0)

    report = agent.finish() if agent is not None else None
    if rank == 0:
        result = {
            "world_size": world,
            "steps": args.steps,
            "first_loss": first_loss,
            "last_loss": last_loss,
            "state_in_sync": in_sync,
            "loop_s": loop_s,
            "steps_timed": args.steps - warmup,
            "rows_unsent": None if report is None else report.rows_unsent,
        }
        print(f"loss {first_loss:.4f} -> {last_loss:.4f}; full state dict equal on all {world} ranks: {in_sync}")
        if args.result:
            with open(args.result, "w") as f:
                json.dump(result, f)
    sys.stdout.flush()
    dist.barrier()
    dist.destroy_process_group()
    return 0 if in_sync else 3


if __name__ == "__main__":
    code = main()
    # As in ddp_train: end without torch's teardown at exit (RELIABILITY.md).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
