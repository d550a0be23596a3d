"""Prometheus metrics of every Phalanx service and launcher: the definitions and ``/metrics``.

Every metric is defined here, in one class per component, each in a
:class:`~prometheus_client.CollectorRegistry` of its own (tests run several
services in one process, so the global default registry is never used). A
service gets its set as ``self.metrics`` (:attr:`phalanx.service.Service.metrics_type`)
and :func:`~phalanx.service.run_service` serves it; the launcher (``phalanx run``)
serves :class:`LauncherMetrics` the same way. :class:`MetricsServer` is a small
asyncio HTTP server in the component's own event loop (no thread to leave behind)
answering ``GET /metrics`` with prometheus_client's exposition (text, or OpenMetrics
when the scraper asks for it). Where it listens comes from the settings
(``PHALANX_METRICS_HOST``, default 127.0.0.1; ``PHALANX_METRICS_PORT``, 0 = a free
port; ``PHALANX_METRICS_ENABLED``); the URL is logged (``metrics_listening``) and, for
a service, in its health details (``metrics_url``).

Labels: ``job`` is the Phalanx job (so Prometheus must scrape with
``honor_labels: true``, or it renames it ``exported_job``); nothing is labelled by
anything unbounded (no incident ids, no worker names).

The metrics, by where they are observed:

failure-detector (:class:`DetectorMetrics`)
    ``phalanx_detector_heartbeat_lag_seconds{source}``: histogram of how old a
    heartbeat (``source="heartbeat"``) or node digest (``"digest"``) is when the
    detector receives it (its wall clock minus the sender's ``ts``).
    ``phalanx_detections_total{job,verdict,cause}``: verdicts this detector
    published (``verdict`` rank_failed/rank_hung/node_lost, ``cause`` the
    :class:`~phalanx.contract.FaultCause`). Replicas each count their own.

elasticity-planner (:class:`PlannerMetrics`; only the leader observes, a
standby exports nothing job-labelled)
    ``phalanx_recoveries_total{job,cause}``: recoveries, once per incident, when
    it is complete (every member of the new generation reported its first step,
    or the report timeout ran out); ``cause``: crash, hang, collective_hang,
    node_lost, collective_error.
    ``phalanx_recovery_downtime_seconds{job,phase}``: histogram, one observation
    per phase per recovery, in the same moment as the counter: ``detect`` (fault ->
    verdict), ``plan`` (verdict -> plan committed), ``notify`` (committed -> every
    member acknowledged), the ranks' ``abort``, ``comm_init``, ``state_transfer``,
    ``data_restore``, ``first_step`` (the longest among the members), and ``total``
    (fault -> the last member's first step done). So ``_count{phase="total"}`` equals
    the recoveries counted.
    ``phalanx_planner_decisions_total{job,action,reason}``: decisions published;
    ``reason`` classes what led to it (a fault cause, node_join, registration,
    worker_exit, capacity, preemption, proposal, cooldown, spare_wait, ack).
    ``phalanx_job_generation{job}``, ``phalanx_job_world_size{job}``,
    ``phalanx_job_spares{job}``: the committed plan.
    ``phalanx_resizes_total{job,direction}``: committed generations whose world
    size grew or shrank.
    ``phalanx_planner_leader``: 1 while this replica leads.

scheduler-signal (:class:`SchedulerMetrics`)
    ``phalanx_scheduler_signals_total{cluster,kind,source}``: signals published
    (``kind`` capacity_changed/preemption_notice, ``source`` local/file/k8s...).

state-replication (:class:`ReplicationMetrics`)
    ``phalanx_checkpoint_copies_total{job,tier,state}``: copies that changed state
    in a tier on this node (complete, corrupt, deleted, failed, served).
    ``phalanx_checkpoint_bytes_total{job,tier}``: bytes of the copies that became
    complete. ``phalanx_checkpoint_newest_step{job,tier}``: newest step this
    keeper made complete in each tier.
    ``phalanx_checkpoint_replicas_missing{job}``: peer replicas that checkpoints this
    keeper took still miss (each retried with backoff until it exists).

launcher (:class:`LauncherMetrics`)
    ``phalanx_step_seconds{job,node}``: histogram of the step time of each
    optimizer step a local rank completed (from its heartbeats).
    ``phalanx_rank_step{job,rank}``: the step each local rank has completed.
    ``phalanx_goodput_ratio{job,node}``: productive step time (the time of each
    job step completed here, counted once, steps redone after a fault not again)
    over the wall time since the first step began.
    ``phalanx_worker_starts_total{job,role,reason}``, ``phalanx_worker_exits_total{job,outcome}``
    (``reason`` initial/requested: a planner's request is a restart;
    ``outcome`` clean, error, signal).
    ``phalanx_launcher_heartbeat_lag_seconds{job}``: how old a local worker's
    heartbeat is when the launcher receives it.

every component
    ``phalanx_component_info{component,instance}``: 1.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics
from prometheus_client.exposition import choose_encoder

from phalanx.contract import Heartbeat
from phalanx.settings import MetricsSettings, load
from phalanx.tracesummary import PHASES as RECOVERY_PHASES

__all__ = [
    "DetectorMetrics",
    "LauncherMetrics",
    "Metrics",
    "MetricsServer",
    "PlannerMetrics",
    "ReplicationMetrics",
    "SchedulerMetrics",
    "metric_names",
    "serve_metrics",
]

PHASES = (*RECOVERY_PHASES, "total")
"""The phases of ``phalanx_recovery_downtime_seconds``: a recovery's, and fault -> last first step."""

