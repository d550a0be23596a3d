"""Mass silence: many members of one job falling silent at once is, until something
else says so, the observer's problem (a stalled bus, a partition between the nodes
and NATS), not a mass death; so their verdicts wait for a second path to confirm.

When a silence verdict (a worker's or a node's) comes due, :meth:`MassSilence.hold_for`
looks one interval ahead: if the members of that job whose silence deadlines fall
within it cover at least ``mass_ratio`` of its tracked workers (and at least
``mass_min``), or of its nodes, every silence verdict of that job is held
(:class:`MassHold`, listed once in :attr:`MassSilence.holds` for the service to
log). Members heard again meanwhile are not judged. A held member is judged only
when one of these confirms it:

- its launcher's connection is gone: the service asks each held node's launcher
  every ``mass_probe_s`` (:meth:`MassSilence.take_probes`); the server's "no
  responders" for :data:`RECONNECT_S` with no answer in between (a client whose
  connection broke, in a partition or a server restart, is back within that of the
  path clearing), or another launcher answering for the node once, judges that node
  at once (:meth:`MassSilence.probed`); a launcher that answers is alive, and its
  node is not judged while it does, whatever its digests say; no answer says
  nothing;
- a survivor's collective failed since the silence began: the ranks that can still
  reach NATS see the silent ones gone, and the hold ends for all of them at once
  (:meth:`MassSilence.collective_error`);
- neither within ``mass_hold_s``, a backstop longer than any stall the bus should
  have (by then the server has dropped a dead client's connection itself, so the
  probes say "no responders" first).

Each verdict after a hold says so and why (:meth:`MassSilence.mark_held`: evidence
``mass_silence``, ``mass_confirmed``). Process exits are never held, nor are step
stalls of ranks still heard, and a hold never lets the silence it spanned be
learned as an interval (``Beat.mass_held``).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import StrEnum

from phalanx.services.failure_detector.config import DetectorConfig, Stats
from phalanx.services.failure_detector.liveness import Liveness
from phalanx.services.failure_detector.tracking import Node, Tracking, Worker
from phalanx.services.failure_detector.verdicts import Verdict

__all__ = ["MassHold", "MassSilence", "Probe", "SilentWithin"]

SilentWithin = Callable[[str, Worker | Node, float, float], tuple[set[str], set[str]]]
"""``(job, first, now, window) -> (workers, nodes)`` of ``job`` whose silence deadline
is within ``window`` and one of their own intervals of ``now``
(``Deadlines.silent_within``)."""


class Probe(StrEnum):
    """What asking a held node's launcher found."""

    GONE = "no_responders"
    """The server knows no one answering for the node: its launcher's connection is gone."""
    REPLACED = "another_launcher"
    """Another launcher answers for the node: the one tracked is gone."""
    ALIVE = "answered"
    """The tracked launcher answered: it is there, whatever its digests say."""
    SILENT = "no_answer"
    """No answer in time (a stopped or cut-off launcher, or a stalled bus): says nothing."""


@dataclass(slots=True)
class MassHold:
    """A mass silence in one job: its silence verdicts are held until ``until``, or
    until something confirms them."""

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
    silent_since: float = math.inf
    """Wall time of the first held member's last heartbeat: when the silence began."""
    confirmed: str = ""
    """What ended the hold before ``until`` ("" while nothing did): a survivor's failed
    collective, ``collective_error:<worker>``."""
    held: list[tuple[bool, Worker | Node]] = field(default_factory=list, repr=False)
    """(stall, member) of every verdict deferred by this hold: checked again at once
    when a survivor confirms it."""


@dataclass(slots=True)
class Suspect:
    """A node held by a mass silence, and what asking its launcher found."""

    node: Node
    since: float
    """When it was first held (monotonic): heard after that, it is no longer a suspect."""
    asked_at: float = -math.inf
    asking: bool = False
    answered_at: float = -math.inf
    gone_at: float | None = None
    """When the server first said "no responders" (None: not since its last answer)."""
    outcome: Probe | None = None
    """The latest finding; GONE or REPLACED once the loss is confirmed."""


