"""Prometheus metrics: every service's and the launcher's /metrics, scraped over HTTP.

A real stack (nats-server and the four services as processes) runs a real job
(the DDP user loop, 2 ranks, 2 hot spares) that loses a rank to SIGKILL twice;
each endpoint must parse with prometheus_client's parser and hold its metrics, the
planner must have observed each recovery exactly once (every rank sends a
RecoveryDone), and the launcher's step metrics must have moved. The Grafana
dashboard may only query metrics that :mod:`phalanx.metrics` defines.
"""

from __future__ import annotations

import asyncio
import json
import re
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from phalanx.services.elasticity_planner.recoveries import Fault, RecoveryBook
from prometheus_client.parser import text_string_to_metric_families

from phalanx.bus import Bus
from phalanx.contract import RecoveryDone
from phalanx.devstack.localstack import LocalStack
from phalanx.launcher.launcher import LaunchConfig, Launcher
from phalanx.metrics import PlannerMetrics, metric_names
from phalanx.service import ping
from phalanx.telemetry import get_logger

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "deploy" / "grafana" / "dashboards" / "phalanx.json"
WORKER = [sys.executable, "-m", "tests.workers.user_loop_worker", "--hidden", "64", "--depth", "2"]
Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def scrape(url: str) -> tuple[set[str], Samples]:
    """The metric families and every sample of an endpoint."""
    with urllib.request.urlopen(url, timeout=10) as resp:
        assert resp.status == 200
        text = resp.read().decode()
    families: set[str] = set()
    samples: Samples = {}
    for fam in text_string_to_metric_families(text):
        families.add(fam.name)
        for s in fam.samples:
            samples[s.name, frozenset(s.labels.items())] = s.value
    return families, samples


def value(samples: Samples, name: str, **labels: str) -> float:
    """The sum of the samples named ``name`` whose labels include ``labels``."""
    want = set(labels.items())
    return sum(v for (n, ls), v in samples.items() if n == name and want <= ls)


# -- the dashboard -----------------------------------------------------------------------
def test_dashboard_queries_only_defined_metrics() -> None:
    board = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in board["panels"] for t in p.get("targets", [])]
    exprs += [v["definition"] for v in board["templating"]["list"]]
    assert exprs, "the dashboard has no queries"
    assert all(t["datasource"]["uid"] == "prometheus" for p in board["panels"] for t in p.get("targets", []))
    used = {n for e in exprs for n in re.findall(r"\bphalanx_[a-z0-9_]+", e)}
    defined = metric_names()
    unknown = set()
    for name in used:
        base = re.sub(r"_(bucket|count|sum|total)$", "", name)
        if name not in defined and base not in defined:
            unknown.add(name)
    assert not unknown, f"the dashboard queries metrics phalanx.metrics does not define: {sorted(unknown)}"
    for want in ("phalanx_recoveries", "phalanx_recovery_downtime_seconds", "phalanx_goodput_ratio"):
        assert any(re.sub(r"_(bucket|count|sum|total)$", "", n) == want for n in used), want


# -- the recovery book: each recovery once -----------------------------------------------
def _done(job: str, gen: int, worker: str, ts: float, **phases: float) -> RecoveryDone:
    return RecoveryDone(
        job=job, ts=ts, generation=gen, worker=worker, rank=0, step=5, incident="i", phases_ms=phases
    )


