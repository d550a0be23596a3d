"""The failure-detection algorithm on a fake clock: phi, deadlines, holds, stalls,
incarnations, exits and plans. No bus here; see tests/integration/test_detector_service.py."""

from __future__ import annotations

import doctest
import itertools
import math
import random

import pytest
from phalanx.services.failure_detector.config import DetectorConfig
from phalanx.services.failure_detector.detector import Detector
from phalanx.services.failure_detector.mass import Probe
from phalanx.services.failure_detector.phi import PHI_CAP, IntervalWindow, phi, phi_threshold_z
from phalanx.services.failure_detector.service import ServiceConfig
from phalanx.services.failure_detector.verdicts import Incident, NodeIncident, incident_id, node_incident_id

from phalanx.contract import (
    CollectiveError,
    DigestEntry,
    FaultCause,
    Heartbeat,
    Member,
    NodeDigest,
    NodeLost,
    Phase,
    Plan,
    RankExited,
    RankFailed,
    RankHung,
    decode,
    encode,
)
from tests.unit.fakeclock import FakeClock

I = 0.1  # heartbeat interval of the simulated workers (s)  # noqa: E741


class Rank:
    """A simulated worker that heartbeats into a detector on a fake clock."""

    def __init__(
        self,
        det: Detector,
        clock: FakeClock,
        worker: str = "w0",
        *,
        rank: int = 0,
        pid: int = 100,
        job: str = "j1",
        interval: float = I,
        phase: Phase = Phase.COMPUTE,
        generation: int = 1,
    ) -> None:
        self.det, self.clock = det, clock
        self.job, self.worker, self.rank, self.pid, self.generation = job, worker, rank, pid, generation
        self.interval = interval
        self.seq = 0
        self.step = 0
        self.step_ms = 0.0
        self.phase = phase
        self.phase_since = clock.monotonic()
        self.bound_ms = 0.0  # the per-op all-reduce timeout it reports
        self.op = 0  # the collectives of its step entered, as RankStatus counts them

    def enter(self, phase: Phase) -> None:
        self.phase, self.phase_since = phase, self.clock.monotonic()
        if phase is Phase.COLLECTIVE:
            self.op += 1

    def complete_step(self, step_ms: float) -> None:
        self.step += 1
        self.step_ms = step_ms
        self.op = 0

    def beat(self) -> bool:
        hb = Heartbeat(
            job=self.job,
            worker=self.worker,
            rank=self.rank,
            generation=self.generation,
            step=self.step,
            step_ms=self.step_ms,
            phase=self.phase,
            phase_ms=(self.clock.monotonic() - self.phase_since) * 1e3,
            seq=self.seq,
            pid=self.pid,
            host="h1",
            interval_ms=self.interval * 1e3,
            collective_bound_ms=self.bound_ms,
            op=self.op,
            ts=self.clock.wall(),
        )
        self.seq += 1
        return self.det.observe(hb)


def make(**cfg: float) -> tuple[Detector, FakeClock]:
    """A detector on a fake clock; phi alone decides silence unless a test sets the
    floors (the service's defaults hold a silence shorter than 0.5 s / 0.75 s)."""
    clock = FakeClock()
    cfg = {"worker_floor_s": 0.0, "node_floor_s": 0.0, **cfg}
    return Detector(DetectorConfig(**cfg), clock=clock.monotonic, wall=clock.wall), clock  # type: ignore[arg-type]


def run(clock: FakeClock, det: Detector, ranks: list[Rank], seconds: float, dt: float = 0.005) -> list:
    """Advance time in small steps; ranks beat on their interval; returns every verdict."""
    out = []
    due = {id(r): clock.monotonic() for r in ranks}
    end = clock.monotonic() + seconds
    while clock.monotonic() < end - 1e-9:
        for r in ranks:
            if clock.monotonic() >= due[id(r)] - 1e-9:
                r.beat()
                due[id(r)] += r.interval
        out += det.tick()
        clock.advance(dt)
    return out


def exit_msg(
    worker: str = "w0",
    pid: int = 100,
    code: int | None = 1,
    sig: int | None = None,
    at: float = 1_700_000_000.0,
) -> RankExited:
    return RankExited(job="j1", worker=worker, pid=pid, host="h1", exit_code=code, signal=sig, exited_at=at)


# -- phi -----------------------------------------------------------------------------
def test_phi_is_the_normal_tail_and_stays_finite() -> None:
    assert phi(1.0, 1.0, 0.1) == pytest.approx(math.log10(2))
    z = phi_threshold_z(8.0)
    assert phi(1.0 + z * 0.1, 1.0, 0.1) == pytest.approx(8.0, rel=1e-6)
    values = [phi(1.0 + k * 0.05, 1.0, 0.1) for k in range(400)]
    assert all(b >= a for a, b in itertools.pairwise(values))
    assert values[-1] == PHI_CAP and math.isfinite(values[-1])
    assert phi(1.0 + 40 * 0.1, 1.0, 0.1) > 300  # asymptotic branch, not inf
    with pytest.raises(ValueError):
        phi_threshold_z(0)


def test_interval_window_slides() -> None:
    w = IntervalWindow(4)
    for x in [10.0, 1.0, 2.0, 3.0, 4.0]:
        w.add(x)
    assert len(w) == 4 and w.mean == pytest.approx(2.5)
    assert w.std == pytest.approx(math.sqrt(1.25))


# -- heartbeat loss ------------------------------------------------------------------
def test_regular_sender_lost_within_three_intervals_not_before_two() -> None:
    det, clock = make()
    r = Rank(det, clock)
    assert run(clock, det, [r], 3.0) == []
    snap = det.snapshot("j1", "w0")
    assert snap is not None and snap["std_ms"] == pytest.approx(20.0)  # floored: 0.2 x 100 ms
    assert 2 * I < snap["threshold_ms"] / 1e3 < 3 * I
    # the rank goes silent right after its last heartbeat
    r.beat()
    last_wall = clock.wall()
    clock.advance(2 * I)
    assert det.tick() == []
    clock.advance(0.8 * I)
    [inc] = det.tick()
    assert inc.cause is FaultCause.HEARTBEAT_LOST
    assert inc.fault_at == pytest.approx(last_wall)
    assert inc.id == incident_id("j1", "w0", 100) == "j1:w0:100"
    assert inc.evidence["phi"] >= 8.0 and inc.evidence["last_seq"] == r.seq - 1
    assert {"elapsed_ms", "mean_interval_ms", "std_interval_ms", "samples"} <= inc.evidence.keys()
    assert len(det) == 0
    clock.advance(10.0)
    assert det.tick() == []  # once


def test_threshold_adapts_to_jitter() -> None:
    det, clock = make()
    steady, jittery = Rank(det, clock, "w0", pid=1), Rank(det, clock, "w1", pid=2)
    rng = random.Random(7)
    t = clock.monotonic()
    for k in range(100):  # w1's intervals vary between 40 and 160 ms, w0's are exact
        clock.now = t + k * I
        steady.beat()
        clock.now = t + k * I + rng.uniform(0, 0.06)
        jittery.beat()
    a, b = det.snapshot("j1", "w0"), det.snapshot("j1", "w1")
    assert a is not None and b is not None
    assert b["std_ms"] > a["std_ms"] and b["threshold_ms"] > a["threshold_ms"]


def test_few_samples_use_declared_interval_widely() -> None:
    det, clock = make()
    r = Rank(det, clock, interval=0.5)
    r.beat()
    snap = det.snapshot("j1", "w0")
    assert snap is not None and snap["std_ms"] == pytest.approx(125.0)  # declared / 4
    clock.advance(1.0)
    assert det.tick() == []
    clock.advance(1.0)
    assert [i.cause for i in det.tick()] == [FaultCause.HEARTBEAT_LOST]


def test_many_workers_tick_cost_stays_bounded_and_detection_within_three_intervals() -> None:
    """2,000 workers at 2 Hz, 20 fall silent at random times: each is found within
    3 intervals of its fault, nobody else is, and the heap stays O(workers)."""
    det, clock = make()
    rng = random.Random(1)
    n, interval = 2000, 0.5
    t0 = clock.monotonic()
    offsets = [rng.uniform(0, interval) for _ in range(n)]
    ranks = [Rank(det, clock, f"w{i}", pid=1000 + i, interval=interval) for i in range(n)]
    silent_at = {i: t0 + 5.0 + rng.uniform(0, 3.0) for i in rng.sample(range(n), 20)}
    next_beat = [t0 + o for o in offsets]
    found: dict[str, float] = {}
    max_heap = 0
    while clock.monotonic() < t0 + 12.0:
        now = clock.monotonic()
        for i in range(n):
            if next_beat[i] <= now:
                if now < silent_at.get(i, math.inf):
                    ranks[i].beat()
                next_beat[i] += interval
        for inc in det.tick():
            found[inc.worker] = now
        max_heap = max(max_heap, len(det._deadlines.heap))
        clock.advance(0.01)
    assert set(found) == {f"w{i}" for i in silent_at}
    for i, at in silent_at.items():
        assert found[f"w{i}"] - at <= 3 * interval
    assert max_heap <= 2 * n


def test_hold_postpones_verdicts_and_restarts_silence() -> None:
    det, clock = make()
    r = Rank(det, clock)
    run(clock, det, [r], 2.0)
    r.beat()
    det.hold(clock.monotonic() + 1.0)  # e.g. disconnected from NATS for a second
    clock.advance(0.9)
    assert det.tick() == [] and not det.due()
    clock.advance(0.1 + 2 * I)  # silence is measured from the end of the hold
    assert det.tick() == []
    clock.advance(I)
    assert [i.cause for i in det.tick()] == [FaultCause.HEARTBEAT_LOST]


def test_intervals_spanning_a_hold_are_not_learned() -> None:
    det, clock = make()
    r = Rank(det, clock)
    run(clock, det, [r], 2.0)
    before = det.snapshot("j1", "w0")
    det.hold(clock.monotonic() + 0.5)
    clock.advance(0.8)
    r.beat()
    after = det.snapshot("j1", "w0")
    assert before is not None and after is not None
    assert after["samples"] == before["samples"] and after["mean_ms"] == pytest.approx(before["mean_ms"])


def test_out_of_order_and_repeated_heartbeats_are_ignored() -> None:
    det, clock = make()
    r = Rank(det, clock)
    assert r.beat()
    r.seq = 0
    assert not r.beat()
    assert det.stats.ignored_heartbeats == 1


# -- step stall ----------------------------------------------------------------------
def _train(r: Rank, clock: FakeClock, det: Detector, steps: int, step_s: float) -> list:
    """Alternate COMPUTE and COLLECTIVE, heartbeating every interval; returns verdicts."""
    out = []
    for _ in range(steps):
        r.enter(Phase.COMPUTE)
        out += run(clock, det, [r], step_s * 0.7)
        r.enter(Phase.COLLECTIVE)
        out += run(clock, det, [r], step_s * 0.3)
        r.complete_step(step_s * 1e3)
    return out


