"""Kubernetes as a source of scheduler signals: list+watch through ``kubernetes_asyncio``.

:class:`KubeWatchSource` lists, then watches from the list's resourceVersion,
three things (a 410 Gone, as an HTTP 410 or as an ``ERROR`` watch event, lists
again; other errors back off from 1 s, doubling up to 30 s; bookmarks are asked
for so a resumed watch starts close to now):

- nodes (``PHALANX_K8S_NODE_SELECTOR``): capacity is the allocatable
  ``PHALANX_K8S_SLOT_RESOURCE`` of the nodes that are Ready, schedulable (not
  cordoned) and not marked unhealthy (label ``PHALANX_K8S_HEALTH_LABEL``, default
  ``phalanx.io/unhealthy``, with a truthy value). A :class:`CapacityChanged` when
  it changes (``offered`` stays empty: that is the local cluster's). A node running
  job pods that turns NotReady, cordoned (a drain is coming) or unhealthy gives a
  :class:`PreemptionNotice` for the workers of those pods, ``nodes=[node]`` (and
  their Phalanx nodes, see below), with their termination grace as the deadline;
- the job's pods (``PHALANX_K8S_POD_SELECTOR`` in the namespace): a
  ``DisruptionTarget`` condition (scheduler preemption, eviction, taint manager,
  node shutdown), a deletion in progress, or a disappearance while running gives a
  notice for the pod's workers (label ``phalanx.io/worker`` or annotation
  ``phalanx.io/workers``) or its Phalanx node (annotation ``phalanx.io/node-id``),
  job (label ``phalanx.io/job``) and node, with the pod's grace period as the deadline;
- pending pods (the namespace, or every namespace with
  ``PHALANX_K8S_ALL_NAMESPACES=1``): a pod that is not a job pod, of higher
  priority than job pods, requesting the slot resource that no usable node has
  free gives a notice for the job pods the scheduler would have to preempt for it
  (see :func:`pending_reclaims` for the approximation).

Each notice is announced once (its key becomes the ``Nats-Msg-Id``; the
:class:`~phalanx.services.scheduler_signal.sources.Ledger` reads the ids already
announced back from the stream). Everything but a pod vanishing while running is
worked out from the current state after every event and every list, so a list
after a 410 or an error misses nothing. An object the watch cannot use (no
metadata, no name) is logged and skipped.

A pod running a launcher (``phalanx run``) cannot name its workers in its
template: an Indexed Job's pods share one, and the planner renames the workers of
a launcher that replaces one (``<node>-w3``.. after ``-w0``..) and names the spares
it starts. So such a pod names its launcher's ``--node-id`` instead (annotation
``phalanx.io/node-id``, see :func:`pod_node`), and its notices carry that node in
``nodes``: the planner takes every worker it has there, whatever their names.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import re
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation
from functools import partial
from pathlib import Path
from typing import Any

from aiohttp import ClientTimeout
from kubernetes_asyncio.client import ApiClient, Configuration, CoreV1Api
from kubernetes_asyncio.client.exceptions import ApiException
from kubernetes_asyncio.watch import Watch
from phalanx.services.scheduler_signal.sources import Emit, Ledger

from phalanx.settings import SchedulerSignalSettings, load
from phalanx.telemetry import get_logger

SA_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")
JOB_LABEL = "phalanx.io/job"
WORKER_LABEL = "phalanx.io/worker"
WORKERS_ANNOTATION = "phalanx.io/workers"  # a pod running several workers (phalanx run): w0,w1,...
NODE_ANNOTATION = "phalanx.io/node-id"  # a pod running a launcher: its --node-id, or "hostname"
HEALTH_LABEL = "phalanx.io/unhealthy"
PENDING = "status.phase=Pending"
_FALSE = ("", "0", "false", "no", "off")
_SUFFIX = {
    "m": Decimal("0.001"),
    "k": Decimal(10**3),
    "M": Decimal(10**6),
    "G": Decimal(10**9),
    "T": Decimal(10**12),
    "Ki": Decimal(2**10),
    "Mi": Decimal(2**20),
    "Gi": Decimal(2**30),
    "Ti": Decimal(2**40),
}


class WatchExpired(Exception):
    """The watch's resourceVersion is too old (410 Gone): list again."""


