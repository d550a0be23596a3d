"""The failure-detection algorithm on a fake clock: phi, deadlines, holds, stalls,
incarnations, exits and plans. No bus here; see tests/integration/test_detector_service.py."""

from __future__ import annotations

import doctest
import itertools
import math
import random

import pytest
from phalanx.services.failure_detector.detector import (
    PHI_CAP,
    Detector,
    DetectorConfig,
    FakeClock,
    Incident,
    IntervalWindow,
    NodeIncident,
    incident_id,
    node_incident_id,
    phi,
    phi_threshold_z,
)
from phalanx.services.failure_detector.service import ServiceConfig

from phalanx.schemas import (
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

    def enter(self, phase: Phase) -> None:
        self.phase, self.phase_since = phase, self.clock.monotonic()

    def complete_step(self, step_ms: float) -> None:
        self.step += 1
        self.step_ms = step_ms

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
            ts=self.clock.wall(),
        )
        self.seq += 1
        return self.det.observe(hb)


def make(**cfg: float) -> tuple[Detector, FakeClock]:
    clock = FakeClock()
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
        max_heap = max(max_heap, len(det._heap))
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
    import phalanx.services.failure_detector.service as service_module

    for module in (detector_module, service_module):
        result = doctest.testmod(module)
        assert result.failed == 0 and result.attempted > 0, module.__name__


def test_service_config_from_env() -> None:
    c = ServiceConfig.from_env(
        {
            "PHALANX_HEARTBEAT_MS": "500",
            "PHALANX_STALL_FLOOR_MS": "1500",
            "PHALANX_DETECTOR_PHI": "10",
            "PHALANX_DETECTOR_JOB": "j1",
        }
    )
    assert (c.heartbeat_s, c.tick_s, c.max_lag_s, c.job) == (0.5, 0.05, 0.25, "j1")
    assert c.detector.stall_floor_s == 1.5 and c.detector.phi_threshold == 10.0
    with pytest.raises(ValueError, match="PHALANX_HEARTBEAT_MS"):
        ServiceConfig.from_env({"PHALANX_HEARTBEAT_MS": "fast"})
    with pytest.raises(ValueError):
        ServiceConfig.from_env({"PHALANX_DETECTOR_JOB": "a.b"})


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


def drive(clock: FakeClock, det: Detector, nodes: list[SimNode], seconds: float, dt: float = 0.005) -> list:
    """Advance time in small steps; nodes beat and digest; returns (time, verdict) pairs."""
    out = []
    end = clock.monotonic() + seconds
    while clock.monotonic() < end - 1e-9:
        for n in nodes:
            n.advance(clock.monotonic())
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
    from phalanx.services.failure_detector.detector import digest_row

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

    from phalanx.schemas import DecodeError, headers_for

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
