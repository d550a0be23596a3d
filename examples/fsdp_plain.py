"""A plain torchrun FSDP2 script, HSDP: examples/fsdp_phalanx.py is its port to Phalanx.

    torchrun --nproc-per-node 4 -m examples.fsdp_plain --replicas 2 --steps 60 --save plain.pt

A (replicate, shard) device mesh, ``fully_shard`` on every linear layer and on
the root, its own loop, a DataLoader over a DistributedSampler, AdamW, a
one-cycle LR schedule and gradient clipping (over DTensor gradients).
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

from .mlp import MLP, StepLog, infinite, local_device, parse_args, regression_data, save_full_weights


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv, __doc__, sharded=True)
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
    log = StepLog(args.steps_log)
    batches = infinite(loader)
    for step in range(args.steps):
        x, y = next(batches)
        x, y = x.to(device), y.to(device)
        loss = F.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)
        opt.step()
        sched.step()
        log.step(step, loss, dist.get_rank())
    save_full_weights(model, args.save, dist.get_rank())
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
