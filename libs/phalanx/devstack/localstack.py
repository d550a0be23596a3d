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

Several nodes: ``LocalStack(workdir, cluster=NetnsCluster([...]))`` runs
nats-server and the services inside the cluster's ``control`` namespace, and
:meth:`LocalStack.run_nodes` starts one ``phalanx run`` per node namespace (the
public CLI, as an operator would) and can act on the job at chosen steps -- kill
a whole node, cut it off -- while it watches the job's events::

    with NetnsCluster(["ctl", "a", "b"]) as cl, LocalStack(work, cluster=cl) as stack:
        result = stack.run_nodes("j1", cmd, nodes={"a": (2, 1), "b": (2, 1)},  # (ranks, spares)
                                 steps_log=log, actions=[(5, lambda r: cl.kill_node("b"))])
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

from phalanx.bus import Bus
from phalanx.contract import Elastic, PlanDecision
from phalanx.contract.permissions import ROLE_OF_SERVICE
from phalanx.devstack.jobwatch import JobResult, last_logged_step, observe, wait_ended
from phalanx.devstack.natsserver import NatsServer
from phalanx.devstack.netns import NetnsCluster
from phalanx.devstack.stackusers import StackUsers
from phalanx.launcher.launcher import LaunchConfig, Launcher
from phalanx.lifecycle import exit_on_sigterm
from phalanx.natsauth import NatsAuth
from phalanx.service import ping
from phalanx.services import SERVICE_MODULES

__all__ = ["LocalStack"]


