"""A rank's client of the rendezvous store (:mod:`phalanx.runtime.storeserver`).

A ``dist.Store``, so gloo, NCCL and ``PrefixStore`` use it as they would torch's
``TCPStore`` (through torch's Python-store trampoline; whoever builds one keeps the
Python object alive as long as a group may ask it for keys). A key always belongs to
a generation: it starts with the generation's secret (``PrefixStore(secret, client)``,
which :func:`phalanx.runtime.comm.generation_store` builds after
:meth:`StoreClient.prove`). The client proves the secret once per connection and sends
the rest of the key under the slot the store gave it, so the secret never crosses the
wire; a key of no proved generation is refused here, before anything is sent.

One request at a time per client (a lock), each bounded: ``get`` and ``wait`` by their
timeout (the store's, :meth:`set_timeout`), told to the server, which answers at the
deadline; everything else by the same timeout on the socket. A connection the store
closed before it proved anything (a spare's early one, past the store's
``AUTH_S``) is made again when it first proves; one that breaks later fails its
request with ``DistNetworkError``, and the next request connects again.
"""

from __future__ import annotations

import hmac
import math
import socket
import threading
import time
from collections import OrderedDict
from datetime import timedelta
from typing import Any

import torch.distributed as dist

import phalanx.runtime.storewire as wire
from phalanx.runtime.storeserver import LEARN_S
from phalanx.worker.addr import split_addr

MAX_SECRETS = 16
"""Generations a client remembers (the store keeps as many slots per connection)."""
PROVE_ATTEMPTS = 4
"""Connections a proof is tried on when the store closes them before it answers."""
SLACK_S = 5.0
"""What a blocking request waits beyond its timeout for the store's answer."""


