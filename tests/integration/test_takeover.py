"""Drain takeover (phalanx.checkpoint.takeover) with a real nats-server, a real S3 server
(moto) and real keepers in this process: the node that took a snapshot is lost in the
middle of its drain, and exactly one keeper holding its replica finishes the shared and
object copies, claimed through KV, the catalog naming who drained them."""

from __future__ import annotations

import asyncio
import inspect
import threading
import time
from collections.abc import Callable
from typing import Any

from phalanx.bus import Bus
from phalanx.checkpoint import Tier
from phalanx.checkpoint.catalog import DONE, DRAINING, Catalog, Entry
from phalanx.checkpoint.keeper import Keeper
from phalanx.checkpoint.manifest import Manifest
from phalanx.checkpoint.tiers import ObjectTier, ReadFile
from phalanx.contract import CheckpointEvent
from tests.integration.test_checkpoint import JOB, Cluster, cluster_bucket, state_at

__all__ = ["cluster_bucket"]  # the fixture: keepers with object storage, as test_checkpoint.py's

FAST = {"refresh_s": 0.2, "lost_after_s": 1.0}  # a keeper is lost ~1 s after its last refresh


class Stall:
    """A store's put that stalls until released, then fails: a drain in flight when its
    node dies (the keeper is stopped while the put waits; nothing reaches the store)."""

    def __init__(self, keeper: Keeper, tier: Tier) -> None:
        self.entered, self.release = threading.Event(), threading.Event()
        keeper.stores[tier].put = self.put  # type: ignore[method-assign]

    def put(self, m: Manifest, read: ReadFile, *args: Any, **kwargs: Any) -> None:
        self.entered.set()
        self.release.wait(60)
        raise OSError("the node died in the middle of this drain")


def count_puts(keeper: Keeper, tier: Tier, puts: list[str]) -> None:
    store = keeper.stores[tier]
    put = store.put

    def counted(m: Manifest, read: ReadFile, *args: Any, **kwargs: Any) -> None:
        puts.append(keeper.node)
        put(m, read, *args, **kwargs)

    store.put = counted  # type: ignore[method-assign]


async def until(what: Callable[[], Any], timeout_s: float, why: str) -> Any:
    """What ``what()`` (awaited if it is a coroutine) returns once it is truthy."""
    deadline = time.monotonic() + timeout_s
    while True:
        got = what()
        if inspect.isawaitable(got):
            got = await got
        if got:
            return got
        if time.monotonic() > deadline:
            raise AssertionError(f"{why}: not within {timeout_s}s")
        await asyncio.sleep(0.05)


def events(c: Cluster, tier: str, state: str = "complete") -> list[CheckpointEvent]:
    return [e for e in c.events if e.tier == tier and e.state == state]


async def entry(bus: Bus, step: int) -> Entry:
    return (await (await Catalog.open(bus)).entries(JOB))[step]


async def test_the_replica_holder_finishes_the_drain_of_a_node_lost_mid_drain(
    cluster: Cluster, bus: Bus
) -> None:
    k1 = await cluster.keeper("n1", replicas=1, **FAST)
    await cluster.keeper("n2", replicas=1, **FAST)
    stall = Stall(k1, Tier.OBJECT)  # n1's upload to the object store hangs
    cluster.rank("n1").save(state_at(5), 5)
    await until(stall.entered.is_set, 30, "n1 starts its object drain")
    replica = await until(
        lambda: [e for e in events(cluster, "memory") if e.node == "n2"], 30, "n2's replica"
    )
    assert replica[0].detail == "replica of n1"

    # n1 is slow, not lost: it refreshes its registration, so nobody takes its drain over.
    await asyncio.sleep(2 * FAST["lost_after_s"])
    catalog = await Catalog.open(bus)
    assert await catalog.claim_of(JOB, 5) is None
    assert events(cluster, "object") == []

    await cluster.kill("n1")  # its keeper, memory and disk gone mid-drain
    stall.release.set()
    done = await until(lambda: events(cluster, "object"), 20, "the object copy, drained by n2")
    assert [(e.node, e.detail) for e in done] == [("n2", "drain taken over from n1")]
    await cluster.keepers["n2"].idle()

    e = await entry(bus, 5)
    assert e.tiers()["object"] == ["-"] and e.tiers()["shared"] == ["-"]
    (obj,) = [c for c in e.complete() if c.tier is Tier.OBJECT]
    assert obj.by == "n2"  # the catalog says who drained it
    assert e.takeover is not None and (e.takeover.node, e.takeover.origin) == ("n2", "n1")
    assert e.takeover.state == DONE
    assert len(events(cluster, "shared")) == 1  # drained once, by whichever keeper got there
    store = cluster.keepers["n2"].stores[Tier.OBJECT]
    assert isinstance(store, ObjectTier)
    (m,) = store.manifests(JOB)
    assert m.step == 5 and m.origin == "n1" and store.damage(m) == []
    assert cluster.keepers["n2"].counters["taken_over"] == 1


