"""A fake Kubernetes API server on loopback that speaks the list and watch wire format.

It serves nodes and pods the way the API server does, so the scheduler-signal
service can be tested with its real Kubernetes client and no cluster:

- ``GET /api/v1/nodes``, ``GET /api/v1/pods`` (all namespaces) and
  ``GET /api/v1/namespaces/{ns}/pods``: a ``NodeList`` / ``PodList`` with
  ``metadata.resourceVersion``;
- the same with ``?watch=1&resourceVersion=R``: a chunked stream of
  newline-delimited watch events (``ADDED``, ``MODIFIED``, ``DELETED``, and
  ``BOOKMARK`` when ``allowWatchBookmarks`` is set) from after ``R``, ended after
  ``timeoutSeconds``;
- ``labelSelector`` (``k``, ``!k``, ``k=v``, ``k==v``, ``k!=v``, comma-joined) and
  ``fieldSelector`` (``a.b=v``, ``a.b!=v``): as the API server does, an object that
  stops matching reaches a watcher as ``DELETED``, one that starts as ``ADDED``;
- a resource version older than the last :meth:`FakeKubeApi.expire` gets 410 Gone,
  as an ``ERROR`` watch event (``{"type": "ERROR", "object": {"kind": "Status",
  "code": 410, ...}}``) or, with ``http=True``, as an HTTP 410 response;
- with ``token`` set, a request without ``Authorization: Bearer <token>`` gets 401.

Events are what a test pushes: recorded streams (``tests/unit/k8s/*.jsonl``,
:func:`load_events`) or objects built with :func:`node`, :func:`job_pod` and
:func:`disrupted`. The server runs in daemon threads, so it can be used from
synchronous and asynchronous tests alike, and by a service in another process.

Example (an end-to-end test)::

    from k8s_api import FakeKubeApi, job_pod, node  # tests/ is on sys.path

    with FakeKubeApi(
        nodes=[node("n1", slots=8)],
        pods=[job_pod("train-0", job="demo", worker="n1-w0", node="n1")],
    ) as api:
        env = {"PHALANX_K8S": "1", "PHALANX_K8S_API": api.url, "PHALANX_K8S_NAMESPACE": api.namespace,
               "PHALANX_CLUSTER_NAME": "k8s", "NATS_URL": nats_url}
        ...  # start `python -m phalanx.services.scheduler_signal` with env
        # the service has listed and watches the job's pods and the pending pods (blocking:
        # from async code, `await asyncio.to_thread(api.wait_watching, "pods", 2)`)
        api.wait_watching("pods", 2)
        api.disrupt("n1-w0")  # its pod gets a DisruptionTarget condition
        ...  # a PreemptionNotice(cluster="k8s", job="demo", workers=["n1-w0"], nodes=["n1"],
             #   deadline_s=30.0, reason="pod default/train-0: PreemptionByScheduler")
             # on phalanx.sched.k8s.preempt, within about a second
        assert api.lists["nodes"] == 1

Attributes a test reads: ``url``, ``namespace``, ``lists`` and ``watches``
(``Counter`` of requests per kind, ``"nodes"`` / ``"pods"``), ``gone_http`` (watches
answered with an HTTP 410), ``requests`` (every request: kind, watch or not, path,
query). Methods: :meth:`push` (a watch event,
streamed to the live watches at once), :meth:`disrupt`, :meth:`expire`,
:meth:`end_watches`, :meth:`fail`, :meth:`get`.
"""

from __future__ import annotations

import copy
import itertools
import json
import threading
import time
import uuid
from collections import Counter, deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, NamedTuple
from urllib.parse import parse_qsl, urlsplit

KINDS = ("nodes", "pods")
_LIST_KIND = {"nodes": "NodeList", "pods": "PodList"}
_OBJ_KIND = {"nodes": "Node", "pods": "Pod"}
_uids = itertools.count(1)


# -- recorded streams and objects ------------------------------------------------------------
def load_list(path: str | Path) -> tuple[list[dict[str, Any]], str]:
    """The items and resource version of a recorded list response (``*_list.json``)."""
    doc = json.loads(Path(path).read_text())
    return list(doc.get("items") or []), str(doc.get("metadata", {}).get("resourceVersion", ""))


