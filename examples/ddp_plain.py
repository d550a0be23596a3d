"""A plain torchrun DDP script: examples/ddp_phalanx.py is its port to Phalanx.

    torchrun --nproc-per-node 3 -m examples.ddp_plain --steps 60 --save plain.pt

Its own loop with DDP, a DataLoader over a DistributedSampler, AdamW, a
one-cycle LR schedule and gradient clipping.
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

from .mlp import MLP, StepLog, infinite, local_device, parse_args, regression_data, save_weights


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv, __doc__)
    torch.set_num_threads(1)
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    device = local_device()
    torch.manual_seed(args.seed)
    model = DDP(MLP(hidden=args.hidden, depth=args.depth, dropout=args.dropout).to(device))
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
    if dist.get_rank() == 0:
        save_weights(model.module, args.save)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
