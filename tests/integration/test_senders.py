"""Events bound to their senders, against a real nats-server enforcing the users of
``phalanx.natsauth`` and the real failure-detector and elasticity-planner.

The job ``sj`` runs on two nodes, ``a`` and ``b``: each node's launcher logs in as
``launcher@sj/<node>`` and publishes its own node's digests (its workers' heartbeats,
advancing every interval, as a live launcher does); each worker logs in as
``rank@sj/<worker>``. Generation 1 has the members ``a-w0 a-w1 b-w0 b-w1`` and the
spares ``a-w2 b-w2``. Each test is an attack with credentials a deployment hands
out (another node's launcher, another rank, a spare): it must be refused (by the
server, or by the receiver as bad input on ``phalanx.err.<service>``) and change
nothing the planner committed; a real fault of the victim afterwards still gives its
verdict, and the victim's own launcher still may report it.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from nats.aio.msg import Msg
from phalanx.services.elasticity_planner.failure_policy import ReplaceOrShrink
from phalanx.services.elasticity_planner.service import ElasticityPlanner
from phalanx.services.failure_detector.service import FailureDetector, ServiceConfig

from phalanx.bus import Bus
from phalanx.bus.auth import PermissionDenied
from phalanx.contract import (
    Action,
    CollectiveError,
    DigestEntry,
    ErrorEvent,
    JobSpec,
    NodeDigest,
    NodeJoined,
    Phase,
    Plan,
    PlanAck,
    PlanDecision,
    RankExited,
    RankFailed,
    RankHung,
    Registered,
    Role,
    decode,
)
from phalanx.contract.subjects import (
    ACK,
    COMM_ERROR,
    DECISION,
    ERROR,
    EXITED,
    FAILED,
    HUNG,
    JOB_SPEC,
    JOINED,
    NODE_DIGEST,
    PLAN,
    REGISTERED,
)
from phalanx.devstack.natsserver import NatsServer
from phalanx.natsauth import NatsAuth
from tests.integration.test_auth import wait_for

JOB = "sj"
NODES = {"a": ["a-w0", "a-w1", "a-w2"], "b": ["b-w0", "b-w1", "b-w2"]}
PIDS = {w: 1000 + i for i, w in enumerate(w for ws in NODES.values() for w in ws)}
INTERVAL_S = 0.1


@dataclass
class Seen:
    """Everything of the job the admin hears: plans, decisions, verdicts, error events."""

    plans: list[Plan] = field(default_factory=list)
    decisions: list[PlanDecision] = field(default_factory=list)
    verdicts: list[RankFailed | RankHung] = field(default_factory=list)
    errors: list[ErrorEvent] = field(default_factory=list)

    async def on_msg(self, raw: Msg) -> None:
        msg = decode(raw.data, raw.headers)
        if isinstance(msg, Plan):
            self.plans.append(msg)
        elif isinstance(msg, PlanDecision):
            self.decisions.append(msg)
        elif isinstance(msg, RankFailed | RankHung):
            self.verdicts.append(msg)
        elif isinstance(msg, ErrorEvent):
            self.errors.append(msg)

    def refused(self, service: str, text: str) -> list[ErrorEvent]:
        return [e for e in self.errors if e.service == service and text in e.reason]

    def generations(self) -> set[int]:
        return {p.generation for p in self.plans}  # (a plan is sent again until acknowledged)

    def actions(self) -> list[Action]:
        return [d.action for d in self.decisions]


class Launcher:
    """One node's launcher: its own user, its join, and a digest every interval with
    each local worker's heartbeat moving on (``hang``: one stops moving)."""

    def __init__(self, bus: Bus, node: str) -> None:
        self.bus, self.node, self.workers = bus, node, NODES[node]
        self.seq = 0
        self.hung: set[str] = set()
        self.gone: set[str] = set()
        self.beats = dict.fromkeys(self.workers, 0)
        self._task: asyncio.Task[None] | None = None

    def digest(self) -> NodeDigest:
        entries = []
        for w in self.workers:
            if w in self.gone:
                continue
            if w not in self.hung:
                self.beats[w] += 1
            seq = self.beats[w]
            entries.append(
                DigestEntry(
                    worker=w,
                    pid=PIDS[w],
                    seq=seq,
                    rank=-1,
                    generation=1,
                    step=seq,
                    step_ms=50.0,
                    phase=Phase.COMPUTE,
                    phase_ms=10.0,
                    age_ms=1.0,
                )
            )
        self.seq += 1
        return NodeDigest(
            job=JOB,
            node=self.node,
            launcher=f"L-{self.node}",
            host=self.node,
            seq=self.seq,
            interval_ms=INTERVAL_S * 1e3,
            entries=entries,
        )

    def start(self) -> None:
        async def pump() -> None:
            while True:
                await self.bus.publish(NODE_DIGEST, self.digest(), traced=False)
                await asyncio.sleep(INTERVAL_S)

        self._task = asyncio.create_task(pump())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    def exit(self, worker: str, *, code: int | None = None, signal: int | None = None) -> RankExited:
        return RankExited(
            job=JOB,
            worker=worker,
            node=self.node,
            pid=PIDS[worker],
            host=self.node,
            exit_code=code,
            signal=signal,
            exited_at=time.time(),
        )


