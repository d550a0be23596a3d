"""Running a committed step's effects: publish, trace, count, arm timers, resend plans.

:class:`EffectRunner` is the planner service's I/O side of :mod:`.effects`. It runs
after the job's record is committed, in order; each effect after a
:class:`~.effects.Traced` runs in that incident's ``plan`` span context, so a plan,
its decision and the ``notify`` span that follows join the incident's trace.

A committed plan goes out twice: whole on ``phalanx.cmd.<job>.plan`` (the services)
and as a :class:`~phalanx.contract.PlanDelta` of the plan announced before it on
``phalanx.cmd.<job>.delta`` (the launchers: one small message whatever the job's size).

It also keeps what only the leader's memory holds: each committed plan's
acknowledgements (a rank's :class:`~phalanx.contract.PlanAck`, or its launcher's
:class:`~phalanx.contract.NodeAck` for all the node's ranks at once; the plan and
its delta are sent again every ``republish_s``, backing off to 8x, until every
member acknowledged it; then the reducer learns it as :class:`~.events.AllAcked`),
the last plan announced per job (the base of the next delta), the timers armed from
the record's deadlines, and the book of recoveries in flight (:mod:`.recoveries`).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import Span
from phalanx.services.elasticity_planner.effects import (
    Announce,
    ArmTimer,
    CancelTimer,
    Committed,
    Decided,
    Effect,
    Log,
    Refuse,
    Reply,
    Spawn,
    Traced,
)
from phalanx.services.elasticity_planner.recoveries import Fault as FaultSeen
from phalanx.services.elasticity_planner.recoveries import RecoveryBook

from phalanx.bus import Bus
from phalanx.contract import DecodeError, JobState, NodeAck, Plan, PlanAck, PlanDelta, plan_delta
from phalanx.contract.subjects import DECISION, DELTA, JOINED, PLAN, SPAWN
from phalanx.metrics import PlannerMetrics
from phalanx.telemetry import inject_headers

_tracer = trace.get_tracer("phalanx.planner")
Fire = Callable[[str, str], Awaitable[None]]  # (job, timer name)


@dataclass
class _Pending:
    """A committed generation waiting for its members' acknowledgements."""

    plan: Plan
    delta: PlanDelta
    notify: Span
    waiting: set[str]
    sent_at: float
    sends: int = 1


class Spans:
    """The ``plan`` spans of one step, opened before the commit (a plan carries its
    trace context), ended once it has committed, before anything is published."""

    def __init__(self, effects: list[Effect], started_ns: int) -> None:
        self.contexts: list[otel_context.Context | None] = []
        self.spans: list[Span] = []
        current: otel_context.Context | None = None
        for effect in effects:
            if isinstance(effect, Traced):
                current = self._open(effect, started_ns)
            self.contexts.append(current)

    def _open(self, t: Traced, started_ns: int) -> otel_context.Context:
        parent = otel_context.Context() if t.root or t.detect else None
        if t.detect is not None:  # no fault event opened this incident's trace: the grace was its detection
            detect = _tracer.start_span(
                "detect", context=parent, start_time=int(t.detect.start * 1e9), attributes=t.detect.attributes
            )
            parent = trace.set_span_in_context(detect)
            self.spans.append(detect)
        span = _tracer.start_span("plan", context=parent, start_time=started_ns, attributes=t.attributes)
        if t.action:
            span.set_attribute("phalanx.action", t.action)
        if t.reason:
            span.set_attribute("phalanx.reason", t.reason)
        self.spans.insert(0, span)
        return trace.set_span_in_context(span)

    def trace_of_plan(self, effects: list[Effect]) -> dict[str, str]:
        """The trace context the step's new plan carries (its incident's ``plan`` span)."""
        announced = [c for e, c in zip(effects, self.contexts, strict=True) if isinstance(e, Announce)]
        ctx = announced[-1] if announced else None  # the last: the generation the record holds
        return inject_headers({}, ctx)

    def end(self) -> None:
        for span in self.spans:
            span.end()


