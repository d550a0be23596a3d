"""The keeper's TCP port and a rank's reads, attacked: real keepers (in this process, each
a node of its own) against a real nats-server; the attacker is this test, speaking the
keeper's frames by hand -- without the keeper key (anyone on the network), or with it
(a keeper gone wrong: it still cannot replace what the catalog committed).

Each attack is refused or contained, logged, and changes nothing that was committed:
the catalog's manifest, the copies the keepers hold and what a restore returns."""

from __future__ import annotations

import asyncio
import contextlib
import os
import pickle
import struct
import subprocess
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgpack
import pytest
import torch
from nats.aio.msg import Msg
from structlog.testing import capture_logs

from phalanx.bus import Bus
from phalanx.checkpoint.catalog import Catalog
from phalanx.checkpoint.keeper import Keeper
from phalanx.checkpoint.manifest import Manifest, ManifestError
from phalanx.checkpoint.packing import Packing
from phalanx.checkpoint.tiers import step_key
from phalanx.contract import CheckpointEvent, decode
from phalanx.contract.subjects import CHECKPOINT
from tests.integration.test_checkpoint import JOB, Cluster, assert_state_equal, in_thread, state_at


def frame(obj: dict[str, Any]) -> bytes:
    raw = msgpack.packb(obj, use_bin_type=True)
    return struct.pack(">I", len(raw)) + raw


def snapshot(state: dict[str, Any]) -> tuple[bytes, bytes]:
    """The bytes of ``state`` as a rank's slot holds them, and their layout."""
    packing = Packing.of(state, torch.device("cpu"))
    buf = torch.zeros(max(packing.size, 1), dtype=torch.uint8)
    packing.copy_into(buf)
    return bytes(buf.numpy()[: packing.size]), packing.meta


def forged_state(step: int) -> dict[str, Any]:
    state = state_at(step)
    state["model"]["w"].fill_(666.0)
    return state


async def read_all(reader: asyncio.StreamReader, timeout_s: float = 30.0) -> bytes:
    """Everything the keeper sends until it closes the connection."""
    out = b""
    async with asyncio.timeout(timeout_s):
        with contextlib.suppress(ConnectionError):
            while piece := await reader.read(1 << 20):
                out += piece
    return out


async def first_reply(reader: asyncio.StreamReader, timeout_s: float = 30.0) -> dict[str, Any] | None:
    """The keeper's first frame as the old (unsealed) protocol would send it; None if it
    closed the connection without one."""
    try:
        async with asyncio.timeout(timeout_s):
            (n,) = struct.unpack(">I", await reader.readexactly(4))
            got = msgpack.unpackb(await reader.readexactly(n), raw=False)
    except (asyncio.IncompleteReadError, ConnectionError):
        return None
    return got if isinstance(got, dict) else None


async def push(writer: asyncio.StreamWriter, data: bytes) -> None:
    with contextlib.suppress(OSError):
        writer.write(data)
        await writer.drain()


