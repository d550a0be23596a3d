"""The rendezvous (phalanx.runtime.rendezvous, through phalanx.runtime.comm's
arrival_barrier): the counted arrival and the polled one over real loopback
TCPStores (ranks as threads), its failures (a missing rank named, a newer plan, a
store that dies), the generation's secret on every key, keys spread over several
stores under real gloo, and gloo's lazy pairs behind the runtime's Group."""

from __future__ import annotations

import itertools
import subprocess
import sys
import threading
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.distributed as dist

from phalanx.runtime import rendezvous
from phalanx.runtime.comm import (
    CommError,
    Group,
    Superseded,
    arrival_barrier,
    generation_store,
)
from phalanx.runtime.comm import connect_store as connect_unproved
from phalanx.runtime.rendezvous import SpreadStore, Waiters
from phalanx.runtime.storeclient import StoreClient
from phalanx.runtime.storeserver import ThreadedStore
from tests.stores import hosted, member
from tests.unit.test_comm import JOIN_S, run_ranks

ROOT = "test-rdv"  # the secret the raw clients prove: keys under test-rdv/ are theirs

_prefixes = itertools.count()
BIG = rendezvous.COUNTED_FROM  # the smallest world that takes the counted path


@pytest.fixture(scope="module")
def store() -> Iterator[ThreadedStore]:
    s = hosted(ROOT, "rdv-s3cret")
    yield s
    s.close()


def connect_store(addr: str) -> StoreClient:
    """A client with this module's keys (``test-rdv/...``)."""
    return member(addr, ROOT)


@pytest.fixture
def prefix() -> str:
    return f"test-rdv/{next(_prefixes)}"


def _addr(store: Any) -> str:
    return f"127.0.0.1:{store.port}"


def _pooled(addr: str, secret: str | None = None) -> tuple[Waiters, Any]:
    """A waiter pool of ``addr`` and the ``waiter`` callable arrival_barrier takes: its
    clients under ``secret`` (generation_store), or raw ones of this module's keys."""
    waiters = Waiters(lambda: connect_unproved(addr) if secret else connect_store(addr))

    def waiter() -> tuple[dist.Store, Any]:
        client = waiters.take()
        return (generation_store(client, secret) if secret else client), lambda: waiters.give(client)

    return waiters, waiter


@pytest.mark.parametrize("n", [3, BIG])  # polled, counted
def test_every_member_returns_once_all_arrived(store: ThreadedStore, prefix: str, n: int) -> None:
    def rank(r: int) -> bool:
        _, waiter = _pooled(_addr(store))
        arrival_barrier(connect_store(_addr(store)), prefix, r, n, lambda: False, JOIN_S, waiter)
        return True

    assert run_ranks(n, rank) == [True] * n
    if n >= BIG:
        client = connect_store(_addr(store))
        assert client.add(f"{prefix}/arrived/count", 0) == n
        assert client.check([f"{prefix}/arrived/done"])


def test_a_missing_member_times_out_naming_it_alone(store: ThreadedStore, prefix: str) -> None:
    absent = 7
    members = [r for r in range(BIG) if r != absent]
    clients = {r: connect_store(_addr(store)) for r in members}  # connected first: only the wait is timed
    spares = {r: _pooled(_addr(store)) for r in members}
    for waiters, _ in spares.values():
        waiters.give(waiters.take())

    def rank(i: int) -> Any:
        r = members[i]
        arrival_barrier(clients[r], prefix, r, BIG, lambda: False, 2.0, spares[r][1])

    results = run_ranks(len(members), rank)
    for error in results:
        assert isinstance(error, CommError), results
        assert f"timed out waiting for ['{prefix}/arrived/{absent}']" in str(error), error


