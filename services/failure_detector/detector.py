"""The failure-detection algorithm: pure state, no I/O, an injected clock.

:class:`Detector` turns what the service hears (heartbeats, process exits, plans)
into :class:`Incident` verdicts. The service (:mod:`.service`) feeds it and
publishes the verdicts; unit tests drive it with a fake clock.

Three ways a worker is judged faulty:

- **process exit** (:meth:`Detector.on_exit`): the launcher saw the process end
  with a non-zero code or a signal -> ``process_exit`` at ``exited_at``. Exit 0 is
  a clean completion: the worker is forgotten, no incident.
- **heartbeat lost** (:meth:`Detector.tick`): phi-accrual (Hayashibara et al.,
  as in Akka and Cassandra). Per worker a sliding window of heartbeat
  inter-arrival times gives a mean ``mu`` and a standard deviation ``sigma``
  (floored, so a very regular sender does not make the detector twitchy);
  ``phi(t) = -log10(1 - F(t))`` with ``F`` the normal CDF of
  ``N(mu + pause, sigma)``, ``t`` the time since the last heartbeat. Instead of
  evaluating phi for every worker on every tick, each heartbeat computes the
  elapsed time at which phi will reach the threshold (``mu + pause + z*sigma``,
  ``z = Phi^-1(1 - 10^-threshold)``), and the resulting deadline goes into a heap:
  a tick costs O(expired). ``fault_at`` is the arrival of the last heartbeat.
- **step stall** (:meth:`Detector.tick`): heartbeats continue, but the rank has
  been in phase ``COMPUTE`` without completing a step for longer than a bound
  learned from its recent step times: ``max(stall_floor, stall_factor *
  max(recent step_ms))`` (``stall_initial`` before any step completed).
  ``COLLECTIVE`` ranks are victims waiting on a stalled peer and are never judged
  by this rule; nor are ``IDLE`` spares or ``STARTING``/``RECOVERING`` ranks.
  ``fault_at`` is when the stalled phase (or the step in it) began.

An incident belongs to one process incarnation, ``(job, worker, pid)``; its id
:func:`incident_id` is deterministic, so a second path to the same fault (an exit
report after the heartbeats were already lost), a duplicated message or a
restarted detector yields the same id, which the service also uses as the
``Nats-Msg-Id`` (JetStream drops the repeat). After a verdict the pid is closed:
its late heartbeats are ignored; a heartbeat from a new pid of the same worker
starts a new incarnation.

The detector never judges while it cannot hear: :meth:`Detector.hold` (the
service calls it while disconnected from NATS or after its own event loop
stalled) postpones every verdict and restarts silence clocks from the end of
the hold, and inter-arrival samples that span a hold are not learned.

>>> clock = FakeClock()
>>> det = Detector(DetectorConfig(), clock=clock.monotonic, wall=clock.wall)
>>> for seq in range(20):
...     _ = det.observe(_example_heartbeat(seq)); clock.advance(0.1)
>>> det.tick()
[]
>>> clock.advance(0.5)
>>> [(i.worker, i.cause.value) for i in det.tick()]
[('w0', 'heartbeat_lost')]
"""

from __future__ import annotations

import heapq
import itertools
import math
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from enum import Enum
from statistics import NormalDist

from phalanx.schemas import (
    Evidence,
    FaultCause,
    Heartbeat,
    Phase,
    Plan,
    RankExited,
    RankFailed,
    RankHung,
)

__all__ = [
    "Clock",
    "Detector",
    "DetectorConfig",
    "FakeClock",
    "Incident",
    "IntervalWindow",
    "Stats",
    "incident_id",
    "phi",
    "phi_threshold_z",
]

Clock = Callable[[], float]
_LOG10_E = math.log10(math.e)
_SQRT2 = math.sqrt(2.0)
_LOG10_SQRT_2PI = math.log10(math.sqrt(2.0 * math.pi))
PHI_CAP = 999.0
"""phi is reported as at most this (an infinite float does not survive the wire)."""


