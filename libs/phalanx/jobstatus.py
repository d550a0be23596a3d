"""What a job is doing now, read from the bus: ``phalanx status`` and ``phalanx up``.

Three sources, none of them the planner's memory: the committed plan in the
``phalanx_jobs`` bucket (generation, members, spares), the node digests the
launchers publish every heartbeat interval (each worker's step, step time, phase,
loss), and the job's decisions and recoveries in the events stream.

>>> view = await job_view(bus, "j1", listen_s=1.0)
>>> view.generation, [w.worker for w in view.workers if w.role == "rank"]
(3, ['w0', 'w1', 'w3'])
>>> [j.job for j in await list_jobs(bus)]
['j1', 'demo-faults']
"""

from __future__ import annotations

import asyncio
import math
import time
from dataclasses import dataclass, field
from typing import TypeVar

from nats.aio.msg import Msg

from phalanx.bus import Bus, Stored
from phalanx.contract import (
    Action,
    JobRecord,
    Message,
    NodeDigest,
    Plan,
    PlanDecision,
    RecoveryDone,
    StepRecord,
    StepStats,
)
from phalanx.contract.streams import EVENTS, JOBS_BUCKET
from phalanx.contract.subjects import DECISION, NODE_DIGEST, RECOVERED, STEPS

M = TypeVar("M", bound=Message)

ENDED = (Action.STOP, Action.COMPLETE)


@dataclass
class WorkerView:
    worker: str
    node: str
    role: str  # "rank" | "spare" | "left" (in a digest, not in the plan)
    rank: int | None
    pid: int | None = None
    step: int | None = None
    step_ms: float | None = None
    phase: str | None = None
    age_ms: float | None = None
    loss: float | None = None


@dataclass
class Incident:
    """A change of generation the ranks finished: ``incident`` is None for a planned resize."""

    generation: int
    incident: str | None
    ranks: int
    rank_phases_ms: float  # the slowest rank's own phases (comm_init .. first_step), summed
    at: float


@dataclass
class JobView:
    job: str
    generation: int
    world_size: int
    reason: str
    workers: list[WorkerView]
    state: str  # "running" | "ended" | "no plan"
    step: int | None = None
    steps_per_s: float | None = None
    decisions: list[PlanDecision] = field(default_factory=list)
    incidents: list[Incident] = field(default_factory=list)
    live: bool = False  # digests arrived while listening

    @property
    def ranks(self) -> list[WorkerView]:
        return sorted((w for w in self.workers if w.role == "rank"), key=lambda w: w.rank or 0)

    @property
    def spares(self) -> list[WorkerView]:
        return [w for w in self.workers if w.role == "spare"]


@dataclass
class JobSummary:
    job: str
    generation: int
    world_size: int
    spares: int
    reason: str


async def _plans(bus: Bus, pattern: str) -> dict[str, Plan]:
    """The committed plan of every job whose record key matches ``pattern``, by key."""
    records = await (await bus.kv.bucket(JOBS_BUCKET)).latest_as(pattern, JobRecord)
    return {key: r.plan for key, r in records.items() if r.plan is not None}


async def list_jobs(bus: Bus) -> list[JobSummary]:
    """Every job with a committed plan, newest generation first."""
    out = []
    for key, plan in (await _plans(bus, "*.plan")).items():
        out.append(
            JobSummary(
                key[: -len(".plan")], plan.generation, len(plan.members), len(plan.spares), plan.reason
            )
        )
    return sorted(out, key=lambda j: (-j.generation, j.job))


async def _last_steps(bus: Bus, job: str) -> list[StepRecord]:
    """The newest step records of the job (the last :class:`StepStats` a launcher sent):
    losses are not in the digests, only in these."""
    try:
        last = await bus.streams.last(EVENTS, STEPS.format(job=job), StepStats)
    except Exception:  # a server without the stream
        return []
    return last.msg.steps if last is not None else []


