"""The verdict rules: when a worker is faulty, and what its verdict says.

- **process exit** (:meth:`Rules.exit_incident`): the launcher saw the process end
  with a non-zero code or a signal -> ``process_exit`` at ``exited_at``.
- **heartbeat lost** (:meth:`Rules.silence_incident`): its silence passed its
  deadline (:mod:`.liveness`) -> ``heartbeat_lost`` at its last heartbeat.
- **step stall** (:meth:`Rules.stall_bound`, :meth:`Rules.stall_incident`):
  heartbeats continue, but the rank has been in ``COMPUTE`` without completing a
  step for longer than ``max(stall_floor, stall_factor x max(recent step_ms))``
  (``stall_initial`` before any step completed) -> ``step_stall`` since the stalled
  phase (or the step in it) began. ``COLLECTIVE`` ranks are victims waiting on a
  stalled peer and are never judged by this rule; nor are ``IDLE`` spares or
  ``STARTING``/``RECOVERING`` ranks.
- **straggler** (:meth:`Rules.stall_at`, the same ``step_stall`` verdict): a rank in
  ``COMPUTE`` while a peer of its generation waits in ``COLLECTIVE`` in a collective
  of the same step it has not entered (:class:`Waiting`: each heartbeat counts the
  step's collectives entered, ``op``, and members enter the same ones in the same
  order; a rank heard in an earlier one of the step, an FSDP all-gather or DDP's
  buffer broadcast, still owes the later ones) is judged by its peers' pace instead
  of a constant: once in
  ``COMPUTE`` past ``max(straggle_floor, stall_factor x max(the longest the waiting
  peers took from their step's start to the collective, its own slowest recent
  step))``, and no sooner than half the floor after the first peer began to wait.
  The job's first step too: its peers' first step is the yardstick, so a slow
  warm-up they share is no fault, and a rank spinning while they wait is found in
  seconds. A pause every member takes together (an evaluation pass) leaves nobody
  waiting and is judged by the stall rule only.
- **joiner that never arrives** (:meth:`Rules.join_at`, the same ``step_stall``
  verdict): a rank ``RECOVERING`` in a generation it has taken but whose
  collectives it has not reached (it reports the generation it joins from the
  moment it takes the plan, then enters its rendezvous at once: nothing a script
  does runs in between) while a peer waits in ``COLLECTIVE`` in that generation,
  past ``straggle_floor`` in that phase and no sooner than half of it after the
  first peer began to wait. A rank ``RECOVERING`` after its generation's
  collectives (its data restore) is not judged by this rule, nor one waiting for a
  plan.
- **collective hang** (:meth:`Rules.hang_at`, :meth:`Rules.hang_incident`): a rank
  in ``COLLECTIVE`` past its own per-op bound plus slack
  (:meth:`Rules.collective_bound`) while a peer of the same job and generation has
  been seen ``RECOVERING`` (its own timeout fired), that slack ago at least ->
  ``collective_hang`` since it entered ``COLLECTIVE``. Peers that timed out are
  ``RECOVERING``, so they are never blamed; while every member is still in
  ``COLLECTIVE`` nobody is judged by this rule (their own timeouts release them).
- **wedged collective** (:class:`.wedges.Wedges`, which this class asks): every member
  of a generation inside a collective of the same step past what its bytes take, none
  left -> ``collective_wedged`` (nobody can be singled out: the same members re-form),
  or ``collective_hang`` on a member behind the others. What ends a hang inside an
  unmodified script's collective; own-loop ranks time theirs out first.

:meth:`Rules.learn` keeps what the last two rules read from each heartbeat (its
phase, its recent step times, the peers that left a generation).
"""

from __future__ import annotations

from phalanx.services.failure_detector.config import DetectorConfig
from phalanx.services.failure_detector.liveness import Liveness
from phalanx.services.failure_detector.records import Left, Waiting
from phalanx.services.failure_detector.tracking import Node, Tracking, Worker
from phalanx.services.failure_detector.verdicts import Incident, NodeIncident
from phalanx.services.failure_detector.wedges import Wedges

from phalanx.contract import Evidence, FaultCause, Phase, RankExited

__all__ = ["Rules"]


