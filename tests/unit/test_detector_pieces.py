"""The detector's pieces one at a time: input checks, the liveness estimate, the verdict
rules, tracking, the mass hold, the deadline heap and the digest rows. The composed
:class:`Detector` is tested in test_detector_algorithm.py."""

from __future__ import annotations

import math
import random
from collections import deque

import pytest
from phalanx.services.failure_detector.checks import InputChecks, Seq
from phalanx.services.failure_detector.config import DetectorConfig, Stats
from phalanx.services.failure_detector.deadlines import Deadlines, Kind
from phalanx.services.failure_detector.digests import digest_row
from phalanx.services.failure_detector.liveness import Liveness
from phalanx.services.failure_detector.mass import MassSilence
from phalanx.services.failure_detector.phi import IntervalWindow, phi
from phalanx.services.failure_detector.rules import Rules
from phalanx.services.failure_detector.tracking import Node, Tracking, Worker
from phalanx.services.failure_detector.verdicts import incident_id, node_incident_id

from phalanx.contract import DigestEntry, FaultCause, Member, Phase, Plan, RankExited, Registered, Role


class Pieces:
    """Every piece built from one config, wired as the Detector wires them."""

    def __init__(self, **cfg: float) -> None:
        self.config = DetectorConfig(**{"worker_floor_s": 0.0, "node_floor_s": 0.0, **cfg})  # type: ignore[arg-type]
        self.stats = Stats()
        self.live = Liveness(self.config)
        self.tracking = Tracking(self.config, self.stats)
        self.checks = InputChecks(self.config, self.stats, self.live)
        self.rules = Rules(self.config, self.live, self.tracking)
        self.mass = MassSilence(self.config, self.stats, self.live, self.tracking)
        self.deadlines = Deadlines(self.tracking, self.live, self.rules, self.mass)

    def worker(self, name: str = "w0", *, at: float = 100.0, interval: float = 0.1, pid: int = 7) -> Worker:
        return self.tracking.new_worker("j1", name, pid, "h", 0, 1, 0, 0, interval, at, 1e9 + at)

    def node(self, name: str = "n0", *, at: float = 100.0, interval: float = 0.1) -> Node:
        return self.tracking.new_node("j1", name, "l0", "h", 0, interval, at, 1e9 + at)


def beats(p: Pieces, b: Worker | Node, n: int, interval: float) -> float:
    """``n`` regular heartbeats after ``b``'s last one, then its estimate; returns the time
    of the last."""
    now = b.last_arrival
    for _ in range(n):
        now += interval
        assert p.checks.sequence(b, b.last_seq + 1, now, "heartbeat") is Seq.NEXT
        p.live.sample(b, now)
        b.last_arrival, b.last_seq = now, b.last_seq + 1
    p.live.estimate(b)  # (as Deadlines.schedule_* does after each)
    return now


# -- input checks --------------------------------------------------------------------
def test_sequence_stale_next_gap_and_resync() -> None:
    p = Pieces()
    w = p.worker()
    assert w.gap_from == -1  # the first heard: a seq below it is a second sender's
    assert p.checks.sequence(w, 0, 100.0, "heartbeat") is Seq.STALE
    assert p.checks.sequence(w, 1, 100.1, "heartbeat") is Seq.NEXT and w.gap_from is None
    w.last_seq = 1
    assert p.checks.sequence(w, 4, 100.2, "heartbeat") is Seq.NEXT and w.gap_from == 1  # skipped 2, 3
    w.last_seq = 4
    assert p.checks.sequence(w, 4, 100.3, "heartbeat") is Seq.STALE
    assert p.checks.sequence(w, 3, 100.3, "heartbeat") is Seq.RESYNC  # strictly inside the gap
    assert w.gap_from is None and p.stats.seq_resyncs == 1
    w.last_seq = 3
    assert p.checks.sequence(w, 2, 100.4, "heartbeat") is Seq.STALE  # one resync per gap
    assert p.checks.refused == []