def test_stall_in_compute_is_reported_with_learned_bound() -> None:
    det, clock = make(stall_floor_s=0.5, stall_factor=4.0)
    r = Rank(det, clock)
    assert _train(r, clock, det, 10, 0.2) == []
    r.enter(Phase.COMPUTE)
    stalled_wall = clock.wall()
    assert det.stall_bound(det._tracked[("j1", "w0")]) == pytest.approx(0.8)  # 4 x 200 ms > 0.5 s
    out = run(clock, det, [r], 0.75)
    assert out == []
    out = run(clock, det, [r], 0.3)
    [inc] = out
    assert inc.cause is FaultCause.STEP_STALL
    assert inc.fault_at == pytest.approx(stalled_wall)
    assert inc.evidence["bound_ms"] == pytest.approx(800.0)
    assert inc.evidence["phase"] == "compute" and inc.evidence["step"] == 10
    assert inc.evidence["phase_ms"] >= 800.0
    assert not r.beat()  # the closed incarnation is not tracked again
    assert run(clock, det, [r], 2.0) == []


def test_stall_bound_floor_and_initial() -> None:
    det, clock = make(stall_floor_s=2.0, stall_factor=4.0, stall_initial_s=30.0)
    r = Rank(det, clock)
    r.beat()
    w = det._tracked[("j1", "w0")]
    assert det.stall_bound(w) == 30.0  # no step seen yet
    _train(r, clock, det, 3, 0.1)
    assert det.stall_bound(w) == 2.0  # 4 x 100 ms < floor


@pytest.mark.parametrize("phase", [Phase.COLLECTIVE, Phase.IDLE, Phase.STARTING, Phase.RECOVERING])
def test_other_phases_are_not_judged_by_the_stall_rule(phase: Phase) -> None:
    det, clock = make(stall_floor_s=0.3, stall_initial_s=0.3)
    r = Rank(det, clock, rank=-1 if phase is Phase.IDLE else 0)
    _train(r, clock, det, 3, 0.1)
    r.enter(phase)
    assert run(clock, det, [r], 5.0) == []
    assert det.snapshot("j1", "w0") is not None


def test_victims_in_collective_are_not_reported_only_the_stalled_rank() -> None:
    det, clock = make(stall_floor_s=0.3, stall_initial_s=0.3)
    ranks = [Rank(det, clock, f"w{i}", rank=i, pid=10 + i) for i in range(4)]
    for r in ranks:
        r.beat()
    ranks[2].enter(Phase.COMPUTE)
    for r in (ranks[0], ranks[1], ranks[3]):
        r.enter(Phase.COLLECTIVE)
    out = run(clock, det, ranks, 3.0)
    assert [(i.worker, i.cause) for i in out] == [("w2", FaultCause.STEP_STALL)]


def test_progress_within_compute_is_not_a_stall() -> None:
    det, clock = make(stall_floor_s=0.3, stall_factor=2.0)
    r = Rank(det, clock)
    r.enter(Phase.COMPUTE)  # never leaves COMPUTE, but completes a step every 100 ms
    out = []
    for _ in range(40):
        out += run(clock, det, [r], 0.1)
        r.complete_step(100.0)
    assert out == []


# -- collective hang -------------------------------------------------------------------
def _in_collective(n: int, bound_s: float, **cfg: float) -> tuple[Detector, FakeClock, list[Rank]]:
    """``n`` ranks of one generation that trained a few steps, all now in COLLECTIVE
    with the same per-op bound ``bound_s``."""
    det, clock = make(**cfg)
    ranks = [Rank(det, clock, f"w{i}", rank=i, pid=10 + i) for i in range(n)]
    for r in ranks:
        r.bound_ms = bound_s * 1e3
    for _ in range(5):
        for r in ranks:
            r.enter(Phase.COMPUTE)
        assert run(clock, det, ranks, 0.07) == []
        for r in ranks:
            r.enter(Phase.COLLECTIVE)
        assert run(clock, det, ranks, 0.03) == []
        for r in ranks:
            r.complete_step(100.0)
    for r in ranks:
        r.enter(Phase.COMPUTE)
    assert run(clock, det, ranks, 0.07) == []
    for r in ranks:
        r.enter(Phase.COLLECTIVE)
    return det, clock, ranks


def test_rank_left_behind_in_collective_is_a_collective_hang() -> None:
    # w1 hangs inside the all-reduce (heartbeats go on); w0 and w2 time out after
    # their 1 s bound and leave: w1 is blamed once past its own bound plus slack.
    det, clock, ranks = _in_collective(3, 1.0)
    hung_wall = clock.wall()
    assert run(clock, det, ranks, 1.0) == []
    for r in (ranks[0], ranks[2]):
        r.enter(Phase.RECOVERING)
    left = clock.monotonic()
    out = run(clock, det, ranks, 0.24)  # 1 s + max(25 % of it, 2 heartbeat intervals) = 1.25 s
    assert out == []
    out = run(clock, det, ranks, 3.0)
    [hang] = out
    assert (hang.worker, hang.cause, hang.rank, hang.generation) == ("w1", FaultCause.COLLECTIVE_HANG, 1, 1)
    assert isinstance(hang.to_event(), RankHung)
    assert hang.fault_at == pytest.approx(hung_wall, abs=I)
    ev = hang.evidence
    assert ev["phase"] == "collective" and ev["bound_ms"] == 1000.0 and ev["slack_ms"] == 250.0
    assert ev["peers_left"] == "w0,w2" and ev["peers_left_count"] == 2
    assert 1250.0 <= ev["phase_ms"] <= 1250.0 + 10 and ev["first_left_ms"] == pytest.approx(250.0, abs=10)
    assert clock.monotonic() - left >= 0.24
    # the peers that left (RECOVERING) are never blamed, however long they wait
    assert sorted(w for _, w, _ in det.tracked()) == ["w0", "w2"]


def test_peers_leaving_late_get_time_to_be_heard_before_anyone_is_blamed() -> None:
    # The peers' timeouts fired late (a gloo timeout restarts with each partial
    # transfer), and not together: w0 leaves at 2 s, w2 only 0.2 s later. w2 is not
    # blamed for the 0.2 s; w1, which never leaves, is -- a slack after w0 left.
    det, clock, ranks = _in_collective(3, 1.0)
    assert run(clock, det, ranks, 2.0) == []
    ranks[0].enter(Phase.RECOVERING)
    assert run(clock, det, ranks, 0.2) == []
    ranks[2].enter(Phase.RECOVERING)
    assert run(clock, det, ranks, 0.04) == []
    [hang] = run(clock, det, ranks, 1.0)
    assert hang.worker == "w1" and hang.evidence["first_left_ms"] == pytest.approx(250.0, abs=10)
    assert hang.evidence["phase_ms"] == pytest.approx(2250.0, abs=10)


def test_every_member_still_in_collective_is_judged_by_nobody_while_the_membership_is_unknown() -> None:
    # no plan heard: nobody knows whether every member is inside (the wedge rule's job)
    det, clock, ranks = _in_collective(3, 1.0)
    assert run(clock, det, ranks, 10.0) == []
    assert len(det) == 3


def test_every_member_inside_the_same_collective_past_its_bound_is_a_wedged_collective() -> None:
    """An unmodified script's ranks bound nothing themselves: every member inside the
    same all-reduce past the bound of its bytes (plus slack) after the last one entered
    is a wedge, judged once, on one member, that nobody can be singled out for."""
    det, clock, ranks = _in_collective(3, 1.0)
    assert det.apply_plan(_plan(1, ["w0", "w1", "w2"]))
    assert run(clock, det, ranks, 0.3) == []
    ranks[2].enter(Phase.COLLECTIVE)  # a second collective of the step: the others follow
    ranks[0].enter(Phase.COLLECTIVE)
    assert run(clock, det, ranks, 0.5) == []
    ranks[1].enter(Phase.COLLECTIVE)
    last_wall, last = clock.wall(), clock.monotonic()
    out = run(clock, det, ranks, 1.24)  # the last one in: 1 s + max(25 %, 2 heartbeats)
    assert out == []
    out = run(clock, det, ranks, 3.0)
    [wedge] = out
    assert wedge.cause is FaultCause.COLLECTIVE_WEDGED and wedge.generation == 1
    assert isinstance(wedge.to_event(), RankHung)
    assert wedge.fault_at == pytest.approx(last_wall, abs=I)
    ev = wedge.evidence
    assert ev["peers_inside_count"] == 2 and ev["op"] == ev["peers_op"] == 2
    assert ev["bound_ms"] == 1000.0 and ev["inside_all_ms"] == pytest.approx(1250.0, abs=10)
    assert clock.monotonic() - last > 1.24
    assert len(det) == 2, "one verdict: the others are not judged for the same wedge"


def test_a_wedge_waits_for_every_member_to_be_heard_since_its_collective_should_have_completed() -> None:
    # w2's heartbeats are held up (a C extension holding the GIL) from before the bound
    # ran out: its last word may be stale, so nobody is judged until it is heard again
    det, clock, ranks = _in_collective(3, 1.0, worker_floor_s=3.0)
    assert det.apply_plan(_plan(1, ["w0", "w1", "w2"]))
    entered = clock.monotonic()
    assert run(clock, det, ranks, 0.8) == []
    assert run(clock, det, ranks[:2], 1.5) == [], "w2 unheard since the collective should have completed"
    [wedge] = run(clock, det, ranks, 0.5)
    assert wedge.cause is FaultCause.COLLECTIVE_WEDGED and clock.monotonic() - entered >= 2.3


def test_a_collective_every_member_is_in_is_not_wedged_while_a_peer_is_outside_or_left() -> None:
    # rank 0 evaluates alone (RUNNING) while the others wait in the next all-reduce
    det, clock, ranks = _in_collective(3, 1.0)
    assert det.apply_plan(_plan(1, ["w0", "w1", "w2"]))
    ranks[0].enter(Phase.RUNNING)
    assert run(clock, det, ranks, 10.0) == []
    # the own-loop runtime: the peers time out at their bound and leave; the one left
    # behind is the collective-hang rule's, not a wedge
    det, clock, ranks = _in_collective(3, 1.0)
    assert det.apply_plan(_plan(1, ["w0", "w1", "w2"]))
    assert run(clock, det, ranks, 1.0) == []
    for r in (ranks[0], ranks[2]):
        r.enter(Phase.RECOVERING)
    [hang] = run(clock, det, ranks, 3.0)
    assert (hang.worker, hang.cause) == ("w1", FaultCause.COLLECTIVE_HANG) and "peers_left" in hang.evidence


def test_a_member_behind_the_collectives_its_peers_wait_in_is_the_hung_one() -> None:
    """DDP's buckets: the peers entered the step's second all-reduce, the hung rank never
    got past its first. Every member is inside one, and it is the one behind."""
    det, clock, ranks = _in_collective(3, 1.0)
    assert det.apply_plan(_plan(1, ["w0", "w1", "w2"]))
    for r in (ranks[0], ranks[2]):
        r.enter(Phase.COLLECTIVE)
    entered = clock.monotonic()
    [hang] = run(clock, det, ranks, 3.0)
    assert (hang.worker, hang.cause) == ("w1", FaultCause.COLLECTIVE_HANG)
    assert (
        hang.evidence["op"] == 1
        and hang.evidence["peers_op"] == 2
        and hang.evidence["peers_inside"] == "w0,w2"
    )
    # judged by its peers' pace as a straggler is: the straggle floor, 1.5 s, over the 1 s bound
    assert clock.monotonic() - entered >= 1.5


def test_a_member_that_moved_on_ends_the_wedge_and_its_peers_are_still_watched() -> None:
    # every member was inside; one moved on (its collective completed) and stays out:
    # no verdict, and the others' deadlines are kept (a silence is still found)
    det, clock, ranks = _in_collective(3, 1.0)
    assert det.apply_plan(_plan(1, ["w0", "w1", "w2"]))
    assert run(clock, det, ranks, 1.0) == []
    ranks[2].enter(Phase.RUNNING)
    assert run(clock, det, ranks, 5.0) == []
    out = run(clock, det, ranks[:2], 2.0)  # w2 falls silent
    assert [(v.worker, v.cause) for v in out] == [("w2", FaultCause.HEARTBEAT_LOST)]


