"""The launcher: one per node, ``phalanx run ... -- python train.py ...``.

It is the job's long-lived agent on a node, the part that does not die with the
ranks:

- joins the job: it sends the planner its node's :class:`~phalanx.contract.JobSpec`
  (workers, the job-level settings every node must agree on) and waits for the
  answer; a launcher that disagrees with the nodes already in the job is refused
  with the reason and starts nothing. The answer carries the job-level run id
  that ranks use to ignore plans of an earlier run;
- hosts a rendezvous store (a ``TCPStore`` on the node's interface; a store
  hosted by a rank would die with it) in a process of its own, started once per
  job (:mod:`phalanx.launcher.store`): the launcher imports no torch. Each
  generation's plan names the store its members meet on, so the rendezvous moves
  to a surviving node when the node hosting it is lost; a store that dies ends
  its launcher, as a lost node;
- starts the ranks and the hot spares (which import torch, build the model and
  open the data before they are needed) and watches their exits: the moment a
  worker dies, a ``RankExited`` goes out -- the fast crash path that does not wait
  for heartbeats to stop. Workers die with their launcher (``PR_SET_PDEATHSIG``),
  so no orphan trains outside the plan;
- collects its workers' heartbeats locally and publishes one
  :class:`~phalanx.contract.NodeDigest` per interval (:mod:`phalanx.worker.digest`);
- fences: a worker a plan removes (a hung rank) is SIGKILLed, which turns a hang
  into a crash and releases the survivors blocked in a collective; a launcher
  whose node was declared lost (cut off, then back) fences all its workers and ends;
- starts Python workers warm, forked from the node's fork server
  (:mod:`phalanx.launcher.forkserver`), which has imported torch once; cold (a plain
  process) when the command is not ``python script.py`` / ``-m`` / ``-c``, when the
  server says a fork is unsafe, or with ``warm=False``;
- with restart recovery (an unmodified torchrun script, :mod:`phalanx.runtime.unmodified`),
  ends every member of the old generation on each new plan and starts the new
  generation's from the fork server, as torchrun's agent restarts its workers; their
  exits are no faults. A worker that could not start the script at all (an import
  error) ends the job on this node with the error, rather than a restart loop;
- ends when its node's members of the current plan have all exited 0, when the
  planner declares the job complete (a node holding only spares), or stops it.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import itertools
import json
import shutil
import signal
import socket
import tempfile
import threading
import time
import uuid
from pathlib import Path

from nats.aio.msg import Msg

from phalanx.bus import Bus, nats_url
from phalanx.contract import (
    Action,
    Heartbeat,
    JobSpec,
    NodeAck,
    NodeJoined,
    NodePlan,
    PlanDecision,
    RankExited,
    Recovery,
    Role,
    SpawnWorkers,
)
from phalanx.contract.subjects import DECISION, EXITED, JOB_SPEC, JOINED, NODE_ACK, SPAWN
from phalanx.launcher.children import Worker, end_all, worker_names
from phalanx.launcher.config import LaunchConfig
from phalanx.launcher.handout import Handout
from phalanx.launcher.planview import NodePlanFollower
from phalanx.launcher.restarts import end_then_start, members_to_restart
from phalanx.launcher.starter import Starter
from phalanx.launcher.store import StoreError, StoreProcess
from phalanx.lifecycle import exit_watchdog
from phalanx.metrics import LauncherMetrics, MetricsServer, serve_metrics
from phalanx.settings import LauncherSettings, load
from phalanx.telemetry import get_logger
from phalanx.worker.addr import listen_socket, local_address_towards
from phalanx.worker.digest import NodeDigestPublisher

__all__ = ["LaunchConfig", "LaunchError", "Launcher", "command_fingerprint", "run", "worker_names"]

EXIT_REPORT_S = 300.0
"""How long a launcher keeps offering a worker's exit to NATS before it goes on without
it. The planner learns that a job completed from these: a job that ends while the bus
is away must still be recorded once it is back. (Bus.publish's 30 s gave up inside a
60 s partition, and every launcher then ended on its own, the planner never hearing.)"""


class LaunchError(RuntimeError):
    """The launcher could not join its job (no planner answered, or it was refused)."""


def command_fingerprint(cmd: list[str]) -> str:
    """What launchers compare to be sure every node runs the same training command."""
    return "sha256:" + hashlib.sha256(json.dumps(cmd).encode()).hexdigest()[:16]


def job_spec(cfg: LaunchConfig, launcher: str, store_addr: str) -> JobSpec:
    """What this node's launcher asks the planner: its workers and the job-level settings."""
    return JobSpec(
        job=cfg.job,
        node=cfg.node,
        launcher=launcher,
        host=socket.gethostname(),
        store_addr=store_addr,
        workers=worker_names(cfg.node, cfg.nproc + cfg.spares, qualified=cfg.max_nodes > 1),
        ranks=cfg.nproc,
        min_nodes=cfg.min_nodes,
        max_nodes=cfg.max_nodes,
        min_world_size=cfg.min_nproc or 0,
        global_batch=cfg.global_batch,
        command=command_fingerprint(cfg.cmd),
        elastic=cfg.elastic,
        recovery=cfg.recovery,
        max_restarts=cfg.max_restarts,
    )


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
        self.plan: NodePlan | None = None  # this node's part of the current generation
        self.decision: PlanDecision | None = None
        self.completed: PlanDecision | None = None
        """The planner's COMPLETE, once read: this node ends when none of its members runs."""
        self.bus: Bus | None = None
        self.store: StoreProcess | None = None
        self.digests: NodeDigestPublisher | None = None
        self.bind = ""
        self.run = ""  # the job-level run id, from the planner's answer
        self.follower: NodePlanFollower | None = None
        self.handout: Handout | None = None
        self.removed_reason: str | None = None
        self._tmp = Path(tempfile.mkdtemp(prefix=f"phalanx-{config.job}-"))
        self.starter = Starter(config, self.log, self._tmp)  # ValueError: restart of a non-Python command
        self._restarts: set[asyncio.Task[None]] = set()
        self._listener: socket.socket | None = None
        self._port = 0
        self._joined: asyncio.Future[NodeJoined] | None = None
        self._done = asyncio.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
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
        # The store's address goes into the join; its process (torch) starts now, to be
        # ready by the time the join is answered.
        self._listener = listen_socket(self.bind)
        self._port = int(self._listener.getsockname()[1])
        self.store = StoreProcess(self._listener, self.bind, self.log)
        self.store.on_exit = self._part_died
        await self.store.start()
        self.starter.start_fork_server(self._part_died)
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
        await bus.subscribe(DECISION.format(job=self.job), self._on_decision, PlanDecision)
        await bus.subscribe(JOINED.format(job=self.job), self._on_joined, NodeJoined)
        await bus.subscribe(SPAWN.format(job=self.job), self._on_spawn, SpawnWorkers)
        self.digests = NodeDigestPublisher(
            bus,
            job=self.job,
            node=self.node,
            launcher=self.id,
            host=socket.gethostname(),
            socket_path=self._tmp / "hb.sock",
            interval_s=load(LauncherSettings).heartbeat_interval_s,
            on_heartbeat=self._heard,
        )
        await self.digests.answer_probes()  # "is this node's launcher there?": from before the join
        self.follower = NodePlanFollower(
            bus, self.job, self.node, lambda: set(self.workers), self._apply_plan
        )
        await self.follower.start()  # deltas from now on; taken once the join names the run
        joined = await self._join()
        try:
            await self.store.ready(cfg.store_timeout_s)
        except StoreError as exc:
            raise LaunchError(str(exc)) from exc
        self.run = joined.run
        self.handout = Handout(self.job, self.node, self._tmp, self._publish_ack)
        await self.follower.follow(self.run)  # the record once: a plan committed while we joined
        roles = [
            Role.SPARE if joined.as_spares or i >= cfg.nproc else Role.RANK
            for i in range(len(joined.workers))
        ]
        await self.digests.start()
        self.log.info("node_joined", run=self.run, workers=joined.workers, reason=joined.reason)
        await asyncio.to_thread(self.starter.wait_ready, cfg.store_timeout_s)
        for name, role in zip(joined.workers, roles, strict=True):
            self.spawn(name, role, generation=0 if role is Role.RANK else None)

    async def _join(self) -> NodeJoined:
        cfg = self.config
        assert self.bus is not None and self._loop is not None
        spec = job_spec(cfg, self.id, self.store_addr)
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

    async def _on_joined(self, msg: NodeJoined, raw: Msg) -> None:
        if msg.launcher == self.id and self._joined is not None and not self._joined.done():
            self._joined.set_result(msg)

    def _heard(self, hb: Heartbeat) -> None:
        self.metrics.heartbeat(hb)
        if self.handout is not None:
            self.handout.heard(hb)

    async def _publish_ack(self, ack: NodeAck) -> None:
        assert self.bus is not None
        await self.bus.publish(NODE_ACK, ack, job=self.job, node=self.node)

    def _part_died(self, why: str) -> None:
        """The store or the fork server died under the job (the fork server's workers with
        it): the node ends, as a lost one (the plan then names a store on another node).
        Called on the loop or on the fork server's reader thread."""
        assert self._loop is not None

        def end() -> None:
            if not self._done.is_set():
                self.removed_reason = why
                self._done.set()

        with contextlib.suppress(RuntimeError):  # the loop is closed: the launcher ended anyway
            self._loop.call_soon_threadsafe(end)

    @property
    def store_addr(self) -> str:
        host = f"[{self.bind}]" if ":" in self.bind else self.bind
        return f"{host}:{self._port}"

    def free_slot(self) -> int:
        """The lowest slot index no live worker of this node holds: a worker's
        ``PHALANX_LOCAL_SLOT``, which picks its GPU (``Job.device``)."""
        taken = {w.slot for w in self.workers.values() if w.proc.poll() is None}
        return next(i for i in range(len(taken) + 1) if i not in taken)

    def spawn(self, name: str, role: Role, requested: bool = False, generation: int | None = None) -> Worker:
        """Start worker ``name``; ``requested``: the planner asked for it (a restart, more
        capacity); ``generation``: restart recovery's (see :class:`Worker`)."""
        slot = self.free_slot()
        job_env = {
            "PHALANX_JOB": self.job,
            "PHALANX_NODE": self.node,
            "PHALANX_STORE_ADDR": self.store_addr,
            "PHALANX_BIND": self.bind,
            "PHALANX_LAUNCH": self.run,
        }
        if self.digests is not None:
            job_env["PHALANX_HEARTBEAT_SOCKET"] = str(self.digests.socket_path)
        if self.handout is not None:
            job_env["PHALANX_PLAN_SOCKET"] = self.handout.path_of(name)
            self.handout.started(name)
        proc = self.starter.start(name, role, slot, job_env, generation)
        w = Worker(name, role, proc, slot, generation=generation)
        self.workers[name] = w
        self.metrics.started(role.value, requested)
        if self.digests is not None:
            self.digests.expect(name, proc.pid)
        threading.Thread(target=self._watch, args=(w,), daemon=True, name=f"watch-{name}").start()
        self.log.info("worker_started", worker=name, role=role.value, pid=proc.pid)
        return w

    async def _on_spawn(self, msg: SpawnWorkers, raw: Msg) -> None:
        """The planner asks for more workers here (capacity offered, spares to refill)."""
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
        if self.digests is not None and self.workers.get(w.name) is w:  # not its successor's heartbeats
            self.digests.forget(w.name)
        if w.restarting:  # ended for a restart by this launcher: no fault
            self.log.info("worker_ended_for_restart", worker=w.name, pid=w.proc.pid, returncode=rc)
            return
        self.metrics.exited(w.name, rc)
        self._read_note(w)
        event = RankExited(
            job=self.job,
            worker=w.name,
            node=self.node,
            pid=w.proc.pid,
            host=socket.gethostname(),
            exit_code=rc if rc >= 0 else None,
            signal=-rc if rc < 0 else None,
            exited_at=w.exited_at,
            generation=w.generation if self.config.recovery is Recovery.RESTART else None,
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
                    retry_for_s=EXIT_REPORT_S,
                )
        self._check_done()

    def _read_note(self, w: Worker) -> None:
        """A worker that could not start the script at all (an import error) left a note:
        restarting it would fail the same way, so this node ends, saying why."""
        error = self.starter.take_note(w.name)
        if error is None or self._done.is_set():
            return
        where = f" (log: {self.config.log_dir / (w.name + '.log')})" if self.config.log_dir else ""
        self.removed_reason = f"the training script could not start on worker {w.name}: {error[:500]}{where}"
        self.log.error("script_failed_to_start", worker=w.name, error=error)
        self._done.set()

    def _check_done(self) -> None:
        if self._done.is_set():
            return
        if self.completed is not None and not self._running_members():
            # Checked on each plan and exit too: plans (a KV watch) and decisions (a stream)
            # are not ordered with each other, so COMPLETE may be read before the plan that
            # took this node's members away, or while they still finish.
            self.log.info("job_completed", reason=self.completed.reason)
            self._done.set()
            return
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
        members = [self.workers[w] for w in self.plan.ranks if w in self.workers]
        if members and all(w.returncode == 0 for w in members):
            self.log.info("job_completed", generation=self.plan.generation)
            self._done.set()

    # -- plans: fencing ------------------------------------------------------------
    def _apply_plan(self, plan: NodePlan, by_message: bool = False) -> None:
        if not self.run or plan.launch != self.run:
            return
        if self.store is not None:
            self.store.allow(plan.store_secret)  # before any rank of this node hears of the plan
        if by_message and self.handout is not None and self.plan is not None:
            self.handout.hand_out(plan, set(self.workers), resend=True)  # acknowledge again
        if not plan.supersedes(self.plan):
            return  # the plan we have, or an older one (from a planner that has been replaced)
        self.plan = plan
        if self.handout is not None:
            self.handout.hand_out(plan, [w for w, x in self.workers.items() if x.proc.poll() is None])
        if self.id in plan.lost_launchers:
            # This node was declared lost (cut off): its workers may still be blocked
            # in a collective of an old generation. Nothing of it may go on.
            self.removed_reason = f"node {self.node} was declared lost (generation {plan.generation})"
            self.log.error("node_removed", generation=plan.generation, reason=plan.reason)
            self._fence([w for w in self.workers if self.workers[w].proc.poll() is None], plan)
            self._done.set()
            return
        self._fence([w for w in plan.removed if w in self.workers], plan)
        if self.config.recovery is Recovery.RESTART:
            self._restart_members(plan)
        leaving = [w for w in plan.leaving if w in self.workers and self.workers[w].proc.poll() is None]
        if leaving and self._loop is not None:
            # They finish their step and exit 0; only one still running at the deadline is fenced.
            left = max(0.0, plan.leave_by - time.time())
            self.log.info(
                "workers_leaving", workers=leaving, generation=plan.generation, deadline_s=round(left, 3)
            )
            self._loop.call_later(left, self._fence_late, leaving, plan)
        self._check_done()

    def _restart_members(self, plan: NodePlan) -> None:
        """Restart recovery: this node's members of ``plan`` run the script for it
        (:func:`~phalanx.launcher.restarts.members_to_restart`)."""
        stale, start = members_to_restart(self.workers, plan)
        if not start or self._loop is None:
            return
        self.log.info("restarting_members", generation=plan.generation, workers=start)

        def spawn() -> None:
            for name in start:
                self.spawn(name, Role.RANK, requested=True, generation=plan.generation)

        current = lambda: self.plan is plan and not self._done.is_set()  # noqa: E731
        task = self._loop.create_task(end_then_start(stale, self.config.restart_grace_s, current, spawn))
        self._restarts.add(task)
        task.add_done_callback(self._restarts.discard)

    def _fence_late(self, names: list[str], plan: NodePlan) -> None:
        late = [w for w in names if self.workers[w].proc.poll() is None]
        if late:
            self.log.error("leave_deadline_passed", workers=late, generation=plan.generation)
            self._fence(late, plan)

    def _fence(self, names: list[str], plan: NodePlan) -> None:
        for name in names:
            w = self.workers[name]
            if w.proc.poll() is None:
                self.log.warning("fencing_worker", worker=name, generation=plan.generation)
                with contextlib.suppress(ProcessLookupError):
                    w.proc.send_signal(signal.SIGKILL)

    async def _on_decision(self, d: PlanDecision, raw: Msg) -> None:
        if d.action is Action.STOP:
            self.log.error("job_stopped_by_planner", reason=d.reason)
            self.decision = d
            self._done.set()
        elif d.action is Action.COMPLETE:
            # A node with spares only: nothing of it is needed any more. A node with
            # members waits for them (rank 0 may still be writing the weights).
            self.completed = d
            self._check_done()

    def _running_members(self) -> list[str]:
        plan = self.plan
        if plan is None:
            return []
        return [w for w in plan.ranks if w in self.workers and self.workers[w].proc.poll() is None]

    # -- end ---------------------------------------------------------------------------
    async def wait(self, timeout_s: float | None = None) -> int:
        """Wait for the job to end on this node: 0 when it completed, 1 when the
        planner stopped it or this node was removed from it (:func:`why`)."""
        await asyncio.wait_for(self._done.wait(), timeout_s)
        return 1 if self.decision is not None or self.removed_reason is not None else 0

    def kill(self, worker: str, sig: int = signal.SIGKILL) -> float:
        """Send ``sig`` to a worker (fault injection by a test or benchmark); returns the time."""
        t = time.time()
        self.workers[worker].proc.send_signal(sig)
        return t

    async def stop(self, grace_s: float = 3.0) -> None:
        self._done.set()
        await end_all([w.proc for w in self.workers.values()], grace_s)
        if self.digests is not None:
            for name in self.workers:  # all ended: the last digest lists none, so no one is missed
                self.digests.forget(name)
            await self.digests.stop()
        if self.follower is not None:
            await self.follower.stop()
        if self.handout is not None:
            self.handout.close()
        for task in list(self._restarts):
            task.cancel()
        await asyncio.to_thread(self.starter.close)
        if self._metrics_server is not None:
            await self._metrics_server.stop()
            self._metrics_server = None
        if self.store is not None:  # after the workers: they may use it to the end
            await self.store.stop()
        if self._listener is not None:
            self._listener.close()  # the store process's now (or it never started one)
        if self.bus is not None:
            await self.bus.close()
        shutil.rmtree(self._tmp, ignore_errors=True)


