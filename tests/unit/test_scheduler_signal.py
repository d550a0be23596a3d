"""scheduler-signal sources: the cluster file, and Kubernetes watch events mapped to signals.

The Kubernetes events are recorded API responses (``k8s/*.json*``): node and pod
lists and watch streams of nodes, of a job's pods and of pending pods, as the API
server sends them. ``tests/integration/test_kube_source.py`` plays them through
the real client against a fake API server.
"""

from __future__ import annotations

import inspect
import json
import os
from pathlib import Path
from typing import Any

import pytest
from phalanx.services.scheduler_signal.kube import (
    BadObject,
    KubeConfig,
    NodeTracker,
    PodTracker,
    WatchExpired,
    client_configuration,
    node_reclaims,
    node_slots,
    node_trouble,
    parse_quantity,
    pending_reclaims,
    pod_preemption,
    pod_request,
    watch_events,
)
from phalanx.services.scheduler_signal.sources import FileClusterSource, Ledger, Signal

from phalanx.contract import CapacityChanged, PreemptionNotice

DATA = Path(__file__).parent / "k8s"


class NothingPublished:
    """The history of a cluster nobody published anything for yet."""

    async def last_capacity(self, cluster: str) -> int | None:
        return None

    async def announced(self, cluster: str) -> set[str]:
        return set()


def _events(name: str) -> list[dict[str, Any]]:
    with open(DATA / name, "rb") as f:
        return list(watch_events(f))


# -- quantities and nodes ---------------------------------------------------------------
@pytest.mark.parametrize(
    ("value", "expected"),
    [("8", 8), (8, 8), ("3900m", 3), ("95500m", 95), ("2k", 2000), ("1Ki", 1024), (None, 0), ("junk", 0)],
)
def test_parse_quantity(value: Any, expected: int) -> None:
    assert parse_quantity(value) == expected


def test_node_list_gives_the_slots_of_ready_nodes() -> None:
    listing = json.loads((DATA / "nodes_list.json").read_text())
    nodes = NodeTracker("nvidia.com/gpu")
    nodes.reset(listing["items"], listing["metadata"]["resourceVersion"])
    assert nodes.slots == {"gpu-a": 8, "gpu-b": 8, "cpu-c": 0}
    assert nodes.available == 16 and nodes.resource_version == "48211"
    cpu = NodeTracker("cpu")
    cpu.reset(listing["items"], "1")
    assert cpu.available == 95 + 95 + 31


def test_node_watch_events_change_capacity() -> None:
    listing = json.loads((DATA / "nodes_list.json").read_text())
    nodes = NodeTracker("nvidia.com/gpu")
    nodes.reset(listing["items"], "48211")
    seen = []
    events = _events("nodes_watch.jsonl")
    for event in events[:-1]:
        seen.append((nodes.apply(event), nodes.available, nodes.resource_version))
    assert seen == [
        (False, 16, "48230"),  # gpu-d added, not ready yet
        (True, 20, "48244"),  # gpu-d ready: +4
        (False, 20, "48290"),  # an annotation changed
        (False, 20, "48300"),  # bookmark
        (True, 12, "48312"),  # gpu-b cordoned
        (True, 4, "48330"),  # gpu-a removed
    ]
    with pytest.raises(WatchExpired, match="too old resource version"):
        nodes.apply(events[-1])


def test_unknown_or_failed_watch_events_are_errors() -> None:
    nodes = NodeTracker("nvidia.com/gpu")
    with pytest.raises(RuntimeError, match="unknown watch event type"):
        nodes.apply({"type": "WEIRD", "object": {}})
    with pytest.raises(RuntimeError, match="watch error: internal error"):
        nodes.apply({"type": "ERROR", "object": {"code": 500, "message": "internal error"}})


def test_node_not_ready_or_unschedulable_offers_nothing() -> None:
    node = {
        "spec": {},
        "status": {
            "allocatable": {"nvidia.com/gpu": "8"},
            "conditions": [{"type": "Ready", "status": "True"}],
        },
    }
    assert node_slots(node, "nvidia.com/gpu") == 8
    assert node_slots({**node, "spec": {"unschedulable": True}}, "nvidia.com/gpu") == 0
    unknown = {**node, "status": {**node["status"], "conditions": [{"type": "Ready", "status": "Unknown"}]}}
    assert node_slots(unknown, "nvidia.com/gpu") == 0
    assert node_slots(node, "amd.com/gpu") == 0


