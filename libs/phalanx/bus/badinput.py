"""Refused input, reported without flooding: a budget of error events per subject pattern.

A message that fails to decode never reaches a handler. It is logged and reported as an
:class:`~phalanx.contract.ErrorEvent` on ``phalanx.err.<service>``; per subject pattern
(:func:`subject_pattern`) at most ``per_s`` of those a second go out, in bursts of
``burst``, and what the limit holds back is summed up in one event as soon as the budget
allows.
"""

from __future__ import annotations

import asyncio
import contextlib

from phalanx.bus.core import Core
from phalanx.contract import DecodeError, ErrorEvent
from phalanx.contract.subjects import CATALOGUE, ERROR


class _Budget:
    """The error-event budget of one subject pattern (a token bucket), and what it held back."""

    __slots__ = ("flusher", "last", "stamp", "suppressed", "tokens")

    def __init__(self, tokens: float, stamp: float) -> None:
        self.tokens = tokens
        self.stamp = stamp
        self.suppressed = 0
        self.last: tuple[str, DecodeError] | None = None
        self.flusher: asyncio.Task[None] | None = None


def subject_pattern(subject: str) -> str:
    """The catalogue pattern ``subject`` is an instance of (its tokens as ``*``), else
    ``other``: the key of the error-event budget, whatever the tokens say.

    >>> subject_pattern("phalanx.hb.j1.w0"), subject_pattern("nope.x")
    ('phalanx.hb.*.*', 'other')
    """
    parts = subject.split(".")
    for s in CATALOGUE:
        pat = s.pattern.split(".")
        if len(pat) == len(parts) and all(p[0] == "{" or p == q for p, q in zip(pat, parts, strict=True)):
            return s.wildcard()
    return "other"


class BadInputReporter:
    """Counts, logs and publishes what ``bus`` refused (:meth:`report`)."""

    def __init__(self, bus: Core) -> None:
        self.bus = bus
        self.decode_errors = 0  # every refused input
        self.suppressed = 0  # refused inputs reported only in a summary (rate limit)
        self._budgets: dict[str, _Budget] = {}  # subject pattern -> its error-event budget
        self._sends: set[asyncio.Task[None]] = set()
        # False for a client that is no error publisher (a policy, the CLI): logged only.
        self.publish_events = True

    async def report(self, subject: str, err: DecodeError) -> None:
        """Count, log and publish an :class:`ErrorEvent` for a message that was refused.

        Never waits (the caller is usually a subscription's callback, and a flood of
        bad messages must not hold up the good ones behind it): the event goes out
        from a task of its own, at most ``bus.ERROR_EVENTS_IN_FLIGHT`` at a time. Per
        subject pattern at most ``bus.ERROR_EVENTS_PER_S`` events and log lines a second
        go out, in bursts of ``bus.ERROR_EVENTS_BURST``; what the limit holds back is
        counted (:attr:`suppressed`) and reported in one summary event and log line
        (``bad_input_suppressed``, "<count> more refused ...") as soon as the budget allows.
        """
        bus = self.bus
        self.decode_errors += 1
        now = asyncio.get_running_loop().time()
        key = subject_pattern(subject)
        budget = self._budgets.get(key)
        if budget is None:
            budget = self._budgets[key] = _Budget(float(bus.ERROR_EVENTS_BURST), now)
        self._refill(budget, now)
        room = len(self._sends) < bus.ERROR_EVENTS_IN_FLIGHT
        if budget.suppressed == 0 and budget.tokens >= 1.0 and room:
            budget.tokens -= 1.0
            bus.log.error("bad_input", subject=subject, reason=err.reason, kind=err.kind)
            self._send(ErrorEvent(service=bus.name, subject=subject, reason=err.reason, kind=err.kind))
            return
        budget.suppressed += 1
        budget.last = (subject, err)
        self.suppressed += 1
        if budget.flusher is None and not bus.closing:
            budget.flusher = bus.spawn(self._flush(key, budget), name="bad-input")

    def _refill(self, budget: _Budget, now: float) -> None:
        tokens = budget.tokens + (now - budget.stamp) * self.bus.ERROR_EVENTS_PER_S
        budget.tokens = min(float(self.bus.ERROR_EVENTS_BURST), tokens)
        budget.stamp = now

    async def _flush(self, key: str, budget: _Budget) -> None:
        """Once the budget allows, one summary of what the rate limit held back on ``key``."""
        bus = self.bus
        loop = asyncio.get_running_loop()
        try:
            while True:
                self._refill(budget, loop.time())
                if bus.closing or (budget.tokens >= 1.0 and len(self._sends) < bus.ERROR_EVENTS_IN_FLIGHT):
                    break
                await asyncio.sleep(max(0.01, (1.0 - budget.tokens) / bus.ERROR_EVENTS_PER_S))
            count, budget.suppressed = budget.suppressed, 0
            if count == 0 or budget.last is None:
                return
            subject, err = budget.last
            bus.log.error(
                "bad_input_suppressed", pattern=key, count=count, subject=subject, reason=err.reason
            )
            if bus.closing:
                return
            budget.tokens -= 1.0
            reason = f"{count} more refused inputs on {key} not reported one by one (rate limit); the last: {err.reason}"
            self._send(ErrorEvent(service=bus.name, subject=key, reason=reason[:4000], kind=err.kind))
        finally:
            budget.flusher = None

    def _send(self, event: ErrorEvent) -> None:
        bus = self.bus
        if not self.publish_events:
            return

        async def send() -> None:
            with contextlib.suppress(Exception):
                await bus.publish(ERROR, event, retry_for_s=2.0, service=bus.name)

        task = bus.spawn(send(), name="error-event")
        self._sends.add(task)
        task.add_done_callback(self._sends.discard)