def load_events(path: str | Path) -> list[dict[str, Any]]:
    """The events of a recorded watch stream (``*.jsonl``: one JSON event a line)."""
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def node(
    name: str,
    slots: int,
    *,
    resource: str = "nvidia.com/gpu",
    ready: bool = True,
    unschedulable: bool = False,
    labels: dict[str, str] | None = None,
) -> dict[str, Any]:
    """A Node as the API server returns it, offering ``slots`` of ``resource``."""
    spec: dict[str, Any] = {}
    if unschedulable:
        spec = {
            "unschedulable": True,
            "taints": [{"key": "node.kubernetes.io/unschedulable", "effect": "NoSchedule"}],
        }
    return {
        "kind": "Node",
        "apiVersion": "v1",
        "metadata": {
            "name": name,
            "uid": str(uuid.uuid5(uuid.NAMESPACE_DNS, f"node.{name}")),
            "labels": {"kubernetes.io/hostname": name, **(labels or {})},
        },
        "spec": spec,
        "status": {
            "capacity": {resource: str(slots), "pods": "110"},
            "allocatable": {resource: str(slots), "pods": "110"},
            "conditions": [
                {
                    "type": "Ready",
                    "status": "True" if ready else "False",
                    "reason": "KubeletReady" if ready else "KubeletNotReady",
                }
            ],
        },
    }


def job_pod(
    name: str,
    *,
    job: str,
    worker: str | None,
    node: str | None,
    namespace: str = "default",
    slots: int = 1,
    resource: str = "nvidia.com/gpu",
    priority: int = 0,
    grace_s: int = 30,
    phase: str = "Running",
) -> dict[str, Any]:
    """A Pod of job ``job`` (label ``phalanx.io/job``) running ``worker`` on ``node``."""
    labels = {"phalanx.io/job": job}
    if worker is not None:
        labels["phalanx.io/worker"] = worker
    spec: dict[str, Any] = {
        "containers": [
            {"name": "train", "image": "phalanx:0.1.0", "resources": {"limits": {resource: str(slots)}}}
        ],
        "terminationGracePeriodSeconds": grace_s,
        "priority": priority,
    }
    if node is not None:
        spec["nodeName"] = node
    return {
        "kind": "Pod",
        "apiVersion": "v1",
        "metadata": {
            "name": name,
            "namespace": namespace,
            "uid": str(uuid.uuid5(uuid.NAMESPACE_DNS, f"pod.{namespace}.{name}.{next(_uids)}")),
            "labels": labels,
        },
        "spec": spec,
        "status": {"phase": phase, "conditions": [{"type": "Ready", "status": "True"}]},
    }


def disrupted(
    pod: dict[str, Any], reason: str = "PreemptionByScheduler", message: str = ""
) -> dict[str, Any]:
    """A copy of ``pod`` with the ``DisruptionTarget`` condition Kubernetes sets before taking it."""
    out = copy.deepcopy(pod)
    status = out.setdefault("status", {})
    conditions = [c for c in status.get("conditions") or [] if c.get("type") != "DisruptionTarget"]
    conditions.append(
        {
            "type": "DisruptionTarget",
            "status": "True",
            "reason": reason,
            "message": message or f"{reason}: the pod is about to be terminated",
        }
    )
    status["conditions"] = conditions
    return out


# -- selectors --------------------------------------------------------------------------------
def _label_matcher(selector: str) -> Callable[[dict[str, Any]], bool]:
    terms: list[Callable[[dict[str, str]], bool]] = []
    for raw in (t.strip() for t in selector.split(",")):
        if not raw:
            continue
        if " in " in raw or " notin " in raw or "(" in raw:
            raise ValueError(f"set-based label selectors are not supported here: {raw!r}")
        if "!=" in raw:
            k, v = (s.strip() for s in raw.split("!=", 1))
            terms.append(lambda labels, k=k, v=v: labels.get(k) != v)
        elif "=" in raw:
            k, v = (s.strip() for s in raw.replace("==", "=").split("=", 1))
            terms.append(lambda labels, k=k, v=v: labels.get(k) == v)
        elif raw.startswith("!"):
            absent = raw[1:].strip()
            terms.append(lambda labels, k=absent: k not in labels)
        else:
            terms.append(lambda labels, k=raw: k in labels)

    def match(obj: dict[str, Any]) -> bool:
        labels = (obj.get("metadata") or {}).get("labels") or {}
        return all(t(labels) for t in terms)

    return match


