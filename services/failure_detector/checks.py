"""Input checks: whether a heartbeat, a digest (or one of its entries) or an exit
report may count. A forged input must change nothing.

- **registered pid** (:meth:`InputChecks.register`): a worker's ``Registered``
  event names its pid. A heartbeat or digest entry whose pid is not the registered
  one is refused (:meth:`InputChecks.wrong_pid`). A worker heard before its
  ``Registered`` arrived (the event stream and the heartbeats race) is tracked
  provisionally, and its registration wins (``Detector.register``).
- **the sender's node** (:meth:`InputChecks.assign`): the planner's answers to the
  launchers say which node runs which worker; a digest entry or an exit report
  about a worker from another node's launcher is refused
  (:meth:`InputChecks.foreign`).
- **sequence** (:meth:`InputChecks.sequence`): a ``seq`` not above the last
  accepted one is stale, except one strictly between the last two accepted when
  they were more than one apart (or below the first one heard): that is a second
  sender under the same pid, a forger that jumped ahead, and the sequence follows
  it again (a resync). A ``seq`` too far ahead of the time since the last
  accepted one is refused (:meth:`InputChecks.seq_refused`).

Refused inputs are counted in :class:`~.config.Stats` and queued in
:attr:`InputChecks.refused` for the service to log and report.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from enum import Enum

from phalanx.services.failure_detector.config import DetectorConfig, Stats
from phalanx.services.failure_detector.liveness import Liveness
from phalanx.services.failure_detector.tracking import Node, Worker

from phalanx.contract import Registered

__all__ = ["InputChecks", "Refusal", "Registration", "Seq"]


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


@dataclass(frozen=True, slots=True)
class Registration:
    """A worker's latest ``Registered`` event: the pid it runs as."""

    pid: int
    incarnation: int
    launch: str
    ts: float


class Seq(Enum):
    """What a heartbeat's (or digest's) ``seq`` is to its sender's sequence."""

    STALE = 0
    """Not above the last accepted one: ignored."""
    REFUSED = 1
    """Beyond the sequence bound: refused."""
    RESYNC = 2
    """A second sender under one identity jumped ahead: follow this one again."""
    NEXT = 3
    """The next one: taken (and its interval learned)."""


