"""The planner as a pure reducer: ``step(state, event, now) -> (state, effects)``.

Every input the planner handles is an :mod:`event <.events>`; every consequence
is an :mod:`effect <.effects>` (a reply, a decision, a plan to announce, a timer to
arm or cancel, an input to refuse). :meth:`Reducer.step` reads no clock, does no
I/O and never changes the state it is given: it decides on a private copy and
returns it. The service (:mod:`.service`) loads the job's record, steps, commits
the new state by compare-and-set, and only then runs the effects; a lost
compare-and-set steps again on the record it reloads.

Decisions are the policies' (:mod:`.failure_policy`: replace, shrink, re-form,
stop; :mod:`.scaling_policy`: grow, shrink on reclaim, proposals, cool-down). What
the reducer adds is the mechanics around them, each wait a deadline in the record
(``JobState.timers``) so that a new leader resumes it as it is:

- ``reform``: members reported failed collectives of the current generation
  (phase ``broken``). Usually a crash or hang explains them and its fault moves the
  generation within milliseconds; if nothing has when the grace
  (``FailurePolicy.reform_wait``) runs out, a member its launcher saw exit is
  fenced as a crash, and otherwise the same members re-form (or stop). A member
  silent while its peers report, with no report of its death, gets a second grace:
  it is never fenced on its peers' word alone.
- ``spares:<incident>``: a shrink or stop while spares of the job are still
  starting waits for them (phase ``holding``) at most ``FailurePolicy.spare_wait``;
  the incident is decided again when a spare registers or the wait runs out.
- ``cooldown``: ready spares grow the job once the cool-down after its last change
  of members is over (``ScalingPolicy.cooldown_left``).

A new leader's :class:`~.events.Resumed` arms the record's timers again, gives a
broken group one more grace from the takeover (the verdicts the old leader had
not read are replayed first), and sends an unacknowledged plan again.
"""

from __future__ import annotations

from phalanx.services.elasticity_planner import events as ev
from phalanx.services.elasticity_planner.decisions import Decision, Fault, cause_class
from phalanx.services.elasticity_planner.effects import (
    Announce,
    ArmTimer,
    CancelTimer,
    Detect,
    Effect,
    FaultTimes,
    Log,
    Refuse,
    Traced,
)
from phalanx.services.elasticity_planner.failure_policy import FailurePolicy, ReplaceOrShrink
from phalanx.services.elasticity_planner.joins import exit_refusal, exited, join, maybe_start, rejoined
from phalanx.services.elasticity_planner.plans import Ctx, apply
from phalanx.services.elasticity_planner.resizes import COOLDOWN, maybe_grow, proposal, signal
from phalanx.services.elasticity_planner.scaling_policy import GrowIntoSpares, ScalingPolicy

from phalanx.contract import Action, CollectiveError, Incident, JobPhase, JobState, Role

REFORM, SPARES = "reform", "spares:"
_TRIGGERS = {
    "join": "node_join",
    "registered": "registration",
    "node_lost": "node_lost",
    "exited": "worker_exit",
    "acked": "ack",
    "comm_error": "collective_error",
    "proposal": "proposal",
    "capacity": "capacity",
    "preemption": "preemption",
    "resumed": "resume",
}


def trigger_of(event: ev.Event) -> str:
    """What led to the decisions of a step no fault explains (their metrics label)."""
    if isinstance(event, ev.Failure | ev.Hang):
        return cause_class(event.msg.cause.value)
    if isinstance(event, ev.TimerFired):
        name = event.name
        return "collective_error" if name == REFORM else "cooldown" if name == COOLDOWN else "spare_wait"
    return _TRIGGERS[event.type]


