"""A rank's place in the job's generations: what every training loop on Phalanx shares.

The batteries-included :class:`~phalanx.runtime.trainer.Trainer` and the user's own
loop (:mod:`phalanx.runtime.loop`) both run on a :class:`Session`. It owns the
generation this rank is a member of and everything that happens between two
optimizer steps when that generation breaks:

1. ``abort``: drop the broken communicator (its sockets close, which releases
   peers still blocked in a collective; NCCL aborts for real) and report the
   failed collective to the planner;
2. wait for the planner's next generation (a hot spare takes the lost rank);
3. ``comm_init``: the job's one :class:`~phalanx.runtime.comm.Communicator` is
   re-pointed at the plan's generation: an abandonable arrival barrier on the
   store the plan names (hosted by a launcher; it moves when its node is lost),
   then a new process group under the generation's own prefix, on this node's
   interface;
4. ``state_transfer``: members all-reduce their step counters; the most advanced
   member sends its state (whatever the loop tracks: model, optimizer, scheduler,
   RNG, data position) to every member behind it -- the joiner, and any survivor
   that missed the last update -- checked end to end (:mod:`.state`);
5. ``data_restore``: the loop positions its data for the new (world, rank);
6. ``first_step``: until the loop's next committed step (:meth:`Session.committed`).

Each phase is timed, traced in the incident's trace and reported (``RECOVERED``).

Every collective of steps 3 and 4 and of training carries a bound
(:mod:`phalanx.runtime.bounds`), which goes out in every heartbeat
(``collective_bound_ms``) while the rank is inside it (phase ``COLLECTIVE``,
generation and rank of the plan being joined from its rendezvous on): a member
hung in any of them is left behind when the others' bounds fire, and the
detector replaces it (``collective_hang``).

A newer plan that arrives while this rank is blocked in a collective aborts the
communicator from the agent's thread (:meth:`Communicator.abort`): NCCL returns at
once; gloo cannot abort an op in flight and relies on the per-op timeout and the
cascade of peers dropping their groups.
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import torch
from opentelemetry import context as otel_context
from opentelemetry import trace

from phalanx.checkpoint.packing import checksum, pack, tensor_bytes
from phalanx.contract import NodePlan, Phase, RecoveryDone, Role
from phalanx.contract.subjects import RECOVERED
from phalanx.runtime.bounds import Bounds
from phalanx.runtime.comm import CommError, Communicator, Superseded
from phalanx.runtime.faults import FaultPlan
from phalanx.runtime.state import recv_state, send_state
from phalanx.settings import RankSettings, load
from phalanx.telemetry import get_logger
from phalanx.worker.agent import Agent
from phalanx.worker.status import RankStatus

PHASES = ("abort", "comm_init", "state_transfer", "data_restore", "first_step")
_tracer = trace.get_tracer("phalanx.runtime")


class Member(Protocol):
    """What a session needs of its process's place in the job
    (:class:`phalanx.runtime.job.Job` is one)."""

    job: str
    worker: str
    role: Role
    status: RankStatus
    agent: Agent
    comm: Communicator
    faults: FaultPlan

    def close(self, *, goodbye: bool = True) -> None: ...


class RecoveryError(RuntimeError):
    """Recovery could not proceed (no plan came, or a peer's state does not fit);
    the process exits and is replaced."""


class StateLost(RecoveryError):
    """Every replica of some state was lost: no member can give it to the generation."""


class Removed(Exception):
    """This worker is not a member of the new generation."""


class Stateful(Protocol):
    """What a session moves to a joiner: ``torch.distributed.checkpoint``'s Stateful,
    told whether the state is a fresh job's reference state (rank 0's initial one)
    or a peer's after some steps."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any], *, fresh: bool) -> None: ...


class Restore(Protocol):
    """Prepares the loop's data for (world_size, rank) at the session's step."""

    def __call__(self, world_size: int, rank: int) -> None: ...


