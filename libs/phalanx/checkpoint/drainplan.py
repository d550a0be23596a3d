"""How a keeper drains: which tiers go side by side, how fast, and at what priority.

A checkpoint's durable tiers drain in *lanes*: the tiers of one lane one after the
other, the lanes at the same time (``PHALANX_CKPT_DRAIN``). The default,
``object | disk, shared``, streams the object copy from the memory copy at once --
it is the slowest and the most durable -- while the local disk and then the
shared path are written beside it; ``disk, shared, object`` is the old order, one
tier at a time. A lane drains one checkpoint at a time.

Each tier may be capped in bytes per second (``PHALANX_CKPT_RATE``, e.g.
``disk=400M,object=100M``): a :class:`Throttle` paces the writes of one copy so
that the drain leaves memory bandwidth and the network to the training step.
The drains' threads run at a lower CPU priority (``PHALANX_KEEPER_DRAIN_NICE``)
and in the idle IO class (``PHALANX_KEEPER_DRAIN_IDLE_IO``): they take what the
ranks leave. Restores, which a recovery waits for, keep the keeper's priority.

>>> DrainPlan.parse("object | disk, shared", "disk=400M").lanes
((<Tier.OBJECT: 'object'>,), (<Tier.DISK: 'disk'>, <Tier.SHARED: 'shared'>))
>>> DrainPlan.parse("disk,shared,object", "disk=400M, object=1.5G").rates[Tier.OBJECT]
1500000000.0
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import threading
import time
from dataclasses import dataclass, field

from phalanx.checkpoint.tiers import DRAIN_ORDER, Tier
from phalanx.settings import parse_drain_lanes, parse_rates

_IOPRIO_SET = 251  # x86_64 syscall number (ioprio_set)
_IOPRIO_WHO_PROCESS, _IOPRIO_CLASS_IDLE, _IOPRIO_CLASS_SHIFT = 1, 3, 13


@dataclass(frozen=True)
class DrainPlan:
    lanes: tuple[tuple[Tier, ...], ...] = ((Tier.OBJECT,), (Tier.DISK, Tier.SHARED))
    rates: dict[Tier, float] = field(default_factory=dict)  # bytes/s per tier; absent: no cap
    nice: int = 10  # added to the drain threads' niceness
    idle_io: bool = True  # the drain threads in the idle IO class
    object_part_bytes: int = 16 << 20
    object_concurrency: int = 8  # parts of one object uploaded at once

    def __post_init__(self) -> None:
        seen = [t for lane in self.lanes for t in lane]
        if any(t not in DRAIN_ORDER for t in seen) or len(seen) != len(set(seen)):
            raise ValueError(f"drain lanes name each of disk, shared, object at most once, got {self.lanes}")
        if set(seen) != set(DRAIN_ORDER):
            missing = sorted(t.value for t in set(DRAIN_ORDER) - set(seen))
            raise ValueError(f"drain lanes leave out {', '.join(missing)}: every durable tier needs a lane")
        if any(r <= 0 for r in self.rates.values()):
            raise ValueError(f"a tier's rate is > 0 bytes/s, got {self.rates}")
        if not 0 <= self.nice <= 19 or self.object_part_bytes < 5 << 20 or self.object_concurrency < 1:
            raise ValueError(
                "drain niceness is 0..19, object parts >= 5 MiB (S3's smallest) and concurrency >= 1"
            )

    @classmethod
    def parse(cls, lanes: str, rates: str = "", **kw: int | bool) -> DrainPlan:
        """From ``PHALANX_CKPT_DRAIN`` and ``PHALANX_CKPT_RATE``'s grammars
        (:func:`~phalanx.settings.parse_drain_lanes`, :func:`~phalanx.settings.parse_rates`)."""
        parsed = tuple(tuple(Tier(t) for t in lane) for lane in parse_drain_lanes(lanes))
        caps = {Tier(t): r for t, r in parse_rates(rates).items()}
        return cls(parsed, caps, **kw)  # type: ignore[arg-type]

    def lane_of(self, tier: Tier) -> int:
        return next(i for i, lane in enumerate(self.lanes) if tier in lane)

    def throttle(self, tier: Tier) -> Throttle | None:
        rate = self.rates.get(tier)
        return None if rate is None else Throttle(rate)

    def lower_priority(self) -> None:
        """Run the calling thread at the drains' priority (a ThreadPoolExecutor's
        initializer): ``nice`` more, and the idle IO class when ``idle_io``."""
        tid = threading.get_native_id()
        with contextlib.suppress(OSError):
            os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + self.nice))
        if self.idle_io:
            with contextlib.suppress(OSError, AttributeError):
                libc = ctypes.CDLL(None, use_errno=True)
                libc.syscall(_IOPRIO_SET, _IOPRIO_WHO_PROCESS, tid, _IOPRIO_CLASS_IDLE << _IOPRIO_CLASS_SHIFT)


def io_class_of_thread(tid: int) -> int:
    """The IO class of thread ``tid`` (ioprio_get; 3 idle): for tests and health."""
    libc = ctypes.CDLL(None, use_errno=True)
    got = libc.syscall(252, _IOPRIO_WHO_PROCESS, tid)
    return int(got) >> _IOPRIO_CLASS_SHIFT if got >= 0 else -1


class Throttle:
    """Paces one copy's writes to ``rate`` bytes/s: :meth:`pace` after each piece sleeps
    for as long as the copy is ahead of that rate (from its first piece)."""

    def __init__(self, rate: float) -> None:
        self.rate = rate
        self._start: float | None = None
        self._sent = 0
        self.slept_s = 0.0

    def pace(self, nbytes: int) -> None:
        now = time.monotonic()
        if self._start is None:
            self._start = now
        self._sent += nbytes
        ahead = self._sent / self.rate - (now - self._start)
        if ahead > 0:
            time.sleep(ahead)
            self.slept_s += ahead
