"""Which drains a keeper takes over (phalanx.checkpoint.takeover's pure parts): who is
stale, and which held checkpoints of a lost origin still miss a shared or object copy."""

from __future__ import annotations

import asyncio
import socket

import pytest
from phalanx.services.state_replication.service import keeper_config

from phalanx.checkpoint.catalog import (
    COMPLETE,
    DONE,
    DRAINING,
    SHARED_NODE,
    Claim,
    Copy,
    Entry,
    Registration,
    Removed,
)
from phalanx.checkpoint.keeperconfig import KeeperConfig
from phalanx.checkpoint.manifest import Manifest
from phalanx.checkpoint.takeover import TAKEOVER_TIERS, Takeover, answers, orphaned, stale
from phalanx.checkpoint.tiers import Tier
from phalanx.settings import SettingsError


def manifest(step: int, origin: str, job: str = "j") -> Manifest:
    return Manifest.of_buffers(job, step, origin, {"state.phx": bytes([step % 256]) * 10})


def entry(m: Manifest, *complete: Tier, takeover: Claim | None = None) -> Entry:
    copies = [Copy(Tier.MEMORY, m.origin, COMPLETE, m.total_bytes)]
    copies += [Copy(t, SHARED_NODE, COMPLETE, m.total_bytes) for t in complete]
    return Entry(m.job, m.step, m, copies, takeover)


def both(step: int) -> tuple[Tier, ...]:
    return TAKEOVER_TIERS


def test_stale_is_old_or_missing_and_carries_the_address_to_probe() -> None:
    regs = {
        "a": Registration("a", "10.0.0.1:5000", at=100.0),
        "b": Registration("b", "10.0.0.2:5000", at=70.0),
        "c": Registration("c", "10.0.0.3:5000", at=130.0),  # its clock runs ahead: fresh
    }
    assert stale(regs, ["a", "b", "c", "d"], now=110.0, bound_s=30.0) == {"b": "10.0.0.2:5000", "d": ""}
    assert stale(regs, ["a"], now=131.0, bound_s=30.0) == {"a": "10.0.0.1:5000"}
    assert stale(regs, [], now=1e9, bound_s=30.0) == {}


def test_only_a_lost_origins_checkpoints_missing_a_tier_are_orphaned() -> None:
    lost_one, ours, alive = manifest(10, "n1"), manifest(11, "me"), manifest(12, "n3")
    drained, half = manifest(13, "n1"), manifest(14, "n1")
    entries = {
        (m.job, m.step): e
        for m, e in [
            (lost_one, entry(lost_one)),
            (ours, entry(ours)),
            (alive, entry(alive)),
            (drained, entry(drained, Tier.SHARED, Tier.OBJECT)),
            (half, entry(half, Tier.SHARED)),
        ]
    }
    got = orphaned("me", [lost_one, ours, alive, drained, half], {"n1", "me"}, entries, both)
    assert [(m.step, tiers) for m, tiers in got] == [
        (14, (Tier.OBJECT,)),  # newest first; shared is complete already
        (10, (Tier.SHARED, Tier.OBJECT)),
    ]


def test_what_the_catalog_does_not_commit_or_a_done_claim_is_left_alone() -> None:
    gone, other, done, claimed = manifest(1, "n1"), manifest(2, "n1"), manifest(3, "n1"), manifest(4, "n1")
    rewritten = Manifest.of_buffers("j", 2, "n1", {"state.phx": b"another save"})
    entries = {
        ("j", 2): entry(rewritten),  # the catalog commits another checkpoint of step 2
        ("j", 3): entry(done, takeover=Claim("n2", "n1", DONE, 0.0)),
        ("j", 4): entry(claimed, takeover=Claim("n2", "n1", DRAINING, 0.0)),  # the claim decides
    }
    got = orphaned("me", [gone, other, done, claimed], {"n1"}, entries, both)
    assert [m.step for m, _ in got] == [4]


def test_the_tiers_are_those_the_step_drains_to() -> None:
    m = manifest(7, "n1")
    got = orphaned("me", [m], {"n1"}, {("j", 7): entry(m)}, lambda step: (Tier.OBJECT,) if step % 7 else ())
    assert got == []
    got = orphaned("me", [m], {"n1"}, {("j", 7): entry(m)}, lambda step: (Tier.OBJECT,))
    assert got == [(m, (Tier.OBJECT,))]


def test_a_closed_port_does_not_answer_and_an_open_one_does() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        assert asyncio.run(answers(f"127.0.0.1:{port}", 2.0))
    assert not asyncio.run(answers(f"127.0.0.1:{port}", 2.0))
    assert not asyncio.run(answers("", 2.0)) and not asyncio.run(answers("nohost", 2.0))


def test_lost_after_must_exceed_the_refresh_period() -> None:
    cfg = KeeperConfig("n1", refresh_s=5.0, lost_after_s=5.0)
    with pytest.raises(ValueError, match="must exceed refresh_s"):
        Takeover(cfg, None, None, None, None, None)  # type: ignore[arg-type]


def test_the_keeper_reads_its_refresh_and_lost_bounds(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PHALANX_KEEPER_KEY", "k" * 32)
    cfg = keeper_config("n1")
    assert (cfg.refresh_s, cfg.lost_after_s) == (5.0, 30.0)
    monkeypatch.setenv("PHALANX_KEEPER_REFRESH_S", "0.5")
    monkeypatch.setenv("PHALANX_KEEPER_LOST_AFTER_S", "3")
    cfg = keeper_config("n1")
    assert (cfg.refresh_s, cfg.lost_after_s) == (0.5, 3.0)
    monkeypatch.setenv("PHALANX_KEEPER_LOST_AFTER_S", "0.5")
    with pytest.raises(SettingsError, match=r"PHALANX_KEEPER_LOST_AFTER_S='0\.5': .*must exceed"):
        keeper_config("n1")


def test_a_removed_checkpoint_is_not_taken_over() -> None:
    m = manifest(5, "n1")
    e = entry(m)
    e.removed = Removed(m.job, m.step, m.created)
    assert orphaned("me", [m], {"n1"}, {("j", 5): e}, both) == []
    e.removed = Removed(m.job, m.step, m.created - 1)  # an earlier save of the step was removed
    assert [x for x, _ in orphaned("me", [m], {"n1"}, {("j", 5): e}, both)] == [m]
