"""What a rank is doing right now, shared between its training thread and its
bus thread. The training thread writes; the heartbeat loop reads. Single
attribute writes are atomic under the GIL, so no lock is needed for a snapshot
that is at most one field stale."""

from __future__ import annotations

import os
import socket
import time
from dataclasses import dataclass, field

from phalanx.schemas import Heartbeat, Phase


@dataclass
class RankStatus:
    job: str
    worker: str
    rank: int = -1
    generation: int = 0
    step: int = 0
    step_ms: float = 0.0
    collective_bound_ms: float = 0.0
    """The per-op timeout of the current (or last) gradient all-reduce: the detector
    takes a rank in COLLECTIVE for longer, while a peer has left, for hung."""
    phase: Phase = Phase.STARTING
    phase_since: float = field(default_factory=time.monotonic)
    pid: int = field(default_factory=os.getpid)
    host: str = field(default_factory=socket.gethostname)

    def enter(self, phase: Phase) -> None:
        if phase is not self.phase:
            self.phase_since = time.monotonic()
            self.phase = phase

    def heartbeat(self, seq: int, interval_s: float) -> Heartbeat:
        return Heartbeat(
            job=self.job,
            worker=self.worker,
            rank=self.rank,
            generation=self.generation,
            step=self.step,
            step_ms=self.step_ms,
            phase=self.phase,
            phase_ms=(time.monotonic() - self.phase_since) * 1000.0,
            seq=seq,
            pid=self.pid,
            host=self.host,
            interval_ms=interval_s * 1000.0,
            collective_bound_ms=self.collective_bound_ms,
        )