def test_recovery_book_observes_each_recovery_once() -> None:
    m = PlannerMetrics()
    book = RecoveryBook(m, get_logger(component="test"))
    fault = Fault("crash", fault_at=100.0, detected_at=100.1)
    book.opened("j", "j:w1:7", fault, 2, ["w0", "w2"], committed_at=100.2)
    book.acked("j", 2, 100.3)
    book.reported(_done("j", 2, "w0", 101.0, comm_init=50.0, first_step=200.0))
    book.reported(_done("j", 2, "w0", 101.0, comm_init=50.0, first_step=200.0))  # redelivered
    book.reported(_done("j", 1, "w2", 101.0))  # an old generation's
    assert m.registry.get_sample_value("phalanx_recoveries_total", {"job": "j", "cause": "crash"}) is None
    book.reported(_done("j", 2, "w2", 101.5, comm_init=80.0, first_step=100.0))
    book.reported(_done("j", 2, "w2", 101.5))  # after completion: nothing more
    get = m.registry.get_sample_value
    assert get("phalanx_recoveries_total", {"job": "j", "cause": "crash"}) == 1
    assert get("phalanx_recovery_downtime_seconds_count", {"job": "j", "phase": "total"}) == 1
    assert get("phalanx_recovery_downtime_seconds_sum", {"job": "j", "phase": "total"}) == pytest.approx(1.5)
    assert get("phalanx_recovery_downtime_seconds_sum", {"job": "j", "phase": "comm_init"}) == pytest.approx(
        0.08
    )
    assert get("phalanx_recovery_downtime_seconds_sum", {"job": "j", "phase": "notify"}) == pytest.approx(0.1)
    assert get("phalanx_recovery_downtime_seconds_count", {"job": "j", "phase": "abort"}) is None


def test_a_recovery_superseded_by_another_completes_with_it() -> None:
    m = PlannerMetrics()
    now = [0.0]
    book = RecoveryBook(m, get_logger(component="test"), timeout_s=10.0, clock=lambda: now[0])
    book.opened("j", "a", Fault("crash", 100.0, 100.1), 2, ["w0", "w1"], 100.2)
    book.reported(_done("j", 2, "w0", 100.5))
    book.opened("j", "b", Fault("hang", 101.0, 101.2), 3, ["w0", "w2"], 101.3)  # w1 hung meanwhile
    book.reported(_done("j", 3, "w0", 102.0))
    book.reported(_done("j", 3, "w2", 102.0))
    get = m.registry.get_sample_value
    assert get("phalanx_recoveries_total", {"job": "j", "cause": "crash"}) == 1
    assert get("phalanx_recoveries_total", {"job": "j", "cause": "hang"}) == 1
    assert get("phalanx_recovery_downtime_seconds_count", {"job": "j", "phase": "total"}) == 2
    assert get("phalanx_recovery_downtime_seconds_sum", {"job": "j", "phase": "total"}) == pytest.approx(3.0)
    # One with some reports missing is observed at the timeout; one with none is not.
    book.opened("j", "c", Fault("crash", 200.0, 200.1), 4, ["w0", "w2"], 200.2)
    book.reported(_done("j", 4, "w0", 201.0))
    book.opened("k", "d", Fault("crash", 200.0, 200.1), 2, ["w0"], 200.2)
    now[0] = 11.0
    book.expire()
    assert get("phalanx_recovery_downtime_seconds_count", {"job": "j", "phase": "total"}) == 3
    assert get("phalanx_recoveries_total", {"job": "k", "cause": "crash"}) is None


# -- the endpoint --------------------------------------------------------------------------
async def test_endpoint_serves_and_stops_clean() -> None:
    from phalanx.metrics import MetricsServer

    m = PlannerMetrics(instance="t")
    m.recoveries.labels("j", "crash").inc()
    server = MetricsServer(m.registry, "127.0.0.1", 0)
    url = await server.start()
    families, samples = await asyncio.to_thread(scrape, url)
    assert "phalanx_recoveries" in families
    assert value(samples, "phalanx_recoveries_total", cause="crash") == 1
    with pytest.raises(urllib.error.HTTPError) as err:
        await asyncio.to_thread(urllib.request.urlopen, url.replace("/metrics", "/nope"), None, 5)
    assert err.value.code == 404
    reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
    writer.write(b"GET /metrics HTTP/1.1\r\n")  # a scraper that never finishes its request
    await writer.drain()
    await server.stop()
    assert await reader.read() == b""  # closed by stop()
    writer.close()
    left = {t for t in asyncio.all_tasks() if t is not asyncio.current_task() and not t.done()}
    assert not left, left
    with pytest.raises(OSError):
        await asyncio.to_thread(urllib.request.urlopen, url, None, 5)


