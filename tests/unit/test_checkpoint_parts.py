"""The parts of tiered checkpointing that need no server: manifests, retention, slots,
the keeper's configuration and its wire frames. Bad input: a clear error, no change."""

from __future__ import annotations

import hashlib
import json
import shutil
import struct
import uuid
from collections.abc import Iterator
from pathlib import Path

import msgpack
import pytest
import torch
from phalanx.services.state_replication.service import keeper_config

from phalanx.checkpoint.manifest import Manifest, ManifestError, digest_chunks
from phalanx.checkpoint.packing import Packing, unpack
from phalanx.checkpoint.slots import SlotFile, SlotsBusy, SlotState, SnapshotSlots
from phalanx.checkpoint.tiers import DirTier, Tier
from phalanx.checkpoint.wire import MAX_FRAME, WireError, _decode, encode_frame
from phalanx.settings import RetentionPolicy, SettingsError

D0 = "0" * 64  # a well-formed digest


def manifest(**change: object) -> bytes:
    m = json.loads(Manifest.of_buffers("j1", 7, "n1", {"state.phx": b"x" * 100}, chunk=64).encode())
    m.update(change)
    return json.dumps(m).encode()


# -- manifests ---------------------------------------------------------------------------------
def test_a_manifest_round_trips_and_verifies_its_data() -> None:
    m = Manifest.parse(manifest())
    assert (m.job, m.step, m.origin, m.total_bytes) == ("j1", 7, "n1", 100)
    assert m.file("state.phx").sha256 == digest_chunks(b"x" * 100, 64)
    assert m.version == 2 and len(m.file("state.phx").sha256) == 2  # one SHA-256 per chunk
    m.verify_file("state.phx", b"x" * 100)


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        (b"{not json", "not a valid manifest"),
        (
            manifest(version=1),
            "a version-1 manifest .CRC32 checksums, which anyone can forge. cannot be verified",
        ),
        (manifest(version=3), "version"),
        (manifest(step=-1), "step"),
        (manifest(job="a b"), "job"),
        (manifest(files=[]), "files"),
        (manifest(files=[{"name": "../etc/passwd", "size": 1, "sha256": [D0]}]), "unsafe file name"),
        (manifest(files=[{"name": "MANIFEST.json", "size": 1, "sha256": [D0]}]), "may not be named"),
        (manifest(files=[{"name": "a", "size": 100, "sha256": [D0]}]), "has 1 digests for 100 bytes"),
        (manifest(files=[{"name": "a", "size": 1, "crc32": [0]}]), "sha256"),
        (manifest(files=[{"name": "a", "size": 1, "sha256": ["00"]}]), "not 64 lowercase hex digits"),
        (manifest(surprise=1), "surprise"),
    ],
)
def test_a_bad_manifest_is_refused_saying_what_is_wrong(raw: bytes, message: str) -> None:
    with pytest.raises(ManifestError, match=message):
        Manifest.parse(raw, "test")


def test_the_digest_is_sha256_per_chunk_whatever_the_threads() -> None:
    data = bytes(range(256)) * 1000  # 256000 bytes: 4 chunks of 64000
    want = [hashlib.sha256(data[i : i + 64000]).hexdigest() for i in range(0, len(data), 64000)]
    assert digest_chunks(data, 64000, threads=1) == want == digest_chunks(data, 64000, threads=4)
    assert digest_chunks(b"", 64000) == [hashlib.sha256(b"").hexdigest()]
    m = Manifest.of_buffers("j1", 1, "n1", {"a": data}, chunk=64000)
    tampered = bytearray(data)
    tampered[130000] ^= 1  # chunk 2
    with pytest.raises(ManifestError, match=r"digest mismatch in chunk\(s\) \[2\] of 4"):
        m.verify_file("a", bytes(tampered))


