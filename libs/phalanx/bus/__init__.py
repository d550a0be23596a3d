"""The NATS bus: a typed, traced client (:class:`Bus`) and the topology it ensures.

Every NATS call of Phalanx goes through a :class:`Bus` (a test keeps it so). Its parts:
``_connection`` (connect, publish, subscribe, request), ``consumer`` (durable pull consumers),
``streams`` (``bus.streams``: a stream's last message, history, tail), ``kv`` (``bus.kv``:
buckets with typed values, compare-and-set, watches; ``keywatch`` for one key), ``badinput``
(refused input, rate-limited), ``outage`` (a lost server logged once, then with backoff),
``auth`` (login and TLS options), ``credentials`` (the logins handed to workers), ``probe`` (is a
server there at all), ``topology`` (streams and buckets, created idempotently).

What travels on it (subjects, messages, streams and buckets) is the contract, in :mod:`phalanx.contract`.
"""

from phalanx.bus._connection import Bus
from phalanx.bus.auth import PermissionDenied, nats_url
from phalanx.bus.consumer import decode_on
from phalanx.bus.kv import Bucket, Conflict, KvEntry
from phalanx.bus.streams import Stored
from phalanx.bus.topology import ensure_topology

__all__ = [
    "Bucket",
    "Bus",
    "Conflict",
    "KvEntry",
    "PermissionDenied",
    "Stored",
    "decode_on",
    "ensure_topology",
    "nats_url",
]
