"""The keeper's TCP server for peer keepers: a replica sent to this node, a copy fetched
from it. Bounded before anything is allocated, and before the peer is trusted:

- a connection first holds a *handshake* slot (:attr:`KeeperConfig.max_handshakes`,
  ``max_handshakes_per_peer`` from one address) while the peer proves the keeper key
  (:mod:`phalanx.checkpoint.peerauth`) within ``auth_timeout_s``;
- an address whose handshakes keep failing (a wrong key, silence until the timeout) is
  refused at once, holding nothing, once it has used its ``auth_failure_burst``; it gets
  one more try every ``auth_failure_refill_s`` (:class:`~phalanx.limits.FailureBudget`);
- only a peer that proved the key takes one of the slots that replicate and fetch
  (:attr:`KeeperConfig.max_connections`, ``max_connections_per_peer``).

So connections that never authenticate -- from many addresses, reconnecting as fast as
they are dropped -- cannot keep a keeper that knows the key out. Every read is timed."""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any

import phalanx.checkpoint.peerauth as peerauth
import phalanx.checkpoint.wire as wire
from phalanx.checkpoint.catalog import COMPLETE
from phalanx.checkpoint.holdings import Holdings
from phalanx.checkpoint.keeperconfig import KeeperConfig
from phalanx.checkpoint.keepertasks import KeeperTasks
from phalanx.checkpoint.manifest import FileEntry, Manifest
from phalanx.checkpoint.record import Recorder
from phalanx.checkpoint.replication import deadline_for
from phalanx.checkpoint.tiers import Tier
from phalanx.limits import ConnectionLimits, FailureBudget, ThrottledLog


