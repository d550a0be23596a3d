"""``phalanx.contract.proto.PARTIES`` is what the code does, not what someone wrote down.

Each party is started for real against a real nats-server, one at a time: the four
services (as ``run_service`` runs them, minus its process-wide logging and
tracing), a rank's agent and a launcher. Every NATS client of the process is
watched: the ``phalanx.*`` subjects it subscribes to, the JetStream consumers it
creates (their filter subjects) and the ``phalanx.*`` subjects it publishes on,
attributed to the party by the client's connection name. Then each subject the
party receives gets a malformed message (a receiver must report it on
``phalanx.err.<itself>``), and the scheduler signals are driven through the
service's own ``emit``.

The test fails when

- a party receives (subscribes to, or consumes) a subject PARTIES does not list it
  as a receiver of, or PARTIES lists it as a receiver and it never subscribes;
- a party publishes a subject PARTIES does not list it as a sender of (what it
  publishes only in situations not driven here, e.g. a rank's comm_error, is not
  seen: sending is checked as a subset, and the auth e2e test runs a whole job);
- a party reports bad input and is not an ERROR sender, or is one and does not;
- a party consumes a stream or watches a KV key its NATS role does not allow
  (:mod:`phalanx.natsauth` derives the rest of the permissions from PARTIES).
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
from nats.aio.client import Client
from nats.js.manager import JetStreamManager
from phalanx.services.elasticity_planner.service import ElasticityPlanner
from phalanx.services.failure_detector.service import FailureDetector, ServiceConfig
from phalanx.services.scheduler_signal.service import SchedulerSignal
from phalanx.services.scheduler_signal.sources import Signal
from phalanx.services.state_replication.service import StateReplication

from phalanx.bus import Bus
from phalanx.contract import CapacityChanged, Member, Plan, PreemptionNotice, Role
from phalanx.contract.permissions import KV_STREAM, ROLE_OF_PARTY, ROLES
from phalanx.contract.proto import PARTIES, subject_matches
from phalanx.contract.streams import JOBS_BUCKET
from phalanx.contract.subjects import CATALOGUE, ERROR, HEALTH, PLAN, Subject
from phalanx.launcher.launcher import LaunchConfig, Launcher, LaunchError
from phalanx.service import Service
from phalanx.worker.agent import Agent
from phalanx.worker.heartbeat import SOCKET_ENV
from phalanx.worker.status import RankStatus

JOB = "contract"
WORKER = "w0"
TOKENS = {"job": JOB, "worker": WORKER, "node": "n1", "cluster": "c1", "instance": "i1"}
WAIT_S = 10.0

PARTY_NAMES = sorted(
    {p for senders, receivers in PARTIES.values() for p in (*senders, *receivers)} - {"operator", "policy"}
)


# -- recording ---------------------------------------------------------------------------
@dataclass
class Seen:
    subscribed: set[str] = field(default_factory=set)  # core subscriptions (phalanx.*)
    consumed: set[tuple[str, str]] = field(default_factory=set)  # (stream, filter subject)
    published: set[str] = field(default_factory=set)  # phalanx.* subjects


class Recorder:
    """What every NATS client of this process does, by its connection name."""

    def __init__(self) -> None:
        self.by_client: dict[str, Seen] = {}

    def seen(self, client: Any) -> Seen:
        name = str(client.options.get("name") or "?")
        return self.by_client.setdefault(name, Seen())

    def of(self, predicate: Callable[[str], bool]) -> Seen:
        """Everything the clients whose names satisfy ``predicate`` did."""
        out = Seen()
        for name, s in self.by_client.items():
            if predicate(name):
                out.subscribed |= s.subscribed
                out.consumed |= s.consumed
                out.published |= s.published
        return out


@pytest.fixture
def recorder(monkeypatch: pytest.MonkeyPatch) -> Recorder:
    rec = Recorder()
    subscribe, publish, add_consumer = Client.subscribe, Client.publish, JetStreamManager.add_consumer

    async def rec_subscribe(self: Client, subject: str, *args: Any, **kwargs: Any) -> Any:
        if subject.startswith("phalanx."):
            rec.seen(self).subscribed.add(subject)
        return await subscribe(self, subject, *args, **kwargs)

    async def rec_publish(self: Client, subject: str, *args: Any, **kwargs: Any) -> None:
        if subject.startswith("phalanx."):
            rec.seen(self).published.add(subject)
        elif subject.startswith("$JS.API.CONSUMER.CREATE.") and subject.count(".") > 5:
            # a consumer named with its filter in the subject (KeyWatch): $JS.API.CONSUMER.CREATE.<stream>.<name>.<filter>
            stream, _name, filter_subject = subject.split(".", 6)[4:]
            rec.seen(self).consumed.add((stream, filter_subject))
        await publish(self, subject, *args, **kwargs)

    async def rec_add_consumer(self: JetStreamManager, stream: str, config: Any = None, **kwargs: Any) -> Any:
        filters = [
            f
            for f in (
                getattr(config, "filter_subject", None),
                *(getattr(config, "filter_subjects", None) or []),
            )
            if f
        ]
        for f in filters or [">"]:
            rec.seen(self._nc).consumed.add((stream, f))
        return await add_consumer(self, stream, config, **kwargs)

    monkeypatch.setattr(Client, "subscribe", rec_subscribe)
    monkeypatch.setattr(Client, "publish", rec_publish)
    monkeypatch.setattr(JetStreamManager, "add_consumer", rec_add_consumer)
    return rec


def overlaps(a: str, b: str) -> bool:
    """Two subject filters have a subject in common (``*`` one token, ``>`` the rest)."""
    x, y = a.split("."), b.split(".")
    for i, (p, q) in enumerate(zip(x, y, strict=False)):
        if p == ">" or q == ">":
            return True
        if p != q and "*" not in (p, q):
            return False
        if i == min(len(x), len(y)) - 1:
            return len(x) == len(y)
    return False


def catalogue_of(filters: set[str], problems: list[str], who: str) -> set[Subject]:
    out: set[Subject] = set()
    for f in filters:
        hits = {s for s in CATALOGUE if overlaps(f, s.wildcard())}
        if not hits and f.startswith("phalanx."):
            problems.append(f"{who}: {f} is no subject of the catalogue")
        out |= hits
    return out


def listed(party: str, side: int) -> set[Subject]:
    return {s for s in CATALOGUE if party in PARTIES[s.pattern][side]}


# -- the parties -------------------------------------------------------------------------------
@dataclass
class Stage:
    url: str
    admin: Bus
    recorder: Recorder

    async def wait_receiving(self, party: str, who: Callable[[str], bool]) -> None:
        """Until the party receives everything PARTIES says it does (or WAIT_S: then the
        comparison below says what is missing)."""
        want = listed(party, 1)
        deadline = asyncio.get_running_loop().time() + WAIT_S
        while asyncio.get_running_loop().time() < deadline:
            seen = self.recorder.of(who)
            got = catalogue_of(seen.subscribed | {f for _, f in seen.consumed}, [], party)
            if want <= got:
                break
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.5)  # consumers created, and anything else it subscribes to at start

    async def feed_bad_input(self, party: str, who: Callable[[str], bool], service: str) -> None:
        """A malformed message on every subject the party receives; wait for its report."""
        for s in listed(party, 1):
            if s is HEALTH:
                continue
            await self.admin.nc.publish(s.format(**{**TOKENS, "service": service}), b"\xc1 not msgpack")
        await self.admin.flush()
        deadline = asyncio.get_running_loop().time() + (WAIT_S if party in PARTIES[ERROR.pattern][0] else 1.5)
        while asyncio.get_running_loop().time() < deadline:
            if any(subject_matches(ERROR.wildcard(), p) for p in self.recorder.of(who).published):
                return
            await asyncio.sleep(0.05)


def _who(party: str) -> Callable[[str], bool]:
    if party == "rank":
        return f"rank-{WORKER}".__eq__
    if party == "launcher":
        return lambda name: name.startswith(f"launcher-{JOB}")
    return party.__eq__


@contextlib.asynccontextmanager
async def service(stage: Stage, cls: type[Service], **kwargs: Any) -> AsyncIterator[Service]:
    bus = await Bus.connect(stage.url, name=cls.name, ensure=True)
    svc = cls(bus, **kwargs)
    await svc.serve_health()
    await svc.start()
    try:
        yield svc
    finally:
        await svc.stop()
        await bus.close()


async def run_service(stage: Stage, party: str) -> None:
    who = _who(party)
    if party == "failure-detector":
        cm = service(stage, FailureDetector, config=ServiceConfig.for_interval(0.5))
    elif party == "elasticity-planner":
        cm = service(stage, ElasticityPlanner)
    elif party == "state-replication":
        cm = service(stage, StateReplication, node="n1")
    else:
        cm = service(stage, SchedulerSignal, sources=[])
    async with cm as svc:
        await stage.wait_receiving(party, who)
        await stage.feed_bad_input(party, who, party)
        if isinstance(svc, SchedulerSignal):  # what its sources would emit
            await svc.emit(
                Signal(CapacityChanged(cluster="c1", available_slots=4, delta=4, source="t"), "c1:1")
            )
            notice = PreemptionNotice(cluster="c1", job=JOB, workers=[WORKER], deadline_s=5.0, source="t")
            await svc.emit(Signal(notice, "c1:p1"))


async def run_rank(stage: Stage, monkeypatch: pytest.MonkeyPatch) -> None:
    """A rank's agent (no launcher: heartbeats on NATS), offered a plan it is in."""
    monkeypatch.delenv(SOCKET_ENV, raising=False)
    agent = Agent(RankStatus(job=JOB, worker=WORKER), Role.RANK, url=stage.url, heartbeat_s=0.05)
    await asyncio.to_thread(agent.start)
    try:
        who = _who("rank")
        await stage.wait_receiving("rank", who)
        await stage.feed_bad_input("rank", who, f"rank-{WORKER}")
        plan = Plan(
            job=JOB,
            generation=1,
            members=[Member(rank=0, worker=WORKER)],
            reason="t",
            store_prefix=f"{JOB}/g1",
        )
        await stage.admin.publish(PLAN, plan, job=JOB)
        got = await asyncio.to_thread(agent.wait_plan, 0, WAIT_S)
        assert got is not None, "the rank never took the plan"
        await asyncio.sleep(0.5)  # its acknowledgement
    finally:
        await asyncio.to_thread(agent.close)


