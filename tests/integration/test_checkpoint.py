"""Tiered checkpoints against a real nats-server and a real S3 server (moto): keepers
run in this process (each as a node of its own, with its own shared-memory root, disk
and TCP port), ranks are played by :class:`Checkpointer` calls in threads.

What a killed keeper process leaves behind is in tests/e2e/test_checkpoint_e2e.py.
"""

from __future__ import annotations

import asyncio
import secrets
import shutil
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import obstore
import pytest
import torch
from nats.aio.msg import Msg

from phalanx.bus import Bus
from phalanx.checkpoint import Checkpointer, ManifestError, NoCheckpoint, RetentionPolicy, Tier
from phalanx.checkpoint.catalog import Catalog
from phalanx.checkpoint.drainplan import DrainPlan
from phalanx.checkpoint.keeper import Keeper
from phalanx.checkpoint.keeperconfig import KeeperConfig
from phalanx.checkpoint.tiers import ObjectTier, step_key
from phalanx.contract import CheckpointEvent, decode
from phalanx.devstack.s3server import S3Server
from phalanx.settings import TierPolicy

JOB = "ckj"
KEY = secrets.token_bytes(32)  # the cluster's keeper key (phalanx.checkpoint.peerauth)


def state_at(step: int, mib: int = 3) -> dict[str, Any]:
    g = torch.Generator().manual_seed(step)
    n = mib * (1 << 20) // 4
    return {
        "model": {"w": torch.randn(n // 2, generator=g), "b": torch.randn(n - n // 2, generator=g)},
        "optimizer": {"state": {0: {"step": torch.tensor(float(step))}}, "param_groups": [{"lr": 0.1}]},
        "step": step,
    }


def assert_state_equal(got: dict[str, Any], step: int) -> None:
    want = state_at(step)
    assert got["step"] == step
    assert torch.equal(got["model"]["w"], want["model"]["w"])
    assert torch.equal(got["model"]["b"], want["model"]["b"])
    assert torch.equal(got["optimizer"]["state"][0]["step"], want["optimizer"]["state"][0]["step"])


class Cluster:
    """Keepers as nodes: each with its own shm root, disk and port; one shared dir and bucket."""

    def __init__(self, bus: Bus, tmp: Path, object_url: str | None) -> None:
        self.bus, self.tmp, self.object_url = bus, tmp, object_url
        self.shm = Path("/dev/shm") / f"phalanx-test-{uuid.uuid4().hex[:8]}"
        self.keepers: dict[str, Keeper] = {}
        self.events: list[CheckpointEvent] = []

    async def on_event(self, raw: Msg) -> None:
        msg = decode(raw.data, raw.headers, CheckpointEvent)
        self.events.append(msg)

    async def keeper(self, node: str, **overrides: Any) -> Keeper:
        settings: dict[str, Any] = {
            "disk_root": self.tmp / "disk",
            "shared_root": self.tmp / "shared",
            "object_url": self.object_url,
            "fsync": False,
            "scan_s": 0.01,
            "key": KEY,
            **overrides,
        }
        cfg = KeeperConfig(node=node, shm_root=self.shm, **settings)
        k = Keeper(self.bus, cfg)
        await k.start()
        self.keepers[node] = k
        return k

    def rank(self, node: str, worker: str = "w0", slots: int = 3) -> Checkpointer:
        return Checkpointer(JOB, node=node, worker=worker, root=self.shm, slots=slots, timeout_s=60)

    async def settle(self) -> None:
        for k in list(self.keepers.values()):
            await k.scan_once()  # takes what the ranks left, as its scan loop would
            await k.idle()

    async def reboot(self, node: str) -> None:
        """The node restarts: its keeper and its shared memory are gone, its disk is not."""
        await self.keepers.pop(node).stop()
        shutil.rmtree(self.shm / node, ignore_errors=True)

    async def kill(self, node: str) -> None:
        """The node is gone: its keeper, its shared memory and its disk."""
        await self.reboot(node)
        shutil.rmtree(self.tmp / "disk" / node, ignore_errors=True)

    async def close(self) -> None:
        for k in self.keepers.values():
            await k.stop()
        shutil.rmtree(self.shm, ignore_errors=True)


@pytest.fixture
def cluster_bucket(s3_server: S3Server, monkeypatch: pytest.MonkeyPatch) -> str:
    """This module's keepers drain to object storage too (tests/integration/conftest.py's
    ``cluster`` takes it)."""
    for k, v in s3_server.env().items():
        monkeypatch.setenv(k, v)
    name = f"ck-{uuid.uuid4().hex[:10]}"
    s3_server.create_bucket(name)
    return f"s3://{name}/ckpt"


async def in_thread(fn: Callable[..., Any], *args: Any) -> Any:
    return await asyncio.to_thread(fn, *args)


def complete(c: Cluster, tier: str) -> list[int]:
    return sorted({e.step for e in c.events if e.tier == tier and e.state == "complete"})


# -- every tier ------------------------------------------------------------------------------
async def test_a_save_reaches_every_tier_and_each_tier_restores_it(cluster: Cluster, bus: Bus) -> None:
    await cluster.keeper("n1")
    rank = cluster.rank("n1")
    written = rank.save(state_at(10), 10)
    assert written is not None and written.step == 10
    await cluster.settle()
    assert complete(cluster, "memory") == [10]
    assert complete(cluster, "disk") == [10] and complete(cluster, "shared") == [10]
    assert complete(cluster, "object") == [10]

    (info,) = await in_thread(rank.list)
    assert info.step == 10 and info.kind == "snapshot"
    assert info.tiers == {"memory": ["n1"], "disk": ["n1"], "shared": ["-"], "object": ["-"]}
    loaded = await in_thread(rank.load)
    assert (loaded.step, loaded.tier) == (10, "memory")
    assert_state_equal(loaded.state, 10)

    # The node's memory is gone (a reboot): disk serves; then the disk too: shared serves.
    await cluster.reboot("n1")
    await cluster.keeper("n1")  # a fresh keeper re-lists its disk, and forgets its memory copy
    (info,) = await in_thread(rank.list)
    assert info.tiers == {"disk": ["n1"], "shared": ["-"], "object": ["-"]}
    loaded = await in_thread(rank.load)
    assert loaded.tier == "disk"
    assert_state_equal(loaded.state, 10)
    await cluster.kill("n1")
    await cluster.keeper("n1")
    loaded = await in_thread(rank.load)
    assert loaded.tier == "shared"
    assert_state_equal(loaded.state, 10)

    # Only the object store is left.
    await cluster.kill("n1")
    shutil.rmtree(cluster.tmp / "shared")
    await cluster.keeper("n1")
    obj = cluster.keepers["n1"].stores[Tier.OBJECT]
    assert isinstance(obj, ObjectTier)
    loaded = await in_thread(rank.load)
    assert loaded.tier == "object"
    assert_state_equal(loaded.state, 10)
    assert obj.bytes_read == loaded.manifest.total_bytes  # each object fetched once, whole
    assert loaded.fetched_bytes == loaded.manifest.total_bytes
    served = [e for e in cluster.events if e.state == "served"]
    assert [e.detail for e in served] == ["from memory", "from disk", "from shared", "from object"]


async def test_the_catalog_holds_every_copy_and_the_manifest(cluster: Cluster, bus: Bus) -> None:
    await cluster.keeper("n1")
    cluster.rank("n1").save(state_at(3), 3)
    await cluster.settle()
    entries = await (await Catalog.open(bus)).entries(JOB)
    e = entries[3]
    assert e.manifest is not None and e.manifest.origin == "n1"
    assert e.tiers() == {"memory": ["n1"], "disk": ["n1"], "shared": ["-"], "object": ["-"]}
    assert all(c.bytes == e.manifest.total_bytes for c in e.copies)


# -- node loss --------------------------------------------------------------------------------
async def test_a_peer_replica_serves_the_restore_when_the_saving_node_is_lost(
    bus: Bus, tmp_path: Path
) -> None:
    c = Cluster(bus, tmp_path, None)  # memory and local disk only: a lost node takes its disk
    try:
        for node in ("n1", "n2", "n3"):
            await c.keeper(node, shared_root=None, replicas=1)
        c.rank("n1").save(state_at(7), 7)
        await c.settle()
        copies = (await (await Catalog.open(bus)).entries(JOB))[7].tiers()
        assert copies["memory"] == ["n1", "n2"]  # n1's slot, and the replica on the next node of the ring
        await c.kill("n1")
        loaded = await in_thread(c.rank("n3").load)
        assert (loaded.step, loaded.tier) == (7, "peer")
        assert_state_equal(loaded.state, 7)
    finally:
        await c.close()


async def test_with_no_copy_left_load_says_so(bus: Bus, tmp_path: Path) -> None:
    c = Cluster(bus, tmp_path, None)
    try:
        await c.keeper("n1", shared_root=None, disk_root=None, replicas=0)
        rank = c.rank("n1")
        with pytest.raises(NoCheckpoint, match="no complete copy of any checkpoint"):
            await in_thread(rank.load)
        rank.save(state_at(1), 1)
        await c.settle()
        with pytest.raises(NoCheckpoint, match="no complete copy of step 99"):
            await in_thread(rank.load, 99)
    finally:
        await c.close()


# -- integrity --------------------------------------------------------------------------------
async def test_a_corrupted_disk_copy_is_detected_served_from_another_tier_and_repaired(
    cluster: Cluster,
) -> None:
    k = await cluster.keeper("n1")
    rank = cluster.rank("n1")
    rank.save(state_at(5), 5)
    await cluster.settle()
    await cluster.reboot("n1")  # memory gone; corrupt one byte of the disk copy
    k = await cluster.keeper("n1")
    data = cluster.tmp / "disk" / "n1" / JOB / step_key(5) / "state.phx"
    with open(data, "r+b") as f:
        f.seek(1000)
        byte = f.read(1)
        f.seek(1000)
        f.write(bytes([byte[0] ^ 0xFF]))
    loaded = await in_thread(rank.load)
    assert loaded.tier == "shared"
    assert_state_equal(loaded.state, 5)
    assert [e.detail for e in cluster.events if e.state == "corrupt"] == ["failed its checksums on restore"]
    await k.idle()
    disk = k.stores[Tier.DISK]
    (m,) = disk.manifests(JOB)
    assert disk.damage(m) == []  # rewritten from the good copy
    assert k.counters["repaired"] == 1


async def test_a_truncated_object_is_refused_clearly(cluster: Cluster) -> None:
    k = await cluster.keeper("n1")
    cluster.rank("n1").save(state_at(2), 2)
    await cluster.settle()
    obj = k.stores[Tier.OBJECT]
    assert isinstance(obj, ObjectTier)
    (m,) = obj.manifests(JOB)
    key = f"{JOB}/{step_key(2)}/state.phx"
    obstore.put(obj.store, key, bytes(obj.read(m, "state.phx"))[:1000])
    with pytest.raises(ManifestError, match=r"1000 bytes, the manifest says .* \(truncated object\)"):
        obj.read(m, "state.phx")
    assert obj.damage(m) == ["state.phx"]


async def test_a_bad_manifest_in_a_tier_is_never_listed(cluster: Cluster) -> None:
    k = await cluster.keeper("n1")
    cluster.rank("n1").save(state_at(4), 4)
    await cluster.settle()
    disk = k.stores[Tier.DISK]
    (cluster.tmp / "disk" / "n1" / JOB / step_key(4) / "MANIFEST.json").write_text(
        '{"version": 1, "job": "ckj"'
    )
    assert disk.manifests(JOB) == []
    obj = k.stores[Tier.OBJECT]
    assert isinstance(obj, ObjectTier)
    obstore.put(obj.store, f"{JOB}/{step_key(4)}/MANIFEST.json", b'{"version": 2}')
    assert obj.manifests(JOB) == []


# -- retention --------------------------------------------------------------------------------
async def test_retention_keeps_exactly_what_each_tier_policy_says(cluster: Cluster) -> None:
    k = await cluster.keeper(
        "n1",
        replicas=0,
        retention={
            Tier.MEMORY: RetentionPolicy(2),
            Tier.DISK: RetentionPolicy(3),
            Tier.SHARED: RetentionPolicy(1, 40),
            Tier.OBJECT: RetentionPolicy(2, 30),
        },
    )
    rank = cluster.rank("n1")
    for step in range(10, 80, 10):  # 10..70
        assert rank.save(state_at(step), step) is not None
        await cluster.settle()
    assert sorted(s for (_j, s) in k.memory) == [60, 70]
    assert sorted(m.step for m in k.stores[Tier.DISK].manifests(JOB)) == [50, 60, 70]
    assert sorted(m.step for m in k.stores[Tier.SHARED].manifests(JOB)) == [40, 70]
    assert sorted(m.step for m in k.stores[Tier.OBJECT].manifests(JOB)) == [30, 60, 70]
    deleted = {(e.tier, e.step) for e in cluster.events if e.state == "deleted"}
    assert {s for t, s in deleted if t == "disk"} == {10, 20, 30, 40}
    infos = await in_thread(rank.list)
    assert [i.step for i in infos] == [70, 60, 50, 40, 30]


async def test_a_save_is_skipped_not_blocked_when_the_keeper_holds_every_slot(
    bus: Bus, tmp_path: Path
) -> None:
    c = Cluster(bus, tmp_path, None)
    try:
        rank = c.rank("n1", slots=2)  # no keeper yet: nobody frees the slots
        assert rank.save(state_at(1), 1) is not None
        assert rank.save(state_at(2), 2) is not None
        assert rank.save(state_at(3), 3) is None
        assert rank.skipped == 1
        await c.keeper("n1", shared_root=None, replicas=0, retention={Tier.MEMORY: RetentionPolicy(1)})
        await c.settle()
        assert rank.save(state_at(4), 4) is not None  # the keeper freed the older slot
    finally:
        await c.close()


def test_bad_steps_are_refused(tmp_path: Path) -> None:
    rank = Checkpointer(JOB, node="n1", worker="w0", root=tmp_path)
    for bad in (-1, 1.5, "3"):
        with pytest.raises(ValueError, match="step must be an int >= 0"):
            rank.save({"w": torch.zeros(1)}, bad)  # type: ignore[arg-type]


def test_without_a_keeper_list_says_what_to_start(tmp_path: Path) -> None:
    rank = Checkpointer(JOB, node="n9", root=tmp_path)
    with pytest.raises(ConnectionError, match="is state-replication running on this node"):
        rank.list()


# -- torch.distributed.checkpoint -------------------------------------------------------------
async def test_dcp_async_save_and_load_go_through_the_tiers(cluster: Cluster) -> None:
    import torch.distributed.checkpoint as dcp

    from phalanx.checkpoint.dcp import TieredReader, TieredWriter

    await cluster.keeper("n1", replicas=0)
    rank = cluster.rank("n1")
    state = state_at(8)["model"]

    def save() -> None:
        fut = dcp.async_save(state, storage_writer=TieredWriter(JOB, 8, checkpointer=rank), no_dist=True)
        fut.result()

    await in_thread(save)
    await cluster.settle()
    assert complete(cluster, "object") == [8]
    (info,) = await in_thread(rank.list)
    assert (info.step, info.kind) == (8, "dcp")

    await cluster.kill("n1")  # memory and disk gone
    shutil.rmtree(cluster.tmp / "shared")  # and the shared tier: only the object store has it
    await cluster.keeper("n1", replicas=0)

    def load() -> tuple[dict[str, torch.Tensor], str]:
        into = {k: torch.zeros_like(v) for k, v in state.items()}
        reader = TieredReader(JOB, checkpointer=rank)
        dcp.load(into, storage_reader=reader, no_dist=True)
        return into, reader.loaded.tier

    got, tier = await in_thread(load)
    assert tier == "object"
    assert all(torch.equal(got[k], state[k]) for k in state)


async def test_a_snapshot_is_not_read_as_a_dcp_checkpoint(cluster: Cluster) -> None:
    from phalanx.checkpoint.dcp import TieredReader

    await cluster.keeper("n1", replicas=0)
    rank = cluster.rank("n1")
    rank.save(state_at(1), 1)
    await cluster.settle()
    with pytest.raises(ValueError, match="is a Phalanx snapshot, not a DCP checkpoint"):
        await in_thread(lambda: TieredReader(JOB, checkpointer=rank))


async def test_the_drain_lanes_run_side_by_side_each_tier_paced_to_its_cap(cluster: Cluster) -> None:
    """The object copy streams beside disk-then-shared; the disk's cap (1 MB/s for a
    checkpoint of ~2 MB) paces its writes (the event says how long), and the object
    copy, in the other lane, does not wait for it."""
    plan = DrainPlan.parse("object | disk, shared", "disk=1M")
    await cluster.keeper("n1", drain=plan, replicas=0)
    rank = cluster.rank("n1")
    assert await in_thread(rank.save, state_at(1, mib=2), 1) is not None
    await cluster.settle()
    done = {e.tier: e for e in cluster.events if e.state == "complete" and e.step == 1}
    assert set(done) >= {"memory", "disk", "shared", "object"}
    assert done["disk"].detail.startswith("paced ")
    assert float(done["disk"].detail.split()[1]) > 0.5
    assert not done["object"].detail  # no cap on its lane
    order = [e.tier for e in cluster.events if e.state == "complete" and e.step == 1]
    assert order.index("object") < order.index("disk") < order.index("shared")


async def test_a_real_keeper_drains_each_step_only_to_the_tiers_its_policy_names(cluster: Cluster) -> None:
    """memory every step, disk every 2nd, shared every 4th, object every 4th keeping 1:
    after steps 1..8 each tier holds what the policy says, and the memory copies of
    the steps no durable tier takes are released by memory's retention alone."""
    policy = TierPolicy.parse("memory:last=2; disk:every=2,last=2; shared:every=4; object:every=4,last=1")
    await cluster.keeper("n1", tier_policy=policy, replicas=0)
    rank = cluster.rank("n1")
    for step in range(1, 9):
        assert await in_thread(rank.save, state_at(step, mib=1), step) is not None
        await cluster.settle()
    assert complete(cluster, "disk") == [2, 4, 6, 8]
    assert complete(cluster, "shared") == [4, 8]
    assert complete(cluster, "object") == [4, 8]
    keeper = cluster.keepers["n1"]
    held = {
        tier: sorted(m.step for m in await in_thread(store.manifests, JOB))
        for tier, store in keeper.stores.items()
    }
    assert held == {Tier.DISK: [6, 8], Tier.SHARED: [4, 8], Tier.OBJECT: [8]}
    assert sorted(s for j, s in keeper.memory if j == JOB) == [7, 8]
