"""The per-tier checkpoint policy (``PHALANX_CKPT_TIERS``): its grammar and errors, which
steps go to which tier and what each tier keeps over 1,000 simulated steps, and a keeper
that refuses to start on a bad policy."""

from __future__ import annotations

import asyncio
import doctest
import os
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

import phalanx.settings.parsing as parsing
from phalanx.checkpoint.holdings import Holdings
from phalanx.checkpoint.keeperconfig import KeeperConfig
from phalanx.checkpoint.tiers import DRAIN_ORDER, Tier
from phalanx.settings import RetentionPolicy, TierPolicy, TierRule
from phalanx.settings.parsing import TIERS

POLICY = (
    "memory:every=50,last=2; disk:every=200,last=3; shared:every=200,last=2,pin=400; object:every=500,last=1"
)
JOB = "j1"


def test_the_tier_names_are_the_checkpoint_tiers_memory_then_drain_order() -> None:
    assert TIERS == tuple(t.value for t in Tier)
    assert TIERS[1:] == tuple(t.value for t in DRAIN_ORDER)


def test_the_grammars_examples_hold() -> None:
    result = doctest.testmod(parsing)
    assert result.failed == 0 and result.attempted > 0


def test_the_policy_parses_and_prints_back() -> None:
    p = TierPolicy.parse(POLICY)
    assert p.named == TIERS
    assert p.rule("disk") == TierRule(200, RetentionPolicy(3))
    assert p.rule("shared") == TierRule(200, RetentionPolicy(2, 400))
    assert p.snapshot_every == 50
    assert TierPolicy.parse(str(p)) == p
    # order, spaces and a trailing ';' do not matter; unnamed tiers get the defaults
    q = TierPolicy.parse(" disk : every = 200 ; memory:every=50;")
    assert q.named == ("memory", "disk") and q.rule("object") == TierRule(1, RetentionPolicy(3))
    assert TierPolicy.parse("object:last=4").snapshot_every is None  # memory not named: the job's interval


