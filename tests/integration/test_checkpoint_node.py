"""The keeper against jobs that share its node, and against faults of its tiers and its catalog.

Real keepers, a real nats-server and a real S3 server (moto), as in test_checkpoint.py:
a slot file planted in another job's directory, a ``register`` of another job's
directory (and from another uid), planted symlinks, malformed slot files; a replica
that must be released, a full disk, a KV outage during a take, an object store that
cannot be listed, a disk copy that rotted before a drain, two loads of one step.
Several need root (another uid, a tmpfs mount): they are skipped without it.
"""

from __future__ import annotations

import asyncio
import inspect
import os
import shutil
import struct
import subprocess
import uuid
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path

import pytest
import torch
from nats.aio.msg import Msg
from structlog.testing import capture_logs

from phalanx.bus import Bus
from phalanx.checkpoint import Checkpointer, RetentionPolicy, Tier, wire
from phalanx.checkpoint.catalog import Catalog
from phalanx.checkpoint.tiers import RetryPolicy, step_key
from phalanx.contract import ErrorEvent, decode
from phalanx.contract.subjects import CHECKPOINT
from phalanx.devstack.natsserver import NatsServer
from phalanx.devstack.s3server import S3Server
from tests.integration.test_checkpoint import JOB, Cluster, assert_state_equal, in_thread, state_at
from tests.procs import as_uid, unix_call

FAST = RetryPolicy(first_s=0.2, factor=2.0, max_s=1.0)
OTHER_UID = 4242  # another job's uid
WAIT_S = 60.0
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (another uid, a tmpfs mount)")


async def wait_for(cond: Callable[[], bool | Awaitable[bool]], what: str, timeout: float = WAIT_S) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not await _value(cond()):
        if asyncio.get_running_loop().time() > deadline:
            pytest.fail(f"timed out after {timeout:g} s waiting for {what}")
        await asyncio.sleep(0.05)


async def _value(got: bool | Awaitable[bool]) -> bool:
    return await got if inspect.isawaitable(got) else got


def states(c: Cluster, tier: str, state: str, step: int) -> list[str]:
    return [e.detail for e in c.events if (e.tier, e.state, e.step) == (tier, state, step)]


class Errors:
    """The ErrorEvents services publish (phalanx.err.>)."""

    def __init__(self) -> None:
        self.got: list[ErrorEvent] = []

    async def on_msg(self, raw: Msg) -> None:
        self.got.append(decode(raw.data, raw.headers, ErrorEvent))

    def about(self, text: str) -> list[ErrorEvent]:
        return [e for e in self.got if text in e.reason]


@pytest.fixture
async def errors(bus: Bus) -> Errors:
    e = Errors()
    await bus.nc.subscribe("phalanx.err.>", cb=e.on_msg)
    return e


def slot_path(c: Cluster, node: str, job: str, name: str) -> Path:
    return c.shm / node / "slots" / job / name


def call_as(uid: int, sock: str, send: bytes | dict[str, object]) -> bytes:
    """``send`` (a request, or raw bytes) to the keeper's Unix socket from a process
    running as ``uid`` (a fork that drops to it and uses nothing but a socket); the raw reply."""
    frame = send if isinstance(send, bytes) else wire.encode_frame(send)
    return bytes(as_uid(uid, lambda: unix_call(sock, frame)))


