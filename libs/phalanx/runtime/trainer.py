"""The training loop a Phalanx rank runs, with in-process recovery built in.

A plain DDP script changes in a few lines: build the model and optimizer as
before, then hand them to a :class:`Trainer` with a loss function and a batch
function instead of wrapping the model in DDP::

    job = phalanx.runtime.init()
    model, opt = GPT(cfg), torch.optim.AdamW(...)
    trainer = Trainer(job, model, opt, batches=data.micro_batches, loss_fn=lm_loss,
                      global_batch=32)
    trainer.fit(steps=200)

Each step: micro-batches forward/backward into one flat gradient buffer (the
grads are views into it), one SUM all-reduce, the optimizer step. The loss of a
micro-batch of ``n`` samples is scaled by ``n / global_batch``, so the update is
the gradient of the mean loss over the global batch whatever the world size.

Each gradient all-reduce carries a per-op timeout learned from this
generation's recent all-reduces, like the detector's compute-stall bound:
``max(PHALANX_COLLECTIVE_FLOOR_MS (2000), PHALANX_COLLECTIVE_FACTOR (4) x the
slowest of the last 20)``, and ``PHALANX_COLLECTIVE_INITIAL_MS`` (60000) until one
has completed in the generation (its first one also waits for a joiner's
forward/backward); never above ``collective_timeout_s``
(``PHALANX_COLLECTIVE_TIMEOUT_S``, 120), the backstop of every other collective.
The gloo per-op timeout really ends the op, so a peer hung inside the
all-reduce costs its partners seconds, not the backstop. The bound goes out in
every heartbeat (``collective_bound_ms``): the detector blames a rank that stays
in COLLECTIVE past it while a peer has left (``collective_hang``).

When a collective fails (a peer crashed, or a hung peer was fenced), the rank
does not exit. Recovery, each phase timed and traced in the incident's trace:

1. ``abort``: drop the broken process group (its sockets close, which releases
   peers still blocked in the collective);
2. wait for the planner's next generation (a hot spare takes the lost rank);
3. ``comm_init``: an abandonable arrival barrier on the store the plan names
   (hosted by a launcher; it moves when its node is lost), then a new gloo group
   under the generation's own prefix, listening on this node's interface;
4. ``state_transfer``: ranks all-reduce their step counters; the most advanced
   rank sends model, optimizer, RNG and data position (CRC-checked) to every
   member behind it -- the joiner, and any survivor that missed the last update;
5. ``data_restore``: the next global batch's slice for this rank is prepared;
6. ``first_step``: the step in flight is redone. Survivors still hold their own
   gradients of it (copied aside before each all-reduce, which works in place),
   so only the joiner runs forward/backward; the others wait in the all-reduce.

Per-step randomness is re-seeded from ``(seed, step, rank)``, so a joiner draws
exactly what the rank it replaces would have drawn.
"""

from __future__ import annotations

import functools
import inspect
import os
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from opentelemetry import context as otel_context
from opentelemetry import trace
from torch import nn

from phalanx.bus.subjects import COMM_ERROR, RECOVERED
from phalanx.runtime.comm import CommError, Communicator, Superseded, arrival_barrier
from phalanx.runtime.job import Job
from phalanx.runtime.state import checksum, pack, recv_state, send_state
from phalanx.schemas import CollectiveError, Phase, RecoveryDone, Role
from phalanx.telemetry import get_logger

Batch = tuple[torch.Tensor, torch.Tensor]
BatchFn = Callable[[int, int, int], list[Batch]]  # (step, world_size, rank) -> micro-batches
LossFn = Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor]

PHASES = ("abort", "comm_init", "state_transfer", "data_restore", "first_step")
COLLECTIVE_WINDOW = 20
"""Gradient all-reduces whose wall times make the learned per-op timeout."""
_tracer = trace.get_tracer("phalanx.runtime")


class RecoveryError(RuntimeError):
    """Recovery could not proceed (no plan came); the process exits and is replaced."""


