"""The training script torchrun elastic runs for the elastic-training baseline
(bench/baseline/torchrun_elastic.py): a constant global batch on whatever world size
the rendezvous formed, restarted from a checkpoint on every membership change.

    PYTHONPATH=. OMP_NUM_THREADS=1 torchrun --nnodes 2:4 --nproc-per-node 1 --rdzv-backend c10d ... \\
        bench/baseline/elastic_worker.py --steps 100000 --ckpt /tmp/ckpt.pt --steps-log /tmp/steps.jsonl

The MLP of examples/mlp.py (default size) on its regression data, AdamW (lr 1e-3).
Step ``s`` (numbered from 0) trains the global batch of samples ``[s*G, (s+1)*G)`` of
one fixed, seeded permutation of the data set (wrapping around), whatever the world
size ``W``: rank ``r`` takes its contiguous shard (``phalanx.batchplan.shard_sizes``:
the first ``G % W`` shards one larger), weights its mean-squared error by ``n / G``,
and the gradients (and the weighted loss, in the same buffer) are SUM-all-reduced over
the default gloo group, so every rank applies the gradient of the mean loss over the
``G`` samples. No sleeps: a step takes what its compute and all-reduce take.

Rank 0 appends one JSON line per completed step to ``--steps-log``:
``{"step": s, "loss": global loss, "world": W, "ts": unix time, "attempt": a}``, where
``a`` identifies this launch of the workers (rank 0's start time in ms, shared by
broadcast), so that a reader can tell restart rounds apart. Every ``--ckpt-every``
steps rank 0 saves model, optimizer and the next step to ``--ckpt`` atomically (a
temporary file renamed over it); at start every rank loads it if present and resumes
from its step, so a restart redoes the steps since the last checkpoint. With
``--starts-log`` rank 0 also appends one line per launch with the wall times of its
start-up: ``proc_start`` (process created), ``imports``/``imported`` (this module's
imports: torch and the model), ``pg_ready`` (``init_process_group`` returned),
``ready`` (checkpoint loaded, about to train), and ``resume_step``.
"""

from __future__ import annotations

import time

_T_IMPORTS = time.time()  # before the imports it times

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402

from examples.mlp import MLP, regression_data  # noqa: E402
from phalanx.batchplan import shard_sizes  # noqa: E402

_T_IMPORTED = time.time()


def process_start_time() -> float | None:
    """Wall time this process was created (Linux ``/proc``, 10 ms resolution)."""
    try:
        fields = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
        stat = Path("/proc/stat").read_text().splitlines()
        btime = next(int(ln.split()[1]) for ln in stat if ln.startswith("btime"))
        return btime + int(fields[19]) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return None


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, required=True, help="train steps 0..steps-1")
    ap.add_argument("--global-batch", type=int, default=48)
    ap.add_argument("--samples", type=int, default=4096, help="data set size")
    ap.add_argument("--seed", type=int, default=0, help="model init, data and permutation")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--ckpt", type=Path, required=True, help="checkpoint file (saved and resumed)")
    ap.add_argument("--ckpt-every", type=int, default=10, help="save after every N steps (0: never)")
    ap.add_argument("--steps-log", type=Path, required=True, help="rank 0's JSON lines (appended)")
    ap.add_argument("--starts-log", type=Path, default=None, help="rank 0's start-up times (appended)")
    args = ap.parse_args(argv)
    if args.steps < 0 or args.global_batch < 1 or args.samples < 1 or args.ckpt_every < 0:
        ap.error("--steps and --ckpt-every must be >= 0, --global-batch and --samples >= 1")
    return args


def batch_indices(step: int, global_batch: int, perm: torch.Tensor) -> torch.Tensor:
    """Indices of step ``step``'s global batch: ``[s*G, (s+1)*G)`` of ``perm``, wrapping."""
    pos = torch.arange(step * global_batch, (step + 1) * global_batch) % len(perm)
    return perm[pos]


def shard_range(global_batch: int, world: int, rank: int) -> tuple[int, int]:
    """``[start, end)`` of rank ``rank``'s contiguous shard of the global batch."""
    sizes = shard_sizes(global_batch, world)
    start = sum(sizes[:rank])
    return start, start + sizes[rank]


def save_checkpoint(path: Path, model: nn.Module, opt: torch.optim.Optimizer, step: int) -> None:
    """``{"model", "optim", "step"}`` (``step``: the next step to run), atomically."""
    tmp = path.with_name(f"{path.name}.tmp.{os.getpid()}")
    torch.save({"model": model.state_dict(), "optim": opt.state_dict(), "step": step}, tmp)
    tmp.replace(path)


def load_checkpoint(path: Path, model: nn.Module, opt: torch.optim.Optimizer) -> int:
    """The step to resume from (0 without a checkpoint)."""
    if not path.exists():
        return 0
    state: dict[str, Any] = torch.load(path, weights_only=True)
    model.load_state_dict(state["model"])
    opt.load_state_dict(state["optim"])
    return int(state["step"])


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    pg_ready = time.time()
    try:
        rank, world = dist.get_rank(), dist.get_world_size()
        torch.manual_seed(args.seed)
        model = MLP()
        opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
        data = regression_data(args.samples, seed=args.seed)
        x_all, y_all = data.tensors
        perm = torch.randperm(args.samples, generator=torch.Generator().manual_seed(args.seed))
        start = load_checkpoint(args.ckpt, model, opt)
        attempt = torch.tensor([int(time.time() * 1000) if rank == 0 else 0], dtype=torch.int64)
        dist.broadcast(attempt, 0)
        if rank == 0 and args.starts_log is not None:
            with open(args.starts_log, "a") as f:
                start_line = {
                    "attempt": int(attempt),
                    "world": world,
                    "resume_step": start,
                    "restart_count": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")),
                    "proc_start": process_start_time(),
                    "imports": _T_IMPORTS,
                    "imported": _T_IMPORTED,
                    "pg_ready": pg_ready,
                    "ready": time.time(),
                }
                f.write(json.dumps(start_line) + "\n")
        lo, hi = shard_range(args.global_batch, world, rank)
        weight = (hi - lo) / args.global_batch
        params = [p for p in model.parameters() if p.requires_grad]
        numel = sum(p.numel() for p in params)
        flat = torch.zeros(numel + 1)  # the gradients and the weighted loss: one all-reduce
        log = open(args.steps_log, "a") if rank == 0 else None  # closed below
        try:
            for step in range(start, args.steps):
                idx = batch_indices(step, args.global_batch, perm)[lo:hi]
                opt.zero_grad(set_to_none=False)
                loss = nn.functional.mse_loss(model(x_all[idx]), y_all[idx]) * weight
                loss.backward()
                offset = 0
                for p in params:
                    n = p.numel()
                    flat[offset : offset + n].copy_(p.grad.view(-1))  # type: ignore[union-attr]
                    offset += n
                flat[numel] = loss.detach()
                dist.all_reduce(flat, op=dist.ReduceOp.SUM)
                offset = 0
                for p in params:
                    n = p.numel()
                    p.grad.view(-1).copy_(flat[offset : offset + n])  # type: ignore[union-attr]
                    offset += n
                opt.step()
                if log is not None:
                    line = {
                        "step": step,
                        "loss": float(flat[numel]),
                        "world": world,
                        "ts": time.time(),
                        "attempt": int(attempt),
                    }
                    log.write(json.dumps(line) + "\n")
                    log.flush()
                if rank == 0 and args.ckpt_every and (step + 1) % args.ckpt_every == 0:
                    save_checkpoint(args.ckpt, model, opt, step + 1)
        finally:
            if log is not None:
                log.close()
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
