"""Node tracking: what one node's digest tells the detector.

A launcher publishes one :class:`~phalanx.contract.NodeDigest` per interval with
each local worker's latest heartbeat and its age. The digest itself is the node's
heartbeat, judged by the same phi accrual per ``(job, node, launcher)``; a new
launcher on a node replaces the old one for good, and later digests of a lost
launcher are ignored (a partitioned node that reconnects does not come back).
Each entry whose ``seq`` moved on is a heartbeat of its worker dated ``arrival -
age_ms``; its inter-arrival sample is divided by the ``seq`` advance (so a
heartbeat that fell between two digests does not look like a long gap). A worker
the launcher stopped listing (its process ended) is forgotten: a crash is judged
by the launcher's exit report.
"""

from __future__ import annotations

from phalanx.services.failure_detector.checks import InputChecks, Seq
from phalanx.services.failure_detector.config import Stats
from phalanx.services.failure_detector.deadlines import Deadlines
from phalanx.services.failure_detector.liveness import Liveness
from phalanx.services.failure_detector.rules import Rules
from phalanx.services.failure_detector.tracking import Node, Tracking, Worker
from phalanx.services.failure_detector.verdicts import incident_id, node_incident_id

from phalanx.contract import DigestEntry, Phase

__all__ = ["DigestRow", "Digests", "digest_row"]

DigestRow = tuple[str, int, int, int, int, int, float, Phase, float, float, float, float, int]
"""One digest entry as the detector reads it: ``(worker, pid, seq, rank, generation,
step, step_ms, phase, phase_ms, age_ms, interval_ms, collective_bound_ms, op)``, the fields of
:class:`~phalanx.contract.DigestEntry` in order (a tuple: 16,000 of them per interval)."""


def digest_row(e: DigestEntry) -> DigestRow:
    """The :data:`DigestRow` of a validated entry."""
    return (
        e.worker, e.pid, e.seq, e.rank, e.generation, e.step, e.step_ms,
        e.phase, e.phase_ms, e.age_ms, e.interval_ms, e.collective_bound_ms, e.op,
    )  # fmt: skip


