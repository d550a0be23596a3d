"""A manual clock for the detector's tests (the detector takes its clocks injected)."""

from __future__ import annotations


class FakeClock:
    """``monotonic`` and ``wall`` move together, only when told.

    >>> c = FakeClock(start=10.0); c.advance(0.5); c.monotonic(), c.wall() - c.epoch
    (10.5, 10.5)
    """

    def __init__(self, start: float = 1000.0, epoch: float = 1_700_000_000.0) -> None:
        self.now = start
        self.epoch = epoch

    def advance(self, seconds: float) -> None:
        self.now += seconds

    def monotonic(self) -> float:
        return self.now

    def wall(self) -> float:
        return self.epoch + self.now
