"""How a generation's members meet, at a cost per store that does not grow as N².

Three pieces, each picked from what ``python -m bench.rendezvous`` measured (socket-level
ranks against real store processes; figures below are its run at 2,048 ranks on a
2-core box):

**Arrival** (:func:`arrival_barrier_any`). Every member announces itself under
``prefix/arrived/<rank>`` (kept: a timeout names the missing ranks from them), adds 1
to ``prefix/arrived/count`` and waits for ``prefix/arrived/done``, which the member
whose ``add`` completes the count sets. The wait is the store's own (server side: one
request, answered when the key appears), run in a helper thread on a second client
(:class:`Waiters`, kept across generations) so that this thread keeps asking
``cancelled()``. That is 3-4 requests per member and O(N) for the store, where
polling ``check`` over all N keys (the design before) is O(N) per poll per member,
O(N²) per poll round on one store. Below :data:`COUNTED_FROM` members the polled form
is kept: at 8 ranks both take ~5 ms, and it needs no second connection. Which ranks
are missing is worked out only on the failure path, by bisecting ``check`` (O(m log N)
requests for m missing).

**gloo's bootstrap** (:func:`gloo_backend`). torch 2.13's gloo connects a full mesh at
construction: every rank stores one key holding its address and one pair id per peer
(8 bytes x N) and ``wait`` s + ``get`` s all N keys: 2N² requests and ~8N³ bytes
through the store -- 527 k requests and 1.2 GB at 512 ranks (20 s); at 2,048 ranks
~8.4 M requests and ~69 GB, of which 1.7 M and 15 GB went through in the 90 s the
benchmark allowed, no rank done. From :data:`LAZY_FROM` ranks on the device is lazy
(gloo's ``lazy_init``): each rank stores one small key and reads a peer's only when it
first talks to it -- the ring of an all-reduce (2 peers), the dissemination barrier
(2 log2 N), a state transfer's sender -- so O(log N) requests per rank: 96 k requests
and 11 MB on the one store at 2,048 ranks, every rank done in ~5.5 s (the simulated
clients' own CPU is most of it). Below :data:`LAZY_FROM` the eager mesh is kept: its
cost is small there (8.5 k requests at 64 ranks) and every connection is then made
inside the connect bound, where the recovery paths were measured.

**Keys spread over several stores** (:class:`SpreadStore`). Where a plan names more
stores than its root (``store_addrs``, read with ``getattr`` until the contract
carries it), every key but the arrival's is routed by a hash of its name to one of
them; the root keeps the arrival's counter and done key (O(1) per rank, O(N) on it),
each other store O(N/K) of gloo's and NCCL's keys: 18 k requests on the busiest of 8
stores at 2,048 ranks, against 96 k on one. On one 2-core box the K store processes
share the cores with the clients, so it is no faster there (12-14 s); what it buys is
the per-store load, for the jobs where one store's requests are the bottleneck. A
plain ``dist.Store`` subclass: gloo and ``PrefixStore`` call it through torch's
Python-store trampoline (``set``/``get``/``wait``/``check``/``add``), which holds only
its C++ half: whoever builds one keeps the Python object for as long as a group may
ask it for keys (torch otherwise fails with "Not implemented").

Everything stays under the generation's secret: the caller wraps the store it gets
here in :func:`phalanx.runtime.comm.generation_store` (the spread store too, so
every key on every store carries it).
"""

from __future__ import annotations

import hashlib
import threading
import time
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import torch.distributed as dist

COUNTED_FROM = 16
"""From this many members the arrival is counted (add + a server-side wait), below it
polled (``check`` of every key): see the module docstring and bench/rendezvous.py."""

LAZY_FROM = 64
"""From this world size gloo's device is lazy: pairs connect on first use."""

SPREAD_FROM = 256
"""From this world size a plan's extra stores (``store_addrs``) are used at all."""

MAX_STORES = 64
"""The most stores a generation's keys are spread over (the rest of a longer list is
ignored): each rank connects to a store only on first use, and at most this many."""


class RendezvousError(RuntimeError):
    """A rendezvous failed: a member missing past the bound, or the store gone."""


class Cancelled(Exception):
    """``cancelled()`` turned true while waiting for the members."""


def arrival_keys(prefix: str, world_size: int) -> list[str]:
    """Every member's arrival key."""
    return [f"{prefix}/arrived/{r}" for r in range(world_size)]


def polling_arrival(
    store: dist.Store,
    prefix: str,
    rank: int,
    world_size: int,
    cancelled: Callable[[], bool],
    timeout_s: float,
    poll_s: float = 0.0005,
) -> None:
    """The small-job arrival: announce, then poll ``check`` of every member's key.

    Raises :class:`Cancelled`, :class:`RendezvousError` naming the missing ranks'
    keys, or the store's ``dist.DistError``.
    """
    keys = arrival_keys(prefix, world_size)
    deadline = time.monotonic() + timeout_s
    store.set(keys[rank], str(time.time()))
    while not store.check(keys):
        if cancelled():
            raise Cancelled(prefix)
        if time.monotonic() > deadline:
            raise RendezvousError(_timed_out(prefix, store, keys))
        time.sleep(poll_s)