# -- per-job isolation -------------------------------------------------------------------------
@needs_root
async def test_a_slot_planted_in_another_jobs_directory_is_never_taken(
    cluster: Cluster, errors: Errors
) -> None:
    k = await cluster.keeper("n1", shared_root=None, object_url=None, replicas=0)
    victim = cluster.rank("n1")
    assert victim.save(state_at(5), 5) is not None
    await cluster.settle()
    # Another job writes a snapshot claiming step 10**9 (on a node this keeper does not
    # scan), then puts it in the victim's slot directory: a copy owned by its own uid,
    # and a hard link (what one uid for everything allows).
    evil = Checkpointer("evil", node="elsewhere", worker="w9", root=cluster.shm, slots=1)
    written = evil.save(state_at(6), 10**9)
    assert written is not None
    copy, link = slot_path(cluster, "n1", JOB, "x1.0.slot"), slot_path(cluster, "n1", JOB, "x2.0.slot")
    shutil.copyfile(written.path, copy)
    os.chown(copy, OTHER_UID, OTHER_UID)
    os.link(written.path, link)
    with capture_logs() as logs:
        await cluster.settle()
        await cluster.settle()  # reported once, not on every scan
    # Nothing changed: the job's checkpoints are its own; the planted files are left for inspection.
    assert [i.step for i in await in_thread(victim.list)] == [5]
    loaded = await in_thread(victim.load)
    assert loaded.step == 5
    assert_state_equal(loaded.state, 5)
    assert copy.exists() and link.exists()
    # Refused, logged and reported (an ErrorEvent each), once.
    refused = [x for x in logs if x["event"] == "slot_refused"]
    assert sorted(x["path"] for x in refused) == [str(copy), str(link)]
    assert "owned by uid 4242" in refused[0]["reason"] and "2 links" in refused[1]["reason"]
    await wait_for(lambda: len(errors.about(str(copy))) == 1 and len(errors.about(str(link))) == 1, "errors")
    assert k.counters["refused"] == 2
    evil.close()


@needs_root
async def test_register_is_confined_to_the_callers_own_job(cluster: Cluster) -> None:
    k = await cluster.keeper(
        "n1", shared_root=None, object_url=None, replicas=0, retention={Tier.MEMORY: RetentionPolicy(1)}
    )
    victim = cluster.rank("n1")
    assert victim.save(state_at(5), 5) is not None
    await cluster.settle()
    node = cluster.shm / "n1"
    victim_slots = node / "slots" / JOB
    before = sorted(os.listdir(victim_slots))
    # The victim's own DCP directory of step 9 (a real one: files in it).
    own_dcp = node / "dcp" / JOB / step_key(9)
    own_dcp.mkdir(parents=True)
    (own_dcp / "data.distcp").write_bytes(b"w" * 4096)
    sock = str(node / "keeper.sock")
    (node / "dcp" / "evil").mkdir()
    os.symlink(own_dcp, node / "dcp" / "evil" / step_key(9))  # evil's "own" step 9: a link to the victim's
    attempts = [
        ("evil", 1, victim_slots),  # another job's slot directory under evil's name
        ("evil", 9, own_dcp),  # another job's DCP directory
        ("evil", 9, node / "dcp" / "evil" / step_key(9)),  # its own name, a link to the victim's
        ("evil", 9, node / "dcp" / "evil" / ".." / JOB / step_key(9)),
    ]
    with capture_logs() as logs:
        for job, step, d in attempts:
            with pytest.raises(wire.WireError):
                await in_thread(
                    wire.call, sock, {"op": "register", "job": job, "step": step, "dir": str(d)}, 30.0
                )
        # The victim's job name, from a process of another uid (SO_PEERCRED): refused too,
        # and so is any other request for that job from it.
        reply = await in_thread(
            call_as, OTHER_UID, sock, {"op": "register", "job": JOB, "step": 9, "dir": str(own_dcp)}
        )
        listed = await in_thread(call_as, OTHER_UID, sock, {"op": "list", "job": JOB})
    assert b"runs as uid 4242" in reply and b"runs as uid 4242" in listed
    assert len([x for x in logs if x["event"] == "register_refused"]) == len(attempts)
    assert len([x for x in logs if x["event"] == "caller_refused"]) == 2
    # Nothing changed: no checkpoint of evil, none of step 9, every victim file in place.
    await k.idle()
    assert await in_thread(Checkpointer("evil", node="n1", root=cluster.shm).list) == []
    assert [i.step for i in await in_thread(victim.list)] == [5]
    assert sorted(os.listdir(victim_slots)) == before and (own_dcp / "data.distcp").exists()
    # The job itself registers its own directory.
    reply_ok = await in_thread(
        wire.call, sock, {"op": "register", "job": JOB, "step": 9, "dir": str(own_dcp)}, 30.0
    )
    assert reply_ok["ok"] is True
    assert [i.step for i in await in_thread(victim.list)] == [9, 5]


