"""Phi-accrual arithmetic (Hayashibara et al., as in Akka and Cassandra): the
suspicion level :func:`phi` of a silence, the number of standard deviations at
which it crosses a threshold, and the sliding window of inter-arrival samples
(:class:`IntervalWindow`) both are computed from."""

from __future__ import annotations

import math
from collections import deque
from statistics import NormalDist

__all__ = ["PHI_CAP", "IntervalWindow", "phi", "phi_threshold_z"]

_LOG10_E = math.log10(math.e)
_SQRT2 = math.sqrt(2.0)
_LOG10_SQRT_2PI = math.log10(math.sqrt(2.0 * math.pi))
PHI_CAP = 999.0
"""phi is reported as at most this (an infinite float does not survive the wire)."""


def phi_threshold_z(threshold: float) -> float:
    """How many standard deviations past the mean phi reaches ``threshold``.

    >>> round(phi_threshold_z(8.0), 3)
    5.612
    """
    if threshold <= 0:
        raise ValueError(f"phi threshold must be positive, got {threshold}")
    return -NormalDist().inv_cdf(10.0**-threshold)


def phi(elapsed: float, mean: float, std: float) -> float:
    """``-log10(1 - F(elapsed))`` for ``F`` the CDF of ``N(mean, std)``.

    Uses ``erfc`` for the tail and its asymptote where that underflows, so large
    values stay finite and monotonic (capped at :data:`PHI_CAP`).

    >>> round(phi(1.0, 1.0, 0.1), 3)     # at the mean: 1 - F = 1/2
    0.301
    >>> phi(2.0, 1.0, 0.1) > phi(1.5, 1.0, 0.1) > 3
    True
    """
    if std <= 0:
        raise ValueError("std must be positive")
    y = (elapsed - mean) / std
    tail = 0.5 * math.erfc(y / _SQRT2)
    if tail > 1e-300:
        return min(PHI_CAP, -math.log10(tail))
    # Q(y) ~ exp(-y^2/2) / (y sqrt(2 pi)) for large y
    return min(PHI_CAP, (y * y / 2.0) * _LOG10_E + math.log10(y) + _LOG10_SQRT_2PI)


class IntervalWindow:
    """A sliding window of samples with O(1) mean and standard deviation.

    >>> w = IntervalWindow(3)
    >>> for x in (1.0, 2.0, 3.0, 4.0):
    ...     w.add(x)
    >>> len(w), w.mean, round(w.std, 4)
    (3, 3.0, 0.8165)
    """

    __slots__ = ("_samples", "_sum", "_sumsq")

    def __init__(self, size: int) -> None:
        if size < 2:
            raise ValueError("window size must be at least 2")
        self._samples: deque[float] = deque(maxlen=size)
        self._sum = 0.0
        self._sumsq = 0.0

    def add(self, x: float) -> None:
        if len(self._samples) == self._samples.maxlen:
            old = self._samples[0]
            self._sum -= old
            self._sumsq -= old * old
        self._samples.append(x)
        self._sum += x
        self._sumsq += x * x

    def __len__(self) -> int:
        return len(self._samples)

    @property
    def mean(self) -> float:
        return self._sum / len(self._samples) if self._samples else 0.0

    def mean_std(self) -> tuple[float, float]:
        """(mean, std) in one go (the detector's hot path)."""
        n = len(self._samples)
        if n < 2:
            return self.mean, 0.0
        m = self._sum / n
        var = self._sumsq / n - m * m
        return m, math.sqrt(var) if var > 0.0 else 0.0

    @property
    def std(self) -> float:
        """Population standard deviation (0 for fewer than two samples)."""
        n = len(self._samples)
        if n < 2:
            return 0.0
        m = self._sum / n
        return math.sqrt(max(0.0, self._sumsq / n - m * m))

    def estimate(
        self, declared: float, min_samples: int, min_std_ratio: float, min_std: float
    ) -> tuple[float, float]:
        """(mean, floored std), the detector's hot path (every heartbeat): with fewer
        than ``min_samples`` samples, the larger of ``declared`` and the mean with a
        wide std; else the window's own, std floored at ``max(min_std_ratio * mean,
        min_std)``.

        >>> w = IntervalWindow(10); w.add(1.0)
        >>> w.estimate(2.0, 2, 0.2, 0.01)
        (2.0, 0.5)
        >>> w.add(1.0); w.estimate(2.0, 2, 0.2, 0.01)
        (1.0, 0.2)
        """
        n = len(self._samples)
        if n < min_samples:  # not enough evidence yet: trust the declared interval, widely
            mean = self._sum / n if n else 0.0
            mean = mean if mean > declared else declared
            return mean, max(mean / 4.0, min_std_ratio * mean, min_std)
        mean = self._sum / n
        var = self._sumsq / n - mean * mean
        std = math.sqrt(var) if var > 0.0 else 0.0
        floor = min_std_ratio * mean
        floor = floor if floor > min_std else min_std
        return mean, std if std > floor else floor