async def test_healthz_says_what_the_health_callable_says() -> None:
    from phalanx.metrics import MetricsServer

    state = {"ok": True}
    server = MetricsServer(PlannerMetrics(instance="t").registry, "127.0.0.1", 0,
                           lambda: (state["ok"], b'{"status": "x"}'))  # fmt: skip
    url = (await server.start()).replace("/metrics", "/healthz")
    try:
        answer = await asyncio.to_thread(urllib.request.urlopen, url, None, 5)
        assert answer.status == 200 and answer.read() == b'{"status": "x"}'
        state["ok"] = False
        with pytest.raises(urllib.error.HTTPError) as err:
            await asyncio.to_thread(urllib.request.urlopen, url, None, 5)
        assert err.value.code == 503
    finally:
        await server.stop()
    bare = MetricsServer(PlannerMetrics(instance="t").registry, "127.0.0.1", 0)  # no health: no /healthz
    url = (await bare.start()).replace("/metrics", "/healthz")
    try:
        with pytest.raises(urllib.error.HTTPError) as err:
            await asyncio.to_thread(urllib.request.urlopen, url, None, 5)
        assert err.value.code == 404
    finally:
        await bare.stop()


# -- a real stack and job ------------------------------------------------------------------
@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalStack]:
    env = {
        "PHALANX_PLANNER_COMM_GRACE_S": "1.0",
        "PHALANX_DATA_CACHE_DIR": str(tmp_path_factory.mktemp("datacache")),
    }
    with LocalStack(tmp_path_factory.mktemp("metrics"), env=env) as s:
        yield s


async def _service_urls(stack: LocalStack) -> dict[str, str]:
    bus = await Bus.connect(stack.url, name="test-metrics")
    try:
        urls = {}
        for name in stack.services:
            reply = await ping(bus, name)
            urls[name] = str(reply.details["metrics_url"])
        return urls
    finally:
        await bus.close()


async def _run_job(stack: LocalStack, job: str, faults: str, log_dir: Path) -> tuple[int, str, Samples]:
    """Run the job to its end under an in-process launcher; its /metrics before it stops."""
    launcher = Launcher(
        LaunchConfig(
            job=job,
            cmd=[*WORKER, "--steps", "90"],
            nproc=2,
            spares=2,
            global_batch=32,
            nats_url=stack.url,
            env={
                **{k: v for k, v in stack.env.items() if k.startswith("PHALANX_")},
                "PHALANX_FAULTS": faults,
            },
            log_dir=log_dir,
        )
    )
    try:
        await launcher.start()
        rc = await launcher.wait(240)
        _, samples = await asyncio.to_thread(scrape, launcher.metrics_url)
        return rc, launcher.metrics_url, samples
    finally:
        await launcher.stop()


def test_every_service_answers_healthz_with_its_own_health(stack: LocalStack) -> None:
    # what compose's health checks ask: each service's event loop, on its metrics port
    for name, url in asyncio.run(_service_urls(stack)).items():
        answer = urllib.request.urlopen(url.replace("/metrics", "/healthz"), None, 5)
        body = json.loads(answer.read())
        assert answer.status == 200 and body["service"] == name and body["status"] == "ok", body


def _wait_for(url: str, ok: object, timeout_s: float = 60.0) -> Samples:
    """Scrape ``url`` until ``ok(samples)`` holds (or the time is up: the caller's asserts say why)."""
    assert callable(ok)
    deadline = time.monotonic() + timeout_s
    while True:
        _, samples = scrape(url)
        if ok(samples) or time.monotonic() > deadline:
            return samples
        time.sleep(0.2)


