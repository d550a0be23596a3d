"""Phalanx under the user's own loop: their DDP model, DataLoader, optimizer, scheduler.

A torchrun DDP script keeps its shape; the changes are where the process group,
the sampler and the loop header come from::

    job = phalanx.runtime.init()                        # instead of init_process_group
    model = job.ddp(MLP().to(job.device))               # instead of DDP(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=1000)
    sampler = ElasticSampler(dataset, seed=0)           # instead of DistributedSampler
    loader = DataLoader(dataset, batch_size=32, sampler=sampler)
    job.track(model=model, optimizer=opt, scheduler=sched)  # optional: what moves to a joiner
    for step, (x, y) in job.steps(loader, 1000):        # instead of the epoch/batch loops
        loss = F.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        if job.step_ok:                                 # the step will commit: log it once
            print(step, loss.item())

The global batch (``phalanx run --global-batch G``) is held across resizes: each
step, every rank reads as many of the loader's batches as its share of ``G`` holds
(:func:`~phalanx.runtime.sampler.per_step`: ``G / (batch_size x world)`` where the
shares are whole batches), so a shrunk job reads more per rank. Above, they come
joined into one batch (one forward over more samples). With ``accumulate=True``
they come one by one -- gradient accumulation, the loader's batch size being the
micro-batch -- as a :class:`MicroBatches`::

    for step, micro_batches in job.steps(loader, 1000, accumulate=True):
        opt.zero_grad()
        for x, y in micro_batches:                      # no_sync for all but the last
            loss = F.mse_loss(model(x), y) / len(micro_batches)
            loss.backward()
        opt.step()
        sched.step()

The backward of every micro-batch but the last runs under DDP's ``no_sync`` (the
script needs none of its own; one it has is harmless), so the gradients add up
locally and one all-reduce per bucket carries the step's sum; the comm hook reduces
only in the last micro-batch's backward. A failed step is redone as a unit: every
micro-batch again, from the RNG state after the step's batches were fetched.

Where the plan's cap (``--micro-batch`` x ``--max-accum``) cuts a rank's share, or the
shares are no whole number of the loader's batches, a step trains fewer (or more)
samples than ``G``: the job's LR rule (``--lr-rule``, :func:`phalanx.batchplan.lr_scale`)
scales every learning rate the tracked optimizers and LR schedulers hold -- the
current ones and those the schedules are computed from (``initial_lr``, base LRs,
OneCycleLR's peak and floor), so a schedule keeps its shape -- logged as the
Trainer logs it (``batch_plan``) and readable as ``job.lr_scale`` and
``job.effective_batch``.

How it fits (torchft's shape: DDP on a placeholder group, gradients through a hook):

- ``job.ddp`` builds a real ``DistributedDataParallel`` on a one-rank group of this
  process and registers a comm hook that all-reduces each bucket over the
  session's current generation (SUM of the bucket divided by the world size, as
  DDP's own reduction does it), under the learned per-op timeout. Bucketing and
  the overlap of communication with backward are DDP's own.
- A bucket's all-reduce that fails does not raise: the hook hands back the local
  gradients and marks the step failed (``job.step_ok`` is False once backward has
  returned: DDP waits there for every bucket). ``opt.step()`` of the tracked
  optimizers and ``step()``/``update()`` of a tracked ``torch.amp.GradScaler`` do
  nothing in a failed step (they are guarded), and what the tracked LR schedulers'
  ``step()`` changed is put back (their state, the optimizers' hyperparameters, the
  GradScalers' scale and what their ``unscale_`` noted), so the body runs to its end
  without changing any state, and :meth:`UserLoop.steps` then recovers
  (:class:`~phalanx.runtime.session.Session`) and yields the same step again:
  survivors redo it with the batches they hold and the RNG state they had after
  fetching them; a joiner (and a survivor that missed the last update) takes the
  state of the most advanced member and reads its batches at the sampler position
  that came with it. ``job.report_loss`` keeps the value with the step once it
  commits: a failed attempt's is dropped.
- The planned-resize vote (one float: whether a member has seen a newer plan) is
  all-reduced beside the step's first gradient bucket and read after the step
  (:class:`ResizeVote` says why it is not an element of a bucket): no
  collective follows the optimizer step.
- With ``broadcast_buffers=True`` (DDP's default; ``forward_sync_buffers`` in newer
  torch) and a module with buffers, DDP's broadcast of the buffers from rank 0
  before each forward goes over the generation (a buffer comm hook): every member
  runs the forward with the generation's rank 0's buffers, as under torchrun. A
  failed broadcast fails the step and leaves the buffers as they were.
- What moves: the tracked objects' ``state_dict`` (torch.distributed.checkpoint's
  Stateful protocol), the torch RNG states at the start of the step (before its
  batch was fetched), the sampler's position, the LR scale and DDP's bucket layout.
  With nothing tracked, the DDP model and the optimizers, LR schedulers and enabled
  GradScalers are found and tracked (logged as ``tracked_found``).
- Bucket layouts must agree across a generation, or the members' all-reduces do
  not match. DDP puts every gradient in one bucket for the first iteration and
  rebuilds the buckets from the order gradients became ready; each member
  rebuilds on its own (the group it was built on has one rank: DDP's own
  collectives -- its construction-time checks, the bucket order it syncs on a
  rebuild -- stay in this process, as members rebuild at different times). So on
  joining a generation a member takes the layout of the most advanced member: its
  rebuilt one, onto which this member's hook maps DDP's buckets for as long as
  they differ (:mod:`.buckets`; the next rebuild usually makes them equal, as the
  ready order is the same), or, where that member has not rebuilt yet, a fresh
  reducer like everyone's first iteration.
- The hook holds the job's one :class:`~phalanx.runtime.comm.Communicator`, which
  each generation re-points; DDP itself never sees a generation's group.
- ``job.checkpoint(every=N)``: every ``N`` committed steps one member (a different one
  each time) snapshots what moves to a joiner into the tiered store
  (:mod:`.snapshots`, the Trainer's rotation); a relaunched job, whose members hold
  nothing, resumes from the newest complete one through the Session's last resort
  (rank 0 loads it and sends it to the others).

The loop is bitwise the plain torchrun script's when the world size is the same
(same sampler order, same reduction, same bucket layouts), and a run with faults
is bitwise its own fault-free run when the joiner takes the lost rank's index. A
resized run holding its global batch matches the fixed-size run at float precision
(the sums run in another order). Limits: per-rank RNG streams (a seed that depends
on the rank) cannot be recovered for a lost rank -- the joiner gets the source's;
random draws inside DataLoader worker processes are not reproduced on a joiner;
after losing the generation's rank 0, its buffers (as broadcast each forward) are
those of the member the new rank 0 took its state from; with ``job.mesh()``
(FSDP2) the micro-batches run without ``no_sync`` (FSDP2 reduces each one unless the
script calls ``set_requires_gradient_sync``) and the vote is a collective after the
step; the hook's per-bucket work (the call into Python, the future's callback) stays.
"""

