"""The JetStream streams and KV buckets Phalanx uses, created idempotently.

One stream per family of subjects: events (``phalanx.evt.>``), commands
(``phalanx.cmd.>``), scheduler signals (``phalanx.sched.>``) and errors
(``phalanx.err.>``). Every stream de-duplicates on ``Nats-Msg-Id`` inside
:data:`DUPLICATE_WINDOW_S`. The ``phalanx_jobs`` bucket holds each job's current
plan under ``<job>.plan``; it only moves forward by compare-and-set. The
``phalanx_cluster`` bucket holds the local cluster that ``phalanx cluster`` drives
(one JSON record per cluster name, see :mod:`phalanx.cluster`); scheduler-signal
watches it.
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass

import nats.errors
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.api import DeliverPolicy, DiscardPolicy, RetentionPolicy, StorageType, StreamConfig
from nats.js.errors import BadRequestError
from nats.js.kv import KeyValue

from phalanx.settings import get_settings

DUPLICATE_WINDOW_S = 120.0


@dataclass(frozen=True)
class StreamSpec:
    name: str
    subjects: tuple[str, ...]
    max_age_s: float
    description: str


EVENTS = StreamSpec("PHALANX_EVT", ("phalanx.evt.>",), 7 * 86400, "Job events")
COMMANDS = StreamSpec("PHALANX_CMD", ("phalanx.cmd.>",), 7 * 86400, "Plans and job specs")
SCHED = StreamSpec("PHALANX_SCHED", ("phalanx.sched.>",), 86400, "Scheduler signals")
ERRORS = StreamSpec("PHALANX_ERR", ("phalanx.err.>",), 7 * 86400, "Refused input")
STREAMS = (EVENTS, COMMANDS, SCHED, ERRORS)

JOBS_BUCKET = "phalanx_jobs"
CLUSTER_BUCKET = "phalanx_cluster"
CKPT_BUCKET = "phalanx_ckpt"  # every checkpoint copy's state, per tier (phalanx.checkpoint.catalog)
BUCKETS = (JOBS_BUCKET, CLUSTER_BUCKET, CKPT_BUCKET)
BUCKET_HISTORY = 16


def stream_replicas() -> int:
    """Replicas of each stream and bucket: ``PHALANX_STREAM_REPLICAS`` (1); 3 on a 3-node cluster."""
    return get_settings().stream_replicas


async def ensure_bucket(js: JetStreamContext, bucket: str, replicas: int | None = None) -> KeyValue:
    """The KV ``bucket``, created (history :data:`BUCKET_HISTORY`) if it does not exist."""
    try:
        return await js.key_value(bucket)
    except Exception:
        return await js.create_key_value(
            bucket=bucket,
            history=BUCKET_HISTORY,
            replicas=stream_replicas() if replicas is None else replicas,
        )


async def ensure_topology(js: JetStreamContext, replicas: int | None = None) -> None:
    """Create every stream and bucket, or leave them as they are if they exist.

    ``replicas`` defaults to ``PHALANX_STREAM_REPLICAS`` (1); 3 on a 3-node cluster.
    """
    if replicas is None:
        replicas = stream_replicas()
    for spec in STREAMS:
        cfg = StreamConfig(
            name=spec.name,
            description=spec.description,
            subjects=list(spec.subjects),
            retention=RetentionPolicy.LIMITS,
            storage=StorageType.FILE,
            max_age=spec.max_age_s,
            duplicate_window=DUPLICATE_WINDOW_S,
            discard=DiscardPolicy.OLD,
            num_replicas=replicas,
        )
        try:
            await js.add_stream(cfg)
        except BadRequestError as exc:
            # 10058: a stream of that name exists with another config -> update it.
            if exc.err_code != 10058:
                raise
            await js.update_stream(cfg)
    for bucket in BUCKETS:
        await ensure_bucket(js, bucket, replicas)


async def kv_latest(
    js: JetStreamContext, bucket: str, pattern: str = ">", timeout_s: float = 5.0
) -> dict[str, bytes]:
    """The current value of every key of ``bucket`` matching ``pattern`` (deleted keys left out).

    Not ``KeyValue.keys()`` or a watch's first ``None``: nats.py decides "caught up" from
    consumer info that can be read before the first deliveries are, so that ``None`` may
    come ahead of the entries, and a planner taking over would see no jobs. This reads
    until the message the server sent with nothing pending after it, and takes "nothing
    there" only from consumer info that shows nothing pending *and* nothing delivered::

        plans = await kv_latest(bus.js, JOBS_BUCKET, "*.plan")

    Raises ``TimeoutError`` when the entries stop coming before the last one (a partial
    view is never returned as the whole).
    """
    prefix = f"$KV.{bucket}."
    sub = await js.subscribe(
        prefix + pattern,
        stream=f"KV_{bucket}",
        ordered_consumer=True,
        deliver_policy=DeliverPolicy.LAST_PER_SUBJECT,
        inactive_threshold=60.0,
    )
    out: dict[str, bytes] = {}
    for msg in await _caught_up(sub, f"{bucket} keys matching {pattern!r}", timeout_s):
        headers = msg.headers or {}
        key = msg.subject[len(prefix) :]
        if headers.get("KV-Operation") in ("DEL", "PURGE") or "Nats-Marker-Reason" in headers:
            out.pop(key, None)
        else:
            out[key] = msg.data
    return out


async def _caught_up(sub: JetStreamContext.PushSubscription, what: str, timeout_s: float) -> list[Msg]:
    """Every message of an ordered consumer up to the one the server sent with nothing
    pending after it (then unsubscribes); ``[]`` only when consumer info shows nothing
    pending *and* nothing delivered; ``TimeoutError`` when they stop coming before that."""
    try:
        info = await sub.consumer_info()
        if info.num_pending == 0 and not (info.delivered and info.delivered.consumer_seq):
            return []
        out: list[Msg] = []
        while True:
            try:
                msg = await sub.next_msg(timeout=timeout_s)
            except nats.errors.TimeoutError:
                raise TimeoutError(f"read {len(out)} of {what}, then nothing for {timeout_s}s") from None
            out.append(msg)
            if msg.metadata.num_pending == 0:
                return out
    finally:
        with contextlib.suppress(Exception):
            await asyncio.shield(sub.unsubscribe())


async def stream_history(
    js: JetStreamContext, subject: str, timeout_s: float = 5.0, *, stream: str | None = None
) -> list[Msg]:
    """Every message a stream holds on ``subject`` (wildcards allowed), oldest first,
    up to the last one there when called: a job's decisions, recoveries, steps::

        decisions = await stream_history(bus.js, DECISION.format(job="j1"))

    Read the way :func:`kv_latest` reads (until the message sent with nothing pending
    after it; "nothing there" only when the consumer shows nothing pending and nothing
    delivered); ``TimeoutError`` when messages stop coming before the last one.
    """
    sub = await js.subscribe(
        subject,
        stream=stream,
        ordered_consumer=True,
        deliver_policy=DeliverPolicy.ALL,
        inactive_threshold=60.0,
    )
    return await _caught_up(sub, f"the messages on {subject}", timeout_s)
