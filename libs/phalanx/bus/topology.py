"""The JetStream streams and KV buckets Phalanx uses, created idempotently.

One stream per family of subjects: events (``phalanx.evt.>``), commands
(``phalanx.cmd.>``), scheduler signals (``phalanx.sched.>``) and errors
(``phalanx.err.>``). Every stream de-duplicates on ``Nats-Msg-Id`` inside
:data:`DUPLICATE_WINDOW_S`. The ``phalanx_jobs`` bucket holds each job's current
plan under ``<job>.plan``; it only moves forward by compare-and-set.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from nats.js import JetStreamContext
from nats.js.api import DiscardPolicy, RetentionPolicy, StorageType, StreamConfig
from nats.js.errors import BadRequestError

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


async def ensure_topology(js: JetStreamContext, replicas: int | None = None) -> None:
    """Create every stream and bucket, or leave them as they are if they exist.

    ``replicas`` defaults to ``PHALANX_STREAM_REPLICAS`` (1); 3 on a 3-node cluster.
    """
    if replicas is None:
        replicas = int(os.environ.get("PHALANX_STREAM_REPLICAS") or 1)
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
    try:
        await js.key_value(JOBS_BUCKET)
    except Exception:
        await js.create_key_value(bucket=JOBS_BUCKET, history=16, replicas=replicas)
