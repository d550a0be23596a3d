"""The failure-detector service against a real nats-server.

Ranks are simulated in this process with the real runtime pieces
(:class:`RankStatus` + :class:`HeartbeatPublisher`), or are real OS processes
(tests/workers/heartbeat_worker.py). Absence of an event is asserted after a
causal barrier (a later incident that must come after it, or the detector's own
state showing it has looked long enough), never after a bare sleep.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any, ClassVar

import pytest
from nats.aio.msg import Msg
from opentelemetry import trace
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from phalanx.services.failure_detector import DetectorConfig, FailureDetector, ServiceConfig

from phalanx.bus import Bus
from phalanx.contract import (
    ErrorEvent,
    FaultCause,
    Heartbeat,
    Member,
    Message,
    Phase,
    Plan,
    RankExited,
    RankFailed,
    RankHung,
    decode,
    encode,
)
from phalanx.contract.subjects import EXITED, HEARTBEAT, PLAN
from phalanx.devstack.natsserver import NatsServer
from phalanx.service import ping
from phalanx.telemetry import extract_context, setup_tracing
from phalanx.worker.heartbeat import HeartbeatPublisher
from phalanx.worker.status import RankStatus

ROOT = Path(__file__).resolve().parents[2]
WORKER = ROOT / "tests" / "workers" / "heartbeat_worker.py"
INTERVAL = 0.1
STALL_FLOOR = 0.6
FAST = ServiceConfig.for_interval(
    INTERVAL, detector=DetectorConfig(stall_floor_s=STALL_FLOOR, stall_initial_s=STALL_FLOOR)
)
WAIT = 20.0  # generous bound for an expected event; never reached when things work


# -- helpers -------------------------------------------------------------------------
async def wait_until(pred: Callable[[], bool], timeout: float = WAIT, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.01)


class Events:
    """Every verdict and error event seen on core NATS, with their headers."""

    def __init__(self) -> None:
        self.items: list[tuple[Message, dict[str, str]]] = []

    async def attach(self, bus: Bus) -> None:
        async def cb(raw: Msg) -> None:
            self.items.append((decode(raw.data, raw.headers), dict(raw.headers or {})))

        for subject in ("phalanx.evt.*.failed", "phalanx.evt.*.hung", "phalanx.err.failure-detector"):
            await bus.nc.subscribe(subject, cb=cb)
        await bus.flush()

    def verdicts(self, worker: str | None = None) -> list[RankFailed | RankHung]:
        return [
            m
            for m, _ in self.items
            if isinstance(m, RankFailed | RankHung) and (worker is None or m.worker == worker)
        ]

    def errors(self) -> list[ErrorEvent]:
        return [m for m, _ in self.items if isinstance(m, ErrorEvent)]

    async def one(self, worker: str, what: str = "verdict") -> RankFailed | RankHung:
        await wait_until(lambda: bool(self.verdicts(worker)), what=f"{what} for {worker}")
        return self.verdicts(worker)[0]


class SimRank:
    """A rank inside the test process: real RankStatus and HeartbeatPublisher, a fake pid."""

    live: ClassVar[set[SimRank]] = set()

    def __init__(
        self,
        bus: Bus,
        worker: str,
        *,
        rank: int = 0,
        pid: int,
        job: str = "j1",
        phase: Phase = Phase.COLLECTIVE,
        interval: float = INTERVAL,
    ) -> None:
        self.status = RankStatus(job=job, worker=worker, rank=rank, generation=1, pid=pid, host="sim")
        self.status.enter(phase)
        self.publisher = HeartbeatPublisher(bus, self.status, interval)
        self._beat = asyncio.create_task(self.publisher.run())
        self._train: asyncio.Task[None] | None = None
        SimRank.live.add(self)

    def train(self, step_s: float = 0.05) -> None:
        async def loop() -> None:
            while True:
                t0 = time.monotonic()
                self.status.enter(Phase.COMPUTE)
                await asyncio.sleep(step_s * 0.8)
                self.status.enter(Phase.COLLECTIVE)
                await asyncio.sleep(step_s * 0.2)
                self.status.step_ms = (time.monotonic() - t0) * 1e3
                self.status.step += 1

        self._train = asyncio.create_task(loop())

    def stick(self, phase: Phase) -> None:
        """Stop training and stay in ``phase`` (heartbeats go on)."""
        if self._train is not None:
            self._train.cancel()
        self.status.enter(phase)

    def silence(self) -> None:
        self._beat.cancel()
        if self._train is not None:
            self._train.cancel()
        SimRank.live.discard(self)

    def resume(self) -> None:
        """Heartbeat again after :meth:`silence`, the sequence going on (a partition healed)."""
        self._beat = asyncio.create_task(self.publisher.run())
        SimRank.live.add(self)


@pytest.fixture(autouse=True)
def _silence_sim_ranks() -> Iterator[None]:
    yield
    for r in list(SimRank.live):
        r.silence()


def exited(
    worker: str, pid: int, *, code: int | None = None, sig: int | None = 9, job: str = "j1"
) -> RankExited:
    return RankExited(
        job=job, worker=worker, pid=pid, host="sim", exit_code=code, signal=sig, exited_at=time.time()
    )


async def publish_exit(bus: Bus, ev: RankExited, msg_id: str) -> None:
    await bus.publish(EXITED, ev, job=ev.job, msg_id=msg_id)


def tracked(svc: FailureDetector) -> set[str]:
    return {w for _, w, _ in svc.detector.tracked()}


@contextlib.asynccontextmanager
async def running_detector(url: str, config: ServiceConfig = FAST) -> AsyncIterator[FailureDetector]:
    bus = await Bus.connect(url, name="failure-detector")
    svc = FailureDetector(bus, config)
    await svc.serve_health()
    await svc.start()
    try:
        yield svc
    finally:
        await svc.stop()
        await bus.close()


@pytest.fixture
async def detector(nats_url: str) -> AsyncIterator[FailureDetector]:
    async with running_detector(nats_url) as svc:
        yield svc


@pytest.fixture
async def events(bus: Bus) -> Events:
    ev = Events()
    await ev.attach(bus)
    return ev


@pytest.fixture
def spans() -> InMemorySpanExporter:
    """Spans finished in this process from now on (added beside whatever exporter is set)."""
    exporter = InMemorySpanExporter()
    setup_tracing("tests").add_span_processor(SimpleSpanProcessor(exporter))
    return exporter


async def stored(bus: Bus, subject: str) -> list[Message]:
    """Every message JetStream holds on ``subject`` (the durable truth, not what we heard)."""
    info = await bus.js.stream_info("PHALANX_EVT", subjects_filter=subject)
    count = sum((info.state.subjects or {}).values())
    if count == 0:
        return []
    sub = await bus.js.pull_subscribe(subject, stream="PHALANX_EVT")
    out: list[Message] = []
    while len(out) < count:
        out += [decode(m.data, m.headers) for m in await sub.fetch(count - len(out), timeout=5)]
    await sub.unsubscribe()
    return out


# -- heartbeat loss ------------------------------------------------------------------
async def test_silent_rank_is_reported_hung_once_in_a_new_trace(
    detector: FailureDetector, bus: Bus, events: Events, spans: InMemorySpanExporter
) -> None:
    ranks = {w: SimRank(bus, w, rank=i, pid=1000 + i) for i, w in enumerate(["w0", "w1", "w2"])}
    await wait_until(lambda: tracked(detector) == set(ranks), what="ranks tracked")
    await wait_until(lambda: detector.detector.snapshot("j1", "w1")["samples"] >= 10)  # type: ignore[index]
    ranks["w1"].silence()
    hung = await events.one("w1")
    assert isinstance(hung, RankHung) and hung.cause is FaultCause.HEARTBEAT_LOST
    assert (hung.incident, hung.rank, hung.generation) == ("j1:w1:1001", 1, 1)
    assert hung.evidence["phi"] >= 8.0 and hung.fault_at < hung.detected_at
    # barrier: a later silence is reported after any repeat of the first would have been
    ranks["w2"].silence()
    await events.one("w2")
    assert [v.incident for v in events.verdicts()] == ["j1:w1:1001", "j1:w2:1002"]
    assert tracked(detector) == {"w0"}

    [detect] = [
        s
        for s in spans.get_finished_spans()
        if s.name == "detect" and s.attributes and s.attributes["phalanx.incident"] == hung.incident
    ]
    assert detect.parent is None
    assert detect.start_time == int(hung.fault_at * 1e9)
    attrs = dict(detect.attributes or {})
    assert attrs["phalanx.cause"] == "heartbeat_lost" and attrs["phalanx.worker"] == "w1"
    assert attrs["phalanx.rank"] == 1 and attrs["phalanx.generation"] == 1 and attrs["phalanx.job"] == "j1"
    assert attrs["phalanx.evidence.last_seq"] == hung.evidence["last_seq"]
    headers = next(h for m, h in events.items if getattr(m, "incident", None) == hung.incident)
    event_ctx = trace.get_current_span(extract_context(headers)).get_span_context()
    assert event_ctx.trace_id == detect.context.trace_id  # the event carries the incident's trace
    ranks["w0"].silence()


# -- process exits -------------------------------------------------------------------
async def test_exit_reported_once_even_if_published_twice_and_heartbeats_stop(
    detector: FailureDetector, bus: Bus, events: Events, spans: InMemorySpanExporter
) -> None:
    ranks = {w: SimRank(bus, w, rank=i, pid=2000 + i) for i, w in enumerate(["w0", "w1", "w2", "w3"])}
    await wait_until(lambda: tracked(detector) == set(ranks), what="ranks tracked")
    # w0 is SIGKILLed: heartbeats stop and the launcher reports the exit, twice
    ranks["w0"].silence()
    ev = exited("w0", 2000)
    with trace.get_tracer("test").start_as_current_span("launcher") as launcher_span:
        await publish_exit(bus, ev, "exit-a")
    await publish_exit(bus, ev, "exit-b")  # a second report that JetStream does not de-duplicate
    failed = await events.one("w0")
    assert isinstance(failed, RankFailed) and failed.cause is FaultCause.PROCESS_EXIT
    assert failed.fault_at == ev.exited_at and failed.evidence["signal"] == 9
    # w3 exits cleanly: no event, forgotten
    ranks["w3"].silence()
    await publish_exit(bus, exited("w3", 2003, code=0, sig=None), "exit-c")
    # barrier 1: w1 falls silent after w0 and w3 did, so once w1 is reported, a
    # heartbeat_lost verdict for w0 or w3 would have come too
    ranks["w1"].silence()
    await events.one("w1")
    # barrier 2: the exit consumer is ordered; w2's exit comes after the duplicates
    ranks["w2"].silence()
    await publish_exit(bus, exited("w2", 2002, code=3, sig=None), "exit-d")
    await wait_until(lambda: any(isinstance(v, RankFailed) for v in events.verdicts("w2")))
    assert [(v.worker, v.cause) for v in events.verdicts()] == [
        ("w0", FaultCause.PROCESS_EXIT),
        ("w1", FaultCause.HEARTBEAT_LOST),
        ("w2", FaultCause.PROCESS_EXIT),
    ]
    assert [m.incident for m in await stored(bus, "phalanx.evt.j1.failed")] == ["j1:w0:2000", "j1:w2:2002"]  # type: ignore[attr-defined]
    details = detector.health_details()
    assert details["clean_exits"] == 1 and details["repeated_exits"] == 1 and details["tracked_workers"] == 0
    [detect] = [
        s
        for s in spans.get_finished_spans()
        if s.name == "detect" and (s.attributes or {}).get("phalanx.incident") == "j1:w0:2000"
    ]
    assert detect.parent is None and detect.start_time == int(ev.exited_at * 1e9)
    # linked to the exit report's context (the launcher's trace), but a trace of its own
    assert [link.context.trace_id for link in detect.links] == [launcher_span.get_span_context().trace_id]
    assert detect.context.trace_id != launcher_span.get_span_context().trace_id


# -- step stall ----------------------------------------------------------------------
async def test_step_stall_is_reported_and_peers_in_collective_are_not(
    detector: FailureDetector, bus: Bus, events: Events
) -> None:
    ranks = {w: SimRank(bus, w, rank=i, pid=3000 + i) for i, w in enumerate(["w0", "w1", "w2", "w3"])}
    for r in ranks.values():
        r.train(0.05)
    await wait_until(
        lambda: all((s := detector.detector.snapshot("j1", w)) is not None and s["step"] >= 5 for w in ranks),
        what="ranks training",
    )
    ranks["w2"].stick(Phase.COMPUTE)  # stalled
    for w in ("w0", "w1", "w3"):
        ranks[w].stick(Phase.COLLECTIVE)  # waiting on w2
    hung = await events.one("w2")
    assert isinstance(hung, RankHung) and hung.cause is FaultCause.STEP_STALL
    assert hung.evidence["phase"] == "compute" and hung.evidence["bound_ms"] == STALL_FLOOR * 1e3
    assert hung.detected_at - hung.fault_at >= STALL_FLOOR
    # the victims have now waited twice the bound in COLLECTIVE, judged on every tick
    await wait_until(
        lambda: all(
            detector.detector.snapshot("j1", w)["stall_ms"] > 2e3 * STALL_FLOOR  # type: ignore[index]
            for w in ("w0", "w1", "w3")
        ),
        what="victims waiting",
    )
    assert [v.worker for v in events.verdicts()] == ["w2"]
    assert tracked(detector) == {"w0", "w1", "w3"}
    for r in ranks.values():
        r.silence()


# -- steady state ----------------------------------------------------------------------
async def test_steady_ranks_and_spares_yield_no_event(
    detector: FailureDetector, bus: Bus, events: Events
) -> None:
    ranks = [SimRank(bus, f"w{i}", rank=i, pid=4000 + i) for i in range(4)]
    for r in ranks:
        r.train(0.05)
    spare = SimRank(bus, "w9", rank=-1, pid=4009, phase=Phase.IDLE)
    await wait_until(lambda: len(tracked(detector)) == 5, what="ranks tracked")
    heartbeats = detector.detector.stats.heartbeats
    await wait_until(
        lambda: detector.detector.stats.heartbeats >= heartbeats + 5 * 30, what="3 s of heartbeats"
    )
    assert events.verdicts() == [] and len(tracked(detector)) == 5
    # barrier: the spare goes away; its verdict is the only one
    spare.silence()
    lost = await events.one("w9")
    assert lost.rank == -1 and lost.cause is FaultCause.HEARTBEAT_LOST
    assert [v.worker for v in events.verdicts()] == ["w9"]
    for r in ranks:
        r.silence()


# -- plans -----------------------------------------------------------------------------
async def test_plan_sets_rank_and_removed_worker_exit_is_expected(
    detector: FailureDetector, bus: Bus, events: Events
) -> None:
    a, b = SimRank(bus, "w0", rank=0, pid=5000), SimRank(bus, "w1", rank=1, pid=5001)
    await wait_until(lambda: tracked(detector) == {"w0", "w1"})
    plan = Plan(
        job="j1",
        generation=2,
        members=[Member(rank=0, worker="w1")],
        removed=["w0"],
        reason="shrink",
        store_prefix="j1/g2",
    )
    await bus.publish(PLAN, plan, job="j1", msg_id="plan-2")
    await wait_until(lambda: tracked(detector) == {"w1"}, what="w0 forgotten")
    a.silence()
    await publish_exit(bus, exited("w0", 5000), "exit-w0")  # the fencing SIGKILL
    b.silence()
    await publish_exit(bus, exited("w1", 5001), "exit-w1")
    failed = await events.one("w1")
    assert (failed.rank, failed.generation) == (0, 2)  # from the plan, newer than w1's heartbeats
    assert [v.worker for v in events.verdicts()] == ["w1"]


# -- bad input -------------------------------------------------------------------------
def _fixed(snapshot: dict[str, Any] | None) -> dict[str, Any]:
    """The parts of a worker's state that only input changes (not the passing of time)."""
    assert snapshot is not None
    keys = ("pid", "rank", "generation", "last_seq", "samples", "mean_ms", "std_ms", "phase", "step")
    return {k: snapshot[k] for k in keys}


