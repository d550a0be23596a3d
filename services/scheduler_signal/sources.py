"""Where scheduler signals come from: a local simulated cluster file, or Kubernetes.

A source watches a cluster and turns what it sees into :class:`Signal` objects
(a :class:`CapacityChanged` or a :class:`PreemptionNotice` with the ``Nats-Msg-Id``
to publish it under). What was already published is kept in a :class:`Ledger`,
which reads the stream back on first use of a cluster, so a restarted service
neither repeats nor misses a change:

- capacity: a signal only when the available slots differ from the last ones
  published for that cluster; ``delta`` is relative to them;
- preemptions: one notice per preemption (file entry id, Kubernetes pod uid).

Sources:

- :class:`FileClusterSource` (``PHALANX_CLUSTER_FILE``): a JSON file describing a
  simulated cluster, polled for changes (mtime, size, inode; content hash)::

      {"cluster": "local",
       "nodes": [{"name": "node-a", "slots": 4, "ready": true}, ...],
       "preemptions": [{"id": "p1", "job": "j1", "workers": ["w3"], "deadline_s": 30}]}

  Write it atomically (write a temporary file, then rename) so a half-written
  file is never read; one that does not parse is logged and skipped.
- :class:`KubeWatchSource` (in a pod, or ``PHALANX_K8S=1``): the Kubernetes REST
  API's list+watch on nodes and on the job's pods, with the service-account token
  (urllib, no client library). Nodes give capacity (allocatable
  ``PHALANX_K8S_SLOT_RESOURCE`` of ready, schedulable nodes); a job pod with a
  ``DisruptionTarget`` condition or a ``deletionTimestamp`` gives a preemption.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import os
import ssl
import threading
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Awaitable, Callable, Iterable, Iterator
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation
from pathlib import Path
from typing import Any, Protocol, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from phalanx.bus.subjects import CAPACITY, PREEMPT, Subject
from phalanx.schemas import CapacityChanged, PreemptionNotice
from phalanx.telemetry import get_logger

NAME_PATTERN = r"^[A-Za-z0-9_-]+$"


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

    async def last_capacity(self, cluster: str) -> int | None: ...

    async def announced(self, cluster: str) -> set[str]: ...


def capacity_msg_id(cluster: str, revision: str) -> str:
    return f"{cluster}:capacity:{revision}"


def preempt_msg_id(cluster: str, key: str) -> str:
    return f"{cluster}:preempt:{key}"


@dataclass
class _Known:
    capacity: int | None
    announced: set[str]


class Ledger:
    """Per cluster: the last capacity published and the preemptions announced."""

    def __init__(self, history: History, source: str) -> None:
        self.history = history
        self.source = source
        self._known: dict[str, _Known] = {}

    async def _get(self, cluster: str) -> _Known:
        if cluster not in self._known:
            self._known[cluster] = _Known(
                await self.history.last_capacity(cluster), await self.history.announced(cluster)
            )
        return self._known[cluster]

    async def capacity(self, cluster: str, available: int, revision: str) -> Signal | None:
        """A CapacityChanged if ``available`` differs from what was last published."""
        known = await self._get(cluster)
        if known.capacity == available:
            return None
        msg = CapacityChanged(
            cluster=cluster,
            available_slots=available,
            delta=available - (known.capacity or 0),
            source=self.source,
        )
        return Signal(msg, capacity_msg_id(cluster, revision))

    async def preemption(
        self, cluster: str, key: str, job: str | None, workers: list[str], deadline_s: float
    ) -> Signal | None:
        """A PreemptionNotice unless preemption ``key`` was announced already."""
        known = await self._get(cluster)
        msg_id = preempt_msg_id(cluster, key)
        if msg_id in known.announced:
            return None
        msg = PreemptionNotice(
            cluster=cluster, job=job, workers=workers, deadline_s=max(0.0, deadline_s), source=self.source
        )
        return Signal(msg, msg_id)

    def published(self, sig: Signal) -> None:
        """Record ``sig`` once the bus has acknowledged it."""
        known = self._known.setdefault(sig.cluster, _Known(None, set()))
        if isinstance(sig.message, CapacityChanged):
            known.capacity = sig.message.available_slots
        else:
            known.announced.add(sig.msg_id)


class Source(Protocol):
    name: str

    async def run(self, emit: Emit) -> None:
        """Watch until cancelled, emitting each change once."""

    def details(self) -> dict[str, str | int | float | bool]: ...


# -- the simulated cluster file -----------------------------------------------------
class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class FileNode(_Strict):
    name: str = Field(min_length=1)
    slots: int = Field(ge=0)
    ready: bool = True


class FilePreemption(_Strict):
    id: str = Field(pattern=NAME_PATTERN, max_length=128)
    job: str | None = Field(default=None, pattern=NAME_PATTERN)
    workers: list[str] = Field(default_factory=list)
    deadline_s: float = Field(default=30.0, ge=0)


class ClusterFile(_Strict):
    """The simulated cluster: its nodes (slots each) and pending preemptions."""

    cluster: str = Field(default="local", pattern=NAME_PATTERN, max_length=64)
    nodes: list[FileNode] = Field(default_factory=list)
    preemptions: list[FilePreemption] = Field(default_factory=list)

    @model_validator(mode="after")
    def _unique(self) -> ClusterFile:
        for what, names in (
            ("node", [n.name for n in self.nodes]),
            ("preemption", [p.id for p in self.preemptions]),
        ):
            dup = {n for n in names if names.count(n) > 1}
            if dup:
                raise ValueError(f"{what} names appear twice: {sorted(dup)}")
        return self

    @property
    def available_slots(self) -> int:
        return sum(n.slots for n in self.nodes if n.ready)


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
        out: list[Signal] = []
        cap = await self.ledger.capacity(state.cluster, state.available_slots, revision)
        if cap is not None:
            out.append(cap)
        for p in state.preemptions:
            notice = await self.ledger.preemption(state.cluster, p.id, p.job, list(p.workers), p.deadline_s)
            if notice is not None:
                out.append(notice)
        return out


# -- Kubernetes ------------------------------------------------------------------------
SA_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")
JOB_LABEL = "phalanx.io/job"
WORKER_LABEL = "phalanx.io/worker"
WORKERS_ANNOTATION = "phalanx.io/workers"  # a pod running several workers (phalanx run): w0,w1,...
_SUFFIX = {
    "m": Decimal("0.001"),
    "k": Decimal(10**3),
    "M": Decimal(10**6),
    "G": Decimal(10**9),
    "Ki": Decimal(2**10),
    "Mi": Decimal(2**20),
    "Gi": Decimal(2**30),
}


class WatchExpired(Exception):
    """The watch's resourceVersion is too old (410 Gone): list again."""