def test_sequence_bound_refuses_a_jump_but_not_during_a_hold_or_before_an_interval_is_known() -> None:
    p = Pieces(seq_slack=5, seq_rate=2.0)
    w = p.worker(interval=0.1)
    now = beats(p, w, 10, 0.1)
    # 0.1 s after the last: at most 5 + 2 x 1 = 7 ahead
    assert p.checks.sequence(w, w.last_seq + 7, now + 0.1, "heartbeat") is Seq.NEXT
    assert p.checks.sequence(w, w.last_seq + 8, now + 0.1, "heartbeat") is Seq.REFUSED
    [r] = p.checks.take_refused()
    assert (r.kind, r.worker, r.pid, r.seq) == ("seq", "w0", 7, w.last_seq + 8)
    assert p.stats.refused_seq == 1 and p.checks.refused == []
    p.live.hold(now + 5.0)  # the last heartbeat predates the hold: time says nothing
    assert p.checks.sequence(w, w.last_seq + 1000, now + 0.1, "heartbeat") is Seq.NEXT
    q = Pieces()
    unknown = q.worker(interval=0.0)  # (a digest entry whose launcher does not know its interval)
    assert q.checks.sequence(unknown, 1000, 100.1, "digest entry") is Seq.NEXT


def test_sequence_bound_of_a_node_names_the_node() -> None:
    p = Pieces()
    n = p.node()
    now = beats(p, n, 10, 0.1)
    assert p.checks.sequence(n, n.last_seq + 100, now + 0.1, "digest") is Seq.REFUSED
    [r] = p.checks.refused
    assert (r.worker, r.pid, r.kind) == ("node:n0", -1, "seq") and r.reason.startswith("digest of j1/n0:")


def test_the_registered_pid_and_the_assigned_node_decide_who_may_speak() -> None:
    p = Pieces(closed_capacity=2)
    assert not p.checks.wrong_pid("j1", "w0", 7, 1, "heartbeat")  # nothing registered: taken
    assert p.checks.register(Registered(job="j1", worker="w0", role=Role.RANK, host="h", pid=7)) is None
    assert not p.checks.wrong_pid("j1", "w0", 7, 1, "heartbeat")
    assert p.checks.wrong_pid("j1", "w0", 8, 1, "heartbeat") and p.stats.refused_pid == 1
    prev = p.checks.register(Registered(job="j1", worker="w0", role=Role.RANK, host="h", pid=8))
    assert prev is not None and prev.pid == 7 and p.checks.registered[("j1", "w0")].pid == 8
    for name in ("w1", "w2"):  # the oldest registration is evicted past the capacity
        p.checks.register(Registered(job="j1", worker=name, role=Role.RANK, host="h", pid=1))
    assert ("j1", "w0") not in p.checks.registered
    assert not p.checks.foreign("j1", "n1", "w0", 7, 1, "exit report")  # not assigned: from any node
    p.checks.assign("j1", "n0", ["w0", "w1", "w2"])
    assert list(p.checks.node_of) == [("j1", "w1"), ("j1", "w2")]  # (capacity 2)
    assert p.checks.foreign("j1", "n1", "w1", 7, -1, "exit report") and p.stats.refused_node == 1
    assert not p.checks.foreign("j1", "n0", "w1", 7, -1, "exit report")
    kinds = [r.kind for r in p.checks.take_refused()]
    assert kinds == ["pid", "node"]


def test_refusals_queued_are_bounded() -> None:
    p = Pieces()
    for i in range(10_050):
        p.checks.wrong_pid("j1", "w0", i, 0, "heartbeat") if i else p.checks.register(
            Registered(job="j1", worker="w0", role=Role.RANK, host="h", pid=0)
        )
    assert len(p.checks.refused) == 10_000 and p.stats.refused_pid == 10_049


# -- the liveness estimate -----------------------------------------------------------
def test_estimate_trusts_the_declared_interval_until_it_has_samples() -> None:
    p = Pieces(min_samples=5, min_std_ratio=0.2, min_std_s=0.02, pause_ratio=0.15, phi_threshold=8.0)
    w = p.worker(interval=0.5)
    p.live.estimate(w)
    assert w.mean_s == 0.5 and w.std_s == pytest.approx(0.125)  # mean / 4: wide
    beats(p, w, 10, 0.1)
    p.live.estimate(w)
    assert w.mean_s == pytest.approx(0.1) and w.std_s == pytest.approx(0.02)  # floored at 0.2 x mean
    assert w.threshold_s == pytest.approx(0.1 * 1.15 + p.live.z * 0.02)
    assert p.live.deadline(w) == pytest.approx(w.last_arrival + w.threshold_s)
    assert w.slack_s == 0.0  # heard directly
    # where phi crosses the threshold is where the deadline is
    assert p.live.phi_now(w, p.live.deadline(w)) == pytest.approx(8.0, abs=0.01)


