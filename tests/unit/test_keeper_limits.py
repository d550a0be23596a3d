"""The bounds a keeper applies before it trusts a caller (phalanx.limits), and
the request cap sized from what a real request needs."""

from __future__ import annotations

from typing import Any

from phalanx.checkpoint import wire
from phalanx.checkpoint.keeperconfig import KeeperConfig
from phalanx.checkpoint.manifest import part_job
from phalanx.limits import ConnectionLimits, FailureBudget, ThrottledLog


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_connections_are_bounded_per_key_and_in_total() -> None:
    limits = ConnectionLimits(total=3, per_key=2)
    assert limits.open("a") == "" and limits.open("a") == ""
    assert "one caller (2 at once)" in limits.open("a")
    assert limits.open("b") == ""
    assert "(3 at once)" in limits.open("c")  # the total, whoever asks
    assert limits.held() == 3 and limits.held("a") == 2
    limits.close("a")
    assert limits.open("c") == ""
    for key in ("a", "b", "c"):
        limits.close(key)
    assert limits.held() == 0 and not limits._open  # nothing kept for keys that left


def test_failed_attempts_use_up_a_budget_given_back_over_time() -> None:
    clock = Clock()
    budget = FailureBudget(burst=3, refill_s=10.0, clock=clock)
    for _ in range(3):
        assert budget.allows("10.0.0.1")
        budget.failed("10.0.0.1")
    assert not budget.allows("10.0.0.1")
    assert budget.wait_s("10.0.0.1") == 10.0
    assert budget.allows("10.0.0.2")  # another address is not affected
    clock.now += 9.0
    assert not budget.allows("10.0.0.1")
    clock.now += 1.0
    assert budget.allows("10.0.0.1")  # one try back
    budget.failed("10.0.0.1")
    assert not budget.allows("10.0.0.1")  # and used: still one try per refill_s
    clock.now += 1000.0
    assert budget.allows("10.0.0.1")
    assert not budget._tokens  # a full bucket is forgotten


class Log:
    def __init__(self) -> None:
        self.lines: list[tuple[str, dict[str, Any]]] = []

    def warning(self, event: str, **fields: Any) -> None:
        self.lines.append((event, fields))


def test_a_flood_of_refusals_is_a_few_lines_and_a_count() -> None:
    clock, log = Clock(), Log()
    throttled = ThrottledLog(log, burst=2, every_s=10.0, clock=clock)
    for _ in range(100):
        throttled.warning("peer_refused", "10.0.0.1", peer="10.0.0.1")
    throttled.warning("peer_refused", "10.0.0.2", peer="10.0.0.2")
    assert [f["peer"] for _, f in log.lines] == ["10.0.0.1", "10.0.0.1", "10.0.0.2"]
    clock.now += 10.0
    throttled.warning("peer_refused", "10.0.0.1", peer="10.0.0.1")
    assert log.lines[-1] == ("peer_refused", {"peer": "10.0.0.1", "left_out": 98})


def test_the_request_cap_fits_a_register_of_a_large_dcp_set() -> None:
    """What a DCP coordinator sends (phalanx.checkpoint.dcp): every part and file of a set
    of 4096 ranks, under a 64-character job name, fits well under the default cap."""
    job = "j" * 64
    request = {
        "op": "register",
        "job": job,
        "step": 10**9,
        "dir": f"/dev/shm/phalanx/{'n' * 64}/dcp/{job}/001000000000",
        "parts": [part_job(job, r) for r in range(4096)],
        "files": [*(f"__{r}_0.distcp" for r in range(4096)), ".metadata"],
    }
    size = len(wire.encode_frame(request))
    cap = KeeperConfig(node="n1").max_request_bytes
    assert size < cap // 2, (size, cap)
    assert cap < wire.MAX_FRAME // 8  # far under what the wire itself allows
