"""A data-parallel job's tiered checkpoints: the Trainer's (``checkpoints=``,
``checkpoint_every=N``) and a ``job.ddp()`` user loop's (``job.checkpoint(every=N)``).

Every member of a data-parallel generation holds the same state after a committed
step, so one member's snapshot is the job's. Every ``N`` committed steps the member at
rank ``(step // N) % world`` takes it -- a different one each time, so the copying
spreads over the members and their nodes' keepers -- and puts ``{"step": step,
"state": state}`` into its node's shared memory with one
:meth:`~phalanx.checkpoint.client.Checkpointer.save_async` (the keeper replicates and
drains it, off the loop): the copy runs beside the next step's forward and backward,
and the optimizer's step (guarded), a state loaded from a peer or a failed step's roll
back each :meth:`RotatingSnapshots.fence` first, waiting only for what is left of the
copy (:mod:`phalanx.checkpoint.overlap`). A save that cannot be had now (the keeper
still holds every slot, shared memory is full) returns None: the Checkpointer counts,
logs and reports it, and the loop goes on without waiting.

Where a job resumes from it is the Session's recovery of last resort, not here: the same
Checkpointer is the Session's ``checkpoints=``, and when no member of a generation holds
state (a relaunched job, or every holder lost at once) rank 0 loads the newest complete
checkpoint and sends it to the others (:meth:`phalanx.runtime.session.Session._sync_state`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

from phalanx.settings import RankSettings, load

if TYPE_CHECKING:
    import torch

    from phalanx.checkpoint.client import Checkpointer
    from phalanx.checkpoint.overlap import PendingSave

__all__ = ["RotatingSnapshots", "snapshot_interval"]


def snapshot_interval(every: int | None) -> int:
    """The steps between snapshots: ``every``, checked, or (None) memory's ``every`` in the
    node's tier policy (``PHALANX_CKPT_TIERS``); a ValueError saying what is wrong."""
    if every is None:
        policy = load(RankSettings).ckpt_tiers
        every = policy.snapshot_every if policy is not None else None
        if every is None:
            raise ValueError(
                "checkpoint(every=None) needs memory's every in PHALANX_CKPT_TIERS; pass every=N"
            )
    if type(every) is not int or every < 1:
        raise ValueError(f"checkpoint(every=...) needs an int >= 1, got {every!r}")
    return every


class _Place(Protocol):
    """Where a member stands after a committed step (a :class:`~.session.Session`)."""

    step: int
    rank: int
    world_size: int


class _Log(Protocol):
    def info(self, event: str, **kw: Any) -> Any: ...


class RotatingSnapshots:
    """Every ``every`` committed steps, one member's snapshot of the job's state."""

    def __init__(
        self,
        checkpoints: Checkpointer,
        every: int,
        log: _Log,
        optimizers: tuple[torch.optim.Optimizer, ...] = (),
    ) -> None:
        """``optimizers``: their ``step`` fences the save in flight (they change the state).
        ``every`` must give each durable tier of the node's policy (``PHALANX_CKPT_TIERS``,
        where the rank sees it) the steps it asks for: refused at start otherwise."""
        if type(every) is not int or every < 1:
            raise ValueError(f"checkpoints every N steps need an int N >= 1, got {every!r}")
        policy = load(RankSettings).ckpt_tiers
        if policy is not None:
            policy.check_interval(every)
        self.checkpoints, self.every, self.log = checkpoints, every, log
        for opt in optimizers:
            checkpoints.guard(opt)

    @classmethod
    def of(cls, job: str, every: int, log: _Log, tracked: dict[str, Any]) -> RotatingSnapshots:
        """A user loop's: ``job``'s Checkpointer, the tracked optimizers guarded."""
        import torch

        from phalanx.checkpoint.client import Checkpointer

        optimizers = tuple(o for o in tracked.values() if isinstance(o, torch.optim.Optimizer))
        return cls(Checkpointer(job), every, log, optimizers)

    def fence(self) -> None:
        """Before anything but a guarded optimizer changes the state in place."""
        self.checkpoints.fence()

    def due(self, step: int, rank: int, world_size: int) -> bool:
        """Whether ``rank`` of ``world_size`` snapshots the state after committed step ``step``."""
        return step > 0 and step % self.every == 0 and rank == (step // self.every) % world_size

    def after_step(self, place: _Place, state: Callable[[], dict[str, Any]]) -> PendingSave | None:
        """After each committed step: the snapshot of ``state()`` where it is due on this
        member (``state`` is called only then); None where it is not, or was skipped."""
        if not self.due(place.step, place.rank, place.world_size):
            return None
        return self.save(state(), place.step)

    def save(self, state: dict[str, Any], step: int) -> PendingSave | None:
        """The one save of a data-parallel job's state, overlapped: None when it was
        skipped (never raised, never waited for: see the module doc)."""
        pending = self.checkpoints.save_async({"step": step, "state": state}, step)
        if pending is not None:
            self.log.info("checkpoint_saving", step=step, bytes=pending.claim.size)
        return pending
