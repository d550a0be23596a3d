"""Steady step time of plain torch DDP, without Phalanx: the reference for Phalanx's
steady-state overhead.

    python -m bench.baseline.plain_ddp [--nproc 4] [--steps 20] [--warmup 3]

:func:`measure_step_time` spawns ``nproc`` ranks (gloo over loopback, one thread
each) that train the same model on the same data and global batch as the baseline
(:class:`bench.baseline.train_ddp.Trainer`), with no checkpoints and no torchrun.
Rank 0 times each step (the allreduce makes it wait for the slowest rank); the
first ``warmup`` steps are left out of the median.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from bench.baseline.torchrun import REPO
from bench.baseline.train_ddp import build_trainer
from examples.corpus import DEFAULT_OUT, build_corpus
from phalanx.devstack.natsserver import free_port


def _worker(rank: int, nproc: int, port: int, args: argparse.Namespace, steps: int, result: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=nproc,
        timeout=timedelta(seconds=300),
    )
    try:
        tr = build_trainer(args, nproc, rank)
        times = []
        for step in range(steps):
            t0 = time.perf_counter()
            tr.step(step)
            times.append(time.perf_counter() - t0)
        if rank == 0:
            Path(result).write_text(json.dumps(times))
    finally:
        dist.destroy_process_group()


def measure_step_time(
    nproc: int = 4,
    steps: int = 20,
    warmup: int = 3,
    *,
    global_batch: int = 16,
    seq_len: int = 128,
    seed: int = 0,
    micro_batch: int = 0,
    data: str | os.PathLike[str] | None = None,
) -> dict[str, Any]:
    """Median steady step time (seconds) of plain DDP over ``nproc`` ranks, with the
    per-step times of rank 0."""
    if steps <= warmup:
        raise ValueError(f"need steps > warmup, got steps={steps} warmup={warmup}")
    if data is None:
        data = REPO / DEFAULT_OUT
        build_corpus(Path(data))  # idempotent
    args = argparse.Namespace(
        data=Path(data),
        seq_len=seq_len,
        seed=seed,
        lr=1e-3,
        weight_decay=0.1,
        global_batch=global_batch,
        micro_batch=micro_batch,
    )
    with tempfile.TemporaryDirectory() as tmp:
        result = Path(tmp) / "times.json"
        mp.start_processes(
            _worker,
            args=(nproc, free_port(), args, steps, str(result)),
            nprocs=nproc,
            join=True,
            start_method="spawn",
        )
        times = json.loads(result.read_text())
    steady = times[warmup:]
    return {
        "median_step_s": statistics.median(steady),
        "min_step_s": min(steady),
        "max_step_s": max(steady),
        "step_s": times,
        "nproc": nproc,
        "global_batch": global_batch,
        "seq_len": seq_len,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m bench.baseline.plain_ddp", description=__doc__.split("\n\n")[0]
    )
    ap.add_argument("--nproc", type=int, default=4)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--global-batch", type=int, default=16)
    args = ap.parse_args(argv)
    r = measure_step_time(args.nproc, args.steps, args.warmup, global_batch=args.global_batch)
    print(json.dumps({k: v for k, v in r.items() if k != "step_s"}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