class BadObject(ValueError):
    """A watched object without what every object has (metadata, a name)."""


# -- quantities, nodes, pods ------------------------------------------------------------------
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


def node_trouble(node: dict[str, Any], health_label: str = HEALTH_LABEL) -> str:
    """Why a node offers nothing (``""``: it is usable): not Ready, cordoned, marked unhealthy."""
    why: list[str] = []
    conditions = (node.get("status") or {}).get("conditions") or []
    ready = next((c for c in conditions if c.get("type") == "Ready"), None)
    if ready is None or ready.get("status") != "True":
        why.append(f"not ready ({(ready or {}).get('reason') or 'no Ready condition'})")
    if (node.get("spec") or {}).get("unschedulable"):
        why.append("cordoned")
    labels = (node.get("metadata") or {}).get("labels") or {}
    if health_label and str(labels.get(health_label, "")).strip().lower() not in _FALSE:
        why.append(f"marked unhealthy ({health_label}={labels[health_label]})")
    return ", ".join(why)


def node_slots(node: dict[str, Any], resource: str, health_label: str = HEALTH_LABEL) -> int:
    """Slots a node offers: its allocatable ``resource`` if it is usable (:func:`node_trouble`)."""
    if node_trouble(node, health_label):
        return 0
    allocatable = (node.get("status") or {}).get("allocatable") or {}
    return max(0, parse_quantity(allocatable.get(resource)))


def pod_request(pod: dict[str, Any], resource: str) -> int:
    """How much of ``resource`` a pod asks for: its containers' requests (else limits),
    or its largest init container's when that is more."""
    spec = pod.get("spec") or {}

    def one(c: dict[str, Any]) -> int:
        res = c.get("resources") or {}
        value = (res.get("requests") or {}).get(resource, (res.get("limits") or {}).get(resource))
        return parse_quantity(value)

    main = sum(one(c) for c in spec.get("containers") or [])
    init = max((one(c) for c in spec.get("initContainers") or []), default=0)
    return max(main, init)


def pod_workers(pod: dict[str, Any]) -> list[str]:
    """The workers a pod runs: label ``phalanx.io/worker``, or annotation ``phalanx.io/workers``."""
    meta = pod.get("metadata") or {}
    labels = meta.get("labels") or {}
    if labels.get(WORKER_LABEL):
        return [labels[WORKER_LABEL]]
    listed = (meta.get("annotations") or {}).get(WORKERS_ANNOTATION, "")
    return [w.strip() for w in listed.split(",") if w.strip()]


def pod_node(pod: dict[str, Any]) -> str:
    """The Phalanx node (the launcher's ``--node-id``) a pod runs, ``""`` if it names none.

    Annotation ``phalanx.io/node-id``: ``hostname`` means the pod's hostname, which
    is ``spec.hostname`` when its controller sets one (an Indexed Job's
    ``<job>-<index>``, a StatefulSet's pod name), else the pod's name; any other
    value is the node id itself (a pod of its own, not from a shared template).
    """
    meta = pod.get("metadata") or {}
    value = str((meta.get("annotations") or {}).get(NODE_ANNOTATION, "")).strip()
    if value == "hostname":
        return str((pod.get("spec") or {}).get("hostname") or meta.get("name") or "")
    return value


def worker_order(worker: str) -> tuple[str, int, str]:
    """Sort key of worker names: ``w2`` before ``w10``."""
    m = re.match(r"^(.*?)(\d+)$", worker)
    return (m.group(1), int(m.group(2)), worker) if m else (worker, -1, worker)


def _grace(pod: dict[str, Any]) -> float:
    return float((pod.get("spec") or {}).get("terminationGracePeriodSeconds", 30))


def _priority(pod: dict[str, Any]) -> int:
    return int((pod.get("spec") or {}).get("priority") or 0)


def _ref(pod: dict[str, Any]) -> str:
    meta = pod.get("metadata") or {}
    return f"{meta.get('namespace', '')}/{meta.get('name', '')}"


