"""The node digest publisher (:mod:`phalanx.worker.digest`) with real unix
datagram sockets, real subprocesses as forgers and a real nats-server.

Ranks' heartbeats go through :class:`HeartbeatPublisher` with a socket path (the
same code a rank under a launcher runs); the digests are read back from NATS.
Waiting is on counters the publisher keeps, never on the clock.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path

import pytest
from nats.aio.msg import Msg

from phalanx.bus import Bus
from phalanx.contract import NodeDigest, Phase, decode, encode
from phalanx.contract.subjects import NODE_DIGEST
from phalanx.worker.digest import NodeDigestPublisher
from phalanx.worker.heartbeat import HeartbeatPublisher
from phalanx.worker.status import RankStatus

WAIT = 20.0
FOREVER = 3600.0  # a digest interval no test waits for: digests come from digest() or stop()


async def wait_until(pred: Callable[[], bool], what: str = "condition") -> None:
    deadline = time.monotonic() + WAIT
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.005)


@pytest.fixture
def sock_dir() -> Iterator[Path]:
    """A short directory for the socket (a unix socket path is at most 107 bytes)."""
    d = Path(tempfile.mkdtemp(prefix="phx-", dir="/tmp"))
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
async def node(bus: Bus, sock_dir: Path) -> AsyncIterator[NodeDigestPublisher]:
    pub = NodeDigestPublisher(
        bus,
        job="j1",
        node="node-a",
        launcher="node-a-1",
        host="host-a",
        socket_path=sock_dir / "hb.sock",
        interval_s=FOREVER,
    )
    await pub.start()
    try:
        yield pub
    finally:
        await pub.stop()


def rank(bus: Bus, pub: NodeDigestPublisher, worker: str, pid: int | None = None) -> HeartbeatPublisher:
    status = RankStatus(job="j1", worker=worker, rank=0, generation=1, pid=pid or os.getpid())
    status.enter(Phase.COMPUTE)
    return HeartbeatPublisher(bus, status, 0.1, socket_path=str(pub.socket_path))


async def beat(hb: HeartbeatPublisher, pub: NodeDigestPublisher) -> None:
    """One heartbeat, sent and received (or refused)."""
    before = pub.received + pub.refused
    assert await hb.send_now(hb.status.heartbeat(hb.seq, hb.interval_s))
    hb.seq += 1
    await wait_until(lambda: pub.received + pub.refused > before, "the datagram")


def forge(path: Path, payload: bytes) -> None:
    """Send ``payload`` to the socket from another process."""
    code = "import socket,sys; s=socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM); s.sendto(sys.stdin.buffer.read(), sys.argv[1])"
    subprocess.run([sys.executable, "-c", code, str(path)], input=payload, check=True, timeout=WAIT)


async def test_digest_carries_the_latest_heartbeat_with_its_age(bus: Bus, node: NodeDigestPublisher) -> None:
    heard: list[NodeDigest] = []

    async def cb(raw: Msg) -> None:
        heard.append(decode(raw.data, raw.headers, NodeDigest))

    await bus.nc.subscribe(NODE_DIGEST.format(job="j1", node="node-a"), cb=cb)
    await bus.flush()
    await wait_until(lambda: node.published == 1, "the first digest")  # published at start
    node.expect("node-a-w0", os.getpid())
    node.expect("node-a-w1", os.getpid())
    w0 = rank(bus, node, "node-a-w0")
    w0.status.step, w0.status.step_ms = 7, 12.5
    await beat(w0, node)
    await beat(w0, node)
    first, second = node.digest(), node.digest()
    assert node.received == 2 and node.refused == 0
    assert [e.worker for e in first.entries] == ["node-a-w0"]  # w1 has not heartbeated yet
    [e1], [e2] = first.entries, second.entries
    assert (e1.seq, e1.pid, e1.step, e1.step_ms, e1.phase, e1.interval_ms) == (
        1,
        os.getpid(),
        7,
        12.5,
        Phase.COMPUTE,
        100.0,
    )
    assert 0 <= e1.age_ms <= e2.age_ms  # the same heartbeat, older
    assert (first.job, first.node, first.launcher, first.host) == ("j1", "node-a", "node-a-1", "host-a")
    assert second.seq == first.seq + 1 and first.interval_ms == FOREVER * 1e3
    # the digest on the wire is the same message
    await node.publish_now()
    await wait_until(lambda: bool(heard), "the published digest")
    assert [e.worker for e in heard[-1].entries] == ["node-a-w0"] and heard[-1].seq == second.seq + 1
    # a worker that has exited is no longer reported
    node.forget("node-a-w0")
    assert node.digest().entries == []


async def test_the_collectives_of_a_step_are_counted_and_carried_to_the_digest(
    bus: Bus, node: NodeDigestPublisher
) -> None:
    """``op``: each collective entered adds one; a completed step and a generation
    joined start the count again; the digest entry carries the heartbeat's."""
    node.expect("node-a-w0", os.getpid())
    w0 = rank(bus, node, "node-a-w0")
    status = w0.status
    status.enter_collective(2.0)  # e.g. DDP's buffer broadcast, then the gradient all-reduce
    status.enter(Phase.COMPUTE)
    status.enter_collective(2.0)
    await beat(w0, node)
    [e] = node.digest().entries
    assert (e.phase, e.op, e.collective_bound_ms) == (Phase.COLLECTIVE, 2, 2000.0)
    status.completed(1, 10.0, None)
    assert status.heartbeat(9, 0.1).op == 0
    status.enter_collective(2.0)
    status.join(0, 2)
    assert (status.op, status.phase, status.generation) == (0, Phase.RECOVERING, 2)


