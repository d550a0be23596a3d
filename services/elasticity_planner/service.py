"""The planner service: the lease, the consumers, and one transaction per input.

Inputs (durable JetStream consumers, so a planner restart loses nothing): job
specs (one per node's launcher), registrations, RankFailed/RankHung, NodeLost,
plan acknowledgements, exits, collective errors, proposals, scheduler signals.
Each becomes a typed event (:mod:`.events`) for the pure reducer
(:mod:`.reducer`), which returns the job's next state and the effects
(:mod:`.effects`): ``NodeJoined`` answers, ``PlanDecision`` events (every decision
with its reason), a ``Plan`` for a membership change, spawn requests, timers.

One record, one truth. Each job's plan and the planner's state for it are one
:class:`~phalanx.contract.JobRecord` in the ``phalanx_jobs`` bucket under
``<job>.plan``. Every input is a transaction (:meth:`ElasticityPlanner._txn`):
load -> step -> compare-and-set -> run effects. The record is written by
compare-and-set on the revision the state was read at, and only then does the new
state become the planner's and are the effects run (:mod:`.runner`). A lost
compare-and-set (another planner wrote) reloads the record and steps again; any
other error (KV unreachable) leaves the planner's state as it was and the input is
redelivered. Timers are deadlines in the record: a planner that takes over arms
them as they are (:class:`~.events.Resumed`).

Replicas. Any number of planners may run; they elect a leader by a lease in KV
(:mod:`.lease`). Only the leader consumes inputs. Its fencing token (the lease's
revision) is written into every record and plan; a record carrying a higher
token deposes a planner that still thought it led, and ranks refuse plans with
a lower token than one they have seen. A standby that takes over rewinds the
consumers so that what the dead leader held is delivered at once.

Inputs are checked: the subject's job, worker and node must match the payload's
(the bus checks that), a process exit must come from the launcher of the node that
runs the worker, a collective error must come from a member of the current
generation and run (the reducer refuses the rest, reported on the error subject).

Policies are swappable: ``ElasticityPlanner(bus, failure=..., scaling=...)`` takes
a :class:`~.failure_policy.FailurePolicy` and a :class:`~.scaling_policy.ScalingPolicy`.
``PHALANX_PLANNER_JOURNAL`` names a file the leader appends its inputs to
(:mod:`.journal`: replayed through the reducer, they give the same plans).

Trace: the ``plan`` span (input received -> plan committed) is a child of the
incident's ``detect`` span; ``notify`` (committed -> every member acknowledged)
follows it. The plan carries the trace context, for readers of the record.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from dataclasses import dataclass

import nats.errors
from nats.aio.msg import Msg
from phalanx.services.elasticity_planner import events as ev
from phalanx.services.elasticity_planner.effects import Effect
from phalanx.services.elasticity_planner.failure_policy import FailurePolicy, ReplaceOrShrink
from phalanx.services.elasticity_planner.inputs import JOB_INPUTS, RECOVERIES, REWOUND, SIGNALS, event_of
from phalanx.services.elasticity_planner.journal import Journal, seal
from phalanx.services.elasticity_planner.lease import Lease, NotLeader, presence
from phalanx.services.elasticity_planner.reducer import Reducer
from phalanx.services.elasticity_planner.runner import EffectRunner, Spans
from phalanx.services.elasticity_planner.scaling_policy import GrowIntoSpares, ScalingPolicy

from phalanx.bus import Bus, Conflict
from phalanx.bus.consumer import process_span
from phalanx.contract import (
    CapacityChanged,
    HealthReply,
    JobMessage,
    JobRecord,
    JobSpec,
    JobState,
    Message,
    NodeAck,
    Ping,
    PlanAck,
    PreemptionNotice,
    RecoveryDone,
    decode,
    headers_for,
)
from phalanx.contract.streams import JOBS_BUCKET, SCHED
from phalanx.contract.subjects import INSTANCE_HEALTH
from phalanx.metrics import PlannerMetrics
from phalanx.service import Service
from phalanx.settings import PlannerSettings, load
from phalanx.worker.follow import record_key


@dataclass(frozen=True)
class Input:
    """One input of a transaction: its event, and where it came from (refusals name it)."""

    event: ev.Event
    subject: str = ""
    kind: str = ""
    raw: Msg | None = None


class ElasticityPlanner(Service):
    name = "elasticity-planner"
    metrics_type = PlannerMetrics
    settings_type = PlannerSettings
    metrics: PlannerMetrics

    def __init__(
        self, bus: Bus, failure: FailurePolicy | None = None, scaling: ScalingPolicy | None = None
    ) -> None:
        super().__init__(bus)
        s = load(PlannerSettings)
        self.reducer = Reducer(
            failure
            or ReplaceOrShrink(
                comm_grace_s=s.planner_comm_grace_s,
                max_reforms=s.planner_max_reforms,
                reform_backoff_max_s=s.planner_reform_backoff_max_s,
                spare_wait_s=s.planner_spare_wait_s,
            ),
            scaling or GrowIntoSpares(spawn_timeout_s=s.planner_spawn_timeout_s),
            s.planner_spec_max_age_s,
        )
        self.lease_ttl_s = s.planner_lease_ttl_s
        self.journal = Journal(s.planner_journal, self.reducer) if s.planner_journal else None
        self.jobs: dict[str, JobState] = {}
        self._revisions: dict[str, int] = {}  # KV revision each job's record was read or written at
        self.runner = EffectRunner(bus, self.metrics, self.log, self._timer_fired, s.planner_republish_s)
        # Handlers of the consumers and timers interleave at every await; one
        # transaction at a time keeps each job's state and generation consistent.
        self._lock = asyncio.Lock()
        self.conflicts = 0
        self._consumers: list[asyncio.Task[None]] = []
        self._tasks: list[asyncio.Task[None]] = []
        self.cluster_offered: dict[str, dict[str, int]] = {}  # cluster -> node -> slots offered
        self.sched_seq = 0  # the newest scheduler signal read (stream sequence)

    @property
    def decisions(self) -> int:
        return self.runner.decisions

    # -- lifecycle and leadership -------------------------------------------------------
    async def start(self) -> None:
        self.kv = await self.bus.kv.bucket(JOBS_BUCKET, leader=True)  # compare-and-set: read-your-writes
        # Answer this instance's own subject before any lease record names it: a standby
        # asks there whether the holder is gone (lease.py).
        await self.bus.subscribe(
            INSTANCE_HEALTH.format(service=self.name, instance=presence(self.instance)),
            self.answer_ping,
            Ping,
            trace_messages=False,
        )
        await self.bus.flush()
        # The lease's requests are bounded by a third of its TTL: one lost in a partition
        # must not hold a standby's step (nats.py's default: 5 s) past the TTL.
        lease_kv = await self.bus.kv.bucket(JOBS_BUCKET, leader=True, timeout_s=self.lease_ttl_s / 3)
        self.lease = Lease(lease_kv, self.instance, self.lease_ttl_s, probe=self._no_responders)
        if await self.lease.step():  # a lone planner leads before start() returns
            await self._lead()
        self._tasks = [
            asyncio.create_task(self._keep_lease(), name="planner-lease"),
            asyncio.create_task(self.runner.republish(), name="planner-republish"),
        ]

    async def _no_responders(self, token: str) -> bool:
        """Whether the planner answering ``token``'s subject is gone: the server says no one
        listens there (a reply, or no answer in time, says nothing of the kind)."""
        subject = INSTANCE_HEALTH.format(service=self.name, instance=token)
        try:
            # at most a standby's step: a holder cut off from the server answers never,
            # and the step after this one must still see the TTL run out on time
            await self.bus.request(subject, Ping(), HealthReply, timeout=self.lease.standby_every_s)
        except nats.errors.NoRespondersError:
            return True
        except Exception:  # late, or our own connection is away: no verdict
            return False
        return False

    async def _keep_lease(self) -> None:
        leading = self.lease.is_leader()
        took = 0.0
        while True:
            # every ttl/3 leading, standby_every_s standing by, a step's own time (a
            # question to the holder, a KV round trip) included
            every = self.lease.ttl_s / 3 if leading else self.lease.standby_every_s
            await asyncio.sleep(max(0.0, every - took))
            started = time.monotonic()
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
            took = time.monotonic() - started

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
            self.log.info("planner_leader", token=token, instance=self.instance)
            self.jobs.clear()
            self._revisions.clear()
            for key in await self.kv.latest("*.plan"):
                await self._load(key[: -len(".plan")])
            self.metrics.leader.set(1)
            with contextlib.suppress(Exception):  # absent: it is created reading from the start
                await self.bus.streams.delete_consumer(SCHED, "planner-sched")
            self.cluster_offered.clear()
            for stream, durable in REWOUND:
                try:
                    await self.bus.rewind(stream, durable)
                except Exception as exc:  # the consumer then redelivers after its ack_wait
                    self.log.warning("rewind_failed", durable=durable, error=repr(exc))
            for job in list(self.jobs):  # timers from the record's deadlines, unacknowledged plans
                await self._txn(job, ev.Resumed(job=job))
            # A pull's job inputs are committed in one transaction per job (_on_inputs).
            self._consumers = [
                self.bus.consume(
                    i.stream,
                    i.durable,
                    i.wildcards(),
                    self._on_input,
                    i.kinds,
                    batch_handler=self._on_inputs,
                    **i.options,
                )  # type: ignore[arg-type]
                for i in JOB_INPUTS
            ]
            self._consumers += [
                self.bus.consume(i.stream, i.durable, i.wildcards(), handler, i.kinds, **i.options)  # type: ignore[arg-type]
                for i, handler in ((RECOVERIES, self._on_recovered), (SIGNALS, self._on_signal))
            ]

    async def _on_deposed(self) -> None:
        """Another replica leads now: stop consuming, forget everything in memory."""
        self.log.warning("planner_deposed", instance=self.instance)
        # Whatever holds the lock is cut short first: a transaction whose request was
        # lost (a partition) would otherwise hold this replica's lease loop for the
        # request's whole timeout, and with it the next takeover.
        self.runner.stop_timers()
        for task in self._consumers:
            task.cancel()
        for task in self._consumers:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        self._consumers = []
        async with self._lock:
            self.runner.forget()
            self.jobs.clear()
            self._revisions.clear()
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
        self.runner.stop_timers()
        await self.lease.release()  # a standby takes over at once, without waiting out the TTL
        if self.journal is not None:
            self.journal.close()

    def health_details(self) -> dict[str, str | int | float | bool]:
        return {
            "jobs": len(self.jobs),
            "decisions": self.decisions,
            "leader": self.lease.is_leader(),
            "token": self.lease.token,
            "conflicts": self.conflicts,
            "refused": self.runner.refused,
        }

    # -- the record: load, write, transactions ----------------------------------------
    async def _load(self, job: str) -> None:
        """Read the job's record into the planner's state (the record wins over memory)."""
        self.jobs.pop(job, None)
        self._revisions.pop(job, None)
        entry = await self.kv.get(record_key(job))
        if entry is None:
            return
        self._revisions[job] = entry.revision  # even unreadable: it may be overwritten
        try:
            record = decode(entry.value, headers_for(JobRecord), JobRecord)
        except Exception as exc:  # a record this version cannot read: say so, start the job afresh
            self.log.error("job_record_unreadable", job=job, error=repr(exc))
            return
        if record.token > self.lease.token:
            self.lease.fenced(record.token)
            raise NotLeader(f"the record of {job} was written by a newer leader (token {record.token})")
        if (state := record.planner) is not None:
            self.jobs[job] = state
            self._gauges(state)
            self.log.info(
                "job_record_loaded",
                job=job,
                phase=state.phase.value,
                generation=state.generation,
                spares=state.spares,
                revision=entry.revision,
            )
        if self.journal is not None:
            self.journal.loaded(job, state)

    async def _txn(
        self, job: str, event: ev.Event, subject: str = "", kind: str = "", raw: Msg | None = None
    ) -> None:
        """One input in its own transaction (:meth:`_txn_many`)."""
        await self._txn_many(job, [Input(event, subject, kind, raw)])

    async def _txn_many(self, job: str, inputs: list[Input], attempts: int = 5) -> None:
        """load -> step each input in order -> compare-and-set once -> run the effects of
        each in order. On a lost compare-and-set the record is read again and every input
        stepped again on it; any other error propagates and changes nothing.

        Every input is stepped in its own message's span (its incident's trace), at the
        same ``now``; only the last generation the inputs lead to is committed, sealed and
        announced (the reducer's plans in between were never written)."""
        started_ns = time.time_ns()
        for _ in range(attempts):
            token = self.lease.check()
            current = state = self.jobs.get(job)
            now = time.time()
            steps: list[tuple[list[Effect], Spans]] = []
            planned_at = -1  # the input whose step made the plan committed now
            for i, item in enumerate(inputs):
                with process_span(item.raw) if item.raw is not None else contextlib.nullcontext():
                    before = state.plan if state is not None else None
                    state, effects = self.reducer.step(state, item.event, now)
                    steps.append((effects, Spans(effects, started_ns)))
                if state is not None and state.plan is not before:
                    planned_at = i
            committed = None
            if state is not None and state != current:
                if state.plan is not None and (current is None or state.plan != current.plan):
                    effects, spans = steps[planned_at]
                    state.plan = committed = seal(state.plan, token, spans.trace_of_plan(effects))
                record = JobRecord(job=job, ts=now, token=token, plan=state.plan, planner=state)
                try:
                    await self._write(job, record)
                except Conflict:
                    self.conflicts += 1
                    self.log.warning("record_conflict", job=job, revision=self._revisions.get(job))
                    for _, spans in steps:
                        spans.end()
                    await self._load(job)
                    continue
            for _, spans in steps:
                spans.end()
            if state is None:
                self.jobs.pop(job, None)
            else:
                self.jobs[job] = state
                self._gauges(state)
            if self.journal is not None:
                for i, item in enumerate(inputs):
                    self.journal.stepped(job, item.event, now, committed if i == planned_at else None)
            for item, (effects, spans) in zip(inputs, steps, strict=True):
                await self.runner.run(job, state, effects, spans, item.subject, item.kind)
            return
        raise RuntimeError(f"{job}: lost the record's compare-and-set {attempts} times in a row")

    async def _write(self, job: str, record: JobRecord) -> None:
        revision = self._revisions.get(job)
        if revision is None:
            self._revisions[job] = await self.kv.create(record_key(job), record)
        else:
            self._revisions[job] = await self.kv.update(record_key(job), record, last=revision)

    def _gauges(self, state: JobState) -> None:
        job = state.spec.job
        self.metrics.generation.labels(job).set(state.generation)
        self.metrics.world_size.labels(job).set(state.world_size)
        self.metrics.spares.labels(job).set(len(state.spares))

    # -- inputs ------------------------------------------------------------------------
    async def _on_input(self, msg: Message, raw: Msg) -> None:
        await self._on_inputs([(msg, raw)])

    async def _on_inputs(self, items: list[tuple[Message, Msg]]) -> None:
        """A pull of job inputs: each becomes its event, and each job's are stepped in
        order in one transaction. Acks are counted at once, outside the lock (the notify
        span and the recovery's notify time end with the last)."""
        by_job: dict[str, list[Input]] = {}
        for msg, raw in items:
            assert isinstance(msg, JobMessage)
            if isinstance(msg, PlanAck | NodeAck) and not self.runner.acked(msg, self.jobs.get(msg.job)):
                continue
            event: ev.Event
            if isinstance(msg, PlanAck | NodeAck):
                event = ev.AllAcked(job=msg.job, generation=msg.generation)
            elif isinstance(msg, JobSpec):
                offered = max((o.get(msg.node, 0) for o in self.cluster_offered.values()), default=0)
                run = f"r-{uuid.uuid4().hex[:12]}"
                event = ev.JoinRequest(msg=msg, run=run, offered=offered, sched_seq=self.sched_seq)
            else:
                event = event_of(msg)
            by_job.setdefault(msg.job, []).append(Input(event, raw.subject, msg.KIND, raw))
        async with self._lock:
            for job, inputs in by_job.items():
                await self._txn_many(job, inputs)

    async def _on_recovered(self, msg: Message, raw: Msg) -> None:
        assert isinstance(msg, RecoveryDone)
        self.runner.recoveries.reported(msg)

    async def _on_signal(self, msg: Message, raw: Msg) -> None:
        assert isinstance(msg, CapacityChanged | PreemptionNotice)
        seq = raw.metadata.sequence.stream if raw.metadata and raw.metadata.sequence else 0
        async with self._lock:
            self.sched_seq = max(self.sched_seq, seq)
            event: ev.Event
            if isinstance(msg, CapacityChanged):
                self.cluster_offered[msg.cluster] = dict(msg.offered)
                event = ev.Capacity(msg=msg, seq=seq)
            else:
                event = ev.Preemption(msg=msg, seq=seq)
            for job in list(self.jobs):
                await self._txn(job, event, raw.subject, msg.KIND)

    async def _timer_fired(self, job: str, name: str) -> None:
        async with self._lock:
            try:
                await self._txn(job, ev.TimerFired(job=job, name=name))
            except Exception as exc:  # KV away, or deposed: the next leader arms it from the record
                self.log.error("timer_failed", job=job, timer=name, error=repr(exc))