async def test_bad_input_makes_error_events_and_changes_nothing(
    detector: FailureDetector, bus: Bus, events: Events
) -> None:
    good = Heartbeat(
        job="j1",
        worker="w0",
        rank=0,
        generation=1,
        step=3,
        step_ms=10,
        phase=Phase.COMPUTE,
        phase_ms=1,
        seq=7,
        pid=6000,
        host="h",
        interval_ms=60_000,
    )
    await bus.publish(HEARTBEAT, good, traced=False, job="j1", worker="w0")
    await wait_until(lambda: tracked(detector) == {"w0"})
    before = _fixed(detector.detector.snapshot("j1", "w0"))
    stats_before = vars(detector.detector.stats).copy()
    payload, headers = encode(good.model_copy(update={"seq": 8}))
    exit_payload, exit_headers = encode(exited("w0", 6000))
    plan_payload, plan_headers = encode(
        Plan(job="j1", generation=1, members=[Member(rank=0, worker="w0")], reason="r", store_prefix="p")
    )
    bad: list[tuple[str, bytes, dict[str, str]]] = [
        ("phalanx.hb.j1.w0", b"\xc1\xff\x00", headers),  # malformed msgpack
        ("phalanx.hb.j1.w0", payload, {**headers, "Phalanx-Schema": "99"}),  # schema mismatch
        ("phalanx.hb.j1.w0", exit_payload, exit_headers),  # wrong kind on the subject
        ("phalanx.hb.j1.w1", payload, headers),  # heartbeat of w0 on w1's subject
        ("phalanx.hb.j1.w0", payload, {}),  # no kind at all
    ]
    for subject, data, hdrs in bad:
        await bus.nc.publish(subject, data, headers=hdrs)
    # JetStream inputs: a plan on the exit subject, a malformed exit
    await bus.js.publish("phalanx.evt.j1.exited.local", plan_payload, headers=plan_headers)
    await bus.js.publish("phalanx.evt.j1.exited.local", b"\x93\x01", headers=exit_headers)
    await wait_until(lambda: len(events.errors()) == 7, what="7 error events")
    reasons = [e.reason for e in events.errors()]
    assert all(e.service == "failure-detector" for e in events.errors())
    assert any("malformed msgpack" in r for r in reasons) and any("schema version '99'" in r for r in reasons)
    assert any("expected 'heartbeat', got 'rank_exited'" in r for r in reasons)
    assert any("on phalanx.hb.j1.w1" in r for r in reasons) and any(
        "does not carry 'plan'" in r for r in reasons
    )
    assert _fixed(detector.detector.snapshot("j1", "w0")) == before
    assert vars(detector.detector.stats) == stats_before
    assert tracked(detector) == {"w0"} and events.verdicts() == []
    assert detector.health_details()["decode_errors"] == 7


