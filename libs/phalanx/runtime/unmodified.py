"""An unmodified torchrun script as a Phalanx worker: torchrun's environment, restarts.

A script that never imports Phalanx runs under ``phalanx run`` as it runs under
torchrun. This module is what runs in its process before the script does (started
warm by the node's fork server, :mod:`phalanx.runtime.zygote`, or cold as
``python -m phalanx.runtime.unmodified [FLAGS] script.py ARGS``):

- it links the worker to the control plane (:class:`~phalanx.worker.agent.Agent`:
  registration, heartbeats to the launcher, the node's plans), so detection,
  ``phalanx status``, metrics and traces see it like any worker. Each optimizer step
  it completes is counted (``register_optimizer_step_post_hook``, no change to the
  script), and a gloo default group is observed
  (:mod:`phalanx.runtime.scriptgroup`): the rank reports ``COLLECTIVE`` inside its
  collectives, ``RUNNING`` while it moves outside them and ``COMPUTE`` once it
  stands still, so a rank that spins or blocks while its peers wait is judged as in
  the own-loop rungs;
- it waits for the generation that makes it a member, then sets torchrun's
  environment for it (:func:`torchrun_env`): ``RANK``, ``WORLD_SIZE``,
  ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``GROUP_RANK``, ``ROLE_*``, ``MASTER_ADDR``,
  ``MASTER_PORT``, ``TORCHELASTIC_*``;
- ``MASTER_ADDR:MASTER_PORT`` is a store made for this generation alone
  (:func:`master_store`): rank 0 hosts it in its process and posts its address in
  the job's store under the generation's secret; the other members read it
  there. It is Phalanx's store (:mod:`phalanx.runtime.storeserver`), which serves
  only clients that prove the generation's secret, so ``init_process_group``'s
  ``env://`` rendezvous is Phalanx's in this process (:func:`member_rendezvous`):
  every rank a proved client of it, and no key of an earlier generation (a gloo
  peer address of a dead process) is ever read. A script that builds its own
  ``TCPStore`` on ``MASTER_PORT``, or names ``tcp://`` itself, does not reach it;
- then it runs the script as ``__main__`` (:func:`phalanx.worker.pycommand.run_target`).

On a change of members the launcher ends every member (SIGTERM, SIGKILL after a
grace) and starts the new generation's, which resume from the script's own
checkpoint, as torchrun's elastic agent does. A hot spare is such a process that
has imported torch and registered, and never runs the script: the launcher starts
the member in its place from the fork server. A script that cannot start (an import
or syntax error, a missing file) leaves a note (``PHALANX_EXIT_NOTE``) from which
its launcher ends the job with the error instead of restarting it in a loop.
"""

from __future__ import annotations

import importlib
import json
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl, urlparse

import torch
import torch.distributed as dist
from torch.optim.optimizer import register_optimizer_step_post_hook

from phalanx.contract import NodePlan, Phase, Role
from phalanx.runtime.comm import connect_store, generation_store
from phalanx.runtime.faults import FaultPlan
from phalanx.runtime.scriptgroup import observe_default_group
from phalanx.runtime.store import host_store
from phalanx.runtime.storeclient import StoreClient
from phalanx.runtime.storeserver import ThreadedStore
from phalanx.settings import RankSettings, load_or_exit
from phalanx.telemetry import get_logger, setup_logging
from phalanx.worker.addr import interface_of, split_addr
from phalanx.worker.agent import Agent
from phalanx.worker.pycommand import Outcome, Target, parse, run_target
from phalanx.worker.status import RankStatus

EXIT_NOTE_ENV = "PHALANX_EXIT_NOTE"
GENERATION_ENV = "PHALANX_GENERATION"
MAX_RESTARTS_ENV = "PHALANX_MAX_RESTARTS"
MASTER_KEY = "torchrun/master"
HEARTBEAT_S = 1.0
"""An unmodified script's worker heartbeats every second, not every 100 ms: code that
was never written for a heartbeat thread beside it (lazy imports, tokenizers, long
Python loops) may hold the GIL for hundreds of milliseconds, which must not read as a
hang. A crash is still reported at once (its launcher sees the exit); a stopped
process is declared hung after a few seconds of silence."""

_hosted: list[ThreadedStore] = []  # rank 0's generation store: it lives as long as the process


