"""A rank's place in the job's generations: what every training loop on Phalanx shares.

The batteries-included :class:`~phalanx.runtime.trainer.Trainer` and the user's own
loop (:mod:`phalanx.runtime.loop`) both run on a :class:`Session`. It owns the
generation this rank is a member of and everything that happens between two
optimizer steps when that generation breaks:

1. ``abort``: drop the broken communicator (its sockets close, which releases
   peers still blocked in a collective; NCCL aborts for real) and report the
   failed collective to the planner;
2. wait for the planner's next generation (a hot spare takes the lost rank);
3. ``comm_init``: an abandonable arrival barrier on the store the plan names
   (hosted by a launcher; it moves when its node is lost), then a new process
   group under the generation's own prefix, on this node's interface;
4. ``state_transfer``: members all-reduce their step counters; the most advanced
   member sends its state (whatever the loop tracks: model, optimizer, scheduler,
   RNG, data position) to every member behind it -- the joiner, and any survivor
   that missed the last update -- checked end to end (:mod:`.state`);
5. ``data_restore``: the loop positions its data for the new (world, rank);
6. ``first_step``: until the loop's next committed step (:meth:`Session.committed`).

Each phase is timed, traced in the incident's trace and reported (``RECOVERED``).

Gradient collectives carry a per-op timeout learned from this generation's
recent ones, like the detector's compute-stall bound:
``max(PHALANX_COLLECTIVE_FLOOR_MS (2000), PHALANX_COLLECTIVE_FACTOR (4) x the
slowest of the last 20)``, and ``PHALANX_COLLECTIVE_INITIAL_MS`` (60000) until one
has completed in the generation (its first one also waits for a joiner's
forward/backward); never above ``collective_timeout_s``
(``PHALANX_COLLECTIVE_TIMEOUT_S``, 120), the backstop of every other collective.
The bound goes out in every heartbeat (``collective_bound_ms``).

A newer plan that arrives while this rank is blocked in a collective aborts the
communicator from the agent's thread (:meth:`Communicator.abort`): NCCL returns at
once; gloo cannot abort an op in flight and relies on the per-op timeout and the
cascade of peers dropping their groups.
"""

from __future__ import annotations

import functools
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from opentelemetry import context as otel_context
from opentelemetry import trace

from phalanx.bus.subjects import COMM_ERROR, RECOVERED
from phalanx.runtime.comm import CommError, Communicator, Superseded, arrival_barrier, generation_store
from phalanx.runtime.job import Job
from phalanx.runtime.state import checksum, pack, recv_state, send_state
from phalanx.schemas import CollectiveError, Phase, Plan, RecoveryDone, Role
from phalanx.settings import get_settings
from phalanx.telemetry import get_logger

PHASES = ("abort", "comm_init", "state_transfer", "data_restore", "first_step")
COLLECTIVE_WINDOW = 20
"""Gradient collectives whose wall times make the learned per-op timeout."""
_tracer = trace.get_tracer("phalanx.runtime")


class RecoveryError(RuntimeError):
    """Recovery could not proceed (no plan came, or a peer's state does not fit);
    the process exits and is replaced."""


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
    checkpoint_tier: str = ""  # the tier a last-resort restore read from (rank 0 only)

    def mark(self, phase: str, start: float) -> float:
        end = time.time()
        self.marks[phase] = (start, end)
        return end


def state_sources(steps: list[int]) -> dict[int, int]:
    """Who sends its state to whom: ``{receiver rank: source rank}``, given each
    member's step (-1: no state yet). The members at the most advanced step hold the
    same state, so the receivers are spread over them round-robin (several joiners
    at once are served in parallel); in a fresh job rank 0 sends to everyone.

    >>> state_sources([7, 7, -1, -1, 6])
    {2: 0, 3: 1, 4: 0}
    >>> state_sources([-1, -1, -1])
    {1: 0, 2: 0}
    """
    best = max(steps)
    if best < 0:  # a fresh job: rank 0's initial state is the reference (like DDP)
        holders, receivers = [0], list(range(1, len(steps)))
    else:
        holders = [r for r, s in enumerate(steps) if s == best]
        receivers = [r for r, s in enumerate(steps) if s != best]
    return {r: holders[i % len(holders)] for i, r in enumerate(receivers)}