@dataclass
class Users:
    """The deployment's users on a nats-server enforcing them: connect as one."""

    url: str
    auth: NatsAuth
    monkeypatch: pytest.MonkeyPatch
    stack: contextlib.AsyncExitStack

    async def connect(self, name: str, role: str, *, ensure: bool = False, **scope: str) -> Bus:
        with self.monkeypatch.context() as m:
            for k, v in self.auth.env(role, **scope).items():
                m.setenv(k, v)
            bus = await Bus.connect(self.url, name=name, ensure=ensure)
        self.stack.push_async_callback(bus.close)
        return bus


@dataclass
class Job:
    srv: Users
    seen: Seen
    launchers: dict[str, Launcher]
    ranks: dict[str, Bus]
    planner: ElasticityPlanner
    detector: FailureDetector
    run: str


@pytest.fixture
async def job(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[Job]:
    auth = NatsAuth.generate(jobs={JOB: [w for ws in NODES.values() for w in ws]})
    assert sorted(auth.nodes(JOB)) == ["a", "b"]
    conf = auth.write_config(tmp_path / "nats.conf")
    server = NatsServer(store_dir=tmp_path / "nats", config_file=conf).start()
    try:
        async with contextlib.AsyncExitStack() as stack:
            srv = Users(server.url, auth, monkeypatch, stack)
            admin = await srv.connect("admin", "admin", ensure=True)
            seen = Seen()
            for subject in (
                PLAN.wildcard(job=JOB),
                DECISION.wildcard(job=JOB),
                FAILED.wildcard(job=JOB),
                HUNG.wildcard(job=JOB),
                ERROR.wildcard(),
            ):
                await admin.nc.subscribe(subject, cb=seen.on_msg)
            await admin.flush()
            # A broken generation re-forms quickly: an attack would show.
            planner = ElasticityPlanner(
                await srv.connect("elasticity-planner", "planner", ensure=True),
                failure=ReplaceOrShrink(comm_grace_s=0.3),
            )
            await planner.start()
            stack.push_async_callback(planner.stop)
            detector = FailureDetector(
                await srv.connect("failure-detector", "detector", ensure=True),
                ServiceConfig.for_interval(INTERVAL_S),
            )
            await detector.start()
            stack.push_async_callback(detector.stop)
            launchers: dict[str, Launcher] = {}
            ranks: dict[str, Bus] = {}
            run = ""
            for node, workers in NODES.items():
                bus = await srv.connect(f"launcher-{JOB}-{node}", "launcher", job=JOB, node=node)
                launchers[node] = Launcher(bus, node)
                answer = await _join(bus, admin, node, workers)
                assert answer.accepted and answer.workers == workers, answer
                run = answer.run
            for node, workers in NODES.items():
                launchers[node].start()
                for i, w in enumerate(workers):
                    ranks[w] = await srv.connect(f"rank-{w}", "rank", job=JOB, worker=w)
                    role = Role.RANK if i < 2 else Role.SPARE
                    reg = Registered(job=JOB, worker=w, role=role, host=node, pid=PIDS[w], launch=run)
                    await ranks[w].publish(REGISTERED, reg, msg_id=f"reg-{w}")
            await wait_for(lambda: seen.generations() == {1}, "generation 1")
            assert [m.worker for m in seen.plans[0].members] == ["a-w0", "a-w1", "b-w0", "b-w1"]
            await wait_for(
                lambda: {w for (_, w, _) in detector.detector.tracked()} == set(PIDS), "every worker tracked"
            )
            await wait_for(lambda: detector.detector.node_of(JOB, "b-w2") == "b", "the placements")
            for launcher in launchers.values():
                stack.push_async_callback(launcher.stop)
            yield Job(srv, seen, launchers, ranks, planner, detector, run)
    finally:
        server.cleanup()


async def _join(bus: Bus, admin: Bus, node: str, workers: list[str]) -> NodeJoined:
    answers: asyncio.Queue[NodeJoined] = asyncio.Queue()

    async def on_answer(raw: Msg) -> None:
        msg = decode(raw.data, raw.headers, NodeJoined)
        if msg.node == node:
            answers.put_nowait(msg)

    sub = await admin.nc.subscribe(JOINED.format(job=JOB), cb=on_answer)
    spec = JobSpec(
        job=JOB,
        node=node,
        launcher=f"L-{node}",
        store_addr=f"{node}:29400",
        workers=workers,
        ranks=2,
        min_nodes=2,
        max_nodes=2,
        global_batch=8,
    )
    await bus.publish(JOB_SPEC, spec, msg_id=f"spec-{node}")
    try:
        return await asyncio.wait_for(answers.get(), 15)
    finally:
        await sub.unsubscribe()


async def _quiet(job: Job, seconds: float) -> None:
    """Let the services act on what they were sent: past the planner's comm grace and
    several detector intervals (what an accepted forgery would have caused by then)."""
    await job.planner.bus.flush()
    await asyncio.sleep(seconds)


# -- a launcher speaks for its own node only ----------------------------------------------------
async def test_a_forged_exit_from_another_nodes_launcher_is_refused(job: Job) -> None:
    b = job.launchers["b"]
    # On its own node's subject, about a worker of node a: refused by detector and planner.
    await b.bus.publish(EXITED, b.exit("a-w0", signal=9), msg_id="forged-exit")
    await wait_for(lambda: bool(job.seen.refused("failure-detector", "runs on a")), "the detector's refusal")
    await wait_for(lambda: bool(job.seen.refused("elasticity-planner", "runs on a")), "the planner's refusal")
    # On node a's subject: the server refuses it.
    forged = b.exit("a-w0", signal=9).model_copy(update={"node": "a"})
    with pytest.raises(PermissionDenied):
        await b.bus.publish(EXITED, forged, msg_id="forged-exit-2")
    await _quiet(job, 1.0)
    assert job.seen.verdicts == [] and job.seen.generations() == {1}
    assert Action.REPLACE not in job.seen.actions() and Action.SHRINK not in job.seen.actions()
    assert job.detector.detector.stats.refused_node >= 1
    assert ("sj", "a-w0", PIDS["a-w0"]) in set(job.detector.detector.tracked())
    # The healthy rank's own launcher reporting its crash is heard: verdict, and a new plan.
    job.launchers["a"].gone.add("a-w0")
    await job.launchers["a"].bus.publish(
        EXITED, job.launchers["a"].exit("a-w0", signal=9), msg_id="real-exit"
    )
    await wait_for(lambda: [v.worker for v in job.seen.verdicts] == ["a-w0"], "the real verdict")
    await wait_for(lambda: 2 in job.seen.generations(), "the re-plan")
    assert next(p for p in job.seen.plans if p.generation == 2).rank_of("a-w0") is None


async def test_a_members_clean_exit_forged_by_another_launcher_does_not_end_the_job(job: Job) -> None:
    b = job.launchers["b"]
    await b.bus.publish(EXITED, b.exit("a-w1", code=0), msg_id="forged-done")
    await wait_for(lambda: bool(job.seen.refused("elasticity-planner", "runs on a")), "the planner's refusal")
    await _quiet(job, 0.5)
    assert Action.COMPLETE not in job.seen.actions()
    assert job.planner.jobs[JOB].phase.value != "completed"
    # Its own launcher seeing it finish is what ends the job.
    a = job.launchers["a"]
    await a.bus.publish(EXITED, a.exit("a-w1", code=0), msg_id="real-done")
    await wait_for(lambda: Action.COMPLETE in job.seen.actions(), "the job completed")


async def test_a_forged_goodbye_in_another_nodes_digest_is_refused(job: Job) -> None:
    b = job.launchers["b"]
    forged = b.digest()
    forged.entries.append(
        DigestEntry(
            worker="a-w0",
            pid=PIDS["a-w0"],
            seq=10_000,
            rank=0,
            generation=1,
            step=10_000,
            step_ms=50.0,
            phase=Phase.DONE,
            phase_ms=0.0,
            age_ms=0.0,
        )
    )
    await b.bus.publish(NODE_DIGEST, forged, traced=False)
    await wait_for(
        lambda: bool(job.seen.refused("failure-detector", "digest entry of sj/a-w0 from node b")),
        "the refusal",
    )
    # Node b's own workers are still heard; a-w0 is still tracked ...
    assert ("sj", "a-w0", PIDS["a-w0"]) in set(job.detector.detector.tracked())
    # ... so when it hangs (its launcher's digests stop moving it on), it is judged.
    job.launchers["a"].hung.add("a-w0")
    await wait_for(lambda: [v.worker for v in job.seen.verdicts] == ["a-w0"], "the hang verdict", timeout=15)
    assert isinstance(job.seen.verdicts[0], RankHung)


# -- a rank speaks for itself only ------------------------------------------------------------
async def test_a_forged_registration_of_another_worker_is_refused(job: Job) -> None:
    rank = job.ranks["b-w0"]
    forged = Registered(job=JOB, worker="a-w0", role=Role.RANK, host="b", pid=4242, launch=job.run)
    # On its own subject: every receiver refuses it (the payload names another worker).
    await rank.publish(REGISTERED, forged, worker="b-w0", msg_id="forged-reg")
    await wait_for(
        lambda: bool(job.seen.refused("failure-detector", "registered of worker 'a-w0'")), "refusal"
    )
    # On the victim's subject: the server refuses it.
    with pytest.raises(PermissionDenied):
        await rank.publish(REGISTERED, forged, msg_id="forged-reg-2")
    assert job.detector.detector.registered_pid(JOB, "a-w0") == PIDS["a-w0"]
    # The victim is still watched: its hang gives a verdict.
    job.launchers["a"].hung.add("a-w0")
    await wait_for(lambda: [v.worker for v in job.seen.verdicts] == ["a-w0"], "the hang verdict", timeout=15)


async def test_a_spare_cannot_drive_a_reform(job: Job) -> None:
    spare = job.ranks["a-w2"]
    as_member = CollectiveError(
        job=JOB, worker="a-w0", rank=0, generation=1, step=1, error="forged", launch=job.run
    )
    await spare.publish(COMM_ERROR, as_member, worker="a-w2")  # its own subject, a member's name
    as_itself = as_member.model_copy(update={"worker": "a-w2"})
    await spare.publish(COMM_ERROR, as_itself)  # its own name: not a member
    with pytest.raises(PermissionDenied):
        await spare.publish(COMM_ERROR, as_member)  # the member's subject
    await spare.publish(ACK, PlanAck(job=JOB, generation=1, worker="a-w0", rank=0), worker="a-w2")
    await wait_for(lambda: len(job.seen.refused("elasticity-planner", "")) >= 3, "the planner's refusals")
    reasons = " | ".join(e.reason for e in job.seen.refused("elasticity-planner", ""))
    assert "collective_error of worker 'a-w0' on phalanx.evt.sj.comm_error.a-w2" in reasons
    assert "a-w2 is not rank 0" in reasons and "plan_ack of worker 'a-w0'" in reasons
    await _quiet(job, 1.5)  # five comm graces
    assert job.seen.generations() == {1} and Action.REFORM not in job.seen.actions()
    assert not job.planner.jobs[JOB].broken
