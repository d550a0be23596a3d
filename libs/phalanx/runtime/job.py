"""``phalanx.runtime.init()``: what a training script calls first.

It reads the environment the launcher sets (``PHALANX_JOB``, ``PHALANX_WORKER``,
``PHALANX_ROLE``, ``PHALANX_LAUNCH`` (the job's run id), ``PHALANX_STORE_ADDR``
(this node's launcher's store), ``PHALANX_BIND`` (the address gloo listens on),
``NATS_URL``), sets up logs and traces and starts the
:class:`~phalanx.worker.agent.Agent` (registration, heartbeats, plans).

``PHALANX_LOCAL_SLOT`` (the worker's slot on its node) picks its GPU: see
:attr:`Job.device`. A script that keeps its own loop calls :meth:`Job.ddp`,
:meth:`Job.track` and :meth:`Job.steps` (:mod:`phalanx.runtime.loop`); the
batteries-included path is :class:`~phalanx.runtime.trainer.Trainer`.

The job's :class:`~phalanx.runtime.comm.Communicator` (:attr:`Job.comm`) lives
as long as the process: each generation's plan re-points it
(:meth:`~phalanx.runtime.comm.Communicator.configure`). The plan names the
store its members meet on (it moves to a surviving node when the node hosting it
is lost); the communicator connects to it on first use and keeps the connection
for later generations.

>>> job = phalanx.runtime.init()
>>> job.worker, job.role
('w2', <Role.RANK: 'rank'>)
"""

from __future__ import annotations

import atexit
import contextlib
import os
import signal
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from phalanx.contract import NodePlan, Role
from phalanx.runtime.comm import Communicator
from phalanx.runtime.faults import FaultPlan
from phalanx.settings import RankSettings, load_or_exit
from phalanx.telemetry import get_logger, setup_logging, setup_tracing, shutdown_tracing
from phalanx.worker.agent import Agent
from phalanx.worker.status import RankStatus

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.nn.parallel import DistributedDataParallel
    from torch.utils.data import DataLoader

    from phalanx.runtime.loop import UserLoop


class LaunchEnvError(RuntimeError):
    """The process was not started by a Phalanx launcher (or the env is malformed)."""


