"""examples/fsdp_plain.py with the checkpoints a torchrun user adds to survive a
restart: the restart baseline of ``python -m bench.recovery --parallel hsdp``.

    torchrun --nproc-per-node 4 --max-restarts 1 -m bench.baseline.fsdp_restart \\
        --replicas 2 --steps 40 --ckpt-dir ckpt --ckpt-every 10

The plain script's HSDP mesh, model, ``fully_shard``, AdamW, one-cycle schedule,
clipping and data, unchanged (its setup is repeated here: examples/fsdp_plain.py
stays the script the port diffs against). Every ``--ckpt-every`` steps the model
and optimizer go through ``torch.distributed.checkpoint`` (``get_state_dict``: each
rank writes its own shards), then rank 0 writes ``meta.pt`` (steps done, the
scheduler) into the same directory. DCP's save returns on every rank only once its
metadata is written, so a directory holding ``meta.pt`` is a complete checkpoint;
one cut short by a fault has none and is skipped.

On start every rank loads the newest complete checkpoint, if there is one
(``set_state_dict``), and skips the batches its steps consumed (no dropout, so
there is no RNG to restore): torchrun ``--max-restarts`` resumes from it instead
of step 0, and the steps since it are trained again.
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.optim.lr_scheduler import LRScheduler
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

from examples.mlp import MLP, StepLog, infinite, local_device, parse_args, regression_data, save_full_weights

META = "meta.pt"


def newest_checkpoint(root: Path) -> Path | None:
    """The complete checkpoint (a ``step-N`` directory with its ``meta.pt``) of most steps."""
    done = [d for d in root.glob("step-*") if (d / META).exists()] if root.is_dir() else []
    return max(done, key=lambda d: int(d.name.split("-", 1)[1]), default=None)


def save_checkpoint(
    root: Path, step: int, model: nn.Module, opt: torch.optim.Optimizer, sched: LRScheduler
) -> None:
    """Every rank's shards of ``model`` and ``opt`` after ``step`` steps, then rank 0's
    ``meta.pt`` (a collective: every rank calls it)."""
    path = root / f"step-{step:06d}"
    model_sd, optim_sd = get_state_dict(model, opt)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
    if dist.get_rank() == 0:
        tmp = path / f"{META}.tmp.{os.getpid()}"
        torch.save({"step": step, "scheduler": sched.state_dict()}, tmp)
        tmp.replace(path / META)


def load_checkpoint(path: Path, model: nn.Module, opt: torch.optim.Optimizer, sched: LRScheduler) -> int:
    """Load ``path`` into ``model``, ``opt`` and ``sched`` (a collective); its steps done."""
    model_sd, optim_sd = get_state_dict(model, opt)  # the shapes DCP loads into, this rank's shards
    dcp.load({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)  # in place
    set_state_dict(model, opt, model_state_dict=model_sd, optim_state_dict=optim_sd)
    meta = torch.load(path / META, weights_only=False)
    sched.load_state_dict(meta["scheduler"])
    return int(meta["step"])


def main(argv: list[str] | None = None) -> int:
    ours = argparse.ArgumentParser(add_help=False)
    ours.add_argument("--ckpt-dir", required=True, help="checkpoints go (and are looked for) here")
    ours.add_argument("--ckpt-every", type=int, default=10, help="steps between checkpoints")
    ckpt, rest = ours.parse_known_args(argv)
    args = parse_args(rest, __doc__, sharded=True)
    torch.set_num_threads(1)
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    device = local_device()
    shape = (args.replicas, dist.get_world_size() // args.replicas)
    mesh = init_device_mesh(device.type, shape, mesh_dim_names=("replicate", "shard"))
    torch.manual_seed(args.seed)
    model = MLP(hidden=args.hidden, depth=args.depth, dropout=args.dropout).to(device)
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=args.lr, total_steps=max(args.steps, 1))
    data = regression_data(args.samples, seed=args.seed)
    sampler: DistributedSampler[int] = DistributedSampler(data, seed=args.seed)
    loader = DataLoader(data, batch_size=args.batch_size, sampler=sampler)
    root = Path(ckpt.ckpt_dir)
    found = newest_checkpoint(root)
    start = load_checkpoint(found, model, opt, sched) if found is not None else 0
    log = StepLog(args.steps_log)
    batches = itertools.islice(infinite(loader), start, None)
    for step in range(start, args.steps):
        x, y = next(batches)
        x, y = x.to(device), y.to(device)
        loss = F.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)
        opt.step()
        sched.step()
        log.step(step, loss, dist.get_rank())
        if (step + 1) % ckpt.ckpt_every == 0 and step + 1 < args.steps:
            save_checkpoint(root, step + 1, model, opt, sched)
    save_full_weights(model, args.save, dist.get_rank())
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