async def test_heartbeat_from_another_process_is_refused(bus: Bus, node: NodeDigestPublisher) -> None:
    """The kernel says who sent a datagram: another process cannot speak for a worker,
    not even with the right pid in the payload."""
    node.expect("node-a-w0", os.getpid())
    status = RankStatus(job="j1", worker="node-a-w0", rank=0, generation=1, pid=os.getpid())
    payload, _ = encode(status.heartbeat(5, 0.1))
    forge(node.socket_path, payload)  # claims the expected pid, sent by another
    await wait_until(lambda: node.refused == 1, "the forged heartbeat refused")
    # a worker the launcher expects under another pid (a leftover of an earlier incarnation)
    node.expect("node-a-w1", os.getpid() + 1_000_000)
    await beat(rank(bus, node, "node-a-w1"), node)
    # a worker nobody expects, another job, and garbage
    await beat(rank(bus, node, "node-a-w9"), node)
    other = RankStatus(job="j2", worker="node-a-w0", rank=0, generation=1)
    await beat(HeartbeatPublisher(bus, other, 0.1, socket_path=str(node.socket_path)), node)
    forge(node.socket_path, b"\xc1garbage")
    await wait_until(lambda: node.refused == 5, "every bad datagram refused")
    assert node.received == 0 and node.digest().entries == []
    # the real one is accepted
    await beat(rank(bus, node, "node-a-w0"), node)
    assert node.received == 1 and [e.worker for e in node.digest().entries] == ["node-a-w0"]


async def test_done_is_reported_once_then_dropped(bus: Bus, node: NodeDigestPublisher) -> None:
    node.expect("node-a-w0", os.getpid())
    hb = rank(bus, node, "node-a-w0")
    await beat(hb, node)
    before = node.received
    await hb.goodbye()
    await wait_until(lambda: node.received > before, "the goodbye")
    [done] = node.digest().entries
    assert done.phase is Phase.DONE
    assert node.digest().entries == []


async def test_a_new_incarnation_starts_without_the_old_heartbeat(
    bus: Bus, node: NodeDigestPublisher
) -> None:
    node.expect("node-a-w0", os.getpid())
    await beat(rank(bus, node, "node-a-w0"), node)
    node.expect("node-a-w0", os.getpid() + 1_000_000)  # respawned: the new process has not spoken
    assert node.digest().entries == []