def test_a_rank_within_its_bound_is_not_blamed_when_peers_left() -> None:
    # w1 entered the all-reduce later (a slower step) with a 3 s bound: its peers
    # leaving does not make it hung until its own bound (plus slack) has passed.
    det, clock, ranks = _in_collective(3, 1.0)
    ranks[1].bound_ms = 3000.0
    assert run(clock, det, ranks, 1.0) == []
    for r in (ranks[0], ranks[2]):
        r.enter(Phase.RECOVERING)
    assert run(clock, det, ranks, 2.25) == []  # 3.25 s in COLLECTIVE < 3 s + 0.3 s
    ranks[1].enter(Phase.RECOVERING)  # it timed out too (or the cascade reached it) before 3.75 s
    assert run(clock, det, ranks, 5.0) == []
    # and one that reports no bound (an older sender) is never judged by the rule
    det, clock, ranks = _in_collective(2, 1.0)
    ranks[1].bound_ms = 0.0
    assert run(clock, det, ranks, 1.0) == []
    ranks[0].enter(Phase.RECOVERING)
    assert run(clock, det, ranks, 10.0) == []


def test_collective_hang_needs_a_peer_of_the_same_job_and_generation() -> None:
    det, clock = make()
    a = Rank(det, clock, "w0", rank=0, pid=1, generation=2)
    b = Rank(det, clock, "w1", rank=1, pid=2, generation=2)
    other_gen = Rank(det, clock, "w2", rank=0, pid=3, generation=1)
    other_job = Rank(det, clock, "w0", rank=0, pid=4, job="j2", generation=2)
    for r in (a, b, other_gen, other_job):
        r.bound_ms = 500.0
        r.enter(Phase.COLLECTIVE)
    assert run(clock, det, [a, b, other_gen, other_job], 0.3) == []
    other_gen.enter(Phase.RECOVERING)
    other_job.enter(Phase.RECOVERING)
    assert run(clock, det, [a, b, other_gen, other_job], 3.0) == []
    b.enter(Phase.RECOVERING)
    [hang] = run(clock, det, [a, b, other_gen, other_job], 0.5)
    assert (hang.job, hang.worker, hang.cause) == ("j1", "w0", FaultCause.COLLECTIVE_HANG)
    assert hang.evidence["peers_left"] == "w1"


def test_collective_hang_through_digests() -> None:
    det, clock = make()
    node = SimNode(det, clock, 0, random.Random(3), ranks=4, jitter=0.5 * I)
    node.bound_ms = 1000.0
    assert drive(clock, det, [node], 2.0) == []
    now = clock.monotonic()
    node.stuck = {j: (Phase.COLLECTIVE, now) for j in range(4)}
    assert drive(clock, det, [node], 1.0) == []
    for j in (0, 2, 3):
        node.stuck[j] = (Phase.RECOVERING, clock.monotonic())
    out = drive(clock, det, [node], 2.0)
    [(at, hang)] = out
    assert isinstance(hang, Incident) and hang.cause is FaultCause.COLLECTIVE_HANG and hang.worker == "n0-w1"
    assert hang.evidence["node"] == "n0" and hang.evidence["peers_left_count"] == 3
    # bound 1 s + 25 % of it + the digest interval, seen with a digest (up to 1.5 I late)
    assert 1.35 <= at - now <= 1.35 + 2 * I
    assert hang.fault_at == pytest.approx(clock.epoch + now, abs=I)


# -- incarnations, exits, plans -----------------------------------------------------
def test_exit_nonzero_is_reported_once_even_with_heartbeats_lost() -> None:
    det, clock = make()
    r = Rank(det, clock)
    run(clock, det, [r], 1.0)
    inc = det.on_exit(exit_msg(sig=9, code=None, at=clock.wall()))
    assert inc is not None and inc.cause is FaultCause.PROCESS_EXIT and inc.fault_at == clock.wall()
    assert inc.evidence["signal"] == 9 and "exit_code" not in inc.evidence
    assert det.on_exit(exit_msg(sig=9, code=None)) is None  # duplicate report
    clock.advance(5.0)
    assert det.tick() == []  # and no heartbeat_lost for the same pid
    assert det.stats.repeated_exits == 1


def test_exit_after_heartbeat_loss_verdict_is_not_a_second_incident() -> None:
    det, clock = make()
    r = Rank(det, clock)
    run(clock, det, [r], 1.0)
    clock.advance(1.0)
    assert [i.cause for i in det.tick()] == [FaultCause.HEARTBEAT_LOST]
    assert det.on_exit(exit_msg(code=137)) is None


def test_exit_code_zero_forgets_the_worker() -> None:
    det, clock = make()
    r = Rank(det, clock)
    run(clock, det, [r], 1.0)
    assert det.on_exit(exit_msg(code=0)) is None
    assert len(det) == 0 and det.stats.clean_exits == 1
    assert not r.beat()  # a heartbeat still in flight does not resurrect it
    clock.advance(5.0)
    assert det.tick() == []


def test_new_pid_is_a_new_incarnation() -> None:
    det, clock = make()
    old = Rank(det, clock, pid=100)
    run(clock, det, [old], 1.0)
    clock.advance(1.0)
    [first] = det.tick()
    new = Rank(det, clock, pid=200)
    assert new.beat() and not old.beat()
    run(clock, det, [new], 1.0)
    clock.advance(1.0)
    [second] = det.tick()
    assert (first.id, second.id) == ("j1:w0:100", "j1:w0:200")


def test_exit_of_an_older_pid_keeps_the_new_incarnation() -> None:
    det, clock = make()
    Rank(det, clock, pid=100).beat()
    new = Rank(det, clock, pid=200)
    run(clock, det, [new], 1.0)
    inc = det.on_exit(exit_msg(pid=100))
    assert inc is not None and inc.id == "j1:w0:100"
    assert det.snapshot("j1", "w0") is not None and det.snapshot("j1", "w0")["pid"] == 200  # type: ignore[index]


def test_lost_spare_is_reported_with_rank_minus_one() -> None:
    det, clock = make()
    s = Rank(det, clock, "w9", rank=-1, phase=Phase.IDLE, generation=0)
    run(clock, det, [s], 1.0)
    clock.advance(1.0)
    [inc] = det.tick()
    assert (inc.rank, inc.worker, inc.cause) == (-1, "w9", FaultCause.HEARTBEAT_LOST)


def _plan(gen: int, members: list[str], removed: tuple[str, ...] = (), spares: tuple[str, ...] = ()) -> Plan:
    return Plan(
        job="j1",
        generation=gen,
        members=[Member(rank=i, worker=w) for i, w in enumerate(members)],
        removed=list(removed),
        spares=list(spares),
        reason="test",
        store_prefix=f"g{gen}",
    )


def test_plans_give_rank_and_generation_and_removed_workers_are_forgotten() -> None:
    det, clock = make()
    a, b = Rank(det, clock, "w0", pid=1, rank=0), Rank(det, clock, "w1", pid=2, rank=1)
    run(clock, det, [a, b], 1.0)
    assert det.apply_plan(_plan(2, ["w1"], removed=["w0"]))  # w1 becomes rank 0 in generation 2
    assert not det.apply_plan(_plan(1, ["w0", "w1"]))  # stale
    assert ("j1", "w0", 1) not in set(det.tracked())
    inc = det.on_exit(exit_msg("w0", pid=1, sig=9, code=None))
    assert inc is None  # fenced by the plan: an expected exit
    inc = det.on_exit(exit_msg("w1", pid=2))
    assert inc is not None and (inc.rank, inc.generation) == (0, 2)
    # an exit of a worker never seen heartbeating: rank from the plan
    det.apply_plan(_plan(3, ["w5"], spares=["w6"]))
    assert det.on_exit(exit_msg("w5", pid=5)).rank == 0  # type: ignore[union-attr]
    assert det.on_exit(exit_msg("w6", pid=6)).rank == -1  # type: ignore[union-attr]
    # restart recovery: the launcher names the generation the process ran; the verdict keeps it
    ran = exit_msg("w5", pid=50).model_copy(update={"generation": 2})
    assert det.on_exit(ran).generation == 2  # type: ignore[union-attr]


def test_incident_becomes_a_valid_event() -> None:
    det, clock = make(stall_floor_s=0.3)
    r = Rank(det, clock)
    run(clock, det, [r], 2.0)
    [hung] = run(clock, det, [], 1.0)
    ev = hung.to_event()
    assert isinstance(ev, RankHung) and ev.incident == hung.id and ev.cause is FaultCause.HEARTBEAT_LOST
    assert decode(*encode(ev)) == ev  # every evidence value survives the wire
    failed = det.on_exit(exit_msg("w1", pid=7))
    assert failed is not None and isinstance(failed.to_event(), RankFailed)


def test_docstring_examples() -> None:
    import phalanx.services.failure_detector.detector as detector_module
    import phalanx.services.failure_detector.phi as phi_module
    import phalanx.services.failure_detector.service as service_module
    import phalanx.services.failure_detector.verdicts as verdicts_module

    import tests.unit.fakeclock as fakeclock_module

    for module in (detector_module, phi_module, verdicts_module, service_module, fakeclock_module):
        result = doctest.testmod(module)
        assert result.failed == 0 and result.attempted > 0, module.__name__


def _config_from(monkeypatch: pytest.MonkeyPatch, env: dict[str, str]) -> ServiceConfig:
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    return ServiceConfig.from_settings()


def test_service_config_from_env(monkeypatch: pytest.MonkeyPatch) -> None:
    assert ServiceConfig.from_settings() == ServiceConfig.for_interval(0.1)  # the same defaults
    env = {
        "PHALANX_HEARTBEAT_MS": "500",
        "PHALANX_STALL_FLOOR_MS": "1500",
        "PHALANX_DETECTOR_PHI": "10",
        "PHALANX_DETECTOR_JOB": "j1",
    }
    c = _config_from(monkeypatch, env)
    assert (c.heartbeat_s, c.tick_s, c.max_lag_s, c.job) == (0.5, 0.05, 0.25, "j1")
    assert c.detector.stall_floor_s == 1.5 and c.detector.phi_threshold == 10.0
    with pytest.raises(ValueError, match="PHALANX_HEARTBEAT_MS"):
        _config_from(monkeypatch, {"PHALANX_HEARTBEAT_MS": "fast"})
    with pytest.raises(ValueError, match="PHALANX_DETECTOR_JOB"):
        _config_from(monkeypatch, {"PHALANX_HEARTBEAT_MS": "500", "PHALANX_DETECTOR_JOB": "a.b"})


