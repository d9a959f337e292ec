"""The quick start: rankscope demo --script train.py (or torchrun --nproc-per-node 2 train.py)."""
import argparse, os, torch, torch.distributed as dist, torch.nn as nn, rankscope

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=100)
steps = parser.parse_args().steps
cuda, local_rank = torch.cuda.is_available(), int(os.environ.get("LOCAL_RANK", 0))
device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
if cuda:
    torch.cuda.set_device(device)
dist.init_process_group("nccl" if cuda else "gloo")
agent = rankscope.init()  # rank, world size and run id from torchrun; settings from RANKSCOPE_*
model = nn.Sequential(nn.Linear(32, 256), nn.ReLU(), nn.Linear(256, 10)).to(device)
model = nn.parallel.DistributedDataParallel(model, device_ids=[local_rank] if cuda else None)
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
agent.watch(model)  # every layer with parameters, and the gradient all-reduce
for step in range(steps):
    with agent.step(step) as s:
        with s.phase("data"):
            x, y = torch.randn(64, 32, device=device), torch.randint(0, 10, (64,), device=device)
        with s.phase("forward"):
            loss = nn.functional.cross_entropy(model(x), y)
        with s.phase("backward"):
            loss.backward()
        with s.phase("optimizer"):
            opt.step(); opt.zero_grad()
        s.record(loss=loss.detach(), lr=1e-3, samples=len(x))
agent.finish()  # send the rest and wait for the collector (at most 10 s)
dist.barrier(); dist.destroy_process_group()
os._exit(0)  # skip torch's teardown at exit, which can abort a DDP rank (docs/python.md)
