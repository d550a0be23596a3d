"""The JetStream streams and KV buckets Phalanx uses, created idempotently.

One stream per family of subjects: events (``phalanx.evt.>``), commands
(``phalanx.cmd.>``), scheduler signals (``phalanx.sched.>``) and errors
(``phalanx.err.>``). Every stream de-duplicates on ``Nats-Msg-Id`` inside
:data:`DUPLICATE_WINDOW_S`. The ``phalanx_jobs`` bucket holds each job's current
plan under ``<job>.plan``; it only moves forward by compare-and-set. The
``phalanx_cluster`` bucket holds the local cluster that ``phalanx cluster`` drives
(one JSON record per cluster name, see :mod:`phalanx.cluster`); scheduler-signal
watches it.

**Limits.** Every stream and bucket is bounded (:func:`stream_limits`,
:func:`bucket_limits`; the byte sizes are settings, ``PHALANX_EVT_MAX_BYTES``...),
so no publisher -- one rank's credentials included -- can fill the server's store:

- ``max_msg_size``: what the largest real message needs. An event is at most a
  node's :class:`~phalanx.contract.StepStats` (~60 B per step record) or an error
  text of 4000 characters: 64 KiB. A plan is ~55 B per rank (900 KB for 16k
  ranks, measured with msgpack), so PHALANX_CMD takes 4 MiB; a job record in
  ``phalanx_jobs`` (plan and planner state) is ~100 B per rank (1.6 MB for 16k
  ranks), hence ``PHALANX_KV_MAX_VALUE_SIZE`` 4 MiB. The server's ``max_payload``
  caps all of these (1 MB by default and in deploy/: ~10k ranks; 2MB holds 16k).
- ``max_msgs_per_subject`` (the newest kept) bounds what one sender can hold:
  a rank publishes only on its own subjects (``phalanx.evt.<job>.ack.<worker>``,
  ``registered``, ``comm_error``, ``recovered``, ``phalanx.err.rank-<worker>``), so a
  flooding rank keeps at most 4 x 2048 x 64 KiB = 512 MiB in PHALANX_EVT (a quarter
  of its 2 GiB) and 1024 x 64 KiB in PHALANX_ERR, and evicts only its own older
  messages: a verdict published during a flood stays until it is consumed, and a
  consumer that reads the flooder's subjects is never more than that many messages
  behind. 2048 per subject keeps a job's newest 2048 decisions, verdicts and step
  batches (~35 min of one node's steps at one batch a second).
- ``max_bytes`` with ``discard: old`` on the streams: a new verdict, plan or error
  is never refused, the oldest messages go first (retention by size as well as
  age: events of a 16k-rank recovery are ~48k messages of ~300 B, 15 MB, so 2 GiB
  keeps over a hundred such recoveries besides the step batches). Buckets keep
  KV's ``discard: new`` (a write is refused when full, never an old record
  dropped) and ``history`` 16 per key; ``phalanx_jobs`` at 1 GiB holds the full
  history of ~40 16k-rank jobs, or of ~30k small ones (2 KB records).

JetStream reserves each stream's ``max_bytes`` against the account when the stream
is created, so the account's quota (:func:`account_max_file`, rendered into the
server config by :mod:`phalanx.natsauth`) is never overcommitted and a bucket's
space is there whatever the event streams hold: the planner's compare-and-set,
the detector's verdicts and the checkpoint catalog cannot be starved.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import nats.errors
from nats.js import JetStreamContext
from nats.js.api import DeliverPolicy, DiscardPolicy, RetentionPolicy, StorageType, StreamConfig
from nats.js.errors import BadRequestError
from nats.js.kv import KeyValue

from phalanx.bus.keywatch import entry_operation
from phalanx.bus.streams import read_to_end
from phalanx.contract.streams import (
    BUCKET_HISTORY,
    BUCKETS,
    CKPT_BUCKET,
    CLUSTER_BUCKET,
    CMD_MAX_MSGS_PER_SUBJECT,
    COMMANDS,
    DIRECT_BUCKETS,
    DUPLICATE_WINDOW_S,
    ERRORS,
    EVENTS,
    JOBS_BUCKET,
    SCHED,
    SCHED_MAX_MSGS_PER_SUBJECT,
    STREAMS,
    StreamSpec,
)
from phalanx.settings import StreamSettings, load
from phalanx.telemetry import get_logger

_log = get_logger(component="topology")


@dataclass(frozen=True)
class Limits:
    """What one stream or bucket may hold (per replica)."""

    max_bytes: int
    max_msg_size: int
    max_msgs_per_subject: int


def stream_limits(spec: StreamSpec) -> Limits:
    """``spec``'s limits: byte sizes and per-subject counts from the settings."""
    s = load(StreamSettings)
    max_bytes, per_subject = {
        EVENTS.name: (s.evt_max_bytes, s.evt_max_msgs_per_subject),
        COMMANDS.name: (s.cmd_max_bytes, CMD_MAX_MSGS_PER_SUBJECT),
        SCHED.name: (s.sched_max_bytes, SCHED_MAX_MSGS_PER_SUBJECT),
        ERRORS.name: (s.err_max_bytes, s.err_max_msgs_per_subject),
    }[spec.name]
    return Limits(max_bytes, spec.max_msg_size, per_subject)


