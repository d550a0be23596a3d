"""``phalanx.runtime.init()``: what a training script calls first.

It reads the environment the launcher sets (``PHALANX_JOB``, ``PHALANX_WORKER``,
``PHALANX_ROLE``, ``PHALANX_STORE_ADDR``, ``NATS_URL``), sets up logs and traces,
starts the :class:`~phalanx.runtime.agent.Agent` (registration, heartbeats,
plans) and connects to the job's rendezvous store.

>>> job = phalanx.runtime.init()
>>> job.worker, job.role
('w2', <Role.RANK: 'rank'>)
"""

from __future__ import annotations

import os
import signal
from dataclasses import dataclass

import torch.distributed as dist

from phalanx.runtime.agent import Agent
from phalanx.runtime.comm import connect_store
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
    store: dist.Store
    faults: FaultPlan

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
    store = connect_store(_need("PHALANX_STORE_ADDR"))
    get_logger(component="runtime").info("worker_ready", job=job, worker=worker, role=role.value)
    result = Job(job, worker, role, status, agent, store, faults)
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