from __future__ import annotations

import functools
import gc
import itertools
import time
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn
from torch.amp import GradScaler
from torch.amp.grad_scaler import _refresh_per_optimizer_state
from torch.nn.parallel import DistributedDataParallel
from torch.nn.parallel.distributed import _BufferCommHookLocation
from torch.optim.lr_scheduler import LRScheduler
from torch.utils.data import DataLoader

from phalanx.batchplan import lr_scale
from phalanx.contract import BatchPlan, NodePlan, Phase
from phalanx.runtime.buckets import Layout, LayoutError, Remap, done, layout_of
from phalanx.runtime.comm import CommError, Communicator, Group
from phalanx.runtime.mesh import Mesh
from phalanx.runtime.pause import Pauses
from phalanx.runtime.rng import rng_state, set_rng_state
from phalanx.runtime.sampler import ElasticSampler, concat, per_step
from phalanx.runtime.session import Member, RecoveryError, Removed, Session
from phalanx.runtime.sharded import StepGuard, load_shards, mesh_for_job
from phalanx.runtime.shards import to_local
from phalanx.runtime.snapshots import RotatingSnapshots, snapshot_interval
from phalanx.runtime.stepbatches import StepBatches
from phalanx.runtime.tiered import ShardedCheckpoints
from phalanx.telemetry import get_logger

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

_ids = itertools.count()


