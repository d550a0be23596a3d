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

How it fits (torchft's shape: DDP on a placeholder group, gradients through a hook):

- ``job.ddp`` builds a real ``DistributedDataParallel`` on a one-rank group of this
  process and registers a comm hook that all-reduces each bucket over the
  session's current generation (SUM of the bucket divided by the world size, as
  DDP's own reduction does it), under the learned per-op timeout. Bucketing and
  the overlap of communication with backward are DDP's own.
- A bucket's all-reduce that fails does not raise: the hook hands back the local
  gradients and marks the step failed. ``opt.step()`` of the tracked optimizers
  does nothing in a failed step (it is guarded), and what the tracked LR
  schedulers' ``step()`` changed is put back (their state and the optimizers'
  hyperparameters), so the body runs to its end without changing any state, and
  :meth:`UserLoop.steps` then recovers (:class:`~phalanx.runtime.session.Session`)
  and yields the same step again: survivors redo it with the batch they hold and
  the RNG state they had after fetching it; a joiner (and a survivor that missed
  the last update) takes the state of the most advanced member and reads its
  batch at the sampler position that came with it.
- What moves: the tracked objects' ``state_dict`` (torch.distributed.checkpoint's
  Stateful protocol), the torch RNG states at the start of the step (before its
  batch was fetched), the sampler's position, and DDP's bucket layout. With
  nothing tracked, the DDP model and the optimizers and LR schedulers holding its
  parameters are found and tracked (logged as ``tracked_found``).
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