class Rules:
    """The stall and collective-hang bounds, what they learn, and every verdict's evidence."""

    def __init__(self, config: DetectorConfig, live: Liveness, tracking: Tracking) -> None:
        self.stall_floor = config.stall_floor_s
        self.stall_factor = config.stall_factor
        self.stall_initial = max(config.stall_floor_s, config.stall_initial_s)
        self.straggle_floor = config.straggle_floor_s
        self._slack_ratio = config.collective_slack_ratio
        self._slack_intervals = config.collective_slack_intervals
        self._live = live
        self._tracking = tracking
        self.left: dict[tuple[str, int], Left] = {}
        """(job, generation) -> the workers heard RECOVERING in that generation: the
        peers that left its collectives."""
        self.waiting: dict[tuple[str, int], Waiting] = {}
        """(job, generation) -> the workers heard waiting in COLLECTIVE at its newest step."""
        self.wedges = Wedges(
            self.waiting, self.left, self.straggle_bound, tracking, config.collective_slack_ratio
        )

    # -- what the rules learn ------------------------------------------------------
    def learn(
        self,
        w: Worker,
        phase: Phase,
        phase_ms: float,
        step: int,
        step_ms: float,
        at: float,
        at_wall: float,
        fresh: bool,
        op: int = 0,
    ) -> None:
        """Learn ``w``'s phase and step from a heartbeat received at ``at``."""
        stepped = step > w.step
        if stepped:
            if step_ms > 0:
                evicted = w.steps[0] if len(w.steps) == w.steps.maxlen else 0.0
                w.steps.append(step_ms)
                if step_ms >= w.max_step_ms:
                    w.max_step_ms = step_ms
                elif evicted >= w.max_step_ms:
                    w.max_step_ms = max(w.steps)
            w.progress_at, w.progress_wall = at, at_wall
            w.step_start = at - phase_ms / 1e3 if phase is Phase.COMPUTE else at
        w.step, w.step_ms = step, step_ms
        # A new phase, or the same one entered again between two heartbeats (seen by its
        # shorter time in it, by a step completed or a collective entered in between, or by
        # a collective of another generation: a failed all-reduce, then the next one's
        # rendezvous).
        if (
            fresh
            or stepped
            or op != w.op
            or phase is not w.phase
            or phase_ms < w.phase_ms
            or (phase is Phase.COLLECTIVE and w.collective_gen != w.generation)
        ):
            w.op = op
            prev = w.phase
            w.phase = phase
            w.phase_start = at - phase_ms / 1e3
            w.phase_start_wall = at_wall - phase_ms / 1e3
            self.entered(w, prev)
        w.phase_ms = phase_ms

    def entered(self, w: Worker, prev: Phase) -> None:
        """``w`` entered its phase (``w.phase``, since ``w.phase_start``) from ``prev``."""
        phase = w.phase
        if phase is Phase.RECOVERING:  # it left the collectives of the generation it was in
            self.mark_left(w)
        elif phase is Phase.COLLECTIVE:
            w.collective_gen = w.generation
            self._note_waiting(w)
        elif phase is Phase.COMPUTE and prev is not Phase.COLLECTIVE and prev is not Phase.COMPUTE:
            if prev is not Phase.RUNNING:  # an unmodified script's rank standing still mid-step
                w.step_start = w.phase_start  # a step begins after joining a generation

    def _note_waiting(self, w: Worker) -> None:
        key = (w.job, w.generation)
        reach = w.phase_start - w.step_start if w.step_start > 0.0 else 0.0
        reach = reach if reach > 0.0 else 0.0
        rec = self.waiting.get(key)
        bound = w.bound_ms / 1e3
        if rec is None or (rec.step, rec.op) < (w.step, w.op):
            self.waiting[key] = Waiting(w.step, w.op, w.phase_start, reach, {w.worker}, w.phase_start, bound)
        elif rec.step == w.step and rec.op == w.op:
            rec.workers.add(w.worker)
            if w.phase_start < rec.since:
                rec.since = w.phase_start
            if w.phase_start > rec.last:
                rec.last = w.phase_start
            if reach > rec.reach_s:
                rec.reach_s = reach
            if bound > rec.bound_s:
                rec.bound_s = bound

    def mark_left(self, w: Worker) -> None:
        """``w`` left the collectives of the generation it was last in (it is RECOVERING
        since ``phase_start``; it may report the next one already, which it joins)."""
        key = (w.job, w.collective_gen)
        left = self.left.get(key)
        if left is None:
            left = self.left[key] = Left(w.phase_start)
        if w.worker not in left.workers:
            left.workers[w.worker] = w.phase_start
            left.first = min(left.first, w.phase_start)

    def forget_before(self, job: str, generation: int) -> None:
        """Forget who left ``job``'s generations before ``generation``."""
        for key in [k for k in self.left if k[0] == job and k[1] < generation]:
            del self.left[key]
        for key in [k for k in self.waiting if k[0] == job and k[1] < generation]:
            del self.waiting[key]

    # -- bounds --------------------------------------------------------------------
    def stall_bound(self, w: Worker) -> float:
        """Seconds a rank may stay in COMPUTE without finishing a step."""
        if not w.steps:
            return self.stall_initial
        bound = self.stall_factor * w.max_step_ms / 1e3
        return bound if bound > self.stall_floor else self.stall_floor

    def straggling(self, w: Worker) -> Waiting | None:
        """The peers waiting in COLLECTIVE in a collective of ``w``'s current step that
        ``w`` (in COMPUTE) has not entered, if any."""
        rec = self.waiting.get((w.job, w.generation))
        if rec is None or rec.step != w.step or w.worker in rec.workers:
            return None
        if rec.op and w.op >= rec.op:  # it has entered that one (op 0: a runtime that does not count)
            return None
        return rec

    def joining(self, w: Worker) -> Waiting | None:
        """The peers waiting in COLLECTIVE in the generation ``w`` has taken but not
        reached (``w`` is RECOVERING in it), if any."""
        if w.phase is not Phase.RECOVERING or w.collective_gen >= w.generation:
            return None
        return self.waiting.get((w.job, w.generation))

    def join_at(self, w: Worker) -> float | None:
        """When a rank that took a generation but never reached its collectives is
        judged while peers wait for it there (module doc); None while none waits."""
        rec = self.joining(w)
        if rec is None:
            return None
        at = w.phase_start + self.straggle_floor
        not_before = rec.since + 0.5 * self.straggle_floor
        return at if at > not_before else not_before

    def straggle_bound(self, w: Worker, rec: Waiting) -> float:
        """Seconds ``w`` may stay in COMPUTE while ``rec``'s peers wait for it."""
        own = w.max_step_ms / 1e3
        pace = rec.reach_s if rec.reach_s > own else own
        bound = self.stall_factor * pace
        return bound if bound > self.straggle_floor else self.straggle_floor

    def stall_at(self, w: Worker) -> float:
        """When a rank in COMPUTE is judged stalled: the stall rule's bound, or sooner
        the straggler rule's while peers wait for it (module doc)."""
        since = w.progress_at if w.progress_at > w.phase_start else w.phase_start
        at = since + self.stall_bound(w)
        rec = self.straggling(w)
        if rec is not None:
            straggle = since + self.straggle_bound(w, rec)
            not_before = rec.since + 0.5 * self.straggle_floor
            straggle = straggle if straggle > not_before else not_before
            if straggle < at:
                at = straggle
        return at

    def collective_slack(self, w: Worker) -> float:
        """How late a rank may leave after its own timeout, or after a peer left, and be
        heard: the spread of peers' timeouts (a gloo timeout restarts with each
        partial transfer, about one normal all-reduce, <= bound / factor) and the
        heartbeat (and digest) that says so."""
        bound = w.bound_ms / 1e3
        slack = max(self._slack_ratio * bound, self._slack_intervals * w.declared_s)
        return slack + (w.digest_s if w.node is not None else 0.0)

    def collective_bound(self, w: Worker) -> float:
        """Seconds a rank may stay in COLLECTIVE once a peer of its generation has left:
        the per-op timeout it reported plus :meth:`collective_slack`."""
        return w.bound_ms / 1e3 + self.collective_slack(w)

    def hang_at(self, w: Worker) -> float | None:
        """When a rank in COLLECTIVE is left behind: its bound and slack after it entered
        the phase, and no sooner than slack after the first peer left (the others, whose
        timeouts fire about then, must be heard leaving too); None while no peer of its
        generation has left, or it reports no bound."""
        if w.phase is not Phase.COLLECTIVE or w.bound_ms <= 0.0:
            return None
        left = self.left.get((w.job, w.generation))
        if left is None or (len(left.workers) == 1 and w.worker in left.workers):
            return None
        slack = self.collective_slack(w)
        at = w.phase_start + w.bound_ms / 1e3 + slack
        after_peer = left.first + slack
        return at if at > after_peer else after_peer

    def collective_at(self, w: Worker) -> float | None:
        """When a rank in COLLECTIVE is next judged: left behind (:meth:`hang_at`) or
        inside a wedged collective (:meth:`.wedges.Wedges.wedged_at`), the earlier."""
        hang, wedged = self.hang_at(w), self.wedges.wedged_at(w)
        return wedged if hang is None or (wedged is not None and wedged < hang) else hang

    def collective_due(self, w: Worker, now: float) -> bool:
        """Whether a rank in COLLECTIVE is judged now: left behind, or every member is
        still inside the wedged collective (checked member by member, only when due)."""
        hang = self.hang_at(w)
        return (hang is not None and hang <= now) or self.wedges.wedge(w) is not None

    # -- verdicts ------------------------------------------------------------------
    def exit_incident(
        self, ex: RankExited, w: Worker | None, rank: int, generation: int, now: float
    ) -> Incident:
        """The verdict on a process that ended with a non-zero code or a signal (``w``:
        its tracked incarnation, if any)."""
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
                since_heartbeat_ms=round((now - w.last_arrival) * 1e3, 1),
            )
        return Incident(
            ex.job, ex.worker, ex.pid, rank, generation, FaultCause.PROCESS_EXIT, ex.exited_at, evidence
        )

    def silence_incident(self, w: Worker, rank: int, generation: int, now: float) -> Incident:
        """The verdict on a worker whose heartbeats stopped."""
        evidence = self._live.evidence(w, now)
        evidence.update(
            slack_ms=round(w.slack_s * 1e3, 1),
            raw_std_interval_ms=round(w.intervals.std * 1e3, 2),
            step=w.step,
            phase=w.phase.value,
            host=w.host,
        )
        if w.node is not None:
            evidence["node"] = w.node[1]
        return Incident(
            w.job, w.worker, w.pid, rank, generation, FaultCause.HEARTBEAT_LOST, w.last_wall, evidence
        )

    def node_incident(self, n: Node, now: float) -> NodeIncident:
        """The verdict on a node whose digests stopped (naming the workers of its last one)."""
        evidence = self._live.evidence(n, now)
        evidence.update(launcher=n.launcher, host=n.host, workers=len(n.workers))
        return NodeIncident(n.job, n.node, n.launcher, tuple(w for w, _ in n.workers), n.last_wall, evidence)

    def stall_incident(self, w: Worker, rank: int, generation: int, now: float) -> Incident:
        """The verdict on a rank stalled in COMPUTE, or RECOVERING short of the
        generation its peers wait in."""
        if w.phase is Phase.RECOVERING:  # since it took the generation's plan
            since, since_wall = w.phase_start, w.phase_start_wall
            rec, bound = self.joining(w), self.straggle_floor
        else:
            since, since_wall = w.stall_since
            rec = self.straggling(w)
            bound = (
                self.stall_bound(w) if rec is None else min(self.stall_bound(w), self.straggle_bound(w, rec))
            )
        evidence: Evidence = {
            "phase": w.phase.value,
            "phase_ms": round((now - since) * 1e3, 1),
            "reported_phase_ms": round(w.phase_ms, 1),
            "bound_ms": round(bound * 1e3, 1),
            "step": w.step,
            "step_ms": round(w.step_ms, 2),
            "max_recent_step_ms": round(max(w.steps), 2) if w.steps else 0.0,
            "step_samples": len(w.steps),
            "last_seq": w.last_seq,
            "phi": self._live.phi_now(w, now),
            "host": w.host,
        }
        if rec is not None:  # judged by its peers' pace: they wait for it
            peers = sorted(rec.workers)
            evidence.update(
                peers_waiting=",".join(peers[:8]) + (",..." if len(peers) > 8 else ""),
                peers_waiting_count=len(peers),
                waiting_ms=round((now - rec.since) * 1e3, 1),
                peers_reach_ms=round(rec.reach_s * 1e3, 1),
            )
        return Incident(w.job, w.worker, w.pid, rank, generation, FaultCause.STEP_STALL, since_wall, evidence)

    def collective_incident(self, w: Worker, rank: int, generation: int, now: float) -> Incident | None:
        """The verdict on a rank whose COLLECTIVE deadline came: left behind, or inside a
        wedged collective; None when neither holds any more (a member moved on)."""
        hang = self.hang_at(w)
        if hang is not None and hang <= now:
            return self.hang_incident(w, rank, generation, now)
        rec = self.wedges.wedge(w)
        if rec is None:
            return None
        return self.wedges.incident(w, rec, rank, generation, now)

    def hang_incident(self, w: Worker, rank: int, generation: int, now: float) -> Incident:
        """The verdict on a rank left behind in a collective its peers left."""
        left = self.left.get((w.job, w.generation))
        peers = sorted(p for p in left.workers if p != w.worker) if left is not None else []
        first = left.first if left is not None else now
        evidence: Evidence = {
            "phase": w.phase.value,
            "phase_ms": round((now - w.phase_start) * 1e3, 1),
            "reported_phase_ms": round(w.phase_ms, 1),
            "bound_ms": round(w.bound_ms, 1),
            "slack_ms": round(self.collective_slack(w) * 1e3, 1),
            "peers_left": ",".join(peers[:8]) + (",..." if len(peers) > 8 else ""),
            "peers_left_count": len(peers),
            "first_left_ms": round((now - first) * 1e3, 1),
            "step": w.step,
            "last_seq": w.last_seq,
            "phi": self._live.phi_now(w, now),
            "host": w.host,
        }
        if w.node is not None:
            evidence["node"] = w.node[1]
        return Incident(
            w.job, w.worker, w.pid, rank, generation, FaultCause.COLLECTIVE_HANG, w.phase_start_wall, evidence
        )
