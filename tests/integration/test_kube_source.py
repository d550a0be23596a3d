"""The scheduler-signal service's Kubernetes watcher, end to end without a cluster.

The real :class:`KubeWatchSource` (``kubernetes_asyncio``) lists and watches a fake
API server on loopback (``tests/k8s_api.py``) that replays recorded objects and
events (``tests/unit/k8s/``); the real service publishes what it sees on a real
nats-server, where the test reads it back from stream ``PHALANX_SCHED``.

The recorded cluster: nodes gpu-a and gpu-b (8 GPUs each) and cpu-c; job j1's
pods train-j1-w0..w3 (4 GPUs each, priority 100, grace 45 s), w0 and w1 on gpu-a,
w2 and w3 on gpu-b. Its capacity is 16.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from nats.aio.msg import Msg
from phalanx.services.scheduler_signal.kube import KubeConfig, KubeWatchSource
from phalanx.services.scheduler_signal.service import SchedulerSignal, StreamHistory
from phalanx.services.scheduler_signal.sources import Ledger

from k8s_api import FakeKubeApi, load_events, load_list
from phalanx.bus import Bus
from phalanx.contract import CapacityChanged, Message, PreemptionNotice
from phalanx.contract.streams import SCHED
from phalanx.contract.subjects import CAPACITY, PREEMPT

DATA = Path(__file__).parent.parent / "unit" / "k8s"
CLUSTER = "prod"
NS = "phalanx"
WAIT_S = 10.0
JOB_SELECTOR = "phalanx.io/job"


def events(name: str) -> list[dict[str, Any]]:
    return load_events(DATA / name)


@pytest.fixture
def api() -> Iterator[FakeKubeApi]:
    nodes, _ = load_list(DATA / "nodes_list.json")
    pods, rv = load_list(DATA / "pods_list.json")
    with FakeKubeApi(nodes, pods, resource_version=rv, namespace=NS) as server:
        yield server


class Published:
    """What the service stored for cluster ``prod``, in stream order, as it arrives."""

    def __init__(self) -> None:
        self.got: list[CapacityChanged | PreemptionNotice] = []
        self._changed = asyncio.Condition()

    async def __call__(self, msg: Message, raw: Msg) -> None:
        assert isinstance(msg, CapacityChanged | PreemptionNotice)
        async with self._changed:
            self.got.append(msg)
            self._changed.notify_all()

    def capacities(self) -> list[int]:
        return [m.available_slots for m in self.got if isinstance(m, CapacityChanged)]

    def notices(self) -> list[PreemptionNotice]:
        return [m for m in self.got if isinstance(m, PreemptionNotice)]

    def workers(self) -> list[list[str]]:
        return [n.workers for n in self.notices()]

    async def wait(self, ready: Callable[[], bool], what: str) -> None:
        async with self._changed:
            try:
                await asyncio.wait_for(self._changed.wait_for(ready), WAIT_S)
            except TimeoutError:
                pytest.fail(f"never published: {what}; got {self.got}")


@pytest.fixture
async def published(bus: Bus) -> Published:
    p = Published()
    bus.consume(
        SCHED,
        "t-k8s",
        [CAPACITY.wildcard(cluster=CLUSTER), PREEMPT.wildcard(cluster=CLUSTER)],
        p,
        (CapacityChanged, PreemptionNotice),
        pull_expires_s=0.2,
    )
    return p


@contextlib.asynccontextmanager
async def service(bus: Bus, api: FakeKubeApi, **options: Any) -> AsyncIterator[KubeWatchSource]:
    """The scheduler-signal service with a Kubernetes source on ``api``, until the block ends."""
    cfg = KubeConfig(api=api.url, namespace=NS, cluster=CLUSTER, **options)
    src = KubeWatchSource(cfg, Ledger(StreamHistory(bus), "k8s"))
    svc = SchedulerSignal(bus, sources=[src])
    await svc.start()
    try:
        yield src
    finally:
        await svc.stop()


async def watching(api: FakeKubeApi, nodes: int = 1, pods: int = 2) -> None:
    """Until the source watches nodes, job pods and pending pods: its lists are handled."""
    await asyncio.to_thread(api.wait_watching, "nodes", nodes)
    await asyncio.to_thread(api.wait_watching, "pods", pods)


def job_pod_lists(api: FakeKubeApi) -> int:
    return sum(1 for r in api.requests if not r.watch and r.query.get("labelSelector") == JOB_SELECTOR)


# -- pods ---------------------------------------------------------------------------------------
async def test_a_disrupted_job_pod_gives_one_notice(bus: Bus, api: FakeKubeApi, published: Published) -> None:
    async with service(bus, api) as src:
        await published.wait(lambda: published.capacities() == [16], "the initial capacity")
        watch = events("pods_watch.jsonl")
        api.push("pods", watch[2])  # w1: DisruptionTarget (PreemptionByScheduler)
        api.push("pods", watch[3])  # w1: its deletion follows
        api.push("pods", watch[4])  # w2: deleted (the last event: all before it are handled)
        await published.wait(lambda: ["w2"] in published.workers(), "w2's notice")
    assert published.workers() == [["w1"], ["w2"]]
    w1 = published.notices()[0]
    assert (w1.cluster, w1.job, w1.nodes, w1.deadline_s, w1.source) == (CLUSTER, "j1", [], 45.0, "k8s")
    assert w1.reason == "pod phalanx/train-j1-w1 on gpu-a: PreemptionByScheduler"
    assert published.notices()[1].deadline_s == 10.0  # w2's deletionGracePeriodSeconds
    assert src.lists == 3 and src.last_error == ""


async def test_the_fake_api_disrupts_a_worker_for_a_service_configured_from_env(
    bus: Bus, api: FakeKubeApi, published: Published, monkeypatch: pytest.MonkeyPatch
) -> None:
    """How an end-to-end test drives the service: PHALANX_K8S=1 and the fake API's URL."""
    for k, v in {
        "PHALANX_K8S": "1",
        "PHALANX_K8S_API": api.url,
        "PHALANX_K8S_NAMESPACE": NS,
        "PHALANX_CLUSTER_NAME": CLUSTER,
        "PHALANX_LOCAL_CLUSTER": "0",
    }.items():
        monkeypatch.setenv(k, v)
    monkeypatch.delenv("PHALANX_CLUSTER_FILE", raising=False)
    svc = SchedulerSignal(bus)
    assert [s.name for s in svc.sources] == ["k8s"]
    await svc.start()
    try:
        await watching(api)
        api.disrupt("w3", reason="EvictionByEvictionAPI")
        await published.wait(lambda: bool(published.notices()), "w3's notice")
    finally:
        await svc.stop()
    (notice,) = published.notices()
    assert (notice.job, notice.workers, notice.nodes) == ("j1", ["w3"], [])  # its pod's workers only
    assert notice.reason == "pod phalanx/train-j1-w3 on gpu-b: EvictionByEvictionAPI"


