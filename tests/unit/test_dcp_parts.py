"""The names and manifests of a DCP checkpoint saved by several ranks (a set of parts),
and the file system a TieredReader hands DCP."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from phalanx.checkpoint.keeperconfig import KeeperConfig
from phalanx.checkpoint.manifest import Manifest, ManifestError, digest, is_part, job_of, part_job

HEX = "ab" * 32


def test_part_names_are_made_and_read_in_one_place() -> None:
    assert part_job("j1", 0) == "j1=r0" and part_job("j1", 12) == "j1=r12"
    assert job_of("j1=r12") == "j1" and job_of("j1") == "j1"
    assert is_part("j1=r3") and not is_part("j1") and not is_part("j1=r03") and not is_part("a=r1=r2")
    for job, rank in (("j=r1", 0), ("", 0), ("j1", -1), ("j1", True)):
        with pytest.raises(ValueError):
            part_job(job, rank)  # type: ignore[arg-type]


def of(job: str, **kw: object) -> Manifest:
    return Manifest.of_buffers(job, 5, "n1", {".metadata": b"m"}, kind="dcp", **kw)  # type: ignore[arg-type]


def test_a_set_pins_parts_of_its_own_job_only() -> None:
    m = of("j1").model_copy(update={"parts": {"j1=r0": HEX}})
    again = Manifest.parse(m.encode())
    assert again.parts == {"j1=r0": HEX} and digest(again.encode()) == digest(m.encode())
    assert b"parts" not in of("j1").encode()  # a checkpoint that is not a set encodes as before
    assert Manifest.parse(of("j1=r4").encode()).job == "j1=r4"  # a part is a checkpoint of its own
    bad = {
        "another job's part": ("j1", {"j2=r0": HEX}),
        "not a part": ("j1", {"j1": HEX}),
        "not a digest": ("j1", {"j1=r0": "AB" * 32}),
        "a part with parts": ("j1=r0", {"j1=r0=r1": HEX}),
    }
    for why, (job, parts) in bad.items():
        raw = of(job).model_dump_json().replace('"parts":{}', f'"parts":{json.dumps(parts)}')
        with pytest.raises(ManifestError):
            Manifest.parse(raw.encode(), why)


def test_a_part_is_its_jobs_for_ownership() -> None:
    cfg = KeeperConfig(node="n1", job_uids={"j1": 20001})
    assert cfg.job_uid("j1=r7") == 20001 and cfg.job_group("j1=r7") == 20001
    assert cfg.job_group("other=r0") is None


def test_dcp_opens_verified_files_only(tmp_path: Path) -> None:
    from phalanx.checkpoint.dcp import _VerifiedFiles

    f = tmp_path / "__0_0.distcp"
    f.write_bytes(b"data")
    fs = _VerifiedFiles({"__0_0.distcp": os.open(f, os.O_RDONLY)})
    f.unlink()
    f.write_bytes(b"swapped")  # another file under the name after the check: never read
    try:
        for _ in range(2):  # each stream from the start of the one descriptor
            with fs.create_stream(fs.concat_path(tmp_path, "__0_0.distcp"), "rb") as s:
                assert s.read() == b"data"
        with pytest.raises(ManifestError, match="no verified file"):
            fs.concat_path(tmp_path, "__1_0.distcp")
        with (
            pytest.raises(ManifestError, match="no verified file"),
            fs.create_stream(tmp_path / "other", "rb"),
        ):
            pass
        with pytest.raises(ManifestError, match="no verified file"), fs.create_stream(str(f), "rb"):
            pass
        with pytest.raises(ManifestError, match="no verified file"), fs.create_stream("__0_0.distcp", "wb"):
            pass
    finally:
        fs.close()
    assert fs.files == {}