disable_created_metrics()  # no ``*_created`` series: nothing here reads them

_LAG_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
_DOWNTIME_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
_STEP_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class Metrics:
    """The metrics of one component, in a registry of its own."""

    def __init__(self, component: str, instance: str = "") -> None:
        self.registry = CollectorRegistry()
        self.info = Gauge(
            "phalanx_component_info",
            "A Phalanx component serving these metrics (always 1).",
            ["component", "instance"],
            registry=self.registry,
        )
        self.info.labels(component, instance).set(1)

    def _counter(self, name: str, doc: str, labels: tuple[str, ...] = ()) -> Counter:
        return Counter(name, doc, labels, registry=self.registry)

    def _gauge(self, name: str, doc: str, labels: tuple[str, ...] = ()) -> Gauge:
        return Gauge(name, doc, labels, registry=self.registry)

    def _histogram(
        self, name: str, doc: str, labels: tuple[str, ...], buckets: tuple[float, ...]
    ) -> Histogram:
        return Histogram(name, doc, labels, buckets=buckets, registry=self.registry)


class DetectorMetrics(Metrics):
    def __init__(self, component: str = "failure-detector", instance: str = "") -> None:
        super().__init__(component, instance)
        self.heartbeat_lag = self._histogram(
            "phalanx_detector_heartbeat_lag_seconds",
            "Age of a heartbeat or node digest when the detector receives it (its clock minus the sender's).",
            ("source",),
            _LAG_BUCKETS,
        )
        self.detections = self._counter(
            "phalanx_detections_total",
            "Verdicts this detector published, by verdict and fault cause.",
            ("job", "verdict", "cause"),
        )


class PlannerMetrics(Metrics):
    def __init__(self, component: str = "elasticity-planner", instance: str = "") -> None:
        super().__init__(component, instance)
        self.recoveries = self._counter(
            "phalanx_recoveries_total",
            "Recoveries completed (once per incident), by cause.",
            ("job", "cause"),
        )
        self.downtime = self._histogram(
            "phalanx_recovery_downtime_seconds",
            "Downtime of each recovery by phase (rank phases: the longest member); total: fault -> first step done.",
            ("job", "phase"),
            _DOWNTIME_BUCKETS,
        )
        self.decisions = self._counter(
            "phalanx_planner_decisions_total",
            "Decisions the planner published, by action and what led to them.",
            ("job", "action", "reason"),
        )
        self.generation = self._gauge("phalanx_job_generation", "The job's committed generation.", ("job",))
        self.world_size = self._gauge(
            "phalanx_job_world_size", "Members of the job's committed generation.", ("job",)
        )
        self.spares = self._gauge(
            "phalanx_job_spares", "Hot spares of the job's committed generation.", ("job",)
        )
        self.resizes = self._counter(
            "phalanx_resizes_total",
            "Committed generations whose world size grew or shrank.",
            ("job", "direction"),
        )
        self.leader = self._gauge("phalanx_planner_leader", "1 while this planner replica leads, else 0.")

    def forget_jobs(self) -> None:
        """A replica that stops leading exports no job's state (the leader does)."""
        for gauge in (self.generation, self.world_size, self.spares):
            gauge.clear()


class SchedulerMetrics(Metrics):
    def __init__(self, component: str = "scheduler-signal", instance: str = "") -> None:
        super().__init__(component, instance)
        self.signals = self._counter(
            "phalanx_scheduler_signals_total",
            "Cluster signals published, by kind and source.",
            ("cluster", "kind", "source"),
        )


