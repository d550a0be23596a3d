"""The NATS bus: subjects, streams, and a typed, traced client."""

from phalanx.bus._connection import Bus, nats_url
from phalanx.bus.subjects import CATALOGUE, Subject, Transport
from phalanx.bus.topology import (
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
    "ensure_topology",
    "nats_url",
]
