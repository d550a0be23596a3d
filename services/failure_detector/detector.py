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

Four ways a worker is judged faulty:

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
- **collective hang** (:meth:`Detector.tick`): a rank hung inside a collective,
  heartbeats going on. Each rank runs its gradient all-reduce with a per-op
  timeout learned from its recent all-reduces and reports it in its heartbeats
  (``collective_bound_ms``); a healthy rank whose all-reduce timed out goes
  ``RECOVERING``. A rank is *left behind* when it has been in ``COLLECTIVE``
  longer than its own bound plus slack (:meth:`Detector.collective_bound`) while a
  peer of the same job and generation has been seen ``RECOVERING``, that slack
  ago at least (the other peers, whose timeouts fire about then, must have been
  heard leaving too): its op should have ended by then, so it is not in a working
  collective -> ``collective_hang``, ``fault_at`` when it entered ``COLLECTIVE``. Peers that timed out are
  ``RECOVERING``, so they are never blamed; while every member is still in
  ``COLLECTIVE`` nobody is judged by this rule (their own timeouts release them).
  The check shares the stall rule's deadline (a worker is in one phase at a time)
  and costs nothing until a peer of the generation has left.

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

Inputs are checked before they count (a forged heartbeat must change nothing):

- **registered pid** (:meth:`Detector.register`): a worker's ``Registered`` event
  names its pid (and incarnation and launch). A heartbeat or digest entry whose
  pid is not the registered one is refused; a new pid of a worker is taken only
  after a ``Registered`` with that pid (a restart registers). A worker heard
  before its ``Registered`` arrived (the event stream and the heartbeats race; a
  detector restarted after the registration) is tracked provisionally, under the
  same sequence rules, and its registration wins: a tracked incarnation of
  another pid is dropped (no verdict: its exit report still counts).
- **sequence bound**: a ``seq`` more than ``seq_slack + seq_rate x elapsed /
  interval`` ahead of the last accepted one is refused (``elapsed`` since that
  heartbeat, ``interval`` the smaller of the one declared when the incarnation
  was first heard and the learned one; not applied while the detector holds, nor
  before an interval is known). The same bound applies to a node's digests.
- **stale and resync**: a ``seq`` not above the last accepted one is stale and
  ignored, except one strictly between the last two accepted when they were more
  than one apart (or below the first one heard): that is a second sender under
  the same pid, a forger that jumped ahead, and the heartbeat is taken as news
  and the sequence follows it again (``seq_resyncs``). So a forged jump within
  the bound blinds the detector until the real sender's next heartbeat at most.

- **the sender's node** (:meth:`Detector.assign`): the planner's answers to the
  launchers say which node runs which worker; a digest entry or an exit report
  about a worker from another node's launcher is refused (a forged ``DONE`` entry
  would make the detector forget a rank, a forged exit would get it replaced).

Refused inputs are counted (``Stats.refused_pid``, ``refused_seq``,
``refused_node``) and queued in :attr:`Detector.refused` for the service to log
and report.

**Mass silence** (:meth:`Detector.tick`): when a silence verdict (a worker's or a
node's) comes due, the detector looks one interval ahead: if the members of
that job whose silence deadlines fall within it cover at least ``mass_ratio`` of
its tracked workers (and at least ``mass_min``), or of its nodes, it is a
partition between the ranks and NATS rather than a mass death, and every silence
verdict of that job is held for ``mass_hold_s`` from then (:class:`MassHold`,
listed once in :attr:`Detector.mass_holds` for the service to log). Members heard
again meanwhile are not judged; those still silent after it are (evidence
``mass_silence``). Process exits are never held, nor are step stalls of ranks
still heard.

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
from collections.abc import Callable, Iterable, Iterator
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
    Registered,
)

__all__ = [
    "Clock",
    "Detector",
    "DetectorConfig",
    "DigestRow",
    "FakeClock",
    "Incident",
    "IntervalWindow",
    "MassHold",
    "NodeIncident",
    "Refusal",
    "Stats",
    "Verdict",
    "digest_row",
    "incident_id",
    "node_incident_id",
    "phi",
    "phi_threshold_z",
]

