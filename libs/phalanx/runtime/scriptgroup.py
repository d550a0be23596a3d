"""An unmodified script's default process group, observed: its collectives seen and
counted, and its rank judged by the detector like any other.

``phalanx run`` gives a torchrun script's ``init_process_group("gloo")`` a
:class:`ObservedGroup` in place of torch's group: the same ``ProcessGroupGloo``,
built from the same store, ranks and timeout as torch builds it, registered on a
``ProcessGroup`` subclass whose collectives (the ones DDP's reducer, FSDP and the
``torch.distributed`` functions call) note entering and leaving in the rank's
status and then run torch's own dispatch to that backend. The tensors, the
backend and the order of operations are torch's, so a script's results are
bitwise those it gets under torchrun; ``dist.get_backend()`` still says ``gloo``.
A collective this class does not list runs unobserved on the same backend.

What the rank then reports (:class:`ScriptActivity`): ``COLLECTIVE``, counted
per step (``op``, as the own-loop runtime counts them), while a collective of the
group is in flight; outside them ``RUNNING`` while the script's main thread moves
and ``COMPUTE`` from the moment it stood still (:mod:`phalanx.worker.stillness`:
the same frames and no file I/O by the process or its children for
:data:`STILL_S`). So the detector's straggler rule finds a rank that spins,
deadlocks or waits on a stuck device while its peers wait in a collective of the
same step (judged by their pace, the 1.5 s floor), and an evaluation pass or
``torch.save`` rank 0 runs alone while the others wait is never judged: it moves.

A collective's bound, as the rank reports it, is what its bytes take once every
member is inside: :func:`~phalanx.runtime.bounds.moving_s` of the bytes in flight
(``PHALANX_COLLECTIVE_INSIDE_FLOOR_MS``, 1 s, plus twice the bytes at 100 MiB/s: a
collective every member is inside waits for nothing else), never more than the
script's own timeout. The detector does not judge a rank by it while any peer is
outside that collective (a peer evaluating alone is waited for, as the script's
timeout allows); once every member is inside past it, the collective is wedged and
the same members restart in place (``collective_wedged``), seconds after the hang
instead of the script's timeout. The ops themselves are not bounded: the script's
timeout means what it meant.

Only a plain ``"gloo"`` group (or no backend named, on a machine without CUDA) is
observed: an NCCL script's group is torch's own, its ranks report ``RUNNING``,
and a stop or crash is what is found there.
"""

from __future__ import annotations

import ctypes
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from phalanx.contract import Phase
from phalanx.runtime.bounds import moving_s
from phalanx.runtime.faults import FaultPlan
from phalanx.worker.status import RankStatus
from phalanx.worker.stillness import Stillness

PLUGIN = "phalanx_gloo"
STILL_S = 0.5
"""How long the main thread must stand still before the rank reports ``COMPUTE``:
a few samples, so a native op of a normal step (a matmul, an optimizer step) does not
flip the phase at every heartbeat."""
SAMPLE_S = 0.1


