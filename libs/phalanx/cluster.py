"""The local cluster: worker slots offered per node, and nodes reclaimed, kept in NATS KV.

One JSON record per cluster (default ``local``) in the ``phalanx_cluster`` bucket,
under the cluster's name::

    {"cluster": "local",
     "nodes": [{"name": "node-b", "slots": 0, "ready": true, "reclaims": 1}],
     "preemptions": [{"id": "reclaim-node-b-1", "job": null, "workers": [], "nodes": ["node-b"],
                      "deadline_s": 10.0, "at": 1718000000.0, "reason": "reclaim node-b"}]}

A node's ``slots`` are the worker slots it offers *beyond* what its launchers
started with; a preemption takes back every worker on its ``nodes`` (or the
``workers`` of ``job``) ``deadline_s`` seconds after ``at``. scheduler-signal
watches the bucket and turns each revision into ``CapacityChanged`` /
``PreemptionNotice`` (``KvClusterSource`` in
:mod:`phalanx.services.scheduler_signal.sources`); the same models describe the
simulated cluster file (``PHALANX_CLUSTER_FILE``).

Every change is a compare-and-set on the record's revision, retried, so two
commands racing both count. Where the server enforces roles
(:mod:`phalanx.natsauth`) only ``admin`` may write the bucket.

>>> await offer(2, "node-b")                          # phalanx cluster offer 2 --node node-b
>>> await reclaim("node-b", parse_grace("10s"))       # phalanx cluster reclaim node-b --grace 10s
>>> (await read()).state.offered                      # phalanx cluster show
{'node-b': 0}
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import random
import re
import ssl
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import nats.errors
from nats.js.errors import NotFoundError
from pydantic import ValidationError

from phalanx.bus import Bucket, Bus, Conflict, PermissionDenied, nats_url
from phalanx.contract.cluster import (
    DEFAULT_CLUSTER,
    MAX_SLOTS,
    NAME_PATTERN,
    ClusterNode,
    ClusterPreemption,
    ClusterState,
)
from phalanx.contract.streams import CLUSTER_BUCKET

MAX_GRACE_S = 7 * 86400.0
RETAIN_S = 3600.0  # a preemption whose deadline passed longer ago is dropped at the next change
CAS_ATTEMPTS = 20
CONNECT_TIMEOUT_S = 4.0
REQUEST_TIMEOUT_S = 2.0  # each JetStream request (a refused write is only seen as no answer)
CLIENT_NAME = "phalanx-cluster"

_NAME = re.compile(NAME_PATTERN)
_DURATION = re.compile(r"(\d+(?:\.\d*)?|\.\d+)(ms|s|m|h)?")
_UNIT_S = {"ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}


class ClusterError(RuntimeError):
    """The change could not be made (NATS unreachable or refusing, a broken record)."""


class BadInput(ClusterError, ValueError):
    """The request itself is wrong; nothing was changed."""


@dataclass(frozen=True)
class ClusterRecord:
    """A cluster's record as stored: ``revision`` 0 when there is none yet."""

    state: ClusterState
    revision: int
    preemption: ClusterPreemption | None = None  # the one a reclaim just added


# -- input checks and the changes, as pure functions ------------------------------------
def check_name(what: str, value: str) -> str:
    """``value`` if it is a valid node or cluster name, else :class:`BadInput`."""
    if not (isinstance(value, str) and _NAME.match(value) and len(value) <= 64):
        raise BadInput(f"bad {what} name {value!r}: use letters, digits, '_' and '-' (at most 64)")
    return value


def check_slots(slots: int) -> int:
    if isinstance(slots, bool) or not isinstance(slots, int) or slots < 1:
        raise BadInput(f"offer at least 1 slot, got {slots!r}")
    if slots > MAX_SLOTS:
        raise BadInput(f"offer at most {MAX_SLOTS} slots per node, got {slots}")
    return slots


def check_grace(grace_s: float) -> float:
    if not (isinstance(grace_s, int | float) and math.isfinite(grace_s) and 0 <= grace_s <= MAX_GRACE_S):
        raise BadInput(f"grace must be between 0 and {MAX_GRACE_S:g} seconds, got {grace_s!r}")
    return float(grace_s)


def parse_grace(text: str, what: str = "grace") -> float:
    """Seconds from ``"10s"``, ``"500ms"``, ``"2m"``, ``"1h"`` or a plain number of seconds.

    >>> parse_grace("10s"), parse_grace("500ms"), parse_grace("2m"), parse_grace("1.5")
    (10.0, 0.5, 120.0, 1.5)
    """
    t = text.strip().lower()
    if t.startswith("-"):
        raise BadInput(f"{what} {text!r} is negative: give a duration >= 0 (e.g. 10s)")
    m = _DURATION.fullmatch(t)
    if m is None:
        raise BadInput(f"{what} {text!r} is not a duration: e.g. 10s, 500ms, 2m, or a number of seconds")
    return check_grace(float(m[1]) * _UNIT_S[m[2] or "s"])


