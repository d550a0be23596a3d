"""Who may publish what, enforced by a real nats-server (phalanx.natsauth), and TLS.

Every test starts its own nats-server with the config ``NatsAuth.render_config``
writes (one user per role, and the users of two jobs: per worker for ``authjob``,
random passwords) and connects each client as a role through
``PHALANX_NATS_USER`` / ``PHALANX_NATS_PASSWORD``, the way a deployment hands
credentials to its processes. A refusal must be seen by the client (a
``permission_denied`` log line, :class:`PermissionDenied` on a JetStream publish)
and change nothing: no stored message, no delivery, no KV revision. "Nothing
arrived" is shown by a later message that did arrive, never by waiting.

The TLS tests make their own CA, server and client certificates with the
``openssl`` command (skipped, with that reason, where there is none).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import shutil
import socket
import ssl
import subprocess
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import nats.errors
import pytest
from nats.aio.msg import Msg
from phalanx.services.elasticity_planner.service import ElasticityPlanner
from structlog.testing import capture_logs

from phalanx.bus import Bus
from phalanx.bus.auth import (
    ENV_NATS_PASSWORD,
    ENV_NATS_TLS_CA,
    ENV_NATS_TLS_CERT,
    ENV_NATS_TLS_KEY,
    ENV_NATS_USER,
    PermissionDenied,
)
from phalanx.bus.keywatch import KeyWatch
from phalanx.bus.kv import kv_decode
from phalanx.bus.topology import bucket_limits, ensure_bucket, ensure_topology
from phalanx.contract import (
    CollectiveError,
    Heartbeat,
    JobRecord,
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
from phalanx.contract.permissions import KV_STREAM, WATCH_SLOTS, watch_names
from phalanx.contract.streams import BUCKET_HISTORY, COMMANDS, EVENTS, JOBS_BUCKET
from phalanx.contract.subjects import COMM_ERROR, HEARTBEAT, JOB_SPEC, JOINED, PLAN, REGISTERED
from phalanx.devstack.natsserver import NatsServer
from phalanx.natsauth import NatsAuth
from phalanx.service import Service, ping
from phalanx.worker.follow import PlanFollower

JOB = "authjob"
OTHER = "otherjob"  # another job on the same server
WORKERS = {JOB: ["w0", "w1"], OTHER: ["w0"]}
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
    server: NatsServer

    @contextlib.contextmanager
    def as_role(self, role: str, job: str | None = None, worker: str | None = None) -> object:
        """The process environment of ``role`` (of ``job``'s ``worker``): what Bus.connect reads."""
        with self.monkeypatch.context() as m:
            for k, v in self.auth.env(role, job, worker).items():
                m.setenv(k, v)
            yield

    async def connect(
        self,
        role: str,
        *,
        name: str | None = None,
        ensure: bool = False,
        job: str | None = None,
        worker: str | None = None,
    ) -> Bus:
        with self.as_role(role, job, worker):
            bus = await Bus.connect(self.url, name=name or role, ensure=ensure)
        self.stack.push_async_callback(bus.close)
        return bus


@pytest.fixture
async def srv(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[AuthServer]:
    auth = NatsAuth.generate(jobs=WORKERS)
    conf = auth.write_config(tmp_path / "nats.conf")  # listen and store dir: NatsServer's flags
    server = NatsServer(store_dir=tmp_path / "nats", config_file=conf).start()
    try:
        async with contextlib.AsyncExitStack() as stack:
            s = AuthServer(server.url, server.log_file, auth, monkeypatch, stack, server)
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

    observer = await srv.connect("observer")  # the planner sends plans; it does not receive them
    await observer.nc.subscribe(PLAN.format(job=JOB), cb=on_core)
    await observer.flush()
    planner.consume(COMMANDS, "auth-plans", [PLAN.wildcard()], on_stream, (Plan,))

    forged = plan(99, "forged by a rank")
    with capture_logs() as logs:
        with pytest.raises(PermissionDenied, match=PLAN.format(job=JOB)):
            await rank.publish(PLAN, forged, job=JOB, msg_id="forged")
        payload, headers = encode(forged)
        await rank.nc.publish(PLAN.format(job=JOB), payload, headers=headers)  # core: refused just the same
        await rank.flush()
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
        await rank.flush()
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
    await detector.flush()
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
        assert decode(entry.value or b"", headers_for(JobRecord), JobRecord).plan == plans[0]
        assert not launcher.denied and not rank.denied
        assert "Violation" not in srv.log_file.read_text()  # the planner was refused nothing either


# -- per job, per worker ------------------------------------------------------------------------
def beat(job: str, worker: str, seq: int = 1) -> Heartbeat:
    return Heartbeat(
        job=job,
        worker=worker,
        rank=0,
        generation=1,
        step=3,
        step_ms=1.0,
        phase=Phase.COMPUTE,
        phase_ms=1.0,
        seq=seq,
        pid=1,
        host="h",
        interval_ms=100.0,
    )


async def test_a_message_on_another_jobs_subject_is_refused_and_changes_nothing(srv: AuthServer) -> None:
    """A rank of one job (and its launcher) cannot put a heartbeat, a collective error
    or a job spec into another job: refused by the server, logged, nothing arrives."""
    intruder = await srv.connect("rank", name="rank-w0", job=JOB, worker="w0")
    launcher = await srv.connect("launcher", name=f"launcher-{JOB}", job=JOB)
    victim = await srv.connect("rank", name="rank-w0", job=OTHER, worker="w0")
    observer = await srv.connect("observer")
    seen: list[str] = []

    async def on_msg(raw: Msg) -> None:
        seen.append(raw.subject)

    for family in ("hb", "evt", "cmd"):  # everything of the other job, as it happens
        await observer.nc.subscribe(f"phalanx.{family}.{OTHER}.>", cb=on_msg)
    await observer.flush()

    forged_error = CollectiveError(job=OTHER, worker="w0", rank=0, generation=1, step=3, error="forged")
    forged_spec = JobSpec(job=OTHER, launcher="L-forged", ranks=1, global_batch=4, workers=["w0"])
    with capture_logs() as logs:
        await intruder.publish(HEARTBEAT, beat(OTHER, "w0"), traced=False, job=OTHER, worker="w0")
        results = await asyncio.gather(
            intruder.publish(COMM_ERROR, forged_error, job=OTHER, msg_id="forged-comm"),
            intruder.publish(JOB_SPEC, forged_spec, job=OTHER, msg_id="forged-spec-1"),
            launcher.publish(JOB_SPEC, forged_spec, job=OTHER, msg_id="forged-spec-2"),  # nor its launcher
            return_exceptions=True,
        )
        assert all(isinstance(r, PermissionDenied) for r in results), results
        await intruder.flush()
        subjects = [
            HEARTBEAT.format(job=OTHER, worker="w0"),
            COMM_ERROR.format(job=OTHER, worker="w0"),
            JOB_SPEC.format(job=OTHER, node="local"),
        ]
        await wait_for(lambda: all(refusals(logs, s) for s in subjects), "every refusal logged")
    await wait_for(
        lambda: len(refusals(logs, JOB_SPEC.format(job=OTHER, node="local"))) >= 2, "both spec refusals"
    )
    users = {s: {str(r["user"]) for r in refusals(logs, s)} for s in subjects}
    assert users == {
        HEARTBEAT.format(job=OTHER, worker="w0"): {f"rank@{JOB}/w0"},
        COMM_ERROR.format(job=OTHER, worker="w0"): {f"rank@{JOB}/w0"},
        JOB_SPEC.format(job=OTHER, node="local"): {f"rank@{JOB}/w0", f"launcher@{JOB}"},
    }

    # The other job's own rank is heard, and is the first thing that job heard at all.
    await victim.publish(HEARTBEAT, beat(OTHER, "w0", seq=2), traced=False, job=OTHER, worker="w0")
    await wait_for(lambda: bool(seen), "the other job's own heartbeat")
    assert seen == [HEARTBEAT.format(job=OTHER, worker="w0")]
    for stream in (EVENTS, COMMANDS):  # nothing stored either
        assert (await observer.js.stream_info(stream.name)).state.messages == 0
    # ... while inside its own job the same rank and launcher are allowed.
    own = CollectiveError(job=JOB, worker="w0", rank=0, generation=1, step=3, error="real")
    await intruder.publish(COMM_ERROR, own, job=JOB, msg_id="own-comm")
    spec = JobSpec(job=JOB, launcher="L1", ranks=1, global_batch=4, workers=["w0"])
    await launcher.publish(JOB_SPEC, spec, job=JOB, msg_id="own-spec")
    assert (await observer.js.stream_info(EVENTS.name)).state.messages == 1
    assert (await observer.js.stream_info(COMMANDS.name)).state.messages == 1
    assert not victim.denied


async def test_a_worker_cannot_heartbeat_as_another(srv: AuthServer) -> None:
    w0 = await srv.connect("rank", name="rank-w0", job=JOB, worker="w0")
    detector = await srv.connect("detector", name="failure-detector")
    beats: list[Heartbeat] = []

    async def on_beat(msg: Heartbeat, raw: Msg) -> None:
        beats.append(msg)

    await detector.subscribe(HEARTBEAT.wildcard(job=JOB), on_beat, Heartbeat, trace_messages=False)
    await detector.flush()
    with capture_logs() as logs:
        await w0.publish(HEARTBEAT, beat(JOB, "w1", seq=1), traced=False, job=JOB, worker="w1")
        await w0.flush()
        await wait_for(lambda: bool(refusals(logs, HEARTBEAT.format(job=JOB, worker="w1"))), "the refusal")
    await w0.publish(HEARTBEAT, beat(JOB, "w0", seq=2), traced=False, job=JOB, worker="w0")
    await wait_for(lambda: bool(beats), "w0's own heartbeat")
    assert [(b.worker, b.seq) for b in beats] == [("w0", 2)]


async def test_a_jobs_rank_follows_its_record_and_reads_nothing_else(srv: AuthServer) -> None:
    """The KV get (a direct get) and the KV watch (a KeyWatch) a rank follows its plan with
    work under its job's credentials; writes, other streams and other jobs' subjects do not."""
    planner = await srv.connect("planner")
    kv = await planner.js.key_value(JOBS_BUCKET)
    await kv.put(f"{JOB}.plan", encode(plan(1, "first"))[0])
    rank = await srv.connect("rank", name="rank-w1", job=JOB, worker="w1")
    rank_js = rank.nc.jetstream(timeout=1.0)  # a refused request is a timeout: keep it short
    rank_kv = await rank_js.key_value(JOBS_BUCKET)
    assert decode((await rank_kv.get(f"{JOB}.plan")).value or b"", headers_for(Plan), Plan).reason == "first"

    async def next_reason(watcher: KeyWatch) -> str:
        entry = await asyncio.wait_for(anext(watcher), WAIT_S)
        return decode(entry.value or b"", headers_for(Plan), Plan).reason

    names = watch_names(srv.auth.credentials("rank", JOB, "w1").user)
    watcher = await KeyWatch.start(rank.nc, JOBS_BUCKET, f"{JOB}.plan", names=names)
    assert await next_reason(watcher) == "first"  # the latest value, replayed
    await kv.put(f"{JOB}.plan", encode(plan(2, "second"))[0])
    assert await next_reason(watcher) == "second"
    await watcher.stop()

    with capture_logs() as logs:
        with pytest.raises(nats.errors.TimeoutError):
            await rank_kv.put(f"{JOB}.plan", b"forged")
        with pytest.raises(nats.errors.TimeoutError):  # another job's events, by message get
            await rank_js.get_msg(EVENTS.name, seq=1)
        with pytest.raises(nats.errors.TimeoutError):  # ... or by a consumer of its own
            await rank_js.pull_subscribe(f"phalanx.evt.{OTHER}.>", durable="peek", stream=EVENTS.name)
        await rank.nc.subscribe(f"phalanx.evt.{OTHER}.>")  # core: refused as well
        await rank.flush()
        await wait_for(lambda: bool(refusals(logs, f"phalanx.evt.{OTHER}.>")), "the refused subscription")
    for api in (f"$KV.{JOBS_BUCKET}.{JOB}.plan", f"$JS.API.STREAM.MSG.GET.{EVENTS.name}"):
        assert api.lower() in rank.denied, api
    assert (await kv.get(f"{JOB}.plan")).revision == 2


async def test_a_rank_holds_at_most_its_few_watches_and_no_job_loses_its_own(srv: AuthServer) -> None:
    """A rank may create consumers on the shared jobs bucket only under its user's
    :func:`watch_names`: fifty durable consumers under names of its choosing (both API
    forms) are refused, the few it may hold it holds (durable ones too, and it may delete
    them), and with every one of them held another job's rank, the planner and the rank
    itself still start their watches of a plan."""
    planner = await srv.connect("planner")
    kv = await planner.js.key_value(JOBS_BUCKET)
    for job in (JOB, OTHER):
        await kv.put(f"{job}.plan", encode(JobRecord(job=job, token=1, plan=plan(1, job)))[0])
    user = srv.auth.credentials("rank", JOB, "w1").user
    rank = await srv.connect("rank", name="rank-w1", job=JOB, worker="w1")
    key = f"$KV.{JOBS_BUCKET}.{JOB}.plan"
    api = "$JS.API"

    def durable(name: str) -> bytes:  # no inactive threshold: it would outlive a server restart
        config = {"durable_name": name, "deliver_subject": rank.nc.new_inbox(), "filter_subject": key}
        return json.dumps({"stream_name": KV_STREAM, "config": config, "action": "create"}).encode()

    with capture_logs() as logs:
        flood = [f"squat{i}" for i in range(50)]
        results = await asyncio.gather(
            *(
                rank.nc.request(f"{api}.CONSUMER.CREATE.{KV_STREAM}.{n}.{key}", durable(n), 1.0)
                for n in flood
            ),
            *(
                rank.nc.request(f"{api}.CONSUMER.DURABLE.CREATE.{KV_STREAM}.{n}", durable(n), 1.0)
                for n in flood
            ),
            return_exceptions=True,
        )
    assert all(isinstance(r, nats.errors.TimeoutError) for r in results), results
    assert any(e.get("event") == "permission_denied" for e in logs)
    names = watch_names(user)
    for name in names:  # what it may hold, it holds: durable, no subscription behind them
        reply = await rank.nc.request(
            f"{api}.CONSUMER.CREATE.{KV_STREAM}.{name}.{key}", durable(name), WAIT_S
        )
        assert "error" not in json.loads(reply.data), reply.data
    assert (await planner.js.stream_info(KV_STREAM)).state.consumer_count == WATCH_SLOTS == len(names)

    async def first_plan(bus: Bus, job: str) -> str:
        watch = await bus.kv.watch(JOBS_BUCKET, f"{job}.plan")
        try:
            entry = await asyncio.wait_for(anext(watch), WAIT_S)
            record = kv_decode(entry.value, JobRecord)
            assert record.plan is not None
            return record.plan.reason
        finally:
            await watch.stop()

    other = await srv.connect("rank", name="rank-other", job=OTHER, worker="w0")
    assert await first_plan(other, OTHER) == OTHER
    assert await first_plan(rank, JOB) == JOB  # every name held by its own leftovers: one taken over
    watcher = await kv.watch(f"{JOB}.plan")  # the planner's own (nats.py's, any name)
    assert (await asyncio.wait_for(watcher.updates(), WAIT_S)) is not None
    await watcher.stop()
    for name in names:  # its own, it may delete
        reply = await rank.nc.request(f"{api}.CONSUMER.DELETE.{KV_STREAM}.{name}", b"", WAIT_S)
        assert json.loads(reply.data).get("error", {}).get("code") in (None, 404), reply.data
    left = {c.name for c in await planner.js.consumers_info(KV_STREAM)}
    assert not left & set(names), left  # (the planner's own watch goes once it is inactive)


async def test_another_jobs_users_cannot_read_a_jobs_plan_or_its_secret(srv: AuthServer) -> None:
    """Job A's plan (and its rendezvous secret) is in A's record, on A's plan subject and in
    the command stream. Job B's rank and launcher get no answer by any read of it -- direct
    get, ``kv.get``, message get, a direct get with the key in the body, nats.py's
    ``kv.watch``, a consumer named with A's key, the command stream, the plan subject -- and
    a consumer named with B's own key but A's filter in its body is refused by the server.
    Every refusal is logged; nothing is created or changed; A's own rank still follows the
    record, across a server restart, and learns the secret."""
    planner = await srv.connect("planner")
    kv = await planner.js.key_value(JOBS_BUCKET)
    first = plan(1, "first").model_copy(update={"store_secret": "s3cret-of-generation-1"})
    revision = await kv.put(f"{JOB}.plan", encode(JobRecord(job=JOB, token=1, plan=first))[0])
    await planner.publish(PLAN, first, job=JOB, msg_id=f"{JOB}:plan:1")  # stored in the command stream
    key = f"$KV.{JOBS_BUCKET}.{JOB}.plan"
    api = "$JS.API"

    for role in ("rank", "launcher"):
        worker = "w0" if role == "rank" else None
        intruder = await srv.connect(role, name=f"{role}-intruder", job=OTHER, worker=worker)
        js = intruder.nc.jetstream(timeout=1.0)  # a refused request is a timeout: keep it short
        ikv = await js.key_value(JOBS_BUCKET)  # the bucket's stream info is allowed (job names)
        body_filter = {"name": "peek", "deliver_subject": intruder.nc.new_inbox(), "filter_subject": key}
        own = f"$KV.{JOBS_BUCKET}.{OTHER}.plan"
        last_by_subject = json.dumps({"last_by_subj": key}).encode()
        with capture_logs() as logs:
            attempts: list[Awaitable[object]] = [
                ikv.get(f"{JOB}.plan"),  # a direct get naming A's key
                js.get_msg(KV_STREAM, subject=key),  # a message get (the key in the body)
                intruder.nc.request(f"{api}.DIRECT.GET.{KV_STREAM}", last_by_subject),  # key in the body
                ikv.watch(f"{JOB}.plan"),  # nats.py's watch: an unnamed consumer
                KeyWatch.start(intruder.nc, JOBS_BUCKET, f"{JOB}.plan", timeout_s=1.0),  # named, A's key
                js.get_msg(COMMANDS.name, seq=1),  # the plan as published
                js.subscribe(PLAN.format(job=JOB), stream=COMMANDS.name),
            ]
            results = await asyncio.gather(*attempts, return_exceptions=True)
            assert all(isinstance(r, nats.errors.TimeoutError) for r in results), results
            # Its own name and key in the API subject (allowed), A's filter in the body: the server refuses.
            name = watch_names(srv.auth.credentials(role, OTHER, worker).user)[0]
            body_filter["name"] = name
            reply = await intruder.nc.request(
                f"{api}.CONSUMER.CREATE.{KV_STREAM}.{name}.{own}",
                json.dumps({"stream_name": KV_STREAM, "config": body_filter, "action": "create"}).encode(),
                timeout=WAIT_S,
            )
            assert json.loads(reply.data)["error"]["err_code"] == 10131, reply.data
            await intruder.nc.subscribe(PLAN.format(job=JOB))  # the plan subject: refused as well
            await intruder.flush()
            await wait_for(lambda: bool(refusals(logs, PLAN.format(job=JOB))), "the refused subscription")
        denied = {
            f"{api}.DIRECT.GET.{KV_STREAM}.{key}",
            f"{api}.STREAM.MSG.GET.{KV_STREAM}",
            f"{api}.DIRECT.GET.{KV_STREAM}",
            f"{api}.CONSUMER.CREATE.{KV_STREAM}",
            f"{api}.STREAM.MSG.GET.{COMMANDS.name}",
            PLAN.format(job=JOB),
        }
        assert {d.lower() for d in denied} <= set(intruder.denied), intruder.denied
        assert any(d.startswith(f"{api}.consumer.create.{KV_STREAM}.watch_".lower()) for d in intruder.denied)
        users = {str(line["user"]) for line in logs if line.get("event") == "permission_denied"}
        assert users == {srv.auth.credentials(role, OTHER, worker).user}

    # Nothing was created or changed: no consumer on the bucket or the commands, the same record.
    for stream in (KV_STREAM, COMMANDS.name):
        assert (await planner.js.stream_info(stream)).state.consumer_count == 0, stream
    assert (await kv.get(f"{JOB}.plan")).revision == revision

    # Job A's own rank follows its record (and so learns the secret), across a restart.
    member = await srv.connect("rank", name="rank-w0", job=JOB, worker="w0")
    seen: list[Plan] = []
    follower = PlanFollower(member, JOB, lambda p, by_message: seen.append(p))
    await follower.start()
    try:
        await wait_for(lambda: any(p.generation == 1 for p in seen), "generation 1, read and replayed")
        assert seen[0].store_secret == "s3cret-of-generation-1"
        await planner.close()
        srv.server.restart()
        planner = await srv.connect("planner")
        await wait_for(lambda: member.reconnects >= 1, "the member's reconnect")
        second = plan(2, "second").model_copy(update={"store_secret": "s3cret-of-generation-2"})
        kv = await planner.js.key_value(JOBS_BUCKET)
        await kv.put(f"{JOB}.plan", encode(JobRecord(job=JOB, token=1, plan=second))[0])  # no message
        await wait_for(lambda: any(p.generation == 2 for p in seen), "generation 2 through the watch")
    finally:
        await follower.stop()
    assert next(p.store_secret for p in seen if p.generation == 2) == "s3cret-of-generation-2"
    assert not member.denied


async def test_a_jobs_bucket_from_before_direct_gets_gets_them_from_the_planner(srv: AuthServer) -> None:
    """A deployment whose bucket has no direct gets (made before they were used): a job's
    rank cannot read its record (the unscoped message get is not allowed); a launcher's
    ensure cannot change the bucket (refused, logged); the planner's does, and the rank
    reads its record from then on."""
    admin = await srv.connect("admin")
    await admin.js.delete_key_value(JOBS_BUCKET)
    limits = bucket_limits(JOBS_BUCKET)
    old = await admin.js.create_key_value(  # as it was made: all but direct gets
        bucket=JOBS_BUCKET,
        history=BUCKET_HISTORY,
        max_bytes=limits.max_bytes,
        max_value_size=limits.max_msg_size,
    )
    await old.put(f"{JOB}.plan", encode(plan(1, "first"))[0])
    rank = await srv.connect("rank", name="rank-w0", job=JOB, worker="w0")
    with pytest.raises(nats.errors.TimeoutError):
        await (await rank.nc.jetstream(timeout=1.0).key_value(JOBS_BUCKET)).get(f"{JOB}.plan")

    launcher = await srv.connect("launcher", name=f"launcher-{JOB}", job=JOB)
    with capture_logs() as logs:
        await ensure_bucket(launcher.nc.jetstream(timeout=1.0), JOBS_BUCKET)
    assert [e["event"] for e in logs if e.get("stream") == KV_STREAM] == ["stream_config_outdated"]
    assert not (await admin.js.stream_info(KV_STREAM)).config.allow_direct

    planner = await srv.connect("planner", name="elasticity-planner", ensure=True)
    assert (await admin.js.stream_info(KV_STREAM)).config.allow_direct
    assert not planner.denied
    entry = await (await rank.nc.jetstream(timeout=1.0).key_value(JOBS_BUCKET)).get(f"{JOB}.plan")
    assert decode(entry.value or b"", headers_for(Plan), Plan).reason == "first"


# -- TLS ----------------------------------------------------------------------------------------
@dataclass
class Pki:
    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


@pytest.fixture
def pki(tmp_path: Path) -> Pki:
    """A throw-away CA, a server certificate for 127.0.0.1/localhost and a client certificate."""
    if shutil.which("openssl") is None:
        pytest.skip("no openssl command to make test certificates with (and no other way is implemented)")
    d = tmp_path / "pki"
    d.mkdir()
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    _openssl("req", "-x509", *ec, "-keyout", "ca.key", "-out", "ca.pem", "-days", "2", "-subj", "/CN=phalanx test CA",
             "-addext", "basicConstraints=critical,CA:TRUE", "-addext", "keyUsage=critical,keyCertSign,cRLSign", cwd=d)  # fmt: skip
    for name, ext in (
        ("server", "subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage=serverAuth\n"),
        ("client", "extendedKeyUsage=clientAuth\n"),
    ):
        (d / f"{name}.ext").write_text(
            f"basicConstraints=CA:FALSE\nauthorityKeyIdentifier=keyid,issuer\n{ext}"
        )
        _openssl(
            "req", *ec, "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN=phalanx {name}", cwd=d
        )
        _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-set_serial", "7",
                 "-days", "2", "-out", f"{name}.pem", "-extfile", f"{name}.ext", cwd=d)  # fmt: skip
    return Pki(d / "ca.pem", d / "server.pem", d / "server.key", d / "client.pem", d / "client.key")


@contextlib.contextmanager
def tls_env(monkeypatch: pytest.MonkeyPatch, **values: Path | None) -> Iterator[None]:
    names = {"ca": ENV_NATS_TLS_CA, "cert": ENV_NATS_TLS_CERT, "key": ENV_NATS_TLS_KEY}
    with monkeypatch.context() as m:
        for k, var in names.items():
            v = values.get(k)
            if v is None:
                m.delenv(var, raising=False)
            else:
                m.setenv(var, str(v))
        yield


def _plaintext_hello(port: int) -> bytes:
    """What a client that does not speak TLS gets: the INFO line, then nothing but a closed socket."""
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        got = s.recv(4096)
        s.sendall(b'CONNECT {"verbose":false}\r\nPING\r\n')
        with contextlib.suppress(OSError):
            while chunk := s.recv(4096):
                got += chunk
    return got


async def test_tls_with_authorization_the_ca_connects_and_plaintext_is_refused(
    tmp_path: Path, pki: Pki, monkeypatch: pytest.MonkeyPatch
) -> None:
    auth = NatsAuth.generate(jobs=WORKERS)
    conf = auth.write_config(tmp_path / "nats.conf")
    server = NatsServer(
        store_dir=tmp_path / "nats", config_file=conf, tls_cert=pki.server_cert, tls_key=pki.server_key
    ).start()
    try:
        assert server.url.startswith("tls://")
        users = {r: auth.env(r) for r in ("admin", "observer")}
        rank_env = auth.env("rank", JOB, "w0")

        async def connect(creds: dict[str, str], url: str, name: str) -> Bus:
            with monkeypatch.context() as m:
                for k, v in creds.items():
                    m.setenv(k, v)
                return await Bus.connect(url, name=name, ensure=False)

        with tls_env(monkeypatch, ca=pki.ca):
            admin = await connect(users["admin"], server.url, "admin")
            await ensure_topology(admin.js)
            observer = await connect(users["observer"], server.url, "observer")
            rank = await connect(rank_env, server.url, "rank-w0")
        beats: list[str] = []

        async def on_msg(raw: Msg) -> None:
            beats.append(raw.subject)

        await observer.nc.subscribe(HEARTBEAT.wildcard(job=JOB), cb=on_msg)
        await observer.flush()
        await rank.publish(HEARTBEAT, beat(JOB, "w0"), traced=False, job=JOB, worker="w0")
        reg = Registered(job=JOB, worker="w0", role=Role.RANK, host="h", pid=1)
        await rank.publish(REGISTERED, reg, job=JOB, msg_id="tls-reg")  # JetStream, acknowledged over TLS
        await wait_for(lambda: bool(beats), "the heartbeat over TLS")
        assert (await admin.js.stream_info(EVENTS.name)).state.messages == 1
        for b in (rank, observer, admin):
            await b.close()

        # A client that does not trust the server's CA (the system's CAs only) is refused at once ...
        with tls_env(monkeypatch), pytest.raises(ssl.SSLError, match="CERTIFICATE_VERIFY_FAILED"):
            await asyncio.wait_for(connect(rank_env, server.url, "rank-w0"), WAIT_S)
        # ... and one that does not speak TLS at all never gets past the server's INFO.
        got = await asyncio.to_thread(_plaintext_hello, server.port)
        assert got.startswith(b"INFO ") and b'"tls_required":true' in got and b"PONG" not in got
    finally:
        server.cleanup()


async def test_mutual_tls_needs_a_client_certificate(
    tmp_path: Path, pki: Pki, monkeypatch: pytest.MonkeyPatch
) -> None:
    server = NatsServer(
        store_dir=tmp_path / "nats", tls_cert=pki.server_cert, tls_key=pki.server_key, tls_ca=pki.ca
    ).start()
    try:
        with tls_env(monkeypatch, ca=pki.ca, cert=pki.client_cert, key=pki.client_key):
            bus = await Bus.connect(server.url, name="mtls", ensure=True)
        await bus.close()
        with tls_env(monkeypatch, ca=pki.ca), pytest.raises(ssl.SSLError):
            await asyncio.wait_for(Bus.connect(server.url, name="no-client-cert", ensure=False), WAIT_S)
    finally:
        server.cleanup()


async def test_asking_for_tls_from_a_server_without_it_fails(
    nats_server: NatsServer, pki: Pki, monkeypatch: pytest.MonkeyPatch
) -> None:
    """nats.py would go on in clear; Bus.connect refuses that."""
    with tls_env(monkeypatch, ca=pki.ca), pytest.raises(ssl.SSLError, match="does not offer"):
        await Bus.connect(nats_server.url, name="wants-tls", ensure=False)
