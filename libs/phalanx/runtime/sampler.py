"""``ElasticSampler``: DistributedSampler's order, as a pure function of where the job is.

``torch.utils.data.DistributedSampler`` fixes ``num_replicas`` and ``rank`` when it
is built and always starts an epoch at its first sample. Under Phalanx both
change while the process lives: a joiner takes over a lost rank mid-epoch, and a
shrunk group re-splits what is left of the epoch. So the indices a rank reads
here are a function of ``(seed, epoch, offset, world, rank)`` alone:

- the epoch's order is DistributedSampler's: ``torch.randperm(n)`` drawn from a
  generator seeded with ``seed + epoch`` (or ``range(n)`` without shuffling);
- ``offset`` samples of it are consumed (the whole job's, not one rank's);
- the rest is padded (repeating the epoch's order from its start) or truncated
  (``drop_last``) to a multiple of ``world``, and rank ``r`` reads every
  ``world``-th sample of it from ``r``.

With the same world size, that is exactly what DistributedSampler yields (offset
0 is its whole epoch, and after ``k`` batches of ``b`` its remaining samples are
those from offset ``k * b * world``), so a script gives bitwise the same batches
under torchrun with DistributedSampler and under Phalanx with this sampler.
:meth:`phalanx.runtime.loop.UserLoop.steps` places the sampler (:meth:`place`) before
each pass over the DataLoader and moves the offset on only when a step commits;
its ``state_dict`` is the position at the start of the step in flight.

>>> s = ElasticSampler(range(10), seed=1)
>>> s.place(epoch=0, offset=4, world=2, rank=1)
>>> list(s) == list(DistributedSampler(range(10), 2, 1, seed=1))[2:]
True
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sized
from typing import Any

import torch
from torch.utils.data import Sampler

from phalanx.contract import BatchPlan


class ElasticSampler(Sampler[int]):
    """A DistributedSampler whose world, rank and position Phalanx sets (see the module doc)."""

    def __init__(
        self, dataset: Sized, *, shuffle: bool = True, seed: int = 0, drop_last: bool = False
    ) -> None:
        self.size = len(dataset)
        if self.size < 1:
            raise ValueError("ElasticSampler needs a non-empty dataset")
        self.shuffle, self.seed, self.drop_last = shuffle, int(seed), drop_last
        self.epoch, self.offset = 0, 0
        self.world, self.rank = 1, 0

    def set_epoch(self, epoch: int) -> None:
        """DistributedSampler's call: start ``epoch`` from its first sample."""
        self.place(epoch=epoch, offset=0, world=self.world, rank=self.rank)

    def place(self, *, epoch: int, offset: int, world: int, rank: int) -> None:
        if epoch < 0 or not 0 <= offset <= self.size or world < 1 or not 0 <= rank < world:
            raise ValueError(f"bad sampler position epoch={epoch} offset={offset} world={world} rank={rank}")
        self.epoch, self.offset, self.world, self.rank = epoch, offset, world, rank

    def advance(self, samples: int) -> None:
        """``samples`` more of the epoch are consumed (a committed step: batch x world)."""
        self.offset = min(self.size, self.offset + samples)

    def order(self, epoch: int) -> list[int]:
        """The whole epoch's order, as DistributedSampler draws it."""
        if not self.shuffle:
            return list(range(self.size))
        g = torch.Generator()
        g.manual_seed(self.seed + epoch)
        return torch.randperm(self.size, generator=g).tolist()

    def _total(self) -> int:
        rest = self.size - self.offset
        per_rank = rest // self.world if self.drop_last else math.ceil(rest / self.world)
        return per_rank * self.world

    def __iter__(self) -> Iterator[int]:
        order = self.order(self.epoch)
        total = self._total()
        rest = order[self.offset : self.offset + total]
        while len(rest) < total:  # pad as DistributedSampler does: from the epoch's start
            rest += order[: total - len(rest)]
        return iter(rest[self.rank : total : self.world])

    def __len__(self) -> int:
        return self._total() // self.world

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "offset": self.offset, "seed": self.seed, "size": self.size}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Take a peer's position; refuses (changing nothing) one over other data."""
        if state.get("seed") != self.seed or state.get("size") != self.size:
            raise ValueError(
                f"sampler state for seed={state.get('seed')} size={state.get('size')} does not fit "
                f"this sampler (seed={self.seed}, size={self.size})"
            )
        self.place(epoch=int(state["epoch"]), offset=int(state["offset"]), world=self.world, rank=self.rank)


def per_step(split: BatchPlan | None, batch_size: int, world: int) -> int:
    """DataLoader batches (micro-batches) per step and rank at ``world`` ranks: as many
    whole batches as fit the smallest share of the job's global batch in ``split``
    (``phalanx run --global-batch``; capped by ``--micro-batch`` x ``--max-accum``), so a
    shrunk job reads more per rank, and at least 1 (then the batch follows the world
    size). The job's global batch is held where every share is a whole number of
    batches: ``batch_size x world x per_step`` is the batch a step trains.

    >>> per_step(BatchPlan(global_batch=64, effective_batch=64, world_size=2, shards=[32, 32]), 16, 2)
    2
    >>> per_step(BatchPlan(global_batch=64, effective_batch=64, world_size=3, shards=[22, 21, 21]), 16, 3)
    1
    >>> per_step(BatchPlan(global_batch=48, effective_batch=32, world_size=2, shards=[16, 16]), 4, 2)
    4
    """
    if split is None or split.world_size != world or not split.shards or batch_size < 1:
        return 1
    return max(1, min(split.shards) // batch_size)


def concat(batches: list[Any]) -> Any:
    """DataLoader batches as one: tensors joined along dim 0, through the tuples, lists
    and dicts a collate function makes (what one rank of a shrunk job trains per step
    when it reads the batches of several).

    >>> concat([(torch.zeros(2, 3), torch.ones(2)), (torch.zeros(1, 3), torch.ones(1))])[0].shape
    torch.Size([3, 3])
    """
    first = batches[0]
    if isinstance(first, torch.Tensor):
        return torch.cat(batches)
    if isinstance(first, dict):
        return type(first)({k: concat([b[k] for b in batches]) for k in first})
    if isinstance(first, (list, tuple)):
        joined = [concat(list(parts)) for parts in zip(*batches, strict=True)]
        return type(first)(*joined) if hasattr(first, "_fields") else type(first)(joined)
    raise TypeError(
        f"cannot join DataLoader batches of {type(first).__name__} (tensors, tuples, lists, dicts)"
    )


__all__ = ["ElasticSampler", "concat", "per_step"]