class PeerServer:
    def __init__(
        self, cfg: KeeperConfig, holdings: Holdings, rec: Recorder, tasks: KeeperTasks, log: Any
    ) -> None:
        self.cfg, self.holdings, self.rec, self.tasks, self.log = cfg, holdings, rec, tasks, log
        self.shm = holdings.shm
        self.handshakes = ConnectionLimits(cfg.max_handshakes, cfg.max_handshakes_per_peer)
        self.sessions = ConnectionLimits(cfg.max_connections, cfg.max_connections_per_peer)
        self.failures = FailureBudget(cfg.auth_failure_burst, cfg.auth_failure_refill_s)
        self._refusals = ThrottledLog(log)
        self._server: asyncio.AbstractServer | None = None

    async def start(self) -> str:
        """Serve on :attr:`KeeperConfig.host`/``port``; the address peers reach (``host:port``)."""
        self._server = await asyncio.start_server(self._serve, self.cfg.host, self.cfg.port, limit=wire.PIECE)
        port = self._server.sockets[0].getsockname()[1]
        return f"{self.cfg.host}:{port}"

    def close(self) -> None:
        if self._server is not None:
            self._server.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """One peer connection: the key proved in a handshake slot, then one request in
        a session slot (module doc); no thread, no allocation before that."""
        task = asyncio.current_task()
        if task is not None:
            task.set_name("keeper-peer")
        name = writer.get_extra_info("peername")
        peer = str(name[0]) if isinstance(name, tuple) and name else "?"
        try:
            session = await self._authenticate(peer, reader, writer)
            if session is None:
                return
            refused = self.sessions.open(peer)
            if refused:
                self._refuse(peer, refused)
                with contextlib.suppress(Exception):
                    await session.send(writer, {"ok": False, "error": refused}, self.cfg.auth_timeout_s)
                return
            try:
                await self._request(session, peer, reader, writer)
            finally:
                self.sessions.close(peer)
        finally:
            writer.close()

    async def _authenticate(
        self, peer: str, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> peerauth.Session | None:
        """The peer's proof of the key, in a handshake slot; None (counted, logged) when
        it is refused a slot or fails."""
        if not self.failures.allows(peer):
            wait = self.failures.wait_s(peer)
            self._refuse(peer, f"too many failed handshakes: next try in {wait:.1f} s", "auth_throttled")
            return None
        refused = self.handshakes.open(peer)
        if refused:
            self._refuse(peer, f"{refused} in handshake")
            return None
        try:
            session = await peerauth.accept(reader, writer, self.cfg.key, self.cfg.auth_timeout_s)
        except (wire.WireError, OSError) as exc:  # AuthError, a broken hello, a timeout
            self.failures.failed(peer)
            self._count("unauthenticated")
            self._refusals.warning(
                "peer_unauthenticated", peer, peer=peer, error=str(exc) or type(exc).__name__
            )
            return None
        finally:
            self.handshakes.close(peer)
        session.peer = peer
        return session

    def _refuse(self, peer: str, why: str, counter: str = "peers_refused") -> None:
        self._count(counter)
        self._refusals.warning("peer_refused", peer, peer=peer, error=why)

    def _count(self, counter: str) -> None:
        self.rec.counters[counter] = self.rec.counters.get(counter, 0) + 1

    async def _request(
        self,
        session: peerauth.Session,
        peer: str,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
    ) -> None:
        """An authenticated peer's one request: ``replicate`` or ``fetch``."""
        try:
            req = await session.recv(reader, self.cfg.io_timeout_s)
            op = req.get("op")
            if op == "replicate":
                await self._receive(session, req, reader, writer)
            elif op == "fetch":
                await self._serve_fetch(session, req, writer)
            else:
                raise wire.WireError(f"unknown op {str(op)[:40]!r}")
        except (wire.WireError, ValueError, OSError) as exc:
            self.log.warning("peer_refused", peer=peer, error=str(exc) or type(exc).__name__)
            with contextlib.suppress(Exception):
                await session.send(writer, {"ok": False, "error": str(exc)[:500]}, self.cfg.auth_timeout_s)

    async def _receive(
        self,
        session: peerauth.Session,
        req: dict[str, Any],
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
    ) -> None:
        raw = req.get("manifest")
        if not isinstance(raw, bytes):
            raise wire.WireError("replicate without a manifest")
        m = Manifest.parse(raw, f"manifest from {session.peer}")
        self.shm.check_room(m)
        await self.rec.committed(m)
        t0 = time.perf_counter()
        deadline = deadline_for(self.cfg, m.total_bytes)

        async def fill(f: FileEntry, at: int, into: memoryview) -> None:
            await wire.read_into(reader, into, deadline)

        directory = await self.shm.fill(m, fill, "replicas")
        self.rec.counters["received"] += 1
        self.shm.adopt(m, directory)
        # Recorded and retained in a task of the keeper's own (``idle`` waits for it), spawned
        # before the sender hears "ok": when the sender is idle, this keeper is busy or done.
        self.tasks.spawn(self._received(m, time.perf_counter() - t0), f"keeper-received-{m.job}-{m.step}")
        await session.send(writer, {"ok": True}, self.cfg.io_timeout_s)

    async def _received(self, m: Manifest, seconds: float) -> None:
        await self.rec.note(m, Tier.MEMORY, COMPLETE, seconds=seconds, detail=f"replica of {m.origin}")
        await self.holdings.retain(m.job, Tier.MEMORY)

    async def _serve_fetch(
        self, session: peerauth.Session, req: dict[str, Any], writer: asyncio.StreamWriter
    ) -> None:
        job, step = req.get("job"), req.get("step")
        if not isinstance(job, str) or type(step) is not int:
            raise wire.WireError("fetch needs a job (str) and a step (int)")
        found = await self.holdings.local_copy(job, step)
        if found is None:
            await session.send(writer, {"ok": False, "error": f"{job}@{step} is not on {self.cfg.node}"}, 5.0)
            return
        m, where = found
        await self.rec.committed(m)
        await session.send(writer, {"ok": True, "manifest": m.encode()}, self.cfg.io_timeout_s)
        deadline = deadline_for(self.cfg, m.total_bytes)
        loop = asyncio.get_running_loop()
        for f in m.files:
            path, offset = where[f.name]
            if not f.size:
                continue
            with open(path, "rb") as src:  # sendfile: the bytes go from the page cache to the socket
                await asyncio.wait_for(
                    loop.sendfile(writer.transport, src, offset, f.size),
                    max(0.0, deadline.end - time.monotonic()),
                )
        self.rec.counters["served"] += 1