The loop is bitwise the plain torchrun script's when the world size is the same
(same sampler order, same reduction, same bucket layouts), and a run with faults
is bitwise its own fault-free run when the joiner takes the lost rank's index.
Limits: one optimizer step per item of ``job.steps`` (gradient accumulation over
several items is not redone as a unit); per-rank RNG streams (a seed that depends
on the rank) cannot be recovered for a lost rank -- the joiner gets the source's;
random draws inside DataLoader worker processes are not reproduced on a joiner;
model buffers are not re-broadcast from rank 0 every forward (``broadcast_buffers``
acts on the one-rank group).
"""

from __future__ import annotations

import functools
import gc
import itertools
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.optim.lr_scheduler import LRScheduler
from torch.utils.data import DataLoader

from phalanx.contract import NodePlan, Phase
from phalanx.runtime.buckets import Layout, LayoutError, Remap, done, layout_of
from phalanx.runtime.comm import CommError, Group
from phalanx.runtime.mesh import Mesh
from phalanx.runtime.rng import rng_state, set_rng_state
from phalanx.runtime.sampler import ElasticSampler, concat, per_step
from phalanx.runtime.session import Member, RecoveryError, Removed, Session
from phalanx.runtime.sharded import StepGuard, load_shards, mesh_for_job
from phalanx.runtime.shards import to_local
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
        self._hooked = False
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
        # Data: the loader, its iterator and the step's batch.
        self._sampler: ElasticSampler | None = None
        self._loader: DataLoader[Any] | None = None
        self._it: Iterator[Any] | None = None
        self._it_at: tuple[int, int, int, int] | None = None  # (epoch, offset, world, rank) of its next batch
        self._rng_before: dict[str, Any] | None = None  # at the start of the step, before its batch
        self._rng_step = -1  # the step _rng_before belongs to
        self._rng_after: dict[str, Any] | None = None  # after the batch was fetched
        self._held: tuple[tuple[int, int, int], Any] | None = None  # ((step, world, rank), batch)
        self._received = False
        self._world_seen = 0
        self._on_resize: Callable[[int, int, NodePlan], None] | None = None
        self._loss: float | torch.Tensor | None = None  # what report_loss() got in the step in flight
        self._every = 0  # job.checkpoint(every=N)
        self.checkpoints: ShardedCheckpoints | None = None

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
        An optimizer's ``step`` does nothing in a failed step; an LR scheduler's is undone."""
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

    def checkpoint(self, every: int) -> None:
        """Save the tracked state every ``every`` steps to the tiered store, where a job
        that loses every replica of a shard resumes from (:mod:`phalanx.runtime.tiered`)."""
        if type(every) is not int or every < 1:
            raise ValueError(f"job.checkpoint(every=...) needs an int >= 1, got {every!r}")
        self._every = every

    def steps(self, loader: DataLoader[Any], total: int) -> Iterator[tuple[int, Any]]:
        """Yield ``(step, batch)`` until ``total`` optimizer steps are done.

        A spare blocks here until a plan gives it a rank; a worker a plan removes
        returns. A step whose collective failed is yielded again after recovery.
        Once the last step is done, the worker leaves the job (``job.close()``).
        """
        if self._ddp is None and self._mesh is None:
            raise RuntimeError(
                "job.steps() needs the model wrapped by job.ddp(model), or a job.mesh(), first"
            )
        if self._every and self._mesh is None:
            raise TypeError("job.checkpoint() is for a job.mesh() job (a DDP job's state is on every rank)")
        sampler = getattr(loader, "sampler", None)
        if not isinstance(sampler, ElasticSampler) or loader.batch_size is None:
            raise TypeError(
                "job.steps() needs a DataLoader(dataset, batch_size=..., sampler=ElasticSampler(dataset)):"
                " a joiner must read exactly the samples of the rank it replaces"
            )
        if total < 0:
            raise ValueError("total must be >= 0")
        self._sampler, self._loader = sampler, loader
        self._prepare_tracking()
        if self._ddp is not None:
            device = next((p.device for p in self._ddp.parameters()), torch.device("cpu"))
            session = self.session = Session(self.job, self, device=device)
        else:
            mesh = self._mesh
            assert mesh is not None
            if self._every:
                self.checkpoints = ShardedCheckpoints(
                    self.job.job, self._every, mesh, self.tracked, self.job.status
                )
            session = self.session = Session(
                self.job, self, device=self._device, position=mesh.position, checkpoints=self.checkpoints
            )
        try:
            session.start(self._restore)
            while session.step < total:
                if session.superseded():
                    session.reconfigure(None, self._restore)
                    continue
                batch = self._batch()
                t0, wall0 = time.perf_counter(), time.time()
                self._prepare_step(session)
                saved = snapshot(self.tracked)
                self.job.status.enter(Phase.COMPUTE)
                self._loss = None
                try:
                    yield session.step, batch
                finally:
                    self._in_step = False
                failed = self._failed
                if failed is not None:
                    _roll_back(saved)
                    session.reconfigure(failed, self._restore)
                    continue
                # a collective failed after the update (a metric's): the step stands
                switch, late = (False, self._late) if self._late else self._vote(session)
                self._held = None
                sampler.advance(loader.batch_size * session.world_size * self._per_step(session.world_size))
                loss = None if self._loss is None else float(self._loss)
                session.committed((time.perf_counter() - t0) * 1000.0, wall0, loss)
                if self.checkpoints is not None and self.checkpoints.due(session.step) and late is None:
                    late = self.checkpoints.save(session.step, session.rank, session.bounds.backstop_s)
                if late is not None or switch:  # a peer died after the step, or a planned resize
                    session.reconfigure(late, self._restore)
            # A sharded model's full state dict is gathered after the loop: its groups stay.
            session.finish(release=self._mesh is None)
            self.job.close()  # every step is done: this worker leaves the job (goodbye)
        except Removed:
            self.log.warning("removed_from_job", generation=session.generation)
            self.job.close()  # shrunk or reclaimed away: a clean leave, not a fault

    def _vote(self, session: Session) -> tuple[bool, CommError | None]:
        """After a step every member completed: agree whether to switch to a newer
        (planned) generation now. One float all-reduced; a failure here means a peer
        died after the gradients were reduced, so this step stands and recovery follows."""
        vote = torch.tensor([session.resize_vote()], device=session.device)
        try:
            session.allreduce_(vote)
        except CommError as err:
            return False, err
        return float(vote.item()) > 0, None

    def report_loss(self, loss: float | torch.Tensor) -> None:
        """This rank's loss of the step in flight, recorded with the step once it is
        committed (``phalanx report`` plots it). A tensor is read (``float()``) only
        then, after the optimizer step, so the call itself does not synchronize."""
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
            "rng": self._rng_before
            if self.session is not None and self._rng_step == self.session.step
            else rng_state(),
            "ddp": {"layout": self._layout},
        }

    def load_state_dict(self, state: dict[str, Any], *, fresh: bool) -> None:
        tracked = state.get("tracked")
        if not isinstance(tracked, dict) or set(tracked) != set(self.tracked):
            got = sorted(tracked) if isinstance(tracked, dict) else tracked
            raise RecoveryError(f"the peer's state holds {got}, this rank tracks {sorted(self.tracked)}")
        for name, obj in self.tracked.items():
            if fresh and obj is self._sampler:
                continue  # everyone starts the epoch at 0 already
            got = tracked[name]
            if self._mesh is not None:  # the shards back into DTensors laid out like ours
                got = load_shards(obj, got, name)
            obj.load_state_dict(got)
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
        if self._on_resize is not None and old and old != world_size and session.plan is not None:
            self._on_resize(old, world_size, session.plan)
        layout = self._source_layout if self._received else self._layout
        if layout is None and self._reducer_used:
            _remake_reducer(self)  # everyone starts over with DDP's first-iteration buckets
        self._layout = layout
        self._source_layout = None
        key = (session.step, world_size, rank)
        held = self._held
        if self._received or held is None or held[0] != key:
            self._held = None
            if not self._received and held is not None and held[0][0] == key[0] and self._rng_before:
                set_rng_state(self._rng_before)  # the same step at a new place: read it afresh
        elif self._rng_after is not None:
            set_rng_state(self._rng_after)  # redo with the batch in hand, as it was drawn
        self._received = False
        self._batch(world_size, rank)

    def _per_step(self, world: int) -> int:
        plan = self.session.plan if self.session is not None else None
        return per_step(
            plan.batch if plan is not None else None,
            self._loader.batch_size or 0 if self._loader else 0,
            world,
        )

    def _batch(self, world_size: int | None = None, rank: int | None = None) -> Any:
        """The batch of the session's step for (world_size, rank) (the session's by
        default): the one held if it is for this very step and place, else the next
        one of an iterator placed at the sampler's position."""
        session, sampler, loader = self.session, self._sampler, self._loader
        assert session is not None and sampler is not None and loader is not None
        batch_size = loader.batch_size or 0
        world = session.world_size if world_size is None else world_size
        rank = session.rank if rank is None else rank
        key = (session.step, world, rank)
        if self._held is not None and self._held[0] == key:
            return self._held[1]
        self._rng_before, self._rng_step = rng_state(), session.step
        for _ in range(2):  # at most one epoch boundary before a batch
            where = (sampler.epoch, sampler.offset, world, rank)
            if self._it is None or self._it_at != where:
                # An iterator serves only the position right after its last batch.
                sampler.place(epoch=sampler.epoch, offset=sampler.offset, world=world, rank=rank)
                if sampler.offset == 0:
                    self._it = iter(loader)  # an epoch begins: it draws its seed, as under torchrun
                else:  # placed mid-epoch: the draw the epoch's start made is in the RNG state already
                    rng = torch.get_rng_state()
                    self._it = iter(loader)
                    torch.set_rng_state(rng)
            try:
                parts = [next(self._it)]
                break
            except StopIteration:
                sampler.place(epoch=sampler.epoch + 1, offset=0, world=world, rank=rank)
                self._it = None
        else:
            raise RuntimeError(
                f"the DataLoader yields nothing in epoch {sampler.epoch} at world size {world}"
            )
        for _ in range(self._per_step(world) - 1):  # a shrunk job holding its global batch
            part = next(self._it, None)
            if part is None:
                break  # the epoch's end: a short step, as the fixed-size run's last one
            parts.append(part)
        batch = parts[0] if len(parts) == 1 else concat(parts)
        done = batch_size * world * len(parts)
        self._it_at = (sampler.epoch, min(sampler.size, sampler.offset + done), world, rank)
        self._rng_after = rng_state()
        self._held = (key, batch)
        return batch

    # -- tracking and guards ------------------------------------------------------------
    def _prepare_tracking(self) -> None:
        assert self._sampler is not None
        if not self.tracked and self._ddp is None:
            raise TypeError(
                "with job.mesh(), say what moves to a joiner: job.track(model=..., optimizer=...)"
            )
        if not self.tracked and self._ddp is not None:
            self.tracked = {"model": self._ddp, **find_optimizers(self._ddp)}
            self.log.info("tracked_found", objects=sorted(self.tracked))
        if not any(obj is self._sampler for obj in self.tracked.values()):
            self.tracked["sampler"] = self._sampler
        for obj in self.tracked.values():
            if isinstance(obj, torch.optim.Optimizer):
                self._guard(obj)

    def _guard(self, obj: torch.optim.Optimizer) -> None:
        """Make the optimizer's ``step`` do nothing while the step in flight has failed
        (an instance attribute: not part of its ``state_dict``)."""
        original = obj.step
        if getattr(original, "_phalanx_guarded", False):
            return

        @functools.wraps(original)
        def step(*args: Any, **kwargs: Any) -> Any:
            if self._failed is not None:
                return None
            self._stepped = True  # a collective failing from now on fails no more than what follows
            return original(*args, **kwargs)

        step._phalanx_guarded = True  # type: ignore[attr-defined]
        obj.step = step  # type: ignore[method-assign]

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
        self._stepped, self._late = False, None
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
        a sharded model's): where ``PHALANX_FAULTS`` strike (:meth:`Session.strike`)."""
        self._hooked = True
        if session.strike(self._bound, point):
            self.job.comm.release()
            self._fail(
                CommError(f"injected: {self.job.worker} broke its communicator in step {session.step}")
            )


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
    found: dict[str, Any] = {f"optimizer{i or ''}": o for i, o in enumerate(opts)}
    found.update({f"scheduler{i or ''}": s for i, s in enumerate(scheds)})
    return found


