"""Launchers follow the plan as deltas, against a real nats-server and the real planner:
each holds exactly its node's part of the committed plan; one whose connection is
cut while a plan is committed (it misses the delta) reads the record once it is back
and ends with the right plan; a node's acknowledgement completes the generation."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import pytest

from phalanx.bus import Bus
from phalanx.contract import JobRecord, NodeAck, NodePlan, decode, headers_for, node_plan
from phalanx.contract.streams import JOBS_BUCKET
from phalanx.contract.subjects import FAILED, NODE_ACK
from phalanx.launcher.planview import NodePlanFollower
from phalanx.worker.follow import record_key
from tests.integration.planning import JOB, Watcher, failed, join, planner


class CutProxy:
    """A TCP proxy to the NATS server that can cut its clients off (and let them back)."""

    def __init__(self, target: tuple[str, int]) -> None:
        self.target = target
        self.server: asyncio.Server | None = None
        self.port = 0
        self.cut_off = False
        self._pipes: set[asyncio.StreamWriter] = set()

    async def start(self) -> None:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", self.port)
        self.port = self.server.sockets[0].getsockname()[1]

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self.cut_off:
            writer.close()
            return
        up_reader, up_writer = await asyncio.open_connection(*self.target)
        self._pipes |= {writer, up_writer}

        async def pump(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
            with contextlib.suppress(Exception):
                while data := await src.read(65536):
                    dst.write(data)
                    await dst.drain()
            dst.close()

        await asyncio.gather(pump(reader, up_writer), pump(up_reader, writer))

    def cut(self) -> None:
        self.cut_off = True
        for w in self._pipes:
            w.close()
        self._pipes.clear()

    def heal(self) -> None:
        self.cut_off = False

    async def stop(self) -> None:
        self.cut()
        if self.server is not None:
            self.server.close()


@pytest.fixture
async def proxy(nats_url: str) -> AsyncIterator[CutProxy]:
    host, port = nats_url.removeprefix("nats://").rsplit(":", 1)
    p = CutProxy((host, int(port)))
    await p.start()
    try:
        yield p
    finally:
        await p.stop()


async def _until(pred: object, what: str, timeout: float = 20.0) -> None:
    async def loop() -> None:
        while not pred():  # type: ignore[operator]
            await asyncio.sleep(0.02)

    try:
        await asyncio.wait_for(loop(), timeout)
    except TimeoutError:
        raise AssertionError(f"timed out waiting for {what}") from None


async def _record(bus: Bus) -> JobRecord:
    kv = await bus.js.key_value(JOBS_BUCKET)
    entry = await kv.get(record_key(JOB))
    assert entry.value is not None
    return decode(entry.value, headers_for(JobRecord), JobRecord)


NODES = {"n1": ["n1-w0", "n1-w1", "n1-w2"], "n2": ["n2-w0", "n2-w1", "n2-w2"]}


async def test_a_launcher_cut_off_during_a_plan_ends_with_the_right_part(
    nats_url: str, bus: Bus, watcher: Watcher, proxy: CutProxy
) -> None:
    views: dict[str, list[NodePlan]] = {"n1": [], "n2": []}
    buses: list[Bus] = []
    followers: dict[str, NodePlanFollower] = {}
    async with planner(nats_url):
        try:
            for node, workers in NODES.items():
                url = f"nats://127.0.0.1:{proxy.port}" if node == "n2" else nats_url
                b = await Bus.connect(url, name=f"launcher-{node}", reconnect_wait_s=0.1)
                buses.append(b)
                f = NodePlanFollower(
                    b, JOB, node, lambda ws=workers: set(ws), lambda v, _r, n=node: views[n].append(v)
                )
                await f.start()
                followers[node] = f
            answers = [
                await join(bus, 2, 1, launcher=f"L-{n}", node=n, workers=ws, min_nodes=2, max_nodes=2)
                for n, ws in NODES.items()
            ]
            for f, a in zip(followers.values(), answers, strict=True):
                await f.follow(a.run)
            await watcher.wait_for(lambda: len(watcher.plans) >= 1)
            await _until(lambda: all(v and v[-1].generation == 1 for v in views.values()), "generation 1")

            reads = {n: f.reads for n, f in followers.items()}
            proxy.cut()  # n2's launcher is cut off while the next plan is committed
            await bus.publish(FAILED, failed("n1-w1", 1, generation=1), job=JOB, msg_id="crash-n1-w1")
            await watcher.wait_for(lambda: any(p.generation == 2 for p in watcher.plans))
            await _until(lambda: views["n1"][-1].generation == 2, "n1 applies the delta")
            assert followers["n1"].applied == 1 and followers["n1"].reads == reads["n1"]  # a delta, no read
            assert views["n2"][-1].generation == 1  # missed it
            proxy.heal()
            await _until(lambda: views["n2"][-1].generation == 2, "n2 reads the record once back")
            assert followers["n2"].reads > reads["n2"] and followers["n2"].applied == 0

            record = await _record(bus)
            assert record.plan is not None and record.plan.generation == 2
            for node, workers in NODES.items():
                assert views[node][-1] == node_plan(record.plan, node, set(workers)), node
            assert views["n1"][-1].ranks == {"n1-w0": 0, "n1-w2": 1}  # n1's spare took n1-w1's rank

            # The node's acknowledgement completes the generation: the planner runs again.
            for node in NODES:
                part = views[node][-1]
                ack = NodeAck(job=JOB, node=node, generation=2, workers=sorted(part.ranks))
                await bus.publish(NODE_ACK, ack, job=JOB, node=node)
            for _ in range(200):
                state = (await _record(bus)).planner
                if state is not None and state.acked == 2:
                    break
                await asyncio.sleep(0.05)
            assert state is not None and state.acked == 2 and state.phase.value == "running"
        finally:
            for f in followers.values():
                await f.stop()
            for b in buses:
                await b.close()
