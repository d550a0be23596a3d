"""The keeper's TCP server for peer keepers: a replica sent to this node, a copy fetched
from it. Bounded before anything is allocated: connections per keeper and per address,
the keeper key proved first (:mod:`phalanx.checkpoint.peerauth`), every read timed."""

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


class PeerServer:
    def __init__(
        self, cfg: KeeperConfig, holdings: Holdings, rec: Recorder, tasks: KeeperTasks, log: Any
    ) -> None:
        self.cfg, self.holdings, self.rec, self.tasks, self.log = cfg, holdings, rec, tasks, log
        self.shm = holdings.shm
        self._conns: dict[str, int] = {}  # peer address -> connections open
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
        """One peer connection: at most ``max_connections`` (``max_connections_per_peer`` from
        one address); the peer proves the keeper key within ``auth_timeout_s`` -- no thread,
        no allocation before that -- then asks for one thing."""
        task = asyncio.current_task()
        if task is not None:
            task.set_name("keeper-peer")
        counters = self.rec.counters
        name = writer.get_extra_info("peername")
        peer = str(name[0]) if isinstance(name, tuple) and name else "?"
        if (
            sum(self._conns.values()) >= self.cfg.max_connections
            or self._conns.get(peer, 0) >= self.cfg.max_connections_per_peer
        ):
            counters["peers_refused"] = counters.get("peers_refused", 0) + 1
            self.log.warning("peer_refused", peer=peer, error="too many connections")
            writer.close()
            return
        self._conns[peer] = self._conns.get(peer, 0) + 1
        try:
            try:
                session = await peerauth.accept(reader, writer, self.cfg.key, self.cfg.auth_timeout_s)
            except (wire.WireError, OSError) as exc:  # AuthError, a broken hello, a timeout
                counters["unauthenticated"] = counters.get("unauthenticated", 0) + 1
                self.log.warning("peer_unauthenticated", peer=peer, error=str(exc) or type(exc).__name__)
                return
            session.peer = peer
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
                    await session.send(
                        writer, {"ok": False, "error": str(exc)[:500]}, self.cfg.auth_timeout_s
                    )
        finally:
            self._conns[peer] -= 1
            if not self._conns[peer]:
                del self._conns[peer]
            writer.close()

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