class ScriptActivity:
    """The rank's phase, from its default group's collectives and its main thread (the
    module doc). ``entered`` is called in the thread that starts a collective,
    ``left`` wherever it completes (gloo's threads), the sampler ticks on its own."""

    def __init__(
        self,
        status: RankStatus,
        *,
        still_s: float = STILL_S,
        floor_s: float = 1.0,
        stillness: Stillness | None = None,
    ) -> None:
        self.status = status
        self.still_s = still_s
        self.floor_s = floor_s
        self.timeout_s = 1800.0  # torch's default process-group timeout, until the group says
        self._stillness = stillness or Stillness()
        self._lock = threading.Lock()
        self._in_flight = 0
        self._bytes = 0
        self._stop = threading.Event()
        self._started = False

    def entered(self, nbytes: int = 0) -> None:
        """A collective moving ``nbytes`` started: the rank is in ``COLLECTIVE``, bounded by
        what every byte in flight takes once every member is inside (the module doc)."""
        with self._lock:
            self._in_flight += 1
            self._bytes += nbytes
            self.status.enter_collective(min(moving_s(self.floor_s, self._bytes), self.timeout_s))

    def left(self, nbytes: int = 0) -> None:
        with self._lock:
            self._in_flight -= 1
            self._bytes -= nbytes
            if self._in_flight <= 0:
                self._in_flight = self._bytes = 0
                self.status.enter(Phase.RUNNING)
                self._stillness.reset()

    def tick(self, now: float | None = None) -> None:
        """One sample of the main thread: ``COMPUTE`` (since it stood still) or ``RUNNING``."""
        now = time.monotonic() if now is None else now
        with self._lock:
            if self._in_flight:
                return
            since = self._stillness.sample(now)
            status = self.status
            if since is not None and now - since >= self.still_s:
                if status.phase is not Phase.COMPUTE:
                    status.phase_since, status.phase = since, Phase.COMPUTE
            elif status.phase is Phase.COMPUTE:
                status.enter(Phase.RUNNING)

    def start(self, interval_s: float = SAMPLE_S) -> ScriptActivity:
        """Sample the main thread every ``interval_s`` from now on (once: a script that
        builds its group again keeps the one sampler)."""
        with self._lock:
            if self._started:
                return self
            self._started = True

        def run() -> None:
            while not self._stop.wait(interval_s):
                self.tick()

        threading.Thread(target=run, name="phalanx-stillness", daemon=True).start()
        return self

    def stop(self) -> None:
        self._stop.set()


def _observed(name: str, *, strikes: bool = False) -> Callable[..., dist.Work]:
    """``ProcessGroup.<name>`` of the group's ``inner`` one, noted in its activity from
    its call to its completion; ``strikes``: the faults set for the step strike first.
    (The base class's method on ``self`` would call this override again: pybind
    dispatches it virtually.)"""
    base = getattr(dist.ProcessGroup, name)

    def op(self: ObservedGroup, *args: Any, **kwargs: Any) -> dist.Work:
        activity = self.activity
        if strikes:
            self.before()
        nbytes = _nbytes(args)
        activity.entered(nbytes)
        try:
            work = base(self.inner, *args, **kwargs)
        except BaseException:
            activity.left(nbytes)
            raise
        # gloo's worker thread runs the callback: it holds the activity, not the group
        work.get_future().add_done_callback(lambda _: activity.left(nbytes))
        return work

    op.__name__ = name
    return op


def _nbytes(args: Any) -> int:
    """The bytes of the tensors among a collective's arguments (lists of them too)."""
    n = 0
    for a in args:
        if isinstance(a, torch.Tensor):
            n += a.numel() * a.element_size()
        elif isinstance(a, list | tuple):
            n += _nbytes(a)
    return n


class ObservedGroup(dist.ProcessGroup):
    """A ``ProcessGroup`` on one gloo backend whose collectives tell ``activity`` (the
    module doc). Each runs torch's dispatch on ``inner``, a plain ``ProcessGroup`` on the
    same backend (registered here too, for what is not listed); the ones listed
    are every collective DDP, FSDP2 and the ``torch.distributed`` functions call on a
    CPU group (``send``/``recv`` are point to point, not a wait on every member)."""

    inner: dist.ProcessGroup
    activity: ScriptActivity
    before: Callable[[], object]

    allreduce = _observed("allreduce", strikes=True)
    allreduce_coalesced = _observed("allreduce_coalesced")
    broadcast = _observed("broadcast")
    reduce = _observed("reduce")
    allgather = _observed("allgather")
    _allgather_base = _observed("_allgather_base")
    allgather_into_tensor_coalesced = _observed("allgather_into_tensor_coalesced")
    reduce_scatter = _observed("reduce_scatter")
    _reduce_scatter_base = _observed("_reduce_scatter_base")
    reduce_scatter_tensor_coalesced = _observed("reduce_scatter_tensor_coalesced")
    gather = _observed("gather")
    scatter = _observed("scatter")
    alltoall_base = _observed("alltoall_base")
    barrier = _observed("barrier")


