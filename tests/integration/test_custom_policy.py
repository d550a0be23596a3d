"""Custom policies on a real nats-server: phalanx.policy.PolicyClient and the example
policy (examples/policy_step_time.py), against a planner side played by the test.

The fake planner does what the wire contract asks of the real one: it takes each
Proposal from ``phalanx.cmd.<job>.proposal`` and answers with a PlanDecision on
``phalanx.evt.<job>.decision`` naming the proposal's id (and, when it commits, a new
plan). A fake launcher publishes node digests the way a launcher does.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest
from nats.aio.msg import Msg
from structlog.testing import capture_logs

from examples.policy_step_time import StepTimePolicy, follow
from phalanx.bus import Bus
from phalanx.contract import (
    Action,
    BatchPlan,
    CapacityChanged,
    DigestEntry,
    Member,
    NodeDigest,
    Phase,
    Plan,
    PlanDecision,
    PreemptionNotice,
    Proposal,
    decode,
)
from phalanx.contract.subjects import CAPACITY, DECISION, NODE_DIGEST, PLAN, PREEMPT, PROPOSAL
from phalanx.devstack.natsserver import NatsServer
from phalanx.natsauth import NatsAuth
from phalanx.policy import Event, PolicyClient, ProposalTimeout, StepSample

ROOT = Path(__file__).resolve().parents[2]
JOB = "polj"
BATCH = 12
WAIT_S = 10.0


def plan(generation: int, world: int, spares: int = 0) -> Plan:
    return Plan(
        job=JOB,
        generation=generation,
        members=[Member(rank=r, worker=f"w{r}") for r in range(world)],
        spares=[f"s{i}" for i in range(spares)],
        reason="test",
        store_prefix=f"{JOB}/g{generation}",
        batch=BatchPlan(
            global_batch=BATCH, effective_batch=BATCH, world_size=world, shards=[BATCH // world] * world
        ),
    )


def answer(p: Proposal, action: Action, reason: str, generation: int | None = None) -> PlanDecision:
    return PlanDecision(
        job=JOB,
        incident=None,
        action=action,
        reason=reason,
        generation=generation,
        world_size=p.world_size if generation is not None else None,
        proposal=p.id,
    )


def digest(generation: int, step: int, step_ms: float, seq: int) -> NodeDigest:
    def entry(worker: str, rank: int) -> DigestEntry:
        return DigestEntry(
            worker=worker,
            pid=100 + max(rank, 0),
            seq=seq,
            rank=rank,
            generation=generation,
            step=step if rank >= 0 else 0,
            step_ms=step_ms if rank >= 0 else 0.0,
            phase=Phase.COMPUTE if rank >= 0 else Phase.IDLE,
            phase_ms=1.0,
            age_ms=1.0,
        )

    return NodeDigest(
        job=JOB,
        node="n1",
        launcher="L1",
        host="h",
        seq=seq,
        interval_ms=5.0,
        entries=[entry("w0", 0), entry("w1", 1), entry("s0", -1)],
    )


class FakePlanner:
    """Answers each proposal with what ``decide`` returns for it (nothing: no answer)."""

    def __init__(self, bus: Bus, decide: Callable[[Proposal], list[PlanDecision]]) -> None:
        self.bus = bus
        self.decide = decide
        self.proposals: list[Proposal] = []
        self.msg_ids: list[str] = []

    async def start(self) -> FakePlanner:
        await self.bus.nc.subscribe(PROPOSAL.format(job=JOB), cb=self._on_proposal)
        await self.bus.flush()  # the server has the subscription before any proposal comes
        return self

    async def _on_proposal(self, raw: Msg) -> None:
        p = decode(raw.data, raw.headers, Proposal)
        self.proposals.append(p)
        self.msg_ids.append((raw.headers or {}).get("Nats-Msg-Id", ""))
        for i, d in enumerate(self.decide(p)):
            await self.bus.publish(DECISION, d, job=JOB, msg_id=f"{JOB}:decision:{p.id}:{i}")


@pytest.fixture
async def client(nats_url: str, bus: Bus) -> AsyncIterator[PolicyClient]:
    c = await PolicyClient.connect(nats_url, name="test-policy")  # `bus` created the streams
    try:
        yield c
    finally:
        await c.close()


# -- propose -------------------------------------------------------------------------------
async def test_propose_round_trips_through_the_planner(bus: Bus, client: PolicyClient) -> None:
    planner = await FakePlanner(bus, lambda p: [answer(p, Action.GROW, "grow to 3", generation=7)]).start()
    decision = await client.propose(JOB, 3, "faster at 3", timeout_s=WAIT_S)
    (p,) = planner.proposals
    assert (p.job, p.policy, p.world_size, p.reason) == (JOB, "test-policy", 3, "faster at 3")
    assert planner.msg_ids == [f"{JOB}:proposal:{p.id}"]
    assert (decision.action, decision.proposal, decision.generation, decision.world_size) == (
        Action.GROW,
        p.id,
        7,
        3,
    )


async def test_propose_ignores_decisions_for_other_proposals(bus: Bus, client: PolicyClient) -> None:
    def decide(p: Proposal) -> list[PlanDecision]:
        other = Proposal(job=JOB, id="p-someone-else", policy="other", world_size=9)
        incident = PlanDecision(
            job=JOB, incident="inc-1", action=Action.REPLACE, reason="w1 died", generation=5
        )
        return [
            answer(other, Action.REJECT, "9 is beyond max"),
            incident,
            answer(p, Action.REJECT, "not enough spares"),
        ]

    await FakePlanner(bus, decide).start()
    decision = await client.propose(JOB, 4, timeout_s=WAIT_S, proposal_id="p-mine")
    assert (decision.proposal, decision.action, decision.reason) == (
        "p-mine",
        Action.REJECT,
        "not enough spares",
    )


async def test_propose_without_a_planner_times_out_clearly(bus: Bus, client: PolicyClient) -> None:
    # the last decision in the stream answers another proposal: no false match there either
    other = Proposal(job=JOB, id="p-old", policy="other", world_size=2)
    await bus.publish(DECISION, answer(other, Action.GROW, "old", generation=2), job=JOB)
    loop = asyncio.get_running_loop()
    started = loop.time()
    with pytest.raises(ProposalTimeout) as info:
        await client.propose(JOB, 3, timeout_s=0.3, proposal_id="p-lonely")
    assert 0.3 <= loop.time() - started < 3.0
    assert (info.value.proposal, info.value.job, info.value.world_size) == ("p-lonely", JOB, 3)
    assert "p-lonely" in str(info.value) and "elasticity-planner" in str(info.value)


async def test_an_answer_the_subscription_missed_is_found_in_the_stream(
    bus: Bus, client: PolicyClient
) -> None:
    # stored before propose subscribed (as if it came while the connection was away)
    early = Proposal(job=JOB, id="p-early", policy="test-policy", world_size=3)
    await bus.publish(DECISION, answer(early, Action.GROW, "grow", generation=4), job=JOB)
    decision = await client.propose(JOB, 3, timeout_s=0.3, proposal_id="p-early")
    assert (decision.proposal, decision.generation) == ("p-early", 4)


# -- watch ---------------------------------------------------------------------------------
async def next_event(events: AsyncIterator[Event]) -> Event:
    return await asyncio.wait_for(anext(events), WAIT_S)


async def test_watch_follows_plans_steps_decisions_and_signals(bus: Bus, client: PolicyClient) -> None:
    await bus.publish(PLAN, plan(1, 2, spares=1), job=JOB, msg_id="plan-1")  # before watching
    async with contextlib.aclosing(client.watch(JOB)) as events:
        first = await next_event(events)
        assert isinstance(first, Plan) and (first.generation, first.world_size, first.spares) == (
            1,
            2,
            ["s0"],
        )
        # subscribed now (the stored plan is read after subscribing)
        await bus.nc.publish(
            PLAN.format(job=JOB), b"junk", headers={"Phalanx-Kind": "plan"}
        )  # refused, dropped
        await publish_digest(bus, digest(1, 5, 100.0, 1))
        await publish_digest(bus, digest(1, 5, 100.0, 2))
        notice = PreemptionNotice(cluster="c1", job="other", workers=["x"], deadline_s=5, source="t")
        await bus.publish(PREEMPT, notice, cluster="c1")  # another job's: not for us
        await bus.publish(PREEMPT, notice.model_copy(update={"job": JOB}), cluster="c1")
        await bus.publish(
            CAPACITY, CapacityChanged(cluster="c1", available_slots=2, delta=2, source="t"), cluster="c1"
        )
        await bus.publish(PLAN, plan(1, 2, spares=1), job=JOB, msg_id="plan-1-again")  # re-published
        grow = PlanDecision(
            job=JOB, incident=None, action=Action.GROW, reason="r", generation=2, world_size=3
        )
        await bus.publish(DECISION, grow, job=JOB)
        await publish_digest(bus, digest(2, 6, 80.0, 3))
        seen = [await next_event(events) for _ in range(5)]
    sample, preempt, capacity, decision, sample2 = seen
    assert isinstance(sample, StepSample)
    assert (
        sample.worker,
        sample.rank,
        sample.generation,
        sample.world_size,
        sample.step,
        sample.step_ms,
    ) == (
        "w0",
        0,
        1,
        2,
        5,
        100.0,
    )
    assert isinstance(preempt, PreemptionNotice) and preempt.job == JOB
    assert isinstance(capacity, CapacityChanged) and capacity.available_slots == 2
    assert isinstance(decision, PlanDecision) and decision.action is Action.GROW
    # the world of generation 2 is known from the decision before its plan comes
    assert isinstance(sample2, StepSample) and (sample2.generation, sample2.world_size, sample2.step) == (
        2,
        3,
        6,
    )


async def publish_digest(bus: Bus, msg: NodeDigest) -> None:
    """As a launcher does: core NATS, untraced."""
    await bus.publish(NODE_DIGEST, msg, traced=False, job=JOB, node=msg.node)


# -- the policy role -----------------------------------------------------------------------
async def test_a_policy_under_its_own_nats_role(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    auth = NatsAuth.generate()
    server = NatsServer(store_dir=tmp_path / "nats", config_file=auth.write_config(tmp_path / "nats.conf"))
    server.start()
    try:
        buses: list[Bus] = []
        for role in ("admin", "planner"):
            with monkeypatch.context() as m:
                for k, v in auth.env(role).items():
                    m.setenv(k, v)
                buses.append(await Bus.connect(server.url, name=role, ensure=role == "admin"))
        admin, planner_bus = buses
        await FakePlanner(planner_bus, lambda p: [answer(p, Action.GROW, "ok", generation=2)]).start()
        await planner_bus.publish(PLAN, plan(1, 2), job=JOB, msg_id="plan-1")
        with monkeypatch.context() as m:
            for k, v in auth.env("policy").items():
                m.setenv(k, v)
            policy = await PolicyClient.connect(server.url, name="role-policy")
        try:
            async with contextlib.aclosing(policy.watch(JOB)) as events:
                first = await next_event(events)  # the stored plan: a message get on PHALANX_CMD
                assert isinstance(first, Plan) and first.generation == 1
                await publish_digest(admin, digest(1, 3, 90.0, 1))
                sample = await next_event(events)  # node digests: a core subscription
                assert isinstance(sample, StepSample) and sample.step == 3
                decision = await policy.propose(JOB, 3, "role check", timeout_s=WAIT_S)
                assert decision.action is Action.GROW
                assert not policy.bus.denied  # the server refused nothing
        finally:
            await policy.close()
            for b in buses:
                await b.close()
    finally:
        server.cleanup()


# -- the example policy, end to end ----------------------------------------------------------
class Job:
    """The planner's and the launchers' side of a job, by hand: world 2 with 2 spares,
    at most 4; a step takes ``STEP_MS[world]``."""

    STEP_MS = {2: 100.0, 3: 70.0, 4: 68.0}  # 3 pays (30 %), 4 does not (3 %)

    def __init__(self, bus: Bus) -> None:
        self.bus = bus
        self.generation, self.world, self.spares = 1, 2, 2
        self.step = 0
        self.shrunk = asyncio.Event()

    def decide(self, p: Proposal) -> list[PlanDecision]:
        if p.world_size > 4:
            return [answer(p, Action.REJECT, f"world size {p.world_size} is beyond max_world_size 4")]
        if p.world_size - self.world > self.spares:
            return [answer(p, Action.REJECT, "not enough spares")]
        action = Action.GROW if p.world_size > self.world else Action.SHRINK
        self.spares -= p.world_size - self.world
        self.generation, self.world = self.generation + 1, p.world_size
        return [answer(p, action, f"{action.value} to {p.world_size}", generation=self.generation)]

    async def on_proposal_decided(self) -> None:
        await self.bus.publish(
            PLAN, plan(self.generation, self.world, self.spares), job=JOB, msg_id=f"plan-{self.generation}"
        )
        if self.world == 3 and self.generation == 4:
            self.shrunk.set()

    async def digests(self) -> None:
        """Rank 0's node publishes a digest per step (a launcher every 5 ms)."""
        while True:
            self.step += 1
            msg = digest(self.generation, self.step, self.STEP_MS[self.world], self.step)
            await publish_digest(self.bus, msg)
            await asyncio.sleep(0.005)


