"""The generation communicator (phalanx.runtime.comm): store helpers, the abandonable
arrival barrier, collectives and the destroy cascade, with ranks as threads over a
real loopback TCPStore and gloo."""

from __future__ import annotations

import contextlib
import itertools
import os
import socket
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist

from phalanx.runtime.comm import (
    CommError,
    Communicator,
    Superseded,
    arrival_barrier,
    connect_store,
    host_store,
)

JOIN_S = 60.0  # generous: a hang shows up as a failure, never as a flaky timing
_prefixes = itertools.count()


@pytest.fixture(scope="module")
def store() -> Iterator[dist.TCPStore]:
    s = host_store()
    yield s


@pytest.fixture
def prefix() -> str:
    return f"test-comm/{next(_prefixes)}"


def _addr(store: dist.TCPStore) -> str:
    return f"127.0.0.1:{store.port}"


def run_ranks(n: int, fn: Callable[[int], Any], join_s: float = JOIN_S) -> list[Any]:
    """Run ``fn(rank)`` for ranks 0..n-1 in threads; each result is a value or the exception."""
    results: list[Any] = [None] * n

    def body(r: int) -> None:
        try:
            results[r] = fn(r)
        except BaseException as exc:
            results[r] = exc

    threads = [threading.Thread(target=body, args=(r,), daemon=True) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(join_s)
    hung = [r for r, t in enumerate(threads) if t.is_alive()]
    assert not hung, f"ranks {hung} still blocked after {join_s}s"
    return results


def _comm(store: dist.TCPStore, prefix: str, rank: int, n: int, timeout_s: float = 30.0) -> Communicator:
    client = connect_store(_addr(store))
    arrival_barrier(client, prefix, rank, n, lambda: False, timeout_s=JOIN_S)
    return Communicator(client, prefix, rank, n, timeout_s=timeout_s)


# -- connect_store -------------------------------------------------------------------------------


@pytest.mark.parametrize("addr", ["", "localhost", "localhost:", ":1234", "host:port", "host:12a", "1234"])
def test_connect_store_rejects_malformed_address(addr: str) -> None:
    with pytest.raises(ValueError, match="host:port"):
        connect_store(addr)


def test_connect_store_reaches_the_hosted_store(store: dist.TCPStore, prefix: str) -> None:
    client = connect_store(_addr(store))
    client.set(f"{prefix}/k", "v")
    assert store.get(f"{prefix}/k") == b"v"


# -- arrival_barrier -----------------------------------------------------------------------------


def test_arrival_barrier_returns_once_all_arrived(store: dist.TCPStore, prefix: str) -> None:
    def rank(r: int) -> bool:
        arrival_barrier(connect_store(_addr(store)), prefix, r, 3, lambda: False, timeout_s=JOIN_S)
        return True

    assert run_ranks(3, rank) == [True, True, True]


def test_arrival_barrier_superseded_when_cancelled(store: dist.TCPStore, prefix: str) -> None:
    calls = 0

    def cancelled() -> bool:
        nonlocal calls
        calls += 1
        return calls >= 3

    with pytest.raises(Superseded, match=prefix):
        arrival_barrier(store, prefix, 0, 2, cancelled, timeout_s=JOIN_S)
    assert calls == 3
    assert store.check([f"{prefix}/arrived/0"])  # it did announce itself


def test_arrival_barrier_times_out_naming_the_missing(store: dist.TCPStore, prefix: str) -> None:
    with pytest.raises(CommError, match=rf"{prefix}/arrived/1") as ei:
        arrival_barrier(store, prefix, 0, 2, lambda: False, timeout_s=0.05)
    assert f"{prefix}/arrived/0" not in str(ei.value)


# -- collectives ---------------------------------------------------------------------------------


@pytest.mark.parametrize("n", [2, 3])
def test_allreduce_sum(store: dist.TCPStore, prefix: str, n: int) -> None:
    def rank(r: int) -> torch.Tensor:
        comm = _comm(store, prefix, r, n)
        t = torch.tensor([float(r + 1), 10.0 * r, -1.0])
        comm.allreduce_sum_(t)
        comm.barrier()
        comm.destroy()
        return t

    want = torch.tensor([float(sum(range(1, n + 1))), 10.0 * sum(range(n)), -float(n)])
    for got in run_ranks(n, rank):
        assert torch.equal(got, want)


def test_send_recv_with_tags(store: dist.TCPStore, prefix: str) -> None:
    def rank(r: int) -> torch.Tensor | None:
        comm = _comm(store, prefix, r, 2)
        if r == 0:
            comm.send(torch.arange(4, dtype=torch.int64), 1, tag=7)
            comm.send(torch.full((2,), 9, dtype=torch.uint8), 1, tag=8)
            out = None
        else:
            # gloo's send waits for the matching recv, so the receiver goes in send order
            a, b = torch.zeros(4, dtype=torch.int64), torch.zeros(2, dtype=torch.uint8)
            comm.recv(a, 0, tag=7)
            comm.recv(b, 0, tag=8)
            out = torch.cat([a, b.to(torch.int64)])
        comm.barrier()
        comm.destroy()
        return out

    res = run_ranks(2, rank)
    assert res[0] is None
    assert res[1].tolist() == [0, 1, 2, 3, 9, 9]


def test_destroyed_communicator_refuses_use(store: dist.TCPStore, prefix: str) -> None:
    comm = _comm(store, prefix, 0, 1)
    t = torch.ones(2)
    comm.allreduce_sum_(t)
    assert t.tolist() == [1.0, 1.0]
    comm.destroy()
    with pytest.raises(CommError, match="destroyed"):
        comm.allreduce_sum_(t)


@pytest.mark.parametrize("n", [2, 3, 4])
def test_destroy_cascades_to_peers_blocked_in_allreduce(store: dist.TCPStore, prefix: str, n: int) -> None:
    """Rank 0 leaves without joining the collective; every peer blocked in it fails.

    The per-op timeout is far above the join timeout, so only the cascade (closed
    sockets), not the timeout backstop, can release the peers in time.
    """
    built = threading.Barrier(n)

    def rank(r: int) -> str:
        comm = _comm(store, prefix, r, n, timeout_s=10 * JOIN_S)
        built.wait(JOIN_S)
        if r == 0:
            comm.destroy()
            return "left"
        t = torch.ones(3)
        try:
            comm.allreduce_sum_(t)
        except CommError as exc:
            with pytest.raises(CommError):  # the failed communicator is dead for good
                comm.allreduce_sum_(t)
            return f"CommError: {exc}"
        return "completed"

    res = run_ranks(n, rank)
    assert res[0] == "left"
    for r in range(1, n):
        assert isinstance(res[r], str) and res[r].startswith("CommError: allreduce on"), (r, res[r])


# -- listening only on the node's interface ------------------------------------------------------
def _reachable(host: str, port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(2.0)
        return s.connect_ex((host, port)) == 0


def _listening_ports() -> dict[int, str]:
    """This process's listening TCP sockets: port -> local address (from /proc, no tools)."""
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            target = os.readlink(f"/proc/self/fd/{fd}")
            if target.startswith("socket:["):
                inodes.add(target[8:-1])
    out = {}
    for line in open("/proc/self/net/tcp").read().splitlines()[1:]:
        parts = line.split()
        local, state, inode = parts[1], parts[3], parts[9]
        if state == "0A" and inode in inodes:  # 0A: LISTEN
            hexip, hexport = local.split(":")
            out[int(hexport, 16)] = socket.inet_ntoa(bytes.fromhex(hexip)[::-1])
    return out


def test_host_store_listens_on_its_address_only() -> None:
    s = host_store("127.0.0.1")
    assert _reachable("127.0.0.1", s.port)
    # 127.0.0.2 is this host too: a store bound to every interface would answer there
    assert not _reachable("127.0.0.2", s.port)
    assert _listening_ports()[s.port] == "127.0.0.1"


def test_gloo_binds_the_address_it_is_given(prefix: str) -> None:
    s = host_store("127.0.0.1")
    before = set(_listening_ports())

    def build(rank: int) -> Communicator:
        client = connect_store(f"127.0.0.1:{s.port}")
        arrival_barrier(client, prefix, rank, 2, lambda: False, timeout_s=JOIN_S)
        return Communicator(client, prefix, rank, 2, timeout_s=30.0, bind="127.0.0.1")

    comms = run_ranks(2, build)
    try:
        opened = {p: a for p, a in _listening_ports().items() if p not in before}
        assert opened and set(opened.values()) == {"127.0.0.1"}, opened
    finally:
        for c in comms:
            c.destroy()
