"""The keeper's side of the peer protocol that dials out: replicating a checkpoint to
the next keepers of the ring, and fetching one from a peer into this node's memory.
Every connection proves the keeper key first (:mod:`phalanx.checkpoint.peerauth`)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Collection
from typing import Any

import phalanx.checkpoint.peerauth as peerauth
import phalanx.checkpoint.wire as wire
from phalanx.checkpoint.holdings import Holdings
from phalanx.checkpoint.keeperconfig import KeeperConfig
from phalanx.checkpoint.manifest import FileEntry, Manifest, ManifestError
from phalanx.checkpoint.memcopy import MemCopy
from phalanx.checkpoint.record import Recorder


def deadline_for(cfg: KeeperConfig, nbytes: int) -> wire.Deadline:
    """How long a transfer of ``nbytes`` with a peer may take, on the whole."""
    return wire.Deadline.for_bytes(nbytes, cfg.io_timeout_s, cfg.min_rate)


class Replicator:
    """Copies to and from peer keepers (their addresses are in the catalog)."""

    def __init__(self, cfg: KeeperConfig, holdings: Holdings, rec: Recorder, log: Any) -> None:
        self.cfg, self.holdings, self.rec, self.log = cfg, holdings, rec, log
        self.node = cfg.node

    async def replicate(self, m: Manifest, have: Collection[str] = ()) -> tuple[list[str], str]:
        """``m`` to ``replicas`` keepers, the next ones after this node in the ring of
        keepers sorted by name (one that fails: the next); ``have``: peers that hold a
        replica already (not sent again, counted). Returns the peers it reached now and
        the last error ("" if none)."""
        keepers = await self.rec.catalog.keepers()
        ring = sorted(keepers)
        others = (
            [n for n in ring[ring.index(self.node) + 1 :] + ring[: ring.index(self.node)]]
            if self.node in ring
            else ring
        )
        made: list[str] = []
        error = ""
        for peer in others:
            if len(made) + len(have) >= self.cfg.replicas:
                break
            if peer == self.node or peer in have:
                continue
            t0 = time.perf_counter()
            try:
                await self._send(keepers[peer], m)
            except (OSError, wire.WireError, TimeoutError, ManifestError) as exc:
                self.log.warning("replicate_failed", job=m.job, step=m.step, peer=peer, error=repr(exc))
                error = f"{peer}: {exc!r}"
                continue
            made.append(peer)
            self.rec.counters["replicated"] += 1
            self.log.info(
                "replicated", job=m.job, step=m.step, peer=peer, seconds=round(time.perf_counter() - t0, 3)
            )
        if len(made) + len(have) < self.cfg.replicas and not error:
            error = f"{len(others)} other keeper(s) registered in the catalog"
        return made, error

    async def _send(self, addr: str, m: Manifest) -> None:
        async with self._dial(addr) as (session, reader, writer):
            request = {"op": "replicate", "manifest": m.encode(), "from": self.node}
            await session.send(writer, request, self.cfg.io_timeout_s)
            deadline = deadline_for(self.cfg, m.total_bytes)
            mem = self.holdings.shm.copies.get((m.job, m.step))
            for f in m.files:
                data = mem.read(f.name) if mem is not None else self.holdings.reader_or_fail(m)(f.name)
                await wire.write_bytes(writer, data, deadline)
            wire.checked(await session.recv(reader, self.cfg.io_timeout_s))

    async def fetch(self, addr: str, m: Manifest) -> MemCopy:
        """``m`` (the catalog's manifest) from the peer keeper at ``addr``, into this
        node's shared memory, each chunk checked against ``m``'s digests as it arrives."""
        async with self._dial(addr) as (session, reader, writer):
            await session.send(writer, {"op": "fetch", "job": m.job, "step": m.step}, self.cfg.io_timeout_s)
            reply = wire.checked(await session.recv(reader, self.cfg.io_timeout_s))
            theirs = Manifest.parse(reply.get("manifest") or b"", f"manifest from {addr}")
            if theirs.encode() != m.encode():
                raise ManifestError(f"{addr} holds another {m.job}@{m.step} than the catalog's")
            deadline = deadline_for(self.cfg, m.total_bytes)

            async def fill(f: FileEntry, at: int, into: memoryview) -> None:
                await wire.read_into(reader, into, deadline)

            directory = await self.holdings.shm.fill(m, fill, "restored")
        return self.holdings.shm.adopt(m, directory)

    @contextlib.asynccontextmanager
    async def _dial(
        self, addr: str
    ) -> AsyncIterator[tuple[peerauth.Session, asyncio.StreamReader, asyncio.StreamWriter]]:
        """An authenticated connection to the keeper at ``addr`` (``host:port``)."""
        host, _, port = addr.rpartition(":")
        reader, writer = await asyncio.wait_for(
            asyncio.open_connection(host, int(port), limit=wire.PIECE), self.cfg.connect_timeout_s
        )
        try:
            session = await peerauth.connect(reader, writer, self.cfg.key, self.cfg.auth_timeout_s)
            session.peer = addr
            yield session, reader, writer
        finally:
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()
