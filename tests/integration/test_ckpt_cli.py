"""``phalanx ckpt list|show|rm`` against a real nats-server, a real S3 server (moto) and
real keepers in this process (the ``Cluster`` of test_checkpoint.py): what the commands
print is what the catalog holds, and ``rm`` removes a checkpoint from every tier and
from the catalog -- also on a keeper that was down when it ran -- and needs the admin
role where the server enforces roles. The command runs as a process of its own, as an
operator runs it, while the keepers go on in this one."""

from __future__ import annotations

import asyncio
import json
import os
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from phalanx.bus import Bus
from phalanx.checkpoint import Tier
from phalanx.checkpoint.catalog import Catalog, Entry
from phalanx.checkpoint.manifest import Manifest
from phalanx.checkpoint.removal import DETAIL
from phalanx.checkpoint.slots import SlotState, scan
from phalanx.checkpoint.tiers import ObjectTier, ReadFile, step_key
from phalanx.devstack.natsserver import NatsServer
from phalanx.natsauth import NatsAuth
from tests.integration.test_checkpoint import JOB, Cluster, cluster_bucket, in_thread, state_at

__all__ = ["cluster_bucket"]  # the fixture: keepers with object storage, as test_checkpoint.py's


@dataclass
class Ran:
    rc: int
    out: str
    err: str

    def json(self) -> Any:
        return json.loads(self.out)