def _pruned(preemptions: list[ClusterPreemption], now: float) -> list[ClusterPreemption]:
    """Preemptions still worth keeping: those whose deadline ended less than RETAIN_S ago."""
    return [p for p in preemptions if p.at is None or p.at + p.deadline_s >= now - RETAIN_S]


def apply_offer(state: ClusterState, node: str, slots: int, now: float | None = None) -> ClusterState:
    """``state`` with ``slots`` more offered on ``node`` (added, ready, if absent)."""
    check_name("node", node)
    check_slots(slots)
    current = state.node(node)
    total = (current.slots if current else 0) + slots
    if total > MAX_SLOTS:
        raise BadInput(f"node {node} would offer {total} slots, more than {MAX_SLOTS}")
    updated = ClusterNode(name=node, slots=total, ready=True, reclaims=current.reclaims if current else 0)
    nodes = [updated if n.name == node else n for n in state.nodes] if current else [*state.nodes, updated]
    now = time.time() if now is None else now
    return ClusterState(cluster=state.cluster, nodes=nodes, preemptions=_pruned(state.preemptions, now))


def apply_reclaim(
    state: ClusterState, node: str, grace_s: float, now: float
) -> tuple[ClusterState, ClusterPreemption]:
    """``state`` with ``node`` offering nothing and a new preemption of it, due ``grace_s`` after ``now``."""
    check_name("node", node)
    check_grace(grace_s)
    current = state.node(node)
    k = (current.reclaims if current else 0) + 1
    taken = {p.id for p in state.preemptions}
    while f"reclaim-{node}-{k}" in taken:  # a record written by hand
        k += 1
    updated = ClusterNode(name=node, slots=0, ready=current.ready if current else True, reclaims=k)
    nodes = [updated if n.name == node else n for n in state.nodes] if current else [*state.nodes, updated]
    notice = ClusterPreemption(
        id=f"reclaim-{node}-{k}", nodes=[node], deadline_s=grace_s, at=now, reason=f"reclaim {node}"
    )
    preemptions = [*_pruned(state.preemptions, now), notice]
    return ClusterState(cluster=state.cluster, nodes=nodes, preemptions=preemptions), notice


def parse_record(cluster: str, value: bytes | None) -> ClusterState:
    """The stored record of ``cluster`` (empty for no value); ValueError if it is broken."""
    if not value:
        return ClusterState(cluster=cluster)
    try:
        state = ClusterState.model_validate_json(value)
    except ValidationError as exc:
        errors = "; ".join(
            f"{'.'.join(str(x) for x in e['loc']) or 'record'}: {e['msg']}"
            for e in exc.errors(include_url=False)[:3]
        )
        raise ValueError(f"the record of cluster {cluster!r} is invalid ({errors})") from None
    if state.cluster != cluster:
        raise ValueError(f"the record under key {cluster!r} names cluster {state.cluster!r}")
    return state


# -- NATS ---------------------------------------------------------------------------------
def _where(url: str) -> str:
    return ",".join(u.strip().split("@")[-1] for u in url.split(","))  # no credentials in messages


async def connect(url: str | None = None, timeout_s: float = CONNECT_TIMEOUT_S) -> Bus:
    """A bus for the cluster commands; :class:`ClusterError` within ``timeout_s`` if NATS is not there."""
    target = url or nats_url()
    try:
        return await asyncio.wait_for(Bus.connect(target, name=CLIENT_NAME, ensure=False), timeout_s)
    except PermissionDenied as exc:
        raise ClusterError(f"{exc} (check PHALANX_NATS_USER / PHALANX_NATS_PASSWORD)") from None
    except ssl.SSLError as exc:
        raise ClusterError(f"TLS to NATS at {_where(target)} failed: {exc}") from None
    except (TimeoutError, OSError, nats.errors.Error) as exc:
        why = "no answer" if isinstance(exc, TimeoutError) else repr(exc)
        raise ClusterError(
            f"cannot reach NATS at {_where(target)} ({why} within {timeout_s:g} s): "
            "start the control plane with `phalanx up` or point NATS_URL at one"
        ) from None


@contextlib.asynccontextmanager
async def _session(bus: Bus | None, url: str | None) -> AsyncIterator[Bus]:
    if bus is not None:
        yield bus
        return
    own = await connect(url)
    try:
        yield own
    finally:
        with contextlib.suppress(Exception):
            await own.close()


def _nats_failed(bus: Bus, exc: Exception) -> ClusterError:
    """What to say when a request went unanswered or failed: a refusal names the admin role."""
    if bus.denied:
        return ClusterError(
            f"the NATS server refused {', '.join(sorted(bus.denied))}: only the admin role may "
            f"write bucket {CLUSTER_BUCKET} (set PHALANX_NATS_USER=admin and PHALANX_NATS_PASSWORD)"
        )
    if isinstance(exc, TimeoutError):
        return ClusterError(f"NATS did not answer in time ({exc!r})")
    return ClusterError(f"NATS failed: {exc!r}")