class StoreClient(dist.Store):
    """A connection to the store at ``addr`` (``host:port``), made at once.

    It lives until :meth:`close`: torch holds only the C++ half of a Python store (a
    ``PrefixStore`` over it, a process group), and fails with "Not implemented" once the
    Python object is gone, so every client is kept here (``_live``) until closed."""

    _live: set[StoreClient] = set()

    def __init__(self, addr: str, timeout: timedelta = timedelta(seconds=30)) -> None:
        super().__init__()
        self.addr = addr
        self._host, self._port = split_addr(addr)
        self._lock = threading.Lock()
        self._sock: socket.socket | None = None
        self._nonce = b""
        self._secrets: OrderedDict[str, int | None] = OrderedDict()  # secret -> slot on this connection
        self._requests = 0  # on this connection, the proofs not counted
        self.set_timeout(timeout)
        with self._lock:
            self._connect()
        StoreClient._live.add(self)

    # -- generations ----------------------------------------------------------------------
    def prove(self, secret: str) -> None:
        """Prove ``secret`` to the store (once per connection): keys under ``secret/``
        are this client's from now on. ``DistStoreError`` when the store refuses."""
        if not secret or "/" in secret:
            raise ValueError("a generation's secret: non-empty, no '/'")
        with self._lock:
            self._secrets[secret] = self._secrets.get(secret)
            self._secrets.move_to_end(secret)
            while len(self._secrets) > MAX_SECRETS:
                self._secrets.popitem(last=False)
            self._slot(secret)

    def _slot(self, secret: str) -> int:
        slot = self._secrets.get(secret)
        if slot is not None and self._sock is not None:
            return slot
        for attempt in range(PROVE_ATTEMPTS):
            if self._sock is None:
                self._connect()
            try:
                return self._prove(secret)
            except (OSError, wire.WireError) as exc:
                self._drop()
                if attempt == PROVE_ATTEMPTS - 1 or self._requests:  # a broken connection that served: say so
                    raise dist.DistNetworkError(f"store {self.addr}: {exc}") from None
                # the store closed a connection that had proved nothing yet (idle past its
                # AUTH_S, or the oldest of a full unproven pool): again, on a new one
                time.sleep(0.01 * (attempt + 1))
        raise AssertionError("unreachable")

    def _prove(self, secret: str) -> int:
        assert self._sock is not None
        mine = wire.nonce()
        status, value = self._exchange(
            [wire.AUTH, wire.space_id(secret), mine, wire.proof(secret, "client", self._nonce, mine)],
            self._timeout_s + LEARN_S,
        )
        if status != wire.OK:
            self._drop()
            raise dist.DistStoreError(f"store {self.addr}: {value}")
        slot, theirs = value
        if not hmac.compare_digest(bytes(theirs), wire.proof(secret, "server", self._nonce, mine)):
            self._drop()
            raise dist.DistStoreError(f"store {self.addr}: it could not prove it serves this generation")
        for other, held in self._secrets.items():  # the store keeps as many slots as we do
            if held is not None and held <= slot - MAX_SECRETS:
                self._secrets[other] = None
        self._secrets[secret] = int(slot)
        return int(slot)

    # -- the connection --------------------------------------------------------------------
    @property
    def _timeout(self) -> timedelta:
        """The store timeout (``set_timeout``; torch keeps it in the store's C++ half)."""
        return self.timeout  # type: ignore[attr-defined,no-any-return]  # in torch, not its stubs

    @property
    def _timeout_s(self) -> float:
        return self._timeout.total_seconds()

    def _connect(self) -> None:
        try:
            sock = socket.create_connection((self._host, self._port), timeout=self._timeout_s)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            greeting = wire.receive(sock)
        except (OSError, wire.WireError) as exc:
            raise dist.DistNetworkError(f"store {self.addr} unreachable: {exc}") from None
        if not (isinstance(greeting, list) and len(greeting) == 2 and greeting[0] == wire.MAGIC):
            sock.close()
            raise dist.DistNetworkError(f"store {self.addr}: not a Phalanx store ({str(greeting)[:80]})")
        self._sock, self._nonce, self._requests = sock, bytes(greeting[1]), 0
        for secret in self._secrets:
            self._secrets[secret] = None

    def _drop(self) -> None:
        if self._sock is not None:
            self._sock.close()
        self._sock = None
        for secret in self._secrets:
            self._secrets[secret] = None

    def _exchange(self, request: list[Any], timeout_s: float) -> tuple[str, Any]:
        assert self._sock is not None
        self._sock.settimeout(timeout_s)
        wire.send(self._sock, request)
        answer = wire.receive(self._sock)
        if not (
            isinstance(answer, list) and len(answer) == 2 and answer[0] in (wire.OK, wire.TIMEOUT, wire.ERROR)
        ):
            raise wire.WireError(f"a malformed answer {str(answer)[:80]}")
        return answer[0], answer[1]

    def _call(self, op: str, secret: str, args: list[Any], timeout_s: float | None = None) -> Any:
        """``op`` with ``args`` in ``secret``'s generation; the store's answer. ``timeout_s``:
        a blocking request's (``get``, ``wait``), told to the store."""
        with self._lock:
            if secret not in self._secrets:
                raise ValueError(
                    f"store {self.addr}: a key of no proved generation (wrap the client with generation_store)"
                )
            slot = self._slot(secret)
            bound = self._timeout_s if timeout_s is None else timeout_s + SLACK_S
            extra = (
                [] if timeout_s is None else [max(0, math.ceil(timeout_s * 1e3) + 1)]
            )  # never before the caller's deadline
            try:
                status, value = self._exchange([op, slot, *args, *extra], bound)
                self._requests += 1
            except (OSError, wire.WireError) as exc:
                self._drop()
                raise dist.DistNetworkError(f"store {self.addr}: {exc}") from None
        if status == wire.OK:
            return value
        raise dist.DistStoreError(f"store {self.addr}: {value}")

    def _key(self, op: str, key: str, *args: Any, timeout_s: float | None = None) -> Any:
        secret, _, rest = key.partition("/")
        return self._call(op, secret, [rest, *args], timeout_s)

    def _keys(self, op: str, keys: list[str], timeout_s: float | None = None) -> Any:
        secrets = {k.partition("/")[0] for k in keys}
        if len(secrets) != 1:
            raise ValueError("keys of one generation per request")
        return self._call(op, secrets.pop(), [[k.partition("/")[2] for k in keys]], timeout_s)

    # -- dist.Store -----------------------------------------------------------------------
    def set(self, key: str, value: str | bytes) -> None:
        self._key(wire.SET, key, value.encode() if isinstance(value, str) else bytes(value))

    def get(self, key: str) -> bytes:
        return bytes(self._key(wire.GET, key, timeout_s=self._timeout_s))

    def add(self, key: str, value: int) -> int:
        return int(self._key(wire.ADD, key, int(value)))

    def compare_set(self, key: str, expected: str | bytes, desired: str | bytes) -> bytes:
        as_bytes = lambda v: v.encode() if isinstance(v, str) else bytes(v)  # noqa: E731
        return bytes(self._key(wire.CAS, key, as_bytes(expected), as_bytes(desired)))

    def delete_key(self, key: str) -> bool:
        return bool(self._key(wire.DELETE, key))

    def check(self, keys: list[str]) -> bool:
        return bool(self._keys(wire.CHECK, keys)) if keys else True

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        if keys:
            self._keys(wire.WAIT, keys, (timeout or self._timeout).total_seconds())

    def clone(self) -> StoreClient:
        """Another connection to the same store, having proved the same generations.
        (Called from Python only: a ``PrefixStore`` over this client cannot clone it.)"""
        other = StoreClient(self.addr, self._timeout)
        with self._lock:
            secrets = list(self._secrets)
        for secret in secrets:
            other.prove(secret)
        return other

    def close(self) -> None:
        """Close the connection; the client is unusable from now on."""
        with self._lock:
            self._drop()
        StoreClient._live.discard(self)