def counted_arrival(
    store: dist.Store,
    prefix: str,
    rank: int,
    world_size: int,
    cancelled: Callable[[], bool],
    timeout_s: float,
    poll_s: float = 0.002,
    waiter: dist.Store | None = None,
    release: Callable[[], None] | None = None,
) -> None:
    """The arrival at any size: announce, count, wait for the done key.

    The store's wait runs in a helper thread on ``waiter``, a second client of the same
    store under the same prefix (default: ``store.clone()``, a new connection each
    call), so that this thread keeps asking ``cancelled()`` every ``poll_s`` and the
    client given stays free for the next generation when this one is abandoned. The
    helper ends when the done key appears or at the deadline, then calls ``release()``
    (the caller's pool takes the client back). A connection per call is what the
    caller's pool avoids: connecting is a request like any other, and on a host
    without DNS torch's client can stall 5 s in a reverse lookup under a burst of
    them (measured: 64 concurrent connects). Raises like :func:`polling_arrival`.
    """
    keys = arrival_keys(prefix, world_size)
    done = f"{prefix}/arrived/done"
    deadline = time.monotonic() + timeout_s
    try:
        store.set(keys[rank], str(time.time()))
        if store.add(f"{prefix}/arrived/count", 1) >= world_size and store.check(keys):
            store.set(done, "1")  # the last to arrive: every other member is waiting for this
            return
        if waiter is None:
            waiter = store.clone()  # type: ignore[attr-defined]  # in torch, not in its stubs
    except BaseException:
        if release is not None:
            release()
        raise
    ended = threading.Event()
    failure: list[BaseException] = []
    helper = waiter

    def wait() -> None:
        try:
            helper.wait([done], timedelta(seconds=max(0.001, deadline - time.monotonic())))
        except BaseException as exc:
            failure.append(exc)
        finally:
            ended.set()
            if release is not None:
                release()

    threading.Thread(target=wait, name=f"arrival-{rank}", daemon=True).start()
    while not ended.wait(poll_s):
        if cancelled():
            raise Cancelled(prefix)  # the helper ends by itself at the deadline
    if not failure:
        return
    exc = failure[0]
    if isinstance(exc, dist.DistNetworkError) or time.monotonic() < deadline:
        raise exc  # the store failed (the caller says so)
    raise RendezvousError(_timed_out(prefix, store, keys))


class Waiters:
    """Spare clients of one store for :func:`counted_arrival`'s helper, kept across
    generations: normally one, another only while an abandoned wait still holds it."""

    def __init__(self, connect: Callable[[], dist.Store]) -> None:
        self._connect = connect
        self._free: list[dist.Store] = []
        self._lock = threading.Lock()

    def take(self) -> dist.Store:
        with self._lock:
            if self._free:
                return self._free.pop()
        return self._connect()

    def give(self, client: dist.Store) -> None:
        with self._lock:
            self._free.append(client)


def arrival_barrier_any(
    store: dist.Store,
    prefix: str,
    rank: int,
    world_size: int,
    cancelled: Callable[[], bool],
    timeout_s: float,
    waiter: Callable[[], tuple[dist.Store, Callable[[], None]]] | None = None,
) -> None:
    """:func:`counted_arrival` from :data:`COUNTED_FROM` members, :func:`polling_arrival`
    below. ``waiter()``: the counted arrival's second client and how to give it back."""
    if world_size < COUNTED_FROM:
        polling_arrival(store, prefix, rank, world_size, cancelled, timeout_s)
        return
    client, release = waiter() if waiter is not None else (None, None)
    counted_arrival(store, prefix, rank, world_size, cancelled, timeout_s, waiter=client, release=release)


def missing(store: dist.Store, keys: Sequence[str]) -> list[str]:
    """The keys of ``keys`` absent from ``store``, by bisecting ``check`` (which is true
    only when every key given is present): O(m log N) requests for m missing."""
    if not keys or store.check(list(keys)):
        return []
    if len(keys) == 1:
        return [keys[0]]
    half = len(keys) // 2
    return missing(store, keys[:half]) + missing(store, keys[half:])


def _timed_out(prefix: str, store: dist.Store, keys: Sequence[str], shown: int = 32) -> str:
    absent = missing(store, keys)
    more = f" and {len(absent) - shown} more" if len(absent) > shown else ""
    return f"rendezvous {prefix}: timed out waiting for {absent[:shown]}{more}"


# -- gloo ---------------------------------------------------------------------------------------


def lazy_gloo(world_size: int) -> bool:
    """Whether a group of ``world_size`` connects its pairs on first use."""
    return world_size >= LAZY_FROM


