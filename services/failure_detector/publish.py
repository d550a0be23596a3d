"""Publishing the detector's verdicts: each in a trace of its own, retried until stored.

:class:`~.verdicts.Incident` goes out as ``RankFailed`` (a process exit) or
``RankHung``, :class:`~.verdicts.NodeIncident` as ``NodeLost``, with the incident
id as ``Nats-Msg-Id`` (JetStream stores a verdict once, whichever path or replica
decided it). Each opens a root span ``detect`` that starts at the inferred fault
time, links to the message that triggered it (an exit report) and ends once the
event is stored; the event carries that trace downstream.
"""

from __future__ import annotations

import asyncio
from typing import Any

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace import Link, SpanKind
from phalanx.services.failure_detector.config import Clock
from phalanx.services.failure_detector.verdicts import NodeIncident, Verdict

from phalanx.bus import Bus
from phalanx.contract import FaultCause
from phalanx.contract.subjects import FAILED, HUNG, NODE_LOST, Subject
from phalanx.metrics import DetectorMetrics

__all__ = ["VerdictPublisher"]

_tracer = trace.get_tracer("phalanx.failure_detector")


class VerdictPublisher:
    """Publishes verdicts on the bus, counts them, and keeps those still on their way."""

    def __init__(self, bus: Bus, metrics: DetectorMetrics, log: Any, wall: Clock) -> None:
        self.bus, self.metrics, self.log, self.wall = bus, metrics, log, wall
        self.reported = 0
        """Verdicts stored."""
        self.retries = 0
        """Publish attempts that failed (each retried)."""
        self._tasks: set[asyncio.Task[None]] = set()

    @property
    def pending(self) -> int:
        """Verdicts decided and not stored yet."""
        return len(self._tasks)

    def spawn(self, verdict: Verdict) -> None:
        """Publish ``verdict`` in the background (the tick loop does not wait)."""
        task = asyncio.create_task(self.publish(verdict), name=f"report:{verdict.id}")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def drain(self, timeout: float) -> None:
        """Let the verdicts already decided reach the bus; cancel those still pending after ``timeout``."""
        if self._tasks:
            _, pending = await asyncio.wait(set(self._tasks), timeout=timeout)
            for t in pending:
                t.cancel()

    async def publish(self, incident: Verdict, trigger: Context | None = None) -> None:
        """Publish one verdict inside its own trace, retrying until it is stored."""
        links = []
        if trigger is not None:
            ctx = trace.get_current_span(trigger).get_span_context()
            if ctx.is_valid:
                links.append(Link(ctx, {"phalanx.link": "trigger"}))
        attrs: dict[str, str | int | float | bool] = {
            "phalanx.job": incident.job,
            "phalanx.cause": incident.cause.value,
            "phalanx.incident": incident.id,
        }
        subject: Subject
        if isinstance(incident, NodeIncident):
            attrs.update({"phalanx.node": incident.node, "phalanx.launcher": incident.launcher})
            subject = NODE_LOST
            who: dict[str, Any] = {"node": incident.node, "workers": list(incident.workers)}
        else:
            attrs.update(
                {
                    "phalanx.worker": incident.worker,
                    "phalanx.rank": incident.rank,
                    "phalanx.generation": incident.generation,
                    "phalanx.pid": incident.pid,
                }
            )
            subject = FAILED if incident.cause is FaultCause.PROCESS_EXIT else HUNG
            who = {"rank": incident.rank, "generation": incident.generation}
        verdict = "node_lost" if subject is NODE_LOST else "rank_failed" if subject is FAILED else "rank_hung"
        attrs.update({f"phalanx.evidence.{k}": v for k, v in incident.evidence.items()})
        start_ns = int(min(incident.fault_at, self.wall()) * 1e9)
        event = incident.to_event()
        with _tracer.start_as_current_span(
            "detect",
            context=Context(),
            kind=SpanKind.INTERNAL,
            start_time=start_ns,
            links=links,
            attributes=attrs,
        ) as span:
            delay = 0.2
            while True:
                try:
                    await self.bus.publish(subject, event, msg_id=incident.id, job=incident.job)
                    break
                except asyncio.CancelledError:
                    raise
                except Exception as exc:
                    self.retries += 1
                    self.log.warning("report_retry", incident=incident.id, error=repr(exc))
                    await asyncio.sleep(delay)
                    delay = min(2 * delay, 2.0)
            span.set_attribute("phalanx.detect_ms", round((event.detected_at - incident.fault_at) * 1e3, 2))
        self.reported += 1
        self.metrics.detections.labels(incident.job, verdict, incident.cause.value).inc()
        self.log.warning(
            "incident",
            incident=incident.id,
            cause=incident.cause.value,
            **who,
            detect_ms=round((event.detected_at - incident.fault_at) * 1e3, 1),
            evidence=incident.evidence,
        )
