"""DCP checkpoints whose ranks span nodes (phalanx.checkpoint.dcp): one catalog entry,
the set, tying a part per rank kept by each rank's own node's keeper; read back on any
node and at another shard count. Real nats-server, real keepers (in this process, a node
each, under one shared-memory root), ranks as real torch processes over gloo, or as
DCP calls in threads of this process (a process without torch.distributed is rank 0:
one part plus the set).

The keepers keep no replicas and drain to their own disks only, so a part is on the
node that wrote it unless a restore brought it elsewhere through the keepers."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import torch

import phalanx.checkpoint.wire as wire
from phalanx.bus import Bus
from phalanx.checkpoint import Checkpointer, ManifestError, NoCheckpoint
from phalanx.checkpoint.catalog import Catalog
from phalanx.checkpoint.manifest import digest, part_job
from phalanx.checkpoint.tiers import step_key
from tests.integration.test_checkpoint import Cluster, in_thread

ROOT = Path(__file__).resolve().parents[2]
JOB = "dcpn"  # tests/workers/dcp_nodes_worker.py's


@pytest.fixture
async def nodes(bus: Bus, tmp_path: Path) -> AsyncIterator[Cluster]:
    c = Cluster(bus, tmp_path, None)
    await bus.nc.subscribe("phalanx.evt.*.checkpoint", cb=c.on_event)  # every job, parts too
    try:
        for node in ("na", "nb"):
            await c.keeper(node, replicas=0, shared_root=None)
        yield c
    finally:
        await c.close()


def rank_on(c: Cluster, node: str) -> Checkpointer:
    return Checkpointer(JOB, node=node, worker="t", root=c.shm, timeout_s=60)


def tensors(step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return {"w": torch.randn(64, 16, generator=g), "b": torch.randn(16, generator=g)}


def save_here(c: Cluster, node: str, step: int) -> None:
    """A single-process save (rank 0) through the node's keeper."""
    import torch.distributed.checkpoint as dcp

    from phalanx.checkpoint.dcp import TieredWriter

    writer = TieredWriter(JOB, step, checkpointer=rank_on(c, node))
    dcp.async_save(tensors(step), storage_writer=writer, no_dist=True).result()


def load_here(c: Cluster, node: str, step: int | None) -> tuple[int, dict[str, torch.Tensor]]:
    import torch.distributed.checkpoint as dcp

    from phalanx.checkpoint.dcp import TieredReader

    into = {k: torch.zeros_like(v) for k, v in tensors(0).items()}
    reader = TieredReader(JOB, step, checkpointer=rank_on(c, node))
    dcp.load(into, storage_reader=reader, no_dist=True)
    return reader.loaded.step, into


def register(c: Cluster, node: str, job: str, step: int, **fields: Any) -> dict[str, Any]:
    directory = c.shm / node / "dcp" / job / step_key(step)
    request = {"op": "register", "job": job, "step": step, "dir": str(directory), **fields}
    return wire.call(str(c.shm / node / "keeper.sock"), request, 60)


def drop_everywhere(c: Cluster, job: str, step: int) -> list[Path]:
    """Every copy of ``job@step`` on every node (shared memory and disk): gone."""
    gone = [*c.shm.glob(f"*/*/{job}/{step_key(step)}"), *(c.tmp / "disk").glob(f"*/{job}/{step_key(step)}")]
    for d in gone:
        shutil.rmtree(d)
    return gone


# -- one process: a part and the set --------------------------------------------------------
async def test_a_save_is_a_part_per_rank_tied_by_one_set(nodes: Cluster) -> None:
    await in_thread(save_here, nodes, "na", 3)
    catalog = await Catalog.open(nodes.bus)
    the_set = await catalog.manifest(JOB, 3)
    part = await catalog.manifest(part_job(JOB, 0), 3)
    assert the_set is not None and part is not None
    assert [f.name for f in the_set.files] == [".metadata"]
    assert the_set.parts == {f"{JOB}=r0": digest(part.encode())}
    assert (nodes.shm / "na" / "dcp" / f"{JOB}=r0" / step_key(3) / part.files[0].name).is_file()
    assert set(await catalog.entries(JOB)) == {3}  # the job's list: the set only
    assert [i.step for i in await in_thread(rank_on(nodes, "na").list)] == [3]
    await nodes.settle()
    assert {e.job for e in nodes.events} == {JOB}  # a part's events are its job's
    assert any(e.detail.startswith(f"part {JOB}=r0") for e in nodes.events)
    step, got = await in_thread(load_here, nodes, "nb", None)  # another node: through the keepers
    assert step == 3 and all(torch.equal(got[k], v) for k, v in tensors(3).items())


