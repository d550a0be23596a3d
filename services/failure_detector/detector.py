"""The failure-detection algorithm: pure state, no I/O, an injected clock.

:class:`Detector` turns what the service hears (heartbeats, process exits, plans)
into verdicts: :class:`Incident` about one worker process, :class:`NodeIncident`
about a whole node. The service (:mod:`.service`) feeds it and publishes the
verdicts; unit tests drive it with a fake clock.

Heartbeats come two ways. A rank without a launcher publishes its own
(:meth:`Detector.observe`). A rank under a node's launcher sends them to the
launcher, which publishes one :class:`~phalanx.schemas.NodeDigest` per interval
with each local worker's latest heartbeat and its age
(:meth:`Detector.observe_digest`; 2,000 digests instead of 16,000 heartbeats per
interval at 2,000 nodes x 8 ranks).

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

  A digest entry whose ``seq`` moved on is an observation dated ``arrival -
  age_ms``; its inter-arrival sample is divided by the ``seq`` advance (so a
  heartbeat that fell between two digests does not look like a long gap). The
  evidence of a heartbeat reaches the detector only with the node's next digest,
  up to one digest interval ``D`` later; a digest-carried worker's deadline gets
  a slack of ``digest_slack_ratio x D`` (0.5) plus ``D - mu`` when it heartbeats
  faster than its node digests. A hung rank in a live node is still found
  within 3 heartbeat intervals (``~2.3 + 0.5``) when ``D`` is the heartbeat
  interval.
- **step stall** (:meth:`Detector.tick`): heartbeats continue, but the rank has
  been in phase ``COMPUTE`` without completing a step for longer than a bound
  learned from its recent step times: ``max(stall_floor, stall_factor *
  max(recent step_ms))`` (``stall_initial`` before any step completed).
  ``COLLECTIVE`` ranks are victims waiting on a stalled peer and are never judged
  by this rule; nor are ``IDLE`` spares or ``STARTING``/``RECOVERING`` ranks.
  ``fault_at`` is when the stalled phase (or the step in it) began.

A whole node is judged by the same phi-accrual machinery over the arrivals of
its digests, per ``(job, node, launcher)``: when they stop, one
:class:`NodeIncident` (``NodeLost``, ``heartbeat_lost``, id
``<job>:node:<node>:<launcher>``, ``fault_at`` the last digest's arrival) names
the workers of its last digest and closes their incarnations, so none of them
gets a ``RankHung`` of its own for the same silence: a worker whose deadline
passes while its node's digest is overdue waits for the node's verdict (or for
the next digest, which decides). Later digests of a lost launcher are ignored (a
partitioned node that reconnects does not come back). A node whose last digest
listed no worker is forgotten silently (a launcher that finished).

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
>>> for seq in range(20):
...     _ = det.observe_digest(_example_digest(seq)); clock.advance(0.1)
>>> clock.advance(0.5)
>>> [(i.id, i.cause.value) for i in det.tick()]
[('j1:node:n0:l0', 'heartbeat_lost')]
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
    DigestEntry,
    Evidence,
    FaultCause,
    Heartbeat,
    NodeDigest,
    NodeLost,
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
    "DigestRow",
    "FakeClock",
    "Incident",
    "IntervalWindow",
    "NodeIncident",
    "Stats",
    "Verdict",
    "digest_row",
    "incident_id",
    "node_incident_id",
    "phi",
    "phi_threshold_z",
]

Clock = Callable[[], float]
DigestRow = tuple[str, int, int, int, int, int, float, Phase, float, float, float]
"""One digest entry as the detector reads it: ``(worker, pid, seq, rank, generation,
step, step_ms, phase, phase_ms, age_ms, interval_ms)``, the fields of
:class:`~phalanx.schemas.DigestEntry` in order (a tuple: 16,000 of them per interval)."""
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


def node_incident_id(job: str, node: str, launcher: str) -> str:
    """The stable id of the incident of one node's launcher.

    >>> node_incident_id("j1", "node-b", "7001")
    'j1:node:node-b:7001'
    """
    return f"{job}:node:{node}:{launcher}"


def digest_row(e: DigestEntry) -> DigestRow:
    """The :data:`DigestRow` of a validated entry."""
    return (
        e.worker, e.pid, e.seq, e.rank, e.generation, e.step, e.step_ms,
        e.phase, e.phase_ms, e.age_ms, e.interval_ms,
    )  # fmt: skip


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

    def mean_std(self) -> tuple[float, float]:
        """(mean, std) in one go (the detector's hot path)."""
        n = len(self._samples)
        if n < 2:
            return self.mean, 0.0
        m = self._sum / n
        var = self._sumsq / n - m * m
        return m, math.sqrt(var) if var > 0.0 else 0.0

    @property
    def std(self) -> float:
        """Population standard deviation (0 for fewer than two samples)."""
        n = len(self._samples)
        if n < 2:
            return 0.0
        m = self._sum / n
        return math.sqrt(max(0.0, self._sumsq / n - m * m))

    def estimate(
        self, declared: float, min_samples: int, min_std_ratio: float, min_std: float
    ) -> tuple[float, float]:
        """(mean, floored std), the detector's hot path (every heartbeat): with fewer
        than ``min_samples`` samples, the larger of ``declared`` and the mean with a
        wide std; else the window's own, std floored at ``max(min_std_ratio * mean,
        min_std)``.

        >>> w = IntervalWindow(10); w.add(1.0)
        >>> w.estimate(2.0, 2, 0.2, 0.01)
        (2.0, 0.5)
        >>> w.add(1.0); w.estimate(2.0, 2, 0.2, 0.01)
        (1.0, 0.2)
        """
        n = len(self._samples)
        if n < min_samples:  # not enough evidence yet: trust the declared interval, widely
            mean = self._sum / n if n else 0.0
            mean = mean if mean > declared else declared
            return mean, max(mean / 4.0, min_std_ratio * mean, min_std)
        mean = self._sum / n
        var = self._sumsq / n - mean * mean
        std = math.sqrt(var) if var > 0.0 else 0.0
        floor = min_std_ratio * mean
        floor = floor if floor > min_std else min_std
        return mean, std if std > floor else floor


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
    digest_slack_ratio: float = 0.5
    """Added to a digest-carried worker's silence deadline, as a fraction of its
    node's digest interval: a heartbeat is seen only with the node's next digest."""
    closed_capacity: int = 100_000
    """Closed incarnations remembered (to drop their late heartbeats and repeated exits)."""

    def __post_init__(self) -> None:
        phi_threshold_z(self.phi_threshold)
        if self.window < 2 or self.step_window < 1 or self.min_samples < 2:
            raise ValueError("window >= 2, step_window >= 1 and min_samples >= 2 are required")
        if (
            self.min_std_ratio < 0
            or self.min_std_s <= 0
            or self.pause_ratio < 0
            or self.digest_slack_ratio < 0
        ):
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


@dataclass(frozen=True)
class NodeIncident:
    """One verdict about one node's launcher: its digests stopped."""

    job: str
    node: str
    launcher: str
    workers: tuple[str, ...]
    fault_at: float
    """Wall-clock arrival of the node's last digest."""
    evidence: Evidence = field(default_factory=dict)
    cause: FaultCause = FaultCause.HEARTBEAT_LOST

    @property
    def id(self) -> str:
        return node_incident_id(self.job, self.node, self.launcher)

    def to_event(self) -> NodeLost:
        return NodeLost(
            job=self.job,
            incident=self.id,
            node=self.node,
            workers=list(self.workers),
            cause=self.cause,
            fault_at=self.fault_at,
            evidence=dict(self.evidence),
        )


Verdict = Incident | NodeIncident


class _Kind(Enum):
    SILENCE = 0
    STALL = 1
    NODE = 2


@dataclass(eq=False, kw_only=True, slots=True)
class _Beat:
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
    stale: bool = False
    """``mean_s``.. ``slack_s`` lag the samples (a worker's, see ``Detector._schedule_worker``):
    read them after ``Detector._fresh``."""
    silence_at: float | None = None
    """When silence is next checked: a node's live heap entry; for a worker, one of the
    two deadlines its single heap entry (``check_at``) stands for."""


@dataclass(eq=False, kw_only=True, slots=True)
class _Node(_Beat):
    """What the detector knows about one node's launcher."""

    job: str
    node: str
    launcher: str
    host: str
    workers: list[tuple[str, int]] = field(default_factory=list)
    """(worker, pid) of the last digest's entries (DONE ones left out)."""

    @property
    def key(self) -> tuple[str, str]:
        return (self.job, self.node)


@dataclass(eq=False, kw_only=True, slots=True)
class _Worker(_Beat):
    """What the detector knows about one live incarnation of a worker."""

    job: str
    worker: str
    pid: int
    host: str
    rank: int
    generation: int
    node: tuple[str, str] | None = None
    """(job, node) whose digests carry this worker; None for a worker heard directly."""
    digest_s: float = 0.0
    """That node's digest interval."""
    step: int = 0
    step_ms: float = 0.0
    steps: deque[float] = field(default_factory=deque)
    max_step_ms: float = 0.0
    """max(steps), kept as steps come and go (read on every heartbeat in COMPUTE)."""
    phase: Phase = Phase.STARTING
    phase_ms: float = 0.0
    phase_start: float = 0.0
    phase_start_wall: float = 0.0
    progress_at: float = 0.0
    progress_wall: float = 0.0
    stall_at: float | None = None
    """When the stall rule is next checked (None: not in COMPUTE when last checked)."""
    check_at: float | None = None
    """When the worker's one live heap entry fires: ``min(silence_at, stall_at)`` when
    pushed; both may have moved later since (see ``Detector._top_expired``)."""

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
    digests: int = 0
    ignored_digests: int = 0
    """Repeated/out-of-order digests, or from a launcher already judged lost."""
    digest_entries: int = 0
    """Digest entries that carried a new heartbeat (each counts as a heartbeat too)."""
    nodes_lost: int = 0
    nodes_left: int = 0
    """Nodes that fell silent with no worker in their last digest: forgotten, no verdict."""


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
        self._pause = 1.0 + self.config.pause_ratio
        c = self.config
        self._min_samples, self._min_std_ratio, self._min_std = c.min_samples, c.min_std_ratio, c.min_std_s
        self._digest_slack = c.digest_slack_ratio
        self._stall_floor, self._stall_factor = c.stall_floor_s, c.stall_factor
        self._stall_initial = max(c.stall_floor_s, c.stall_initial_s)
        self._tracked: dict[tuple[str, str], _Worker] = {}
        self._nodes: dict[tuple[str, str], _Node] = {}
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

    def nodes(self) -> Iterator[tuple[str, str, str]]:
        """(job, node, launcher) of every tracked node."""
        return ((n.job, n.node, n.launcher) for n in self._nodes.values())

    def node_snapshot(self, job: str, node: str) -> dict[str, float | int | str] | None:
        """What is known of a tracked node, for health output and tests."""
        n = self._nodes.get((job, node))
        if n is None:
            return None
        return {
            "launcher": n.launcher,
            "last_seq": n.last_seq,
            "samples": len(n.intervals),
            "mean_ms": n.mean_s * 1e3,
            "std_ms": n.std_s * 1e3,
            "threshold_ms": n.threshold_s * 1e3,
            "workers": len(n.workers),
            "phi": self._phi_now(n, self.clock()),
        }

    def snapshot(self, job: str, worker: str) -> dict[str, float | int | str] | None:
        """What is known of a tracked worker, for health output and tests."""
        w = self._tracked.get((job, worker))
        if w is None:
            return None
        now = self.clock()
        self._fresh(w)
        return {
            "pid": w.pid,
            "rank": w.rank,
            "generation": w.generation,
            "last_seq": w.last_seq,
            "samples": len(w.intervals),
            "mean_ms": w.mean_s * 1e3,
            "std_ms": w.std_s * 1e3,
            "threshold_ms": w.threshold_s * 1e3,
            "slack_ms": w.slack_s * 1e3,
            "node": w.node[1] if w.node else "",
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
            self._goodbye(hb.job, hb.worker, hb.pid)
            return True
        if w is None or w.pid != hb.pid:
            if incident_id(hb.job, hb.worker, hb.pid) in self._closed:
                self.stats.ignored_heartbeats += 1
                return False
            w = self._new_worker(
                hb.job, hb.worker, hb.pid, hb.host, hb.rank, hb.generation, hb.step, hb.seq,
                hb.interval_ms / 1e3, now, self.wall(),
            )  # fmt: skip
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
        self._learn_progress(w, hb.phase, hb.phase_ms, hb.step, hb.step_ms, now, hb.ts, fresh)
        self._schedule(w)
        return True

    def observe_digest(self, d: NodeDigest) -> bool:
        """Learn from one node's digest (the node is alive, and so is each worker whose
        entry moved on); returns False when it was ignored: a repeated or out-of-order
        ``seq``, or a launcher already judged lost."""
        rows = [digest_row(e) for e in d.entries]
        return self.observe_digest_rows(d.job, d.node, d.launcher, d.host, d.seq, d.interval_ms, rows)

    def observe_digest_rows(
        self,
        job: str,
        node: str,
        launcher: str,
        host: str,
        seq: int,
        interval_ms: float,
        rows: list[DigestRow],
    ) -> bool:
        """:meth:`observe_digest` for a digest already validated and taken apart (the
        service's hot path: no model per entry)."""
        now, wall = self.clock(), self.wall()
        key = (job, node)
        n = self._nodes.get(key)
        interval = interval_ms / 1e3
        if n is None or n.launcher != launcher:
            # (a tracked launcher is never closed: a verdict or a new launcher untracks it)
            if node_incident_id(job, node, launcher) in self._closed:
                self.stats.ignored_digests += 1
                return False
            if n is not None:  # a new launcher on the node: the old one is gone for good
                self._close(node_incident_id(n.job, n.node, n.launcher), "replaced")
            n = _Node(
                token=next(self._tokens),
                declared_s=interval,
                last_arrival=now,
                last_wall=wall,
                last_seq=seq,
                intervals=IntervalWindow(self.config.window),
                job=job,
                node=node,
                launcher=launcher,
                host=host,
            )
            self._nodes[key] = n
        elif seq <= n.last_seq:
            self.stats.ignored_digests += 1
            return False
        else:
            if n.last_arrival >= self._hold_until:
                n.intervals.add(now - n.last_arrival)
            n.last_arrival, n.last_wall, n.last_seq = now, wall, seq
            n.declared_s = interval
        self.stats.digests += 1
        n.host = host
        done = Phase.DONE
        workers = [(r[0], r[1]) for r in rows if r[7] is not done]
        if workers != n.workers:  # (usually the same workers as last time: nobody left)
            listed = {(r[0], r[1]) for r in rows}
            for worker, pid in n.workers:
                w = self._tracked.get((job, worker))
                if (worker, pid) not in listed and w is not None and w.pid == pid and w.node == key:
                    # The launcher forgets a worker once its process has ended: not a silence.
                    # A crash is judged by the launcher's exit report, which still finds no verdict.
                    del self._tracked[w.key]
            n.workers = workers
        self._schedule(n)
        # The hot path (16,000 entries per interval at 2,000 nodes): a known worker
        # whose entry moved on. Anything else takes _observe_entry.
        heard = 0
        tracked, hold = self._tracked, self._hold_until
        for row in rows:
            worker, pid, seq, rank, generation, step, step_ms, phase, phase_ms, age_ms, interval_ms = row
            w = tracked.get((job, worker))
            age = age_ms / 1e3
            at, at_wall = now - age, wall - age  # when the launcher received the heartbeat
            if w is None or w.pid != pid or seq <= w.last_seq or phase is done:
                heard += self._observe_entry(n, row, w, at, at_wall, interval)
                continue
            last = w.last_arrival
            if last >= hold:  # one sample per heartbeat the entry moved on by
                w.intervals.add((at - last if at > last else 0.0) / (seq - w.last_seq))
            w.last_arrival, w.last_wall, w.last_seq = (at if at > last else last), at_wall, seq
            w.declared_s = interval_ms / 1e3 or interval  # its own interval when the launcher knows it
            w.node, w.digest_s = key, interval
            w.rank, w.generation, w.host = rank, generation, n.host
            # what _learn_progress(..., fresh=False) does, inline (keep the two in step)
            if phase is not w.phase or phase_ms < w.phase_ms:
                w.phase = phase
                w.phase_start = at - phase_ms / 1e3
                w.phase_start_wall = at_wall - phase_ms / 1e3
            w.phase_ms = phase_ms
            if step > w.step:
                if step_ms > 0:
                    steps = w.steps
                    evicted = steps[0] if len(steps) == steps.maxlen else 0.0
                    steps.append(step_ms)
                    if step_ms >= w.max_step_ms:
                        w.max_step_ms = step_ms
                    elif evicted >= w.max_step_ms:
                        w.max_step_ms = max(steps)
                w.progress_at, w.progress_wall = at, at_wall
            w.step, w.step_ms = step, step_ms
            self._schedule_worker(w)
            heard += 1
        self.stats.heartbeats += heard
        self.stats.digest_entries += heard
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
            if w.node is not None:
                evidence["node"] = w.node[1]
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

    def tick(self) -> list[Verdict]:
        """Every verdict whose time has come, in deadline order. O(expired)."""
        now = self.clock()
        out: list[Verdict] = []
        while (entry := self._top_expired(now)) is not None:
            heapq.heappop(self._heap)
            kind, b = entry
            if isinstance(b, _Node):
                if (lost := self._node_verdict(b, now)) is not None:
                    out.append(lost)
            elif kind is _Kind.SILENCE:
                out.append(self._silence_verdict(b, now))
            else:
                out.append(self._stall_verdict(b, now))
        return out

    def stall_bound(self, w: _Worker) -> float:
        """Seconds a rank may stay in COMPUTE without finishing a step."""
        c = self.config
        if not w.steps:
            return max(c.stall_floor_s, c.stall_initial_s)
        return max(c.stall_floor_s, c.stall_factor * w.max_step_ms / 1e3)

    # -- internals -----------------------------------------------------------------
    def _goodbye(self, job: str, worker: str, pid: int) -> None:
        iid = incident_id(job, worker, pid)
        if iid not in self._closed:
            self.stats.clean_exits += 1
            self._close(iid, "leaving")
        w = self._tracked.get((job, worker))
        if w is not None and w.pid == pid:
            del self._tracked[w.key]

    def _observe_entry(
        self, n: _Node, row: DigestRow, w: _Worker | None, at: float, at_wall: float, digest_s: float
    ) -> bool:
        """A digest entry off the hot path: a goodbye, no news, or a new incarnation.
        True when it carried a new heartbeat."""
        worker, pid, seq, rank, generation, step, step_ms, phase, phase_ms, _, interval_ms = row
        if phase is Phase.DONE:
            self._goodbye(n.job, worker, pid)
            return False
        if w is not None and w.pid == pid:  # no news (news took the hot path)
            # a verdict deferred while the node was silent is due again
            if w.silence_at is not None and self._silence_deadline(w) < w.silence_at:
                w.silence_at = None
                self._schedule_worker(w)
            return False
        if incident_id(n.job, worker, pid) in self._closed:
            return False
        interval = interval_ms / 1e3 or digest_s
        w = self._new_worker(n.job, worker, pid, n.host, rank, generation, step, seq, interval, at, at_wall)
        w.node, w.digest_s = n.key, digest_s
        self._learn_progress(w, phase, phase_ms, step, step_ms, at, at_wall, True)
        self._schedule_worker(w)
        return True

    def _new_worker(
        self,
        job: str,
        worker: str,
        pid: int,
        host: str,
        rank: int,
        generation: int,
        step: int,
        seq: int,
        declared_s: float,
        at: float,
        at_wall: float,
    ) -> _Worker:
        w = _Worker(
            job=job,
            worker=worker,
            pid=pid,
            host=host,
            token=next(self._tokens),
            rank=rank,
            generation=generation,
            declared_s=declared_s,
            last_arrival=at,
            last_wall=at_wall,
            last_seq=seq,
            intervals=IntervalWindow(self.config.window),
            steps=deque(maxlen=self.config.step_window),
            step=step,
        )
        self._tracked[w.key] = w
        return w

    def _learn_progress(
        self,
        w: _Worker,
        phase: Phase,
        phase_ms: float,
        step: int,
        step_ms: float,
        at: float,
        at_wall: float,
        fresh: bool,
    ) -> None:
        # A new phase, or the same one entered again between two heartbeats.
        if fresh or phase is not w.phase or phase_ms < w.phase_ms:
            w.phase = phase
            w.phase_start = at - phase_ms / 1e3
            w.phase_start_wall = at_wall - phase_ms / 1e3
        w.phase_ms = phase_ms
        if step > w.step:
            if step_ms > 0:
                evicted = w.steps[0] if len(w.steps) == w.steps.maxlen else 0.0
                w.steps.append(step_ms)
                if step_ms >= w.max_step_ms:
                    w.max_step_ms = step_ms
                elif evicted >= w.max_step_ms:
                    w.max_step_ms = max(w.steps)
            w.progress_at, w.progress_wall = at, at_wall
        w.step, w.step_ms = step, step_ms

    def _schedule(self, w: _Worker | _Node) -> None:
        if isinstance(w, _Worker):
            self._schedule_worker(w)
            return
        c = self.config
        mean, std = w.intervals.estimate(w.declared_s, c.min_samples, c.min_std_ratio, c.min_std_s)
        w.mean_s, w.std_s = mean, std
        w.threshold_s = mean * self._pause + self._z * std
        at = max(w.last_arrival, self._hold_until) + w.threshold_s + w.slack_s
        if w.silence_at is None or at < w.silence_at:
            w.silence_at = at
            self._push(at, _Kind.NODE, w)

    def _schedule_worker(self, w: _Worker) -> None:
        """Push ``w``'s deadlines when they moved earlier (a later one is re-pushed
        lazily by :meth:`_top_expired`).

        Hot path (every heartbeat and digest entry). Its silence deadline usually
        moves later, by an interval, and is not needed until the heap entry expires:
        when even the earliest it can be (sigma at its floor) is not earlier than the
        heap entry, the estimate is left stale and made by :meth:`_fresh` on demand.
        """
        iv, silence_at = w.intervals, w.silence_at
        n = len(iv._samples)  # (IntervalWindow's state read directly: no calls on this path)
        if silence_at is not None and n >= self._min_samples and w.node is not None:
            mean = iv._sum / n
            floor = self._min_std_ratio * mean
            floor = floor if floor > self._min_std else self._min_std
            gap = w.digest_s - mean  # the slack, as in _slack
            slack = self._digest_slack * w.digest_s + (gap if gap > 0.0 else 0.0)
            last, hold = w.last_arrival, self._hold_until
            # the sum of _silence_deadline, with std at its floor: a lower bound
            if (last if last > hold else hold) + (mean * self._pause + self._z * floor) + slack >= silence_at:
                w.stale = True
            else:
                self._estimate(w)
        else:
            self._estimate(w)
        check = w.check_at
        if not w.stale:
            at = self._silence_deadline(w)
            if silence_at is None or at < silence_at:
                w.silence_at = at
                if check is None or at < check:
                    w.check_at = check = at
                    self._push(at, _Kind.SILENCE, w)
        if w.phase is Phase.COMPUTE:  # (stall_bound, inline)
            since = w.progress_at if w.progress_at > w.phase_start else w.phase_start
            if w.steps:
                bound = self._stall_factor * w.max_step_ms / 1e3
                at = since + (bound if bound > self._stall_floor else self._stall_floor)
            else:
                at = since + self._stall_initial
            stall_at = w.stall_at
            if stall_at is None or at < stall_at:
                w.stall_at = at
                if check is None or at < check:
                    w.check_at = at
                    self._push(at, _Kind.STALL, w)

    def _slack(self, w: _Worker, mean: float) -> float:
        if w.node is None:
            return w.slack_s
        # seen only with the next digest: up to one digest interval late, more
        # when the worker heartbeats faster than its node digests
        gap = w.digest_s - mean
        return self._digest_slack * w.digest_s + (gap if gap > 0.0 else 0.0)

    def _estimate(self, w: _Worker) -> None:
        """Set ``w``'s mean, floored sigma, threshold and slack from its samples.

        (:meth:`IntervalWindow.estimate` and :meth:`_slack`, inline: this runs for
        every worker about once per interval.)
        """
        iv = w.intervals
        n = len(iv._samples)
        if n < self._min_samples:
            mean, std = iv.estimate(w.declared_s, self._min_samples, self._min_std_ratio, self._min_std)
        else:
            mean = iv._sum / n
            var = iv._sumsq / n - mean * mean
            std = math.sqrt(var) if var > 0.0 else 0.0
            floor = self._min_std_ratio * mean
            floor = floor if floor > self._min_std else self._min_std
            std = std if std > floor else floor
        if w.node is not None:
            gap = w.digest_s - mean
            w.slack_s = self._digest_slack * w.digest_s + (gap if gap > 0.0 else 0.0)
        w.mean_s, w.std_s = mean, std
        w.threshold_s = mean * self._pause + self._z * std
        w.stale = False

    def _fresh(self, w: _Beat) -> None:
        """Make a lazily scheduled worker's estimate current before reading it."""
        if w.stale:
            assert isinstance(w, _Worker)
            self._estimate(w)

    def _silence_deadline(self, w: _Beat) -> float:
        self._fresh(w)
        last, hold = w.last_arrival, self._hold_until
        return (last if last > hold else hold) + w.threshold_s + w.slack_s

    def _push(self, at: float, kind: _Kind, w: _Worker | _Node) -> None:
        heapq.heappush(self._heap, (at, next(self._counter), kind, w.key, w.token))

    def _node_overdue(self, w: _Worker, now: float) -> _Node | None:
        """The node that carries ``w``, if its next digest is overdue (it may be lost)."""
        n = self._nodes.get(w.node) if w.node is not None else None
        if n is None:
            return None
        expected = max(n.last_arrival, self._hold_until) + n.mean_s * (1.0 + self.config.pause_ratio)
        return n if now > expected else None

    def _top_expired(self, now: float) -> tuple[_Kind, _Worker | _Node] | None:
        """Tidy the heap top until it is a real expiry (returned) or in the future.

        A node has one heap entry, at its ``silence_at``; a worker has one, at its
        ``check_at``, for the earlier of its two deadlines (``silence_at``,
        ``stall_at``). An entry is live if its incarnation is still tracked and it is
        the entry that ``silence_at``/``check_at`` points to. A deadline checked
        before its real time (newer heartbeats, a hold moved it later) is moved to
        that time and the entry re-pushed (one ``heapreplace``). When a worker's
        silence is checked, its stall deadline is brought up to date too (cleared
        out of COMPUTE, else the learned bound, which only moves later), so a rank
        that keeps alternating COMPUTE and COLLECTIVE costs no heap operation of
        its own for the stall rule.
        """
        heap, tracked, nodes = self._heap, self._tracked, self._nodes
        while heap and heap[0][0] <= now:
            at, _, kind, key, token = heap[0]
            if kind is _Kind.NODE:
                n = nodes.get(key)
                if n is None or n.token != token or n.silence_at != at:
                    heapq.heappop(heap)
                    continue
                if now < self._hold_until:
                    return None
                real = self._silence_deadline(n)
                if real <= now:
                    return kind, n
                n.silence_at = real
                heapq.heapreplace(heap, (real, next(self._counter), kind, key, token))
                continue
            w = tracked.get(key)
            if w is None or w.token != token or w.check_at != at:
                heapq.heappop(heap)
                continue
            if now < self._hold_until:
                return None
            silence_at, stall_at = w.silence_at, w.stall_at
            if stall_at is not None and (silence_at is None or stall_at < silence_at):
                kind = _Kind.STALL
                real_stall: float | None
                if w.phase is not Phase.COMPUTE:
                    real_stall = None
                elif w.last_arrival < self._hold_until:
                    real_stall = now + w.declared_s  # wait for a heartbeat after the hold to confirm
                else:
                    real_stall = w.stall_since[0] + self.stall_bound(w)
                if real_stall is not None and real_stall <= now:
                    node = self._node_overdue(w, now)
                    if node is not None:  # no news of the node either: its verdict (or next digest) decides
                        real_stall = max(self._silence_deadline(node), now + 1e-3)
                    if real_stall <= now:
                        return kind, w
                w.stall_at = stall_at = real_stall
            else:
                kind = _Kind.SILENCE
                if w.stale:  # (_silence_deadline, inline)
                    self._estimate(w)
                last, hold = w.last_arrival, self._hold_until
                real = (last if last > hold else hold) + w.threshold_s + w.slack_s
                if real <= now:
                    node = self._node_overdue(w, now)
                    if node is not None:  # no news of the node either: its verdict (or next digest) decides
                        real = max(self._silence_deadline(node), now + 1e-3)
                    if real <= now:
                        return kind, w
                w.silence_at = silence_at = real
                if stall_at is not None and stall_at > now:  # (one that is due is checked on its own)
                    if w.phase is not Phase.COMPUTE:
                        w.stall_at = stall_at = None
                    elif last >= hold:  # (stall_since and stall_bound, inline)
                        since = w.progress_at if w.progress_at > w.phase_start else w.phase_start
                        if w.steps:
                            bound = self._stall_factor * w.max_step_ms / 1e3
                            bound = bound if bound > self._stall_floor else self._stall_floor
                        else:
                            bound = self._stall_initial
                        w.stall_at = stall_at = since + bound
            if stall_at is not None and (silence_at is None or stall_at < silence_at):
                nxt, kind = stall_at, _Kind.STALL
            elif silence_at is not None:
                nxt, kind = silence_at, _Kind.SILENCE
            else:  # (not reached: a tracked worker always has a silence deadline)
                w.check_at = None
                heapq.heappop(heap)
                continue
            w.check_at = nxt
            heapq.heapreplace(heap, (nxt, next(self._counter), kind, key, token))
        return None

    def _phi_now(self, w: _Beat, now: float) -> float:
        self._fresh(w)
        elapsed = now - max(w.last_arrival, self._hold_until)
        return round(phi(elapsed, w.mean_s * (1.0 + self.config.pause_ratio), w.std_s), 2)

    def _silence_evidence(self, b: _Beat, now: float) -> Evidence:
        """What a silence verdict on a worker or a node reports about its heartbeats."""
        self._fresh(b)
        return {
            "phi": self._phi_now(b, now),
            "threshold": self.config.phi_threshold,
            "elapsed_ms": round((now - b.last_arrival) * 1e3, 1),
            "threshold_ms": round(b.threshold_s * 1e3, 1),
            "mean_interval_ms": round(b.mean_s * 1e3, 2),
            "std_interval_ms": round(b.std_s * 1e3, 2),
            "samples": len(b.intervals),
            "declared_interval_ms": round(b.declared_s * 1e3, 1),
            "last_seq": b.last_seq,
        }

    def _silence_verdict(self, w: _Worker, now: float) -> Incident:
        rank, generation = self._rank_of(w.job, w.worker, w)
        evidence = self._silence_evidence(w, now)
        evidence.update(
            slack_ms=round(w.slack_s * 1e3, 1),
            raw_std_interval_ms=round(w.intervals.std * 1e3, 2),
            step=w.step,
            phase=w.phase.value,
            host=w.host,
        )
        if w.node is not None:
            evidence["node"] = w.node[1]
        return self._verdict(
            Incident(
                w.job, w.worker, w.pid, rank, generation, FaultCause.HEARTBEAT_LOST, w.last_wall, evidence
            ),
            w,
        )

    def _node_verdict(self, n: _Node, now: float) -> NodeIncident | None:
        """NodeLost for a silent node with workers (closing them); None for an empty one."""
        del self._nodes[n.key]
        iid = node_incident_id(n.job, n.node, n.launcher)
        if not n.workers:
            self.stats.nodes_left += 1
            self._close(iid, "left")
            return None
        for worker, pid in n.workers:  # lost with the node: no RankHung of their own
            w = self._tracked.get((n.job, worker))
            if w is not None and w.pid == pid:
                del self._tracked[w.key]
            self._close(incident_id(n.job, worker, pid), "node_lost")
        evidence = self._silence_evidence(n, now)
        evidence.update(launcher=n.launcher, host=n.host, workers=len(n.workers))
        self._close(iid, FaultCause.HEARTBEAT_LOST.value)
        self.stats.incidents += 1
        self.stats.nodes_lost += 1
        return NodeIncident(n.job, n.node, n.launcher, tuple(w for w, _ in n.workers), n.last_wall, evidence)

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


def _example_digest(seq: int) -> NodeDigest:
    entry = DigestEntry(
        worker="n0-w0",
        pid=200,
        seq=seq,
        rank=0,
        generation=1,
        step=seq,
        step_ms=50.0,
        phase=Phase.COLLECTIVE,
        phase_ms=1.0,
        age_ms=30.0,
    )
    return NodeDigest(
        job="j1", node="n0", launcher="l0", host="h", seq=seq, interval_ms=100.0, entries=[entry]
    )
