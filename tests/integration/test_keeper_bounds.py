"""A keeper bounded before it trusts (issue 37): real keepers (in this process, each a node
of its own) against a real nats-server, attacked by this test over the ranks' Unix socket
and the peers' TCP port, and a replica that could not be made at save time.

- the ranks' socket: a caller's uid and its connections are checked at accept, before a
  byte is read; a request is capped at what a real one needs; a caller that goes away
  leaves no unhandled exception behind;
- the peers' port: connections that never authenticate, from many addresses and
  reconnecting as fast as they are dropped, do not keep a keeper that knows the key out;
- a replica no peer could take is reported (event, metric, ``phalanx ckpt show``) and
  retried until it exists, without a new save."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import msgpack
import pytest

from phalanx.bus import Bus
from phalanx.checkpoint import wire
from phalanx.checkpoint.catalog import Catalog
from phalanx.checkpoint.keeper import Keeper
from phalanx.checkpoint.tiers import RetryPolicy
from phalanx.metrics import ReplicationMetrics
from tests.integration.test_checkpoint import JOB, Cluster, in_thread, state_at
from tests.integration.test_checkpoint_node import call_as
from tests.integration.test_ckpt_cli import phalanx
from tests.procs import NOBODY

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (another uid)")


async def until(check: Callable[[], bool], what: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout_s:g} s waiting for {what}")
        await asyncio.sleep(0.05)


def socket_of(k: Keeper) -> str:
    return str(k.cfg.socket_path)


def reply_of(raw: bytes) -> dict[str, object]:
    (n,) = struct.unpack(">I", raw[:4])
    got = msgpack.unpackb(raw[4 : 4 + n], raw=False)
    assert isinstance(got, dict)
    return got


def rss_bytes() -> int:
    """This process's resident memory (the keepers run in it)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS in /proc/self/status")


# -- the ranks' socket ----------------------------------------------------------------------
class HugeSender(threading.Thread):
    """A caller announcing a frame of ``len(body) + 1`` bytes and sending all but its last
    byte (kernel buffers only: a memoryview of one shared buffer) -- ``sent`` once it did
    or was refused -- then reading the keeper's answer (``reply``, ``done``) and holding
    the connection until ``release`` is set."""

    def __init__(self, path: str, body: memoryview, release: threading.Event) -> None:
        super().__init__(daemon=True)
        self.path, self.body, self.release = path, body, release
        self.sent, self.done = threading.Event(), threading.Event()
        self.reply = b""

    def run(self) -> None:
        with socket.socket(socket.AF_UNIX) as s:
            s.settimeout(60)
            try:
                s.connect(self.path)
                s.sendall(struct.pack(">I", len(self.body) + 1))
                s.sendall(self.body)
            except OSError:  # refused: the keeper answered and closed
                pass
            self.sent.set()
            with contextlib.suppress(OSError):
                while chunk := s.recv(65536):
                    self.reply += chunk
                    if len(self.reply) >= 4 and len(self.reply) >= 4 + struct.unpack(">I", self.reply[:4])[0]:
                        break
            self.done.set()
            self.release.wait(120)


async def test_huge_requests_on_the_rank_socket_are_refused_unread(cluster: Cluster) -> None:
    k = await cluster.keeper("n1", replicas=0, shared_root=None)
    body = memoryview(bytearray((16 << 20) - 8))  # just under the wire's own frame bound
    release = threading.Event()
    senders = [HugeSender(socket_of(k), body, release) for _ in range(32)]  # what one uid may hold
    before = rss_bytes()
    try:
        for t in senders:
            t.start()
        await until(lambda: all(t.sent.is_set() for t in senders), "every request sent or refused")
        grown = rss_bytes() - before  # while every connection is still held
        await until(lambda: all(t.done.is_set() for t in senders), "every answer")
    finally:
        release.set()
        for t in senders:
            await in_thread(t.join, 60)
    assert grown < 128 << 20, f"the keeper grew by {grown >> 20} MiB for 32 refused requests"
    for t in senders:
        assert t.reply, "the keeper answered nothing"
        error = str(reply_of(t.reply)["error"])
        assert "over 1048576" in error and "PHALANX_KEEPER_MAX_REQUEST_BYTES" in error, error
    assert k.counters["rank_refused"] == 32
    listed = await in_thread(wire.call, socket_of(k), {"op": "list", "job": JOB}, 30.0)
    assert listed["ok"] is True  # still serving


