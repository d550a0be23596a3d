"""Where scheduler signals come from, and what was already published of them.

A source watches a cluster and turns what it sees into :class:`Signal` objects
(a :class:`CapacityChanged` or a :class:`PreemptionNotice` with the ``Nats-Msg-Id``
to publish it under). What was already published is kept in a :class:`Ledger`,
which reads the stream back on first use of a cluster, so a restarted service
neither repeats nor misses a change:

- capacity: a signal only when the available slots (or, for the local cluster
  and the file, the slots offered per node) differ from the last ones published
  for that cluster; ``delta`` is relative to them;
- preemptions: one notice per preemption (file or record entry id; for
  Kubernetes, a key per pod, node trouble or pending pod).

Sources:

- :class:`~phalanx.services.scheduler_signal.local.KvClusterSource` (on unless
  ``PHALANX_LOCAL_CLUSTER=0``): the local cluster that ``phalanx cluster offer`` /
  ``reclaim`` write to the ``phalanx_cluster`` KV bucket (:mod:`phalanx.cluster`).
- :class:`FileClusterSource` (``PHALANX_CLUSTER_FILE``): a JSON file describing a
  simulated cluster, polled for changes (mtime, size, inode; content hash)::

      {"cluster": "local",
       "nodes": [{"name": "node-a", "slots": 4, "ready": true}, ...],
       "preemptions": [{"id": "p1", "job": "j1", "workers": ["w3"], "deadline_s": 30},
                       {"id": "p2", "nodes": ["node-b"], "deadline_s": 10, "reason": "maintenance"}]}

  The same model as the local cluster's record (:class:`phalanx.cluster.ClusterState`):
  ``offered`` carries each node's slots, a preemption its ``nodes`` and ``reason``.

  Write it atomically (write a temporary file, then rename) so a half-written
  file is never read; one that does not parse is logged and skipped.
- :class:`~phalanx.services.scheduler_signal.kube.KubeWatchSource` (in a pod, or
  ``PHALANX_K8S=1``): list+watch of nodes, the job's pods and pending pods through
  ``kubernetes_asyncio``; see :mod:`phalanx.services.scheduler_signal.kube`.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from pydantic import ValidationError

from phalanx.contract import CapacityChanged, PreemptionNotice
from phalanx.contract.cluster import ClusterNode, ClusterPreemption, ClusterState
from phalanx.contract.subjects import CAPACITY, PREEMPT, Subject
from phalanx.telemetry import get_logger

# The simulated cluster file is the local cluster's record (phalanx.cluster), under its old names.
ClusterFile = ClusterState
FileNode = ClusterNode
FilePreemption = ClusterPreemption


# -- signals and what was published -------------------------------------------
@dataclass(frozen=True)
class Signal:
    """A message to publish once, under ``msg_id``."""

    message: CapacityChanged | PreemptionNotice
    msg_id: str

    @property
    def subject(self) -> Subject:
        return CAPACITY if isinstance(self.message, CapacityChanged) else PREEMPT

    @property
    def cluster(self) -> str:
        return self.message.cluster


Emit = Callable[[Signal], Awaitable[None]]


class History(Protocol):
    """What the bus already holds for a cluster (the service reads the stream)."""

    async def last_capacity(self, cluster: str) -> CapacityChanged | None: ...

    async def announced(self, cluster: str) -> set[str]: ...


def capacity_msg_id(cluster: str, revision: str) -> str:
    return f"{cluster}:capacity:{revision}"


def preempt_msg_id(cluster: str, key: str) -> str:
    return f"{cluster}:preempt:{key}"


@dataclass
class _Known:
    capacity: int | None
    announced: set[str]
    offered: dict[str, int] = field(default_factory=dict)


class Ledger:
    """Per cluster: the last capacity published and the preemptions announced."""

    def __init__(self, history: History, source: str) -> None:
        self.history = history
        self.source = source
        self._known: dict[str, _Known] = {}

    async def _get(self, cluster: str) -> _Known:
        if cluster not in self._known:
            last = await self.history.last_capacity(cluster)
            self._known[cluster] = _Known(
                last.available_slots if last is not None else None,
                await self.history.announced(cluster),
                dict(last.offered) if last is not None else {},
            )
        return self._known[cluster]

    async def capacity(
        self, cluster: str, available: int, revision: str, offered: dict[str, int] | None = None
    ) -> Signal | None:
        """A CapacityChanged if ``available`` differs from what was last published, or
        (when given) the slots ``offered`` per node do: a reclaim on one node and an
        offer on another can leave the sum where it was."""
        known = await self._get(cluster)
        if known.capacity == available and (offered is None or offered == known.offered):
            return None
        msg = CapacityChanged(
            cluster=cluster,
            available_slots=available,
            delta=available - (known.capacity or 0),
            source=self.source,
            offered=dict(offered or {}),
        )
        return Signal(msg, capacity_msg_id(cluster, revision))

    async def preemption(
        self,
        cluster: str,
        key: str,
        job: str | None,
        workers: list[str],
        deadline_s: float,
        *,
        nodes: list[str] | None = None,
        reason: str = "",
    ) -> Signal | None:
        """A PreemptionNotice unless preemption ``key`` was announced already."""
        known = await self._get(cluster)
        msg_id = preempt_msg_id(cluster, key)
        if msg_id in known.announced:
            return None
        msg = PreemptionNotice(
            cluster=cluster,
            job=job,
            workers=workers,
            nodes=list(nodes or []),
            deadline_s=max(0.0, deadline_s),
            source=self.source,
            reason=reason[:500],
        )
        return Signal(msg, msg_id)

    def published(self, sig: Signal) -> None:
        """Record ``sig`` once the bus has acknowledged it."""
        known = self._known.setdefault(sig.cluster, _Known(None, set()))
        if isinstance(sig.message, CapacityChanged):
            known.capacity = sig.message.available_slots
            known.offered = dict(sig.message.offered)
        else:
            known.announced.add(sig.msg_id)


class Source(Protocol):
    name: str

    async def run(self, emit: Emit) -> None:
        """Watch until cancelled, emitting each change once."""

    def details(self) -> dict[str, str | int | float | bool]: ...


# -- a cluster's state as signals --------------------------------------------------------
async def state_signals(
    ledger: Ledger, state: ClusterState, revision: str, now: float | None = None
) -> list[Signal]:
    """What ``state`` (a file's or a KV record's revision) has not published yet: the
    capacity with the slots offered per node, then one notice per new preemption, its
    deadline counted from its ``at`` (if set) to ``now``."""
    now = time.time() if now is None else now
    out: list[Signal] = []
    cap = await ledger.capacity(state.cluster, state.available_slots, revision, offered=state.offered)
    if cap is not None:
        out.append(cap)
    for p in state.preemptions:
        notice = await ledger.preemption(
            state.cluster,
            p.id,
            p.job,
            list(p.workers),
            p.remaining_s(now),
            nodes=list(p.nodes),
            reason=p.reason,
        )
        if notice is not None:
            out.append(notice)
    return out


# -- the simulated cluster file -----------------------------------------------------
class FileClusterSource:
    """Polls a cluster file and emits what changed in it."""

    name = "file"

    def __init__(self, path: str | os.PathLike[str], ledger: Ledger, poll_s: float = 0.5) -> None:
        self.path = Path(path)
        self.ledger = ledger
        self.poll_s = poll_s
        self.log = get_logger(component="scheduler-signal", source="file", path=str(self.path))
        self._seen: tuple[int, int, int] | None = None  # (mtime_ns, size, inode) handled
        self._digest: str | None = None  # content hash handled
        self._missing_logged = False
        self.revisions = 0
        self.last_error = ""

    def details(self) -> dict[str, str | int | float | bool]:
        return {
            "file.path": str(self.path),
            "file.revisions": self.revisions,
            "file.last_error": self.last_error,
        }

    async def run(self, emit: Emit) -> None:
        while True:
            try:
                await self.poll(emit)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # the bus is down: the same revision is retried next poll
                self.last_error = repr(exc)
                self.log.warning("cluster_file_publish_failed", error=repr(exc))
            await asyncio.sleep(self.poll_s)

    async def poll(self, emit: Emit) -> bool:
        """Handle the file if it changed since the last call; True if it was read."""
        try:
            st = self.path.stat()
        except FileNotFoundError:
            if not self._missing_logged:
                self.log.warning("cluster_file_missing")
                self._missing_logged = True
            return False
        self._missing_logged = False
        sig = (st.st_mtime_ns, st.st_size, st.st_ino)
        if sig == self._seen:
            return False
        text = self.path.read_bytes()
        digest = hashlib.sha256(text).hexdigest()
        if digest == self._digest:  # touched, not changed
            self._seen = sig
            return False
        try:
            state = ClusterFile.model_validate_json(text)
        except ValidationError as exc:
            self.last_error = f"invalid cluster file: {exc.errors(include_url=False)}"
            self.log.error("cluster_file_invalid", errors=exc.errors(include_url=False))
            self._seen = sig  # wait for the next change
            return False
        revision = f"{st.st_mtime_ns}-{digest[:12]}"
        for signal in await self.signals(state, revision):
            await emit(signal)
            self.ledger.published(signal)
        self._seen, self._digest = sig, digest
        self.revisions += 1
        self.last_error = ""
        self.log.info(
            "cluster_file_read", cluster=state.cluster, available=state.available_slots, revision=revision
        )
        return True

    async def signals(self, state: ClusterFile, revision: str) -> list[Signal]:
        return await state_signals(self.ledger, state, revision)
