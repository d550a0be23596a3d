"""The detector's deadlines: one heap of when each tracked worker or node is next
checked, so that a tick costs O(expired) rather than a pass over every sender.

Instead of evaluating phi for every worker on every tick, each heartbeat computes
the time at which its silence becomes a fault (:meth:`.liveness.Liveness.deadline`)
and, in ``COMPUTE``, ``COLLECTIVE`` or ``RECOVERING``, when the stall, the
collective-hang (or wedge) or the joiner rule would judge it (:mod:`.rules`); the earlier
goes into the heap. Deadlines that
move later (the usual case: another heartbeat) are not re-pushed but re-read when
their entry comes up (:meth:`Deadlines.top_expired`).

A worker's deadline that passes while its node's digest is overdue waits for the
node's verdict (or for the next digest, which decides).
"""

from __future__ import annotations

import heapq
import itertools
from enum import Enum

from phalanx.services.failure_detector.liveness import Liveness
from phalanx.services.failure_detector.mass import MassSilence
from phalanx.services.failure_detector.rules import Rules
from phalanx.services.failure_detector.tracking import Node, Tracking, Worker

from phalanx.contract import Phase

__all__ = ["Deadlines", "Kind"]


class Kind(Enum):
    """What a heap entry checks."""

    SILENCE = 0
    """A worker's silence."""
    STALL = 1
    """A worker's stall (in COMPUTE), collective hang (in COLLECTIVE) or failure to
    reach the generation it joins (in RECOVERING)."""
    NODE = 2
    """A node's silence."""


