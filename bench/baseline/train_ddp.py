"""The baseline training script: plain DDP under torchrun, restarted from DCP checkpoints.

This is what users run instead of Phalanx, and what the benchmarks compare against:
``torch.distributed.elastic`` (torchrun) restarts the whole worker group when a rank
dies; every rank then reloads the latest complete ``torch.distributed.checkpoint``
(DCP) checkpoint and redoes the steps since. Same model (examples.gpt), data
(phalanx.runtime.data: the same global batch, sliced across ranks the same way),
seed and AdamW as the Phalanx runs. No sleeps or handicaps.

    PYTHONPATH=. torchrun --nproc-per-node 4 --max-restarts 3 --rdzv-backend c10d \\
        --rdzv-endpoint 127.0.0.1:29400 bench/baseline/train_ddp.py \\
        --steps 40 --ckpt-dir /tmp/ckpt --log-file /tmp/log.jsonl --kill-at-step 23 --kill-rank 1

(set ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``: see bench/baseline/run.py). Steps are
numbered from 0; step ``s`` trains on global batch ``s``. A checkpoint taken after
step ``s`` holds ``step = s + 1``, the next step to run.

The log (``--log-file``, JSON lines, appended and flushed) is what the benchmark reads:
``step`` lines from rank 0 after every completed step (``time`` = wall clock),
``start``/``ckpt`` lines from rank 0, and one ``fault`` line from the rank that
kills itself, written just before the SIGKILL.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.nn.parallel import DistributedDataParallel as DDP

from examples.gpt import GPT, GPTConfig
from phalanx.runtime.data import DataStream

COMPLETE = ".complete"  # written by rank 0 once dcp.save has returned everywhere
_CKPT_DIR = re.compile(r"^step_(\d+)$")


def process_start_time() -> float | None:
    """Wall-clock time this process was created (Linux ``/proc``; 10 ms resolution), so
    that the log shows what a restarted worker spends on interpreter start and imports."""
    try:
        fields = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
        btime = next(
            int(ln.split()[1]) for ln in Path("/proc/stat").read_text().splitlines() if ln.startswith("btime")
        )
        return btime + int(fields[19]) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return None


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", type=Path, default=Path("data/corpus.bin"), help="uint8 token file")
    ap.add_argument("--steps", type=int, default=40, help="train steps 0..steps-1")
    ap.add_argument("--global-batch", type=int, default=16)
    ap.add_argument("--micro-batch", type=int, default=0, help="split each shard (0: whole shard)")
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--seed", type=int, default=0, help="model init and data order")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--ckpt-dir", type=Path, required=True)
    ap.add_argument("--ckpt-every", type=int, default=10, help="checkpoint after every N steps (0: never)")
    ap.add_argument("--log-file", type=Path, required=True, help="JSON-lines log (appended)")
    ap.add_argument("--kill-at-step", type=int, default=-1, help="SIGKILL after completing this step")
    ap.add_argument("--kill-rank", type=int, default=0)
    return ap.parse_args(argv)


def log_line(path: Path, **fields: Any) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(fields) + "\n")
        f.flush()


@dataclass
class Trainer:
    """Model, DDP wrapper, optimizer and data of one rank."""

    model: GPT
    ddp: DDP
    opt: torch.optim.AdamW
    data: DataStream
    global_batch: int
    world_size: int
    rank: int
    micro_batch: int = 0

    def step(self, step: int) -> float:
        """One optimizer update on global batch ``step``; returns this rank's shard loss.

        Each micro-batch's mean loss is weighted by ``n * W / G`` so that DDP's
        averaging allreduce yields the gradient of the mean over the global batch,
        also when shards differ in size."""
        shard = self.data.shard(step, self.global_batch, self.world_size, self.rank)
        pieces = shard.micro_batches(self.micro_batch) if self.micro_batch else [(shard.x, shard.y)]
        self.opt.zero_grad(set_to_none=True)
        total = 0.0
        for i, (x, y) in enumerate(pieces):
            sync = i == len(pieces) - 1
            with contextlib.nullcontext() if sync else self.ddp.no_sync():
                _, loss = self.ddp(x, y)
                assert loss is not None
                (loss * (x.shape[0] * self.world_size / self.global_batch)).backward()
            total += loss.item() * x.shape[0]
        self.opt.step()
        return total / len(shard)


def build_trainer(
    args: argparse.Namespace, world_size: int, rank: int, process_group: dist.ProcessGroup | None = None
) -> Trainer:
    torch.manual_seed(args.seed)
    data = DataStream.open(args.data, args.seq_len, args.seed)
    model = GPT(GPTConfig(seq_len=args.seq_len), seed=args.seed)
    ddp = DDP(model, process_group=process_group)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=args.weight_decay)
    return Trainer(model, ddp, opt, data, args.global_batch, world_size, rank, args.micro_batch)


def latest_checkpoint(ckpt_dir: Path) -> tuple[int, Path] | None:
    """``(next step, directory)`` of the newest complete checkpoint, if any."""
    best: tuple[int, Path] | None = None
    if ckpt_dir.is_dir():
        for d in ckpt_dir.iterdir():
            m = _CKPT_DIR.match(d.name)
            if m and (d / COMPLETE).is_file() and (best is None or int(m[1]) > best[0]):
                best = (int(m[1]), d)
    return best


def save_checkpoint(tr: Trainer, ckpt_dir: Path, next_step: int) -> Path:
    path = ckpt_dir / f"step_{next_step:06d}"
    model_sd, optim_sd = get_state_dict(tr.ddp, tr.opt)
    dcp.save({"model": model_sd, "optim": optim_sd, "step": torch.tensor(next_step)}, checkpoint_id=path)
    if tr.rank == 0:  # dcp.save returns on every rank after the metadata is written
        (path / COMPLETE).write_text(f"{next_step}\n")
    return path


def load_checkpoint(tr: Trainer, path: Path) -> int:
    model_sd, optim_sd = get_state_dict(tr.ddp, tr.opt)
    step = torch.tensor(0)
    dcp.load({"model": model_sd, "optim": optim_sd, "step": step}, checkpoint_id=path)  # in place
    set_state_dict(tr.ddp, tr.opt, model_state_dict=model_sd, optim_state_dict=optim_sd)
    return int(step)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(1)
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    dist.init_process_group("gloo")
    pg_ready = time.time()
    tr = build_trainer(args, world_size, rank)
    start = 0
    found = latest_checkpoint(args.ckpt_dir)
    if found is not None:
        start = load_checkpoint(tr, found[1])
        if start != found[0]:
            raise RuntimeError(f"checkpoint {found[1]} holds step {start}, its name says {found[0]}")
    if rank == 0:
        log_line(
            args.log_file,
            event="start",
            attempt=attempt,
            world_size=world_size,
            resume_step=start,
            proc_start=process_start_time(),
            pg_ready=pg_ready,
            time=time.time(),
        )
    for step in range(start, args.steps):
        t0 = time.time()
        loss = tr.step(step)
        now = time.time()
        if rank == 0:
            log_line(
                args.log_file, event="step", step=step, time=now, step_s=now - t0, loss=loss, attempt=attempt
            )
        if args.ckpt_every and (step + 1) % args.ckpt_every == 0 and step + 1 < args.steps:
            t1 = time.time()
            save_checkpoint(tr, args.ckpt_dir, step + 1)
            t2 = time.time()
            if rank == 0:
                log_line(args.log_file, event="ckpt", step=step + 1, time=t2, ckpt_s=t2 - t1)
        if step == args.kill_at_step and rank == args.kill_rank and attempt == 0:
            log_line(args.log_file, event="fault", step=step, rank=rank, time=time.time(), attempt=attempt)
            os.kill(os.getpid(), signal.SIGKILL)
    if rank == 0:
        log_line(args.log_file, event="done", step=args.steps, time=time.time(), attempt=attempt)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