def test_a_digest_carried_heartbeat_gets_the_digest_slack() -> None:
    p = Pieces(digest_slack_ratio=0.5)
    w = p.worker()
    beats(p, w, 10, 0.1)
    w.digest_s = 0.5  # its node digests every 0.5 s: up to 0.5 s late, and 0.4 s slower than it beats
    p.live.estimate(w)
    assert w.slack_s == pytest.approx(0.5 * 0.5 + 0.4)
    assert p.live.deadline(w) == pytest.approx(w.last_arrival + w.threshold_s + w.slack_s)


def test_a_hold_restarts_silence_and_its_span_is_not_learned() -> None:
    p = Pieces()
    w = p.worker()
    now = beats(p, w, 10, 0.1)
    p.live.estimate(w)
    before = p.live.deadline(w)
    assert p.live.phi_now(w, before + 1.0) > 8.0
    assert p.live.hold(now + 3.0) and not p.live.hold(now + 1.0)  # a hold only moves later
    assert p.live.deadline(w) == pytest.approx(before + 3.0)
    assert p.live.phi_now(w, before + 1.0) < 1.0  # silent since the end of the hold only
    samples = len(w.intervals)
    p.live.sample(w, now + 3.5)  # the last arrival predates the hold
    assert len(w.intervals) == samples


def test_a_stale_estimate_is_made_before_it_is_read() -> None:
    p = Pieces()
    w = p.worker()
    beats(p, w, 10, 0.1)
    w.stale = True
    evidence = p.live.evidence(w, w.last_arrival + 1.0)
    assert not w.stale and evidence["mean_interval_ms"] == pytest.approx(100.0)
    assert evidence["samples"] == 10 and evidence["last_seq"] == 10


# -- the verdict rules ---------------------------------------------------------------
def test_learned_max_step_follows_the_window_as_steps_come_and_go() -> None:
    p = Pieces(step_window=5)
    w = p.worker()
    rng = random.Random(3)
    for step in range(1, 400):
        step_ms = rng.choice([0.0, rng.uniform(1, 100), rng.uniform(100, 1000)])
        p.rules.learn(w, Phase.COMPUTE, 1.0, step, step_ms, 100.0 + step, 1e9 + step, False)
        assert w.max_step_ms == (max(w.steps) if w.steps else 0.0)
        assert w.step == step and w.progress_at == 100.0 + step


def test_stall_bound_floor_factor_and_initial() -> None:
    p = Pieces(stall_floor_s=2.0, stall_factor=4.0, stall_initial_s=30.0)
    w = p.worker()
    assert p.rules.stall_bound(w) == 30.0
    w.steps, w.max_step_ms = deque([100.0], maxlen=5), 100.0
    assert p.rules.stall_bound(w) == 2.0
    w.max_step_ms = 1000.0
    assert p.rules.stall_bound(w) == 4.0
    assert Pieces(stall_floor_s=5.0, stall_initial_s=1.0).rules.stall_initial == 5.0  # never under the floor


def test_hang_waits_for_a_peer_to_leave_and_for_the_slack_after_it() -> None:
    p = Pieces(collective_slack_ratio=0.25, collective_slack_intervals=2.0)
    w = p.worker(interval=0.1)
    p.rules.learn(w, Phase.COLLECTIVE, 0.0, 0, 0.0, 100.0, 1e9 + 100.0, True)
    w.bound_ms = 2000.0
    assert p.rules.collective_slack(w) == pytest.approx(0.5)  # max(0.25 x 2 s, 2 x 0.1 s)
    assert p.rules.collective_bound(w) == pytest.approx(2.5)
    assert p.rules.hang_at(w) is None  # nobody left
    me = p.worker("w0-again", interval=0.1)
    p.rules.learn(me, Phase.RECOVERING, 0.0, 0, 0.0, 101.0, 1e9 + 101.0, True)
    peer = p.worker("w1", interval=0.1)
    p.rules.learn(peer, Phase.RECOVERING, 0.0, 0, 0.0, 103.0, 1e9 + 103.0, True)
    assert p.rules.left[("j1", 1)].first == 101.0
    assert p.rules.hang_at(w) == pytest.approx(max(100.0 + 2.5, 101.0 + 0.5))
    w.node, w.digest_s = ("j1", "n0"), 0.5  # its heartbeats come with its node's digests: heard later
    assert p.rules.collective_slack(w) == pytest.approx(1.0)
    w.bound_ms = 0.0
    assert p.rules.hang_at(w) is None  # no bound reported: never judged by this rule
    p.rules.forget_before("j1", 2)
    assert p.rules.left == {}