async def _history(bus: Bus, subject: str, expected: type[M], timeout_s: float) -> list[Stored[M]]:
    try:
        return await bus.streams.history(subject, expected, timeout_s=timeout_s)
    except Exception:  # no stream yet, or a slow server: the status shows less
        return []


def _incidents(done: list[RecoveryDone]) -> list[Incident]:
    by_gen: dict[int, list[RecoveryDone]] = {}
    for r in done:
        by_gen.setdefault(r.generation, []).append(r)
    out = []
    for gen, rs in sorted(by_gen.items()):
        out.append(
            Incident(
                generation=gen,
                incident=rs[0].incident,
                ranks=len({r.worker for r in rs}),
                rank_phases_ms=max(sum(r.phases_ms.values()) for r in rs),
                at=max(r.ts for r in rs),
            )
        )
    return out


async def job_view(bus: Bus, job: str, *, listen_s: float = 1.0, history: int = 5) -> JobView | None:
    """The job as the bus knows it; None when it has no plan and sent nothing.

    Listens to the job's node digests for ``listen_s`` (at least two heartbeat
    intervals, for a step rate) and reads its last ``history`` decisions and incidents.
    """
    digests: list[tuple[float, NodeDigest]] = []

    async def on_digest(digest: NodeDigest, raw: Msg) -> None:
        digests.append((time.monotonic(), digest))

    sub = await bus.subscribe(NODE_DIGEST.wildcard(job=job), on_digest, NodeDigest, trace_messages=False)
    try:
        plan: Plan | None = None
        try:
            plan = (await _plans(bus, f"{job}.plan")).get(f"{job}.plan")
        except Exception:
            plan = None
        decided = [s.msg for s in await _history(bus, DECISION.format(job=job), PlanDecision, timeout_s=3.0)]
        done = [s.msg for s in await _history(bus, RECOVERED.wildcard(job=job), RecoveryDone, timeout_s=3.0)]
        await asyncio.sleep(max(0.0, listen_s))
    finally:
        await sub.unsubscribe()
    if plan is None and not digests and not decided:
        return None
    workers: dict[str, WorkerView] = {}
    if plan is not None:
        for m in plan.members:
            workers[m.worker] = WorkerView(m.worker, plan.nodes.get(m.worker, "local"), "rank", m.rank)
        for name in plan.spares:
            workers[name] = WorkerView(name, plan.nodes.get(name, "local"), "spare", None)
    first: dict[str, tuple[float, int]] = {}
    last: dict[str, tuple[float, int]] = {}
    for at, d in digests:
        for e in d.entries:
            # not in the plan: a spare that registered after it (rank -1), or one that left
            role = "spare" if e.rank < 0 else "left"
            v = workers.setdefault(e.worker, WorkerView(e.worker, d.node, role, None))
            v.pid, v.step, v.step_ms, v.phase, v.age_ms = e.pid, e.step, e.step_ms, e.phase.value, e.age_ms
            if v.role == "rank":
                first.setdefault(e.worker, (at, e.step))
                last[e.worker] = (at, e.step)
    for rec in await _last_steps(bus, job):
        if rec.worker in workers and rec.loss is not None and math.isfinite(rec.loss):
            workers[rec.worker].loss = rec.loss
    rates = [
        (last[w][1] - first[w][1]) / (last[w][0] - first[w][0])
        for w in last
        if last[w][0] > first[w][0] and last[w][1] >= first[w][1]
    ]
    steps = [w.step for w in workers.values() if w.role == "rank" and w.step is not None]
    ended = bool(decided) and decided[-1].action in ENDED
    return JobView(
        job=job,
        generation=plan.generation if plan else 0,
        world_size=len(plan.members) if plan else 0,
        reason=plan.reason if plan else "",
        workers=list(workers.values()),
        state="ended" if ended else ("running" if plan else "no plan"),
        step=max(steps) if steps else None,
        steps_per_s=min(rates) if rates else None,
        decisions=decided[-history:],
        incidents=_incidents(done)[-history:],
        live=bool(digests),
    )