def _node_of(pod: dict[str, Any]) -> str:
    return str((pod.get("spec") or {}).get("nodeName") or "")


def _job_of(pod: dict[str, Any]) -> str | None:
    return ((pod.get("metadata") or {}).get("labels") or {}).get(JOB_LABEL)


@dataclass(frozen=True)
class Reclaim:
    """A preemption to announce once, under ``key``."""

    key: str
    job: str | None
    workers: list[str]
    nodes: list[str]
    deadline_s: float
    reason: str
    covers: tuple[str, ...] = ()  # node trouble: the (node/uid) pods it announces


@dataclass(frozen=True)
class PodPreemption:
    """A job pod Kubernetes is taking away, and how long it has left."""

    uid: str
    pod: str
    job: str | None
    workers: list[str]
    deadline_s: float
    reason: str
    node: str = ""
    namespace: str = ""
    phalanx_node: str = ""  # the launcher's --node-id (pod_node), "" if the pod names none

    def reclaim(self) -> Reclaim:
        where = f"{self.namespace}/{self.pod}" if self.namespace else self.pod
        return Reclaim(
            key=self.uid,
            job=self.job,
            workers=list(self.workers),
            # the pod's workers leave, not every worker on its Kubernetes node; a pod's
            # Phalanx node is its launcher's, whose workers are all in this pod
            nodes=[self.phalanx_node] if self.phalanx_node else [],
            deadline_s=self.deadline_s,
            reason=f"pod {where}{' on ' + self.node if self.node else ''}: {self.reason}",
        )


def pod_preemption(pod: dict[str, Any], event_type: str = "MODIFIED") -> PodPreemption | None:
    """Whether a job pod is being taken away, and how long it has left.

    A pod is taken when Kubernetes marks it with a ``DisruptionTarget`` condition
    (scheduler preemption, eviction, taint manager, node shutdown), when its
    deletion has begun (``deletionTimestamp``), or when it disappears while still
    running. Pods that already finished are the failure-detector's business.
    """
    meta = pod.get("metadata") or {}
    status = pod.get("status") or {}
    if status.get("phase") in ("Succeeded", "Failed"):
        return None
    grace = _grace(pod)
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
    return PodPreemption(
        uid=meta.get("uid") or meta.get("name", ""),
        pod=meta.get("name", ""),
        job=_job_of(pod),
        workers=pod_workers(pod),
        deadline_s=deadline,
        reason=reason,
        node=_node_of(pod),
        namespace=meta.get("namespace", ""),
        phalanx_node=pod_node(pod),
    )


# -- what the watches keep ----------------------------------------------------------------------
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


def _meta(obj: Any) -> dict[str, Any]:
    meta = obj.get("metadata") if isinstance(obj, dict) else None
    if not isinstance(meta, dict) or not meta.get("name"):
        raise BadObject(f"no metadata.name in {str(obj)[:200]}")
    return meta


def _uid(obj: dict[str, Any]) -> str:
    meta = _meta(obj)
    return str(meta.get("uid") or f"{meta.get('namespace', '')}/{meta['name']}")


def watch_events(lines: Iterable[bytes]) -> list[dict[str, Any]]:
    """Watch events from a recorded stream: one JSON object per line."""
    return [json.loads(line) for line in (raw.strip() for raw in lines) if line]