def test_only_itself_having_left_is_no_hang() -> None:
    p = Pieces()
    w = p.worker()
    p.rules.learn(w, Phase.RECOVERING, 0.0, 0, 0.0, 100.0, 1e9 + 100.0, True)
    p.rules.learn(w, Phase.COLLECTIVE, 0.0, 0, 0.0, 101.0, 1e9 + 101.0, False)
    w.bound_ms = 1000.0
    assert p.rules.hang_at(w) is None


def test_exit_verdict_says_how_it_ended_and_what_was_known() -> None:
    p = Pieces()
    ex = RankExited(job="j1", worker="w0", pid=7, host="h", exit_code=None, signal=9, exited_at=1e9)
    bare = p.rules.exit_incident(ex, None, -1, 0, 100.0)
    assert bare.cause is FaultCause.PROCESS_EXIT and bare.evidence == {"host": "h", "signal": 9}
    w = p.worker()
    w.node = ("j1", "n3")
    full = p.rules.exit_incident(ex, w, 2, 5, 100.25)
    assert (full.rank, full.generation, full.fault_at) == (2, 5, 1e9)
    assert full.evidence["node"] == "n3" and full.evidence["since_heartbeat_ms"] == pytest.approx(250.0)
    assert full.id == incident_id("j1", "w0", 7)


# -- tracking ------------------------------------------------------------------------
def test_closed_incarnations_are_remembered_up_to_the_capacity() -> None:
    p = Pieces(closed_capacity=3)
    for i in range(5):
        p.tracking.close(incident_id("j1", "w0", i), "x")
    p.tracking.close(incident_id("j1", "w0", 2), "again")  # refreshed: evicted last
    assert list(p.tracking.closed) == ["j1:w0:3", "j1:w0:4", "j1:w0:2"]


def test_goodbye_counts_once_and_untracks_only_its_own_pid() -> None:
    p = Pieces()
    p.worker(pid=8)
    p.tracking.goodbye("j1", "w0", 7)  # an older pid says goodbye
    assert ("j1", "w0") in p.tracking.workers and p.stats.clean_exits == 1
    p.tracking.goodbye("j1", "w0", 7)
    assert p.stats.clean_exits == 1
    p.tracking.goodbye("j1", "w0", 8)
    assert p.tracking.workers == {} and p.stats.clean_exits == 2


def test_a_lost_node_closes_its_workers_and_an_empty_one_is_forgotten() -> None:
    p = Pieces()
    empty = p.node("n0")
    assert not p.tracking.lose_node(empty) and p.stats.nodes_left == 1
    assert node_incident_id("j1", "n0", "l0") not in p.tracking.closed  # its digests may come again
    n = p.node("n1")
    p.worker("w0", pid=7)
    p.worker("w1", pid=9)
    n.workers = [("w0", 7), ("w1", 8)]  # w1's listed pid is not the tracked one
    assert p.tracking.lose_node(n) and p.stats.nodes_lost == 1
    assert list(p.tracking.workers) == [("j1", "w1")]
    assert p.tracking.closed[incident_id("j1", "w0", 7)] == "node_lost"
    assert incident_id("j1", "w1", 8) in p.tracking.closed and p.tracking.nodes == {}


def _plan(
    generation: int, members: list[str], spares: tuple[str, ...] = (), removed: tuple[str, ...] = ()
) -> Plan:
    return Plan(
        job="j1",
        generation=generation,
        members=[Member(worker=w, rank=r) for r, w in enumerate(members)],
        spares=list(spares),
        removed=list(removed),
        reason="test",
        store_prefix=f"g{generation}",
    )


def test_rank_comes_from_the_newer_of_plan_and_heartbeats() -> None:
    p = Pieces()
    w = p.worker("w1")
    w.rank, w.generation = 4, 3
    assert p.tracking.rank_of("j1", "w1", w) == (4, 3)
    assert p.tracking.rank_of("j1", "w1", None) == (-1, 0)
    assert p.tracking.apply_plan(_plan(2, ["w0", "w1"]))
    assert p.tracking.rank_of("j1", "w1", w) == (4, 3)  # its heartbeats are newer
    assert p.tracking.apply_plan(_plan(4, ["w1"], spares=("w9",), removed=("w0",)))
    assert p.tracking.rank_of("j1", "w1", w) == (0, 4)
    assert p.tracking.rank_of("j1", "w9", None) == (-1, 4)
    assert not p.tracking.apply_plan(_plan(3, ["w0"])) and p.stats.stale_plans == 1


