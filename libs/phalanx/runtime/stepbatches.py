"""The loader batches a user loop's step trains, drawn so that a redone step, or the
same step at a new place, reads exactly what a fault-free run would.

An iterator serves only the position right after its last batch; anything else
places the :class:`~.sampler.ElasticSampler` and starts a new one. The batches of
the step in flight are held with the RNG state from before and after they were
drawn: a step redone at the same (step, world, rank) trains the batch in hand and
continues the RNG from after it; the same step at another place (the world
changed) rewinds the RNG and reads afresh; a state received from a peer carries
the RNG already and reads afresh.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader

from phalanx.contract import BatchPlan
from phalanx.runtime.rng import rng_state, set_rng_state
from phalanx.runtime.sampler import ElasticSampler, per_step

Place = tuple[int, int, int]  # (step, world, rank)


class StepBatches:
    """One loader's batches, step by step (``job.steps``'s)."""

    def __init__(self, loader: DataLoader[Any], sampler: ElasticSampler) -> None:
        self.loader, self.sampler = loader, sampler
        self.batch_size = loader.batch_size or 0
        self._it: Iterator[Any] | None = None
        self._it_at: tuple[int, int, int, int] | None = None  # (epoch, offset, world, rank) of its next batch
        self._rng_before: dict[str, Any] | None = None  # before the held batches were drawn
        self._rng_step = -1  # the step _rng_before belongs to
        self._rng_after: dict[str, Any] | None = None  # after they were
        self._held: tuple[Place, list[Any]] | None = None

    def per_step(self, split: BatchPlan | None, world: int) -> int:
        """Loader batches per rank and step: the plan's split of the global batch."""
        return per_step(split, self.batch_size, world)

    def rng_of(self, step: int) -> dict[str, Any]:
        """The RNG state before ``step``'s batches were drawn (now, if not yet): what a
        joiner continues from."""
        if self._rng_step == step and self._rng_before is not None:
            return self._rng_before
        return rng_state()

    def rejoin(self, place: Place, received: bool) -> None:
        """A generation was joined at ``place``: keep the batches in hand only for that
        very place (and continue the RNG as it was after drawing them); for the same
        step elsewhere, rewind the RNG to read afresh. ``received``: the RNG came from
        a peer."""
        held = self._held
        if received or held is None or held[0] != place:
            self._held = None
            if not received and held is not None and held[0][0] == place[0] and self._rng_before:
                set_rng_state(self._rng_before)
        elif self._rng_after is not None:
            set_rng_state(self._rng_after)

    def committed(self, world: int, split: BatchPlan | None) -> None:
        """The step trained its batches everywhere: the sampler moves past the world's."""
        self._held = None
        self.sampler.advance(self.batch_size * world * self.per_step(split, world))

    def at(self, place: Place, split: BatchPlan | None) -> list[Any]:
        """The loader batches for ``place``: those held if they are for it, else the
        next ones of an iterator at the sampler's position."""
        if self._held is not None and self._held[0] == place:
            return self._held[1]
        step, world, rank = place
        sampler, loader = self.sampler, self.loader
        self._rng_before, self._rng_step = rng_state(), step
        for _ in range(2):  # at most one epoch boundary before a batch
            where = (sampler.epoch, sampler.offset, world, rank)
            if self._it is None or self._it_at != where:
                sampler.place(epoch=sampler.epoch, offset=sampler.offset, world=world, rank=rank)
                if sampler.offset == 0:
                    self._it = iter(loader)  # an epoch begins: it draws its seed, as under torchrun
                else:  # placed mid-epoch: the draw the epoch's start made is in the RNG state already
                    rng = torch.get_rng_state()
                    self._it = iter(loader)
                    torch.set_rng_state(rng)
            try:
                parts = [next(self._it)]
                break
            except StopIteration:
                sampler.place(epoch=sampler.epoch + 1, offset=0, world=world, rank=rank)
                self._it = None
        else:
            raise RuntimeError(
                f"the DataLoader yields nothing in epoch {sampler.epoch} at world size {world}"
            )
        for _ in range(self.per_step(split, world) - 1):  # a shrunk job holding its global batch
            part = next(self._it, None)
            if part is None:
                break  # the epoch's end: a short step, as the fixed-size run's last one
            parts.append(part)
        done = self.batch_size * world * len(parts)
        self._it_at = (sampler.epoch, min(sampler.size, sampler.offset + done), world, rank)
        self._rng_after = rng_state()
        self._held = (place, parts)
        return parts


__all__ = ["StepBatches"]