def parse_quantity(value: str | int | float | None) -> int:
    """A Kubernetes quantity as a whole number of units (``"8"``, ``"3900m"`` -> 3)."""
    if value is None:
        return 0
    s = str(value).strip()
    try:
        for suffix in sorted(_SUFFIX, key=len, reverse=True):
            if s.endswith(suffix):
                return int(Decimal(s[: -len(suffix)]) * _SUFFIX[suffix])
        return int(Decimal(s))
    except InvalidOperation:
        return 0


def node_slots(node: dict[str, Any], resource: str) -> int:
    """Slots a node offers: its allocatable ``resource`` if it is Ready and schedulable."""
    spec = node.get("spec") or {}
    if spec.get("unschedulable"):
        return 0
    conditions = (node.get("status") or {}).get("conditions") or []
    ready = any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)
    if not ready:
        return 0
    allocatable = (node.get("status") or {}).get("allocatable") or {}
    return max(0, parse_quantity(allocatable.get(resource)))


class NodeTracker:
    """Slots per node from a list and a stream of node watch events."""

    def __init__(self, resource: str) -> None:
        self.resource = resource
        self.slots: dict[str, int] = {}
        self.resource_version = ""

    @property
    def available(self) -> int:
        return sum(self.slots.values())

    def reset(self, items: Iterable[dict[str, Any]], resource_version: str) -> None:
        """Start over from a full list."""
        self.slots = {n["metadata"]["name"]: node_slots(n, self.resource) for n in items}
        self.resource_version = resource_version

    def apply(self, event: dict[str, Any]) -> bool:
        """Apply one watch event; True when the available slots changed."""
        kind, obj = _event_parts(event)
        before = self.available
        if kind != "BOOKMARK":
            name = obj["metadata"]["name"]
            if kind == "DELETED":
                self.slots.pop(name, None)
            else:
                self.slots[name] = node_slots(obj, self.resource)
        self.resource_version = obj.get("metadata", {}).get("resourceVersion", self.resource_version)
        return self.available != before