class LocalStack:
    def __init__(
        self,
        workdir: str | os.PathLike[str],
        *,
        services: tuple[str, ...] = tuple(SERVICE_MODULES),
        env: dict[str, str] | None = None,
        auth: bool = False,
        cluster: NetnsCluster | None = None,
        control: str = "ctl",
        nats_host: str = "127.0.0.1",
        nats_port: int | None = None,
        service_env: Mapping[str, Mapping[str, str]] | None = None,
        publish_logins: bool = False,
    ) -> None:
        self.cluster = cluster
        self.nats_host = nats_host
        self.nats_port = nats_port  # None: a free one
        self.service_env = service_env or {}  # added to each service's environment, by name
        self.control = control
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.services = services
        self.env = {**os.environ, **(env or {})}
        self.env.setdefault("PHALANX_SPAN_FILE", str(self.workdir / "spans.jsonl"))
        self.server: NatsServer | None = None
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self._spawned: dict[str, tuple[list[str], dict[str, str]]] = {}
        self.with_auth = auth
        self.auth: NatsAuth | None = None  # the users, once start() made them
        self.users = StackUsers()  # each process's login (none with auth off)
        self.publish_logins = publish_logins  # auth on: leave the logins for this user
        # The keepers' cluster key (phalanx.checkpoint.peerauth): one per stack, given to
        # state-replication processes only (unless the environment brings its own).
        self.keeper_env = (
            {}
            if self.env.get("PHALANX_KEEPER_KEY") or self.env.get("PHALANX_KEEPER_KEY_FILE")
            else {"PHALANX_KEEPER_KEY": secrets.token_urlsafe(32)}
        )

    @property
    def url(self) -> str:
        return self.env["NATS_URL"]

    @property
    def span_file(self) -> Path:
        return Path(self.env["PHALANX_SPAN_FILE"])

    def start(self) -> LocalStack:
        exit_on_sigterm()  # a SIGTERM of this process runs stop() (in `with` or finally)
        if self.with_auth and os.environ.get("NATS_URL"):
            raise ValueError("LocalStack(auth=True) configures its own nats-server: unset NATS_URL")
        if not os.environ.get("NATS_URL"):
            conf = None
            if self.with_auth:
                self.auth = NatsAuth.generate()
                self.users = StackUsers(self.auth)
                conf = self.auth.write_config(self.workdir / "nats.conf", listen=None)
            host = self.cluster.ip(self.control) if self.cluster is not None else self.nats_host
            self.server = NatsServer(
                port=self.nats_port,
                store_dir=self.workdir / "nats",
                config_file=conf,
                host=host,
                argv_prefix=self._argv([]),
            ).start()
            self.env["NATS_URL"] = self.server.url
            if self.publish_logins:
                self.users.publish(self.server.url)
        shm = str(self.shm_root)  # ranks and keepers share it
        for name in self.services:
            # The control node's keeper: the one of a single-node stack's node, "local"
            # (the launcher's default node name).
            keeper = {"PHALANX_NODE": self.control if self.cluster else "local", "PHALANX_SHM_ROOT": shm}
            self.start_service(name, env=keeper if name == "state-replication" else None)
        asyncio.run(self._wait_healthy())
        return self

    def start_service(self, name: str, *, node: str | None = None, env: dict[str, str] | None = None) -> str:
        """Start one process of service ``name`` (on cluster ``node``, default the control
        node, with ``env`` added); returns its key in :attr:`procs` (``name``, then
        ``name#2``.. for replicas, each with its own log)."""
        n = 1 + sum(1 for k in self.procs if k.split("#")[0] == name)
        key = name if n == 1 else f"{name}#{n}"
        log = open(self.workdir / f"{key.replace('#', '-')}.log", "ab")
        full = {
            **self.env,
            **self.users.env(ROLE_OF_SERVICE[name]),
            **(self.keeper_env if name == "state-replication" else {}),
            **self.service_env.get(name, {}),
            **(env or {}),
        }
        argv = self._argv([sys.executable, "-m", SERVICE_MODULES[name]], node)
        self._spawned[key] = (argv, full)
        self.procs[key] = subprocess.Popen(argv, env=full, stdout=log, stderr=log)
        log.close()
        return key

    def respawn(self, key: str) -> None:
        """Start service process ``key`` again as it was first started (it exited)."""
        argv, env = self._spawned[key]
        with open(self.workdir / f"{key.replace('#', '-')}.log", "ab") as log:
            self.procs[key] = subprocess.Popen(argv, env=env, stdout=log, stderr=log)

    def start_keeper(self, node: str, env: dict[str, str] | None = None, timeout_s: float = 30.0) -> str:
        """Start ``node``'s checkpoint keeper (a state-replication process there, reachable
        by peers on the node's address) and wait for its socket; returns its key.

        ``env`` adds the tiers (``PHALANX_CKPT_DISK``...); ``PHALANX_SHM_ROOT`` defaults
        to the stack's ``shm`` directory under /dev/shm."""
        full = {
            "PHALANX_NODE": node,
            "PHALANX_KEEPER_HOST": self.cluster.ip(node) if self.cluster is not None else "127.0.0.1",
            "PHALANX_SHM_ROOT": str(self.shm_root),
            **(env or {}),
        }
        key = self.start_service(
            "state-replication", node=node if self.cluster is not None else None, env=full
        )
        sock = Path(full["PHALANX_SHM_ROOT"]) / node / "keeper.sock"
        with contextlib.suppress(FileNotFoundError):
            sock.unlink()  # a dead keeper's: wait for the new one's
        deadline = time.monotonic() + timeout_s
        while not sock.exists():
            if self.procs[key].poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(
                    f"keeper of {node} did not start: see {self.workdir}/{key.replace('#', '-')}.log"
                )
            time.sleep(0.05)
        return key

    @property
    def shm_root(self) -> Path:
        """The shared memory of this stack's ranks and keepers (``PHALANX_SHM_ROOT``)."""
        if "PHALANX_SHM_ROOT" not in self.env:
            self.env["PHALANX_SHM_ROOT"] = f"/dev/shm/phalanx-{self.workdir.name}-{os.getpid()}"
        return Path(self.env["PHALANX_SHM_ROOT"])

    def _argv(self, argv: list[str], node: str | None = None) -> list[str]:
        """``argv`` run on ``node`` (default: the control node) when there is a cluster."""
        return self.cluster.argv(node or self.control, argv) if self.cluster is not None else argv

    async def _wait_healthy(self, timeout_s: float = 60.0) -> None:
        with self.users.credentials("admin"):
            bus = await Bus.connect(self.url, name="localstack")
        try:
            deadline = time.monotonic() + timeout_s
            for key, proc in self.procs.items():
                name = key.split("#")[0]
                while True:
                    if proc.poll() is not None:
                        raise RuntimeError(f"service {key} exited: see the logs in {self.workdir}")
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
        self.users.withdraw()
        if self.env.get("PHALANX_SHM_ROOT", "").startswith(f"/dev/shm/phalanx-{self.workdir.name}-"):
            shutil.rmtree(self.env["PHALANX_SHM_ROOT"], ignore_errors=True)  # one this stack made

    def __enter__(self) -> LocalStack:
        return self.start()

    def __exit__(
        self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    # -- jobs ---------------------------------------------------------------------
    async def _observer(self, job: str) -> Bus:
        with self.users.credentials("observer"):  # an observer may not create streams: auth on, no ensure
            return await Bus.connect(
                self.url, name=f"observer-{job}", ensure=self.auth is None, report_errors=False
            )

    def wait_ended(self, job: str, timeout_s: float = 60.0) -> PlanDecision:
        """Block until the planner has ended ``job`` (its last decision is ``stop`` or
        ``complete``): a job relaunched before that would join the run being ended."""
        return asyncio.run(self._wait_ended(job, timeout_s))

    async def _wait_ended(self, job: str, timeout_s: float) -> PlanDecision:
        bus = await self._observer(job)
        try:
            return await wait_ended(bus, job, timeout_s)
        finally:
            await bus.close()

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
        elastic: Elastic | None = None,
    ) -> JobResult:
        result = JobResult(job, -1, 0.0)
        bus = await self._observer(job)

        await observe(bus, job, result)
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
                    **self.users.env("rank"),
                    **(env or {}),
                },
                log_dir=self.workdir / "logs" / job,
                elastic=elastic or Elastic(),
            )
        )
        t0 = time.time()
        try:
            with self.users.credentials("launcher"):  # its own connection; its ranks get cfg.env's
                await launcher.start()
            result.returncode = await launcher.wait(timeout_s)
        finally:
            result.wall_s = time.time() - t0
            await launcher.stop()
            await asyncio.sleep(0.3)  # let the last events arrive
            await bus.close()
        return result

    # -- several nodes --------------------------------------------------------------
    def _stuck_report(self, job: str, nodes: list[str], result: JobResult, lines: int = 25) -> str:
        """What a job that did not end was doing: its decisions, then the tail of each
        node's launcher log (a failure in CI explains itself)."""
        out = [f"gen {d.generation} {d.action.value}: {d.reason}" for d in result.decisions]
        for node in nodes:
            path = self.workdir / f"launcher-{job}-{node}.log"
            tail = path.read_text(errors="replace").splitlines()[-lines:] if path.exists() else []
            out += [f"--- {path.name} (last {len(tail)} lines)", *tail]
        return "\n".join(out)

    def node_argv(
        self,
        node: str,
        job: str,
        cmd: Sequence[str],
        *,
        nproc_per_node: int,
        spares_per_node: int = 0,
        nnodes: str = "1",
        global_batch: int = 16,
        min_nproc: int | None = None,
        extra: Sequence[str] = (),
    ) -> list[str]:
        """The ``phalanx run`` command line of one node (run inside its namespace);
        ``extra``: more ``phalanx run`` options (``--max-nproc 4 --cooldown 1s``)."""
        endpoint = self.url.split("://", 1)[-1]
        argv = [sys.executable, "-m", "phalanx.cli", "run", "--job", job, "--nnodes", nnodes]
        argv += ["--node-id", node, "--nproc-per-node", str(nproc_per_node)]
        argv += ["--spares-per-node", str(spares_per_node), "--rdzv-endpoint", endpoint]
        argv += ["--global-batch", str(global_batch), "--log-dir", str(self.workdir / "logs" / job / node)]
        if min_nproc is not None:
            argv += ["--min-nproc", str(min_nproc)]
        return self._argv([*argv, *extra, "--", *cmd], node)

    def node_env(self, faults: str = "", env: dict[str, str] | None = None) -> dict[str, str]:
        """A launcher's environment: the stack's settings, its credentials, its ranks'."""
        return {**self.env, **self.users.run_env(), "PHALANX_FAULTS": faults, **(env or {})}

    def run_nodes(self, job: str, cmd: Sequence[str], **kwargs: Any) -> JobResult:
        """Run a job across nodes to its end; the arguments are :meth:`run_nodes_async`'s."""
        return asyncio.run(self.run_nodes_async(job, cmd, **kwargs))

    async def run_nodes_async(
        self,
        job: str,
        cmd: Sequence[str],
        *,
        nodes: Mapping[str, tuple[int, int]],
        nnodes: str | None = None,
        global_batch: int = 16,
        min_nproc: int | None = None,
        faults: str = "",
        env: dict[str, str] | None = None,
        steps_log: Path | None = None,
        actions: Sequence[tuple[int | Callable[[JobResult], bool], Callable[[JobResult], object]]] = (),
        launcher_args: Sequence[str] = (),
        timeout_s: float = 300.0,
    ) -> JobResult:
        """One ``phalanx run`` per node, ``nodes[node] = (ranks, spares)``, started in
        that order; ``actions`` run in order, each once rank 0's ``steps_log`` shows its
        step done (a node killed after step 5: ``(5, lambda result: cl.kill_node("b"))``)
        or once its predicate on the result so far holds (``lambda r: r.world_size == 3``).

        ``result.returncode`` is 0 when every launcher that was not killed by an
        action exited 0; each launcher's own code is in ``node_returncodes``.
        """
        result = JobResult(job, -1, 0.0)
        bus = await self._observer(job)
        await observe(bus, job, result)
        spec = nnodes or str(len(nodes))
        procs: dict[str, subprocess.Popen[bytes]] = {}
        todo = list(actions)
        t0 = time.time()
        try:
            for node, (nproc, spares) in nodes.items():
                log = open(self.workdir / f"launcher-{job}-{node}.log", "ab")
                argv = self.node_argv(
                    node,
                    job,
                    cmd,
                    nproc_per_node=nproc,
                    spares_per_node=spares,
                    nnodes=spec,
                    global_batch=global_batch,
                    min_nproc=min_nproc,
                    extra=launcher_args,
                )
                procs[node] = subprocess.Popen(
                    argv, env=self.node_env(faults, env), stdout=log, stderr=subprocess.STDOUT
                )
                log.close()
            deadline = time.monotonic() + timeout_s
            killed: set[str] = set()
            while any(p.poll() is None for p in procs.values()):
                if time.monotonic() > deadline:
                    running = [n for n, p in procs.items() if p.poll() is None]
                    raise TimeoutError(
                        f"job {job} did not end within {timeout_s:g}s; launchers still running: "
                        f"{running}\n{self._stuck_report(job, list(procs), result)}"
                    )
                done = last_logged_step(steps_log) if steps_log is not None and todo else -1
                while todo and (todo[0][0](result) if callable(todo[0][0]) else done >= todo[0][0]):
                    result.actions_at.append(time.time())
                    todo.pop(0)[1](result)
                killed |= {n for n, p in procs.items() if p.poll() is not None and p.returncode < 0}
                await asyncio.sleep(0.01)
            result.node_returncodes = {n: int(p.returncode) for n, p in procs.items()}
            survivors = [rc for n, rc in result.node_returncodes.items() if n not in killed]
            result.returncode = 0 if survivors and all(rc == 0 for rc in survivors) else 1
        finally:
            result.wall_s = time.time() - t0
            for p in procs.values():
                if p.poll() is None:
                    p.terminate()
            for p in procs.values():
                with contextlib.suppress(subprocess.TimeoutExpired):
                    p.wait(10)
                if p.poll() is None:
                    p.kill()
            await asyncio.sleep(0.3)  # let the last events arrive
            await bus.close()
        return result
