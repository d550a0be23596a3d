"""The NATS bus: subjects, streams, and a typed, traced client."""

from phalanx.bus._connection import Bus, decode_on, nats_url
from phalanx.bus.subjects import CATALOGUE, Subject, Transport
from phalanx.bus.topology import (
    CLUSTER_BUCKET,
    COMMANDS,
    DUPLICATE_WINDOW_S,
    ERRORS,
    EVENTS,
    JOBS_BUCKET,
    SCHED,
    STREAMS,
    StreamSpec,
    ensure_topology,
)

__all__ = [
    "CATALOGUE",
    "CLUSTER_BUCKET",
    "COMMANDS",
    "DUPLICATE_WINDOW_S",
    "ERRORS",
    "EVENTS",
    "JOBS_BUCKET",
    "SCHED",
    "STREAMS",
    "Bus",
    "StreamSpec",
    "Subject",
    "Transport",
    "decode_on",
    "ensure_topology",
    "nats_url",
]