class UserLoop:
    """The user-loop integration of one job (one per process: ``job.loop``)."""

    def __init__(self, job: Member) -> None:
        self.job = job
        self.log = get_logger(component="loop", worker=job.worker)
        self.tracked: dict[str, Any] = {}
        self.session: Session | None = None
        self._ddp: DistributedDataParallel | None = None
        self._mesh: Mesh | None = None  # job.mesh(): FSDP2/HSDP instead of DDP
        self._device = torch.device("cpu")  # the mesh's
        self._local: Group | None = None  # the one-rank group DDP is built on
        self._param_index: dict[int, int] = {}
        # The step in flight.
        self._in_step = False
        self._failed: CommError | None = None
        self._stepped = False  # the tracked optimizers stepped in the step in flight
        self._late: CommError | None = None  # a collective of the step failed after that
        self.pauses = Pauses(job)  # job.pause() in the step in flight
        self._hooked = False
        self._final = True  # the micro-batch in flight is the step's last: its backward reduces
        self._vote = ResizeVote()  # this step's, beside its gradient all-reduces
        self._buckets: dict[int, list[int]] = {}
        # The generation's layout (None: DDP's first-iteration buckets, everyone's),
        # DDP's own once rebuilt (None: not yet), and whether the reducer has run a
        # backward since made; while the two differ, steps map onto the first.
        self._layout: Layout | None = None
        self._physical: Layout | None = None
        self._reducer_used = False
        self._recording = True
        # Per step, for the hook (_prepare_step).
        self._bound = 0.0
        self._scale = 1.0
        self._remap: Remap | None = None
        self._source_layout: Layout | None = None
        self._data: StepBatches | None = None  # job.steps()'s loader
        self._received = False  # the state (RNG included) came from a peer
        self._world_seen = 0
        self._on_resize: Callable[[int, int, NodePlan], None] | None = None
        # The batch a step trains (loader batch x world x micro-batches) and the factor
        # the job's LR rule applied to the tracked learning rates for it.
        self.effective_batch = 0
        self.lr_scale = 1.0
        self._loss: float | torch.Tensor | None = None  # what report_loss() got in the step in flight
        self._every = 0  # job.checkpoint(every=N)
        self.checkpoints: ShardedCheckpoints | None = None  # a job.mesh() job's, or
        self.snapshots: RotatingSnapshots | None = None  # a job.ddp() job's

    # -- the user's API --------------------------------------------------------------
    def ddp(self, module: nn.Module, **kwargs: Any) -> DistributedDataParallel:
        """``DistributedDataParallel(module, **kwargs)`` whose gradients go over the
        job's current generation (see the module doc); ``process_group`` is Phalanx's."""
        if self._ddp is not None:
            raise RuntimeError("job.ddp() was already called: one DDP model per job")
        if "process_group" in kwargs:
            raise ValueError("job.ddp() chooses the process group; do not pass process_group")
        device = next((p.device for p in module.parameters()), torch.device("cpu"))
        self._local = Group(dist.HashStore(), f"phalanx-ddp-{next(_ids)}", 0, 1, device=device)
        ddp = DistributedDataParallel(module, process_group=self._local.pg, **kwargs)
        ddp.register_comm_hook(self, _bucket_hook)
        # DDP calls it before each forward where it would broadcast the module's buffers
        # from rank 0 (broadcast_buffers=True and the module has buffers): over the generation.
        ddp._register_buffer_comm_hook(self, _buffer_hook, _BufferCommHookLocation.PRE_FORWARD)
        params, _ = ddp._build_params_for_reducer()
        self._param_index = {id(p): i for i, p in enumerate(params)}
        self._ddp = ddp
        return ddp

    def mesh(self, shape: tuple[int, ...], names: tuple[str, ...], device: torch.device) -> DeviceMesh:
        """A ``DeviceMesh`` of ``shape`` whose groups follow the generations
        (:mod:`phalanx.runtime.sharded`); blocks until a plan gives this worker a rank."""
        if self._mesh is not None or self._ddp is not None:
            raise RuntimeError("a job has one job.mesh() or one job.ddp(), and calls it once")
        self._mesh = mesh_for_job(self.job, tuple(shape), tuple(names), device)
        self._mesh.set_guard(StepGuard(self, self._mesh))
        self._device = device
        return self._mesh.device_mesh

    def track(self, **objects: Any) -> None:
        """What moves to a joiner, by name: objects with ``state_dict`` and
        ``load_state_dict`` (model, optimizer, scheduler, sampler, your own).
        An optimizer's ``step`` and a ``torch.amp.GradScaler``'s ``step`` and ``update`` do
        nothing in a failed step; an LR scheduler's is undone."""
        if self.session is not None:
            raise RuntimeError("job.track() must come before job.steps()")
        for name, obj in objects.items():
            if not (
                callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))
            ):
                raise TypeError(
                    f"job.track({name}=...): {type(obj).__name__} has no state_dict/load_state_dict"
                )
        self.tracked.update(objects)

    def checkpoint(self, every: int | None = None) -> None:
        """Save the state every ``every`` committed steps (None: the node policy's) to the
        tiered store, where a job whose members hold nothing resumes from (:mod:`.snapshots`;
        a mesh's: :mod:`.tiered`)."""
        self._every = snapshot_interval(every)

    def steps(
        self, loader: DataLoader[Any], total: int, *, accumulate: bool = False
    ) -> Iterator[tuple[int, Any]]:
        """Yield ``(step, batch)`` until ``total`` optimizer steps are done.

        ``batch`` is this rank's share of the step: the loader's batches that hold the
        job's global batch at the current world size (:func:`~.sampler.per_step`),
        joined into one (:func:`~.sampler.concat`); with ``accumulate=True`` they come
        as :class:`MicroBatches` instead, one forward/backward each (gradient
        accumulation; see the module doc).

        A spare blocks here until a plan gives it a rank; a worker a plan removes
        returns. A step whose collective failed is yielded again after recovery.
        Once the last step is done, the worker leaves the job (``job.close()``).
        """
        if self._ddp is None and self._mesh is None:
            raise RuntimeError(
                "job.steps() needs the model wrapped by job.ddp(model), or a job.mesh(), first"
            )
        sampler = getattr(loader, "sampler", None)
        if not isinstance(sampler, ElasticSampler) or loader.batch_size is None:
            raise TypeError(
                "job.steps() needs a DataLoader(dataset, batch_size=..., sampler=ElasticSampler(dataset)):"
                " a joiner must read exactly the samples of the rank it replaces"
            )
        if total < 0:
            raise ValueError("total must be >= 0")
        data = self._data = StepBatches(loader, sampler)
        self._prepare_tracking(sampler)
        if self._ddp is not None:
            device = next((p.device for p in self._ddp.parameters()), torch.device("cpu"))
            if self._every:  # resumed from by the Session's last resort (its checkpoints=)
                self.snapshots = RotatingSnapshots.of(self.job.job, self._every, self.log, self.tracked)
            store = self.snapshots.checkpoints if self.snapshots is not None else None
            session = self.session = Session(
                self.job, self, device=device, checkpoints=store, gradient_bytes=_gradient_bytes(self._ddp)
            )
        else:
            mesh = self._mesh
            assert mesh is not None
            if self._every:
                self.checkpoints = ShardedCheckpoints(
                    self.job.job, self._every, mesh, self.tracked, self.job.status
                )
            modules = [m for m in self.tracked.values() if isinstance(m, nn.Module)]
            session = self.session = Session(
                self.job,
                self,
                device=self._device,
                position=mesh.position,
                checkpoints=self.checkpoints,
                gradient_bytes=sum(_gradient_bytes(m) for m in modules),
            )
        try:
            session.start(self._restore)
            while session.step < total:
                if session.superseded():
                    session.reconfigure(None, self._restore)
                    continue
                parts = self._batch()
                t0, wall0 = time.perf_counter(), time.time()
                self._prepare_step(session)
                saved = snapshot(self.tracked)
                self.job.status.enter(Phase.COMPUTE)
                self._loss = None
                try:
                    yield session.step, MicroBatches(self, parts) if accumulate else _joined(parts)
                finally:
                    self._in_step = False
                    self.pauses.end()
                failed = self._failed
                if failed is not None:
                    self._vote.drop()
                    self._fence()
                    _roll_back(saved)
                    session.reconfigure(failed, self._restore)
                    continue
                # a collective failed after the update (a metric's): the step stands
                switch, late = self._vote.outcome(session, self._late or self.pauses.failed)
                data.committed(session.world_size, session.plan.batch if session.plan is not None else None)
                loss = None if self._loss is None else float(self._loss)
                session.committed((time.perf_counter() - t0 - self.pauses.seconds) * 1000.0, wall0, loss)
                if self.checkpoints is not None and self.checkpoints.due(session.step) and late is None:
                    late = self.checkpoints.save(session.step, session.rank, session.bounds.backstop_s)
                if self.snapshots is not None:  # a skipped save (None) is the Checkpointer's to report
                    self.snapshots.after_step(session, self.state_dict)
                if late is not None or switch:  # a peer died after the step, or a planned resize
                    session.reconfigure(late, self._restore)
            # A sharded model's full state dict is gathered after the loop: its groups stay.
            session.finish(release=self._mesh is None)
            self.job.close()  # every step is done: this worker leaves the job (goodbye)
        except Removed:
            self.log.warning("removed_from_job", generation=session.generation)
            self.job.close()  # shrunk or reclaimed away: a clean leave, not a fault

    @property
    def step_ok(self) -> bool:
        """Whether the step in flight will commit as far as is known: False once one of
        its collectives failed (then the step is redone after recovery). Read after
        ``backward()`` has returned -- DDP waits there for every bucket's all-reduce --
        it is final for a DDP model: log what the step computed only when it is True,
        or a failed step's figures are logged twice."""
        return self._failed is None

    def report_loss(self, loss: float | torch.Tensor) -> None:
        """This rank's loss of the step in flight, recorded with the step once it is
        committed (``phalanx report`` plots it). A tensor is read (``float()``) only
        then, after the optimizer step, so the call itself does not synchronize; a
        failed step's (:attr:`step_ok` False) is dropped with the step."""
        self._loss = loss.detach() if isinstance(loss, torch.Tensor) else loss

    def on_resize(self, hook: Callable[[int, int, NodePlan], None]) -> None:
        """Call ``hook(old_world, new_world, plan)`` when a new generation has another
        world size (``plan.batch`` says how the job's global batch splits at that size):
        where a user loop re-splits its batch or rescales its learning rate."""
        self._on_resize = hook

    # -- what moves to a joiner (the Session's Stateful) ---------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {
            # a sharded model's DTensors as their local shards: only those move
            "tracked": {name: to_local(obj.state_dict()) for name, obj in self.tracked.items()},
            # the RNG state before the step in flight's batch was fetched (now, if not yet)
            "rng": self._data.rng_of(self.session.step)
            if self._data is not None and self.session is not None
            else rng_state(),
            # the generation's layout; a loaded checkpoint's until _restore adopts it
            "ddp": {"layout": self._source_layout if self._received else self._layout},
            "lr_scale": self.lr_scale,  # what the tracked learning rates carry
        }

    def _fence(self) -> None:  # a save in flight still reads the state
        if self.snapshots is not None:
            self.snapshots.fence()

    def load_state_dict(self, state: dict[str, Any], *, fresh: bool) -> None:
        self._fence()
        tracked = state.get("tracked")
        if not isinstance(tracked, dict) or set(tracked) != set(self.tracked):
            got = sorted(tracked) if isinstance(tracked, dict) else tracked
            raise RecoveryError(f"the peer's state holds {got}, this rank tracks {sorted(self.tracked)}")
        for name, obj in self.tracked.items():
            if fresh and self._data is not None and obj is self._data.sampler:
                continue  # everyone starts the epoch at 0 already
            got = tracked[name]
            if self._mesh is not None:  # the shards back into DTensors laid out like ours
                got = load_shards(obj, got, name)
            obj.load_state_dict(got)
        self.lr_scale = float(state.get("lr_scale", 1.0))
        if not fresh:  # a fresh job keeps each rank's own RNG, as under torchrun
            set_rng_state(state["rng"])
            self._received = True
        try:
            self._source_layout = layout_of(state.get("ddp", {}).get("layout"), len(self._param_index))
        except LayoutError as exc:
            raise RecoveryError(str(exc)) from None

    # -- data ---------------------------------------------------------------------------
    def _restore(self, world_size: int, rank: int) -> None:
        """After a generation is joined: agree on DDP's buckets, then get the batch."""
        session = self.session
        assert session is not None
        old, self._world_seen = self._world_seen, world_size
        _follow_batch_plan(self, world_size, changed=old != world_size)
        if self._on_resize is not None and old and old != world_size and session.plan is not None:
            self._on_resize(old, world_size, session.plan)
        layout = self._source_layout if self._received else self._layout
        if layout is None and self._reducer_used:
            _remake_reducer(self)  # everyone starts over with DDP's first-iteration buckets
        self._layout, self._source_layout = layout, None
        assert self._data is not None
        self._data.rejoin((session.step, world_size, rank), self._received)
        self._received = False
        self._batch(world_size, rank)

    def _batch(self, world_size: int | None = None, rank: int | None = None) -> list[Any]:
        """The loader batches of the session's step for (world_size, rank), the session's
        by default (:class:`~.stepbatches.StepBatches`)."""
        session, data = self.session, self._data
        assert session is not None and data is not None
        world = session.world_size if world_size is None else world_size
        place = (session.step, world, session.rank if rank is None else rank)
        return data.at(place, session.plan.batch if session.plan is not None else None)

    # -- tracking and guards ------------------------------------------------------------
    def _prepare_tracking(self, sampler: ElasticSampler) -> None:
        if not self.tracked and self._ddp is None:
            raise TypeError(
                "with job.mesh(), say what moves to a joiner: job.track(model=..., optimizer=...)"
            )
        if not self.tracked and self._ddp is not None:
            self.tracked = {"model": self._ddp, **find_optimizers(self._ddp)}
            self.log.info("tracked_found", objects=sorted(self.tracked))
        if not any(obj is sampler for obj in self.tracked.values()):
            self.tracked["sampler"] = sampler
        for obj in self.tracked.values():
            if isinstance(obj, torch.optim.Optimizer):
                _guard(self, obj, "step")
            elif isinstance(obj, GradScaler):
                _guard(self, obj, "step")
                _guard(self, obj, "update")

    # -- DDP's buckets --------------------------------------------------------------------
    def _fail(self, err: CommError) -> None:
        if self._failed is None:
            self._failed = err

    def step_bound(self) -> float | None:
        """The bound of the step in flight's collectives (None outside a step)."""
        return self._bound if self._in_step else None

    def _record_bucket(self, bucket: dist.GradBucket) -> None:
        """Note which parameters each bucket holds, until one whole iteration after
        DDP's rebuild has been seen: DDP's own layout from then on."""
        self._buckets[bucket.index()] = [self._param_index[id(p)] for p in bucket.parameters()]
        if bucket.is_last():
            assert self._ddp is not None
            if self._ddp._has_rebuilt_buckets:
                self._physical = [self._buckets[i] for i in sorted(self._buckets)]
                self._recording = False
                if self._layout is None:  # the generation's members rebuild alike
                    self._layout = self._physical
            self._buckets = {}

    def _prepare_step(self, session: Session) -> None:
        """What the hook needs, once per step: the bound, the scale, and whether DDP's
        buckets are the generation's or must be mapped onto them (:mod:`.buckets`)."""
        self._failed, self._hooked, self._in_step = None, False, True
        self._stepped, self._late, self._final = False, None, True
        self.pauses.begin(session.step, session.bounds.floor_s)
        self._vote.drop()
        self._bound = bound = session.collective_bound_s()
        self._scale = 1.0 / session.world_size
        layout = self._layout
        if layout is None or layout == self._physical:
            self._remap = None
        else:
            self._remap = Remap(
                layout, self.job.comm, bound, self._param_index, session.record_collective, self._fail
            )

    def _first_bucket(self, session: Session, point: str = "step") -> None:
        """The first bucket of a step (the first collective, the first reduce-scatter of
        a sharded model's): where ``PHALANX_FAULTS`` strike and, in the job's first
        step, every member passes a barrier first (:meth:`Session.strike`), after which
        the step's collectives have the arrived bound."""
        self._hooked = True
        try:
            broke = session.strike(self._bound, point)
        except CommError as err:  # the generation broke in the barrier
            self.job.comm.release()  # the step's other collectives fail at once
            self._fail(err)
            return
        self._bound = session.collective_bound_s()
        if broke:
            self.job.comm.release()
            self._fail(
                CommError(f"injected: {self.job.worker} broke its communicator in step {session.step}")
            )


