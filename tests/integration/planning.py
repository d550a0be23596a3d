"""What the planner tests share: a planner service in the test's loop, a watcher of
the job's plans and decisions, a node's launcher joining (spec, answer,
registrations), and a crash verdict."""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator

from nats.aio.msg import Msg
from phalanx.services.elasticity_planner.service import ElasticityPlanner

from phalanx.bus import Bus
from phalanx.contract import (
    FaultCause,
    JobSpec,
    NodeJoined,
    Plan,
    PlanDecision,
    RankFailed,
    Registered,
    Role,
    decode,
)
from phalanx.contract.subjects import JOB_SPEC, JOINED, REGISTERED
from phalanx.service import run_service

JOB = "pj"


@contextlib.asynccontextmanager
async def planner(url: str, **kwargs: object) -> AsyncIterator[None]:
    """The elasticity-planner service, run as ``phalanx service`` runs it, until the block
    ends; ``kwargs`` go to its constructor (``failure=``, ``scaling=``: the policies)."""
    stop = asyncio.Event()
    task = asyncio.create_task(run_service(ElasticityPlanner, url=url, stop=stop, **kwargs))
    try:
        yield
    finally:
        stop.set()
        await task


class Watcher:
    """Collects plans and decisions of the job from core subscriptions."""

    def __init__(self) -> None:
        self.plans: list[Plan] = []
        self.decisions: list[PlanDecision] = []
        self.changed = asyncio.Event()

    async def on_msg(self, raw: Msg) -> None:
        msg = decode(raw.data, raw.headers)
        (self.plans if isinstance(msg, Plan) else self.decisions).append(msg)  # type: ignore[arg-type]
        self.changed.set()

    async def wait_for(self, pred: object, timeout: float = 15.0) -> None:
        async def loop() -> None:
            while not pred():  # type: ignore[operator]
                self.changed.clear()
                await self.changed.wait()

        await asyncio.wait_for(loop(), timeout)


async def join(
    bus: Bus,
    ranks: int = 3,
    spares: int = 1,
    *,
    launcher: str = "L1",
    node: str = "local",
    workers: list[str] | None = None,
    register: bool = True,
    **settings: object,
) -> NodeJoined:
    """One node's launcher joins: its spec, the planner's answer, then its workers register."""
    answers: asyncio.Queue[NodeJoined] = asyncio.Queue()

    async def on_answer(raw: Msg) -> None:
        msg = decode(raw.data, raw.headers, NodeJoined)
        if msg.launcher == launcher:
            answers.put_nowait(msg)

    sub = await bus.nc.subscribe(JOINED.format(job=JOB), cb=on_answer)
    names = workers or [f"w{i}" for i in range(ranks + spares)]
    spec = JobSpec(
        job=JOB,
        node=node,
        launcher=launcher,
        store_addr=f"store-{launcher}:29400",
        workers=names,
        ranks=ranks,
        **{"global_batch": 12, **settings},  # type: ignore[arg-type]
    )
    await bus.publish(JOB_SPEC, spec, job=JOB, msg_id=f"spec-{launcher}-{uuid.uuid4().hex[:8]}")
    answer = await asyncio.wait_for(answers.get(), 15)
    await sub.unsubscribe()
    if answer.accepted and register:
        for i, w in enumerate(answer.workers):
            role = Role.RANK if i < ranks and not answer.as_spares else Role.SPARE
            reg = Registered(job=JOB, worker=w, role=role, host=node, pid=100 + i, launch=answer.run)
            await bus.publish(REGISTERED, reg, job=JOB, msg_id=f"reg-{answer.run}-{w}")
    return answer


async def start_job(bus: Bus, ranks: int = 3, spares: int = 1) -> NodeJoined:
    return await join(bus, ranks, spares)


def failed(worker: str, rank: int, generation: int = 1, pid: int = 101) -> RankFailed:
    return RankFailed(
        job=JOB,
        incident=f"{JOB}:{worker}:{pid}",
        worker=worker,
        rank=rank,
        generation=generation,
        cause=FaultCause.PROCESS_EXIT,
        fault_at=1.0,
    )
