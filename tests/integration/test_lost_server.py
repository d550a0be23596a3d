"""A lost server is said once, then with backoff, and its return once: against a real
nats-server that the test stops for a few seconds under a bus that is busy the way a
launcher's is (a durable consumer, a plan follower, a JetStream publisher that retries).

Before: every failed reconnect attempt was a ``nats_error`` warning (4 a second at the
0.25 s reconnect wait), every re-bind of a consumer and every publish retry one more:
603 identical warnings in 75 s in one launcher's output.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

from structlog.testing import capture_logs

from phalanx.bus import Bus
from phalanx.contract import ErrorEvent, Message, RecoveryDone
from phalanx.contract.streams import EVENTS
from phalanx.contract.subjects import ERROR, RECOVERED
from phalanx.devstack.natsserver import NatsServer
from phalanx.worker.follow import PlanFollower

OUTAGE_S = 6.0


async def _until(pred: Any, what: str, timeout_s: float = 20.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not pred():
        assert loop.time() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.02)


async def test_a_lost_server_is_logged_once_then_with_backoff_and_its_return_once(
    nats_server: NatsServer,
) -> None:
    bus = await Bus.connect(nats_server.url, name="launcher-outage")
    published = 0

    async def on_recovered(msg: Message, raw: Any) -> None:
        return None

    async def publisher() -> None:  # a launcher's step batches: a JetStream publish a tenth of a second
        nonlocal published
        while True:
            with contextlib.suppress(Exception):
                event = ErrorEvent(service=bus.name, subject="x", reason=f"tick {published}")
                await bus.publish(ERROR, event, service=bus.name, retry_for_s=30.0, traced=False)
                published += 1
            await asyncio.sleep(0.1)

    bus.consume(EVENTS, "outage-recovered", [RECOVERED.wildcard()], on_recovered, (RecoveryDone,))
    follower = PlanFollower(bus, "outage-job", lambda plan, by_message: None)
    await follower.start()
    task = asyncio.create_task(publisher())
    try:
        await _until(lambda: published >= 3, "the first publishes")
        with capture_logs() as logs:
            await asyncio.to_thread(nats_server.stop)
            await asyncio.sleep(OUTAGE_S)  # the outage itself: nothing to wait for but time
            before = published
            await asyncio.to_thread(nats_server.start)
            await _until(lambda: bus.reconnects >= 1 and published > before + 2, "the bus back at work")
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await follower.stop()
        await bus.close()

    warnings = [e for e in logs if e["log_level"] == "warning"]
    events = [e["event"] for e in warnings]
    assert events.count("nats_disconnected") == 1, events
    assert [e["event"] for e in logs].count("nats_reconnected") == 1
    # 1 s, then 2 s, then 4 s after the loss: at most 3 summaries in 6 s
    assert 1 <= events.count("nats_still_disconnected") <= 3, events
    assert events.count("nats_error") <= 1, events  # (one only if it came before the loss was seen)
    assert len(warnings) <= 8, events
    back = next(e for e in logs if e["event"] == "nats_reconnected")
    assert back["down_s"] >= OUTAGE_S - 1
    # what was held back: failed reconnect attempts (4 a second), re-binds, publish retries
    assert back["suppressed"] >= 10, back
    summary = next(e for e in warnings if e["event"] == "nats_still_disconnected")
    assert summary["suppressed"] >= 1 and summary["last"]