async def test_missing_socket_never_raises_into_the_heartbeat_loop(bus: Bus, sock_dir: Path) -> None:
    status = RankStatus(job="j1", worker="w0")
    hb = HeartbeatPublisher(bus, status, 0.01, socket_path=str(sock_dir / "nobody.sock"))
    task = asyncio.create_task(hb.run())
    await wait_until(lambda: hb.failures >= 3, "three failed sends")
    assert not task.done() and hb.seq == 0  # still on schedule, nothing counted as sent
    task.cancel()
    await hb.goodbye()  # no launcher: logged, not raised
    assert status.phase is Phase.DONE


async def test_stop_publishes_a_last_digest_and_removes_the_socket(bus: Bus, sock_dir: Path) -> None:
    heard: list[NodeDigest] = []

    async def cb(raw: Msg) -> None:
        heard.append(decode(raw.data, raw.headers, NodeDigest))

    await bus.nc.subscribe(NODE_DIGEST.wildcard(job="j1"), cb=cb)
    pub = NodeDigestPublisher(
        bus, job="j1", node="n1", launcher="l1", host="h", socket_path=sock_dir / "s", interval_s=FOREVER
    )
    await pub.start()
    await wait_until(lambda: pub.published == 1, "the first digest")
    await pub.stop()
    await bus.flush()
    await wait_until(lambda: len(heard) == 2, "start and stop digests")
    assert [d.seq for d in heard] == [0, 1] and not (sock_dir / "s").exists()
    with pytest.raises(ValueError):
        NodeDigestPublisher(
            bus, job="j1", node="a.b", launcher="l", host="h", socket_path=sock_dir / "x", interval_s=1.0
        )


async def test_finished_steps_reach_the_events_stream(bus: Bus, node: NodeDigestPublisher) -> None:
    """Steps a rank completed ride on its heartbeats; the launcher publishes them on
    JetStream, where a report reads them after the job. A rank cannot report steps
    as another worker."""
    from phalanx.contract import StepRecord, StepStats
    from phalanx.contract.streams import EVENTS
    from phalanx.report import read_stream

    node.expect("node-a-w0", os.getpid())
    hb = rank(bus, node, "node-a-w0")
    for step, loss in ((1, 2.5), (2, 2.25), (3, None)):
        hb.status.completed(step, 10.0 * step, loss)
    forged = StepRecord(worker="node-a-w1", rank=1, generation=1, step=9, step_ms=1.0, at=time.time())
    hb.status.unsent.append(forged)
    before = node.received
    assert await hb.send_now(hb.status.heartbeat(hb.seq, hb.interval_s, hb.status.take_finished()))
    await wait_until(lambda: node.received > before, "the heartbeat")
    assert not hb.status.unsent  # taken by the heartbeat that went out
    await node.publish_steps()
    stats = [m for m in await read_stream(bus, EVENTS, "phalanx.evt.j1.steps") if isinstance(m, StepStats)]
    records = [r for m in stats for r in m.steps]
    assert [(r.worker, r.step, r.step_ms, r.loss) for r in records] == [
        ("node-a-w0", 1, 10.0, 2.5),
        ("node-a-w0", 2, 20.0, 2.25),
        ("node-a-w0", 3, 30.0, None),
    ]
    assert {(m.node, m.launcher) for m in stats} == {("node-a", "node-a-1")}


async def test_steps_of_a_heartbeat_that_did_not_go_out_are_sent_later(bus: Bus, sock_dir: Path) -> None:
    status = RankStatus(job="j1", worker="w0", rank=0, generation=1)
    hb = HeartbeatPublisher(bus, status, 0.01, socket_path=str(sock_dir / "nobody.sock"))
    status.completed(1, 5.0, 1.0)
    task = asyncio.create_task(hb.run())
    await wait_until(lambda: hb.failures >= 2, "two failed sends")
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    assert [r.step for r in status.unsent] == [1]