def _gradient_bytes(module: nn.Module) -> int:
    """The bytes of ``module``'s trainable parameters (a sharded one's whole tensors):
    at most what one gradient collective of a step moves."""
    return sum(p.numel() * p.element_size() for p in module.parameters() if p.requires_grad)


def _follow_batch_plan(loop: UserLoop, world: int, changed: bool) -> None:
    """The batch the loop's new generation trains and the LR rule's scale for it
    (applied to the tracked learning rates), logged as the Trainer does."""
    session, data = loop.session, loop._data
    assert session is not None and data is not None
    split = session.plan.batch if session.plan is not None else None
    loop.effective_batch, scale = batch_and_scale(split, data.batch_size, world)
    if scale != loop.lr_scale:
        rescale_lrs(loop.tracked.values(), scale / loop.lr_scale)
        loop.lr_scale = scale
    if split is not None and changed:
        loop.log.info(
            "batch_plan",
            world_size=world,
            plan=split.describe(),
            effective_batch=loop.effective_batch,
            lr_scale=loop.lr_scale,
        )


def _joined(parts: list[Any]) -> Any:
    """A step's loader batches as the one batch ``job.steps`` yields without ``accumulate``."""
    return parts[0] if len(parts) == 1 else concat(parts)


def batch_and_scale(split: BatchPlan | None, batch_size: int, world: int) -> tuple[int, float]:
    """The batch a step trains at ``world`` ranks (whole loader batches,
    :func:`~.sampler.per_step`) and the job's LR rule's scale for it: below 1 where the
    plan's cap, or shares that are no whole number of batches, leave the global batch
    unheld (:func:`phalanx.batchplan.lr_scale`, the Trainer's rule).

    >>> from phalanx.batchplan import LrRule, plan_batch
    >>> batch_and_scale(plan_batch(24, 2, micro_batch=2, max_accum=3, lr_rule=LrRule.LINEAR), 2, 2)
    (12, 0.5)
    """
    effective = batch_size * world * per_step(split, batch_size, world)
    return effective, 1.0 if split is None else lr_scale(split.lr_rule, effective, split.global_batch)


