"""The planner's elastic inputs against a real nats-server: capacity offered on a
node becomes a request to that node's launcher and then a planned GROW; a slot
whose worker crashed is not reused until capacity is offered again; a reclaim
becomes a planned SHRINK with a deadline; a proposal is committed or rejected
with its reason; signals read again after a planner restart change nothing."""

from __future__ import annotations

import asyncio

from nats.aio.msg import Msg

from phalanx.bus import Bus
from phalanx.contract import (
    Action,
    CapacityChanged,
    Plan,
    PlanAck,
    PreemptionNotice,
    Proposal,
    Registered,
    Role,
    SpawnWorkers,
    decode,
)
from phalanx.contract.subjects import ACK, CAPACITY, FAILED, PREEMPT, PROPOSAL, REGISTERED, SPAWN
from tests.integration.planning import JOB, Watcher, failed, join, planner

ELASTIC = {"max_world_size": 4, "cooldown_s": 0.0}


class Spawns:
    """The SpawnWorkers requests launchers get."""

    def __init__(self) -> None:
        self.asks: list[SpawnWorkers] = []

    async def on_msg(self, raw: Msg) -> None:
        self.asks.append(decode(raw.data, raw.headers, SpawnWorkers))


def generations(watcher: Watcher) -> list[Plan]:
    """Each generation's plan once (the planner sends a plan again until it is acknowledged)."""
    return list({p.generation: p for p in watcher.plans}.values())


async def ack(bus: Bus, plan: Plan) -> None:
    """Every member acknowledges ``plan`` (as their agents do): the job is running again."""
    for m in plan.members:
        a = PlanAck(job=JOB, generation=plan.generation, worker=m.worker, rank=m.rank)
        await bus.publish(ACK, a, job=JOB, msg_id=f"ack-{plan.generation}-{m.worker}")


async def two_nodes(bus: Bus, watcher: Watcher, **elastic: object) -> str:
    """Nodes a and b, two ranks each, no spares: generation 1 of 4 ranks. Returns the run."""
    settings = {"elastic": {**ELASTIC, **elastic}, "min_world_size": 2, "max_nodes": 2, "min_nodes": 2}
    await join(bus, 2, 0, launcher="La", node="a", workers=["a-w0", "a-w1"], **settings)
    answer = await join(bus, 2, 0, launcher="Lb", node="b", workers=["b-w0", "b-w1"], **settings)
    await watcher.wait_for(lambda: len(generations(watcher)) == 1)
    return answer.run


async def offer(bus: Bus, slots: int, seq: int) -> None:
    msg = CapacityChanged(
        cluster="local", available_slots=slots, delta=1, source="test", offered={"b": slots}
    )
    await bus.publish(CAPACITY, msg, cluster="local", msg_id=f"cap-{seq}")


async def register_spare(bus: Bus, worker: str, run: str) -> None:
    reg = Registered(job=JOB, worker=worker, role=Role.SPARE, host="b", pid=900, launch=run)
    await bus.publish(REGISTERED, reg, job=JOB, msg_id=f"reg-{run}-{worker}")


