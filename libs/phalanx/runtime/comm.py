"""A rank's communicator: one object for the process's whole life
(:class:`Communicator`), re-pointed at each generation's process group by
:meth:`Communicator.configure`; that group (:class:`Group`) is gloo over the
job's store, with an NCCL backend beside it when the job trains on CUDA.

The training loops (the Trainer, the user's DDP loop through its comm hook) hold
the :class:`Communicator` from start to end and never a generation's group, so
nothing of theirs is rebuilt when a generation changes. Every operation it runs
carries a bound the caller gives (the rendezvous', the state transfer's, each
gradient all-reduce's; :mod:`phalanx.runtime.session` picks them): a peer hung
inside any of them costs its partners that bound, and they leave the phase so
the detector can tell the hung one (the shape of torchft's reconfigurable
process group, without a process-group subclass: Phalanx's collectives all go
through this class).

The store is a long-lived ``TCPStore`` hosted by the launcher (never by a
training rank, which could die with it). Each generation gets its own
``PrefixStore`` (``plan.store_prefix``), so stale keys of an old generation can
never confuse a new one, and a standalone ``ProcessGroupGloo`` wrapped in a
``ProcessGroup`` -- no default group, no ``init_process_group``.

The store is Phalanx's own (:mod:`phalanx.runtime.storeserver`), with torch's
``TCPStore`` semantics and an authenticated wire: a client reaches a generation's keys
only after proving the plan's ``store_secret`` (which only the job's users and the
services read: the job's KV record and plan subject, :mod:`phalanx.natsauth`), and the
secret never crosses the wire (:mod:`phalanx.runtime.storewire`). A non-member with the
store's address can neither read, write, delete nor list a generation's keys; its
connections and failed proofs are bounded by the store. :func:`generation_store`
proves the secret and puts every key of the generation under it. The secret stays
out of logs and error messages: those name ``store_prefix``, and a key named in an
error is shown from its prefix on (``<secret>/j1/gen2/pg/0``).

Devices (:func:`backend_for` is the one place that picks a backend): gloo is
always registered, for CPU tensors (step counters, the state header and
metadata, barriers). With a CUDA ``device`` a ``ProcessGroupNCCL`` is registered
on the same ``ProcessGroup`` for CUDA tensors, so each collective goes where
its tensor lives: gradients and state buffers over NCCL, the rest over gloo.
The NCCL communicator is built eagerly, on ``device``, when the
``Group`` is (its cost shows in ``comm_init``, not in the first step).

Teardown, gloo: gloo's own ``abort()`` does nothing to an op in flight
(docs/recovery.md, "What gloo does when a peer dies"), so :meth:`Group.abort`
shuts down the TCP sockets the group opened while it was built
(:class:`~phalanx.worker.sever.SocketSet`, noted around gloo's connect): the op
blocked in them fails with "Connection closed by peer" within a millisecond, from
any thread, and every peer at the other end of a pair fails the same way (the
cascade). :meth:`Group.destroy` cuts them too before it drops the references, so a
reference that outlives the group (a ``Work`` in a future) cannot keep peers
waiting. Every collective still carries a per-op timeout as the backstop.

Teardown, NCCL: :meth:`Group.abort` calls the backend's abort
(``ncclCommAbort``), from any thread; a collective blocked in another thread
then returns and fails with :class:`CommError`. :meth:`Group.destroy`
aborts first, never a graceful shutdown that would wait for work in flight.
One exception: :meth:`Communicator.release` parks an intact (never aborted)
NCCL communicator instead, and the next :meth:`Communicator.configure` shrinks
it (``ncclCommShrink``) when the plan's ``shrunk`` says the new generation is
the old one minus some ranks, or aborts it before a full init
(:mod:`phalanx.runtime.nccl_shrink`: when that works, the votes that keep the
members on one path, ``PHALANX_NCCL_SHRINK``).

NCCL errors must surface in the calling thread, where the runtime recovers,
not kill the process. So before the first NCCL group is built, unless the
environment already says otherwise (``os.environ.setdefault``):

* ``TORCH_NCCL_ASYNC_ERROR_HANDLING=2``: when ProcessGroupNCCL's watchdog sees
  a collective fail or time out it aborts the communicator (which frees the GPU
  and any waiter) but does not tear the process down (torch's default, 3, does).
* ``TORCH_NCCL_DUMP_ON_TIMEOUT=0``: otherwise a timeout writes a dump flag into
  the store under the prefixes -- the launcher's store, shared by every
  generation -- and the heartbeat monitor of each rank's first NCCL group that
  sees the flag dumps and then terminates its process (torch's sources; not
  measured here), survivors and later generations included.

``TORCH_NCCL_BLOCKING_WAIT`` is left alone: it would switch the watchdog's
error handling off and make every wait (DDP's too) block the CPU. Instead each
collective of this class waits with an explicit timeout (``work.wait(timeout)``),
which torch implements as a blocking wait that, on timeout or error, aborts the
communicator and raises here (:meth:`Group._run` turns that into
:class:`CommError`). The heartbeat monitor stays on: if the watchdog itself
hangs (an ``ncclCommAbort`` that never returns) it kills the process after
``TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC``, which the runtime handles as a rank exit.

A rendezvous must be abandonable: before the group is built, every member
announces itself under the prefix and waits for the others with
:func:`arrival_barrier`, which gives up when ``cancelled()`` says a newer plan
has superseded this one. The group is then connected under its own bound
(``connect_timeout_s``: every member has arrived, so only a member hung in
between keeps the others waiting). How members meet at scale -- an arrival of
O(1) requests per member, gloo's pairs connected on first use in large groups,
keys spread over several launchers' stores -- is :mod:`phalanx.runtime.rendezvous`. (NCCL's own communicator init is blocking: a
member that dies inside it leaves the others waiting for the NCCL bootstrap.)
"""

