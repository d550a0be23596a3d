"""Who may publish what, enforced by a real nats-server (phalanx.natsauth).

Every test starts its own nats-server with the config ``NatsAuth.render_config``
writes (one user per role, random passwords) and connects each client as a role
through ``PHALANX_NATS_USER`` / ``PHALANX_NATS_PASSWORD``, the way a deployment
hands credentials to its processes. A refusal must be seen by the client (a
``permission_denied`` log line, :class:`PermissionDenied` on a JetStream publish)
and change nothing: no stored message, no delivery, no KV revision. "Nothing
arrived" is shown by a later message that did arrive, never by waiting.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path

import nats.errors
import pytest
from nats.aio.msg import Msg
from phalanx.services.elasticity_planner.service import ElasticityPlanner
from structlog.testing import capture_logs

from phalanx.bus import COMMANDS, EVENTS, JOBS_BUCKET, Bus
from phalanx.bus._connection import ENV_NATS_PASSWORD, ENV_NATS_USER, PermissionDenied
from phalanx.bus.subjects import HEARTBEAT, JOB_SPEC, JOINED, PLAN, REGISTERED
from phalanx.natsauth import KV_STREAM, NatsAuth
from phalanx.natsserver import NatsServer
from phalanx.schemas import (
    Heartbeat,
    JobSpec,
    Member,
    Message,
    NodeJoined,
    Phase,
    Plan,
    Registered,
    Role,
    decode,
    encode,
    headers_for,
)
from phalanx.service import Service, ping

JOB = "authjob"
WAIT_S = 10.0


async def wait_for(cond: Callable[[], bool], what: str, timeout: float = WAIT_S) -> None:
    """Wait until ``cond()`` holds; fail with ``what`` if it never does."""
    deadline = asyncio.get_running_loop().time() + timeout
    while not cond():
        if asyncio.get_running_loop().time() > deadline:
            pytest.fail(f"timed out after {timeout:g} s waiting for {what}")
        await asyncio.sleep(0.02)


def plan(generation: int, reason: str) -> Plan:
    return Plan(
        job=JOB,
        generation=generation,
        members=[Member(rank=0, worker="w0"), Member(rank=1, worker="w1")],
        reason=reason,
        store_prefix=f"{JOB}/gen{generation}",
    )


@dataclass
class AuthServer:
    """A nats-server enforcing the roles, and a way to connect as one of them."""

    url: str
    log_file: Path
    auth: NatsAuth
    monkeypatch: pytest.MonkeyPatch
    stack: contextlib.AsyncExitStack

    @contextlib.contextmanager
    def as_role(self, role: str) -> object:
        """The process environment of ``role`` (what Bus.connect reads)."""
        with self.monkeypatch.context() as m:
            for k, v in self.auth.env(role).items():
                m.setenv(k, v)
            yield

    async def connect(self, role: str, *, name: str | None = None, ensure: bool = False) -> Bus:
        with self.as_role(role):
            bus = await Bus.connect(self.url, name=name or role, ensure=ensure)
        self.stack.push_async_callback(bus.close)
        return bus


@pytest.fixture
async def srv(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[AuthServer]:
    auth = NatsAuth.generate()
    conf = auth.write_config(tmp_path / "nats.conf")  # listen and store dir: NatsServer's flags
    server = NatsServer(store_dir=tmp_path / "nats", config_file=conf).start()
    try:
        async with contextlib.AsyncExitStack() as stack:
            s = AuthServer(server.url, server.log_file, auth, monkeypatch, stack)
            await s.connect("admin", ensure=True)  # provisions the streams and the bucket
            yield s
    finally:
        server.cleanup()


@contextlib.asynccontextmanager
async def service_as(srv: AuthServer, role: str, cls: type[Service], *, asker: Bus) -> AsyncIterator[None]:
    """Run a real service in this process with ``role``'s credentials, as run_service
    does (minus the process-wide logging and tracing set-up), until it answers its
    health ping: the reply goes to ``asker``'s inbox (allow_responses)."""
    bus = await srv.connect(role, name=cls.name, ensure=True)
    svc = cls(bus)
    await svc.serve_health()
    await svc.start()
    try:
        reply = await ping(asker, cls.name, timeout=2.0)
        assert reply.status == "ok"
        yield
    finally:
        await svc.stop()


def refusals(logs: list[dict[str, object]], subject: str) -> list[dict[str, object]]:
    return [e for e in logs if e.get("event") == "permission_denied" and e.get("subject") == subject.lower()]


