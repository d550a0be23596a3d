"""``job.mesh()``: what the user's loop does differently for a sharded model.

The loop itself (:mod:`phalanx.runtime.loop`) is the same for DDP and FSDP2; a
sharded model differs in three places, here:

- the mesh comes from the first plan that names this worker
  (:func:`mesh_for_job`): FSDP2 splits the parameters by the mesh position when
  the model is wrapped, so a hot spare waits for its rank before its script
  builds the model; the plan's ``group_size`` (``phalanx run --group-size``) must
  be the mesh's, or the planner would resize across replica groups;
- what a joiner receives is DTensor shards (:mod:`.shards`), put back into
  DTensors laid out like its own (:func:`load_shards`);
- every collective goes through the mesh's groups, whose guard is the loop
  (:class:`phalanx.runtime.mesh.Guard`).
"""

from __future__ import annotations

import math
from typing import Any, Protocol

import torch

from phalanx.contract import NodePlan, Phase, Role
from phalanx.runtime.comm import CommError
from phalanx.runtime.mesh import Mesh, group_size_of
from phalanx.runtime.session import Member, RecoveryError, Session
from phalanx.runtime.shards import ShardMismatch, from_local, optimizer_template


class _Loop(Protocol):
    """What :class:`StepGuard` uses of :class:`phalanx.runtime.loop.UserLoop`."""

    job: Member
    session: Session | None
    _hooked: bool
    _stepped: bool
    _late: CommError | None

    def step_bound(self) -> float | None: ...

    def _first_bucket(self, session: Session, point: str = "step") -> None: ...

    def _fail(self, err: CommError) -> None: ...


__all__ = ["StepGuard", "first_plan", "load_shards", "mesh_for_job", "mesh_shape"]


class StepGuard:
    """The mesh's :class:`~phalanx.runtime.mesh.Guard` in the user's loop: each
    collective of a step runs under the step's bound and reports to its session; the
    first one of a step is where ``PHALANX_FAULTS``' ``step=N`` strikes, the first
    reduce-scatter where ``reduce=N`` does; a failure fails the step (it is redone
    after recovery) and points the mesh at nothing for the rest of it."""

    def __init__(self, loop: _Loop, mesh: Mesh) -> None:
        self.loop, self.mesh = loop, mesh
        self._reducing_in = -1  # the step whose first reduce-scatter was seen

    def collective_bound_s(self) -> float | None:
        return self.loop.step_bound()

    def collective_started(self, bound_s: float, what: str) -> None:
        loop, session = self.loop, self.loop.session
        assert session is not None
        if not loop._hooked:
            loop._first_bucket(session)
        if what.startswith("reduce_scatter") and self._reducing_in != session.step:
            self._reducing_in = session.step
            loop._first_bucket(session, "reduce")
        session.enter_collective(self.collective_bound_s() or bound_s)  # _first_bucket may set it

    def collective_done(self, ms: float) -> None:
        session = self.loop.session
        assert session is not None
        session.record_collective(ms)
        self.loop.job.status.enter(Phase.COMPUTE)

    def collective_failed(self, err: CommError) -> None:
        """Before the tracked optimizers stepped, the step fails (it is redone after
        recovery); after, it stands (the update was everyone's) and recovery follows it,
        the collective's output (a metric's) left as garbage."""
        loop = self.loop
        if loop._stepped:
            loop._late = loop._late or err
        else:
            loop._fail(err)
        self.mesh.fail()  # the rest of the step's collectives complete at once


def first_plan(job: Member) -> NodePlan:
    """The first plan that gives this worker a rank (a spare waits here, idle)."""
    seen = 0
    if job.role is Role.SPARE:
        job.status.enter(Phase.IDLE)
    while True:
        env = job.agent.wait_plan(seen, None)
        assert env is not None  # no timeout
        seen = env.plan.generation
        if env.plan.rank_of(job.worker) is not None:
            return env.plan


def mesh_for_job(job: Member, shape: tuple[int, ...], names: tuple[str, ...], device: torch.device) -> Mesh:
    """The job's :class:`Mesh` of ``shape`` (:func:`mesh_shape`), at this worker's rank
    in the first plan that names it."""
    plan = first_plan(job)
    rank = plan.rank_of(job.worker)
    assert rank is not None
    shape = mesh_shape(tuple(shape), plan.world_size, plan.group_size)
    return Mesh(job.comm, shape, names, rank=rank, device_type=device.type)


def mesh_shape(shape: tuple[int, ...], world: int, group_size: int) -> tuple[int, ...]:
    """``shape`` (one dimension may be -1: the rest of the world) at a world of ``world``
    ranks in replica groups of ``group_size`` (the job's ``--group-size``).

    The dimensions past the first are a replica group's and stay the job's for life; the
    first (replicate) one follows the world. So a spare that joins a job shrunk to one
    replica group gets ``(1, 2)`` from the script's ``(2, -1)``.

    >>> mesh_shape((2, -1), 4, 2), mesh_shape((2, -1), 2, 2), mesh_shape((-1,), 2, 2)
    ((2, 2), (1, 2), (2,))
    """
    if not shape or sum(1 for d in shape if d == -1) > 1 or any(d == 0 or d < -1 for d in shape):
        raise ValueError(f"mesh shape {shape}: dimensions >= 1, at most one -1 (the rest of the world)")
    known = math.prod(d for d in shape if d != -1)
    as_given = tuple(world // known if d == -1 else d for d in shape)
    if math.prod(as_given) == world and group_size_of(as_given) == group_size:
        return as_given
    inner = shape[1:]
    if len(shape) > 1 and group_size > 1 and world % group_size == 0:
        rest = math.prod(d for d in inner if d != -1)
        if -1 in inner and group_size % rest == 0:
            inner = tuple(group_size // rest if d == -1 else d for d in inner)
        if math.prod(inner) == group_size:
            return (world // group_size, *inner)
    group = group_size_of(as_given)
    raise ValueError(
        f"job.mesh({shape}) at {world} ranks has replica groups of {group} ranks, the job"
        f" {group_size}: start it with `phalanx run --group-size {group}` (so that it grows and"
        " shrinks by whole groups and every rank keeps its shard)"
    )


def load_shards(obj: Any, got: Any, name: str) -> Any:
    """A peer's state of tracked object ``obj`` (shards as plain tensors) with each
    shard back in a DTensor laid out like ``obj``'s own; :class:`RecoveryError` when
    one does not fit."""
    template = optimizer_template(obj, got) if isinstance(obj, torch.optim.Optimizer) else obj.state_dict()
    try:
        return from_local(got, template, name)
    except ShardMismatch as exc:
        raise RecoveryError(str(exc)) from None
