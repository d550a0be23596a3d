"""Bounded streams and buckets against a real nats-server (phalanx.bus.topology).

Every stream and bucket carries ``max_bytes``, ``max_msg_size`` and a per-subject
limit; ``ensure_topology`` gives an older deployment's unlimited streams and buckets
their limits; the rendered server config puts every user in an account whose
JetStream quota covers exactly those limits and refuses a stream without one. And a
rank flooding every JetStream subject it may publish to neither fills the store nor
stops the planner's compare-and-set writes or the detector's verdicts.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path

import nats
import pytest
from nats.js.api import DiscardPolicy, RetentionPolicy, StorageType, StreamConfig
from nats.js.errors import BadRequestError, ServerError
from structlog.testing import capture_logs

from phalanx.bus import Bus
from phalanx.bus.topology import account_max_file, bucket_limits, ensure_topology, stream_limits
from phalanx.contract import PlanAck, PlanDecision, RankFailed, StepStats
from phalanx.contract.codec import encode
from phalanx.contract.messages import Action, FaultCause, StepRecord
from phalanx.contract.permissions import inbox_prefix
from phalanx.contract.streams import BUCKET_HISTORY, BUCKETS, EVENTS, STREAMS
from phalanx.contract.subjects import (
    ACK,
    COMM_ERROR,
    DECISION,
    ERROR,
    FAILED,
    RECOVERED,
    REGISTERED,
    STEPS,
    Subject,
)
from phalanx.devstack.natsserver import NatsServer
from phalanx.natsauth import NatsAuth

JOB = "lim"


def _own(subject: Subject, worker: str = "w0") -> str:
    """``subject`` as ``worker`` of the job publishes it."""
    return subject.format(**{k: v for k, v in {"job": JOB, "worker": worker}.items() if k in subject.params})


def _decision(n: int) -> PlanDecision:
    return PlanDecision(job=JOB, incident=f"i{n}", action=Action.REPLACE, reason="test", generation=n)


async def test_every_stream_and_bucket_is_bounded(bus: Bus) -> None:
    for spec in STREAMS:
        cfg = (await bus.js.stream_info(spec.name)).config
        want = stream_limits(spec)
        assert (cfg.max_bytes, cfg.max_msg_size, cfg.max_msgs_per_subject) == (
            want.max_bytes,
            want.max_msg_size,
            want.max_msgs_per_subject,
        ), spec.name
        assert cfg.discard == DiscardPolicy.OLD and want.max_bytes > 0 and want.max_msgs_per_subject > 0
    for bucket in BUCKETS:
        cfg = (await bus.js.stream_info(f"KV_{bucket}")).config
        want = bucket_limits(bucket)
        assert (cfg.max_bytes, cfg.max_msg_size) == (want.max_bytes, want.max_msg_size), bucket
        assert cfg.max_msgs_per_subject == BUCKET_HISTORY and cfg.discard == DiscardPolicy.NEW


async def test_an_event_over_max_msg_size_is_refused_at_once_with_the_reason(bus: Bus) -> None:
    """A StepStats batch of 1024 records (~100 KB) is over PHALANX_EVT's 64 KiB: the
    publisher gets the stream's refusal (10054) at once, not after 30 s of retries,
    logged as ``publish_refused``; nothing is stored."""
    now = time.time()
    records = [
        StepRecord(worker="w0", rank=0, generation=1, step=i + 1, step_ms=1.0, at=now) for i in range(1024)
    ]
    big = StepStats(job=JOB, node="n0", launcher="l0", seq=0, steps=records)
    assert len(encode(big)[0]) > stream_limits(EVENTS).max_msg_size
    started = time.monotonic()
    with capture_logs() as logs, pytest.raises(BadRequestError) as refused:
        await bus.publish(STEPS, big, traced=False, retry_for_s=30.0, job=JOB)
    assert refused.value.err_code == 10054 and "maximum" in (refused.value.description or "")
    assert time.monotonic() - started < 10.0  # not retried for retry_for_s
    assert [e for e in logs if e.get("event") == "publish_refused" and e.get("size", 0) > 65536]
    with pytest.raises(nats.js.errors.NotFoundError):
        await bus.js.get_last_msg(EVENTS.name, STEPS.format(job=JOB))


async def test_the_per_subject_limit_keeps_the_newest_of_each_subject_only(
    nats_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PHALANX_EVT_MAX_MSGS_PER_SUBJECT", "16")
    bus = await Bus.connect(nats_url, name="limits")
    try:
        await bus.publish(DECISION, _decision(1))
        await bus.publish(ACK, PlanAck(job=JOB, generation=1, worker="w1", rank=1))
        for g in range(1, 41):
            await bus.publish(ACK, PlanAck(job=JOB, generation=g, worker="w0", rank=0))
        js = bus.js
        flooded = _own(ACK)
        kept = [await js.get_msg(EVENTS.name, seq) for seq in range(1, 43) if await _has(js, seq)]
        on_w0 = [m for m in kept if m.subject == flooded]
        assert len(on_w0) == 16  # the newest 16: generations 25..40
        assert [PlanAck.model_validate(_unpack(m.data)).generation for m in on_w0] == list(range(25, 41))
        # other subjects -- the planner's decision, another worker's ack -- untouched
        assert {m.subject for m in kept} == {flooded, DECISION.format(job=JOB), _own(ACK, "w1")}
    finally:
        await bus.close()


async def _has(js: nats.js.JetStreamContext, seq: int) -> bool:
    try:
        await js.get_msg(EVENTS.name, seq)
        return True
    except nats.js.errors.NotFoundError:
        return False


def _unpack(data: bytes | None) -> object:
    import msgpack

    return msgpack.unpackb(data or b"")


async def test_ensure_topology_gives_an_old_deployments_streams_and_buckets_their_limits(
    nats_url: str,
) -> None:
    """Streams and buckets as an older version made them (no limits but max_age) get
    every limit from the planner's ensure_topology; what they held stays."""
    nc = await nats.connect(nats_url)
    js = nc.jetstream()
    try:
        for spec in STREAMS:
            await js.add_stream(
                StreamConfig(
                    name=spec.name,
                    subjects=list(spec.subjects),
                    retention=RetentionPolicy.LIMITS,
                    storage=StorageType.FILE,
                    max_age=spec.max_age_s,
                    discard=DiscardPolicy.OLD,
                )
            )
        for bucket in BUCKETS:
            await js.create_key_value(bucket=bucket, history=BUCKET_HISTORY)
        assert (await js.stream_info(EVENTS.name)).config.max_bytes == -1
        await js.publish(DECISION.format(job=JOB), encode(_decision(1))[0])
        kv = await js.key_value(BUCKETS[0])
        await kv.put("old.plan", b"record")

        await ensure_topology(js)

        for spec in STREAMS:
            cfg = (await js.stream_info(spec.name)).config
            assert cfg.max_bytes == stream_limits(spec).max_bytes, spec.name
            assert cfg.max_msg_size == spec.max_msg_size and cfg.max_msgs_per_subject > 0
        for bucket in BUCKETS:
            cfg = (await js.stream_info(f"KV_{bucket}")).config
            assert (cfg.max_bytes, cfg.max_msg_size) == (
                bucket_limits(bucket).max_bytes,
                bucket_limits(bucket).max_msg_size,
            )
        assert (await js.stream_info(EVENTS.name)).state.messages == 1
        assert (await kv.get("old.plan")).value == b"record"
    finally:
        await nc.close()


