"""Node digests end to end: real worker processes heartbeat into a real
:class:`NodeDigestPublisher` over its unix socket, which publishes on a real
nats-server to a real failure-detector service.

Absence of an event is asserted after a causal barrier (the detector's own
counters show it has looked long enough), never after a bare sleep.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import AsyncIterator, Iterable, Iterator
from pathlib import Path

import pytest
from nats.aio.msg import Msg
from phalanx.services.failure_detector import DetectorConfig, FailureDetector, ServiceConfig

from phalanx.bus import Bus
from phalanx.contract import (
    DigestEntry,
    ErrorEvent,
    FaultCause,
    Message,
    NodeDigest,
    NodeLost,
    Phase,
    RankFailed,
    RankHung,
    decode,
)
from phalanx.contract.subjects import NODE_DIGEST
from phalanx.worker.digest import NodeDigestPublisher
from tests.integration.test_detector_service import wait_until

ROOT = Path(__file__).resolve().parents[2]
WORKER = ROOT / "tests" / "workers" / "heartbeat_worker.py"
JOB = "j1"
INTERVAL = 0.1
FAST = ServiceConfig.for_interval(INTERVAL, detector=DetectorConfig(stall_floor_s=0.6, stall_initial_s=0.6))


class Events:
    """Every verdict, NodeLost and error event seen on core NATS."""

    def __init__(self) -> None:
        self.items: list[Message] = []

    async def attach(self, bus: Bus) -> None:
        async def cb(raw: Msg) -> None:
            self.items.append(decode(raw.data, raw.headers))

        for subject in (
            "phalanx.evt.*.failed",
            "phalanx.evt.*.hung",
            "phalanx.evt.*.node_lost",
            "phalanx.err.failure-detector",
        ):
            await bus.nc.subscribe(subject, cb=cb)
        await bus.flush()

    def verdicts(self) -> list[RankFailed | RankHung | NodeLost]:
        return [m for m in self.items if isinstance(m, RankFailed | RankHung | NodeLost)]

    def errors(self) -> list[ErrorEvent]:
        return [m for m in self.items if isinstance(m, ErrorEvent)]


def spawn(url: str, socket_path: Path, worker: str, *extra: str) -> subprocess.Popen[str]:
    """A real worker process that heartbeats into ``socket_path`` (as under a launcher)."""
    env = {**os.environ, "NATS_URL": url, "PHALANX_HEARTBEAT_SOCKET": str(socket_path)}
    args = ["--job", JOB, "--worker", worker, "--interval-ms", str(INTERVAL * 1e3), "--step-ms", "50"]
    return subprocess.Popen(
        [sys.executable, str(WORKER), *args, *extra],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        text=True,
    )


class Node:
    """A node: its own NATS connection, a digest publisher and real worker processes."""

    def __init__(self, url: str, name: str, sock_dir: Path) -> None:
        self.url, self.name, self.sock_dir = url, name, sock_dir
        self.procs: dict[str, subprocess.Popen[str]] = {}
        self.bus: Bus | None = None
        self.pub: NodeDigestPublisher | None = None

    async def start(self, workers: int) -> None:
        self.bus = await Bus.connect(self.url, name=f"launcher-{self.name}", ensure=False)
        self.pub = NodeDigestPublisher(
            self.bus,
            job=JOB,
            node=self.name,
            launcher=f"{self.name}-L",
            host=self.name,
            socket_path=self.sock_dir / f"{self.name}.sock",
            interval_s=INTERVAL,
        )
        await self.pub.start()
        for i in range(workers):
            worker = f"{self.name}-w{i}"
            proc = spawn(self.url, self.pub.socket_path, worker, "--rank", str(i))
            self.pub.expect(worker, proc.pid)
            self.procs[worker] = proc

    async def cut_off(self) -> None:
        """The node falls off the network: its digests stop, its processes live on."""
        assert self.bus is not None
        await self.bus.nc.close()

    async def stop(self) -> None:
        for p in self.procs.values():
            with contextlib.suppress(ProcessLookupError):
                p.send_signal(signal.SIGKILL)
                p.send_signal(signal.SIGCONT)
        for p in self.procs.values():
            p.wait(10)
        if self.pub is not None:
            await self.pub.stop()
        if self.bus is not None:
            await self.bus.close()


@pytest.fixture
def sock_dir() -> Iterator[Path]:
    d = Path(tempfile.mkdtemp(prefix="phx-", dir="/tmp"))  # short: socket paths are at most 107 bytes
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
async def detector(nats_url: str) -> AsyncIterator[FailureDetector]:
    bus = await Bus.connect(nats_url, name="failure-detector")
    svc = FailureDetector(bus, FAST)
    await svc.start()
    try:
        yield svc
    finally:
        await svc.stop()
        await bus.close()


@pytest.fixture
async def events(bus: Bus) -> Events:
    ev = Events()
    await ev.attach(bus)
    return ev


@pytest.fixture
async def nodes(nats_url: str, sock_dir: Path) -> AsyncIterator[dict[str, Node]]:
    made = {name: Node(nats_url, name, sock_dir) for name in ("na", "nb")}
    try:
        yield made
    finally:
        for n in made.values():
            await n.stop()


def tracked(svc: FailureDetector) -> set[str]:
    return {w for _, w, _ in svc.detector.tracked()}


async def started(svc: FailureDetector, nodes: Iterable[Node], workers: int) -> set[str]:
    """Start ``nodes`` with ``workers`` each; return their workers once the detector
    tracks every one of them through digests and has learnt their rhythm."""
    for n in nodes:
        await n.start(workers)
    everyone = {w for n in nodes for w in n.procs}
    await wait_until(lambda: tracked(svc) == everyone, what="every worker tracked through digests")
    await wait_until(
        lambda: all((s := svc.detector.snapshot(JOB, w)) is not None and s["samples"] >= 5 for w in everyone),
        what="rhythm learnt",
    )
    return everyone


async def test_node_silence_is_one_node_lost_and_a_frozen_rank_is_hung(
    detector: FailureDetector, events: Events, nodes: dict[str, Node], bus: Bus
) -> None:
    everyone = await started(detector, nodes.values(), 2)
    # steady: 3 s of digests from both nodes, and nothing
    digests = detector.detector.stats.digests
    await wait_until(lambda: detector.detector.stats.digests >= digests + 2 * 30, what="3 s of digests")
    assert events.verdicts() == [] and tracked(detector) == everyone
    assert {s["node"] for w in everyone if (s := detector.detector.snapshot(JOB, w))} == {"na", "nb"}

    # a rank stops inside a live node: its entry freezes, the node goes on
    victim = nodes["na"].procs["na-w1"]
    os.kill(victim.pid, signal.SIGSTOP)
    await wait_until(lambda: bool(events.verdicts()), what="RankHung for na-w1")
    [hung] = events.verdicts()
    assert isinstance(hung, RankHung) and hung.cause is FaultCause.HEARTBEAT_LOST
    assert hung.incident == f"{JOB}:na-w1:{victim.pid}" and hung.evidence["node"] == "na"

    # node nb is cut off: one NodeLost, and none of its workers is hung on its own
    await nodes["nb"].cut_off()
    await wait_until(lambda: len(events.verdicts()) == 2, what="NodeLost for nb")
    lost = events.verdicts()[1]
    assert isinstance(lost, NodeLost) and lost.incident == f"{JOB}:node:nb:nb-L"
    assert lost.node == "nb" and sorted(lost.workers) == ["nb-w0", "nb-w1"]
    assert lost.cause is FaultCause.HEARTBEAT_LOST and lost.fault_at < lost.detected_at
    assert tracked(detector) == {"na-w0"}
    # barrier: na keeps digesting for 3 s more, twice what any late RankHung of nb's would need
    digests = detector.detector.stats.digests
    await wait_until(lambda: detector.detector.stats.digests >= digests + 30, what="3 s more of na")
    assert len(events.verdicts()) == 2 and detector.detector.stats.nodes_lost == 1

    # nb comes back with the same launcher: ignored, it does not resurrect
    nb = nodes["nb"]
    assert nb.pub is not None
    nb.bus = await Bus.connect(nb.url, name="launcher-nb-again", ensure=False)
    nb.pub.bus = nb.bus
    ignored = detector.detector.stats.ignored_digests
    await wait_until(lambda: detector.detector.stats.ignored_digests >= ignored + 10, what="nb's digests")
    assert tracked(detector) == {"na-w0"} and len(events.verdicts()) == 2
    assert [n for _, n, _ in detector.detector.nodes()] == ["na"]
    health = detector.health_details()
    assert health["nodes_lost"] == 1 and health["tracked_nodes"] == 1


async def test_step_stall_through_digests_and_digest_on_the_wrong_subject(
    detector: FailureDetector, events: Events, bus: Bus, sock_dir: Path, nats_url: str
) -> None:
    node = Node(nats_url, "nc", sock_dir)
    try:
        await node.start(0)
        assert node.pub is not None
        for i, extra in enumerate(
            (["--stall-after", "5"], ["--stall-after", "5", "--stall-phase", "collective"])
        ):
            worker = f"nc-w{i}"
            proc = spawn(nats_url, node.pub.socket_path, worker, *extra)
            node.pub.expect(worker, proc.pid)
            node.procs[worker] = proc
        await wait_until(lambda: bool(events.verdicts()), what="the stall")
        [stalled] = events.verdicts()
        assert isinstance(stalled, RankHung) and stalled.cause is FaultCause.STEP_STALL
        assert stalled.incident == f"{JOB}:nc-w0:{node.procs['nc-w0'].pid}" and stalled.evidence["step"] == 5
        await wait_until(
            lambda: detector.detector.snapshot(JOB, "nc-w1")["stall_ms"] > 2e3 * FAST.detector.stall_floor_s,  # type: ignore[index]
            what="nc-w1 waiting in COLLECTIVE",
        )
        assert len(events.verdicts()) == 1

        # a digest of node nc published on nd's subject: an error event, nothing learnt
        entry = DigestEntry(
            worker="nc-w9",
            pid=1,
            seq=1,
            rank=9,
            generation=1,
            step=0,
            step_ms=0,
            phase=Phase.IDLE,
            phase_ms=0,
            age_ms=0,
        )
        forged = NodeDigest(
            job=JOB, node="nc", launcher="x", host="h", seq=1, interval_ms=100, entries=[entry]
        )
        await bus.publish(NODE_DIGEST, forged, traced=False, job=JOB, node="nd")
        await wait_until(lambda: bool(events.errors()), what="the error event")
        [err] = events.errors()
        assert "digest of j1/nc on phalanx.node.j1.nd" in err.reason
        assert "nc-w9" not in tracked(detector)
    finally:
        await node.stop()


async def test_a_mass_silence_judges_a_node_whose_launcher_is_gone_and_not_one_that_answers(
    nats_url: str, sock_dir: Path, events: Events
) -> None:
    """Three nodes of four fall silent at once: held. The detector asks their launchers:
    na's connection is closed ("no responders" for 3 s: judged), nb and nc still answer
    with their digests stopped (a stalled path, not a death: never judged, not even
    past the hold), and when their digests come back nothing is published."""
    from dataclasses import replace

    config = replace(FAST, detector=replace(FAST.detector, mass_hold_s=8.0, mass_probe_s=0.3))
    bus = await Bus.connect(nats_url, name="failure-detector")
    svc = FailureDetector(bus, config)
    await svc.start()
    made = {name: Node(nats_url, name, sock_dir) for name in ("na", "nb", "nc", "nd")}
    try:
        await started(svc, made.values(), 1)
        stalled = [made["nb"].pub, made["nc"].pub]
        for pub in stalled:  # digests stop, the launchers answer on
            assert pub is not None and pub._task is not None
            pub._task.cancel()
        await made["na"].cut_off()
        await wait_until(lambda: bool(events.verdicts()), what="NodeLost for na")
        [lost] = events.verdicts()
        assert isinstance(lost, NodeLost) and lost.node == "na"
        assert lost.evidence["mass_confirmed"] == "no_responders" and lost.evidence["mass_silent_nodes"] == 3
        assert float(lost.evidence["elapsed_ms"]) < 8000.0  # before the hold's end
        # barrier: nd digests for 3 s past the hold's end; nb and nc are asked and answer
        hold = svc.detector.mass_hold(JOB)
        assert hold is not None
        digests = svc.detector.stats.digests
        await wait_until(lambda: svc.detector.clock() > hold.until + 3.0, timeout=30, what="past the hold")
        assert svc.detector.stats.digests > digests + 20 and svc.detector.stats.mass_probes > 10
        assert len(events.verdicts()) == 1, events.verdicts()
        for pub in stalled:  # their digests again: nothing
            assert pub is not None
            pub._task = asyncio.create_task(pub._run())
        probes = svc.detector.stats.mass_probes
        digests = svc.detector.stats.digests
        await wait_until(
            lambda: svc.detector.stats.digests > digests + 60, what="6 s of three nodes' digests"
        )
        assert len(events.verdicts()) == 1 and svc.detector.stats.mass_probes <= probes + 2
        assert sorted(n for _, n, _ in svc.detector.nodes()) == ["nb", "nc", "nd"]
    finally:
        for n in made.values():
            await n.stop()
        await svc.stop()
        await bus.close()
