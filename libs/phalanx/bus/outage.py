"""A lost server said once, not hundreds of times: the loss, then repeats with backoff, then the recovery.

While the server is away nats.py retries every ``reconnect_time_wait`` and hands each failed
attempt to the error callback; consume loops re-bind and JetStream publishes retry on their own
clocks. Logged as they come that was 603 identical ``nats_error`` warnings in 75 s in one
launcher's output. Here:

- the loss is logged once (``nats_disconnected``), and the recovery once (``nats_reconnected``, with how
  long the server was away and how many events were held back);
- in between, the outage's own symptoms (failed reconnect attempts, re-binds, publish retries)
  are counted and logged at most once per interval (``nats_still_disconnected`` with the count held back),
  the interval doubling from ``first_s`` to ``max_s`` (1 s, 2 s, 4 s ... 60 s);
- any other warning that repeats (the same event and key) is logged the first time and then on
  the same backoff, each line with ``repeated``: how many came since the last one logged
  (:class:`Repeats`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

FIRST_S = 1.0
MAX_S = 60.0


@dataclass
class _Streak:
    interval: float
    next_at: float
    held: int = 0


class Repeats:
    """Warnings keyed by what they are about: the first logged, repeats at most once per backoff interval."""

    def __init__(
        self,
        log: Any,
        *,
        first_s: float = FIRST_S,
        max_s: float = MAX_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.log = log
        self.first_s, self.max_s, self.clock = first_s, max_s, clock
        self._streaks: dict[str, _Streak] = {}
        self.held = 0  # every warning held back so far (all keys)

    def warn(self, key: str, event: str, **fields: Any) -> bool:
        """Log ``event`` unless it is a repeat of ``key`` inside its interval; True when logged."""
        now = self.clock()
        streak = self._streaks.get(key)
        if streak is None:
            self._streaks[key] = _Streak(self.first_s, now + self.first_s)
            self.log.warning(event, **fields)
            return True
        if now < streak.next_at:
            streak.held += 1
            self.held += 1
            return False
        self.log.warning(event, repeated=streak.held + 1, **fields)
        streak.interval = min(streak.interval * 2, self.max_s)
        streak.next_at, streak.held = now + streak.interval, 0
        return True

    def reset(self) -> None:
        """Forget every streak: the next of each kind is news again (after a recovery)."""
        self._streaks.clear()


class Outage:
    """The connection's story as the log tells it: :meth:`lost`, :meth:`symptom`..., :meth:`recovered`."""

    def __init__(
        self,
        log: Any,
        *,
        first_s: float = FIRST_S,
        max_s: float = MAX_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.log = log
        self.first_s, self.max_s, self.clock = first_s, max_s, clock
        self.repeats = Repeats(log, first_s=first_s, max_s=max_s, clock=clock)
        self.since: float | None = None  # when the server was lost (None: connected)
        self.outages = 0
        self._interval = first_s
        self._next_at = 0.0
        self._held = 0  # symptoms since the last line
        self._held_total = 0  # symptoms of this outage
        self._last = ""

    @property
    def down(self) -> bool:
        return self.since is not None

    def lost(self, server: str) -> None:
        """The connection is gone (nats.py's disconnected callback): logged once per outage."""
        if self.since is not None:
            return
        now = self.clock()
        self.since, self.outages = now, self.outages + 1
        self._interval, self._next_at = self.first_s, now + self.first_s
        self._held = self._held_total = 0
        self._last = ""
        self.log.warning("nats_disconnected", server=server)

    def symptom(self, key: str, event: str, **fields: Any) -> None:
        """Something went wrong: during an outage a symptom of it (counted, summed up with
        backoff); otherwise a warning of its own, logged the :class:`Repeats` way."""
        if self.since is None:
            self.repeats.warn(f"{event}:{key}", event, **fields)
            return
        now = self.clock()
        self._held += 1
        self._held_total += 1
        self._last = f"{event}: {fields.get('error', key)}"
        if now < self._next_at:
            return
        self.log.warning(
            "nats_still_disconnected",
            down_s=round(now - self.since, 1),
            suppressed=self._held,
            last=self._last,
        )
        self._interval = min(self._interval * 2, self.max_s)
        self._next_at, self._held = now + self._interval, 0

    def recovered(self, server: str) -> None:
        """Connected again (nats.py's reconnected callback): logged once, with the outage's length."""
        down_s = 0.0 if self.since is None else self.clock() - self.since
        self.log.info("nats_reconnected", url=server, down_s=round(down_s, 1), suppressed=self._held_total)
        self.since = None
        self.repeats.reset()
