"""The DDP example port (examples/ddp_phalanx.py) with what tests need to look inside.

Trains examples.mlp's MLP with the user-loop API exactly as the port does, then
writes this worker's end state to ``--dump DIR/<worker>.pt``: the model's
weights, the optimizer's and the LR scheduler's state_dicts, the sampler's
position and the step count, so a test can compare a joiner with the ranks it
joined. ``--no-track`` registers nothing (the runtime finds model, optimizer and
scheduler itself); ``--no-scheduler`` trains without an LR scheduler;
``--fail-sync W`` makes worker W raise when its state is taken (the first sync).

``--sgd`` trains with SGD instead of AdamW (whose per-element normalisation turns
float-rounding differences of near-zero gradients into learning-rate-sized ones).
``--accumulate`` trains each step's micro-batches one by one
(``job.steps(..., accumulate=True)``: gradient accumulation, the global batch held
across resizes); ``--rank-log DIR`` makes every rank append one JSON line per
committed step to ``DIR/<worker>.jsonl``: its rank, the world size, the sum of its
samples' losses (``loss_sum``), its samples, the learning rate the step used, and
``job.lr_scale`` and ``job.effective_batch`` -- what a test sums into the global
batch's loss and checks the LR rule against.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

from examples.mlp import MLP, local_device, regression_data, save_weights
from phalanx.runtime import ElasticSampler, init
from phalanx.runtime.loop import UserLoop


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--samples", type=int, default=512)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--depth", type=int, default=4)
    p.add_argument("--dropout", type=float, default=0.0)
    p.add_argument("--save")
    p.add_argument("--dump")
    p.add_argument("--no-track", action="store_true")
    p.add_argument("--no-scheduler", action="store_true")
    p.add_argument("--sgd", action="store_true", help="SGD (lr 0.05, momentum 0.9) instead of AdamW")
    p.add_argument("--fail-sync", metavar="WORKER", help="this worker raises when its state is taken")
    p.add_argument("--accumulate", action="store_true", help="one forward/backward per micro-batch")
    p.add_argument("--rank-log", help="every rank: one JSON line per committed step, in DIR/<worker>.jsonl")
    args = p.parse_args()
    torch.set_num_threads(1)
    job = init()
    if args.fail_sync == job.worker:  # a bug in user code met while sending the state

        def broken(self: object) -> dict[str, object]:
            raise TypeError("cannot take this rank's state")

        UserLoop.state_dict = broken  # type: ignore[method-assign,assignment]
    device = local_device()
    torch.manual_seed(0)
    model = job.ddp(MLP(hidden=args.hidden, depth=args.depth, dropout=args.dropout).to(device))
    lr = 0.05 if args.sgd else 3e-3
    opt: torch.optim.Optimizer
    if args.sgd:  # linear in the gradient: a wrong scale shows, float rounding is not amplified
        opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    sched = None
    if not args.no_scheduler:
        sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=max(args.steps, 1))
    data = regression_data(args.samples)
    sampler = ElasticSampler(data, seed=0)
    loader = DataLoader(data, batch_size=args.batch_size, sampler=sampler)
    if not args.no_track:
        job.track(model=model, optimizer=opt, sampler=sampler, **({"scheduler": sched} if sched else {}))
    done = 0
    log = open(Path(args.rank_log) / f"{job.worker}.jsonl", "a") if args.rank_log else None
    for step, batch in job.steps(loader, args.steps, accumulate=args.accumulate):
        step_lr = float(opt.param_groups[0]["lr"])
        if args.accumulate:
            opt.zero_grad()
            loss_sum, samples = 0.0, 0
            for x, y in batch:
                loss = F.mse_loss(model(x.to(device)), y.to(device))
                (loss / len(batch)).backward()
                loss_sum, samples = loss_sum + float(loss) * len(x), samples + len(x)
        else:
            x, y = batch
            loss = F.mse_loss(model(x.to(device)), y.to(device))
            opt.zero_grad()
            loss.backward()
            loss_sum, samples = float(loss) * len(x), len(x)
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)
        opt.step()
        if sched is not None:
            sched.step()
        done = step + 1
        if log is not None and job.step_ok:
            world = job.loop.session.world_size if job.loop.session is not None else 0
            line = {"step": done, "rank": job.rank, "world": world, "loss_sum": loss_sum, "samples": samples}
            line |= {"lr": step_lr, "lr_scale": job.lr_scale, "batch": job.effective_batch}
            log.write(json.dumps(line) + "\n")
            log.flush()
    if job.rank == 0:
        save_weights(model.module, args.save)
    if args.dump and job.rank >= 0:
        out = Path(args.dump) / f"{job.worker}.pt"
        state = {
            "rank": job.rank,
            "steps": done,
            "model": {k: v.detach().cpu() for k, v in model.module.state_dict().items()},
            "optimizer": opt.state_dict(),
            "scheduler": sched.state_dict() if sched is not None else None,
            "sampler": sampler.state_dict(),
        }
        torch.save(state, f"{out}.tmp")
        os.replace(f"{out}.tmp", out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