# -- NATS restart ----------------------------------------------------------------------
async def test_nats_restart_detects_new_exit_once_and_repeats_nothing(nats_server: NatsServer) -> None:
    async with running_detector(nats_server.url) as svc:
        bus = await Bus.connect(nats_server.url, name="test")
        try:
            ranks = {w: SimRank(bus, w, rank=i, pid=7000 + i) for i, w in enumerate(["w0", "w1", "w2", "w3"])}
            await wait_until(lambda: tracked(svc) == set(ranks))
            ranks["w0"].silence()
            first = exited("w0", 7000)
            await publish_exit(bus, first, "x0")
            await wait_until(lambda: svc.verdicts.reported == 1, what="first verdict")

            nats_server.stop()
            await wait_until(lambda: not svc.bus.nc.is_connected, what="disconnect")
            nats_server.start()
            await wait_until(lambda: svc.bus.reconnects >= 1 and svc.bus.nc.is_connected, what="reconnect")
            await wait_until(lambda: bus.nc.is_connected)

            # after the restart: a worker that died before its first heartbeat (only
            # the exit path can tell), then a repeat of the exit from before
            await publish_exit(bus, exited("w4", 7004), "x4")
            await publish_exit(bus, first, "x0-again")
            # barrier: w2 is silenced last; ranks that heartbeated across the restart
            # (w1, w2, w3) were not blamed for the outage
            ranks["w2"].silence()
            await wait_until(lambda: svc.verdicts.reported == 3, what="three verdicts")
            failed = await stored(bus, "phalanx.evt.j1.failed")
            hung = await stored(bus, "phalanx.evt.j1.hung")
            assert sorted(m.incident for m in failed) == ["j1:w0:7000", "j1:w4:7004"]  # type: ignore[attr-defined]
            assert [m.incident for m in hung] == ["j1:w2:7002"]  # type: ignore[attr-defined]
            assert tracked(svc) == {"w1", "w3"}
            await wait_until(lambda: svc.health_details()["repeated_exits"] == 1, what="repeat consumed")
        finally:
            await bus.close()