def test_data_that_does_not_match_its_manifest_is_refused() -> None:
    m = Manifest.parse(manifest())
    with pytest.raises(ManifestError, match="99 bytes, the manifest says 100"):
        m.verify_file("state.phx", b"x" * 99)
    with pytest.raises(ManifestError, match=r"digest mismatch in chunk\(s\) \[1\]"):
        m.verify_file("state.phx", b"x" * 64 + b"y" + b"x" * 35)
    with pytest.raises(ManifestError, match="has no file 'other'"):
        m.verify_file("other", b"")


# -- retention ---------------------------------------------------------------------------------
def test_retention_keeps_the_newest_and_every_multiple() -> None:
    assert RetentionPolicy(2).expired([30, 10, 20]) == [10]
    assert RetentionPolicy(1, 100).expired([100, 150, 200, 250]) == [150]
    assert RetentionPolicy(5).expired([1, 2]) == []


@pytest.mark.parametrize(("last", "every"), [(0, 0), (-1, 0), (2, -1)])
def test_bad_retention_is_refused(last: int, every: int) -> None:
    with pytest.raises(ValueError, match="retention"):
        RetentionPolicy(last, every)


# -- the keeper's configuration ------------------------------------------------------------------
def test_the_keeper_reads_its_tiers_from_the_environment(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("PHALANX_CKPT_DISK", str(tmp_path / "d"))
    monkeypatch.setenv("PHALANX_CKPT_OBJECT", "s3://b/p")
    monkeypatch.setenv("PHALANX_CKPT_REPLICAS", "2")
    monkeypatch.setenv("PHALANX_CKPT_TIERS", "object:every=100,last=3,pin=1000")
    monkeypatch.setenv("PHALANX_KEEPER_KEY", "k" * 32)
    monkeypatch.setenv("PHALANX_KEEPER_MAX_FILLS", "3")
    cfg = keeper_config("n1")
    assert (cfg.key, cfg.max_fills) == (b"k" * 32, 3)
    assert (cfg.disk_root, cfg.shared_root, cfg.object_url, cfg.replicas) == (
        tmp_path / "d",
        None,
        "s3://b/p",
        2,
    )
    assert cfg.retention[Tier.OBJECT] == RetentionPolicy(3, 1000)
    assert cfg.retention[Tier.DISK] == RetentionPolicy(5)  # not named: the default
    assert (cfg.drain_tiers(100), cfg.drain_tiers(150)) == ((Tier.DISK, Tier.OBJECT), (Tier.DISK,))


@pytest.mark.parametrize(
    ("name", "value", "message"),
    [
        (
            "PHALANX_CKPT_REPLICAS",
            "-1",
            "PHALANX_CKPT_REPLICAS='-1': Input should be greater than or equal to 0",
        ),
        ("PHALANX_KEEPER_PORT", "http", "PHALANX_KEEPER_PORT='http': Input should be a valid integer"),
        ("PHALANX_CKPT_TIERS", "memory:last=0", "PHALANX_CKPT_TIERS='memory:last=0': .*tier policy"),
    ],
)
def test_a_bad_keeper_setting_is_refused_at_start(
    monkeypatch: pytest.MonkeyPatch, name: str, value: str, message: str
) -> None:
    monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=message):
        keeper_config("n1")


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({}, "a keeper needs the cluster's keeper key"),
        ({"PHALANX_KEEPER_KEY": "short"}, "PHALANX_KEEPER_KEY has 5 bytes, needs at least 32"),
        ({"PHALANX_KEEPER_KEY_FILE": "/nonexistent/key"}, "PHALANX_KEEPER_KEY_FILE='/nonexistent/key'"),
        ({"PHALANX_KEEPER_KEY": "k" * 32, "PHALANX_KEEPER_KEY_FILE": "/k"}, "not both"),
    ],
)
def test_a_keeper_without_a_good_key_is_refused_at_start(
    monkeypatch: pytest.MonkeyPatch, env: dict[str, str], message: str
) -> None:
    monkeypatch.delenv("PHALANX_KEEPER_KEY", raising=False)  # the suite's (tests/conftest.py)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(SettingsError, match=message):
        keeper_config("n1")