def gloo_backend(
    store: dist.Store, rank: int, world_size: int, connect: timedelta, bind: str | None
) -> dist.ProcessGroupGloo:
    """A ``ProcessGroupGloo`` over ``store``: eager full mesh below :data:`LAZY_FROM`
    ranks, lazy pairs from there (every member decides alike: same world size).

    ``bind``: the address gloo listens on and announces; None lets gloo pick from the
    hostname, as torch does by default.
    """
    lazy = lazy_gloo(world_size)
    opts = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
    opts._timeout = connect
    if bind:
        device = dist.ProcessGroupGloo.create_device(hostname=bind, lazy_init=lazy)  # type: ignore[attr-defined]
    else:
        device = dist.ProcessGroupGloo.create_default_device(lazy_init=lazy)  # type: ignore[attr-defined]
    opts._devices = [device]
    return dist.ProcessGroupGloo(store, rank, world_size, opts)


# -- keys over several stores -------------------------------------------------------------------


def plan_stores(plan: Any) -> list[str]:
    """The stores a generation's keys are spread over: the plan's root store first, then
    the others it names (``store_addrs``, once the contract carries it), at most
    :data:`MAX_STORES`; just the root below :data:`SPREAD_FROM` members."""
    root = str(plan.store_addr)
    extra = [str(a) for a in getattr(plan, "store_addrs", None) or [] if a and a != root]
    if plan.world_size < SPREAD_FROM or not extra:
        return [root]
    return [root, *dict.fromkeys(extra)][:MAX_STORES]


def route(key: str, n: int) -> int:
    """The store (0..n-1) a key lives on: a stable hash of its name (every member, every
    process, the same). Not crc32: it is linear, and gloo's keys differ only in their
    last digits (crc32 mod 2 put every ``.../pg/0/<rank>`` of a group on one store)."""
    return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "big") % n


class SpreadStore(dist.Store):
    """Keys routed by :func:`route` over several stores, each connected on first use.

    ``connect(addr)`` gives a client (the communicator's cached one). ``add`` and
    ``check`` of a key go to that key's store, so the arrival may run over this too;
    ``wait`` waits on each key's store in turn (the deadline of the call as a whole
    is the store timeout of each: gloo waits for one key at a time).
    """

    def __init__(
        self, addrs: Sequence[str], connect: Callable[[str], dist.Store], timeout: timedelta | None = None
    ) -> None:
        """``timeout``: each client's per-request timeout, set as it is connected."""
        super().__init__()
        if not addrs:
            raise ValueError("a spread store needs at least one store")
        self.addrs = list(addrs)
        self._connect = connect
        self._clients: dict[int, dist.Store] = {}
        self._lock = threading.Lock()
        self._timeout = timeout
        self._secrets: list[str] = []  # proved to each store as it is connected

    def _at(self, key: str) -> dist.Store:
        i = route(key, len(self.addrs))
        client = self._clients.get(i)
        if client is None:
            with self._lock:
                client = self._clients.get(i)
                if client is None:
                    client = self._clients[i] = self._connected(self.addrs[i])
        return client

    def prove(self, secret: str) -> None:
        """Prove a generation's secret to every store (:meth:`StoreClient.prove
        <phalanx.runtime.storeclient.StoreClient.prove>`): those connected now, and each
        one connected later."""
        with self._lock:
            self._secrets.append(secret)
            clients = list(self._clients.values())
        for client in clients:
            client.prove(secret)  # type: ignore[attr-defined]

    def _connected(self, addr: str) -> dist.Store:
        client = self._connect(addr)
        if self._timeout is not None:
            client.set_timeout(self._timeout)
        for secret in self._secrets:
            client.prove(secret)  # type: ignore[attr-defined]
        return client

    def set(self, key: str, value: str | bytes) -> None:
        self._at(key).set(key, value)  # type: ignore[arg-type]  # bytes too, whatever the stubs say

    def get(self, key: str) -> bytes:
        return self._at(key).get(key)

    def add(self, key: str, value: int) -> int:
        return self._at(key).add(key, value)

    def compare_set(self, key: str, expected: str | bytes, desired: str | bytes) -> bytes:
        return self._at(key).compare_set(key, expected, desired)  # type: ignore[arg-type]

    def delete_key(self, key: str) -> bool:
        return self._at(key).delete_key(key)

    def check(self, keys: list[str]) -> bool:
        return all(self._at(k).check([k]) for k in keys)

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        for key in keys:
            if timeout is None:
                self._at(key).wait([key])
            else:
                self._at(key).wait([key], timeout)

    def connect_all(self) -> None:
        """Connect to every store now (a rank's earlier generations would have)."""
        for i in range(len(self.addrs)):
            self._at_index(i)

    def _at_index(self, i: int) -> dist.Store:
        with self._lock:
            if i not in self._clients:
                self._clients[i] = self._connected(self.addrs[i])
            return self._clients[i]

    def set_timeout(self, timeout: timedelta) -> None:
        self._timeout = timeout
        with self._lock:
            for client in self._clients.values():
                client.set_timeout(timeout)

    @property
    def connected(self) -> int:
        """How many of the stores this rank has talked to."""
        return len(self._clients)