class ReplicationMetrics(Metrics):
    def __init__(self, component: str = "state-replication", instance: str = "") -> None:
        super().__init__(component, instance)
        self.copies = self._counter(
            "phalanx_checkpoint_copies_total",
            "Checkpoint copies that changed state in a tier on this node.",
            ("job", "tier", "state"),
        )
        self.bytes = self._counter(
            "phalanx_checkpoint_bytes_total",
            "Bytes of the checkpoint copies that became complete in a tier on this node.",
            ("job", "tier"),
        )
        self.newest_step = self._gauge(
            "phalanx_checkpoint_newest_step",
            "Newest step this keeper made complete in each tier.",
            ("job", "tier"),
        )
        self._newest: dict[tuple[str, str], int] = {}
        self.replicas_missing = self._gauge(
            "phalanx_checkpoint_replicas_missing",
            "Peer replicas that checkpoints this keeper took still miss (retried until made).",
            ("job",),
        )
        self._missing: dict[str, dict[str, int]] = {}  # job -> checkpoint -> replicas missing

    def replicas_changed(self, job: str, checkpoint: str, missing: int) -> None:
        """``checkpoint`` (``<job or part>@<step>``) of ``job`` misses ``missing`` replicas."""
        of_job = self._missing.setdefault(job, {})
        if missing:
            of_job[checkpoint] = missing
        else:
            of_job.pop(checkpoint, None)
        self.replicas_missing.labels(job).set(sum(of_job.values()))

    def copy_changed(self, job: str, tier: str, state: str, step: int, nbytes: int) -> None:
        self.copies.labels(job, tier, state).inc()
        if state == "complete":
            self.bytes.labels(job, tier).inc(nbytes)
            if step > self._newest.get((job, tier), -1):
                self._newest[job, tier] = step
                self.newest_step.labels(job, tier).set(step)


class LauncherMetrics(Metrics):
    """A launcher's metrics; it reports what it sees through :meth:`heartbeat`,
    :meth:`started` and :meth:`exited`."""

    def __init__(
        self, component: str = "launcher", instance: str = "", job: str = "", node: str = ""
    ) -> None:
        super().__init__(component, instance)
        self.job, self.node = job, node
        self._rank_of: dict[str, int] = {}  # local worker -> the rank its heartbeats say
        self._counted = 0  # the highest job step whose time is counted as productive
        self._productive = 0.0
        self._first_start: float | None = None  # wall time the first step counted began
        self.step_seconds = self._histogram(
            "phalanx_step_seconds",
            "Time of each optimizer step a local rank completed.",
            ("job", "node"),
            _STEP_BUCKETS,
        )
        self.rank_step = self._gauge(
            "phalanx_rank_step", "Optimizer steps each local rank has completed.", ("job", "rank")
        )
        self.goodput = self._gauge(
            "phalanx_goodput_ratio",
            "Productive step time (each job step once) over wall time since the first step began.",
            ("job", "node"),
        )
        self.worker_starts = self._counter(
            "phalanx_worker_starts_total",
            "Worker processes started (reason: initial, or requested by the planner).",
            ("job", "role", "reason"),
        )
        self.worker_exits = self._counter(
            "phalanx_worker_exits_total",
            "Worker processes that ended (outcome: clean, error, signal).",
            ("job", "outcome"),
        )
        self.heartbeat_lag = self._histogram(
            "phalanx_launcher_heartbeat_lag_seconds",
            "Age of a local worker's heartbeat when the launcher receives it.",
            ("job",),
            _LAG_BUCKETS,
        )

    def started(self, role: str, requested: bool) -> None:
        self.worker_starts.labels(self.job, role, "requested" if requested else "initial").inc()

    def exited(self, worker: str, returncode: int) -> None:
        outcome = "clean" if returncode == 0 else "signal" if returncode < 0 else "error"
        self.worker_exits.labels(self.job, outcome).inc()
        if returncode != 0:  # its rank goes on elsewhere; a clean exit's last step stays shown
            self._set_rank(worker, None)

    def heartbeat(self, hb: Heartbeat, now: float | None = None) -> None:
        """A local worker's heartbeat, as the launcher accepted it."""
        now = time.time() if now is None else now
        self.heartbeat_lag.labels(self.job).observe(max(0.0, now - hb.ts))
        self._set_rank(hb.worker, hb.rank if hb.rank >= 0 else None)
        if hb.rank >= 0:
            self.rank_step.labels(self.job, str(hb.rank)).set(hb.step)
        steps = self.step_seconds.labels(self.job, self.node)
        for r in hb.finished:
            steps.observe(r.step_ms / 1e3)
            if r.step > self._counted:  # a step of the job done here for the first time
                self._counted = r.step
                self._productive += r.step_ms / 1e3
                began = r.at - r.step_ms / 1e3
                self._first_start = began if self._first_start is None else min(self._first_start, began)
        if self._first_start is not None and now > self._first_start:
            self.goodput.labels(self.job, self.node).set(
                min(1.0, self._productive / (now - self._first_start))
            )

    def _set_rank(self, worker: str, rank: int | None) -> None:
        old = self._rank_of.pop(worker, None)
        if rank is not None:
            self._rank_of[worker] = rank
        if old is not None and old != rank and old not in self._rank_of.values():
            with contextlib.suppress(KeyError):
                self.rank_step.remove(self.job, str(old))


