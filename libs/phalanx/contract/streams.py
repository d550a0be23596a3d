"""The JetStream streams and KV buckets of the contract: names, subjects, ages, per-message sizes.

What each holds and who may write it is part of the wire contract (proto/ documents it;
:mod:`phalanx.contract.permissions` derives the NATS permissions from it). Their byte limits come
from the settings and are applied by :mod:`phalanx.bus.topology`.
"""

from __future__ import annotations

from dataclasses import dataclass

DUPLICATE_WINDOW_S = 120.0


@dataclass(frozen=True)
class StreamSpec:
    name: str
    subjects: tuple[str, ...]
    max_age_s: float
    description: str
    max_msg_size: int = 64 << 10  # see the module docstring


EVENTS = StreamSpec("PHALANX_EVT", ("phalanx.evt.>",), 7 * 86400, "Job events")
COMMANDS = StreamSpec("PHALANX_CMD", ("phalanx.cmd.>",), 7 * 86400, "Plans and job specs", 4 << 20)
SCHED = StreamSpec("PHALANX_SCHED", ("phalanx.sched.>",), 86400, "Scheduler signals")
ERRORS = StreamSpec("PHALANX_ERR", ("phalanx.err.>",), 7 * 86400, "Refused input")
STREAMS = (EVENTS, COMMANDS, SCHED, ERRORS)
# Plans: a job's newest 256 generations (and each node's spec); nothing else there.
CMD_MAX_MSGS_PER_SUBJECT = 256
# Signals are re-read from the stream's start at every election: keep a day's worth of
# one cluster's (max_age), a signal every ~9 s; only the scheduler publishes there.
SCHED_MAX_MSGS_PER_SUBJECT = 10_000

JOBS_BUCKET = "phalanx_jobs"
CLUSTER_BUCKET = "phalanx_cluster"
CKPT_BUCKET = "phalanx_ckpt"  # every checkpoint copy's state, per tier (phalanx.checkpoint.catalog)
BUCKETS = (JOBS_BUCKET, CLUSTER_BUCKET, CKPT_BUCKET)
# Read with direct gets, whose API subject names the key (``$JS.API.DIRECT.GET.KV_<bucket>.$KV.<bucket>.<key>``):
# what lets a job's users be allowed their own record only (phalanx.natsauth). Direct gets may be answered
# by a follower that is behind (no read-your-writes): who compare-and-sets reads through leader_bucket().
DIRECT_BUCKETS = (JOBS_BUCKET,)
BUCKET_HISTORY = 16
