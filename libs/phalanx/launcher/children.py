"""The processes a launcher starts for its job: the workers (ranks and hot spares), each
with its environment, and -- through :mod:`phalanx.launcher.store` -- the job's store.
Every one dies with the launcher (``PR_SET_PDEATHSIG``): no orphan trains outside the plan."""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import os
import signal
import subprocess
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Protocol

from phalanx.bus.credentials import ENV_WORKER_CREDENTIALS, worker_credentials
from phalanx.contract import Role
from phalanx.launcher.config import LaunchConfig
from phalanx.settings.keeper import SERVICE_SECRET_ENV

_PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """In the child before exec: SIGKILL when the launcher dies (Linux)."""
    with contextlib.suppress(Exception):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


class Proc(Protocol):
    """What the launcher needs of a worker process: ``subprocess.Popen``, or a
    :class:`~phalanx.launcher.forkserver.ForkedProc` forked by the node's fork server."""

    pid: int
    returncode: int | None

    def poll(self) -> int | None: ...
    def wait(self, timeout: float | None = None) -> int: ...
    def send_signal(self, sig: int) -> None: ...
    def terminate(self) -> None: ...
    def kill(self) -> None: ...


@dataclass
class Worker:
    name: str
    role: Role
    proc: Proc
    slot: int = 0
    exited_at: float | None = None
    returncode: int | None = None
    generation: int | None = None
    """Restart recovery: the generation it runs the script for (0: the first plan that
    names it; None: a spare, which never runs it)."""
    restarting: bool = False
    """Ended by the launcher for a restart: its exit is no fault."""


def worker_names(node: str, count: int, qualified: bool) -> list[str]:
    """``w0..`` in a one-node job; ``<node>-w0..`` when the job may span nodes.

    >>> worker_names("node-a", 2, True), worker_names("local", 2, False)
    (['node-a-w0', 'node-a-w1'], ['w0', 'w1'])
    """
    return [f"{node}-w{i}" if qualified else f"w{i}" for i in range(count)]


def worker_env(
    cfg: LaunchConfig, name: str, role: Role, slot: int, job_env: dict[str, str], log: Any
) -> dict[str, str]:
    """The environment of worker ``name``: the launcher's, the job's ``cfg.env``, then
    ``job_env`` (what the launcher knows of the job: store, bind, run, heartbeat socket),
    and a NATS login of its own -- never the launcher's, and never a service's secret
    (:data:`~phalanx.settings.keeper.SERVICE_SECRET_ENV`), wherever it came from."""
    env = {
        **os.environ,
        **cfg.env,
        **job_env,
        "PHALANX_WORKER": name,
        "PHALANX_ROLE": role.value,
        "PHALANX_LOCAL_SLOT": str(slot),
        "LOCAL_RANK": str(slot),  # as torchrun sets it: scripts pick their GPU by it
        "PYTHONUNBUFFERED": "1",
    }
    if cfg.nproc + cfg.spares > 1 and not env.get("OMP_NUM_THREADS"):
        # As torchrun does: several workers on one node each running a full-width
        # OpenMP pool oversubscribe its cores (measured: +9 % step time on 2 cores).
        env["OMP_NUM_THREADS"] = "1"
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
        log.error("no_nats_login_for_worker", worker=name)
    env.update(own)
    for secret in SERVICE_SECRET_ENV:
        env.pop(secret, None)
    if cfg.nats_url:
        env["NATS_URL"] = cfg.nats_url
    return env


def start_worker(
    cmd: list[str], cfg: LaunchConfig, name: str, env: dict[str, str]
) -> subprocess.Popen[bytes]:
    """Run ``cmd`` (the job's, cold) as worker ``name``, its output to ``<log_dir>/<name>.log``
    when the job has a log directory (else the launcher's own)."""
    out: int | None = None
    if cfg.log_dir is not None:
        cfg.log_dir.mkdir(parents=True, exist_ok=True)
        out = os.open(cfg.log_dir / f"{name}.log", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        return subprocess.Popen(
            cmd,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT if out else None,
            preexec_fn=die_with_parent,  # spawned from the loop's (main) thread
        )
    finally:
        if out is not None:
            os.close(out)


async def end_all(procs: Iterable[Proc], grace_s: float) -> None:
    """SIGTERM every live one (SIGCONT first: a stopped process cannot act on it), SIGKILL
    those still running after ``grace_s``, and return once all have ended."""
    live = [p for p in procs if p.poll() is None]
    for p in live:
        with contextlib.suppress(ProcessLookupError):
            p.send_signal(signal.SIGCONT)
            p.terminate()
    deadline = time.monotonic() + grace_s
    while any(p.poll() is None for p in live):
        if time.monotonic() > deadline:
            for p in live:
                p.kill()
            deadline = float("inf")
        await asyncio.sleep(0.005)
