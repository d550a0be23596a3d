"""The Phalanx twin of bench/baseline/elastic_worker.py: the same MLP, data, global
batch and optimizer, trained by a Phalanx :class:`~phalanx.runtime.trainer.Trainer`
instead of torchrun, for ``python -m bench.elastic``.

    phalanx run --nnodes 2:2 --node-id a --nproc-per-node 2 --max-nproc 4 ... -- \\
        python -m bench.elastic_mlp --steps 2000 --steps-log steps.jsonl

Step ``s`` (from 0) trains samples ``[s*G, (s+1)*G)`` of the same seeded permutation;
rank ``r`` of ``W`` takes the same contiguous shard (``shard_sizes``), its loss weighted
``n/G`` and SUM-all-reduced: whatever ``W`` is, every step applies the gradient of the
mean loss over the same ``G`` samples. Micro-batches are cut at multiples of
``--micro-batch`` of the global batch, so with ``--exact-reduce`` (the Trainer sums
in float64) a step's update is bitwise the same at every size whose shards are
multiples of it (48 at 2, 3 or 4 replicas with micro-batch 4). Rank 0 appends ``{"step", "loss", "world",
"ts", "ms", "generation"}`` per completed step to ``--steps-log``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from pathlib import Path

import torch
from torch import nn

from bench.baseline.elastic_worker import batch_indices, shard_range
from examples.mlp import MLP, regression_data
from phalanx.runtime.job import init
from phalanx.runtime.trainer import Trainer


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, required=True)
    ap.add_argument("--global-batch", type=int, default=48)
    ap.add_argument("--samples", type=int, default=4096)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--micro-batch", type=int, default=4)
    ap.add_argument("--exact-reduce", action="store_true", help="sum gradients in float64 (Trainer)")
    ap.add_argument("--steps-log", type=Path, required=True)
    ap.add_argument("--save", type=Path, help="rank 0 saves the final weights here")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    job = init()
    torch.manual_seed(args.seed)
    model = MLP()
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    x_all, y_all = regression_data(args.samples, seed=args.seed).tensors
    perm = torch.randperm(args.samples, generator=torch.Generator().manual_seed(args.seed))
    G, m = args.global_batch, args.micro_batch
    log = open(args.steps_log, "a")

    def batches(step: int, world: int, rank: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        lo, hi = shard_range(G, world, rank)
        idx = batch_indices(step, G, perm)
        cuts = [lo, *range((lo // m + 1) * m, hi, m), hi]  # at global multiples of m
        return [(x_all[idx[a:b]], y_all[idx[a:b]]) for a, b in itertools.pairwise(cuts) if b > a]

    def on_step(done: int, step_ms: float) -> None:
        if trainer.rank == 0:
            line = {
                "step": done - 1,
                "loss": trainer.last_loss,
                "world": trainer.world_size,
                "ts": time.time(),
                "ms": step_ms,
                "generation": trainer.generation,
            }
            log.write(json.dumps(line) + "\n")
            log.flush()

    trainer = Trainer(
        job,
        model,
        opt,
        batches=batches,
        loss_fn=lambda m, x, y: nn.functional.mse_loss(m(x), y),
        global_batch=G,
        seed=args.seed,
        on_step=on_step,
        exact_reduce=args.exact_reduce,
    )
    trainer.fit(args.steps)
    if args.save is not None and trainer.rank == 0:
        torch.save(model.state_dict(), args.save)
    log.close()
    job.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
