"""What the detector tracks: one :class:`Worker` per live process incarnation, one
:class:`Node` per node's launcher, the incarnations already closed, and each job's
membership from its latest plan.

An incarnation is ``(job, worker, pid)``; once closed (a verdict, a clean exit, a
plan that removed it, its node lost) its late heartbeats and repeated exits are
ignored: :attr:`Tracking.closed` remembers the last ``closed_capacity`` incident
ids (:func:`~.verdicts.incident_id`, :func:`~.verdicts.node_incident_id`).
"""

from __future__ import annotations

import itertools
from collections import OrderedDict, deque
from dataclasses import dataclass, field

from phalanx.services.failure_detector.config import DetectorConfig, Stats
from phalanx.services.failure_detector.liveness import Beat
from phalanx.services.failure_detector.phi import IntervalWindow
from phalanx.services.failure_detector.verdicts import incident_id, node_incident_id

from phalanx.contract import FaultCause, Phase, Plan

__all__ = ["Membership", "Node", "Tracking", "Worker"]


@dataclass(eq=False, kw_only=True, slots=True)
class Node(Beat):
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
class Worker(Beat):
    """What the detector knows about one live incarnation of a worker."""

    job: str
    worker: str
    pid: int
    host: str
    rank: int
    generation: int
    node: tuple[str, str] | None = None
    """(job, node) whose digests carry this worker; None for a worker heard directly."""
    heard_digest: int = -1
    """``seq`` of the last digest of its node that carried news of it (-1: none)."""
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
    step_start: float = 0.0
    """When its current step began, as far as heard: its last step's completion, or its
    entry into COMPUTE from outside a step (a generation joined)."""
    collective_gen: int = 0
    """The generation whose collectives it was last heard in (its generation when first
    heard): below ``generation`` while it is joining that one and has not arrived."""
    bound_ms: float = 0.0
    """The per-op timeout of its current (or last) all-reduce, as it reported (0: none)."""
    op: int = 0
    """The collectives of its current step it had entered, as last heard."""
    stall_at: float | None = None
    """When the stall rule (in COMPUTE) or the collective-hang rule (in COLLECTIVE, once
    a peer has left) is next checked (None: neither applied when last checked)."""
    check_at: float | None = None
    """When the worker's one live heap entry fires: ``min(silence_at, stall_at)`` when
    pushed; both may have moved later since (see ``Deadlines.top_expired``)."""

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
class Membership:
    """One job's latest plan, as far as verdicts need it (who has which rank)."""

    generation: int = 0
    ranks: dict[str, int] = field(default_factory=dict)
    spares: set[str] = field(default_factory=set)
    plan: Plan | None = None  # the newest (Plan.supersedes)


