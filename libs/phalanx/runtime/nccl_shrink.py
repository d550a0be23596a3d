"""Shrinking a generation's NCCL communicator instead of building it again.

When a generation is exactly the previous one's members minus some, in the same
order, with no one joining (the planner says so in ``Plan.shrunk``: the previous
generation's ranks left out), the survivors can derive the new NCCL communicator
from the old one with ``ncclCommShrink`` (NCCL >= 2.27; torch exposes it as
``Backend.shrink``, which ``torch.distributed.shrink_group`` calls) instead of a
full ``ncclCommInitRank`` over the store: no unique-id exchange, no bootstrap ring
of N ranks, no topology search from scratch. gloo is still rebuilt over the store
as for any generation (:class:`~phalanx.runtime.comm.Group`).

``shrink_group`` itself cannot be used: it looks the group up in torch's global
registry (``_world.pg_map``), which Phalanx's standalone groups are not in (no
``init_process_group``). So :func:`shrink_backend` calls the backend's
``shrink(sorted ranks, flags, options)`` directly, as ``shrink_group`` does in its
step 5, and registers the child on the new generation's ``ProcessGroup`` itself.

What state the old communicator is in, and so when a shrink is possible
-----------------------------------------------------------------------
:meth:`Communicator.release <phalanx.runtime.comm.Communicator.release>` keeps
("parks") the NCCL backend of the group it drops, unless that group was aborted
or shrinking is off, instead of aborting it; the next ``configure`` either shrinks
it or aborts it (before the full init, so its GPU memory is free again), never
both, never neither. The parked communicator can be in three states:

* intact and idle (a planned resize at a step boundary; a failure seen by gloo's
  cascade while no NCCL op was queued): a shrink works, with either flag;
* intact with ops queued on the NCCL stream that wait on the lost rank (the
  main thread left a gloo op or a DDP future while the GPU still runs an
  all-reduce with the dead peer): only ``NCCL_SHRINK_ABORT`` (``SHRINK_ABORT``)
  can shrink it; it ends those ops first. So an unplanned generation (a failure)
  shrinks with ``SHRINK_ABORT`` and a planned one (every op drained at the step
  boundary) with ``SHRINK_DEFAULT``;
* aborted: ``ncclCommAbort`` ran (:meth:`Group.abort`, a new plan arriving while
  the rank was blocked in an NCCL op, torch's watchdog after an op's timeout or
  error with ``TORCH_NCCL_ASYNC_ERROR_HANDLING=2``, a ``work.wait(timeout)`` that
  expired). Nothing can be derived from it: the generation is built in full.
  Today a peer's death in the middle of an NCCL all-reduce usually ends here (the
  op can only end by abort or timeout), so shrinking pays off mostly for planned
  shrinks and failures caught outside NCCL; shrinking from the agent's thread in
  place of that abort (``SHRINK_ABORT`` also releases the blocked op) is the step
  that would cover the rest, and needs the session to coordinate it.

Agreement. ``ncclCommShrink`` is collective over the survivors: one survivor
that cannot shrink (its communicator aborted, an older torch or NCCL, another
rank arithmetic) while the others call it leaves them blocked in NCCL. So every
member first votes over the new generation's gloo group (one all-reduce of two
integers: MIN of "I can shrink", MAX of "I require a shrink") and all take the
same path. A second vote after the shrink catches a member whose ``shrink``
raised: then everybody drops the child and builds in full. What the votes cannot
cover is a member that dies inside ``ncclCommShrink`` itself: the others wait, as
they would inside ``ncclCommInitRank`` (:mod:`phalanx.runtime.comm`), and the
detector sees them past their connect bound.

The mode (:class:`ShrinkMode`) forces either path, for the GPU benchmark
(``bench/gpu_check.py``): ``off`` always builds in full, ``require`` fails the
generation (:class:`~phalanx.runtime.comm.CommError` on every member, the vote
tells them all) when a plan that names ``shrunk`` cannot be shrunk. It must be the
same on every rank of a job for ``require`` to mean anything; a member with
``off`` makes the others build in full (it votes "cannot").

None of this runs without two GPUs and NCCL >= 2.27: the pure parts
(:func:`shrink_rank`, :func:`can_shrink`, :func:`resolve_mode`) are unit-tested
on the CPU; the rest is measured by ``bench/gpu_check.py`` where GPUs are lent.
"""

