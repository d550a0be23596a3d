"""A fast reader for :class:`~phalanx.contract.NodeDigest` payloads: the detector's hot path.

At 2,000 nodes every node's launcher sends one digest per heartbeat interval
(4,000/s at 500 ms). Through :func:`~phalanx.contract.decode` each costs a pydantic
model per entry (~50 us for 8 entries), as much as the detection itself. This
reader checks a well-formed digest field by field against the same schema and
returns plain tuples (:data:`~.digests.DigestRow`) for
:meth:`~.detector.Detector.observe_digest_rows`.

It accepts a subset of what :func:`decode` accepts and returns None for anything
else (a missing default, an int where a float is declared, a negative number, an
unknown field, wrong headers, malformed msgpack...); the caller then runs the full
:func:`decode`, which refuses a bad digest with the very :class:`DecodeError` of
every other subscription (or accepts a lax but valid one).

>>> from phalanx.contract import DigestEntry, Phase, encode
>>> e = DigestEntry(worker="w0", pid=7, seq=3, rank=0, generation=1, step=3,
...                 step_ms=5.0, phase=Phase.COMPUTE, phase_ms=1.0, age_ms=2.0)
>>> data, headers = encode(NodeDigest(job="j", node="n", launcher="l", host="h",
...                                   seq=1, interval_ms=100.0, entries=[e]))
>>> read_digest(data, headers)
('j', 'n', 'l', 'h', 1, 100.0, [('w0', 7, 3, 0, 1, 3, 5.0, <Phase.COMPUTE: 'compute'>, 1.0, 2.0, 0.0, 0.0, 0)])
>>> read_digest(data, {**headers, "Phalanx-Schema": "2"}) is None  # decode() must say why
True
"""

from __future__ import annotations

import re
from typing import Any

import msgpack
from phalanx.services.failure_detector.digests import DigestRow

from phalanx.contract import DigestEntry, NodeDigest, Phase
from phalanx.contract.codec import ENCODING, HDR_ENCODING, HDR_KIND, HDR_SCHEMA

__all__ = ["DigestFields", "read_digest"]

DigestFields = tuple[str, str, str, str, int, float, list[DigestRow]]
"""``(job, node, launcher, host, seq, interval_ms, rows)``."""

_KIND = NodeDigest.KIND
_SCHEMA = str(NodeDigest.SCHEMA_VERSION)
_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # job and node: JobMessage.job, NodeDigest.node
_PHASES = {p.value: p for p in Phase}
_DIGEST_FIELDS = 8  # job, ts, node, launcher, host, seq, interval_ms, entries
_ENTRY_FIELDS = 13  # every DigestEntry field, interval_ms, collective_bound_ms and op included


if len(NodeDigest.model_fields) != _DIGEST_FIELDS or len(DigestEntry.model_fields) != _ENTRY_FIELDS:
    raise RuntimeError("NodeDigest or DigestEntry changed: update read_digest")


def read_digest(
    data: bytes, headers: dict[str, str] | None, sent_at: list[float] | None = None
) -> DigestFields | None:
    """The fields of a complete, well-formed digest; None when :func:`decode` must judge.

    ``sent_at``: the digest's ``ts`` (the sender's wall clock) is appended to it when
    the digest is taken (the detector's heartbeat lag metric)."""
    if (
        not headers
        or headers.get(HDR_KIND) != _KIND
        or headers.get(HDR_SCHEMA) != _SCHEMA
        or headers.get(HDR_ENCODING, ENCODING) != ENCODING
    ):
        return None
    try:
        d = msgpack.unpackb(data, raw=False, strict_map_key=True)
    except Exception:
        return None
    if type(d) is not dict or len(d) != _DIGEST_FIELDS:
        return None
    try:  # with len(d) == 8, these 8 lookups succeed only without unknown keys
        job, node, launcher, host = d["job"], d["node"], d["launcher"], d["host"]
        ts, seq, interval_ms, entries = d["ts"], d["seq"], d["interval_ms"], d["entries"]
    except KeyError:
        return None
    if not (
        type(job) is str
        and _NAME.fullmatch(job)
        and type(node) is str
        and _NAME.fullmatch(node)
        and type(launcher) is str
        and 0 < len(launcher) <= 64
        and type(host) is str
        and type(ts) is float
        and type(seq) is int
        and seq >= 0
        and type(interval_ms) is float
        and interval_ms > 0.0
        and type(entries) is list
    ):
        return None
    rows: list[DigestRow] = []
    for e in entries:
        row = _entry(e)
        if row is None:
            return None
        rows.append(row)
    if sent_at is not None:
        sent_at.append(ts)
    return job, node, launcher, host, seq, interval_ms, rows


def _entry(e: Any) -> DigestRow | None:
    if type(e) is not dict or len(e) != _ENTRY_FIELDS:
        return None
    try:
        worker, pid, seq, rank = e["worker"], e["pid"], e["seq"], e["rank"]
        generation, step, step_ms, phase = e["generation"], e["step"], e["step_ms"], e["phase"]
        phase_ms, age_ms, interval_ms = e["phase_ms"], e["age_ms"], e["interval_ms"]
        bound_ms, op = e["collective_bound_ms"], e["op"]
    except KeyError:
        return None
    p = _PHASES.get(phase) if type(phase) is str else None
    if (
        p is None
        or type(worker) is not str
        or type(pid) is not int
        or type(seq) is not int
        or type(rank) is not int
        or type(generation) is not int
        or type(step) is not int
        or type(step_ms) is not float
        or type(phase_ms) is not float
        or type(age_ms) is not float
        or type(interval_ms) is not float
        or type(bound_ms) is not float
        or type(op) is not int
        # written so that NaN fails too
        or not (seq >= 0 and rank >= -1 and generation >= 0 and step >= 0 and op >= 0)
        or not (step_ms >= 0.0 and phase_ms >= 0.0 and age_ms >= 0.0 and interval_ms >= 0.0)
        or not bound_ms >= 0.0
    ):
        return None
    return worker, pid, seq, rank, generation, step, step_ms, p, phase_ms, age_ms, interval_ms, bound_ms, op