class NodeTracker:
    """Nodes from a list and a stream of node watch events: slots and trouble of each."""

    def __init__(self, resource: str, health_label: str = HEALTH_LABEL) -> None:
        self.resource = resource
        self.health_label = health_label
        self.slots: dict[str, int] = {}
        self.trouble: dict[str, str] = {}  # unusable nodes: why
        self.resource_version = ""
        self.skipped: list[str] = []  # what the last reset could not use

    @property
    def available(self) -> int:
        return sum(self.slots.values())

    def usable(self, name: str) -> bool:
        return name in self.slots and name not in self.trouble

    def allocatable(self, name: str) -> int:
        return self.slots.get(name, 0)

    def reset(self, items: Iterable[dict[str, Any]], resource_version: str) -> None:
        """Start over from a full list."""
        self.slots, self.trouble, self.skipped = {}, {}, []
        for n in items:
            try:
                self._put(n)
            except BadObject as exc:
                self.skipped.append(str(exc))
        self.resource_version = resource_version

    def apply(self, event: dict[str, Any]) -> bool:
        """Apply one watch event; True when the available slots changed."""
        kind, obj = _event_parts(event)
        before = self.available
        if kind != "BOOKMARK":
            name = _meta(obj)["name"]
            if kind == "DELETED":
                self.slots.pop(name, None)
                self.trouble.pop(name, None)
            else:
                self._put(obj)
        self.resource_version = (obj.get("metadata") or {}).get("resourceVersion", self.resource_version)
        return self.available != before

    def _put(self, node: dict[str, Any]) -> None:
        name = _meta(node)["name"]
        why = node_trouble(node, self.health_label)
        self.slots[name] = node_slots(node, self.resource, self.health_label)
        if why:
            self.trouble[name] = why
        else:
            self.trouble.pop(name, None)


class PodTracker:
    """Pods from a list and a stream of pod watch events: those that hold a node now.

    ``pods`` (uid -> pod) keeps the pods not finished (the job's, or the pending
    ones, by what is watched); :meth:`apply` returns the preemption an event shows.
    """

    def __init__(self) -> None:
        self.pods: dict[str, dict[str, Any]] = {}
        self.resource_version = ""
        self.skipped: list[str] = []

    def reset(self, items: Iterable[dict[str, Any]], resource_version: str) -> list[PodPreemption]:
        self.pods, self.skipped = {}, []
        out: list[PodPreemption] = []
        for pod in items:
            try:
                self._put("ADDED", pod)
            except BadObject as exc:
                self.skipped.append(str(exc))
                continue
            p = pod_preemption(pod, "ADDED")
            if p is not None:
                out.append(p)
        self.resource_version = resource_version
        return out

    def apply(self, event: dict[str, Any]) -> PodPreemption | None:
        kind, obj = _event_parts(event)
        if kind != "BOOKMARK":
            self._put(kind, obj)
        self.resource_version = (obj.get("metadata") or {}).get("resourceVersion", self.resource_version)
        if kind == "BOOKMARK":
            return None
        return pod_preemption(obj, kind)

    def _put(self, kind: str, pod: dict[str, Any]) -> None:
        uid = _uid(pod)
        if kind == "DELETED" or (pod.get("status") or {}).get("phase") in ("Succeeded", "Failed"):
            self.pods.pop(uid, None)
        else:
            self.pods[uid] = pod


# -- what the state means ---------------------------------------------------------------------
def _reclaims_by_job(
    key: str, pods: list[dict[str, Any]], nodes: list[str], reason: str, always_suffix: bool
) -> list[Reclaim]:
    """One notice per job of ``pods``: their workers, ``nodes`` and their Phalanx nodes."""
    by_job: dict[str | None, list[dict[str, Any]]] = {}
    for p in pods:
        by_job.setdefault(_job_of(p), []).append(p)
    out = []
    for job, group in sorted(by_job.items(), key=lambda kv: kv[0] or ""):
        suffix = f"-{job}" if (always_suffix or len(by_job) > 1) and job else ""
        out.append(
            Reclaim(
                key=f"{key}{suffix}",
                job=job,
                workers=sorted({w for p in group for w in pod_workers(p)}, key=worker_order),
                nodes=list(dict.fromkeys([*nodes, *sorted({pod_node(p) for p in group} - {""})])),
                deadline_s=min(_grace(p) for p in group),
                reason=reason,
            )
        )
    return out