def test_missing_bisects_to_exactly_the_absent_keys(store: ThreadedStore, prefix: str) -> None:
    keys = rendezvous.arrival_keys(prefix, 40)
    client = connect_store(_addr(store))
    for i, key in enumerate(keys):
        if i not in (0, 17, 39):
            client.set(key, "1")
    assert rendezvous.missing(client, keys) == [keys[0], keys[17], keys[39]]
    assert rendezvous.missing(client, keys[1:17]) == []


def test_a_newer_plan_ends_the_wait_and_the_pool_recovers_its_client(
    store: ThreadedStore, prefix: str
) -> None:
    """cancelled() is asked while the store's wait runs in the helper; Superseded ends
    it, and the next generation on the same pool gets a working client at once."""
    calls = 0

    def cancelled() -> bool:
        nonlocal calls
        calls += 1
        return calls >= 3

    client = connect_store(_addr(store))
    _, waiter = _pooled(_addr(store))
    with pytest.raises(Superseded, match=prefix):
        arrival_barrier(client, prefix, 0, BIG, cancelled, JOIN_S, waiter)
    assert calls == 3
    assert client.check([f"{prefix}/arrived/0"]) and client.add(f"{prefix}/arrived/count", 0) == 1
    nxt = f"{prefix}-next"  # the abandoned wait still holds its client: the pool makes another

    def rank(r: int) -> bool:
        own = client if r == 0 else connect_store(_addr(store))
        arrival_barrier(own, nxt, r, BIG, lambda: False, JOIN_S, waiter if r == 0 else None)
        return True

    assert run_ranks(BIG, rank) == [True] * BIG


