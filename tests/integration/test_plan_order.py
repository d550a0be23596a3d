"""Every receiver of plans keeps the newest by one order, ``Plan.supersedes``: the worker
agent, the launcher, the detector, state-replication, the policy client (and the dev
stack's job watch). Each is fed the same sequence, a stale plan of a deposed planner
(lower token, higher generation) and an older and a repeated one among them, and must end
on the same plan having taken the same ones; and no other code orders plans by hand.
"""

from __future__ import annotations

import ast
import asyncio
import contextlib
import subprocess
from pathlib import Path

import pytest
from phalanx.services.failure_detector.detector import Detector
from phalanx.services.state_replication.service import StateReplication

from phalanx.bus import Bus
from phalanx.contract import Action, Member, NodePlan, Plan, PlanDecision, Role, node_plan
from phalanx.contract.subjects import PLAN
from phalanx.devstack.jobwatch import JobResult
from phalanx.devstack.natsserver import NatsServer
from phalanx.launcher.children import Worker
from phalanx.launcher.config import LaunchConfig
from phalanx.launcher.launcher import Launcher
from phalanx.policy import PolicyClient
from phalanx.worker.agent import Agent
from phalanx.worker.status import RankStatus

JOB = "order"
ROOT = Path(__file__).resolve().parents[2]


def plan(generation: int, token: int, world: int = 2) -> Plan:
    return Plan(
        job=JOB,
        generation=generation,
        members=[Member(rank=r, worker=f"w{r}") for r in range(world)],
        reason=f"generation {generation} token {token}",
        store_prefix=f"{JOB}/gen{generation}",
        launch="r1",
        token=token,
    )


# (plan, whether it is news to a receiver holding the ones before it)
SEQUENCE = [
    (plan(2, 5), True),
    (plan(7, 3, world=3), False),  # a deposed leader's plan: higher generation, lower token
    (plan(1, 5), False),  # older, same leader
    (plan(2, 5), False),  # the same plan again (re-sent, or read from KV)
    (plan(3, 6), True),  # the new leader's next generation
    (plan(2, 6), False),  # older generation under the same (new) token
]
TAKEN = [p for p, news in SEQUENCE if news]
NEWEST = TAKEN[-1]


def test_the_order_is_token_then_generation_within_one_job() -> None:
    assert plan(2, 5).supersedes(None)
    assert plan(3, 5).supersedes(plan(2, 5)) and not plan(2, 5).supersedes(plan(3, 5))
    assert plan(1, 6).supersedes(plan(9, 5))  # a later leader wins whatever the generation
    assert not plan(9, 5).supersedes(plan(1, 6))
    assert not plan(2, 5).supersedes(plan(2, 5))  # the same plan is no news
    other = plan(4, 9).model_copy(update={"job": "another"})
    with pytest.raises(ValueError, match="not ordered"):
        other.supersedes(plan(2, 5))
    # every pair of SEQUENCE's plans is ordered one way or the same
    for a, _ in SEQUENCE:
        for b, _ in SEQUENCE:
            assert a.supersedes(b) + b.supersedes(a) + (a == b) == 1 or (a.token, a.generation) == (
                b.token,
                b.generation,
            )


def test_the_agent_takes_only_newer_plans() -> None:
    agent = Agent(RankStatus(job=JOB, worker="w0"), Role.RANK, launch="r1")  # not started: no bus
    taken: list[Plan] = []
    agent.on_plan(taken.append)
    for p, _ in SEQUENCE:
        agent._offer(p, by_message=True)
    assert taken == TAKEN and agent.latest is not None and agent.latest.plan == NEWEST


def _part(p: Plan) -> NodePlan:
    """What a launcher of node "local" holds of ``p`` (its part, as from a delta)."""
    return node_plan(p, "local", {m.worker for m in p.members} | set(p.leaving) | {"w0", "w1"})


def test_the_launcher_takes_only_newer_plans(tmp_path: Path) -> None:
    launcher = Launcher(LaunchConfig(job=JOB, cmd=["true"], nproc=2, log_dir=tmp_path))
    launcher.run = "r1"
    seen: list[tuple[int, int]] = []
    for p, _ in SEQUENCE:
        launcher._apply_plan(_part(p))
        if launcher.plan is not None and (
            not seen or seen[-1] != (launcher.plan.token, launcher.plan.generation)
        ):
            seen.append((launcher.plan.token, launcher.plan.generation))
    assert seen == [(t.token, t.generation) for t in TAKEN] and launcher.plan == _part(NEWEST)


async def test_the_launcher_ends_on_a_completion_read_before_the_plan_that_took_its_members(
    tmp_path: Path,
) -> None:
    """Plans and decisions come by different ways, in no order with each other: a node
    whose members were shrunk away ends on COMPLETE even when it reads the COMPLETE while
    its plan still names them, and the plan without them only afterwards."""
    launcher = Launcher(LaunchConfig(job=JOB, cmd=["true"], nproc=2, log_dir=tmp_path))
    launcher.run = "r1"
    procs = [subprocess.Popen(["sleep", "60"]) for _ in range(2)]
    try:
        for r, proc in enumerate(procs):
            launcher.workers[f"w{r}"] = Worker(f"w{r}", Role.RANK, proc, r)
        launcher._apply_plan(_part(plan(1, 5)))
        complete = PlanDecision(job=JOB, incident=None, action=Action.COMPLETE, reason="members finished")
        await launcher._on_decision(complete, None)  # type: ignore[arg-type]
        assert not launcher._done.is_set()  # its members (of the plan it has) still run
        for proc in procs:
            proc.kill()
            proc.wait()
        shrunk = plan(2, 5).model_copy(
            update={"members": [Member(rank=0, worker="x0")], "leaving": ["w0", "w1"]}
        )
        launcher._apply_plan(_part(shrunk))
        assert launcher._done.is_set() and await launcher.wait(1) == 0
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()


