"""Another job on the node against a job's directories in shared memory (issue 37, point 2).

``<node>/slots/`` and ``<node>/dcp/`` are open to every uid: another uid can take a
job's name there first -- a directory of its own, or a symlink to a directory it reads.
Real keepers and a real nats-server (as in test_checkpoint_node.py); the other uid is a
forked process that drops to ``nobody``. The job's files never land where the squatter
can read them, its saves go on (in a fallback directory of its own), the squat is
logged by the rank and published as an error event by the keeper, and the keeper takes
a fallback directory only where it is the job's own real directory. A DCP reader reads
each file from the descriptor it verified: a file swapped under its name afterwards is
never read. Every test needs root (another uid) and is skipped without it.
"""

from __future__ import annotations

import functools
import os
import shutil
import stat
from collections.abc import MutableMapping
from pathlib import Path
from typing import Any

import pytest
import torch
from structlog.testing import capture_logs
from torch.distributed.checkpoint.api import CheckpointException

from phalanx.bus import Bus
from phalanx.checkpoint import Checkpointer, wire
from phalanx.checkpoint.tiers import step_key
from tests.integration.test_checkpoint import JOB, Cluster, assert_state_equal, in_thread, state_at
from tests.integration.test_checkpoint_node import Errors, wait_for
from tests.procs import NOBODY, as_uid

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (another uid)")
SQUATTER = NOBODY
PART = f"{JOB}=r0"  # the part of rank 0 (a save without a process group)


@pytest.fixture
async def errors(bus: Bus) -> Errors:
    e = Errors()
    await bus.nc.subscribe("phalanx.err.>", cb=e.on_msg)
    return e


def readable(files: list[Path]) -> list[str]:
    """Which of ``files`` the calling process can read a byte of."""
    out = []
    for f in files:
        try:
            with open(f, "rb") as fh:
                fh.read(1)
            out.append(str(f))
        except OSError:
            pass
    return out


def dcp_save(rank: Checkpointer, state: dict[str, torch.Tensor], step: int) -> None:
    import torch.distributed.checkpoint as dcp

    from phalanx.checkpoint.dcp import TieredWriter

    dcp.save(state, storage_writer=TieredWriter(JOB, step, checkpointer=rank), no_dist=True)


def dcp_load(rank: Checkpointer, step: int) -> dict[str, torch.Tensor]:
    import torch.distributed.checkpoint as dcp

    from phalanx.checkpoint.dcp import TieredReader

    into = {k: torch.zeros_like(v) for k, v in state_at(step)["model"].items()}
    reader = TieredReader(JOB, step, checkpointer=rank)
    try:
        dcp.load(into, storage_reader=reader, no_dist=True)
    finally:
        reader.close()
    return into


def assert_model_equal(got: dict[str, torch.Tensor], step: int) -> None:
    want = state_at(step)["model"]
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)


def files_of(c: Cluster, node: str, job: str, step: int) -> list[Path]:
    return [Path(p) for p, _ in c.keepers[node].memory[(job, step)].files.values()]


def squatted_logs(logs: list[MutableMapping[str, Any]]) -> list[MutableMapping[str, Any]]:
    """The rank's logs of a squatted name (the keeper in this process logs its own)."""
    return [x for x in logs if x["event"] == "job_dir_squatted" and "fallback" in x]


async def test_a_symlink_planted_for_a_part_diverts_no_shard_and_the_save_goes_on(
    cluster: Cluster, errors: Errors
) -> None:
    await cluster.keeper("n1", shared_root=None, object_url=None, replicas=0)
    rank = cluster.rank("n1")
    assert await in_thread(rank.save, state_at(5), 5) is not None  # committed before the squat
    await cluster.settle()
    dcp_dir = cluster.shm / "n1" / "dcp"
    loot = dcp_dir / "loot"

    def squat() -> None:  # the other uid: a directory it reads, under the part's name
        os.mkdir(loot, 0o777)
        os.chmod(loot, 0o777)
        os.symlink(loot, dcp_dir / PART)

    as_uid(SQUATTER, squat)

    def save() -> BaseException | None:
        try:
            dcp_save(rank, state_at(8)["model"], 8)
        except (Exception, CheckpointException) as exc:  # a BaseException
            return exc
        return None

    with capture_logs() as logs:
        failed = await in_thread(save)
    await cluster.settle()

    leaked = [str(p.relative_to(loot)) for p in loot.rglob("*")]
    assert leaked == [], f"the job wrote into the squatter's directory: {leaked}"
    assert failed is None
    (log,) = [x for x in squatted_logs(logs) if PART in x["directory"]]
    assert f"a symlink of uid {SQUATTER}" in log["reason"]
    part_files = files_of(cluster, "n1", PART, 8)
    fallback = part_files[0].parent.parent
    assert (
        fallback.parent == dcp_dir
        and fallback.name.startswith(f"{PART}.")
        and fallback == Path(log["fallback"])
    )
    st = fallback.stat()
    assert (st.st_uid, stat.S_IMODE(st.st_mode)) == (os.geteuid(), 0o770)
    assert readable(part_files) == [str(f) for f in part_files]  # this process can
    assert as_uid(SQUATTER, lambda: readable(part_files + files_of(cluster, "n1", JOB, 8))) == []
    await wait_for(
        lambda: bool(
            errors.about(f"{dcp_dir / PART} (a symlink of uid {SQUATTER}) is not the directory of {PART}")
        ),
        "the keeper's event",
    )
    # The save is a checkpoint; the one committed before is unchanged.
    assert [i.step for i in await in_thread(rank.list)] == [8, 5]
    assert_model_equal(await in_thread(dcp_load, rank, 8), 8)
    assert_state_equal((await in_thread(rank.load, 5)).state, 5)


