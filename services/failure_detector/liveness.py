"""The liveness estimate: when the silence of something that heartbeats (a worker,
a node's launcher) becomes a fault, by phi accrual over its inter-arrival times.

Per sender a sliding window of inter-arrival samples gives a mean ``mu`` and a
standard deviation ``sigma`` (floored, so a very regular sender does not make the
detector twitchy); phi reaches the threshold after a silence of ``mu x (1 + pause)
+ z x sigma`` (:func:`~.phi.phi_threshold_z`), plus a slack for a heartbeat that
reaches the detector only with its node's next digest. The silence is measured
from the last heartbeat or from the end of the detector's hold, whichever is
later (:meth:`Liveness.hold`), and a sample that spans a hold is not learned.

A heartbeat carried by a node's digest (interval ``D``) reaches the detector up to
``D`` late: its deadline gets a slack of ``digest_slack_ratio x D`` plus ``D - mu``
when the worker heartbeats faster than its node digests. With the defaults a
regular sender is declared lost ``~2.3`` intervals after its last heartbeat, and a
hung rank in a live node within 3 intervals (``~2.3 + 0.5``) when ``D`` is the
heartbeat interval.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from phalanx.services.failure_detector.config import DetectorConfig
from phalanx.services.failure_detector.phi import IntervalWindow, phi, phi_threshold_z

from phalanx.contract import Evidence

__all__ = ["Beat", "Liveness"]


@dataclass(eq=False, kw_only=True, slots=True)
class Beat:
    """Arrivals of something that heartbeats (a worker, a node) and its silence deadline."""

    token: int
    declared_s: float
    last_arrival: float
    last_wall: float
    last_seq: int
    intervals: IntervalWindow
    mean_s: float = 0.0
    std_s: float = 0.0
    """The sigma used (floored)."""
    threshold_s: float = 0.0
    """Silence (from the last heartbeat or the end of a hold) at which phi crosses the threshold."""
    slack_s: float = 0.0
    """Added to the threshold: how late evidence may arrive beyond the sender's own rhythm."""
    digest_s: float = 0.0
    """The digest interval of the node whose digests carry its heartbeats (0: heard
    directly, and for a node itself)."""
    stale: bool = False
    """``mean_s``.. ``slack_s`` lag the samples (a worker's, see
    ``Deadlines.schedule_worker``): read them after :meth:`Liveness.fresh`."""
    silence_at: float | None = None
    """When silence is next checked: a node's live heap entry; for a worker, one of the
    two deadlines its single heap entry (``check_at``) stands for."""
    seq_interval: float = 0.0
    """The interval declared when the incarnation was first heard, for the sequence
    bound (0: unknown; a later heartbeat cannot loosen the bound by declaring less)."""
    min_silence_s: float = 0.0
    """The shortest silence taken for a fault whatever the estimate says (a node's
    launcher: ``DetectorConfig.node_floor_s``)."""
    mass_held: bool = False
    """Its verdict was held by a mass silence since its last arrival: the interval that
    ends at its next one spans the hold and is not learned (:mod:`.mass`)."""
    gap_from: int | None = None
    """``last_seq`` before the last accepted advance when that advance skipped numbers
    (-1: the first one heard), else None: a heartbeat strictly between it and
    ``last_seq`` is a second sender's (see :mod:`.checks`)."""


class Liveness:
    """The estimate of every :class:`Beat`, and the hold during which nobody is judged.

    ``hold_until`` (monotonic) is read by every piece that measures silence; it only
    moves later.
    """

    def __init__(self, config: DetectorConfig) -> None:
        self.threshold = config.phi_threshold
        self.z = phi_threshold_z(config.phi_threshold)
        self.pause = 1.0 + config.pause_ratio
        self.min_samples = config.min_samples
        self.min_std_ratio = config.min_std_ratio
        self.min_std = config.min_std_s
        self.digest_slack = config.digest_slack_ratio
        self.hold_until = -math.inf

    def hold(self, until: float) -> bool:
        """Measure silence from ``until`` on (if later than the current hold); True if it moved."""
        if until > self.hold_until:
            self.hold_until = until
            return True
        return False

    def sample(self, b: Beat, now: float) -> None:
        """Learn the interval since ``b``'s last arrival (not one that spans a hold)."""
        if b.mass_held:
            b.mass_held = False
        elif b.last_arrival >= self.hold_until:
            b.intervals.add(now - b.last_arrival)

    def estimate(self, b: Beat) -> None:
        """Set ``b``'s mean, floored sigma, threshold and slack from its samples.

        (:meth:`IntervalWindow.estimate`, inline: this runs for every worker about
        once per interval.) A heartbeat carried by a digest is seen only with the
        node's next digest: up to one digest interval late, more when the worker
        heartbeats faster than its node digests.
        """
        iv = b.intervals
        n = len(iv._samples)
        if n < self.min_samples:
            mean, std = iv.estimate(b.declared_s, self.min_samples, self.min_std_ratio, self.min_std)
        else:
            mean = iv._sum / n
            var = iv._sumsq / n - mean * mean
            std = math.sqrt(var) if var > 0.0 else 0.0
            floor = self.min_std_ratio * mean
            floor = floor if floor > self.min_std else self.min_std
            std = std if std > floor else floor
        digest_s = b.digest_s
        if digest_s > 0.0:
            gap = digest_s - mean
            b.slack_s = self.digest_slack * digest_s + (gap if gap > 0.0 else 0.0)
        b.mean_s, b.std_s = mean, std
        threshold = mean * self.pause + self.z * std
        b.threshold_s = threshold if threshold > b.min_silence_s else b.min_silence_s
        b.stale = False

    def fresh(self, b: Beat) -> None:
        """Make a lazily scheduled worker's estimate current before reading it."""
        if b.stale:
            self.estimate(b)

    def deadline(self, b: Beat) -> float:
        """When ``b``'s silence becomes a fault, from what is known now."""
        if b.stale:
            self.estimate(b)
        last, hold = b.last_arrival, self.hold_until
        return (last if last > hold else hold) + b.threshold_s + b.slack_s

    def phi_now(self, b: Beat, now: float) -> float:
        """phi of ``b``'s silence at ``now`` (rounded, for evidence and health output)."""
        self.fresh(b)
        elapsed = now - max(b.last_arrival, self.hold_until)
        return round(phi(elapsed, b.mean_s * self.pause, b.std_s), 2)

    def evidence(self, b: Beat, now: float) -> Evidence:
        """What a silence verdict on a worker or a node reports about its heartbeats."""
        self.fresh(b)
        return {
            "phi": self.phi_now(b, now),
            "threshold": self.threshold,
            "elapsed_ms": round((now - b.last_arrival) * 1e3, 1),
            "threshold_ms": round(b.threshold_s * 1e3, 1),
            "mean_interval_ms": round(b.mean_s * 1e3, 2),
            "std_interval_ms": round(b.std_s * 1e3, 2),
            "samples": len(b.intervals),
            "declared_interval_ms": round(b.declared_s * 1e3, 1),
            "last_seq": b.last_seq,
        }