class Removed(Exception):
    """This worker is not a member of the new generation."""


@dataclass
class _Recovery:
    """Timestamps (time.time()) of one recovery's phases on this rank."""

    started: float
    marks: dict[str, tuple[float, float]] = field(default_factory=dict)
    incident: str | None = None
    context: otel_context.Context | None = None
    bytes_received: int = 0
    role: str = "survivor"
    reused_grads: bool = False

    def mark(self, phase: str, start: float) -> float:
        end = time.time()
        self.marks[phase] = (start, end)
        return end


def _env_pos(name: str, default: float) -> float:
    raw = os.environ.get(name, "")
    value = float(raw) if raw else default
    if not value > 0:
        raise ValueError(f"{name} must be positive, got {raw!r}")
    return value


def step_seed(seed: int, step: int, rank: int) -> int:
    return (seed * 1_000_003 + step * 65_537 + rank * 257) % (2**63 - 1)


def _flat_grads(params: list[nn.Parameter]) -> tuple[torch.Tensor, list[torch.Tensor]]:
    total = sum(p.numel() for p in params)
    flat = torch.zeros(total, dtype=params[0].dtype)
    views, off = [], 0
    for p in params:
        views.append(flat[off : off + p.numel()].view_as(p))
        off += p.numel()
    return flat, views


