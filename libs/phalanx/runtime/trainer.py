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

With ``exact_reduce=True`` the gradients are summed in float64 (each micro-batch's
fp32 gradient added to a float64 buffer, that buffer all-reduced, the sum rounded
back to fp32 once). A sum of fp32 values in float64 is exact whatever its order,
so when every micro-batch is the same chunk of the global batch at every world
size (shards that are multiples of the micro-batch), the update is bitwise the
same at any size: a resize leaves no trace in the weights. It costs twice the
all-reduce bytes and a float64 copy of the gradients.

Each gradient all-reduce carries the session's learned per-op timeout (see
:mod:`phalanx.runtime.session`): the gloo per-op timeout really ends the op, so a
peer hung inside the all-reduce costs its partners seconds, not the backstop.

When a collective fails (a peer crashed, or a hung peer was fenced), the rank
does not exit: its :class:`~phalanx.runtime.session.Session` recovers it in
place (abort, wait for the next plan, comm_init, state_transfer, data_restore,
first_step). ``data_restore`` prepares the next global batch's slice for this
rank; in ``first_step`` the step in flight is redone. Survivors still hold their
own gradients of it (copied aside before each all-reduce, which works in place),
so only the joiner runs forward/backward; the others wait in the all-reduce.

Per-step randomness is re-seeded from ``(seed, step, rank)``, so a joiner draws
exactly what the rank it replaces would have drawn.
"""

from __future__ import annotations

import inspect
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from phalanx.contract import BatchPlan, NodePlan, Phase, Role
from phalanx.runtime.comm import CommError, Group
from phalanx.runtime.session import Member, RecoveryError, Removed, Session
from phalanx.runtime.snapshots import RotatingSnapshots
from phalanx.telemetry import get_logger

if TYPE_CHECKING:
    from phalanx.checkpoint.client import Checkpointer

Batch = tuple[torch.Tensor, torch.Tensor]
BatchFn = Callable[[int, int, int], list[Batch]]  # (step, world_size, rank) -> micro-batches
LossFn = Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor]


def step_seed(seed: int, step: int, rank: int) -> int:
    return (seed * 1_000_003 + step * 65_537 + rank * 257) % (2**63 - 1)


VOTE, LOSS = -2, -1
"""Slots after the gradients in the all-reduced buffer: the members' resize votes
(:meth:`Session.resize_vote`) and their shares of the step's loss."""


def _flat_grads(params: list[nn.Parameter]) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """One buffer on the parameters' device: every gradient (each parameter gets its
    view) followed by the two slots VOTE and LOSS, all-reduced together (or, with
    ``exact_reduce``, added into the float64 buffer that is)."""
    total = sum(p.numel() for p in params)
    flat = torch.zeros(total + 2, dtype=params[0].dtype, device=params[0].device)
    views, off = [], 0
    for p in params:
        views.append(flat[off : off + p.numel()].view_as(p))
        off += p.numel()
    return flat, views


