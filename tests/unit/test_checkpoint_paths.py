"""The keeper's path resolution (no symlink followed) and the slot header checks, on real files."""

from __future__ import annotations

import os
import struct
from pathlib import Path

import pytest

from phalanx.checkpoint import paths
from phalanx.checkpoint.jobdirs import own_job_dir
from phalanx.checkpoint.slots import SlotError, SlotFile, scan
from phalanx.checkpoint.tiers import RetryPolicy
from phalanx.settings import parse_job_uids


def test_rmtree_at_never_follows_a_link_on_the_way_or_at_the_end(tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    (victim / "step").mkdir(parents=True)
    (victim / "step" / "data").write_text("keep")
    base = tmp_path / "base"
    base.mkdir()
    os.symlink(victim, base / "job")  # base/job/step is victim/step through a link
    with pytest.raises(OSError):
        paths.rmtree_at(base, "job", "step")
    os.unlink(base / "job")
    (base / "job").mkdir()
    os.symlink(victim / "step", base / "job" / "step")  # the last component a link
    with pytest.raises(OSError):
        paths.rmtree_at(base, "job", "step")
    assert (victim / "step" / "data").read_text() == "keep"
    os.unlink(base / "job" / "step")
    (base / "job" / "real" / "deep").mkdir(parents=True)
    os.symlink(victim, base / "job" / "real" / "link")  # a link inside is removed, not followed
    assert paths.rmtree_at(base, "job", "real") is True
    assert not (base / "job" / "real").exists() and (victim / "step" / "data").exists()
    assert paths.rmtree_at(base, "job", "gone") is False


def test_open_file_refuses_links_fifos_and_dot_dot(tmp_path: Path) -> None:
    (tmp_path / "d").mkdir()
    (tmp_path / "secret").write_text("s")
    os.symlink(tmp_path / "secret", tmp_path / "d" / "link")
    os.mkfifo(tmp_path / "d" / "fifo")
    with paths.dir_at(tmp_path, "d") as fd:
        for name in ("link", "fifo", "../secret"):
            with pytest.raises(OSError):
                os.close(paths.open_file(fd, name, os.O_RDONLY))
        with pytest.raises(OSError, match=r"is a symlink|not a regular file"):
            paths.regular_files(fd)


def test_check_owned_refuses_another_uid_and_world_writable(tmp_path: Path) -> None:
    d = tmp_path / "d"
    d.mkdir(mode=0o750)
    with paths.dir_at(tmp_path, "d") as fd:
        paths.check_owned(fd, os.geteuid(), "d")
        with pytest.raises(PermissionError, match="owned by uid"):
            paths.check_owned(fd, os.geteuid() + 1, "d")
        os.fchmod(fd, 0o777)
        with pytest.raises(PermissionError, match="writable by every user"):
            paths.check_owned(fd, os.geteuid(), "d")


def _slot(tmp_path: Path, state: int, data_at: int = 4096, data_len: int = 8, meta_len: int = 0) -> SlotFile:
    path = tmp_path / "w0.0.slot"
    head = struct.pack("<8sIIQqQQd", b"PHXSLOT1", state, meta_len, 1, 5, data_at, data_len, 0.0)
    path.write_bytes(head + b"\0" * (8192 - len(head)))
    return SlotFile(path)


@pytest.mark.parametrize(
    ("state", "data_at", "data_len", "meta_len", "why"),
    [
        (7, 4096, 8, 0, "is not a slot state"),
        (2, 4096, 1 << 20, 0, "bad layout"),  # data past the end
        (2, 100, 8, 0, "bad layout"),  # not page aligned
        (3, 4096, 8, 8000, "bad layout"),  # metadata runs into the data
    ],
)
def test_a_malformed_slot_header_is_a_slot_error(
    tmp_path: Path, state: int, data_at: int, data_len: int, meta_len: int, why: str
) -> None:
    f = _slot(tmp_path, state, data_at, data_len, meta_len)
    with pytest.raises(SlotError, match=why):
        f.header()
    f.close()
    assert _slot(tmp_path, 2).header().step == 5


def test_a_rank_refuses_a_job_directory_writable_by_all_and_the_scan_reports_it(tmp_path: Path) -> None:
    own = own_job_dir(tmp_path / "n1", "slots", "j1")
    os.close(own.fd)
    assert own.squatted == "" and own.path == tmp_path / "n1" / "slots" / "j1"
    assert oct((tmp_path / "n1" / "slots").stat().st_mode & 0o7777) == "0o1777"
    assert oct((tmp_path / "n1" / "slots" / "j1").stat().st_mode & 0o777) == "0o770"
    os.chmod(tmp_path / "n1" / "slots" / "j1", 0o777)
    # Not used: the rank goes on in a fallback directory of its own, the same one each time.
    fallback = own_job_dir(tmp_path / "n1", "slots", "j1")
    os.close(fallback.fd)
    assert "writable by every user" in fallback.squatted and fallback.path.name.startswith("j1.")
    assert oct(fallback.path.stat().st_mode & 0o777) == "0o770"
    again = own_job_dir(tmp_path / "n1", "slots", "j1")
    os.close(again.fd)
    assert again.path == fallback.path
    found = scan(tmp_path, "n1", lambda job: os.geteuid())
    assert found.slots == [] and [why for _p, why in found.refused] == [
        f"{tmp_path / 'n1' / 'slots' / 'j1'} is writable by every user (mode drwxrwxrwx)"
    ]


def test_job_uids_and_retry_policy_parse_and_back_off() -> None:
    assert parse_job_uids("") == {}
    for bad in ("a", "a=x", "a=1,a=2", "../x=1"):
        with pytest.raises(ValueError, match="expected 'job=uid"):
            parse_job_uids(bad)
    policy = RetryPolicy(1.0, 2.0, 10.0, attempts=3)
    assert [policy.delay(a) for a in range(6)] == [1.0, 2.0, 4.0, 8.0, 10.0, 10.0]
    assert not policy.gives_up(2) and policy.gives_up(3) and not RetryPolicy().gives_up(10**6)