def node_reclaims(nodes: NodeTracker, pods: PodTracker, covered: Iterable[str] = ()) -> list[Reclaim]:
    """A notice per job on each unusable node for its job pods not yet announced.

    Pods already being taken (their own notice) and pods in ``covered``
    (``node/uid``, announced for this node before: see :attr:`Reclaim.covers`)
    are left out; a notice goes out when any pod is left. Its key is the node and
    the uids of the job's live pods on it, so the same trouble seen again (another
    event, a list after a 410, a restart) is the same notice, while a new pod on
    the node is news.
    """
    done = set(covered)
    out: list[Reclaim] = []
    on_node: dict[str, list[dict[str, Any]]] = {}
    for pod in pods.pods.values():
        node = _node_of(pod)
        if node in nodes.trouble:
            on_node.setdefault(node, []).append(pod)
    for node, live in sorted(on_node.items()):
        fresh = [p for p in live if pod_preemption(p) is None and f"{node}/{_uid(p)}" not in done]
        if not fresh:
            continue
        for r in _reclaims_by_job("", fresh, [node], f"node {node} {nodes.trouble[node]}", False):
            uids = sorted(_uid(p) for p in live if _job_of(p) == r.job)
            digest = hashlib.sha256("\n".join([r.job or "", *uids]).encode()).hexdigest()[:16]
            covers = tuple(f"{node}/{u}" for u in uids)
            out.append(
                Reclaim(f"node-{node}-{digest}", r.job, r.workers, r.nodes, r.deadline_s, r.reason, covers)
            )
    return out


def pending_reclaims(
    nodes: NodeTracker, job: PodTracker, pending: PodTracker, resource: str
) -> list[Reclaim]:
    """The job pods the scheduler would preempt for pending pods of higher priority.

    An approximation of the scheduler's own preemption: a node's free slots are
    its allocatable ``resource`` minus what the job pods on it request; the
    requests of other pods are not watched, so a node may be fuller than it
    looks, and a notice may come late or not at all (the pods' ``DisruptionTarget``
    then still announces them); node selectors, affinity and taints are not
    considered. Pending pods are taken highest priority first. One that fits on a
    usable node takes that room; one that does not needs victims on a single
    node (the one it is nominated to, when the scheduler named it): job pods of
    lower priority, lowest priority and highest worker index first, the fewest
    that make it fit (ties: the lowest priorities, then the highest worker
    index). Where none would, nothing is announced. One notice per pending pod
    (per job), keyed by its uid.
    """
    used: dict[str, int] = {}
    on_node: dict[str, list[dict[str, Any]]] = {}
    for p in job.pods.values():
        node = _node_of(p)
        if nodes.usable(node):
            used[node] = used.get(node, 0) + pod_request(p, resource)
            if pod_preemption(p) is None:
                on_node.setdefault(node, []).append(p)
    free = {n: nodes.allocatable(n) - used.get(n, 0) for n in nodes.slots if nodes.usable(n)}
    taken: set[str] = set()
    out: list[Reclaim] = []

    def order(p: dict[str, Any]) -> tuple[int, str, str]:
        meta = p.get("metadata") or {}
        return (-_priority(p), str(meta.get("creationTimestamp") or ""), _ref(p))

    for pod in sorted(pending.pods.values(), key=order):
        uid = _uid(pod)
        if uid in job.pods or _job_of(pod) is not None:
            continue
        need, prio = pod_request(pod, resource), _priority(pod)
        if need <= 0 or (pod.get("status") or {}).get("phase", "Pending") != "Pending" or _node_of(pod):
            continue
        fits = [n for n, f in free.items() if f >= need]
        if fits:
            room = min(fits, key=lambda n: (free[n], n))  # the tightest fit
            free[room] -= need
            continue
        nominated = str((pod.get("status") or {}).get("nominatedNodeName") or "")
        best: tuple[tuple[int, int, int, int, str], str, list[dict[str, Any]]] | None = None
        for node in sorted(free if nominated not in free else [nominated]):
            candidates = sorted(
                (
                    v
                    for v in on_node.get(node, [])
                    if _uid(v) not in taken and _priority(v) < prio and pod_request(v, resource) > 0
                ),
                key=lambda v: (
                    _priority(v),
                    -max((worker_order(w)[1] for w in pod_workers(v)), default=-1),
                    _ref(v),
                ),
            )
            got, chosen = free[node], []
            for v in candidates:
                if got >= need:
                    break
                chosen.append(v)
                got += pod_request(v, resource)
            if got < need:
                continue
            prios = [_priority(v) for v in chosen]
            index = max((worker_order(w)[1] for v in chosen for w in pod_workers(v)), default=-1)
            rank = (len(chosen), max(prios, default=0), sum(prios), -index, node)
            if best is None or rank < best[0]:
                best = (rank, node, chosen)
        if best is None:
            continue
        _, node, chosen = best
        taken |= {_uid(v) for v in chosen}
        free[node] += sum(pod_request(v, resource) for v in chosen) - need
        reason = f"pending pod {_ref(pod)} (priority {prio}) needs {need} {resource}"
        out.extend(_reclaims_by_job(f"pending-{uid}", chosen, [], reason, False))  # the victims only
    return out