@dataclass(frozen=True)
class PodPreemption:
    uid: str
    pod: str
    job: str | None
    workers: list[str]
    deadline_s: float
    reason: str


def pod_preemption(pod: dict[str, Any], event_type: str = "MODIFIED") -> PodPreemption | None:
    """Whether a job pod is being taken away, and how long it has left.

    A pod is taken when Kubernetes marks it with a ``DisruptionTarget`` condition
    (scheduler preemption, eviction, taint manager, node shutdown), when its
    deletion has begun (``deletionTimestamp``), or when it disappears while still
    running. Pods that already finished are the failure-detector's business.
    """
    meta = pod.get("metadata") or {}
    status = pod.get("status") or {}
    spec = pod.get("spec") or {}
    if status.get("phase") in ("Succeeded", "Failed"):
        return None
    grace = float(spec.get("terminationGracePeriodSeconds", 30))
    reason = ""
    deadline = grace
    for cond in status.get("conditions") or []:
        if cond.get("type") == "DisruptionTarget" and cond.get("status") == "True":
            reason = cond.get("reason") or "DisruptionTarget"
    if meta.get("deletionTimestamp"):
        reason = reason or "Deleted"
        deadline = float(meta.get("deletionGracePeriodSeconds", grace))
    if event_type == "DELETED" and not reason:
        reason, deadline = "Deleted", 0.0
    if not reason:
        return None
    labels = meta.get("labels") or {}
    if labels.get(WORKER_LABEL):
        workers = [labels[WORKER_LABEL]]
    else:  # empty: every worker of the job on that pod
        listed = (meta.get("annotations") or {}).get(WORKERS_ANNOTATION, "")
        workers = [w.strip() for w in listed.split(",") if w.strip()]
    return PodPreemption(
        uid=meta.get("uid") or meta.get("name", ""),
        pod=meta.get("name", ""),
        job=labels.get(JOB_LABEL),
        workers=workers,
        deadline_s=deadline,
        reason=reason,
    )


class PodTracker:
    """Preemptions of job pods from a list and a stream of pod watch events."""

    def __init__(self) -> None:
        self.resource_version = ""

    def reset(self, items: Iterable[dict[str, Any]], resource_version: str) -> list[PodPreemption]:
        self.resource_version = resource_version
        return [p for p in (pod_preemption(i, "ADDED") for i in items) if p is not None]

    def apply(self, event: dict[str, Any]) -> PodPreemption | None:
        kind, obj = _event_parts(event)
        self.resource_version = obj.get("metadata", {}).get("resourceVersion", self.resource_version)
        if kind == "BOOKMARK":
            return None
        return pod_preemption(obj, kind)


