"""scheduler-signal sources: the cluster file, and Kubernetes watch events mapped to signals.

The Kubernetes events are recorded API responses (``k8s/*.json*``): a node list
and watch streams of nodes and of a job's pods, as the API server sends them.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
from phalanx.services.scheduler_signal.sources import (
    FileClusterSource,
    KubeConfig,
    Ledger,
    NodeTracker,
    PodTracker,
    Signal,
    WatchExpired,
    node_slots,
    parse_quantity,
    pod_preemption,
    watch_events,
)

from phalanx.schemas import CapacityChanged, PreemptionNotice

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
def test_kube_config_from_env(tmp_path: Path) -> None:
    sa = tmp_path / "sa"
    assert KubeConfig.from_env({}, sa_dir=sa) is None
    assert KubeConfig.from_env({"KUBERNETES_SERVICE_HOST": "10.0.0.1"}, sa_dir=sa) is None  # no token
    with pytest.raises(ValueError, match="PHALANX_K8S_API"):
        KubeConfig.from_env({"PHALANX_K8S": "1"}, sa_dir=sa)
    cfg = KubeConfig.from_env({"PHALANX_K8S": "1", "PHALANX_K8S_API": "http://127.0.0.1:8001/"}, sa_dir=sa)
    assert cfg is not None and cfg.api == "http://127.0.0.1:8001" and cfg.token_file is None
    sa.mkdir()
    (sa / "token").write_text("tok\n")
    (sa / "namespace").write_text("phalanx\n")
    cfg = KubeConfig.from_env(
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
