"""Nodes joining a job, workers registering and ending: the job's membership books.

A spec opens a run (or joins the running one as spare capacity); generation 1
starts once ``min_nodes`` nodes joined and all their ranks registered; a worker's
exit with 0 completes the job, any other exit corroborates a silence
(:mod:`.reducer`, a broken group). Pure: effects go through :class:`~.plans.Ctx`.
"""

from __future__ import annotations

import re

from phalanx.services.elasticity_planner.decisions import Decision
from phalanx.services.elasticity_planner.effects import Reply
from phalanx.services.elasticity_planner.placement import describe, lone_shards, place
from phalanx.services.elasticity_planner.plans import Ctx, apply, numbered

from phalanx.contract import Action, JobPhase, JobSpec, JobState, Member, NodeJoined, NodeState, RankExited


def join(ctx: Ctx, msg: JobSpec, prior: JobState | None, offered: int, sched_seq: int) -> JobState | None:
    """A node's spec: answer it (joined, or refused with the reason). ``ctx.state`` is
    the run it joins (a new one when ``prior``, the job's state before, is None or
    ended); returns the state to keep."""
    state = ctx.state
    refusal = refusal_of(state, msg)
    if refusal is not None:
        reason, retry = refusal
        ctx.log("node_refused", "warning", node=msg.node, launcher=msg.launcher, reason=reason)
        answer = NodeJoined(
            job=msg.job,
            ts=ctx.now,
            node=msg.node,
            launcher=msg.launcher,
            accepted=False,
            reason=reason,
            retry=retry,
        )
        ctx.emit(Reply(answer, None))
        return prior if not state.nodes else state  # a refused first node opens no run
    workers = names_for(state, msg)
    state.put_node(
        msg.node,
        NodeState(
            launcher=msg.launcher,
            host=msg.host,
            store_addr=msg.store_addr,
            workers=workers,
            ranks=msg.ranks,
            slots=len(workers),
            reserve=len(workers) - (0 if state.phase is not JobPhase.WAITING else msg.ranks),
        ),
    )
    state.offered[msg.node] = offered  # offers made before this node joined are not for this job
    state.sched_seq = max(state.sched_seq, sched_seq)
    live = len(state.live_nodes())
    reason = f"node {msg.node} joined run {state.run} with {len(workers)} workers"
    reason += (
        ": spare capacity for the running job"
        if state.phase is not JobPhase.WAITING
        else f" ({live} of min {state.spec.min_nodes} nodes)"
    )
    ctx.log("node_joined", node=msg.node, workers=workers, run=state.run)
    answer_spec(ctx, msg, workers, reason)
    ctx.decided(None, Action.JOIN, reason, None, key=f"join:{msg.launcher}")
    maybe_start(ctx)
    return state


def rejoined(ctx: Ctx, msg: JobSpec) -> bool:
    """A redelivered spec of a launcher already in the run: answered again, nothing else."""
    state = ctx.state
    known = next((n for n, s in state.nodes.items() if s.launcher == msg.launcher), None)
    if known is None or state.nodes[known].lost or state.phase.ended:
        return False
    answer_spec(ctx, msg, state.nodes[known].workers, "already joined")
    return True


def refusal_of(state: JobState, spec: JobSpec) -> tuple[str, bool] | None:
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


def names_for(state: JobState, spec: JobSpec) -> list[str]:
    """The spec's worker names, renumbered if an earlier launcher of the run used them."""
    used = {w for s in state.nodes.values() for w in s.workers}
    if not used & set(spec.workers):
        return list(spec.workers)
    return numbered(state, re.sub(r"\d+$", "", spec.workers[0]), len(spec.workers))


def answer_spec(ctx: Ctx, spec: JobSpec, workers: list[str], reason: str) -> None:
    answer = NodeJoined(
        job=spec.job,
        ts=ctx.now,
        node=spec.node,
        launcher=spec.launcher,
        accepted=True,
        run=ctx.state.run,
        as_spares=ctx.state.phase is not JobPhase.WAITING,
        workers=workers,
        reason=reason,
    )
    ctx.emit(Reply(answer, f"{answer.job}:joined:{answer.launcher}"))


def maybe_start(ctx: Ctx) -> None:
    """Generation 1: once ``min_nodes`` nodes joined and all their ranks registered."""
    state = ctx.state
    if state.phase is not JobPhase.WAITING or len(state.live_nodes()) < state.spec.min_nodes:
        return
    live = state.live_nodes()
    if len(state.ranks) < sum(state.nodes[n].ranks for n in live):
        return  # some rank has not registered yet (checked first: this runs on every registration)
    nodes = [(n, state.nodes[n].workers[: state.nodes[n].ranks]) for n in live]
    expected = [w for _, workers in nodes for w in workers]
    registered = set(state.ranks)
    if not expected or any(w not in registered for w in expected):
        return
    group = state.spec.elastic.group_size
    order = place(nodes, group)
    members = [Member(rank=i, worker=w) for i, w in enumerate(order)]
    state.start_world = len(members)
    reason = f"{len(members)} ranks registered on {len(state.live_nodes())} node(s)"
    if warning := describe(lone_shards(order, state.worker_nodes(), group), group):
        reason += f"; {warning}"
        ctx.log("placement_unsafe", level="warning", detail=warning)
    apply(ctx, None, Decision(Action.START, reason, members=members))


def exit_refusal(state: JobState | None, msg: RankExited) -> str | None:
    """Why an exit report cannot be taken (None: its worker's own launcher sent it).

    The subject names the sender's node (a launcher may publish only its own, and
    the bus checked the payload's node is the subject's): a worker of another node
    is not that launcher's to report, whatever the exit code.
    """
    node = state.node_of(msg.worker) if state is not None else None
    if node is not None and node != msg.node:
        return f"exit of {msg.worker} reported by the launcher of node {msg.node}: it runs on {node}"
    return None


def exited(ctx: Ctx, msg: RankExited) -> None:
    state = ctx.state
    if state.phase.ended or state.node_of(msg.worker) is None:
        return
    if msg.exit_code != 0 or msg.signal:
        state.exited.add(msg.worker)  # corroborates a silence (a broken group, see the reducer)
        if state.spawned.pop(msg.worker, None) is not None:  # died before it registered
            apply(
                ctx, None, Decision(Action.HOLD, f"{msg.worker} exited while starting", removed=[msg.worker])
            )
        return
    # A member's own launcher saw it end with 0 (only it may report that worker:
    # exit_refusal): the training command finished, and so does the job.
    if state.plan and state.plan.rank_of(msg.worker) is not None:
        state.phase = JobPhase.COMPLETED
        reason = f"{msg.worker} finished generation {state.generation}: the job is complete"
        ctx.decided(None, Action.COMPLETE, reason, state.generation, key="complete")