class Reducer:
    """The planner's decisions on one job's state; the policies are swappable."""

    def __init__(
        self,
        failure: FailurePolicy | None = None,
        scaling: ScalingPolicy | None = None,
        spec_max_age_s: float = 300.0,
    ) -> None:
        self.failure: FailurePolicy = failure or ReplaceOrShrink()
        self.scaling: ScalingPolicy = scaling or GrowIntoSpares()
        self.spec_max_age_s = spec_max_age_s

    def step(
        self, state: JobState | None, event: ev.Event, now: float
    ) -> tuple[JobState | None, list[Effect]]:
        """The job's next state (None: still no record) and what to do once it is committed."""
        effects: list[Effect] = []
        mine = state.clone() if state is not None else None  # the given one stays as it is
        if isinstance(event, ev.JoinRequest):
            new = self._join(mine, event, now, effects)
        elif mine is None:
            new = None
            effects += _unknown_job(event)
        else:
            ctx = Ctx(mine, now, trigger_of(event), self.failure, self.scaling, effects)
            self._handle(ctx, event)
            new = ctx.state
        if new is None:
            return None, effects
        before = {} if isinstance(event, ev.Resumed) or state is None else dict(state.timers)
        if isinstance(event, ev.TimerFired):
            before.pop(event.name, None)  # it fired: armed again only if set again
        if new.phase.ended:
            new.timers.clear()
            new.deferred, new.broken, new.broken_at = [], {}, 0.0
        new.settle()
        effects += [CancelTimer(n) for n in before if n not in new.timers]
        effects += [ArmTimer(n, d) for n, d in new.timers.items() if before.get(n) != d]
        return new, effects

    # -- dispatch -----------------------------------------------------------------------
    def _join(
        self, state: JobState | None, event: ev.JoinRequest, now: float, effects: list[Effect]
    ) -> JobState | None:
        msg = event.msg
        age = now - msg.ts
        if age > self.spec_max_age_s:  # a replay from before any live launch
            effects.append(Refuse(f"job spec of launcher {msg.launcher} is {age:.0f}s old"))
            return state
        trigger = trigger_of(event)
        if state is not None and rejoined(Ctx(state, now, trigger, self.failure, self.scaling, effects), msg):
            return state  # a redelivery, answered again
        if state is None or state.phase.ended:  # a new run continues the job's generations
            run = JobState(spec=msg, run=event.run, base_generation=state.generation if state else 0)
        else:
            run = state
        ctx = Ctx(run, now, trigger, self.failure, self.scaling, effects)
        return join(ctx, msg, state, event.offered, event.sched_seq)

    def _handle(self, ctx: Ctx, event: ev.Event) -> None:
        state = ctx.state
        if isinstance(event, ev.Registration):
            self._registered(ctx, event)
        elif isinstance(event, ev.Failure | ev.Hang):
            m = event.msg
            cause = m.cause.value
            incident = Incident(
                incident=m.incident,
                worker=m.worker,
                cause=cause,
                hung=isinstance(event, ev.Hang),
                generation=m.generation,
                cause_class=cause_class(cause),
                fault_at=m.fault_at,
                detected_at=m.detected_at,
                attributes={"phalanx.worker": m.worker, "phalanx.cause": cause},
            )
            self._plan(ctx, incident)
        elif isinstance(event, ev.NodeLoss):
            self._node_lost(ctx, event)
        elif isinstance(event, ev.Exit):
            if (why := exit_refusal(state, event.msg)) is not None:
                ctx.emit(Refuse(why))
            else:
                exited(ctx, event.msg)
        elif isinstance(event, ev.AllAcked):
            if state.plan and event.generation == state.plan.generation and state.acked < event.generation:
                if not state.phase.ended:
                    state.acked = event.generation
                    maybe_grow(ctx)
        elif isinstance(event, ev.CommFailure):
            self._comm_error(ctx, event.msg)
        elif isinstance(event, ev.Proposed):
            proposal(ctx, event)
        elif isinstance(event, ev.Capacity | ev.Preemption):
            signal(ctx, event)
        elif isinstance(event, ev.TimerFired):
            self._timer(ctx, event.name)
        elif isinstance(event, ev.Resumed):
            self._resumed(ctx)

    # -- workers and faults ---------------------------------------------------------------
    def _registered(self, ctx: Ctx, event: ev.Registration) -> None:
        state, reg = ctx.state, event.msg
        if state.run != reg.launch:
            ctx.log("registration_of_another_run", worker=reg.worker, launch=reg.launch)
            return
        if state.node_of(reg.worker) is None:
            ctx.log("unknown_worker", "warning", worker=reg.worker)
            return
        member = state.plan is not None and state.plan.rank_of(reg.worker) is not None
        if member or reg.worker in state.lost or reg.worker in state.ranks or reg.worker in state.spares:
            return  # a redelivery (of a spare's registration: it may be a member by now)
        rank = reg.role is Role.RANK and state.phase is JobPhase.WAITING
        if rank:
            state.ranks.add(reg.worker)
        else:
            state.spares.append(reg.worker)
        state.spawned.pop(reg.worker, None)
        maybe_start(ctx)
        if not rank and state.deferred:
            self._retry_deferred(ctx)
        if not rank:
            maybe_grow(ctx)

    def _node_lost(self, ctx: Ctx, event: ev.NodeLoss) -> None:
        state, m = ctx.state, event.msg
        node = state.nodes.get(m.node)
        if node is None or node.lost or (m.launcher and m.launcher != node.launcher):
            ctx.log("node_lost_ignored", node=m.node, incident=m.incident)
            return
        node = state.node(m.node)
        node.lost = True
        state.lost_launchers.append(node.launcher)
        incident = Incident(
            incident=m.incident,
            node=m.node,
            cause=f"lost ({m.cause.value})",
            cause_class="node_lost",
            fault_at=m.fault_at,
            detected_at=m.detected_at,
            attributes={"phalanx.node": m.node, "phalanx.cause": m.cause.value},
        )
        self._plan(ctx, incident)

    def _plan(self, ctx: Ctx, inc: Incident) -> None:
        """Decide on an incident and apply it, in the incident's ``plan`` span. A shrink
        or stop while spares are still starting waits for them (``spares:`` timer)."""
        state, name = ctx.state, inc.incident
        if not inc.since and any(d.incident == name for d in state.deferred):
            ctx.log("incident_already_waiting", incident=name)  # a redelivery of a deferred fault
            return
        ctx.faults.setdefault(name, FaultTimes(inc.cause_class, inc.fault_at, inc.detected_at))
        if inc.node:
            decision = self.failure.on_node_lost(state, inc.node, inc.cause)
        else:
            decision = self.failure.on_fault(
                state, Fault(name, inc.worker, inc.cause, inc.hung, inc.generation)
            )
        starting = _starting(state) if decision.action in (Action.SHRINK, Action.STOP) else []
        wait = self.failure.spare_wait(state)
        attributes = {"phalanx.job": ctx.job, "phalanx.incident": name, **inc.attributes}
        if starting and not (inc.since and ctx.now >= inc.since + wait - 0.01):
            ctx.emit(Traced(attributes, action=Action.HOLD.value))
            if not inc.since:
                reason = f"{name}: waiting up to {wait:g}s for spare(s) {starting} still starting"
                ctx.decided(name, Action.HOLD, reason, None, key=f"{name}:waiting")
            since = inc.since or ctx.now
            state.deferred.append(inc.model_copy(update={"since": since}))
            state.timers[SPARES + name] = since + wait
            state.settle()
            return
        decision = _within_restarts(state, decision)
        ctx.emit(Traced(attributes, action=decision.action.value, reason=decision.reason))
        apply(ctx, name, decision)

    def _retry_deferred(self, ctx: Ctx, only: str | None = None) -> None:
        """Decide the waiting incidents again (a spare registered, or the wait ran out)."""
        state = ctx.state
        waiting = [d for d in state.deferred if only is None or d.incident == only]
        state.deferred = [d for d in state.deferred if d not in waiting]
        for entry in waiting:
            state.timers.pop(SPARES + entry.incident, None)
        state.settle()
        for entry in waiting:
            self._plan(ctx, entry)

    # -- a broken group with nobody to blame ------------------------------------------------
    def _comm_error(self, ctx: Ctx, msg: CollectiveError) -> None:
        state = ctx.state
        if (why := _comm_error_refusal(state, msg)) is not None:
            ctx.emit(Refuse(why))
            return
        if msg.unrecoverable:  # no member can give the generation its state: say why, and stop
            reason = (
                f"generation {state.generation} cannot recover: {msg.worker} (rank {msg.rank}) "
                f"reports {msg.error}: stopping the job"
            )
            apply(ctx, f"{ctx.job}:gen{state.generation}:unrecoverable", Decision(Action.STOP, reason))
            return
        if not state.broken:
            state.broken_at = msg.ts
        state.broken[msg.worker] = msg.error[:300]
        if REFORM not in state.timers:
            state.timers[REFORM] = state.broken_at + self.failure.reform_wait(state, ctx.now)
        state.settle()

    def _reform(self, ctx: Ctx) -> None:
        state, now = ctx.state, ctx.now
        if state.plan is None or not state.broken or state.phase.ended:
            return
        silent = [m.worker for m in state.plan.members if m.worker not in state.broken]
        if [w for w in silent if w not in state.exited]:
            # Someone is silent and nobody says it is dead: give the verdicts (or the
            # launcher's exit report, late after a NATS outage) a second grace.
            second = state.broken_at + 2 * self.failure.reform_wait(state, now)
            if now < second - 0.01:
                state.timers[REFORM] = second
                return
        generation = state.generation
        if state.deferred:  # a fault's decision waits for spares: it, not a re-form, moves the generation
            ctx.log("reform_skipped", generation=generation, waiting=len(state.deferred))
            return
        reporters = sorted(state.broken)
        incident = f"{ctx.job}:gen{generation}:collective"
        ctx.faults.setdefault(incident, FaultTimes("collective_error", state.broken_at, now))
        detect = Detect(
            state.broken_at,
            {
                "phalanx.job": ctx.job,
                "phalanx.incident": incident,
                "phalanx.cause": "collective_error",
                "phalanx.generation": generation,
                "phalanx.evidence.reporters": ",".join(reporters),
                "phalanx.evidence.error": next(iter(state.broken.values()), ""),
            },
        )
        ctx.emit(Traced({"phalanx.job": ctx.job, "phalanx.incident": incident}, detect=detect))
        # A silent member is fenced only with corroboration: its launcher saw it die.
        # (A detector verdict goes its own way, as a fault, and moves the generation.)
        if dead := [w for w in silent if w in state.exited]:
            for worker in dead:
                cause = f"exited (its launcher saw it) while {reporters} reported failed collectives"
                name = f"{incident}:{worker}"
                ctx.faults.setdefault(name, FaultTimes("crash", state.broken_at, now))
                apply(ctx, name, self.failure.on_fault(state, Fault(incident, worker, cause, False)))
            return
        row = self.failure.reforms_in_a_row(state, now)
        why = f"collectives of generation {generation} failed on {reporters}"
        if silent:
            why += f"; {silent} silent but alive as far as anyone can tell"
        decision = self.failure.on_broken(state, why, now)
        if decision.action is Action.REFORM:
            state.reforms, state.reform_at = row + 1, now
        apply(ctx, incident, decision)

    # -- timers and takeover ----------------------------------------------------------------
    def _timer(self, ctx: Ctx, name: str) -> None:
        state = ctx.state
        if state.timers.pop(name, None) is None:
            return  # cancelled meanwhile, or fired twice
        if name == REFORM:
            self._reform(ctx)
        elif name == COOLDOWN:
            maybe_grow(ctx)
        elif name.startswith(SPARES):
            self._retry_deferred(ctx, only=name[len(SPARES) :])

    def _resumed(self, ctx: Ctx) -> None:
        state, now = ctx.state, ctx.now
        if state.phase.ended:
            return
        if state.plan is not None and state.acked < state.plan.generation:
            ctx.emit(Announce(state.plan.generation, resend=True))  # the last leader saw no acks
        if state.broken:
            # A new leader replays verdicts and reports together: a grace that ran out while
            # nobody led must not re-form before the replayed hang or crash is read.
            wait = self.failure.reform_wait(state, now)
            state.timers[REFORM] = max(state.timers.get(REFORM, 0.0), now + wait)
        if state.phase is JobPhase.RUNNING and state.spares and COOLDOWN not in state.timers:
            left = max(0.0, self.scaling.cooldown_left(state, now))
            state.timers[COOLDOWN] = now + left + 0.01