Clock = Callable[[], float]
DigestRow = tuple[str, int, int, int, int, int, float, Phase, float, float, float, float]
"""One digest entry as the detector reads it: ``(worker, pid, seq, rank, generation,
step, step_ms, phase, phase_ms, age_ms, interval_ms, collective_bound_ms)``, the fields of
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
        e.phase, e.phase_ms, e.age_ms, e.interval_ms, e.collective_bound_ms,
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
    collective_slack_ratio: float = 0.25
    collective_slack_intervals: float = 2.0
    """A rank is left behind in COLLECTIVE once past its reported bound plus a slack,
    and at least that slack after a peer of its generation left: ``max(
    collective_slack_ratio x bound, collective_slack_intervals x its heartbeat
    interval)``, plus its node's digest interval. Peers blocked on the same hung
    rank time out within about one normal all-reduce of each other (a quarter of the
    bound with the trainer's factor 4), and their leaving is heard a heartbeat later."""
    digest_slack_ratio: float = 0.5
    """Added to a digest-carried worker's silence deadline, as a fraction of its
    node's digest interval: a heartbeat is seen only with the node's next digest."""
    closed_capacity: int = 100_000
    """Closed incarnations remembered (to drop their late heartbeats and repeated exits)."""
    seq_slack: int = 5
    """Heartbeats a sender may be ahead of the time since its last accepted one."""
    seq_rate: float = 2.0
    """How many times its own rate a sender's ``seq`` may advance (the bound's slope)."""
    mass_hold_s: float = 10.0
    """How long a mass silence holds its job's silence verdicts (0: never held)."""
    mass_ratio: float = 0.5
    """Share of a job's tracked workers (or nodes) silent at once that makes a mass silence."""
    mass_min: int = 2
    """...and at least this many of them."""

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
        if self.seq_slack < 1 or not self.seq_rate >= 1.0:
            raise ValueError("seq_slack >= 1 and seq_rate >= 1 are required")
        if not self.mass_hold_s >= 0 or not 0 < self.mass_ratio <= 1 or self.mass_min < 1:
            raise ValueError("mass_hold_s >= 0, 0 < mass_ratio <= 1 and mass_min >= 1 are required")
        if self.collective_slack_ratio < 0 or self.collective_slack_intervals < 0:
            raise ValueError("collective slacks must be non-negative")


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
    seq_interval: float = 0.0
    """The interval declared when the incarnation was first heard, for the sequence
    bound (0: unknown; a later heartbeat cannot loosen the bound by declaring less)."""
    gap_from: int | None = None
    """``last_seq`` before the last accepted advance when that advance skipped numbers
    (-1: the first one heard), else None: a heartbeat strictly between it and
    ``last_seq`` is a second sender's (see the module's "stale and resync")."""


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
    bound_ms: float = 0.0
    """The per-op timeout of its current (or last) all-reduce, as it reported (0: none)."""
    stall_at: float | None = None
    """When the stall rule (in COMPUTE) or the collective-hang rule (in COLLECTIVE, once
    a peer has left) is next checked (None: neither applied when last checked)."""
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


@dataclass(slots=True)
class _Left:
    """The workers of one (job, generation) heard RECOVERING, and when (monotonic) they left."""

    first: float
    workers: dict[str, float] = field(default_factory=dict)


@dataclass
class _Membership:
    generation: int = 0
    ranks: dict[str, int] = field(default_factory=dict)
    spares: set[str] = field(default_factory=set)


@dataclass(frozen=True, slots=True)
class _Registration:
    pid: int
    incarnation: int
    launch: str
    ts: float


@dataclass(frozen=True, slots=True)
class Refusal:
    """A heartbeat, digest entry or digest the detector refused (it changed nothing)."""

    job: str
    worker: str
    """The worker, or ``node:<node>`` for a whole digest."""
    pid: int
    seq: int
    reason: str
    kind: str
    """``pid`` (not the registered pid), ``seq`` (beyond the sequence bound) or
    ``node`` (about a worker of another node than the sender's)."""


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
    registrations: int = 0
    stale_registrations: int = 0
    """Registrations older than the known one, or of a closed incarnation: ignored."""
    displaced: int = 0
    """Tracked incarnations dropped because the worker registered another pid."""
    refused_pid: int = 0
    """Heartbeats and digest entries whose pid is not the worker's registered one."""
    refused_seq: int = 0
    """Heartbeats, digest entries and digests whose seq was beyond the sequence bound."""
    refused_node: int = 0
    """Digest entries and exit reports about a worker of another node than the sender's."""
    seq_resyncs: int = 0
    """Heartbeats that showed a second sender under one pid (see "stale and resync")."""
    mass_holds: int = 0
    mass_held: int = 0
    """Verdicts published after a mass-silence hold (their members stayed silent)."""


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
        self._seq_slack, self._seq_rate = c.seq_slack, c.seq_rate
        self._mass_hold_s = c.mass_hold_s
        self._registered: dict[tuple[str, str], _Registration] = {}
        self._node_of: dict[tuple[str, str], str] = {}
        """(job, worker) -> the node the planner placed it on (:meth:`assign`)."""
        self.refused: list[Refusal] = []
        """Inputs refused since the service last took them (:meth:`take_refused`)."""
        self._mass: dict[str, MassHold] = {}
        """job -> its latest mass-silence hold (kept after it ends: verdicts say they were held)."""
        self._mass_checked: dict[str, float] = {}
        """job -> until when its last "no mass silence" finding stands (the check costs a heap walk)."""
        self.mass_holds: list[MassHold] = []
        """Holds begun since the service last took them (:meth:`take_mass_holds`)."""
        self._left: dict[tuple[str, int], _Left] = {}
        """(job, generation) -> the workers heard RECOVERING in that generation: the
        peers that left its collectives."""

    # -- introspection -------------------------------------------------------------
    def __len__(self) -> int:
        """Number of tracked worker incarnations."""
        return len(self._tracked)

    def tracked(self) -> Iterator[tuple[str, str, int]]:
        """(job, worker, pid) of every tracked incarnation."""
        return ((w.job, w.worker, w.pid) for w in self._tracked.values())

    def is_closed(self, job: str, worker: str, pid: int) -> bool:
        return incident_id(job, worker, pid) in self._closed

    def registered_pid(self, job: str, worker: str) -> int | None:
        """The pid ``worker`` last registered, None if no registration was heard."""
        reg = self._registered.get((job, worker))
        return reg.pid if reg is not None else None

    def mass_hold(self, job: str) -> MassHold | None:
        """``job``'s latest mass-silence hold (it may have ended: see ``until``)."""
        return self._mass.get(job)

    def take_refused(self) -> list[Refusal]:
        """The inputs refused since the last call (for the service to log and report)."""
        out, self.refused = self.refused, []
        return out

    def take_mass_holds(self) -> list[MassHold]:
        """The mass-silence holds begun since the last call (for the service to log)."""
        out, self.mass_holds = self.mass_holds, []
        return out

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
            "registered": (r := self._registered.get(w.key)) is not None and r.pid == w.pid,
        }

    @property
    def hold_until(self) -> float:
        return self._hold_until

    # -- inputs --------------------------------------------------------------------
    def observe(self, hb: Heartbeat) -> bool:
        """Learn from one heartbeat; returns False when it was ignored or refused.

        A heartbeat is ignored when its incarnation was closed (a verdict, a clean
        exit or a plan removed it) or its ``seq`` is stale; it is refused (counted
        and queued in :attr:`refused`) when its pid is not the worker's registered
        one or its ``seq`` is beyond the bound (the module's "Inputs are checked").
        """
        now = self.clock()
        key = (hb.job, hb.worker)
        w = self._tracked.get(key)
        closed = False
        if w is None or w.pid != hb.pid:
            closed = incident_id(hb.job, hb.worker, hb.pid) in self._closed
            if not closed and self._wrong_pid(hb.job, hb.worker, hb.pid, hb.seq, "heartbeat"):
                return False
        if hb.phase is Phase.DONE:  # a clean goodbye: the silence that follows is no fault
            self._goodbye(hb.job, hb.worker, hb.pid)
            return True
        if w is None or w.pid != hb.pid:
            if closed:
                self.stats.ignored_heartbeats += 1
                return False
            w = self._new_worker(
                hb.job, hb.worker, hb.pid, hb.host, hb.rank, hb.generation, hb.step, hb.seq,
                hb.interval_ms / 1e3, now, self.wall(),
            )  # fmt: skip
            fresh = True
        elif hb.seq <= w.last_seq:
            gap = w.gap_from
            if gap is None or not gap < hb.seq < w.last_seq:
                self.stats.ignored_heartbeats += 1
                return False
            # a second sender under this pid jumped ahead: follow the one below again
            self.stats.seq_resyncs += 1
            w.gap_from = None
            w.last_arrival, w.last_wall, w.last_seq = now, self.wall(), hb.seq
            w.declared_s = hb.interval_ms / 1e3
            fresh = False
        else:
            ahead = hb.seq - w.last_seq
            what = "heartbeat"
            if ahead > self._seq_slack and self._seq_refused(w, hb.seq, now, what):
                return False
            w.gap_from = w.last_seq if ahead > 1 else None
            if w.last_arrival >= self._hold_until:  # a sample that spans a hold is not learned
                w.intervals.add(now - w.last_arrival)
            w.last_arrival, w.last_wall, w.last_seq = now, self.wall(), hb.seq
            w.declared_s = hb.interval_ms / 1e3
            fresh = False
        self.stats.heartbeats += 1
        w.rank, w.generation, w.host = hb.rank, hb.generation, hb.host
        w.bound_ms = hb.collective_bound_ms
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
                seq_interval=interval,
                gap_from=-1,
            )
            self._nodes[key] = n
        elif seq <= n.last_seq:
            gap = n.gap_from
            if gap is None or not gap < seq < n.last_seq:
                self.stats.ignored_digests += 1
                return False
            self.stats.seq_resyncs += 1  # a second sender as this launcher jumped ahead (see observe)
            n.gap_from = None
            n.last_arrival, n.last_wall, n.last_seq = now, wall, seq
            n.declared_s = interval
        else:
            ahead = seq - n.last_seq
            if ahead > self._seq_slack and self._seq_refused(n, seq, now, "digest"):
                return False
            n.gap_from = n.last_seq if ahead > 1 else None
            if n.last_arrival >= self._hold_until:
                n.intervals.add(now - n.last_arrival)
            n.last_arrival, n.last_wall, n.last_seq = now, wall, seq
            n.declared_s = interval
        self.stats.digests += 1
        n.host = host
        owners = self._node_of
        if any(owners.get((job, r[0]), node) != node for r in rows):  # (one lookup per entry)
            rows = [r for r in rows if not self._foreign(job, node, r[0], r[1], r[2], "digest entry")]
        done = Phase.DONE
        workers = [(r[0], r[1]) for r in rows if r[7] is not done]
        if workers != n.workers:  # (usually the same workers as last time: nobody left)
            listed = {(r[0], r[1]) for r in rows}
            reg, kept = self._registered, []
            for worker, pid in workers:
                r = reg.get((job, worker))
                if r is None or r.pid == pid:
                    kept.append((worker, pid))
                elif (worker, r.pid) in n.workers:  # an entry of another pid (refused below): as it was
                    kept.append((worker, r.pid))
                    listed.add((worker, r.pid))
            workers = kept
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
        slack = self._seq_slack
        recovering = Phase.RECOVERING
        for row in rows:
            worker, pid, seq, rank, generation, step, step_ms, phase, phase_ms, age_ms, interval_ms, bound = (
                row
            )
            w = tracked.get((job, worker))
            age = age_ms / 1e3
            at, at_wall = now - age, wall - age  # when the launcher received the heartbeat
            if w is None or w.pid != pid or seq <= w.last_seq or phase is done:
                heard += self._observe_entry(n, row, w, at, at_wall, interval)
                continue
            ahead = seq - w.last_seq
            if ahead > 1:  # (the sequence bound, and remember the gap: see observe)
                if ahead > slack and self._seq_refused(w, seq, now, "digest entry"):
                    continue
                w.gap_from = w.last_seq
            else:
                w.gap_from = None
            last = w.last_arrival
            if last >= hold:  # one sample per heartbeat the entry moved on by
                w.intervals.add((at - last if at > last else 0.0) / (seq - w.last_seq))
            w.last_arrival, w.last_wall, w.last_seq = (at if at > last else last), at_wall, seq
            w.declared_s = interval_ms / 1e3 or interval  # its own interval when the launcher knows it
            w.node, w.digest_s = key, interval
            w.rank, w.generation, w.host = rank, generation, n.host
            w.bound_ms = bound
            # what _learn_progress(..., fresh=False) does, inline (keep the two in step)
            if phase is not w.phase or phase_ms < w.phase_ms:
                w.phase = phase
                w.phase_start = at - phase_ms / 1e3
                w.phase_start_wall = at_wall - phase_ms / 1e3
                if phase is recovering:
                    self._mark_left(w)
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
        """A process ended. Returns the incident, or None (clean exit, already closed, or
        refused: reported by the launcher of another node than the worker's)."""
        if self._foreign(ex.job, ex.node, ex.worker, ex.pid, -1, "exit report"):
            return None
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
        for key in [k for k in self._left if k[0] == plan.job and k[1] < plan.generation - 1]:
            del self._left[key]  # (the last generation's stay: a reform may come before a verdict)
        return True

    def assign(self, job: str, node: str, workers: Iterable[str]) -> None:
        """Learn that ``workers`` of ``job`` run on ``node`` (the planner's answer to the
        node's launcher, or its request to start spares there).

        From then on only that node's launcher speaks for them: a digest entry or an
        exit report about one of them from another node is refused (a launcher's
        credentials cannot end, replace or silence another node's ranks). A worker
        not assigned yet (the join answer and the first digests race; a detector
        restarted reads the answers again first) is taken from any node.
        """
        for w in workers:
            self._node_of[(job, w)] = node
        while len(self._node_of) > self.config.closed_capacity:
            del self._node_of[next(iter(self._node_of))]

    def node_of(self, job: str, worker: str) -> str | None:
        return self._node_of.get((job, worker))

    def _foreign(self, job: str, node: str, worker: str, pid: int, seq: int, what: str) -> bool:
        """Whether ``worker`` runs on another node than ``node`` (then refused)."""
        owner = self._node_of.get((job, worker))
        if owner is None or owner == node:
            return False
        self.stats.refused_node += 1
        self._refuse(
            job, worker, pid, seq, f"{what} of {job}/{worker} from node {node}: it runs on {owner}", "node"
        )
        return True

    def register(self, reg: Registered) -> tuple[str, int | None]:
        """Learn the pid ``reg.worker`` runs as (the ``Registered`` events, in stream order).

        Returns what it changed and the pid of a tracked incarnation it dropped:
        ``new`` (the worker's first registration heard), ``same`` (the pid it had),
        ``replaced`` (another pid before: a restart), or ``stale`` (an incarnation
        already closed: ignored). A tracked incarnation of another pid (heard before
        this registration, or an older process) is dropped without a verdict; its
        exit report still makes one.
        """
        key = (reg.job, reg.worker)
        if incident_id(reg.job, reg.worker, reg.pid) in self._closed:
            self.stats.stale_registrations += 1
            return "stale", None
        self.stats.registrations += 1
        cur = self._registered.pop(key, None)  # (re-inserted last: the oldest are evicted first)
        self._registered[key] = _Registration(reg.pid, reg.incarnation, reg.launch, reg.ts)
        while len(self._registered) > self.config.closed_capacity:
            del self._registered[next(iter(self._registered))]
        dropped = None
        w = self._tracked.get(key)
        if w is not None and w.pid != reg.pid:
            del self._tracked[key]
            self.stats.displaced += 1
            dropped = w.pid
        return ("new" if cur is None else "same" if cur.pid == reg.pid else "replaced"), dropped

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
        """Every verdict whose time has come, in deadline order. O(expired).

        A silence verdict that is part of a mass silence is held instead (see the
        module's "Mass silence"): it comes due again when the hold ends.
        """
        now = self.clock()
        out: list[Verdict] = []
        while (entry := self._top_expired(now)) is not None:
            heapq.heappop(self._heap)
            kind, b = entry
            if self._mass_hold_s > 0.0 and (until := self._mass_hold(kind, b, now)) is not None:
                self._defer(kind, b, until)
                continue
            decided = len(out)
            if isinstance(b, _Node):
                if (lost := self._node_verdict(b, now)) is not None:
                    out.append(lost)
            elif kind is _Kind.SILENCE:
                out.append(self._silence_verdict(b, now))
            elif b.phase is Phase.COLLECTIVE:
                out.append(self._hang_verdict(b, now))
            else:
                out.append(self._stall_verdict(b, now))
            if self._mass and len(out) > decided:
                self._mark_held(out[-1], kind, b, now)
        return out

    def stall_bound(self, w: _Worker) -> float:
        """Seconds a rank may stay in COMPUTE without finishing a step."""
        c = self.config
        if not w.steps:
            return max(c.stall_floor_s, c.stall_initial_s)
        return max(c.stall_floor_s, c.stall_factor * w.max_step_ms / 1e3)

    def collective_bound(self, w: _Worker) -> float:
        """Seconds a rank may stay in COLLECTIVE once a peer of its generation has left:
        the per-op timeout it reported plus :meth:`_collective_slack`."""
        return w.bound_ms / 1e3 + self._collective_slack(w)

    def _collective_slack(self, w: _Worker) -> float:
        """How late a rank may leave after its own timeout, or after a peer left, and be
        heard: the spread of peers' timeouts (a gloo timeout restarts with each
        partial transfer, about one normal all-reduce, <= bound / factor) and the
        heartbeat (and digest) that says so."""
        c = self.config
        bound = w.bound_ms / 1e3
        slack = max(c.collective_slack_ratio * bound, c.collective_slack_intervals * w.declared_s)
        return slack + (w.digest_s if w.node is not None else 0.0)

    # -- internals -----------------------------------------------------------------
    def _wrong_pid(self, job: str, worker: str, pid: int, seq: int, what: str) -> bool:
        """Whether ``worker`` registered a pid other than ``pid`` (then refused)."""
        reg = self._registered.get((job, worker))
        if reg is None or reg.pid == pid:
            return False
        self.stats.refused_pid += 1
        why = f"{what} of {job}/{worker} from pid {pid}: registered pid is {reg.pid}"
        self._refuse(job, worker, pid, seq, why, "pid")
        return True

    def _seq_refused(self, b: _Worker | _Node, seq: int, now: float, what: str) -> bool:
        """Whether ``seq`` is beyond the sequence bound of ``b`` (then refused).

        The bound is ``seq_slack + seq_rate x elapsed / interval`` past ``b.last_seq``:
        ``elapsed`` since its last accepted heartbeat (or digest), ``interval`` the
        smaller of the one declared when it was first heard and the learned one. It
        does not apply before an interval is known, nor while the detector holds (time
        says nothing about what the sender did then).
        """
        if b.last_arrival < self._hold_until:
            return False
        iv = b.seq_interval
        samples = b.intervals
        if len(samples) >= self._min_samples:
            mean = samples.mean
            if mean > 0.0 and (iv <= 0.0 or mean < iv):
                iv = mean
        if iv <= 0.0:
            return False
        elapsed = now - b.last_arrival
        bound = self._seq_slack + self._seq_rate * (elapsed if elapsed > 0.0 else 0.0) / iv
        ahead = seq - b.last_seq
        if ahead <= bound:
            return False
        self.stats.refused_seq += 1
        if isinstance(b, _Node):
            worker, pid = f"node:{b.node}", -1
        else:
            worker, pid = b.worker, b.pid
        self._refuse(
            b.job, worker, pid, seq,
            f"{what} of {b.job}/{worker[5:] if pid < 0 else worker}: seq {seq} is {ahead} past "
            f"{b.last_seq} after {elapsed * 1e3:.0f} ms (at most {bound:.1f} at {iv * 1e3:.0f} ms each)",
            "seq",
        )  # fmt: skip
        return True

    def _refuse(self, job: str, worker: str, pid: int, seq: int, reason: str, kind: str) -> None:
        if len(self.refused) < 10_000:  # (the service takes them after every input)
            self.refused.append(Refusal(job, worker, pid, seq, reason, kind))

    def _mass_hold(self, kind: _Kind, b: _Worker | _Node, now: float) -> float | None:
        """Until when the verdict on ``b``, due now, is held as part of a mass silence
        in its job; None to judge it now."""
        job = b.job
        rec = self._mass.get(job)
        if kind is _Kind.STALL:  # a rank still heard is judged as usual; a silent one waits with the rest
            held = rec is not None and now < rec.until and b.last_arrival <= rec.started
            return rec.until if held and rec is not None else None
        if isinstance(b, _Node) and not b.workers:
            return None  # a launcher that finished: forgotten, no verdict to hold
        if rec is not None:
            if now < rec.until:
                return rec.until
            if self._silence_deadline(b) <= rec.until:
                return None  # silent through the hold: judged now (and the verdict says so)
        if now < self._mass_checked.get(job, -math.inf):
            return None
        # One interval: members cut off together (their last heartbeats within one interval)
        # come due within it; one still heard is at least ~1.3 intervals from its deadline.
        self._fresh(b)
        window = b.mean_s
        workers, nodes = self._silent_within(job, b, now + window)
        c = self.config
        if len(workers) >= c.mass_min or len(nodes) >= c.mass_min:
            tracked_workers = sum(1 for k in self._tracked if k[0] == job)
            tracked_nodes = sum(1 for k in self._nodes if k[0] == job)
            if (len(workers) >= c.mass_min and len(workers) >= c.mass_ratio * tracked_workers) or (
                len(nodes) >= c.mass_min and len(nodes) >= c.mass_ratio * tracked_nodes
            ):
                until = now + self._mass_hold_s
                rec = MassHold(job, now, until, len(workers), len(nodes), tracked_workers, tracked_nodes)
                self._mass[job] = rec
                self.mass_holds.append(rec)
                self.stats.mass_holds += 1
                return rec.until
        self._mass_checked[job] = now + window / 2  # (a mass silence shows at its first verdict)
        return None

    def _silent_within(self, job: str, first: _Worker | _Node, horizon: float) -> tuple[set[str], set[str]]:
        """Workers and nodes of ``job`` whose silence deadline is ``horizon`` or earlier
        (``first``, just popped from the heap, included). Walks the heap's entries up
        to ``horizon`` (a heap entry is never later than its deadline)."""
        tracked, known = self._tracked, self._nodes
        workers: set[str] = set()
        nodes: set[str] = set()

        def add(x: _Worker | _Node) -> None:
            if isinstance(x, _Node):
                if x.workers:
                    nodes.add(x.node)
                    workers.update(w for w, _ in x.workers if (job, w) in tracked)
            else:
                workers.add(x.worker)

        add(first)
        heap = self._heap
        size = len(heap)
        stack = [0] if size else []
        while stack:
            i = stack.pop()
            at, _, kind, key, token = heap[i]
            if at > horizon:
                continue
            j = 2 * i + 1
            if j < size:
                stack.append(j)
                if j + 1 < size:
                    stack.append(j + 1)
            if key[0] != job:
                continue
            x: _Worker | _Node | None = known.get(key) if kind is _Kind.NODE else tracked.get(key)
            if x is not None and x.token == token and self._silence_deadline(x) <= horizon:
                add(x)
        return workers, nodes

    def _defer(self, kind: _Kind, b: _Worker | _Node, until: float) -> None:
        """Put the verdict on ``b``, due now, off until ``until`` (checked again then)."""
        if isinstance(b, _Node):
            b.silence_at = until
            self._push(until, _Kind.NODE, b)
            return
        if kind is _Kind.SILENCE:
            b.silence_at = until
        else:
            b.stall_at = until
        silence_at, stall_at = b.silence_at, b.stall_at
        if stall_at is not None and (silence_at is None or stall_at < silence_at):
            b.check_at = stall_at
            self._push(stall_at, _Kind.STALL, b)
        else:
            b.check_at = at = silence_at if silence_at is not None else until
            self._push(at, _Kind.SILENCE, b)

    def _held_until(self, job: str) -> float:
        rec = self._mass.get(job)
        return rec.until if rec is not None else -math.inf

    def _mark_held(self, v: Verdict, kind: _Kind, b: _Worker | _Node, now: float) -> None:
        """Say in ``v``'s evidence that it was held as a mass silence, if it was."""
        rec = self._mass.get(v.job)
        if rec is None or now < rec.until:
            return
        if kind is _Kind.STALL:
            if b.last_arrival > rec.started:
                return
        elif self._silence_deadline(b) > rec.until:
            return
        v.evidence.update(
            mass_silence=True,
            mass_hold_ms=round((rec.until - rec.started) * 1e3, 1),
            mass_silent_workers=rec.workers,
            mass_silent_nodes=rec.nodes,
            mass_tracked_workers=rec.tracked_workers,
        )
        self.stats.mass_held += 1

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
        worker, pid, seq, rank, generation, step, step_ms, phase, phase_ms, _, interval_ms, bound_ms = row
        closed = False
        if w is None or w.pid != pid:
            closed = incident_id(n.job, worker, pid) in self._closed
            if not closed and self._wrong_pid(n.job, worker, pid, seq, "digest entry"):
                return False
        if phase is Phase.DONE:
            self._goodbye(n.job, worker, pid)
            return False
        if w is not None and w.pid == pid:
            gap = w.gap_from
            if gap is not None and gap < seq < w.last_seq:  # a second sender jumped ahead (see observe)
                self.stats.seq_resyncs += 1
                w.gap_from = None
                last = w.last_arrival
                w.last_arrival, w.last_wall, w.last_seq = (at if at > last else last), at_wall, seq
                w.rank, w.generation, w.bound_ms = rank, generation, bound_ms
                self._learn_progress(w, phase, phase_ms, step, step_ms, at, at_wall, False)
                self._schedule_worker(w)
                return True
            # no news (news took the hot path): a verdict deferred while the node was silent is due again
            if w.silence_at is not None and self._silence_deadline(w) < w.silence_at:
                w.silence_at = None
                self._schedule_worker(w)
            return False
        if closed:
            return False
        interval = interval_ms / 1e3 or digest_s
        w = self._new_worker(n.job, worker, pid, n.host, rank, generation, step, seq, interval, at, at_wall)
        w.node, w.digest_s, w.bound_ms = n.key, digest_s, bound_ms
        w.seq_interval = interval_ms / 1e3  # (0 when the launcher does not know it: learned first)
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
            seq_interval=declared_s,
            gap_from=-1,
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
            if phase is Phase.RECOVERING:  # it left this generation's collectives
                self._mark_left(w)
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
        elif self._left and w.phase is Phase.COLLECTIVE and w.bound_ms > 0.0:
            hang_at = self._hang_at(w)
            stall_at = w.stall_at
            if hang_at is not None and (stall_at is None or hang_at < stall_at):
                w.stall_at = hang_at
                if check is None or hang_at < check:
                    w.check_at = hang_at
                    self._push(hang_at, _Kind.STALL, w)

    def _mark_left(self, w: _Worker) -> None:
        left = self._left.get((w.job, w.generation))
        if left is None:
            left = self._left[(w.job, w.generation)] = _Left(w.phase_start)
        if w.worker not in left.workers:
            left.workers[w.worker] = w.phase_start
            left.first = min(left.first, w.phase_start)

    def _hang_at(self, w: _Worker) -> float | None:
        """When a rank in COLLECTIVE is left behind: its bound and slack after it entered
        the phase, and no sooner than slack after the first peer left (the others, whose
        timeouts fire about then, must be heard leaving too); None while no peer of its
        generation has left, or it reports no bound."""
        if w.phase is not Phase.COLLECTIVE or w.bound_ms <= 0.0:
            return None
        left = self._left.get((w.job, w.generation))
        if left is None or (len(left.workers) == 1 and w.worker in left.workers):
            return None
        slack = self._collective_slack(w)
        at = w.phase_start + w.bound_ms / 1e3 + slack
        after_peer = left.first + slack
        return at if at > after_peer else after_peer

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
                if w.phase is Phase.COLLECTIVE:  # the collective-hang rule
                    real_stall = self._hang_at(w)
                    if real_stall is not None and w.last_arrival < self._hold_until:
                        real_stall = now + w.declared_s  # as below
                elif w.phase is not Phase.COMPUTE:
                    real_stall = None
                elif w.last_arrival < self._hold_until:
                    real_stall = now + w.declared_s  # wait for a heartbeat after the hold to confirm
                else:
                    real_stall = w.stall_since[0] + self.stall_bound(w)
                if real_stall is not None and real_stall <= now:
                    node = self._node_overdue(w, now)
                    if node is not None:  # no news of the node either: its verdict (or next digest) decides
                        real_stall = max(self._silence_deadline(node), self._held_until(node.job), now + 1e-3)
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
                        real = max(self._silence_deadline(node), self._held_until(node.job), now + 1e-3)
                    if real <= now:
                        return kind, w
                w.silence_at = silence_at = real
                if stall_at is not None and stall_at > now:  # (one that is due is checked on its own)
                    if w.phase is Phase.COLLECTIVE:
                        w.stall_at = stall_at = self._hang_at(w)
                    elif w.phase is not Phase.COMPUTE:
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

    def _hang_verdict(self, w: _Worker, now: float) -> Incident:
        rank, generation = self._rank_of(w.job, w.worker, w)
        left = self._left.get((w.job, w.generation))
        peers = sorted(p for p in left.workers if p != w.worker) if left is not None else []
        first = left.first if left is not None else now
        since = w.phase_start_wall
        evidence: Evidence = {
            "phase": w.phase.value,
            "phase_ms": round((now - w.phase_start) * 1e3, 1),
            "reported_phase_ms": round(w.phase_ms, 1),
            "bound_ms": round(w.bound_ms, 1),
            "slack_ms": round(self._collective_slack(w) * 1e3, 1),
            "peers_left": ",".join(peers[:8]) + (",..." if len(peers) > 8 else ""),
            "peers_left_count": len(peers),
            "first_left_ms": round((now - first) * 1e3, 1),
            "step": w.step,
            "last_seq": w.last_seq,
            "phi": self._phi_now(w, now),
            "host": w.host,
        }
        if w.node is not None:
            evidence["node"] = w.node[1]
        return self._verdict(
            Incident(w.job, w.worker, w.pid, rank, generation, FaultCause.COLLECTIVE_HANG, since, evidence),
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
