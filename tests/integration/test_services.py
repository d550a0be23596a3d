"""Each service as its own process against a real nats-server.

Every service answers a health ping and exits 0 on SIGTERM. scheduler-signal
turns changes of a cluster file into CapacityChanged / PreemptionNotice, each
stored exactly once, also across a restart of the service. state-replication
follows plans and recoveries through its durable consumers.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest
from nats.aio.msg import Msg

from phalanx.bus import Bus
from phalanx.contract import (
    CapacityChanged,
    HealthReply,
    Member,
    Message,
    Plan,
    PreemptionNotice,
    RecoveryDone,
)
from phalanx.contract.streams import COMMANDS, EVENTS, SCHED
from phalanx.contract.subjects import CAPACITY, PLAN, PREEMPT, RECOVERED
from phalanx.service import ping

SERVICES = {
    "failure_detector": "failure-detector",
    "scheduler_signal": "scheduler-signal",
    "elasticity_planner": "elasticity-planner",
    "state_replication": "state-replication",
}
WAIT_S = 30.0


class ServiceProcess:
    """``python -m phalanx.services.<module>`` (or ``phalanx service <name>`` with
    ``cli=True``) with NATS_URL set, logging to a file."""

    def __init__(
        self, module: str, url: str, log: Path, env: dict[str, str] | None = None, cli: bool = False
    ) -> None:
        self.module = module
        self.name = SERVICES[module]
        self.log = log
        environ = {**os.environ, "NATS_URL": url, "PHALANX_LOG_LEVEL": "INFO", **(env or {})}
        environ.pop("OTEL_EXPORTER_OTLP_ENDPOINT", None)
        with open(log, "ab") as out:
            cmd = (
                [sys.executable, "-m", "phalanx.cli", "service", self.name]
                if cli
                else [sys.executable, "-m", f"phalanx.services.{module}"]
            )
            self.proc = subprocess.Popen(cmd, env=environ, stdout=out, stderr=out)

    def tail(self, n: int = 3000) -> str:
        return self.log.read_text(errors="replace")[-n:]

    async def healthy(self, bus: Bus, timeout: float = WAIT_S) -> HealthReply:
        """Ping until the service answers (it may still be starting)."""
        deadline = asyncio.get_running_loop().time() + timeout
        while True:
            if self.proc.poll() is not None:
                pytest.fail(
                    f"{self.module} exited with {self.proc.returncode} before answering:\n{self.tail()}"
                )
            try:
                return await ping(bus, self.name, timeout=1.0)
            except Exception as exc:
                if asyncio.get_running_loop().time() > deadline:
                    pytest.fail(f"{self.name} never answered a ping ({exc!r}):\n{self.tail()}")
                await asyncio.sleep(0.1)

    async def terminate(self, timeout: float = 15.0) -> int:
        """SIGTERM and wait for the exit code (SIGKILL and fail if it does not come)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return await asyncio.to_thread(self.proc.wait, timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            pytest.fail(f"{self.name} did not exit within {timeout:g} s of SIGTERM:\n{self.tail()}")

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture
async def services(nats_url: str, tmp_path: Path) -> AsyncIterator[Callable[..., ServiceProcess]]:
    started: list[ServiceProcess] = []

    def start(module: str, cli: bool = False, **env: str) -> ServiceProcess:
        svc = ServiceProcess(module, nats_url, tmp_path / f"{module}-{len(started)}.log", env, cli)
        started.append(svc)
        return svc

    yield start
    for svc in started:
        svc.kill()


async def wait_for(cond: Callable[[], bool], what: str, timeout: float = WAIT_S) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not cond():
        if asyncio.get_running_loop().time() > deadline:
            pytest.fail(f"timed out after {timeout:g} s waiting for {what}")
        await asyncio.sleep(0.05)


# -- every service: health and graceful shutdown --------------------------------------------
@pytest.mark.parametrize("cli", [False, True], ids=["python-m", "phalanx-service"])
@pytest.mark.parametrize("module", list(SERVICES))
async def test_service_answers_health_and_exits_cleanly_on_sigterm(
    module: str, cli: bool, bus: Bus, services: Callable[..., ServiceProcess]
) -> None:
    svc = services(module, cli=cli)
    reply = await svc.healthy(bus)
    assert reply.service == SERVICES[module]
    assert reply.status == "ok"
    assert reply.uptime_s >= 0 and reply.instance
    code = await svc.terminate()
    assert code == 0, f"{module} exited with {code}:\n{svc.tail()}"
    assert "service_stopped" in svc.tail(100_000)


# -- scheduler-signal ------------------------------------------------------------------------
def write_cluster(
    path: Path,
    nodes: dict[str, int],
    preemptions: list[dict[str, Any]] | None = None,
    not_ready: tuple[str, ...] = (),
) -> None:
    doc = {
        "cluster": "sim",
        "nodes": [{"name": n, "slots": s, "ready": n not in not_ready} for n, s in nodes.items()],
        "preemptions": preemptions or [],
    }
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(doc))
    os.replace(tmp, path)  # atomic, as the service asks of writers