class MassSilence:
    """Each job's latest mass-silence hold, the check that begins one, and what
    confirms its verdicts."""

    def __init__(self, config: DetectorConfig, stats: Stats, live: Liveness, tracking: Tracking) -> None:
        self.hold_s = config.mass_hold_s
        """The longest a hold lasts with nothing confirming it (0: never held)."""
        self.probe_s = config.mass_probe_s
        """How often a held node's launcher is asked, and how long its answer is awaited."""
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
        self.suspects: dict[tuple[str, str], Suspect] = {}
        """(job, node) -> a node held, whose launcher is asked (:meth:`take_probes`)."""
        self._next_probe_at = math.inf
        """No suspect is to be asked before this (:meth:`take_probes`)."""
        self._failed: dict[str, tuple[float, str]] = {}
        """job -> (wall time, worker) of its latest failed collective heard."""

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
            if rec is not None and now < rec.until and b.last_arrival <= rec.started:
                self._held(rec, True, b, now)
                return rec.until
            return None
        if isinstance(b, Node):
            if not b.workers:
                return None  # a launcher that finished: forgotten, no verdict to hold
            s = self.suspects.get(b.key)
            if s is not None and s.node is b:
                if s.outcome is Probe.GONE or s.outcome is Probe.REPLACED:
                    return None  # confirmed: its launcher's connection is gone
                if s.outcome is Probe.ALIVE and now - s.answered_at < 2 * self.probe_s:
                    return now + self.probe_s  # its launcher answers: not judged while it does
        if rec is not None:
            if now < rec.until:
                self._held(rec, False, b, now)
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
                rec = MassHold(
                    job, now, now + self.hold_s, len(workers), len(nodes), tracked_workers, tracked_nodes,
                    silent_since=b.last_wall,
                )  # fmt: skip
                self.latest[job] = rec
                self.holds.append(rec)
                self._stats.mass_holds += 1
                failed = self._failed.get(job)
                if failed is not None and failed[0] >= rec.silent_since - _CLOCK_SKEW_S:
                    self._confirm(rec, failed[1], now)  # a survivor already said so
                    return None
                self._held(rec, False, b, now)
                return rec.until
        # (a mass silence shows at its first verdict: the finding stands for half the
        # shortest look-ahead, a node's digest interval when b is one of its workers)
        window = b.digest_s if 0.0 < b.digest_s < b.mean_s else b.mean_s
        self._checked[job] = now + window / 2
        return None

    def _held(self, rec: MassHold, stall: bool, b: Worker | Node, now: float) -> None:
        """``b``'s verdict waits for ``rec``: released at once if a survivor confirms it;
        a node's launcher is asked."""
        rec.held.append((stall, b))
        b.mass_held = True
        if isinstance(b, Node):
            s = self.suspects.get(b.key)
            if s is None or s.node is not b:
                self.suspects[b.key] = Suspect(b, now)
                self._next_probe_at = now

    # -- what confirms a held verdict ------------------------------------------------------
    def take_probes(self, now: float) -> list[Node]:
        """The held nodes whose launcher is to be asked now (at most one question in
        flight per node, one every ``probe_s``); suspects heard again or no longer
        tracked are dropped. Called every tick: the walk over the suspects is made only
        once one of them may be due."""
        out: list[Node] = []
        if now < self._next_probe_at:
            return out
        self._next_probe_at = math.inf
        nodes = self._tracking.nodes
        for key, s in list(self.suspects.items()):
            n = s.node
            if nodes.get(key) is not n or n.last_arrival > s.since:
                del self.suspects[key]
                continue
            if s.outcome is Probe.GONE or s.outcome is Probe.REPLACED:
                continue  # its verdict is due
            if not s.asking and now - s.asked_at >= self.probe_s:
                s.asking, s.asked_at = True, now
                out.append(n)
            # (an answer awaited comes within probe_s of the question)
            self._next_probe_at = min(self._next_probe_at, s.asked_at + self.probe_s)
        return out

    def probed(self, n: Node, outcome: Probe, now: float) -> bool:
        """What asking ``n``'s launcher found; True when that confirms its loss (check
        its verdict now): another launcher answering, or "no responders" still
        :data:`RECONNECT_S` after the first, with no answer in between."""
        s = self.suspects.get(n.key)
        if s is None or s.node is not n:
            return False
        s.asking = False
        self._stats.mass_probes += 1
        if outcome is Probe.GONE:
            if s.gone_at is None:
                s.gone_at = now
            if now - s.gone_at < RECONNECT_S:
                return False  # asked again in probe_s
        elif outcome is Probe.ALIVE:
            s.answered_at, s.gone_at = now, None
        elif outcome is Probe.SILENT and s.outcome is Probe.ALIVE:
            return False  # (it answered before: that stands for two periods)
        s.outcome = outcome
        return outcome is Probe.GONE or outcome is Probe.REPLACED

    def collective_error(
        self, job: str, worker: str, ts: float, now: float
    ) -> list[tuple[bool, Worker | Node]]:
        """A rank of ``job`` reported a failed collective at wall time ``ts``. If that is
        after the silence of ``job``'s running hold began, the survivors confirm it: the
        hold ends now and its deferred verdicts are returned, to be checked again now."""
        last = self._failed.get(job)
        if last is None or ts > last[0]:
            self._failed[job] = (ts, worker)
        rec = self.latest.get(job)
        if rec is None or now >= rec.until or ts < rec.silent_since - _CLOCK_SKEW_S:
            return []
        self._confirm(rec, worker, now)
        return rec.held

    def _confirm(self, rec: MassHold, worker: str, now: float) -> None:
        rec.until, rec.confirmed = now, f"collective_error:{worker}"
        self._stats.mass_confirmed += 1

    def mark_held(self, v: Verdict, stall: bool, b: Worker | Node, now: float) -> None:
        """Say in ``v``'s evidence that it was held as a mass silence, if it was, and
        what confirmed it."""
        rec = self.latest.get(v.job)
        if rec is None:
            return
        s = self.suspects.pop(b.key, None) if isinstance(b, Node) else None
        probe = s.outcome if s is not None and s.node is b else None
        if probe is Probe.GONE or probe is Probe.REPLACED:
            confirmed = probe.value
        else:
            if now < rec.until:
                return
            if stall:
                if b.last_arrival > rec.started:
                    return
            elif self._live.deadline(b) > rec.until:
                return
            confirmed = rec.confirmed or "hold_elapsed"
        v.evidence.update(
            mass_silence=True,
            mass_hold_ms=round((min(now, rec.until) - rec.started) * 1e3, 1),
            mass_silent_workers=rec.workers,
            mass_silent_nodes=rec.nodes,
            mass_tracked_workers=rec.tracked_workers,
            mass_confirmed=confirmed,
        )
        if probe is not None:
            v.evidence["mass_probe"] = probe.value
        self._stats.mass_held += 1


RECONNECT_S = 3.0
"""How long "no responders" must last before it confirms a held node lost. A launcher
cut off from NATS (a partition, a server restart) has no subscription from the moment
the server closes its old connection until it has reconnected: nats.py's connect
timeout (2 s) and reconnect wait (0.25 s) after the path clears. Seen in CI: after a
60 s partition healed, one launcher reconnected 0.7 s after the detector's first "no
responders" and 0.2 s after its second, 0.5 s later, had judged its node lost."""

_CLOCK_SKEW_S = 1.0
"""How far a failed collective's time may precede the silence's start and still
count (the rank's clock and its launcher's are different hosts' clocks)."""