def _store_process() -> tuple[subprocess.Popen[bytes], str]:
    """A store in a process of its own, started the way the launcher starts it."""
    from phalanx.worker.addr import listen_socket

    sock = listen_socket("127.0.0.1", 0)
    port = sock.getsockname()[1]
    proc = subprocess.Popen(
        [sys.executable, "-m", "phalanx.runtime.store", "--fd", str(sock.fileno()), "--host", "127.0.0.1"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        pass_fds=(sock.fileno(),),
    )
    sock.close()
    assert proc.stdout is not None and proc.stdout.readline().startswith(b"ready ")
    assert proc.stdin is not None
    proc.stdin.write(f"allow {ROOT}\n".encode())  # what the launcher writes for each plan
    proc.stdin.flush()
    return proc, f"127.0.0.1:{port}"


@pytest.mark.parametrize("n", [2, BIG])  # polled, counted
def test_a_store_that_dies_during_the_wait_is_a_comm_error(prefix: str, n: int) -> None:
    proc, addr = _store_process()
    try:
        client = connect_store(addr)
        _, waiter = _pooled(addr)
        asked = threading.Event()

        def cancelled() -> bool:
            asked.set()  # the member is waiting: now the store goes
            return False

        def member(_: int) -> None:
            arrival_barrier(client, prefix, 0, n, cancelled, JOIN_S, waiter)

        def kill() -> None:
            asked.wait(JOIN_S)
            proc.kill()

        killer = threading.Thread(target=kill, daemon=True)
        killer.start()
        [error] = run_ranks(1, member)
        assert isinstance(error, CommError) and "the store failed" in str(error), error
    finally:
        proc.kill()
        proc.wait()


def test_every_key_of_the_counted_arrival_lives_under_the_secret(store: ThreadedStore, prefix: str) -> None:
    secret = "rdv-s3cret"

    def rank(r: int) -> bool:
        _, waiter = _pooled(_addr(store), secret)
        client = generation_store(connect_store(_addr(store)), secret)
        arrival_barrier(client, prefix, r, BIG, lambda: False, JOIN_S, waiter)
        return True

    assert run_ranks(BIG, rank) == [True] * BIG
    held, outside = set(store.keys(secret)), set(store.keys(ROOT))
    for key in ("arrived/count", "arrived/done", "arrived/0", f"arrived/{BIG - 1}"):
        assert f"{prefix}/{key}" in held, key
        assert f"{prefix}/{key}" not in outside, key


def test_keys_spread_over_stores_carry_the_secret_and_serve_real_gloo() -> None:
    """gloo (eager and lazy) bootstraps through PrefixStore -> the secret -> a
    SpreadStore over two stores; each store holds some of the keys, all under the secret."""
    secret = "spread-s3cret"
    stores = [hosted(secret), hosted(secret)]
    addrs = [_addr(s) for s in stores]
    n = 4
    for lazy in (False, True):
        pre = f"test-spread/lazy{int(lazy)}"  # fixed: these names route to both stores, each run

        def rank(r: int, pre: str = pre, lazy: bool = lazy) -> float:
            keys = SpreadStore(addrs, connect_unproved)  # held: torch keeps only its C++ half
            spread = generation_store(keys, secret)
            opts = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
            opts._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1", lazy_init=lazy)]  # type: ignore[attr-defined]
            pg = dist.ProcessGroupGloo(dist.PrefixStore(f"{pre}/pg", spread), r, n, opts)
            t = torch.full((3,), float(r + 1))
            pg.allreduce([t]).wait()  # type: ignore[attr-defined]  # a backend's ops, not in the stubs
            pg.barrier().wait()  # type: ignore[attr-defined]
            del keys, pg
            return float(t[0])

        assert run_ranks(n, rank) == [10.0] * n
        held = [[k for k in s.keys(secret) if pre in k] for s in stores]
        assert all(held), held  # both stores hold some of gloo's keys (blake2b of their names)
        assert all(k.startswith(f"{pre}/pg/") for k in itertools.chain(*held)), held
        assert len(set(itertools.chain(*held))) == sum(map(len, held)), held  # each on one store only


def test_plan_stores_spreads_only_large_worlds_root_first_bounded() -> None:
    many = [f"10.0.0.{i}:1" for i in range(100)]

    def plan(n: int, extra: list[str] | None) -> Any:
        p = SimpleNamespace(store_addr="10.0.0.1:1", world_size=n)
        if extra is not None:
            p.store_addrs = extra
        return p

    big = rendezvous.SPREAD_FROM
    assert rendezvous.plan_stores(plan(big, None)) == ["10.0.0.1:1"]  # the contract does not carry it yet
    assert rendezvous.plan_stores(plan(big - 1, many)) == ["10.0.0.1:1"]
    spread = rendezvous.plan_stores(plan(big, [*many, *many]))
    assert spread[0] == "10.0.0.1:1" and len(spread) == rendezvous.MAX_STORES == len(set(spread))


def test_a_large_world_gets_lazy_gloo_pairs_that_still_reduce_and_cascade(
    store: ThreadedStore, prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """From LAZY_FROM ranks the runtime's Group connects pairs on first use (lowered
    here to 3 ranks): all-reduce, barrier and send/recv work, and a destroyed member
    still fails its peers' next op (CommError), not a hang."""
    monkeypatch.setattr(rendezvous, "LAZY_FROM", 3)
    assert rendezvous.lazy_gloo(3) and not rendezvous.lazy_gloo(2)
    n = 3

    def rank(r: int) -> Any:
        client = connect_store(_addr(store))
        arrival_barrier(client, prefix, r, n, lambda: False, JOIN_S)
        group = Group(client, prefix, r, n, timeout_s=JOIN_S, bind="127.0.0.1")
        t = torch.ones(2)
        group.allreduce_sum_(t)
        group.barrier()
        if r == 0:
            group.send(torch.tensor([42.0]), dst=2)
        if r == 2:
            got = torch.zeros(1)
            group.recv(got, src=0)
            assert got.item() == 42.0
        group.barrier()
        if r == 1:
            group.destroy()
            return "gone"
        try:
            group.allreduce_sum_(torch.ones(1), timeout_s=JOIN_S)
        except CommError:
            return float(t[0])
        return "no error"

    assert run_ranks(n, rank) == [3.0, "gone", 3.0]
