"""Sends a rank's heartbeat every interval: to its node's launcher, or on NATS.

Runs on the rank's bus thread, so a training thread busy in a long step keeps
heartbeating, while a stopped process (SIGSTOP) or a dead one falls silent.
The schedule is anchored to the loop clock, so heartbeats do not drift.

Where the launcher set ``PHALANX_HEARTBEAT_SOCKET`` (the path of its unix
datagram socket), each heartbeat is one datagram to it, the encoded
:class:`~phalanx.contract.Heartbeat` payload: the launcher checks the sender's pid
with the kernel and publishes one :class:`~phalanx.contract.NodeDigest` per node
and interval (:mod:`phalanx.worker.digest`), so the detector reads 2,000 digests
instead of 16,000 heartbeats. Without the variable (a rank run without a
launcher, tests, small deployments) each heartbeat is published on core NATS,
``phalanx.hb.<job>.<worker>``. Sending never blocks and never raises into the loop.
"""

from __future__ import annotations

import asyncio
import socket

from phalanx.bus import Bus
from phalanx.contract import Heartbeat, Phase, encode
from phalanx.contract.subjects import HEARTBEAT
from phalanx.settings import RankSettings, load
from phalanx.worker.status import RankStatus

SOCKET_ENV = "PHALANX_HEARTBEAT_SOCKET"


class HeartbeatPublisher:
    """``run()`` heartbeats forever; ``goodbye()`` sends the last one (phase DONE).

    ``interval_s`` defaults to ``PHALANX_HEARTBEAT_MS`` (in seconds, converted once by
    the settings); ``socket_path`` defaults to ``PHALANX_HEARTBEAT_SOCKET``; empty means NATS.
    """

    def __init__(
        self,
        bus: Bus,
        status: RankStatus,
        interval_s: float | None = None,
        *,
        socket_path: str | None = None,
    ) -> None:
        self.bus = bus
        self.status = status
        settings = load(RankSettings)
        self.interval_s = interval_s or settings.heartbeat_interval_s
        if socket_path is None:
            socket_path = str(settings.heartbeat_socket or "")
        self.socket_path = socket_path
        self.seq = 0
        self.failures = 0
        self._sock: socket.socket | None = None

    async def send_now(self, hb: Heartbeat) -> bool:
        """Send one heartbeat the configured way; False (logged at debug) when it did not go out."""
        try:
            if self.socket_path:
                if self._sock is None:
                    self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
                    self._sock.setblocking(False)
                payload, _ = encode(hb)  # the kind is known: a datagram is a heartbeat
                self._sock.sendto(payload, self.socket_path)
            else:
                await self.bus.publish(HEARTBEAT, hb, traced=False, job=hb.job, worker=hb.worker)
            return True
        except Exception as exc:  # no launcher socket, a full queue, disconnected: try again later
            self.failures += 1
            self.bus.log.debug("heartbeat_failed", error=repr(exc), socket=self.socket_path or None)
            return False

    async def goodbye(self) -> None:
        """Enter DONE and say so, so the detector does not take the silence that follows for a hang."""
        self.status.enter(Phase.DONE)
        await self.send_now(self.status.heartbeat(self.seq, 1.0, self.status.take_finished()))
        self.close()

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        next_at = loop.time()
        while True:
            finished = self.status.take_finished()
            if await self.send_now(self.status.heartbeat(self.seq, self.interval_s, finished)):
                self.seq += 1
            else:
                self.status.put_back(finished)
            next_at += self.interval_s
            delay = next_at - loop.time()
            if delay < 0:  # fell behind (e.g. the process was stopped): resync
                next_at = loop.time()
                delay = 0
            await asyncio.sleep(delay)