@pytest.mark.slow
def test_every_endpoint_and_each_recovery_once(stack: LocalStack, tmp_path: Path) -> None:
    urls = asyncio.run(_service_urls(stack))
    assert set(urls) == set(stack.services)
    expected = {
        "failure-detector": {"phalanx_detector_heartbeat_lag_seconds", "phalanx_detections"},
        "elasticity-planner": {
            "phalanx_recoveries",
            "phalanx_recovery_downtime_seconds",
            "phalanx_planner_decisions",
            "phalanx_job_generation",
            "phalanx_job_world_size",
            "phalanx_resizes",
            "phalanx_planner_leader",
        },
        "scheduler-signal": {"phalanx_scheduler_signals"},
        "state-replication": {
            "phalanx_checkpoint_copies",
            "phalanx_checkpoint_bytes",
            "phalanx_checkpoint_newest_step",
        },
    }
    for name, url in urls.items():
        families, samples = scrape(url)
        assert {"phalanx_component_info", *expected[name]} <= families, (name, families)
        assert value(samples, "phalanx_component_info", component=name) == 1
    _, planner = scrape(urls["elasticity-planner"])
    assert value(planner, "phalanx_planner_leader") == 1

    job = "metrics1"
    rc, launcher_url, launcher = asyncio.run(
        # The second fault ~60 steps (~0.4 s here) after the first: its recovery is complete by
        # then (every member acknowledged with its next heartbeat, and reported). A fault inside
        # a recovery carries it into the next, which has no notify phase of its own to observe.
        _run_job(stack, job, "kill:w1@step=6,kill:w0@step=70", tmp_path / "logs")
    )
    assert rc == 0
    recoveries = 2

    # Every rank of a generation sends a RecoveryDone: the recovery is observed once.
    planner = _wait_for(
        urls["elasticity-planner"],
        lambda s: value(s, "phalanx_recovery_downtime_seconds_count", job=job, phase="total") >= recoveries,
    )
    assert value(planner, "phalanx_recovery_downtime_seconds_count", job=job, phase="total") == recoveries
    assert value(planner, "phalanx_recoveries_total", job=job) == recoveries
    assert value(planner, "phalanx_recoveries_total", job=job, cause="crash") == recoveries
    for phase in ("detect", "plan", "notify", "comm_init", "state_transfer", "first_step"):
        assert value(planner, "phalanx_recovery_downtime_seconds_count", job=job, phase=phase) == recoveries
    assert value(planner, "phalanx_planner_decisions_total", job=job, action="replace", reason="crash") == 2
    assert value(planner, "phalanx_planner_decisions_total", job=job, action="start") == 1
    assert value(planner, "phalanx_job_generation", job=job) == 3
    assert value(planner, "phalanx_job_world_size", job=job) == 2
    assert value(planner, "phalanx_resizes_total", job=job) == 0

    _, detector = scrape(urls["failure-detector"])
    assert value(detector, "phalanx_detections_total", job=job, verdict="rank_failed") == recoveries
    assert value(detector, "phalanx_detector_heartbeat_lag_seconds_count", source="digest") > 0

    # The launcher: steps, goodput, exits and starts, heartbeat lag.
    assert value(launcher, "phalanx_step_seconds_count", job=job) >= 90
    assert value(launcher, "phalanx_rank_step", job=job, rank="0") == 90
    assert 0 < value(launcher, "phalanx_goodput_ratio", job=job) <= 1
    assert value(launcher, "phalanx_worker_starts_total", job=job, reason="initial") == 4
    assert value(launcher, "phalanx_worker_exits_total", job=job, outcome="signal") == 2
    assert value(launcher, "phalanx_launcher_heartbeat_lag_seconds_count", job=job) > 0
    with pytest.raises(OSError):  # the launcher's endpoint ended with it
        scrape(launcher_url)