def _field(obj: dict[str, Any], path: str) -> str:
    value: Any = obj
    for part in path.split("."):
        value = value.get(part) if isinstance(value, dict) else None
    return "" if value is None else str(value)


def _field_matcher(selector: str) -> Callable[[dict[str, Any]], bool]:
    terms: list[tuple[str, str, bool]] = []  # path, value, equal
    for raw in (t.strip() for t in selector.split(",")):
        if not raw:
            continue
        if "!=" in raw:
            path, value = raw.split("!=", 1)
            terms.append((path.strip(), value.strip(), False))
        elif "=" in raw:
            path, value = raw.replace("==", "=").split("=", 1)
            terms.append((path.strip(), value.strip(), True))
        else:
            raise ValueError(f"invalid field selector {raw!r}")
    return lambda obj: all((_field(obj, p) == v) == eq for p, v, eq in terms)


# -- the server -------------------------------------------------------------------------------
class Request(NamedTuple):
    kind: str
    watch: bool
    path: str
    query: dict[str, str]


@dataclass
class _Change:
    rv: int
    type: str
    obj: dict[str, Any]
    old: dict[str, Any] | None
    raw: bool = False  # sent to every watcher as it is (a malformed object)


@dataclass
class _Watcher:
    kind: str
    namespace: str | None
    match: Callable[[dict[str, Any]], bool]
    bookmarks: bool
    queue: deque[dict[str, Any]] = field(default_factory=deque)
    closed: bool = False

    def view(self, change: _Change) -> dict[str, Any] | None:
        """The event this watcher gets for ``change``, if any."""
        if change.raw:
            return {"type": change.type, "object": change.obj}
        if change.type == "BOOKMARK":
            return {"type": "BOOKMARK", "object": change.obj} if self.bookmarks else None
        new_ok = self._sees(change.obj)
        old_ok = change.old is not None and self._sees(change.old)
        if change.type == "DELETED":
            return {"type": "DELETED", "object": change.obj} if (new_ok or old_ok) else None
        if new_ok:
            kind = "MODIFIED" if old_ok and change.type == "MODIFIED" else "ADDED"
            return {"type": kind, "object": change.obj}
        if old_ok:  # no longer matches the selectors: gone, for this watcher
            return {"type": "DELETED", "object": change.obj}
        return None

    def _sees(self, obj: dict[str, Any]) -> bool:
        ns = (obj.get("metadata") or {}).get("namespace")
        return (self.namespace is None or ns == self.namespace) and self.match(obj)


def _status(code: int, reason: str, message: str) -> dict[str, Any]:
    return {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": message,
        "reason": reason,
        "code": code,
    }


def _key(obj: dict[str, Any]) -> tuple[str, str]:
    meta = obj["metadata"]
    return meta.get("namespace", ""), meta["name"]


