"""The planner leader's book of recoveries in flight: each observed exactly once.

A recovery opens when the planner commits the plan that answers a fault (its
detection and plan times known), gets its ``notify`` time when every member has
acknowledged, and completes when every member of that generation has reported its
first step (``RecoveryDone``, one per rank, each with its phase times): then
``phalanx_recoveries_total`` and ``phalanx_recovery_downtime_seconds`` are observed
once for it (:mod:`phalanx.metrics`). Reports are keyed by worker, so a redelivered
one counts once.

A recovery still open when the job's next generation is committed for another
fault (a second crash during the first recovery) is carried into that one: its
downtime runs until the job trains again, so it completes with it (its own
detect/plan/notify, and total from its own fault). A report of a newer generation
completes whatever is open (a planned resize may follow before every old member
reported). Acknowledgements and reports arrive by different consumers: a recovery
whose reports are all in while its plan's acknowledgements are still due
(``acks_due``) completes with the last acknowledgement. One that gets no complete set of reports within ``timeout_s`` is
observed with the reports it has; with none, it is dropped with a warning, counted
by neither metric. Only the leader keeps the book; a replica that stops leading
forgets it (a recovery in flight across a leader change is not observed).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from phalanx.contract import RecoveryDone
from phalanx.metrics import PlannerMetrics

RANK_PHASES = ("abort", "comm_init", "state_transfer", "data_restore", "first_step")


@dataclass(frozen=True)
class Fault:
    """What the planner knows of a fault when it receives it."""

    cause: str  # a cause_class
    fault_at: float  # wall time the fault happened (the detector's inference)
    detected_at: float  # wall time of the verdict
    received: float = field(default_factory=time.monotonic)


@dataclass
class _Recovery:
    job: str
    incident: str
    fault: Fault
    generation: int
    members: frozenset[str]
    committed_at: float
    opened: float  # monotonic
    acked_at: float | None = None
    reports: dict[str, RecoveryDone] = field(default_factory=dict)
    carried: list[_Recovery] = field(default_factory=list)  # superseded, completing with this one


class RecoveryBook:
    def __init__(
        self,
        metrics: PlannerMetrics,
        log: Any,
        timeout_s: float = 300.0,
        clock: Callable[[], float] = time.monotonic,
        acks_due: Callable[[str, int], bool] = lambda job, generation: False,
    ) -> None:
        self.metrics, self.log = metrics, log
        self.timeout_s = timeout_s
        self.clock = clock
        self.acks_due = acks_due  # whether (job, generation) has acknowledgements on their way
        self._open: dict[str, _Recovery] = {}  # job -> the recovery of its newest generation
        self.observed = 0

    def opened(
        self,
        job: str,
        incident: str,
        fault: Fault,
        generation: int,
        members: list[str],
        committed_at: float,
    ) -> None:
        """The plan of ``generation`` answering ``fault`` was committed."""
        rec = _Recovery(job, incident, fault, generation, frozenset(members), committed_at, self.clock())
        prev = self._open.pop(job, None)
        if prev is not None:
            rec.carried = [*prev.carried, prev]
            prev.carried = []
        self._open[job] = rec

    def acked(self, job: str, generation: int, at: float) -> None:
        """Every member acknowledged ``generation``'s plan."""
        rec = self._open.get(job)
        if rec is not None and rec.generation == generation and rec.acked_at is None:
            rec.acked_at = at
            if rec.members <= rec.reports.keys():  # every report came first (see reported)
                self._complete(rec)

    def reported(self, done: RecoveryDone) -> None:
        rec = self._open.get(done.job)
        if rec is None:
            return
        if done.generation > rec.generation:  # the job moved on: the open recovery is over
            self._complete(rec, end=done.ts)
        elif done.generation == rec.generation and done.worker in rec.members:
            rec.reports[done.worker] = done
            # Acks and reports come by different consumers: the last ack may still be queued
            # behind another input when the last report is in. Complete with it, then.
            acks_due = rec.acked_at is None and self.acks_due(rec.job, rec.generation)
            if rec.members <= rec.reports.keys() and not acks_due:
                self._complete(rec)

    def expire(self) -> None:
        """Complete (or drop) recoveries whose reports did not all come within the timeout."""
        now = self.clock()
        for rec in [r for r in self._open.values() if now - r.opened > self.timeout_s]:
            missing = sorted(rec.members - rec.reports.keys())
            self.log.warning(
                "recovery_reports_missing", job=rec.job, incident=rec.incident, missing=missing[:16]
            )
            self._complete(rec)

    def forget(self) -> None:
        self._open.clear()

    def _complete(self, rec: _Recovery, end: float | None = None) -> None:
        del self._open[rec.job]
        if rec.reports:
            end = max(d.ts for d in rec.reports.values())
        if end is None:
            self.log.warning("recovery_not_observed", job=rec.job, incident=rec.incident, reason="no reports")
            return
        phases = {p: max(d.phases_ms.get(p, 0.0) for d in rec.reports.values()) / 1e3 for p in RANK_PHASES}
        phases = {p: v for p, v in phases.items() if any(p in d.phases_ms for d in rec.reports.values())}
        for old in rec.carried:
            self._observe(old, {}, end)
        self._observe(rec, phases, end)

    def _observe(self, rec: _Recovery, rank_phases: dict[str, float], end: float) -> None:
        f = rec.fault
        phases = {
            "detect": f.detected_at - f.fault_at,
            "plan": rec.committed_at - f.detected_at,
            **({"notify": rec.acked_at - rec.committed_at} if rec.acked_at is not None else {}),
            **rank_phases,
            "total": end - f.fault_at,
        }
        for phase, seconds in phases.items():
            self.metrics.downtime.labels(rec.job, phase).observe(max(0.0, seconds))
        self.metrics.recoveries.labels(rec.job, f.cause).inc()
        self.observed += 1
        self.log.info(
            "recovery_observed",
            job=rec.job,
            incident=rec.incident,
            cause=f.cause,
            generation=rec.generation,
            downtime_ms=round(phases["total"] * 1e3, 1),
        )