def _guard(loop: UserLoop, obj: Any, name: str) -> None:
    """Make ``obj.<name>`` (an optimizer's or a GradScaler's ``step``, a GradScaler's
    ``update``) do nothing while the loop's step in flight has failed (an instance
    attribute: not part of its ``state_dict``)."""
    original = getattr(obj, name)
    if getattr(original, "_phalanx_guarded", False):
        return

    @functools.wraps(original)
    def guarded(*args: Any, **kwargs: Any) -> Any:
        if loop._failed is not None:
            return None
        loop._stepped = True  # a collective failing from now on fails no more than what follows
        return original(*args, **kwargs)

    guarded._phalanx_guarded = True  # type: ignore[attr-defined]
    setattr(obj, name, guarded)


class ResizeVote:
    """One step's planned-resize vote (:meth:`Session.resize_vote`: whether a member
    has seen a newer plan), all-reduced beside the step's gradient all-reduces.

    A DDP step starts it before its first bucket's all-reduce (every member at the same
    point) and reads it after the step: it is done by then, so no collective follows
    the optimizer step. It is a one-float all-reduce of its own, not an element appended
    to a bucket: gloo cuts a buffer into segments by its length, and the segment decides
    the order of each element's sum, so a bucket one element longer rounds some of its
    sums otherwise (whenever its length is a multiple of twice the world size) and the
    loop would no longer be bitwise the plain torchrun script's. A step that started
    none (a sharded model's) all-reduces it when it is read.
    """

    def __init__(self) -> None:
        self._pending: tuple[torch.Tensor, dist.Work] | None = None

    def start(
        self, session: Session, comm: Communicator, bound_s: float, fail: Callable[[CommError], None]
    ) -> None:
        vote = torch.tensor([session.resize_vote()], device=session.device)
        try:
            self._pending = vote, comm.allreduce_work(vote, bound_s)
        except CommError as err:
            fail(err)

    def drop(self) -> None:
        """Forget the vote in flight: its Work holds the group's sockets, and peers
        blocked on a broken group are released only once they close."""
        self._pending = None

    def outcome(self, session: Session, late: CommError | None) -> tuple[bool, CommError | None]:
        """After a step every member completed: whether all switch to the newer (planned)
        generation now. A failure (or ``late``: a collective of the step that failed
        after the update) means a peer died after the gradients were reduced: the step
        stands and recovery follows."""
        pending, self._pending = self._pending, None
        if late is not None:
            return False, late
        try:
            if pending is None:
                vote = torch.tensor([session.resize_vote()], device=session.device)
                session.allreduce_(vote)
            else:
                vote, work = pending
                work.wait()
        except CommError as err:
            return False, err
        except RuntimeError as exc:  # the vote's all-reduce failed in gloo/NCCL
            return False, CommError(f"resize vote failed: {exc}"[:2000])
        return float(vote.item()) > 0, None