async def test_squatted_slot_and_dcp_directories_are_loud_and_saves_go_on(
    cluster: Cluster, errors: Errors
) -> None:
    await cluster.keeper("n1", shared_root=None, object_url=None, replicas=0)
    node = cluster.shm / "n1"

    def squat() -> None:  # the other uid's own directories under the job's names
        os.mkdir(node / "slots" / JOB, 0o755)
        os.mkdir(node / "dcp" / JOB, 0o755)

    as_uid(SQUATTER, squat)
    rank = cluster.rank("n1")
    with capture_logs() as logs:
        written = [await in_thread(rank.save, state_at(step), step) for step in (5, 6)]
        await in_thread(dcp_save, rank, state_at(8)["model"], 8)
    await cluster.settle()

    # Every save went through, none skipped: snapshots in a fallback slot directory,
    # the DCP set's .metadata in a fallback beside dcp/<job>.
    assert rank.skipped == 0 and all(w is not None for w in written)
    slot_dirs = {w.path.parent for w in written if w is not None}
    assert len(slot_dirs) == 1 and next(iter(slot_dirs)).name.startswith(f"{JOB}.")
    (metadata,) = files_of(cluster, "n1", JOB, 8)
    assert metadata.parent.parent.name.startswith(f"{JOB}.") and metadata.parent.parent.parent == node / "dcp"
    assert os.listdir(node / "slots" / JOB) == [] and os.listdir(node / "dcp" / JOB) == []
    assert [i.step for i in await in_thread(rank.list)] == [8, 6, 5]
    assert_state_equal((await in_thread(rank.load, 6)).state, 6)
    assert_model_equal(await in_thread(dcp_load, rank, 8), 8)
    # Loud: the rank logs each squat, naming who holds the name; the keeper publishes both.
    reasons = {Path(x["directory"]).parent.name: x["reason"] for x in squatted_logs(logs)}
    assert reasons.keys() == {"slots", "dcp"}
    assert all(f"owned by uid {SQUATTER}" in why for why in reasons.values())
    await wait_for(
        lambda: bool(errors.about(f"{node / 'slots' / JOB} is owned by uid {SQUATTER}")), "the slot event"
    )
    await wait_for(
        lambda: bool(
            errors.about(
                f"{node / 'dcp' / JOB} (a directory of uid {SQUATTER}) is not the directory of {JOB}"
            )
        ),
        "the dcp event",
    )


async def test_the_keeper_takes_a_fallback_directory_only_if_it_is_the_jobs_own(cluster: Cluster) -> None:
    await cluster.keeper("n1", shared_root=None, object_url=None, replicas=0)
    dcp_dir = cluster.shm / "n1" / "dcp"
    sock = str(cluster.shm / "n1" / "keeper.sock")
    step = step_key(9)
    own, theirs, link = (dcp_dir / f"{JOB}.{c * 16}" for c in "abc")

    def write_dir(top: Path) -> None:
        (top / step).mkdir(parents=True)
        (top / step / "__0_0.distcp").write_bytes(b"w" * 4096)

    write_dir(own)
    as_uid(SQUATTER, lambda: write_dir(theirs))  # a fallback name, made by another uid
    os.symlink(own, link)  # a fallback name, a symlink (to a directory the job owns)
    shutil.copytree(own, dcp_dir / f"{JOB}.zz")  # not a fallback name
    shutil.copytree(own, dcp_dir / f"evil.{'d' * 16}")  # another job's fallback name
    refused = [theirs, link, dcp_dir / f"{JOB}.zz", dcp_dir / f"evil.{'d' * 16}"]

    def register(top: Path) -> dict[str, Any]:
        return wire.call(sock, {"op": "register", "job": JOB, "step": 9, "dir": str(top / step)}, 30.0)

    with capture_logs() as logs:
        for top in refused:
            with pytest.raises(wire.WireError):
                await in_thread(register, top)
    assert len([x for x in logs if x["event"] == "register_refused"]) == len(refused)
    assert await in_thread(Checkpointer(JOB, node="n1", root=cluster.shm).list) == []
    # The job's own fallback directory: taken.
    assert (await in_thread(register, own))["ok"] is True
    assert [i.step for i in await in_thread(Checkpointer(JOB, node="n1", root=cluster.shm).list)] == [9]


async def test_a_dcp_file_swapped_after_its_check_is_never_read(cluster: Cluster) -> None:
    await cluster.keeper("n1", shared_root=None, object_url=None, replicas=0)
    rank = cluster.rank("n1")
    await in_thread(dcp_save, rank, state_at(8)["model"], 8)
    await in_thread(dcp_save, rank, state_at(9)["model"], 9)  # the same layout, other values
    await cluster.settle()

    import torch.distributed.checkpoint as dcp

    from phalanx.checkpoint.dcp import TieredReader

    reader = await in_thread(lambda: TieredReader(JOB, 8, checkpointer=rank))
    # Verified; now someone of the job's uid renames step 9's file over step 8's.
    (data,) = files_of(cluster, "n1", PART, 8)
    (forged,) = files_of(cluster, "n1", PART, 9)
    swap = data.with_name(".swap")
    shutil.copyfile(forged, swap)
    os.replace(swap, data)
    into = {k: torch.zeros_like(v) for k, v in state_at(8)["model"].items()}
    await in_thread(functools.partial(dcp.load, into, storage_reader=reader, no_dist=True))
    del reader  # the files it verified are closed with it
    assert_model_equal(into, 8)
