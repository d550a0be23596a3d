"""``phalanx.runtime.init()``: what a training script calls first.

It reads the environment the launcher sets (``PHALANX_JOB``, ``PHALANX_WORKER``,
``PHALANX_ROLE``, ``PHALANX_LAUNCH`` (the job's run id), ``PHALANX_STORE_ADDR``
(this node's launcher's store), ``PHALANX_BIND`` (the address gloo listens on),
``NATS_URL``), sets up logs and traces and starts the
:class:`~phalanx.runtime.agent.Agent` (registration, heartbeats, plans).

Each generation's plan names the store its members meet on (it moves to a
surviving node when the node hosting it is lost); :meth:`Job.store_at` connects
to it on first use and keeps the connection for later generations.

>>> job = phalanx.runtime.init()
>>> job.worker, job.role
('w2', <Role.RANK: 'rank'>)
"""

from __future__ import annotations

import os
import signal
from dataclasses import dataclass, field

import torch.distributed as dist

from phalanx.runtime.agent import Agent
from phalanx.runtime.comm import CommError, connect_store
from phalanx.runtime.faults import FaultPlan
from phalanx.runtime.status import RankStatus
from phalanx.schemas import Role
from phalanx.telemetry import get_logger, setup_logging, setup_tracing, shutdown_tracing


class LaunchEnvError(RuntimeError):
    """The process was not started by a Phalanx launcher (or the env is malformed)."""


@dataclass
class Job:
    job: str
    worker: str
    role: Role
    status: RankStatus
    agent: Agent
    store_addr: str
    faults: FaultPlan
    bind: str | None = None
    store_connect_s: float = 5.0
    _stores: dict[str, dist.Store] = field(default_factory=dict, repr=False)

    def store_at(self, addr: str = "") -> dist.Store:
        """The store at ``addr`` (``""``: this node's launcher's), connected once.

        Raises :class:`CommError` when it cannot be reached within
        ``store_connect_s``: the plan that named it is then abandoned for a newer one.
        """
        addr = addr or self.store_addr
        store = self._stores.get(addr)
        if store is None:
            try:
                store = self._stores[addr] = connect_store(addr, self.store_connect_s)
            except Exception as exc:  # a malformed address, DistNetworkError, a timeout
                raise CommError(f"store {addr} unreachable: {exc}") from exc
        return store

    def close(self) -> None:
        self.agent.close()
        shutdown_tracing()


def _need(name: str) -> str:
    value = os.environ.get(name)
    if not value:
        raise LaunchEnvError(
            f"{name} is not set: start this script with `phalanx run ... -- python script.py`"
        )
    return value


def _warm_imports() -> None:
    """Import what the first optimizer and process group would import later.

    Constructing the first ``torch.optim`` optimizer imports ``torch._dynamo``
    (about 1 s here), holding the GIL in long stretches: started after the agent,
    it silences heartbeats for hundreds of ms. A hot spare pays it now, once.
    """
    import torch._dynamo  # noqa: F401


def init() -> Job:
    job, worker = _need("PHALANX_JOB"), _need("PHALANX_WORKER")
    try:
        role = Role(_need("PHALANX_ROLE"))
    except ValueError as exc:
        raise LaunchEnvError(f"PHALANX_ROLE must be one of {[r.value for r in Role]}") from exc
    faults = FaultPlan.from_env()
    _warm_imports()
    setup_logging(f"rank-{worker}")
    setup_tracing("phalanx-rank")
    status = RankStatus(job=job, worker=worker)
    agent = Agent(status, role, launch=os.environ.get("PHALANX_LAUNCH", "")).start()
    result = Job(
        job,
        worker,
        role,
        status,
        agent,
        _need("PHALANX_STORE_ADDR"),
        faults,
        bind=os.environ.get("PHALANX_BIND") or None,
    )
    result.store_at()  # this node's store answers: the launcher is up
    get_logger(component="runtime").info("worker_ready", job=job, worker=worker, role=role.value)
    _leave_quietly_on_sigterm(result)
    return result


def _leave_quietly_on_sigterm(job: Job) -> None:
    """SIGTERM to a worker that is no member (a spare the launcher releases at the
    end of a job): say goodbye and exit 0, so that no fault is reported. A member
    dies of it as usual, which the launcher reports and the planner handles."""

    def handler(signum: int, frame: object) -> None:
        if job.status.rank < 0:
            job.close()
            os._exit(0)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTERM)

    signal.signal(signal.SIGTERM, handler)