class Trainer:
    def __init__(
        self,
        job: Member,
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
        on_resize: Callable[[int, int, NodePlan], None] | None = None,
        reuse_local_grads: bool = True,
        exact_reduce: bool = False,
        checkpoints: Checkpointer | None = None,
        checkpoint_every: int = 0,
    ) -> None:
        if global_batch < 1:
            raise ValueError("global_batch must be >= 1")
        if checkpoint_every < 0 or (checkpoint_every and checkpoints is None):
            raise ValueError("checkpoint_every needs checkpoints and must be >= 0")
        # Tiered checkpoints: every checkpoint_every steps one member (a different one
        # each time, so the work spreads over the nodes) snapshots the state; a group
        # in which nobody holds state resumes from the newest one (:mod:`.snapshots`).
        self.checkpoints, self.checkpoint_every = checkpoints, checkpoint_every
        self.job, self.model, self.optimizer = job, model, optimizer
        self.batches, self.loss_fn = batches, loss_fn
        self.global_batch, self.seed = global_batch, seed
        self.data_state = data_state
        self.on_step = on_step
        self.on_resize = on_resize
        self.log = get_logger(component="trainer", worker=job.worker)
        self._snapshots = (
            RotatingSnapshots(checkpoints, checkpoint_every, self.log, (optimizer,))
            if checkpoints is not None and checkpoint_every
            else None
        )
        # How the current generation splits the global batch (the plan's, when it is
        # for this global batch), and the optimizer's learning rates it scales.
        self.batch: BatchPlan | None = None
        self.base_lr = [float(g["lr"]) for g in optimizer.param_groups]
        self.lr_scale = 1.0
        self.last_loss = float("nan")  # the global batch's mean loss of the last step
        self._world_seen = 0
        self._switch = False  # the members voted to switch generations after this step
        self.params = [p for p in model.parameters() if p.requires_grad]
        # The grads are views into _grads; flat is what is all-reduced: _grads itself,
        # or with exact_reduce a float64 buffer each micro-batch's gradient is added to.
        self._grads, self._views = _flat_grads(self.params)
        self.exact_reduce = exact_reduce
        self.flat = self._grads.to(torch.float64) if exact_reduce else self._grads
        self.session = Session(
            job,
            self,
            device=self.flat.device,
            collective_timeout_s=collective_timeout_s,
            rendezvous_timeout_s=rendezvous_timeout_s,
            plan_timeout_s=plan_timeout_s,
            checkpoints=checkpoints,
            gradient_bytes=self.flat.numel() * self.flat.element_size(),
        )
        self._prefetched: tuple[int, list[Batch]] | None = None
        # This rank's own gradients of the step in flight, kept until its all-reduce
        # succeeds: a survivor redoing that step after a recovery skips its
        # forward/backward, so the joiner computes alone (1% of a step to copy).
        self.reuse_local_grads = reuse_local_grads
        self._local_grads = torch.empty_like(self.flat) if reuse_local_grads else self.flat
        self._local_key: tuple[int, int, int] | None = None

    # The session's view of this rank, for callers that only know the trainer.
    @property
    def step(self) -> int:
        return self.session.step

    @property
    def rank(self) -> int:
        return self.session.rank

    @property
    def world_size(self) -> int:
        return self.session.world_size

    @property
    def generation(self) -> int:
        return self.session.generation

    @property
    def recoveries(self) -> int:
        return self.session.recoveries

    # -- state that moves to a joiner ------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        step = self.session.step
        return {
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "rng": {"torch": torch.get_rng_state()},
            "data": self.data_state(step) if self.data_state else {"step": step},
        }

    def load_state_dict(self, state: dict[str, Any], *, fresh: bool = False) -> None:
        """Adopt a peer's state; refuses one taken on other data."""
        step = self.session.step
        if self.data_state is not None and state["data"] != self.data_state(step):
            raise RecoveryError(
                f"data position mismatch: got {state['data']}, expected {self.data_state(step)}"
            )
        self._local_key = None  # the weights change: kept gradients no longer apply
        if self._snapshots is not None:
            self._snapshots.fence()  # a save in flight still reads the weights
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        torch.set_rng_state(state["rng"]["torch"].cpu().clone())  # a view into the buffer segfaults

    # -- the loop --------------------------------------------------------------------
    def fit(self, steps: int) -> int:
        """Train until ``steps`` optimizer steps are done; returns the steps done.

        A spare blocks here until a plan gives it a rank. A worker that a plan
        removes returns early (its process should then exit 0).
        """
        session = self.session
        try:
            if self.job.role is Role.SPARE:
                self._warm_up()
            session.start(self._restore)
            while session.step < steps:
                if session.superseded() or self._switch:
                    self._switch = False
                    session.reconfigure(None, self._restore)
                    continue
                try:
                    self._train_step()
                except CommError as err:
                    session.reconfigure(err, self._restore)
            session.finish()
        except Removed:
            self.log.warning("removed_from_job", generation=session.generation)
        return session.step

    def _restore(self, world_size: int, rank: int) -> None:
        plan = self.session.plan
        batch = plan.batch if plan is not None else None
        if batch is not None and batch.global_batch != self.global_batch:
            self.log.warning(
                "batch_plan_ignored",
                reason=f"the job's global batch is {batch.global_batch}, this trainer's {self.global_batch}",
            )
            batch = None
        self.batch = batch
        self._set_lr_scale(batch.lr_scale if batch is not None else 1.0)
        old, self._world_seen = self._world_seen, world_size
        if batch is not None and old != world_size:
            self.log.info("batch_plan", world_size=world_size, plan=batch.describe(), lr_scale=self.lr_scale)
        if self.on_resize is not None and old and old != world_size and plan is not None:
            self.on_resize(old, world_size, plan)
        step = self.session.step
        self._prefetched = (step, self._shard(step, world_size, rank))

    def _set_lr_scale(self, scale: float) -> None:
        """The learning rates as the job's rule sets them for the effective batch."""
        if scale == self.lr_scale:
            return
        for group, base in zip(self.optimizer.param_groups, self.base_lr, strict=True):
            group["lr"] = base * scale
        self.lr_scale = scale

    def _shard(self, step: int, world_size: int, rank: int) -> list[Batch]:
        """This rank's micro-batches of ``step``, cut to its share when the plan caps it."""
        mbs = self.batches(step, world_size, rank)
        batch = self.batch
        if batch is None or batch.effective_batch == batch.global_batch:
            return mbs
        left, out = batch.shards[rank], []
        for x, y in mbs:
            if left <= 0:
                break
            out.append((x[:left], y[:left]))
            left -= x.shape[0]
        return out

    @property
    def effective_batch(self) -> int:
        return self.batch.effective_batch if self.batch is not None else self.global_batch

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
        warm_up_group(self.flat)
        self.flat.zero_()
        self._grads.zero_()
        torch.set_rng_state(rng)
        self.log.info("spare_warm", ms=round((time.perf_counter() - t) * 1000, 1))

    def _micro_batches(self) -> list[Batch]:
        step, session = self.session.step, self.session
        if self._prefetched is not None and self._prefetched[0] == step:
            mbs = self._prefetched[1]
        else:
            mbs = self._shard(step, session.world_size, session.rank)
        self._prefetched = None
        return mbs

    def _train_step(self) -> None:
        session, status = self.session, self.job.status
        step = session.step
        t0, wall0 = time.perf_counter(), time.time()
        status.enter(Phase.COMPUTE)
        torch.manual_seed(step_seed(self.seed, step, session.rank))
        for p, v in zip(self.params, self._views, strict=True):
            p.grad = v
        key = (step, session.world_size, session.rank)
        if self._local_key == key:
            # Redoing the step a failed all-reduce interrupted, with unchanged weights,
            # data shard and seed: this rank's gradients are the ones it already had.
            self.flat.copy_(self._local_grads)
            if session.pending is not None:
                session.pending.reused_grads = True
        else:
            self.flat.zero_()
            total = self.effective_batch
            for x, y in self._micro_batches():
                loss = self.loss_fn(self.model, x, y) * (x.shape[0] / total)
                if self.exact_reduce:
                    self._grads.zero_()
                loss.backward()
                if self.exact_reduce:
                    self.flat[:VOTE] += self._grads[:VOTE]
                self.flat[LOSS] += loss.detach()
            if self.reuse_local_grads:
                self._local_grads.copy_(self.flat)  # the all-reduce works in place
                self._local_key = key
        if session.strike(session.collective_bound_s()):
            session.comm.release()
            raise CommError(f"injected: {self.job.worker} broke its communicator in step {step}")
        self._prefetched = None
        self.flat[VOTE] = session.resize_vote()
        session.allreduce_(self.flat)
        self._local_key = None
        if self.exact_reduce:
            self._grads.copy_(self.flat)  # the one rounding back to fp32
        status.enter(Phase.COMPUTE)
        self.optimizer.step()
        votes, self.last_loss = self.flat[VOTE:].tolist()
        step_ms = (time.perf_counter() - t0) * 1000.0
        session.committed(step_ms, wall0, self.last_loss)
        self._switch = votes > 0  # every member saw the same sum: all switch after this step
        if self._snapshots is not None:  # data parallel: one member's snapshot is the job's
            self._snapshots.after_step(session, self.state_dict)
        if self.on_step is not None:
            self.on_step(session.step, step_ms)


def warm_up_group(t: torch.Tensor) -> None:
    """Build and use a one-rank group on ``t``'s device: the first group in a process
    costs more than later ones, and a hot spare pays that before it is needed."""
    warm = Group(dist.HashStore(), "warm-up", 0, 1, 10.0, device=t.device)
    warm.allreduce_sum_(t)
    warm.destroy()


__all__ = ["Batch", "BatchFn", "LossFn", "RecoveryError", "Trainer", "step_seed", "warm_up_group"]