async def test_planted_symlinks_redirect_no_write_and_no_delete(cluster: Cluster, tmp_path: Path) -> None:
    for node in ("n1", "n2"):
        await cluster.keeper(node, shared_root=None, object_url=None, replicas=1)
    # A "disk copy" somewhere else that a link planted as n2's replicas/<job> points to.
    target = tmp_path / "victim-copy"
    (target / step_key(1)).mkdir(parents=True)
    (target / step_key(1) / "keep.txt").write_text("mine")
    (cluster.shm / "n2" / "replicas").mkdir(exist_ok=True)
    os.symlink(target, cluster.shm / "n2" / "replicas" / JOB)
    rank = cluster.rank("n1")
    with capture_logs() as logs:
        assert rank.save(state_at(1), 1) is not None
        await cluster.settle()
    assert sorted(os.listdir(target)) == [step_key(1)]  # nothing written there, nothing removed
    assert (target / step_key(1) / "keep.txt").read_text() == "mine"
    assert any(x["event"] == "replicate_failed" for x in logs)

    # A restored copy's job directory swapped for a link: its release deletes nothing there.
    await cluster.reboot("n1")
    await cluster.keeper("n1", shared_root=None, object_url=None, replicas=0)
    rank = cluster.rank("n1")  # the node's processes are new too
    loaded = await in_thread(rank.load)
    assert loaded.tier == "disk"
    restored = cluster.shm / "n1" / "restored" / JOB
    os.rename(restored, restored.with_name("moved"))
    os.symlink(target, restored)
    with capture_logs() as logs:
        for step in (2, 3):  # memory keeps 2: step 1's restored copy is released
            assert rank.save(state_at(step), step) is not None
            await cluster.settle()
    assert (target / step_key(1) / "keep.txt").read_text() == "mine"
    assert [x for x in logs if x["event"] == "release_refused"]
    assert [i.step for i in await in_thread(rank.list)][:3] == [3, 2, 1]


async def test_a_malformed_slot_is_skipped_at_start_and_while_running(
    cluster: Cluster, errors: Errors
) -> None:
    rank = cluster.rank("n1")
    written = rank.save(state_at(1), 1)
    assert written is not None
    bad_state = slot_path(cluster, "n1", JOB, "a-state.0.slot")  # sorts before the rank's own
    shutil.copyfile(written.path, bad_state)
    with open(bad_state, "r+b") as f:
        f.seek(8)
        f.write(struct.pack("<I", 7))  # no such state
    with capture_logs() as logs:
        k = await cluster.keeper("n1", shared_root=None, object_url=None, replicas=0)  # starts
        await cluster.settle()
    assert [i.step for i in await in_thread(rank.list)] == [1]
    assert [x["path"] for x in logs if x["event"] == "slot_refused"] == [str(bad_state)]

    # While it runs: a short file and a slot whose data lies past its end.
    short = slot_path(cluster, "n1", JOB, "a-short.0.slot")
    short.write_bytes(b"PHXSLOT1" + b"\0" * 40)
    bad_layout = slot_path(cluster, "n1", JOB, "a-layout.0.slot")
    shutil.copyfile(written.path, bad_layout)
    with open(bad_layout, "r+b") as f:
        f.seek(8)
        f.write(struct.pack("<I", 2))  # READY
        f.seek(32)
        f.write(struct.pack("<Q", 1 << 40))  # data offset
    assert rank.save(state_at(2), 2) is not None
    await wait_for(
        lambda: ("memory", "complete", 2) in {(e.tier, e.state, e.step) for e in cluster.events}, "step 2"
    )
    await cluster.settle()
    for path in (bad_state, short, bad_layout):
        assert path.exists()
    reported = [str(p) for p in (bad_state, short, bad_layout)]
    await wait_for(lambda: all(len(errors.about(p)) == 1 for p in reported), "one error event each")
    assert k.counters["refused"] == 3
    loaded = await in_thread(rank.load)
    assert loaded.step == 2
    assert_state_equal(loaded.state, 2)


# -- durability ---------------------------------------------------------------------------------
def shm_bytes(root: Path) -> int:
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file() and not p.is_symlink())