async def phalanx(url: str, *args: str, env: dict[str, str] | None = None) -> Ran:
    """``phalanx ARGS`` in a process of its own (the keepers in this one go on meanwhile)."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "phalanx.cli",
        *args,
        env={**os.environ, "NATS_URL": url, "COLUMNS": "200", **(env or {})},
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(proc.communicate(), 90)
    assert proc.returncode is not None
    return Ran(proc.returncode, out.decode(), err.decode())


async def until(what: Callable[[], Any], timeout_s: float, why: str) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        got = what()
        if asyncio.iscoroutine(got):
            got = await got
        if got:
            return got
        if time.monotonic() > deadline:
            raise AssertionError(f"{why}: not within {timeout_s}s")
        await asyncio.sleep(0.05)


async def saved(c: Cluster, *steps: int, nodes: tuple[str, ...] = ("n1", "n2")) -> None:
    """Keepers on ``nodes`` (each replicating to the other), ``steps`` saved on n1, settled."""
    for node in nodes:
        if node not in c.keepers:
            await c.keeper(node, replicas=len(nodes) - 1)
    rank = c.rank("n1")
    for step in steps:
        assert rank.save(state_at(step), step) is not None
        await c.settle()
    await c.settle()


async def entries(bus: Bus) -> dict[int, Entry]:
    return await (await Catalog.open(bus)).entries(JOB)


def held_slots(c: Cluster, node: str) -> list[int]:
    """Steps of the HELD or READY slots on ``node``."""
    found = scan(c.shm, node, lambda job: os.geteuid())
    steps = []
    for _, f in found.slots:
        h = f.header()
        if h.state in (SlotState.HELD, SlotState.READY):
            steps.append(h.step)
        f.close()
    return sorted(steps)


def object_paths(c: Cluster, step: int) -> list[str]:
    store = ObjectTier(c.object_url or "")
    return store._objects(f"{JOB}/{step_key(step)}/")


def rows(table: str) -> list[list[str]]:
    """The cells of each row of the rich tables printed."""
    return [[x.strip() for x in line.split("│")[1:-1]] for line in table.splitlines() if line.startswith("│")]


def copies(e: Entry) -> list[tuple[str, str, str, int]]:
    return sorted((c.tier.value, c.node, c.state, c.bytes) for c in e.copies)


# -- list and show ---------------------------------------------------------------------------
async def test_list_and_show_print_what_the_catalog_holds(cluster: Cluster, bus: Bus, nats_url: str) -> None:
    await saved(cluster, 10, 20)
    catalog = await entries(bus)
    assert sorted(catalog) == [10, 20]

    listed = (await phalanx(nats_url, "ckpt", "list", JOB, "--json")).json()
    assert listed["job"] == JOB
    assert [c["step"] for c in listed["checkpoints"]] == [20, 10]  # newest first
    for got in listed["checkpoints"]:
        e = catalog[got["step"]]
        assert e.manifest is not None
        assert {t: n for t, n in got["tiers"].items() if n} == {t: sorted(n) for t, n in e.tiers().items()}
        assert got["tiers"] == {"memory": ["n1", "n2"], "disk": ["n1"], "shared": ["-"], "object": ["-"]}
        assert (got["kind"], got["origin"], got["bytes"]) == ("snapshot", "n1", e.manifest.total_bytes)
        assert got["manifest"] and not got["removed"]

    table = await phalanx(nats_url, "ckpt", "list", JOB)
    assert table.rc == 0, table.err
    assert rows(table.out) == [  # step, kind, origin, size, age, memory, disk, shared, object
        [str(s), "snapshot", "n1", "3.0 MiB", r[4], "n1,n2", "n1", "yes", "yes"]
        for s, r in zip((20, 10), rows(table.out), strict=True)
    ], table.out

    shown = (await phalanx(nats_url, "ckpt", "show", JOB, "--json")).json()  # the newest
    e = catalog[20]
    assert e.manifest is not None
    assert shown["step"] == 20 and shown["removed"] is None
    assert shown["manifest"]["kind"] == "snapshot" and shown["manifest"]["origin"] == "n1"
    assert shown["manifest"]["files"] == [{"name": f.name, "size": f.size} for f in e.manifest.files]
    got = sorted((c["tier"], c["node"], c["state"], c["bytes"]) for c in shown["copies"])
    assert got == copies(e)
    assert {c["node"] for c in shown["copies"] if c["tier"] in ("shared", "object")} == {"-"}
    assert all(0 <= c["age_s"] < 120 for c in shown["copies"])

    table = await phalanx(nats_url, "ckpt", "show", JOB, "10")
    assert table.rc == 0, table.err
    assert f"{JOB}@10" in table.out and "snapshot" in table.out and "origin n1" in table.out
    cells = rows(table.out)
    size = str(catalog[10].manifest.total_bytes)  # type: ignore[union-attr]
    for tier, node in (("memory", "n1"), ("memory", "n2"), ("disk", "n1"), ("shared", "-"), ("object", "-")):
        assert [tier, node, "complete", size, "3.0 MiB"] in [r[:5] for r in cells], table.out
    assert ["state.phx", size, "3.0 MiB"] in cells, table.out

    missing = await phalanx(nats_url, "ckpt", "show", JOB, "99")
    assert missing.rc == 2 and f"no checkpoint {JOB}@99" in missing.err and missing.err.count("\n") == 1
    none = await phalanx(nats_url, "ckpt", "list", "nosuchjob", "--json")
    assert none.rc == 0 and none.json() == {"job": "nosuchjob", "checkpoints": []}


# -- rm --------------------------------------------------------------------------------------
async def test_rm_removes_the_checkpoint_from_every_tier_and_the_catalog(
    cluster: Cluster, bus: Bus, nats_url: str
) -> None:
    await saved(cluster, 10, 20)
    tmp, shm = cluster.tmp, cluster.shm
    assert (tmp / "disk" / "n1" / JOB / step_key(10)).is_dir() and (
        tmp / "shared" / JOB / step_key(10)
    ).is_dir()
    assert (shm / "n2" / "replicas" / JOB / step_key(10)).is_dir()
    assert object_paths(cluster, 10) and held_slots(cluster, "n1") == [10, 20]
    before = await entries(bus)

    done = await phalanx(nats_url, "ckpt", "rm", JOB, "10", "--json")
    assert done.rc == 0, done.err
    out = done.json()
    assert out["removed"] == [f"{JOB}@10"] and out["copies_left"] == []
    assert sorted((c["tier"], c["node"]) for c in out["copies_removed"]) == sorted(
        (c.tier.value, c.node) for c in before[10].copies
    )

    # Every tier: n1's slot freed, n2's replica, n1's disk copy, the shared and object copies gone.
    await until(lambda: held_slots(cluster, "n1") == [20], 10, "n1's slot of step 10 freed")
    assert (JOB, 10) not in cluster.keepers["n1"].memory and (JOB, 10) not in cluster.keepers["n2"].memory
    assert not (shm / "n2" / "replicas" / JOB / step_key(10)).exists()
    assert not (tmp / "disk" / "n1" / JOB / step_key(10)).exists()
    assert not (tmp / "shared" / JOB / step_key(10)).exists()
    assert object_paths(cluster, 10) == []
    # ... and the catalog: no manifest, no copy, the tombstone.
    after = await entries(bus)
    assert after[10].manifest is None and after[10].copies == []
    assert after[10].removed is not None and after[10].removed.created == before[10].manifest.created  # type: ignore[union-attr]
    deleted = {(e.tier, e.node) for e in cluster.events if e.step == 10 and e.state == "deleted"}
    assert {t for t, _ in deleted} == {"memory", "disk", "shared", "object"}
    assert all(e.detail == DETAIL for e in cluster.events if e.step == 10 and e.state == "deleted")

    # Step 20 is untouched, and is what a rank loads now.
    assert copies(after[20]) == copies(before[20])
    (info,) = await in_thread(cluster.rank("n1").list)
    assert info.step == 20
    listed = (await phalanx(nats_url, "ckpt", "list", JOB, "--json")).json()
    assert [c["step"] for c in listed["checkpoints"]] == [20]
    gone = await phalanx(nats_url, "ckpt", "show", JOB, "10")
    assert gone.rc == 2 and f"no checkpoint {JOB}@10" in gone.err


async def test_rm_of_an_unknown_step_changes_nothing_and_exits_2(
    cluster: Cluster, bus: Bus, nats_url: str
) -> None:
    await saved(cluster, 10, nodes=("n1",))
    kv = (await Catalog.open(bus)).kv
    before = await kv.latest(f"{JOB}.>")  # (a keeper refreshes its own =keeper key meanwhile)
    for argv, says in (
        (["ckpt", "rm", JOB, "11"], f"no checkpoint {JOB}@11 in the catalog"),
        (["ckpt", "rm", "otherjob", "10"], "no checkpoint otherjob@10 in the catalog"),
        (["ckpt", "rm", "bad.job", "10"], "'bad.job' is not a job name"),
        (["ckpt", "rm", JOB, "ten"], "'ten' is not a valid integer"),
    ):
        ran = await phalanx(nats_url, *argv)
        assert ran.rc == 2, (argv, ran)
        assert says in ran.err and ran.err.count("\n") == 1 and ran.err.startswith("phalanx ckpt rm"), ran.err
        assert ran.out == ""
    assert await kv.latest(f"{JOB}.>") == before
    assert held_slots(cluster, "n1") == [10]
    assert (cluster.tmp / "shared" / JOB / step_key(10)).is_dir() and object_paths(cluster, 10)


async def test_a_keeper_down_during_rm_removes_its_copies_when_it_starts(
    cluster: Cluster, bus: Bus, nats_url: str
) -> None:
    await saved(cluster, 10, nodes=("n1",))
    await cluster.keepers.pop("n1").stop()  # down: its slot, shared memory and disk stay

    done = await phalanx(nats_url, "ckpt", "rm", JOB, "10", "--wait", "0.5", "--json")
    assert done.rc == 0, done.err
    left = {(c["tier"], c["node"]) for c in done.json()["copies_left"]}
    assert left == {("memory", "n1"), ("disk", "n1"), ("shared", "-"), ("object", "-")}
    assert held_slots(cluster, "n1") == [10]  # nobody there to free it

    # It starts again: the held slot is freed before it would be taken (and its manifest
    # committed) again, and its disk, shared and object copies go.
    await cluster.keeper("n1")
    await cluster.settle()
    assert held_slots(cluster, "n1") == []
    e = (await entries(bus))[10]
    assert e.manifest is None and e.copies == [] and e.removed is not None
    assert not (cluster.tmp / "disk" / "n1" / JOB / step_key(10)).exists()
    assert not (cluster.tmp / "shared" / JOB / step_key(10)).exists()
    assert object_paths(cluster, 10) == []
    listed = (await phalanx(nats_url, "ckpt", "list", JOB, "--json")).json()
    assert listed["checkpoints"] == []

    # A later save of the same step is a new checkpoint: the tombstone leaves it alone.
    cluster.rank("n1").save(state_at(10), 10)
    await cluster.settle()
    e = (await entries(bus))[10]
    assert e.manifest is not None and e.removed is not None and not e.removed.of(e.manifest)
    assert e.tiers() == {"memory": ["n1"], "disk": ["n1"], "shared": ["-"], "object": ["-"]}


# -- who may ---------------------------------------------------------------------------------
async def test_reading_needs_any_role_and_rm_the_admin_role(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    auth = NatsAuth.generate()
    server = NatsServer(store_dir=tmp_path / "nats", config_file=auth.write_config(tmp_path / "nats.conf"))
    server.start()
    buses: list[Bus] = []
    try:

        async def as_role(role: str, ensure: bool = False) -> Bus:
            with monkeypatch.context() as m:
                for k, v in auth.env(role).items():
                    m.setenv(k, v)
                buses.append(await Bus.connect(server.url, name=role, ensure=ensure))
            return buses[-1]

        await as_role("admin", ensure=True)  # provisions the streams and the buckets
        keepers = Cluster(await as_role("replication"), tmp_path, None)  # the keepers' own role
        try:
            await keepers.keeper("n1")
            keepers.rank("n1").save(state_at(10), 10)
            await keepers.settle()
            kv = (await Catalog.open(buses[0])).kv
            before = await kv.latest(f"{JOB}.>")

            observer = await phalanx(server.url, "ckpt", "list", JOB, "--json", env=auth.env("observer"))
            assert observer.rc == 0, observer.err
            assert [c["step"] for c in observer.json()["checkpoints"]] == [10]

            refused = await phalanx(server.url, "ckpt", "rm", JOB, "10", env=auth.env("observer"))
            assert refused.rc == 1, refused
            assert "only the admin role" in refused.err and refused.err.count("\n") == 1, refused.err
            assert await kv.latest(f"{JOB}.>") == before  # nothing written

            done = await phalanx(server.url, "ckpt", "rm", JOB, "10", "--json", env=auth.env("admin"))
            assert done.rc == 0, done.err
            assert done.json()["copies_left"] == []  # the keeper (replication) watched and removed them
            assert not (tmp_path / "shared" / JOB / step_key(10)).exists()
            assert held_slots(keepers, "n1") == []
        finally:
            await keepers.close()
    finally:
        for b in buses:
            await b.close()
        server.cleanup()


async def test_a_copy_drained_after_rm_is_removed_too(cluster: Cluster, bus: Bus, nats_url: str) -> None:
    """The shared drain is in flight when rm runs (it read the checkpoint before, and
    writes it after): the copy it records is swept as soon as it is."""
    k1 = await cluster.keeper("n1")
    entered, release = threading.Event(), threading.Event()
    store = k1.stores[Tier.SHARED]
    put = store.put

    def late_put(m: Manifest, read: ReadFile, *args: Any, **kwargs: Any) -> None:
        data = {f.name: bytes(read(f.name)) for f in m.files}  # read while it is still there
        entered.set()
        release.wait(60)
        put(m, lambda name: memoryview(data[name]), *args, **kwargs)

    store.put = late_put  # type: ignore[method-assign]
    cluster.rank("n1").save(state_at(10), 10)
    await until(entered.is_set, 30, "the shared drain starts")
    done = await phalanx(nats_url, "ckpt", "rm", JOB, "10", "--wait", "0", "--json")
    assert done.rc == 0, done.err
    await until(lambda: not (cluster.tmp / "disk" / "n1" / JOB / step_key(10)).exists(), 10, "disk copy gone")
    release.set()  # the shared copy is written now, and recorded complete ...
    await until(
        lambda: any(e.tier == "shared" and e.step == 10 for e in cluster.events), 10, "shared drained"
    )
    await k1.idle()

    async def nothing_left() -> bool:  # ... and removed by the keeper that watches the step
        e = (await entries(bus))[10]
        return (
            e.manifest is None and not e.copies and not (cluster.tmp / "shared" / JOB / step_key(10)).exists()
        )

    await until(nothing_left, 10, "the late shared copy removed")
    shared = lambda: [e.state for e in cluster.events if e.step == 10 and e.tier == "shared"]  # noqa: E731
    await until(lambda: shared() == ["complete", "deleted"], 10, "recorded, then removed")
    assert held_slots(cluster, "n1") == [] and object_paths(cluster, 10) == []


async def test_rm_of_a_dcp_checkpoint_removes_the_set_and_its_parts(
    cluster: Cluster, bus: Bus, nats_url: str
) -> None:
    import torch.distributed.checkpoint as dcp

    from phalanx.checkpoint.dcp import TieredWriter

    await cluster.keeper("n1", replicas=0)
    rank = cluster.rank("n1")
    state = state_at(8)["model"]
    await in_thread(
        lambda: dcp.async_save(
            state, storage_writer=TieredWriter(JOB, 8, checkpointer=rank), no_dist=True
        ).result()  # type: ignore[union-attr]
    )
    await cluster.settle()
    catalog = await Catalog.open(bus)
    m = await catalog.manifest(JOB, 8)
    assert m is not None and m.kind == "dcp" and m.parts
    jobs = [JOB, *sorted(m.parts)]

    part = await phalanx(nats_url, "ckpt", "rm", jobs[1], "8")  # one rank's part alone: refused
    assert part.rc == 2 and "part of a DCP checkpoint" in part.err, part
    done = await phalanx(nats_url, "ckpt", "rm", JOB, "8", "--json")
    assert done.rc == 0, done.err
    assert done.json()["removed"] == [f"{j}@8" for j in jobs] and done.json()["copies_left"] == []
    for j in jobs:
        e = (await catalog.entries(j))[8]
        assert e.manifest is None and e.copies == [] and e.removed is not None, j
        assert not (cluster.tmp / "disk" / "n1" / j / step_key(8)).exists()
        assert not (cluster.tmp / "shared" / j / step_key(8)).exists()
        assert not (cluster.shm / "n1" / "dcp" / j / step_key(8)).exists()
    assert cluster.keepers["n1"].memory == {}