async def test_detector_restart_repeats_no_verdict(nats_url: str, bus: Bus, events: Events) -> None:
    """A second detector instance re-judges a rank still stalled (same incident id:
    JetStream drops it) and does not re-read exits the first one handled."""
    stalled = SimRank(bus, "w0", rank=0, pid=9000, phase=Phase.COMPUTE)  # no step ever: initial bound
    async with running_detector(nats_url) as first:
        await publish_exit(bus, exited("w1", 9001), "exit-w1")
        await wait_until(lambda: first.verdicts.reported == 2, what="first detector's verdicts")
    async with running_detector(nats_url) as second:
        await wait_until(lambda: second.verdicts.reported == 1, what="the stall judged again")
        await publish_exit(bus, exited("w2", 9002), "exit-w2")
        await events.one("w2")  # barrier: the exit consumer is ordered, w2's exit came last
        # (the event can arrive here before the detector has counted its publish ack)
        await wait_until(lambda: second.verdicts.reported >= 2, what="w2's verdict counted")
        assert second.verdicts.reported == 2  # the stall and w2: w1's exit was not redelivered
    hung = await stored(bus, "phalanx.evt.j1.hung")
    failed = await stored(bus, "phalanx.evt.j1.failed")
    assert [m.incident for m in hung] == ["j1:w0:9000"]  # type: ignore[attr-defined]
    assert [m.incident for m in failed] == ["j1:w1:9001", "j1:w2:9002"]  # type: ignore[attr-defined]
    assert [v.incident for v in events.verdicts("w0")] == ["j1:w0:9000"] * 2  # published twice, stored once
    stalled.silence()