class LastResort(Protocol):
    """Where a group in which no member holds state resumes from
    (:class:`phalanx.checkpoint.Checkpointer`): ``load()`` returns an object with
    ``step``, ``tier`` and ``state`` (``{"step", "state"}`` as saved), or raises
    LookupError when there is no checkpoint."""

    def load(self, step: int | None = None) -> Any: ...


@runtime_checkable
class ShardedLastResort(Protocol):
    """Where a sharded group resumes from when some shard position has no holder
    (:class:`phalanx.runtime.tiered.ShardedCheckpoints`): ``restore`` is collective,
    loads each rank's own shards into the tracked objects, and returns ``step``,
    ``tier`` and ``rng`` (this rank's RNG state, or None), or None when there is none."""

    def restore(self, rank: int, bound_s: float) -> Any: ...


@dataclass
class Recovery:
    """Timestamps (time.time()) of one recovery's phases on this rank."""

    started: float
    marks: dict[str, tuple[float, float]] = field(default_factory=dict)
    incident: str | None = None
    context: otel_context.Context | None = None
    bytes_received: int = 0
    role: str = "survivor"
    reused_grads: bool = False
    computing: bool = False
    """The plan that ended its generation found this rank computing its step, outside
    any collective: there was none to release, and its ``abort`` starts when its next
    collective failed (at once, the group being aborted)."""
    checkpoint_tier: str = ""  # the tier a last-resort restore read from (rank 0 only)

    def mark(self, phase: str, start: float) -> float:
        end = time.time()
        self.marks[phase] = (start, end)
        return end

    def report(self, member: Member, rank: int, generation: int, step: int) -> None:
        """This recovery is over (its first step is done): export its phases as spans
        of the incident's trace and announce it (``RECOVERED``). A job's start is
        announced but not traced unless it restored from a checkpoint."""
        phases_ms = {k: (e - s) * 1000.0 for k, (s, e) in self.marks.items()}
        if self.role != "start" or self.incident or self.checkpoint_tier:
            for name in PHASES:
                if name not in self.marks:
                    continue
                s, e = self.marks[name]
                span = _tracer.start_span(
                    name,
                    context=self.context,
                    start_time=int(s * 1e9),
                    attributes={
                        "phalanx.job": member.job,
                        "phalanx.worker": member.worker,
                        "phalanx.rank": rank,
                        "phalanx.generation": generation,
                        "phalanx.incident": self.incident or "",
                        "phalanx.role": self.role,
                        "phalanx.step": step,
                        "phalanx.bytes_received": self.bytes_received,
                        "phalanx.reused_gradients": self.reused_grads,
                        "phalanx.abort.computing": self.computing,
                        "phalanx.checkpoint.tier": self.checkpoint_tier,
                    },
                )
                span.end(end_time=int(e * 1e9))
        member.agent.publish(
            RECOVERED,
            RecoveryDone(
                job=member.job,
                generation=generation,
                worker=member.worker,
                rank=rank,
                step=step,
                incident=self.incident,
                phases_ms=phases_ms,
                bytes_received=self.bytes_received,
            ),
            job=member.job,
            worker=member.worker,
        )


def unheld(steps: list[int], positions: list[Hashable] | None) -> bool:
    """Whether some member's state is held by nobody at the most advanced step: no
    member holds any (a relaunched job), or a position (a sharded model's) has no
    holder left -- what only a checkpoint can give back."""
    top = max(steps)
    if top < 0 or positions is None:
        return top < 0
    return not set(positions) <= {p for p, s in zip(positions, steps, strict=True) if s == top}


