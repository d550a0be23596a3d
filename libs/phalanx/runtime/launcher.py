"""The launcher: one per node, ``phalanx run ... -- python train.py ...``.

It is the job's long-lived agent on a node, the part that does not die with the
ranks:

- joins the job: it sends the planner its node's :class:`~phalanx.schemas.JobSpec`
  (workers, the job-level settings every node must agree on) and waits for the
  answer; a launcher that disagrees with the nodes already in the job is refused
  with the reason and starts nothing. The answer carries the job-level run id
  that ranks use to ignore plans of an earlier run;
- hosts a rendezvous store (a ``TCPStore`` on the node's interface; a store
  hosted by a rank would die with it). Each generation's plan names the store
  its members meet on, so the rendezvous moves to a surviving node when the node
  hosting it is lost;
- starts the ranks and the hot spares (which import torch, build the model and
  open the data before they are needed) and watches their exits: the moment a
  worker dies, a ``RankExited`` goes out -- the fast crash path that does not wait
  for heartbeats to stop. Workers die with their launcher (``PR_SET_PDEATHSIG``),
  so no orphan trains outside the plan;
- collects its workers' heartbeats locally and publishes one
  :class:`~phalanx.schemas.NodeDigest` per interval (:mod:`phalanx.runtime.digest`);
- fences: a worker a plan removes (a hung rank) is SIGKILLed, which turns a hang
  into a crash and releases the survivors blocked in a collective; a launcher
  whose node was declared lost (cut off, then back) fences all its workers and ends;
- ends when its node's members of the current plan have all exited 0, when the
  planner declares the job complete (a node holding only spares), or stops it.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import hashlib
import itertools
import json
import os
import signal
import socket
import subprocess
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from nats.aio.msg import Msg

if TYPE_CHECKING:
    import torch.distributed as dist

from phalanx.bus import Bus, nats_url
from phalanx.bus.subjects import DECISION, EXITED, JOB_SPEC, JOINED, SPAWN
from phalanx.metrics import LauncherMetrics, MetricsServer, serve_metrics
from phalanx.natsauth import ENV_WORKER_CREDENTIALS, worker_credentials
from phalanx.runtime.addr import listen_socket, local_address_towards
from phalanx.runtime.digest import NodeDigestPublisher
from phalanx.runtime.follow import PlanFollower
from phalanx.runtime.heartbeat import heartbeat_interval_s
from phalanx.schemas import (
    Action,
    Elastic,
    JobSpec,
    NodeJoined,
    Plan,
    PlanDecision,
    RankExited,
    Role,
    SpawnWorkers,
    decode,
)
from phalanx.settings import get_settings
from phalanx.telemetry import get_logger

_PR_SET_PDEATHSIG = 1


class LaunchError(RuntimeError):
    """The launcher could not join its job (no planner answered, or it was refused)."""


@dataclass
class Worker:
    name: str
    role: Role
    proc: subprocess.Popen[bytes]
    slot: int = 0
    exited_at: float | None = None
    returncode: int | None = None


@dataclass
class LaunchConfig:
    """One node's part of a job. ``nproc`` ranks and ``spares`` hot spares start on
    this node; ``min_nodes``..``max_nodes``, ``global_batch``, ``min_nproc`` and the
    command are job-level settings every node's launcher must agree on."""

    job: str
    cmd: list[str]
    nproc: int
    spares: int = 0
    global_batch: int = 32
    min_nproc: int | None = None  # smallest world a shrink may leave (default: no shrink)
    nats_url: str | None = None
    env: dict[str, str] = field(default_factory=dict)
    log_dir: Path | None = None
    node: str = "local"
    min_nodes: int = 1
    max_nodes: int = 1
    bind: str | None = None  # the address store and gloo listen on; None: towards NATS
    join_timeout_s: float = 10.0  # for the planner's answer
    join_retry_s: float = 30.0  # for a refusal that may lift (the node's old launcher not yet lost)
    elastic: Elastic = field(default_factory=Elastic)  # sizes, cool-down, grace, batch split, LR rule


def worker_names(node: str, count: int, qualified: bool) -> list[str]:
    """``w0..`` in a one-node job; ``<node>-w0..`` when the job may span nodes.

    >>> worker_names("node-a", 2, True), worker_names("local", 2, False)
    (['node-a-w0', 'node-a-w1'], ['w0', 'w1'])
    """
    return [f"{node}-w{i}" if qualified else f"w{i}" for i in range(count)]