# -- real processes --------------------------------------------------------------------
def _spawn_worker(url: str, worker: str, *extra: str) -> subprocess.Popen[str]:
    env = {**os.environ, "NATS_URL": url, "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen(
        [
            sys.executable,
            str(WORKER),
            "--job",
            "j1",
            "--worker",
            worker,
            "--interval-ms",
            str(INTERVAL * 1e3),
            "--step-ms",
            "50",
            *extra,
        ],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )


async def _ready(proc: subprocess.Popen[str]) -> int:
    assert proc.stdout is not None
    line = await asyncio.wait_for(asyncio.to_thread(proc.stdout.readline), WAIT)
    assert line.startswith("ready"), line
    return int(line.split()[1])


async def test_real_workers_sigstop_is_heartbeat_lost_and_stall_is_step_stall(
    nats_url: str, detector: FailureDetector, events: Events
) -> None:
    procs = {
        "w0": _spawn_worker(nats_url, "w0"),
        "w1": _spawn_worker(nats_url, "w1"),
        "w2": _spawn_worker(nats_url, "w2", "--stall-after", "5", "--stall-phase", "compute"),
        "w3": _spawn_worker(nats_url, "w3", "--stall-after", "5", "--stall-phase", "collective"),
    }
    try:
        pids = {w: await _ready(p) for w, p in procs.items()}
        await wait_until(lambda: tracked(detector) == set(procs), what="workers tracked")
        await wait_until(lambda: detector.detector.snapshot("j1", "w1")["samples"] >= 5)  # type: ignore[index]
        os.kill(pids["w1"], signal.SIGSTOP)
        lost = await events.one("w1")
        assert isinstance(lost, RankHung) and lost.cause is FaultCause.HEARTBEAT_LOST
        assert lost.incident == f"j1:w1:{pids['w1']}"
        stalled = await events.one("w2")
        assert isinstance(stalled, RankHung) and stalled.cause is FaultCause.STEP_STALL
        assert stalled.incident == f"j1:w2:{pids['w2']}" and stalled.evidence["step"] == 5
        await wait_until(
            lambda: detector.detector.snapshot("j1", "w3")["stall_ms"] > 2e3 * STALL_FLOOR,  # type: ignore[index]
            what="w3 waiting in COLLECTIVE",
        )
        assert sorted(v.worker for v in events.verdicts()) == ["w1", "w2"]
        assert tracked(detector) == {"w0", "w3"}
    finally:
        for p in procs.values():
            with contextlib.suppress(ProcessLookupError):
                p.send_signal(signal.SIGKILL)
                p.send_signal(signal.SIGCONT)
        for p in procs.values():
            p.wait(10)