def _event_parts(event: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    kind = event.get("type", "")
    obj = event.get("object") or {}
    if kind == "ERROR":
        if obj.get("code") == 410:
            raise WatchExpired(obj.get("message", "resource version too old"))
        raise RuntimeError(f"watch error: {obj.get('message', obj)}")
    if kind not in ("ADDED", "MODIFIED", "DELETED", "BOOKMARK"):
        raise RuntimeError(f"unknown watch event type {kind!r}")
    return kind, obj


def watch_events(lines: Iterable[bytes]) -> Iterator[dict[str, Any]]:
    """Watch events from the API server's stream: one JSON object per line."""
    for line in lines:
        line = line.strip()
        if line:
            yield json.loads(line)


@dataclass
class KubeConfig:
    api: str
    namespace: str
    cluster: str = "k8s"
    token_file: Path | None = None
    ca_file: Path | None = None
    pod_selector: str = JOB_LABEL
    node_selector: str = ""
    slot_resource: str = "nvidia.com/gpu"
    watch_timeout_s: int = 300

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None, sa_dir: Path = SA_DIR) -> KubeConfig | None:
        """In a pod (service host and token present) or with ``PHALANX_K8S=1``; else None."""
        env = dict(os.environ if env is None else env)
        host, port = env.get("KUBERNETES_SERVICE_HOST"), env.get("KUBERNETES_SERVICE_PORT", "443")
        in_cluster = bool(host) and (sa_dir / "token").exists()
        if not (in_cluster or env.get("PHALANX_K8S", "").lower() in ("1", "true", "yes")):
            return None
        api = env.get("PHALANX_K8S_API") or (f"https://{host}:{port}" if host else "")
        if not api:
            raise ValueError("PHALANX_K8S=1 but neither PHALANX_K8S_API nor KUBERNETES_SERVICE_HOST is set")
        ns_file = sa_dir / "namespace"
        namespace = env.get("PHALANX_K8S_NAMESPACE") or (
            ns_file.read_text().strip() if ns_file.exists() else "default"
        )
        token = sa_dir / "token"
        ca = sa_dir / "ca.crt"
        return cls(
            api=api.rstrip("/"),
            namespace=namespace,
            cluster=env.get("PHALANX_CLUSTER_NAME", "k8s"),
            token_file=token if token.exists() else None,
            ca_file=ca if ca.exists() else None,
            pod_selector=env.get("PHALANX_K8S_POD_SELECTOR", JOB_LABEL),
            node_selector=env.get("PHALANX_K8S_NODE_SELECTOR", ""),
            slot_resource=env.get("PHALANX_K8S_SLOT_RESOURCE", "nvidia.com/gpu"),
        )


class KubeClient:
    """The few Kubernetes API calls the watcher needs, over urllib."""

    def __init__(self, cfg: KubeConfig) -> None:
        self.cfg = cfg
        self._ssl: ssl.SSLContext | None = None
        if cfg.api.startswith("https"):
            self._ssl = ssl.create_default_context(cafile=str(cfg.ca_file) if cfg.ca_file else None)

    def _open(self, path: str, params: dict[str, str], timeout_s: float) -> Any:
        url = f"{self.cfg.api}{path}?{urllib.parse.urlencode(params)}"
        req = urllib.request.Request(url, headers={"Accept": "application/json"})
        if self.cfg.token_file is not None:  # re-read: projected tokens rotate
            req.add_header("Authorization", f"Bearer {self.cfg.token_file.read_text().strip()}")
        return urllib.request.urlopen(req, timeout=timeout_s, context=self._ssl)

    def list(self, path: str, selector: str) -> dict[str, Any]:
        params = {"labelSelector": selector} if selector else {}
        with self._open(path, params, 30) as resp:
            data: dict[str, Any] = json.load(resp)
            return data

    def watch(
        self,
        path: str,
        selector: str,
        resource_version: str,
        stop: threading.Event,
        on_event: Callable[[dict[str, Any]], None],
    ) -> None:
        """Stream watch events to ``on_event`` until the server ends the watch or ``stop``."""
        params = {
            "watch": "1",
            "resourceVersion": resource_version,
            "allowWatchBookmarks": "true",
            "timeoutSeconds": str(self.cfg.watch_timeout_s),
        }
        if selector:
            params["labelSelector"] = selector
        with self._open(path, params, self.cfg.watch_timeout_s + 30) as resp:
            for event in watch_events(iter(resp.readline, b"")):
                if stop.is_set():
                    return
                on_event(event)


T = TypeVar("T")


async def _in_daemon_thread(fn: Callable[[], T]) -> T:
    """Run blocking ``fn`` in a daemon thread (unlike ``to_thread``, never delays exit)."""
    loop = asyncio.get_running_loop()
    fut: asyncio.Future[T] = loop.create_future()

    def settle(result: T | None, exc: BaseException | None) -> None:
        if fut.done():
            return
        if exc is not None:
            fut.set_exception(exc)
        else:
            fut.set_result(result)  # type: ignore[arg-type]

    def work() -> None:
        try:
            result = fn()
        except BaseException as exc:
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(settle, None, exc)
            return
        with contextlib.suppress(RuntimeError):
            loop.call_soon_threadsafe(settle, result, None)

    threading.Thread(target=work, daemon=True, name="k8s-request").start()
    return await fut