async def test_a_checkpoint_written_before_sets_still_reads(nodes: Cluster) -> None:
    import torch.distributed.checkpoint as dcp

    directory = nodes.shm / "na" / "dcp" / JOB / step_key(4)
    directory.parent.mkdir(mode=0o770, parents=True)
    writer = dcp.FileSystemWriter(directory, sync_files=False)
    await in_thread(lambda: dcp.save(tensors(4), storage_writer=writer, no_dist=True))
    await in_thread(register, nodes, "na", JOB, 4)  # the old register: data and .metadata in one directory
    step, got = await in_thread(load_here, nodes, "na", 4)
    assert step == 4 and all(torch.equal(got[k], v) for k, v in tensors(4).items())


# -- attacks and faults ---------------------------------------------------------------------
async def test_a_set_is_refused_unless_every_part_is_its_jobs_and_committed(nodes: Cluster) -> None:
    await in_thread(save_here, nodes, "na", 1)
    catalog = await Catalog.open(nodes.bus)
    part = await catalog.manifest(part_job(JOB, 0), 1)
    assert part is not None
    names = [f.name for f in part.files]
    d = nodes.shm / "na" / "dcp" / JOB / step_key(5)
    d.mkdir()
    (d / ".metadata").write_bytes(b"not unpickled by the keeper")
    refused = {
        "another job's part": ["other=r0"],
        "a part not registered at this step": [part_job(JOB, 0)],  # r0 is at step 1, not 5
        "a part that is not one": [JOB],
    }
    for why, parts in refused.items():
        with pytest.raises(wire.WireError, match=r"is refused"):
            await in_thread(lambda p=parts: register(nodes, "na", JOB, 5, parts=p, files=names))
        assert await catalog.manifest(JOB, 5) is None, why
    # at step 1, where r0 is committed: files it does not have, or data beside .metadata
    d1 = nodes.shm / "na" / "dcp" / JOB / step_key(1)
    with pytest.raises(wire.WireError, match=r"no part has \['__9_0.distcp'\]"):
        await in_thread(
            lambda: register(nodes, "na", JOB, 1, parts=[part_job(JOB, 0)], files=["__9_0.distcp"])
        )
    (d1 / "__0_0.distcp").write_bytes(b"x")
    with pytest.raises(wire.WireError, match=r"holds \.metadata alone"):
        await in_thread(lambda: register(nodes, "na", JOB, 1, parts=[part_job(JOB, 0)], files=names))
    (d1 / "__0_0.distcp").unlink()
    # the committed set is still the first one: it reads
    step, got = await in_thread(load_here, nodes, "na", 1)
    assert step == 1 and torch.equal(got["w"], tensors(1)["w"])


async def test_a_changed_or_replaced_part_is_refused(nodes: Cluster) -> None:
    await in_thread(save_here, nodes, "na", 1)
    part_dir = nodes.shm / "na" / "dcp" / part_job(JOB, 0) / step_key(1)
    (data,) = part_dir.glob("*.distcp")
    raw = bytearray(data.read_bytes())
    raw[-100] ^= 0xFF
    data.write_bytes(bytes(raw))  # after the keeper committed it
    with pytest.raises(ManifestError, match="digest mismatch"):
        await in_thread(load_here, nodes, "na", 1)
    # re-registered (a new part manifest at the same step, after the set): not the pinned one
    await in_thread(register, nodes, "na", part_job(JOB, 0), 1)
    with pytest.raises(ManifestError, match="not the one the set pinned"):
        await in_thread(load_here, nodes, "na", 1)


async def test_the_newest_set_missing_a_part_falls_back_to_the_older_complete_one(nodes: Cluster) -> None:
    for step in (1, 2):
        await in_thread(save_here, nodes, "na", step)
    await nodes.settle()  # drained to na's disk
    assert drop_everywhere(nodes, part_job(JOB, 0), 2)
    step, got = await in_thread(load_here, nodes, "nb", None)
    assert step == 1 and torch.equal(got["w"], tensors(1)["w"])
    with pytest.raises(NoCheckpoint, match=f"part {JOB}=r0 cannot be had"):
        await in_thread(load_here, nodes, "nb", 2)


