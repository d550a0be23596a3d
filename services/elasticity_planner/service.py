"""The planner service: turns faults into committed, published plans.

Inputs (durable JetStream consumers, so a planner restart loses nothing):
job specs (one per node's launcher), registrations, RankFailed/RankHung,
NodeLost, plan acknowledgements, exits, collective errors. Outputs:
``NodeJoined`` answers to the launchers, ``PlanDecision`` events (every decision
with its reason) and, for a membership change, a ``Plan``.

One record, one truth. Each job's plan and the planner's state for it are one
:class:`~phalanx.schemas.JobRecord` in the ``phalanx_jobs`` bucket under
``<job>.plan``. Every input is handled as a transaction (:meth:`_txn`): the
decision is computed on a private copy of the job's state, the record is written
by compare-and-set on the revision that state was read at, and only then does
the copy become the planner's state and are the answers, decisions and plans
published. A lost compare-and-set (another planner wrote) reloads the record and
decides again; any other error (KV unreachable) leaves the planner's state as it
was and the input is redelivered. A planner that starts rebuilds from the records.

Replicas. Any number of planners may run; they elect a leader by a lease in KV
(:mod:`.lease`). Only the leader consumes inputs. Its fencing token (the lease's
revision) is written into every record and plan; a record carrying a higher
token deposes a planner that still thought it led, and ranks refuse plans with
a lower token than one they have seen. A standby that takes over rewinds the
consumers so that what the dead leader held is delivered at once.

Plans no one can miss. Ranks and launchers watch the job's record; besides, the
planner re-publishes a plan on ``phalanx.cmd.<job>.plan`` until every member has
acknowledged it (or a newer one replaces it).

Inputs are checked: the subject's job, worker and node must match the payload's
(the bus checks that; a rank may publish only on its own worker's subjects, a
launcher only on its own node's), a process exit must come from the launcher of
the node that runs the worker, a collective error and a plan acknowledgement
must come from a member of the current generation and run, and a member that falls silent while its peers report failing collectives
is fenced only with corroboration (a detector verdict, or its launcher having
seen it exit); otherwise the same members re-form, with a growing wait and at
most ``PHALANX_PLANNER_MAX_REFORMS`` times in a row.

Trace: the ``plan`` span (fault received -> plan committed) is a child of the
incident's ``detect`` span; ``notify`` (committed -> every member acknowledged)
follows it. The plan carries the trace context, for readers of the record.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import functools
import re
import secrets
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import Any

from nats.aio.msg import Msg
from nats.js.errors import KeyNotFoundError, KeyWrongLastSequenceError
from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import Span
from phalanx.services.elasticity_planner.lease import Lease, NotLeader
from phalanx.services.elasticity_planner.policy import (
    Decision,
    Fault,
    JobPhase,
    JobState,
    NodeState,
    Policy,
    ReplaceOrShrink,
    state_from_dict,
    state_to_dict,
)
from phalanx.services.elasticity_planner.recoveries import Fault as FaultSeen
from phalanx.services.elasticity_planner.recoveries import RecoveryBook, cause_class

from phalanx.batchplan import plan_for
from phalanx.bus import COMMANDS, EVENTS, JOBS_BUCKET, SCHED, Bus
from phalanx.bus.subjects import (
    ACK,
    CAPACITY,
    COMM_ERROR,
    DECISION,
    EXITED,
    FAILED,
    HUNG,
    JOB_SPEC,
    JOINED,
    NODE_LOST,
    PLAN,
    PREEMPT,
    PROPOSAL,
    RECOVERED,
    REGISTERED,
    SPAWN,
)
from phalanx.bus.topology import kv_latest, leader_bucket
from phalanx.metrics import PlannerMetrics
from phalanx.runtime.addr import split_addr
from phalanx.runtime.follow import record_key
from phalanx.schemas import (
    Action,
    BatchPlan,
    CapacityChanged,
    CollectiveError,
    DecodeError,
    JobRecord,
    JobSpec,
    Member,
    Message,
    NodeJoined,
    NodeLost,
    Plan,
    PlanAck,
    PlanDecision,
    PreemptionNotice,
    Proposal,
    RankExited,
    RankFailed,
    RankHung,
    RecoveryDone,
    Registered,
    Role,
    SpawnWorkers,
    decode,
    encode,
    headers_for,
)
from phalanx.service import Service
from phalanx.settings import get_settings
from phalanx.telemetry import inject_headers

_tracer = trace.get_tracer("phalanx.planner")

_ENDED = (JobPhase.STOPPED, JobPhase.COMPLETED)
_Thunk = Callable[[], Awaitable[None]]
Decide = Callable[[JobState | None], Awaitable[JobState | None]]


@dataclass
class _Pending:
    """A committed generation waiting for its members' acknowledgements."""

    plan: Plan
    notify: Span
    waiting: set[str]
    sent_at: float
    sends: int = 1


