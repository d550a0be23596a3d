"""The local launcher: ``phalanx run --nproc N --spares K -- python train.py ...``.

It is the job's long-lived agent on a node, the part that does not die with the
ranks:

- hosts the job's rendezvous store (a ``TCPStore``) that every generation's
  process group is built over (a store hosted by rank 0 would die with rank 0);
- publishes the job spec the planner forms generation 1 from;
- starts the ranks and the hot spares (which import torch, build the model and
  open the data before they are needed) and watches their exits: the moment a
  worker dies, a ``RankExited`` goes out -- the fast crash path that does not wait
  for heartbeats to stop;
- fences: a worker a plan removes (a hung rank) is SIGKILLed, which turns a hang
  into a crash and releases the survivors blocked in a collective;
- ends the job when the ranks of the current plan have all exited 0, or when the
  planner decides to stop.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import subprocess
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from nats.aio.msg import Msg

if TYPE_CHECKING:
    import torch.distributed as dist

from phalanx.bus import Bus
from phalanx.bus.subjects import DECISION, EXITED, JOB_SPEC, PLAN
from phalanx.schemas import Action, JobSpec, Plan, PlanDecision, RankExited, Role, decode
from phalanx.telemetry import get_logger


@dataclass
class Worker:
    name: str
    role: Role
    proc: subprocess.Popen[bytes]
    exited_at: float | None = None
    returncode: int | None = None


@dataclass
class LaunchConfig:
    job: str
    cmd: list[str]
    nproc: int
    spares: int = 0
    global_batch: int = 32
    min_nproc: int | None = None
    max_nproc: int | None = None
    nats_url: str | None = None
    env: dict[str, str] = field(default_factory=dict)
    log_dir: Path | None = None
    store_host: str = "127.0.0.1"


class Launcher:
    def __init__(self, config: LaunchConfig) -> None:
        if config.nproc < 1 or config.spares < 0:
            raise ValueError("need nproc >= 1 and spares >= 0")
        if not config.cmd:
            raise ValueError("no command to launch")
        self.config = config
        self.job = config.job
        self.log = get_logger(component="launcher", job=config.job)
        self.workers: dict[str, Worker] = {}
        self.plan: Plan | None = None
        self.decision: PlanDecision | None = None
        self.bus: Bus | None = None
        self.store: dist.TCPStore | None = None
        self._done = asyncio.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._next_index = 0
        # Plans of an earlier launch of the same job name stay in KV; ranks tell
        # them apart by this id (and the planner only ever moves generations up).
        self.launch = uuid.uuid4().hex[:12]

    # -- start -------------------------------------------------------------------
    async def start(self) -> None:
        from phalanx.runtime.comm import host_store  # imports torch: only here

        cfg = self.config
        self._loop = asyncio.get_running_loop()
        self.store = host_store(cfg.store_host)
        self.bus = bus = await Bus.connect(cfg.nats_url, name=f"launcher-{self.job}")
        await bus.nc.subscribe(PLAN.format(job=self.job), cb=self._on_plan)
        await bus.nc.subscribe(DECISION.format(job=self.job), cb=self._on_decision)
        names = [f"w{i}" for i in range(cfg.nproc + cfg.spares)]
        self._next_index = len(names)
        spec = JobSpec(
            job=self.job,
            world_size=cfg.nproc,
            min_world_size=cfg.min_nproc or cfg.nproc,
            max_world_size=cfg.max_nproc or cfg.nproc,
            global_batch=cfg.global_batch,
            workers=names,
            launch=self.launch,
        )
        await bus.publish(JOB_SPEC, spec, job=self.job, msg_id=f"{self.job}:spec:{self.launch}")
        for i, name in enumerate(names):
            self.spawn(name, Role.RANK if i < cfg.nproc else Role.SPARE)

    @property
    def store_addr(self) -> str:
        assert self.store is not None
        return f"{self.config.store_host}:{self.store.port}"

    def spawn(self, name: str, role: Role) -> Worker:
        cfg = self.config
        env = {
            **os.environ,
            **cfg.env,
            "PHALANX_JOB": self.job,
            "PHALANX_WORKER": name,
            "PHALANX_ROLE": role.value,
            "PHALANX_STORE_ADDR": self.store_addr,
            "PHALANX_LAUNCH": self.launch,
            "PYTHONUNBUFFERED": "1",
        }
        # With NATS authorization on, ranks log in as the rank role, never with the
        # launcher's own credentials (which may publish exits and job specs).
        rank_user = env.pop("PHALANX_NATS_RANK_USER", None)
        rank_password = env.pop("PHALANX_NATS_RANK_PASSWORD", None)
        if rank_user:
            env["PHALANX_NATS_USER"], env["PHALANX_NATS_PASSWORD"] = rank_user, rank_password or ""
        if cfg.nats_url:
            env["NATS_URL"] = cfg.nats_url
        out: int | None = None
        if cfg.log_dir is not None:
            cfg.log_dir.mkdir(parents=True, exist_ok=True)
            out = os.open(cfg.log_dir / f"{name}.log", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        try:
            proc = subprocess.Popen(cfg.cmd, env=env, stdout=out, stderr=subprocess.STDOUT if out else None)
        finally:
            if out is not None:
                os.close(out)
        w = Worker(name, role, proc)
        self.workers[name] = w
        threading.Thread(target=self._watch, args=(w,), daemon=True, name=f"watch-{name}").start()
        self.log.info("worker_started", worker=name, role=role.value, pid=proc.pid)
        return w

    # -- exits: the fast crash path -------------------------------------------------
    def _watch(self, w: Worker) -> None:
        rc = w.proc.wait()
        w.exited_at, w.returncode = time.time(), rc
        assert self._loop is not None
        with contextlib.suppress(RuntimeError):  # loop closed at shutdown
            asyncio.run_coroutine_threadsafe(self._on_exit(w), self._loop)

    async def _on_exit(self, w: Worker) -> None:
        rc = w.returncode
        assert rc is not None and w.exited_at is not None and self.bus is not None
        event = RankExited(
            job=self.job,
            worker=w.name,
            pid=w.proc.pid,
            host=socket.gethostname(),
            exit_code=rc if rc >= 0 else None,
            signal=-rc if rc < 0 else None,
            exited_at=w.exited_at,
        )
        self.log.info("worker_exited", worker=w.name, pid=w.proc.pid, returncode=rc)
        if not self._done.is_set():
            await self.bus.publish(
                EXITED, event, job=self.job, msg_id=f"{self.job}:{w.name}:{w.proc.pid}:exit"
            )
        self._check_done()

    def _check_done(self) -> None:
        if self.plan is None:
            return
        members = [self.workers[m.worker] for m in self.plan.members if m.worker in self.workers]
        if members and all(w.returncode == 0 for w in members):
            self.log.info("job_completed", generation=self.plan.generation)
            self._done.set()

    # -- plans: fencing ------------------------------------------------------------
    async def _on_plan(self, raw: Msg) -> None:
        try:
            plan = decode(raw.data, raw.headers, Plan)
        except Exception as exc:
            self.log.error("bad_plan", error=repr(exc))
            return
        if plan.launch != self.launch or (self.plan is not None and plan.generation <= self.plan.generation):
            return
        self.plan = plan
        for name in plan.removed:
            w = self.workers.get(name)
            if w is not None and w.proc.poll() is None:
                self.log.warning("fencing_worker", worker=name, generation=plan.generation)
                with contextlib.suppress(ProcessLookupError):
                    w.proc.send_signal(signal.SIGKILL)
        self._check_done()

    async def _on_decision(self, raw: Msg) -> None:
        try:
            d = decode(raw.data, raw.headers, PlanDecision)
        except Exception as exc:
            self.log.error("bad_decision", error=repr(exc))
            return
        if d.action is Action.STOP:
            self.log.error("job_stopped_by_planner", reason=d.reason)
            self.decision = d
            self._done.set()

    # -- end ---------------------------------------------------------------------------
    async def wait(self, timeout_s: float | None = None) -> int:
        """Wait for the job to end; 0 when it completed, 1 when the planner stopped it."""
        await asyncio.wait_for(self._done.wait(), timeout_s)
        return 1 if self.decision is not None else 0

    def kill(self, worker: str, sig: int = signal.SIGKILL) -> float:
        """Send ``sig`` to a worker (fault injection by a test or benchmark); returns the time."""
        t = time.time()
        self.workers[worker].proc.send_signal(sig)
        return t

    async def stop(self, grace_s: float = 3.0) -> None:
        self._done.set()
        for w in self.workers.values():
            if w.proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    w.proc.send_signal(signal.SIGCONT)
                    w.proc.terminate()
        deadline = time.monotonic() + grace_s
        for w in self.workers.values():
            while w.proc.poll() is None and time.monotonic() < deadline:
                await asyncio.sleep(0.02)
            if w.proc.poll() is None:
                w.proc.kill()
        if self.bus is not None:
            await self.bus.close()


async def run(config: LaunchConfig, timeout_s: float | None = None) -> int:
    launcher = Launcher(config)
    await launcher.start()
    try:
        return await launcher.wait(timeout_s)
    finally:
        await launcher.stop()