def snapshot(tracked: dict[str, Any]) -> list[tuple[Any, Any]]:
    """What a failed step's scheduler steps change, to put back: the schedulers'
    state and the optimizers' hyperparameters (lr, betas, momentum...)."""
    saved: list[tuple[Any, Any]] = []
    for obj in tracked.values():
        if isinstance(obj, LRScheduler):
            saved.append((obj, obj.state_dict()))
        elif isinstance(obj, torch.optim.Optimizer):
            saved.append((obj, [{k: v for k, v in g.items() if k != "params"} for g in obj.param_groups]))
    return saved


def _roll_back(saved: list[tuple[Any, Any]]) -> None:
    """Put back what :func:`snapshot` saved (a failed step's scheduler steps)."""
    for obj, state in saved:
        if isinstance(obj, LRScheduler):
            obj.load_state_dict(state)
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
    if loop._recording:
        loop._record_bucket(bucket)
    if not loop._hooked:
        loop._first_bucket(session)
    if bucket.is_last():
        session.enter_collective(loop._bound)
    comm = loop.job.comm
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


# DDP checks a hook's annotations as objects; this module's are strings (PEP 563).
_bucket_hook.__annotations__.update(
    {"loop": UserLoop, "bucket": dist.GradBucket, "return": torch.futures.Future[torch.Tensor]}
)


__all__ = ["UserLoop", "rng_state", "set_rng_state"]
