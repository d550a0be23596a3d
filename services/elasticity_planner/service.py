"""The planner service: turns faults into committed, published plans.

Inputs (durable JetStream consumers, so a planner restart loses nothing):
job specs, registrations, RankFailed/RankHung, plan acknowledgements, exits.
Outputs: ``PlanDecision`` events (every decision with its reason) and, for a
membership change, a ``Plan`` committed first in the ``phalanx_jobs`` bucket
under ``<job>.plan`` by compare-and-set (the generation only moves forward),
then published with ``Nats-Msg-Id = <job>:plan:<generation>``.

The planner's own state per job (spec, phase, spares, lost workers, current
plan) is kept in the same bucket under ``<job>.planner`` after every change and
read back at start, so a restarted planner carries on where the last one was.

Trace: the ``plan`` span (fault received -> plan committed) is a child of the
incident's ``detect`` span; ``notify`` (committed -> every member acknowledged)
follows it.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

import msgpack
from nats.aio.msg import Msg
from nats.js.errors import KeyWrongLastSequenceError, NoKeysError
from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import Span
from phalanx.services.elasticity_planner.policy import (
    Decision,
    Fault,
    JobPhase,
    JobState,
    Policy,
    ReplaceOrShrink,
    state_from_dict,
    state_to_dict,
)

from phalanx.bus import COMMANDS, EVENTS, JOBS_BUCKET, Bus
from phalanx.bus.subjects import ACK, COMM_ERROR, DECISION, EXITED, FAILED, HUNG, JOB_SPEC, PLAN, REGISTERED
from phalanx.schemas import (
    Action,
    CollectiveError,
    JobSpec,
    Member,
    Message,
    Plan,
    PlanAck,
    PlanDecision,
    RankExited,
    RankFailed,
    RankHung,
    Registered,
    Role,
    decode,
    encode,
    headers_for,
)
from phalanx.service import Service, env_float

_tracer = trace.get_tracer("phalanx.planner")


_ENDED = (JobPhase.STOPPED, JobPhase.COMPLETED)


@dataclass
class _Broken:
    first_at: float
    timer: asyncio.TimerHandle
    reporters: dict[str, str] = field(default_factory=dict)


@dataclass
class _Pending:
    """A committed generation waiting for its members' acknowledgements."""

    generation: int
    notify: Span
    waiting: set[str]


