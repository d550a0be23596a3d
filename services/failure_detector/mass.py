"""Mass silence: many members of one job falling silent at once is a partition
between the ranks and NATS rather than a mass death, so their verdicts wait.

When a silence verdict (a worker's or a node's) comes due, :meth:`MassSilence.hold_for`
looks one interval ahead: if the members of that job whose silence deadlines fall
within it cover at least ``mass_ratio`` of its tracked workers (and at least
``mass_min``), or of its nodes, every silence verdict of that job is held for
``mass_hold_s`` from then (:class:`MassHold`, listed once in
:attr:`MassSilence.holds` for the service to log). Members heard again meanwhile
are not judged; those still silent after it are, and their verdicts say so
(:meth:`MassSilence.mark_held`: evidence ``mass_silence``). Process exits are
never held, nor are step stalls of ranks still heard.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from phalanx.services.failure_detector.config import DetectorConfig, Stats
from phalanx.services.failure_detector.liveness import Liveness
from phalanx.services.failure_detector.tracking import Node, Tracking, Worker
from phalanx.services.failure_detector.verdicts import Verdict

__all__ = ["MassHold", "MassSilence", "SilentWithin"]

SilentWithin = Callable[[str, Worker | Node, float, float], tuple[set[str], set[str]]]
"""``(job, first, now, window) -> (workers, nodes)`` of ``job`` whose silence deadline
is within ``window`` and one of their own intervals of ``now``
(``Deadlines.silent_within``)."""


@dataclass(slots=True)
class MassHold:
    """A mass silence in one job: its silence verdicts are held until ``until``."""

    job: str
    started: float
    """Monotonic time the hold began (the first member's silence verdict came due)."""
    until: float
    workers: int
    """Workers whose silence was due within the window when it began..."""
    nodes: int
    """...and nodes."""
    tracked_workers: int
    tracked_nodes: int


class MassSilence:
    """Each job's latest mass-silence hold, and the check that begins one."""

    def __init__(self, config: DetectorConfig, stats: Stats, live: Liveness, tracking: Tracking) -> None:
        self.hold_s = config.mass_hold_s
        """How long a hold lasts (0: never held)."""
        self._ratio, self._min = config.mass_ratio, config.mass_min
        self._stats = stats
        self._live = live
        self._tracking = tracking
        self.latest: dict[str, MassHold] = {}
        """job -> its latest hold (kept after it ends: verdicts say they were held)."""
        self._checked: dict[str, float] = {}
        """job -> until when its last "no mass silence" finding stands (the check costs a heap walk)."""
        self.holds: list[MassHold] = []
        """Holds begun since the service last took them (:meth:`take_holds`)."""

    def take_holds(self) -> list[MassHold]:
        """The holds begun since the last call (for the service to log)."""
        out, self.holds = self.holds, []
        return out

    def held_until(self, job: str) -> float:
        """When ``job``'s latest hold ends (-inf: never held)."""
        rec = self.latest.get(job)
        return rec.until if rec is not None else -math.inf

    def hold_for(
        self, stall: bool, b: Worker | Node, now: float, silent_within: SilentWithin
    ) -> float | None:
        """Until when the verdict on ``b``, due now (a stall or hang verdict if
        ``stall``, else a silence), is held as part of a mass silence in its job;
        None to judge it now."""
        job = b.job
        rec = self.latest.get(job)
        if stall:  # a rank still heard is judged as usual; a silent one waits with the rest
            held = rec is not None and now < rec.until and b.last_arrival <= rec.started
            return rec.until if held and rec is not None else None
        if isinstance(b, Node) and not b.workers:
            return None  # a launcher that finished: forgotten, no verdict to hold
        if rec is not None:
            if now < rec.until:
                return rec.until
            if self._live.deadline(b) <= rec.until:
                return None  # silent through the hold: judged now (and the verdict says so)
        if now < self._checked.get(job, -math.inf):
            return None
        # One interval: members cut off together (their last heartbeats within one interval)
        # come due within it; one still heard is at least ~1.3 of its own intervals from
        # its deadline.
        self._live.fresh(b)
        workers, nodes = silent_within(job, b, now, b.mean_s)
        if len(workers) >= self._min or len(nodes) >= self._min:
            tracked_workers = sum(1 for k in self._tracking.workers if k[0] == job)
            tracked_nodes = sum(1 for k in self._tracking.nodes if k[0] == job)
            if (len(workers) >= self._min and len(workers) >= self._ratio * tracked_workers) or (
                len(nodes) >= self._min and len(nodes) >= self._ratio * tracked_nodes
            ):
                until = now + self.hold_s
                rec = MassHold(job, now, until, len(workers), len(nodes), tracked_workers, tracked_nodes)
                self.latest[job] = rec
                self.holds.append(rec)
                self._stats.mass_holds += 1
                return rec.until
        # (a mass silence shows at its first verdict: the finding stands for half the
        # shortest look-ahead, a node's digest interval when b is one of its workers)
        window = b.digest_s if 0.0 < b.digest_s < b.mean_s else b.mean_s
        self._checked[job] = now + window / 2
        return None

    def mark_held(self, v: Verdict, stall: bool, b: Worker | Node, now: float) -> None:
        """Say in ``v``'s evidence that it was held as a mass silence, if it was."""
        rec = self.latest.get(v.job)
        if rec is None or now < rec.until:
            return
        if stall:
            if b.last_arrival > rec.started:
                return
        elif self._live.deadline(b) > rec.until:
            return
        v.evidence.update(
            mass_silence=True,
            mass_hold_ms=round((rec.until - rec.started) * 1e3, 1),
            mass_silent_workers=rec.workers,
            mass_silent_nodes=rec.nodes,
            mass_tracked_workers=rec.tracked_workers,
        )
        self._stats.mass_held += 1