async def dial(addr: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    host, _, port = addr.rpartition(":")
    return await asyncio.open_connection(host, int(port))


async def committed(bus: Bus, step: int) -> bytes:
    m = (await (await Catalog.open(bus)).entries(JOB))[step].manifest
    assert m is not None
    return m.encode()


async def until(check: Callable[[], bool], what: str, timeout_s: float = 30.0) -> None:
    async with asyncio.timeout(timeout_s):
        while not check():
            await asyncio.sleep(0.02)
    assert check(), what


async def replicated(c: Cluster, step: int) -> tuple[Keeper, Keeper]:
    """n1 took ``step`` and replicated it to n2 (n3 stands by)."""
    for node in ("n1", "n2", "n3"):
        await c.keeper(node, shared_root=None, replicas=1)
    assert c.rank("n1").save(state_at(step), step) is not None
    await c.settle()
    n2 = c.keepers["n2"]
    assert (JOB, step) in n2.memory
    return c.keepers["n1"], n2


# -- forged replicas ------------------------------------------------------------------------
async def test_a_forged_replicate_is_refused_and_the_restore_serves_the_original(
    cluster: Cluster, bus: Bus
) -> None:
    _, n2 = await replicated(cluster, 7)
    before = await committed(bus, 7)
    data, meta = snapshot(forged_state(7))
    forged = Manifest.of_buffers(JOB, 7, "n1", {"state.phx": data}, meta=meta)
    with capture_logs() as logs:
        reader, writer = await dial(n2.addr)
        writer.write(frame({"op": "replicate", "manifest": forged.encode(), "from": "n1"}))
        pusher = asyncio.create_task(push(writer, data))
        reply = await first_reply(reader)
        pusher.cancel()
        writer.close()
        assert reply is None or not reply.get("ok"), f"the keeper took a forged replica: {reply}"
        await until(lambda: any(e["event"] == "peer_unauthenticated" for e in logs), "the refusal logged")
    assert await committed(bus, 7) == before
    assert n2.memory[(JOB, 7)].manifest.encode() == before
    await cluster.kill("n1")  # the replica on n2 is the only copy left
    loaded = await in_thread(cluster.rank("n3").load)
    assert (loaded.step, loaded.tier) == (7, "peer")
    assert_state_equal(loaded.state, 7)


async def test_a_keeper_with_the_key_cannot_replace_a_committed_step_nor_add_one(
    cluster: Cluster, bus: Bus
) -> None:
    from phalanx.checkpoint import peerauth

    _, n2 = await replicated(cluster, 7)
    before = await committed(bus, 7)
    data, meta = snapshot(forged_state(7))
    for step, why in ((7, "not the manifest committed in the catalog"), (9, "the catalog has no manifest")):
        forged = Manifest.of_buffers(JOB, step, "n1", {"state.phx": data}, meta=meta)
        reader, writer = await dial(n2.addr)
        session = await peerauth.connect(reader, writer, n2.cfg.key, 5.0)
        with capture_logs() as logs:
            await session.send(writer, {"op": "replicate", "manifest": forged.encode(), "from": "n1"}, 5.0)
            pusher = asyncio.create_task(push(writer, data))
            reply = await session.recv(reader, 30.0)
            pusher.cancel()
            writer.close()
            await until(lambda: any(e["event"] == "peer_refused" for e in logs), "the refusal logged")
        assert not reply["ok"] and why in reply["error"]
    assert (JOB, 9) not in n2.memory and await (await Catalog.open(bus)).manifest(JOB, 9) is None
    assert not (cluster.shm / "n2" / "replicas" / JOB / step_key(9)).exists()
    assert await committed(bus, 7) == before
    assert n2.memory[(JOB, 7)].manifest.encode() == before
    await cluster.kill("n1")
    loaded = await in_thread(cluster.rank("n3").load)
    assert loaded.tier == "peer"
    assert_state_equal(loaded.state, 7)


# -- fetch ----------------------------------------------------------------------------------
async def test_a_fetch_without_the_key_gets_nothing(cluster: Cluster, bus: Bus) -> None:
    n1, _ = await replicated(cluster, 7)
    with capture_logs() as logs:
        reader, writer = await dial(n1.addr)
        writer.write(frame({"op": "fetch", "job": JOB, "step": 7}))
        got = await read_all(reader)
        writer.close()
        assert got == b"", f"{len(got)} bytes sent to a peer that proved nothing"
        await until(lambda: any(e["event"] == "peer_unauthenticated" for e in logs), "the refusal logged")

    from phalanx.checkpoint import peerauth

    reader, writer = await dial(n1.addr)  # a wrong key: the keeper's proof does not check out
    with pytest.raises(peerauth.AuthError, match="does not know the keeper key"):
        await peerauth.connect(reader, writer, b"w" * 32, 5.0)
    writer.close()


# -- DCP metadata ---------------------------------------------------------------------------
class Payload:
    """Unpickled, it creates the file ``marker`` (it could run anything)."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (open, (str(self.marker), "w"))


async def test_forged_dcp_metadata_is_never_unpickled(cluster: Cluster, tmp_path: Path) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    from phalanx.checkpoint.dcp import TieredReader, TieredWriter

    await cluster.keeper("n1", replicas=0, shared_root=None)
    rank = cluster.rank("n1")
    state = state_at(8)["model"]

    def save() -> None:
        dcp.async_save(state, storage_writer=TieredWriter(JOB, 8, checkpointer=rank), no_dist=True).result()

    await in_thread(save)
    await cluster.settle()
    # The keeper's memory copy is not checksummed again on every read: someone who can
    # write it (or a replica that got past the keeper) puts a pickle in .metadata.
    marker = tmp_path / "unpickled"
    (metadata,) = [
        Path(p) for n, (p, _) in cluster.keepers["n1"].memory[(JOB, 8)].files.items() if n == ".metadata"
    ]
    payload = pickle.dumps(Payload(marker))
    size = metadata.stat().st_size
    assert len(payload) < size
    metadata.write_bytes(payload + b"\0" * (size - len(payload)))  # the same size: only the digest differs

    def load() -> None:
        into = {k: torch.zeros_like(v) for k, v in state.items()}
        dcp.load(into, storage_reader=TieredReader(JOB, checkpointer=rank), no_dist=True)

    with pytest.raises((ManifestError, CheckpointException)) as refused:
        await in_thread(load)
    assert not marker.exists(), "DCP unpickled a forged .metadata in the rank"
    assert refused.match(r"\.metadata: digest mismatch in chunk")


# -- a bounded keeper -----------------------------------------------------------------------
async def test_idle_and_stalled_connections_hold_nothing(cluster: Cluster, bus: Bus) -> None:
    k = await cluster.keeper("n1", replicas=0, shared_root=None)
    k.cfg.auth_timeout_s = 1.0
    rank = cluster.rank("n1")
    assert rank.save(state_at(1), 1) is not None
    await cluster.settle()
    m = await committed(bus, 1)
    conns = []
    # More connections than one peer may hold, silent; then more than the default thread
    # pool (min(32, cpus + 4)), each declaring a replica of a committed step and sending
    # none of its bytes.
    with capture_logs() as logs:
        try:
            for i in range(10 + 2 * ((os.cpu_count() or 1) + 4)):
                reader, writer = await dial(k.addr)
                if i >= 10:
                    writer.write(frame({"op": "replicate", "manifest": m, "from": "n9"}))
                    await writer.drain()
                conns.append((reader, writer))
            assert rank.save(state_at(2), 2) is not None
            await asyncio.wait_for(cluster.settle(), 60)  # the snapshot is taken
            loaded = await asyncio.wait_for(in_thread(rank.load), 60)  # and a restore served
            assert loaded.step == 2
            assert_state_equal(loaded.state, 2)
            for reader, _ in conns:  # each dropped (refused at once, or after the auth timeout)
                assert await read_all(reader, 60) == b""
        finally:
            for _, writer in conns:
                writer.close()
    assert any("too many connections" in e.get("error", "") for e in logs)  # turned away, and logged
    assert any(e["event"] == "peer_unauthenticated" for e in logs)


async def test_a_slow_loris_peer_is_dropped(cluster: Cluster, bus: Bus) -> None:
    k = await cluster.keeper("n1", replicas=0, shared_root=None)
    k.cfg.auth_timeout_s = 0.5
    reader, writer = await dial(k.addr)
    hello = frame({"op": "replicate", "manifest": b"x" * 1000})

    async def trickle() -> None:  # one byte at a time, never a whole frame for long
        with contextlib.suppress(OSError):
            for b in hello:
                writer.write(bytes([b]))
                await writer.drain()
                await asyncio.sleep(0.1)

    sender = asyncio.create_task(trickle())
    with capture_logs() as logs:
        assert await read_all(reader, 60) == b""  # the keeper closed it
        await until(lambda: any(e["event"] == "peer_unauthenticated" for e in logs), "the drop logged")
    assert not sender.done(), "the trickle ended before the keeper dropped it"
    sender.cancel()
    writer.close()


async def test_an_authenticated_peer_that_stalls_mid_transfer_is_dropped(cluster: Cluster, bus: Bus) -> None:
    from phalanx.checkpoint import peerauth

    _, n2 = await replicated(cluster, 7)
    n2.cfg.io_timeout_s = 1.0
    before = await committed(bus, 7)
    reader, writer = await dial(n2.addr)
    session = await peerauth.connect(reader, writer, n2.cfg.key, 5.0)
    with capture_logs() as logs:
        await session.send(writer, {"op": "replicate", "manifest": before, "from": "n1"}, 5.0)
        writer.write(b"\0" * 4096)  # then nothing
        reply = await session.recv(reader, 60.0)
        await until(lambda: any(e["event"] == "peer_refused" for e in logs), "the drop logged")
    writer.close()
    assert not reply["ok"] and "dropped" in reply["error"]
    replicas = cluster.shm / "n2" / "replicas" / JOB
    assert [p.name for p in replicas.iterdir()] == [step_key(7)]  # no partial copy left
    assert n2.memory[(JOB, 7)].manifest.encode() == before and n2.memory[(JOB, 7)].intact()
    assert n2.shm._fills._value == n2.cfg.max_fills and not n2.peers.sessions.held()  # nothing held


async def test_a_declared_huge_size_is_refused_before_anything_is_allocated(
    cluster: Cluster, bus: Bus
) -> None:
    from phalanx.checkpoint import peerauth
    from phalanx.checkpoint.manifest import FileEntry

    n1 = await cluster.keeper("n1", replicas=0, shared_root=None)
    chunk = 1 << 30
    size = 1 << 40  # 1 TiB
    huge = Manifest(
        job=JOB,
        step=50,
        kind="snapshot",
        origin="n9",
        created=1.0,
        chunk=chunk,
        files=[FileEntry(name="state.phx", size=size, sha256=["0" * 64] * (size // chunk))],
    )
    await (await Catalog.open(bus)).put_manifest(huge)  # committed: only the size stops it
    for keeper, why in (
        (n1, "over the largest checkpoint this keeper takes"),
        (
            await cluster.keeper("n2", replicas=0, shared_root=None, max_bytes=1 << 50),
            "of shared memory are free",
        ),
    ):
        reader, writer = await dial(keeper.addr)
        session = await peerauth.connect(reader, writer, keeper.cfg.key, 5.0)
        await session.send(writer, {"op": "replicate", "manifest": huge.encode(), "from": "n9"}, 5.0)
        reply = await session.recv(reader, 30.0)
        writer.close()
        assert not reply["ok"] and why in reply["error"], reply
        assert not (cluster.shm / keeper.node / "replicas" / JOB).exists()  # nothing allocated


# -- ENOSPC in a rank's save ----------------------------------------------------------------
@pytest.fixture
def small_shm(tmp_path: Path) -> Any:
    """A 24 MiB tmpfs as the shared memory of ranks and keeper (root only)."""
    where = tmp_path / "shm"
    where.mkdir()
    try:
        subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "size=24m", "tmpfs", str(where)], check=True, capture_output=True
        )
    except (OSError, subprocess.CalledProcessError) as exc:
        pytest.skip(f"cannot mount a small tmpfs here: {exc}")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)


async def test_enospc_in_a_save_is_a_skipped_save_with_an_event_and_the_rank_goes_on(
    bus: Bus, tmp_path: Path, small_shm: Path
) -> None:
    c = Cluster(bus, tmp_path, None)
    c.shm = small_shm / f"phalanx-{uuid.uuid4().hex[:6]}"
    events: list[CheckpointEvent] = []

    async def on_event(raw: Msg) -> None:
        events.append(decode(raw.data, raw.headers, CheckpointEvent))

    await bus.nc.subscribe(CHECKPOINT.format(job=JOB), cb=on_event)
    try:
        k = await c.keeper("n1", replicas=0, disk_root=None, shared_root=None)
        k.cfg.shm_reserve_bytes = 0  # the whole (small) tmpfs may be used
        rank = c.rank("n1")
        assert rank.save(state_at(1, mib=3), 1) is not None
        await c.settle()
        big = {"w": torch.zeros(40 << 20, dtype=torch.uint8)}  # 40 MiB: more than the whole tmpfs
        assert rank.save(big, 2) is None  # skipped, not raised
        assert rank.skipped == 1
        await until(lambda: any(e.state == "skipped" and e.step == 2 for e in events), "a skipped event")
        (e,) = [e for e in events if e.state == "skipped"]
        assert "ENOSPC" in e.detail
        assert rank.save(state_at(3, mib=3), 3) is not None  # the rank goes on
        await c.settle()
        loaded = await in_thread(rank.load)
        assert loaded.step == 3
    finally:
        await c.close()
