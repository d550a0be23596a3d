"""The rendezvous store's server: each generation's keys, reachable only by its members.

One :class:`StoreServer` holds a key space per generation it was told the secret of
(:meth:`StoreServer.allow`: by its launcher, from each plan; by rank 0 of an unmodified
script, for the script's own generation store). A connection reaches a space only
after it proved the secret (:mod:`phalanx.runtime.storewire`), and only the spaces it
proved: a non-member with the store's address can read, write, delete, count or list
nothing, and cannot learn a key's name.

It is bounded before it trusts (the shape of the keeper's, :mod:`phalanx.limits`):
connections per address and in total; connections that have not yet proved anything in
a smaller pool of their own, closed after :data:`AUTH_S` or, when the pool is full,
oldest first for a newcomer (members prove within a round trip, so holding the pool
keeps no member out); failed proofs per address
(a token bucket: a guessing client gets one try per :data:`FAILURE_REFILL_S`); a frame
read within :data:`BODY_S` of its header; values, keys and each space's bytes capped;
the oldest space dropped when more than :data:`MAX_SPACES` are known (its members are
long gone: every plan names a new secret). A proof for a space not yet known waits up
to :data:`LEARN_S` for the launcher to be told it (a rank may read the plan first).

The semantics are torch's ``TCPStore``'s, which gloo and NCCL rely on: ``get`` and
``wait`` block until the keys exist (or the request's timeout), ``add`` keeps a decimal
integer, ``compare_set`` sets when the value is the expected one (or absent and
expected empty) and answers the value now held. Imports no torch.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import phalanx.runtime.storewire as wire
from phalanx.limits import ConnectionLimits, FailureBudget, ThrottledLog
from phalanx.telemetry import get_logger

AUTH_S = 30.0
"""A connection that has proved no generation within this is closed (a spare's early
connection reconnects when it first authenticates)."""
BODY_S = 10.0
"""A frame whose header arrived must be complete within this."""
LEARN_S = 3.0
"""How long a proof for an unknown generation waits for its secret to be allowed."""
MAX_SPACES = 64
MAX_SPACE_BYTES = 256 * 1024 * 1024
MAX_SPACE_KEYS = 1 << 20
MAX_SLOTS = 16
"""Generations one connection holds at once (a client kept across generations proves
each new one; the oldest is forgotten)."""
MAX_CONNECTIONS, MAX_CONNECTIONS_PER_HOST = 16384, 4096
MAX_UNPROVEN, MAX_UNPROVEN_PER_HOST = 4096, 1024
"""Connections that have proved nothing yet, in all and from one address (a few KiB
each): when full, the oldest of them is closed for the newcomer
(:meth:`StoreServer._admit`). Room for every rank of a large single-host job connecting
at once (a rank's two connections, hundreds of ranks: ``bench.rendezvous``)."""
FAILURE_BURST, FAILURE_REFILL_S = 8, 10.0
MAX_INT = 1 << 62

_log = get_logger(component="store")


class Refused(Exception):
    """A request answered with an error; the connection goes on."""


@dataclass
class Space:
    """One generation's keys, and the requests waiting for keys to appear."""

    data: dict[str, bytes] = field(default_factory=dict)
    size: int = 0
    waiting: dict[str, list[asyncio.Future[None]]] = field(default_factory=dict)

    def put(self, key: str, value: bytes) -> None:
        old = self.data.get(key)
        grown = len(value) - len(old) if old is not None else len(key) + len(value)
        if old is None and len(self.data) >= MAX_SPACE_KEYS:
            raise Refused(f"the generation's store holds {MAX_SPACE_KEYS} keys already")
        if self.size + grown > MAX_SPACE_BYTES:
            raise Refused(f"the generation's store holds {MAX_SPACE_BYTES} bytes already")
        self.data[key] = value
        self.size += grown
        for fut in self.waiting.pop(key, []):
            if not fut.done():
                fut.set_result(None)

    def delete(self, key: str) -> bool:
        old = self.data.pop(key, None)
        if old is None:
            return False
        self.size -= len(old) + len(key)
        return True

    async def wait(self, keys: list[str], timeout_s: float) -> bool:
        """Whether every key of ``keys`` exists within ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        loop = asyncio.get_running_loop()
        for key in keys:
            while key not in self.data:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                fut: asyncio.Future[None] = loop.create_future()
                self.waiting.setdefault(key, []).append(fut)
                try:
                    await asyncio.wait_for(fut, left)
                except TimeoutError:
                    return False
                finally:
                    futs = self.waiting.get(key)
                    if futs is not None and fut in futs:
                        futs.remove(fut)
                        if not futs:
                            del self.waiting[key]
        return True

    def close(self) -> None:
        """Retired: every request waiting here is answered with an error."""
        for futs in self.waiting.values():
            for fut in futs:
                if not fut.done():
                    fut.set_exception(Refused("the generation was retired from this store"))
        self.waiting.clear()


class StoreServer:
    """The key spaces of the generations it knows, served on a listening socket."""

    def __init__(self, secrets: tuple[str, ...] = ()) -> None:
        self._spaces: OrderedDict[bytes, tuple[str, Space]] = OrderedDict()
        self._learned: asyncio.Event | None = None
        self.connections = ConnectionLimits(MAX_CONNECTIONS, MAX_CONNECTIONS_PER_HOST)
        self.unproven = ConnectionLimits(MAX_UNPROVEN, MAX_UNPROVEN_PER_HOST)
        self.failures = FailureBudget(FAILURE_BURST, FAILURE_REFILL_S)
        self._throttled = ThrottledLog(_log)
        self._server: asyncio.Server | None = None
        self._sessions: dict[asyncio.Task[Any], asyncio.StreamWriter] = {}
        self._unproven: OrderedDict[Session, None] = OrderedDict()  # oldest first
        for secret in secrets:
            self.allow(secret)

    # -- what the launcher tells it -------------------------------------------------------
    def allow(self, secret: str) -> None:
        """Serve the generation of ``secret`` (idempotent); the oldest beyond
        :data:`MAX_SPACES` is dropped. Call from the server's event loop."""
        if not secret:
            return
        sid = wire.space_id(secret)
        if sid in self._spaces:
            return
        self._spaces[sid] = (secret, Space())
        while len(self._spaces) > MAX_SPACES:
            _, (_, old) = self._spaces.popitem(last=False)
            old.close()
        if self._learned is not None:
            self._learned.set()
            self._learned = asyncio.Event()

    def keys(self, secret: str) -> list[str]:
        """The keys the generation of ``secret`` holds (in this process only: no request
        lists keys)."""
        known = self._spaces.get(wire.space_id(secret))
        return list(known[1].data) if known is not None else []

    # -- serving -------------------------------------------------------------------------
    async def start(self, sock: Any) -> None:
        """Serve on ``sock``, a bound, listening socket (the server's from now on)."""
        self._learned = asyncio.Event()
        self._server = await asyncio.start_server(self._connection, sock=sock, limit=wire.MAX_FRAME)

    async def close(self) -> None:
        """Stop listening and end every connection."""
        if self._server is not None:
            self._server.close()
        for _, space in self._spaces.values():
            space.close()
        for writer in self._sessions.values():
            writer.transport.abort()  # not a task's cancel: 3.11's stream callback chokes on that
        if self._sessions:
            await asyncio.wait(list(self._sessions), timeout=2.0)

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer = writer.get_extra_info("peername")
        host = str(peer[0]) if isinstance(peer, tuple) else "local"
        why = self.connections.open(host)
        if why:
            self._throttled.warning("store_connection_refused", host, host=host, reason=why)
            writer.close()
            return
        session = Session(self, reader, writer, host)
        self._admit(session)
        task = asyncio.current_task()
        assert task is not None
        self._sessions[task] = writer
        try:
            await session.run()
        except (ConnectionError, wire.WireError, TimeoutError, asyncio.IncompleteReadError):
            pass  # the client went away or broke the protocol: its connection ends, nothing else
        finally:
            self._sessions.pop(task, None)
            self.connections.close(host)
            self._settle(session)
            writer.close()

    def _admit(self, session: Session) -> None:
        """Count ``session`` among the unproven; when their pool (its host's, or all) is
        full, the oldest unproven connection there is closed to make room: a member proves
        within a round trip of connecting, so whoever holds connections without proving
        anything loses them first, and cannot keep members out by holding the pool."""
        host = session.host
        while self.unproven.open(host):
            full_host = self.unproven.held(host) >= self.unproven.per_key
            victim = next(s for s in self._unproven if not full_host or s.host == host)
            self._throttled.warning("store_unproven_evicted", victim.host, host=victim.host)
            self._settle(victim)
            victim.writer.transport.abort()
        self._unproven[session] = None

    def _settle(self, session: Session) -> None:
        """``session`` leaves the unproven pool (it proved a generation, ended or was evicted)."""
        if self._unproven.pop(session, False) is None:
            self.unproven.close(session.host)

    # -- what a session asks for ----------------------------------------------------------
    async def prove(self, host: str, sid: bytes, server_nonce: bytes, client_nonce: bytes, mac: bytes) -> str:
        """The secret of ``sid`` when ``mac`` proves it, else :class:`Refused`."""
        if not self.failures.allows(host):
            raise Refused(
                f"too many failed authentications from {host}: retry in {self.failures.wait_s(host):.0f}s"
            )
        deadline = time.monotonic() + LEARN_S
        while sid not in self._spaces and self._learned is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._learned.wait(), left)
        known = self._spaces.get(sid)
        if known is None or not hmac.compare_digest(
            mac, wire.proof(known[0], "client", server_nonce, client_nonce)
        ):
            self.failures.failed(host)
            self._throttled.warning("store_authentication_failed", host, host=host)
            raise Refused("authentication failed: not a member of a generation this store serves")
        return known[0]

    def space(self, sid: bytes) -> Space:
        known = self._spaces.get(sid)
        if known is None:
            raise Refused("the generation was retired from this store")
        return known[1]

    def proven(self, session: Session) -> None:
        """``session`` proved its first generation: it leaves the unproven pool."""
        self._settle(session)