async def drain(launcher: Launcher, grace_s: float) -> None:
    """Asked to go (SIGTERM: a pod being deleted, a node being drained): give the planner
    ``grace_s`` to take this node's workers out at a step boundary (the scheduler's
    preemption notice leads to a plan in which they leave and exit 0), then end;
    whatever still runs is stopped by :meth:`Launcher.stop`."""
    launcher.log.warning("draining", grace_s=grace_s, workers=launcher._running_members())
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and not launcher._done.is_set():
        if all(w.proc.poll() is not None for w in launcher.workers.values()):
            break
        await asyncio.sleep(0.05)
    launcher._done.set()


def why(launcher: Launcher) -> str | None:
    """Why the job did not complete on this node (None: it did, or it runs)."""
    if launcher.removed_reason is not None:
        return launcher.removed_reason
    d = launcher.decision
    return f"the planner stopped the job: {d.reason}" if d is not None else None


def drain_grace_s() -> float:
    """``PHALANX_LAUNCHER_DRAIN_S``: how long a launcher told to stop (SIGTERM) waits for
    its workers to be taken out of the job gracefully (0, the default: stop at once).
    On Kubernetes set it a little below the pod's ``terminationGracePeriodSeconds``."""
    return load(LauncherSettings).launcher_drain_s


STOP_BOUND_S = 60.0
"""The longest a launcher's process lives once its job has ended (:func:`exit_watchdog`)."""


async def run(config: LaunchConfig, timeout_s: float | None = None) -> tuple[int, str | None]:
    """Run this node's part of the job to its end: (exit code, why it did not complete)."""
    grace = drain_grace_s()
    launcher = Launcher(config)
    loop = asyncio.get_running_loop()
    drains: list[asyncio.Task[None]] = []
    if grace > 0:
        loop.add_signal_handler(
            signal.SIGTERM, lambda: drains.append(loop.create_task(drain(launcher, grace)))
        )
    try:
        await launcher.start()
        return await launcher.wait(timeout_s), why(launcher)
    finally:
        if grace > 0:
            loop.remove_signal_handler(signal.SIGTERM)
        # Everything from here on is bounded, but a stuck child, drain or exporter must not
        # keep a finished node's launcher (and whoever waits for it) alive: a clean-clone run
        # saw one linger for minutes after "job_completed".
        exit_watchdog(
            STOP_BOUND_S, lambda: 0 if launcher._done.is_set() and why(launcher) is None else 1, "launcher"
        )
        await launcher.stop()