# -- node digests ----------------------------------------------------------------------
class SimNode:
    """A node's launcher on the fake clock: its ranks heartbeat into it on their own
    schedules, it samples them into a digest every ``interval``, and each digest
    reaches the detector ``delay()`` later (jitter of the network and the loops)."""

    def __init__(
        self,
        det: Detector,
        clock: FakeClock,
        k: int,
        rng: random.Random,
        *,
        ranks: int = 8,
        interval: float = I,
        rank_interval: float | None = None,
        jitter: float = 0.0,
    ) -> None:
        self.det, self.clock, self.k, self.rng = det, clock, k, rng
        self.node, self.launcher = f"n{k}", f"L{k}"
        self.interval, self.rank_interval = interval, rank_interval or interval
        self.jitter = jitter
        now = clock.monotonic()
        self.next_digest = now + rng.uniform(0, interval)
        self.next_beat = [now + rng.uniform(0, self.rank_interval) for _ in range(ranks)]
        self.heard: list[tuple[int, float, Phase, float, int] | None] = [None] * ranks
        """Per rank: (seq, received at, phase, phase_ms, step) of its latest heartbeat."""
        self.seq = [0] * ranks
        self.stuck: dict[int, tuple[Phase, float]] = {}
        self.frozen: set[int] = set()
        self.silent = False
        self.bound_ms = 0.0  # the per-op all-reduce timeout its ranks report
        self.digest_seq = 0
        self.in_flight: list[tuple[float, NodeDigest]] = []

    def worker(self, j: int) -> str:
        return f"n{self.k}-w{j}"

    def pid(self, j: int) -> int:
        return 10_000 + 100 * self.k + j

    def _beat(self, j: int, now: float) -> None:
        seq = self.seq[j]
        self.seq[j] += 1
        if j in self.stuck:  # heartbeats go on, the step does not
            phase, since = self.stuck[j]
            prev = self.heard[j]
            self.heard[j] = (seq, now, phase, (now - since) * 1e3, prev[4] if prev else 0)
        else:  # a step per heartbeat, alternating phases
            self.heard[j] = (seq, now, Phase.COMPUTE if seq % 2 else Phase.COLLECTIVE, 1.0, seq)

    def _digest(self, now: float) -> NodeDigest:
        entries = [
            DigestEntry(
                worker=self.worker(j),
                pid=self.pid(j),
                seq=seq,
                rank=self.k * 8 + j,
                generation=1,
                step=step,
                step_ms=self.rank_interval * 800,
                phase=phase,
                phase_ms=phase_ms,
                age_ms=(now - at) * 1e3,
                interval_ms=self.rank_interval * 1e3,
                collective_bound_ms=self.bound_ms,
            )
            for j, h in enumerate(self.heard)
            if h is not None
            for seq, at, phase, phase_ms, step in [h]
        ]
        self.digest_seq += 1
        return NodeDigest(
            job="j1",
            node=self.node,
            launcher=self.launcher,
            host=f"h{self.k}",
            seq=self.digest_seq,
            interval_ms=self.interval * 1e3,
            entries=entries,
        )

    def advance(self, now: float) -> None:
        for j, at in enumerate(self.next_beat):
            if at <= now + 1e-9:
                if j not in self.frozen:
                    self._beat(j, now)
                self.next_beat[j] = at + self.rank_interval
        if self.next_digest <= now + 1e-9:
            if not self.silent:
                self.in_flight.append((now + self.rng.uniform(0, self.jitter), self._digest(now)))
            self.next_digest += self.interval
        while self.in_flight and self.in_flight[0][0] <= now + 1e-9:
            self.observe(self.in_flight.pop(0)[1])

    def observe(self, d: NodeDigest) -> None:
        self.det.observe_digest(d)


def drive(
    clock: FakeClock,
    det: Detector,
    nodes: list[SimNode],
    seconds: float,
    dt: float = 0.005,
    answers: dict[str, Probe | list[Probe]] | None = None,
) -> list:
    """Advance time in small steps; nodes beat and digest; returns (time, verdict) pairs.
    ``answers``: what asking each held node's launcher finds (as the service would ask;
    a list: one answer per question, the last one repeated)."""
    out = []
    end = clock.monotonic() + seconds
    while clock.monotonic() < end - 1e-9:
        for n in nodes:
            n.advance(clock.monotonic())
        for job, node, launcher in det.take_probes():
            a = (answers or {}).get(node, Probe.SILENT)
            det.probed(job, node, launcher, (a.pop(0) if len(a) > 1 else a[0]) if isinstance(a, list) else a)
        out += [(clock.monotonic(), v) for v in det.tick()]
        clock.advance(dt)
    return out


def test_silent_node_is_one_node_lost_and_no_rank_hung_for_its_workers() -> None:
    det, clock = make()
    rng = random.Random(3)
    nodes = [SimNode(det, clock, k, rng, jitter=0.5 * I) for k in range(3)]
    assert drive(clock, det, nodes, 3.0) == []
    assert len(det) == 24 and sorted(det.nodes()) == [("j1", f"n{k}", f"L{k}") for k in range(3)]
    nodes[1].silent = True
    silent_at = clock.monotonic()
    out = drive(clock, det, nodes, 3.0)
    [(at, lost)] = out
    assert isinstance(lost, NodeIncident) and isinstance(lost.to_event(), NodeLost)
    assert lost.id == node_incident_id("j1", "n1", "L1") == "j1:node:n1:L1"
    assert lost.cause is FaultCause.HEARTBEAT_LOST and lost.node == "n1"
    assert sorted(lost.workers) == [f"n1-w{j}" for j in range(8)]
    assert at - silent_at <= 3 * I and lost.fault_at <= clock.epoch + silent_at + 0.5 * I
    assert lost.evidence["phi"] >= 8.0 and lost.evidence["launcher"] == "L1"
    event = lost.to_event()
    assert decode(*encode(event)) == event
    assert all(det.is_closed("j1", f"n1-w{j}", nodes[1].pid(j)) for j in range(8))
    assert len(det) == 16 and det.stats.nodes_lost == 1
    # the partition heals: the same launcher's digests (and its workers) are not taken back
    nodes[1].silent = False
    ignored = det.stats.ignored_digests
    assert drive(clock, det, nodes, 3.0) == []
    assert det.stats.ignored_digests > ignored
    assert len(det) == 16 and ("j1", "n1", "L1") not in set(det.nodes())


def test_a_launcher_stalled_for_a_third_of_a_second_is_no_lost_node() -> None:
    """A launcher's event loop stalled for 330 ms at a job's start (a compose stack on
    two loaded cores): over its digests' phi threshold, under the node floor; a node
    silent past the floor is lost."""
    det, clock = make(node_floor_s=0.75)
    node = SimNode(det, clock, 0, random.Random(8), ranks=1)  # (two silent at once: a mass hold)
    assert drive(clock, det, [node], 3.0) == []
    node.silent = True
    assert drive(clock, det, [node], 0.33) == []
    node.silent = False
    assert drive(clock, det, [node], 2.0) == [] and det.stats.nodes_lost == 0
    node.silent = True
    silent_at = clock.monotonic()
    [(at, lost)] = drive(clock, det, [node], 2.0)
    assert isinstance(lost, NodeIncident) and 0.75 - I <= at - silent_at <= 0.75 + 2 * I


def test_a_worker_floor_holds_a_short_silence_and_judges_a_long_one() -> None:
    det, clock = make(worker_floor_s=0.5)
    node = SimNode(det, clock, 0, random.Random(9), ranks=4)
    assert drive(clock, det, [node], 2.0) == []
    node.frozen = {2}  # 300 ms of silence (a rank's agent thread starved): no verdict
    assert drive(clock, det, [node], 0.3) == []
    node.frozen = set()
    assert drive(clock, det, [node], 1.0) == []
    node.frozen = {2}
    stopped = clock.monotonic()
    [(at, hung)] = drive(clock, det, [node], 2.0)
    assert hung.cause is FaultCause.HEARTBEAT_LOST and 0.5 - 2 * I <= at - stopped <= 0.5 + 2 * I


def test_rank_hung_inside_a_live_node_is_found_within_three_intervals() -> None:
    det, clock = make()
    rng = random.Random(5)
    nodes = [SimNode(det, clock, k, rng, jitter=0.3 * I) for k in range(20)]
    assert drive(clock, det, nodes, 3.0) == []
    t0 = clock.monotonic()
    frozen_at = {}
    found: dict[str, float] = {}
    while clock.monotonic() < t0 + 6.0:
        now = clock.monotonic()
        for n in nodes:  # each node loses one rank at a random moment in the first 3 s
            if n.k not in frozen_at and now >= t0 + 3.0 * n.k / len(nodes) + rng.uniform(0, I):
                j = rng.randrange(8)
                n.frozen.add(j)
                frozen_at[n.k] = (n.worker(j), now)
        for at, v in drive(clock, det, nodes, 0.005):
            assert isinstance(v, Incident) and v.cause is FaultCause.HEARTBEAT_LOST
            assert v.evidence["node"] == f"n{v.worker.split('-')[0][1:]}"
            found[v.worker] = at
    assert sorted(found) == sorted(w for w, _ in frozen_at.values())
    worst = max(found[w] - at for w, at in frozen_at.values())
    assert worst <= 3 * I, worst
    assert det.stats.nodes_lost == 0 and len(det) == 20 * 7


@pytest.mark.parametrize("rank_interval", [I, I / 4, 2 * I])
def test_no_false_positive_with_digest_jitter_up_to_one_interval(rank_interval: float) -> None:
    det, clock = make()
    rng = random.Random(11)
    nodes = [SimNode(det, clock, k, rng, jitter=I, rank_interval=rank_interval) for k in range(10)]
    assert drive(clock, det, nodes, 30.0) == []
    assert len(det) == 80 and det.stats.digest_entries > 0
    # and a rank that stops is still found
    nodes[4].frozen.add(2)
    [(_, hung)] = drive(clock, det, nodes, 5 * max(I, rank_interval))
    assert isinstance(hung, Incident) and hung.worker == "n4-w2"


def test_step_stall_from_digest_entries_and_peers_in_collective_are_not_judged() -> None:
    det, clock = make(stall_floor_s=0.5, stall_factor=4.0)
    rng = random.Random(2)
    node = SimNode(det, clock, 0, rng, ranks=4, jitter=0.5 * I)
    assert drive(clock, det, [node], 2.0) == []
    now = clock.monotonic()
    node.stuck = {0: (Phase.COMPUTE, now), 1: (Phase.COLLECTIVE, now), 2: (Phase.COLLECTIVE, now)}
    out = drive(clock, det, [node], 3.0)
    [(at, stall)] = out
    assert isinstance(stall, Incident) and stall.cause is FaultCause.STEP_STALL and stall.worker == "n0-w0"
    assert stall.evidence["bound_ms"] == 500.0
    assert stall.fault_at == pytest.approx(clock.epoch + now, abs=I)
    assert 0.5 <= at - now <= 0.5 + 2 * I
    assert sorted(w for _, w, _ in det.tracked()) == ["n0-w1", "n0-w2", "n0-w3"]


def test_a_straggler_in_the_first_step_is_judged_by_its_peers_pace() -> None:
    """Before any step completed (the old bound: stall_initial, 60 s), a rank in COMPUTE
    while its peers wait in COLLECTIVE at the same step is judged once past
    max(straggle_floor, factor x the peers' time to reach the collective)."""
    det, clock = make()  # stall_floor 5 s, stall_initial 60 s
    node = SimNode(det, clock, 0, random.Random(6), ranks=4, jitter=0.3 * I)
    t0 = clock.monotonic()
    node.stuck = {j: (Phase.COMPUTE, t0) for j in range(4)}  # step 1 starts everywhere
    assert drive(clock, det, [node], 0.3) == []
    waiting = clock.monotonic()
    node.stuck.update({j: (Phase.COLLECTIVE, waiting) for j in (1, 2, 3)})  # w0 spins
    [(at, stall)] = drive(clock, det, [node], 5.0)
    assert isinstance(stall, Incident) and stall.cause is FaultCause.STEP_STALL and stall.worker == "n0-w0"
    ev = stall.evidence
    assert ev["peers_waiting_count"] == 3 and ev["peers_waiting"] == "n0-w1,n0-w2,n0-w3"
    assert ev["bound_ms"] == 1500.0  # the floor: 4 x ~0.3 s of the peers' reach is less
    assert 0.25 <= ev["peers_reach_ms"] / 1e3 <= 0.3 + 2 * I
    assert t0 + 1.5 <= at <= t0 + 1.5 + 3 * I