async def test_detector_process_answers_ping_reports_in_a_trace_and_stops_on_sigterm(
    nats_url: str, bus: Bus, events: Events, _span_file: Path
) -> None:
    env = {**os.environ, "NATS_URL": nats_url, "PHALANX_HEARTBEAT_MS": "100", "PHALANX_LOG_LEVEL": "INFO"}
    env.pop("OTEL_EXPORTER_OTLP_ENDPOINT", None)
    proc = subprocess.Popen(
        [sys.executable, "-m", "phalanx.services.failure_detector"],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
    )
    try:
        reply = None
        deadline = time.monotonic() + WAIT
        while reply is None:
            try:
                reply = await ping(bus, "failure-detector", timeout=0.5)
            except Exception:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.1)  # still starting
        assert reply.status == "ok" and reply.details["tracked_workers"] == 0
        assert {"incidents_reported", "decode_errors"} <= reply.details.keys()
        ev = exited("w5", 8005, code=2, sig=None)
        await publish_exit(bus, ev, "exit-w5")
        failed = await events.one("w5")
        assert failed.incident == "j1:w5:8005" and failed.evidence["exit_code"] == 2
        reply = await ping(bus, "failure-detector")
        # the event is stored (and seen here) just before the detector has its ack and counts it
        deadline = time.monotonic() + WAIT
        while reply.details["incidents_reported"] != 1 and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
            reply = await ping(bus, "failure-detector")
        assert reply.details["incidents_reported"] == 1
        proc.send_signal(signal.SIGTERM)
        _, err = await asyncio.to_thread(proc.communicate, timeout=WAIT)
        assert proc.returncode == 0, err[-2000:]
        assert "service_stopped" in err
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    spans: list[dict[str, Any]] = [json.loads(line) for line in _span_file.read_text().splitlines()]
    [detect] = [
        s for s in spans if s["name"] == "detect" and s["attributes"].get("phalanx.incident") == "j1:w5:8005"
    ]
    assert detect["parent_id"] is None and detect["service"] == "failure-detector"
    assert (
        detect["start_ns"] == int(ev.exited_at * 1e9)
        and detect["attributes"]["phalanx.cause"] == "process_exit"
    )
    assert detect["attributes"]["phalanx.evidence.exit_code"] == 2
    children = [
        s for s in spans if s["trace_id"] == detect["trace_id"] and s["parent_id"] == detect["span_id"]
    ]
    assert [s["name"] for s in children] == ["publish phalanx.evt.{job}.failed"]


# -- inputs checked ----------------------------------------------------------------------
async def register(bus: Bus, worker: str, pid: int, job: str = "j1") -> None:
    """What a rank's agent publishes once it is up: the pid it runs as."""
    from phalanx.contract import Registered, Role
    from phalanx.contract.subjects import REGISTERED

    reg = Registered(job=job, worker=worker, role=Role.RANK, host="sim", pid=pid)
    await bus.publish(REGISTERED, reg, job=job, msg_id=f"{job}:{worker}:{pid}:registered")


def logged(logs: list[dict[str, Any]], event: str) -> list[dict[str, Any]]:
    return [line for line in logs if line.get("event") == event]


async def test_forged_heartbeats_are_refused_logged_and_change_nothing(
    detector: FailureDetector, bus: Bus, events: Events
) -> None:
    from structlog.testing import capture_logs

    ranks = {w: SimRank(bus, w, rank=i, pid=6100 + i) for i, w in enumerate(["w0", "w1"])}
    for w, r in ranks.items():
        await register(bus, w, r.status.pid)
    det = detector.detector
    await wait_until(
        lambda: det.registered_pid("j1", "w0") == 6100 and det.registered_pid("j1", "w1") == 6101,
        what="registrations consumed",
    )
    await wait_until(lambda: tracked(detector) == set(ranks), what="ranks tracked")
    await wait_until(lambda: det.snapshot("j1", "w0")["samples"] >= 10)  # type: ignore[index]
    base = ranks["w0"].status.heartbeat(ranks["w0"].publisher.seq, INTERVAL)
    forged = [
        base.model_copy(update={"pid": 999, "seq": base.seq + 1}),  # another pid
        base.model_copy(update={"seq": base.seq + 10**9}),  # the victim's pid, a huge seq
        base.model_copy(update={"pid": 999, "phase": Phase.DONE}),  # a goodbye from another pid
    ]
    with capture_logs() as logs:
        for hb in forged:
            await bus.publish(HEARTBEAT, hb, traced=False, job="j1", worker="w0")
        await wait_until(lambda: len(events.errors()) == 3, what="3 error events")
        await wait_until(lambda: len(logged(logs, "bad_input")) == 3, what="3 log lines")
    reasons = sorted(e.reason for e in events.errors())
    [seq] = [r for r in reasons if f"seq {base.seq + 10**9} is" in r]
    assert "past" in seq and len([r for r in reasons if "from pid 999: registered pid is 6100" in r]) == 2
    assert sorted(line["reason"] for line in logged(logs, "bad_input")) == reasons
    assert all(e.subject == "phalanx.hb.j1.w0" and e.kind == "heartbeat" for e in events.errors())
    details = detector.health_details()
    assert (details["refused_pid"], details["refused_seq"], details["decode_errors"]) == (2, 1, 3)
    # Nothing changed: w0 is still the registered pid's, and its real heartbeats still count (a
    # verdict would have untracked it: the reviewer's forged seq had it declared lost in 0.3 s).
    await wait_until(lambda: det.snapshot("j1", "w0")["last_seq"] >= base.seq + 10, what="w0 heard")  # type: ignore[index]
    snap = det.snapshot("j1", "w0")
    assert snap is not None and snap["pid"] == 6100 and snap["registered"]
    assert snap["last_seq"] < base.seq + 100  # the real sender's, not the forger's
    assert not det.is_closed("j1", "w0", 999) and det.stats.clean_exits == 0
    # barrier: a later silence is reported; it is the only verdict
    ranks["w1"].silence()
    await events.one("w1")
    assert [v.worker for v in events.verdicts()] == ["w1"]


