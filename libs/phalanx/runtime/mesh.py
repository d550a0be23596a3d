"""A ``DeviceMesh`` whose process groups follow the job's generations (FSDP2, HSDP).

FSDP2 (``fully_shard``) and DTensor keep the process groups of the mesh they
were given for their whole life. So the groups Phalanx hands them are
long-lived objects, :class:`MeshGroup` (a ``torch.distributed.ProcessGroup``
subclass, the shape of torchft's reconfigurable process group), and each
generation re-points them at its real groups: the job's
:class:`~phalanx.runtime.comm.Communicator` builds, with every generation, one
gloo (or NCCL) group per mesh dimension (:meth:`Communicator.set_mesh`), and
:class:`Mesh` points each :class:`MeshGroup` at the one of its dimension.

Two ways reach a group, and both follow the generation:

- Python calls (FSDP2's all-gather, reduce-scatter and all-reduce go through
  ``torch.distributed``'s functions, which call the group object's methods) reach
  the :class:`MeshGroup`'s methods.
- Functional collectives (DTensor's redistributions: ``full_tensor()``, a
  ``clip_grad_norm_`` over DTensor gradients) find a group by its name in torch's
  C++ registry (as ``DeviceMesh.get_group`` does), where the name is the
  :class:`MeshGroup`'s, and torch's C++ calls its Python methods (the
  ``ProcessGroup`` trampoline: ``allreduce``, ``all_gather_single_coalesced``,
  ``reduce_scatter_tensor_coalesced``...).

Either way the :class:`MeshGroup` runs the op on the generation's group under
the step's bound (:class:`Guard`).

A collective that fails inside a step does not raise into the user's code: the
guard marks the step failed (the loop redoes it after recovery, as for DDP's
gradient hook) and every group of the mesh is pointed at a group of torch's
``FakeProcessGroup`` backend, on which every later collective of the step
completes at once and leaves its output alone. The body of the step so runs to
its end on garbage, changes no state (the optimizer's ``step`` is skipped in a
failed step) and the loop recovers.

The mesh's ranks are the plan's: rank ``r`` sits at ``unravel(r, shape)``
(row-major, as ``torch.arange(world).view(shape)``), so with ``(replicate,
shard)`` the members of replica group ``g`` are ``g*S .. g*S+S-1``. A joiner
takes the lost rank's index, so its coordinates; a rank whose coordinates along
the non-replicated dimensions would change cannot keep its shards (FSDP2 split
its parameters by them when the model was wrapped), and the session refuses
such a generation.

``torch.distributed``'s default group is a :class:`MeshGroup` over the whole
generation (DeviceMesh and DCP ask it for this process's rank), registered
through ``init_process_group`` with a backend of Phalanx's own.
"""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import AllgatherOptions, FakeProcessGroup
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.distributed_c10d import GroupName, _register_process_group

from phalanx.runtime.comm import CommError, Communicator, Group

BACKEND = "phalanx"
_ids = itertools.count()


class Guard(Protocol):
    """What a :class:`MeshGroup` asks of the loop around each collective."""

    def collective_bound_s(self) -> float | None:
        """The bound of the next collective; None outside a step (failures raise)."""
        ...

    def collective_started(self, bound_s: float, what: str) -> None:
        """A collective of the step (``what``: ``all_gather``, ``reduce_scatter``...) is
        about to start (fault injection, heartbeats)."""
        ...

    def collective_done(self, ms: float) -> None: ...

    def collective_failed(self, err: CommError) -> None:
        """A collective of the step failed: the step is redone after recovery."""
        ...


def _fake_pg(rank: int, size: int) -> dist.ProcessGroup:
    """A group on which every collective completes at once, its output untouched."""
    pg = dist.ProcessGroup(dist.HashStore(), rank, size)
    backend = FakeProcessGroup._create_internal(rank, size)  # type: ignore[attr-defined]
    pg._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.CUSTOM, backend)
    if torch.cuda.is_available():
        pg._register_backend(torch.device("cuda"), dist.ProcessGroup.BackendType.CUSTOM, backend)
    pg._set_default_backend(dist.ProcessGroup.BackendType.CUSTOM)
    return pg