def test_a_straggler_bound_follows_the_peers_pace_and_a_shared_pause_is_no_fault() -> None:
    det, clock = make(stall_floor_s=60.0)
    node = SimNode(det, clock, 0, random.Random(7), ranks=4, jitter=0.3 * I)
    t0 = clock.monotonic()
    # a long step (an evaluation pass) every rank takes at once: nobody waits, nobody is judged
    node.stuck = {j: (Phase.COMPUTE, t0) for j in range(4)}
    assert drive(clock, det, [node], 8.0) == []
    # the peers reach the collective after 8 s: w2, as slow as they were, is no straggler...
    reached = clock.monotonic()
    node.stuck.update({j: (Phase.COLLECTIVE, reached) for j in (0, 1, 3)})
    assert drive(clock, det, [node], 20.0) == []
    # ...until it has taken 4 x their 8 s
    [(at, stall)] = drive(clock, det, [node], 10.0)
    assert stall.worker == "n0-w2" and stall.evidence["peers_waiting_count"] == 3
    assert stall.evidence["bound_ms"] == pytest.approx(4 * 8.0e3, abs=4e3 * 2 * I)
    assert t0 + 32.0 - 2 * I <= at <= t0 + 32.0 + 10 * I


def test_a_peer_seen_in_collective_at_two_steps_in_a_row_still_counts_as_waiting() -> None:
    """A sharded model's ranks toggle between COMPUTE and COLLECTIVE many times a step:
    a waiter heard in COLLECTIVE in step 3, then (a step later, its phase never seen
    leaving) in COLLECTIVE again, waits for step 4's straggler."""
    det, clock = make(stall_floor_s=60.0)
    ranks = [Rank(det, clock, f"w{r}", rank=r, pid=100 + r) for r in range(2)]
    for r in ranks:
        r.complete_step(100.0)  # 3 steps done, 100 ms each
        r.complete_step(100.0)
        r.complete_step(100.0)
    waiter, straggler = ranks
    waiter.enter(Phase.COLLECTIVE)
    assert run(clock, det, ranks, 0.3) == []
    # the waiter completes a step and is in a new collective before its next heartbeat
    waiter.complete_step(100.0)
    straggler.complete_step(100.0)
    straggler.enter(Phase.COMPUTE)
    clock.advance(0.05)
    waiter.enter(Phase.COLLECTIVE)
    out = run(clock, det, ranks, 3.0)
    assert [(v.worker, v.cause, v.evidence.get("peers_waiting")) for v in out] == [
        ("w1", FaultCause.STEP_STALL, "w0")
    ]


# -- the joiner rule ---------------------------------------------------------------------
def _after_a_failed_step(n: int = 3) -> tuple[Detector, FakeClock, list[Rank]]:
    """``n`` ranks of generation 1 that trained 3 steps of 100 ms, then left its
    collectives (RECOVERING in generation 1, waiting for the next plan); each reports a
    60 s all-reduce bound, so that only the rule under test can judge anyone."""
    det, clock = make(stall_floor_s=60.0, stall_initial_s=60.0)
    ranks = [Rank(det, clock, f"w{i}", rank=i, pid=10 + i) for i in range(n)]
    for r in ranks:
        r.bound_ms = 60e3
    for _ in range(3):
        for r in ranks:
            r.enter(Phase.COMPUTE)
        assert run(clock, det, ranks, 0.07) == []
        for r in ranks:
            r.enter(Phase.COLLECTIVE)
        assert run(clock, det, ranks, 0.03) == []
        for r in ranks:
            r.complete_step(100.0)
    for r in ranks:
        r.enter(Phase.RECOVERING)
    assert run(clock, det, ranks, 1.0) == []  # a second waiting for the plan: no fault
    return det, clock, ranks


def _take_plan(r: Rank, generation: int) -> None:
    r.generation = generation
    r.enter(Phase.RECOVERING)  # RankStatus.join


def test_a_rank_that_took_a_generation_and_never_reaches_it_is_judged_while_its_peers_wait() -> None:
    """Its peers arrived at generation 2's rendezvous; it took the plan (it reports
    generation 2, RECOVERING) and stopped there: judged after the straggle floor."""
    det, clock, ranks = _after_a_failed_step()
    taken = clock.monotonic()
    for r in ranks:
        _take_plan(r, 2)
    for r in ranks[:2]:
        r.enter(Phase.COLLECTIVE)  # the arrival wait
    out: list = []
    while not out and clock.monotonic() < taken + 5.0:
        out = run(clock, det, ranks, 0.05)
    at = clock.monotonic()
    [v] = out
    assert (v.worker, v.cause, v.generation) == ("w2", FaultCause.STEP_STALL, 2)
    assert v.evidence["phase"] == "recovering" and v.evidence["bound_ms"] == 1500.0
    assert v.evidence["peers_waiting"] == "w0,w1"
    assert taken + 1.5 <= at <= taken + 1.5 + 3 * I


def test_peers_heard_only_in_collective_before_and_after_the_plan_wait_in_the_new_generation() -> None:
    """No heartbeat of the peers' went out between their failed all-reduce (generation 1,
    heard 10 ms into it) and their arrival wait (generation 2, heard 60 ms into it): the
    same phase with a longer time in it, but another generation's collective, so they
    wait there, and the spare stuck short of it is judged."""
    det, clock = make(stall_floor_s=60.0, stall_initial_s=60.0)
    peers = [Rank(det, clock, f"w{i}", rank=i, pid=10 + i) for i in range(2)]
    spare = Rank(det, clock, "w3", rank=-1, pid=23, phase=Phase.IDLE, generation=0)
    for r in peers:
        r.bound_ms = 60e3
        r.complete_step(100.0)
    assert run(clock, det, [*peers, spare], 0.5) == []
    for r in peers:
        r.enter(Phase.COLLECTIVE)
    clock.advance(0.01)
    for r in peers:
        r.beat()
    clock.advance(0.05)
    _take_plan(spare, 2)
    for r in peers:  # failed, took the plan, arrived: COLLECTIVE again, 60 ms in by the next beat
        r.generation, r.phase_since = 2, clock.monotonic() - 0.01
    clock.advance(0.05)
    out = run(clock, det, [*peers, spare], 5.0)
    assert [(v.worker, v.cause, v.evidence["peers_waiting"]) for v in out] == [
        ("w3", FaultCause.STEP_STALL, "w0,w1")
    ]


def test_a_stuck_spare_is_judged_and_a_prompt_one_is_not() -> None:
    det, clock, ranks = _after_a_failed_step(2)
    spares = [Rank(det, clock, f"w{i}", rank=-1, pid=20 + i, phase=Phase.IDLE, generation=0) for i in (3, 4)]
    assert run(clock, det, ranks + spares, 0.5) == []
    for r in [*ranks, *spares]:
        _take_plan(r, 2)
    for r in [*ranks, spares[0]]:
        r.enter(Phase.COLLECTIVE)
    out = run(clock, det, ranks + spares, 5.0)
    assert [(v.worker, v.cause) for v in out] == [("w4", FaultCause.STEP_STALL)]


def test_a_rank_heard_in_an_earlier_collective_of_the_step_still_owes_the_later_one() -> None:
    """Sharded models and DDP's buffer broadcast enter several collectives a step. A rank
    heard in the step's first (an all-gather) that then spins in compute is judged by the
    peers waiting in the second within the straggle bound, not the 60 s stall floor: the
    heartbeats count the step's collectives entered (``op``)."""
    det, clock = make(stall_floor_s=60.0)
    ranks = [Rank(det, clock, f"w{r}", rank=r, pid=100 + r) for r in range(3)]
    for r in ranks:
        r.complete_step(100.0)
        r.enter(Phase.COLLECTIVE)  # the step's first collective: every rank heard in it
    assert run(clock, det, ranks, 0.2) == []
    peers = ranks[1:]  # w0 spins
    for r in ranks:
        r.enter(Phase.COMPUTE)
    assert run(clock, det, ranks, 0.1) == []
    for r in peers:
        r.enter(Phase.COLLECTIVE)  # the second: the spinner never comes
    out = run(clock, det, ranks, 3.0)
    assert [(v.worker, v.cause, v.evidence.get("peers_waiting")) for v in out] == [
        ("w0", FaultCause.STEP_STALL, "w1,w2")
    ]
    assert out[0].evidence["bound_ms"] == 1500.0


def test_an_unmodified_scripts_rank_is_judged_once_it_stands_still_and_never_while_it_moves() -> None:
    """An unmodified script's ranks (heartbeats every second) report RUNNING outside
    their collectives while the main thread moves, and COMPUTE timed from where it stood
    still (``phalanx.runtime.scriptgroup``). Rank 0 evaluating alone for 10 s while its
    peer waits in the next step's all-reduce moves: no verdict. A rank standing still
    while its peer waits is the straggler, judged on the floor from where it stopped."""
    det, clock = make(stall_floor_s=60.0)
    ranks = [
        Rank(det, clock, f"w{r}", rank=r, pid=100 + r, interval=1.0, phase=Phase.RUNNING) for r in range(2)
    ]
    evaluating, waiting = ranks
    for _ in range(3):
        for r in ranks:
            r.complete_step(50.0)
        assert run(clock, det, ranks, 1.0) == []
    for r in ranks:
        r.complete_step(50.0)
    waiting.enter(Phase.COLLECTIVE)
    assert run(clock, det, ranks, 10.0) == [], "moving (RUNNING) is never judged"
    evaluating.enter(Phase.RUNNING)
    evaluating.phase, evaluating.phase_since = Phase.COMPUTE, clock.monotonic() - 0.5  # stood still 0.5 s ago
    out = run(clock, det, ranks, 3.0)
    assert [(v.worker, v.cause, v.evidence.get("peers_waiting")) for v in out] == [
        ("w0", FaultCause.STEP_STALL, "w1")
    ]
    assert out[0].evidence["bound_ms"] == 1500.0
    # timed from where it stood still, not from the heartbeat that said so
    assert 1500.0 <= out[0].evidence["phase_ms"] <= 1600.0, out[0].evidence


def test_a_rank_past_the_collective_its_peers_wait_in_is_not_their_straggler() -> None:
    """Subgroups (HSDP's shard groups) run ahead of each other: a rank in compute after
    the step's second collective owes nothing to a peer still waiting in its first."""
    det, clock = make(stall_floor_s=60.0)
    ahead, waiter = Rank(det, clock, "w0", rank=0, pid=100), Rank(det, clock, "w1", rank=1, pid=101)
    for r in (ahead, waiter):
        r.complete_step(100.0)
    ahead.enter(Phase.COLLECTIVE)
    assert run(clock, det, [ahead, waiter], 0.2) == []
    ahead.enter(Phase.COMPUTE)
    ahead.enter(Phase.COLLECTIVE)
    ahead.enter(Phase.COMPUTE)  # op 2, computing
    waiter.enter(Phase.COLLECTIVE)  # op 1, waiting (for a rank of its own subgroup)
    assert run(clock, det, [ahead, waiter], 5.0) == []