# -- refusals --------------------------------------------------------------------------------
async def test_a_rank_cannot_publish_a_plan(srv: AuthServer) -> None:
    planner = await srv.connect("planner")
    rank = await srv.connect("rank", name="rank-w1")
    kv = await planner.js.key_value(JOBS_BUCKET)
    key = f"{JOB}.plan"
    revision = await kv.create(key, encode(plan(1, "committed"))[0])

    core: list[Plan] = []

    async def on_core(raw: Msg) -> None:
        core.append(decode(raw.data, raw.headers, Plan))

    stream: list[Plan] = []

    async def on_stream(msg: Message, raw: Msg) -> None:
        assert isinstance(msg, Plan)
        stream.append(msg)

    await planner.nc.subscribe(PLAN.format(job=JOB), cb=on_core)
    planner.consume(COMMANDS, "auth-plans", [PLAN.wildcard()], on_stream, (Plan,))
    await planner.nc.flush()

    forged = plan(99, "forged by a rank")
    with capture_logs() as logs:
        with pytest.raises(PermissionDenied, match=PLAN.format(job=JOB)):
            await rank.publish(PLAN, forged, job=JOB, msg_id="forged")
        await rank.publish_raw(PLAN.format(job=JOB), *encode(forged))  # core: refused just the same
        await rank.nc.flush()
        await wait_for(lambda: len(refusals(logs, PLAN.format(job=JOB))) >= 2, "both refusals logged")
    line = refusals(logs, PLAN.format(job=JOB))[0]
    assert line["operation"] == "publish" and line["user"] == "rank" and line["log_level"] == "error"
    assert PLAN.format(job=JOB) in rank.denied

    # Nothing changed: no message stored, the committed plan untouched.
    assert (await planner.js.stream_info(COMMANDS.name)).state.messages == 0
    entry = await kv.get(key)
    assert (
        entry.revision == revision
        and decode(entry.value or b"", headers_for(Plan), Plan).reason == "committed"
    )

    # The planner may: its plan is committed and delivered, and it is the first one to arrive.
    revision2 = await kv.update(key, encode(plan(2, "by the planner"))[0], last=revision)
    await planner.publish(PLAN, plan(2, "by the planner"), job=JOB, msg_id=f"{JOB}:plan:2")
    await wait_for(lambda: bool(core) and bool(stream), "the planner's plan on both paths")
    assert [p.reason for p in core] == ["by the planner"]
    assert [p.reason for p in stream] == ["by the planner"]
    assert (await kv.get(key)).revision == revision2
    assert not planner.denied


async def test_a_rank_cannot_write_the_jobs_bucket(srv: AuthServer) -> None:
    planner = await srv.connect("planner")
    rank = await srv.connect("rank", name="rank-w0")
    key = f"{JOB}.plan"
    revision = await (await planner.js.key_value(JOBS_BUCKET)).create(key, encode(plan(1, "committed"))[0])
    before = (await planner.js.stream_info(KV_STREAM)).state

    # A rank may read the committed plan (that is how a late worker learns it) ...
    rank_kv = await rank.nc.jetstream(timeout=1.0).key_value(JOBS_BUCKET)
    assert (await rank_kv.get(key)).revision == revision

    # ... but every way of writing the bucket is refused by the server.
    with pytest.raises(nats.errors.TimeoutError):
        await rank_kv.put(key, b"forged")
    with pytest.raises(nats.errors.TimeoutError):
        await rank_kv.purge(key)  # what a launcher does for a fresh job: also not a rank's
    api = [
        f"$JS.API.STREAM.PURGE.{KV_STREAM}",
        f"$JS.API.STREAM.MSG.DELETE.{KV_STREAM}",
        f"$JS.API.STREAM.UPDATE.{KV_STREAM}",
        f"$JS.API.STREAM.DELETE.{KV_STREAM}",
    ]
    payloads = [b"{}", b'{"seq": 1}', b'{"name": "%s", "subjects": ["phalanx.>"]}' % KV_STREAM.encode(), b""]
    results = await asyncio.gather(
        *(rank.nc.request(s, p, timeout=1.0) for s, p in zip(api, payloads, strict=True)),
        return_exceptions=True,
    )
    assert all(isinstance(r, nats.errors.TimeoutError) for r in results), results
    for subject in [f"$KV.{JOBS_BUCKET}.{key}", *api]:
        assert subject.lower() in rank.denied, subject

    after = (await planner.js.stream_info(KV_STREAM)).state
    assert (after.messages, after.last_seq) == (before.messages, before.last_seq)
    entry = await planner.js.key_value(JOBS_BUCKET)
    assert (await entry.get(key)).revision == revision

    # The same requests from the admin are answered: the rank's were refused, not lost.
    admin = await srv.connect("admin")
    info = await admin.js.stream_info(KV_STREAM)
    assert info.config.name == KV_STREAM


