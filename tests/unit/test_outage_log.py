"""The lost-server log (phalanx.bus.outage) on a clock the test moves: the loss once, the
outage's symptoms summed up at 1, 2, 4 ... 60 s, the return once; other repeats on the
same backoff."""

from __future__ import annotations

import itertools
from typing import Any

from structlog.testing import capture_logs

from phalanx.bus.outage import Outage, Repeats
from phalanx.telemetry import get_logger


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _events(logs: list[dict[str, Any]]) -> list[str]:
    return [e["event"] for e in logs]


def test_an_outage_is_one_line_then_summaries_at_doubling_intervals_then_one_line() -> None:
    clock = Clock()
    with capture_logs() as logs:
        outage = Outage(get_logger(), clock=clock)
        outage.lost("127.0.0.1:4222")
        outage.lost("127.0.0.1:4222")  # nats.py may say it twice: still one outage
        for _ in range(300):  # 75 s of failed attempts, 4 a second
            clock.now += 0.25
            outage.symptom("OSError", "nats_error", error="ConnectionRefusedError(111)")
        outage.recovered("127.0.0.1:4222")
    events = _events(logs)
    assert events[0] == "nats_disconnected" and events[-1] == "nats_reconnected"
    summaries = [e for e in logs if e["event"] == "nats_still_disconnected"]
    # at 1, 3, 7, 15, 31, 63 s: six lines for 300 events
    assert [round(e["down_s"]) for e in summaries] == [1, 3, 7, 15, 31, 63]
    assert sum(e["suppressed"] for e in summaries) <= 300
    assert logs[-1]["suppressed"] == 300 and logs[-1]["down_s"] == 75.0
    assert "ConnectionRefusedError" in summaries[0]["last"]


def test_the_backoff_is_capped_and_starts_again_after_a_recovery() -> None:
    clock = Clock()
    with capture_logs() as logs:
        outage = Outage(get_logger(), first_s=1.0, max_s=4.0, clock=clock)
        outage.lost("s")
        for _ in range(200):
            clock.now += 0.1
            outage.symptom("x", "consume_rebind", error="e")
        outage.recovered("s")
        outage.lost("s")
        clock.now += 1.0
        outage.symptom("x", "consume_rebind", error="e")
    downs = [e["down_s"] for e in logs if e["event"] == "nats_still_disconnected"]
    first, second = downs[:-1], downs[-1]
    assert [round(d) for d in first[:4]] == [1, 3, 7, 11]
    assert all(b - a <= 4.2 for a, b in itertools.pairwise(first))  # capped at 4 s (0.1 s ticks)
    assert len(first) == 6  # at 1, 3, 7, then every 4 s: 11, 15, 19
    assert round(second) == 1  # the second outage starts at 1 s again
    assert _events(logs).count("nats_disconnected") == 2


def test_repeats_outside_an_outage_are_logged_first_then_with_backoff_and_a_count() -> None:
    clock = Clock()
    with capture_logs() as logs:
        repeats = Repeats(get_logger(), clock=clock)
        for _ in range(40):  # 10 s, 4 a second
            clock.now += 0.25
            repeats.warn("slow", "nats_error", error="SlowConsumerError")
        repeats.warn("other", "nats_error", error="another")  # another key: news
    assert len(logs) == 5  # the first, at 1, 3, 7 s after it, and the other key
    assert "repeated" not in logs[0] and logs[1]["repeated"] == 4
    assert logs[-1]["error"] == "another"
    assert repeats.held == 40 - 4