def test_a_rank_restoring_after_its_generation_s_collectives_or_waiting_for_a_plan_is_not_judged() -> None:
    """RECOVERING after generation 2's rendezvous and state transfer (its data restore),
    or RECOVERING in generation 1 waiting for a plan while its peers still wait in
    generation 1's collective: neither is a joiner that never arrived."""
    det, clock, ranks = _after_a_failed_step()
    for r in ranks:
        _take_plan(r, 2)
        r.enter(Phase.COLLECTIVE)
    assert run(clock, det, ranks, 0.3) == []
    ranks[2].enter(Phase.RECOVERING)  # a slow data restore
    assert run(clock, det, ranks, 5.0) == []

    det, clock, ranks = _after_a_failed_step()
    for r in ranks[:2]:
        r.enter(Phase.COLLECTIVE)  # (heard in generation 1's collective again)
    assert run(clock, det, ranks, 5.0) == []


def test_done_entries_and_empty_nodes_make_no_verdict() -> None:
    det, clock = make()
    node = SimNode(det, clock, 0, random.Random(1), ranks=2)
    assert drive(clock, det, [node], 2.0) == []
    # both ranks leave: their last entries say DONE, then the launcher stops
    for j in range(2):
        node.frozen.add(j)
        seq, at, _, _, step = node.heard[j]  # type: ignore[misc]
        node.heard[j] = (seq + 1, at, Phase.DONE, 0.0, step)
    assert drive(clock, det, [node], 2 * I) == []
    assert len(det) == 0 and det.stats.clean_exits == 2
    node.heard = [None, None]  # dropped after the DONE digest
    assert drive(clock, det, [node], 2 * I) == []
    node.silent = True
    assert drive(clock, det, [node], 2.0) == []
    assert det.stats.nodes_left == 1 and list(det.nodes()) == []


def test_a_launcher_silent_before_its_workers_heartbeat_still_has_its_stopped_rank_judged() -> None:
    """What made ``make demo`` fail once in two runs: a launcher, busy forking its
    workers, sent empty digests and then none for longer than its node's deadline;
    the empty node was forgotten *and closed*, every later digest of that launcher
    was ignored, and a rank SIGSTOPped later in the job got no verdict at all."""
    det, clock = make()
    node = SimNode(det, clock, 0, random.Random(5), ranks=4)
    node.frozen = {0, 1, 2, 3}  # workers still starting: the digests list nobody
    assert drive(clock, det, [node], 1.0) == []
    node.silent = True  # the launcher stalls (CPU starved while it forks)
    assert drive(clock, det, [node], 1.0) == []
    assert det.stats.nodes_left == 1 and list(det.nodes()) == []
    node.silent, node.frozen = False, set()  # it speaks again, its workers heartbeat
    assert drive(clock, det, [node], 2.0) == []
    assert sorted(w for _, w, _ in det.tracked()) == [f"n0-w{j}" for j in range(4)]
    node.frozen = {1}  # SIGSTOP
    stopped = clock.monotonic()
    [(at, hung)] = drive(clock, det, [node], 2.0)
    assert isinstance(hung, Incident) and hung.worker == "n0-w1" and hung.cause is FaultCause.HEARTBEAT_LOST
    assert at - stopped < 4 * I


@pytest.mark.parametrize("seed", range(12))
def test_one_stopped_rank_among_live_ones_is_no_mass_silence(seed: int) -> None:
    """Live workers heard in their node's digests are never counted into a mass
    silence, however their heartbeats and the digests are phased (a live worker's
    deadline can be less than an interval away just before the next digest): one
    stopped rank is judged in about 3 intervals, not held for ``mass_hold_s``."""
    det, clock = make()
    rng = random.Random(seed)
    node = SimNode(det, clock, 0, rng, ranks=4, jitter=0.3 * I)
    assert drive(clock, det, [node], 1.0 + rng.uniform(0, I)) == []
    node.frozen = {rng.randrange(4)}
    stopped = clock.monotonic()
    [(at, hung)] = drive(clock, det, [node], 2.0)
    assert hung.cause is FaultCause.HEARTBEAT_LOST and det.stats.mass_holds == 0
    assert at - stopped < 4 * I


@pytest.mark.parametrize("seed", range(6))
def test_a_stopped_slow_heartbeat_rank_beside_a_live_node_is_no_mass_silence(seed: int) -> None:
    """What made an unmodified script's SIGSTOPped rank wait 12.6 s (bench.hangs): its
    ranks heartbeat every second, their node digests every 100 ms. The mass-silence
    check looked one of the *stopped rank's* intervals ahead (1 s), and the live
    node's deadline (its last digest + the 0.75 s floor) is always within that: the
    node and, with it, every worker it carries counted as silent, and the verdict was
    held for ``mass_hold_s``. Each member is now looked ahead by its own interval."""
    det, clock = make(worker_floor_s=0.5, node_floor_s=0.75)
    rng = random.Random(seed)
    node = SimNode(det, clock, 0, rng, ranks=5, interval=I, rank_interval=1.0, jitter=0.3 * I)
    assert drive(clock, det, [node], rng.uniform(1.01, 3.0)) == []  # its first heartbeats (one or two each)
    node.frozen = {rng.randrange(5)}
    stopped = clock.monotonic()
    [(at, hung)] = drive(clock, det, [node], 4.0)
    assert hung.cause is FaultCause.HEARTBEAT_LOST and det.stats.mass_holds == 0
    assert at - stopped < 3.7  # its threshold with few samples (2.55 intervals) plus its phase


def test_a_node_cut_off_with_its_slow_heartbeat_ranks_is_still_a_mass_silence() -> None:
    """The same shape cut off from the detector at once (a partition) is one mass
    silence: held, not three ranks and a node judged one by one."""
    det, clock = make(worker_floor_s=0.5, node_floor_s=0.75)
    nodes = [SimNode(det, clock, k, random.Random(k), ranks=2, rank_interval=1.0) for k in range(3)]
    assert drive(clock, det, nodes, 6.0) == []
    for n in nodes[:2]:
        n.silent = True
    drive(clock, det, nodes, 3.0)
    assert det.stats.mass_holds == 1


def test_digest_ignores_repeats_and_a_replaced_launcher_takes_over() -> None:
    det, clock = make()
    node = SimNode(det, clock, 0, random.Random(4), ranks=1)
    drive(clock, det, [node], 1.0)
    d = node._digest(clock.monotonic())
    assert det.observe_digest(d) and not det.observe_digest(d)  # a repeat
    restarted = d.model_copy(update={"launcher": "L0b", "seq": 0, "entries": []})
    assert det.observe_digest(restarted)
    assert list(det.nodes()) == [("j1", "n0", "L0b")]
    assert not det.observe_digest(d.model_copy(update={"seq": d.seq + 1}))  # the old launcher is gone


def test_a_worker_the_launcher_forgot_is_not_declared_silent_but_its_exit_still_counts() -> None:
    det, clock = make()
    node = SimNode(det, clock, 0, random.Random(5), ranks=3)
    assert drive(clock, det, [node], 2.0) == []
    # w1's process ended without a goodbye (terminated, or killed): the launcher drops it
    node.frozen.add(1)
    node.heard[1] = None
    assert drive(clock, det, [node], 3.0) == []
    assert len(det) == 2
    # the launcher's exit report still makes the verdict
    exited = RankExited(job="j1", worker=node.worker(1), pid=node.pid(1), host="h0", signal=9, exited_at=1.0)
    incident = det.on_exit(exited)
    assert incident is not None and incident.cause is FaultCause.PROCESS_EXIT


# -- the service's fast digest reader --------------------------------------------------
_ODD_VALUES: list[object] = [
    None, True, False, 0, 1, -1, -2, 2**63, 2**64 - 1, -(2**63), 0.0, -0.0, 1.5, -1.5,
    math.nan, math.inf, -math.inf, "", "x", "a" * 65, "bad name", "a\n", "é", b"n0", [], {}, [1], {"a": 1},
]  # fmt: skip


def _valid_digest() -> dict[str, object]:
    entry = DigestEntry(
        worker="n0-w0", pid=7, seq=3, rank=0, generation=1, step=3, step_ms=50.0,
        phase=Phase.COMPUTE, phase_ms=1.0, age_ms=2.0, interval_ms=100.0,
    )  # fmt: skip
    d = NodeDigest(
        job="j1", node="n0", launcher="L0", host="h0", seq=5, interval_ms=100.0, entries=[entry, entry]
    )
    return d.model_dump(mode="json")


def _mutants(rng: random.Random) -> list[dict[str, object]]:
    """Digests with one field (of the digest or of an entry) broken: every odd value,
    a missing field, an unknown one."""
    out = []
    base = _valid_digest()
    entry = base["entries"][0]  # type: ignore[index]
    for name in [*base, "extra"]:
        for value in [*_ODD_VALUES, "missing"]:
            d = dict(base)
            if value == "missing":
                d.pop(name, None)
            else:
                d[name] = value
            out.append(d)
    for name in [*entry, "extra"]:  # type: ignore[union-attr]
        for value in [*_ODD_VALUES, "missing", "done", "Compute", "collective"]:
            e = dict(entry)  # type: ignore[call-overload]
            if value == "missing":
                e.pop(name, None)
            else:
                e[name] = value
            d = dict(base)
            d["entries"] = [entry, e] if rng.random() < 0.5 else [e]
            out.append(d)
    out += [dict(base, entries=[1]), dict(base, entries=[[]]), dict(base, entries=[None])]
    return out


def _as_read(d: NodeDigest) -> tuple[object, ...]:
    from phalanx.services.failure_detector.digests import digest_row

    return (d.job, d.node, d.launcher, d.host, d.seq, d.interval_ms, [digest_row(e) for e in d.entries])


def _same(a: object, b: object) -> bool:
    """Equal, with the same types all the way down (1 == 1.0 is not enough), NaN equal to itself."""
    if type(a) is not type(b):
        return False
    if isinstance(a, tuple | list):
        assert isinstance(b, tuple | list)
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a):
        return math.isnan(b)
    return a == b


def test_read_digest_takes_only_what_decode_takes_and_reads_it_the_same() -> None:
    """The fast path (wire.read_digest) may pass a digest to decode() but never take
    one decode() refuses, nor read one differently."""
    import msgpack
    from phalanx.services.failure_detector.wire import read_digest

    from phalanx.contract import DecodeError, headers_for

    headers = headers_for(NodeDigest)
    payloads = [(msgpack.packb(d, use_bin_type=True), headers) for d in _mutants(random.Random(7))]
    valid = msgpack.packb(_valid_digest(), use_bin_type=True)
    payloads += [
        (valid, {**headers, "Phalanx-Schema": "99"}),
        (valid, {**headers, "Phalanx-Kind": "heartbeat"}),
        (valid, {**headers, "Phalanx-Encoding": "json"}),
        (valid, {}),
        (valid, None),
        (valid[:-3], headers),
        (b"\xc1", headers),
        (msgpack.packb([1, 2]), headers),
    ]
    taken = refused = 0
    for data, hdrs in payloads:
        fast = read_digest(data, hdrs)
        try:
            model: NodeDigest | None = decode(data, hdrs, NodeDigest)
        except DecodeError:
            model = None
        refused += model is None
        if fast is not None:
            taken += 1
            assert model is not None, f"read_digest took what decode refuses: {msgpack.unpackb(data)!r}"
            assert _same(fast, _as_read(model))
    assert read_digest(valid, headers) is not None
    assert taken > 50 and refused > 300