def test_a_plan_closes_the_workers_it_removed() -> None:
    p = Pieces()
    p.worker("w0", pid=7)
    p.tracking.apply_plan(_plan(2, ["w1"], removed=("w0",)))
    assert p.tracking.workers == {} and p.tracking.closed[incident_id("j1", "w0", 7)] == "removed_gen2"


# -- the mass hold -------------------------------------------------------------------
def test_a_mass_silence_holds_its_job_and_the_verdicts_after_it_say_so() -> None:
    p = Pieces(mass_hold_s=10.0, mass_ratio=0.5, mass_min=2)
    ws = [p.worker(f"w{i}") for i in range(4)]
    for w in ws:
        beats(p, w, 10, 0.1)
    now = ws[0].last_arrival + 1.0
    asked: list[float] = []

    def two_silent(job: str, first: Worker | Node, now: float, window: float) -> tuple[set[str], set[str]]:
        asked.append(now + window)
        return {"w0", "w1"}, set()

    until = p.mass.hold_for(False, ws[0], now, two_silent)
    assert until == now + 10.0 and asked == [pytest.approx(now + ws[0].mean_s)]
    [h] = p.mass.take_holds()
    assert (h.workers, h.tracked_workers, h.nodes) == (2, 4, 0) and p.stats.mass_holds == 1
    assert p.mass.hold_for(False, ws[1], now + 1.0, two_silent) == until  # the rest wait too
    assert len(asked) == 1
    # a stall of a rank still heard after the hold began is judged as usual
    ws[2].last_arrival = now + 0.5
    assert p.mass.hold_for(True, ws[2], now + 1.0, two_silent) is None
    assert p.mass.hold_for(True, ws[1], now + 1.0, two_silent) == until
    # after the hold: a member silent through it is judged, and its verdict says it was held
    assert p.mass.hold_for(False, ws[0], until + 0.1, two_silent) is None
    v = p.rules.silence_incident(ws[0], 0, 1, until + 0.1)
    p.mass.mark_held(v, False, ws[0], until + 0.1)
    assert v.evidence["mass_silence"] is True and v.evidence["mass_tracked_workers"] == 4
    assert p.stats.mass_held == 1


def test_too_few_silent_is_no_mass_silence_and_the_finding_is_kept_half_an_interval() -> None:
    p = Pieces(mass_hold_s=10.0, mass_ratio=0.5, mass_min=2)
    ws = [p.worker(f"w{i}") for i in range(5)]
    for w in ws:
        beats(p, w, 10, 0.1)
    now = ws[0].last_arrival + 1.0
    calls = []

    def silent(job: str, first: Worker | Node, now: float, window: float) -> tuple[set[str], set[str]]:
        calls.append(job)
        return {"w0", "w1"}, set()  # 2 of 5: under half

    assert p.mass.hold_for(False, ws[0], now, silent) is None
    assert p.mass.hold_for(False, ws[1], now + 0.01, silent) is None and len(calls) == 1
    assert p.mass.hold_for(False, ws[1], now + 0.06, silent) is None and len(calls) == 2
    assert p.mass.take_holds() == [] and p.mass.held_until("j1") == -math.inf


# -- the deadline heap ---------------------------------------------------------------
def test_scheduled_deadlines_are_the_rules_and_the_estimate() -> None:
    """The inline formulas of Deadlines.schedule_worker agree with Liveness and Rules."""
    rng = random.Random(5)
    for trial in range(200):
        p = Pieces(stall_floor_s=rng.choice([0.5, 2.0]), stall_initial_s=rng.choice([1.0, 60.0]))
        w = p.worker(interval=rng.choice([0.05, 0.1, 0.5]))
        if rng.random() < 0.5:
            w.node, w.digest_s = ("j1", "n0"), rng.choice([0.1, 0.5])
        beats(p, w, rng.randrange(0, 12), rng.choice([0.05, 0.1, 0.3]))
        for step in range(rng.randrange(0, 4)):
            p.rules.learn(w, Phase.COMPUTE, 1.0, step + 1, rng.uniform(10, 500), w.last_arrival, 0.0, False)
        p.rules.learn(
            w, Phase.COMPUTE, rng.uniform(0, 50), w.step, w.step_ms, w.last_arrival, 0.0, trial % 3 == 0
        )
        p.deadlines.schedule_worker(w)
        assert w.silence_at == pytest.approx(p.live.deadline(w))
        assert w.stall_at == pytest.approx(w.stall_since[0] + p.rules.stall_bound(w))
        assert w.check_at == min(w.silence_at, w.stall_at)