# -- configuration and the client ----------------------------------------------------------------
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
    health_label: str = HEALTH_LABEL
    all_namespaces: bool = False
    watch_timeout_s: int = 300

    @classmethod
    def from_env(cls, sa_dir: Path = SA_DIR) -> KubeConfig | None:
        """In a pod (service host and token present) or with ``PHALANX_K8S=1``; else None.

        In a pod the API server, token and CA are the ones the client's in-cluster
        configuration would use (``KUBERNETES_SERVICE_HOST``/``PORT``, the service
        account's files); ``PHALANX_K8S_API`` overrides the server (e.g. ``kubectl proxy``).
        The ``PHALANX_K8S_*`` knobs come from :class:`phalanx.settings.SchedulerSignalSettings`.
        """
        settings = load(SchedulerSignalSettings)
        host = os.environ.get("KUBERNETES_SERVICE_HOST")
        port = os.environ.get("KUBERNETES_SERVICE_PORT", "443")
        in_cluster = bool(host) and (sa_dir / "token").exists()
        if not (in_cluster or settings.k8s):
            return None
        api = settings.k8s_api or (f"https://{host}:{port}" if host else "")
        if not api:
            raise ValueError("PHALANX_K8S=1 but neither PHALANX_K8S_API nor KUBERNETES_SERVICE_HOST is set")
        ns_file = sa_dir / "namespace"
        namespace = settings.k8s_namespace or (ns_file.read_text().strip() if ns_file.exists() else "default")
        token = sa_dir / "token"
        ca = sa_dir / "ca.crt"
        return cls(
            api=api.rstrip("/"),
            namespace=namespace,
            cluster=settings.cluster_name,
            token_file=token if token.exists() else None,
            ca_file=ca if ca.exists() else None,
            pod_selector=settings.k8s_pod_selector,
            node_selector=settings.k8s_node_selector,
            slot_resource=settings.k8s_slot_resource,
            health_label=settings.k8s_health_label,
            all_namespaces=settings.k8s_all_namespaces,
        )


class ServiceAccountToken:
    """A bearer token file, read again whenever it changes (projected tokens rotate)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._stamp: tuple[int, int, int] | None = None
        self.value = ""

    def read(self) -> str:
        st = self.path.stat()
        stamp = (st.st_mtime_ns, st.st_size, st.st_ino)
        if stamp != self._stamp:
            self.value = self.path.read_text().strip()
            self._stamp = stamp
        return self.value

    def refresh(self, conf: Configuration) -> None:
        """The client's ``refresh_api_key_hook``: called before each request."""
        try:
            conf.api_key["BearerToken"] = self.read()
        except OSError:  # mid-rotation: keep the token read last
            pass


def client_configuration(cfg: KubeConfig) -> Configuration:
    """The client's configuration: the API server, its CA, the bearer token (re-read on change)."""
    conf = Configuration(host=cfg.api)
    conf.verify_ssl = True
    if cfg.ca_file is not None:
        conf.ssl_ca_cert = str(cfg.ca_file)
    if cfg.token_file is not None:
        token = ServiceAccountToken(cfg.token_file)
        conf.api_key = {"BearerToken": token.read()}
        conf.api_key_prefix = {"BearerToken": "Bearer"}
        conf.refresh_api_key_hook = token.refresh
    return conf


class _RawWatch(Watch):
    """The client's watch, leaving objects as the API server sent them (dicts)."""

    def get_return_type(self, func: object) -> str:
        return ""


ListCall = Callable[..., Awaitable[Any]]


