"""Bounds a server applies to whoever connects, before it trusts them: connections held
per caller and in total, failed authentications per address, and log lines per cause.

Each is counted before a byte of a request is read, so a flood of connections costs the
server a counter, not memory (the keeper's :mod:`~phalanx.checkpoint.ranksocket` and
:mod:`~phalanx.checkpoint.peerserver`, the rendezvous store's
:mod:`~phalanx.runtime.storeserver`)."""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Any


@dataclass
class ConnectionLimits:
    """Connections open at once: at most ``total``, and ``per_key`` from one key (a uid,
    a peer address). :meth:`open` before a connection is served, :meth:`close` after."""

    total: int
    per_key: int
    _open: dict[Hashable, int] = field(default_factory=dict)

    def open(self, key: Hashable) -> str:
        """Count one more connection of ``key``: "" when it fits, else why not (and
        nothing is counted)."""
        if self.held() >= self.total:
            return f"too many connections ({self.total} at once)"
        if self._open.get(key, 0) >= self.per_key:
            return f"too many connections from one caller ({self.per_key} at once)"
        self._open[key] = self._open.get(key, 0) + 1
        return ""

    def close(self, key: Hashable) -> None:
        left = self._open[key] - 1
        if left:
            self._open[key] = left
        else:
            del self._open[key]

    def held(self, key: Hashable | None = None) -> int:
        """Connections open (``key``'s, or all)."""
        return sum(self._open.values()) if key is None else self._open.get(key, 0)


@dataclass
class FailureBudget:
    """Failed attempts each key (a peer address) may make: a token bucket of ``burst``
    failures, one given back every ``refill_s``. A key whose bucket is empty is refused
    at once -- it holds no handshake slot -- until a token is back: a flood that never
    authenticates gets one try per ``refill_s``, however fast it reconnects."""

    burst: int
    refill_s: float
    clock: Callable[[], float] = time.monotonic
    _tokens: dict[Hashable, tuple[float, float]] = field(default_factory=dict)  # key -> (tokens, at)

    def _now(self, key: Hashable) -> float:
        tokens, at = self._tokens.get(key, (float(self.burst), 0.0))
        now = self.clock()
        if key in self._tokens:
            tokens = min(float(self.burst), tokens + (now - at) / self.refill_s)
        if tokens >= self.burst:
            self._tokens.pop(key, None)  # a full bucket is the default: nothing kept for it
        else:
            self._tokens[key] = (tokens, now)
        return tokens

    def allows(self, key: Hashable) -> bool:
        """Whether ``key`` may try (it has a failure left)."""
        return self._now(key) >= 1.0

    def failed(self, key: Hashable) -> None:
        self._tokens[key] = (max(0.0, self._now(key) - 1.0), self.clock())

    def wait_s(self, key: Hashable) -> float:
        """How long until ``key`` may try again (0: now)."""
        return max(0.0, (1.0 - self._now(key)) * self.refill_s)


@dataclass
class ThrottledLog:
    """At most ``burst`` log lines per cause (event and key) every ``every_s``; the first
    line of the next period says how many were left out: a flood of refusals is counted,
    not written line by line."""

    log: Any
    burst: int = 5
    every_s: float = 10.0
    clock: Callable[[], float] = time.monotonic
    _periods: dict[tuple[str, Hashable], list[float]] = field(default_factory=dict)  # start, lines, left out

    def warning(self, event: str, key: Hashable, **fields: Any) -> None:
        now = self.clock()
        period = self._periods.get((event, key))
        left_out = 0
        if period is None or now - period[0] >= self.every_s:
            left_out = int(period[2]) if period is not None else 0
            if len(self._periods) > 4096:  # many keys (addresses): forget the quiet ones
                self._periods = {k: v for k, v in self._periods.items() if now - v[0] < self.every_s}
            period = self._periods[event, key] = [now, 0.0, 0.0]
        if period[1] >= self.burst:
            period[2] += 1
            return
        period[1] += 1
        self.log.warning(event, **fields, **({"left_out": left_out} if left_out else {}))