# -- four ranks on two nodes, loaded at another shard count -----------------------------------
def run_ranks(c: Cluster, mode: str, world: int, node_of: list[str], out: Path, *extra: str) -> None:
    store = out / f"store-{mode}"
    procs = []
    for rank in range(world):
        env = {**os.environ, "PHALANX_SHM_ROOT": str(c.shm), "PHALANX_KEEPER_NODE": node_of[rank]}
        cmd = [sys.executable, "-m", "tests.workers.dcp_nodes_worker", "--mode", mode]
        cmd += ["--rank", str(rank), "--world", str(world), "--store", str(store), "--out", str(out), *extra]
        procs.append(
            subprocess.Popen(
                cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
            )
        )
    try:
        for rank, p in enumerate(procs):
            log, _ = p.communicate(timeout=180)
            assert p.returncode == 0, f"rank {rank}:\n{log[-4000:]}"
    finally:
        for p in procs:
            p.kill()


def assemble(c: Cluster, step: int, into: Path) -> Path:
    """A plain DCP directory of checkpoint ``step``: the set's .metadata and every part's files."""
    into.mkdir()
    shutil.copy(c.shm / "na" / "dcp" / JOB / step_key(step) / ".metadata", into)
    for f in c.shm.glob(f"*/dcp/{JOB}=r*/{step_key(step)}/*.distcp"):
        shutil.copy(f, into)
    return into


@pytest.mark.slow
async def test_ranks_on_two_nodes_save_one_checkpoint_read_anywhere_at_another_shard_count(
    nodes: Cluster, tmp_path: Path
) -> None:
    out = tmp_path / "out"
    out.mkdir()
    await asyncio.to_thread(run_ranks, nodes, "save", 4, ["na", "na", "nb", "nb"], out, "--steps", "1", "2")
    catalog = await Catalog.open(nodes.bus)
    for step in (1, 2):
        the_set = await catalog.manifest(JOB, step)
        assert the_set is not None and the_set.origin == "na"  # rank 0, the coordinator, is on na
        assert sorted(the_set.parts) == [part_job(JOB, r) for r in range(4)]
        for r in range(4):
            node = "na" if r < 2 else "nb"
            part = await catalog.manifest(part_job(JOB, r), step)
            assert (
                part is not None and part.origin == node and the_set.parts[part.job] == digest(part.encode())
            )
            assert all(
                (nodes.shm / node / "dcp" / part.job / step_key(step) / f.name).is_file() for f in part.files
            )
    assert [i.step for i in await in_thread(rank_on(nodes, "nb").list)] == [2, 1]  # each step once

    # two ranks on a 1-D mesh, both on na: nb's parts come through the keepers
    ref = assemble(nodes, 2, tmp_path / "ref2")
    await asyncio.to_thread(run_ranks, nodes, "load", 2, ["na", "na"], out, "--step", "2", "--ref", str(ref))
    reports = [json.loads((out / f"load{r}.json").read_text()) for r in range(2)]
    assert all(rep["equal"] and rep["step"] == 2 and rep["tensors"] > 6 for rep in reports), reports
    tiers = {name: {rep["parts"][name] for rep in reports} for name in reports[0]["parts"]}
    assert all("peer" in tiers[part_job(JOB, r)] for r in (2, 3)), tiers
    saved, loaded = torch.load(out / "full2.pt"), torch.load(out / "loaded.pt")
    for key, want in saved["model"].items():
        assert torch.equal(loaded["model"][key], want), key
    for fqn, state in saved["optim"]["state"].items():
        for name, want in state.items():
            assert torch.equal(loaded["optim"]["state"][fqn][name], want), (fqn, name)

    # one process, no mesh (full tensors), on nb: na's parts through the keepers
    def whole(step: int | None) -> tuple[int, dict[str, torch.Tensor]]:
        import torch.distributed.checkpoint as dcp

        from phalanx.checkpoint.dcp import TieredReader

        want = torch.load(out / f"full{step or 1}.pt")["model"]
        into = {"model": {k: torch.zeros_like(v) for k, v in want.items()}}
        reader = TieredReader(JOB, step, checkpointer=rank_on(nodes, "nb"))
        dcp.load(into, storage_reader=reader, no_dist=True)
        return reader.loaded.step, into["model"]

    step, got = await in_thread(whole, 2)
    assert step == 2 and all(torch.equal(got[k], v) for k, v in saved["model"].items())

    # rank 2's part of step 2 lost everywhere: the newest complete checkpoint is step 1
    await nodes.settle()
    assert drop_everywhere(nodes, part_job(JOB, 2), 2)
    step, got = await in_thread(whole, None)
    full1 = torch.load(out / "full1.pt")["model"]
    assert step == 1 and all(torch.equal(got[k], v) for k, v in full1.items())
    with pytest.raises(NoCheckpoint, match=f"part {JOB}=r2 cannot be had"):
        await in_thread(whole, 2)