class InputChecks:
    """The registered pids, which node runs which worker, and the sequence bound."""

    def __init__(self, config: DetectorConfig, stats: Stats, live: Liveness) -> None:
        self.registered: dict[tuple[str, str], Registration] = {}
        """(job, worker) -> its latest registration (the oldest evicted past the capacity)."""
        self.node_of: dict[tuple[str, str], str] = {}
        """(job, worker) -> the node the planner placed it on (:meth:`assign`)."""
        self.refused: list[Refusal] = []
        """Inputs refused since the service last took them (:meth:`take_refused`)."""
        self._capacity = config.closed_capacity
        self.seq_slack, self._seq_rate = config.seq_slack, config.seq_rate
        self._min_samples = config.min_samples
        self._stats = stats
        self._live = live

    def take_refused(self) -> list[Refusal]:
        """The inputs refused since the last call (for the service to log and report)."""
        out, self.refused = self.refused, []
        return out

    def register(self, reg: Registered) -> Registration | None:
        """Remember the pid ``reg.worker`` runs as; returns the registration it replaced."""
        key = (reg.job, reg.worker)
        cur = self.registered.pop(key, None)  # (re-inserted last: the oldest are evicted first)
        self.registered[key] = Registration(reg.pid, reg.incarnation, reg.launch, reg.ts)
        while len(self.registered) > self._capacity:
            del self.registered[next(iter(self.registered))]
        return cur

    def assign(self, job: str, node: str, workers: Iterable[str]) -> None:
        """Learn that ``workers`` of ``job`` run on ``node`` (see :meth:`foreign`)."""
        for w in workers:
            self.node_of[(job, w)] = node
        while len(self.node_of) > self._capacity:
            del self.node_of[next(iter(self.node_of))]

    def foreign(self, job: str, node: str, worker: str, pid: int, seq: int, what: str) -> bool:
        """Whether ``worker`` runs on another node than ``node`` (then refused)."""
        owner = self.node_of.get((job, worker))
        if owner is None or owner == node:
            return False
        self._stats.refused_node += 1
        self.refuse(
            job, worker, pid, seq, f"{what} of {job}/{worker} from node {node}: it runs on {owner}", "node"
        )
        return True

    def wrong_pid(self, job: str, worker: str, pid: int, seq: int, what: str) -> bool:
        """Whether ``worker`` registered a pid other than ``pid`` (then refused)."""
        reg = self.registered.get((job, worker))
        if reg is None or reg.pid == pid:
            return False
        self._stats.refused_pid += 1
        why = f"{what} of {job}/{worker} from pid {pid}: registered pid is {reg.pid}"
        self.refuse(job, worker, pid, seq, why, "pid")
        return True

    def sequence(self, b: Worker | Node, seq: int, now: float, what: str, late_s: float = 0.0) -> Seq:
        """Where ``seq`` stands in ``b``'s sequence; remembers a gap it skips (and
        counts a resync). The caller takes a RESYNC or NEXT as ``b``'s latest.
        ``late_s``: how long after it was sent the detector took it (:meth:`seq_refused`)."""
        last = b.last_seq
        if seq <= last:
            gap = b.gap_from
            if gap is None or not gap < seq < last:
                return Seq.STALE
            self._stats.seq_resyncs += 1  # a second sender under this identity jumped ahead
            b.gap_from = None
            return Seq.RESYNC
        ahead = seq - last
        if ahead > self.seq_slack and self.seq_refused(b, seq, now, what, late_s):
            return Seq.REFUSED
        b.gap_from = last if ahead > 1 else None
        return Seq.NEXT

    def seq_refused(self, b: Worker | Node, seq: int, now: float, what: str, late_s: float = 0.0) -> bool:
        """Whether ``seq`` is beyond the sequence bound of ``b`` (then refused).

        The bound is ``seq_slack + seq_rate x elapsed / interval`` past ``b.last_seq``:
        ``elapsed`` since its last accepted heartbeat (or digest), plus ``late_s``, how
        long after it was sent this one was taken (by the sender's clock: a detector
        working through a backlog takes in a second what was sent over ten, and the
        server drops some of it to a slow consumer; the gap is then no forger's jump;
        a sender that dates its messages back loosens only its own bound), ``interval``
        the smaller of the one declared when it was first heard and the learned one. It
        does not apply before an interval is known, nor while the detector holds (time
        says nothing about what the sender did then).
        """
        if b.last_arrival < self._live.hold_until:
            return False
        iv = b.seq_interval
        samples = b.intervals
        if len(samples) >= self._min_samples:
            mean = samples.mean
            if mean > 0.0 and (iv <= 0.0 or mean < iv):
                iv = mean
        if iv <= 0.0:
            return False
        elapsed = now - b.last_arrival + (late_s if late_s > 0.0 else 0.0)
        bound = self.seq_slack + self._seq_rate * (elapsed if elapsed > 0.0 else 0.0) / iv
        ahead = seq - b.last_seq
        if ahead <= bound:
            return False
        self._stats.refused_seq += 1
        if isinstance(b, Node):
            worker, pid = f"node:{b.node}", -1
        else:
            worker, pid = b.worker, b.pid
        self.refuse(
            b.job, worker, pid, seq,
            f"{what} of {b.job}/{worker[5:] if pid < 0 else worker}: seq {seq} is {ahead} past "
            f"{b.last_seq} after {elapsed * 1e3:.0f} ms (at most {bound:.1f} at {iv * 1e3:.0f} ms each)",
            "seq",
        )  # fmt: skip
        return True

    def refuse(self, job: str, worker: str, pid: int, seq: int, reason: str, kind: str) -> None:
        """Queue a refusal for the service (which takes them after every input)."""
        if len(self.refused) < 10_000:
            self.refused.append(Refusal(job, worker, pid, seq, reason, kind))