def _starting(state: JobState) -> list[str]:
    """Workers of live nodes that have not registered yet (spares warming up)."""
    members = {m.worker for m in state.plan.members} if state.plan else set()
    known = state.ranks | set(state.spares) | state.lost | members  # a member registered once
    return [w for n in state.live_nodes() for w in state.nodes[n].workers if w not in known]


def _comm_error_refusal(state: JobState, msg: CollectiveError) -> str | None:
    """Why a collective error cannot be taken (None: it is a member's, of now)."""
    if state.plan is None or state.phase.ended:
        return f"job {msg.job} has no running generation"
    if msg.launch != state.run:
        return f"run {msg.launch!r} is not the job's run {state.run!r}"
    if msg.generation != state.generation:
        return f"generation {msg.generation} is not the current {state.generation}"
    if state.plan.rank_of(msg.worker) != msg.rank:
        return f"{msg.worker} is not rank {msg.rank} of generation {state.generation}"
    return None


def _unknown_job(event: ev.Event) -> list[Effect]:
    """What an input about a job without a record leads to."""
    if isinstance(event, ev.Failure | ev.Hang):
        fields = {"job": event.msg.job, "incident": event.msg.incident}
        return [Log("fault_for_unknown_job", "warning", fields)]
    if isinstance(event, ev.Proposed):
        return [Refuse(f"job {event.msg.job} is not known to the planner")]
    if isinstance(event, ev.CommFailure):
        return [Refuse(f"job {event.msg.job} has no running generation")]
    if isinstance(event, ev.Registration):
        fields = {"job": event.msg.job, "worker": event.msg.worker, "launch": event.msg.launch}
        return [Log("registration_of_another_run", "info", fields)]
    return []


def _within_restarts(state: JobState, decision: Decision) -> Decision:
    """``decision`` counted against the job's ``max_restarts`` (torchrun's
    ``--max-restarts``): a recovery past the budget is a stop, whatever the policy said."""
    recovery = (Action.REPLACE, Action.SHRINK, Action.REFORM)  # a REFORM here: a fault's restart in place
    if decision.action not in recovery:
        return decision
    budget = state.spec.max_restarts
    if 0 <= budget <= state.restarts:
        return Decision(
            Action.STOP,
            f"{decision.reason}; but the job already recovered {state.restarts} time(s) of "
            f"max_restarts={budget}: stopping the job",
            removed=decision.removed,
        )
    state.restarts += 1
    return decision