class Signals:
    def __init__(self) -> None:
        self.got: list[CapacityChanged | PreemptionNotice] = []

    async def __call__(self, msg: Message, raw: Msg) -> None:
        assert isinstance(msg, CapacityChanged | PreemptionNotice)
        self.got.append(msg)

    def capacities(self) -> list[tuple[int, int]]:
        return [(m.available_slots, m.delta) for m in self.got if isinstance(m, CapacityChanged)]

    def summary(self) -> list[tuple[str, Any]]:
        return [
            ("capacity", m.available_slots)
            if isinstance(m, CapacityChanged)
            else ("preempt", tuple(m.workers))
            for m in self.got
        ]


async def test_scheduler_signal_publishes_each_cluster_change_exactly_once(
    bus: Bus, services: Callable[..., ServiceProcess], tmp_path: Path
) -> None:
    path = tmp_path / "cluster.json"
    write_cluster(path, {"a": 4, "b": 4})
    env = {"PHALANX_CLUSTER_FILE": str(path), "PHALANX_CLUSTER_POLL_S": "0.1"}
    signals = Signals()
    bus.consume(
        SCHED,
        "t-signals",
        [CAPACITY.wildcard(cluster="sim"), PREEMPT.wildcard(cluster="sim")],
        signals,
        (CapacityChanged, PreemptionNotice),
    )

    svc = services("scheduler_signal", **env)
    await svc.healthy(bus)
    await wait_for(lambda: signals.capacities() == [(8, 8)], "the initial capacity")

    preemption = {"id": "p1", "job": "j1", "workers": ["w3"], "deadline_s": 20}
    write_cluster(path, {"a": 4, "b": 4}, [preemption], not_ready=("b",))
    await wait_for(lambda: len(signals.got) >= 3, "the capacity drop and the preemption")
    write_cluster(path, {"a": 4, "b": 4, "c": 2}, [preemption])  # the last change: everything before is out
    await wait_for(lambda: (10, 6) in signals.capacities(), "the capacity rise")
    assert signals.summary() == [("capacity", 8), ("capacity", 4), ("preempt", ("w3",)), ("capacity", 10)]
    assert signals.capacities() == [(8, 8), (4, -4), (10, 6)]
    notice = signals.got[2]
    assert isinstance(notice, PreemptionNotice)
    assert (notice.cluster, notice.job, notice.deadline_s, notice.source) == ("sim", "j1", 20.0, "file")
    assert (await svc.healthy(bus)).details["published.capacity_changed"] == 3
    assert await svc.terminate() == 0

    # A restarted service reads what it published back from the stream: the same
    # file is no news, and the preemption it announced is not announced again.
    again = services("scheduler_signal", **env)
    await wait_for_revision(again, bus)
    details = (await again.healthy(bus)).details
    assert (details["published.capacity_changed"], details["published.preemption_notice"]) == (0, 0)
    write_cluster(path, {"a": 4, "b": 4, "c": 2, "d": 2}, [preemption])
    await wait_for(lambda: (12, 2) in signals.capacities(), "the change after the restart")
    assert signals.summary() == [
        ("capacity", 8),
        ("capacity", 4),
        ("preempt", ("w3",)),
        ("capacity", 10),
        ("capacity", 12),
    ]
    info = await bus.js.stream_info(SCHED.name)
    assert info.state.messages == 5
    assert await again.terminate() == 0


