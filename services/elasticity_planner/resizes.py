"""Planned changes of a job's size: growing into spares, cluster signals, proposals.

Each is an incident of its own (``<job>:<kind>:gen<N>``: its trace holds plan,
notify and the ranks' phases), switched at a step boundary. The decisions are the
:class:`~.scaling_policy.ScalingPolicy`'s; this is the mechanics around them,
on a step's :class:`~.plans.Ctx` (pure, like :mod:`.reducer`).
"""

from __future__ import annotations

from phalanx.services.elasticity_planner import events as ev
from phalanx.services.elasticity_planner.decisions import Decision
from phalanx.services.elasticity_planner.effects import Traced
from phalanx.services.elasticity_planner.plans import Ctx, apply, refill, slots

from phalanx.contract import Action, JobPhase, PreemptionNotice

COOLDOWN = "cooldown"


def maybe_grow(ctx: Ctx) -> None:
    """Grow into ready spares once the job runs and the cool-down after its last change
    is over (a ``cooldown`` timer comes back for it)."""
    state = ctx.state
    state.settle()
    if state.phase is not JobPhase.RUNNING or not state.usable_spares():
        return
    decision = ctx.scaling.on_spares(state)
    if decision is None:
        return
    left = ctx.scaling.cooldown_left(state, ctx.now)
    if left > 0:
        state.timers.setdefault(COOLDOWN, ctx.now + left + 0.01)
        return
    resize(ctx, "grow", decision)


def resize(ctx: Ctx, kind: str, decision: Decision, proposal: str | None = None) -> None:
    """Apply a planned change as an incident of its own (its trace: plan, notify, the ranks' phases)."""
    incident = f"{ctx.job}:{kind}:gen{ctx.state.generation + 1}"
    attributes = {
        "phalanx.job": ctx.job,
        "phalanx.incident": incident,
        "phalanx.cause": kind,
        "phalanx.resize": kind,
    }
    # A preemption's trace begins with the signal, a proposal's with the policy's
    # publish; a grow of the planner's own starts a trace of its own.
    root = kind == "grow" and proposal is None
    ctx.emit(Traced(attributes, decision.action.value, decision.reason, root=root))
    apply(ctx, incident if decision.members is not None else None, decision, proposal)


def signal(ctx: Ctx, event: ev.Capacity | ev.Preemption) -> None:
    state, msg = ctx.state, event.msg
    if state.phase.ended or event.seq <= state.sched_seq:
        return
    state.sched_seq = event.seq
    if isinstance(event, ev.Capacity):
        for node, offered in event.msg.offered.items():
            if node not in state.nodes or state.nodes[node].lost:
                continue
            delta = offered - state.offered.get(node, 0)
            state.offered[node] = offered
            if delta > 0:
                state.node(node).slots = slots(state, node) + delta
                ctx.log("capacity_offered", node=node, slots=delta)
        refill(ctx)
        return
    assert isinstance(msg, PreemptionNotice)
    if msg.job is not None and msg.job != ctx.job:
        return
    workers = [w for w in msg.workers if state.node_of(w) is not None]
    for node in msg.nodes:
        if node in state.nodes:
            state.node(node).slots = 0  # reclaimed: nothing is started there again
            workers += state.alive(node)
    for w in msg.workers:  # a pod taken away: its slot goes with it
        if (node := state.node_of(w)) is not None and w not in state.lost:
            state.node(node).slots = max(0, slots(state, node) - 1)
    workers = [w for w in dict.fromkeys(workers) if w not in state.lost]
    if not workers or state.plan is None:
        return
    for w in workers:
        state.spawned.pop(w, None)
    leave_by = msg.ts + msg.deadline_s
    what = msg.reason or f"preemption by {msg.source}"
    why = f"{what}: {workers} must leave within {max(0.0, leave_by - ctx.now):.1f}s"
    decision = ctx.scaling.on_preemption(state, workers, why, leave_by)
    resize(ctx, "shrink" if decision.action is Action.SHRINK else "preempt", decision)


def proposal(ctx: Ctx, event: ev.Proposed) -> None:
    state, msg = ctx.state, event.msg
    if f"proposal:{msg.id}" in state.notices:
        return  # a redelivery
    state.notices = [*state.notices[-63:], f"proposal:{msg.id}"]
    why = f"policy {msg.policy}: {msg.reason or 'proposed'}"
    decision = ctx.scaling.on_proposal(state, msg.world_size, why)
    if decision.action is Action.GROW:
        left = ctx.scaling.cooldown_left(state, ctx.now)
        if left > 0:
            reason = f"{why}: in the cool-down after the last change ({left:.1f}s left)"
            decision = Decision(Action.REJECT, reason)
    if decision.members is None:
        reason = f"proposal {msg.id} ({msg.world_size} ranks) rejected: {decision.reason}"
        ctx.decided(None, Action.REJECT, reason, None, key=f"proposal:{msg.id}", proposal=msg.id)
        return
    resize(ctx, decision.action.value, decision, proposal=msg.id)