async def test_a_rank_cannot_read_another_users_replies(srv: AuthServer) -> None:
    rank = await srv.connect("rank", name="rank-w0")
    with capture_logs() as logs:
        await rank.nc.subscribe("_INBOX.planner.>")
        await rank.nc.flush()
        await wait_for(lambda: bool(refusals(logs, "_INBOX.planner.>")), "the refused subscription logged")
    assert refusals(logs, "_INBOX.planner.>")[0]["operation"] == "subscription"


@pytest.mark.parametrize("who", ["an unknown user", "a wrong password", "no credentials"])
async def test_who_is_not_a_user_cannot_connect(
    srv: AuthServer, monkeypatch: pytest.MonkeyPatch, who: str
) -> None:
    user, password = {
        "an unknown user": ("intruder", "secret"),
        "a wrong password": ("planner", "not-the-password"),
        "no credentials": (None, None),
    }[who]
    with monkeypatch.context() as m:
        for k, v in ((ENV_NATS_USER, user), (ENV_NATS_PASSWORD, password)):
            if v is None:
                m.delenv(k, raising=False)
            else:
                m.setenv(k, v)
        with pytest.raises(PermissionDenied, match="authorization violation"):
            await Bus.connect(srv.url, name="intruder", ensure=False)


# -- what the roles may do ------------------------------------------------------------------
async def test_heartbeats_and_registrations_from_a_rank_are_delivered(srv: AuthServer) -> None:
    detector = await srv.connect("detector", name="failure-detector")
    rank = await srv.connect("rank", name="rank-w0")
    beats: list[Heartbeat] = []

    async def on_beat(msg: Heartbeat, raw: Msg) -> None:
        beats.append(msg)

    await detector.subscribe(HEARTBEAT.wildcard(job=JOB), on_beat, Heartbeat, trace_messages=False)
    await detector.nc.flush()
    beat = Heartbeat(
        job=JOB,
        worker="w0",
        rank=0,
        generation=1,
        step=3,
        step_ms=1.0,
        phase=Phase.COMPUTE,
        phase_ms=1.0,
        seq=7,
        pid=1,
        host="h",
        interval_ms=100.0,
    )
    await rank.publish(HEARTBEAT, beat, traced=False, job=JOB, worker="w0")
    await wait_for(lambda: bool(beats), "the heartbeat")
    assert beats == [beat]

    reg = Registered(job=JOB, worker="w0", role=Role.RANK, host="h", pid=1)
    await rank.publish(REGISTERED, reg, job=JOB, msg_id="reg-w0")  # JetStream: acknowledged
    assert (await detector.js.stream_info(EVENTS.name)).state.messages == 1
    assert not rank.denied and not detector.denied


async def test_the_planner_service_runs_under_its_role(srv: AuthServer) -> None:
    """The real planner (consumers, KV restore, compare-and-set, publish) with planner
    credentials; spec from a launcher, registrations from ranks: generation 1 arrives."""
    admin = await srv.connect("admin")
    launcher = await srv.connect("launcher", name=f"launcher-{JOB}")
    rank = await srv.connect("rank", name="rank-w0")
    plans: list[Plan] = []

    async def on_plan(raw: Msg) -> None:
        plans.append(decode(raw.data, raw.headers, Plan))

    await rank.nc.subscribe(PLAN.format(job=JOB), cb=on_plan)
    async with service_as(srv, "planner", ElasticityPlanner, asker=admin):
        workers = ["w0", "w1"]
        answers: list[NodeJoined] = []

        async def on_answer(raw: Msg) -> None:
            answers.append(decode(raw.data, raw.headers, NodeJoined))

        await launcher.nc.subscribe(JOINED.format(job=JOB), cb=on_answer)
        spec = JobSpec(job=JOB, launcher="L1", ranks=2, global_batch=4, workers=workers)
        await launcher.publish(JOB_SPEC, spec, job=JOB, msg_id="spec")
        await wait_for(lambda: bool(answers), "the planner's answer to the launcher")
        assert answers[0].accepted
        for w in workers:
            reg = Registered(job=JOB, worker=w, role=Role.RANK, host="h", pid=1, launch=answers[0].run)
            await rank.publish(REGISTERED, reg, job=JOB, msg_id=f"reg-{w}")
        await wait_for(lambda: bool(plans), "generation 1")
        assert plans[0].generation == 1 and [m.worker for m in plans[0].members] == workers
        entry = await (await admin.js.key_value(JOBS_BUCKET)).get(f"{JOB}.plan")
        assert decode(entry.value or b"", headers_for(Plan), Plan) == plans[0]
        assert not launcher.denied and not rank.denied
        assert "Violation" not in srv.log_file.read_text()  # the planner was refused nothing either