# -- nodes -------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("line", "node", "workers", "why"),
    [
        (0, "gpu-a", ["w0", "w1"], "not ready (NodeStatusUnknown)"),
        (1, "gpu-b", ["w2", "w3"], "cordoned"),
        (2, "gpu-a", ["w0", "w1"], "marked unhealthy (phalanx.io/unhealthy=true)"),
    ],
    ids=["not-ready", "cordoned", "unhealthy"],
)
async def test_a_job_node_in_trouble_drops_capacity_and_reclaims_its_workers(
    bus: Bus, api: FakeKubeApi, published: Published, line: int, node: str, workers: list[str], why: str
) -> None:
    healthy = api.get("nodes", node)
    async with service(bus, api):
        await published.wait(lambda: published.capacities() == [16], "the initial capacity")
        api.push("nodes", events("nodes_trouble.jsonl")[line])
        await published.wait(lambda: bool(published.notices()), f"the notice for {node}")
        api.push("nodes", {"type": "MODIFIED", "object": healthy})  # back: the last event
        await published.wait(lambda: published.capacities() == [16, 8, 16], "the capacity back")
    (notice,) = published.notices()
    assert (notice.job, notice.workers, notice.nodes, notice.deadline_s) == ("j1", workers, [node], 45.0)
    assert notice.reason == f"node {node} {why}"
    assert published.got[2] is notice  # the capacity drop, then the notice
    assert published.got[0].offered == {}  # type: ignore[union-attr]  # for the local cluster only


# -- pending pods --------------------------------------------------------------------------------
@pytest.mark.parametrize("all_namespaces", [False, True], ids=["namespace", "all-namespaces"])
async def test_a_pending_pod_of_higher_priority_reclaims_job_pods(
    bus: Bus, api: FakeKubeApi, published: Published, all_namespaces: bool
) -> None:
    serving, batch, etl, other_ns = events("pods_pending.jsonl")
    async with service(bus, api, all_namespaces=all_namespaces):
        await watching(api)
        api.push("pods", batch)  # priority 10: below the job's
        api.push("pods", etl)  # asks for no GPU
        api.push("pods", other_ns)  # infer/serving-e2, 4 GPUs: seen with all namespaces only
        api.push("pods", serving)  # phalanx/serving-7d9c, 8 GPUs: the last event
        await published.wait(lambda: any("serving-7d9c" in n.reason for n in published.notices()), "serving")
    pending = [q for q in api.requests if q.query.get("fieldSelector") == "status.phase=Pending"]
    assert {q.path for q in pending} == {
        "/api/v1/pods" if all_namespaces else f"/api/v1/namespaces/{NS}/pods"
    }
    last = published.notices()[-1]
    assert (last.job, last.workers, last.nodes, last.deadline_s) == ("j1", ["w2", "w3"], [], 45.0)
    assert last.reason == "pending pod phalanx/serving-7d9c (priority 1000) needs 8 nvidia.com/gpu"
    if all_namespaces:
        first, _ = published.notices()
        assert (first.workers, first.nodes) == (["w3"], [])
        assert first.reason == "pending pod infer/serving-e2 (priority 1000) needs 4 nvidia.com/gpu"
    else:
        assert len(published.notices()) == 1