async def test_the_step_time_policy_keeps_a_grow_that_pays_and_undoes_one_that_does_not(
    bus: Bus, client: PolicyClient
) -> None:
    job = Job(bus)

    def decide(p: Proposal) -> list[PlanDecision]:
        out = job.decide(p)
        if out[0].action is not Action.REJECT:
            asyncio.get_running_loop().create_task(job.on_proposal_decided())
        return out

    planner = await FakePlanner(bus, decide).start()
    await bus.publish(PLAN, plan(1, 2, spares=2), job=JOB, msg_id="plan-1")
    policy = StepTimePolicy(min_gain=0.05, window=3, discard=1, retry_s=30.0)
    launcher = asyncio.create_task(job.digests())
    with capture_logs() as logs:
        following = asyncio.create_task(follow(client, policy, JOB, timeout_s=WAIT_S))
        try:
            await asyncio.wait_for(job.shrunk.wait(), WAIT_S)
            done = PlanDecision(job=JOB, incident=None, action=Action.COMPLETE, reason="members finished")
            await bus.publish(DECISION, done, job=JOB)
            await asyncio.wait_for(following, WAIT_S)  # it ends with the job
        finally:
            launcher.cancel()
            following.cancel()
    assert [(p.world_size, p.policy) for p in planner.proposals] == [
        (3, "test-policy"),
        (4, "test-policy"),
        (3, "test-policy"),
    ]
    assert "back to 3" in planner.proposals[2].reason
    verdicts = [e for e in logs if e["event"] == "verdict"]
    assert [(v["kept"], v["before"]["world_size"], v["after"]["world_size"]) for v in verdicts] == [
        (True, 2, 3),
        (False, 3, 4),
    ]
    assert verdicts[0]["gain"] == pytest.approx(0.3)
    assert [e["action"] for e in logs if e["event"] == "answer"] == ["grow", "grow", "shrink"]
    assert logs[-1]["event"] == "job_ended"
    assert (policy.world, policy.ceiling, policy.ended) == (3, 4, True)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_the_policy_process_ends_cleanly_on_a_signal(nats_url: str, bus: Bus, sig: signal.Signals) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", "examples.policy_step_time", "--job", JOB, "--nats-url", nats_url],
        cwd=ROOT,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stderr is not None
        started = json.loads(proc.stderr.readline())  # logged once the signal handlers are in place
        assert started["event"] == "policy_started"
        proc.send_signal(sig)
        rest = proc.communicate(timeout=WAIT_S)[1]
        assert proc.returncode == 0, rest
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    last = json.loads(rest.strip().splitlines()[-1])
    assert (last["event"], last["why"], last["job"]) == ("policy_stopped", "signal", JOB)


async def test_a_signal_stops_the_policy_even_when_a_cancel_is_lost(
    nats_url: str, bus: Bus, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Python 3.11's ``asyncio.wait_for`` swallows a cancel that lands as its inner future
    completes (the CI failure of stop 16): the process must cancel again until it stops."""
    import examples.policy_step_time as example

    swallowed: list[int] = []

    async def stubborn_follow(*args: object, **kwargs: object) -> None:
        while True:
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                if swallowed:
                    raise
                swallowed.append(1)  # the first cancel is lost, as in wait_for

    monkeypatch.setattr(example, "follow", stubborn_follow)
    args = example.parse_args(["--job", JOB, "--nats-url", nats_url])
    with capture_logs() as logs:
        running = asyncio.create_task(example.run(args))
        while not any(e["event"] == "policy_started" for e in logs):
            await asyncio.sleep(0.01)
        signal.raise_signal(signal.SIGTERM)
        await asyncio.wait({running}, timeout=WAIT_S)
        if not running.done():
            running.cancel()
            pytest.fail("the policy did not stop on SIGTERM")
        assert running.result() == 0
    assert swallowed == [1]
    assert (logs[-1]["event"], logs[-1]["why"]) == ("policy_stopped", "signal")
