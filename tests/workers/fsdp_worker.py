"""examples/fsdp_phalanx.py with the whole job's loss in its steps log, for
tests/e2e/test_elastic.py: rank 0 logs the mean loss over every sample of the step
(all ranks' losses weighted by their samples, one all-reduce), so a run resized
by whole replica groups can be compared with the fixed-size run step by step.
"""

from __future__ import annotations

import json
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.utils.data import DataLoader

from examples.mlp import MLP, parse_args, regression_data, save_full_weights
from phalanx.runtime import ElasticSampler, init


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv, __doc__, sharded=True)
    torch.set_num_threads(1)
    job = init()
    mesh = job.mesh((args.replicas, -1), ("replicate", "shard"))
    torch.manual_seed(args.seed)
    model = MLP(hidden=args.hidden, depth=args.depth)
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=args.lr, total_steps=max(args.steps, 1))
    data = regression_data(args.samples, seed=args.seed)
    sampler = ElasticSampler(data, seed=args.seed)
    loader = DataLoader(data, batch_size=args.batch_size, sampler=sampler)
    job.track(model=model, optimizer=opt, scheduler=sched, sampler=sampler)
    log = open(args.steps_log, "a") if args.steps_log else None
    for step, (x, y) in job.steps(loader, args.steps):
        loss = F.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        # the step's loss over every sample, before the update: a failure here fails the
        # step, which is redone (and logged again); one after the update would stand
        whole = torch.stack([loss.detach() * len(x), torch.tensor(float(len(x)))]).double()
        dist.all_reduce(whole)  # the job's default group: this generation's members
        opt.step()
        sched.step()
        if log is not None and job.rank == 0:
            line = {"step": step + 1, "loss": float(whole[0] / whole[1]), "world": dist.get_world_size()}
            log.write(json.dumps({**line, "ts": time.time()}) + "\n")
            log.flush()
    save_full_weights(model, args.save, job.rank)
    return 0


if __name__ == "__main__":
    sys.exit(main())