def test_digest_rows_from_the_wire_make_the_same_verdicts_as_models() -> None:
    from phalanx.services.failure_detector.wire import read_digest

    runs = []
    for fast in (False, True):
        det, clock = make()
        rng = random.Random(11)
        nodes = [SimNode(det, clock, k, rng, jitter=0.5 * I) for k in range(3)]
        if fast:
            for n in nodes:
                n.observe = lambda d, det=det: det.observe_digest_rows(*read_digest(*encode(d)))  # type: ignore[misc]
        out = drive(clock, det, nodes, 2.0)
        nodes[0].frozen.add(3)  # a hung rank in a live node
        nodes[1].silent = True  # a lost node
        out += drive(clock, det, nodes, 3.0)
        runs.append([(at, v.id, v.fault_at, sorted(v.evidence.items())) for at, v in out])
    assert len(runs[0]) == 2 and runs[0] == runs[1]


def test_bench_simulator_sends_what_a_launcher_encodes() -> None:
    """bench.detect builds its simulated digests from pre-packed fragments: the bytes
    must be those of a launcher's encode() of the same NodeDigest, and read the same."""
    from bench.detect import _check_payload

    _check_payload()


# -- inputs checked: registered pid, sequence bound, resync --------------------------------
def _registered(worker: str = "w0", pid: int = 100, job: str = "j1"):  # type: ignore[no-untyped-def]
    from phalanx.contract import Registered, Role

    return Registered(job=job, worker=worker, role=Role.RANK, host="h1", pid=pid)


def _forged(r: Rank, **changes: object) -> Heartbeat:
    """The heartbeat ``r`` would send next, with ``changes`` (a forger's copy of it)."""
    fields: dict[str, object] = dict(
        job=r.job, worker=r.worker, rank=r.rank, generation=r.generation, step=r.step,
        step_ms=r.step_ms, phase=r.phase, phase_ms=0.0, seq=r.seq, pid=r.pid, host="h1",
        interval_ms=r.interval * 1e3, ts=r.clock.wall(),
    )  # fmt: skip
    fields.update(changes)
    return Heartbeat.model_validate(fields)


def _state(det: Detector, worker: str = "w0", job: str = "j1") -> dict[str, object]:
    """What only input changes in a tracked worker (not the passing of time)."""
    snap = det.snapshot(job, worker)
    assert snap is not None
    keys = ("pid", "rank", "generation", "last_seq", "samples", "mean_ms", "std_ms", "phase", "step")
    return {k: snap[k] for k in keys}


def _stats_but(det: Detector, *counters: str) -> dict[str, int]:
    return {k: v for k, v in vars(det.stats).items() if k not in counters}


def test_a_forged_heartbeat_with_a_huge_seq_is_refused_and_the_rank_is_not_declared_lost() -> None:
    """The reviewer's case: one heartbeat with the victim's pid and a huge seq made every
    real heartbeat after it stale, and the rank was declared lost 0.3 s later."""
    det, clock = make()
    r = Rank(det, clock)
    run(clock, det, [r], 2.0)
    before, stats = _state(det), _stats_but(det, "refused_seq")
    assert not det.observe(_forged(r, seq=r.seq + 1_000_000))
    [refusal] = det.take_refused()
    assert (refusal.kind, refusal.worker, refusal.pid, refusal.seq) == ("seq", "w0", 100, r.seq + 1_000_000)
    assert "past" in refusal.reason and det.stats.refused_seq == 1
    assert _state(det) == before and _stats_but(det, "refused_seq") == stats  # it changed nothing
    assert run(clock, det, [r], 3.0) == []  # the real heartbeats still count
    assert det.take_refused() == []


def test_heartbeats_from_a_pid_other_than_the_registered_one_are_refused() -> None:
    det, clock = make()
    r = Rank(det, clock, pid=100)
    assert det.register(_registered(pid=100)) == ("new", None)
    run(clock, det, [r], 2.0)
    before, stats = _state(det), _stats_but(det, "refused_pid")
    forger = Rank(det, clock, pid=999)
    forger.seq = r.seq
    assert not forger.beat()
    forger.enter(Phase.DONE)
    assert not forger.beat()  # a forged goodbye does not make the detector forget the rank
    refused = det.take_refused()
    assert [(x.kind, x.pid) for x in refused] == [("pid", 999), ("pid", 999)]
    assert "registered pid is 100" in refused[0].reason
    assert _state(det) == before and _stats_but(det, "refused_pid") == stats
    assert det.stats.refused_pid == 2 and not det.is_closed("j1", "w0", 999)
    assert run(clock, det, [r], 2.0) == [] and _state(det)["pid"] == 100
    assert det.snapshot("j1", "w0")["registered"]  # type: ignore[index]


def test_a_new_pid_is_taken_only_after_it_registers_and_the_old_exit_still_counts() -> None:
    det, clock = make()
    old = Rank(det, clock, pid=100)
    det.register(_registered(pid=100))
    run(clock, det, [old], 1.0)
    new = Rank(det, clock, pid=200)
    assert not new.beat()  # heard before its registration: refused
    assert _state(det)["pid"] == 100
    assert det.register(_registered(pid=200)) == ("replaced", 100)  # a restart registers
    assert det.snapshot("j1", "w0") is None  # the old incarnation is dropped without a verdict
    assert not old.beat()
    inc = det.on_exit(exit_msg(pid=100, sig=9, code=None))
    assert inc is not None and inc.id == "j1:w0:100"  # ...and its exit report still makes one
    assert new.beat() and _state(det)["pid"] == 200
    assert run(clock, det, [new], 2.0) == []
    assert (det.stats.displaced, det.stats.refused_pid, det.stats.registrations) == (1, 2, 2)
    assert det.register(_registered(pid=100)) == ("stale", None)  # a closed incarnation registers nothing
    assert _state(det)["pid"] == 200 and det.registered_pid("j1", "w0") == 200


def test_a_worker_heard_before_it_registered_is_provisional_and_its_registration_wins() -> None:
    det, clock = make()
    early = Rank(det, clock, pid=999)  # e.g. a forger that guessed the worker's name
    assert early.beat()  # no registration yet: tracked, provisionally
    assert not det.snapshot("j1", "w0")["registered"]  # type: ignore[index]
    assert det.register(_registered(pid=100)) == ("new", 999)
    assert det.snapshot("j1", "w0") is None
    real = Rank(det, clock, pid=100)
    assert run(clock, det, [real], 2.0) == []
    assert not early.beat() and _state(det)["pid"] == 100
    clock.advance(5.0)
    assert [v.id for v in det.tick()] == ["j1:w0:100"]  # never one for the dropped pid 999


def test_a_forged_jump_within_the_bound_blinds_no_longer_than_the_next_real_heartbeat() -> None:
    det, clock = make()
    r = Rank(det, clock)
    run(clock, det, [r], 2.0)
    r.beat()
    clock.advance(0.2 * I)
    assert det.observe(_forged(r, seq=r.seq + 3))  # within the bound: taken...
    clock.advance(0.8 * I)
    assert r.beat()  # ...but the real sender's next one is not stale: the sequence follows it again
    assert det.stats.seq_resyncs == 1 and _state(det)["last_seq"] == r.seq - 1
    assert run(clock, det, [r], 3.0) == []
    # a forged *first* heartbeat (a restarted detector hears it first) does not set the sequence for good
    det, clock = make()
    r = Rank(det, clock)
    r.seq = 50
    assert det.observe(_forged(r, seq=10**9))
    clock.advance(0.2 * I)
    assert r.beat() and _state(det)["last_seq"] == 50  # below the first one heard: a resync
    assert not det.observe(_forged(r, seq=10**9 + 1))  # now beyond the bound
    assert run(clock, det, [r], 3.0) == []


def test_the_sequence_bound_follows_the_time_since_the_last_heartbeat() -> None:
    det, clock = make()  # seq_slack 5, seq_rate 2
    r = Rank(det, clock)
    run(clock, det, [r], 2.0)
    r.seq += 29  # 29 heartbeats lost on the way: their time has passed too
    clock.advance(30 * I)
    assert r.beat()
    clock.advance(I)
    r.seq += 20  # 21 in one interval: more than 5 + 2 x 1
    assert not r.beat() and det.stats.refused_seq == 1
    det.hold(clock.monotonic() + 1.0)  # while the detector holds, time says nothing: no bound
    assert r.beat()
    assert [x.kind for x in det.take_refused()] == ["seq"]


def test_forged_digest_entries_and_digests_are_refused_and_change_nothing() -> None:
    det, clock = make()
    rng = random.Random(5)
    nodes = [SimNode(det, clock, k, rng) for k in range(3)]
    drive(clock, det, nodes, 2.0)
    n0 = nodes[0]
    worker = n0.worker(0)
    det.register(_registered(worker, n0.pid(0)))
    before, stats_digests = _state(det, worker), det.stats.digests
    nodes_before = det.node_snapshot("j1", "n0")
    real = n0._digest(clock.monotonic())
    forged = {"pid": 4242, "seq": real.entries[0].seq + 1}
    entries = [e.model_copy(update=forged) if e.worker == worker else e for e in real.entries]
    assert det.observe_digest(real.model_copy(update={"entries": entries}))  # the node is heard...
    [refusal] = det.take_refused()  # ...the entry of another pid is not
    assert (refusal.kind, refusal.worker, refusal.pid) == ("pid", worker, 4242)
    assert _state(det, worker) == before
    huge = real.model_copy(update={"seq": real.seq + 1_000_000})
    assert not det.observe_digest(huge)  # a digest far ahead of its launcher's sequence
    [refusal] = det.take_refused()
    assert (refusal.kind, refusal.worker) == ("seq", "node:n0")
    assert det.node_snapshot("j1", "n0")["last_seq"] == real.seq  # type: ignore[index]
    assert nodes_before is not None and nodes_before["last_seq"] == real.seq - 1
    assert (det.stats.refused_pid, det.stats.refused_seq, det.stats.digests) == (1, 1, 1 + stats_digests)
    assert drive(clock, det, nodes, 3.0) == []  # nobody lost: not the node, not its workers
    assert len(det) == 24


def test_a_gap_the_detector_took_late_is_no_forgers_jump() -> None:
    """A detector working through a backlog takes a node's digests seconds after they
    were sent, and the server drops some of them to it as a slow consumer: the next one
    it takes is far ahead after a second of its own time (16,384 ranks on this box: 22
    ahead after 1.3 s, refused, and the node deaf for seconds). Counted from when it was
    sent, that is the node's own pace: taken. The same jump sent just now is refused."""
    det, clock = make()
    rng = random.Random(11)
    nodes = [SimNode(det, clock, k, rng) for k in range(2)]
    drive(clock, det, nodes, 2.0)
    n0 = nodes[0]
    real = n0._digest(clock.monotonic()).model_copy(update={"ts": clock.wall()})
    assert det.observe_digest(real)
    clock.advance(1.0)  # the bound after a second: 5 + 2 x 1.0 / 0.1 = 25 ahead
    fresh = real.model_copy(update={"seq": real.seq + 40, "ts": clock.wall()})
    assert not det.observe_digest(fresh)
    [refusal] = det.take_refused()
    assert (refusal.kind, refusal.worker) == ("seq", "node:n0")
    late = fresh.model_copy(update={"ts": clock.wall() - 11.0})  # sent 11 s ago
    assert det.observe_digest(late)
    assert det.take_refused() == [] and det.node_snapshot("j1", "n0")["last_seq"] == real.seq + 40  # type: ignore[index]


