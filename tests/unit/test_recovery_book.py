"""The planner's book of recoveries (services/elasticity_planner/recoveries.py): acks and
reports come by different consumers, so the last report may be in before the last ack."""

from __future__ import annotations

from phalanx.services.elasticity_planner.recoveries import Fault, RecoveryBook

from phalanx.contract import RecoveryDone
from phalanx.metrics import PlannerMetrics
from phalanx.telemetry import get_logger


def _done(worker: str, ts: float) -> RecoveryDone:
    return RecoveryDone(
        job="j",
        ts=ts,
        generation=2,
        worker=worker,
        rank=0,
        step=1,
        incident="i",
        phases_ms={"first_step": 5.0},
    )


def test_reports_before_the_last_ack_complete_with_it() -> None:
    m = PlannerMetrics()
    due = {("j", 2)}
    book = RecoveryBook(m, get_logger(component="test"), acks_due=lambda job, gen: (job, gen) in due)
    book.opened("j", "i", Fault("crash", 100.0, 100.1), 2, ["w0", "w1"], committed_at=100.2)
    book.reported(_done("w0", 101.0))
    book.reported(_done("w1", 101.2))
    get = m.registry.get_sample_value
    assert get("phalanx_recoveries_total", {"job": "j", "cause": "crash"}) is None  # the ack is due
    due.clear()
    book.acked("j", 2, 100.4)
    assert get("phalanx_recoveries_total", {"job": "j", "cause": "crash"}) == 1
    assert get("phalanx_recovery_downtime_seconds_sum", {"job": "j", "phase": "notify"}) == 100.4 - 100.2
    assert get("phalanx_recovery_downtime_seconds_sum", {"job": "j", "phase": "total"}) == 101.2 - 100.0
    book.acked("j", 2, 100.5)
    assert get("phalanx_recoveries_total", {"job": "j", "cause": "crash"}) == 1  # once
