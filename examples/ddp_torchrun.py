"""A plain torchrun DDP script with its own checkpoints: what teams run today.

    torchrun --nproc-per-node 4 --max-restarts 3 -m examples.ddp_torchrun --steps 200 \\
        --ckpt /tmp/ckpt.pt --ckpt-every 20 --save final.pt
    phalanx run --nproc-per-node 4 --max-restarts 3 -m examples.ddp_torchrun --steps 200 \\
        --ckpt /tmp/ckpt.pt --ckpt-every 20 --save final.pt      # unchanged

It never imports Phalanx: DistributedSampler, DDP, AdamW, a one-cycle schedule,
gradient clipping, and ``torch.save`` of model, optimizer, schedule and step by
rank 0 every ``--ckpt-every`` steps (written to a temporary file and renamed, so a
kill never leaves half a checkpoint). On start every rank loads the newest
checkpoint, if any, and goes on from its step, reading the batches that step would
have read: a run restarted after a fault ends with the weights of a run without one.

``--events`` (JSON lines, appended): every process writes ``{"event": "start", "rank",
"pid", "world", "attempt", "resume", "ts"}`` when it is ready to train; rank 0 writes
``{"event": "step", "step", "ts", "attempt"}`` after each step. Benchmarks and tests
read it from outside.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

from .mlp import MLP, local_device, regression_data, save_weights


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--batch-size", type=int, default=32, help="samples per rank and step")
    p.add_argument("--samples", type=int, default=4096)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--depth", type=int, default=4)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ckpt", type=Path, help="the checkpoint file (resumed from when present)")
    p.add_argument("--ckpt-every", type=int, default=10)
    p.add_argument("--save", help="rank 0 writes the final weights here")
    p.add_argument("--events", help="JSON-lines log (see the module doc)")
    p.add_argument("--eval-every", type=int, default=0, help="rank 0 evaluates alone every N steps")
    p.add_argument(
        "--eval-s", type=float, default=0.0, help="for this long, the others waiting in the next step"
    )
    return p.parse_args(argv)


def log(path: str | None, **fields: Any) -> None:
    if path:
        with open(path, "a") as f:
            f.write(json.dumps(fields) + "\n")


def batches(loader: DataLoader[Any], sampler: DistributedSampler[Any], start: int) -> Any:
    """The batches of steps ``start``, ``start + 1``, ...: epoch after epoch, as a run
    from step 0 reads them."""
    per_epoch = len(loader)
    epoch, skip = divmod(start, per_epoch)
    while True:
        sampler.set_epoch(epoch)
        for i, batch in enumerate(loader):
            if i >= skip:
                yield batch
        epoch, skip = epoch + 1, 0


def evaluate(module: torch.nn.Module, data: Any, seconds: float, device: torch.device) -> float:
    """Rank 0's evaluation pass, alone, for about ``seconds`` (the others wait for it in
    the next step's all-reduce): the loss over the data, batch after batch, on the bare
    module (no DDP forward, which would start a collective)."""
    deadline, total, n = time.monotonic() + seconds, 0.0, 0
    with torch.no_grad():
        while time.monotonic() < deadline:
            x, y = data[(n * 64) % len(data) : (n * 64) % len(data) + 64]
            total += F.mse_loss(module(x.to(device)), y.to(device)).item()
            n += 1
    return total / max(n, 1)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(1)
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    device = local_device()
    torch.manual_seed(args.seed)
    model = DDP(MLP(hidden=args.hidden, depth=args.depth).to(device))
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=args.lr, total_steps=max(args.steps, 1))
    start = 0
    if args.ckpt is not None and args.ckpt.exists():
        ckpt = torch.load(args.ckpt, map_location=device)
        model.module.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["opt"])
        sched.load_state_dict(ckpt["sched"])
        start = int(ckpt["step"])
    data = regression_data(args.samples, seed=args.seed)
    sampler: DistributedSampler[Any] = DistributedSampler(data, seed=args.seed)
    loader = DataLoader(data, batch_size=args.batch_size, sampler=sampler)
    log(args.events, event="start", rank=rank, pid=os.getpid(), world=world, attempt=attempt, resume=start,
        ts=time.time())  # fmt: skip
    it = batches(loader, sampler, start)
    for step in range(start, args.steps):
        x, y = next(it)
        loss = F.mse_loss(model(x.to(device)), y.to(device))
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)
        opt.step()
        sched.step()
        if rank == 0:
            log(args.events, event="step", step=step + 1, ts=time.time(), attempt=attempt, loss=loss.item())
        done = step + 1
        if rank == 0 and args.eval_every and done % args.eval_every == 0:
            evaluate(model.module, data, args.eval_s, device)
        if args.ckpt is not None and rank == 0 and args.ckpt_every and done % args.ckpt_every == 0:
            tmp = args.ckpt.with_name(f"{args.ckpt.name}.tmp.{os.getpid()}")
            state = {"model": model.module.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict()}
            torch.save({**state, "step": done}, tmp)
            tmp.replace(args.ckpt)
    if rank == 0:
        save_weights(model.module, args.save)
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