class Session:
    """One client connection: the handshake, then its requests in order."""

    def __init__(
        self, server: StoreServer, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, host: str
    ) -> None:
        self.server, self.reader, self.writer, self.host = server, reader, writer, host
        self.nonce = wire.nonce()
        self.slots: OrderedDict[int, bytes] = OrderedDict()
        self._next_slot = 0

    @property
    def slots_ever(self) -> bool:
        """Whether this connection proved a generation (it left the unproven pool then)."""
        return self._next_slot > 0

    async def run(self) -> None:
        await self._send(wire.hello(self.nonce))
        unproven_until = time.monotonic() + AUTH_S
        while True:
            if not self.slots_ever:
                left = unproven_until - time.monotonic()
                if left <= 0:
                    return
                header = await asyncio.wait_for(self.reader.readexactly(wire.HEADER_SIZE), left)
            else:
                header = await self.reader.readexactly(wire.HEADER_SIZE)
            n = wire.frame_length(header)
            body = wire.unpack(await asyncio.wait_for(self.reader.readexactly(n), BODY_S))
            try:
                answer = await self._answer(body)
            except Refused as exc:
                answer = [wire.ERROR, str(exc)]
                if body[:1] == [wire.AUTH]:
                    await self._send(answer)
                    return  # a failed proof ends the connection
            await self._send(answer)

    async def _send(self, body: Any) -> None:
        self.writer.write(wire.pack(body))
        await self.writer.drain()

    async def _answer(self, body: Any) -> list[Any]:
        if not isinstance(body, list) or not body or not isinstance(body[0], str):
            raise wire.WireError("a request is [op, ...]")
        op, args = body[0], body[1:]
        if op == wire.AUTH:
            return await self._auth(*_typed(args, bytes, bytes, bytes))
        if not self.slots_ever:
            raise wire.WireError(f"{op!r} before any generation was proved")
        if not args or not isinstance(args[0], int) or args[0] not in self.slots:
            raise Refused("no such slot on this connection")
        space = self.server.space(self.slots[args[0]])
        args = args[1:]
        if op == wire.SET:
            key, value = _typed(args, str, bytes)
            space.put(_key(key), _value(value))
            return [wire.OK, None]
        if op == wire.GET:
            key, timeout_ms = _typed(args, str, int)
            deadline = time.monotonic() + timeout_ms / 1e3
            while (value := space.data.get(_key(key))) is None:  # deleted as it appeared: wait again
                if not await space.wait([key], deadline - time.monotonic()):
                    return [wire.TIMEOUT, f"wait timeout after {timeout_ms}ms, keys: {key}"]
            return [wire.OK, value]
        if op == wire.ADD:
            key, delta = _typed(args, str, int)
            try:
                now = int(space.data.get(_key(key), b"0")) + delta
            except ValueError:
                raise Refused(f"add: {key} does not hold an integer") from None
            if abs(now) >= MAX_INT:
                raise Refused("add: out of range")
            space.put(key, str(now).encode())
            return [wire.OK, now]
        if op == wire.CAS:
            key, expected, desired = _typed(args, str, bytes, bytes)
            held = space.data.get(_key(key))
            if (held is None and not expected) or (held is not None and held == expected):
                space.put(key, _value(desired))
                return [wire.OK, desired]
            return [wire.OK, expected if held is None else held]
        if op == wire.DELETE:
            (key,) = _typed(args, str)
            return [wire.OK, space.delete(key)]
        if op == wire.CHECK:
            (keys,) = _typed(args, list)
            return [wire.OK, all(_key(k) in space.data for k in _keys(keys))]
        if op == wire.WAIT:
            keys, timeout_ms = _typed(args, list, int)
            if not await space.wait([_key(k) for k in _keys(keys)], timeout_ms / 1e3):
                return [wire.TIMEOUT, f"wait timeout after {timeout_ms}ms, keys: {keys[:8]}"]
            return [wire.OK, None]
        raise wire.WireError(f"no such request {op!r}")

    async def _auth(self, sid: bytes, client_nonce: bytes, mac: bytes) -> list[Any]:
        if len(sid) != 16 or len(client_nonce) != 16 or len(mac) != 32:
            raise wire.WireError("a malformed proof")
        secret = await self.server.prove(self.host, sid, self.nonce, client_nonce, mac)
        if not self.slots_ever:
            self.server.proven(self)
        slot = self._next_slot
        self._next_slot += 1
        self.slots[slot] = sid
        while len(self.slots) > MAX_SLOTS:
            self.slots.popitem(last=False)
        return [wire.OK, [slot, wire.proof(secret, "server", self.nonce, client_nonce)]]


