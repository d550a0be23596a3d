"""Train the byte-level GPT under Phalanx: the example a user's script follows.

    phalanx run --nproc 4 --spares 1 -- python -m examples.train_gpt --steps 200

Compared with a plain DDP script, the changes are: ``phalanx.runtime.init()``
instead of ``init_process_group``, and a :class:`~phalanx.runtime.trainer.Trainer`
(given a loss function and the data stream's shards) instead of ``DDP(model)``
and the hand-written loop. Rank 0 of the last generation writes the final
weights with ``--save`` so runs can be compared bit for bit.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
import torch.nn.functional as F

from phalanx.checkpoint import Checkpointer
from phalanx.runtime.data import DataStream
from phalanx.runtime.job import init
from phalanx.runtime.trainer import Trainer

from .corpus import DEFAULT_OUT, build_corpus
from .gpt import GPT, GPTConfig

SMALL = ["--n-layer", "2", "--n-embd", "64", "--seq-len", "64", "--global-batch", "12", "--micro-batch", "2"]
"""A GPT small enough for many CPU ranks on one machine (~50 ms a step): tests and demo."""


def command(
    steps: int,
    data: str | os.PathLike[str],
    *extra: str,
    save: str | os.PathLike[str] | None = None,
    steps_log: str | os.PathLike[str] | None = None,
) -> list[str]:
    """The command line that runs this script (what ``phalanx run -- ...`` is given)."""
    cmd = [sys.executable, "-m", __name__, "--steps", str(steps), "--data", str(data)]
    if save is not None:
        cmd += ["--save", str(save)]
    if steps_log is not None:
        cmd += ["--steps-log", str(steps_log)]
    return [*cmd, *extra]


def lm_loss(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    logits, _ = model(x)
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--global-batch", type=int, default=16)
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--n-layer", type=int, default=GPTConfig.n_layer)
    p.add_argument("--n-embd", type=int, default=GPTConfig.n_embd)
    p.add_argument("--n-head", type=int, default=GPTConfig.n_head)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--data", default=str(DEFAULT_OUT))
    p.add_argument(
        "--prepare-ahead",
        type=int,
        default=2,
        help="prepare this rank's next N shards in shared memory, for a replacement on this node",
    )
    p.add_argument(
        "--checkpoint-every",
        type=int,
        default=0,
        help="snapshot the state every N steps into the tiers (needs state-replication on each node);"
        " a relaunched job resumes from the newest complete one",
    )
    p.add_argument("--save", help="rank 0 writes the final state_dict here")
    p.add_argument("--steps-log", help="rank 0 appends one JSON line per completed step")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(1)
    job = init()  # 1. register with the job, heartbeat, follow plans
    if not Path(args.data).exists():
        build_corpus(Path(args.data))
    cfg = GPTConfig(seq_len=args.seq_len, n_layer=args.n_layer, n_embd=args.n_embd, n_head=args.n_head)
    model = GPT(cfg, seed=args.seed)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=args.weight_decay)
    stream = DataStream.open(args.data, args.seq_len, args.seed, prepared_cache=args.prepare_ahead > 0)
    # Prepared shards are written off the training thread; a joiner taking this
    # rank's index on this node reads them instead of gathering its batch again.
    preparer = ThreadPoolExecutor(1, thread_name_prefix="prepare") if args.prepare_ahead else None
    G, m = args.global_batch, args.micro_batch
    log = open(args.steps_log, "a") if args.steps_log else None

    def on_step(step: int, step_ms: float) -> None:
        if preparer is not None:
            preparer.submit(stream.prepare, step, args.prepare_ahead, G, trainer.world_size, trainer.rank)
        if log is not None and trainer.rank == 0:
            log.write(
                json.dumps(
                    {
                        "step": step,
                        "ms": step_ms,
                        "loss": trainer.last_loss,
                        "world": trainer.world_size,
                        "batch": trainer.effective_batch,
                        "lr_scale": trainer.lr_scale,
                        "worker": job.worker,
                        "generation": trainer.generation,
                        "ts": time.time(),
                    }
                )
                + "\n"
            )
            log.flush()

    trainer = Trainer(  # 2. instead of DDP(model) and the loop
        job,
        model,
        opt,
        batches=lambda step, w, r: stream.shard(step, G, w, r).micro_batches(m),
        loss_fn=lm_loss,
        global_batch=G,
        seed=args.seed,
        data_state=lambda step: stream.position(step, G).to_dict(),
        on_step=on_step,
        checkpoints=Checkpointer(job.job) if args.checkpoint_every else None,
        checkpoint_every=args.checkpoint_every,
    )
    done = trainer.fit(args.steps)
    if args.save and trainer.rank == 0 and done >= args.steps:
        tmp = f"{args.save}.tmp.{os.getpid()}"
        torch.save(model.state_dict(), tmp)
        os.replace(tmp, args.save)
    if preparer is not None:
        preparer.shutdown(wait=True)
    job.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
