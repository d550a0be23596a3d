"""A sharded job's tiered checkpoints: the recovery of last resort when every replica of a
shard is lost.

A joiner takes its shards from a live member at its mesh position
(:func:`phalanx.runtime.session.state_sources`). Where no member holds some position
-- plain FSDP (one replica group) losing a rank, or every replica of a shard lost at
once -- there is no peer to take it from. With ``job.checkpoint(every=N)`` every
rank saves its shards every ``N`` committed steps, through DCP and
:class:`phalanx.checkpoint.dcp.TieredWriter`: a part on its node's keeper, one
checkpoint tied by the coordinator (replicated and drained by the keepers like any).
When a generation has a position nobody holds, every member loads the newest complete
checkpoint through :class:`~phalanx.checkpoint.dcp.TieredReader`, each its own shards
(DCP reshards), and the job goes on from that step: survivors step back with it.

What is saved: the tracked model and optimizers through DCP's ``get_state_dict``
(FQN keys, DTensor shards; an optimizer with no state yet is initialized first, so a
joiner can load into it), the other tracked objects' ``state_dict`` (sampler, LR
schedulers: the same on every rank, stored once), each rank's RNG state under its
rank (restored only at the same world size: it is what makes the resumed run its
fault-free run, bitwise), and the step.

Saves are synchronous and go to shared memory (the keeper makes them durable, off the
training loop); their collectives run on the mesh's groups under a bound, and one that
fails fails the save (nothing is committed: the set is registered last) and starts the
recovery that follows.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from phalanx.checkpoint.client import Checkpointer, NoCheckpoint
from phalanx.checkpoint.dcp import TieredReader, TieredWriter
from phalanx.checkpoint.wire import WireError
from phalanx.runtime.comm import CommError
from phalanx.runtime.mesh import Guard, Mesh
from phalanx.runtime.rng import rng_state
from phalanx.telemetry import get_logger

__all__ = ["Restored", "ShardedCheckpoints"]


class _Status(Protocol):
    def enter_collective(self, bound_s: float) -> None: ...


@dataclass(frozen=True)
class Restored:
    step: int
    tier: str
    rng: dict[str, Any] | None  # this rank's, when the checkpoint has one for it


class _Bounded:
    """The mesh's guard while a checkpoint is saved or loaded: every collective under
    ``bound_s`` (the detector sees it as in a collective), and a failure raises."""

    def __init__(self, status: _Status, bound_s: float) -> None:
        self.status, self.bound_s = status, bound_s

    def collective_bound_s(self) -> float | None:
        return self.bound_s

    def collective_started(self, bound_s: float, what: str) -> None:
        self.status.enter_collective(bound_s)

    def collective_done(self, ms: float) -> None:
        pass

    def collective_failed(self, err: CommError) -> None:
        raise err


class ShardedCheckpoints:
    """``job.checkpoint(every=N)`` of a job with a ``job.mesh()`` (see the module doc)."""

    def __init__(self, job: str, every: int, mesh: Mesh, tracked: dict[str, Any], status: _Status) -> None:
        """``every``: as :meth:`phalanx.runtime.loop.UserLoop.checkpoint` checked it."""
        models = [o for o in tracked.values() if isinstance(o, nn.Module)]
        if len(models) != 1:
            raise TypeError(
                f"job.checkpoint() needs exactly one tracked model (job.track(model=...)), got {len(models)}"
            )
        self.job, self.every, self.mesh, self.status = job, every, mesh, status
        self.model = models[0]
        self.optimizers = [o for o in tracked.values() if isinstance(o, torch.optim.Optimizer)]
        self.others = {
            name: o for name, o in tracked.items() if o is not self.model and o not in self.optimizers
        }
        self.log = get_logger(component="checkpoint", job=job)

    def due(self, step: int) -> bool:
        return step > 0 and step % self.every == 0

    # -- save ------------------------------------------------------------------------------
    def save(self, step: int, rank: int, bound_s: float) -> CommError | None:
        """Save this rank's shards as checkpoint ``step`` (every member calls it after the
        same committed step). A collective that failed here is returned (the generation is
        over: recovery follows); a save DCP reports failed is logged and training goes on.
        Either way nothing of this step was committed."""
        t0 = time.perf_counter()
        state = self._state(rank, step)
        try:
            with self._guarded(bound_s):
                dcp.save(state, storage_writer=TieredWriter(self.job, step))
        except CommError as err:
            self.log.warning("checkpoint_failed", step=step, error=str(err))
            return err
        except CheckpointException as exc:  # any rank's failure (its keeper's...), on every rank
            # Nothing was committed; training goes on (a lost peer fails the next step).
            self.log.warning("checkpoint_failed", step=step, error=str(exc)[:2000])
            return None
        self.log.info("checkpoint_saved", step=step, seconds=round(time.perf_counter() - t0, 4))
        return None

    # -- restore ---------------------------------------------------------------------------
    def restore(self, rank: int, bound_s: float) -> Restored | None:
        """Load the newest checkpoint every member can read (collective: the members
        agree on the step), each rank its own shards; None when there is none."""
        try:
            steps = sorted((c.step for c in Checkpointer(self.job).list()), reverse=True)
        except (OSError, WireError) as exc:  # no keeper on this node: this rank has none to offer
            self.log.warning("checkpoints_unlisted", error=str(exc)[:1000])
            steps = []
        with self._guarded(bound_s):
            limit = 2**62
            while True:
                mine = next((s for s in steps if s <= limit), -1)
                step = self._least(mine)
                if step < 0:
                    return None
                try:
                    reader: TieredReader | None = TieredReader(self.job, step)
                except (NoCheckpoint, ValueError, OSError, WireError) as exc:
                    self.log.warning("checkpoint_unreadable", step=step, error=str(exc)[:1000])
                    reader = None
                if self._least(int(reader is not None)):
                    assert reader is not None
                    break
                if reader is not None:
                    reader.close()
                limit = step - 1
            try:
                return self._load(reader, rank, step)
            finally:
                reader.close()  # the verified files it holds open

    def _load(self, reader: TieredReader, rank: int, step: int) -> Restored:
        keys = reader.read_metadata().state_dict_metadata.keys()
        state = self._state(rank, -1)
        mine = f"r{rank}"
        saved_world = len({k.split(".")[1] for k in keys if k.startswith("rng.")})
        if saved_world != dist.get_world_size():
            state.pop("rng")  # saved at another world size: each rank keeps its own
        dcp.load(state, storage_reader=reader)
        if state["step"] != step:
            raise ValueError(f"checkpoint {step} of {self.job} says it is step {state['step']!r}")
        set_state_dict(
            self.model, self.optimizers, model_state_dict=state["model"], optim_state_dict=state["optim"]
        )
        for name, obj in self.others.items():
            obj.load_state_dict(state["extra"][name])
        rng = state["rng"][mine] if "rng" in state else None
        return Restored(step, reader.loaded.tier, rng)

    # -- helpers ---------------------------------------------------------------------------
    def _state(self, rank: int, step: int) -> dict[str, Any]:
        model, optim = get_state_dict(self.model, self.optimizers)
        return {
            "model": model,
            "optim": optim,
            "extra": {name: obj.state_dict() for name, obj in self.others.items()},
            "rng": {f"r{rank}": rng_state()},
            "step": step,
        }

    def _least(self, value: int) -> int:
        """The smallest of every member's ``value`` (what all of them agree on)."""
        t = torch.tensor([value], dtype=torch.int64, device=torch.device(self.mesh.device_mesh.device_type))
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        return int(t.item())

    @contextmanager
    def _guarded(self, bound_s: float) -> Iterator[None]:
        """The mesh's groups under :class:`_Bounded` for the block (the step's guard after)."""
        previous: Guard | None = self.mesh.world.guard
        self.mesh.set_guard(_Bounded(self.status, bound_s))
        try:
            yield
        finally:
            self.mesh.set_guard(previous)