class Digests:
    """Takes node digests into the tracked nodes and workers."""

    def __init__(
        self,
        stats: Stats,
        tracking: Tracking,
        checks: InputChecks,
        live: Liveness,
        rules: Rules,
        deadlines: Deadlines,
    ) -> None:
        self._stats, self._tracking, self._checks = stats, tracking, checks
        self._live, self._rules, self._deadlines = live, rules, deadlines

    def observe(
        self,
        now: float,
        wall: float,
        job: str,
        node: str,
        launcher: str,
        host: str,
        seq: int,
        interval_ms: float,
        rows: list[DigestRow],
        late_s: float = 0.0,
    ) -> bool:
        """Learn from one digest received at ``now``, ``late_s`` after it was sent;
        False when it was ignored: a repeated or out-of-order ``seq``, or a launcher
        already judged lost."""
        interval = interval_ms / 1e3
        n = self._node(now, wall, job, node, launcher, host, seq, interval, late_s)
        if n is None:
            return False
        key = n.key
        owners = self._checks.node_of
        if any(owners.get((job, r[0]), node) != node for r in rows):  # (one lookup per entry)
            foreign = self._checks.foreign
            rows = [r for r in rows if not foreign(job, node, r[0], r[1], r[2], "digest entry")]
        done = Phase.DONE
        workers = [(r[0], r[1]) for r in rows if r[7] is not done]
        if workers != n.workers:  # (usually the same workers as last time: nobody left)
            self._relist(n, rows, workers)
        self._deadlines.schedule_node(n)
        # The hot path (16,000 entries per interval at 2,000 nodes): a known worker
        # whose entry moved on. Anything else takes _entry.
        heard = 0
        tracked, hold = self._tracking.workers, self._live.hold_until
        slack = self._checks.seq_slack
        entered, compute = self._rules.entered, Phase.COMPUTE
        schedule = self._deadlines.schedule_worker
        for row in rows:
            (
                worker, pid, seq, rank, generation, step, step_ms,
                phase, phase_ms, age_ms, interval_ms, bound, op,
            ) = row  # fmt: skip
            w = tracked.get((job, worker))
            age = age_ms / 1e3
            at, at_wall = now - age, wall - age  # when the launcher received the heartbeat
            if w is None or w.pid != pid or seq <= w.last_seq or phase is done:
                heard += self._entry(n, row, w, at, at_wall, interval)
                continue
            ahead = seq - w.last_seq
            if ahead > 1:  # (the sequence bound, and remember the gap: InputChecks.sequence)
                if ahead > slack and self._checks.seq_refused(w, seq, now, "digest entry", late_s):
                    continue
                w.gap_from = w.last_seq
            else:
                w.gap_from = None
            last = w.last_arrival
            if last >= hold:  # one sample per heartbeat the entry moved on by
                w.intervals.add((at - last if at > last else 0.0) / (seq - w.last_seq))
            w.last_arrival, w.last_wall, w.last_seq = (at if at > last else last), at_wall, seq
            w.declared_s = interval_ms / 1e3 or interval  # its own interval when the launcher knows it
            w.node, w.digest_s, w.heard_digest = key, interval, n.last_seq
            w.rank, w.generation, w.host = rank, generation, n.host
            w.bound_ms = bound
            # what Rules.learn(..., fresh=False) does, inline (keep the two in step)
            stepped = step > w.step
            if stepped:
                if step_ms > 0:
                    steps = w.steps
                    evicted = steps[0] if len(steps) == steps.maxlen else 0.0
                    steps.append(step_ms)
                    if step_ms >= w.max_step_ms:
                        w.max_step_ms = step_ms
                    elif evicted >= w.max_step_ms:
                        w.max_step_ms = max(steps)
                w.progress_at, w.progress_wall = at, at_wall
                w.step_start = at - phase_ms / 1e3 if phase is compute else at
            w.step, w.step_ms = step, step_ms
            if (
                stepped
                or op != w.op
                or phase is not w.phase
                or phase_ms < w.phase_ms
                or (phase is Phase.COLLECTIVE and w.collective_gen != generation)
            ):
                w.op = op
                prev = w.phase
                w.phase = phase
                w.phase_start = at - phase_ms / 1e3
                w.phase_start_wall = at_wall - phase_ms / 1e3
                entered(w, prev)
            w.phase_ms = phase_ms
            schedule(w)
            heard += 1
        self._stats.heartbeats += heard
        self._stats.digest_entries += heard
        return True

    def _node(
        self,
        now: float,
        wall: float,
        job: str,
        node: str,
        launcher: str,
        host: str,
        seq: int,
        interval: float,
        late_s: float,
    ) -> Node | None:
        """The node's record, with the digest taken as its latest heartbeat; None when
        the digest is ignored or refused."""
        tracking = self._tracking
        n = tracking.nodes.get((job, node))
        if n is None or n.launcher != launcher:
            # (a tracked launcher is never closed: a verdict or a new launcher untracks it)
            if node_incident_id(job, node, launcher) in tracking.closed:
                self._stats.ignored_digests += 1
                return None
            if n is not None:  # a new launcher on the node: the old one is gone for good
                tracking.close(node_incident_id(n.job, n.node, n.launcher), "replaced")
            n = tracking.new_node(job, node, launcher, host, seq, interval, now, wall)
        else:
            s = self._checks.sequence(n, seq, now, "digest", late_s)
            if s is Seq.STALE:
                self._stats.ignored_digests += 1
                return None
            if s is Seq.REFUSED:
                return None
            if s is Seq.NEXT:
                self._live.sample(n, now)
            n.last_arrival, n.last_wall, n.last_seq = now, wall, seq
            n.declared_s = interval
        self._stats.digests += 1
        n.host = host
        return n

    def _relist(self, n: Node, rows: list[DigestRow], workers: list[tuple[str, int]]) -> None:
        """The node lists other workers than before: keep its list, and forget a
        worker it no longer lists (its process ended: not a silence)."""
        job = n.job
        listed = {(r[0], r[1]) for r in rows}
        reg, kept = self._checks.registered, []
        for worker, pid in workers:
            r = reg.get((job, worker))
            if r is None or r.pid == pid:
                kept.append((worker, pid))
            elif (worker, r.pid) in n.workers:  # an entry of another pid (refused later): as it was
                kept.append((worker, r.pid))
                listed.add((worker, r.pid))
        tracked = self._tracking.workers
        for worker, pid in n.workers:
            w = tracked.get((job, worker))
            if (worker, pid) not in listed and w is not None and w.pid == pid and w.node == n.key:
                # A crash is judged by the launcher's exit report, which still finds no verdict.
                del tracked[w.key]
        n.workers = kept

    def _entry(
        self, n: Node, row: DigestRow, w: Worker | None, at: float, at_wall: float, digest_s: float
    ) -> bool:
        """A digest entry off the hot path: a goodbye, no news, or a new incarnation.
        True when it carried a new heartbeat."""
        worker, pid, seq, rank, generation, step, step_ms, phase, phase_ms, _, interval_ms, bound_ms, op = row
        tracking = self._tracking
        closed = False
        if w is None or w.pid != pid:
            closed = incident_id(n.job, worker, pid) in tracking.closed
            if not closed and self._checks.wrong_pid(n.job, worker, pid, seq, "digest entry"):
                return False
        if phase is Phase.DONE:
            tracking.goodbye(n.job, worker, pid)
            return False
        if w is not None and w.pid == pid:
            gap = w.gap_from
            if gap is not None and gap < seq < w.last_seq:  # a second sender jumped ahead (see observe)
                self._stats.seq_resyncs += 1
                w.gap_from = None
                last = w.last_arrival
                w.last_arrival, w.last_wall, w.last_seq = (at if at > last else last), at_wall, seq
                w.rank, w.generation, w.bound_ms, w.heard_digest = rank, generation, bound_ms, n.last_seq
                self._rules.learn(w, phase, phase_ms, step, step_ms, at, at_wall, False, op)
                self._deadlines.schedule_worker(w)
                return True
            # no news (news took the hot path): a verdict deferred while the node was silent is due again
            if w.silence_at is not None and self._live.deadline(w) < w.silence_at:
                w.silence_at = None
                self._deadlines.schedule_worker(w)
            return False
        if closed:
            return False
        interval = interval_ms / 1e3 or digest_s
        w = tracking.new_worker(
            n.job, worker, pid, n.host, rank, generation, step, seq, interval, at, at_wall
        )
        w.node, w.digest_s, w.bound_ms, w.heard_digest = n.key, digest_s, bound_ms, n.last_seq
        w.seq_interval = interval_ms / 1e3  # (0 when the launcher does not know it: learned first)
        self._rules.learn(w, phase, phase_ms, step, step_ms, at, at_wall, True, op)
        self._deadlines.schedule_worker(w)
        return True