# -- pods -------------------------------------------------------------------------------
def test_pod_watch_events_map_to_preemptions() -> None:
    pods = PodTracker()
    got = []
    for event in _events("pods_watch.jsonl"):
        p = pods.apply(event)
        name = event["object"]["metadata"].get("name", "<bookmark>")
        got.append((name, None if p is None else (p.job, p.workers, p.deadline_s, p.reason)))
    assert got == [
        ("train-j1-w0", None),
        ("train-j1-w1", None),
        ("train-j1-w1", ("j1", ["w1"], 45.0, "PreemptionByScheduler")),
        ("train-j1-w1", ("j1", ["w1"], 45.0, "PreemptionByScheduler")),  # deletion follows
        ("train-j1-w2", ("j1", ["w2"], 10.0, "Deleted")),
        ("train-j1-w3", None),  # already failed: the failure-detector's business
        ("<bookmark>", None),
        ("train-j1-w4", ("j1", ["w4"], 0.0, "Deleted")),  # gone while running
        ("train-j1-w0", None),  # finished
    ]
    assert pods.resource_version == "51070"


def test_pod_of_several_workers_lists_them_from_its_annotation() -> None:
    meta = {
        "name": "p-7",
        "uid": "u7",
        "deletionTimestamp": "2026-01-01T00:00:00Z",
        "labels": {"phalanx.io/job": "j2"},
    }
    pod = {"metadata": meta, "spec": {}, "status": {"phase": "Pending"}}
    p = pod_preemption(pod)
    assert p is not None and p.workers == [] and p.job == "j2" and p.deadline_s == 30.0
    pod["metadata"] = {**meta, "annotations": {"phalanx.io/workers": "w0, w1,w2"}}
    p = pod_preemption(pod)
    assert p is not None and p.workers == ["w0", "w1", "w2"]


async def test_each_preempted_pod_is_announced_once() -> None:
    pods = PodTracker()
    ledger = Ledger(NothingPublished(), "k8s")
    notices: list[Signal] = []
    for event in _events("pods_watch.jsonl"):
        p = pods.apply(event)
        if p is None:
            continue
        sig = await ledger.preemption("prod", p.uid, p.job, p.workers, p.deadline_s)
        if sig is not None:
            notices.append(sig)
            ledger.published(sig)
    assert [s.msg_id for s in notices] == [
        "prod:preempt:1e0f6a0c-0000-4000-8000-000000000001",
        "prod:preempt:1e0f6a0c-0000-4000-8000-000000000002",
        "prod:preempt:1e0f6a0c-0000-4000-8000-000000000004",
    ]
    first = notices[0].message
    assert isinstance(first, PreemptionNotice)
    assert (first.cluster, first.job, first.workers, first.source) == ("prod", "j1", ["w1"], "k8s")


def _cluster() -> tuple[NodeTracker, PodTracker]:
    """The recorded cluster: gpu-a, gpu-b (8 GPUs each), cpu-c; job j1's w0..w3 (4 GPUs each)."""
    listing = json.loads((DATA / "nodes_list.json").read_text())
    nodes = NodeTracker("nvidia.com/gpu")
    nodes.reset(listing["items"], listing["metadata"]["resourceVersion"])
    pod_list = json.loads((DATA / "pods_list.json").read_text())
    pods = PodTracker()
    job = [p for p in pod_list["items"] if "phalanx.io/job" in p["metadata"]["labels"]]
    assert pods.reset(job, pod_list["metadata"]["resourceVersion"]) == []
    return nodes, pods


def test_node_health_label_and_why_a_node_offers_nothing() -> None:
    trouble = {
        e["object"]["metadata"]["name"] + str(i): e["object"]
        for i, e in enumerate(_events("nodes_trouble.jsonl"))
    }
    assert [node_trouble(n) for n in trouble.values()] == [
        "not ready (NodeStatusUnknown)",
        "cordoned",
        "marked unhealthy (phalanx.io/unhealthy=true)",
    ]
    assert [node_slots(n, "nvidia.com/gpu") for n in trouble.values()] == [0, 0, 0]
    unhealthy = trouble["gpu-a2"]
    assert node_slots(unhealthy, "nvidia.com/gpu", health_label="example.com/broken") == 8
    for value, slots in (("false", 8), ("0", 8), ("", 8), ("yes", 0), ("xid-79", 0)):
        unhealthy["metadata"]["labels"]["phalanx.io/unhealthy"] = value
        assert node_slots(unhealthy, "nvidia.com/gpu") == slots, value