async def wait_for_revision(svc: ServiceProcess, bus: Bus) -> None:
    """Until the service has read the cluster file once."""
    deadline = asyncio.get_running_loop().time() + WAIT_S
    while int((await svc.healthy(bus)).details.get("file.revisions", 0)) < 1:
        if asyncio.get_running_loop().time() > deadline:
            pytest.fail(f"scheduler-signal never read the cluster file:\n{svc.tail()}")
        await asyncio.sleep(0.1)


async def test_scheduler_signal_reports_a_bad_cluster_file_and_keeps_going(
    bus: Bus, services: Callable[..., ServiceProcess], tmp_path: Path
) -> None:
    path = tmp_path / "cluster.json"
    path.write_text('{"cluster": "sim", "nodes": [{"name": "a", "slots": -1}]}')
    svc = services("scheduler_signal", PHALANX_CLUSTER_FILE=str(path), PHALANX_CLUSTER_POLL_S="0.1")
    deadline = asyncio.get_running_loop().time() + WAIT_S
    while "invalid cluster file" not in str((await svc.healthy(bus)).details.get("file.last_error")):
        assert asyncio.get_running_loop().time() < deadline, svc.tail()
        await asyncio.sleep(0.1)
    signals = Signals()
    bus.consume(SCHED, "t-bad-file", [CAPACITY.wildcard(cluster="sim")], signals, (CapacityChanged,))
    write_cluster(path, {"a": 3})
    await wait_for(lambda: signals.capacities() == [(3, 3)], "the capacity of the repaired file")
    assert "cluster_file_invalid" in svc.tail(100_000)
    assert await svc.terminate() == 0


# -- state-replication --------------------------------------------------------------------------
def plan(generation: int) -> Plan:
    return Plan(
        job="j1",
        generation=generation,
        members=[Member(rank=0, worker="w0"), Member(rank=1, worker="w1")],
        reason="test",
        store_prefix=f"phalanx/j1/g{generation}",
    )


async def test_state_replication_follows_plans_and_recoveries(
    bus: Bus, services: Callable[..., ServiceProcess]
) -> None:
    svc = services("state_replication", PHALANX_NODE="node-1")
    reply = await svc.healthy(bus)
    assert reply.details["node"] == "node-1"
    for stream, durable in (
        (COMMANDS.name, "state-repl-node-1-plan"),
        (EVENTS.name, "state-repl-node-1-recovered"),
    ):
        await wait_consumer(bus, stream, durable)

    await bus.publish(PLAN, plan(2), job="j1", msg_id="j1:plan:2")
    await bus.publish(PLAN, plan(1), job="j1", msg_id="j1:plan:1")  # late: older generation
    done = RecoveryDone(
        job="j1", generation=2, worker="w1", rank=1, step=10, incident=None, phases_ms={"first_step": 5.0}
    )
    await bus.publish(RECOVERED, done, job="j1", msg_id="j1:2:w1")

    deadline = asyncio.get_running_loop().time() + WAIT_S
    while True:
        details = (await svc.healthy(bus)).details
        if details["plans"] == 2 and details["recoveries"] == 1:
            break
        assert asyncio.get_running_loop().time() < deadline, (details, svc.tail())
        await asyncio.sleep(0.1)
    assert details["stale_plans"] == 1 and details["jobs"] == 1
    assert await svc.terminate() == 0
    log = svc.tail(100_000)
    assert '"event": "plan"' in log and '"event": "plan_stale"' in log and '"event": "recovery_done"' in log


async def wait_consumer(bus: Bus, stream: str, durable: str) -> None:
    deadline = asyncio.get_running_loop().time() + WAIT_S
    while True:
        try:
            await bus.js.consumer_info(stream, durable)
            return
        except Exception:
            if asyncio.get_running_loop().time() > deadline:
                raise
            await asyncio.sleep(0.1)