async def test_of_two_replica_holders_racing_exactly_one_drains(cluster: Cluster, bus: Bus) -> None:
    # n1 has no object tier: its checkpoint reaches the object store only by a takeover.
    await cluster.keeper("n1", replicas=2, object_url=None, **FAST)
    k2 = await cluster.keeper("n2", replicas=2, **FAST)
    k3 = await cluster.keeper("n3", replicas=2, **FAST)
    puts: list[str] = []
    count_puts(k2, Tier.OBJECT, puts)
    count_puts(k3, Tier.OBJECT, puts)
    cluster.rank("n1").save(state_at(9), 9)
    await until(lambda: {e.node for e in events(cluster, "memory")} == {"n1", "n2", "n3"}, 30, "replicas")
    await cluster.keepers["n1"].idle()
    await cluster.kill("n1")

    # Both loops race for it; so do these ticks, run at once, again and again.
    deadline = time.monotonic() + 3 * FAST["lost_after_s"]
    started: list[tuple[str, int]] = []
    while time.monotonic() < deadline:
        for got in await asyncio.gather(k2.takeover.tick(), k3.takeover.tick()):
            started.extend(got)
        await asyncio.sleep(0.05)
    await until(lambda: events(cluster, "object"), 20, "the object copy")
    await k2.idle()
    await k3.idle()
    await asyncio.sleep(4 * FAST["refresh_s"])  # loops that would drain it again have had their turn

    (done,) = events(cluster, "object")
    assert puts == [done.node]  # one put, by the keeper whose event says so
    assert len(started) <= 1
    e = await entry(bus, 9)
    assert e.takeover is not None and e.takeover.node == done.node and e.takeover.state == DONE
    (obj,) = [c for c in e.complete() if c.tier is Tier.OBJECT]
    assert obj.by == done.node
    assert sum(k.counters.get("taken_over", 0) for k in (k2, k3)) == 1


async def test_a_claim_is_left_to_a_live_claimer_and_taken_from_a_lost_one(
    cluster: Cluster, bus: Bus
) -> None:
    await cluster.keeper("n1", replicas=1, object_url=None, **FAST)
    k2 = await cluster.keeper("n2", replicas=1, **FAST)
    await cluster.keeper("n3", replicas=0, **FAST)  # alive, holds no replica of it
    puts: list[str] = []
    count_puts(k2, Tier.OBJECT, puts)
    cluster.rank("n1").save(state_at(3), 3)
    await until(lambda: [e for e in events(cluster, "memory") if e.node == "n2"], 30, "n2's replica")
    await cluster.keepers["n1"].idle()
    catalog = await Catalog.open(bus)
    await catalog.claim(JOB, 3, "n3", "n1")  # n3 claimed it (and then does nothing)
    await cluster.kill("n1")

    await asyncio.sleep(3 * FAST["lost_after_s"])  # n1 is lost by now; n3 is not
    claim = await catalog.claim_of(JOB, 3)
    assert claim is not None and (claim.node, claim.state) == ("n3", DRAINING)
    assert puts == [] and events(cluster, "object") == []

    await cluster.kill("n3")  # the claimer is lost in turn: n2 takes its claim over (CAS)
    await until(lambda: events(cluster, "object"), 20, "the object copy, drained by n2")
    await k2.idle()
    assert puts == ["n2"]
    claim = await until(lambda: _claim_state(catalog, 3, DONE), 10, "n2 marks the claim done")
    assert (claim.node, claim.origin) == ("n2", "n1")


async def _claim_state(catalog: Catalog, step: int, state: str) -> Any:
    claim = await catalog.claim_of(JOB, step)
    return claim if claim is not None and claim.state == state else None