class _Done(dist.Work):
    """A completed ``Work``: what a collective of a failed step returns."""

    def __init__(self, result: Any = None) -> None:
        super().__init__()
        self._result = result

    def wait(self, timeout: Any = None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True

    def is_success(self) -> bool:
        return True

    def get_future(self) -> torch.futures.Future[Any]:
        fut: torch.futures.Future[Any] = torch.futures.Future()
        fut.set_result(self._result)
        return fut


class _Guarded(dist.Work):
    """A collective in flight: its failure is the step's, never the caller's."""

    def __init__(self, work: dist.Work, group: MeshGroup, what: str, start: float) -> None:
        super().__init__()
        self._work: dist.Work | None = work
        self._group, self._what, self._start = group, what, start

    def wait(self, timeout: Any = None) -> bool:
        work, self._work = self._work, None
        if work is None:
            return True
        try:
            work.wait()
        except Exception as exc:
            self._group._failed(self._what, exc)
            return True
        self._group._done(self._start)
        return True

    def is_completed(self) -> bool:
        return self._work is None or self._work.is_completed()

    def is_success(self) -> bool:
        return True

    def get_future(self) -> torch.futures.Future[Any]:
        self.wait()
        return _Done().get_future()


class MeshGroup(dist.ProcessGroup):
    """One dimension's process group, for the process's whole life; :meth:`point`
    re-points it at a generation's group (see the module doc)."""

    def __init__(self, name: str, rank: int, size: int) -> None:
        """``rank`` and ``size``: this process's place along the dimension, which FSDP2
        reads when it wraps a model (before any generation is joined)."""
        super().__init__(rank, size)  # type: ignore[call-arg]  # rank and size are the methods below
        self._name = GroupName(name)
        self._size = size
        self._rank = rank
        self._pg: dist.ProcessGroup = _fake_pg(0, size)
        self.guard: Guard | None = None
        _register_process_group(self._name, self)  # what DeviceMesh and funcol resolve

    # -- what torch asks of a group ----------------------------------------------------
    @property
    def group_name(self) -> GroupName:  # type: ignore[override]
        return self._name

    def _set_group_name(self, name: str) -> None:  # init_process_group names it; it has its name
        pass

    def _set_group_desc(self, desc: str) -> None:
        pass

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._size

    def getBackendName(self) -> str:
        return BACKEND

    def name(self) -> str:
        return BACKEND

    # -- generations -------------------------------------------------------------------
    def point(self, group: Group | None) -> None:
        """Run every collective from now on on ``group`` (None: on nothing -- each
        completes at once; the generation is over)."""
        if group is None:
            self._pg = _fake_pg(self._rank, self._size)
        else:
            self._pg, self._rank, self._size = group.pg, group.rank, group.world_size

    def _failed(self, what: str, exc: BaseException) -> None:
        err = exc if isinstance(exc, CommError) else CommError(f"{what} on {self._name} failed: {exc}"[:2000])
        guard = self.guard
        if guard is None or guard.collective_bound_s() is None:
            raise err
        guard.collective_failed(err)

    def _done(self, start: float) -> None:
        if self.guard is not None:
            self.guard.collective_done((time.perf_counter() - start) * 1000.0)

    def _run(self, what: str, call: Callable[[dist.ProcessGroup], dist.Work], opts: Any = None) -> dist.Work:
        guard = self.guard
        bound = guard.collective_bound_s() if guard is not None else None
        if bound is not None and guard is not None:
            guard.collective_started(bound, what)
            bound = guard.collective_bound_s() or bound  # the job's first: past its barrier
            if opts is not None and hasattr(opts, "timeout"):
                opts.timeout = timedelta(seconds=bound)
        start = time.perf_counter()
        try:
            work = call(self._pg)
        except Exception as exc:
            self._failed(what, exc)
            return _Done()
        if bound is None:
            return work
        return _Guarded(work, self, what, start)

    # -- the collectives (torch.distributed's functions call these) ---------------------
    def allreduce(self, tensors: Any, opts: Any = None) -> dist.Work:  # type: ignore[override]
        opts = _opts(opts, dist.AllreduceOptions)
        return self._run("allreduce", lambda pg: pg.allreduce(tensors, opts), opts)

    def allreduce_coalesced(self, tensors: Any, opts: Any = None) -> dist.Work:  # type: ignore[override]
        opts = _opts(opts, dist.AllreduceCoalescedOptions)
        return self._run("allreduce_coalesced", lambda pg: pg.allreduce_coalesced(tensors, opts), opts)

    def all_gather_single(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> dist.Work:
        opts = _opts(opts, AllgatherOptions)
        return self._run("all_gather", lambda pg: pg.all_gather_single(output, input, opts), opts)

    def all_gather_single_coalesced(self, outputs: Any, inputs: Any, opts: Any = None) -> dist.Work:
        opts = _opts(opts, AllgatherOptions)
        return self._run(
            "all_gather_coalesced", lambda pg: pg.all_gather_single_coalesced(outputs, inputs, opts), opts
        )

    def allgather(self, outputs: Any, inputs: Any, opts: Any = None) -> dist.Work:  # type: ignore[override]
        opts = _opts(opts, AllgatherOptions)
        return self._run("allgather", lambda pg: pg.allgather(outputs, inputs, opts), opts)

    def reduce_scatter_single(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> dist.Work:
        opts = _opts(opts, dist.ReduceScatterOptions)
        return self._run("reduce_scatter", lambda pg: pg.reduce_scatter_single(output, input, opts), opts)

    def reduce_scatter_single_coalesced(self, outputs: Any, inputs: Any, opts: Any = None) -> dist.Work:
        opts = _opts(opts, dist.ReduceScatterOptions)
        return self._run(
            "reduce_scatter_coalesced",
            lambda pg: pg.reduce_scatter_single_coalesced(outputs, inputs, opts),
            opts,
        )

    def allgather_into_tensor_coalesced(self, outputs: Any, inputs: Any, opts: Any = None) -> dist.Work:
        opts = _opts(opts, AllgatherOptions)
        return self._run(
            "all_gather_coalesced", lambda pg: pg.allgather_into_tensor_coalesced(outputs, inputs, opts), opts
        )

    def reduce_scatter_tensor_coalesced(self, outputs: Any, inputs: Any, opts: Any = None) -> dist.Work:
        opts = _opts(opts, dist.ReduceScatterOptions)
        return self._run(
            "reduce_scatter_coalesced",
            lambda pg: pg.reduce_scatter_tensor_coalesced(outputs, inputs, opts),
            opts,
        )

    def all_to_all_single(
        self, output: torch.Tensor, input: torch.Tensor, out_splits: Any, in_splits: Any, opts: Any = None
    ) -> dist.Work:
        opts = _opts(opts, dist.AllToAllOptions)
        return self._run(
            "all_to_all", lambda pg: pg.all_to_all_single(output, input, out_splits, in_splits, opts), opts
        )

    def alltoall(self, outputs: Any, inputs: Any, opts: Any = None) -> dist.Work:  # type: ignore[override]
        opts = _opts(opts, dist.AllToAllOptions)
        return self._run("alltoall", lambda pg: pg.alltoall(outputs, inputs, opts), opts)

    def reduce_scatter(self, outputs: Any, inputs: Any, opts: Any = None) -> dist.Work:  # type: ignore[override]
        opts = _opts(opts, dist.ReduceScatterOptions)
        return self._run("reduce_scatter", lambda pg: pg.reduce_scatter(outputs, inputs, opts), opts)

    def broadcast(self, tensors: Any, opts: Any = None) -> dist.Work:  # type: ignore[override]
        opts = _opts(opts, dist.BroadcastOptions)
        return self._run("broadcast", lambda pg: pg.broadcast(tensors, opts), opts)

    def barrier(self, opts: Any = None) -> dist.Work:  # type: ignore[override]
        opts = _opts(opts, dist.BarrierOptions)
        return self._run("barrier", lambda pg: pg.barrier(opts), opts)

    def gather(self, outputs: Any, inputs: Any, opts: Any = None) -> dist.Work:  # type: ignore[override]
        opts = _opts(opts, dist.GatherOptions)
        return self._run("gather", lambda pg: pg.gather(outputs, inputs, opts), opts)

    def scatter(self, outputs: Any, inputs: Any, opts: Any = None) -> dist.Work:  # type: ignore[override]
        opts = _opts(opts, dist.ScatterOptions)
        return self._run("scatter", lambda pg: pg.scatter(outputs, inputs, opts), opts)

    def send(self, tensors: Any, dst: int, tag: int = 0) -> dist.Work:  # type: ignore[override]
        return self._run("send", lambda pg: pg.send(tensors, dst, tag))

    def recv(self, tensors: Any, src: int, tag: int = 0) -> dist.Work:  # type: ignore[override]
        return self._run("recv", lambda pg: pg.recv(tensors, src, tag))


def _opts(opts: Any, kind: type) -> Any:
    return kind() if opts is None else opts


class Mesh:
    """The job's device mesh: one :class:`MeshGroup` per dimension plus the default
    group, re-pointed at every generation of ``comm`` (see the module doc).

    >>> mesh = Mesh(comm, (2, 2), ("replicate", "shard"), rank=3, device_type="cpu")
    >>> fully_shard(model, mesh=mesh.device_mesh)
    """

    def __init__(
        self,
        comm: Communicator,
        shape: tuple[int, ...],
        names: tuple[str, ...],
        *,
        rank: int,
        device_type: str,
    ) -> None:
        if len(shape) != len(names) or len(set(names)) != len(names):
            raise ValueError(f"mesh {shape} needs one distinct name per dimension, got {names}")
        world = math.prod(shape)
        if not 0 <= rank < world:
            raise ValueError(f"rank {rank} is outside the mesh {shape}")
        self.shape, self.names, self.rank = tuple(shape), tuple(names), rank
        self.coords = tuple(int(c) for c in torch.unravel_index(torch.tensor(rank), shape))
        tag = f"phalanx-{comm.worker}-{next(_ids)}"
        self.world = MeshGroup(f"{tag}-world", rank, world)
        self.groups = [
            MeshGroup(f"{tag}-{name}", coord, size)
            for name, coord, size in zip(names, self.coords, shape, strict=True)
        ]
        self._comm = comm
        _init_default_group(self.world, rank, world)
        mesh = DeviceMesh(
            device_type,
            torch.arange(world).view(shape),
            mesh_dim_names=self.names,
            _init_backend=False,
            _rank=rank,
        )
        mesh._dim_group_names = [g.group_name for g in self.groups]
        for group in self.groups:
            mesh._pg_registry[group.group_name] = group
        self.device_mesh = mesh
        # replica groups come and go with the generations (the first dimension, when
        # there are two or more); a 1-D mesh is one group of shards
        comm.set_mesh((-1, *self.shape[1:]) if len(self.shape) > 1 else self.shape)
        comm.on_change(self._follow)
        self._follow(comm)

    @property
    def group_size(self) -> int:
        return group_size_of(self.shape)

    def position(self, rank: int) -> tuple[int, ...]:
        """What a rank holds, at whatever world size: its coordinates past the first
        (replicated) dimension (a 1-D mesh: its rank). Members at the same position
        hold the same shards."""
        if len(self.shape) == 1:
            return (rank,)
        return tuple(
            int(c) for c in torch.unravel_index(torch.tensor(rank % self.group_size), self.shape[1:])
        )

    def set_guard(self, guard: Guard | None) -> None:
        for group in (self.world, *self.groups):
            group.guard = guard

    def fail(self) -> None:
        """The step failed: every collective until the next generation completes at once."""
        for group in (self.world, *self.groups):
            group.point(None)

    def _follow(self, comm: Communicator) -> None:
        if not comm.configured:
            self.fail()
            return
        self.world.point(comm.held())
        for dim, group in enumerate(self.groups):
            group.point(comm.line(dim))


def group_size_of(shape: tuple[int, ...]) -> int:
    """Ranks per replica group of a mesh: its size past the first (replicated)
    dimension; a 1-D mesh is all one group (plain FSDP)."""
    return math.prod(shape[1:]) if len(shape) > 1 else shape[0]


def _init_default_group(world: MeshGroup, rank: int, size: int) -> None:
    """``torch.distributed``'s default group: ``world`` (DeviceMesh and DCP ask it for
    this process's rank and the world size)."""
    if dist.is_initialized():
        raise RuntimeError(
            "torch.distributed is initialized already: with job.mesh() Phalanx provides the process groups"
            " (remove init_process_group)"
        )
    dist.Backend.register_backend(BACKEND, lambda *args: world, devices=["cpu", "cuda"])
    dist.init_process_group(BACKEND, store=dist.HashStore(), rank=rank, world_size=size)


__all__ = ["BACKEND", "Guard", "Mesh", "MeshGroup", "group_size_of"]
