"""A whole Phalanx deployment on one machine: nats-server, the four services,
and jobs under the launcher. ``make demo``, the end-to-end tests and the
benchmarks all run through it; it is also the quickest way to try Phalanx.

>>> with LocalStack(workdir) as stack:          # NATS_URL set: that server is used
...     result = stack.run_job("j1", ["python", "-m", "examples.train_gpt"], nproc=4, spares=1,
...                            faults="kill:w2@step=8")
...     result.returncode, [d.action for d in result.decisions]
(0, ['start', 'replace'])

``LocalStack(workdir, auth=True)`` runs its nats-server with the users and
permissions of :mod:`phalanx.natsauth` and gives each process its role's
credentials (services their own role, the launcher ``launcher``, ranks ``rank``,
the stack's observer ``observer``, its health checks ``admin``); default off.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any

from nats.aio.msg import Msg

from phalanx.bus import Bus
from phalanx.bus._connection import ENV_NATS_PASSWORD, ENV_NATS_USER
from phalanx.bus.subjects import DECISION, FAILED, HUNG, PLAN, RECOVERED
from phalanx.natsauth import ROLE_OF_SERVICE, NatsAuth
from phalanx.natsserver import NatsServer
from phalanx.runtime.launcher import LaunchConfig, Launcher
from phalanx.schemas import Plan, PlanDecision, RankFailed, RankHung, RecoveryDone, decode
from phalanx.service import ping

SERVICE_MODULES = {
    "failure-detector": "phalanx.services.failure_detector",
    "elasticity-planner": "phalanx.services.elasticity_planner",
    "scheduler-signal": "phalanx.services.scheduler_signal",
    "state-replication": "phalanx.services.state_replication",
}


@dataclass
class JobResult:
    job: str
    returncode: int
    wall_s: float
    faults: list[RankFailed | RankHung] = field(default_factory=list)
    decisions: list[PlanDecision] = field(default_factory=list)
    plans: list[Plan] = field(default_factory=list)
    recoveries: list[RecoveryDone] = field(default_factory=list)
    received_at: dict[str, float] = field(default_factory=dict)  # first receipt per incident


class LocalStack:
    def __init__(
        self,
        workdir: str | os.PathLike[str],
        *,
        services: tuple[str, ...] = tuple(SERVICE_MODULES),
        env: dict[str, str] | None = None,
        auth: bool = False,
    ) -> None:
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.services = services
        self.env = {**os.environ, **(env or {})}
        self.env.setdefault("PHALANX_SPAN_FILE", str(self.workdir / "spans.jsonl"))
        self.server: NatsServer | None = None
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.with_auth = auth
        self.auth: NatsAuth | None = None  # the users, once start() made them

    @property
    def url(self) -> str:
        return self.env["NATS_URL"]

    @property
    def span_file(self) -> Path:
        return Path(self.env["PHALANX_SPAN_FILE"])

    def role_env(self, role: str) -> dict[str, str]:
        """The credentials a process of ``role`` gets (nothing with auth off)."""
        return self.auth.env(role) if self.auth is not None else {}

    @contextlib.contextmanager
    def _credentials(self, role: str) -> Iterator[None]:
        """This process's environment holds ``role``'s credentials while Bus.connect reads them."""
        saved = {k: os.environ.get(k) for k in (ENV_NATS_USER, ENV_NATS_PASSWORD)}
        os.environ.update(self.role_env(role))
        try:
            yield
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v

    def start(self) -> LocalStack:
        if self.with_auth and os.environ.get("NATS_URL"):
            raise ValueError("LocalStack(auth=True) configures its own nats-server: unset NATS_URL")
        if not os.environ.get("NATS_URL"):
            conf = None
            if self.with_auth:
                self.auth = NatsAuth.generate()
                conf = self.auth.write_config(self.workdir / "nats.conf", listen=None)
            self.server = NatsServer(store_dir=self.workdir / "nats", config_file=conf).start()
            self.env["NATS_URL"] = self.server.url
        for name in self.services:
            log = open(self.workdir / f"{name}.log", "ab")
            env = {**self.env, **self.role_env(ROLE_OF_SERVICE[name])}
            self.procs[name] = subprocess.Popen(
                [sys.executable, "-m", SERVICE_MODULES[name]], env=env, stdout=log, stderr=log
            )
            log.close()
        asyncio.run(self._wait_healthy())
        return self

    async def _wait_healthy(self, timeout_s: float = 60.0) -> None:
        with self._credentials("admin"):
            bus = await Bus.connect(self.url, name="localstack")
        try:
            deadline = time.monotonic() + timeout_s
            for name in self.services:
                while True:
                    if self.procs[name].poll() is not None:
                        raise RuntimeError(f"service {name} exited: see {self.workdir / (name + '.log')}")
                    try:
                        await ping(bus, name, timeout=1.0)
                        break
                    except Exception:
                        if time.monotonic() > deadline:
                            raise
                        await asyncio.sleep(0.2)
        finally:
            await bus.close()

    def stop(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                p.terminate()
        for p in self.procs.values():
            try:
                p.wait(15)
            except subprocess.TimeoutExpired:
                p.kill()
        self.procs.clear()
        if self.server is not None:
            self.server.cleanup()
            self.server = None

    def __enter__(self) -> LocalStack:
        return self.start()

    def __exit__(
        self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    # -- jobs ---------------------------------------------------------------------
    def run_job(self, job: str, cmd: list[str], **kwargs: Any) -> JobResult:
        """Run a job to its end; the arguments are :meth:`run_job_async`'s."""
        return asyncio.run(self.run_job_async(job, cmd, **kwargs))

    async def run_job_async(
        self,
        job: str,
        cmd: list[str],
        *,
        nproc: int,
        spares: int = 0,
        min_nproc: int | None = None,
        faults: str = "",
        global_batch: int = 16,
        timeout_s: float = 300.0,
        env: dict[str, str] | None = None,
    ) -> JobResult:
        result = JobResult(job, -1, 0.0)
        with self._credentials("observer"):  # an observer may not create streams: auth on, no ensure
            bus = await Bus.connect(self.url, name=f"observer-{job}", ensure=self.auth is None)

        async def on_msg(raw: Msg) -> None:
            msg = decode(raw.data, raw.headers)
            if isinstance(msg, RankFailed | RankHung):
                result.received_at.setdefault(msg.incident, time.time())
                result.faults.append(msg)
            elif isinstance(msg, PlanDecision):
                result.decisions.append(msg)
            elif isinstance(msg, Plan):
                result.plans.append(msg)
            elif isinstance(msg, RecoveryDone):
                result.recoveries.append(msg)

        for subject in (FAILED, HUNG, DECISION, PLAN, RECOVERED):
            await bus.nc.subscribe(subject.format(job=job), cb=on_msg)
        launcher = Launcher(
            LaunchConfig(
                job=job,
                cmd=cmd,
                nproc=nproc,
                spares=spares,
                global_batch=global_batch,
                min_nproc=min_nproc,
                nats_url=self.url,
                env={
                    **{k: v for k, v in self.env.items() if k.startswith(("PHALANX_", "OTEL_"))},
                    "PHALANX_FAULTS": faults,
                    **self.role_env("rank"),
                    **(env or {}),
                },
                log_dir=self.workdir / "logs" / job,
            )
        )
        t0 = time.time()
        try:
            with self._credentials("launcher"):  # its own connection; its ranks get cfg.env's
                await launcher.start()
            result.returncode = await launcher.wait(timeout_s)
        finally:
            result.wall_s = time.time() - t0
            await launcher.stop()
            await asyncio.sleep(0.3)  # let the last events arrive
            await bus.close()
        return result
