"""Following a job's plan through its KV record, against a real nats-server: a plan
committed before the follower started, one written with no message published, one
written after a server restart; and the rank-side fencing by planner token."""

from __future__ import annotations

import asyncio

from phalanx.bus import Bus
from phalanx.contract import JobRecord, Member, Plan, Role, encode
from phalanx.contract.streams import JOBS_BUCKET
from phalanx.devstack.natsserver import NatsServer
from phalanx.worker.agent import Agent
from phalanx.worker.follow import PlanFollower, record_key
from phalanx.worker.status import RankStatus

JOB = "fj"


def plan(generation: int, token: int = 1, launch: str = "r1") -> Plan:
    return Plan(
        job=JOB,
        generation=generation,
        members=[Member(rank=0, worker="w0"), Member(rank=1, worker="w1")],
        reason=f"generation {generation}",
        store_prefix=f"{JOB}/gen{generation}",
        launch=launch,
        token=token,
    )


async def commit(bus: Bus, p: Plan) -> None:
    """Write the record as the planner does (no plan message is published here)."""
    kv = await bus.js.key_value(JOBS_BUCKET)
    payload, _ = encode(JobRecord(job=JOB, token=p.token, plan=p))
    await kv.put(record_key(JOB), payload)


async def _until(pred: object, timeout: float = 15.0) -> None:
    async def loop() -> None:
        while not pred():  # type: ignore[operator]
            await asyncio.sleep(0.02)

    await asyncio.wait_for(loop(), timeout)


async def test_the_record_is_followed_across_a_server_restart(nats_server: NatsServer) -> None:
    writer = await Bus.connect(nats_server.url, name="planner")
    reader = await Bus.connect(nats_server.url, name="rank", reconnect_wait_s=0.1)
    seen: list[int] = []
    follower = PlanFollower(reader, JOB, lambda p, by_message: seen.append(p.generation))
    try:
        await commit(writer, plan(1))  # before the follower starts: replayed
        await follower.start()
        await _until(lambda: 1 in seen)
        await commit(writer, plan(2))  # no message: the watch brings it
        await _until(lambda: 2 in seen)
        await writer.close()
        nats_server.restart()
        writer = await Bus.connect(nats_server.url, name="planner")
        await _until(lambda: reader.reconnects >= 1)
        await commit(writer, plan(3))
        await _until(lambda: 3 in seen)
    finally:
        await follower.stop()
        await reader.close()
        await writer.close()
    assert follower.watch_restarts >= 1


def test_a_rank_refuses_plans_of_a_replaced_planner_leader() -> None:
    agent = Agent(RankStatus(job=JOB, worker="w0"), Role.RANK, launch="r1")  # not started: no bus
    agent._offer_whole(plan(2, token=7), False)
    agent._offer_whole(plan(3, token=5), True)  # a deposed leader's plan: newer generation, older token
    assert agent.latest is not None and agent.latest.plan.generation == 2
    assert agent.latest.plan.ranks == {"w0": 0}  # its own part of the whole plan
    agent._offer_whole(plan(3, token=9), False)
    agent._offer_whole(plan(4, token=9, launch="r0"), False)  # another run of the job: ignored
    assert agent.latest.plan.generation == 3 and agent.latest.plan.token == 9
    assert agent.wait_plan(newer_than=2, timeout_s=0.1) is agent.latest
