"""What every Phalanx service shares: start-up, health, graceful shutdown.

A service subclasses :class:`Service`, subscribes to its inputs in
:meth:`Service.start`, and is run by :func:`run_service`, which connects the bus,
answers ``phalanx.health.<name>`` requests, and on SIGTERM/SIGINT stops the
service and drains the connection so nothing in flight is lost.

>>> asyncio.run(run_service(FailureDetector))   # python -m phalanx.services.failure_detector

``kill -USR1 <pid>`` logs every asyncio task of a running service and where it waits.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import time
import uuid
from typing import Any, ClassVar

from nats.aio.msg import Msg

from phalanx.bus import Bus
from phalanx.contract import HealthReply, Ping
from phalanx.contract.subjects import HEALTH
from phalanx.metrics import Metrics, MetricsServer, serve_metrics
from phalanx.settings import ServiceSettings, load
from phalanx.telemetry import get_logger, setup_logging, setup_tracing, shutdown_tracing


class Service:
    """Base of the four services. Subclasses set ``name`` and override :meth:`start`."""

    name: ClassVar[str] = "service"
    metrics_type: ClassVar[type[Metrics]] = Metrics
    """The service's metrics (:mod:`phalanx.metrics`); a subclass names its own set."""
    settings_type: ClassVar[type[ServiceSettings]] = ServiceSettings
    """The service's settings model (:mod:`phalanx.settings`); a subclass names its own."""

    def __init__(self, bus: Bus) -> None:
        self.bus = bus
        self.log = get_logger(component=self.name)
        self.started = time.monotonic()
        self.instance = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:6]}"
        self.metrics = self.metrics_type(self.name, self.instance)
        self.metrics_url = ""  # where run_service serves them ("": not served)

    async def start(self) -> None:
        """Subscribe to inputs and start background tasks."""

    async def stop(self) -> None:
        """Stop background tasks; the bus is drained after this returns."""

    def health_details(self) -> dict[str, str | int | float | bool]:
        return {}

    def health(self) -> HealthReply:
        return HealthReply(
            service=self.name,
            status="ok" if self.bus.is_connected else "degraded",
            uptime_s=time.monotonic() - self.started,
            instance=self.instance,
            details={
                **self.health_details(),
                **({"metrics_url": self.metrics_url} if self.metrics_url else {}),
            },
        )

    def health_http(self) -> tuple[bool, bytes]:
        """:meth:`health` for ``GET /healthz`` (:class:`~phalanx.metrics.MetricsServer`)."""
        reply = self.health()
        return reply.status == "ok", reply.model_dump_json().encode()

    async def answer_ping(self, ping: Ping, raw: Msg) -> None:
        await self.bus.reply(raw, self.health())

    async def serve_health(self) -> None:
        await self.bus.subscribe(
            HEALTH.format(service=self.name), self.answer_ping, Ping, trace_messages=False
        )


async def run_service(
    cls: type[Service], *, url: str | None = None, stop: asyncio.Event | None = None, **kwargs: Any
) -> None:
    """Run ``cls`` until SIGTERM/SIGINT (or ``stop`` is set), then shut down gracefully.

    A malformed ``PHALANX_*`` setting raises :class:`~phalanx.settings.SettingsError`
    before anything starts (a service's ``__main__`` turns it into exit status 2)."""
    load(cls.settings_type)
    setup_logging(cls.name)
    setup_tracing(cls.name)
    log = get_logger(component=cls.name)
    bus = await Bus.connect(url, name=cls.name)
    svc = cls(bus, **kwargs)
    metrics: MetricsServer | None = None
    try:
        metrics = await serve_metrics(svc.metrics, log, svc.health_http)
    except BaseException:
        await bus.close()
        raise
    svc.metrics_url = metrics.url if metrics is not None else ""
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, stop.set)
    with contextlib.suppress(NotImplementedError, RuntimeError):
        loop.add_signal_handler(signal.SIGUSR1, lambda: _dump_tasks(log))
    await svc.serve_health()
    await svc.start()
    log.info(
        "service_started",
        instance=svc.instance,
        nats=bus.server,
    )
    try:
        await stop.wait()
    finally:
        log.info("service_stopping")
        await svc.stop()
        if metrics is not None:
            await metrics.stop()
        await bus.close()
        shutdown_tracing()
        log.info("service_stopped")


def _dump_tasks(log: Any) -> None:
    """``kill -USR1 <pid>``: every asyncio task of the service and where it waits, in the log."""
    for task in asyncio.all_tasks():
        frames = [f"{f.f_code.co_filename}:{f.f_lineno} {f.f_code.co_name}" for f in task.get_stack(limit=12)]
        log.warning("task_dump", task=task.get_name(), stack=frames)


async def ping(bus: Bus, service: str, timeout: float = 2.0) -> HealthReply:
    """Ask a service for its health."""
    return await bus.request(HEALTH.format(service=service), Ping(), HealthReply, timeout=timeout)
