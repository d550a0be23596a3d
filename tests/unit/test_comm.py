"""The communicator (phalanx.runtime.comm): store helpers, the abandonable arrival
barrier, a generation's group (collectives and the destroy cascade), and the
long-lived Communicator re-pointed from one generation to the next, each of its
phases under its bound, with ranks as threads over Phalanx's store on loopback and
gloo; backend choice by device, abort on gloo, and (skipped without GPUs) NCCL
beside gloo and its real abort."""

from __future__ import annotations

import contextlib
import itertools
import os
import socket
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist

from phalanx.contract import Member, Plan
from phalanx.runtime import storeserver
from phalanx.runtime.comm import (
    CommError,
    Communicator,
    Group,
    Superseded,
    arrival_barrier,
    backend_for,
    generation_store,
)
from phalanx.runtime.comm import connect_store as connect_unproved
from phalanx.runtime.store import host_store
from phalanx.runtime.storeclient import StoreClient
from phalanx.runtime.storeserver import ThreadedStore
from tests.stores import hosted, member

ROOT = "test-comm"  # the secret the raw clients prove: keys under test-comm/ are theirs
SECRETS = (ROOT, "s1", "s2", "s3", "s3cret-of-gen-1", "s3cret-of-gen-2", "s3cret-never-shown")

JOIN_S = 60.0  # generous: a hang shows up as a failure, never as a flaky timing
_prefixes = itertools.count()


@pytest.fixture(scope="module")
def store() -> Iterator[ThreadedStore]:
    s = hosted(*SECRETS)
    yield s
    s.close()


def connect_store(addr: str, timeout_s: float = 30.0) -> StoreClient:
    """A client with this module's keys (``test-comm/...``)."""
    return member(addr, ROOT, timeout_s)


@pytest.fixture
def prefix() -> str:
    return f"test-comm/{next(_prefixes)}"


def _addr(store: ThreadedStore) -> str:
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


def together(n: int) -> threading.Barrier:
    """Where the ranks' threads wait before they destroy their groups. Here the ranks are
    threads of one process, so a group's destroy cuts every socket that appeared while it
    was built, the other ranks' too (SocketSet's documented limit; a job runs one rank per
    process): a thread that destroyed its group before its peers had read the last op's
    data broke their op, about one try in ten of a 3-rank barrier."""
    return threading.Barrier(n, timeout=JOIN_S)


def _comm(store: ThreadedStore, prefix: str, rank: int, n: int, timeout_s: float = 30.0) -> Group:
    client = connect_store(_addr(store))
    arrival_barrier(client, prefix, rank, n, lambda: False, timeout_s=JOIN_S)
    return Group(client, prefix, rank, n, timeout_s=timeout_s)


def _plan(store: ThreadedStore, generation: int, workers: list[str], secret: str = ROOT) -> Plan:
    return Plan(
        job="j1",
        generation=generation,
        members=[Member(worker=w, rank=r) for r, w in enumerate(workers)],
        reason="test",
        store_prefix=f"test-comm/j1/gen{generation}-{next(_prefixes)}",
        store_secret=secret,
        store_addr=_addr(store),
    )


# -- connect_store -------------------------------------------------------------------------------


@pytest.mark.parametrize("addr", ["", "localhost", "localhost:", ":1234", "host:port", "host:12a", "1234"])
def test_connect_store_rejects_malformed_address(addr: str) -> None:
    with pytest.raises(ValueError, match="host:port"):
        connect_unproved(addr)


def test_connect_store_reaches_the_hosted_store(store: ThreadedStore, prefix: str) -> None:
    client = connect_store(_addr(store))
    client.set(f"{prefix}/k", "v")
    assert connect_store(_addr(store)).get(f"{prefix}/k") == b"v"


# -- arrival_barrier -----------------------------------------------------------------------------