def test_a_tick_pops_dead_entries_and_moves_deadlines_that_moved_later() -> None:
    p = Pieces()
    a, b = p.worker("w0"), p.worker("w1")
    for w in (a, b):
        beats(p, w, 10, 0.1)
        p.rules.learn(w, Phase.IDLE, 0.0, 0, 0.0, w.last_arrival, 0.0, True)
        p.deadlines.schedule_worker(w)
    due = a.silence_at
    assert due is not None
    del p.tracking.workers[b.key]  # untracked: its entry is dropped when it comes up
    beats(p, a, 3, 0.1)  # a heard again: its deadline moved later, its heap entry did not
    assert p.deadlines.top_expired(due + 0.01) is None
    assert len(p.deadlines.heap) == 1 and a.check_at == a.silence_at == pytest.approx(p.live.deadline(a))
    at = a.silence_at
    assert at is not None
    assert p.deadlines.top_expired(at + 0.01) == (Kind.SILENCE, a)
    p.live.hold(at + 5.0)
    assert p.deadlines.top_expired(at + 0.02) is None  # nobody is judged during a hold


def test_silent_within_walks_the_heap_up_to_the_horizon_for_one_job() -> None:
    p = Pieces()
    ws = [p.worker(f"w{i}", at=100.0 + 0.04 * i) for i in range(6)]
    other = p.tracking.new_worker("j2", "x", 1, "h", 0, 1, 0, 0, 0.1, 100.0, 0.0)
    for w in [*ws, other]:
        p.rules.learn(w, Phase.IDLE, 0.0, 0, 0.0, w.last_arrival, 0.0, True)
        p.deadlines.schedule_worker(w)
    now = p.live.deadline(ws[0])
    workers, nodes = p.deadlines.silent_within("j1", ws[0], now, 0.1)  # w3 is 0.12 s off
    assert workers == {"w0", "w1", "w2"} and nodes == set()


def test_silent_within_looks_ahead_by_each_members_own_interval() -> None:
    """A slow sender's window (1 s) does not make a fast one (0.1 s) silent: the fast
    one is judged silent only within one of its own intervals of its deadline."""
    p = Pieces()
    slow = p.worker("slow", at=100.0, interval=1.0)
    fast = p.worker("fast", at=100.0, interval=0.1)
    for w in (slow, fast):
        p.rules.learn(w, Phase.IDLE, 0.0, 0, 0.0, w.last_arrival, 0.0, True)
        p.live.estimate(w)
    beats(p, fast, int((p.live.deadline(slow) - 100.0) / 0.1), 0.1)  # heard within its interval
    for w in (slow, fast):
        p.deadlines.schedule_worker(w)
    now = p.live.deadline(slow)
    assert p.live.deadline(fast) < now + 1.0  # within the slow one's window...
    assert p.deadlines.silent_within("j1", slow, now, 1.0) == ({"slow"}, set())  # ...not its own


# -- digest rows ---------------------------------------------------------------------
def test_a_digest_row_is_the_entry_fields_in_order() -> None:
    e = DigestEntry(
        worker="w0", pid=7, seq=3, rank=1, generation=2, step=4, step_ms=5.0, phase=Phase.COMPUTE,
        phase_ms=6.0, age_ms=7.0, interval_ms=8.0, collective_bound_ms=9.0,
    )  # fmt: skip
    assert digest_row(e) == tuple(getattr(e, f) for f in DigestEntry.model_fields)


def test_interval_window_estimate_matches_the_inline_one() -> None:
    rng = random.Random(9)
    p = Pieces(window=10, min_samples=4)
    for _ in range(100):
        w = p.worker(interval=rng.choice([0.1, 0.5]))
        for _ in range(rng.randrange(0, 15)):
            w.intervals.add(rng.uniform(0.0, 1.0))
        p.live.estimate(w)
        iv: IntervalWindow = w.intervals
        if len(iv) >= 4:
            mean, std = iv.mean_std()
            floor = max(0.2 * mean, 0.02)
            assert (w.mean_s, w.std_s) == (pytest.approx(mean), pytest.approx(max(std, floor)))
        else:
            assert (w.mean_s, w.std_s) == iv.estimate(w.declared_s, 4, 0.2, 0.02)
    assert phi(1.0, 1.0, 0.1) == pytest.approx(math.log10(2))