def torchrun_env(
    plan: NodePlan, worker: str, master: str, *, run_id: str, max_restarts: int
) -> dict[str, str]:
    """torchrun's environment for ``worker`` in ``plan`` (which makes it a member).

    ``LOCAL_RANK`` is the worker's place among its node's members by rank (the GPU a
    torchrun script picks); ``GROUP_RANK``/``GROUP_WORLD_SIZE`` count nodes of
    ``LOCAL_WORLD_SIZE`` ranks as torchrun's homogeneous nodes do (after a shrink that
    leaves nodes uneven they are the nearest such numbering);
    ``TORCHELASTIC_RESTART_COUNT`` is the number of generations before this one.

    >>> plan = NodePlan(job="j", generation=3, world_size=4, store_prefix="j/gen3",
    ...                 ranks={"n1-w0": 2, "n1-w1": 3})
    >>> env = torchrun_env(plan, "n1-w1", "10.0.0.2:4321", run_id="j", max_restarts=-1)
    >>> env["RANK"], env["LOCAL_RANK"], env["GROUP_RANK"], env["MASTER_PORT"], env["TORCHELASTIC_RESTART_COUNT"]
    ('3', '1', '1', '4321', '2')
    """
    rank = plan.rank_of(worker)
    if rank is None:
        raise ValueError(f"{worker} is no member of generation {plan.generation}")
    local = sorted(plan.ranks.values())
    local_world = len(local)
    host, port = split_addr(master)
    return {
        "RANK": str(rank),
        "WORLD_SIZE": str(plan.world_size),
        "LOCAL_RANK": str(local.index(rank)),
        "LOCAL_WORLD_SIZE": str(local_world),
        "GROUP_RANK": str(local[0] // local_world),
        "GROUP_WORLD_SIZE": str(max(1, plan.world_size // local_world)),
        "ROLE_RANK": str(rank),
        "ROLE_WORLD_SIZE": str(plan.world_size),
        "ROLE_NAME": "default",
        "MASTER_ADDR": host,
        "MASTER_PORT": str(port),
        "TORCHELASTIC_RESTART_COUNT": str(plan.generation - 1),
        "TORCHELASTIC_MAX_RESTARTS": str(max_restarts),
        "TORCHELASTIC_RUN_ID": run_id,
        "TORCHELASTIC_USE_AGENT_STORE": "True",
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1"),
    }


def master_store(plan: NodePlan, rank: int, bind: str, timeout_s: float) -> str:
    """``host:port`` of generation ``plan``'s own store: hosted here when ``rank`` is 0
    (on ``bind``, the node's address), else read from the job's store, where rank 0
    posts it under the generation's secret."""
    job_store = generation_store(connect_store(plan.store_addr, timeout_s), plan.store_secret)
    key = f"{plan.store_prefix}/{MASTER_KEY}"
    if rank == 0:
        store = host_store(bind, secrets=(plan.store_secret,))
        _hosted.append(store)
        addr = f"[{bind}]:{store.port}" if ":" in bind else f"{bind}:{store.port}"
        job_store.set(key, addr)
        return addr
    return job_store.get(key).decode()


def member_rendezvous(secret: str) -> Callable[..., Iterator[tuple[dist.Store, int, int]]]:
    """torch's ``env://`` rendezvous handler, for a member of the generation of ``secret``:
    ``MASTER_ADDR:MASTER_PORT`` is the generation's store (:func:`master_store`), which
    a client reaches only by proving the secret; rank and world size as torch reads
    them (the URL's query, else ``RANK`` and ``WORLD_SIZE``)."""

    def handler(
        url: str, timeout: timedelta = timedelta(minutes=30), **kwargs: Any
    ) -> Iterator[tuple[dist.Store, int, int]]:
        query = dict(parse_qsl(urlparse(url).query))
        rank = int(query.get("rank", os.environ["RANK"]))
        world_size = int(query.get("world_size", os.environ["WORLD_SIZE"]))
        master = f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}"
        if ":" in os.environ["MASTER_ADDR"]:
            master = f"[{os.environ['MASTER_ADDR']}]:{os.environ['MASTER_PORT']}"
        yield generation_store(StoreClient(master, timeout), secret), rank, world_size
        raise RuntimeError(
            "env:// rendezvous: a generation's store is made once; Phalanx restarts the script"
        )

    return handler


def use_member_rendezvous(secret: str) -> None:
    """Make ``init_process_group``'s default (``env://``) rendezvous :func:`member_rendezvous`
    in this process (torch's handler table: its registration function refuses a scheme
    twice)."""
    module = importlib.import_module("torch.distributed.rendezvous")  # the attribute is torch's function
    module._rendezvous_handlers["env"] = member_rendezvous(secret)


class StepCounter:
    """Counts the script's optimizer steps (the first optimizer that steps; a second one,
    a GAN's discriminator say, steps in the same iteration) into the rank's status."""

    def __init__(self, status: RankStatus) -> None:
        self.status = status
        self._first: int | None = None
        self._last = time.perf_counter()
        self.handle = register_optimizer_step_post_hook(self._stepped)

    def _stepped(self, opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if self._first is None:
            self._first = id(opt)
        if id(opt) != self._first:
            return
        now = time.perf_counter()
        self.status.completed(self.status.step + 1, (now - self._last) * 1e3, None)
        self._last = now


def _wait_membership(agent: Agent, worker: str, floor: int) -> NodePlan:
    """The newest plan from generation ``floor`` on that makes ``worker`` a member."""
    seen = floor - 1
    while True:
        envelope = agent.wait_plan(seen)
        assert envelope is not None  # no timeout
        plan = envelope.plan
        if plan.rank_of(worker) is not None:
            return plan
        seen = plan.generation


def _note(error: BaseException | None, worker: str) -> None:
    """Leave the launcher a note: this worker could not start the script."""
    path = os.environ.get(EXIT_NOTE_ENV)
    if path:
        text = f"{type(error).__name__}: {error}" if error is not None else "unknown"
        Path(path).write_text(json.dumps({"stage": "start", "worker": worker, "error": text[:2000]}))


def _spare_until_released(agent: Agent) -> int:
    """A hot spare: registered and warm, it never runs the script. The launcher starts
    the member in its place; at the end of the job it releases it (SIGTERM: exit 0)."""
    released = threading.Event()
    signal.signal(signal.SIGTERM, lambda signum, frame: released.set())
    while not released.wait(3600):
        pass
    agent.close(timeout_s=1.0, drain_s=0.0)  # a spare has nothing to drain
    return 0


def run(target: Target, on_env: Callable[[dict[str, str]], object] | None = None) -> int:
    """Run ``target`` as this worker of the job (the module doc); returns its exit code.
    ``on_env`` is called with the environment the script will see (the fork server
    shows it in ``/proc``, :func:`phalanx.runtime.zygote.retitle`)."""
    settings = load_or_exit(RankSettings, "phalanx worker")
    job, worker, role = settings.job, settings.worker, settings.role
    if not job or not worker or role is None:
        print(
            "phalanx: start this worker with `phalanx run` (PHALANX_JOB/WORKER/ROLE unset)", file=sys.stderr
        )
        return 2
    setup_logging(f"rank-{worker}", "WARNING")
    status = RankStatus(job=job, worker=worker)
    agent = Agent(status, role, heartbeat_s=HEARTBEAT_S, launch=settings.launch).start()
    if role is Role.SPARE:
        status.enter(Phase.IDLE)
        return _spare_until_released(agent)
    plan = _wait_membership(agent, worker, int(os.environ.get(GENERATION_ENV, "1")))
    rank = plan.rank_of(worker)
    assert rank is not None
    status.rank, status.generation = rank, plan.generation
    bind = settings.bind or "127.0.0.1"
    master = master_store(plan, rank, bind, settings.collective_timeout_s)
    os.environ.update(
        torchrun_env(
            plan, worker, master, run_id=job, max_restarts=int(os.environ.get(MAX_RESTARTS_ENV, "-1"))
        )
    )
    if "GLOO_SOCKET_IFNAME" not in os.environ and (iface := interface_of(bind)) is not None:
        os.environ["GLOO_SOCKET_IFNAME"] = iface  # the node's address, not what its hostname resolves to
    use_member_rendezvous(plan.store_secret)
    if on_env is not None:
        on_env(dict(os.environ))
    status.enter(Phase.RUNNING)
    StepCounter(status)
    activity = observe_default_group(
        status, FaultPlan(settings.faults), floor_s=settings.collective_inside_floor_s
    )
    outcome: Outcome = run_target(target)
    if outcome.at_start:
        _note(outcome.error, worker)
    activity.stop()
    get_logger(component="unmodified").info("script_ended", code=outcome.code, generation=plan.generation)
    agent.close(goodbye=outcome.code == 0)  # a failed script is a fault: no goodbye
    return outcome.code


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    target = parse([sys.executable, *args])
    if target is None:
        print(f"usage: python -m phalanx.runtime.unmodified [FLAGS] (script.py | -m module | -c code) ARGS, got {args}",
              file=sys.stderr)  # fmt: skip
        return 2
    return run(target)


if __name__ == "__main__":
    sys.exit(main())