class EffectRunner:
    def __init__(self, bus: Bus, metrics: PlannerMetrics, log: Any, fire: Fire, republish_s: float) -> None:
        self.bus, self.metrics, self.log = bus, metrics, log
        self.fire = fire
        self.republish_s = republish_s
        self.pending: dict[str, _Pending] = {}
        self.announced: dict[str, Plan] = {}  # job -> the plan its launchers were sent last
        self.recoveries = RecoveryBook(metrics, log, acks_due=self._acks_due)
        self.timers: dict[tuple[str, str], asyncio.TimerHandle] = {}
        self.firing: set[asyncio.Task[None]] = set()  # timers that fired, their transactions running
        self.decisions = 0
        self.refused = 0

    async def run(
        self,
        job: str,
        state: JobState | None,
        effects: list[Effect],
        spans: Spans | None,
        subject: str = "",
        kind: str = "",
    ) -> None:
        """Run a committed step's effects in order, each in its incident's trace context."""
        for i, effect in enumerate(effects):
            ctx = spans.contexts[i] if spans is not None else None
            token = otel_context.attach(ctx) if ctx is not None else None
            try:
                await self._run(job, state, effect, subject, kind)
            finally:
                if token is not None:
                    otel_context.detach(token)

    async def _run(self, job: str, state: JobState | None, effect: Effect, subject: str, kind: str) -> None:
        log = self.log
        if isinstance(effect, Reply):
            await self.bus.publish(JOINED, effect.answer, job=job, msg_id=effect.msg_id)
        elif isinstance(effect, Decided):
            d = effect.decision
            self.decisions += 1
            self.metrics.decisions.labels(job, d.action.value, effect.why).inc()
            log.info(
                "decision",
                job=job,
                incident=d.incident,
                action=d.action.value,
                reason=d.reason,
                generation=d.generation,
            )
            await self.bus.publish(DECISION, d, job=job, msg_id=effect.msg_id)
        elif isinstance(effect, Announce):
            plan = state.plan if state is not None else None
            if plan is None or plan.generation != effect.generation:
                return  # a generation the same step went past: only the committed one is sent
            delta = plan_delta(self.announced.get(job), plan)
            self.announced[job] = plan
            self._track(plan, delta, time.monotonic() - (self.republish_s if effect.resend else 0.0))
            if not effect.resend:  # the delta first: launchers (and their ranks) wait on it
                await self.bus.publish(DELTA, delta, job=job, msg_id=f"{job}:delta:{plan.generation}")
                await self.bus.publish(PLAN, plan, job=job, msg_id=f"{job}:plan:{plan.generation}")
        elif isinstance(effect, Spawn):
            await self.bus.publish(SPAWN, effect.ask, job=job, msg_id=effect.msg_id)
        elif isinstance(effect, Committed) and state is not None:
            self._committed(state, effect)
        elif isinstance(effect, ArmTimer):
            self.cancel(job, effect.name)
            left = max(0.0, effect.deadline - time.time())
            self.timers[(job, effect.name)] = asyncio.get_running_loop().call_later(
                left, self._start_firing, job, effect.name
            )
        elif isinstance(effect, CancelTimer):
            self.cancel(job, effect.name)
        elif isinstance(effect, Refuse):
            await self.refuse(subject, kind, effect.why)
        elif isinstance(effect, Log):
            getattr(log, effect.level)(effect.event, **effect.fields)

    async def refuse(self, subject: str, kind: str, why: str) -> None:
        self.refused += 1
        self.log.warning("input_refused", subject=subject, kind=kind, reason=why)
        await self.bus.report_bad_input(subject, DecodeError(why, kind))

    def _committed(self, state: JobState, c: Committed) -> None:
        """Metrics of a committed generation: a recovery opens, a resize is counted."""
        plan = state.plan
        if plan is None or plan.generation != c.generation:
            return  # a generation the same step went past (its recovery goes on in the next)
        if c.fault is not None and c.incident is not None:
            fault = FaultSeen(c.fault.cause, c.fault.fault_at, c.fault.detected_at)
            members = [m.worker for m in plan.members]
            self.recoveries.opened(plan.job, c.incident, fault, c.generation, members, time.time())
        if c.old_world and plan.world_size != c.old_world:
            direction = "grow" if plan.world_size > c.old_world else "shrink"
            self.metrics.resizes.labels(plan.job, direction).inc()

    def _start_firing(self, job: str, name: str) -> None:
        self.timers.pop((job, name), None)
        task = asyncio.ensure_future(self.fire(job, name))
        self.firing.add(task)
        task.add_done_callback(self.firing.discard)

    def cancel(self, job: str, name: str) -> None:
        if (handle := self.timers.pop((job, name), None)) is not None:
            handle.cancel()

    # -- telling the members -------------------------------------------------------------
    def _track(self, plan: Plan, delta: PlanDelta, sent_at: float) -> None:
        prev = self.pending.pop(plan.job, None)
        if prev is not None:
            prev.notify.set_attribute("phalanx.superseded_by", plan.generation)
            prev.notify.end()
        notify = _tracer.start_span(
            "notify", attributes={"phalanx.job": plan.job, "phalanx.generation": plan.generation}
        )
        self.pending[plan.job] = _Pending(plan, delta, notify, {m.worker for m in plan.members}, sent_at)

    def _acks_due(self, job: str, generation: int) -> bool:
        pending = self.pending.get(job)
        return pending is not None and pending.plan.generation == generation

    def acked(self, ack: PlanAck | NodeAck, state: JobState | None = None) -> bool:
        """Count a member's acknowledgement, or a node's for those of its workers it names
        (only workers of that node count: a launcher speaks for its own node); True once
        every member of that plan has."""
        pending = self.pending.get(ack.job)
        if pending is None or ack.generation != pending.plan.generation:
            return False  # stale, or no plan waits
        if isinstance(ack, PlanAck):
            workers = [ack.worker]
        else:
            node_of = state.node_of if state is not None else (lambda w: None)
            workers = [w for w in ack.workers if node_of(w) == ack.node]  # indexed: 2,048 acks a plan at 16k
        if not pending.waiting.intersection(workers):
            return False  # duplicate, or not members of that plan
        pending.waiting.difference_update(workers)
        if pending.waiting:
            return False
        pending.notify.end()
        del self.pending[ack.job]
        self.recoveries.acked(ack.job, ack.generation, time.time())
        self.log.info("plan_acknowledged", job=ack.job, generation=ack.generation, sends=pending.sends)
        return True

    async def republish(self) -> None:
        """Send again every plan some member has not acknowledged, backing off to 8x."""
        while True:
            await asyncio.sleep(self.republish_s / 4)
            now = time.monotonic()
            self.recoveries.expire()
            for pending in list(self.pending.values()):
                if now - pending.sent_at < self.republish_s * min(2 ** (pending.sends - 1), 8):
                    continue
                plan = pending.plan
                pending.sends += 1
                pending.sent_at = now
                self.log.info(
                    "plan_republished",
                    job=plan.job,
                    generation=plan.generation,
                    waiting=len(pending.waiting),
                    first_waiting=sorted(pending.waiting)[:16],  # a log line stays short at 16k ranks
                )
                try:
                    msg_id = f"{plan.job}:delta:{plan.generation}:{pending.sends}"
                    await self.bus.publish(DELTA, pending.delta, job=plan.job, msg_id=msg_id, retry_for_s=2.0)
                    msg_id = f"{plan.job}:plan:{plan.generation}:{pending.sends}"
                    await self.bus.publish(PLAN, plan, job=plan.job, msg_id=msg_id, retry_for_s=2.0)
                except Exception as exc:
                    self.log.warning("plan_republish_failed", job=plan.job, error=repr(exc))

    def stop_timers(self) -> None:
        """Cancel every timer, and the transaction of any that fired (a transaction cut
        short is one a crash would cut short: the next leader reads the record)."""
        for handle in self.timers.values():
            handle.cancel()
        self.timers.clear()
        for task in self.firing:
            task.cancel()

    def forget(self) -> None:
        """This replica no longer leads: drop every timer, pending plan and recovery."""
        self.stop_timers()
        for p in self.pending.values():
            p.notify.end()
        self.pending.clear()
        self.announced.clear()
        self.recoveries.forget()