def state_sources(steps: list[int], positions: list[Hashable] | None = None) -> dict[int, int]:
    """Who sends its state to whom: ``{receiver rank: source rank}``, given each
    member's step (-1: no state yet). The members at the most advanced step hold the
    same state, so the receivers are spread over them round-robin (several joiners
    at once are served in parallel); in a fresh job rank 0 sends to everyone.

    With ``positions`` (a sharded model: what each rank holds, its mesh position) a
    receiver takes the state of a holder at its own position only, and a fresh job
    moves nothing (every rank built its own shards, as under torchrun). A position
    no holder is at has no source: :class:`RecoveryError`.

    >>> state_sources([7, 7, -1, -1, 6])
    {2: 0, 3: 1, 4: 0}
    >>> state_sources([-1, -1, -1])
    {1: 0, 2: 0}
    >>> state_sources([7, 7, -1, 7], positions=[0, 1, 0, 1])   # (replicate, shard) = (2, 2)
    {2: 0}
    """
    best = max(steps)
    if positions is None:
        positions = [0] * len(steps)
    elif best < 0:
        return {}
    if best < 0:  # a fresh job: rank 0's initial state is the reference (like DDP)
        holders, receivers = [0], list(range(1, len(steps)))
    else:
        holders = [r for r, s in enumerate(steps) if s == best]
        receivers = [r for r, s in enumerate(steps) if s != best]
    at: dict[Hashable, list[int]] = {}
    for r in holders:
        at.setdefault(positions[r], []).append(r)
    served: dict[Hashable, int] = {}
    out: dict[int, int] = {}
    for r in receivers:
        mine = at.get(positions[r])
        if not mine:
            raise StateLost(
                f"every replica of shard {positions[r]} was lost: rank {r} takes it and no member "
                f"at step {best} holds it"
            )
        n = served[positions[r]] = served.get(positions[r], -1) + 1
        out[r] = mine[n % len(mine)]
    return out