@pytest.mark.parametrize(
    ("line", "node", "workers", "reason"),
    [
        (0, "gpu-a", ["w0", "w1"], "node gpu-a not ready (NodeStatusUnknown)"),
        (1, "gpu-b", ["w2", "w3"], "node gpu-b cordoned"),
        (2, "gpu-a", ["w0", "w1"], "node gpu-a marked unhealthy (phalanx.io/unhealthy=true)"),
    ],
)
def test_a_job_node_in_trouble_reclaims_its_workers(
    line: int, node: str, workers: list[str], reason: str
) -> None:
    nodes, pods = _cluster()
    assert node_reclaims(nodes, pods) == []
    assert nodes.apply(_events("nodes_trouble.jsonl")[line]) is True
    assert nodes.available == 8
    (r,) = node_reclaims(nodes, pods)
    assert (r.job, r.workers, r.nodes, r.deadline_s, r.reason) == ("j1", workers, [node], 45.0, reason)
    assert r.key.startswith(f"node-{node}-")
    assert node_reclaims(nodes, pods) == [r]  # the same trouble, the same key
    # a pod already being taken is the pod's own notice, not the node's
    w1 = next(uid for uid, p in pods.pods.items() if p["metadata"]["name"] == "train-j1-w1")
    pods.pods[w1] = {**pods.pods[w1], "metadata": {**pods.pods[w1]["metadata"], "deletionTimestamp": "x"}}
    if node == "gpu-a":
        (r2,) = node_reclaims(nodes, pods)
        assert r2.workers == ["w0"] and r2.key == r.key  # w1 still lives there: the same notice
    # what was announced for the node is not announced again, a new pod there is
    assert node_reclaims(nodes, pods, covered=r.covers) == []
    newcomer = json.loads(json.dumps(next(iter(pods.pods.values()))))
    newcomer["metadata"] = {
        **newcomer["metadata"],
        "uid": "new",
        "labels": {**newcomer["metadata"]["labels"], "phalanx.io/worker": "w9"},
    }
    newcomer["spec"]["nodeName"] = node
    pods.apply({"type": "ADDED", "object": newcomer})
    (r3,) = node_reclaims(nodes, pods, covered=r.covers)
    assert r3.workers == ["w9"] and r3.key != r.key


def test_pending_pods_of_higher_priority_reclaim_job_pods() -> None:
    nodes, pods = _cluster()
    pending = PodTracker()
    serving, batch, etl, other_ns = _events("pods_pending.jsonl")
    assert pod_request(serving["object"], "nvidia.com/gpu") == 8
    assert pod_request(etl["object"], "nvidia.com/gpu") == 0
    pending.apply(batch)  # priority 10 < the job's 100: it may not preempt the job
    pending.apply(etl)  # no GPU asked for
    assert pending_reclaims(nodes, pods, pending, "nvidia.com/gpu") == []
    pending.apply(serving)
    (r,) = pending_reclaims(nodes, pods, pending, "nvidia.com/gpu")
    assert (r.key, r.job, r.workers, r.nodes, r.deadline_s) == (
        "pending-9f8e7d6c-0000-4000-8000-0000000000c1",
        "j1",
        ["w2", "w3"],  # the highest worker indexes, on one node
        [],  # the victims leave, not every worker of their node
        45.0,
    )
    assert r.reason == "pending pod phalanx/serving-7d9c (priority 1000) needs 8 nvidia.com/gpu"
    # the scheduler nominated gpu-a: the victims are there
    nominated = json.loads(json.dumps(serving))
    nominated["object"]["status"]["nominatedNodeName"] = "gpu-a"
    pending.apply({**nominated, "type": "MODIFIED"})
    (r,) = pending_reclaims(nodes, pods, pending, "nvidia.com/gpu")
    assert (r.workers, r.nodes) == (["w0", "w1"], []) and "gpu-a" not in r.reason
    # a second one needs 4 more: the next victims, not the same ones
    pending.apply(other_ns)
    first, second = pending_reclaims(nodes, pods, pending, "nvidia.com/gpu")
    assert (first.workers, second.workers, second.nodes) == (["w0", "w1"], ["w3"], [])
    # room on a node: nothing to take
    nodes.apply({"type": "ADDED", "object": {**_events("nodes_watch.jsonl")[1]["object"]}})  # gpu-d: 4 GPUs
    assert [r.workers for r in pending_reclaims(nodes, pods, pending, "nvidia.com/gpu")] == [["w0", "w1"]]