def test_the_default_is_todays_behaviour() -> None:
    p = TierPolicy()
    all_durable = ("disk", "shared", "object")
    assert all(p.tiers_for(step, all_durable) == all_durable for step in (0, 1, 7, 50, 999))
    assert p.tiers_for(3, ["object", "disk"]) == ("disk", "object")  # drain order, configured only
    assert p.retention() == {
        "memory": RetentionPolicy(2),
        "disk": RetentionPolicy(5),
        "shared": RetentionPolicy(5),
        "object": RetentionPolicy(3),
    }
    cfg = KeeperConfig("n1", disk_root=Path("/d"), object_url="s3://b/p")
    assert cfg.retention == {Tier(t): r for t, r in p.retention().items()}
    assert cfg.drain_tiers(7) == (Tier.DISK, Tier.OBJECT)
    assert KeeperConfig("n1").drain_tiers(7) == ()  # memory only


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("", "names no tier"),
        (" ; ", "names no tier"),
        ("disk", r"'disk': expected 'tier:field=N\[,field=N...\]'"),
        ("disk:", "expected 'tier:field=N"),
        ("tape:last=2", "unknown tier 'tape' .the tiers: memory, disk, shared, object."),
        ("disk:last=2; disk:last=3", "'disk:last=3': disk is named twice"),
        ("disk:keep=3", "unknown field 'keep' .the fields: every, last, pin."),
        ("disk:last", "'last' is not field=N"),
        ("disk:last=2,last=3", "last is given twice"),
        ("disk:last=0", "last='0' is not a whole number >= 1"),
        ("disk:every=-5", "every='-5' is not a whole number >= 1"),
        ("disk:every=x", "every='x' is not a whole number >= 1"),
        ("disk:pin=1.5", "pin='1.5' is not a whole number >= 1"),
        ("memory:every=50; object:every=75", "object's every=75 is not a multiple of memory's every=50"),
        ("disk:every=200,pin=300", "disk's pin=300 is not a multiple of its every=200"),
        ("memory:pin=100", "memory's pin=100: memory keeps only its newest"),
    ],
)
def test_a_bad_policy_is_a_clear_value_error(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        TierPolicy.parse(text)


def test_a_policy_may_name_only_the_tiers_a_keeper_configures() -> None:
    p = TierPolicy.parse("memory:last=3; shared:every=2")
    p.check(["shared"])
    with pytest.raises(
        ValueError, match=r"names shared, which this keeper does not configure .set PHALANX_CKPT_SHARED"
    ):
        p.check(["disk", "object"])
    with pytest.raises(ValueError, match="names shared"):
        KeeperConfig("n1", disk_root=Path("/d"), tier_policy=p)
    TierPolicy.parse("memory:every=10").check([])  # memory always is


# -- 1,000 steps through the keeper's retention ------------------------------------------------
@dataclass
class FakeStore:
    """A durable tier in memory: the steps it holds, and every step it was given."""

    tier: Tier
    held: dict[int, Any] = field(default_factory=dict)
    taken: list[int] = field(default_factory=list)
    location: str = "fake"

    def put(self, m: Any) -> None:
        self.held[m.step] = m
        self.taken.append(m.step)

    def manifests(self, job: str) -> list[Any]:
        return [m for m in self.held.values() if m.job == job]

    def delete(self, job: str, step: int) -> None:
        del self.held[step]


class FakeShm:
    def __init__(self) -> None:
        self.copies: dict[tuple[str, int], Any] = {}
        self.released: list[int] = []

    def release(self, mem: Any) -> None:
        self.released.append(mem.manifest.step)


class FakeRec:
    def __init__(self) -> None:
        self.catalog = SimpleNamespace(entries=self._entries)

    async def _entries(self, job: str) -> dict[int, Any]:
        return {}  # no copy on another node: only this keeper's tiers count

    async def note(self, m: Any, tier: Tier, state: str, **kw: Any) -> None:
        pass


class Node:
    """One keeper's holdings under ``cfg``, driven the way the drains drive them: save a
    checkpoint into memory, put it to each of ``cfg.drain_tiers(step)`` (the tiers that
    are up) with that tier's retention after, then memory's retention."""

    def __init__(self, cfg: KeeperConfig) -> None:
        self.cfg = cfg
        self.shm = FakeShm()
        self.holdings = Holdings(KeeperConfig(cfg.node), self.shm, FakeRec(), SimpleNamespace())  # type: ignore[arg-type]
        self.holdings.cfg = cfg
        self.stores = {t: FakeStore(t) for t in cfg.durable_tiers}
        self.holdings.stores = dict(self.stores)  # type: ignore[arg-type]

    def memory(self) -> list[int]:
        return sorted(s for (_, s) in self.shm.copies)

    async def save(self, step: int, up: bool = True) -> None:
        m = SimpleNamespace(job=JOB, step=step, files=())
        self.shm.copies[(JOB, step)] = SimpleNamespace(manifest=m)
        if up:
            await self.drain(step)
        await self.holdings.retain(JOB, Tier.MEMORY)

    async def drain(self, step: int) -> None:
        m = self.shm.copies[(JOB, step)].manifest
        for tier in self.cfg.drain_tiers(step):
            self.stores[tier].put(m)
            await self.holdings.retain(JOB, tier)


def keeper(policy: str) -> KeeperConfig:
    return KeeperConfig(
        "n1",
        disk_root=Path("/d"),
        shared_root=Path("/s"),
        object_url="s3://b/p",
        tier_policy=TierPolicy.parse(policy),
    )


def test_the_policy_is_honoured_over_1000_steps() -> None:
    cfg = keeper(POLICY)
    node = Node(cfg)
    every = cfg.tier_policy.snapshot_every
    assert every == 50

    async def run() -> None:
        for step in range(every, 1001, every):
            await node.save(step)
            # memory holds its last 2 and nothing else: every durable-bound one is durable at once
            assert node.memory() == list(range(max(every, step - every), step + 1, every))

    asyncio.run(run())
    s = node.stores
    # which steps went to which tier
    assert s[Tier.DISK].taken == s[Tier.SHARED].taken == [200, 400, 600, 800, 1000]
    assert s[Tier.OBJECT].taken == [500, 1000]
    # what each tier keeps at the end
    assert node.memory() == [950, 1000]
    assert sorted(s[Tier.DISK].held) == [600, 800, 1000]  # last=3
    assert sorted(s[Tier.SHARED].held) == [400, 800, 1000]  # last=2, and 400, 800 pinned
    assert sorted(s[Tier.OBJECT].held) == [1000]  # last=1
    # the memory copies no durable tier takes were released by memory's retention alone
    assert node.shm.released == [s for s in range(50, 901, 50)]
    # the same, computed from the pure functions alone
    saves = range(every, 1001, every)
    for tier, store in s.items():
        took = [step for step in saves if tier.value in cfg.tier_policy.tiers_for(step, TIERS)]
        assert store.taken == took
        policy = cfg.retention[tier]
        assert sorted(store.held) == sorted(set(took) - set(policy.expired(took)))


def test_memory_keeps_a_durable_bound_checkpoint_until_it_is_durable() -> None:
    """The durable tiers are down from step 200 to 350: memory's retention releases the
    steps no durable tier takes (250, 300) but keeps 200, bound for disk and shared, until
    its drain is done."""
    node = Node(keeper(POLICY))

    async def run() -> None:
        for step in (50, 100, 150):
            await node.save(step)
        for step in (200, 250, 300, 350):
            await node.save(step, up=False)
            assert 200 in node.memory()  # the newest durable-bound checkpoint, not durable yet
        assert node.memory() == [200, 300, 350]
        await node.drain(200)  # the tiers are back: the drain is retried
        await node.holdings.retain(JOB, Tier.MEMORY)
        assert node.memory() == [300, 350]

    asyncio.run(run())
    assert node.shm.released == [50, 100, 150, 250, 200]


def test_memory_only_retention_is_unchanged() -> None:
    """No durable tier configured: memory's retention alone decides, as before."""
    node = Node(KeeperConfig("n1", tier_policy=TierPolicy.parse("memory:every=10,last=3")))

    async def run() -> None:
        for step in range(10, 101, 10):
            await node.save(step)

    asyncio.run(run())
    assert node.memory() == [80, 90, 100]


# -- the service refuses to start ----------------------------------------------------------------
@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"PHALANX_CKPT_TIERS": "disk:every=200"}, "names disk, which this keeper does not configure"),
        (
            {"PHALANX_CKPT_DISK": "{tmp}/disk", "PHALANX_CKPT_TIERS": "memory:every=50; disk:every=120"},
            "disk's every=120 is not a multiple of memory's every=50",
        ),
        ({"PHALANX_CKPT_TIERS": "memory:every=50,keep=3"}, "unknown field 'keep'"),
    ],
    ids=["unconfigured-tier", "not-a-multiple", "unknown-field"],
)
def test_the_state_replication_service_refuses_a_bad_policy_at_start(
    tmp_path: Path, env: dict[str, str], message: str
) -> None:
    run_env = {k: v for k, v in os.environ.items() if not k.startswith("PHALANX_") and k != "NATS_URL"}
    run_env.update({k: v.format(tmp=tmp_path) for k, v in env.items()})
    run_env["PHALANX_KEEPER_KEY"] = "k" * 32  # all else is good: the policy alone is refused
    run_env["PHALANX_SHM_ROOT"] = str(tmp_path / "shm")
    run_env["NATS_URL"] = "nats://127.0.0.1:1"  # nothing there: a start would fail differently
    proc = subprocess.run(
        [sys.executable, "-m", "phalanx.services.state_replication"],
        env=run_env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.startswith("state-replication: bad setting: PHALANX_CKPT_TIERS="), proc.stderr
    assert message in proc.stderr and proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr
    assert not (tmp_path / "shm").exists() and not (tmp_path / "disk").exists()  # nothing started
