"""The failure-detection algorithm: pure state, no I/O, an injected clock.

:class:`Detector` turns what the service hears (heartbeats, node digests, process
exits, registrations, placements, plans) into verdicts: an
:class:`~.verdicts.Incident` about one worker process, a
:class:`~.verdicts.NodeIncident` about a whole node. The service (:mod:`.service`)
feeds it and publishes the verdicts; unit tests drive it with a fake clock.

It composes separate pieces, each testable alone:

- :mod:`.checks`, input checks: the registered pid, the sender's node, the
  sequence bound (a forged input must change nothing);
- :mod:`.liveness`, the liveness estimate: phi accrual over each sender's
  inter-arrival times (:mod:`.phi`), and the hold;
- :mod:`.rules`, the verdict rules: process exit, heartbeat lost, step stall,
  collective hang, a wedged collective (:mod:`.wedges`), and what each verdict says,
  from what they learn (:mod:`.records`);
- :mod:`.tracking` and :mod:`.digests`, what is tracked: worker incarnations,
  nodes and their digests, closed incarnations, each job's membership;
- :mod:`.mass`, the mass hold: many members of a job silent at once wait;
- :mod:`.deadlines`, the heap that makes a tick cost O(expired).

Heartbeats come two ways. A rank without a launcher publishes its own
(:meth:`Detector.observe`). A rank under a node's launcher sends them to the
launcher, which publishes one :class:`~phalanx.contract.NodeDigest` per interval
with each local worker's latest heartbeat and its age
(:meth:`Detector.observe_digest`; 2,000 digests instead of 16,000 heartbeats per
interval at 2,000 nodes x 8 ranks). When a node's digests stop, one
``NodeIncident`` names the workers of its last digest and closes their
incarnations, so none of them gets a verdict of its own for the same silence.

An incident belongs to one process incarnation, ``(job, worker, pid)``; its id is
deterministic, so a second path to the same fault (an exit report after the
heartbeats were already lost), a duplicated message or a restarted detector
yields the same id, which the service also uses as the ``Nats-Msg-Id``. After a
verdict the pid is closed: its late heartbeats are ignored; a heartbeat from a new
pid of the same worker (registered first) starts a new incarnation. A process that
exits 0, or says DONE, is forgotten with no incident.

The detector never judges while it cannot hear: :meth:`Detector.hold` (the
service calls it while disconnected from NATS or after its own event loop
stalled) postpones every verdict and restarts silence clocks from the end of
the hold, and inter-arrival samples that span a hold are not learned.

>>> from phalanx.contract import Heartbeat, Phase
>>> t = [1000.0]
>>> det = Detector(clock=lambda: t[0], wall=lambda: 1.7e9 + t[0])
>>> def beat(seq: int) -> Heartbeat:
...     return Heartbeat(job="j1", worker="w0", rank=0, generation=1, step=seq, step_ms=50.0,
...                      phase=Phase.COLLECTIVE, phase_ms=1.0, seq=seq, pid=100, host="h", interval_ms=100.0)
>>> for seq in range(20):
...     _ = det.observe(beat(seq)); t[0] += 0.1
>>> det.tick()
[]
>>> t[0] += 0.5
>>> [(i.worker, i.cause.value) for i in det.tick()]
[('w0', 'heartbeat_lost')]
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator

from phalanx.services.failure_detector.checks import InputChecks, Refusal, Seq
from phalanx.services.failure_detector.config import Clock, DetectorConfig, Stats
from phalanx.services.failure_detector.deadlines import Deadlines, Kind
from phalanx.services.failure_detector.digests import DigestRow, Digests, digest_row
from phalanx.services.failure_detector.liveness import Liveness
from phalanx.services.failure_detector.mass import MassHold, MassSilence, Probe
from phalanx.services.failure_detector.rules import Rules
from phalanx.services.failure_detector.tracking import Node, Tracking, Worker
from phalanx.services.failure_detector.verdicts import Incident, Verdict, incident_id

from phalanx.contract import CollectiveError, Heartbeat, NodeDigest, Phase, Plan, RankExited, Registered

__all__ = ["Detector"]


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
        c, stats = self.config, self.stats
        self._live = Liveness(c)
        self._tracking = Tracking(c, stats)
        self._checks = InputChecks(c, stats, self._live)
        self._rules = Rules(c, self._live, self._tracking)
        self._mass = MassSilence(c, stats, self._live, self._tracking)
        self._deadlines = Deadlines(self._tracking, self._live, self._rules, self._mass)
        self._digests = Digests(stats, self._tracking, self._checks, self._live, self._rules, self._deadlines)
        self._tracked = self._tracking.workers
        self._closed = self._tracking.closed

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
        reg = self._checks.registered.get((job, worker))
        return reg.pid if reg is not None else None

    def mass_hold(self, job: str) -> MassHold | None:
        """``job``'s latest mass-silence hold (it may have ended: see ``until``)."""
        return self._mass.latest.get(job)

    @property
    def refused(self) -> list[Refusal]:
        """Inputs refused since the service last took them (:meth:`take_refused`)."""
        return self._checks.refused

    def take_refused(self) -> list[Refusal]:
        """The inputs refused since the last call (for the service to log and report)."""
        return self._checks.take_refused()

    @property
    def mass_holds(self) -> list[MassHold]:
        """Mass-silence holds begun since the service last took them (:meth:`take_mass_holds`)."""
        return self._mass.holds

    def take_mass_holds(self) -> list[MassHold]:
        """The mass-silence holds begun since the last call (for the service to log)."""
        return self._mass.take_holds()

    def nodes(self) -> Iterator[tuple[str, str, str]]:
        """(job, node, launcher) of every tracked node."""
        return ((n.job, n.node, n.launcher) for n in self._tracking.nodes.values())

    def node_snapshot(self, job: str, node: str) -> dict[str, float | int | str] | None:
        """What is known of a tracked node, for health output and tests."""
        n = self._tracking.nodes.get((job, node))
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
            "phi": self._live.phi_now(n, self.clock()),
        }

    def snapshot(self, job: str, worker: str) -> dict[str, float | int | str] | None:
        """What is known of a tracked worker, for health output and tests."""
        w = self._tracked.get((job, worker))
        if w is None:
            return None
        now = self.clock()
        self._live.fresh(w)
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
            "stall_bound_ms": self._rules.stall_bound(w) * 1e3,
            "phi": self._live.phi_now(w, now),
            "registered": (r := self._checks.registered.get(w.key)) is not None and r.pid == w.pid,
        }

    @property
    def hold_until(self) -> float:
        return self._live.hold_until

    # -- inputs --------------------------------------------------------------------
    def observe(self, hb: Heartbeat) -> bool:
        """Learn from one heartbeat; returns False when it was ignored or refused.

        A heartbeat is ignored when its incarnation was closed (a verdict, a clean
        exit or a plan removed it) or its ``seq`` is stale; it is refused (counted
        and queued in :attr:`refused`) when its pid is not the worker's registered
        one or its ``seq`` is beyond the bound (:mod:`.checks`).
        """
        now = self.clock()
        w = self._tracked.get((hb.job, hb.worker))
        closed = False
        if w is None or w.pid != hb.pid:
            closed = incident_id(hb.job, hb.worker, hb.pid) in self._closed
            if not closed and self._checks.wrong_pid(hb.job, hb.worker, hb.pid, hb.seq, "heartbeat"):
                return False
        if hb.phase is Phase.DONE:  # a clean goodbye: the silence that follows is no fault
            self._tracking.goodbye(hb.job, hb.worker, hb.pid)
            return True
        if w is None or w.pid != hb.pid:
            if closed:
                self.stats.ignored_heartbeats += 1
                return False
            w = self._tracking.new_worker(
                hb.job, hb.worker, hb.pid, hb.host, hb.rank, hb.generation, hb.step, hb.seq,
                hb.interval_ms / 1e3, now, self.wall(),
            )  # fmt: skip
            fresh = True
        else:
            seq = self._checks.sequence(w, hb.seq, now, "heartbeat", self.wall() - hb.ts)
            if seq is Seq.STALE:
                self.stats.ignored_heartbeats += 1
                return False
            if seq is Seq.REFUSED:
                return False
            if seq is Seq.NEXT:
                self._live.sample(w, now)
            w.last_arrival, w.last_wall, w.last_seq = now, self.wall(), hb.seq
            w.declared_s = hb.interval_ms / 1e3
            fresh = False
        self.stats.heartbeats += 1
        w.rank, w.generation, w.host = hb.rank, hb.generation, hb.host
        w.bound_ms = hb.collective_bound_ms
        self._rules.learn(w, hb.phase, hb.phase_ms, hb.step, hb.step_ms, now, hb.ts, fresh, hb.op)
        self._deadlines.schedule_worker(w)
        return True

    def observe_digest(self, d: NodeDigest) -> bool:
        """Learn from one node's digest (the node is alive, and so is each worker whose
        entry moved on); returns False when it was ignored: a repeated or out-of-order
        ``seq``, or a launcher already judged lost."""
        rows = [digest_row(e) for e in d.entries]
        return self.observe_digest_rows(d.job, d.node, d.launcher, d.host, d.seq, d.interval_ms, rows, d.ts)

    def observe_digest_rows(
        self,
        job: str,
        node: str,
        launcher: str,
        host: str,
        seq: int,
        interval_ms: float,
        rows: list[DigestRow],
        sent_at: float | None = None,
    ) -> bool:
        """:meth:`observe_digest` for a digest already validated and taken apart (the
        service's hot path: no model per entry); ``sent_at``: its ``ts``."""
        wall = self.wall()
        late = wall - sent_at if sent_at is not None else 0.0
        return self._digests.observe(
            self.clock(), wall, job, node, launcher, host, seq, interval_ms, rows, late
        )

    def on_exit(self, ex: RankExited) -> Incident | None:
        """A process ended. Returns the incident, or None (clean exit, already closed, or
        refused: reported by the launcher of another node than the worker's)."""
        if self._checks.foreign(ex.job, ex.node, ex.worker, ex.pid, -1, "exit report"):
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
            self._tracking.close(iid, "clean_exit")
            if w is not None:
                del self._tracked[w.key]
            return None
        rank, generation = self._tracking.rank_of(ex.job, ex.worker, w)
        if ex.generation is not None:  # a process per generation: the verdict is on the one it ran
            generation = ex.generation
        return self._verdict(self._rules.exit_incident(ex, w, rank, generation, self.clock()), w)

    def apply_plan(self, plan: Plan) -> bool:
        """Learn a generation's membership; returns False for a stale plan.

        Workers in ``plan.removed`` are forgotten: their tracked incarnation is
        closed without a verdict (the launcher fences them; their exit is expected).
        """
        if not self._tracking.apply_plan(plan):
            return False
        # (the last generation's stay: a reform may come before a verdict)
        self._rules.forget_before(plan.job, plan.generation - 1)
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
        self._checks.assign(job, node, workers)

    def node_of(self, job: str, worker: str) -> str | None:
        return self._checks.node_of.get((job, worker))

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
        cur = self._checks.register(reg)
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
        if self._live.hold(until):
            self.stats.holds += 1

    # -- what confirms a mass silence ----------------------------------------------
    def take_probes(self) -> list[tuple[str, str, str]]:
        """(job, node, launcher) of each node held by a mass silence whose launcher is to
        be asked now whether it is there (the service asks, and says :meth:`probed`)."""
        return [(n.job, n.node, n.launcher) for n in self._mass.take_probes(self.clock())]

    def probed(self, job: str, node: str, launcher: str, outcome: Probe) -> None:
        """What asking ``launcher`` of a held node found: gone (no responders, or another
        launcher answering for the node) makes its verdict due now."""
        n = self._tracking.nodes.get((job, node))
        if n is None or n.launcher != launcher:
            return
        now = self.clock()
        if self._mass.probed(n, outcome, now):
            self._deadlines.defer(Kind.NODE, n, now)

    def collective_error(self, err: CollectiveError) -> None:
        """A rank's collective failed: if its job is in a mass silence that began before,
        the survivors confirm it, and every verdict it held is due now."""
        now = self.clock()
        for stall, b in self._mass.collective_error(err.job, err.worker, err.ts, now):
            if isinstance(b, Node):
                if self._tracking.nodes.get(b.key) is b:
                    self._deadlines.defer(Kind.NODE, b, now)
            elif self._tracked.get(b.key) is b:
                self._deadlines.defer(Kind.STALL if stall else Kind.SILENCE, b, now)

    # -- judgement -----------------------------------------------------------------
    def due(self) -> bool:
        """Whether :meth:`tick` would return a verdict now (it tidies the heap on the way).

        The service calls this first and, when True, makes sure every heartbeat
        already received has been observed before it calls :meth:`tick`.
        """
        return self._deadlines.top_expired(self.clock()) is not None

    def tick(self) -> list[Verdict]:
        """Every verdict whose time has come, in deadline order. O(expired).

        A silence verdict that is part of a mass silence is held instead
        (:mod:`.mass`): it comes due again when the hold ends.
        """
        now = self.clock()
        out: list[Verdict] = []
        deadlines, mass, rules, rank_of = self._deadlines, self._mass, self._rules, self._tracking.rank_of
        while (entry := deadlines.top_expired(now)) is not None:
            deadlines.pop()
            kind, b = entry
            stall = kind is Kind.STALL
            if (
                mass.hold_s > 0.0
                and (until := mass.hold_for(stall, b, now, deadlines.silent_within)) is not None
            ):
                deadlines.defer(kind, b, until)
                continue
            decided = len(out)
            if isinstance(b, Node):
                if self._tracking.lose_node(b):  # (its workers are closed with it: no verdict of their own)
                    self.stats.incidents += 1
                    out.append(rules.node_incident(b, now))
            elif kind is Kind.SILENCE:
                out.append(self._verdict(rules.silence_incident(b, *rank_of(b.job, b.worker, b), now), b))
            elif b.phase is Phase.COLLECTIVE:
                incident = rules.collective_incident(b, *rank_of(b.job, b.worker, b), now)
                if incident is None:  # (top_expired checked it at this very time: not reached)
                    deadlines.defer(kind, b, now + b.declared_s)
                    continue
                out.append(self._verdict(incident, b))
            else:
                out.append(self._verdict(rules.stall_incident(b, *rank_of(b.job, b.worker, b), now), b))
            if mass.latest and len(out) > decided:
                mass.mark_held(out[-1], stall, b, now)
        return out

    def stall_bound(self, w: Worker) -> float:
        """Seconds a rank may stay in COMPUTE without finishing a step (:meth:`.rules.Rules.stall_bound`)."""
        return self._rules.stall_bound(w)

    def collective_bound(self, w: Worker) -> float:
        """Seconds a rank may stay in COLLECTIVE once a peer of its generation has left
        (:meth:`.rules.Rules.collective_bound`)."""
        return self._rules.collective_bound(w)

    def _verdict(self, incident: Incident, w: Worker | None) -> Incident:
        """Close ``incident``'s incarnation (untracking ``w``) and count it."""
        self._tracking.close(incident.id, incident.cause.value)
        if w is not None:
            self._tracking.untrack(w)
        self.stats.incidents += 1
        return incident