def _keep_for_life(group: ObservedGroup) -> None:
    """Never free ``group`` (nor, through it, its gloo backend): it lives as long as the
    process, as rank 0's store does in :mod:`phalanx.runtime.unmodified`.

    Freed, its ``ProcessGroupGloo`` destructor joins gloo's worker thread, and it runs
    where the last reference goes: at the script's end, in the main thread holding the
    GIL (DDP's reducer, torn down at exit). A gloo work started through this Python
    subclass carries Python state that its worker thread must take the GIL to drop, so
    that join waited forever: seen once in 15 restarted ranks of ``bench.hangs`` (a
    rank that had run every step and never exited; py-spy: the main thread in
    ``~ProcessGroupGloo`` -> ``std::thread::join``, gloo's thread in ``~AsyncWork`` ->
    ``gil_scoped_acquire``). A reference the interpreter never drops keeps the
    destructor from running; the process's exit ends the threads. The cost: a script
    that builds its default group again keeps the old one's threads and sockets."""
    ctypes.pythonapi.Py_IncRef(ctypes.py_object(group))


def _build(activity: ScriptActivity, before: Callable[[], object]) -> Callable[..., ObservedGroup]:
    """The plugin's creator: torch's gloo backend for (store, rank, size, timeout), on an
    :class:`ObservedGroup`."""

    def create(store: dist.Store, rank: int, size: int, timeout: timedelta) -> ObservedGroup:
        gloo = dist.ProcessGroupGloo(store, rank, size, timeout=timeout)
        gloo._set_sequence_number_for_group()
        inner = dist.ProcessGroup(store, rank, size)
        # (rank, size): the (store, rank, size) constructor makes no Python subclass; the
        # stubs know only that one
        group = ObservedGroup(rank, size)  # type: ignore[call-arg]
        group.inner, group.activity, group.before = inner, activity, before
        for pg in (inner, group):
            for device in ("cpu", "cuda") if torch.cuda.is_available() else ("cpu",):
                pg._register_backend(torch.device(device), dist.ProcessGroup.BackendType.GLOO, gloo)
            pg._set_default_backend(dist.ProcessGroup.BackendType.GLOO)
        activity.timeout_s = timeout.total_seconds()
        activity.start()  # not before: the rendezvous' wait is no standing still
        _keep_for_life(group)
        return group

    return create


def _is_plain_gloo(backend: object) -> bool:
    if backend is None:
        return not torch.cuda.is_available()
    return str(backend).lower() == "gloo"


def observe_default_group(
    status: RankStatus, faults: FaultPlan | None = None, *, still_s: float = STILL_S, floor_s: float = 1.0
) -> ScriptActivity:
    """From now on in this process, ``init_process_group`` with gloo builds an
    :class:`ObservedGroup` (the module doc), and the main thread is sampled from then
    on (the rendezvous before it, a wait on the other ranks, is no standing still).
    Faults at ``step=N`` strike as the script's step N (its optimizer steps in this
    process, plus one) starts its first all-reduce; at ``collective=G``, as this
    process's first all-reduce starts in generation G."""
    activity = ScriptActivity(status, still_s=still_s, floor_s=floor_s)
    plan = faults or FaultPlan()
    first = [True]

    def before() -> None:
        if first[0]:
            first[0] = False
            plan.fire(status.worker, "collective", status.generation, enter_collective=activity.entered)
        plan.fire(status.worker, "step", status.step + 1, enter_collective=activity.entered)

    dist.Backend.register_backend(PLUGIN, _build(activity, before), devices=["cpu", "cuda"])
    original = dist.init_process_group

    def init_process_group(*args: Any, **kwargs: Any) -> None:
        backend = kwargs["backend"] if "backend" in kwargs else (args[0] if args else None)
        if not _is_plain_gloo(backend):
            original(*args, **kwargs)
            return
        if args:
            args = (PLUGIN, *args[1:])
        else:
            kwargs["backend"] = PLUGIN
        original(*args, **kwargs)
        group = c10d._get_default_group()
        _, store = c10d._world.pg_map[group]
        c10d._world.pg_map[group] = ("gloo", store)  # what the script asked for, as torch says it
        c10d._world.pg_backend_config[group] = c10d._world.pg_backend_config[group].replace(PLUGIN, "gloo")

    dist.init_process_group = init_process_group
    c10d.init_process_group = init_process_group
    return activity