async def test_a_rebinding_client_re_creates_what_is_lost_and_changes_nothing_that_exists(
    nats_url: str,
) -> None:
    """``create_only`` (a consumer re-binding after a failure): a stream of another
    configuration is left as it is (on a cluster, a re-bind once scaled the streams to
    one replica while a node was down), a missing stream or bucket is made again."""
    nc = await nats.connect(nats_url)
    js = nc.jetstream()
    try:
        await ensure_topology(js)
        events = (await js.stream_info(EVENTS.name)).config
        await js.update_stream(events.evolve(max_bytes=events.max_bytes // 2))
        await js.delete_stream(STREAMS[-1].name)
        await js.delete_key_value(BUCKETS[-1])

        await ensure_topology(js, create_only=True)

        assert (await js.stream_info(EVENTS.name)).config.max_bytes == events.max_bytes // 2
        assert (await js.stream_info(STREAMS[-1].name)).config.max_bytes == stream_limits(
            STREAMS[-1]
        ).max_bytes
        assert (await js.stream_info(f"KV_{BUCKETS[-1]}")).config.max_bytes == bucket_limits(
            BUCKETS[-1]
        ).max_bytes

        await ensure_topology(js)
        assert (await js.stream_info(EVENTS.name)).config.max_bytes == events.max_bytes
    finally:
        await nc.close()


# -- with the rendered server config: the account's quota ------------------------------------
@dataclass
class QuotaServer:
    server: NatsServer
    auth: NatsAuth

    async def connect(self, role: str, worker: str | None = None, **kw: object) -> nats.NATS:
        cred = self.auth.credentials(role, JOB if worker else None, worker)
        return await nats.connect(
            self.server.url,
            user=cred.user,
            password=cred.password,
            inbox_prefix=inbox_prefix(cred.user),
            **kw,  # type: ignore[arg-type]
        )


SMALL = {  # small limits, so the flood below reaches them in seconds
    "PHALANX_EVT_MAX_BYTES": str(64 << 20),
    "PHALANX_EVT_MAX_MSGS_PER_SUBJECT": "64",
    "PHALANX_ERR_MAX_BYTES": str(16 << 20),
    "PHALANX_ERR_MAX_MSGS_PER_SUBJECT": "64",
    "PHALANX_CMD_MAX_BYTES": str(16 << 20),
    "PHALANX_SCHED_MAX_BYTES": str(4 << 20),
    "PHALANX_JOBS_KV_MAX_BYTES": str(16 << 20),
    "PHALANX_CLUSTER_KV_MAX_BYTES": str(1 << 20),
    "PHALANX_CKPT_KV_MAX_BYTES": str(16 << 20),
}


@pytest.fixture
def small_limits(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    for k, v in SMALL.items():
        monkeypatch.setenv(k, v)
    yield


@pytest.fixture
async def quota_server(tmp_path: Path, small_limits: None) -> AsyncIterator[QuotaServer]:
    auth = NatsAuth.generate(jobs={JOB: ["w0", "w1"]})
    conf = auth.write_config(tmp_path / "nats.conf")
    server = NatsServer(store_dir=tmp_path / "nats", config_file=conf).start()
    try:
        qs = QuotaServer(server, auth)
        nc = await qs.connect("planner")
        await ensure_topology(nc.jetstream())
        await nc.close()
        yield qs
    finally:
        server.cleanup()


async def test_the_account_refuses_a_stream_without_max_bytes_or_beyond_its_quota(
    quota_server: QuotaServer,
) -> None:
    nc = await quota_server.connect("admin")
    js = nc.jetstream()
    try:
        info = await js.account_info()
        assert info.limits.max_storage == account_max_file() and info.limits.max_bytes_required
        with pytest.raises(BadRequestError) as unbounded:
            await js.add_stream(StreamConfig(name="UNBOUNDED", subjects=["other.a"]))
        assert unbounded.value.err_code == 10113  # "account requires a stream config to have max bytes set"
        with pytest.raises(ServerError) as overcommit:
            await js.add_stream(
                StreamConfig(name="GREEDY", subjects=["other.b"], max_bytes=account_max_file())
            )
        assert overcommit.value.err_code == 10047  # insufficient storage resources
    finally:
        await nc.close()


async def test_a_flooding_rank_fills_nothing_and_starves_no_write(quota_server: QuotaServer) -> None:
    """``rank@lim/w0`` publishes 60 KiB messages as fast as it can for 8 s on every
    JetStream subject it may publish to (its registered/ack/comm_error/recovered
    events and its error subject) while the planner compare-and-sets the job's record
    and the detector publishes verdicts: every write succeeds, every verdict is kept,
    each stream stays within max_bytes and the account within its quota."""
    flooder = await quota_server.connect("rank", "w0", pending_size=64 << 20)
    planner = await quota_server.connect("planner")
    detector = await quota_server.connect("detector")
    subjects = [_own(s) for s in (REGISTERED, ACK, COMM_ERROR, RECOVERED)] + [ERROR.format(service="rank-w0")]
    payload = os.urandom(60 << 10)
    stop = time.monotonic() + 8.0
    sent = 0

    done = asyncio.Event()  # the control plane's writes are over: the flood may stop

    async def flood() -> None:
        nonlocal sent
        while not done.is_set():
            for s in subjects:
                await flooder.publish(s, payload)
                sent += 1
            if sent % 200 == 0:
                await flooder.flush()

    pjs, djs = planner.jetstream(), detector.jetstream()
    kv = await pjs.key_value(BUCKETS[0])
    revision = await kv.create(f"{JOB}.plan", os.urandom(200_000))
    writes, verdicts = 0, []

    async def control_plane() -> None:
        """At least 20 writes, for 8 s, all of it under the flood (which ends after it); at
        most 60, so that the verdicts' own subject stays within its cap of 64 messages."""
        nonlocal revision, writes
        try:
            while writes < 60 and (writes < 20 or time.monotonic() < stop):
                revision = await kv.update(f"{JOB}.plan", os.urandom(200_000), last=revision)
                writes += 1
                v = RankFailed(
                    job=JOB,
                    incident=f"inc-{writes}",
                    worker="w1",
                    rank=1,
                    generation=1,
                    cause=FaultCause.PROCESS_EXIT,
                    fault_at=time.time(),
                )
                ack = await djs.publish(FAILED.format(job=JOB), encode(v)[0], timeout=5.0)
                verdicts.append(ack.seq)
                await asyncio.sleep(0.05)
        finally:
            done.set()

    try:
        await asyncio.gather(flood(), control_plane())
        assert sent * len(payload) > 4 * (64 << 20)  # the flood was several times EVT's max_bytes
        assert writes >= 20 and (await kv.get(f"{JOB}.plan")).revision == revision
        for seq in verdicts:  # every verdict is still there to be consumed
            assert (await pjs.get_msg(EVENTS.name, seq)).subject == FAILED.format(job=JOB)
        admin = await quota_server.connect("admin")
        ajs = admin.jetstream()
        for spec in STREAMS:
            info = await ajs.stream_info(spec.name)
            max_bytes = info.config.max_bytes or -1
            assert 0 < max_bytes and info.state.bytes <= max_bytes, spec.name
        account = await ajs.account_info()
        assert account.storage <= account.limits.max_storage == account_max_file()
        await admin.close()
    finally:
        for nc in (flooder, planner, detector):
            with contextlib.suppress(Exception):
                await nc.close()
