"""The wedged-collective rule: every member of a generation stuck inside a collective.

Every member of a generation in ``COLLECTIVE`` in the same step, none left, and the
last of them entered its collective more than the largest bound they report plus
slack ago (:meth:`Wedges.slack`); each member heard since then and still inside
(:meth:`Wedges.wedge`). A bound is what the bytes in flight take once every member is
inside (:func:`phalanx.runtime.bounds.moving_s`), so this is a collective that stopped
moving, not a wait for a peer (that is the straggler rule's). Ranks that time out their
own collectives (the own-loop runtime) leave before it, and the collective-hang rule
judges the one left behind; this rule is what ends a hang inside an unmodified
script's collective, whose ops carry only the script's timeout.

A member behind the others (a lower ``op``: it has not entered the collectives they
wait in, and it is past its peers' pace as the straggler rule counts it) is the hung
one: ``collective_hang``. When all are in the same one nobody can be singled out:
``collective_wedged``, on the member judged first, and the planner re-forms the same
members. It reads the records :class:`~.rules.Rules` learns (:mod:`.records`: who
waits where, who left); :class:`~.rules.Rules` asks it.
"""

from __future__ import annotations

from collections.abc import Callable

from phalanx.services.failure_detector.records import Left, Waiting
from phalanx.services.failure_detector.tracking import Tracking, Worker
from phalanx.services.failure_detector.verdicts import Incident

from phalanx.contract import Evidence, FaultCause, Phase

__all__ = ["Wedges"]


class Wedges:
    """When a collective every member is inside is wedged, and what its verdict says."""

    def __init__(
        self,
        waiting: dict[tuple[str, int], Waiting],
        left: dict[tuple[str, int], Left],
        straggle_bound: Callable[[Worker, Waiting], float],
        tracking: Tracking,
        slack_ratio: float,
    ) -> None:
        self._waiting, self._left, self._straggle_bound = waiting, left, straggle_bound
        self._tracking = tracking
        self._ratio = slack_ratio

    def wedged_at(self, w: Worker) -> float | None:
        """When a rank in COLLECTIVE is judged inside a wedged collective (the module doc) as far
        as the peers' record says; None while a member is outside it, a peer left, or the
        membership is unknown. :meth:`wedge` checks every member before a verdict."""
        stuck = self._stuck_from(w)
        return None if stuck is None else stuck + self.slack(w, stuck - self._last_in(w))

    def _last_in(self, w: Worker) -> float:
        """When the last member entered the collective ``w`` is in."""
        rec = self._waiting[(w.job, w.generation)]
        return rec.last if rec.last > w.phase_start else w.phase_start

    def _stuck_from(self, w: Worker) -> float | None:
        """When the collective ``w`` is in should have completed for every member: the last
        one in, plus the largest bound (for a member behind, its peers' pace too)."""
        key = (w.job, w.generation)
        rec = self._waiting.get(key)
        if rec is None or rec.step != w.step or w.bound_ms <= 0.0 or key in self._left:
            return None
        behind = w.worker not in rec.workers
        if behind and not w.op < rec.op:
            return None
        members = self._tracking.members(w.job, w.generation)
        if members is None or len(rec.workers) + behind != len(members):
            return None
        bound = rec.bound_s if rec.bound_s > w.bound_ms / 1e3 else w.bound_ms / 1e3
        if behind:  # judged by its peers' pace too, as a straggler is
            pace = self._straggle_bound(w, rec)
            bound = bound if bound > pace else pace
        return self._last_in(w) + bound

    def slack(self, w: Worker, bound_s: float) -> float:
        """How long past a wedged collective's bound its members have to be heard leaving:
        ``max(slack ratio x bound, one heartbeat interval)`` and the digest (one interval:
        any member heard is enough; ranks that time out their own are heard first)."""
        slack = max(self._ratio * bound_s, w.declared_s)
        return slack + (w.digest_s if w.node is not None else 0.0)

    def wedge(self, w: Worker) -> Waiting | None:
        """The peers' record, if every member of ``w``'s generation, heard since its
        collective should have completed, still says it is inside: in COLLECTIVE, at its
        step, at its op (``w`` at a lower one, or the same)."""
        rec = self._waiting.get((w.job, w.generation))
        members = self._tracking.members(w.job, w.generation)
        stuck = self._stuck_from(w)
        if rec is None or members is None or stuck is None:
            return None
        tracked = self._tracking.workers
        for name in members:
            m = tracked.get((w.job, name))
            if m is None or m.phase is not Phase.COLLECTIVE or m.step != rec.step or m.last_arrival < stuck:
                return None
            if m.generation != w.generation or (name in rec.workers and m.op != rec.op):
                return None
        return rec

    def incident(self, w: Worker, rec: Waiting, rank: int, generation: int, now: float) -> Incident:
        """The verdict on a wedged collective (module doc): ``collective_hang`` on the
        member behind the others, else ``collective_wedged`` on ``w``."""
        behind = w.worker not in rec.workers
        peers = sorted(p for p in rec.workers if p != w.worker)
        last = self._last_in(w)
        evidence: Evidence = {
            "phase": w.phase.value,
            "phase_ms": round((now - w.phase_start) * 1e3, 1),
            "inside_all_ms": round((now - last) * 1e3, 1),
            "bound_ms": round(max(rec.bound_s * 1e3, w.bound_ms), 1),
            "slack_ms": round(self.slack(w, max(rec.bound_s, w.bound_ms / 1e3)) * 1e3, 1),
            "step": w.step,
            "op": w.op,
            "peers_op": rec.op,
            "peers_inside": ",".join(peers[:8]) + (",..." if len(peers) > 8 else ""),
            "peers_inside_count": len(peers),
            "last_seq": w.last_seq,
            "host": w.host,
        }
        if w.node is not None:
            evidence["node"] = w.node[1]
        cause = FaultCause.COLLECTIVE_HANG if behind else FaultCause.COLLECTIVE_WEDGED
        fault_at = w.phase_start_wall + (last - w.phase_start)
        return Incident(w.job, w.worker, w.pid, rank, generation, cause, fault_at, evidence)