from __future__ import annotations

import itertools
import os
from dataclasses import dataclass
from datetime import timedelta
from enum import StrEnum

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import Backend as C10dBackend

# The flags of ncclCommShrink as torch names them (distributed_c10d.py).
SHRINK_DEFAULT = 0x00
SHRINK_ABORT = 0x01

ENV_MODE = "PHALANX_NCCL_SHRINK"


class ShrinkMode(StrEnum):
    """When a generation's NCCL communicator is shrunk from the previous one."""

    AUTO = "auto"  # when the plan allows it and every member can
    OFF = "off"  # never: always a full init
    REQUIRE = "require"  # whenever the plan allows it, or the generation fails


def resolve_mode(mode: ShrinkMode | str | None = None) -> ShrinkMode:
    """``mode``, or the environment's ``PHALANX_NCCL_SHRINK``, or ``auto``;
    :class:`ValueError` on anything else."""
    raw = mode if mode is not None else os.environ.get(ENV_MODE, "") or ShrinkMode.AUTO
    try:
        return ShrinkMode(str(raw).strip().lower())
    except ValueError:
        choices = ", ".join(m.value for m in ShrinkMode)
        raise ValueError(f"NCCL shrink mode {raw!r}: one of {choices}") from None


@dataclass
class Parked:
    """The NCCL backend of a dropped generation, kept for the next one to shrink.

    Owned by one party at a time (the :class:`~phalanx.runtime.comm.Communicator`,
    then the :class:`~phalanx.runtime.comm.Group` being built), which either
    shrinks or aborts it."""

    backend: C10dBackend
    generation: int
    rank: int
    world_size: int
    prefix: str

    def abort(self) -> None:
        """``ncclCommAbort`` on it; never raises (it may have failed already)."""
        try:
            self.backend.abort()
        except Exception:  # already aborted or broken: nothing left to free
            pass


def shrink_rank(old_rank: int, world_size: int, shrunk: list[int]) -> int | None:
    """This rank's rank after the ranks ``shrunk`` of a ``world_size`` group leave:
    ``old_rank`` minus the left-out ranks below it (ncclCommShrink keeps the
    survivors' order); None when ``shrunk`` is no valid exclusion that keeps
    ``old_rank`` (empty, unsorted or repeated, out of range, everyone, or this rank).

    >>> shrink_rank(3, 4, [1])
    2
    >>> shrink_rank(1, 4, [1]) is None
    True
    """
    if not shrunk or any(b <= a for a, b in itertools.pairwise(shrunk)):
        return None
    if shrunk[0] < 0 or shrunk[-1] >= world_size or len(shrunk) >= world_size:
        return None
    if not 0 <= old_rank < world_size or old_rank in shrunk:
        return None
    return old_rank - sum(1 for r in shrunk if r < old_rank)


def can_shrink(
    parked: Parked | None,
    *,
    generation: int,
    rank: int,
    world_size: int,
    shrunk: list[int],
    mode: ShrinkMode,
) -> str | None:
    """Why this member cannot shrink ``parked`` into generation ``generation``
    (where it is ``rank`` of ``world_size``, the plan leaving out ``shrunk``), or
    None when it can. Pure: no NCCL call (:func:`backend_ready` is the check that
    asks the backend)."""
    if mode is ShrinkMode.OFF:
        return "shrinking is off"
    if not shrunk:
        return "the plan is no shrink (someone joins, the order changes, or nobody leaves)"
    if parked is None:
        return "no communicator of the previous generation is held (aborted, or none)"
    if parked.generation != generation - 1:
        return f"the communicator held is of generation {parked.generation}, not {generation - 1}"
    if parked.world_size - len(shrunk) != world_size:
        return f"{parked.world_size} ranks minus {len(shrunk)} is not the plan's {world_size}"
    new = shrink_rank(parked.rank, parked.world_size, shrunk)
    if new is None:
        return f"{shrunk} is no exclusion from {parked.world_size} ranks that keeps rank {parked.rank}"
    if new != rank:
        return f"rank {parked.rank} minus the ranks left out below it is {new}, the plan says {rank}"
    return None