def incident_id(job: str, worker: str, pid: int) -> str:
    """The stable id of the incident of one process incarnation.

    >>> incident_id("j1", "w3", 4242)
    'j1:w3:4242'
    """
    return f"{job}:{worker}:{pid}"


def phi_threshold_z(threshold: float) -> float:
    """How many standard deviations past the mean phi reaches ``threshold``.

    >>> round(phi_threshold_z(8.0), 3)
    5.612
    """
    if threshold <= 0:
        raise ValueError(f"phi threshold must be positive, got {threshold}")
    return -NormalDist().inv_cdf(10.0**-threshold)


def phi(elapsed: float, mean: float, std: float) -> float:
    """``-log10(1 - F(elapsed))`` for ``F`` the CDF of ``N(mean, std)``.

    Uses ``erfc`` for the tail and its asymptote where that underflows, so large
    values stay finite and monotonic (capped at :data:`PHI_CAP`).

    >>> round(phi(1.0, 1.0, 0.1), 3)     # at the mean: 1 - F = 1/2
    0.301
    >>> phi(2.0, 1.0, 0.1) > phi(1.5, 1.0, 0.1) > 3
    True
    """
    if std <= 0:
        raise ValueError("std must be positive")
    y = (elapsed - mean) / std
    tail = 0.5 * math.erfc(y / _SQRT2)
    if tail > 1e-300:
        return min(PHI_CAP, -math.log10(tail))
    # Q(y) ~ exp(-y^2/2) / (y sqrt(2 pi)) for large y
    return min(PHI_CAP, (y * y / 2.0) * _LOG10_E + math.log10(y) + _LOG10_SQRT_2PI)


class IntervalWindow:
    """A sliding window of samples with O(1) mean and standard deviation.

    >>> w = IntervalWindow(3)
    >>> for x in (1.0, 2.0, 3.0, 4.0):
    ...     w.add(x)
    >>> len(w), w.mean, round(w.std, 4)
    (3, 3.0, 0.8165)
    """

    __slots__ = ("_samples", "_sum", "_sumsq")

    def __init__(self, size: int) -> None:
        if size < 2:
            raise ValueError("window size must be at least 2")
        self._samples: deque[float] = deque(maxlen=size)
        self._sum = 0.0
        self._sumsq = 0.0

    def add(self, x: float) -> None:
        if len(self._samples) == self._samples.maxlen:
            old = self._samples[0]
            self._sum -= old
            self._sumsq -= old * old
        self._samples.append(x)
        self._sum += x
        self._sumsq += x * x

    def __len__(self) -> int:
        return len(self._samples)

    @property
    def mean(self) -> float:
        return self._sum / len(self._samples) if self._samples else 0.0

    @property
    def std(self) -> float:
        """Population standard deviation (0 for fewer than two samples)."""
        n = len(self._samples)
        if n < 2:
            return 0.0
        m = self._sum / n
        return math.sqrt(max(0.0, self._sumsq / n - m * m))