def command_fingerprint(cmd: list[str]) -> str:
    """What launchers compare to be sure every node runs the same training command."""
    return "sha256:" + hashlib.sha256(json.dumps(cmd).encode()).hexdigest()[:16]


def _die_with_parent() -> None:
    """In the child before exec: SIGKILL when the launcher dies (Linux)."""
    with contextlib.suppress(Exception):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


class Launcher:
    def __init__(self, config: LaunchConfig) -> None:
        if config.nproc < 0 or config.spares < 0 or config.nproc + config.spares < 1:
            raise ValueError("need nproc >= 0, spares >= 0 and at least one worker")
        if not 1 <= config.min_nodes <= config.max_nodes:
            raise ValueError(f"need 1 <= min_nodes <= max_nodes, got {config.min_nodes}:{config.max_nodes}")
        if not config.cmd:
            raise ValueError("no command to launch")
        self.config = config
        self.job = config.job
        self.node = config.node
        self.log = get_logger(component="launcher", job=config.job, node=config.node)
        self.workers: dict[str, Worker] = {}
        self.plan: Plan | None = None
        self.decision: PlanDecision | None = None
        self.bus: Bus | None = None
        self.store: dist.TCPStore | None = None
        self.digests: NodeDigestPublisher | None = None
        self.bind = ""
        self.run = ""  # the job-level run id, from the planner's answer
        self._token = 0  # the highest planner fencing token seen in a plan
        self.follower: PlanFollower | None = None
        self.removed_reason: str | None = None
        self._listener: socket.socket | None = None
        self._port = 0
        self._joined: asyncio.Future[NodeJoined] | None = None
        self._done = asyncio.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._tmp = Path(tempfile.mkdtemp(prefix=f"phalanx-{config.job}-"))
        # This process's identity in the job: a launcher started again on the same
        # node is new capacity, not the one that was lost.
        self.id = f"{config.node}-{uuid.uuid4().hex[:12]}"
        self.metrics = LauncherMetrics(instance=self.id, job=config.job, node=config.node)
        self._metrics_server: MetricsServer | None = None
        self.metrics_url = ""  # where /metrics is served ("": not yet, or disabled)

    # -- start -------------------------------------------------------------------
    async def start(self) -> None:
        """Join the job and start this node's workers; raises :class:`LaunchError`."""
        cfg = self.config
        self._loop = asyncio.get_running_loop()
        url = cfg.nats_url or nats_url()
        self.bind = cfg.bind or local_address_towards(url)
        # The store's address goes into the join; the store itself (torch) comes after.
        self._listener = listen_socket(self.bind)
        self._port = int(self._listener.getsockname()[1])
        try:
            self.bus = bus = await asyncio.wait_for(
                Bus.connect(url, name=f"launcher-{self.job}-{self.node}"), cfg.join_timeout_s
            )
        except (TimeoutError, OSError) as exc:
            raise LaunchError(
                f"no NATS server answers at {url}: start the control plane (`phalanx up`) or set NATS_URL ({exc!r})"
            ) from exc
        self._metrics_server = await serve_metrics(self.metrics, self.log)
        self.metrics_url = self._metrics_server.url if self._metrics_server is not None else ""
        await bus.nc.subscribe(DECISION.format(job=self.job), cb=self._on_decision)
        await bus.nc.subscribe(JOINED.format(job=self.job), cb=self._on_joined)
        await bus.nc.subscribe(SPAWN.format(job=self.job), cb=self._on_spawn)
        self.follower = PlanFollower(bus, self.job, self._apply_plan, poll_s=2.0)
        self.follower.eager = True  # a launcher must never miss the plan that fences its node
        await self.follower.start()
        joined = await self._join()
        from phalanx.runtime.comm import host_store  # imports torch: only here

        self.store = host_store(self.bind, sock=self._listener)
        self.run = joined.run
        await self.follower.read()  # a plan committed while we joined
        roles = [
            Role.SPARE if joined.as_spares or i >= cfg.nproc else Role.RANK
            for i in range(len(joined.workers))
        ]
        self.digests = NodeDigestPublisher(
            bus,
            job=self.job,
            node=self.node,
            launcher=self.id,
            host=socket.gethostname(),
            socket_path=self._tmp / "hb.sock",
            interval_s=heartbeat_interval_s(),
        )
        self.digests.on_heartbeat = self.metrics.heartbeat
        await self.digests.start()
        self.log.info("node_joined", run=self.run, workers=joined.workers, reason=joined.reason)
        for name, role in zip(joined.workers, roles, strict=True):
            self.spawn(name, role)

    async def _join(self) -> NodeJoined:
        cfg = self.config
        assert self.bus is not None and self._loop is not None
        spec = JobSpec(
            job=self.job,
            node=self.node,
            launcher=self.id,
            host=socket.gethostname(),
            store_addr=self.store_addr,
            workers=worker_names(cfg.node, cfg.nproc + cfg.spares, qualified=cfg.max_nodes > 1),
            ranks=cfg.nproc,
            min_nodes=cfg.min_nodes,
            max_nodes=cfg.max_nodes,
            min_world_size=cfg.min_nproc or 0,
            global_batch=cfg.global_batch,
            command=command_fingerprint(cfg.cmd),
            elastic=cfg.elastic,
        )
        # A node whose old launcher died is refused until the detector declares it
        # lost (a fraction of a second): such refusals are asked again, for a while.
        retry_until = time.monotonic() + cfg.join_retry_s
        for attempt in itertools.count():
            self._joined = self._loop.create_future()
            msg_id = f"{self.job}:spec:{self.id}:{attempt}"
            await self.bus.publish(JOB_SPEC, spec, job=self.job, node=self.node, msg_id=msg_id)
            try:
                joined = await asyncio.wait_for(self._joined, cfg.join_timeout_s)
            except TimeoutError:
                raise LaunchError(
                    f"no elasticity-planner answered the join of job {self.job!r} within "
                    f"{cfg.join_timeout_s:g}s: start the services (`phalanx service elasticity-planner`, "
                    f"or `make demo` / LocalStack for everything on one machine)"
                ) from None
            if joined.accepted:
                return joined
            if not joined.retry or time.monotonic() > retry_until:
                raise LaunchError(f"job {self.job!r} refused node {self.node!r}: {joined.reason}")
            self.log.info("join_refused_for_now", reason=joined.reason, attempt=attempt)
            await asyncio.sleep(0.5)
        raise AssertionError("unreachable")

    async def _on_joined(self, raw: Msg) -> None:
        try:
            msg = decode(raw.data, raw.headers, NodeJoined)
        except Exception as exc:
            self.log.error("bad_join_answer", error=repr(exc))
            return
        if msg.launcher == self.id and self._joined is not None and not self._joined.done():
            self._joined.set_result(msg)

    @property
    def store_addr(self) -> str:
        host = f"[{self.bind}]" if ":" in self.bind else self.bind
        return f"{host}:{self._port}"

    def free_slot(self) -> int:
        """The lowest slot index no live worker of this node holds: a worker's
        ``PHALANX_LOCAL_SLOT``, which picks its GPU (``Job.device``)."""
        taken = {w.slot for w in self.workers.values() if w.proc.poll() is None}
        return next(i for i in range(len(taken) + 1) if i not in taken)

    def spawn(self, name: str, role: Role, requested: bool = False) -> Worker:
        """Start worker ``name``; ``requested``: the planner asked for it (a restart, more capacity)."""
        cfg = self.config
        slot = self.free_slot()
        env = {
            **os.environ,
            **cfg.env,
            "PHALANX_JOB": self.job,
            "PHALANX_WORKER": name,
            "PHALANX_ROLE": role.value,
            "PHALANX_NODE": self.node,
            "PHALANX_STORE_ADDR": self.store_addr,
            "PHALANX_BIND": self.bind,
            "PHALANX_LAUNCH": self.run,
            "PHALANX_LOCAL_SLOT": str(slot),
            "LOCAL_RANK": str(slot),  # as torchrun sets it: scripts pick their GPU by it
            "PYTHONUNBUFFERED": "1",
        }
        if cfg.nproc + cfg.spares > 1 and not env.get("OMP_NUM_THREADS"):
            # As torchrun does: several workers on one node each running a full-width
            # OpenMP pool oversubscribe its cores (measured: +9 % step time on 2 cores).
            env["OMP_NUM_THREADS"] = "1"
        if self.digests is not None:
            env["PHALANX_HEARTBEAT_SOCKET"] = str(self.digests.socket_path)
        # With NATS authorization on, ranks log in as the rank role, never with the
        # launcher's own credentials (which may publish exits and job specs): each
        # worker as itself where the launcher was given per-worker users
        # (PHALANX_NATS_WORKER_CREDENTIALS, see phalanx.natsauth), else as the rank user.
        rank_user = env.pop("PHALANX_NATS_RANK_USER", None)
        rank_password = env.pop("PHALANX_NATS_RANK_PASSWORD", None)
        own = worker_credentials(env.pop(ENV_WORKER_CREDENTIALS, None), name)
        if rank_user:
            env["PHALANX_NATS_USER"], env["PHALANX_NATS_PASSWORD"] = rank_user, rank_password or ""
        elif not own and env.pop("PHALANX_NATS_USER", None) is not None:
            # No login for this worker (a name the deployment did not render a user
            # for): never the launcher's own, which speaks for the whole node.
            env.pop("PHALANX_NATS_PASSWORD", None)
            self.log.error("no_nats_login_for_worker", worker=name)
        env.update(own)
        if cfg.nats_url:
            env["NATS_URL"] = cfg.nats_url
        out: int | None = None
        if cfg.log_dir is not None:
            cfg.log_dir.mkdir(parents=True, exist_ok=True)
            out = os.open(cfg.log_dir / f"{name}.log", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        try:
            proc = subprocess.Popen(
                cfg.cmd,
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT if out else None,
                preexec_fn=_die_with_parent,  # spawned from the loop's (main) thread
            )
        finally:
            if out is not None:
                os.close(out)
        w = Worker(name, role, proc, slot)
        self.workers[name] = w
        self.metrics.started(role.value, requested)
        if self.digests is not None:
            self.digests.expect(name, proc.pid)
        threading.Thread(target=self._watch, args=(w,), daemon=True, name=f"watch-{name}").start()
        self.log.info("worker_started", worker=name, role=role.value, pid=proc.pid)
        return w

    async def _on_spawn(self, raw: Msg) -> None:
        """The planner asks for more workers here (capacity offered, spares to refill)."""
        try:
            msg = decode(raw.data, raw.headers, SpawnWorkers)
        except Exception as exc:
            self.log.error("bad_spawn_request", error=repr(exc))
            return
        if msg.launcher != self.id or msg.run != self.run or self._done.is_set():
            return
        for name in msg.workers:
            if name not in self.workers:  # a redelivery starts nothing twice
                self.spawn(name, Role.SPARE, requested=True)
        self.log.info("workers_requested", workers=msg.workers, reason=msg.reason)

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
        if self.digests is not None:
            self.digests.forget(w.name)
        self.metrics.exited(w.name, rc)
        event = RankExited(
            job=self.job,
            worker=w.name,
            node=self.node,
            pid=w.proc.pid,
            host=socket.gethostname(),
            exit_code=rc if rc >= 0 else None,
            signal=-rc if rc < 0 else None,
            exited_at=w.exited_at,
        )
        self.log.info("worker_exited", worker=w.name, pid=w.proc.pid, returncode=rc)
        if not self._done.is_set():
            with contextlib.suppress(Exception):  # cut off from NATS: the detector hears the silence
                await self.bus.publish(
                    EXITED,
                    event,
                    job=self.job,
                    node=self.node,
                    msg_id=f"{self.job}:{w.name}:{w.proc.pid}:exit",
                )
        self._check_done()

    def _check_done(self) -> None:
        if self.plan is None:
            codes = {w.name: w.returncode for w in self.workers.values()}
            if codes and all(rc is not None and rc != 0 for rc in codes.values()):
                # Nothing can start: a command that does not run (not found, an import
                # error) would otherwise leave the launcher waiting for a plan forever.
                self.removed_reason = f"every worker exited before the job started (exit codes {codes})"
                self.log.error(
                    "job_not_started", reason=self.removed_reason, log_dir=str(self.config.log_dir)
                )
                self._done.set()
            return
        members = [self.workers[m.worker] for m in self.plan.members if m.worker in self.workers]
        if members and all(w.returncode == 0 for w in members):
            self.log.info("job_completed", generation=self.plan.generation)
            self._done.set()

    # -- plans: fencing ------------------------------------------------------------
    def _apply_plan(self, plan: Plan, by_message: bool = False) -> None:
        if not self.run or plan.launch != self.run:
            return
        if plan.token < self._token:
            self.log.warning("plan_fenced", generation=plan.generation, token=plan.token, seen=self._token)
            return  # from a planner that has been replaced
        self._token = plan.token
        if self.plan is not None and plan.generation <= self.plan.generation:
            return
        self.plan = plan
        if self.id in plan.lost_launchers:
            # This node was declared lost (cut off): its workers may still be blocked
            # in a collective of an old generation. Nothing of it may go on.
            self.removed_reason = f"node {self.node} was declared lost (generation {plan.generation})"
            self.log.error("node_removed", generation=plan.generation, reason=plan.reason)
            self._fence([w for w in self.workers if self.workers[w].proc.poll() is None], plan)
            self._done.set()
            return
        self._fence([w for w in plan.removed if w in self.workers], plan)
        leaving = [w for w in plan.leaving if w in self.workers and self.workers[w].proc.poll() is None]
        if leaving and self._loop is not None:
            # They finish their step and exit 0; only one still running at the deadline is fenced.
            left = max(0.0, plan.leave_by - time.time())
            self.log.info(
                "workers_leaving", workers=leaving, generation=plan.generation, deadline_s=round(left, 3)
            )
            self._loop.call_later(left, self._fence_late, leaving, plan)
        self._check_done()

    def _fence_late(self, names: list[str], plan: Plan) -> None:
        late = [w for w in names if self.workers[w].proc.poll() is None]
        if late:
            self.log.error("leave_deadline_passed", workers=late, generation=plan.generation)
            self._fence(late, plan)

    def _fence(self, names: list[str], plan: Plan) -> None:
        for name in names:
            w = self.workers[name]
            if w.proc.poll() is None:
                self.log.warning("fencing_worker", worker=name, generation=plan.generation)
                with contextlib.suppress(ProcessLookupError):
                    w.proc.send_signal(signal.SIGKILL)

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
        elif d.action is Action.COMPLETE and not self._running_members():
            # A node with spares only: nothing of it is needed any more. A node with
            # members waits for them (rank 0 may still be writing the weights).
            self.log.info("job_completed", reason=d.reason)
            self._done.set()

    def _running_members(self) -> list[str]:
        plan = self.plan
        if plan is None:
            return []
        return [
            m.worker
            for m in plan.members
            if m.worker in self.workers and self.workers[m.worker].proc.poll() is None
        ]

    # -- end ---------------------------------------------------------------------------
    async def wait(self, timeout_s: float | None = None) -> int:
        """Wait for the job to end on this node: 0 when it completed, 1 when the
        planner stopped it or this node was removed from it."""
        await asyncio.wait_for(self._done.wait(), timeout_s)
        return 1 if self.decision is not None or self.removed_reason is not None else 0

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
        if self.digests is not None:
            for name in self.workers:  # all ended: the last digest lists none, so no one is missed
                self.digests.forget(name)
            await self.digests.stop()
        if self.follower is not None:
            await self.follower.stop()
        if self._metrics_server is not None:
            await self._metrics_server.stop()
            self._metrics_server = None
        if self.bus is not None:
            await self.bus.close()
        if self.store is None and self._listener is not None:
            self._listener.close()  # it never became a store
        with contextlib.suppress(OSError):
            for p in self._tmp.iterdir():
                p.unlink()
            self._tmp.rmdir()

    async def drain(self, grace_s: float) -> None:
        """Asked to go (SIGTERM: a pod being deleted, a node being drained): give the
        planner ``grace_s`` to take this node's workers out at a step boundary (the
        scheduler's preemption notice leads to a plan in which they leave and exit 0),
        then end; whatever still runs is stopped by :meth:`stop`."""
        self.log.warning("draining", grace_s=grace_s, workers=self._running_members())
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline and not self._done.is_set():
            if all(w.proc.poll() is not None for w in self.workers.values()):
                break
            await asyncio.sleep(0.05)
        self._done.set()


def drain_grace_s() -> float:
    """``PHALANX_LAUNCHER_DRAIN_S``: how long a launcher told to stop (SIGTERM) waits for
    its workers to be taken out of the job gracefully (0, the default: stop at once).
    On Kubernetes set it a little below the pod's ``terminationGracePeriodSeconds``."""
    return get_settings().launcher_drain_s


async def run(config: LaunchConfig, timeout_s: float | None = None) -> int:
    grace = drain_grace_s()
    launcher = Launcher(config)
    loop = asyncio.get_running_loop()
    drains: list[asyncio.Task[None]] = []
    if grace > 0:
        loop.add_signal_handler(
            signal.SIGTERM, lambda: drains.append(loop.create_task(launcher.drain(grace)))
        )
    try:
        await launcher.start()
        return await launcher.wait(timeout_s)
    finally:
        if grace > 0:
            loop.remove_signal_handler(signal.SIGTERM)
        await launcher.stop()
