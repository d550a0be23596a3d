"""The model, data and bookkeeping shared by the DDP example pair.

``examples/ddp_plain.py`` is a plain torchrun DDP script; ``examples/ddp_phalanx.py``
is the same script ported to Phalanx. Everything they share lives here, so that
the two files differ exactly in the lines the port changes::

    diff examples/ddp_plain.py examples/ddp_phalanx.py
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


class MLP(nn.Sequential):
    """A regression MLP: ``depth`` hidden layers of ``hidden`` units (GELU).

    The default (about 0.8 M parameters, 3.3 MB of fp32 gradients) makes DDP
    build two gradient buckets after its first iteration, so bucketing and the
    overlap of communication with backward are really exercised."""

    def __init__(
        self, d_in: int = 64, hidden: int = 512, depth: int = 4, d_out: int = 8, dropout: float = 0.0
    ) -> None:
        layers: list[nn.Module] = []
        width = d_in
        for _ in range(depth):
            layers += [nn.Linear(width, hidden), nn.GELU()]
            if dropout:
                layers.append(nn.Dropout(dropout))
            width = hidden
        super().__init__(*layers, nn.Linear(width, d_out))


def regression_data(samples: int = 4096, d_in: int = 64, d_out: int = 8, seed: int = 0) -> TensorDataset:
    """A fixed synthetic task: ``y = tanh(x W) + noise``, the same on every rank."""
    g = torch.Generator().manual_seed(10_000 + seed)
    x = torch.randn(samples, d_in, generator=g)
    w = torch.randn(d_in, d_out, generator=g) / d_in**0.5
    y = torch.tanh(x @ w) + 0.05 * torch.randn(samples, d_out, generator=g)
    return TensorDataset(x, y)


def infinite(loader: DataLoader[Any]) -> Iterator[Any]:
    """The loader's batches, epoch after epoch, telling its sampler each epoch."""
    epoch = 0
    while True:
        loader.sampler.set_epoch(epoch)  # type: ignore[attr-defined]
        yield from loader
        epoch += 1


def local_device() -> torch.device:
    """torchrun's: ``cuda:<LOCAL_RANK>`` when CUDA is present, else the CPU."""
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
        return device
    return torch.device("cpu")


def parse_args(
    argv: list[str] | None = None, doc: str | None = None, sharded: bool = False
) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=doc)
    if sharded:
        p.add_argument("--replicas", type=int, default=2, help="HSDP replica groups (the rest shard)")
    p.add_argument(
        "--checkpoint-every",
        type=int,
        default=0,
        help="the Phalanx port: tiered checkpoint every N steps (the plain script ignores it)",
    )
    p.add_argument("--steps", type=int, default=100, help="optimizer steps to train")
    p.add_argument("--batch-size", type=int, default=32, help="samples per rank and step")
    p.add_argument("--samples", type=int, default=4096, help="dataset size (an epoch)")
    p.add_argument("--hidden", type=int, default=512, help="MLP hidden width")
    p.add_argument("--depth", type=int, default=4, help="MLP hidden layers")
    p.add_argument("--dropout", type=float, default=0.0, help="dropout after each hidden layer")
    p.add_argument("--lr", type=float, default=3e-3, help="peak learning rate (one-cycle schedule)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--save", help="rank 0 writes the final weights (state_dict) here")
    p.add_argument("--steps-log", help="rank 0 appends one JSON line per step: step, ms, loss")
    p.add_argument(
        "--eval-every",
        type=int,
        default=0,
        help="the Phalanx port: every N steps rank 0 evaluates the model for --eval-s seconds while the"
        " others wait (inside job.pause; the plain script ignores it)",
    )
    p.add_argument("--eval-s", type=float, default=5.0, help="how long each evaluation pass runs")
    p.add_argument(
        "--eval-undeclared",
        action="store_true",
        help="evaluate without job.pause (what a script that declares nothing gets)",
    )
    args = p.parse_args(argv)
    if sharded and args.replicas < 1:
        p.error("--replicas must be >= 1")
    if args.steps < 0 or args.batch_size < 1 or args.samples < 1 or not 0.0 <= args.dropout < 1.0:
        p.error("--steps must be >= 0, --batch-size and --samples >= 1, --dropout in [0, 1)")
    if args.checkpoint_every < 0:
        p.error("--checkpoint-every must be >= 0 (0: no checkpoints)")
    if args.eval_every < 0 or not args.eval_s > 0:
        p.error("--eval-every must be >= 0 (0: no evaluation) and --eval-s > 0")
    return args


def evaluate(model: nn.Module, data: TensorDataset, seconds: float, device: torch.device) -> float:
    """An evaluation pass of ``seconds``: the mean loss over ``data``, batch after
    batch (round and round), until the time is up. ``model`` is the bare module (a DDP
    model's ``.module``: its forward would sync buffers with the other ranks); in eval
    mode and without gradients it draws no random numbers (nor does slicing the
    tensors: a DataLoader's iterator would draw its base seed)."""
    was_training, total, n = model.training, 0.0, 0
    model.eval()
    xs, ys = data.tensors
    end = time.monotonic() + seconds
    with torch.no_grad():
        while time.monotonic() < end:
            i = (n * 256) % len(xs)
            x, y = xs[i : i + 256].to(device), ys[i : i + 256].to(device)
            total += float(nn.functional.mse_loss(model(x), y))
            n += 1
    model.train(was_training)
    return total / max(n, 1)


class StepLog:
    """Rank 0's JSON lines: ``{"step": steps done, "ms": wall time since the last
    line, "loss": this rank's loss, "ts": unix time}`` (the Phalanx ports log a
    step only when ``job.step_ok``: a step redone after a recovery logs once)."""

    def __init__(self, path: str | None) -> None:
        self.file = open(path, "a") if path else None  # closed at exit
        self.last = time.perf_counter()

    def step(self, step: int, loss: torch.Tensor, rank: int) -> None:
        now = time.perf_counter()
        if self.file is not None and rank == 0:
            ms = (now - self.last) * 1000.0
            self.file.write(
                json.dumps({"step": step + 1, "ms": ms, "loss": float(loss.detach()), "ts": time.time()})
                + "\n"
            )
            self.file.flush()
        self.last = now


def save_weights(model: nn.Module, path: str | None) -> None:
    """Write ``model.state_dict()`` to ``path`` atomically (no partial file)."""
    if path:
        tmp = f"{path}.tmp.{os.getpid()}"
        torch.save({k: v.detach().cpu() for k, v in model.state_dict().items()}, tmp)
        Path(tmp).replace(path)


def save_full_weights(model: nn.Module, path: str | None, rank: int) -> None:
    """A sharded (FSDP2) model's full weights, gathered on every rank (a collective:
    every rank calls it) and written by ``rank`` 0 like :func:`save_weights` (under
    Phalanx ``job.rank``: -1 on a worker the job left behind)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if path and rank == 0:
        tmp = f"{path}.tmp.{os.getpid()}"
        torch.save({k: v.detach().cpu() for k, v in full.items() if isinstance(v, torch.Tensor)}, tmp)
        Path(tmp).replace(path)