from __future__ import annotations

import functools
import math
import os
import re
import socket
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import Backend as C10dBackend

from phalanx.contract import NodePlan, Plan
from phalanx.runtime.nccl_shrink import (
    Parked,
    ShrinkMode,
    ShrinkRequest,
    flags_for,
    resolve_mode,
    shrink_backend,
    vote,
)
from phalanx.runtime.rendezvous import (
    Cancelled,
    RendezvousError,
    SpreadStore,
    Waiters,
    arrival_barrier_any,
    gloo_backend,
    lazy_gloo,
    plan_stores,
)
from phalanx.runtime.storeclient import StoreClient
from phalanx.telemetry import get_logger
from phalanx.worker.addr import split_addr
from phalanx.worker.sever import SocketSet

DEFAULT_TIMEOUT_S = 60.0

# What an NCCL group needs for in-process recovery (see the module docstring).
NCCL_ENV_DEFAULTS = {
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": "2",
    "TORCH_NCCL_DUMP_ON_TIMEOUT": "0",
}

_log = get_logger(component="comm")


class CommError(RuntimeError):
    """A collective or a rendezvous failed; the communicator is dead. ``at`` (wall
    time): when, the moment the rank left that collective (its recovery's ``abort``
    starts there, also when the rank runs the rest of its step first)."""

    def __init__(self, *args: object) -> None:
        super().__init__(*args)
        self.at = time.time()


class Superseded(Exception):
    """A newer plan arrived while waiting for this generation's members."""


def connect_store(addr: str, timeout_s: float = 30.0) -> StoreClient:
    """A client of the store at ``host:port`` (it reaches no key before
    :func:`generation_store` proved a generation)."""
    return StoreClient(addr, timedelta(seconds=timeout_s))


def _endpoints(addr: str) -> frozenset[tuple[str, int]]:
    """The ``(ip, port)`` pairs a connection to ``host:port`` may show as its peer."""
    host, port = split_addr(addr)
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError:
        return frozenset()
    return frozenset((str(info[4][0]), port) for info in infos)


def generation_store(store: dist.Store, secret: str) -> dist.Store:
    """The keys of one generation: ``store`` (a client, or several clients' spread)
    having proved the plan's ``store_secret``, with every key under it.

    Every member wraps its client the same way, so they meet; the store serves no
    client that cannot prove the secret. ``DistStoreError`` when the store refuses
    the proof (it does not serve the generation), ``ValueError`` for an empty secret
    (a plan of a planner from before secrets: its members cannot meet here).
    """
    if not secret:
        raise ValueError("the plan carries no store secret (a planner older than the authenticated store)")
    prove = getattr(store, "prove", None)  # StoreClient's and SpreadStore's
    if prove is None:
        raise TypeError(f"a generation's keys live on Phalanx's store, not on {type(store).__name__}")
    prove(secret)
    return dist.PrefixStore(secret, store)


def _scrubbed(error: BaseException, prefix: str) -> str:
    """``error``'s text without what a store key holds before ``prefix``: torch names a
    key it waited for in full (``wait timeout after 2000ms, keys: /<secret>/j/gen2/pg/0/1``),
    and the generation's secret must not reach a log line or an event."""
    return re.sub(rf"[A-Za-z0-9_-]+/(?={re.escape(prefix)}/)", "<secret>/", str(error))


