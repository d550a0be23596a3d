"""One generation's communicator: a gloo process group over the job's store.

The store is a long-lived ``TCPStore`` hosted by the launcher (never by a
training rank, which could die with it). Each generation gets its own
``PrefixStore`` (``plan.store_prefix``), so stale keys of an old generation can
never confuse a new one, and a standalone ``ProcessGroupGloo`` wrapped in a
``ProcessGroup`` -- no default group, no ``init_process_group``.

Teardown is by dropping references (:meth:`Communicator.destroy`): the gloo
destructor closes its TCP pairs, which makes every peer still blocked in a
collective fail with "Connection closed by peer" within tens of ms (the cascade
measured in notes/inprocess-recovery.md). gloo has no working abort for an
in-flight op, so every collective also carries a per-op timeout as a backstop.

A rendezvous must be abandonable: before the group is built, every member
announces itself under the prefix and waits for the others with
:meth:`arrival_barrier`, which polls and gives up when ``cancelled()`` says a
newer plan has superseded this one.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist

from phalanx.runtime.addr import listen_socket, split_addr

DEFAULT_TIMEOUT_S = 60.0


class CommError(RuntimeError):
    """A collective or a rendezvous failed; the communicator is dead."""


class Superseded(Exception):
    """A newer plan arrived while waiting for this generation's members."""


def connect_store(addr: str, timeout_s: float = 30.0) -> dist.TCPStore:
    """A client of a store at ``host:port``."""
    host, port = split_addr(addr)
    return dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=timeout_s), use_libuv=True)


def host_store(host: str = "127.0.0.1", port: int = 0, sock: socket.socket | None = None) -> dist.TCPStore:
    """Host a store (a launcher does this) listening on ``host`` only (``store.port``).

    ``TCPStore(is_master=True)`` alone listens on every interface whatever ``host``
    says; handing it a socket already bound to ``host`` (``sock``, or one made
    here) keeps it on the interface the node is reached by.
    """
    sock = sock or listen_socket(host, port)
    try:
        store = dist.TCPStore(
            host,
            int(sock.getsockname()[1]),
            is_master=True,
            wait_for_workers=False,
            use_libuv=True,
            master_listen_fd=sock.fileno(),
        )
    except BaseException:
        sock.close()
        raise
    sock.detach()  # the store serves on this fd from now on: Python must not close it
    return store


def arrival_barrier(
    store: dist.Store,
    prefix: str,
    rank: int,
    world_size: int,
    cancelled: Callable[[], bool],
    timeout_s: float,
    poll_s: float = 0.0005,
) -> None:
    """Announce ``rank`` under ``prefix`` and wait until all ``world_size`` have.

    Raises :class:`Superseded` when ``cancelled()`` turns true and
    :class:`CommError` after ``timeout_s``.
    """
    store.set(f"{prefix}/arrived/{rank}", str(time.time()))
    keys = [f"{prefix}/arrived/{r}" for r in range(world_size)]
    deadline = time.monotonic() + timeout_s
    while not store.check(keys):
        if cancelled():
            raise Superseded(prefix)
        if time.monotonic() > deadline:
            missing = [k for k in keys if not store.check([k])]
            raise CommError(f"rendezvous {prefix}: timed out waiting for {missing}")
        time.sleep(poll_s)


class Communicator:
    """The process group of one generation, and the few collectives the runtime uses."""

    def __init__(
        self,
        store: dist.Store,
        prefix: str,
        rank: int,
        world_size: int,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        bind: str | None = None,
    ) -> None:
        """``bind``: the address gloo listens on and announces (the node's interface);
        None lets gloo pick from the hostname, as torch does by default."""
        self.prefix = prefix
        self.rank = rank
        self.world_size = world_size
        self.timeout = timedelta(seconds=timeout_s)
        pstore = dist.PrefixStore(f"{prefix}/pg", store)
        try:
            if bind:
                opts = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
                opts._timeout = self.timeout
                opts._devices = [dist.ProcessGroupGloo.create_device(hostname=bind)]
                backend = dist.ProcessGroupGloo(pstore, rank, world_size, opts)
            else:
                backend = dist.ProcessGroupGloo(pstore, rank, world_size, self.timeout)
        except Exception as exc:  # DistStoreError, gloo connect errors
            raise CommError(f"building process group {prefix}: {exc}") from exc
        pg = dist.ProcessGroup(pstore, rank, world_size)
        pg._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.GLOO, backend)
        pg._set_default_backend(dist.ProcessGroup.BackendType.GLOO)
        self._backend: dist.ProcessGroupGloo | None = backend
        self._pg: dist.ProcessGroup | None = pg

    @property
    def pg(self) -> dist.ProcessGroup:
        if self._pg is None:
            raise CommError(f"communicator {self.prefix} was destroyed")
        return self._pg

    def destroy(self) -> None:
        """Drop the group at once: its sockets close and blocked peers fail fast."""
        self._pg = None
        self._backend = None

    def _run(self, what: str, fn: Callable[[], object]) -> None:
        work = None
        try:
            work = fn()
            work.wait()  # type: ignore[attr-defined]
            return
        except Exception as exc:
            msg = f"{what} on {self.prefix} failed: {exc}"
        # The Work object and a chained traceback would keep the group (and its
        # sockets) alive; peers blocked on us are only released once it is gone.
        work = None
        self.destroy()
        raise CommError(msg)

    def allreduce_sum_(self, t: torch.Tensor, timeout_s: float | None = None) -> None:
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.SUM  # type: ignore[assignment]  # the stubs mix ReduceOp and RedOpType
        opts.timeout = timedelta(seconds=timeout_s) if timeout_s else self.timeout
        self._run("allreduce", lambda: self.pg.allreduce([t], opts))

    def send(self, t: torch.Tensor, dst: int, tag: int = 0) -> None:
        self._run(f"send to {dst}", lambda: self.pg.send([t], dst, tag))

    def recv(self, t: torch.Tensor, src: int, tag: int = 0) -> None:
        self._run(f"recv from {src}", lambda: self.pg.recv([t], src, tag))

    def barrier(self) -> None:
        opts = dist.BarrierOptions()
        opts.timeout = self.timeout
        self._run("barrier", lambda: self.pg.barrier(opts))
