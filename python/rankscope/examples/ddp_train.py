"""A small GPT-style transformer trained with DistributedDataParallel, watched by
rankscope. Run it under torchrun:

    rankscope collector --out ./rankscope-out &
    RANKSCOPE_COLLECTOR=127.0.0.1:50051 \
        torchrun --standalone --nproc-per-node 4 -m rankscope.examples.ddp_train --steps 50

Each rank trains on its own synthetic token stream (gloo on CPU, nccl on CUDA).
At the end the script checks that the parameters are identical on every rank,
which proves the gradient all-reduce ran, and exits 3 if they are not.

Test knobs: ``--slow-rank R --slow-ms M`` sleeps M ms in rank R's forward (a
straggler); ``--result FILE`` writes rank 0's result (and every rank's finish
report) as JSON; ``--no-agent`` trains without rankscope (the overhead baseline).
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
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP


class CausalSelfAttention(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).split(d, dim=2)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, d))


class Block(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(d)
        self.attn = CausalSelfAttention(d, heads)
        self.ln2 = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, vocab: int, seq: int, d: int, layers: int, heads: int) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(seq, d)
        self.blocks = nn.Sequential(*[Block(d, heads) for _ in range(layers)])
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.slow_ms = 0.0

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        if self.slow_ms:
            time.sleep(self.slow_ms / 1e3)
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.tok(idx) + self.pos(pos)
        return self.head(self.ln_f(self.blocks(x)))


def batches(vocab: int, seq: int, batch: int, seed: int, device: torch.device):
    """Synthetic tokens with structure to learn: each token is the previous plus a
    per-sequence stride, modulo the vocabulary, with a little noise."""
    g = torch.Generator().manual_seed(seed)
    while True:
        start = torch.randint(0, vocab, (batch, 1), generator=g)
        stride = torch.randint(1, 4, (batch, 1), generator=g)
        tokens = (start + stride * torch.arange(seq + 1)) % vocab
        noise = torch.rand(tokens.shape, generator=g) < 0.05
        tokens = torch.where(noise, torch.randint(0, vocab, tokens.shape, generator=g), tokens)
        yield tokens[:, :-1].to(device), tokens[:, 1:].to(device)


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
    p.add_argument("--slow-rank", type=int, default=-1)
    p.add_argument("--slow-ms", type=float, default=0.0)
    p.add_argument("--result", help="write rank 0's result as JSON here")
    p.add_argument("--no-agent", action="store_true", help="train without rankscope")
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

        agent = rankscope.init(workload="ddp_gpt")

    torch.manual_seed(0)  # the same initial weights on every rank
    model = GPT(args.vocab, args.seq, args.d_model, args.layers, args.heads).to(device)
    if rank == args.slow_rank:
        model.slow_ms = args.slow_ms
    ddp = DDP(model, device_ids=[local_rank] if cuda else None)
    opt = torch.optim.AdamW(ddp.parameters(), lr=args.lr)
    data = batches(args.vocab, args.seq, args.batch_size, seed=1000 + rank, device=device)

    if agent is not None:
        agent.watch(ddp)
        agent.profile(ddp, next(data)[0], opt)

    first_loss = last_loss = math.nan
    warmup = min(5, args.steps - 1)
    loop_started = time.perf_counter()
    for step in range(args.steps):
        if step == warmup:
            loop_started = time.perf_counter()
        if agent is None:
            x, y = next(data)
            loss = F.cross_entropy(ddp(x).flatten(0, 1), y.flatten())
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            last_loss = loss.item() if step in (0, args.steps - 1) else last_loss
        else:
            with agent.step(step) as s:
                with s.phase("data"):
                    x, y = next(data)
                with s.phase("forward"):
                    loss = F.cross_entropy(ddp(x).flatten(0, 1), y.flatten())
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

    # The all-reduce keeps every replica identical: check it.
    flat = torch.cat([q.detach().reshape(-1) for q in model.parameters()]).double()
    reference = flat.clone()
    dist.broadcast(reference, src=0)
    identical = torch.equal(flat, reference)
    agreed = torch.tensor([1.0 if identical else 0.0], device=device)
    dist.all_reduce(agreed, op=dist.ReduceOp.MIN)
    in_sync = bool(agreed.item() == 1.0)

    report = agent.finish() if agent is not None else None
    # Every rank's finish report, gathered as numbers (no pickling).
    fields = ("rows_sent", "rows_unsent", "rows_dropped", "connected")
    mine = torch.tensor(
        [float(getattr(report, f)) if report is not None else -1.0 for f in fields],
        dtype=torch.float64,
        device=device,
    )
    gathered = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(gathered, mine)
    reports = [
        None if t[0] < 0 else {"rank": r, **{f: int(v) for f, v in zip(fields, t.tolist())}}
        for r, t in enumerate(gathered)
    ]
    if rank == 0:
        result = {
            "world_size": world,
            "steps": args.steps,
            "first_loss": first_loss,
            "last_loss": last_loss,
            "params_in_sync": in_sync,
            "loop_s": loop_s,
            "steps_timed": args.steps - warmup,
            "reports": reports,
        }
        print(f"loss {first_loss:.4f} -> {last_loss:.4f}; parameters identical on all {world} ranks: {in_sync}")
        if args.result:
            with open(args.result, "w") as f:
                json.dump(result, f)
    sys.stdout.flush()
    # Every rank done with gloo before any tears it down (an early teardown can abort
    # a peer still in its last collective).
    dist.barrier()
    dist.destroy_process_group()
    return 0 if in_sync else 3


if __name__ == "__main__":
    code = main()
    # torch's own teardown at interpreter exit (a C++ thread of the gloo backend still
    # joinable) aborts a rank now and then with "terminate called without an active
    # exception", after all of its work is done, and torchrun then fails the job. The
    # work is finished, flushed and torn down above, so the process ends here without
    # running that teardown. (RELIABILITY.md, "Not covered".)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