class FakeKubeApi:
    """The fake API server: a store of nodes and pods, their change log, live watches.

    ``nodes`` and ``pods`` are the objects a list returns at first; the resource
    version starts at the highest of theirs and ``resource_version``.
    """

    def __init__(
        self,
        nodes: Iterable[dict[str, Any]] = (),
        pods: Iterable[dict[str, Any]] = (),
        *,
        resource_version: int | str = 1,
        namespace: str = "default",
        token: str | None = None,
        host: str = "127.0.0.1",
    ) -> None:
        self.namespace = namespace
        self.token = token
        self.lists: Counter[str] = Counter()
        self.watches: Counter[str] = Counter()
        self.requests: list[Request] = []
        self.gone_http: Counter[str] = Counter()  # watches answered with an HTTP 410
        self._host = host
        self._cond = threading.Condition()
        self._rv = int(resource_version or 1)
        self._store: dict[str, dict[tuple[str, str], dict[str, Any]]] = {k: {} for k in KINDS}
        self._log: dict[str, list[_Change]] = {k: [] for k in KINDS}
        self._oldest: dict[str, int] = dict.fromkeys(KINDS, 0)  # older watches get 410
        self._http_410: set[str] = set()
        self._failures: dict[str, deque[int]] = {k: deque() for k in KINDS}
        self._watchers: list[_Watcher] = []
        self._stopping = False
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None
        for kind, items in (("nodes", nodes), ("pods", pods)):
            for obj in items:
                obj = copy.deepcopy(obj)
                rv = _int(obj["metadata"].get("resourceVersion"))
                self._rv = max(self._rv, rv)
                obj["metadata"].setdefault("resourceVersion", "0")
                self._store[kind][_key(obj)] = obj
        for kind in KINDS:
            for obj in self._store[kind].values():
                if obj["metadata"]["resourceVersion"] == "0":
                    obj["metadata"]["resourceVersion"] = str(self._rv)

    # -- lifecycle ----------------------------------------------------------------------------
    @property
    def url(self) -> str:
        if self._server is None:
            raise RuntimeError("FakeKubeApi is not started")
        return f"http://{self._host}:{self._server.server_address[1]}"

    def start(self) -> FakeKubeApi:
        handler = type("Handler", (_Handler,), {"api": self})
        self._server = ThreadingHTTPServer((self._host, 0), handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, name="fake-kube-api", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def __enter__(self) -> FakeKubeApi:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- what a test does --------------------------------------------------------------------
    def push(self, kind: str, event: dict[str, Any]) -> dict[str, Any]:
        """Apply a watch event to the store and stream it to the live watches; returns it as sent.

        ``ADDED`` / ``MODIFIED`` / ``DELETED`` change the store (the object's
        resource version is kept when newer than the server's, else a new one is
        given); ``BOOKMARK`` goes to watches that allow bookmarks; ``ERROR`` goes to
        the live watches, which then end (as the API server ends them). An object
        without ``metadata.name`` is streamed as it is, without touching the store.
        """
        self._check_kind(kind)
        with self._cond:
            sent = self._apply(kind, event)
            self._cond.notify_all()
        return sent

    def disrupt(self, worker: str, reason: str = "PreemptionByScheduler") -> dict[str, Any]:
        """Give the pod running ``worker`` a ``DisruptionTarget`` condition (a MODIFIED event)."""
        with self._cond:
            for pod in self._store["pods"].values():
                meta = pod.get("metadata") or {}
                listed = (meta.get("annotations") or {}).get("phalanx.io/workers", "")
                if (meta.get("labels") or {}).get("phalanx.io/worker") == worker or worker in [
                    w.strip() for w in listed.split(",")
                ]:
                    target = pod
                    break
            else:
                raise KeyError(f"no pod runs worker {worker!r}")
            return self.push("pods", {"type": "MODIFIED", "object": disrupted(target, reason)})

    def expire(self, kind: str, *, http: bool = False, changes: Iterable[dict[str, Any]] = ()) -> None:
        """410 Gone for every watch of ``kind`` so far: what it had seen is compacted away.

        The live watches get an ``ERROR`` event with code 410 and end; with
        ``http=True`` they just end, and watching again from their old resource
        version gets an HTTP 410. ``changes`` (watch events) are applied after
        the live watches ended and before the compaction: only a new list sees them.
        """
        self._check_kind(kind)
        with self._cond:
            gone = _status(410, "Expired", f"too old resource version: {self._rv} ({self._rv + 1})")
            for w in self._watchers:
                if w.kind == kind and not w.closed:
                    if not http:
                        w.queue.append({"type": "ERROR", "object": gone})
                    w.closed = True
            self._watchers = [w for w in self._watchers if w.kind != kind]
            for event in changes:
                self._apply(kind, event)
            self._rv += 1  # the store moved on; everything before is compacted
            self._oldest[kind] = self._rv
            if http:
                self._http_410.add(kind)
            else:
                self._http_410.discard(kind)
            self._cond.notify_all()

    def end_watches(self, kind: str | None = None) -> None:
        """End the live watches (of ``kind``), as the API server does at ``timeoutSeconds``."""
        with self._cond:
            for w in self._watchers:
                if kind is None or w.kind == kind:
                    w.closed = True
            self._cond.notify_all()

    def fail(self, kind: str, status: int = 500, times: int = 1) -> None:
        """The next ``times`` requests (list or watch) for ``kind`` get HTTP ``status``."""
        self._check_kind(kind)
        with self._cond:
            self._failures[kind].extend([status] * times)

    def get(self, kind: str, name: str, namespace: str | None = None) -> dict[str, Any]:
        """A copy of a stored object (pods: in ``namespace``, by default the server's)."""
        self._check_kind(kind)
        ns = "" if kind == "nodes" else (namespace or self.namespace)
        with self._cond:
            return copy.deepcopy(self._store[kind][(ns, name)])

    def live_watches(self, kind: str) -> int:
        """How many watches of ``kind`` are streaming now."""
        with self._cond:
            return sum(1 for w in self._watchers if w.kind == kind and not w.closed)

    def wait_watching(self, kind: str, count: int = 1, timeout: float = 10.0) -> None:
        """Block until ``count`` watches of ``kind`` stream (e.g. after the source's list)."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while sum(1 for w in self._watchers if w.kind == kind and not w.closed) < count:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"fewer than {count} {kind} watches after {timeout}s")
                self._cond.wait(left)

    # -- internals (under the lock) -------------------------------------------------------------
    @staticmethod
    def _check_kind(kind: str) -> None:
        if kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, not {kind!r}")

    def _apply(self, kind: str, event: dict[str, Any]) -> dict[str, Any]:
        etype = event.get("type", "")
        obj = copy.deepcopy(event.get("object") or {})
        meta = obj.get("metadata")
        if etype == "ERROR":
            for w in self._watchers:
                if w.kind == kind and not w.closed:
                    w.queue.append({"type": "ERROR", "object": obj})
                    w.closed = True
            return {"type": etype, "object": obj}
        if not isinstance(meta, dict) or (etype != "BOOKMARK" and not meta.get("name")):
            change = _Change(self._next_rv(None), etype, obj, None, raw=True)
        else:
            meta["resourceVersion"] = str(self._next_rv(meta.get("resourceVersion")))
            old = None
            if etype != "BOOKMARK":
                obj.setdefault("kind", _OBJ_KIND[kind])
                obj.setdefault("apiVersion", "v1")
                store = self._store[kind]
                old = store.get(_key(obj))
                if etype == "DELETED":
                    store.pop(_key(obj), None)
                else:
                    store[_key(obj)] = obj
            change = _Change(self._rv, etype, obj, old)
        self._log[kind].append(change)
        for w in self._watchers:
            if w.kind == kind and not w.closed and (ev := w.view(change)) is not None:
                w.queue.append(ev)
        return {"type": etype, "object": obj}

    def _next_rv(self, recorded: Any) -> int:
        self._rv = max(self._rv + 1, _int(recorded))
        return self._rv

    def _list(
        self, kind: str, namespace: str | None, match: Callable[[dict[str, Any]], bool]
    ) -> dict[str, Any]:
        items = [
            copy.deepcopy(o)
            for (ns, _), o in sorted(self._store[kind].items())
            if (namespace is None or ns == namespace) and match(o)
        ]
        return {
            "kind": _LIST_KIND[kind],
            "apiVersion": "v1",
            "metadata": {"resourceVersion": str(self._rv)},
            "items": items,
        }

    def _open_watch(
        self,
        kind: str,
        namespace: str | None,
        match: Callable[[dict[str, Any]], bool],
        rv: str,
        bookmarks: bool,
    ) -> _Watcher | dict[str, Any]:
        """A registered watcher with its backlog queued, or the Status of a 410."""
        w = _Watcher(kind, namespace, match, bookmarks)
        start = _int(rv)
        if rv in ("", "0"):  # "any": the current state as ADDED events, then what follows
            for o in self._store[kind].values():
                if w._sees(o):
                    w.queue.append({"type": "ADDED", "object": copy.deepcopy(o)})
            start = self._rv
        elif start < self._oldest[kind]:
            return _status(410, "Expired", f"too old resource version: {start} ({self._oldest[kind]})")
        for change in self._log[kind]:
            if change.rv > start and (ev := w.view(change)) is not None:
                w.queue.append(ev)
        self._watchers.append(w)
        self.watches[kind] += 1
        self._cond.notify_all()
        return w


def _int(value: Any) -> int:
    try:
        return int(value)
    except (TypeError, ValueError):
        return 0


class _Handler(BaseHTTPRequestHandler):
    api: FakeKubeApi
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:  # quiet
        pass

    def _send_json(self, code: int, doc: dict[str, Any]) -> None:
        body = json.dumps(doc, separators=(",", ":")).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(body)
        self.close_connection = True

    def _route(self, path: str) -> tuple[str, str | None] | None:
        parts = [p for p in path.split("/") if p]
        if parts == ["api", "v1", "nodes"]:
            return "nodes", None
        if parts == ["api", "v1", "pods"]:
            return "pods", None
        if len(parts) == 5 and parts[:3] == ["api", "v1", "namespaces"] and parts[4] == "pods":
            return "pods", parts[3]
        return None

    def do_GET(self) -> None:
        api = self.api
        url = urlsplit(self.path)
        query = dict(parse_qsl(url.query, keep_blank_values=True))
        route = self._route(url.path)
        if route is None:
            self._send_json(404, _status(404, "NotFound", f"the server could not find {url.path}"))
            return
        kind, namespace = route
        watch = query.get("watch", "").lower() in ("1", "true")
        with api._cond:
            api.requests.append(Request(kind, watch, url.path, query))
            if api.token is not None and self.headers.get("Authorization") != f"Bearer {api.token}":
                self._send_json(401, _status(401, "Unauthorized", "Unauthorized"))
                return
            if api._failures[kind]:
                code = api._failures[kind].popleft()
                self._send_json(code, _status(code, "InternalError", "scripted failure"))
                return
            try:
                labels = _label_matcher(query.get("labelSelector", ""))
                fields = _field_matcher(query.get("fieldSelector", ""))
            except ValueError as exc:
                self._send_json(400, _status(400, "BadRequest", str(exc)))
                return

            def match(obj: dict[str, Any]) -> bool:
                return labels(obj) and fields(obj)

            if not watch:
                api.lists[kind] += 1
                self._send_json(200, api._list(kind, namespace, match))
                return
            opened = api._open_watch(
                kind,
                namespace,
                match,
                query.get("resourceVersion", ""),
                query.get("allowWatchBookmarks", "").lower() in ("1", "true"),
            )
            if isinstance(opened, dict) and kind in api._http_410:
                api.gone_http[kind] += 1
                self._send_json(410, opened)
                return
        timeout_s = float(query.get("timeoutSeconds") or 1800)
        self._stream(opened, timeout_s)

    def _stream(self, watcher: _Watcher | dict[str, Any], timeout_s: float) -> None:
        api = self.api
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Transfer-Encoding", "chunked")
        self.send_header("Connection", "close")
        self.end_headers()
        self.close_connection = True
        if isinstance(watcher, dict):  # too old: the 410 as an ERROR event, then the end
            self._chunk({"type": "ERROR", "object": watcher})
            self._end()
            return
        deadline = time.monotonic() + timeout_s
        try:
            while True:
                with api._cond:
                    while not (watcher.queue or watcher.closed or api._stopping):
                        left = deadline - time.monotonic()
                        if left <= 0:
                            break
                        api._cond.wait(min(left, 0.25))
                    events = list(watcher.queue)
                    watcher.queue.clear()
                    done = watcher.closed or api._stopping or time.monotonic() >= deadline
                for ev in events:
                    self._chunk(ev)
                if done:
                    break
            self._end()
        except OSError:  # the client went away
            pass
        finally:
            with api._cond:
                watcher.closed = True
                if watcher in api._watchers:
                    api._watchers.remove(watcher)

    def _chunk(self, event: dict[str, Any]) -> None:
        data = json.dumps(event, separators=(",", ":")).encode() + b"\n"
        self.wfile.write(f"{len(data):X}\r\n".encode() + data + b"\r\n")
        self.wfile.flush()

    def _end(self) -> None:
        self.wfile.write(b"0\r\n\r\n")
        self.wfile.flush()