def find_optimizers(ddp: DistributedDataParallel) -> dict[str, Any]:
    """The optimizers holding the DDP model's parameters, and their LR schedulers."""
    mine = {id(p) for p in ddp.parameters()}
    live = gc.get_objects()
    opts = [
        o
        for o in live
        if isinstance(o, torch.optim.Optimizer)
        and any(id(p) in mine for g in o.param_groups for p in g["params"])
    ]
    scheds = [o for o in live if isinstance(o, LRScheduler) and any(o.optimizer is x for x in opts)]
    scalers = [o for o in live if isinstance(o, GradScaler) and o.is_enabled()]
    found: dict[str, Any] = {f"optimizer{i or ''}": o for i, o in enumerate(opts)}
    found.update({f"scheduler{i or ''}": s for i, s in enumerate(scheds)})
    found.update({f"scaler{i or ''}": s for i, s in enumerate(scalers)})
    return found


class MicroBatches:
    """One step's micro-batches (``job.steps(loader, total, accumulate=True)``): the
    loader batches this rank trains in the step, as many as hold the job's global batch
    at the current world size. Iterate them once per step, one forward/backward each;
    the backward of every one but the last runs under DDP's ``no_sync`` (the gradients
    add up locally, and the last backward all-reduces the sum), so a script needs no
    ``no_sync`` of its own (one it has is harmless). Divide each loss by ``len()`` for
    the mean over the step's samples, as a torchrun script with accumulation does (the
    short last micro-batch of an epoch then weighs as much as a whole one)."""

    def __init__(self, loop: UserLoop, parts: list[Any]) -> None:
        self._loop, self._parts = loop, parts

    def __len__(self) -> int:
        return len(self._parts)

    def __iter__(self) -> Iterator[Any]:
        loop, last = self._loop, len(self._parts) - 1
        for i, part in enumerate(self._parts):
            loop._final = i == last
            if i == last or loop._ddp is None:  # FSDP2 syncs per its own set_requires_gradient_sync
                yield part
            else:
                with loop._ddp.no_sync():
                    yield part