def test_arrival_barrier_returns_once_all_arrived(store: ThreadedStore, prefix: str) -> None:
    def rank(r: int) -> bool:
        arrival_barrier(connect_store(_addr(store)), prefix, r, 3, lambda: False, timeout_s=JOIN_S)
        return True

    assert run_ranks(3, rank) == [True, True, True]


def test_arrival_barrier_superseded_when_cancelled(store: ThreadedStore, prefix: str) -> None:
    calls = 0

    def cancelled() -> bool:
        nonlocal calls
        calls += 1
        return calls >= 3

    client = connect_store(_addr(store))
    with pytest.raises(Superseded, match=prefix):
        arrival_barrier(client, prefix, 0, 2, cancelled, timeout_s=JOIN_S)
    assert calls == 3
    assert client.check([f"{prefix}/arrived/0"])  # it did announce itself


def test_arrival_barrier_times_out_naming_the_missing(store: ThreadedStore, prefix: str) -> None:
    with pytest.raises(CommError, match=rf"{prefix}/arrived/1") as ei:
        arrival_barrier(connect_store(_addr(store)), prefix, 0, 2, lambda: False, timeout_s=0.05)
    assert f"{prefix}/arrived/0" not in str(ei.value)


# -- collectives ---------------------------------------------------------------------------------


@pytest.mark.parametrize("n", [2, 3])
def test_allreduce_sum(store: ThreadedStore, prefix: str, n: int) -> None:
    done = together(n)

    def rank(r: int) -> torch.Tensor:
        comm = _comm(store, prefix, r, n)
        t = torch.tensor([float(r + 1), 10.0 * r, -1.0])
        comm.allreduce_sum_(t)
        comm.barrier()
        done.wait()
        comm.destroy()
        return t

    want = torch.tensor([float(sum(range(1, n + 1))), 10.0 * sum(range(n)), -float(n)])
    for got in run_ranks(n, rank):
        assert torch.equal(got, want)


def test_send_recv_with_tags(store: ThreadedStore, prefix: str) -> None:
    done = together(2)

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
        done.wait()
        comm.destroy()
        return out

    res = run_ranks(2, rank)
    assert res[0] is None
    assert res[1].tolist() == [0, 1, 2, 3, 9, 9]


def test_destroyed_communicator_refuses_use(store: ThreadedStore, prefix: str) -> None:
    comm = _comm(store, prefix, 0, 1)
    t = torch.ones(2)
    comm.allreduce_sum_(t)
    assert t.tolist() == [1.0, 1.0]
    comm.destroy()
    with pytest.raises(CommError, match="destroyed"):
        comm.allreduce_sum_(t)


@pytest.mark.parametrize("n", [2, 3, 4])
def test_destroy_cascades_to_peers_blocked_in_allreduce(store: ThreadedStore, prefix: str, n: int) -> None:
    """Rank 0 leaves without joining the collective; every peer blocked in it fails.

    The per-op timeout is far above the join timeout, so only the cascade (closed
    sockets), not the timeout backstop, can release the peers in time.
    """
    built = threading.Barrier(n)
    left: list[float] = []

    def rank(r: int) -> str:
        comm = _comm(store, prefix, r, n, timeout_s=10 * JOIN_S)
        built.wait(JOIN_S)
        if r == 0:
            left.append(time.time())
            comm.destroy()
            return "left"
        t = torch.ones(3)
        try:
            comm.allreduce_sum_(t)
        except CommError as exc:
            time.sleep(0.2)  # a user's loop runs the rest of its step before it recovers
            # ``at`` is when the collective failed (its recovery's abort starts there)
            assert left[0] <= exc.at < time.time() - 0.15
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
    s = host_store("127.0.0.1", secrets=(ROOT,))
    assert _reachable("127.0.0.1", s.port)
    # 127.0.0.2 is this host too: a store bound to every interface would answer there
    assert not _reachable("127.0.0.2", s.port)
    assert _listening_ports()[s.port] == "127.0.0.1"