def bucket_limits(bucket: str) -> Limits:
    """``bucket``'s limits (a value is a message; per key: :data:`BUCKET_HISTORY`)."""
    s = load(StreamSettings)
    max_bytes = {
        JOBS_BUCKET: s.jobs_kv_max_bytes,
        CLUSTER_BUCKET: s.cluster_kv_max_bytes,
        CKPT_BUCKET: s.ckpt_kv_max_bytes,
    }[bucket]
    return Limits(max_bytes, s.kv_max_value_bytes, BUCKET_HISTORY)


def account_max_file(replicas: int = 1) -> int:
    """The JetStream file-store quota of the account every Phalanx user is in: the sum
    of every stream's and bucket's ``max_bytes`` times ``replicas``, plus an eighth
    for what is not a stream's messages (consumers' state, the raft logs of a cluster)."""
    total = sum(stream_limits(s).max_bytes for s in STREAMS) + sum(
        bucket_limits(b).max_bytes for b in BUCKETS
    )
    return total * replicas * 9 // 8


def stream_replicas() -> int:
    """Replicas of each stream and bucket: ``PHALANX_STREAM_REPLICAS`` (1); 3 on a 3-node cluster."""
    return load(StreamSettings).stream_replicas


async def ensure_bucket(
    js: JetStreamContext, bucket: str, replicas: int | None = None, *, create_only: bool = False
) -> KeyValue:
    """The KV ``bucket``, created (history :data:`BUCKET_HISTORY`) if it does not exist.

    The buckets of :data:`DIRECT_BUCKETS` are created with direct gets, and an existing
    one without them is given them (a stream update: the planner's or admin's right;
    anyone else's attempt is refused and left to the planner's next start), unless
    ``create_only``.
    """
    try:
        kv = await js.key_value(bucket)
    except Exception:
        limits = bucket_limits(bucket)
        return await js.create_key_value(
            bucket=bucket,
            history=BUCKET_HISTORY,
            max_bytes=limits.max_bytes,
            max_value_size=limits.max_msg_size,
            replicas=stream_replicas() if replicas is None else replicas,
            direct=bucket in DIRECT_BUCKETS,
        )
    if bucket in DIRECT_BUCKETS and not create_only:
        await _allow_direct(js, bucket)
    return kv


async def _allow_direct(js: JetStreamContext, bucket: str) -> None:
    """Turn direct gets on for an existing ``bucket`` (one made before they were used)."""
    info = await js.stream_info(f"KV_{bucket}")
    if not info.config.allow_direct:
        await _update(js, info.config.evolve(allow_direct=True))


async def leader_bucket(js: JetStreamContext, bucket: str) -> KeyValue:
    """``bucket`` with every get answered by its stream's leader (``STREAM.MSG.GET``).

    A direct get may be answered by a follower that is behind (NATS promises monotonic
    reads, not read-your-writes), so whoever reads a key to compare-and-set it (the
    planner, its lease) reads through this; followers of a record use direct gets.
    """
    await js.key_value(bucket)  # BucketNotFoundError as from js.key_value
    return KeyValue(name=bucket, stream=f"KV_{bucket}", pre=f"$KV.{bucket}.", js=js, direct=False)