async def _call(fn: Any, *args: Any) -> Any:
    return fn(*args)


def _typed(args: list[Any], *types: type) -> list[Any]:
    if len(args) != len(types) or not all(isinstance(a, t) for a, t in zip(args, types, strict=True)):
        raise wire.WireError(
            f"arguments {[type(a).__name__ for a in args]}, expected {[t.__name__ for t in types]}"
        )
    if any(isinstance(a, bool) for a, t in zip(args, types, strict=True) if t is int):
        raise wire.WireError("a boolean where an integer belongs")
    return args


def _key(key: str) -> str:
    if not key or len(key) > wire.MAX_KEY:
        raise Refused(f"a key of {len(key)} characters (1 to {wire.MAX_KEY})")
    return key


def _keys(keys: list[Any]) -> list[str]:
    if len(keys) > wire.MAX_KEYS_PER_REQUEST or not all(isinstance(k, str) for k in keys):
        raise wire.WireError(f"keys: a list of at most {wire.MAX_KEYS_PER_REQUEST} strings")
    return keys


def _value(value: bytes) -> bytes:
    if len(value) > wire.MAX_VALUE:
        raise Refused(f"a value of {len(value)} bytes (at most {wire.MAX_VALUE})")
    return value


class ThreadedStore:
    """A :class:`StoreServer` on a thread of its own with its own event loop: a rank that
    hosts a store for the script it runs (:mod:`phalanx.runtime.unmodified`)."""

    def __init__(self, sock: Any, secrets: tuple[str, ...]) -> None:
        self.port = int(sock.getsockname()[1])
        self.server = StoreServer(secrets)
        self._loop = asyncio.new_event_loop()
        started = threading.Event()
        failure: list[BaseException] = []

        def serve() -> None:
            asyncio.set_event_loop(self._loop)
            try:
                self._loop.run_until_complete(self.server.start(sock))
            except BaseException as exc:
                failure.append(exc)
                started.set()
                return
            started.set()
            self._loop.run_forever()

        self._thread = threading.Thread(target=serve, name="phalanx-store", daemon=True)
        self._thread.start()
        started.wait()
        if failure:
            raise failure[0]

    def allow(self, secret: str) -> None:
        self._loop.call_soon_threadsafe(self.server.allow, secret)

    def keys(self, secret: str) -> list[str]:
        return asyncio.run_coroutine_threadsafe(_call(self.server.keys, secret), self._loop).result(5.0)

    def close(self) -> None:
        if self._loop.is_closed():
            return
        asyncio.run_coroutine_threadsafe(self.server.close(), self._loop).result(5.0)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5.0)
        if not self._thread.is_alive():
            self._loop.close()
