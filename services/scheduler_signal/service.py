"""The scheduler-signal service: cluster signals in, CapacityChanged / PreemptionNotice out.

Runs every configured source (:mod:`phalanx.services.scheduler_signal.sources`)
and publishes what they see on ``phalanx.sched.<cluster>.capacity`` and
``phalanx.sched.<cluster>.preempt`` (stream ``PHALANX_SCHED``), each under a
``Nats-Msg-Id`` derived from the change itself, so a retry or a restart stores it
once. What was already published is read back from the stream (the last capacity
per cluster, the ids of the preemptions announced) the first time a cluster is
seen.

Environment: the local cluster (the ``phalanx_cluster`` KV bucket that ``phalanx
cluster`` writes, :mod:`phalanx.services.scheduler_signal.local`) is watched unless
``PHALANX_LOCAL_CLUSTER=0``; ``PHALANX_CLUSTER_FILE`` (and ``PHALANX_CLUSTER_POLL_S``, default
0.5) for the simulated cluster; in a pod or with ``PHALANX_K8S=1`` the Kubernetes
watcher (see :mod:`phalanx.services.scheduler_signal.kube` and its
:class:`~phalanx.services.scheduler_signal.kube.KubeConfig`).
"""

from __future__ import annotations

import asyncio
import contextlib

from opentelemetry import trace
from phalanx.services.scheduler_signal.kube import KubeConfig, KubeWatchSource
from phalanx.services.scheduler_signal.local import KvClusterSource
from phalanx.services.scheduler_signal.sources import FileClusterSource, Ledger, Signal, Source

from phalanx.bus import Bus
from phalanx.contract import CapacityChanged, HealthReply, PreemptionNotice
from phalanx.contract.streams import SCHED
from phalanx.contract.subjects import CAPACITY, PREEMPT
from phalanx.metrics import SchedulerMetrics
from phalanx.service import Service
from phalanx.settings import SchedulerSignalSettings, load

_tracer = trace.get_tracer("phalanx.scheduler_signal")


class StreamHistory:
    """What ``PHALANX_SCHED`` already holds for a cluster."""

    def __init__(self, bus: Bus) -> None:
        self.bus = bus

    async def last_capacity(self, cluster: str) -> CapacityChanged | None:
        last = await self.bus.streams.last(SCHED, CAPACITY.format(cluster=cluster), CapacityChanged)
        return last.msg if last is not None else None

    async def announced(self, cluster: str) -> set[str]:
        # Message gets, not a consumer: scheduler-signal may read its stream, not consume it.
        stored = await self.bus.streams.walk(SCHED, PREEMPT.format(cluster=cluster), PreemptionNotice)
        return {s.msg_id for s in stored if s.msg_id}


def sources_from_env(bus: Bus) -> list[Source]:
    """The sources the environment asks for (possibly none)."""
    history = StreamHistory(bus)
    sources: list[Source] = []
    settings = load(SchedulerSignalSettings)
    if settings.local_cluster:
        sources.append(KvClusterSource(bus, Ledger(history, "local")))
    if settings.cluster_file is not None:
        sources.append(
            FileClusterSource(settings.cluster_file, Ledger(history, "file"), poll_s=settings.cluster_poll_s)
        )
    kube = KubeConfig.from_env()
    if kube is not None:
        sources.append(KubeWatchSource(kube, Ledger(history, "k8s")))
    return sources


class SchedulerSignal(Service):
    name = "scheduler-signal"
    metrics_type = SchedulerMetrics
    settings_type = SchedulerSignalSettings
    metrics: SchedulerMetrics

    def __init__(self, bus: Bus, sources: list[Source] | None = None) -> None:
        super().__init__(bus)
        self.sources = sources if sources is not None else sources_from_env(bus)
        self._tasks: list[asyncio.Task[None]] = []
        self.published: dict[str, int] = {"capacity_changed": 0, "preemption_notice": 0}

    async def start(self) -> None:
        if not self.sources:
            self.log.warning(
                "no_sources",
                hint="unset PHALANX_LOCAL_CLUSTER=0, set PHALANX_CLUSTER_FILE, or PHALANX_K8S=1 / run in a pod",
            )
        for src in self.sources:
            self._tasks.append(asyncio.create_task(self._run(src), name=f"source:{src.name}"))
        self.log.info("sources_started", sources=[s.name for s in self.sources])

    async def _run(self, src: Source) -> None:
        try:
            await src.run(self.emit)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            self.log.exception("source_failed", source=src.name, error=repr(exc))
            raise

    async def emit(self, sig: Signal) -> None:
        """Publish one signal (under its de-duplication id) in a span of its own."""
        msg = sig.message
        with _tracer.start_as_current_span(
            f"signal {msg.KIND}",
            attributes={
                "phalanx.cluster": msg.cluster,
                "phalanx.source": msg.source,
                "messaging.message.id": sig.msg_id,
            },
        ):
            await self.bus.publish(sig.subject, msg, msg_id=sig.msg_id, cluster=msg.cluster)
        self.published[msg.KIND] += 1
        self.metrics.signals.labels(msg.cluster, msg.KIND, msg.source).inc()
        if isinstance(msg, CapacityChanged):
            self.log.info(
                "capacity_changed",
                cluster=msg.cluster,
                available=msg.available_slots,
                delta=msg.delta,
                source=msg.source,
                msg_id=sig.msg_id,
            )
        else:
            self.log.info(
                "preemption_notice",
                cluster=msg.cluster,
                job=msg.job,
                workers=msg.workers,
                nodes=msg.nodes,
                deadline_s=msg.deadline_s,
                reason=msg.reason,
                source=msg.source,
                msg_id=sig.msg_id,
            )

    async def stop(self) -> None:
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        self._tasks.clear()

    def _failed(self) -> dict[str, str]:
        return {
            t.get_name(): repr(t.exception())
            for t in self._tasks
            if t.done() and not t.cancelled() and t.exception() is not None
        }

    def health(self) -> HealthReply:
        reply = super().health()
        return reply.model_copy(update={"status": "degraded"}) if self._failed() else reply

    def health_details(self) -> dict[str, str | int | float | bool]:
        details: dict[str, str | int | float | bool] = {
            "sources": ",".join(s.name for s in self.sources),
            **{f"published.{k}": v for k, v in self.published.items()},
        }
        for src in self.sources:
            details.update(src.details())
        details.update({f"failed.{name}": err for name, err in self._failed().items()})
        return details