async def test_a_request_over_the_cap_is_refused_with_a_clear_error(cluster: Cluster) -> None:
    k = await cluster.keeper("n1", replicas=0, shared_root=None)
    files = [f"{'f' * 100}/{i}" for i in range(12000)]  # ~1.2 MiB of names
    request = {
        "op": "register",
        "job": JOB,
        "step": 1,
        "dir": "/nowhere",
        "parts": [JOB + "=r0"],
        "files": files,
    }
    with pytest.raises(
        wire.WireError, match=r"over 1048576 \(the keeper's PHALANX_KEEPER_MAX_REQUEST_BYTES\)"
    ):
        await in_thread(wire.call, socket_of(k), request, 30.0)
    assert k.counters["rank_refused"] == 1


@needs_root
async def test_a_caller_of_another_uid_is_refused_before_it_sends_a_byte(cluster: Cluster) -> None:
    k = await cluster.keeper("n1", replicas=0, shared_root=None)
    got = await in_thread(call_as, NOBODY, socket_of(k), b"")  # connects, sends nothing
    assert got, "the keeper waited for a request from a uid no job runs as"
    error = str(reply_of(got)["error"])
    assert f"runs as uid {NOBODY}, which no job on this node runs as" in error, error
    # A huge frame from it: refused just the same, nothing read.
    got = await in_thread(call_as, NOBODY, socket_of(k), struct.pack(">I", 16 << 20) + b"\0" * 65536)
    assert f"runs as uid {NOBODY}" in str(reply_of(got)["error"])
    assert k.counters["rank_refused"] == 2


async def test_a_uid_holds_at_most_its_connections(cluster: Cluster) -> None:
    k = await cluster.keeper("n1", replicas=0, shared_root=None)
    held = []
    try:
        for _ in range(32):  # silent: each holds its slot until the keeper's read timeout
            s = socket.socket(socket.AF_UNIX)
            s.connect(socket_of(k))
            held.append(s)
        await until(lambda: k.ranks.limits.held(os.geteuid()) == 32, "the connections counted")
        with pytest.raises(wire.WireError, match=r"too many connections from one caller \(32 at once\)"):
            await in_thread(wire.call, socket_of(k), {"op": "list", "job": JOB}, 30.0)
    finally:
        for s in held:
            s.close()
    await until(lambda: k.ranks.limits.held() == 0, "the slots given back")
    listed = await in_thread(wire.call, socket_of(k), {"op": "list", "job": JOB}, 30.0)
    assert listed["ok"] is True


async def test_callers_that_go_away_leave_no_unhandled_exception(
    cluster: Cluster, caplog: pytest.LogCaptureFixture
) -> None:
    k = await cluster.keeper("n1", replicas=0, shared_root=None)
    caplog.set_level(logging.ERROR, logger="asyncio")
    for _ in range(8):  # half a frame, then gone: the keeper's answer finds no one
        with socket.socket(socket.AF_UNIX) as s:
            s.connect(socket_of(k))
            s.sendall(struct.pack(">I", 1000) + b"\x81" * 10)
    await until(lambda: k.counters.get("rank_dropped", 0) == 8, "the keeper done with the eight", 30.0)
    unhandled = [r.getMessage() for r in caplog.records if r.name == "asyncio"]
    assert not unhandled, unhandled


# -- the peers' port ------------------------------------------------------------------------
@dataclass
class Flooder:
    """Silent connections to ``addr`` from ``source``, each reconnecting once the keeper drops it."""

    addr: str
    source: str
    opened: float = 0.0  # when the open connection (if any) was made

    async def run(self) -> None:
        host, _, port = self.addr.rpartition(":")
        while True:
            try:
                reader, writer = await asyncio.open_connection(host, int(port), local_addr=(self.source, 0))
            except OSError:
                await asyncio.sleep(0.2)
                continue
            self.opened = time.monotonic()
            with contextlib.suppress(OSError):
                await reader.read()  # until the keeper drops it
            self.opened = 0.0
            writer.close()
            await asyncio.sleep(0.2)

    def holding(self, for_s: float) -> bool:
        return bool(self.opened) and time.monotonic() - self.opened > for_s