class KubeWatchSource:
    """Capacity from nodes and preemptions from the job's pods, by list+watch."""

    name = "k8s"

    def __init__(self, cfg: KubeConfig, ledger: Ledger, client: KubeClient | None = None) -> None:
        self.cfg = cfg
        self.ledger = ledger
        self.client = client or KubeClient(cfg)
        self.nodes = NodeTracker(cfg.slot_resource)
        self.pods = PodTracker()
        self.log = get_logger(component="scheduler-signal", source="k8s", api=cfg.api)
        self.events = 0
        self.last_error = ""

    def details(self) -> dict[str, str | int | float | bool]:
        return {
            "k8s.api": self.cfg.api,
            "k8s.events": self.events,
            "k8s.nodes": len(self.nodes.slots),
            "k8s.last_error": self.last_error,
        }

    async def run(self, emit: Emit) -> None:
        await asyncio.gather(self._loop("nodes", emit), self._loop("pods", emit))

    async def _loop(self, what: str, emit: Emit) -> None:
        path = "/api/v1/nodes" if what == "nodes" else f"/api/v1/namespaces/{self.cfg.namespace}/pods"
        selector = self.cfg.node_selector if what == "nodes" else self.cfg.pod_selector
        backoff = 1.0
        while True:
            try:
                listing = await _in_daemon_thread(lambda: self.client.list(path, selector))
                rv = listing.get("metadata", {}).get("resourceVersion", "")
                if what == "nodes":
                    self.nodes.reset(listing.get("items") or [], rv)
                    await self._capacity(rv, emit)
                else:
                    for p in self.pods.reset(listing.get("items") or [], rv):
                        await self._preempted(p, emit)
                while True:  # watch until the server ends it, then resume from the last version
                    await self._watch(what, path, selector, emit)
                    backoff = 1.0
            except asyncio.CancelledError:
                raise
            except WatchExpired as exc:
                self.log.info("k8s_watch_expired", what=what, reason=str(exc))
            except Exception as exc:
                self.last_error = repr(exc)
                self.log.warning("k8s_watch_failed", what=what, error=repr(exc), retry_s=backoff)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 30.0)

    async def _watch(self, what: str, path: str, selector: str, emit: Emit) -> None:
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[dict[str, Any] | BaseException | None] = asyncio.Queue()
        tracker: NodeTracker | PodTracker = self.nodes if what == "nodes" else self.pods

        stop = threading.Event()  # set when this watch is left, for whatever reason

        def forward(item: dict[str, Any] | BaseException | None) -> None:
            with contextlib.suppress(RuntimeError):  # the loop is closed: shutting down
                loop.call_soon_threadsafe(queue.put_nowait, item)

        def pump() -> None:  # a daemon thread: a blocked read never holds up shutdown
            try:
                self.client.watch(path, selector, tracker.resource_version, stop, forward)
                forward(None)
            except BaseException as exc:
                forward(exc)

        threading.Thread(target=pump, daemon=True, name=f"k8s-watch-{what}").start()
        try:
            await self._drain(what, queue, emit)
        finally:
            stop.set()

    async def _drain(
        self, what: str, queue: asyncio.Queue[dict[str, Any] | BaseException | None], emit: Emit
    ) -> None:
        while True:
            item = await queue.get()
            if item is None:
                return
            if isinstance(item, BaseException):
                raise item
            self.events += 1
            if what == "nodes":
                if self.nodes.apply(item):
                    await self._capacity(self.nodes.resource_version, emit)
            else:
                p = self.pods.apply(item)
                if p is not None:
                    await self._preempted(p, emit)

    async def _capacity(self, revision: str, emit: Emit) -> None:
        sig = await self.ledger.capacity(self.cfg.cluster, self.nodes.available, f"nodes-{revision}")
        if sig is not None:
            await emit(sig)
            self.ledger.published(sig)

    async def _preempted(self, p: PodPreemption, emit: Emit) -> None:
        sig = await self.ledger.preemption(self.cfg.cluster, p.uid, p.job, p.workers, p.deadline_s)
        if sig is not None:
            self.log.info("k8s_pod_preempted", pod=p.pod, job=p.job, reason=p.reason, deadline_s=p.deadline_s)
            await emit(sig)
            self.ledger.published(sig)
