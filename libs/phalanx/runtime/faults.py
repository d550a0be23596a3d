"""Fault injection for tests, the demo and benchmarks: ``PHALANX_FAULTS``.

A comma-separated list of ``action:worker@point``:

- actions: ``kill`` (SIGKILL itself), ``stop`` (SIGSTOP itself: a hang with
  silent heartbeats), ``stall`` (the training thread blocks forever while the
  heartbeats go on), ``spin`` (the training thread runs a busy Python loop forever:
  the process burns its CPU, the heartbeats go on), ``exit`` (exit code 3), ``break`` (the worker drops its
  communicator as if the network had failed: every rank's collective fails,
  nobody dies; only at ``step=N``), ``wedge`` (the training thread enters phase
  COLLECTIVE and blocks forever, as a rank hung inside a collective whose
  heartbeats go on: its peers' per-op timeouts fire; not at ``recovery=G``);
- points: ``step=N`` (in step N, before the gradient all-reduce, so peers are
  left blocked in the collective: after the backward pass under the Trainer, as
  DDP hands over its first gradient bucket in the user's own loop; with a
  sharded model (``job.mesh``) as the step's first collective starts, the
  forward's first all-gather, at the step boundary), ``reduce=N`` (a sharded
  model's step N, as its first gradient reduce-scatter starts: mid-step, in the
  backward pass), ``pause=N`` (in step N, as the rank enters ``job.pause``),
  ``collective=G`` (the same place in the first step of generation G: its first
  gradient all-reduce, past the barrier every member passes first where no member
  has timed a step yet: ``Session.arrive``), ``recovery=G`` (as the worker starts
  joining generation G, before its rendezvous), ``rendezvous=G`` (inside G's
  rendezvous, once every member has arrived and the process group is being
  connected) or ``transfer=G`` (inside G's state transfer, as it begins).

>>> FaultPlan.parse("kill:w2@step=5,stop:w1@recovery=2")
FaultPlan(faults=(Fault(action='kill', worker='w2', point='step', value=5), ...))

Faults name a worker, not a rank, so a spare that takes over a rank does not
inherit its predecessor's fault. With ``PHALANX_FAULT_LOG`` set, each fault
appends ``{"worker", "action", "point", "value", "ts"}`` to that file just before
it strikes: benchmarks measure downtime from that instant.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from phalanx.settings import Fault, RankSettings, load, parse_faults

__all__ = ["Fault", "FaultPlan"]


@dataclass(frozen=True)
class FaultPlan:
    faults: tuple[Fault, ...] = ()
    _fired: set[Fault] = field(default_factory=set, compare=False, repr=False)

    @classmethod
    def parse(cls, spec: str) -> FaultPlan:
        """The plan of ``spec`` (grammar: :func:`phalanx.settings.parse_faults`)."""
        return cls(parse_faults(spec))

    @classmethod
    def from_env(cls) -> FaultPlan:
        """``PHALANX_FAULTS``, parsed when the rank read its settings."""
        return cls(load(RankSettings).faults)

    def fire(
        self, worker: str, point: str, value: int, *, enter_collective: Callable[[], object] | None = None
    ) -> bool:
        """Strike the faults set for this point; True when one is ``break``, which
        the caller carries out (it owns the communicator). A ``wedge`` calls
        ``enter_collective`` (the caller's way into phase COLLECTIVE) before it blocks."""
        broke = False
        for f in self.faults:
            if f.worker == worker and f.point == point and f.value == value and f not in self._fired:
                self._fired.add(f)  # each fault strikes once, also when its step is redone
                _log(f)
                if f.action == "break":
                    broke = True
                else:
                    if f.action == "wedge" and enter_collective is not None:
                        enter_collective()
                    _do(f.action)
        return broke


def _log(f: Fault) -> None:
    path = load(RankSettings).fault_log
    if path:
        line = json.dumps(
            {"worker": f.worker, "action": f.action, "point": f.point, "value": f.value, "ts": time.time()}
        )
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        try:
            os.write(fd, (line + "\n").encode())
        finally:
            os.close(fd)


def _do(action: str) -> None:
    if action == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif action == "stop":
        os.kill(os.getpid(), signal.SIGSTOP)
    elif action == "exit":
        os._exit(3)
    elif action in ("stall", "wedge"):
        threading.Event().wait()  # blocks this thread for good; heartbeats go on
    elif action == "spin":
        n = 0
        while True:  # a livelock in Python: the GIL is handed over every switch interval
            n += 1