class Tracking:
    """The tracked incarnations and nodes, the closed ones, and each job's membership."""

    def __init__(self, config: DetectorConfig, stats: Stats) -> None:
        self.workers: dict[tuple[str, str], Worker] = {}
        """(job, worker) -> its live incarnation."""
        self.nodes: dict[tuple[str, str], Node] = {}
        """(job, node) -> its launcher."""
        self.closed: OrderedDict[str, str] = OrderedDict()
        """Incident id of a closed incarnation or launcher -> why it was closed."""
        self._members: dict[str, Membership] = {}
        self._tokens = itertools.count(1)
        self._capacity = config.closed_capacity
        self._window = config.window
        self._node_floor = config.node_floor_s
        self._worker_floor = config.worker_floor_s
        self._step_window = config.step_window
        self._stats = stats

    def close(self, iid: str, why: str) -> None:
        """Remember ``iid`` as closed (the oldest are forgotten past the capacity)."""
        self.closed[iid] = why
        self.closed.move_to_end(iid)
        while len(self.closed) > self._capacity:
            self.closed.popitem(last=False)

    def new_worker(
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
    ) -> Worker:
        """Track a new incarnation of ``worker``, first heard at ``at`` with ``seq``."""
        w = Worker(
            job=job,
            worker=worker,
            pid=pid,
            host=host,
            token=next(self._tokens),
            rank=rank,
            generation=generation,
            collective_gen=generation,
            declared_s=declared_s,
            last_arrival=at,
            last_wall=at_wall,
            last_seq=seq,
            intervals=IntervalWindow(self._window),
            steps=deque(maxlen=self._step_window),
            step=step,
            seq_interval=declared_s,
            gap_from=-1,
            min_silence_s=self._worker_floor,
        )
        self.workers[w.key] = w
        return w

    def new_node(
        self, job: str, node: str, launcher: str, host: str, seq: int, interval: float, at: float, wall: float
    ) -> Node:
        """Track ``launcher`` as ``node``'s, first heard at ``at`` with ``seq``."""
        n = Node(
            token=next(self._tokens),
            declared_s=interval,
            last_arrival=at,
            last_wall=wall,
            last_seq=seq,
            intervals=IntervalWindow(self._window),
            job=job,
            node=node,
            launcher=launcher,
            host=host,
            seq_interval=interval,
            gap_from=-1,
            min_silence_s=self._node_floor,
        )
        self.nodes[n.key] = n
        return n

    def untrack(self, w: Worker) -> None:
        """Stop tracking ``w`` if it is still the tracked incarnation of its worker."""
        if self.workers.get(w.key) is w:
            del self.workers[w.key]

    def goodbye(self, job: str, worker: str, pid: int) -> None:
        """A clean goodbye (phase DONE): the silence that follows is no fault."""
        iid = incident_id(job, worker, pid)
        if iid not in self.closed:
            self._stats.clean_exits += 1
            self.close(iid, "leaving")
        w = self.workers.get((job, worker))
        if w is not None and w.pid == pid:
            del self.workers[w.key]

    def lose_node(self, n: Node) -> bool:
        """Untrack a silent node; with workers, close it and them (lost with the node,
        no verdict of their own) and return True. An empty one (a launcher that
        finished, or one that has not heard its first worker yet) is only forgotten,
        not closed: False. Its digests, should they come again, are a node tracked
        afresh -- closing it would ignore them for good, and a launcher that was
        slow for a moment at its job's start would leave its workers unjudged for
        the whole job (a stopped rank found by nobody)."""
        del self.nodes[n.key]
        iid = node_incident_id(n.job, n.node, n.launcher)
        if not n.workers:
            self._stats.nodes_left += 1
            return False
        for worker, pid in n.workers:
            w = self.workers.get((n.job, worker))
            if w is not None and w.pid == pid:
                del self.workers[w.key]
            self.close(incident_id(n.job, worker, pid), "node_lost")
        self.close(iid, FaultCause.HEARTBEAT_LOST.value)
        self._stats.nodes_lost += 1
        return True

    def apply_plan(self, plan: Plan) -> bool:
        """Learn a generation's membership and close the workers it removed (no
        verdict: the launcher fences them); False for a plan older than the known one."""
        m = self._members.setdefault(plan.job, Membership())
        if m.plan is not None and m.plan.supersedes(plan):  # the same plan again is applied again
            self._stats.stale_plans += 1
            return False
        m.plan, m.generation = plan, plan.generation
        m.ranks = {x.worker: x.rank for x in plan.members}
        m.spares = set(plan.spares)
        for name in plan.removed:
            w = self.workers.pop((plan.job, name), None)
            if w is not None:
                self.close(incident_id(w.job, w.worker, w.pid), f"removed_gen{plan.generation}")
        return True

    def members(self, job: str, generation: int) -> dict[str, int] | None:
        """Worker -> rank of ``job``'s ``generation``, if it is the latest plan known."""
        m = self._members.get(job)
        return m.ranks if m is not None and m.generation == generation else None

    def rank_of(self, job: str, worker: str, w: Worker | None) -> tuple[int, int]:
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