class Deadlines:
    """The heap of deadlines; reads the tracked workers and nodes, writes their
    ``silence_at``/``stall_at``/``check_at``.

    Its hot paths (:meth:`schedule_worker`, :meth:`top_expired`) repeat a few
    formulas of :class:`.liveness.Liveness` and :class:`.rules.Rules` inline (one
    call fewer per heartbeat); each such place names what it repeats.
    """

    def __init__(self, tracking: Tracking, live: Liveness, rules: Rules, mass: MassSilence) -> None:
        self.heap: list[tuple[float, int, Kind, tuple[str, str], int]] = []
        self._counter = itertools.count()
        self._workers, self._nodes = tracking.workers, tracking.nodes
        self._live, self._rules, self._mass = live, rules, mass
        self._estimate, self._deadline = live.estimate, live.deadline
        self._min_samples, self._min_std_ratio, self._min_std = (
            live.min_samples,
            live.min_std_ratio,
            live.min_std,
        )
        self._digest_slack, self._pause, self._z = live.digest_slack, live.pause, live.z

    def push(self, at: float, kind: Kind, b: Worker | Node) -> None:
        heapq.heappush(self.heap, (at, next(self._counter), kind, b.key, b.token))

    def pop(self) -> None:
        """Drop the entry :meth:`top_expired` returned."""
        heapq.heappop(self.heap)

    def schedule_node(self, n: Node) -> None:
        """Push ``n``'s silence deadline when it moved earlier."""
        self._estimate(n)
        at = self._deadline(n)
        if n.silence_at is None or at < n.silence_at:
            n.silence_at = at
            self.push(at, Kind.NODE, n)

    def schedule_worker(self, w: Worker) -> None:
        """Push ``w``'s deadlines when they moved earlier (a later one is re-pushed
        lazily by :meth:`top_expired`).

        Hot path (every heartbeat and digest entry). Its silence deadline usually
        moves later, by an interval, and is not needed until the heap entry expires:
        when even the earliest it can be (sigma at its floor) is not earlier than the
        heap entry, the estimate is left stale and made by
        :meth:`.liveness.Liveness.fresh` on demand.
        """
        iv, silence_at = w.intervals, w.silence_at
        n = len(iv._samples)  # (IntervalWindow's state read directly: no calls on this path)
        if silence_at is not None and n >= self._min_samples and w.node is not None:
            mean = iv._sum / n
            floor = self._min_std_ratio * mean
            floor = floor if floor > self._min_std else self._min_std
            gap = w.digest_s - mean  # the slack, as in Liveness.estimate
            slack = self._digest_slack * w.digest_s + (gap if gap > 0.0 else 0.0)
            last, hold = w.last_arrival, self._live.hold_until
            # the sum of Liveness.deadline, with std at its floor: a lower bound
            if (last if last > hold else hold) + (mean * self._pause + self._z * floor) + slack >= silence_at:
                w.stale = True
            else:
                self._estimate(w)
        else:
            self._estimate(w)
        check = w.check_at
        if not w.stale:
            last, hold = w.last_arrival, self._live.hold_until  # (Liveness.deadline, inline)
            at = (last if last > hold else hold) + w.threshold_s + w.slack_s
            if silence_at is None or at < silence_at:
                w.silence_at = at
                if check is None or at < check:
                    w.check_at = check = at
                    self.push(at, Kind.SILENCE, w)
        if w.phase is Phase.COMPUTE:
            at = self._rules.stall_at(w)
            stall_at = w.stall_at
            if stall_at is None or at < stall_at:
                w.stall_at = at
                if check is None or at < check:
                    w.check_at = at
                    self.push(at, Kind.STALL, w)
        elif w.phase is Phase.COLLECTIVE or w.phase is Phase.RECOVERING:
            if w.phase is Phase.COLLECTIVE:
                judged_at = self._rules.collective_at(w) if w.bound_ms > 0.0 else None
            else:
                judged_at = self._rules.join_at(w)
            stall_at = w.stall_at
            if judged_at is not None and (stall_at is None or judged_at < stall_at):
                w.stall_at = judged_at
                if check is None or judged_at < check:
                    w.check_at = judged_at
                    self.push(judged_at, Kind.STALL, w)

    def defer(self, kind: Kind, b: Worker | Node, until: float) -> None:
        """Put the verdict on ``b``, due now, off until ``until`` (checked again then)."""
        if isinstance(b, Node):
            b.silence_at = until
            self.push(until, Kind.NODE, b)
            return
        if kind is Kind.SILENCE:
            b.silence_at = until
        else:
            b.stall_at = until
        silence_at, stall_at = b.silence_at, b.stall_at
        if stall_at is not None and (silence_at is None or stall_at < silence_at):
            b.check_at = stall_at
            self.push(stall_at, Kind.STALL, b)
        else:
            b.check_at = at = silence_at if silence_at is not None else until
            self.push(at, Kind.SILENCE, b)

    def node_overdue(self, w: Worker, now: float) -> Node | None:
        """The node that carries ``w``, if its next digest is overdue (it may be lost)."""
        n = self._nodes.get(w.node) if w.node is not None else None
        if n is None:
            return None
        expected = max(n.last_arrival, self._live.hold_until) + n.mean_s * self._pause
        return n if now > expected else None

    def _after_node(self, node: Node, now: float) -> float:
        """When a worker of overdue ``node`` is checked again: its node's verdict (or
        next digest) decides first."""
        return max(self._deadline(node), self._mass.held_until(node.job), now + 1e-3)

    def top_expired(self, now: float) -> tuple[Kind, Worker | Node] | None:
        """Tidy the heap top until it is a real expiry (returned, still on the heap:
        :meth:`pop` it) or in the future.

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
        heap, tracked, nodes = self.heap, self._workers, self._nodes
        hold = self._live.hold_until
        while heap and heap[0][0] <= now:
            at, _, kind, key, token = heap[0]
            if kind is Kind.NODE:
                n = nodes.get(key)
                if n is None or n.token != token or n.silence_at != at:
                    heapq.heappop(heap)
                    continue
                if now < hold:
                    return None
                real = self._deadline(n)
                if real <= now:
                    return kind, n
                n.silence_at = real
                heapq.heapreplace(heap, (real, next(self._counter), kind, key, token))
                continue
            w = tracked.get(key)
            if w is None or w.token != token or w.check_at != at:
                heapq.heappop(heap)
                continue
            if now < hold:
                return None
            silence_at, stall_at = w.silence_at, w.stall_at
            if stall_at is not None and (silence_at is None or stall_at < silence_at):
                kind = Kind.STALL
                real_stall: float | None
                if (
                    w.phase is Phase.COLLECTIVE or w.phase is Phase.RECOVERING
                ):  # collective hang or wedge, joiner
                    if w.phase is Phase.COLLECTIVE:
                        real_stall = self._rules.collective_at(w)
                        if (
                            real_stall is not None
                            and real_stall <= now
                            and not self._rules.collective_due(w, now)
                        ):
                            real_stall = now + w.declared_s  # a member moved on: look again after a heartbeat
                    else:
                        real_stall = self._rules.join_at(w)
                    if real_stall is not None and w.last_arrival < hold:
                        real_stall = now + w.declared_s  # as below
                elif w.phase is not Phase.COMPUTE:
                    real_stall = None
                elif w.last_arrival < hold:
                    real_stall = now + w.declared_s  # wait for a heartbeat after the hold to confirm
                else:
                    real_stall = self._rules.stall_at(w)
                if real_stall is not None and real_stall <= now:
                    node = self.node_overdue(w, now)
                    if node is not None:  # no news of the node either: its verdict (or next digest) decides
                        real_stall = self._after_node(node, now)
                    if real_stall <= now:
                        return kind, w
                w.stall_at = stall_at = real_stall
            else:
                kind = Kind.SILENCE
                if w.stale:  # (Liveness.deadline, inline)
                    self._estimate(w)
                last = w.last_arrival
                real = (last if last > hold else hold) + w.threshold_s + w.slack_s
                if real <= now:
                    node = self.node_overdue(w, now)
                    if node is not None:  # no news of the node either: its verdict (or next digest) decides
                        real = self._after_node(node, now)
                    if real <= now:
                        return kind, w
                w.silence_at = silence_at = real
                if stall_at is not None and stall_at > now:  # (one that is due is checked on its own)
                    if w.phase is Phase.COLLECTIVE:
                        w.stall_at = stall_at = self._rules.collective_at(w)
                    elif w.phase is Phase.RECOVERING:
                        w.stall_at = stall_at = self._rules.join_at(w)
                    elif w.phase is not Phase.COMPUTE:
                        w.stall_at = stall_at = None
                    elif last >= hold:
                        w.stall_at = stall_at = self._rules.stall_at(w)
            if stall_at is not None and (silence_at is None or stall_at < silence_at):
                nxt, kind = stall_at, Kind.STALL
            elif silence_at is not None:
                nxt, kind = silence_at, Kind.SILENCE
            else:  # (not reached: a tracked worker always has a silence deadline)
                w.check_at = None
                heapq.heappop(heap)
                continue
            w.check_at = nxt
            heapq.heapreplace(heap, (nxt, next(self._counter), kind, key, token))
        return None

    def silent_within(
        self, job: str, first: Worker | Node, now: float, window: float
    ) -> tuple[set[str], set[str]]:
        """Workers and nodes of ``job`` whose silence deadline is within ``window``, and
        within one of their own intervals, of ``now`` (``first``, just popped from the
        heap, included). Walks the heap's entries up to ``now + window`` (a heap entry
        is never later than its deadline).

        A member's own interval bounds its look-ahead: a live one is always more than an
        interval from its deadline, but not more than ``window`` when ``first`` heartbeats
        more slowly than it does (a node digesting every 100 ms, its deadline 0.75 s
        ahead at most, beside ranks heartbeating every second)."""
        horizon = now + window
        tracked, known = self._workers, self._nodes
        workers: set[str] = set()
        nodes: set[str] = set()

        def add(x: Worker | Node) -> None:
            if isinstance(x, Node):
                if x.workers:
                    nodes.add(x.node)
                    workers.update(w for w, _ in x.workers if (job, w) in tracked)
            elif x is first or not heard_lately(x):
                workers.add(x.worker)

        def heard_lately(w: Worker) -> bool:
            # A worker whose node's last two digests carried news of it is heard, however
            # close its deadline looks: a heartbeat reaches the detector up to a digest
            # interval after it was sent, so a live worker's deadline can be less than
            # one interval away just before its node's next digest.
            n = known.get(w.node) if w.node is not None else None
            return n is not None and w.heard_digest >= n.last_seq - 1

        add(first)
        heap = self.heap
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
            x: Worker | Node | None = known.get(key) if kind is Kind.NODE else tracked.get(key)
            if x is not None and x.token == token and self._deadline(x) <= now + min(window, x.mean_s):
                add(x)
        return workers, nodes