async def test_a_flood_of_malformed_heartbeats_is_rate_limited_and_blinds_nothing(
    detector: FailureDetector, bus: Bus, events: Events
) -> None:
    flood = 5000
    ranks = {w: SimRank(bus, w, rank=i, pid=6200 + i) for i, w in enumerate(["w0", "w1", "w2"])}
    await wait_until(lambda: tracked(detector) == set(ranks), what="ranks tracked")
    await wait_until(lambda: all(detector.detector.snapshot("j1", w)["samples"] >= 10 for w in ranks))  # type: ignore[index]
    _, headers = encode(ranks["w0"].status.heartbeat(0, INTERVAL))
    t0 = time.monotonic()

    async def send() -> None:
        for k in range(flood):  # malformed msgpack, on every rank's subject
            await bus.nc.publish(
                f"phalanx.hb.j1.w{k % 3}", b"\xc1\xff" + k.to_bytes(4, "big"), headers=headers
            )
            if k % 250 == 0:
                await asyncio.sleep(0)  # the ranks' heartbeats go out in between
        await bus.flush()

    flooding = asyncio.create_task(send())
    ranks["w1"].silence()  # silenced while the flood goes on
    hung = await events.one("w1")
    await flooding
    assert isinstance(hung, RankHung) and hung.cause is FaultCause.HEARTBEAT_LOST
    assert hung.incident == "j1:w1:6201"
    # decided about when phi crossed the threshold, not held up behind the flood (awaiting each
    # error event's JetStream ack held the heartbeats up for ~9 s here)
    ev = hung.evidence
    assert float(ev["elapsed_ms"]) <= float(ev["threshold_ms"]) + float(ev["slack_ms"]) + 20 * INTERVAL * 1e3

    def accounted() -> int:
        """Bad heartbeats reported: one event each, or a summary with their count."""
        n = 0
        for e in events.errors():
            m = re.match(r"(\d+) more refused inputs on phalanx\.hb\.\*\.\* ", e.reason)
            n += int(m.group(1)) if m else 1
        return n

    await wait_until(lambda: detector.bus.decode_errors == flood, what="every bad heartbeat counted")
    await wait_until(lambda: accounted() == flood, what="the suppressed ones summed up")
    elapsed = time.monotonic() - t0
    errors = events.errors()
    assert 2 <= len(errors) <= Bus.ERROR_EVENTS_BURST + Bus.ERROR_EVENTS_PER_S * elapsed + 1
    one_by_one = [e for e in errors if " more refused inputs " not in e.reason]
    assert detector.bus.bad_input_suppressed == flood - len(one_by_one)
    # no healthy rank was declared lost: both still tracked, heard after the flood
    after = {w: detector.detector.snapshot("j1", w)["last_seq"] for w in ("w0", "w2")}  # type: ignore[index]
    await wait_until(
        lambda: all(detector.detector.snapshot("j1", w)["last_seq"] >= after[w] + 5 for w in after),  # type: ignore[index]
        what="w0 and w2 heard after the flood",
    )
    assert [v.worker for v in events.verdicts()] == ["w1"]