def test_objects_without_metadata_are_refused() -> None:
    nodes, pods = _cluster()
    pod_event, node_event = _events("bad_objects.jsonl")
    with pytest.raises(BadObject):
        pods.apply(pod_event)
    with pytest.raises(BadObject):
        nodes.apply(node_event)
    nodes.reset([node_event["object"], *json.loads((DATA / "nodes_list.json").read_text())["items"]], "1")
    assert len(nodes.skipped) == 1 and nodes.available == 16


# -- the ledger -----------------------------------------------------------------------------
async def test_ledger_publishes_capacity_only_when_it_changes() -> None:
    ledger = Ledger(NothingPublished(), "file")
    first = await ledger.capacity("c", 8, "r1")
    assert first is not None and first.msg_id == "c:capacity:r1"
    assert isinstance(first.message, CapacityChanged) and (
        first.message.available_slots,
        first.message.delta,
    ) == (8, 8)
    # not yet acknowledged by the bus: the same change is proposed again
    again = await ledger.capacity("c", 8, "r1")
    assert again is not None and again.msg_id == first.msg_id
    assert again.message.model_dump(exclude={"ts"}) == first.message.model_dump(exclude={"ts"})
    ledger.published(first)
    assert await ledger.capacity("c", 8, "r2") is None
    down = await ledger.capacity("c", 6, "r3")
    assert down is not None and isinstance(down.message, CapacityChanged) and down.message.delta == -2


# -- the cluster file --------------------------------------------------------------------------
def _write(path: Path, doc: dict[str, Any] | str) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(doc if isinstance(doc, str) else json.dumps(doc))
    os.replace(tmp, path)


async def test_file_source_emits_each_change_once(tmp_path: Path) -> None:
    path = tmp_path / "cluster.json"
    src = FileClusterSource(path, Ledger(NothingPublished(), "file"))
    out: list[Signal] = []

    async def emit(sig: Signal) -> None:
        out.append(sig)

    assert await src.poll(emit) is False  # no file yet
    nodes = [{"name": "a", "slots": 4}, {"name": "b", "slots": 4}]
    _write(path, {"cluster": "sim", "nodes": nodes})
    assert await src.poll(emit) is True
    assert await src.poll(emit) is False  # unchanged
    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 10_000_000))
    assert await src.poll(emit) is False  # touched, same content
    _write(
        path,
        {
            "cluster": "sim",
            "nodes": [nodes[0], {**nodes[1], "ready": False}],
            "preemptions": [{"id": "p1", "job": "j1", "workers": ["w3"], "deadline_s": 20}],
        },
    )
    assert await src.poll(emit) is True
    _write(path, "{not json")
    assert await src.poll(emit) is False
    assert "invalid cluster file" in src.last_error
    _write(path, {"cluster": "sim", "nodes": [{"name": "a", "slots": 4}, {"name": "a", "slots": 1}]})
    assert await src.poll(emit) is False
    assert "appear twice" in src.last_error
    _write(
        path,
        {
            "cluster": "sim",
            "nodes": nodes,
            "preemptions": [{"id": "p1", "job": "j1", "workers": ["w3"], "deadline_s": 20}],
        },
    )
    assert await src.poll(emit) is True
    assert src.last_error == ""

    kinds = [(type(s.message).__name__, s.msg_id.split(":")[1]) for s in out]
    assert kinds == [
        ("CapacityChanged", "capacity"),
        ("CapacityChanged", "capacity"),
        ("PreemptionNotice", "preempt"),
        ("CapacityChanged", "capacity"),
    ]
    caps = [s.message for s in out if isinstance(s.message, CapacityChanged)]
    assert [(c.available_slots, c.delta) for c in caps] == [(8, 8), (4, -4), (8, 4)]
    notice = out[2].message
    assert isinstance(notice, PreemptionNotice)
    assert (notice.cluster, notice.job, notice.workers, notice.deadline_s) == ("sim", "j1", ["w3"], 20.0)
    assert out[2].msg_id == "sim:preempt:p1"
    assert len({s.msg_id for s in out}) == len(out)


