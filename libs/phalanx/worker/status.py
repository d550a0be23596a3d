"""What a rank is doing right now, shared between its training thread and its
bus thread. The training thread writes; the heartbeat loop reads. Single
attribute writes are atomic under the GIL, so no lock is needed for a snapshot
that is at most one field stale."""

from __future__ import annotations

import os
import socket
import time
from collections import deque
from dataclasses import dataclass, field

from phalanx.contract import Heartbeat, Phase, StepRecord
from phalanx.contract.messages import MAX_STEP_RECORDS


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
    op: int = 0
    """The collectives of the current step (or of the generation's recovery) entered so
    far: members enter the same ones in the same order, so a rank in COMPUTE at a
    lower count than a peer waiting in COLLECTIVE owes it that collective."""
    loss: float | None = None
    plan: int = 0
    """The newest plan generation the agent holds (its launcher acknowledges from it)."""
    phase: Phase = Phase.STARTING
    phase_since: float = field(default_factory=time.monotonic)
    pid: int = field(default_factory=os.getpid)
    host: str = field(default_factory=socket.gethostname)
    unsent: deque[StepRecord] = field(default_factory=lambda: deque(maxlen=4 * MAX_STEP_RECORDS))
    """Completed steps not yet on a heartbeat that went out (the oldest are dropped
    first when heartbeats cannot go out for long)."""

    def enter(self, phase: Phase) -> None:
        if phase is not self.phase:
            self.phase_since = time.monotonic()
            self.phase = phase

    def join(self, rank: int, generation: int) -> None:
        """Took ``generation``'s plan as ``rank``: RECOVERING in that generation from now,
        short of its collectives (a rank that stays so while its peers wait there is
        judged: the detector's joiner rule)."""
        self.phase_since = time.monotonic()
        self.phase = Phase.RECOVERING
        self.rank, self.generation, self.op = rank, generation, 0

    def enter_collective(self, bound_s: float) -> None:
        """Into a collective that may take ``bound_s``, timed from now also when the
        rank was in another one (a rendezvous, then the state transfer that follows)."""
        self.collective_bound_ms = bound_s * 1e3
        self.op += 1
        self.phase_since = time.monotonic()
        self.phase = Phase.COLLECTIVE

    def completed(self, step: int, step_ms: float, loss: float | None) -> None:
        """The training thread completed optimizer step ``step`` (counting it)."""
        self.step, self.step_ms, self.loss, self.op = step, step_ms, loss, 0
        self.unsent.append(
            StepRecord(
                worker=self.worker,
                rank=max(self.rank, 0),
                generation=self.generation,
                step=step,
                step_ms=step_ms,
                loss=loss,
                at=time.time(),
            )
        )

    def take_finished(self) -> list[StepRecord]:
        """Up to :data:`MAX_STEP_RECORDS` of the oldest unsent steps, removed from the queue."""
        out: list[StepRecord] = []
        while self.unsent and len(out) < MAX_STEP_RECORDS:
            out.append(self.unsent.popleft())
        return out

    def put_back(self, records: list[StepRecord]) -> None:
        """A heartbeat with ``records`` did not go out: they go out with the next."""
        self.unsent.extendleft(reversed(records))

    def heartbeat(self, seq: int, interval_s: float, finished: list[StepRecord] | None = None) -> Heartbeat:
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
            op=self.op,
            loss=self.loss,
            finished=finished or [],
            plan=self.plan,
        )
