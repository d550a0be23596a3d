"""Publishes a rank's heartbeat on core NATS every interval.

Runs on the rank's bus thread, so a training thread busy in a long step keeps
heartbeating, while a stopped process (SIGSTOP) or a dead one falls silent.
The schedule is anchored to the loop clock, so heartbeats do not drift.
"""

from __future__ import annotations

import asyncio
import os

from phalanx.bus import Bus
from phalanx.bus.subjects import HEARTBEAT
from phalanx.runtime.status import RankStatus

DEFAULT_INTERVAL_S = 0.1


def heartbeat_interval_s() -> float:
    """``PHALANX_HEARTBEAT_MS`` (default 100 ms)."""
    raw = os.environ.get("PHALANX_HEARTBEAT_MS")
    value = float(raw) / 1000.0 if raw else DEFAULT_INTERVAL_S
    if value <= 0:
        raise ValueError(f"PHALANX_HEARTBEAT_MS must be positive, got {raw!r}")
    return value


class HeartbeatPublisher:
    def __init__(self, bus: Bus, status: RankStatus, interval_s: float | None = None) -> None:
        self.bus = bus
        self.status = status
        self.interval_s = interval_s or heartbeat_interval_s()
        self.seq = 0

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        next_at = loop.time()
        while True:
            try:
                await self.bus.publish(
                    HEARTBEAT,
                    self.status.heartbeat(self.seq, self.interval_s),
                    traced=False,
                    job=self.status.job,
                    worker=self.status.worker,
                )
                self.seq += 1
            except Exception as exc:  # disconnected: keep the schedule, try again
                self.bus.log.debug("heartbeat_failed", error=repr(exc))
            next_at += self.interval_s
            delay = next_at - loop.time()
            if delay < 0:  # fell behind (e.g. the process was stopped): resync
                next_at = loop.time()
                delay = 0
            await asyncio.sleep(delay)