@dataclass(frozen=True)
class DetectorConfig:
    """Tuning of the detector; the defaults suit intervals from 50 ms to a few s.

    With the defaults a regular sender is declared lost ``~2.3`` intervals after
    its last heartbeat (``mu + 0.15 mu + 5.61 * 0.2 mu``): at most 3 intervals
    after the fault, with over one interval of lateness tolerated.
    """

    phi_threshold: float = 8.0
    window: int = 100
    """Inter-arrival samples kept per worker."""
    min_samples: int = 5
    """Below this many samples, use the declared interval and a wide std."""
    min_std_ratio: float = 0.2
    """Floor of sigma as a fraction of the mean interval (absorbs GC and scheduling jitter)."""
    min_std_s: float = 0.02
    """Absolute floor of sigma."""
    pause_ratio: float = 0.15
    """Acceptable extra pause, as a fraction of the mean interval, added to the mean."""
    stall_floor_s: float = 5.0
    stall_factor: float = 4.0
    stall_initial_s: float = 60.0
    """Stall bound before the rank has reported any completed step."""
    step_window: int = 20
    closed_capacity: int = 100_000
    """Closed incarnations remembered (to drop their late heartbeats and repeated exits)."""

    def __post_init__(self) -> None:
        phi_threshold_z(self.phi_threshold)
        if self.window < 2 or self.step_window < 1 or self.min_samples < 2:
            raise ValueError("window >= 2, step_window >= 1 and min_samples >= 2 are required")
        if self.min_std_ratio < 0 or self.min_std_s <= 0 or self.pause_ratio < 0:
            raise ValueError("std floors must be positive and pause_ratio non-negative")
        if self.stall_floor_s <= 0 or self.stall_factor <= 0 or self.stall_initial_s <= 0:
            raise ValueError("stall bounds must be positive")


@dataclass(frozen=True)
class Incident:
    """One verdict about one process incarnation."""

    job: str
    worker: str
    pid: int
    rank: int
    generation: int
    cause: FaultCause
    fault_at: float
    """Wall-clock seconds when the fault is inferred to have happened."""
    evidence: Evidence = field(default_factory=dict)

    @property
    def id(self) -> str:
        return incident_id(self.job, self.worker, self.pid)

    def to_event(self) -> RankFailed | RankHung:
        """The bus message: :class:`RankFailed` for an exit, else :class:`RankHung`."""
        cls = RankFailed if self.cause is FaultCause.PROCESS_EXIT else RankHung
        return cls(
            job=self.job,
            incident=self.id,
            worker=self.worker,
            rank=self.rank,
            generation=self.generation,
            cause=self.cause,
            fault_at=self.fault_at,
            evidence=dict(self.evidence),
        )


class _Kind(Enum):
    SILENCE = 0
    STALL = 1


@dataclass(eq=False)
class _Worker:
    """What the detector knows about one live incarnation of a worker."""

    job: str
    worker: str
    pid: int
    host: str
    token: int
    rank: int
    generation: int
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
    silence_at: float | None = None
    """When the live heap entry for silence fires."""
    step: int = 0
    step_ms: float = 0.0
    steps: deque[float] = field(default_factory=deque)
    phase: Phase = Phase.STARTING
    phase_ms: float = 0.0
    phase_start: float = 0.0
    phase_start_wall: float = 0.0
    progress_at: float = 0.0
    progress_wall: float = 0.0
    stall_at: float | None = None
    """When the live heap entry for a stall fires."""

    @property
    def key(self) -> tuple[str, str]:
        return (self.job, self.worker)

    @property
    def stall_since(self) -> tuple[float, float]:
        """(monotonic, wall) since when the rank has neither left COMPUTE nor finished a step."""
        if self.progress_at > self.phase_start:
            return self.progress_at, self.progress_wall
        return self.phase_start, self.phase_start_wall


@dataclass
class _Membership:
    generation: int = 0
    ranks: dict[str, int] = field(default_factory=dict)
    spares: set[str] = field(default_factory=set)


@dataclass
class Stats:
    """Counters of what the detector saw and decided (the service's health details)."""

    heartbeats: int = 0
    ignored_heartbeats: int = 0
    """From closed incarnations, or repeated/out-of-order sequence numbers."""
    incidents: int = 0
    clean_exits: int = 0
    repeated_exits: int = 0
    """Exit reports for closed incarnations (a duplicate, or after another verdict)."""
    stale_plans: int = 0
    holds: int = 0