def test_gloo_binds_the_address_it_is_given(prefix: str) -> None:
    s = host_store("127.0.0.1", secrets=(ROOT,))
    before = set(_listening_ports())

    def build(rank: int) -> Group:
        client = connect_store(f"127.0.0.1:{s.port}")
        arrival_barrier(client, prefix, rank, 2, lambda: False, timeout_s=JOIN_S)
        return Group(client, prefix, rank, 2, timeout_s=30.0, bind="127.0.0.1")

    comms = run_ranks(2, build)
    try:
        opened = {p: a for p, a in _listening_ports().items() if p not in before}
        assert opened and set(opened.values()) == {"127.0.0.1"}, opened
    finally:
        for c in comms:
            c.destroy()


# -- the generation's secret ---------------------------------------------------------------------


def test_without_the_generations_secret_a_client_neither_sees_nor_forges_its_keys(
    store: ThreadedStore, prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Members prove the plan's ``store_secret`` (generation_store), meet and all-reduce.
    A client with the store's address and the plan's ``store_prefix`` but not the secret
    (another job's rank, anyone on the network) is refused; the secret of an earlier
    generation (a fenced member's) opens only that generation's keys, so what it plants
    is not taken for a member's arrival. The wire-level attacks are test_storeserver's."""
    secret, old_secret = "s3cret-of-gen-2", "s3cret-of-gen-1"
    monkeypatch.setattr(storeserver, "LEARN_S", 0.2)  # how long an unknown secret's proof waits
    with pytest.raises(dist.DistStoreError, match="authentication failed"):
        generation_store(connect_unproved(_addr(store)), "a-guess")
    fenced = generation_store(connect_unproved(_addr(store)), old_secret)
    arrived = [f"{prefix}/arrived/{r}" for r in range(2)]
    fenced.set(arrived[1], "forged")
    lone = generation_store(connect_unproved(_addr(store)), secret)
    with pytest.raises(CommError, match="timed out"):  # the plant does not complete rank 0's barrier
        arrival_barrier(lone, prefix, 0, 2, lambda: False, timeout_s=0.5)

    done = together(2)

    def rank(r: int) -> list[float]:
        client = generation_store(connect_unproved(_addr(store)), secret)
        arrival_barrier(client, prefix, r, 2, lambda: False, timeout_s=JOIN_S)
        comm = Group(client, prefix, r, 2)
        t = torch.full((2,), float(r + 1))
        comm.allreduce_sum_(t)
        done.wait()
        comm.destroy()
        return t.tolist()

    assert run_ranks(2, rank) == [[3.0, 3.0], [3.0, 3.0]]
    assert fenced.get(arrived[1]) == b"forged"  # the plant stayed in the old generation
    assert generation_store(connect_unproved(_addr(store)), secret).get(arrived[1]) != b"forged"
    with pytest.raises(ValueError, match="no store secret"):
        generation_store(connect_unproved(_addr(store)), "")


def test_a_failed_rendezvous_names_its_prefix_never_its_secret(store: ThreadedStore, prefix: str) -> None:
    """torch names the key it waited for in full; the CommError (what is logged and
    published) shows it from the prefix on, without the secret."""
    secret = "s3cret-never-shown"
    alone = generation_store(connect_unproved(_addr(store), timeout_s=1.0), secret)
    with pytest.raises(CommError) as caught:
        Group(alone, prefix, 0, 2, timeout_s=1.0)  # rank 1 never comes
    text = str(caught.value)
    assert f"{prefix}/" in text and secret not in text, text
    assert secret not in "".join(traceback.format_exception(caught.value))  # a logged traceback too


# -- devices and backends ------------------------------------------------------------------------

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
needs_2_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")


def test_backend_for_cpu_is_gloo() -> None:
    assert backend_for(torch.device("cpu")) == "gloo"
    assert backend_for(torch.device("cpu", 0)) == "gloo"


def test_backend_for_cuda_is_nccl_or_a_clear_error() -> None:
    if dist.is_nccl_available():
        assert backend_for(torch.device("cuda")) == "nccl"
        assert backend_for(torch.device("cuda", 3)) == "nccl"  # no GPU is touched to decide
    else:
        with pytest.raises(ValueError, match="needs NCCL"):
            backend_for(torch.device("cuda"))


@pytest.mark.parametrize("device", ["meta", "mps", "xpu", "hpu"])
def test_backend_for_refuses_other_devices(device: str) -> None:
    with pytest.raises(ValueError, match=f"no communication backend for device {device}"):
        backend_for(torch.device(device))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a machine without CUDA")
def test_communicator_on_cuda_without_cuda_is_a_clear_error(store: ThreadedStore, prefix: str) -> None:
    """Refused before anything is built: with world size 2 and no peer, building gloo
    first would block for the timeout and fail with CommError instead."""
    client = connect_store(_addr(store))
    with pytest.raises(ValueError, match=r"NCCL|no CUDA device"):
        Group(client, prefix, 0, 2, timeout_s=5.0, device=torch.device("cuda"))
    with pytest.raises(ValueError, match="no communication backend"):
        Group(client, prefix, 0, 2, timeout_s=5.0, device=torch.device("meta"))


def test_cpu_device_is_the_default_path(store: ThreadedStore, prefix: str) -> None:
    done = together(2)

    def rank(r: int) -> tuple[torch.device, torch.Tensor]:
        client = connect_store(_addr(store))
        arrival_barrier(client, prefix, r, 2, lambda: False, timeout_s=JOIN_S)
        comm = Group(client, prefix, r, 2, 30.0, None, torch.device("cpu"))
        t = torch.tensor([float(r + 1)])
        comm.allreduce_sum_(t)
        done.wait()
        comm.destroy()
        return comm.device, t

    for device, t in run_ranks(2, rank):
        assert device == torch.device("cpu") and t.tolist() == [3.0]
    default = Group(dist.HashStore(), "p", 0, 1)
    assert default.device == torch.device("cpu")
    default.destroy()


def test_abort_on_gloo_is_harmless_and_final() -> None:
    comm = Group(dist.HashStore(), "abort-idle", 0, 1, timeout_s=5.0)
    t = torch.ones(2)
    comm.allreduce_sum_(t)
    comm.abort()
    comm.abort()  # idempotent, never raises
    assert comm.aborted
    with pytest.raises(CommError, match="aborted"):
        comm.allreduce_sum_(t)
    with pytest.raises(CommError, match="destroyed"):  # the failed op destroyed it
        comm.barrier()
    comm.destroy()
    comm.abort()  # after destroy too


def test_abort_on_gloo_releases_an_op_in_flight_and_its_peer(store: ThreadedStore, prefix: str) -> None:
    """gloo's own abort() does nothing to an op in flight; Group.abort() cuts the
    group's sockets: the allreduce blocked in another thread fails at once, long
    before its per-op timeout, and so does the peer's op with this rank."""
    built = threading.Barrier(2)
    timings: dict[str, float] = {}

    def rank(r: int) -> str:
        comm = peer_comm[r] = _comm(store, prefix, r, 2, timeout_s=JOIN_S)
        built.wait(JOIN_S)
        if r == 0:  # never joins the allreduce: aborts its peer's group from here
            time.sleep(0.3)
            t0 = time.monotonic()
            peer_comm[1].abort()
            timings["abort_s"] = time.monotonic() - t0
            try:  # its own pair with the peer was cut under it: a recv fails at once
                comm.recv(torch.zeros(3), 1, timeout_s=JOIN_S)
            except CommError as exc:
                return f"CommError: {exc}"
            return "received"
        t0 = time.monotonic()
        try:
            comm.allreduce_sum_(torch.ones(3), timeout_s=JOIN_S)
        except CommError as exc:
            timings["op_s"] = time.monotonic() - t0
            return f"CommError: {exc}"
        return "completed"

    peer_comm: dict[int, Group] = {}
    res = run_ranks(2, rank)
    assert res[1].startswith("CommError: allreduce on") and "aborted" in res[1], res[1]
    assert res[0].startswith("CommError: recv from 1"), res[0]
    assert timings["op_s"] < JOIN_S / 2, timings  # the abort ended it, not its bound


# -- real CUDA (skipped without GPUs) ------------------------------------------------------------


@needs_cuda
def test_cuda_communicator_dispatches_by_tensor_device() -> None:
    comm = Group(dist.HashStore(), "cuda-1", 0, 1, timeout_s=30.0, device=torch.device("cuda"))
    assert comm.device == torch.device("cuda", torch.cuda.current_device())
    on_gpu = torch.ones(4, device=comm.device)
    on_cpu = torch.ones(4)
    comm.allreduce_sum_(on_gpu)
    comm.allreduce_sum_(on_cpu)
    comm.barrier()
    assert on_gpu.device.type == "cuda" and on_gpu.tolist() == [1.0] * 4
    assert on_cpu.tolist() == [1.0] * 4
    comm.abort()
    with pytest.raises(CommError, match="aborted"):
        comm.allreduce_sum_(on_gpu)
    comm.destroy()


@needs_2_gpus
def test_nccl_abort_releases_an_allreduce_blocked_in_another_thread(
    store: ThreadedStore, prefix: str
) -> None:
    built = threading.Barrier(2)
    comms: dict[int, Group] = {}
    timings: dict[str, float] = {}

    def rank(r: int) -> str:
        torch.cuda.set_device(r)
        client = connect_store(_addr(store))
        arrival_barrier(client, prefix, r, 2, lambda: False, timeout_s=JOIN_S)
        comm = comms[r] = Group(client, prefix, r, 2, timeout_s=10 * JOIN_S, device=torch.device("cuda", r))
        built.wait(JOIN_S)
        if r == 0:  # never joins; aborts the peer from here
            time.sleep(1.0)
            comms[1].abort()
            comm.destroy()
            return "left"
        t0 = time.monotonic()
        try:
            comm.allreduce_sum_(torch.ones(1 << 20, device=comm.device))
        except CommError as exc:
            timings["op_s"] = time.monotonic() - t0
            return f"CommError: {exc}"
        return "completed"

    res = run_ranks(2, rank)
    assert res[0] == "left"
    assert res[1].startswith("CommError: allreduce on"), res[1]
    assert timings["op_s"] < JOIN_S, timings  # released by the abort, far before the op timeout


# -- the long-lived Communicator -----------------------------------------------------------------


def test_one_communicator_is_re_pointed_from_generation_to_generation(store: ThreadedStore) -> None:
    """The same objects go through generations of 3, then 2 ranks (one left), then 3
    again (a joiner): each configure() reaches that generation's members only."""
    workers = ["w0", "w1", "w2", "w3"]
    comms = {w: Communicator(w, _addr(store), backstop_s=JOIN_S) for w in workers}
    plans = [
        _plan(store, 1, ["w0", "w1", "w2"], secret="s1"),
        _plan(store, 2, ["w0", "w2"], secret="s2"),
        _plan(store, 3, ["w0", "w3", "w2"], secret="s3"),
    ]
    seen: dict[str, list[tuple[int, int, int, float]]] = {w: [] for w in workers}
    connecting: list[tuple[str, int]] = []

    def member(w: str, plan: Plan) -> None:
        comm = comms[w]
        comm.configure(
            plan,
            cancelled=lambda: False,
            arrival_s=JOIN_S,
            connect_s=JOIN_S,
            connecting=lambda: connecting.append((w, plan.generation)),
        )
        t = torch.tensor([float(comm.rank + 1)])
        comm.allreduce_sum_(t, timeout_s=JOIN_S)
        comm.barrier(timeout_s=JOIN_S)
        seen[w].append((comm.generation, comm.rank, comm.world_size, float(t.item())))

    for plan in plans:
        names = [m.worker for m in plan.members]
        results = run_ranks(len(names), lambda r, names=names, plan=plan: member(names[r], plan))
        assert all(r is None for r in results), results
    assert seen["w0"] == [(1, 0, 3, 6.0), (2, 0, 2, 3.0), (3, 0, 3, 6.0)]
    assert seen["w2"] == [(1, 2, 3, 6.0), (2, 1, 2, 3.0), (3, 2, 3, 6.0)]
    assert seen["w1"] == [(1, 1, 3, 6.0)] and seen["w3"] == [(3, 1, 3, 6.0)]
    assert sorted(connecting) == sorted((m.worker, p.generation) for p in plans for m in p.members)
    assert len(comms["w0"]._stores) == 1  # the store is connected once, kept for later generations
    for comm in comms.values():
        comm.release()
        comm.release()  # idempotent
        assert not comm.configured
        with pytest.raises(CommError, match="between generations"):
            comm.allreduce_sum_(torch.ones(1))


def test_configure_refuses_a_plan_without_this_worker(store: ThreadedStore) -> None:
    comm = Communicator("w9", _addr(store))
    with pytest.raises(ValueError, match="no member"):
        comm.configure(_plan(store, 1, ["w0"]), cancelled=lambda: False, arrival_s=1.0, connect_s=1.0)


def test_a_rendezvous_is_bounded_and_abandonable(store: ThreadedStore) -> None:
    """Waiting for a member that never arrives ends at the arrival bound (CommError)
    or at once when a newer plan supersedes it; either way no group is held."""
    comm = Communicator("w0", _addr(store), backstop_s=JOIN_S)
    t0 = time.monotonic()
    with pytest.raises(CommError, match="timed out"):
        comm.configure(
            _plan(store, 1, ["w0", "w1"]), cancelled=lambda: False, arrival_s=0.3, connect_s=JOIN_S
        )
    assert time.monotonic() - t0 < 5.0
    assert not comm.configured
    with pytest.raises(Superseded):
        comm.configure(
            _plan(store, 2, ["w0", "w1"]), cancelled=lambda: True, arrival_s=JOIN_S, connect_s=JOIN_S
        )
    assert not comm.configured


def test_connecting_to_a_member_hung_after_its_arrival_ends_at_the_connect_bound(
    store: ThreadedStore,
) -> None:
    """w1 arrives, then hangs before building its group (``connecting`` blocks): w0's
    connect gives up after ``connect_s``, not gloo's default or the backstop."""
    plan = _plan(store, 1, ["w0", "w1"])
    release = threading.Event()
    took: dict[str, float] = {}

    def member(r: int) -> None:
        comm = Communicator(f"w{r}", _addr(store), backstop_s=JOIN_S)
        hang = release.wait if r == 1 else None
        t0 = time.monotonic()
        try:
            comm.configure(plan, cancelled=lambda: False, arrival_s=JOIN_S, connect_s=1.0, connecting=hang)
        finally:
            took[f"w{r}"] = time.monotonic() - t0
            comm.release()
            release.set()

    results = run_ranks(2, member)
    assert isinstance(results[0], CommError), results
    assert took["w0"] < 10.0, took


def test_abort_below_spares_a_newer_generation(store: ThreadedStore) -> None:
    comm = Communicator("w0", _addr(store), backstop_s=JOIN_S)
    comm.configure(_plan(store, 3, ["w0"]), cancelled=lambda: False, arrival_s=JOIN_S, connect_s=JOIN_S)
    comm.abort(below=3)  # a plan of this very generation: nothing to abort
    comm.allreduce_sum_(torch.ones(2), timeout_s=JOIN_S)
    comm.abort(below=4)  # a newer plan: the group held is aborted
    with pytest.raises(CommError, match="aborted"):
        comm.allreduce_sum_(torch.ones(2), timeout_s=JOIN_S)
    comm.release()
    comm.abort()  # nothing held: never raises