_GROUP_LRS = ("lr", "initial_lr", "max_lr", "min_lr")
"""Learning rates an optimizer's param group holds (``initial_lr``: every LR scheduler's
start; ``max_lr``/``min_lr``: OneCycleLR's)."""
_SCHEDULER_LRS = ("base_lrs", "_last_lr", "max_lrs", "min_lrs", "eta_min")
"""Learning rates LR schedulers hold as attributes (their base LRs, CyclicLR's peaks,
ReduceLROnPlateau's floors, the cosine schedules' floor)."""


def rescale_lrs(objects: Iterable[Any], factor: float) -> None:
    """Multiply every learning rate the tracked optimizers and LR schedulers hold by
    ``factor``: the current ones and those the schedules are computed from, so a
    schedule keeps its shape at the new scale."""

    def scaled(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            return value.mul_(factor)
        if isinstance(value, list):
            return [scaled(v) for v in value]
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return value * factor
        return value

    for obj in objects:
        if isinstance(obj, torch.optim.Optimizer):
            for group in obj.param_groups:
                for key in _GROUP_LRS:
                    if key in group:
                        group[key] = scaled(group[key])
        elif isinstance(obj, LRScheduler):
            for attr in _SCHEDULER_LRS:
                if hasattr(obj, attr):
                    setattr(obj, attr, scaled(getattr(obj, attr)))


def snapshot(tracked: dict[str, Any]) -> list[tuple[Any, Any]]:
    """What a failed step changes, to put back: the schedulers' state and the
    optimizers' hyperparameters (lr, betas, momentum...); the GradScalers, whose
    ``update`` does nothing then, only forget their ``unscale_`` (:func:`_roll_back`)."""
    saved: list[tuple[Any, Any]] = []
    for obj in tracked.values():
        if isinstance(obj, LRScheduler):
            saved.append((obj, obj.state_dict()))
        elif isinstance(obj, GradScaler):
            saved.append((obj, None))
        elif isinstance(obj, torch.optim.Optimizer):
            saved.append((obj, [{k: v for k, v in g.items() if k != "params"} for g in obj.param_groups]))
    return saved


def _roll_back(saved: list[tuple[Any, Any]]) -> None:
    """Put back what :func:`snapshot` saved. A GradScaler also forgets what the failed
    step's ``unscale_`` noted per optimizer (as its ``update`` does), so the redone
    step may unscale again."""
    for obj, state in saved:
        if isinstance(obj, LRScheduler):
            obj.load_state_dict(state)
        elif isinstance(obj, GradScaler):
            obj._per_optimizer_states = defaultdict(_refresh_per_optimizer_state)
        else:
            for group, hyper in zip(obj.param_groups, state, strict=True):
                group.update(hyper)


def _remake_reducer(loop: UserLoop) -> None:
    """A new reducer for the loop's DDP model, with DDP's first-iteration buckets."""
    ddp = loop._ddp
    assert ddp is not None
    params, sparse = ddp._build_params_for_reducer()
    names = ddp._build_debug_param_to_name_mapping(params)
    ddp._ddp_init_helper(params, sparse, names, ddp.static_graph)
    if ddp.static_graph:
        ddp.reducer._set_static_graph()
        ddp.logger._set_static_graph()  # type: ignore[union-attr]
    dist._register_comm_hook(ddp.reducer, loop, _bucket_hook)
    loop._physical, loop._reducer_used, loop._buckets, loop._recording = None, False, {}, True
    loop.log.info("ddp_buckets_remade")


def _bucket_hook(loop: UserLoop, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP's comm hook: all-reduce this bucket over the generation the job's
    communicator holds (what it needs per step was prepared by
    :meth:`UserLoop._prepare_step`)."""
    buf = bucket.buffer()
    session = loop.session
    if not loop._in_step or session is None:
        raise RuntimeError(
            "backward of a job.ddp() model outside job.steps(): its gradients cannot be reduced"
        )
    loop._reducer_used = True
    if not loop._final:  # a micro-batch's backward that syncs (no no_sync): the last one reduces the sum
        return done(buf)
    if loop._recording:
        loop._record_bucket(bucket)
    comm = loop.job.comm
    if not loop._hooked:
        loop._first_bucket(session)
        if loop._failed is None and comm.configured:
            loop._vote.start(session, comm, loop._bound, loop._fail)
    if bucket.is_last():
        session.enter_collective(loop._bound)
    failed = loop._failed is not None or not comm.configured
    if failed and loop._remap is None:
        return done(buf)
    if loop._scale != 1.0:
        buf.mul_(loop._scale)  # what DDP's own reduction does before its SUM
    if loop._remap is not None:
        return loop._remap.add(bucket, failed=failed)
    start = time.perf_counter()
    try:
        work = comm.allreduce_work(buf, loop._bound)
    except CommError as err:  # the group was destroyed under us, or gloo refused at once
        loop._fail(err)
        return done(buf)

    def settle(fut: torch.futures.Future[list[torch.Tensor]]) -> torch.Tensor:
        try:
            fut.value()
            session.record_collective((time.perf_counter() - start) * 1000.0)
        except Exception as exc:  # never raise into DDP: the step is redone instead
            loop._fail(CommError(f"allreduce on {comm.prefix} failed: {exc}"[:2000]))
        return buf

    return work.get_future().then(settle)


def _buffer_hook(loop: UserLoop, buffers: dict[str, torch.Tensor]) -> None:
    """DDP's buffer hook, before each forward that syncs buffers: the module's buffers
    of the generation's rank 0 into every member's, as DDP's own broadcast does over its
    group. It runs in a step only (outside one there is no generation to agree with);
    a failed broadcast fails the step, and leaves this rank's buffers as they were."""
    session = loop.session
    if not loop._in_step or session is None or loop._failed is not None or session.world_size < 2:
        return
    comm, status = loop.job.comm, loop.job.status
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for b in buffers.values():
        by_dtype.setdefault(b.dtype, []).append(b)
    session.enter_collective(loop._bound)
    try:
        flats = [torch._utils._flatten_dense_tensors(group) for group in by_dtype.values()]
        for flat in flats:
            comm.broadcast_(flat, 0, loop._bound)
    except CommError as err:
        loop._fail(err)
        return
    finally:
        status.enter(Phase.COMPUTE)
    with torch.no_grad():
        for group, flat in zip(by_dtype.values(), flats, strict=True):
            for b, got in zip(group, torch._utils._unflatten_dense_tensors(flat, group), strict=True):
                b.copy_(got)


# DDP checks a hook's annotations as objects; this module's are strings (PEP 563).
_bucket_hook.__annotations__.update(
    {"loop": UserLoop, "bucket": dist.GradBucket, "return": torch.futures.Future[torch.Tensor]}
)


__all__ = [
    "MicroBatches",
    "ResizeVote",
    "UserLoop",
    "batch_and_scale",
    "rescale_lrs",
    "rng_state",
    "set_rng_state",
]
