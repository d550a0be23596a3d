"""examples/ddp_plain.py ported to Phalanx: the same loop, DDP, DataLoader, AdamW,
one-cycle LR schedule and gradient clipping, now surviving lost ranks in place.

    phalanx run --nproc 3 --spares 1 -- python -m examples.ddp_phalanx --steps 60 --save port.pt

``diff examples/ddp_plain.py examples/ddp_phalanx.py`` shows the port: ``init()``
instead of ``init_process_group``, ``job.ddp`` instead of ``DDP``, an
``ElasticSampler`` instead of ``DistributedSampler``, ``job.track`` (what moves to
a joiner) and ``job.steps`` as the loop header; ranks come from ``job.rank``.

``--checkpoint-every N`` (``job.checkpoint(every=N)``) also saves that state every
``N`` steps to the tiered store (each node runs a keeper, ``state-replication``): the
same command, relaunched after the whole job was lost, resumes from the newest one.

``--eval-every N`` has rank 0 evaluate the model for ``--eval-s`` seconds every ``N``
steps while the other ranks wait, inside ``job.pause``, which tells the failure
detector the ranks may drift that far apart (``--eval-undeclared``: without it).
"""

from __future__ import annotations

import contextlib
import sys

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

from phalanx.runtime import ElasticSampler, init

from .mlp import MLP, StepLog, evaluate, local_device, parse_args, regression_data, save_weights


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv, __doc__)
    torch.set_num_threads(1)
    job = init()
    device = local_device()
    torch.manual_seed(args.seed)
    model = job.ddp(MLP(hidden=args.hidden, depth=args.depth, dropout=args.dropout).to(device))
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=args.lr, total_steps=max(args.steps, 1))
    data = regression_data(args.samples, seed=args.seed)
    sampler = ElasticSampler(data, seed=args.seed)
    loader = DataLoader(data, batch_size=args.batch_size, sampler=sampler)
    log = StepLog(args.steps_log)
    job.track(model=model, optimizer=opt, scheduler=sched, sampler=sampler)
    if args.checkpoint_every:  # where a relaunch resumes from when the whole job was lost
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
        if args.eval_every and (step + 1) % args.eval_every == 0:
            # every rank enters the pause; rank 0 evaluates while the others wait
            with contextlib.nullcontext() if args.eval_undeclared else job.pause(max_s=4 * args.eval_s + 10):
                if job.rank == 0:
                    print(
                        f"step {step + 1} eval loss {evaluate(model.module, data, args.eval_s, device):.4f}"
                    )
    if job.rank == 0:
        save_weights(model.module, args.save)
    return 0


if __name__ == "__main__":
    sys.exit(main())