async def run_launcher(stage: Stage) -> None:
    """A launcher up to its join (no planner answers: it gives up after a second)."""
    launcher = Launcher(
        LaunchConfig(job=JOB, cmd=[sys.executable, "-c", "pass"], nproc=1, nats_url=stage.url, node="n1")
    )
    launcher.config.join_timeout_s = 1.0
    who = _who("launcher")
    try:
        with pytest.raises(LaunchError, match="no elasticity-planner answered"):
            await launcher.start()
        await stage.wait_receiving("launcher", who)
        await stage.feed_bad_input("launcher", who, f"launcher-{JOB}-n1")
    finally:
        await launcher.stop()


# -- the test ----------------------------------------------------------------------------------
def test_every_party_is_one_the_code_runs() -> None:
    assert set(PARTY_NAMES) == {
        "failure-detector",
        "elasticity-planner",
        "scheduler-signal",
        "state-replication",
        "rank",
        "launcher",
    }
    assert set(PARTY_NAMES) <= set(ROLE_OF_PARTY)


async def test_parties_say_what_the_code_subscribes_to_and_publishes(
    nats_url: str, recorder: Recorder, monkeypatch: pytest.MonkeyPatch
) -> None:
    admin = await Bus.connect(nats_url, name="contract-admin", ensure=True)
    stage = Stage(nats_url, admin, recorder)
    try:
        for party in ("failure-detector", "elasticity-planner", "scheduler-signal", "state-replication"):
            await run_service(stage, party)
        await run_rank(stage, monkeypatch)
        await run_launcher(stage)
    finally:
        await admin.close()

    problems: list[str] = []
    error_senders = set(PARTIES[ERROR.pattern][0])
    for party in PARTY_NAMES:
        seen = recorder.of(_who(party))
        received = catalogue_of(
            seen.subscribed | {f for _, f in seen.consumed if not f.startswith("$KV.")}, problems, party
        )
        sent = catalogue_of(seen.published, problems, party)
        for s in sorted(received - listed(party, 1), key=lambda s: s.pattern):
            problems.append(f"{party} receives {s.pattern}, which PARTIES does not say")
        for s in sorted(listed(party, 1) - received, key=lambda s: s.pattern):
            problems.append(f"PARTIES says {party} receives {s.pattern}, but it never subscribes to it")
        for s in sorted(sent - listed(party, 0), key=lambda s: s.pattern):
            problems.append(f"{party} publishes {s.pattern}, which PARTIES does not say")
        if (ERROR in sent) != (party in error_senders):
            problems.append(
                f"{party} {'reports' if ERROR in sent else 'does not report'} bad input, "
                f"but PARTIES {'does not list' if party not in error_senders else 'lists'} it as an ERROR sender"
            )
        role = ROLES[ROLE_OF_PARTY[party]]
        streams = {stream for stream, _ in seen.consumed}
        if not streams <= set(role.consumes) | ({KV_STREAM} if role.follows_plans else set()):
            problems.append(
                f"{party} consumes {sorted(streams)}; role {role.name} may consume {list(role.consumes)}"
            )
        if role.follows_plans:
            keys = {f for stream, f in seen.consumed if stream == KV_STREAM}
            if not keys <= {f"$KV.{JOBS_BUCKET}.{JOB}.plan"}:
                problems.append(f"{party} watches {sorted(keys)}; its role may watch only its job's record")
    assert not problems, "PARTIES and the code disagree:\n" + "\n".join(problems)