async def test_silent_connections_from_many_addresses_do_not_keep_a_peer_out(cluster: Cluster) -> None:
    n1 = await cluster.keeper("n1", shared_root=None, replicas=1)
    n2 = await cluster.keeper("n2", shared_root=None, replicas=1, auth_timeout_s=2.0)
    sources = [f"127.0.0.{i}" for i in range(2, 10)]
    flood = [Flooder(n2.addr, src) for src in sources for _ in range(12)]
    tasks = [asyncio.create_task(f.run()) for f in flood]
    try:
        # Every address holds (at least) four connections the keeper has not dropped.
        await until(
            lambda: all(sum(f.holding(0.3) for f in flood if f.source == src) >= 4 for src in sources),
            "the flood holding its connections",
        )
        assert cluster.rank("n1").save(state_at(3), 3) is not None
        await n1.scan_once()
        await n1.idle()
        assert (JOB, 3) in n2.memory, "the flood kept n1's replica out of n2"
        assert not n1.rec.replicas_missing
        assert n1.counters["replicated"] == 1
        # Addresses whose handshakes keep failing are turned away at once.
        await until(lambda: n2.counters.get("auth_throttled", 0) > 0, "the flooding addresses throttled")
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


# -- a replica that could not be made ---------------------------------------------------------
async def test_a_missing_replica_is_reported_and_retried_until_it_exists(
    cluster: Cluster, bus: Bus, nats_url: str
) -> None:
    fast = RetryPolicy(first_s=0.2, factor=2.0, max_s=1.0)
    n1 = await cluster.keeper("n1", shared_root=None, replicas=1, retry=fast)
    await cluster.keeper("n2", shared_root=None, replicas=1)
    await cluster.kill("n2")  # its registration stays: its port refuses
    metrics = ReplicationMetrics()
    n1.on_replicas = metrics.replicas_changed

    def gauge() -> float | None:
        return metrics.registry.get_sample_value("phalanx_checkpoint_replicas_missing", {"job": JOB})

    assert cluster.rank("n1").save(state_at(5), 5) is not None
    await n1.scan_once()
    await n1.idle()
    # Reported: an event, the metric, the catalog (what phalanx ckpt show prints).
    await until(
        lambda: any(
            e.step == 5 and e.state == "failed" and "replicas missing: 1 of 1" in e.detail
            for e in cluster.events
        ),
        "a replicas-missing event",
    )
    assert gauge() == 1
    assert n1.counters["replicas_short"] == 1
    shown = await phalanx(nats_url, "ckpt", "show", JOB, "5")
    assert shown.rc == 0, shown.err
    assert "replicas missing: 1 of 1" in shown.out and "(made on: none)" in shown.out, shown.out
    as_json = (await phalanx(nats_url, "ckpt", "show", JOB, "5", "--json")).json()
    assert as_json["replicas_missing"]["missing"] == 1 and as_json["replicas_missing"]["by"] == "n1"
    listed = await phalanx(nats_url, "ckpt", "list", JOB)
    assert "1 replica(s) missing" in listed.out, listed.out

    # n2 comes back (a new port in the catalog): the replica arrives, without a new save.
    n2 = await cluster.keeper("n2", shared_root=None, replicas=1)
    await until(lambda: (JOB, 5) in n2.memory, "the replica on n2")
    await until(lambda: not n1.rec.replicas_missing, "the shortfall settled")
    assert gauge() == 0
    assert n1.counters["retried"] >= 1

    async def record_gone() -> bool:
        return (await (await Catalog.open(bus)).entries(JOB))[5].replicas is None

    deadline = time.monotonic() + 30
    while not await record_gone():
        assert time.monotonic() < deadline, "the replicas record is still in the catalog"
        await asyncio.sleep(0.05)
    shown = await phalanx(nats_url, "ckpt", "show", JOB, "5")
    assert "replicas missing" not in shown.out, shown.out