# -- replicas --------------------------------------------------------------------------------
async def test_two_replicas_store_one_verdict_per_incident_and_both_decide_it(
    nats_url: str, bus: Bus, events: Events
) -> None:
    from dataclasses import replace

    from phalanx.contract.streams import COMMANDS, EVENTS

    async with (
        running_detector(nats_url, replace(FAST, replica="a")) as a,
        running_detector(nats_url, replace(FAST, replica="b")) as b,
    ):
        ranks = {w: SimRank(bus, w, rank=i, pid=6300 + i) for i, w in enumerate(["w0", "w1", "w2"])}
        await wait_until(lambda: tracked(a) == tracked(b) == set(ranks), what="ranks tracked by both")
        ranks["w0"].silence()  # a crash: the launcher reports the exit once
        await publish_exit(bus, exited("w0", 6300), "exit-w0")
        await wait_until(
            lambda: a.verdicts.reported == 1 and b.verdicts.reported == 1,
            what="both replicas judged the exit",
        )
        ranks["w1"].silence()  # a silent rank
        await wait_until(
            lambda: a.verdicts.reported == 2 and b.verdicts.reported == 2,
            what="both replicas judged the silence",
        )
        for d in (a, b):
            assert d.detector.is_closed("j1", "w0", 6300) and d.detector.is_closed("j1", "w1", 6301)
            assert tracked(d) == {"w2"} and d.health_details()["replica"] == d.config.replica
        for stream, what in ((EVENTS, "exits"), (EVENTS, "registrations"), (COMMANDS, "plans")):
            for d in (a, b):
                await bus.js.consumer_info(stream.name, d.config.durable(what))  # one consumer each
    failed = await stored(bus, "phalanx.evt.j1.failed")
    hung = await stored(bus, "phalanx.evt.j1.hung")
    assert [m.incident for m in failed] == ["j1:w0:6300"]  # type: ignore[attr-defined]
    assert [m.incident for m in hung] == ["j1:w1:6301"]  # type: ignore[attr-defined]
    assert sorted(v.incident for v in events.verdicts()) == ["j1:w0:6300"] * 2 + ["j1:w1:6301"] * 2


# -- mass silence ----------------------------------------------------------------------------
async def test_a_mass_silence_is_held_and_only_ranks_still_silent_after_it_are_judged(
    nats_url: str, bus: Bus, events: Events
) -> None:
    from dataclasses import replace

    from structlog.testing import capture_logs

    config = replace(FAST, detector=replace(FAST.detector, mass_hold_s=3.0))
    async with running_detector(nats_url, config) as svc:
        ranks = {w: SimRank(bus, w, rank=i, pid=6400 + i) for i, w in enumerate(["w0", "w1", "w2", "w3"])}
        await wait_until(lambda: tracked(svc) == set(ranks), what="ranks tracked")
        await wait_until(lambda: all(svc.detector.snapshot("j1", w)["samples"] >= 10 for w in ranks))  # type: ignore[index]
        with capture_logs() as logs:
            for w in ("w1", "w2", "w3"):  # cut off from NATS together
                ranks[w].silence()
            await wait_until(lambda: bool(logged(logs, "mass_silence_hold")), what="the hold logged")
        [line] = logged(logs, "mass_silence_hold")
        assert (line["job"], line["count"], line["tracked_workers"], line["hold_s"]) == ("j1", 3, 4, 3.0)
        # a real death during the hold is not held
        ranks["w0"].silence()
        await publish_exit(bus, exited("w0", 6400), "exit-w0")
        failed = await events.one("w0")
        assert isinstance(failed, RankFailed)
        ranks["w1"].resume()  # w1 and w2 come back within the hold; w3 does not
        ranks["w2"].resume()
        hung = await events.one("w3")
        assert isinstance(hung, RankHung) and hung.cause is FaultCause.HEARTBEAT_LOST
        assert hung.evidence["mass_silence"] is True and hung.evidence["mass_hold_ms"] == 3000.0
        assert float(hung.evidence["elapsed_ms"]) >= 3000.0
        # barrier: w1 falls silent alone (not a mass silence: judged at once), after any
        # verdict on w2 would have come
        ranks["w1"].silence()
        alone = await events.one("w1")
        assert "mass_silence" not in alone.evidence
        assert [v.worker for v in events.verdicts()] == ["w0", "w3", "w1"]
        assert tracked(svc) == {"w2"} and svc.health_details()["mass_held"] == 1


async def test_a_survivors_failed_collective_ends_a_mass_hold_at_once(
    nats_url: str, bus: Bus, events: Events
) -> None:
    """Three ranks of four fall silent together: held (the hold would last 60 s); then
    the fourth reports its all-reduce with them failed, and they are judged at once."""
    from dataclasses import replace

    from phalanx.contract import CollectiveError
    from phalanx.contract.subjects import COMM_ERROR

    config = replace(FAST, detector=replace(FAST.detector, mass_hold_s=60.0))
    async with running_detector(nats_url, config) as svc:
        ranks = {w: SimRank(bus, w, rank=i, pid=6500 + i) for i, w in enumerate(["w0", "w1", "w2", "w3"])}
        await wait_until(lambda: tracked(svc) == set(ranks), what="ranks tracked")
        await wait_until(lambda: all(svc.detector.snapshot("j1", w)["samples"] >= 10 for w in ranks))  # type: ignore[index]
        for w in ("w1", "w2", "w3"):
            ranks[w].silence()
        await wait_until(lambda: svc.detector.mass_hold("j1") is not None, what="the hold")
        t0 = time.monotonic()
        err = CollectiveError(job="j1", worker="w0", rank=0, generation=1, step=3, error="peer closed")
        await bus.publish(COMM_ERROR, err)
        for w in ("w1", "w2", "w3"):
            v = await events.one(w)
            assert v.evidence["mass_confirmed"] == "collective_error:w0", v.evidence
        assert time.monotonic() - t0 < 10.0  # not the hold's 60 s
        assert svc.health_details()["mass_confirmed"] == 1