def test_the_keeper_key_can_come_from_a_file(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    (tmp_path / "key").write_text("f" * 40 + "\n")
    monkeypatch.delenv("PHALANX_KEEPER_KEY", raising=False)
    monkeypatch.setenv("PHALANX_KEEPER_KEY_FILE", str(tmp_path / "key"))
    assert keeper_config("n1").key == b"f" * 40


# -- slots -------------------------------------------------------------------------------------
@pytest.fixture
def shm() -> Iterator[Path]:
    path = Path("/dev/shm") / f"phalanx-unit-{uuid.uuid4().hex[:8]}"
    yield path
    shutil.rmtree(path, ignore_errors=True)


def test_a_snapshot_slot_holds_the_state_bytes_and_its_layout(shm: Path) -> None:
    state = {"w": torch.arange(10.0), "step": 3}
    slots = SnapshotSlots(shm, "n1", "j1", "w0", count=2)
    written = slots.write(3, Packing.of(state, torch.device("cpu")))
    f = SlotFile(written.path)
    h = f.header()
    assert (h.state, h.step, h.seq) == (SlotState.READY, 3, 1)
    got = unpack(h.meta, torch.frombuffer(bytearray(f.data(h)), dtype=torch.uint8))
    assert torch.equal(got["w"], state["w"]) and got["step"] == 3
    f.close()
    slots.close()


def test_held_slots_are_never_overwritten_and_a_half_written_one_is_reused(shm: Path) -> None:
    packing = Packing.of({"w": torch.ones(4)}, torch.device("cpu"))
    slots = SnapshotSlots(shm, "n1", "j1", "w0", count=2)
    a, b = slots.write(1, packing), slots.write(2, packing)
    for w in (a, b):
        f = SlotFile(w.path)
        f.set_state(SlotState.HELD)
        f.close()
    with pytest.raises(SlotsBusy, match="all 2 snapshot slots of w0"):
        slots.write(3, packing)
    f = SlotFile(a.path)
    f.set_state(SlotState.WRITING)  # this rank died in the middle of writing it
    f.close()
    assert slots.write(3, packing).path == a.path
    slots.close()


def test_a_file_too_short_to_be_a_slot_is_refused(shm: Path) -> None:
    shm.mkdir(parents=True)
    (shm / "x.slot").write_bytes(b"short")
    with pytest.raises(ValueError, match="is not a snapshot slot"):
        SlotFile(shm / "x.slot")


# -- directory tiers -----------------------------------------------------------------------------
def test_a_dir_tier_lists_only_complete_copies(tmp_path: Path) -> None:
    tier = DirTier(Tier.DISK, tmp_path, fsync=False)
    data = {"state.phx": b"abc" * 10}
    m = Manifest.of_buffers("j1", 5, "n1", data)
    tier.put(m, lambda name: memoryview(data[name]))
    (tmp_path / "j1" / ".partial-000000000006-dead").mkdir()  # a write that was killed
    assert [x.step for x in tier.manifests("j1")] == [5]
    assert tier.damage(m) == []
    assert tier.clean_partials("j1") == 1
    tier.delete("j1", 5)
    assert tier.manifests("j1") == []


# -- wire frames ---------------------------------------------------------------------------------
def test_frames_that_are_not_the_protocol_are_refused() -> None:
    with pytest.raises(WireError, match="not a map"):
        _decode(msgpack.packb([1, 2]))
    with pytest.raises(WireError, match="not msgpack"):
        _decode(b"\xc1")
    with pytest.raises(WireError, match="over"):
        encode_frame({"x": b"y" * (MAX_FRAME + 1)})
    assert struct.unpack(">I", encode_frame({"op": "list"})[:4])[0] == len(msgpack.packb({"op": "list"}))