def arrival_barrier(
    store: dist.Store,
    prefix: str,
    rank: int,
    world_size: int,
    cancelled: Callable[[], bool],
    timeout_s: float,
    waiter: Callable[[], tuple[dist.Store, Callable[[], None]]] | None = None,
) -> None:
    """Announce ``rank`` under ``prefix`` and wait until all ``world_size`` have
    (:mod:`phalanx.runtime.rendezvous`: polled below ``COUNTED_FROM`` members, counted
    with a server-side wait from there).

    Raises :class:`Superseded` when ``cancelled()`` turns true and
    :class:`CommError` after ``timeout_s`` (naming the missing members' keys), or when
    the store fails (its host is gone: the plan that named it is abandoned for a newer one).
    ``waiter()``: a second client under the same prefix for the counted wait, and how to
    give it back (default: a clone per call).
    """
    try:
        arrival_barrier_any(store, prefix, rank, world_size, cancelled, timeout_s, waiter)
    except Cancelled:
        raise Superseded(prefix) from None
    except RendezvousError as exc:
        raise CommError(str(exc)) from None
    except dist.DistError as exc:  # DistNetworkError, DistStoreError: the store is unreachable
        raise CommError(f"rendezvous {prefix}: the store failed: {_scrubbed(exc, prefix)}") from None


def backend_for(device: torch.device) -> str:
    """The backend for tensors on ``device``: ``"gloo"`` for cpu, ``"nccl"`` for cuda.

    The one place that decides. Any other device type, or cuda on a torch built
    without NCCL, is a :class:`ValueError` saying so.
    """
    device = torch.device(device)
    if device.type == "cpu":
        return "gloo"
    if device.type == "cuda":
        if not dist.is_nccl_available():
            raise ValueError(
                f"device {device} needs NCCL, and this torch ({torch.__version__}) is built without it"
            )
        return "nccl"
    raise ValueError(
        f"no communication backend for device {device}: Phalanx runs on cpu (gloo) or cuda (nccl)"
    )


def _cuda_device(device: torch.device) -> torch.device:
    """``device`` with its index, once it is known to exist here."""
    if not torch.cuda.is_available():
        raise ValueError(f"device {device} was asked for, but no CUDA device is available here")
    count = torch.cuda.device_count()
    index = torch.cuda.current_device() if device.index is None else device.index
    if not 0 <= index < count:
        raise ValueError(f"device {device}: this machine has {count} CUDA device(s)")
    return torch.device("cuda", index)


def _nccl_backend(
    store: dist.Store, prefix: str, rank: int, world_size: int, timeout: timedelta
) -> C10dBackend:
    """A ``ProcessGroupNCCL`` under its own prefix, after the environment it needs."""
    from torch._C._distributed_c10d import ProcessGroupNCCL  # only in builds with NCCL
    from torch.distributed.distributed_c10d import GroupName

    for key, value in NCCL_ENV_DEFAULTS.items():
        os.environ.setdefault(key, value)  # read by ProcessGroupNCCL's constructor
    opts = ProcessGroupNCCL.Options()
    opts._timeout = timeout
    opts.group_name = GroupName(prefix)  # names the group in NCCL's log lines
    return ProcessGroupNCCL(dist.PrefixStore(f"{prefix}/nccl", store), rank, world_size, opts)