def test_a_launcher_speaks_only_for_the_workers_of_its_node() -> None:
    """Once the planner placed a worker (assign), another node's digest entries and exit
    reports about it are refused: a forged goodbye or crash changes nothing."""
    det, clock = make()
    rng = random.Random(7)
    nodes = [SimNode(det, clock, k, rng) for k in range(2)]
    drive(clock, det, nodes, 2.0)
    n0, n1 = nodes
    victim = n0.worker(0)
    for n in nodes:
        det.assign("j1", n.node, [n.worker(j) for j in range(8)])
    before = _state(det, victim)
    real = n1._digest(clock.monotonic())
    goodbye = real.entries[0].model_copy(update={"worker": victim, "pid": n0.pid(0), "phase": Phase.DONE})
    assert det.observe_digest(real.model_copy(update={"entries": [*real.entries, goodbye]}))  # n1 is heard
    [refusal] = det.take_refused()  # ... but not about n0's worker
    assert (refusal.kind, refusal.worker) == ("node", victim) and "runs on n0" in refusal.reason
    assert _state(det, victim) == before and ("j1", victim, n0.pid(0)) in set(det.tracked())
    forged = exit_msg(victim, pid=n0.pid(0), sig=9, code=None).model_copy(update={"node": "n1"})
    assert det.on_exit(forged) is None
    [refusal] = det.take_refused()
    assert refusal.kind == "node" and det.stats.refused_node == 2
    assert drive(clock, det, nodes, 2.0) == []  # nobody judged
    own = forged.model_copy(update={"node": "n0"})  # its own launcher: heard
    failed = det.on_exit(own)
    assert failed is not None and failed.worker == victim and det.take_refused() == []


# -- mass silence --------------------------------------------------------------------------
def test_a_mass_silence_is_held_and_nothing_is_published_when_the_ranks_come_back() -> None:
    det, clock = make(mass_hold_s=2.0)
    ranks = [Rank(det, clock, f"w{i}", rank=i, pid=10 + i) for i in range(4)]
    run(clock, det, ranks, 2.0)
    assert run(clock, det, ranks[:1], 1.0) == []  # w1..w3 cut off from NATS together
    [hold] = det.take_mass_holds()
    assert (hold.job, hold.workers, hold.nodes, hold.tracked_workers) == ("j1", 3, 0, 4)
    assert hold.until - hold.started == pytest.approx(2.0) and len(det) == 4
    assert run(clock, det, ranks, 4.0) == []  # back within the hold: no verdict, ever
    assert len(det) == 4 and det.stats.mass_holds == 1 and det.stats.mass_held == 0


def test_a_mass_silence_that_persists_is_judged_after_the_hold_and_exits_are_never_held() -> None:
    det, clock = make(mass_hold_s=2.0)
    ranks = [Rank(det, clock, f"w{i}", rank=i, pid=10 + i) for i in range(4)]
    run(clock, det, ranks, 2.0)
    assert run(clock, det, ranks[:1], 1.5) == []
    assert det.mass_hold("j1") is not None and det.stats.mass_holds == 1
    failed = det.on_exit(exit_msg("w0", pid=10, sig=9, code=None))  # a real death, seen by the launcher
    assert failed is not None and failed.cause is FaultCause.PROCESS_EXIT
    out = run(clock, det, [], 1.0)
    assert sorted(v.worker for v in out) == ["w1", "w2", "w3"]
    for v in out:
        assert v.cause is FaultCause.HEARTBEAT_LOST and v.evidence["mass_silence"] is True
        assert v.evidence["mass_hold_ms"] == 2000.0 and v.evidence["mass_silent_workers"] == 3
        assert v.evidence["elapsed_ms"] >= 2000.0  # not before the hold ended
        ev = v.to_event()
        assert decode(*encode(ev)) == ev  # every evidence value survives the wire
    assert det.stats.mass_held == 3 and len(det) == 0


def test_the_mass_rule_is_per_job_and_needs_half_of_it_and_two() -> None:
    det, clock = make(mass_hold_s=2.0)
    a = [Rank(det, clock, f"w{i}", rank=i, pid=10 + i) for i in range(5)]
    b = [Rank(det, clock, f"v{i}", rank=i, pid=20 + i, job="j2") for i in range(2)]
    c = [Rank(det, clock, f"u{i}", rank=i, pid=30 + i, job="j3") for i in range(2)]
    run(clock, det, a + b + c, 2.0)
    out = run(clock, det, a[2:] + c[1:], 1.0)  # j1: 2 of 5 silent; j2: 2 of 2; j3: 1 of 2
    assert sorted(v.worker for v in out) == ["u0", "w0", "w1"]  # judged at once
    assert all("mass_silence" not in v.evidence for v in out)
    [hold] = det.take_mass_holds()
    assert (hold.job, hold.workers, hold.tracked_workers) == ("j2", 2, 2)
    out = run(clock, det, a[2:] + c[1:], 2.0)
    assert sorted(v.worker for v in out) == ["v0", "v1"] and all(v.evidence["mass_silence"] for v in out)


def test_half_the_nodes_of_a_job_silent_at_once_are_held() -> None:
    det, clock = make(mass_hold_s=2.0)
    rng = random.Random(9)
    nodes = [SimNode(det, clock, k, rng) for k in range(4)]
    drive(clock, det, nodes, 2.0)
    nodes[1].silent = nodes[2].silent = True
    assert drive(clock, det, nodes, 1.0) == []
    [hold] = det.take_mass_holds()
    assert (hold.nodes, hold.tracked_nodes, hold.workers, hold.tracked_workers) == (2, 4, 16, 32)
    nodes[1].silent = False  # n1 comes back, n2 does not
    out = drive(clock, det, nodes, 3.0)
    [(_, lost)] = out
    assert isinstance(lost, NodeIncident) and lost.node == "n2" and lost.evidence["mass_silence"] is True
    assert len(det) == 24 and sorted(n for _, n, _ in det.nodes()) == ["n0", "n1", "n3"]


def test_a_held_node_is_judged_when_its_launcher_is_gone_and_never_while_it_answers() -> None:
    """Five nodes of seven fall silent together (a stalled bus, as the detector sees it).
    Asking their launchers decides: "no responders" for 3 s, or another launcher
    answering for the node, judges it at once; "no responders" for 2.5 s and then an
    answer (a launcher reconnecting) judges nothing; one that answers is not judged while it does; one that
    does not answer waits for the backstop. A hold's silence is not learned."""
    det, clock = make(mass_hold_s=10.0, mass_probe_s=0.5)
    rng = random.Random(4)
    nodes = [SimNode(det, clock, k, rng, ranks=2) for k in range(7)]
    drive(clock, det, nodes, 2.0)
    mean_before = det.node_snapshot("j1", "n2")["mean_ms"]  # type: ignore[index]
    for n in nodes[1:6]:
        n.silent = True
    answers: dict[str, Probe | list[Probe]] = {
        "n1": Probe.GONE,
        "n2": Probe.ALIVE,
        "n3": Probe.SILENT,
        "n4": Probe.REPLACED,
        "n5": [Probe.GONE] * 5 + [Probe.ALIVE],  # reconnecting for 2.5 s: no verdict
    }
    early = drive(clock, det, nodes, 5.0, answers=answers)
    [hold] = det.take_mass_holds()
    assert (hold.nodes, hold.tracked_nodes) == (5, 7)
    judged = {v.node: v for _, v in early}
    assert sorted(judged) == ["n1", "n4"], judged
    assert judged["n1"].evidence["mass_confirmed"] == "no_responders"
    assert judged["n4"].evidence["mass_confirmed"] == "another_launcher"
    assert float(judged["n4"].evidence["elapsed_ms"]) < 2000.0  # at once, not the hold's 10 s
    assert 3000.0 < float(judged["n1"].evidence["elapsed_ms"]) < 5000.0  # no responders for RECONNECT_S
    late = drive(clock, det, nodes, 7.0, answers=answers)
    [(_, n3)] = late  # past the backstop: the one that never answered
    assert n3.node == "n3" and n3.evidence["mass_confirmed"] == "hold_elapsed"
    assert isinstance(n3, NodeIncident) and n3.evidence["mass_probe"] == "no_answer"
    nodes[2].silent = nodes[5].silent = False  # their digests come back: nothing, and 7 s not learned
    assert drive(clock, det, nodes, 1.0, answers=answers) == []
    assert det.node_snapshot("j1", "n2")["mean_ms"] == pytest.approx(mean_before, rel=0.2)  # type: ignore[index]
    assert det.stats.mass_probes > 10 and sorted(n for _, n, _ in det.nodes()) == ["n0", "n2", "n5", "n6"]


def test_a_survivors_failed_collective_ends_a_mass_hold_and_an_older_one_does_not() -> None:
    det, clock = make(mass_hold_s=30.0)
    ranks = [Rank(det, clock, f"w{i}", rank=i, pid=10 + i) for i in range(4)]
    run(clock, det, ranks, 2.0)
    before = clock.wall() - 5.0  # a failed collective from before the silence began

    def failed(worker: str, ts: float) -> CollectiveError:
        return CollectiveError(
            job="j1", worker=worker, rank=0, generation=1, step=7, error="peer gone", ts=ts
        )

    det.collective_error(failed("w0", before))  # (heard before the hold: it does not start confirmed)
    assert run(clock, det, ranks[:1], 1.0) == []  # w1..w3 silent together: held
    det.collective_error(failed("w0", before))
    assert run(clock, det, ranks[:1], 1.0) == []  # still held
    det.collective_error(failed("w0", clock.wall()))  # w0's all-reduce with them failed just now
    out = run(clock, det, ranks[:1], 0.05)
    assert sorted(v.worker for v in out) == ["w1", "w2", "w3"]
    for v in out:
        assert v.evidence["mass_confirmed"] == "collective_error:w0" and v.evidence["mass_hold_ms"] < 2000.0
    assert det.stats.mass_confirmed == 1


def test_service_config_replica_and_mass_hold_from_env(monkeypatch: pytest.MonkeyPatch) -> None:
    d = ServiceConfig.from_settings()
    assert (d.replica, d.durable("exits"), d.detector.mass_hold_s) == ("", "failure-detector-exits", 120.0)
    c = _config_from(monkeypatch, {"PHALANX_DETECTOR_REPLICA": "b-2", "PHALANX_DETECTOR_MASS_HOLD_S": "0"})
    assert c.replica == "b-2" and c.detector.mass_hold_s == 0.0
    assert [c.durable(x) for x in ("exits", "plans", "registrations")] == [
        "failure-detector-exits-b-2",
        "failure-detector-plans-b-2",
        "failure-detector-registrations-b-2",
    ]
    for bad in ("a.b", "a b", "*", "x" * 33):
        with pytest.raises(ValueError, match="PHALANX_DETECTOR_REPLICA"):
            _config_from(monkeypatch, {"PHALANX_DETECTOR_REPLICA": bad})
    monkeypatch.setenv("PHALANX_DETECTOR_REPLICA", "b-2")
    with pytest.raises(ValueError, match="PHALANX_DETECTOR_MASS_HOLD_S"):
        _config_from(monkeypatch, {"PHALANX_DETECTOR_MASS_HOLD_S": "-1"})