class Detector:
    """The detector's state. All methods are synchronous and cheap.

    ``clock`` is a monotonic clock (seconds) for every deadline; ``wall`` is
    wall-clock time (seconds since the epoch) for timestamps in verdicts.
    """

    def __init__(
        self,
        config: DetectorConfig | None = None,
        *,
        clock: Clock = time.monotonic,
        wall: Clock = time.time,
    ) -> None:
        self.config = config or DetectorConfig()
        self.clock = clock
        self.wall = wall
        self.stats = Stats()
        self._z = phi_threshold_z(self.config.phi_threshold)
        self._tracked: dict[tuple[str, str], _Worker] = {}
        self._heap: list[tuple[float, int, _Kind, tuple[str, str], int]] = []
        self._counter = itertools.count()
        self._tokens = itertools.count(1)
        self._closed: OrderedDict[str, str] = OrderedDict()
        self._members: dict[str, _Membership] = {}
        self._hold_until = -math.inf

    # -- introspection -------------------------------------------------------------
    def __len__(self) -> int:
        """Number of tracked worker incarnations."""
        return len(self._tracked)

    def tracked(self) -> Iterator[tuple[str, str, int]]:
        """(job, worker, pid) of every tracked incarnation."""
        return ((w.job, w.worker, w.pid) for w in self._tracked.values())

    def is_closed(self, job: str, worker: str, pid: int) -> bool:
        return incident_id(job, worker, pid) in self._closed

    def snapshot(self, job: str, worker: str) -> dict[str, float | int | str] | None:
        """What is known of a tracked worker, for health output and tests."""
        w = self._tracked.get((job, worker))
        if w is None:
            return None
        now = self.clock()
        return {
            "pid": w.pid,
            "rank": w.rank,
            "generation": w.generation,
            "last_seq": w.last_seq,
            "samples": len(w.intervals),
            "mean_ms": w.mean_s * 1e3,
            "std_ms": w.std_s * 1e3,
            "threshold_ms": w.threshold_s * 1e3,
            "phase": w.phase.value,
            "step": w.step,
            "stall_ms": (now - w.stall_since[0]) * 1e3,
            "stall_bound_ms": self.stall_bound(w) * 1e3,
            "phi": self._phi_now(w, now),
        }

    @property
    def hold_until(self) -> float:
        return self._hold_until

    # -- inputs --------------------------------------------------------------------
    def observe(self, hb: Heartbeat) -> bool:
        """Learn from one heartbeat; returns False when it was ignored.

        A heartbeat is ignored when its incarnation was closed (a verdict, a clean
        exit or a plan removed it) or its ``seq`` is not newer than the last one.
        """
        now = self.clock()
        key = (hb.job, hb.worker)
        w = self._tracked.get(key)
        if hb.phase is Phase.DONE:  # a clean goodbye: the silence that follows is no fault
            iid = incident_id(hb.job, hb.worker, hb.pid)
            if iid not in self._closed:
                self.stats.clean_exits += 1
                self._close(iid, "leaving")
            if w is not None and w.pid == hb.pid:
                del self._tracked[key]
            return True
        if w is None or w.pid != hb.pid:
            if incident_id(hb.job, hb.worker, hb.pid) in self._closed:
                self.stats.ignored_heartbeats += 1
                return False
            w = self._new_worker(hb, now)
            fresh = True
        elif hb.seq <= w.last_seq:
            self.stats.ignored_heartbeats += 1
            return False
        else:
            if w.last_arrival >= self._hold_until:  # a sample that spans a hold is not learned
                w.intervals.add(now - w.last_arrival)
            w.last_arrival, w.last_wall, w.last_seq = now, self.wall(), hb.seq
            w.declared_s = hb.interval_ms / 1e3
            fresh = False
        self.stats.heartbeats += 1
        w.rank, w.generation, w.host = hb.rank, hb.generation, hb.host
        self._learn_progress(w, hb, now, fresh)
        self._schedule(w, now)
        return True

    def on_exit(self, ex: RankExited) -> Incident | None:
        """A process ended. Returns the incident, or None (clean exit, already closed)."""
        iid = incident_id(ex.job, ex.worker, ex.pid)
        if iid in self._closed:
            self.stats.repeated_exits += 1
            return None
        w = self._tracked.get((ex.job, ex.worker))
        if w is not None and w.pid != ex.pid:
            w = None  # an older incarnation ended; the tracked one lives on
        if ex.exit_code == 0 and ex.signal is None:
            self.stats.clean_exits += 1
            self._close(iid, "clean_exit")
            if w is not None:
                del self._tracked[w.key]
            return None
        rank, generation = self._rank_of(ex.job, ex.worker, w)
        evidence: Evidence = {"host": ex.host}
        if ex.exit_code is not None:
            evidence["exit_code"] = ex.exit_code
        if ex.signal is not None:
            evidence["signal"] = ex.signal
        if w is not None:
            evidence.update(
                last_seq=w.last_seq,
                step=w.step,
                phase=w.phase.value,
                since_heartbeat_ms=round((self.clock() - w.last_arrival) * 1e3, 1),
            )
        return self._verdict(
            Incident(
                ex.job, ex.worker, ex.pid, rank, generation, FaultCause.PROCESS_EXIT, ex.exited_at, evidence
            ),
            w,
        )

    def apply_plan(self, plan: Plan) -> bool:
        """Learn a generation's membership; returns False for a stale plan.

        Workers in ``plan.removed`` are forgotten: their tracked incarnation is
        closed without a verdict (the launcher fences them; their exit is expected).
        """
        m = self._members.setdefault(plan.job, _Membership())
        if plan.generation < m.generation:
            self.stats.stale_plans += 1
            return False
        m.generation = plan.generation
        m.ranks = {x.worker: x.rank for x in plan.members}
        m.spares = set(plan.spares)
        for name in plan.removed:
            w = self._tracked.pop((plan.job, name), None)
            if w is not None:
                self._close(incident_id(w.job, w.worker, w.pid), f"removed_gen{plan.generation}")
        return True

    def hold(self, until: float) -> None:
        """Judge nobody before ``until`` (monotonic) and measure silence from then on.

        For times the detector could not hear: disconnected from NATS, or its own
        event loop stalled. Cost O(1): deadlines are re-read lazily.
        """
        if until > self._hold_until:
            self._hold_until = until
            self.stats.holds += 1

    # -- judgement -----------------------------------------------------------------
    def due(self) -> bool:
        """Whether :meth:`tick` would return a verdict now (it tidies the heap on the way).

        The service calls this first and, when True, makes sure every heartbeat
        already received has been observed before it calls :meth:`tick`.
        """
        return self._top_expired(self.clock()) is not None

    def tick(self) -> list[Incident]:
        """Every verdict whose time has come, in deadline order. O(expired)."""
        now = self.clock()
        out: list[Incident] = []
        while (entry := self._top_expired(now)) is not None:
            heapq.heappop(self._heap)
            kind, w = entry
            out.append(
                self._silence_verdict(w, now) if kind is _Kind.SILENCE else self._stall_verdict(w, now)
            )
        return out

    def stall_bound(self, w: _Worker) -> float:
        """Seconds a rank may stay in COMPUTE without finishing a step."""
        c = self.config
        if not w.steps:
            return max(c.stall_floor_s, c.stall_initial_s)
        return max(c.stall_floor_s, c.stall_factor * max(w.steps) / 1e3)

    # -- internals -----------------------------------------------------------------
    def _new_worker(self, hb: Heartbeat, now: float) -> _Worker:
        w = _Worker(
            job=hb.job,
            worker=hb.worker,
            pid=hb.pid,
            host=hb.host,
            token=next(self._tokens),
            rank=hb.rank,
            generation=hb.generation,
            declared_s=hb.interval_ms / 1e3,
            last_arrival=now,
            last_wall=self.wall(),
            last_seq=hb.seq,
            intervals=IntervalWindow(self.config.window),
            steps=deque(maxlen=self.config.step_window),
            step=hb.step,
        )
        self._tracked[w.key] = w
        return w

    def _learn_progress(self, w: _Worker, hb: Heartbeat, now: float, fresh: bool) -> None:
        # A new phase, or the same one entered again between two heartbeats.
        if fresh or hb.phase is not w.phase or hb.phase_ms < w.phase_ms:
            w.phase = hb.phase
            w.phase_start = now - hb.phase_ms / 1e3
            w.phase_start_wall = hb.ts - hb.phase_ms / 1e3
        w.phase_ms = hb.phase_ms
        if hb.step > w.step:
            if hb.step_ms > 0:
                w.steps.append(hb.step_ms)
            w.progress_at, w.progress_wall = now, hb.ts
        w.step, w.step_ms = hb.step, hb.step_ms

    def _estimate(self, w: _Worker) -> tuple[float, float]:
        """(mean, floored sigma) of the inter-arrival time."""
        c = self.config
        n = len(w.intervals)
        if n < c.min_samples:  # not enough evidence yet: trust the declared interval, widely
            mean = max(w.declared_s, w.intervals.mean)
            return mean, max(mean / 4.0, c.min_std_ratio * mean, c.min_std_s)
        mean = w.intervals.mean
        return mean, max(w.intervals.std, c.min_std_ratio * mean, c.min_std_s)

    def _schedule(self, w: _Worker, now: float) -> None:
        mean, std = self._estimate(w)
        w.mean_s, w.std_s = mean, std
        w.threshold_s = mean * (1.0 + self.config.pause_ratio) + self._z * std
        at = self._silence_deadline(w)
        if w.silence_at is None or at < w.silence_at:
            w.silence_at = at
            self._push(at, _Kind.SILENCE, w)
        if w.phase is Phase.COMPUTE:
            since, _ = w.stall_since
            at = since + self.stall_bound(w)
            if w.stall_at is None or at < w.stall_at:
                w.stall_at = at
                self._push(at, _Kind.STALL, w)

    def _silence_deadline(self, w: _Worker) -> float:
        return max(w.last_arrival, self._hold_until) + w.threshold_s

    def _push(self, at: float, kind: _Kind, w: _Worker) -> None:
        heapq.heappush(self._heap, (at, next(self._counter), kind, w.key, w.token))

    def _top_expired(self, now: float) -> tuple[_Kind, _Worker] | None:
        """Tidy the heap top until it is a real expiry (returned) or in the future.

        A heap entry is live if its worker incarnation is still tracked and it is
        the entry that worker's ``silence_at``/``stall_at`` points to. A live entry
        whose real deadline moved later (newer heartbeats, a hold) is re-pushed.
        """
        heap = self._heap
        while heap and heap[0][0] <= now:
            at, _, kind, key, token = heap[0]
            w = self._tracked.get(key)
            live = (
                w is not None
                and w.token == token
                and (w.silence_at == at if kind is _Kind.SILENCE else w.stall_at == at)
            )
            if not live or w is None:
                heapq.heappop(heap)
                continue
            if now < self._hold_until:
                return None
            if kind is _Kind.SILENCE:
                real: float | None = self._silence_deadline(w)
            elif w.phase is not Phase.COMPUTE:
                real = None
            elif w.last_arrival < self._hold_until:
                real = now + w.declared_s  # wait for a heartbeat after the hold to confirm
            else:
                real = w.stall_since[0] + self.stall_bound(w)
            if real is not None and real <= now:
                return kind, w
            heapq.heappop(heap)
            if kind is _Kind.SILENCE:
                w.silence_at = real
            else:
                w.stall_at = real
            if real is not None:
                self._push(real, kind, w)
        return None

    def _phi_now(self, w: _Worker, now: float) -> float:
        elapsed = now - max(w.last_arrival, self._hold_until)
        return round(phi(elapsed, w.mean_s * (1.0 + self.config.pause_ratio), w.std_s), 2)

    def _silence_verdict(self, w: _Worker, now: float) -> Incident:
        rank, generation = self._rank_of(w.job, w.worker, w)
        evidence: Evidence = {
            "phi": self._phi_now(w, now),
            "threshold": self.config.phi_threshold,
            "elapsed_ms": round((now - w.last_arrival) * 1e3, 1),
            "threshold_ms": round(w.threshold_s * 1e3, 1),
            "mean_interval_ms": round(w.mean_s * 1e3, 2),
            "std_interval_ms": round(w.std_s * 1e3, 2),
            "raw_std_interval_ms": round(w.intervals.std * 1e3, 2),
            "samples": len(w.intervals),
            "declared_interval_ms": round(w.declared_s * 1e3, 1),
            "last_seq": w.last_seq,
            "step": w.step,
            "phase": w.phase.value,
            "host": w.host,
        }
        return self._verdict(
            Incident(
                w.job, w.worker, w.pid, rank, generation, FaultCause.HEARTBEAT_LOST, w.last_wall, evidence
            ),
            w,
        )

    def _stall_verdict(self, w: _Worker, now: float) -> Incident:
        rank, generation = self._rank_of(w.job, w.worker, w)
        since, since_wall = w.stall_since
        evidence: Evidence = {
            "phase": w.phase.value,
            "phase_ms": round((now - since) * 1e3, 1),
            "reported_phase_ms": round(w.phase_ms, 1),
            "bound_ms": round(self.stall_bound(w) * 1e3, 1),
            "step": w.step,
            "step_ms": round(w.step_ms, 2),
            "max_recent_step_ms": round(max(w.steps), 2) if w.steps else 0.0,
            "step_samples": len(w.steps),
            "last_seq": w.last_seq,
            "phi": self._phi_now(w, now),
            "host": w.host,
        }
        return self._verdict(
            Incident(w.job, w.worker, w.pid, rank, generation, FaultCause.STEP_STALL, since_wall, evidence),
            w,
        )

    def _verdict(self, incident: Incident, w: _Worker | None) -> Incident:
        self._close(incident.id, incident.cause.value)
        if w is not None and self._tracked.get(w.key) is w:
            del self._tracked[w.key]
        self.stats.incidents += 1
        return incident

    def _close(self, iid: str, why: str) -> None:
        self._closed[iid] = why
        self._closed.move_to_end(iid)
        while len(self._closed) > self.config.closed_capacity:
            self._closed.popitem(last=False)

    def _rank_of(self, job: str, worker: str, w: _Worker | None) -> tuple[int, int]:
        """(rank, generation): from the newer of the heartbeats and the latest plan."""
        m = self._members.get(job)
        if m is not None and (w is None or m.generation > w.generation):
            if worker in m.ranks:
                return m.ranks[worker], m.generation
            if worker in m.spares:
                return -1, m.generation
        if w is not None:
            return w.rank, w.generation
        return -1, m.generation if m is not None else 0


class FakeClock:
    """A manual clock for tests and doctests: ``monotonic`` and ``wall`` move together.

    >>> c = FakeClock(start=10.0); c.advance(0.5); c.monotonic(), c.wall() - c.epoch
    (10.5, 10.5)
    """

    def __init__(self, start: float = 1000.0, epoch: float = 1_700_000_000.0) -> None:
        self.now = start
        self.epoch = epoch

    def advance(self, seconds: float) -> None:
        self.now += seconds

    def monotonic(self) -> float:
        return self.now

    def wall(self) -> float:
        return self.epoch + self.now


def _example_heartbeat(seq: int, **kw: object) -> Heartbeat:
    fields: dict[str, object] = dict(
        job="j1",
        worker="w0",
        rank=0,
        generation=1,
        step=seq,
        step_ms=50.0,
        phase=Phase.COLLECTIVE,
        phase_ms=1.0,
        seq=seq,
        pid=100,
        host="h",
        interval_ms=100.0,
    )
    fields.update(kw)
    return Heartbeat.model_validate(fields)