def backend_ready(backend: C10dBackend) -> str | None:
    """Why ``backend`` cannot be shrunk as it is (no support in this torch/NCCL, an
    error already recorded), or None. ``supports_shrinking`` is False for NCCL
    older than 2.27; ``get_error`` exists on NCCL builds only."""
    try:
        if not bool(backend.supports_shrinking):  # type: ignore[attr-defined]  # not in torch's stubs
            return f"{backend.name()} does not support shrinking (NCCL >= 2.27 needed)"
    except Exception as exc:
        return f"cannot ask the backend whether it shrinks: {exc}"
    get_error = getattr(backend, "get_error", None)
    if get_error is not None:
        error = get_error()
        if getattr(error, "name", "SUCCESS") != "SUCCESS":
            return f"the communicator has recorded an error ({error.name})"
    return None


def vote(gloo: dist.ProcessGroup, able: bool, required: bool, timeout: timedelta) -> tuple[bool, bool]:
    """One gloo all-reduce over the new generation: (every member can, some member
    requires). Raises what the all-reduce raises (the caller turns it into
    :class:`~phalanx.runtime.comm.CommError`)."""
    t = torch.tensor([1 if able else 0, -1 if required else 0], dtype=torch.int64)
    opts = dist.AllreduceOptions()
    opts.reduceOp = dist.ReduceOp.MIN  # type: ignore[assignment]  # the stubs mix ReduceOp and RedOpType
    opts.timeout = timeout
    gloo.allreduce([t], opts).wait()
    return bool(t[0] == 1), bool(t[1] == -1)


def shrink_backend(
    parked: Parked, shrunk: list[int], flags: int, prefix: str, timeout: timedelta
) -> C10dBackend:
    """``ncclCommShrink`` of ``parked`` without the ranks ``shrunk``: the new
    generation's backend, already connected (no eager connect follows: that would
    build a second communicator over the store). ``prefix`` names it in NCCL's
    log lines, as :func:`~phalanx.runtime.comm._nccl_backend` does for a full init."""
    from torch._C._distributed_c10d import ProcessGroupNCCL  # only in builds with NCCL
    from torch.distributed.distributed_c10d import GroupName

    opts = ProcessGroupNCCL.Options()
    opts._timeout = timeout
    opts.group_name = GroupName(prefix)
    child: C10dBackend = parked.backend.shrink(sorted(shrunk), flags, opts)  # type: ignore[attr-defined]
    return child


def flags_for(planned: bool) -> int:
    """``SHRINK_DEFAULT`` after a planned change (every op drained at the step
    boundary); ``SHRINK_ABORT`` after a failure (ops may still wait on the lost
    rank on the NCCL stream; the flag ends them first)."""
    return SHRINK_DEFAULT if planned else SHRINK_ABORT


@dataclass
class ShrinkRequest:
    """What :class:`~phalanx.runtime.comm.Group` needs to try a shrink: the parked
    parent (which it now owns), the plan's ``shrunk`` and ``planned``, the mode."""

    parked: Parked | None
    shrunk: list[int]
    planned: bool
    mode: ShrinkMode
    generation: int

    def why_not(self, rank: int, world_size: int) -> str | None:
        """:func:`can_shrink`, then :func:`backend_ready` on the parent."""
        why = can_shrink(
            self.parked,
            generation=self.generation,
            rank=rank,
            world_size=world_size,
            shrunk=self.shrunk,
            mode=self.mode,
        )
        if why is None and self.parked is not None:
            why = backend_ready(self.parked.backend)
        return why

    def release(self) -> None:
        """Abort the parent (after a shrink, or instead of one); idempotent."""
        parked, self.parked = self.parked, None
        if parked is not None:
            parked.abort()