class Group:
    """The process group of one generation, and the few collectives the runtime uses."""

    def __init__(
        self,
        store: dist.Store,
        prefix: str,
        rank: int,
        world_size: int,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        bind: str | None = None,
        device: torch.device | None = None,
        connect_timeout_s: float | None = None,
        shrink: ShrinkRequest | None = None,
        spared: frozenset[tuple[str, int]] = frozenset(),
    ) -> None:
        """``timeout_s``: the bound of an op that is given none (the backstop);
        ``connect_timeout_s`` (default ``timeout_s``): how long connecting to the
        members may take (gloo's own timeout, which no op here relies on: each
        passes its bound explicitly).

        ``bind``: the address gloo listens on and announces (the node's interface);
        None lets gloo pick from the hostname, as torch does by default.

        ``device`` (default cpu): where the training tensors live. A cuda device adds
        an NCCL communicator on that GPU (its index, or the current device) for CUDA
        tensors; the caller picks the GPU (``torch.cuda.set_device``). A device with
        no backend here is a :class:`ValueError` before anything is built.

        ``shrink``: the previous generation's parked NCCL backend and the plan's
        ``shrunk`` (:mod:`phalanx.runtime.nccl_shrink`); this group owns it from
        here and shrinks or aborts it. Every member of a generation passes one or
        none alike (the members vote over gloo). ``nccl_built`` says which way the
        NCCL backend came about.

        ``spared``: ``(ip, port)`` endpoints whose connections are never the group's
        (the stores a rank may connect to while the group is built); :meth:`abort`
        leaves them alone."""
        self.prefix = prefix
        self.rank = rank
        self.world_size = world_size
        self.timeout = timedelta(seconds=timeout_s)
        self.device = torch.device("cpu") if device is None else torch.device(device)
        use_nccl = backend_for(self.device) == "nccl"
        if use_nccl:
            self.device = _cuda_device(self.device)
        self._lock = threading.Lock()
        self._aborted = False
        self.nccl_built: dict[str, Any] = {}
        if shrink is not None and not use_nccl:
            shrink.release()
            shrink = None
        pstore = dist.PrefixStore(f"{prefix}/pg", store)
        connect = self.timeout if connect_timeout_s is None else timedelta(seconds=connect_timeout_s)
        self._sockets = SocketSet(spared, late=lazy_gloo(world_size))
        self._sockets.note_before()
        try:  # eager full mesh for small groups, pairs on first use for large ones
            backend = gloo_backend(pstore, rank, world_size, connect, bind)
            self._sockets.note_after()
        except Exception as exc:  # DistStoreError, gloo connect errors
            if shrink is not None:
                shrink.release()
            raise CommError(f"building process group {prefix}: {_scrubbed(exc, prefix)}") from None
        pg = dist.ProcessGroup(pstore, rank, world_size)
        pg._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.GLOO, backend)
        pg._set_default_backend(dist.ProcessGroup.BackendType.GLOO)  # barriers and the like: gloo
        nccl: C10dBackend | None = None
        if use_nccl:
            t0 = time.monotonic()
            try:
                pg.bound_device_id = self.device  # handed to the NCCL backend as it is registered
                if shrink is not None:  # ncclCommShrink of the previous generation's, when all agree
                    nccl = self._shrunk(shrink, pg, rank, connect)
                if nccl is not None:
                    pg._register_backend(torch.device("cuda"), dist.ProcessGroup.BackendType.NCCL, nccl)
                else:
                    nccl = _nccl_backend(store, prefix, rank, world_size, self.timeout)
                    pg._register_backend(torch.device("cuda"), dist.ProcessGroup.BackendType.NCCL, nccl)
                    nccl.eager_connect_single_device(self.device)  # ncclCommInitRank now, not in step 1
                    self.nccl_built.setdefault("how", "init")
            except Exception as exc:
                if nccl is not None:
                    _abort_quietly(nccl, prefix)
                error = _scrubbed(exc, prefix)
                raise CommError(f"building the NCCL group {prefix} on {self.device}: {error}") from None
            finally:
                if shrink is not None:
                    shrink.release()  # the parent: shrunk from, or unusable; aborted either way
            self.nccl_built["ms"] = round((time.monotonic() - t0) * 1000.0, 2)
            _log.info("comm_nccl_built", prefix=prefix, **self.nccl_built)
        self._backend: dist.ProcessGroupGloo | None = backend
        self._nccl: C10dBackend | None = nccl
        self._pg: dist.ProcessGroup | None = pg

    def _shrunk(
        self, req: ShrinkRequest, pg: dist.ProcessGroup, rank: int, connect: timedelta
    ) -> C10dBackend | None:
        """The NCCL backend shrunk from ``req``'s parent, or None: build it in full.

        Two gloo votes keep the members on one path (:mod:`.nccl_shrink`): before,
        whether every member can shrink (and whether one requires it); after,
        whether every member's shrink returned the rank the plan gives it. The
        parent is aborted before a full init (its GPU memory is free again).
        Raises :class:`CommError` when a member requires a shrink that does not
        happen (every member does: the vote tells them all)."""
        why = req.why_not(rank, self.world_size)
        able, required = vote(pg, why is None, req.mode is ShrinkMode.REQUIRE, connect)
        if able and req.parked is not None:  # every member can; ours is there (why_not said so)
            flags = flags_for(req.planned)
            child: C10dBackend | None = None
            try:
                child = shrink_backend(req.parked, req.shrunk, flags, self.prefix, self.timeout)
                if child.rank() != rank or child.size() != self.world_size:
                    why = f"the shrunk communicator is rank {child.rank()} of {child.size()}"
            except Exception as exc:
                why = f"ncclCommShrink failed: {_scrubbed(exc, self.prefix)}"
            req.release()  # the parent is spent either way
            all_done, _ = vote(pg, why is None, False, connect)
            if all_done and child is not None:
                self.nccl_built = {"how": "shrink", "flags": flags, "left_out": list(req.shrunk)}
                return child
            if child is not None:
                _abort_quietly(child, self.prefix)
            why = why or "another member's shrink failed"
        req.release()
        self.nccl_built = {"how": "init", "why_not_shrunk": why or "another member cannot shrink"}
        if required:
            raise CommError(f"a shrink was required and did not happen: {self.nccl_built['why_not_shrunk']}")
        return None

    def detach_nccl(self, generation: int) -> Parked | None:
        """Take this group's NCCL backend out, intact, for the next generation to
        shrink (:class:`~.nccl_shrink.Parked`); None when there is none or it was
        aborted (:meth:`destroy` then aborts it as before). Under the lock
        :meth:`abort` takes: a concurrent abort either finds it gone or wins."""
        with self._lock:
            nccl = self._nccl
            if nccl is None or self._aborted:
                return None
            self._nccl = None
        return Parked(nccl, generation, self.rank, self.world_size, self.prefix)

    @property
    def pg(self) -> dist.ProcessGroup:
        if self._pg is None:
            raise CommError(f"communicator {self.prefix} was destroyed")
        return self._pg

    @property
    def aborted(self) -> bool:
        """:meth:`abort` was called: every op from now on (and one in flight) fails."""
        return self._aborted

    def abort(self) -> None:
        """End this communicator now, from any thread; never raises.

        NCCL: ``ncclCommAbort`` through the backend, which releases an op blocked in
        another thread (that op then raises :class:`CommError`). gloo: the group's
        sockets are shut down (:class:`~phalanx.worker.sever.SocketSet`), so an op
        blocked in another thread fails at once, and so do the peers' ops with this
        rank (its ``abort()`` does nothing to an op in flight: docs/recovery.md).
        """
        with self._lock:
            if self._aborted:
                return
            self._aborted = True
            nccl = self._nccl
        if nccl is not None:
            _abort_quietly(nccl, self.prefix)
        t0 = time.monotonic()
        cut = self._sockets.cut()
        if cut:
            _log.info("comm_cut", prefix=self.prefix, sockets=cut, ms=round((time.monotonic() - t0) * 1e3, 2))

    def destroy(self) -> None:
        """Drop the group at once: NCCL is aborted first (never a graceful shutdown that
        waits for work in flight); gloo's sockets are cut, so blocked peers fail fast
        even while a reference to the group lives on somewhere (a ``Work``)."""
        if self._nccl is not None:
            self.abort()
        self._sockets.cut()
        self._pg = None
        self._backend = None
        self._nccl = None

    def _run(self, what: str, fn: Callable[[], Any], wait: timedelta | None = None) -> None:
        """Run one op to its end. ``wait``: the timeout of a blocking ``work.wait``
        (for an NCCL op torch then aborts the communicator and raises; a gloo
        send/recv raises); gloo collectives wait plainly and end by their own
        per-op timeout."""
        work = None
        try:
            self.pg  # noqa: B018  # raises once destroyed
            if self._aborted:
                raise CommError(f"communicator {self.prefix} was aborted")
            work = fn()
            if wait is None:
                work.wait()
            else:
                work.wait(wait)
            if self._aborted:  # an aborted NCCL op returns, its output possibly partial
                raise CommError(f"communicator {self.prefix} was aborted during the op")
            return
        except Exception as exc:
            how = "was aborted" if self._aborted else "failed"
            msg = f"{what} on {self.prefix} {how}: {_scrubbed(exc, self.prefix)}"
        # The Work object and a chained traceback would keep the group (and its
        # sockets) alive; peers blocked on us are only released once it is gone.
        work = None
        self.destroy()
        raise CommError(msg)

    def _nccl_wait(self, t: torch.Tensor, timeout: timedelta) -> timedelta | None:
        return timeout if self._nccl is not None and t.device.type == "cuda" else None

    def _bound(self, timeout_s: float | None) -> timedelta:
        return timedelta(seconds=timeout_s) if timeout_s else self.timeout

    def allreduce_sum_(self, t: torch.Tensor, timeout_s: float | None = None) -> None:
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.SUM  # type: ignore[assignment]  # the stubs mix ReduceOp and RedOpType
        opts.timeout = self._bound(timeout_s)
        self._run("allreduce", lambda: self.pg.allreduce([t], opts), self._nccl_wait(t, opts.timeout))

    def allreduce_work(self, t: torch.Tensor, timeout_s: float | None = None) -> dist.Work:
        """Start a SUM all-reduce of ``t`` under its per-op timeout; the caller waits
        (DDP's comm hook chains on its future). Raises :class:`CommError` at once when
        the group is gone or refuses."""
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.SUM  # type: ignore[assignment]
        opts.timeout = self._bound(timeout_s)
        try:
            if self._aborted:
                raise CommError(f"communicator {self.prefix} was aborted")
            return self.pg.allreduce([t], opts)
        except Exception as exc:
            raise CommError(f"allreduce on {self.prefix} failed: {_scrubbed(exc, self.prefix)}") from None

    def broadcast_(self, t: torch.Tensor, root: int = 0, timeout_s: float | None = None) -> None:
        """``t`` of rank ``root`` into every member's ``t``, in place."""
        opts = dist.BroadcastOptions()
        opts.rootRank = root
        opts.timeout = self._bound(timeout_s)
        self._run("broadcast", lambda: self.pg.broadcast([t], opts), self._nccl_wait(t, opts.timeout))

    def send(self, t: torch.Tensor, dst: int, tag: int = 0, timeout_s: float | None = None) -> None:
        self._run(f"send to {dst}", lambda: self.pg.send([t], dst, tag), self._bound(timeout_s))

    def recv(self, t: torch.Tensor, src: int, tag: int = 0, timeout_s: float | None = None) -> None:
        self._run(f"recv from {src}", lambda: self.pg.recv([t], src, tag), self._bound(timeout_s))

    def barrier(self, timeout_s: float | None = None) -> None:
        opts = dist.BarrierOptions()
        opts.timeout = self._bound(timeout_s)
        if self._nccl is not None:
            opts.device = torch.device("cpu")  # over gloo, even where NCCL is the device's backend
        self._run("barrier", lambda: self.pg.barrier(opts))