# -- the watch itself -------------------------------------------------------------------------------
@pytest.mark.parametrize("http", [False, True], ids=["error-event", "http-410"])
async def test_410_gone_lists_again_and_misses_nothing(
    bus: Bus, api: FakeKubeApi, published: Published, http: bool
) -> None:
    async with service(bus, api) as src:
        await watching(api)
        assert job_pod_lists(api) == 1
        # w1 is disrupted while the watch is gone: only a new list can see it
        api.expire("pods", http=http, changes=[events("pods_watch.jsonl")[2]])
        await published.wait(lambda: ["w1"] in published.workers(), "w1's notice")
        await watching(api)
        api.push("pods", events("pods_watch.jsonl")[4])  # and the new watch works
        await published.wait(lambda: ["w2"] in published.workers(), "w2's notice")
        assert src.last_error == ""  # an expiry, not a failure: no back-off
    assert job_pod_lists(api) == 2
    assert api.gone_http["pods"] == (2 if http else 0)  # the job's and the pending pods' watches
    assert published.workers() == [["w1"], ["w2"]]


async def test_a_watch_the_server_ends_resumes_without_a_list(
    bus: Bus, api: FakeKubeApi, published: Published, tmp_path: Path
) -> None:
    token = tmp_path / "token"
    token.write_text("first\n")
    api.token = "first"
    async with service(bus, api, token_file=token) as src:
        await watching(api)
        rotated = tmp_path / "token.new"
        rotated.write_text("second\n")
        os.replace(rotated, token)  # the kubelet rotates the projected token
        api.token = "second"
        api.end_watches()  # as at timeoutSeconds
        api.push("pods", events("pods_watch.jsonl")[2])
        await published.wait(lambda: ["w1"] in published.workers(), "w1's notice")
        assert src.last_error == ""
    assert job_pod_lists(api) == 1 and api.lists["nodes"] == 1
    assert api.watches["pods"] >= 4  # two, then two again with the new token


async def test_errors_back_off_then_recover(bus: Bus, api: FakeKubeApi, published: Published) -> None:
    api.fail("nodes", 500, times=2)
    async with service(bus, api) as src:
        src.BACKOFF_MIN_S = 0.05  # the real one is 1 s
        await published.wait(lambda: published.capacities() == [16], "the capacity")
        assert src.last_error == "nodes: HTTP 500 Internal Server Error"
    assert (
        api.lists["nodes"] == 1 and len([r for r in api.requests if r.kind == "nodes" and not r.watch]) == 3
    )


async def test_a_restart_does_not_announce_again(bus: Bus, api: FakeKubeApi, published: Published) -> None:
    watch = events("pods_watch.jsonl")
    async with service(bus, api):
        await watching(api)
        api.push("pods", watch[2])  # w1 disrupted
        api.push("nodes", events("nodes_trouble.jsonl")[1])  # gpu-b cordoned
        await published.wait(lambda: len(published.notices()) == 2, "w1's and gpu-b's notices")
    api.push("pods", watch[3])  # w1's deletion begins while the service is down
    async with service(bus, api) as again:
        await watching(api)
        api.push("pods", watch[4])  # w2 deleted: news, and the last event
        await published.wait(lambda: len(published.notices()) == 3, "w2's notice")
        assert again.lists == 3
    assert sorted(published.workers()) == [["w1"], ["w2"], ["w2", "w3"]]
    assert published.capacities() == [16, 8]  # the restart found 8 already published
    assert published.notices()[-1].reason == "pod phalanx/train-j1-w2 on gpu-b: Deleted"
    info = await bus.js.stream_info(SCHED.name)
    assert info.state.messages == 5


async def test_an_object_without_metadata_is_logged_and_skipped(
    bus: Bus, api: FakeKubeApi, published: Published
) -> None:
    bad_pod, bad_node = events("bad_objects.jsonl")
    async with service(bus, api) as src:
        await watching(api)
        api.push("pods", bad_pod)
        api.push("nodes", bad_node)
        api.push("pods", events("pods_watch.jsonl")[2])
        await published.wait(lambda: ["w1"] in published.workers(), "w1's notice")
        await asyncio.to_thread(api.wait_watching, "nodes")
        api.push("nodes", events("nodes_trouble.jsonl")[1])  # after the bad node: still watched
        await published.wait(lambda: 8 in published.capacities(), "the cordon")
        # the bad pod reaches both pod watches (the job's, the pending pods'), as its
        # phase says Running; the fake streams an object it cannot select to every watch
        assert src.bad_objects == 3 and src.last_error == ""
    assert api.lists == {"nodes": 1, "pods": 2}  # skipped, not a reason to list again