async def test_file_source_retries_a_revision_the_bus_did_not_take(tmp_path: Path) -> None:
    path = tmp_path / "cluster.json"
    _write(path, {"cluster": "sim", "nodes": [{"name": "a", "slots": 2}]})
    src = FileClusterSource(path, Ledger(NothingPublished(), "file"))
    out: list[Signal] = []

    async def refuse(sig: Signal) -> None:
        raise ConnectionError("nats down")

    async def emit(sig: Signal) -> None:
        out.append(sig)

    with pytest.raises(ConnectionError):
        await src.poll(refuse)
    assert await src.poll(emit) is True
    assert (
        len(out) == 1 and isinstance(out[0].message, CapacityChanged) and out[0].message.available_slots == 2
    )


# -- configuration --------------------------------------------------------------------------------
def test_kube_config_from_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def from_env(env: dict[str, str], sa_dir: Path) -> KubeConfig | None:
        with monkeypatch.context() as m:
            for k in ("KUBERNETES_SERVICE_HOST", "KUBERNETES_SERVICE_PORT"):
                m.delenv(k, raising=False)
            for k, v in env.items():
                m.setenv(k, v)
            return KubeConfig.from_env(sa_dir=sa_dir)

    sa = tmp_path / "sa"
    assert from_env({}, sa_dir=sa) is None
    assert from_env({"KUBERNETES_SERVICE_HOST": "10.0.0.1"}, sa_dir=sa) is None  # no token
    with pytest.raises(ValueError, match="PHALANX_K8S_API"):
        from_env({"PHALANX_K8S": "1"}, sa_dir=sa)
    cfg = from_env({"PHALANX_K8S": "1", "PHALANX_K8S_API": "http://127.0.0.1:8001/"}, sa_dir=sa)
    assert cfg is not None and cfg.api == "http://127.0.0.1:8001" and cfg.token_file is None
    sa.mkdir()
    (sa / "token").write_text("tok\n")
    (sa / "namespace").write_text("phalanx\n")
    cfg = from_env(
        {
            "KUBERNETES_SERVICE_HOST": "10.0.0.1",
            "KUBERNETES_SERVICE_PORT": "6443",
            "PHALANX_CLUSTER_NAME": "prod",
        },
        sa_dir=sa,
    )
    assert cfg is not None
    assert (cfg.api, cfg.namespace, cfg.cluster, cfg.token_file) == (
        "https://10.0.0.1:6443",
        "phalanx",
        "prod",
        sa / "token",
    )
    assert (cfg.health_label, cfg.all_namespaces) == ("phalanx.io/unhealthy", False)
    cfg = from_env(
        {
            "PHALANX_K8S": "1",
            "PHALANX_K8S_API": "http://127.0.0.1:8001",
            "PHALANX_K8S_HEALTH_LABEL": "example.com/gpu-broken",
            "PHALANX_K8S_ALL_NAMESPACES": "1",
        },
        sa_dir=sa,
    )
    assert cfg is not None and (cfg.health_label, cfg.all_namespaces) == ("example.com/gpu-broken", True)


async def _bearer(conf: Any) -> Any:
    """The Authorization header the client sends (a coroutine in newer client releases)."""
    value = conf.get_api_key_with_prefix("BearerToken")
    return await value if inspect.isawaitable(value) else value


async def test_client_configuration_reads_the_token_again_when_it_rotates(tmp_path: Path) -> None:
    token = tmp_path / "token"
    token.write_text("first\n")
    ca = tmp_path / "ca.crt"
    cfg = KubeConfig(api="https://10.0.0.1:6443", namespace="ns", token_file=token, ca_file=ca)
    conf = client_configuration(cfg)
    assert (conf.host, conf.ssl_ca_cert, conf.verify_ssl) == ("https://10.0.0.1:6443", str(ca), True)
    assert await _bearer(conf) == "Bearer first"
    rotated = tmp_path / "token.new"
    rotated.write_text("second\n")
    os.replace(rotated, token)  # how the kubelet swaps a projected token
    assert await _bearer(conf) == "Bearer second"
    plain = client_configuration(KubeConfig(api="http://127.0.0.1:8001", namespace="ns"))
    assert plain.api_key == {} and plain.refresh_api_key_hook is None