class Session:
    """Membership, state sync and recovery for one training process.

    >>> session = Session(job, state=my_loop, device=torch.device("cpu"))
    >>> session.join(restore=my_loop.restore)      # blocks until a plan gives a rank
    >>> session.allreduce_(grads)                  # raises CommError when the group broke
    >>> session.committed(step_ms)                 # step += 1, reports a recovery's first step
    """

    def __init__(
        self,
        job: Job,
        state: Stateful,
        *,
        device: torch.device | None = None,
        collective_timeout_s: float | None = None,
        rendezvous_timeout_s: float = 60.0,
        plan_timeout_s: float = 120.0,
        checkpoints: LastResort | None = None,
    ) -> None:
        self.job, self.state = job, state
        self.checkpoints = checkpoints
        self.device = device or torch.device("cpu")
        settings = get_settings()
        self.collective_timeout_s = collective_timeout_s or settings.collective_timeout_s
        self.collective_floor_s = settings.collective_floor_ms / 1e3
        self.collective_factor = settings.collective_factor
        self.collective_initial_s = settings.collective_initial_ms / 1e3
        self._collective_ms: deque[float] = deque(maxlen=COLLECTIVE_WINDOW)
        self.rendezvous_timeout_s = rendezvous_timeout_s
        self.plan_timeout_s = plan_timeout_s
        self.log = get_logger(component="session", worker=job.worker)
        self.step = 0
        self.generation = 0
        self.rank = -1
        self.world_size = 0
        self.comm: Communicator | None = None
        self.plan: Plan | None = None  # the plan of the generation being joined or run
        self.recoveries = 0
        self.pending: Recovery | None = None  # reported once the first step after it commits
        self._seen = 0  # newest generation looked at (a spare skips plans that leave it out)
        self._has_state = False
        self._lock = threading.Lock()  # (comm, generation) as the agent's thread sees them

    # -- collectives -------------------------------------------------------------------
    def collective_bound_s(self) -> float:
        """The per-op timeout of the next gradient collective (see the module doc)."""
        if self._collective_ms:
            bound = max(self.collective_floor_s, self.collective_factor * max(self._collective_ms) / 1e3)
        else:
            bound = max(self.collective_floor_s, self.collective_initial_s)
        return min(bound, self.collective_timeout_s)

    def record_collective(self, ms: float) -> None:
        self._collective_ms.append(ms)

    def enter_collective(self, bound_s: float) -> None:
        status = self.job.status
        status.collective_bound_ms = bound_s * 1e3
        status.enter(Phase.COLLECTIVE)

    def allreduce_(self, t: torch.Tensor) -> None:
        """SUM ``t`` in place over the generation under the learned bound."""
        comm = self.comm
        if comm is None:
            raise CommError("no communicator: this rank is between generations")
        bound = self.collective_bound_s()
        self.enter_collective(bound)
        start = time.perf_counter()
        comm.allreduce_sum_(t, bound)
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
        report the failure, and join the next one."""
        now = time.time()
        # Out of the collective at once: the detector tells the peers that left from
        # one hung inside it (collective_hang) by this phase, a heartbeat later.
        self.job.status.enter(Phase.RECOVERING)
        rec = Recovery(now)
        self._drop_comm()  # the cascade: peers blocked on us fail now
        rec.mark("abort", now)
        if err is not None:
            self.log.warning("collective_failed", step=self.step, generation=self.generation, error=str(err))
            self.job.agent.publish(
                COMM_ERROR,
                CollectiveError(
                    job=self.job.job,
                    worker=self.job.worker,
                    rank=self.rank,
                    generation=self.generation,
                    step=self.step,
                    error=str(err)[:2000],
                    launch=self.job.agent.launch,
                ),
                job=self.job.job,
                worker=self.job.worker,
            )
        self._join(rec, restore, first=False)

    def committed(self, step_ms: float, started: float, loss: float | None = None) -> None:
        """One optimizer step, begun at wall time ``started``, is done everywhere:
        count it (with its ``loss``, when known, for the run's record), and report the
        recovery whose first step it was."""
        self.step += 1
        status = self.job.status
        status.completed(self.step, step_ms, loss)
        status.enter(Phase.COMPUTE)
        if self.pending is not None:
            self.pending.mark("first_step", started)
            self._report(self.pending)
            self.pending = None

    def finish(self) -> None:
        """The last step is done: leave the group together (nobody closes sockets a
        peer still reads from)."""
        comm = self.comm
        if comm is not None:
            try:
                comm.barrier()
            except CommError as err:
                self.log.warning("final_barrier_failed", error=str(err))
            self._drop_comm()

    def _drop_comm(self) -> None:
        with self._lock:
            comm, self.comm = self.comm, None
        if comm is not None:
            comm.destroy()

    def _abort_on_newer_plan(self, plan: Plan) -> None:
        """From the agent's thread: a newer plan ends this generation, so a collective
        blocked in it can only fail; NCCL is released now instead of at its timeout.
        gloo cannot abort an op in flight: its ranks see the plan at the next step's
        start, or their collective fails by the cascade or its timeout."""
        with self._lock:
            comm, generation = self.comm, self.generation
        planned = plan.planned and plan.generation == generation + 1  # waits for the step boundary
        if comm is not None and comm.abortable and plan.generation > generation and not planned:
            threading.Thread(target=comm.abort, name="phalanx-abort", daemon=True).start()

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
            status.enter(Phase.RECOVERING)
            rec.incident, rec.context = plan.incident, env.context
            if self.generation == 0 and self.job.role is Role.SPARE:
                rec.role = "joiner"
            comm = None
            try:
                self.job.faults.fire(self.job.worker, "recovery", plan.generation)
                t = time.time()
                store = generation_store(self.job.store_at(plan.store_addr), plan.store_secret)
                arrival_barrier(
                    store,
                    plan.store_prefix,
                    rank,
                    plan.world_size,
                    functools.partial(agent.superseded, plan.generation),
                    self.rendezvous_timeout_s,
                )
                comm = Communicator(
                    store,
                    plan.store_prefix,
                    rank,
                    plan.world_size,
                    self.collective_timeout_s,
                    bind=self.job.bind,
                    device=self.device,
                )
                t = rec.mark("comm_init", t)
                rec.bytes_received = self._sync_state(comm, rank, rec)
                t = rec.mark("state_transfer", t)
                self.plan = plan
                restore(plan.world_size, rank)
                rec.mark("data_restore", t)
            except (Superseded, CommError) as exc:
                if comm is not None:
                    comm.destroy()
                self.log.warning("generation_abandoned", generation=plan.generation, error=str(exc))
                continue
            with self._lock:
                self.comm, self.generation = comm, plan.generation
            self.rank, self.world_size = rank, plan.world_size
            status.rank, status.generation = rank, plan.generation
            self._collective_ms.clear()  # a new group (maybe of another size): learn its times afresh
            self.recoveries += 0 if first else 1
            self.pending = rec
            self.log.info(
                "generation_joined",
                generation=plan.generation,
                rank=rank,
                world_size=plan.world_size,
                step=self.step,
                phases_ms={k: round((e - s) * 1000, 2) for k, (s, e) in rec.marks.items()},
            )
            return

    def _member_steps(self, comm: Communicator, rank: int) -> list[int]:
        """Every member's step (-1: holds no state)."""
        steps_t = torch.zeros(comm.world_size, dtype=torch.int64)
        steps_t[rank] = self.step + 2 if self._has_state else 1
        comm.allreduce_sum_(steps_t, self.collective_timeout_s)
        return [int(s) - 2 for s in steps_t.tolist()]

    def _sync_state(self, comm: Communicator, rank: int, rec: Recovery | None = None) -> int:
        """Bring every member to the most advanced member's state; returns bytes received.

        When no member holds state (a relaunched job, or every holder lost) and a
        checkpoint store is configured, rank 0 loads the newest complete checkpoint
        and is the source for everyone: the recovery of last resort."""
        steps = self._member_steps(comm, rank)
        if max(steps) < 0 and self.checkpoints is not None:
            if rank == 0:
                self._load_checkpoint(rec)
            steps = self._member_steps(comm, rank)
        fresh = max(steps) < 0
        source = state_sources(steps)
        received = 0
        mine_to = [r for r, src in source.items() if src == rank]
        if mine_to:
            state = {"step": self.step, "state": self.state.state_dict()}
            meta, buf = pack(state, device=self.device)
            crc = checksum(buf)
            for r in mine_to:
                send_state(comm, meta, buf, crc, r)
        elif rank in source:
            src = source[rank]
            got, received = recv_state(comm, src)
            step = got.get("step") if isinstance(got, dict) else None
            if type(step) is not int or step < 0 or not isinstance(got.get("state"), dict):
                raise RecoveryError(f"rank {src} sent a state without a step: {sorted(got)[:8]}")
            self.step = self.job.status.step = step
            self.state.load_state_dict(got["state"], fresh=fresh)
        self._has_state = True
        return received

    def _load_checkpoint(self, rec: Recovery | None) -> None:
        assert self.checkpoints is not None
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
        self._has_state = True
        if rec is not None:
            rec.checkpoint_tier = loaded.tier
        self.log.warning(
            "restored_from_checkpoint",
            step=step,
            tier=loaded.tier,
            seconds=round(time.perf_counter() - t0, 3),
        )

    def _report(self, rec: Recovery) -> None:
        phases_ms = {k: (e - s) * 1000.0 for k, (s, e) in rec.marks.items()}
        if rec.role != "start" or rec.incident or rec.checkpoint_tier:
            for name in PHASES:
                if name not in rec.marks:
                    continue
                s, e = rec.marks[name]
                span = _tracer.start_span(
                    name,
                    context=rec.context,
                    start_time=int(s * 1e9),
                    attributes={
                        "phalanx.job": self.job.job,
                        "phalanx.worker": self.job.worker,
                        "phalanx.rank": self.rank,
                        "phalanx.generation": self.generation,
                        "phalanx.incident": rec.incident or "",
                        "phalanx.role": rec.role,
                        "phalanx.step": self.step,
                        "phalanx.bytes_received": rec.bytes_received,
                        "phalanx.reused_gradients": rec.reused_grads,
                        "phalanx.checkpoint.tier": rec.checkpoint_tier,
                    },
                )
                span.end(end_time=int(e * 1e9))
        self.job.agent.publish(
            RECOVERED,
            RecoveryDone(
                job=self.job.job,
                generation=self.generation,
                worker=self.job.worker,
                rank=self.rank,
                step=self.step,
                incident=rec.incident,
                phases_ms=phases_ms,
            ),
            job=self.job.job,
            worker=self.job.worker,
        )


__all__ = [
    "PHASES",
    "Recovery",
    "RecoveryError",
    "Removed",
    "Restore",
    "Session",
    "Stateful",
    "state_sources",
]