class ElasticityPlanner(Service):
    name = "elasticity-planner"

    def __init__(self, bus: Bus, policy: Policy | None = None) -> None:
        super().__init__(bus)
        self.policy: Policy = policy or ReplaceOrShrink()
        self.jobs: dict[str, JobState] = {}
        # registrations that came before their launch's job spec (two streams, no order)
        self._early: dict[tuple[str, str], list[Registered]] = {}
        self._pending: dict[str, _Pending] = {}
        self._broken: dict[tuple[str, int], _Broken] = {}  # collective errors awaiting a culprit
        self.comm_grace_s = env_float("PHALANX_PLANNER_COMM_GRACE_S", 2.0)
        # Handlers of the spec, events and comm-error consumers interleave at every
        # await; one decision at a time keeps each job's state and generation consistent.
        self._lock = asyncio.Lock()
        self.decisions = 0

    async def start(self) -> None:
        self.kv = await self.bus.js.key_value(JOBS_BUCKET)
        await self._restore()
        self.bus.consume(COMMANDS, "planner-spec", [JOB_SPEC.wildcard()], self._on_command, (JobSpec,))
        self.bus.consume(
            EVENTS,
            "planner-events",
            [REGISTERED.wildcard(), FAILED.wildcard(), HUNG.wildcard(), ACK.wildcard(), EXITED.wildcard()],
            self._on_event,
            (Registered, RankFailed, RankHung, PlanAck, RankExited),
            ack_wait_s=10.0,
        )
        self.bus.consume(
            EVENTS, "planner-comm-errors", [COMM_ERROR.wildcard()], self._on_comm_error, (CollectiveError,)
        )

    async def stop(self) -> None:
        for b in self._broken.values():
            b.timer.cancel()

    # -- a broken group with nobody to blame ----------------------------------------------
    async def _on_comm_error(self, msg: Message, raw: Msg) -> None:
        async with self._lock:
            await self._on_comm_error_locked(msg)

    async def _on_comm_error_locked(self, msg: Message) -> None:
        """Ranks report failed collectives. Usually a crash or hang explains them and
        its fault arrives within milliseconds; if none has moved the job past that
        generation within ``comm_grace_s`` (every member is alive: a network blip,
        a timed-out collective), the same members re-form in a new generation."""
        assert isinstance(msg, CollectiveError)
        state = self.jobs.get(msg.job)
        if state is None or msg.generation != state.generation or state.phase in _ENDED:
            return
        key = (msg.job, msg.generation)
        broken = self._broken.get(key)
        if broken is None:
            timer = asyncio.get_running_loop().call_later(
                self.comm_grace_s, lambda: asyncio.ensure_future(self._reform(key))
            )
            broken = self._broken[key] = _Broken(first_at=msg.ts, timer=timer)
        broken.reporters[msg.worker] = msg.error

    async def _reform(self, key: tuple[str, int]) -> None:
        async with self._lock:
            await self._reform_locked(key)

    async def _reform_locked(self, key: tuple[str, int]) -> None:
        broken = self._broken.pop(key)
        job, generation = key
        state = self.jobs.get(job)
        if state is None or state.generation != generation or state.phase in _ENDED or state.plan is None:
            return  # a fault explained it and was planned, or the job ended
        reporters = sorted(broken.reporters)
        incident = f"{job}:gen{generation}:collective"
        # No fault event opened this incident's trace: its detection is the grace itself.
        with (
            _tracer.start_as_current_span(
                "detect",
                context=otel_context.Context(),
                start_time=int(broken.first_at * 1e9),
                attributes={
                    "phalanx.job": job,
                    "phalanx.incident": incident,
                    "phalanx.cause": "collective_error",
                    "phalanx.generation": generation,
                    "phalanx.evidence.reporters": ",".join(reporters),
                    "phalanx.evidence.error": next(iter(broken.reporters.values()))[:300],
                },
            ),
            _tracer.start_as_current_span(
                "plan", attributes={"phalanx.job": job, "phalanx.incident": incident}
            ),
        ):
            silent = [m.worker for m in state.plan.members if m.worker not in broken.reporters]
            if not silent:
                decision = Decision(
                    Action.REFORM,
                    f"collectives of generation {generation} failed on {reporters} and no rank was found "
                    f"dead or hung within {self.comm_grace_s:g}s: the same members re-form",
                    members=list(state.plan.members),
                )
                await self._apply(state, incident, decision)
                return
            # A member that did not report its collective failing while its peers did
            # is dead, hung or cut off (and no detector said so, e.g. none is running):
            # it is treated as lost, and fenced by the plan that replaces it.
            for worker in silent:
                cause = f"silent while {reporters} reported failed collectives for {self.comm_grace_s:g}s"
                await self._apply(
                    state,
                    f"{incident}:{worker}",
                    self.policy.on_fault(state, Fault(incident, worker, cause, hung=True)),
                )

    # -- persistence -----------------------------------------------------------------
    async def _save(self, state: JobState) -> None:
        await self.kv.put(f"{state.spec.job}.planner", msgpack.packb(state_to_dict(state)))

    async def _restore(self) -> None:
        try:
            keys = await self.kv.keys()
        except NoKeysError:
            return
        for key in keys:
            if not key.endswith(".planner"):
                continue
            entry = await self.kv.get(key)
            if not entry.value:
                continue
            try:
                state = state_from_dict(msgpack.unpackb(entry.value))
            except Exception as exc:  # a record this version cannot read: say so, skip it
                self.log.error("planner_state_unreadable", key=key, error=repr(exc))
                continue
            self.jobs[state.spec.job] = state
            self.log.info(
                "planner_state_restored",
                job=state.spec.job,
                phase=state.phase.value,
                generation=state.generation,
                spares=state.spares,
            )

    def health_details(self) -> dict[str, str | int | float | bool]:
        return {"jobs": len(self.jobs), "decisions": self.decisions}

    # -- inputs ------------------------------------------------------------------
    async def _on_command(self, msg: Message, raw: Msg) -> None:
        async with self._lock:
            await self._on_command_locked(msg)

    async def _on_command_locked(self, msg: Message) -> None:
        assert isinstance(msg, JobSpec)
        current = self.jobs.get(msg.job)
        if current is not None and current.spec == msg:
            return  # redelivery
        # A new launch of a job continues its generations: they only move forward.
        self.jobs[msg.job] = JobState(spec=msg, base_generation=await self._committed_generation(msg.job))
        await self._save(self.jobs[msg.job])
        self.log.info("job_spec", job=msg.job, world_size=msg.world_size, workers=len(msg.workers))
        for reg in self._early.pop((msg.job, msg.launch), []):
            await self._on_registered(reg)

    async def _on_event(self, msg: Message, raw: Msg) -> None:
        async with self._lock:
            await self._on_event_locked(msg)

    async def _on_event_locked(self, msg: Message) -> None:
        if isinstance(msg, Registered):
            await self._on_registered(msg)
        elif isinstance(msg, RankFailed | RankHung):
            await self._on_fault(msg)
        elif isinstance(msg, PlanAck):
            self._on_ack(msg)
        elif isinstance(msg, RankExited):
            state = self.jobs.get(msg.job)
            if state and msg.exit_code == 0 and state.plan and state.plan.rank_of(msg.worker) is not None:
                state.phase = JobPhase.COMPLETED
                await self._save(state)

    async def _on_registered(self, reg: Registered) -> None:
        state = self.jobs.get(reg.job)
        if state is None or state.spec.launch != reg.launch:
            self._early.setdefault((reg.job, reg.launch), []).append(reg)
            return
        if reg.worker not in state.spec.workers:
            self.log.warning("unknown_worker", job=reg.job, worker=reg.worker)
            return
        if reg.worker in state.lost or reg.worker in state.ranks or reg.worker in state.spares:
            return  # redelivery
        (state.ranks if reg.role is Role.RANK else state.spares).append(reg.worker)
        await self._save(state)
        if state.phase is JobPhase.WAITING and len(state.ranks) >= state.spec.world_size:
            order = sorted(state.ranks, key=state.spec.workers.index)[: state.spec.world_size]
            members = [Member(rank=i, worker=w) for i, w in enumerate(order)]
            await self._apply(
                state, None, Decision(Action.START, f"{len(members)} ranks registered", members=members)
            )

    async def _on_fault(self, event: RankFailed | RankHung) -> None:
        state = self.jobs.get(event.job)
        if state is None:
            self.log.warning("fault_for_unknown_job", job=event.job, incident=event.incident)
            return
        fault = Fault(event.incident, event.worker, event.cause.value, isinstance(event, RankHung))
        with _tracer.start_as_current_span(
            "plan",
            start_time=int(time.time() * 1e9),
            attributes={
                "phalanx.job": event.job,
                "phalanx.incident": event.incident,
                "phalanx.worker": event.worker,
                "phalanx.cause": event.cause.value,
            },
        ) as span:
            decision = self.policy.on_fault(state, fault)
            span.set_attribute("phalanx.action", decision.action.value)
            span.set_attribute("phalanx.reason", decision.reason)
            await self._apply(state, event.incident, decision)

    def _on_ack(self, ack: PlanAck) -> None:
        pending = self._pending.get(ack.job)
        if pending is None or ack.generation != pending.generation:
            return
        pending.waiting.discard(ack.worker)
        if not pending.waiting:
            pending.notify.end()
            del self._pending[ack.job]
            state = self.jobs.get(ack.job)
            if state and state.phase is JobPhase.RECOVERING:
                state.phase = JobPhase.RUNNING
            self.log.info("plan_acknowledged", job=ack.job, generation=ack.generation)

    # -- decisions -----------------------------------------------------------------
    async def _apply(self, state: JobState, incident: str | None, d: Decision) -> None:
        job = state.spec.job
        self.decisions += 1
        for w in d.removed:
            state.lost.add(w)
            if w in state.spares:
                state.spares.remove(w)
        for w in d.spares_used:
            state.spares.remove(w)
        generation = None
        if d.members is not None:
            plan = Plan(
                job=job,
                generation=state.generation + 1,
                members=d.members,
                spares=list(state.spares),
                removed=d.removed,
                incident=incident,
                reason=d.reason,
                store_prefix=f"{job}/gen{state.generation + 1}",
                launch=state.spec.launch,
            )
            await self._commit(plan)
            state.plan = plan
            state.phase = JobPhase.RECOVERING if incident else JobPhase.RUNNING
            generation = plan.generation
        elif d.action is Action.STOP:
            state.phase = JobPhase.STOPPED
        await self._save(state)
        self.log.info(
            "decision",
            job=job,
            incident=incident,
            action=d.action.value,
            reason=d.reason,
            generation=generation,
        )
        await self.bus.publish(
            DECISION,
            PlanDecision(job=job, incident=incident, action=d.action, reason=d.reason, generation=generation),
            job=job,
            msg_id=f"{job}:decision:{incident or 'start'}",
        )

    async def _committed_generation(self, job: str) -> int:
        try:
            entry = await self.kv.get(f"{job}.plan")
        except Exception:  # no plan committed for this job yet
            return 0
        return decode(entry.value, headers_for(Plan), Plan).generation if entry.value else 0

    async def _commit(self, plan: Plan) -> None:
        """Compare-and-set the job's plan in KV, then publish it."""
        key = f"{plan.job}.plan"
        payload, _ = encode(plan)
        try:
            entry = await self.kv.get(key)
            current = entry.revision
        except Exception:
            current = None
        try:
            if current is None:
                await self.kv.create(key, payload)
            else:
                await self.kv.update(key, payload, last=current)
        except KeyWrongLastSequenceError as exc:
            raise RuntimeError(f"plan {plan.job} gen {plan.generation}: lost the compare-and-set") from exc
        prev = self._pending.pop(plan.job, None)
        if prev is not None:
            prev.notify.set_attribute("phalanx.superseded_by", plan.generation)
            prev.notify.end()
        notify = _tracer.start_span(
            "notify", attributes={"phalanx.job": plan.job, "phalanx.generation": plan.generation}
        )
        self._pending[plan.job] = _Pending(plan.generation, notify, {m.worker for m in plan.members})
        await self.bus.publish(PLAN, plan, job=plan.job, msg_id=f"{plan.job}:plan:{plan.generation}")