def test_the_detector_takes_only_plans_not_older_than_its_own() -> None:
    detector = Detector()
    applied = [detector.apply_plan(p) for p, _ in SEQUENCE]
    # the same plan again is applied again (idempotent); an older one is refused
    assert applied == [True, False, False, True, True, False]
    assert detector.stats.stale_plans == 3


def test_the_job_watch_reports_the_world_of_the_newest_plan() -> None:
    result = JobResult(JOB, 0, 0.0)
    for p, _ in SEQUENCE:
        result.observe(p)
    assert result.world_size == NEWEST.world_size == 2  # not the deposed leader's 3


async def test_state_replication_takes_only_newer_plans(nats_server: NatsServer, tmp_path: Path) -> None:
    bus = await Bus.connect(nats_server.url, name="state-replication")
    try:
        svc = StateReplication(bus, node="n-order")
        for p, _ in SEQUENCE:
            await svc._on_plan(p, None)  # type: ignore[arg-type]  # the raw message is not read
        assert svc.jobs[JOB].plan == NEWEST and svc.plans == len(SEQUENCE)
        assert svc.stale == len(SEQUENCE) - len(TAKEN)
    finally:
        await bus.close()


async def test_the_policy_client_hands_out_only_newer_plans(nats_server: NatsServer) -> None:
    planner = await Bus.connect(nats_server.url, name="elasticity-planner")
    client = await PolicyClient.connect(nats_server.url, name="order-policy", ensure=True)
    got: list[Plan] = []

    async def follow() -> None:
        async with contextlib.aclosing(client.watch(JOB)) as events:
            async for event in events:
                if isinstance(event, Plan):
                    got.append(event)

    async def until(n: int) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 10
        while len(got) < n and loop.time() < deadline:
            await asyncio.sleep(0.02)

    first, _ = SEQUENCE[0]
    await planner.publish(PLAN, first, msg_id=f"{JOB}:0")  # before the watch: it reads it from the stream
    task = asyncio.create_task(follow())
    last = plan(4, 6)  # after it, nothing of the sequence is still on its way (one subscription: in order)
    try:
        await until(1)  # the watch has subscribed and read the stream
        for i, (p, _) in enumerate(SEQUENCE[1:], 1):
            await planner.publish(PLAN, p, msg_id=f"{JOB}:{i}")
        await planner.publish(PLAN, last, msg_id=f"{JOB}:last")
        await until(len(TAKEN) + 1)
        assert got == [*TAKEN, last]
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await client.close()
        await planner.close()


ORDER = (ast.Lt, ast.LtE, ast.Gt, ast.GtE)


def _plan_attr(node: ast.AST, attrs: tuple[str, ...]) -> bool:
    """``<something named plan>.generation`` (or ``.token``): an attribute of a plan."""

    def names_plan(n: ast.AST) -> bool:
        if isinstance(n, ast.Attribute):
            return "plan" in n.attr.lower() or names_plan(n.value)
        return isinstance(n, ast.Name) and "plan" in n.id.lower()

    return isinstance(node, ast.Attribute) and node.attr in attrs and names_plan(node.value)


def hand_ordered_plans(source: str) -> list[str]:
    """Comparisons that order plans by hand: a plan's fencing token in an ordering
    comparison (tokens mean something only in Plan.supersedes), two plans' generations or
    tokens against each other, or ``max``/``min`` of plans by generation or token."""
    out = []
    for n in ast.walk(ast.parse(source)):
        if isinstance(n, ast.Compare) and any(isinstance(op, ORDER) for op in n.ops):
            parts = [sub for side in (n.left, *n.comparators) for sub in ast.walk(side)]
            tokens = [p for p in parts if _plan_attr(p, ("token",))]
            both = [p for p in parts if _plan_attr(p, ("generation", "token"))]
            if tokens or len(both) >= 2:
                out.append(f"{n.lineno}: {ast.unparse(n)}")
        elif isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id in ("max", "min"):
            for kw in n.keywords:
                if kw.arg == "key" and isinstance(kw.value, ast.Lambda):
                    body = kw.value.body
                    if any(
                        isinstance(s, ast.Attribute) and s.attr in ("generation", "token")
                        for s in ast.walk(body)
                    ):
                        if any("plan" in ast.unparse(a).lower() for a in n.args):
                            out.append(f"{n.lineno}: {ast.unparse(n)}")
    return out


def test_the_static_check_finds_hand_ordered_plans() -> None:
    """The check below can fail: the old forms that name a plan are found. (One that names
    none, ``msg.generation <= view.generation``, cannot be told from a rank comparing its own
    progress: the behavioural tests above are what holds each receiver to the order.)"""
    found = [
        "if plan.token < self._token: pass",
        "if plan.generation <= latest.plan.generation: pass",
        "if self.plan is not None and plan.generation <= self.plan.generation: pass",
        "newest = max(self.plans, key=lambda p: p.generation)",
        "if (p.token, p.generation) > (plan.token, plan.generation): pass",
    ]
    for src in found:
        assert hand_ordered_plans(src), src
    assert not hand_ordered_plans("if plan.generation > generation: pass")  # a plan against a rank's progress


def test_no_code_but_plan_supersedes_orders_plans() -> None:
    offenders = []
    for base in ("libs", "services", "examples"):
        for path in sorted((ROOT / base).rglob("*.py")):
            if path == ROOT / "libs/phalanx/contract/messages.py":
                continue  # Plan.supersedes itself
            offenders += [f"{path.relative_to(ROOT)}:{hit}" for hit in hand_ordered_plans(path.read_text())]
    assert not offenders, "order plans with Plan.supersedes:\n" + "\n".join(offenders)