async def test_reclaim_shrinks_offers_spawn_on_the_node_and_spares_grow_the_job(
    nats_url: str, bus: Bus, watcher: Watcher
) -> None:
    spawns = Spawns()
    await bus.nc.subscribe(SPAWN.format(job=JOB), cb=spawns.on_msg)
    async with planner(nats_url):
        run = await two_nodes(bus, watcher)
        notice = PreemptionNotice(
            cluster="local", nodes=["b"], deadline_s=10.0, source="test", reason="reclaim b"
        )
        await bus.publish(PREEMPT, notice, cluster="local", msg_id="reclaim-b-1")
        await watcher.wait_for(lambda: len(generations(watcher)) == 2)
        shrink = generations(watcher)[1]
        assert shrink.planned and shrink.world_size == 2 and sorted(shrink.leaving) == ["b-w0", "b-w1"]
        assert not shrink.removed and abs(shrink.leave_by - (notice.ts + 10.0)) < 1e-6
        assert shrink.incident == f"{JOB}:shrink:gen2"
        assert shrink.batch is not None and shrink.batch.shards == [6, 6]
        await ack(bus, shrink)

        await offer(bus, 1, 1)
        await watcher.wait_for(lambda: len(spawns.asks) == 1)
        ask = spawns.asks[0]
        assert (ask.launcher, ask.node, ask.run, ask.workers) == (
            "Lb",
            "b",
            run,
            ["b-w2"],
        )  # never a reused name
        await register_spare(bus, "b-w2", run)
        await watcher.wait_for(lambda: len(generations(watcher)) == 3)
        grow = generations(watcher)[2]
        assert grow.planned and grow.world_size == 3 and grow.rank_of("b-w2") == 2
        await watcher.wait_for(lambda: any(d.action is Action.GROW for d in watcher.decisions))
        grown = next(d for d in watcher.decisions if d.action is Action.GROW)
        assert grown.world_size == 3 and "global batch 12 held: 3 replicas x 4 samples" in grown.reason

    # A new planner reads every signal again: the job's record says it took them.
    async with planner(nats_url):
        await offer(bus, 1, 1)  # the same offer again (a duplicate: the stream drops it)
        await asyncio.sleep(1.0)
        assert len(spawns.asks) == 1 and len(generations(watcher)) == 3


async def test_a_crashed_workers_slot_waits_for_an_offer(nats_url: str, bus: Bus, watcher: Watcher) -> None:
    spawns = Spawns()
    await bus.nc.subscribe(SPAWN.format(job=JOB), cb=spawns.on_msg)
    async with planner(nats_url):
        run = await two_nodes(bus, watcher)
        event = failed("b-w1", 3)
        await bus.publish(FAILED, event, job=JOB, msg_id=event.incident)
        await watcher.wait_for(lambda: len(generations(watcher)) == 2)
        shrunk = generations(watcher)[1]
        assert shrunk.world_size == 3 and not shrunk.planned  # the group broke
        await ack(bus, shrunk)
        await asyncio.sleep(0.5)
        assert not spawns.asks  # b's free slot is the crashed one: not reused on its own
        await offer(bus, 1, 2)
        await watcher.wait_for(lambda: len(spawns.asks) == 1)
        assert spawns.asks[0].workers == ["b-w2"]
        await register_spare(bus, "b-w2", run)
        await watcher.wait_for(lambda: len(generations(watcher)) == 3)
        assert generations(watcher)[2].world_size == 4 and generations(watcher)[2].rank_of("b-w2") == 3


async def test_proposals_are_committed_or_rejected_with_the_reason(
    nats_url: str, bus: Bus, watcher: Watcher
) -> None:
    async with planner(nats_url):
        settings = {"elastic": {**ELASTIC, "auto_grow": False, "sizes": [2, 3, 4]}, "min_world_size": 2}
        answer = await join(bus, 2, 2, workers=["w0", "w1", "w2", "w3"], **settings)
        await watcher.wait_for(lambda: len(generations(watcher)) == 1)
        await ack(bus, generations(watcher)[0])
        await asyncio.sleep(0.3)
        assert len(generations(watcher)) == 1  # no grow of its own: the spares wait for a proposal

        async def propose(pid: str, world: int) -> None:
            p = Proposal(job=JOB, id=pid, policy="test", world_size=world, reason="because")
            await bus.publish(PROPOSAL, p, job=JOB, msg_id=f"{JOB}:proposal:{pid}")
            await watcher.wait_for(lambda: any(d.proposal == pid for d in watcher.decisions))

        def answer_to(pid: str) -> tuple[Action, str]:
            d = next(d for d in watcher.decisions if d.proposal == pid)
            return d.action, d.reason

        await propose("too-big", 5)
        action, reason = answer_to("too-big")
        assert action is Action.REJECT and "5 ranks is not allowed: min 2, max 4, sizes [2, 3, 4]" in reason
        await propose("grow", 3)
        assert answer_to("grow")[0] is Action.GROW
        await watcher.wait_for(lambda: len(generations(watcher)) == 2)
        grown = generations(watcher)[1]
        assert grown.world_size == 3 and grown.planned and grown.launch == answer.run