COMPONENTS: tuple[type[Metrics], ...] = (
    DetectorMetrics,
    PlannerMetrics,
    SchedulerMetrics,
    ReplicationMetrics,
    LauncherMetrics,
)


def metric_names() -> set[str]:
    """Every metric family name defined here (counters without ``_total``, as Prometheus' client names them)."""
    names: set[str] = set()
    every: tuple[type[Metrics], ...] = (Metrics, *COMPONENTS)
    for cls in every:
        names |= {f.name for f in cls("any").registry.collect()}
    return names


class MetricsServer:
    """``GET /metrics`` of one registry, served by the running event loop; with
    ``health``, ``GET /healthz`` too: 200 and its body when it says ok, else 503.

    ``/healthz`` is the cheap probe for a container's health check: a plain HTTP GET
    (``python3 -I -S`` and urllib), answered by the service's own event loop, where
    ``phalanx health`` starts the whole CLI and a bus connection -- about 1.4 s of
    CPU each time on a 2-core box, five services every 5 s.

    One request per connection (``Connection: close``); :meth:`stop` closes the
    listener and every connection still open, so nothing outlives it.
    """

    def __init__(
        self,
        registry: CollectorRegistry,
        host: str,
        port: int,
        health: Callable[[], tuple[bool, bytes]] | None = None,
    ) -> None:
        self.registry = registry
        self.host, self.port = host, port
        self.health = health
        self._server: asyncio.Server | None = None
        self._conns: set[asyncio.Task[Any]] = set()

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/metrics"

    async def start(self) -> str:
        """Listen (port 0: a free one); returns the URL."""
        self._server = await asyncio.start_server(self._handle, self.host, self.port)
        self.port = int(self._server.sockets[0].getsockname()[1])
        return self.url

    async def stop(self) -> None:
        if self._server is None:
            return
        self._server.close()
        for task in list(self._conns):
            task.cancel()
        if self._conns:
            await asyncio.wait(list(self._conns), timeout=2.0)
        await self._server.wait_closed()
        self._server = None

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        if task is not None:
            self._conns.add(task)
        try:
            try:
                head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10.0)
            except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, TimeoutError, ConnectionError):
                return
            status, ctype, body = self._answer(head.decode("latin-1"))
            writer.write(
                f"HTTP/1.1 {status}\r\nContent-Type: {ctype}\r\nContent-Length: {len(body)}\r\n"
                "Connection: close\r\n\r\n".encode("latin-1")
            )
            if not head.startswith(b"HEAD "):
                writer.write(body)
            with contextlib.suppress(ConnectionError):
                await writer.drain()
        except asyncio.CancelledError:
            pass  # stop(): the connection closes below
        finally:
            writer.close()
            with contextlib.suppress(Exception, asyncio.CancelledError):
                await writer.wait_closed()
            if task is not None:
                self._conns.discard(task)

    def _answer(self, head: str) -> tuple[str, str, bytes]:
        lines = head.split("\r\n")
        parts = lines[0].split(" ")
        if len(parts) != 3:
            return "400 Bad Request", "text/plain", b"bad request\n"
        method, target = parts[0], parts[1].split("?", 1)[0]
        if method not in ("GET", "HEAD"):
            return "405 Method Not Allowed", "text/plain", b"only GET\n"
        if target == "/healthz" and self.health is not None:
            ok, body = self.health()
            return ("200 OK" if ok else "503 Service Unavailable"), "application/json", body
        if target not in ("/metrics", "/"):
            return "404 Not Found", "text/plain", b"see /metrics\n"
        accept = ""
        for line in lines[1:]:
            name, _, value = line.partition(":")
            if name.strip().lower() == "accept":
                accept = value.strip()
        encoder, ctype = choose_encoder(accept)
        return "200 OK", ctype, encoder(self.registry)


async def serve_metrics(
    metrics: Metrics, log: Any, health: Callable[[], tuple[bool, bytes]] | None = None
) -> MetricsServer | None:
    """Serve ``metrics`` (and ``health`` on ``/healthz``) where the settings say (None when
    ``PHALANX_METRICS_ENABLED`` is off); logs ``metrics_listening url=...``."""
    settings = load(MetricsSettings)
    if not settings.metrics_enabled:
        return None
    server = MetricsServer(metrics.registry, settings.metrics_host, settings.metrics_port, health)
    url = await server.start()
    log.info("metrics_listening", url=url)
    return server