class Communicator:
    """This rank's communicator for the whole job: :meth:`configure` re-points it at
    a generation (its rendezvous, then its :class:`Group`), :meth:`release` drops
    that group, and the collectives in between go to the group held, each under the
    bound its caller gives. The training loops hold this object for their whole life.

    >>> comm = Communicator("w1", "10.0.0.5:29400")
    >>> comm.configure(plan, cancelled=lambda: False, arrival_s=4.0, connect_s=2.0)
    >>> comm.allreduce_sum_(grads, timeout_s=2.0)   # CommError when the generation broke
    >>> comm.release()                              # peers blocked on us fail now
    """

    def __init__(
        self,
        worker: str,
        store_addr: str,
        *,
        bind: str | None = None,
        device: torch.device | None = None,
        store_connect_s: float = 5.0,
        backstop_s: float = DEFAULT_TIMEOUT_S,
        nccl_shrink: ShrinkMode | str | None = None,
    ) -> None:
        """``store_addr``: this node's launcher's store (a plan naming no store means
        it); ``bind``: the address gloo listens on; ``device``: where the training
        tensors live (:meth:`configure` may change it); ``backstop_s``: the bound of
        an op whose caller gives none.

        ``nccl_shrink`` (default: ``PHALANX_NCCL_SHRINK``, else ``auto``): whether a
        generation that only loses ranks shrinks the previous NCCL communicator
        instead of building one (:mod:`phalanx.runtime.nccl_shrink`; ``off`` and
        ``require`` force either path). Without CUDA it changes nothing."""
        self.worker = worker
        self.store_addr = store_addr
        self.bind = bind
        self.device = torch.device("cpu") if device is None else torch.device(device)
        self.store_connect_s = store_connect_s
        self.backstop_s = backstop_s
        self.nccl_shrink = resolve_mode(nccl_shrink)
        self._parked: Parked | None = None  # the last generation's NCCL backend, kept to shrink
        self.generation = 0  # of the group held, or last held (0: none yet)
        self.rank = -1
        self.world_size = 0
        self._stores: dict[str, dist.Store] = {}
        self._spared: frozenset[tuple[str, int]] = frozenset()  # the stores' endpoints: never a group's
        self._waiters: dict[str, Waiters] = {}  # second clients for the arrival's wait, by address
        self._spread: SpreadStore | None = None  # the generation's keys over several stores, if so
        self._lock = threading.Lock()  # the group, as another thread (an abort) sees it
        self._group: Group | None = None
        # A device mesh's shape (set_mesh): each generation also gets, per dimension,
        # the group of the members that differ from this rank along it only.
        self.mesh_shape: tuple[int, ...] = ()
        self._lines: list[Group] = []
        self._listeners: list[Callable[[Communicator], None]] = []

    # -- stores --------------------------------------------------------------------------
    def store_at(self, addr: str = "", *, spare: bool = False) -> dist.Store:
        """The store at ``addr`` (``""``: this node's launcher's), connected once and kept
        for later generations. ``spare``: also connect now the second client a large
        generation's arrival waits on (:class:`~phalanx.runtime.rendezvous.Waiters`;
        otherwise connected by the first such arrival).

        Raises :class:`CommError` when it cannot be reached within ``store_connect_s``:
        the plan that named it is then abandoned for a newer one.
        """
        addr = addr or self.store_addr
        store = self._stores.get(addr)
        try:
            if store is None:
                store = self._stores[addr] = connect_store(addr, self.store_connect_s)
                self._spared |= _endpoints(addr)
            if spare and addr not in self._waiters:
                waiters = self._waiters[addr] = Waiters(lambda: connect_store(addr, self.store_connect_s))
                waiters.give(waiters.take())
        except Exception as exc:  # a malformed address, DistNetworkError, a timeout
            raise CommError(f"store {addr} unreachable: {exc}") from exc
        return store

    def _waiter(self, addr: str, secret: str, timeout_s: float) -> tuple[dist.Store, Callable[[], None]]:
        """A spare client of the store at ``addr`` for the arrival's wait, under the
        generation's secret, and how to give it back (:class:`Waiters`)."""
        if addr not in self._waiters:
            self._waiters[addr] = Waiters(lambda: connect_store(addr, self.store_connect_s))
        waiters = self._waiters[addr]
        client = waiters.take()
        client.set_timeout(timedelta(seconds=timeout_s))
        return generation_store(client, secret), functools.partial(waiters.give, client)

    # -- a device mesh over the generation ---------------------------------------------------
    def set_mesh(self, shape: tuple[int, ...]) -> None:
        """From the next :meth:`configure` on, also build one group per dimension of a
        mesh of ``shape`` over the generation's ranks (row-major, as
        ``torch.arange(world).view(shape)``). The first dimension may be -1: as many
        as the generation's world size makes (replica groups come and go)."""
        if not shape or any(d < 1 for d in shape[1:]) or not (shape[0] >= 1 or shape[0] == -1):
            raise ValueError(f"mesh shape {shape}: dimensions >= 1 (the first may be -1)")
        self.mesh_shape = tuple(shape)

    def mesh_for(self, world_size: int) -> tuple[int, ...]:
        """The mesh shape at ``world_size`` ranks; :class:`CommError` when it does not fit."""
        shape = self.mesh_shape
        rest = math.prod(shape[1:])
        if shape[0] == -1 and world_size % rest == 0:
            return (world_size // rest, *shape[1:])
        if shape[0] != -1 and math.prod(shape) == world_size:
            return shape
        raise CommError(f"{world_size} ranks do not make the mesh {shape}")

    def line(self, dim: int) -> Group:
        """The group of the generation held along mesh dimension ``dim``."""
        lines = self._lines
        if not lines:
            raise CommError("no communicator: this rank is between generations")
        return lines[dim]

    def on_change(self, listener: Callable[[Communicator], None]) -> None:
        """Call ``listener(self)`` after each :meth:`configure` and :meth:`release`
        (:mod:`phalanx.runtime.mesh` re-points the process groups a model holds)."""
        self._listeners.append(listener)

    def _notify(self) -> None:
        for listener in self._listeners:
            listener(self)

    def _build_lines(
        self, store: dist.Store, prefix: str, rank: int, world_size: int, connect_s: float
    ) -> list[Group]:
        """This rank's group along each mesh dimension, built in dimension order by
        every member (so no two members wait on each other in a different order)."""
        shape = self.mesh_for(world_size)
        coords = torch.arange(math.prod(shape)).view(shape)
        where = [int(c) for c in (coords == rank).nonzero()[0]]
        lines: list[Group] = []
        try:
            for dim in range(len(shape)):
                index = list(where)
                index[dim] = slice(None)  # type: ignore[call-overload]
                ranks = [int(r) for r in coords[tuple(index)].tolist()]
                key = "_".join(str(c) for i, c in enumerate(where) if i != dim)
                lines.append(
                    Group(
                        store,
                        f"{prefix}/dim{dim}/{key}",
                        ranks.index(rank),
                        len(ranks),
                        self.backstop_s,
                        bind=self.bind,
                        device=self.device,
                        connect_timeout_s=connect_s,
                        spared=self._spared,
                    )
                )
        except CommError:
            for group in lines:
                group.destroy()
            raise
        return lines

    # -- generations -----------------------------------------------------------------------
    def configure(
        self,
        plan: NodePlan | Plan,
        *,
        cancelled: Callable[[], bool],
        arrival_s: float,
        connect_s: float,
        store_s: float | None = None,
        device: torch.device | None = None,
        connecting: Callable[[], object] | None = None,
    ) -> None:
        """Point this communicator at ``plan``'s generation: drop the group held, meet
        the members on the store the plan names (:func:`arrival_barrier`, at most
        ``arrival_s``, given up when ``cancelled()``), call ``connecting()`` once all
        have arrived, then connect the generation's group (at most ``connect_s``).
        Each request to the store is bounded by ``store_s`` (default ``connect_s``).

        Raises :class:`Superseded` or :class:`CommError`; then no group is held.
        """
        rank = plan.rank_of(self.worker)
        if rank is None:
            raise ValueError(f"{self.worker} is no member of generation {plan.generation}")
        self.release()
        if device is not None:
            self.device = torch.device(device)
        client = self.store_at(plan.store_addr)
        store_s = connect_s if store_s is None else store_s
        client.set_timeout(timedelta(seconds=store_s))  # per store op: a live store answers at once
        store = generation_store(client, plan.store_secret)
        arrival_barrier(
            store,
            plan.store_prefix,
            rank,
            plan.world_size,
            cancelled,
            arrival_s,
            functools.partial(self._waiter, plan.store_addr or self.store_addr, plan.store_secret, store_s),
        )
        spread = plan_stores(plan)
        if len(spread) > 1:  # gloo's and NCCL's keys over several launchers' stores, by hash
            # held for the generation's life: a Python store passed to torch keeps only its
            # C++ half alive, and lazy gloo pairs ask it for keys long after this call
            self._spread = SpreadStore(spread, self.store_at, timedelta(seconds=store_s))
            store = generation_store(self._spread, plan.store_secret)
        if connecting is not None:
            connecting()
        shrink = self._shrink_request(plan)
        try:
            group = Group(
                store,
                plan.store_prefix,
                rank,
                plan.world_size,
                self.backstop_s,
                bind=self.bind,
                device=self.device,
                connect_timeout_s=connect_s,
                shrink=shrink,
                spared=self._spared,
            )
        finally:
            if shrink is not None:
                shrink.release()  # idempotent: Group released it already, unless it raised first
        lines: list[Group] = []
        if self.mesh_shape:
            try:
                lines = self._build_lines(store, plan.store_prefix, rank, plan.world_size, connect_s)
            except CommError:
                group.destroy()
                raise
        with self._lock:
            self._group, self._lines = group, lines
            self.generation, self.rank, self.world_size = plan.generation, rank, plan.world_size
        self.device = group.device
        self._notify()

    @property
    def configured(self) -> bool:
        """Whether a generation's group is held (it may have failed since)."""
        return self._group is not None

    @property
    def prefix(self) -> str:
        group = self._group
        return group.prefix if group is not None else ""

    def _shrink_request(self, plan: NodePlan | Plan) -> ShrinkRequest | None:
        """What the group of ``plan`` needs to try an NCCL shrink (it takes the parked
        backend over), or None, the parked backend then aborted here. A plan-wide
        choice (``plan.shrunk``, NCCL in use), so every member votes or none does."""
        with self._lock:
            parked, self._parked = self._parked, None
        if plan.shrunk and self.device.type == "cuda":
            return ShrinkRequest(parked, list(plan.shrunk), plan.planned, self.nccl_shrink, plan.generation)
        if parked is not None:
            parked.abort()
        return None

    def release(self) -> None:
        """Drop the group held at once (:meth:`Group.destroy`): peers blocked on this
        rank fail fast. Idempotent.

        With NCCL and shrinking not ``off``, an intact (never aborted) NCCL
        communicator of the group is not aborted here but parked for the next
        :meth:`configure`, which shrinks it into the next generation or aborts it
        (:mod:`phalanx.runtime.nccl_shrink`)."""
        t0 = time.monotonic()
        with self._lock:
            group, self._group = self._group, None
            lines, self._lines = self._lines, []
        if group is not None and self.nccl_shrink is not ShrinkMode.OFF:
            parked = group.detach_nccl(self.generation)
            if parked is not None:
                with self._lock:
                    older, self._parked = self._parked, parked
                if older is not None:
                    older.abort()
        for held in [group, *lines]:
            if held is not None:
                held.destroy()
        if group is not None:
            self._notify()
        ms = (time.monotonic() - t0) * 1000.0
        if ms > 100.0:  # dropping a group runs its destructor here, in this thread
            _log.warning("comm_release_slow", generation=self.generation, ms=round(ms, 1))

    def abort(self, below: int | None = None) -> None:
        """End the op in flight now, from any thread (:meth:`Group.abort`); with
        ``below``, only while the group held is of an older generation than that.
        Never raises."""
        with self._lock:
            group = self._group
            if group is None or (below is not None and self.generation >= below):
                return
            lines = list(self._lines)
        for held in [group, *lines]:
            held.abort()

    # -- collectives of the generation held ----------------------------------------------
    def held(self) -> Group:
        """The generation's group; :class:`CommError` between generations."""
        group = self._group
        if group is None:
            raise CommError("no communicator: this rank is between generations")
        return group

    def allreduce_sum_(self, t: torch.Tensor, timeout_s: float | None = None) -> None:
        self.held().allreduce_sum_(t, timeout_s or self.backstop_s)

    def allreduce_work(self, t: torch.Tensor, timeout_s: float | None = None) -> dist.Work:
        return self.held().allreduce_work(t, timeout_s or self.backstop_s)

    def broadcast_(self, t: torch.Tensor, root: int = 0, timeout_s: float | None = None) -> None:
        self.held().broadcast_(t, root, timeout_s or self.backstop_s)

    def send(self, t: torch.Tensor, dst: int, tag: int = 0, timeout_s: float | None = None) -> None:
        self.held().send(t, dst, tag, timeout_s or self.backstop_s)

    def recv(self, t: torch.Tensor, src: int, tag: int = 0, timeout_s: float | None = None) -> None:
        self.held().recv(t, src, tag, timeout_s or self.backstop_s)

    def barrier(self, timeout_s: float | None = None) -> None:
        self.held().barrier(timeout_s or self.backstop_s)


def _abort_quietly(backend: C10dBackend, prefix: str) -> None:
    """``backend.abort()``, its errors logged, never raised."""
    t0 = time.monotonic()
    try:
        backend.abort()
    except Exception as exc:
        _log.warning("comm_abort_failed", prefix=prefix, error=str(exc)[:300])
        return
    _log.info("comm_aborted", prefix=prefix, ms=round((time.monotonic() - t0) * 1000.0, 2))