async def _checked(call: ListCall, **kwargs: Any) -> Any:
    """``call`` (with ``_preload_content=False``), raising :class:`ApiException` on an HTTP error."""
    kwargs["_preload_content"] = False
    resp = await call(**kwargs)
    if not 200 <= resp.status < 300:
        body = await resp.read()
        resp.release()
        exc = ApiException(status=resp.status, reason=resp.reason)
        exc.body = body
        raise exc
    return resp


def _describe(exc: BaseException) -> str:
    if isinstance(exc, ApiException):
        return f"HTTP {exc.status} {exc.reason or ''}".strip()
    return repr(exc)


def _expired(exc: BaseException) -> bool:
    return isinstance(exc, WatchExpired) or (isinstance(exc, ApiException) and exc.status == 410)


@dataclass
class _Feed:
    """One list+watch: what, how to call it, and the tracker it fills."""

    what: str
    call: ListCall
    selectors: dict[str, str]
    tracker: NodeTracker | PodTracker


# -- the source -----------------------------------------------------------------------------------
class KubeWatchSource:
    """Capacity from nodes, preemptions from the job's pods, their nodes and pending pods."""

    name = "k8s"
    BACKOFF_MIN_S = 1.0
    BACKOFF_MAX_S = 30.0
    LIST_TIMEOUT_S = 30.0
    PAGE = 500

    def __init__(self, cfg: KubeConfig, ledger: Ledger) -> None:
        self.cfg = cfg
        self.ledger = ledger
        self.nodes = NodeTracker(cfg.slot_resource, cfg.health_label)
        self.pods = PodTracker()
        self.pending = PodTracker()
        self.log = get_logger(component="scheduler-signal", source="k8s", api=cfg.api)
        self.events = 0
        self.lists = 0
        self.bad_objects = 0
        self.last_error = ""
        self._synced: set[str] = set()
        self._covered: set[str] = set()  # node/uid: job pods announced for their node's trouble
        self._lock = asyncio.Lock()  # one event at a time: the state and the ledger stay consistent

    def details(self) -> dict[str, str | int | float | bool]:
        return {
            "k8s.api": self.cfg.api,
            "k8s.events": self.events,
            "k8s.lists": self.lists,
            "k8s.nodes": len(self.nodes.slots),
            "k8s.job_pods": len(self.pods.pods),
            "k8s.pending_pods": len(self.pending.pods),
            "k8s.bad_objects": self.bad_objects,
            "k8s.last_error": self.last_error,
        }

    async def run(self, emit: Emit) -> None:
        async with ApiClient(client_configuration(self.cfg)) as api_client:
            core = CoreV1Api(api_client)
            ns = self.cfg.namespace
            pending_call: ListCall = (
                core.list_pod_for_all_namespaces
                if self.cfg.all_namespaces
                else partial(core.list_namespaced_pod, ns)
            )
            feeds = [
                _Feed("nodes", core.list_node, _selectors(self.cfg.node_selector), self.nodes),
                _Feed(
                    "pods",
                    partial(core.list_namespaced_pod, ns),
                    _selectors(self.cfg.pod_selector),
                    self.pods,
                ),
                _Feed("pending", pending_call, _selectors("", PENDING), self.pending),
            ]
            await asyncio.gather(*(self._loop(f, emit) for f in feeds))

    async def _loop(self, feed: _Feed, emit: Emit) -> None:
        backoff = self.BACKOFF_MIN_S
        while True:
            try:
                await self._list(feed, emit)
                while True:  # watch until the server ends it, then resume from the last version
                    await self._watch(feed, emit)
                    backoff = self.BACKOFF_MIN_S
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                if _expired(exc):
                    self.log.info("k8s_watch_expired", what=feed.what, reason=str(exc).strip())
                    continue
                self.last_error = f"{feed.what}: {_describe(exc)}"
                self.log.warning("k8s_watch_failed", what=feed.what, error=_describe(exc), retry_s=backoff)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, self.BACKOFF_MAX_S)

    async def _list(self, feed: _Feed, emit: Emit) -> None:
        items: list[dict[str, Any]] = []
        cont = ""
        while True:
            kwargs: dict[str, Any] = {**feed.selectors, "limit": self.PAGE}
            if cont:
                kwargs["_continue"] = cont
            resp = await _checked(
                feed.call, _request_timeout=ClientTimeout(total=self.LIST_TIMEOUT_S), **kwargs
            )
            doc = json.loads(await resp.read())
            items.extend(doc.get("items") or [])
            meta = doc.get("metadata") or {}
            cont = meta.get("continue") or ""
            if not cont:
                break
        self.lists += 1
        async with self._lock:
            feed.tracker.reset(items, str(meta.get("resourceVersion", "")))
            for why in feed.tracker.skipped:
                self.bad_objects += 1
                self.log.warning("k8s_bad_object", what=feed.what, error=why)
            self._synced.add(feed.what)
            self.log.info(
                "k8s_listed", what=feed.what, items=len(items), resource_version=meta.get("resourceVersion")
            )
            await self._evaluate(emit)

    async def _watch(self, feed: _Feed, emit: Emit) -> None:
        async with _RawWatch() as watch:
            stream = watch.stream(
                partial(_checked, feed.call),
                resource_version=feed.tracker.resource_version,
                timeout_seconds=self.cfg.watch_timeout_s,
                allow_watch_bookmarks=True,
                # connecting may take LIST_TIMEOUT_S, then silence until the server's timeout
                _request_timeout=ClientTimeout(
                    sock_connect=self.LIST_TIMEOUT_S, sock_read=self.cfg.watch_timeout_s + 30
                ),
                **feed.selectors,
            )
            async for event in stream:
                async with self._lock:
                    self.events += 1
                    await self._event(feed, event, emit)

    async def _event(self, feed: _Feed, event: Any, emit: Emit) -> None:
        gone: PodPreemption | None = None
        try:
            if not isinstance(event, dict):
                raise BadObject(f"not a watch event: {str(event)[:200]}")
            event = {"type": event.get("type"), "object": event.get("raw_object", event.get("object"))}
            if isinstance(feed.tracker, NodeTracker):
                feed.tracker.apply(event)
            else:
                p = feed.tracker.apply(event)
                if feed.what == "pods" and p is not None and event["type"] == "DELETED":
                    gone = p  # no longer in the state: announced from the event itself
        except BadObject as exc:
            self.bad_objects += 1
            self.log.warning("k8s_bad_object", what=feed.what, error=str(exc))
            return
        if gone is not None:
            await self._announce(gone.reclaim(), emit)
        await self._evaluate(emit)

    async def _evaluate(self, emit: Emit) -> None:
        """Announce what the state shows (the ledger drops what was announced already)."""
        if "nodes" in self._synced:
            sig = await self.ledger.capacity(
                self.cfg.cluster, self.nodes.available, f"nodes-{self.nodes.resource_version}"
            )
            if sig is not None:
                await emit(sig)
                self.ledger.published(sig)
        if "pods" in self._synced:
            for pod in list(self.pods.pods.values()):
                p = pod_preemption(pod)
                if p is not None:
                    await self._announce(p.reclaim(), emit)
        if {"nodes", "pods"} <= self._synced:
            self._covered = {c for c in self._covered if c.split("/", 1)[0] in self.nodes.trouble}
            for r in node_reclaims(self.nodes, self.pods, self._covered):
                await self._announce(r, emit)
                self._covered.update(r.covers)
        if {"nodes", "pods", "pending"} <= self._synced:
            for r in pending_reclaims(self.nodes, self.pods, self.pending, self.cfg.slot_resource):
                await self._announce(r, emit)

    async def _announce(self, r: Reclaim, emit: Emit) -> None:
        sig = await self.ledger.preemption(
            self.cfg.cluster, r.key, r.job, r.workers, r.deadline_s, nodes=r.nodes, reason=r.reason
        )
        if sig is None:
            return
        self.log.info(
            "k8s_preemption",
            key=r.key,
            job=r.job,
            workers=r.workers,
            nodes=r.nodes,
            reason=r.reason,
            deadline_s=r.deadline_s,
        )
        await emit(sig)
        self.ledger.published(sig)


def _selectors(labels: str, fields: str = "") -> dict[str, str]:
    out = {}
    if labels:
        out["label_selector"] = labels
    if fields:
        out["field_selector"] = fields
    return out