class Trainer:
    def __init__(
        self,
        job: Job,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        *,
        batches: BatchFn,
        loss_fn: LossFn,
        global_batch: int,
        seed: int = 0,
        data_state: Callable[[int], dict[str, Any]] | None = None,
        collective_timeout_s: float | None = None,
        rendezvous_timeout_s: float = 60.0,
        plan_timeout_s: float = 120.0,
        on_step: Callable[[int, float], None] | None = None,
        reuse_local_grads: bool = True,
    ) -> None:
        if global_batch < 1:
            raise ValueError("global_batch must be >= 1")
        self.job, self.model, self.optimizer = job, model, optimizer
        self.batches, self.loss_fn = batches, loss_fn
        self.global_batch, self.seed = global_batch, seed
        self.data_state = data_state
        self.collective_timeout_s = collective_timeout_s or float(
            os.environ.get("PHALANX_COLLECTIVE_TIMEOUT_S", "120")
        )
        self.collective_floor_s = _env_pos("PHALANX_COLLECTIVE_FLOOR_MS", 2000.0) / 1e3
        self.collective_factor = _env_pos("PHALANX_COLLECTIVE_FACTOR", 4.0)
        self.collective_initial_s = _env_pos("PHALANX_COLLECTIVE_INITIAL_MS", 60000.0) / 1e3
        # Wall times (ms) of this generation's completed gradient all-reduces.
        self._collective_ms: deque[float] = deque(maxlen=COLLECTIVE_WINDOW)
        self.rendezvous_timeout_s = rendezvous_timeout_s
        self.plan_timeout_s = plan_timeout_s
        self.on_step = on_step
        self.log = get_logger(component="trainer", worker=job.worker)
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.flat, self._views = _flat_grads(self.params)
        self.step = 0
        self.generation = 0
        self.rank = -1
        self.world_size = 0
        self.comm: Communicator | None = None
        self.recoveries = 0
        self._seen = 0  # newest generation looked at (a spare skips plans that leave it out)
        self._has_state = False
        self._prefetched: tuple[int, list[Batch]] | None = None
        # This rank's own gradients of the step in flight, kept until its all-reduce
        # succeeds: a survivor redoing that step after a recovery skips its
        # forward/backward, so the joiner computes alone (1% of a step to copy).
        self.reuse_local_grads = reuse_local_grads
        self._local_grads = torch.empty_like(self.flat) if reuse_local_grads else self.flat
        self._local_key: tuple[int, int, int] | None = None
        self._pending: _Recovery | None = None

    def collective_bound_s(self) -> float:
        """The per-op timeout of the next gradient all-reduce (see the module doc)."""
        if self._collective_ms:
            bound = max(self.collective_floor_s, self.collective_factor * max(self._collective_ms) / 1e3)
        else:
            bound = max(self.collective_floor_s, self.collective_initial_s)
        return min(bound, self.collective_timeout_s)

    # -- state that moves to a joiner ------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "rng": {"torch": torch.get_rng_state()},
            "data": self.data_state(self.step) if self.data_state else {"step": self.step},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Adopt a peer's state; refuses (changing nothing) one taken on other data."""
        step = int(state["step"])
        if self.data_state is not None and state["data"] != self.data_state(step):
            raise RecoveryError(
                f"data position mismatch: got {state['data']}, expected {self.data_state(step)}"
            )
        self._local_key = None  # the weights change: kept gradients no longer apply
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        torch.set_rng_state(state["rng"]["torch"].clone())  # a view into the buffer segfaults
        self.step = step
        self.job.status.step = step

    # -- the loop --------------------------------------------------------------------
    def fit(self, steps: int) -> int:
        """Train until ``steps`` optimizer steps are done; returns the steps done.

        A spare blocks here until a plan gives it a rank. A worker that a plan
        removes returns early (its process should then exit 0).
        """
        try:
            if self.job.role is Role.SPARE:
                self._warm_up()
            self._join(_Recovery(time.time(), role="start"), first=True)
            while self.step < steps:
                if self.job.agent.superseded(self.generation):
                    self._reconfigure(None)
                    continue
                try:
                    self._train_step()
                except CommError as err:
                    self._reconfigure(err)
            self._finish()
        except Removed:
            self.log.warning("removed_from_job", generation=self._seen)
        return self.step

    def _warm_up(self) -> None:
        """A hot spare runs one forward/backward and one optimizer step on copies
        before it is needed, so that kernels, allocator, data order and the
        optimizer's code paths are warm when it joins. Model, optimizer and
        RNG state are left as they were (the RNG is also replaced on joining), and
        the gradient buffer is zeroed again."""
        t = time.perf_counter()
        rng = torch.get_rng_state()
        for p, v in zip(self.params, self._views, strict=True):
            p.grad = v
        x, y = self.batches(0, 1, 0)[0]
        self.loss_fn(self.model, x, y).backward()
        try:
            clones = [p.detach().clone().requires_grad_(True) for p in self.params]
            for c, p in zip(clones, self.params, strict=True):
                c.grad = p.grad.detach().clone() if p.grad is not None else None
            accepted = inspect.signature(type(self.optimizer)).parameters
            kwargs = {k: v for k, v in self.optimizer.defaults.items() if k in accepted}
            type(self.optimizer)(clones, **kwargs).step()
        except Exception as exc:  # an optimizer that cannot be rebuilt from its defaults
            self.log.info("optimizer_warm_up_skipped", error=repr(exc))
        # The first gloo group in a process costs more than later ones: build one here.
        warm = Communicator(dist.HashStore(), "warm-up", 0, 1, 10.0)
        warm.allreduce_sum_(self.flat)
        warm.destroy()
        self.flat.zero_()
        torch.set_rng_state(rng)
        self.log.info("spare_warm", ms=round((time.perf_counter() - t) * 1000, 1))

    def _finish(self) -> None:
        if self.comm is not None:
            try:
                self.comm.barrier()  # nobody closes sockets a peer still reads from
            except CommError as err:
                self.log.warning("final_barrier_failed", error=str(err))
            self.comm.destroy()
            self.comm = None

    def _micro_batches(self) -> list[Batch]:
        if self._prefetched is not None and self._prefetched[0] == self.step:
            mbs = self._prefetched[1]
        else:
            mbs = self.batches(self.step, self.world_size, self.rank)
        self._prefetched = None
        return mbs

    def _train_step(self) -> None:
        status, comm = self.job.status, self.comm
        assert comm is not None
        t0, wall0 = time.perf_counter(), time.time()
        status.enter(Phase.COMPUTE)
        torch.manual_seed(step_seed(self.seed, self.step, self.rank))
        for p, v in zip(self.params, self._views, strict=True):
            p.grad = v
        key = (self.step, self.world_size, self.rank)
        bound = self.collective_bound_s()

        def enter_collective() -> None:
            status.collective_bound_ms = bound * 1e3
            status.enter(Phase.COLLECTIVE)

        if self._local_key == key:
            # Redoing the step a failed all-reduce interrupted, with unchanged weights,
            # data shard and seed: this rank's gradients are the ones it already had.
            self.flat.copy_(self._local_grads)
            if self._pending is not None:
                self._pending.reused_grads = True
        else:
            self.flat.zero_()
            for x, y in self._micro_batches():
                loss = self.loss_fn(self.model, x, y) * (x.shape[0] / self.global_batch)
                loss.backward()
            if self.reuse_local_grads:
                self._local_grads.copy_(self.flat)  # the all-reduce works in place
                self._local_key = key
            if self.job.faults.fire(self.job.worker, "step", self.step, enter_collective=enter_collective):
                comm.destroy()
                raise CommError(f"injected: {self.job.worker} broke its communicator in step {self.step}")
        self._prefetched = None
        enter_collective()
        t_ar = time.perf_counter()
        comm.allreduce_sum_(self.flat, bound)
        self._collective_ms.append((time.perf_counter() - t_ar) * 1000.0)
        self._local_key = None
        status.enter(Phase.COMPUTE)
        self.optimizer.step()
        self.step += 1
        step_ms = (time.perf_counter() - t0) * 1000.0
        status.step, status.step_ms = self.step, step_ms
        if self.on_step is not None:
            self.on_step(self.step, step_ms)
        if self._pending is not None:
            self._pending.mark("first_step", wall0)
            self._report(self._pending)
            self._pending = None

    # -- recovery ----------------------------------------------------------------------
    def _reconfigure(self, err: CommError | None) -> None:
        now = time.time()
        # Out of the collective at once: the detector tells the peers that left from
        # one hung inside it (collective_hang) by this phase, a heartbeat later.
        self.job.status.enter(Phase.RECOVERING)
        rec = _Recovery(now)
        if self.comm is not None:
            self.comm.destroy()  # the cascade: peers blocked on us fail now
            self.comm = None
        rec.mark("abort", now)
        if err is not None:
            self.log.warning("collective_failed", step=self.step, generation=self.generation, error=str(err))
            self.job.agent.publish(
                COMM_ERROR,
                CollectiveError(
                    job=self.job.job,
                    worker=self.job.worker,
                    rank=self.rank,
                    generation=self.generation,
                    step=self.step,
                    error=str(err)[:2000],
                    launch=self.job.agent.launch,
                ),
                job=self.job.job,
            )
        self._join(rec, first=False)

    def _join(self, rec: _Recovery, first: bool) -> None:
        agent, status = self.job.agent, self.job.status
        waiting = Phase.IDLE if self.job.role is Role.SPARE and self.generation == 0 else Phase.RECOVERING
        while True:
            status.enter(waiting)
            timeout = None if waiting is Phase.IDLE or first else self.plan_timeout_s
            env = agent.wait_plan(max(self._seen, self.generation), timeout)
            if env is None:
                raise RecoveryError(f"no plan newer than generation {self.generation} in {timeout}s")
            plan = env.plan
            self._seen = plan.generation
            rank = plan.rank_of(self.job.worker)
            if rank is None:
                if self.generation > 0:
                    raise Removed()
                continue  # a spare not (yet) chosen
            status.enter(Phase.RECOVERING)
            rec.incident, rec.context = plan.incident, env.context
            if self.generation == 0 and self.job.role is Role.SPARE:
                rec.role = "joiner"
            comm = None
            try:
                self.job.faults.fire(self.job.worker, "recovery", plan.generation)
                t = time.time()
                store = self.job.store_at(plan.store_addr)
                arrival_barrier(
                    store,
                    plan.store_prefix,
                    rank,
                    plan.world_size,
                    functools.partial(agent.superseded, plan.generation),
                    self.rendezvous_timeout_s,
                )
                comm = Communicator(
                    store,
                    plan.store_prefix,
                    rank,
                    plan.world_size,
                    self.collective_timeout_s,
                    bind=self.job.bind,
                )
                t = rec.mark("comm_init", t)
                rec.bytes_received = self._sync_state(comm, rank)
                t = rec.mark("state_transfer", t)
                self._prefetched = (self.step, self.batches(self.step, plan.world_size, rank))
                rec.mark("data_restore", t)
            except (Superseded, CommError) as exc:
                if comm is not None:
                    comm.destroy()
                self.log.warning("generation_abandoned", generation=plan.generation, error=str(exc))
                continue
            self.comm, self.generation, self.rank, self.world_size = (
                comm,
                plan.generation,
                rank,
                plan.world_size,
            )
            status.rank, status.generation = rank, plan.generation
            self._collective_ms.clear()  # a new group (maybe of another size): learn its times afresh
            self.recoveries += 0 if first else 1
            self._pending = rec
            self.log.info(
                "generation_joined",
                generation=plan.generation,
                rank=rank,
                world_size=plan.world_size,
                step=self.step,
                phases_ms={k: round((e - s) * 1000, 2) for k, (s, e) in rec.marks.items()},
            )
            return

    def _sync_state(self, comm: Communicator, rank: int) -> int:
        """Bring every member to the most advanced member's state; returns bytes received."""
        mine = self.step + 2 if self._has_state else 1
        steps_t = torch.zeros(comm.world_size, dtype=torch.int64)
        steps_t[rank] = mine
        comm.allreduce_sum_(steps_t, self.collective_timeout_s)
        steps = [int(s) - 2 for s in steps_t.tolist()]  # -1: has no state
        best = max(steps)
        if best < 0:  # a fresh job: rank 0's initial state is the reference (like DDP)
            src, receivers = 0, [r for r in range(comm.world_size) if r != 0]
        else:
            src = steps.index(best)
            receivers = [r for r, s in enumerate(steps) if s != best]
        received = 0
        if rank == src and receivers:
            meta, buf = pack(self.state_dict())
            crc = checksum(buf)
            for r in receivers:
                send_state(comm, meta, buf, crc, r)
        elif rank in receivers:
            state, received = recv_state(comm, src)
            self.load_state_dict(state)
        self._has_state = True
        return received

    def _report(self, rec: _Recovery) -> None:
        phases_ms = {k: (e - s) * 1000.0 for k, (s, e) in rec.marks.items()}
        if rec.role != "start" or rec.incident:
            for name in PHASES:
                if name not in rec.marks:
                    continue
                s, e = rec.marks[name]
                span = _tracer.start_span(
                    name,
                    context=rec.context,
                    start_time=int(s * 1e9),
                    attributes={
                        "phalanx.job": self.job.job,
                        "phalanx.worker": self.job.worker,
                        "phalanx.rank": self.rank,
                        "phalanx.generation": self.generation,
                        "phalanx.incident": rec.incident or "",
                        "phalanx.role": rec.role,
                        "phalanx.step": self.step,
                        "phalanx.bytes_received": rec.bytes_received,
                        "phalanx.reused_gradients": rec.reused_grads,
                    },
                )
                span.end(end_time=int(e * 1e9))
        self.job.agent.publish(
            RECOVERED,
            RecoveryDone(
                job=self.job.job,
                generation=self.generation,
                worker=self.job.worker,
                rank=self.rank,
                step=self.step,
                incident=rec.incident,
                phases_ms=phases_ms,
            ),
            job=self.job.job,
        )


__all__ = ["Batch", "BatchFn", "LossFn", "RecoveryError", "Trainer", "step_seed"]