class ElasticityPlanner(Service):
    name = "elasticity-planner"
    metrics_type = PlannerMetrics
    metrics: PlannerMetrics

    def __init__(self, bus: Bus, policy: Policy | None = None) -> None:
        super().__init__(bus)
        self.policy: Policy = policy or ReplaceOrShrink()
        self.jobs: dict[str, JobState] = {}
        self._revisions: dict[str, int] = {}  # KV revision each job's record was read or written at
        self._out: list[_Thunk] | None = None  # what the transaction in progress publishes once committed
        self._pending: dict[str, _Pending] = {}
        self._timers: dict[tuple[str, int], asyncio.TimerHandle] = {}  # broken generations' graces
        self._waits: dict[tuple[str, str], asyncio.TimerHandle] = {}  # incidents waiting for spares
        settings = get_settings()
        self.comm_grace_s = settings.planner_comm_grace_s
        self.max_reforms = settings.planner_max_reforms
        self.reform_backoff_max_s = settings.planner_reform_backoff_max_s
        self.republish_s = settings.planner_republish_s
        self.lease_ttl_s = settings.planner_lease_ttl_s
        self.spec_max_age_s = settings.planner_spec_max_age_s
        # Handlers of the spec, events and comm-error consumers interleave at every
        # await; one decision at a time keeps each job's state and generation consistent.
        self._lock = asyncio.Lock()
        self.decisions = 0
        self.conflicts = 0
        self.refused = 0
        self.spare_wait_s = settings.planner_spare_wait_s
        self._consumers: list[asyncio.Task[None]] = []
        self._tasks: list[asyncio.Task[None]] = []
        self.elected_at: float | None = None  # wall time this replica last became leader
        self.cluster_offered: dict[str, dict[str, int]] = {}  # cluster -> node -> slots offered
        self.sched_seq = 0  # the newest scheduler signal read (stream sequence)
        # Metrics: the faults being answered (incident -> cause and times), the recoveries
        # in flight, and what the input being handled is (a decision's ``reason`` class).
        self._faults: dict[str, FaultSeen] = {}
        self.recoveries = RecoveryBook(self.metrics, self.log)
        self._trigger = ""
        self.spawn_timeout_s = settings.planner_spawn_timeout_s

    # -- lifecycle and leadership -------------------------------------------------------
    async def start(self) -> None:
        self.kv = await leader_bucket(self.bus.js, JOBS_BUCKET)  # compare-and-set: read-your-writes
        self.lease = Lease(self.kv, self.instance, self.lease_ttl_s)
        if await self.lease.step():  # a lone planner leads before start() returns
            await self._lead()
        self._tasks = [
            asyncio.create_task(self._keep_lease(), name="planner-lease"),
            asyncio.create_task(self._republish_loop(), name="planner-republish"),
        ]

    async def _keep_lease(self) -> None:
        leading = self.lease.is_leader()
        while True:
            await asyncio.sleep(self.lease.ttl_s / (3 if leading else 10))
            try:
                now_leader = await self.lease.step()
            except Exception as exc:
                self.log.warning("lease_step_failed", error=repr(exc))
                continue
            if now_leader and not leading:
                now_leader = await self._lead()
            elif leading and not now_leader:
                await self._on_deposed()
            leading = now_leader

    async def _lead(self) -> bool:
        """Take over as leader; on failure (KV away, a newer leader) stand by again."""
        try:
            await self._on_elected(self.lease.token)
            return True
        except Exception as exc:
            self.log.error("takeover_failed", error=repr(exc))
            self.lease.resign(f"takeover failed: {exc!r}")
            await self._on_deposed()
            return False

    async def _on_elected(self, token: int) -> None:
        async with self._lock:
            self.elected_at = time.time()
            self.log.info("planner_leader", token=token, instance=self.instance)
            await self._load_all()
            self.metrics.leader.set(1)
            for state in self.jobs.values():
                self._gauges(state)
            with contextlib.suppress(Exception):  # absent: it is created reading from the start
                await self.bus.js.delete_consumer(SCHED.name, "planner-sched")
            self.cluster_offered.clear()
            for stream, durable in (
                (COMMANDS, "planner-spec"),
                (EVENTS, "planner-events"),
                (EVENTS, "planner-comm-errors"),
                (COMMANDS, "planner-proposals"),
            ):
                try:
                    await self.bus.rewind(stream, durable)
                except Exception as exc:  # the consumer then redelivers after its ack_wait
                    self.log.warning("rewind_failed", durable=durable, error=repr(exc))
            # A plan the last leader committed but saw not acknowledged: sent again.
            for state in self.jobs.values():
                if state.phase is JobPhase.RECOVERING and state.plan is not None:
                    self._track(state.plan, time.monotonic() - self.republish_s)
                if state.broken:  # the last leader was waiting out a broken group's grace
                    self._arm(state)
                if state.deferred:  # ... or a wait for spares still starting
                    self._arm_spare_wait(state)
                if state.phase is JobPhase.RUNNING and state.spares:  # ... or a grow's cool-down
                    self._arm_cooldown(state)
            self._consumers = [
                self.bus.consume(
                    COMMANDS,
                    "planner-spec",
                    [JOB_SPEC.wildcard()],
                    self._on_command,
                    (JobSpec,),
                    max_deliver=-1,
                ),
                self.bus.consume(
                    EVENTS,
                    "planner-events",
                    [
                        REGISTERED.wildcard(),
                        FAILED.wildcard(),
                        HUNG.wildcard(),
                        NODE_LOST.wildcard(),
                        ACK.wildcard(),
                        EXITED.wildcard(),
                    ],
                    self._on_event,
                    (Registered, RankFailed, RankHung, NodeLost, PlanAck, RankExited),
                    ack_wait_s=10.0,
                    max_deliver=-1,  # a fault is never dropped: a KV outage is retried until it ends
                ),
                self.bus.consume(
                    EVENTS,
                    "planner-comm-errors",
                    [COMM_ERROR.wildcard()],
                    self._on_comm_error,
                    (CollectiveError,),
                    max_deliver=-1,
                ),
                self.bus.consume(
                    COMMANDS,
                    "planner-proposals",
                    [PROPOSAL.wildcard()],
                    self._on_proposal,
                    (Proposal,),
                    max_deliver=-1,
                ),
                # Each rank's first step in a new generation: the recoveries' downtime (metrics only).
                self.bus.consume(
                    EVENTS,
                    "planner-recoveries",
                    [RECOVERED.wildcard()],
                    self._on_recovered,
                    (RecoveryDone,),
                    deliver_new=True,
                ),
                # Signals are about the cluster, not one job. They are read from the
                # stream's start on every election: that rebuilds the cluster's offers, and
                # each job's record says which signals it already took (sched_seq).
                self.bus.consume(
                    SCHED,
                    "planner-sched",
                    [CAPACITY.wildcard(), PREEMPT.wildcard()],
                    self._on_signal,
                    (CapacityChanged, PreemptionNotice),
                    max_deliver=-1,
                ),
            ]

    async def _on_deposed(self) -> None:
        """Another replica leads now: stop consuming, forget everything in memory."""
        self.log.warning("planner_deposed", instance=self.instance)
        for task in self._consumers:
            task.cancel()
        for task in self._consumers:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        self._consumers = []
        async with self._lock:
            self._forget()

    def _forget(self) -> None:
        for t in [*self._timers.values(), *self._waits.values()]:
            t.cancel()
        self._waits.clear()
        for p in self._pending.values():
            p.notify.end()
        self._timers.clear()
        self._pending.clear()
        self.jobs.clear()
        self._revisions.clear()
        self._faults.clear()
        self.recoveries.forget()
        self.metrics.forget_jobs()
        self.metrics.leader.set(0)

    async def stop(self) -> None:
        # Consumers first: once the lease is released a standby takes over, and by then
        # this replica must hold no pull request that could take its next input.
        tasks = self._consumers + self._tasks
        for task in tasks:
            task.cancel()
        if tasks:
            _, stuck = await asyncio.wait(tasks, timeout=5.0)
            if stuck:
                self.log.error("tasks_did_not_stop", tasks=sorted(t.get_name() for t in stuck))
        for t in [*self._timers.values(), *self._waits.values()]:
            t.cancel()
        await self.lease.release()  # a standby takes over at once, without waiting out the TTL

    def health_details(self) -> dict[str, str | int | float | bool]:
        return {
            "jobs": len(self.jobs),
            "decisions": self.decisions,
            "leader": self.lease.is_leader(),
            "token": self.lease.token,
            "conflicts": self.conflicts,
            "refused": self.refused,
        }

    # -- the record: load, write, transactions ----------------------------------------
    async def _load_all(self) -> None:
        self.jobs.clear()
        self._revisions.clear()
        for key in await kv_latest(self.bus.js, JOBS_BUCKET, "*.plan"):
            await self._load(key[: -len(".plan")])

    async def _load(self, job: str) -> None:
        """Read the job's record into the planner's state (the record wins over memory)."""
        self.jobs.pop(job, None)
        self._revisions.pop(job, None)
        try:
            entry = await self.kv.get(record_key(job))
        except KeyNotFoundError:
            return
        assert entry.revision is not None
        self._revisions[job] = entry.revision  # even unreadable: it may be overwritten
        try:
            record = decode(entry.value or b"", headers_for(JobRecord), JobRecord)
            state = state_from_dict(record.planner, record.plan) if record.planner else None
        except Exception as exc:  # a record this version cannot read: say so, start the job afresh
            self.log.error("job_record_unreadable", job=job, error=repr(exc))
            return
        if record.token > self.lease.token:
            self.lease.fenced(record.token)
            raise NotLeader(f"the record of {job} was written by a newer leader (token {record.token})")
        if state is not None:
            self.jobs[job] = state
            self.log.info(
                "job_record_loaded",
                job=job,
                phase=state.phase.value,
                generation=state.generation,
                spares=state.spares,
                revision=entry.revision,
            )

    async def _write(self, state: JobState) -> None:
        job = state.spec.job
        token = self.lease.check()
        record = JobRecord(job=job, token=token, plan=state.plan, planner=state_to_dict(state))
        payload, _ = encode(record)
        revision = self._revisions.get(job)
        if revision is None:
            self._revisions[job] = await self.kv.create(record_key(job), payload)
        else:
            self._revisions[job] = await self.kv.update(record_key(job), payload, last=revision)

    async def _txn(self, job: str, decide: Decide, attempts: int = 5) -> None:
        """Decide on a copy of ``job``'s state, commit it by compare-and-set, then publish.

        ``decide`` gets a private copy (None: no record) and returns the state to
        keep; what it publishes goes through :meth:`_later` and leaves only once the
        record is written. On a lost compare-and-set the record is read again and
        ``decide`` runs again on it; any other error propagates and changes nothing.
        """
        for _ in range(attempts):
            self.lease.check()
            current = self.jobs.get(job)
            before = None if current is None else (state_to_dict(current), current.plan)
            self._out = []
            try:
                state = await decide(copy.deepcopy(current))
                out = self._out
            finally:
                self._out = None
            changed = state is not None and (state_to_dict(state), state.plan) != before
            if changed:
                assert state is not None
                try:
                    await self._write(state)
                except KeyWrongLastSequenceError:
                    self.conflicts += 1
                    self.log.warning("record_conflict", job=job, revision=self._revisions.get(job))
                    await self._load(job)
                    continue
            if state is None:
                self.jobs.pop(job, None)
            else:
                self.jobs[job] = state
                self._gauges(state)
            for publish in out:
                await publish()
            return
        raise RuntimeError(f"{job}: lost the record's compare-and-set {attempts} times in a row")

    @contextlib.contextmanager
    def _plan_span(self, attributes: dict[str, str], *, root: bool = False) -> Iterator[Span]:
        """The incident's ``plan`` span (fault received -> plan committed): current while
        deciding, ended once the transaction has committed, before anything is published.
        ``root``: the first span of a trace of its own (a grow: no signal or fault led to it)."""
        span = _tracer.start_span(
            "plan", context=otel_context.Context() if root else None, attributes=attributes
        )

        async def end() -> None:
            span.end()

        with trace.use_span(span, end_on_exit=False):
            yield span
        assert self._out is not None, "a plan span outside a transaction"
        self._out.insert(0, end)

    def _later(self, publish: _Thunk) -> None:
        """Publish once the transaction in progress has committed, in the trace context
        of now (the incident's ``plan`` span, say)."""
        assert self._out is not None, "publishing outside a transaction"
        ctx = otel_context.get_current()

        async def run() -> None:
            token = otel_context.attach(ctx)
            try:
                await publish()
            finally:
                otel_context.detach(token)

        self._out.append(run)

    # -- a broken group with nobody to blame ----------------------------------------------
    async def _on_comm_error(self, msg: Message, raw: Msg) -> None:
        """Ranks report failed collectives. Usually a crash or hang explains them and
        its fault arrives within milliseconds; if none has moved the job past that
        generation within the grace (every member is alive: a network blip, a
        timed-out collective), the group is re-formed (:meth:`_decide_reform`).
        The reports are part of the record, so a new leader waits out the grace."""
        assert isinstance(msg, CollectiveError)
        async with self._lock:
            why = self._comm_error_refusal(msg)
            if why is not None:
                await self._refuse(raw.subject, msg, why)
                return

            async def report(state: JobState | None) -> JobState | None:
                if state is not None and state.generation == msg.generation:
                    if not state.broken:
                        state.broken_at = msg.ts
                    state.broken[msg.worker] = msg.error[:300]
                return state

            await self._txn(msg.job, report)
            if (state := self.jobs.get(msg.job)) is not None and state.broken:
                self._arm(state)

    def _arm(self, state: JobState, graces: int = 1) -> None:
        """Start the grace of the job's broken generation, once."""
        key = (state.spec.job, state.generation)
        if key in self._timers:
            return
        wait = self._reform_wait(state)
        left = state.broken_at + graces * wait - time.time()
        # A new leader replays verdicts and reports together: a grace that ran out while
        # nobody led must not re-form before the replayed hang or crash is read.
        left = max(0.0, left, (self.elected_at or 0.0) + wait - time.time())
        self._timers[key] = asyncio.get_running_loop().call_later(
            left, lambda: asyncio.ensure_future(self._reform(key))
        )

    def _comm_error_refusal(self, msg: CollectiveError) -> str | None:
        """Why a collective error cannot be taken (None: it is a member's, of now)."""
        state = self.jobs.get(msg.job)
        if state is None or state.plan is None or state.phase in _ENDED:
            return f"job {msg.job} has no running generation"
        if msg.launch != state.run:
            return f"run {msg.launch!r} is not the job's run {state.run!r}"
        if msg.generation != state.generation:
            return f"generation {msg.generation} is not the current {state.generation}"
        if state.plan.rank_of(msg.worker) != msg.rank:
            return f"{msg.worker} is not rank {msg.rank} of generation {state.generation}"
        return None

    async def _refuse(self, subject: str, msg: Message, why: str) -> None:
        self.refused += 1
        self.log.warning("input_refused", subject=subject, kind=msg.KIND, reason=why)
        await self.bus.report_bad_input(subject, DecodeError(why, msg.KIND))

    def _reform_wait(self, state: JobState) -> float:
        """The grace before the same members re-form: doubles with each re-form in a row."""
        return min(self.comm_grace_s * 2 ** self._reforms_in_a_row(state), self.reform_backoff_max_s)

    def _reforms_in_a_row(self, state: JobState) -> int:
        quiet = max(60.0, 2 * self.reform_backoff_max_s)  # this long without one: the count restarts
        return state.reforms if time.time() - state.reform_at < quiet else 0

    async def _reform(self, key: tuple[str, int]) -> None:
        async with self._lock:
            self._trigger = "collective_error"
            if self._timers.pop(key, None) is None:
                return
            job, generation = key
            state = self.jobs.get(job)
            if state is not None and state.generation == generation and self._unexplained(state):
                # Someone is silent and nobody says it is dead: give the verdicts (or the
                # launcher's exit report, late after a NATS outage) a second grace.
                if time.time() < state.broken_at + 2 * self._reform_wait(state) - 0.01:
                    self._arm(state, graces=2)
                    return
            try:
                await self._txn(job, lambda state: self._decide_reform(state, generation))
            except Exception as exc:  # KV unreachable or deposed: the next leader re-arms it
                self.log.error("reform_failed", job=job, generation=generation, error=repr(exc))

    @staticmethod
    def _unexplained(state: JobState) -> list[str]:
        """Members silent while their peers report failing collectives, with no report of their death."""
        if state.plan is None:
            return []
        return [
            m.worker
            for m in state.plan.members
            if m.worker not in state.broken and m.worker not in state.exited
        ]

    async def _decide_reform(self, state: JobState | None, generation: int) -> JobState | None:
        if state is None or state.generation != generation or state.phase in _ENDED or state.plan is None:
            return state  # a fault explained it and was planned, or the job ended
        job = state.spec.job
        if state.deferred:  # a fault's decision waits for spares: it, not a re-form, moves the generation
            self.log.info("reform_skipped", job=job, generation=generation, waiting=len(state.deferred))
            return state
        reporters = sorted(state.broken)
        incident = f"{job}:gen{generation}:collective"
        self._faults.setdefault(incident, FaultSeen("collective_error", state.broken_at, time.time()))
        # No fault event opened this incident's trace: its detection is the grace itself.
        with (
            _tracer.start_as_current_span(
                "detect",
                context=otel_context.Context(),
                start_time=int(state.broken_at * 1e9),
                attributes={
                    "phalanx.job": job,
                    "phalanx.incident": incident,
                    "phalanx.cause": "collective_error",
                    "phalanx.generation": generation,
                    "phalanx.evidence.reporters": ",".join(reporters),
                    "phalanx.evidence.error": next(iter(state.broken.values()), ""),
                },
            ),
            self._plan_span({"phalanx.job": job, "phalanx.incident": incident}),
        ):
            silent = [m.worker for m in state.plan.members if m.worker not in state.broken]
            # A silent member is fenced only with corroboration: its launcher saw it die.
            # (A detector verdict goes its own way, as a fault, and moves the generation.)
            dead = [w for w in silent if w in state.exited]
            if dead:
                for worker in dead:
                    cause = f"exited (its launcher saw it) while {reporters} reported failed collectives"
                    self._faults.setdefault(
                        f"{incident}:{worker}", FaultSeen("crash", state.broken_at, time.time())
                    )
                    await self._apply(
                        state,
                        f"{incident}:{worker}",
                        self.policy.on_fault(state, Fault(incident, worker, cause, False)),
                    )
                return state
            row = self._reforms_in_a_row(state)
            why = f"collectives of generation {generation} failed on {reporters}"
            if silent:
                why += f"; {silent} silent but alive as far as anyone can tell"
            if row >= self.max_reforms:
                decision = Decision(
                    Action.STOP,
                    f"{why}: the group broke {row + 1} times in a row (max_reforms={self.max_reforms}), stopping",
                )
            else:
                decision = Decision(
                    Action.REFORM,
                    f"{why} and no rank was found dead or hung within "
                    f"{self._reform_wait(state):g}s: the same members re-form",
                    members=list(state.plan.members),
                )
                state.reforms, state.reform_at = row + 1, time.time()
            await self._apply(state, incident, decision)
            return state

    # -- inputs ------------------------------------------------------------------
    async def _on_command(self, msg: Message, raw: Msg) -> None:
        assert isinstance(msg, JobSpec)
        async with self._lock:
            self._trigger = "node_join"
            age = time.time() - msg.ts
            if age > self.spec_max_age_s:  # a replay from before any live launch
                await self._refuse(raw.subject, msg, f"job spec of launcher {msg.launcher} is {age:.0f}s old")
                return
            await self._txn(msg.job, lambda state: self._on_spec(state, msg))

    async def _on_spec(self, state: JobState | None, msg: JobSpec) -> JobState | None:
        if state is not None:
            known = next((n for n, s in state.nodes.items() if s.launcher == msg.launcher), None)
            if known is not None and not state.nodes[known].lost and state.phase not in _ENDED:
                self._answer(state, msg, state.nodes[known].workers, "already joined")  # a redelivery
                return state
        prior = state
        if state is None or state.phase in _ENDED:
            # A new run of the job continues its generations: they only move forward.
            state = JobState(
                spec=msg,
                run=f"r-{uuid.uuid4().hex[:12]}",
                base_generation=state.generation if state else 0,
            )
        refusal = self._refusal(state, msg)
        if refusal is not None:
            reason, retry = refusal
            self.log.warning("node_refused", job=msg.job, node=msg.node, launcher=msg.launcher, reason=reason)
            answer = NodeJoined(
                job=msg.job, node=msg.node, launcher=msg.launcher, accepted=False, reason=reason, retry=retry
            )
            # not de-duplicated: a retry gets its own answer
            self._later(lambda: self.bus.publish(JOINED, answer, job=msg.job))
            return prior if not state.nodes else state  # a refused first node opens no run
        workers = self._names(state, msg)
        state.nodes[msg.node] = NodeState(
            msg.launcher,
            msg.host,
            msg.store_addr,
            workers,
            msg.ranks,
            slots=len(workers),
            reserve=len(workers) - (0 if state.phase is not JobPhase.WAITING else msg.ranks),
        )
        # Offers made before this node joined are not for this job.
        state.offered[msg.node] = self._offered_now(msg.node)
        state.sched_seq = max(state.sched_seq, self.sched_seq)
        live = len(state.live_nodes())
        reason = f"node {msg.node} joined run {state.run} with {len(workers)} workers"
        reason += (
            ": spare capacity for the running job"
            if state.phase is not JobPhase.WAITING
            else f" ({live} of min {state.spec.min_nodes} nodes)"
        )
        self.log.info("node_joined", job=msg.job, node=msg.node, workers=workers, run=state.run)
        self._answer(state, msg, workers, reason)
        self._decision(state, None, Action.JOIN, reason, None, key=f"join:{msg.launcher}")
        await self._maybe_start(state)
        return state

    def _refusal(self, state: JobState, spec: JobSpec) -> tuple[str, bool] | None:
        """Why ``spec`` cannot join, and whether asking again later may succeed."""
        if spec.launcher in state.lost_launchers:
            return f"launcher {spec.launcher} was declared lost in run {state.run}; start a new one", False
        if not state.nodes:
            return None
        mine, theirs = spec.settings(), state.spec.settings()
        differ = [f"{k}={mine[k]!r} (the job has {theirs[k]!r})" for k in theirs if mine[k] != theirs[k]]
        if differ:
            return f"settings differ from the job's: {', '.join(differ)}", False
        live = state.live_nodes()
        if spec.node in live:
            old = state.nodes[spec.node].launcher
            return f"node {spec.node} is already in the job (launcher {old}, not declared lost)", True
        if len(live) >= state.spec.max_nodes:
            return f"the job already has max_nodes={state.spec.max_nodes} nodes", True
        return None

    @staticmethod
    def _names(state: JobState, spec: JobSpec) -> list[str]:
        """The spec's worker names, renumbered if an earlier launcher of the run used them."""
        used = {w for s in state.nodes.values() for w in s.workers}
        if not used & set(spec.workers):
            return list(spec.workers)
        stem = re.sub(r"\d+$", "", spec.workers[0])
        taken = [int(m.group(1)) for w in used if (m := re.fullmatch(re.escape(stem) + r"(\d+)", w))]
        first = max(taken, default=-1) + 1
        return [f"{stem}{first + i}" for i in range(len(spec.workers))]

    def _answer(self, state: JobState, spec: JobSpec, workers: list[str], reason: str) -> None:
        answer = NodeJoined(
            job=spec.job,
            node=spec.node,
            launcher=spec.launcher,
            accepted=True,
            run=state.run,
            as_spares=state.phase is not JobPhase.WAITING,
            workers=workers,
            reason=reason,
        )
        msg_id = f"{answer.job}:joined:{answer.launcher}"
        self._later(lambda: self.bus.publish(JOINED, answer, job=answer.job, msg_id=msg_id))

    async def _maybe_start(self, state: JobState) -> None:
        """Generation 1: once ``min_nodes`` nodes joined and all their ranks registered."""
        if state.phase is not JobPhase.WAITING or len(state.live_nodes()) < state.spec.min_nodes:
            return
        expected = [w for n in state.live_nodes() for w in state.nodes[n].workers[: state.nodes[n].ranks]]
        if not expected or any(w not in state.ranks for w in expected):
            return
        members = [Member(rank=i, worker=w) for i, w in enumerate(expected)]
        state.start_world = len(members)
        await self._apply(
            state,
            None,
            Decision(
                Action.START,
                f"{len(members)} ranks registered on {len(state.live_nodes())} node(s)",
                members=members,
            ),
        )

    async def _on_event(self, msg: Message, raw: Msg) -> None:
        async with self._lock:
            self._trigger = self._trigger_of(msg)
            if isinstance(msg, PlanAck):
                await self._on_ack(msg)
            elif isinstance(msg, Registered):
                await self._txn(msg.job, lambda state: self._on_registered(state, msg))
            elif isinstance(msg, RankFailed | RankHung):
                await self._on_fault(msg)
            elif isinstance(msg, NodeLost):
                await self._txn(msg.job, lambda state: self._on_node_lost(state, msg))
            elif isinstance(msg, RankExited):
                if (why := self._exit_refusal(msg)) is not None:
                    await self._refuse(raw.subject, msg, why)
                    return
                await self._txn(msg.job, lambda state: self._on_exited(state, msg))

    def _exit_refusal(self, msg: RankExited) -> str | None:
        """Why an exit report cannot be taken (None: its worker's own launcher sent it).

        The subject names the sender's node (a launcher may publish only its own,
        and the bus checked the payload's node is the subject's): a worker of another
        node is not that launcher's to report, whatever the exit code.
        """
        state = self.jobs.get(msg.job)
        node = state.node_of(msg.worker) if state is not None else None
        if node is not None and node != msg.node:
            return f"exit of {msg.worker} reported by the launcher of node {msg.node}: it runs on {node}"
        return None

    def _trigger_of(self, msg: Message) -> str:
        """The ``reason`` class of decisions an event leads to; a fault is also noted for
        its recovery's metrics (the first delivery's times are kept)."""
        if isinstance(msg, RankFailed | RankHung | NodeLost):
            cause = "node_lost" if isinstance(msg, NodeLost) else cause_class(msg.cause.value)
            self._faults.setdefault(msg.incident, FaultSeen(cause, msg.fault_at, msg.detected_at))
            return cause
        if isinstance(msg, PlanAck):
            return "ack"
        return "registration" if isinstance(msg, Registered) else "worker_exit"

    async def _on_recovered(self, msg: Message, raw: Msg) -> None:
        assert isinstance(msg, RecoveryDone)
        self.recoveries.reported(msg)

    def _gauges(self, state: JobState) -> None:
        job = state.spec.job
        self.metrics.generation.labels(job).set(state.generation)
        self.metrics.world_size.labels(job).set(state.plan.world_size if state.plan else 0)
        self.metrics.spares.labels(job).set(len(state.spares))

    async def _on_exited(self, state: JobState | None, msg: RankExited) -> JobState | None:
        if state is None or state.phase in _ENDED or state.node_of(msg.worker) is None:
            return state
        if msg.exit_code != 0 or msg.signal:
            state.exited.add(msg.worker)  # corroborates a silence (see _decide_reform)
            if state.spawned.pop(msg.worker, None) is not None:  # died before it registered
                await self._apply(
                    state,
                    None,
                    Decision(Action.HOLD, f"{msg.worker} exited while starting", removed=[msg.worker]),
                )
            return state
        # A member's own launcher saw it end with 0 (only it may report that worker:
        # _exit_refusal): the training command finished, and so does the job.
        if state.plan and state.plan.rank_of(msg.worker) is not None:
            state.phase = JobPhase.COMPLETED
            self._decision(
                state,
                None,
                Action.COMPLETE,
                f"{msg.worker} finished generation {state.generation}: the job is complete",
                state.generation,
                key="complete",
            )
        return state

    async def _on_registered(self, state: JobState | None, reg: Registered) -> JobState | None:
        if state is None or state.run != reg.launch:
            self.log.info("registration_of_another_run", job=reg.job, worker=reg.worker, launch=reg.launch)
            return state
        if state.node_of(reg.worker) is None:
            self.log.warning("unknown_worker", job=reg.job, worker=reg.worker)
            return state
        if reg.worker in state.lost or reg.worker in state.ranks or reg.worker in state.spares:
            return state  # redelivery
        rank = reg.role is Role.RANK and state.phase is JobPhase.WAITING
        (state.ranks if rank else state.spares).append(reg.worker)
        state.spawned.pop(reg.worker, None)
        await self._maybe_start(state)
        if not rank and state.deferred:
            await self._retry_deferred(state)
        if not rank:
            await self._maybe_grow(state)
        return state

    async def _on_node_lost(self, state: JobState | None, event: NodeLost) -> JobState | None:
        node = state.nodes.get(event.node) if state else None
        if state is None or node is None or node.lost or (event.launcher and event.launcher != node.launcher):
            self.log.info("node_lost_ignored", job=event.job, node=event.node, incident=event.incident)
            return state
        node.lost = True
        state.lost_launchers.append(node.launcher)
        await self._plan(
            state,
            {
                "incident": event.incident,
                "node": event.node,
                "cause": f"lost ({event.cause.value})",
                "attributes": {"phalanx.node": event.node, "phalanx.cause": event.cause.value},
            },
        )
        return state

    async def _on_fault(self, event: RankFailed | RankHung) -> None:
        if event.job not in self.jobs:
            self.log.warning("fault_for_unknown_job", job=event.job, incident=event.incident)
            return
        incident = {
            "incident": event.incident,
            "worker": event.worker,
            "cause": event.cause.value,
            "hung": isinstance(event, RankHung),
            "attributes": {"phalanx.worker": event.worker, "phalanx.cause": event.cause.value},
        }

        async def decide(state: JobState | None) -> JobState | None:
            if state is not None:
                await self._plan(state, incident)
            return state

        await self._txn(event.job, decide)

    def _decide(self, state: JobState, incident: dict[str, Any]) -> Decision:
        """The policy's decision on an incident, described as the record keeps it."""
        if "node" in incident:
            return self.policy.on_node_lost(state, incident["node"], incident["cause"])
        fault = Fault(incident["incident"], incident["worker"], incident["cause"], bool(incident["hung"]))
        return self.policy.on_fault(state, fault)

    async def _plan(self, state: JobState, incident: dict[str, Any], since: float | None = None) -> None:
        """Decide on an incident and apply it, inside the incident's ``plan`` span.

        A shrink or a stop while spares of the job are still starting (a fault in
        the first step, before a spare has registered) waits for them, at most
        ``spare_wait_s`` from ``since`` (when the wait began): the incident is kept in
        the record and decided again when one registers, or when the wait runs out,
        by this leader or the next.
        """
        name = incident["incident"]
        with self._plan_span(
            {"phalanx.job": state.spec.job, "phalanx.incident": name, **incident["attributes"]}
        ) as span:
            decision = self._decide(state, incident)
            starting = self._starting(state) if decision.action in (Action.SHRINK, Action.STOP) else []
            waited_out = since is not None and time.time() >= since + self.spare_wait_s - 0.01
            if starting and not waited_out:
                span.set_attribute("phalanx.action", Action.HOLD.value)
                if since is None:
                    reason = (
                        f"{name}: waiting up to {self.spare_wait_s:g}s for spare(s) {starting} still starting"
                    )
                    self._decision(state, name, Action.HOLD, reason, None, key=f"{name}:waiting")
                state.deferred.append({**incident, "since": since or time.time()})
                self._arm_spare_wait(state)
                return
            span.set_attribute("phalanx.action", decision.action.value)
            span.set_attribute("phalanx.reason", decision.reason)
            await self._apply(state, name, decision)

    @staticmethod
    def _starting(state: JobState) -> list[str]:
        """Workers of live nodes that have not registered yet (spares warming up)."""
        known = set(state.ranks) | set(state.spares) | state.lost
        return [w for n in state.live_nodes() for w in state.nodes[n].workers if w not in known]

    def _arm_spare_wait(self, state: JobState) -> None:
        """A timer for the end of each deferred incident's wait (at most one per incident)."""
        job = state.spec.job
        for entry in state.deferred:
            key = (job, f"spares:{entry['incident']}")
            if key in self._waits:
                continue
            left = max(0.0, float(entry["since"]) + self.spare_wait_s - time.time())
            self._wait_for_spares(key, str(entry["incident"]), left)

    def _wait_for_spares(self, key: tuple[str, str], incident: str, left: float) -> None:
        self._waits[key] = asyncio.get_running_loop().call_later(
            left, lambda: asyncio.ensure_future(self._spare_wait_over(key, incident))
        )

    async def _spare_wait_over(self, key: tuple[str, str], incident: str) -> None:
        async with self._lock:
            self._trigger = "spare_wait"
            self._waits.pop(key, None)

            async def again(state: JobState | None) -> JobState | None:
                if state is not None:
                    await self._retry_deferred(state, only=incident)
                return state

            try:
                await self._txn(key[0], again)
            except Exception as exc:  # KV away, or deposed: the next leader's timer decides it
                self.log.error("spare_wait_failed", job=key[0], incident=incident, error=repr(exc))

    async def _retry_deferred(self, state: JobState, only: str | None = None) -> None:
        """Decide the waiting incidents of the job again (a spare registered, or the wait ran out)."""
        waiting = [d for d in state.deferred if only is None or d["incident"] == only]
        state.deferred = [d for d in state.deferred if d not in waiting]
        for entry in waiting:
            await self._plan(state, entry, since=float(entry["since"]))

    async def _on_ack(self, ack: PlanAck) -> None:
        pending = self._pending.get(ack.job)
        if pending is None or ack.generation != pending.plan.generation or ack.worker not in pending.waiting:
            return  # stale, duplicate, or not a member of that plan
        pending.waiting.discard(ack.worker)
        if pending.waiting:
            return
        pending.notify.end()
        del self._pending[ack.job]
        self.recoveries.acked(ack.job, ack.generation, time.time())
        self.log.info("plan_acknowledged", job=ack.job, generation=ack.generation, sends=pending.sends)

        async def running(state: JobState | None) -> JobState | None:
            if (
                state is not None
                and state.phase is JobPhase.RECOVERING
                and state.generation == ack.generation
            ):
                state.phase = JobPhase.RUNNING
                await self._maybe_grow(state)
            return state

        await self._txn(ack.job, running)

    # -- decisions -----------------------------------------------------------------
    async def _apply(
        self, state: JobState, incident: str | None, d: Decision, proposal: str | None = None
    ) -> None:
        job = state.spec.job
        for w in d.removed:
            if w not in state.lost and (node := state.node_of(w)) is not None:
                # The slot of a worker that failed is not used again until the cluster
                # offers capacity on that node again: a faulty device is not crash-looped.
                state.nodes[node].slots = max(0, self._slots(state, node) - 1)
            state.lost.add(w)
            if w in state.spares:
                state.spares.remove(w)
        for w in d.leaving:
            state.lost.add(w)
            if w in state.spares:
                state.spares.remove(w)
        for w in d.spares_used:
            state.spares.remove(w)
        generation = None
        batch: BatchPlan | None = None
        if d.members is not None:
            generation = state.generation + 1
            batch = plan_for(state.spec.elastic, state.spec.global_batch, len(d.members))
            if state.plan is None or len(d.members) != state.plan.world_size or d.spares_used:
                state.changed_at = time.time()
            workers = [m.worker for m in d.members] + state.spares
            plan = Plan(
                job=job,
                generation=generation,
                members=d.members,
                spares=list(state.spares),
                removed=d.removed,
                incident=incident,
                reason=d.reason,
                store_prefix=f"{job}/gen{generation}",
                store_secret=secrets.token_urlsafe(24),  # the members' own: see Plan.store_secret
                store_addr=self._store_for(state),
                launch=state.run,
                nodes={w: n for w in workers if (n := state.node_of(w)) is not None},
                lost_launchers=list(state.lost_launchers),
                lost_hosts=self._lost_hosts(state),
                token=self.lease.check(),
                trace=inject_headers({}),
                planned=d.planned,
                leaving=d.leaving,
                leave_by=d.leave_by or (time.time() + state.spec.elastic.grace_s if d.leaving else 0.0),
                batch=batch,
            )
            self._later(functools.partial(self._committed, plan, state.plan.world_size if state.plan else 0))
            if d.action is not Action.REFORM:
                state.reforms = 0
            state.broken, state.broken_at = {}, 0.0
            state.plan = plan
            state.phase = JobPhase.RECOVERING if incident else JobPhase.RUNNING
            self._later(lambda: self._announce(plan))
        elif d.action is Action.STOP:
            state.phase = JobPhase.STOPPED
        reason = d.reason
        if batch is not None and d.action is not Action.REFORM:
            reason += f"; {batch.describe()}"
        self._decision(
            state,
            incident,
            d.action,
            reason,
            generation,
            key=proposal or incident or "start",
            world_size=len(d.members) if d.members is not None else None,
            proposal=proposal,
            batch=batch,
        )
        if state.phase not in _ENDED:
            self._refill(state)

    async def _committed(self, plan: Plan, old_world: int) -> None:
        """Metrics of a committed generation: a recovery opens, a resize is counted."""
        fault = self._faults.pop(plan.incident, None) if plan.incident else None
        if fault is not None and plan.incident is not None:
            members = [m.worker for m in plan.members]
            self.recoveries.opened(plan.job, plan.incident, fault, plan.generation, members, time.time())
        if old_world and plan.world_size != old_world:
            direction = "grow" if plan.world_size > old_world else "shrink"
            self.metrics.resizes.labels(plan.job, direction).inc()

    @staticmethod
    def _lost_hosts(state: JobState) -> list[str]:
        """The addresses of lost nodes that no live node shares (a cut must never hit a live peer)."""
        live = {split_addr(s.store_addr)[0] for s in state.nodes.values() if not s.lost and s.store_addr}
        lost = {split_addr(s.store_addr)[0] for s in state.nodes.values() if s.lost and s.store_addr}
        return sorted(lost - live)

    @staticmethod
    def _store_for(state: JobState) -> str:
        """The current generation's store while its node lives, else the first live node's."""
        current = state.plan.store_addr if state.plan else ""
        if any(s.store_addr == current and not s.lost for s in state.nodes.values()):
            return current
        return next((s.store_addr for s in state.nodes.values() if not s.lost), "")

    def _decision(
        self,
        state: JobState,
        incident: str | None,
        action: Action,
        reason: str,
        generation: int | None,
        key: str,
        *,
        world_size: int | None = None,
        proposal: str | None = None,
        batch: BatchPlan | None = None,
    ) -> None:
        job = state.spec.job
        event = PlanDecision(
            job=job,
            incident=incident,
            action=action,
            reason=reason,
            generation=generation,
            world_size=world_size,
            proposal=proposal,
            batch=batch,
        )
        msg_id = f"{job}:{state.run}:decision:{key}"

        why = self._faults[incident].cause if incident in self._faults else self._trigger or "other"
        why = "proposal" if proposal is not None else why

        async def publish() -> None:
            self.decisions += 1
            self.metrics.decisions.labels(job, action.value, why).inc()
            self.log.info(
                "decision",
                job=job,
                incident=incident,
                action=action.value,
                reason=reason,
                generation=generation,
            )
            await self.bus.publish(DECISION, event, job=job, msg_id=msg_id)

        self._later(publish)

    # -- elasticity: capacity, preemptions, proposals ----------------------------------
    @staticmethod
    def _slots(state: JobState, node: str) -> int:
        n = state.nodes[node]
        return len(n.workers) if n.slots < 0 else n.slots

    def _offered_now(self, node: str) -> int:
        return max((offers.get(node, 0) for offers in self.cluster_offered.values()), default=0)

    def _refill(self, state: JobState) -> None:
        """Ask launchers to start spares where the job has free slots and a use for them:
        to grow back to its largest size, and to keep the hot spares it started with."""
        if state.plan is None or state.phase in _ENDED:
            return
        now = time.time()
        for w, at in list(state.spawned.items()):  # asked for and never registered
            if now - at > self.spawn_timeout_s:
                self.log.warning("spawn_timed_out", job=state.spec.job, worker=w)
                state.spawned.pop(w)
                state.lost.add(w)
        reserve = sum(n.reserve for n in state.nodes.values() if not n.lost)
        want = (
            state.max_world_size
            - state.world_size
            + reserve
            - len(state.usable_spares())
            - len(state.spawned)
        )
        for node in state.live_nodes():
            if want <= 0:
                return
            free = self._slots(state, node) - len(state.alive(node))
            count = min(free, want)
            if count <= 0:
                continue
            names = self._new_names(state, node, count)
            state.nodes[node].workers.extend(names)
            for w in names:
                state.spawned[w] = now
            want -= count
            reason = f"{free} free slot(s) on {node}: start {names} as hot spare(s)"
            n = state.nodes[node]
            ask = SpawnWorkers(
                job=state.spec.job,
                node=node,
                launcher=n.launcher,
                run=state.run,
                workers=names,
                reason=reason,
            )
            key = f"spawn:{state.run}:{names[0]}"
            self._later(
                functools.partial(self.bus.publish, SPAWN, ask, job=ask.job, msg_id=f"{ask.job}:{key}")
            )
            self._decision(state, None, Action.SPAWN, reason, None, key=key)

    @staticmethod
    def _new_names(state: JobState, node: str, count: int) -> list[str]:
        """Fresh worker names on ``node`` (never reused within the run)."""
        first = state.nodes[node].workers[0] if state.nodes[node].workers else f"{node}-w0"
        stem = re.sub(r"\d+$", "", first)
        used = {w for s in state.nodes.values() for w in s.workers}
        taken = [int(m.group(1)) for w in used if (m := re.fullmatch(re.escape(stem) + r"(\d+)", w))]
        start = max(taken, default=-1) + 1
        return [f"{stem}{start + i}" for i in range(count)]

    async def _maybe_grow(self, state: JobState) -> None:
        """Grow into ready spares, once the job runs and the cool-down after its last
        change is over (a timer comes back for it)."""
        if state.phase is not JobPhase.RUNNING or state.deferred or not state.usable_spares():
            return
        left = state.changed_at + state.spec.elastic.cooldown_s - time.time()
        decision = self.policy.on_spares(state)
        if decision is None:
            return
        if left > 0:
            self._arm_cooldown(state)
            return
        await self._resize(state, "grow", decision)

    async def _resize(
        self, state: JobState, kind: str, decision: Decision, proposal: str | None = None
    ) -> None:
        """Apply a planned change as an incident of its own (its trace: plan, notify, the ranks' phases)."""
        job = state.spec.job
        incident = f"{job}:{kind}:gen{state.generation + 1}"
        attributes = {
            "phalanx.job": job,
            "phalanx.incident": incident,
            "phalanx.cause": kind,
            "phalanx.resize": kind,
        }
        # A preemption's trace begins with the signal, a proposal's with the policy's
        # publish; a grow of the planner's own starts a trace of its own.
        with self._plan_span(attributes, root=kind == "grow" and proposal is None) as span:
            span.set_attribute("phalanx.action", decision.action.value)
            span.set_attribute("phalanx.reason", decision.reason)
            await self._apply(state, incident if decision.members is not None else None, decision, proposal)

    def _arm_cooldown(self, state: JobState) -> None:
        key = (state.spec.job, "cooldown")
        if key in self._waits:
            return
        left = max(0.0, state.changed_at + state.spec.elastic.cooldown_s - time.time()) + 0.01

        async def over() -> None:
            async with self._lock:
                self._trigger = "cooldown"
                self._waits.pop(key, None)

                async def grow(st: JobState | None) -> JobState | None:
                    if st is not None:
                        await self._maybe_grow(st)
                    return st

                try:
                    await self._txn(key[0], grow)
                except Exception as exc:  # KV away or deposed: the next trigger (or leader) grows
                    self.log.error("cooldown_grow_failed", job=key[0], error=repr(exc))

        self._waits[key] = asyncio.get_running_loop().call_later(left, lambda: asyncio.ensure_future(over()))

    async def _on_signal(self, msg: Message, raw: Msg) -> None:
        assert isinstance(msg, CapacityChanged | PreemptionNotice)
        seq = raw.metadata.sequence.stream if raw.metadata and raw.metadata.sequence else 0
        async with self._lock:
            self._trigger = "capacity" if isinstance(msg, CapacityChanged) else "preemption"
            self.sched_seq = max(self.sched_seq, seq)
            if isinstance(msg, CapacityChanged):
                self.cluster_offered[msg.cluster] = dict(msg.offered)
            for job in list(self.jobs):
                await self._txn(job, lambda state: self._signal_for(state, msg, seq))

    async def _signal_for(
        self, state: JobState | None, msg: CapacityChanged | PreemptionNotice, seq: int
    ) -> JobState | None:
        if state is None or state.phase in _ENDED or seq <= state.sched_seq:
            return state
        state.sched_seq = seq
        if isinstance(msg, CapacityChanged):
            for node, offered in msg.offered.items():
                if node not in state.nodes or state.nodes[node].lost:
                    continue
                delta = offered - state.offered.get(node, 0)
                state.offered[node] = offered
                if delta > 0:
                    state.nodes[node].slots = self._slots(state, node) + delta
                    self.log.info("capacity_offered", job=state.spec.job, node=node, slots=delta)
            self._refill(state)
            return state
        if msg.job is not None and msg.job != state.spec.job:
            return state
        workers = [w for w in msg.workers if state.node_of(w) is not None]
        for node in msg.nodes:
            if node in state.nodes:
                state.nodes[node].slots = 0  # reclaimed: nothing is started there again
                workers += state.alive(node)
        for w in msg.workers:  # a pod taken away: its slot goes with it
            if (node := state.node_of(w)) is not None and w not in state.lost:
                state.nodes[node].slots = max(0, self._slots(state, node) - 1)
        workers = [w for w in dict.fromkeys(workers) if w not in state.lost]
        if not workers or state.plan is None:
            return state
        for w in workers:
            state.spawned.pop(w, None)
        leave_by = msg.ts + msg.deadline_s
        what = msg.reason or f"preemption by {msg.source}"
        why = f"{what}: {workers} must leave within {max(0.0, leave_by - time.time()):.1f}s"
        decision = self.policy.on_preemption(state, workers, why, leave_by)
        await self._resize(state, "shrink" if decision.action is Action.SHRINK else "preempt", decision)
        return state

    async def _on_proposal(self, msg: Message, raw: Msg) -> None:
        assert isinstance(msg, Proposal)
        async with self._lock:
            self._trigger = "proposal"
            if msg.job not in self.jobs:
                await self._refuse(raw.subject, msg, f"job {msg.job} is not known to the planner")
                return

            async def decide(state: JobState | None) -> JobState | None:
                if state is None or f"proposal:{msg.id}" in state.notices:
                    return state  # a redelivery
                state.notices = [*state.notices[-63:], f"proposal:{msg.id}"]
                why = f"policy {msg.policy}: {msg.reason or 'proposed'}"
                decision = self.policy.on_proposal(state, msg.world_size, why)
                if decision.action is Action.GROW:
                    left = state.changed_at + state.spec.elastic.cooldown_s - time.time()
                    if left > 0:
                        decision = Decision(
                            Action.REJECT, f"{why}: in the cool-down after the last change ({left:.1f}s left)"
                        )
                if decision.members is None:
                    reason = f"proposal {msg.id} ({msg.world_size} ranks) rejected: {decision.reason}"
                    self._decision(
                        state, None, Action.REJECT, reason, None, key=f"proposal:{msg.id}", proposal=msg.id
                    )
                    return state
                await self._resize(state, decision.action.value, decision, proposal=msg.id)
                return state

            await self._txn(msg.job, decide)

    # -- telling the members -------------------------------------------------------------
    def _track(self, plan: Plan, sent_at: float) -> None:
        prev = self._pending.pop(plan.job, None)
        if prev is not None:
            prev.notify.set_attribute("phalanx.superseded_by", plan.generation)
            prev.notify.end()
        notify = _tracer.start_span(
            "notify", attributes={"phalanx.job": plan.job, "phalanx.generation": plan.generation}
        )
        self._pending[plan.job] = _Pending(plan, notify, {m.worker for m in plan.members}, sent_at)

    async def _announce(self, plan: Plan) -> None:
        """A committed plan: track its acknowledgements and publish it."""
        self._track(plan, time.monotonic())
        await self.bus.publish(PLAN, plan, job=plan.job, msg_id=f"{plan.job}:plan:{plan.generation}")

    async def _republish_loop(self) -> None:
        """Send again every plan some member has not acknowledged, backing off to 8x."""
        while True:
            await asyncio.sleep(self.republish_s / 4)
            now = time.monotonic()
            self.recoveries.expire()
            for incident, fault in list(self._faults.items()):  # never planned (held, a redelivery)
                if now - fault.received > self.spare_wait_s + 600.0:
                    del self._faults[incident]
            for pending in list(self._pending.values()):
                if now - pending.sent_at < self.republish_s * min(2 ** (pending.sends - 1), 8):
                    continue
                plan = pending.plan
                pending.sends += 1
                pending.sent_at = now
                self.log.info(
                    "plan_republished",
                    job=plan.job,
                    generation=plan.generation,
                    waiting=sorted(pending.waiting),
                )
                try:
                    await self.bus.publish(
                        PLAN,
                        plan,
                        job=plan.job,
                        msg_id=f"{plan.job}:plan:{plan.generation}:{pending.sends}",
                        retry_for_s=2.0,
                    )
                except Exception as exc:
                    self.log.warning("plan_republish_failed", job=plan.job, error=repr(exc))