@dataclass
class Job:
    job: str
    worker: str
    role: Role
    status: RankStatus
    agent: Agent
    comm: Communicator
    faults: FaultPlan
    local_slot: int = 0
    _loop: UserLoop | None = field(default=None, repr=False)

    @property
    def rank(self) -> int:
        """This worker's rank in the current generation (-1 while it has none); it
        can change when the group shrinks."""
        return self.status.rank

    @property
    def device(self) -> torch.device:
        """This worker's device: ``cuda:<local slot mod GPUs>`` when CUDA is present
        (made the current device), else the CPU. The communicator's backend follows
        from it (:func:`phalanx.runtime.comm.backend_for`: NCCL or gloo)."""
        if not torch.cuda.is_available():
            return torch.device("cpu")
        device = torch.device("cuda", self.local_slot % torch.cuda.device_count())
        torch.cuda.set_device(device)
        return device

    # -- the user's own loop (phalanx.runtime.loop) ------------------------------------
    @property
    def loop(self) -> UserLoop:
        if self._loop is None:
            from phalanx.runtime.loop import UserLoop

            self._loop = UserLoop(self)
        return self._loop

    def ddp(self, module: torch.nn.Module, **kwargs: Any) -> DistributedDataParallel:
        """``DistributedDataParallel(module, **kwargs)`` over Phalanx's generations."""
        return self.loop.ddp(module, **kwargs)

    def mesh(self, shape: tuple[int, ...], names: tuple[str, ...]) -> DeviceMesh:
        """What ``init_device_mesh(device_type, shape, mesh_dim_names=names)`` gives a
        torchrun script, for FSDP2 and HSDP (``(replicate, shard)``): a ``DeviceMesh``
        whose process groups follow the generations (:mod:`phalanx.runtime.mesh`).
        Blocks until a plan gives this worker a rank."""
        return self.loop.mesh(shape, names, self.device)

    def track(self, **objects: Any) -> None:
        """Name what moves to a joiner: objects with ``state_dict``/``load_state_dict``."""
        self.loop.track(**objects)

    def checkpoint(self, every: int | None = None) -> None:
        """Save the loop's state every ``every`` committed steps to the tiered store (the
        node's keeper, ``state-replication``, must run): where the job resumes from when
        no member holds some of it. Call it before :meth:`steps`. ``every`` None: memory's
        ``every`` in the node's ``PHALANX_CKPT_TIERS``; an interval that would not give each
        durable tier of that policy the steps it asks for is refused (ValueError).

        A ``job.ddp()`` job: one member (a different one each time) snapshots what moves
        to a joiner -- the tracked objects (model, optimizer, scheduler, sampler: the data
        position), the RNG state, DDP's bucket layout, the LR scale -- and a relaunch of
        the same script after the whole job was lost resumes from the newest complete
        checkpoint with its state bit for bit (:mod:`phalanx.runtime.snapshots`; every
        rank gets the saver's RNG state, as a joiner does). A save the keeper cannot take
        now is skipped, never waited for. A ``job.mesh()`` job: every rank saves its
        shards, loaded when every replica of a shard is lost (:mod:`phalanx.runtime.tiered`)."""
        self.loop.checkpoint(every)

    def pause(self, max_s: float) -> contextlib.AbstractContextManager[None]:
        """A part of a step where ranks may drift up to ``max_s`` seconds apart (rank
        0's evaluation or save), entered by every rank (:mod:`phalanx.runtime.pause`)."""
        return self.loop.pauses.pause(max_s)

    def on_resize(self, hook: Callable[[int, int, NodePlan], None]) -> None:
        """``hook(old_world, new_world, plan)`` after a resize (see :meth:`UserLoop.on_resize`)."""
        self.loop.on_resize(hook)

    def steps(
        self, loader: DataLoader[Any], total: int, *, accumulate: bool = False
    ) -> Iterator[tuple[int, Any]]:
        """``(step, batch)`` until ``total`` steps are done, failed steps redone; with
        ``accumulate=True`` the batch is the step's micro-batches
        (:class:`~phalanx.runtime.loop.MicroBatches`)."""
        return self.loop.steps(loader, total, accumulate=accumulate)

    @property
    def step_ok(self) -> bool:
        """Whether the step in flight will commit (see :attr:`UserLoop.step_ok`): read
        it after ``backward()`` to log a step's figures once."""
        return self.loop.step_ok

    @property
    def lr_scale(self) -> float:
        """The factor the job's LR rule applied to the tracked learning rates (1.0 while
        the global batch is held)."""
        return self.loop.lr_scale

    @property
    def effective_batch(self) -> int:
        """The samples a step trains over all ranks in the current generation."""
        return self.loop.effective_batch

    def report_loss(self, loss: float | torch.Tensor) -> None:
        """The loss of the step in flight of :meth:`steps`, kept with the step's record."""
        self.loop.report_loss(loss)

    def close(self, *, goodbye: bool = True) -> None:
        """Leave the job: say goodbye (the detector takes the exit that follows for no
        fault), flush traces, disconnect. Idempotent."""
        self.agent.close(goodbye=goodbye)
        shutdown_tracing()


def _need(value: str | None, name: str) -> str:
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
    settings = load_or_exit(RankSettings, "phalanx worker")  # a bad PHALANX_* value: exit 2, one line
    job, worker = _need(settings.job, "PHALANX_JOB"), _need(settings.worker, "PHALANX_WORKER")
    role = Role(_need(settings.role, "PHALANX_ROLE"))
    faults = FaultPlan.from_env()
    _warm_imports()
    setup_logging(f"rank-{worker}")
    setup_tracing("phalanx-rank")
    status = RankStatus(job=job, worker=worker)
    agent = Agent(status, role, launch=settings.launch).start()
    comm = Communicator(
        worker,
        _need(settings.store_addr, "PHALANX_STORE_ADDR"),
        bind=settings.bind,
        backstop_s=settings.collective_timeout_s,
    )
    result = Job(job, worker, role, status, agent, comm, faults, local_slot=settings.local_slot)
    comm.store_at()  # this node's store answers: the launcher is up
    # Spans flushed and NATS left also without job.close(), but no goodbye: a process
    # ending on an uncaught exception or sys.exit(1) is a fault, not a finished worker.
    atexit.register(result.close, goodbye=False)
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