async def _get(kv: Bucket, cluster: str) -> ClusterRecord:
    entry = await kv.get(cluster)
    if entry is None:  # never written, or deleted
        return ClusterRecord(ClusterState(cluster=cluster), 0)
    try:
        return ClusterRecord(parse_record(cluster, entry.value), entry.revision)
    except ValueError as exc:
        raise ClusterError(f"{exc}: fix or delete it (key {cluster!r} of bucket {CLUSTER_BUCKET})") from None


async def _update(
    bus: Bus, cluster: str, change: Callable[[ClusterState], tuple[ClusterState, ClusterPreemption | None]]
) -> ClusterRecord:
    """Apply ``change`` to the stored record by compare-and-set, retrying on a race."""
    try:
        kv = await bus.kv.bucket(CLUSTER_BUCKET, create=True, timeout_s=REQUEST_TIMEOUT_S)
        for attempt in range(CAS_ATTEMPTS):
            current = await _get(kv, cluster)
            state, notice = change(current.state)  # BadInput: nothing written
            try:
                if current.revision == 0:
                    revision = await kv.create(cluster, state)
                else:
                    revision = await kv.update(cluster, state, last=current.revision)
            except Conflict:  # someone else changed it first: read again
                await asyncio.sleep(random.uniform(0.005, 0.03) * (attempt + 1))
                continue
            return ClusterRecord(state, revision, notice)
    except (nats.errors.Error, TimeoutError) as exc:
        raise _nats_failed(bus, exc) from None
    raise ClusterError(f"the record of cluster {cluster!r} kept changing: gave up after {CAS_ATTEMPTS} tries")


async def offer(
    slots: int, node: str, *, cluster: str = DEFAULT_CLUSTER, url: str | None = None, bus: Bus | None = None
) -> ClusterRecord:
    """Offer ``slots`` more worker slots on ``node`` (``phalanx cluster offer``)."""
    check_name("cluster", cluster)
    check_name("node", node)
    check_slots(slots)
    async with _session(bus, url) as b:
        return await _update(b, cluster, lambda s: (apply_offer(s, node, slots), None))


async def reclaim(
    node: str,
    grace_s: float,
    *,
    cluster: str = DEFAULT_CLUSTER,
    url: str | None = None,
    bus: Bus | None = None,
) -> ClusterRecord:
    """Take ``node`` back: it offers nothing, and every worker on it must leave within
    ``grace_s`` (``phalanx cluster reclaim``). The record's ``preemption`` is the new one."""
    check_name("cluster", cluster)
    check_name("node", node)
    check_grace(grace_s)
    async with _session(bus, url) as b:
        return await _update(b, cluster, lambda s: apply_reclaim(s, node, grace_s, time.time()))


async def read(
    cluster: str = DEFAULT_CLUSTER, *, url: str | None = None, bus: Bus | None = None
) -> ClusterRecord:
    """The record of ``cluster`` (an empty one, revision 0, if there is none or no bucket)."""
    check_name("cluster", cluster)
    async with _session(bus, url) as b:
        try:
            return await _get(await b.kv.bucket(CLUSTER_BUCKET, timeout_s=REQUEST_TIMEOUT_S), cluster)
        except NotFoundError:  # no bucket yet
            return ClusterRecord(ClusterState(cluster=cluster), 0)
        except (nats.errors.Error, TimeoutError) as exc:
            raise _nats_failed(b, exc) from None


# -- printing ---------------------------------------------------------------------------------
def _table(headers: list[str], rows: list[list[str]]) -> list[str]:
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]
    return [
        "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in [headers, *rows]
    ]


def describe(record: ClusterRecord, now: float | None = None) -> str:
    """A human-readable view of a cluster's record (``phalanx cluster show``)."""
    now = time.time() if now is None else now
    s = record.state
    if record.revision == 0:
        return f"cluster {s.cluster}: no record yet (offer slots with `phalanx cluster offer N --node X`)"
    ready = sum(1 for n in s.nodes if n.ready)
    lines = [
        f"cluster {s.cluster} (revision {record.revision}): {s.available_slots} slot(s) offered "
        f"on {ready} ready node(s)"
    ]
    if s.nodes:
        rows = [[n.name, str(n.slots), "yes" if n.ready else "no", str(n.reclaims)] for n in s.nodes]
        lines += ["", *_table(["NODE", "SLOTS", "READY", "RECLAIMS"], rows)]
    if s.preemptions:
        rows = []
        for p in s.preemptions:
            left = p.remaining_s(now)
            rows.append(
                [
                    p.id,
                    ",".join(p.nodes) or "-",
                    p.job or "-",
                    ",".join(p.workers) or "-",
                    f"{p.deadline_s:g}s",
                    "passed" if p.at is not None and left <= 0 else f"{left:.1f}s",
                ]
            )
        lines += ["", *_table(["PREEMPTION", "NODES", "JOB", "WORKERS", "GRACE", "LEFT"], rows)]
    return "\n".join(lines)
