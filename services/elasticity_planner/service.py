"""The planner service: turns faults into committed, published plans.

Inputs (durable JetStream consumers, so a planner restart loses nothing):
job specs (one per node's launcher), registrations, RankFailed/RankHung,
NodeLost, plan acknowledgements, exits. Outputs: ``NodeJoined`` answers to the
launchers, ``PlanDecision`` events (every decision with its reason) and, for a
membership change, a ``Plan`` committed first in the ``phalanx_jobs`` bucket
under ``<job>.plan`` by compare-and-set (the generation only moves forward),
then published with ``Nats-Msg-Id = <job>:plan:<generation>``.

Nodes: the first launcher to join a job that has no live run opens a run (its
id goes into every plan); later launchers must agree on the run's settings or
are refused with the reason. Generation 1 starts when ``min_nodes`` nodes have
joined and all their ranks registered; a node joining a running job brings
spares. Every plan names the store its members meet on: the current one while
its node lives, else the store of the first live node.

The planner's own state per job (spec, phase, spares, lost workers, current
plan) is kept in the same bucket under ``<job>.planner`` after every change and
read back at start, so a restarted planner carries on where the last one was.

Trace: the ``plan`` span (fault received -> plan committed) is a child of the
incident's ``detect`` span; ``notify`` (committed -> every member acknowledged)
follows it.
"""

from __future__ import annotations

import asyncio
import re
import time
import uuid
from collections.abc import Callable
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
    NodeState,
    Policy,
    ReplaceOrShrink,
    state_from_dict,
    state_to_dict,
)

