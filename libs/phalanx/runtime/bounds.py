"""How long a rank waits in each collective before it gives up on its peers.

Every collective Phalanx runs on a rank carries one of these bounds (through the
:class:`~phalanx.runtime.comm.Communicator`), and the rank reports it in its
heartbeats while it waits (``collective_bound_ms``, phase ``COLLECTIVE``). A
member whose bound fires leaves the phase (``RECOVERING``); the failure detector
then takes a member still inside the collective past its own bound for hung
(``collective_hang``), so a hang anywhere costs its peers about one bound:

- **gradient all-reduce**: ``max(floor, factor x the slowest of this generation's
  last 20)`` (``PHALANX_COLLECTIVE_FLOOR_MS``, 2000; ``PHALANX_COLLECTIVE_FACTOR``,
  4). Before the *first* of each generation every member passes a barrier, which
  waits for the slowest member's whole step (a joiner's forward and backward, while
  survivors may reuse their gradients): ``max(floor, factor x the slowest recent
  step of any member)``, the members' step times being shared at state transfer;
  before any member has completed a step (the job's first), nothing says how long
  the members' first forward and backward may differ, and the barrier is bounded by
  ``PHALANX_COLLECTIVE_INITIAL_MS`` (60000; a member that never arrives is the
  detector's straggler). The all-reduce after the barrier, whose members now start
  together, waits what moving the step's gradients takes at the slowest rate still
  taken for progress: ``inside floor + 2 x gradient bytes / MIN_BYTES_PER_S`` (a
  ring sends each byte about twice; ``PHALANX_COLLECTIVE_INSIDE_FLOOR_MS``, 1000:
  every member is known to be inside, so nothing but the transfer and the scheduler
  is waited for), never more than the barrier's: a rank hung inside a generation's
  first all-reduce costs its peers about a second, not a step-sized bound or a
  minute, and a large model's is not judged a hang.
- **rendezvous**: the arrival wait, ``floor + the gradient bound of the
  generation this rank leaves`` (a peer may still sit in that generation's last
  all-reduce; a newer plan ends the wait at once), or ``rendezvous_timeout_s``
  for a rank's first generation (the job's start, a spare); connecting the
  group once every member has arrived: the inside floor (every member is known to
  be there: nothing but the connections and the scheduler is waited for), each
  request to the generation's store meanwhile: ``floor``.
- **state transfer**: the members' exchange of their steps: ``floor``; each
  message of a state: ``floor + (receivers served before + 1) x the largest
  member's state / MIN_BYTES_PER_S``.

None is above ``collective_timeout_s`` (``PHALANX_COLLECTIVE_TIMEOUT_S``, 120), the
backstop, which is also the bound of the collectives outside recovery's path (the
final barrier, the all-reduce that follows a checkpoint load).
"""

from __future__ import annotations

from collections import deque

COLLECTIVE_WINDOW = 20
"""Gradient collectives (and steps) whose wall times make the learned bounds."""

MIN_BYTES_PER_S = 100 * 2**20
"""The slowest transfer (a state, packing included; the job's first gradient
all-reduce) still taken for progress, not a hang: a bound, far below what a
network or a memory copy does."""


def moving_s(floor_s: float, nbytes: int) -> float:
    """What a collective moving ``nbytes`` may take once every member is inside it:
    ``floor_s`` plus twice the bytes (a ring sends each about twice) at
    :data:`MIN_BYTES_PER_S`."""
    return floor_s + 2 * nbytes / MIN_BYTES_PER_S