async def ensure_topology(
    js: JetStreamContext, replicas: int | None = None, *, create_only: bool = False
) -> None:
    """Create every stream and bucket; bring an existing one to this version's
    configuration (limits, direct gets, ``replicas``) unless ``create_only``.

    ``replicas`` defaults to ``PHALANX_STREAM_REPLICAS`` (1); 3 on a 3-node cluster.
    An existing stream is scaled up to ``replicas``, never down. ``create_only`` is for a client re-binding after a failure: it re-creates what a
    server lost and changes nothing that exists. (Re-binding with a reconfiguration
    once scaled a 3-node cluster's streams to one replica while a node was down,
    which left a consumer without quorum.)
    """
    if replicas is None:
        replicas = stream_replicas()
    for spec in STREAMS:
        limits = stream_limits(spec)
        cfg = StreamConfig(
            name=spec.name,
            description=spec.description,
            subjects=list(spec.subjects),
            retention=RetentionPolicy.LIMITS,
            storage=StorageType.FILE,
            max_age=spec.max_age_s,
            duplicate_window=DUPLICATE_WINDOW_S,
            # A new verdict, plan or error is never refused: the oldest go first
            # (per subject, then by size; see the module docstring).
            discard=DiscardPolicy.OLD,
            num_replicas=replicas,
            **asdict(limits),
        )
        try:
            await js.add_stream(cfg)
        except BadRequestError as exc:
            # 10058: a stream of that name exists with another config (an older
            # version's, e.g. without limits) -> update it.
            if exc.err_code != 10058:
                raise
            if not create_only:
                await _update(js, await _keep_replicas(js, cfg))
    for bucket in BUCKETS:
        await ensure_bucket(js, bucket, replicas, create_only=create_only)
        if not create_only:
            await _limit_bucket(js, bucket)


async def _keep_replicas(js: JetStreamContext, cfg: StreamConfig) -> StreamConfig:
    """``cfg`` with the existing stream's replica count where that is higher: a stream is
    never scaled down on its own (a service started without ``PHALANX_STREAM_REPLICAS``
    on a 3-node cluster would otherwise take its streams to one replica); lower it by hand."""
    existing = (await js.stream_info(cfg.name or "")).config.num_replicas or 1
    if existing > (cfg.num_replicas or 1):
        _log.warning(
            "stream_replicas_kept",
            stream=cfg.name,
            replicas=existing,
            asked=cfg.num_replicas,
            hint="set PHALANX_STREAM_REPLICAS on every service; a stream is never scaled down on its own",
        )
        return cfg.evolve(num_replicas=existing)
    return cfg


async def _update(js: JetStreamContext, cfg: StreamConfig) -> None:
    """Update a stream's configuration: the planner's and admin's right. Anyone else's
    attempt is refused (a permissions violation: a timeout here) and logged; the
    stream keeps its configuration until the planner's next start."""
    try:
        await js.update_stream(cfg)
    except (nats.errors.TimeoutError, nats.errors.NoRespondersError) as exc:
        _log.warning("stream_config_outdated", stream=cfg.name, error=repr(exc))


async def _limit_bucket(js: JetStreamContext, bucket: str) -> None:
    """Give an existing ``bucket`` (one made without them, or with others) its limits."""
    limits = bucket_limits(bucket)
    info = await js.stream_info(f"KV_{bucket}")
    cfg = info.config
    if (cfg.max_bytes, cfg.max_msg_size) == (limits.max_bytes, limits.max_msg_size):
        return
    await _update(js, cfg.evolve(max_bytes=limits.max_bytes, max_msg_size=limits.max_msg_size))


async def kv_latest(
    js: JetStreamContext, bucket: str, pattern: str = ">", timeout_s: float = 5.0
) -> dict[str, bytes]:
    """The current value of every key of ``bucket`` matching ``pattern`` (deleted keys left
    out): what :meth:`phalanx.bus.kv.Bucket.latest` returns (read it through that)."""
    prefix = f"$KV.{bucket}."
    sub = await js.subscribe(
        prefix + pattern,
        stream=f"KV_{bucket}",
        ordered_consumer=True,
        deliver_policy=DeliverPolicy.LAST_PER_SUBJECT,
        inactive_threshold=60.0,
    )
    out: dict[str, bytes] = {}
    for msg in await read_to_end(sub, f"{bucket} keys matching {pattern!r}", timeout_s):
        key = msg.subject[len(prefix) :]
        if entry_operation(msg.headers) is None:
            out[key] = msg.data
        else:
            out.pop(key, None)
    return out