from phalanx.bus import COMMANDS, EVENTS, JOBS_BUCKET, Bus
from phalanx.bus.subjects import (
    ACK,
    COMM_ERROR,
    DECISION,
    EXITED,
    FAILED,
    HUNG,
    JOB_SPEC,
    JOINED,
    NODE_LOST,
    PLAN,
    REGISTERED,
)
from phalanx.runtime.addr import split_addr
from phalanx.schemas import (
    Action,
    CollectiveError,
    JobSpec,
    Member,
    Message,
    NodeJoined,
    NodeLost,
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
        self.spare_wait_s = env_float("PHALANX_PLANNER_SPARE_WAIT_S", 30.0)
        self._deferred: dict[str, list[tuple[str, dict[str, str], Callable[[], Decision]]]] = {}
        self._waiting_for_spares: set[str] = set()  # incidents whose wait for spares has begun
        self._waited_out: set[str] = set()

    async def start(self) -> None:
        self.kv = await self.bus.js.key_value(JOBS_BUCKET)
        await self._restore()
        self.bus.consume(COMMANDS, "planner-spec", [JOB_SPEC.wildcard()], self._on_command, (JobSpec,))
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
        state = self.jobs.get(msg.job)
        if state is not None:
            known = next((n for n, s in state.nodes.items() if s.launcher == msg.launcher), None)
            if known is not None:  # redelivery: answer again (the answer is de-duplicated)
                await self._answer(state, msg, state.nodes[known].workers, "already joined")
                return
        if state is None or state.phase in _ENDED:
            # A new run of the job continues its generations: they only move forward.
            state = JobState(
                spec=msg,
                run=f"r-{uuid.uuid4().hex[:12]}",
                base_generation=await self._committed_generation(msg.job),
            )
            self.jobs[msg.job] = state
        refusal = self._refusal(state, msg)
        if refusal is not None:
            reason, retry = refusal
            self.log.warning("node_refused", job=msg.job, node=msg.node, launcher=msg.launcher, reason=reason)
            answer = NodeJoined(
                job=msg.job, node=msg.node, launcher=msg.launcher, accepted=False, reason=reason, retry=retry
            )
            await self.bus.publish(JOINED, answer, job=msg.job)  # not de-duplicated: a retry gets its own
            if not state.nodes:  # it would have opened the run: nothing of it stays
                del self.jobs[msg.job]
            return
        workers = self._names(state, msg)
        state.nodes[msg.node] = NodeState(msg.launcher, msg.host, msg.store_addr, workers, msg.ranks)
        await self._save(state)
        live = len(state.live_nodes())
        reason = f"node {msg.node} joined run {state.run} with {len(workers)} workers"
        reason += (
            ": spare capacity for the running job"
            if state.phase is not JobPhase.WAITING
            else f" ({live} of min {state.spec.min_nodes} nodes)"
        )
        self.log.info("node_joined", job=msg.job, node=msg.node, workers=workers, run=state.run)
        await self._answer(state, msg, workers, reason)
        await self._publish_decision(state, None, Action.JOIN, reason, None, key=f"join:{msg.launcher}")
        for reg in self._early.pop((msg.job, state.run), []):
            await self._on_registered(reg)
        await self._maybe_start(state)

    def _refusal(self, state: JobState, spec: JobSpec) -> tuple[str, bool] | None:
        """Why ``spec`` cannot join, and whether asking again later may succeed."""
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

    async def _answer(self, state: JobState, spec: JobSpec, workers: list[str], reason: str) -> None:
        await self._publish_answer(
            NodeJoined(
                job=spec.job,
                node=spec.node,
                launcher=spec.launcher,
                accepted=True,
                run=state.run,
                as_spares=state.phase is not JobPhase.WAITING,
                workers=workers,
                reason=reason,
            )
        )

    async def _publish_answer(self, answer: NodeJoined) -> None:
        await self.bus.publish(
            JOINED, answer, job=answer.job, msg_id=f"{answer.job}:joined:{answer.launcher}"
        )

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
            await self._on_event_locked(msg)

    async def _on_event_locked(self, msg: Message) -> None:
        if isinstance(msg, Registered):
            await self._on_registered(msg)
        elif isinstance(msg, RankFailed | RankHung):
            await self._on_fault(msg)
        elif isinstance(msg, NodeLost):
            await self._on_node_lost(msg)
        elif isinstance(msg, PlanAck):
            self._on_ack(msg)
        elif isinstance(msg, RankExited):
            state = self.jobs.get(msg.job)
            if (
                state
                and msg.exit_code == 0
                and state.plan
                and state.plan.rank_of(msg.worker) is not None
                and state.phase not in _ENDED
            ):
                state.phase = JobPhase.COMPLETED
                await self._save(state)
                await self._publish_decision(
                    state,
                    None,
                    Action.COMPLETE,
                    f"{msg.worker} finished generation {state.generation}: the job is complete",
                    state.generation,
                    key="complete",
                )

    async def _on_registered(self, reg: Registered) -> None:
        state = self.jobs.get(reg.job)
        if state is None or state.run != reg.launch:
            self._early.setdefault((reg.job, reg.launch), []).append(reg)
            return
        if state.node_of(reg.worker) is None:
            self.log.warning("unknown_worker", job=reg.job, worker=reg.worker)
            return
        if reg.worker in state.lost or reg.worker in state.ranks or reg.worker in state.spares:
            return  # redelivery
        rank = reg.role is Role.RANK and state.phase is JobPhase.WAITING
        (state.ranks if rank else state.spares).append(reg.worker)
        await self._save(state)
        await self._maybe_start(state)
        if not rank and reg.job in self._deferred:
            await self._retry_deferred(reg.job)

    async def _on_node_lost(self, event: NodeLost) -> None:
        state = self.jobs.get(event.job)
        node = state.nodes.get(event.node) if state else None
        if state is None or node is None or node.lost or (event.launcher and event.launcher != node.launcher):
            self.log.info("node_lost_ignored", job=event.job, node=event.node, incident=event.incident)
            return
        node.lost = True
        state.lost_launchers.append(node.launcher)
        await self._plan(
            state,
            event.incident,
            {"phalanx.node": event.node, "phalanx.cause": event.cause.value},
            lambda: self.policy.on_node_lost(state, event.node, f"lost ({event.cause.value})"),
        )

    async def _plan(
        self,
        state: JobState,
        incident: str,
        attributes: dict[str, str],
        decide: Callable[[], Decision],
    ) -> None:
        """Decide on an incident and apply it, inside the incident's ``plan`` span.

        A shrink or a stop while spares of the job are still starting (a fault in
        the first step, before a spare has registered) waits for them, at most
        ``spare_wait_s``: the decision is taken again when one registers.
        """
        with _tracer.start_as_current_span(
            "plan",
            start_time=int(time.time() * 1e9),
            attributes={"phalanx.job": state.spec.job, "phalanx.incident": incident, **attributes},
        ) as span:
            decision = decide()
            starting = self._starting(state) if decision.action in (Action.SHRINK, Action.STOP) else []
            if starting and incident not in self._waited_out:
                span.set_attribute("phalanx.action", Action.HOLD.value)
                await self._defer(state, incident, attributes, decide, starting)
                return
            span.set_attribute("phalanx.action", decision.action.value)
            span.set_attribute("phalanx.reason", decision.reason)
            await self._apply(state, incident, decision)

    @staticmethod
    def _starting(state: JobState) -> list[str]:
        """Workers of live nodes that have not registered yet (spares warming up)."""
        known = set(state.ranks) | set(state.spares) | state.lost
        return [w for n in state.live_nodes() for w in state.nodes[n].workers if w not in known]

    async def _defer(
        self,
        state: JobState,
        incident: str,
        attributes: dict[str, str],
        decide: Callable[[], Decision],
        starting: list[str],
    ) -> None:
        job = state.spec.job
        self._deferred.setdefault(job, []).append((incident, attributes, decide))
        if incident in self._waiting_for_spares:
            return  # decided again, still waiting: the first wait's deadline holds
        self._waiting_for_spares.add(incident)
        reason = f"{incident}: waiting up to {self.spare_wait_s:g}s for spare(s) {starting} still starting"
        await self._publish_decision(state, incident, Action.HOLD, reason, None, key=f"{incident}:waiting")

        async def give_up() -> None:
            async with self._lock:
                self._waited_out.add(incident)
                await self._retry_deferred(job, only=incident)

        loop = asyncio.get_running_loop()
        loop.call_later(self.spare_wait_s, lambda: asyncio.ensure_future(give_up()))

    async def _retry_deferred(self, job: str, only: str | None = None) -> None:
        """Decide the waiting incidents of ``job`` again (a spare registered, or the wait ran out)."""
        state = self.jobs.get(job)
        waiting = self._deferred.pop(job, [])
        keep = [d for d in waiting if only is not None and d[0] != only]
        if keep:
            self._deferred[job] = keep
        for incident, attributes, decide in waiting:
            if state is not None and (only is None or incident == only):
                await self._plan(state, incident, attributes, decide)

    async def _on_fault(self, event: RankFailed | RankHung) -> None:
        state = self.jobs.get(event.job)
        if state is None:
            self.log.warning("fault_for_unknown_job", job=event.job, incident=event.incident)
            return
        fault = Fault(event.incident, event.worker, event.cause.value, isinstance(event, RankHung))
        await self._plan(
            state,
            event.incident,
            {"phalanx.worker": event.worker, "phalanx.cause": event.cause.value},
            lambda: self.policy.on_fault(state, fault),
        )

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
            generation = state.generation + 1
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
                store_addr=self._store_for(state),
                launch=state.run,
                nodes={w: n for w in workers if (n := state.node_of(w)) is not None},
                lost_launchers=list(state.lost_launchers),
                lost_hosts=self._lost_hosts(state),
            )
            await self._commit(plan)
            state.plan = plan
            state.phase = JobPhase.RECOVERING if incident else JobPhase.RUNNING
        elif d.action is Action.STOP:
            state.phase = JobPhase.STOPPED
        await self._save(state)
        await self._publish_decision(state, incident, d.action, d.reason, generation, key=incident or "start")

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

    async def _publish_decision(
        self,
        state: JobState,
        incident: str | None,
        action: Action,
        reason: str,
        generation: int | None,
        key: str,
    ) -> None:
        job = state.spec.job
        self.log.info(
            "decision", job=job, incident=incident, action=action.value, reason=reason, generation=generation
        )
        await self.bus.publish(
            DECISION,
            PlanDecision(job=job, incident=incident, action=action, reason=reason, generation=generation),
            job=job,
            msg_id=f"{job}:{state.run}:decision:{key}",
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
