"""examples/fsdp_plain.py ported to Phalanx: the same HSDP mesh, ``fully_shard``,
loop, DataLoader, AdamW, one-cycle LR schedule and gradient clipping, now
surviving lost ranks in place, each joiner taking its shards from a replica.

    phalanx run --nproc 4 --spares 1 -- python -m examples.fsdp_phalanx --replicas 2 --steps 60 --save port.pt

``diff examples/fsdp_plain.py examples/fsdp_phalanx.py`` shows the port: ``init()``
instead of ``init_process_group``, ``job.mesh`` instead of ``init_device_mesh``
(its groups follow the generations), an ``ElasticSampler`` instead of
``DistributedSampler``, ``job.track`` (what moves to a joiner: only its shards)
and ``job.steps`` as the loop header. ``--checkpoint-every N`` adds tiered
checkpoints (``job.checkpoint``), the last resort when every replica of a shard is
lost (plain FSDP, ``--replicas 1``, losing any rank).
"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.utils.data import DataLoader

from phalanx.runtime import ElasticSampler, init

from .mlp import MLP, StepLog, parse_args, regression_data, save_full_weights


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv, __doc__, sharded=True)
    torch.set_num_threads(1)
    job = init()
    device = job.device
    shape = (args.replicas, -1)
    mesh = job.mesh(shape, ("replicate", "shard"))
    torch.manual_seed(args.seed)
    model = MLP(hidden=args.hidden, depth=args.depth, dropout=args.dropout).to(device)
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=args.lr, total_steps=max(args.steps, 1))
    data = regression_data(args.samples, seed=args.seed)
    sampler = ElasticSampler(data, seed=args.seed)
    loader = DataLoader(data, batch_size=args.batch_size, sampler=sampler)
    log = StepLog(args.steps_log)
    job.track(model=model, optimizer=opt, scheduler=sched, sampler=sampler)
    if args.checkpoint_every:  # where the job resumes if every replica of a shard is lost
        job.checkpoint(every=args.checkpoint_every)
    for step, (x, y) in job.steps(loader, args.steps):
        x, y = x.to(device), y.to(device)
        loss = F.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)
        opt.step()
        sched.step()
        job.report_loss(loss)  # kept with the step for `phalanx report`
        if job.step_ok:  # a failed step is redone: log it once, when it commits
            log.step(step, loss, job.rank)
    save_full_weights(model, args.save, job.rank)
    return 0


if __name__ == "__main__":
    sys.exit(main())