async def test_a_received_replica_is_released_once_the_catalog_has_a_durable_copy(cluster: Cluster) -> None:
    for node in ("n1", "n2"):  # the shipped setup: memory and local disk, one replica
        await cluster.keeper(node, shared_root=None, object_url=None, replicas=1)
    rank = cluster.rank("n1")
    one = 0
    for step in range(1, 9):
        assert rank.save(state_at(step), step) is not None
        await cluster.settle()
        one = one or shm_bytes(cluster.shm / "n2" / "replicas")
    replicas = sorted(os.listdir(cluster.shm / "n2" / "replicas" / JOB))
    assert replicas == [step_key(7), step_key(8)]  # what memory retention keeps, not all 8
    assert shm_bytes(cluster.shm / "n2") <= 2 * one + 4096  # (two manifests may differ by a digit)

    def released() -> set[int]:
        return {e.step for e in cluster.events if (e.tier, e.state, e.node) == ("memory", "deleted", "n2")}

    await wait_for(lambda: released() == set(range(1, 7)), "an event for each replica released")


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A 1 MiB tmpfs for the disk tier: a checkpoint of 3 MiB does not fit."""
    where = tmp_path / "disk"
    where.mkdir()
    if (
        os.geteuid() != 0
        or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(where)]).returncode
    ):
        pytest.skip("needs root and mount (a small tmpfs)")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=True)


async def test_a_full_disk_does_not_stop_the_later_tiers_and_is_retried(
    bus: Bus, tmp_path: Path, small_disk: Path, s3_server: S3Server, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name, value in s3_server.env().items():
        monkeypatch.setenv(name, value)
    bucket = f"ck-{uuid.uuid4().hex[:10]}"
    s3_server.create_bucket(bucket)
    c = Cluster(bus, tmp_path, f"s3://{bucket}/ckpt")
    await bus.nc.subscribe(CHECKPOINT.format(job=JOB), cb=c.on_event)
    try:
        await c.keeper("n1", replicas=0, retry=FAST)
        rank = c.rank("n1")
        assert rank.save(state_at(1), 1) is not None
        await c.settle()
        await wait_for(
            lambda: bool(states(c, "shared", "complete", 1) and states(c, "object", "complete", 1)),
            "the shared and object tiers, after the disk failed",
        )
        assert "No space left on device" in states(c, "disk", "failed", 1)[0]
        subprocess.run(["mount", "-o", "remount,size=64m", str(small_disk)], check=True)  # room again
        await wait_for(lambda: bool(states(c, "disk", "complete", 1)), "the disk tier retried")
        (info,) = await in_thread(rank.list)
        assert info.tiers == {"memory": ["n1"], "disk": ["n1"], "shared": ["-"], "object": ["-"]}
    finally:
        await c.close()


async def test_an_object_store_that_cannot_be_listed_does_not_abort_propagation(
    bus: Bus, tmp_path: Path, s3_server: S3Server, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name, value in s3_server.env().items():
        monkeypatch.setenv(name, value)
    bucket = f"ck-{uuid.uuid4().hex[:10]}"  # not created yet: listing and writes fail
    c = Cluster(bus, tmp_path, f"s3://{bucket}/ckpt")
    await bus.nc.subscribe(CHECKPOINT.format(job=JOB), cb=c.on_event)
    try:
        k = await c.keeper("n1", replicas=0, retry=FAST)
        rank = c.rank("n1")
        with capture_logs() as logs:
            assert rank.save(state_at(1), 1) is not None
            await c.settle()
        assert not [x for x in logs if x["event"] == "keeper_task_failed"]
        await wait_for(lambda: bool(states(c, "object", "failed", 1)), "the object tier's failure")
        assert states(c, "disk", "complete", 1) and states(c, "shared", "complete", 1)
        s3_server.create_bucket(bucket)
        await wait_for(lambda: bool(states(c, "object", "complete", 1)), "the object tier retried")
        assert k.counters["retried"] >= 1
        assert [x for x in logs if x["event"] == "listing_failed"]
    finally:
        await c.close()


async def test_a_kv_outage_during_a_take_leaves_no_snapshot_outside_the_catalog(
    nats_server: NatsServer, tmp_path: Path
) -> None:
    bus = await Bus.connect(nats_server.url, name="test")
    c = Cluster(bus, tmp_path, None)
    try:
        k = await c.keeper("n1", shared_root=None, replicas=0, retry=FAST)
        rank = c.rank("n1")
        catalog = await Catalog.open(bus)
        await asyncio.to_thread(nats_server.stop)
        assert rank.save(state_at(1), 1) is not None
        await wait_for(lambda: k.counters["taken"] == 1, "the take")  # its scan loop, during the outage
        # The outage outlasts a KV write: one started after the keeper's has timed out.
        with pytest.raises(Exception):  # noqa: B017 (nats-py raises timeouts of several types)
            await catalog.kv.put("=probe", b"")
        await asyncio.to_thread(nats_server.start)

        async def in_catalog() -> bool:
            e = (await catalog.entries(JOB)).get(1)
            return (
                e is not None and e.manifest is not None and e.tiers() == {"memory": ["n1"], "disk": ["n1"]}
            )

        await wait_for(in_catalog, "the snapshot in the catalog once KV is back", 120.0)
        assert [i.step for i in await in_thread(rank.list)] == [1]
    finally:
        await c.close()
        await bus.close()


async def test_a_disk_copy_is_verified_before_it_is_drained_to_a_later_tier(cluster: Cluster) -> None:
    await cluster.keeper("n1", object_url=None, replicas=0)
    rank = cluster.rank("n1")
    assert rank.save(state_at(1), 1) is not None
    await cluster.settle()
    await cluster.reboot("n1")  # memory gone: only the disk copy is left here
    data = cluster.tmp / "disk" / "n1" / JOB / step_key(1) / "state.phx"
    with open(data, "r+b") as f:
        f.seek(2000)
        byte = f.read(1)
        f.seek(2000)
        f.write(bytes([byte[0] ^ 0xFF]))
    shutil.rmtree(cluster.tmp / "shared" / JOB / step_key(1))  # the shared copy is to be drained again
    before = len(cluster.events)
    k = await cluster.keeper("n1", object_url=None, replicas=0, retry=RetryPolicy(0.1, 1.0, 0.1, attempts=2))
    await k.idle()

    def drained() -> list[str]:
        return [e.state for e in cluster.events[before:] if (e.tier, e.step) == ("shared", 1)]

    await wait_for(lambda: bool(drained()), "the drain to the shared tier, resumed")
    assert drained()[0] == "failed"  # the rotten copy went nowhere
    assert k.stores[Tier.SHARED].manifests(JOB) == []
    assert "mismatch" in states(cluster, "shared", "failed", 1)[0]
    await wait_for(lambda: drained() == ["failed", "failed"], "both attempts")


async def test_two_loads_of_one_step_at_once_both_get_it(cluster: Cluster) -> None:
    await cluster.keeper("n1", shared_root=None, object_url=None, replicas=0)
    rank = cluster.rank("n1")
    assert rank.save(state_at(4), 4) is not None
    await cluster.settle()
    await cluster.reboot("n1")
    await cluster.keeper("n1", shared_root=None, object_url=None, replicas=0)
    a, b = await asyncio.gather(in_thread(rank.load), in_thread(cluster.rank("n1", worker="w1").load))
    assert sorted([a.tier, b.tier]) == ["disk", "memory"]  # one filled it, the other found it there
    for got in (a, b):
        assert got.step == 4
        assert_state_equal(got.state, 4)
    assert torch.equal(a.state["model"]["w"], b.state["model"]["w"])


async def test_a_skipped_save_is_an_event_and_a_count(cluster: Cluster) -> None:
    k = await cluster.keeper(
        "n1",
        disk_root=None,
        shared_root=None,
        object_url=None,
        replicas=0,
        retention={Tier.MEMORY: RetentionPolicy(2)},
    )
    rank = cluster.rank("n1", slots=2)
    for step in (1, 2):
        assert rank.save(state_at(step), step) is not None
        await cluster.settle()
    assert rank.save(state_at(3), 3) is None  # the keeper holds both slots (memory keeps 2)
    await wait_for(lambda: bool(states(cluster, "memory", "skipped", 3)), "the skipped event")
    assert "w0: all 2 snapshot slots" in states(cluster, "memory", "skipped", 3)[0]
    assert k.counters["skipped"] == 1 and rank.skipped == 1