class Session:
    """Membership, state sync and recovery for one training process.

    >>> session = Session(job, state=my_loop, device=torch.device("cpu"))
    >>> session.start(restore=my_loop.restore)     # blocks until a plan gives a rank
    >>> session.allreduce_(grads)                  # raises CommError when the group broke
    >>> session.committed(step_ms, started)        # step += 1, reports a recovery's first step
    """

    def __init__(
        self,
        job: Member,
        state: Stateful,
        *,
        device: torch.device | None = None,
        collective_timeout_s: float | None = None,
        rendezvous_timeout_s: float = 60.0,
        plan_timeout_s: float = 120.0,
        checkpoints: LastResort | ShardedLastResort | None = None,
        position: Callable[[int], Hashable] | None = None,
        gradient_bytes: int = 0,
    ) -> None:
        """``position``: what a rank holds, for a sharded model (its mesh position,
        :meth:`phalanx.runtime.mesh.Mesh.position`): state moves between members at
        the same position only, and a rank keeps its position for its whole life.
        ``gradient_bytes``: what a step's gradient collectives move on this rank (at
        most), which bounds each generation's first all-reduce (:meth:`arrive`)."""
        self.job, self.state = job, state
        self.gradient_bytes = gradient_bytes
        self.position = position
        self._held_position: Hashable = None  # this rank's, once it has joined
        self.checkpoints = checkpoints
        self.device = device or torch.device("cpu")
        settings = load(RankSettings)
        self.collective_timeout_s = collective_timeout_s or settings.collective_timeout_s
        self.bounds = Bounds(
            floor_s=settings.collective_floor_s,
            inside_floor_s=settings.collective_inside_floor_s,
            factor=settings.collective_factor,
            initial_s=settings.collective_initial_s,
            backstop_s=self.collective_timeout_s,
            rendezvous_s=rendezvous_timeout_s,
        )
        self.plan_timeout_s = plan_timeout_s
        self.log = get_logger(component="session", worker=job.worker)
        self.step = 0
        self.generation = 0
        self.rank = -1
        self.world_size = 0
        self.plan: NodePlan | None = None  # the plan of the generation being joined or run
        self.recoveries = 0
        self.pending: Recovery | None = None  # reported once the first step after it commits
        self._seen = 0  # newest generation looked at (a spare skips plans that leave it out)
        self._has_state = False
        self._computing_at_abort = False  # the newer plan's abort found the rank computing

    @property
    def comm(self) -> Communicator:
        """The job's communicator, whatever the generation (between two, it holds none)."""
        return self.job.comm

    # -- collectives -------------------------------------------------------------------
    def collective_bound_s(self) -> float:
        """The per-op timeout of the next gradient collective (:mod:`.bounds`)."""
        return self.bounds.gradient_s()

    def record_collective(self, ms: float) -> None:
        self.bounds.record_collective(ms)

    def enter_collective(self, bound_s: float) -> None:
        self.job.status.enter_collective(bound_s)

    def strike(self, bound_s: float, point: str = "step") -> bool:
        """The step's first gradient collective is about to start (``point`` "step";
        ``reduce``: a sharded model's first reduce-scatter): ``PHALANX_FAULTS`` of
        step N strike here; then, before a generation's first all-reduce, every member
        passes a barrier (:meth:`arrive`: raises :class:`CommError` when the generation
        breaks in it); then the faults of generation G's first all-reduce
        (``collective=G``) strike, inside it. True when one is ``break``, which the
        caller carries out.

        The order is the detector's: a rank that spins or stalls before the barrier
        is a straggler its waiting peers expose; past it, the rank is in COLLECTIVE
        under the all-reduce's bound, so a hang there costs its peers that bound."""
        faults, worker = self.job.faults, self.job.worker
        enter = functools.partial(self.enter_collective, bound_s)
        broke = faults.fire(worker, point, self.step, enter_collective=enter)
        if point == "step" and self.bounds.first_of_generation:
            if not broke:
                self.arrive()
            enter = functools.partial(self.enter_collective, self.collective_bound_s())
            broke = faults.fire(worker, "collective", self.generation, enter_collective=enter) or broke
        return broke

    def arrive(self) -> None:
        """Before a generation's first gradient all-reduce: a barrier under that
        all-reduce's bound (the members' slowest step; the initial bound where none
        has one), so that the all-reduce after it, whose members start together, is
        bounded by its bytes (:mod:`.bounds`): a rank hung inside it costs its peers
        about a second. Raises :class:`CommError` when the generation breaks
        meanwhile; a no-op once this generation's members arrived.

        It leaves the rank in COLLECTIVE under the all-reduce's bound: nothing but
        that all-reduce follows, and a rank hung before it is judged as one inside it."""
        if not self.bounds.awaiting_arrival:
            return
        bound = self.collective_bound_s()
        self.enter_collective(bound)
        self.comm.barrier(bound)
        self.bounds.arrived(self.gradient_bytes)
        self.enter_collective(self.collective_bound_s())

    def allreduce_(self, t: torch.Tensor) -> None:
        """SUM ``t`` in place over the generation under the learned bound."""
        bound = self.collective_bound_s()
        self.enter_collective(bound)
        start = time.perf_counter()
        self.comm.allreduce_sum_(t, bound)
        self.record_collective((time.perf_counter() - start) * 1000.0)

    def superseded(self) -> bool:
        return self.job.agent.superseded(self.generation)

    def resize_vote(self) -> float:
        """1.0 when a newer plan is known (a planned resize), else 0.0: what this rank
        adds to its step's all-reduce. A sum above 0 means every member switches to
        the new generation after this very step (:meth:`reconfigure` with no error)."""
        return 1.0 if self.job.agent.resize_pending(self.generation) else 0.0

    # -- membership ------------------------------------------------------------------------
    def start(self, restore: Restore) -> None:
        """Join the first generation this worker is a member of (a spare waits here)."""
        self.job.agent.on_plan(self._abort_on_newer_plan)
        self._join(Recovery(time.time(), role="start"), restore, first=True)

    def reconfigure(self, err: CommError | None, restore: Restore) -> None:
        """The current generation is over (``err``: its collective failed): drop it,
        report the failure, and join the next one. The ``abort`` phase runs from the
        moment the collective failed (a user's loop finishes its step's compute after
        that) to the group dropped."""
        now = time.time()
        # Out of the collective at once: the detector tells the peers that left from
        # one hung inside it (collective_hang) by this phase, a heartbeat later.
        self.job.status.enter(Phase.RECOVERING)
        left = now if err is None else min(err.at, now)
        rec = Recovery(left, computing=self._computing_at_abort)
        self._computing_at_abort = False
        self.bounds.leave()
        self.comm.release()  # the cascade: peers blocked on us fail now
        rec.mark("abort", left)
        if err is not None:
            self.log.warning("collective_failed", step=self.step, generation=self.generation, error=str(err))
            self.job.agent.report_collective_error(self.rank, self.generation, self.step, str(err))
        self._join(rec, restore, first=False)

    def committed(self, step_ms: float, started: float, loss: float | None = None) -> None:
        """One optimizer step, begun at wall time ``started``, is done everywhere:
        count it (with its ``loss``, when known, for the run's record), and report the
        recovery whose first step it was."""
        self.step += 1
        self.bounds.record_step(step_ms)
        status = self.job.status
        status.completed(self.step, step_ms, loss)
        status.enter(Phase.COMPUTE)
        if self.pending is not None:
            self.pending.mark("first_step", started)
            self.pending.report(self.job, self.rank, self.generation, self.step)
            self.pending = None

    def finish(self, *, release: bool = True) -> None:
        """The last step is done: leave the group together (nobody closes sockets a
        peer still reads from). ``release=False`` keeps the last generation's groups
        for what the script does after its loop (gathering a sharded model's weights)."""
        if self.comm.configured:
            try:
                self.comm.barrier(self.bounds.backstop_s)
            except CommError as err:
                self.log.warning("final_barrier_failed", error=str(err))
            if release:
                self.comm.release()

    def _abort_on_newer_plan(self, plan: NodePlan) -> None:
        """From the agent's thread: a newer plan ends the generation the communicator
        holds, so a collective blocked in it can only fail; it is released now
        (NCCL's abort, gloo's sockets cut: :meth:`Group.abort`) instead of at its
        bound. A planned plan waits for the step boundary and aborts nothing."""
        comm = self.comm
        generation = comm.generation
        planned = plan.planned and plan.generation == generation + 1  # waits for the step boundary
        if comm.configured and plan.generation > generation and not planned:
            self._computing_at_abort = self.job.status.phase is Phase.COMPUTE
            abort = functools.partial(comm.abort, below=plan.generation)
            threading.Thread(target=abort, name="phalanx-abort", daemon=True).start()

    def _join(self, rec: Recovery, restore: Restore, first: bool) -> None:
        agent, status = self.job.agent, self.job.status
        waiting = Phase.IDLE if self.job.role is Role.SPARE and self.generation == 0 else Phase.RECOVERING
        while True:
            status.enter(waiting)
            timeout = None if waiting is Phase.IDLE or first else self.plan_timeout_s
            env = agent.wait_plan(max(self._seen, self.generation), timeout)
            if env is None:
                raise RecoveryError(f"no plan newer than generation {self.generation} in {timeout}s")
            plan = env.plan
            self._seen = plan.generation
            rank = plan.rank_of(self.job.worker)
            if self.job.worker in plan.leaving:  # reclaimed or shrunk away: leave cleanly
                self.rank = status.rank = -1
                self.log.info("leaving_job", generation=plan.generation, reason=plan.reason)
                raise Removed()
            if rank is None:
                if self.generation > 0:
                    self.rank = status.rank = -1  # no rank: a script's `if rank == 0` must not fire
                    raise Removed()
                continue  # a spare not (yet) chosen
            self._keep_position(rank, plan)
            rec.incident, rec.context = plan.incident, env.context
            if self.generation == 0 and self.job.role is Role.SPARE:
                rec.role = "joiner"
            try:
                self._enter(plan, rank, rec, restore)
            except RecoveryError as exc:
                self._unrecoverable(plan, rank, exc)
                raise
            except (Superseded, CommError) as exc:
                self.comm.release()
                status.enter(Phase.RECOVERING)  # it left this generation's collectives
                self.log.warning("generation_abandoned", generation=plan.generation, error=str(exc))
                continue
            self.rank, self.world_size, self.generation = rank, plan.world_size, plan.generation
            self.recoveries += 0 if first else 1
            self.pending = rec
            self.log.info(
                "generation_joined",
                generation=plan.generation,
                rank=rank,
                world_size=plan.world_size,
                step=self.step,
                bytes_received=rec.bytes_received,
                phases_ms={k: round((e - s) * 1000, 2) for k, (s, e) in rec.marks.items()},
            )
            return

    def _unrecoverable(self, plan: NodePlan, rank: int, exc: RecoveryError) -> None:
        """Tell the planner that ``plan``'s generation cannot go on and why, before this
        process ends on ``exc``: the job's stop then names the cause, not the exits."""
        why = str(exc)
        if isinstance(exc, StateLost):
            why += (
                "; a checkpoint (job.checkpoint(every=N)) or a hot spare per replica group would have kept it"
                if self.checkpoints is None
                else "; and no checkpoint every member can read holds it"
            )
        self.log.error("generation_unrecoverable", generation=plan.generation, error=why)
        self.job.agent.report_collective_error(rank, plan.generation, self.step, why, unrecoverable=True)

    def _keep_position(self, rank: int, plan: NodePlan) -> None:
        """A sharded rank holds the shards of its position for life: a plan that
        moves it elsewhere cannot be followed."""
        if self.position is None:
            return
        where = self.position(rank)
        if self._held_position is None:
            self._held_position = where
        elif where != self._held_position:
            raise RecoveryError(
                f"generation {plan.generation} puts {self.job.worker} at rank {rank}, mesh position {where};"
                f" it holds the shards of position {self._held_position}"
            )

    def _enter(self, plan: NodePlan, rank: int, rec: Recovery, restore: Restore) -> None:
        """Become ``rank`` of ``plan``'s generation: its rendezvous (``comm_init``), the
        state transfer, the data restore. From the rendezvous on this rank reports the
        generation it joins, and each collective's bound, so a hang in any is seen."""
        job, status, bounds = self.job, self.job.status, self.bounds
        status.join(rank, plan.generation)
        job.faults.fire(job.worker, "recovery", plan.generation)
        t = time.time()
        status.enter_collective(bounds.arrival_s())

        def connecting() -> None:
            status.enter_collective(bounds.connect_s())
            job.faults.fire(job.worker, "rendezvous", plan.generation)

        self.comm.configure(
            plan,
            cancelled=functools.partial(job.agent.superseded, plan.generation),
            arrival_s=bounds.arrival_s(),
            connect_s=bounds.connect_s(),
            store_s=bounds.store_s(),
            device=self.device,
            connecting=connecting,
        )
        t = rec.mark("comm_init", t)
        rec.bytes_received = self._sync_state(rank, plan.generation, rec)
        t = rec.mark("state_transfer", t)
        status.enter(Phase.RECOVERING)
        self.plan = plan
        restore(plan.world_size, rank)
        rec.mark("data_restore", t)

    def _member_facts(self, rank: int, bound_s: float) -> tuple[list[int], int, float]:
        """Every member's step (-1: holds no state), the largest member's state bytes
        and the slowest recent step of any member (ms), in one all-reduce."""
        comm, n = self.comm, self.comm.world_size
        facts = torch.zeros(3 * n, dtype=torch.int64)
        facts[rank] = self.step + 2 if self._has_state else 1
        facts[n + rank] = tensor_bytes(self.state.state_dict())
        facts[2 * n + rank] = round(self.bounds.slowest_step_ms())
        comm.allreduce_sum_(facts, bound_s)
        steps = [int(s) - 2 for s in facts[:n].tolist()]
        return steps, int(facts[n : 2 * n].max()), float(facts[2 * n :].max())

    def _sync_state(self, rank: int, generation: int, rec: Recovery | None = None) -> int:
        """Bring every member to the most advanced member's state; returns bytes received.

        When no member holds state (a relaunched job, or every holder lost) and a
        checkpoint store is configured, rank 0 loads the newest complete checkpoint
        and is the source for everyone: the recovery of last resort."""
        comm, bounds, status = self.comm, self.bounds, self.job.status
        status.enter_collective(bounds.exchange_s())
        self.job.faults.fire(self.job.worker, "transfer", generation)
        steps, size, slowest = self._member_facts(rank, bounds.exchange_s())
        positions = None if self.position is None else [self.position(r) for r in range(len(steps))]
        if self.checkpoints is not None and unheld(steps, positions):
            status.enter_collective(bounds.backstop_s)  # the load's time is the source's
            if isinstance(self.checkpoints, ShardedLastResort):
                self._restore_shards(rank, rec)
            elif rank == 0:
                self._load_checkpoint(rec)
            steps, size, slowest = self._member_facts(rank, bounds.backstop_s)
        bounds.join(slowest)
        fresh = max(steps) < 0
        source = state_sources(steps, positions)
        received = 0
        mine_to = [r for r, src in source.items() if src == rank]
        if mine_to:
            state = {"step": self.step, "state": self.state.state_dict()}
            meta, buf = pack(state, device=self.device)
            crc = checksum(buf)
            for queued, r in enumerate(mine_to):
                bound = bounds.transfer_s(size, queued)
                status.enter_collective(bound)
                send_state(comm, meta, buf, crc, r, timeout_s=bound)
            self.log.info("state_sent", to=mine_to, bytes=buf.numel(), generation=generation)
        elif rank in source:
            src = source[rank]
            bound = bounds.transfer_s(size, [r for r, s in source.items() if s == src].index(rank))
            status.enter_collective(bound)
            got, received = recv_state(comm, src, timeout_s=bound)
            step = got.get("step") if isinstance(got, dict) else None
            if type(step) is not int or step < 0 or not isinstance(got.get("state"), dict):
                raise RecoveryError(f"rank {src} sent a state without a step: {sorted(got)[:8]}")
            self.step = self.job.status.step = step
            self.state.load_state_dict(got["state"], fresh=fresh)
        self._has_state = True
        return received

    def _restore_shards(self, rank: int, rec: Recovery | None) -> None:
        """Every member loads its shards of the newest checkpoint (see ShardedLastResort)."""
        assert isinstance(self.checkpoints, ShardedLastResort)
        t0 = time.perf_counter()
        got = self.checkpoints.restore(rank, self.bounds.backstop_s)
        if got is None:
            self.log.info("no_checkpoint", reason="no checkpoint every member can read")
            return
        state = self.state.state_dict()  # the tracked objects as just loaded ...
        if got.rng is not None:
            state["rng"] = got.rng  # ... with this rank's RNG state as saved
        self.state.load_state_dict(state, fresh=False)
        self._restored(got.step, got.tier, rec, t0)

    def _load_checkpoint(self, rec: Recovery | None) -> None:
        assert self.checkpoints is not None and not isinstance(self.checkpoints, ShardedLastResort)
        t0 = time.perf_counter()
        try:
            loaded = self.checkpoints.load()
        except LookupError as exc:
            self.log.info("no_checkpoint", reason=str(exc))
            return
        got = loaded.state
        step = got.get("step") if isinstance(got, dict) else None
        if type(step) is not int or step < 0 or not isinstance(got.get("state"), dict):
            raise RecoveryError(f"checkpoint {loaded.step} holds no training state: {type(got).__name__}")
        self.step = self.job.status.step = step
        self.state.load_state_dict(got["state"], fresh=False)
        self._restored(step, loaded.tier, rec, t0)

    def _restored(self, step: int, tier: str, rec: Recovery | None, t0: float) -> None:
        self.step = self.job.status.step = step
        self._has_state = True
        if rec is not None:
            rec.checkpoint_tier = tier
        self.log.warning(
            "restored_from_checkpoint", step=step, tier=tier, seconds=round(time.perf_counter() - t0, 3)
        )


__all__ = [
    "PHASES",
    "Member",
    "Recovery",
    "RecoveryError",
    "Removed",
    "Restore",
    "Session",
    "ShardedLastResort",
    "StateLost",
    "Stateful",
    "state_sources",
    "unheld",
]