class Bounds:
    """The bounds of one rank's collectives, learned from its own (and, at each
    state transfer, its peers') recent times. All in seconds."""

    def __init__(
        self,
        *,
        floor_s: float,
        factor: float,
        initial_s: float,
        backstop_s: float,
        rendezvous_s: float,
        inside_floor_s: float = 1.0,
    ) -> None:
        self.floor_s = floor_s
        self.inside_floor_s = inside_floor_s
        self.factor = factor
        self.initial_s = initial_s
        self.backstop_s = backstop_s
        self.rendezvous_s = rendezvous_s
        self._collective_ms: deque[float] = deque(maxlen=COLLECTIVE_WINDOW)
        self._step_ms: deque[float] = deque(maxlen=COLLECTIVE_WINDOW)
        self._first_s: float | None = None  # the first gradient all-reduce's, learned at state transfer
        self._left_s: float | None = None  # the gradient bound of the generation left
        self._arrived = False  # every member passed this generation's barrier

    def _capped(self, bound: float) -> float:
        return min(max(self.floor_s, bound), self.backstop_s)

    # -- gradient all-reduces ------------------------------------------------------------
    def gradient_s(self) -> float:
        """The per-op timeout of the next gradient all-reduce."""
        if self._collective_ms:
            return self._capped(self.factor * max(self._collective_ms) / 1e3)
        if self._first_s is not None:
            return self._first_s
        return self._capped(self.initial_s)

    @property
    def awaiting_arrival(self) -> bool:
        """Before this generation's first gradient all-reduce, whose barrier the
        members have not passed yet (:meth:`gradient_s` is then the barrier's bound)."""
        return not self._collective_ms and not self._arrived

    def arrived(self, gradient_bytes: int) -> None:
        """Every member has reached this generation's first gradient all-reduce (a
        barrier), which reduces ``gradient_bytes`` on this rank: it is bounded from
        here as one whose members start together (the module doc), never longer than
        the barrier was."""
        moving = min(moving_s(self.inside_floor_s, gradient_bytes), self.backstop_s)
        self._first_s = moving if self._first_s is None else min(self._first_s, moving)
        self._arrived = True

    @property
    def first_of_generation(self) -> bool:
        """No gradient all-reduce of this generation has completed yet."""
        return not self._collective_ms

    def record_collective(self, ms: float) -> None:
        self._collective_ms.append(ms)

    def record_step(self, ms: float) -> None:
        self._step_ms.append(ms)

    def slowest_step_ms(self) -> float:
        """This rank's slowest recent step (0: none yet), what it shares at state transfer."""
        return max(self._step_ms, default=0.0)

    # -- generations ---------------------------------------------------------------------
    def leave(self) -> None:
        """This rank leaves its generation: the next rendezvous waits for peers that
        may still be inside its last all-reduce."""
        self._left_s = self.gradient_s()

    def join(self, slowest_step_ms: float) -> None:
        """A new generation starts: its times are learned afresh, its first all-reduce
        bounded by the slowest recent step of any member (``0``: none has one)."""
        self._collective_ms.clear()
        self._arrived = False
        self._first_s = self._capped(self.factor * slowest_step_ms / 1e3) if slowest_step_ms > 0 else None

    # -- recovery ------------------------------------------------------------------------
    def arrival_s(self) -> float:
        """How long the rendezvous waits for every member to arrive."""
        if self._left_s is None:
            return min(self.rendezvous_s, self.backstop_s)
        return min(self.floor_s + self._left_s, self.backstop_s)

    def connect_s(self) -> float:
        """How long connecting the group may take once every member has arrived: the
        inside floor, every member being known to be there."""
        return min(self.inside_floor_s, self.backstop_s)

    def store_s(self) -> float:
        """Each request to the generation's store (a live store answers at once)."""
        return self._capped(self.floor_s)

    def exchange_s(self) -> float:
        """The members' exchange of their steps, right after connecting."""
        return self._capped(self.floor_s)

    def transfer_s(self, state_bytes: int, queued: int) -> float:
        """Each message of a state of (at most) ``state_bytes``, with ``queued``
        receivers served by the same source before this one."""
        return self._capped(self.floor_s + (queued + 1) * state_bytes / MIN_BYTES_PER_S)


__all__ = ["COLLECTIVE_WINDOW", "MIN_BYTES_PER_S", "Bounds", "moving_s"]
