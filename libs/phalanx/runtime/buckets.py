"""DDP's gradient buckets against the generation's: which parameters each all-reduce
carries, and one step's all-reduces in an agreed layout whatever DDP's buckets are.

The members of a generation must issue the same all-reduces (the same parameters,
in the same order, in the same buffer positions), or they do not match, and a
sum's rounding depends on where an element sits in its buffer. Each member's DDP
builds its own buckets (its process group has one rank), and rebuilds them once
from the order its gradients became ready; a member that joins (or whose reducer
was remade) starts over with DDP's first-iteration buckets while the others
already run rebuilt ones. So the generation agrees on a layout at state transfer
(the most advanced member's, :class:`~phalanx.runtime.loop.UserLoop`), and a
member whose DDP buckets differ from it runs its step through :class:`Remap`:
gradients are taken from DDP's buckets as they come, each agreed bucket is
all-reduced as soon as all its gradients are in (in place when it is one of
DDP's buckets, else packed into a buffer laid out as the agreed bucket is, then
copied back), and each DDP bucket's future completes once every all-reduce that
holds one of its gradients has.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from phalanx.runtime.comm import CommError, Communicator

Layout = list[list[int]]
"""Buckets in all-reduce order, each the indices of its parameters (in the order
DDP's reducer gives them), as DDP lays them out in a bucket's buffer."""


class LayoutError(ValueError):
    """A peer's layout does not describe this model's parameters."""


def layout_of(raw: Any, nparams: int) -> Layout | None:
    """A peer's layout, checked: every parameter index exactly once."""
    if raw is None:
        return None
    if not isinstance(raw, list) or not all(isinstance(b, list) for b in raw):
        raise LayoutError("the peer's DDP bucket layout is not a list of lists")
    flat = sorted(i for b in raw for i in b)
    if flat != list(range(nparams)):
        raise LayoutError(f"the peer's DDP bucket layout does not cover this model's {nparams} parameters")
    return [[int(i) for i in b] for b in raw]


def done(t: torch.Tensor) -> torch.futures.Future[torch.Tensor]:
    """A future that already holds ``t``."""
    fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    fut.set_result(t)
    return fut


class Remap:
    """One step's gradient all-reduces in ``layout``, fed DDP's buckets by the comm hook.

    ``index`` maps a parameter (by ``id``) to its index; ``on_done(ms)`` records each
    all-reduce's wall time; ``on_error(err)`` marks the step failed (never raised into
    DDP: its buckets then complete with their local gradients).
    """

    def __init__(
        self,
        layout: Layout,
        comm: Communicator,
        bound_s: float,
        index: dict[int, int],
        on_done: Callable[[float], None],
        on_error: Callable[[CommError], None],
    ) -> None:
        self.layout, self.comm, self.bound_s, self.index = layout, comm, bound_s, index
        self._on_done, self._on_error = on_done, on_error
        self._lock = threading.Lock()
        self._grads: dict[int, torch.Tensor] = {}  # parameter index -> its gradient, a view into a DDP bucket
        self._whole: dict[tuple[int, ...], torch.Tensor] = {}  # a DDP bucket's parameters -> its buffer
        self._next = 0  # the next agreed bucket to all-reduce
        self._reduced: set[int] = set()  # parameters whose all-reduce has completed (or was given up)
        self._waiting: list[tuple[set[int], torch.Tensor, torch.futures.Future[torch.Tensor]]] = []
        self.failed = False

    def add(self, bucket: dist.GradBucket, failed: bool) -> torch.futures.Future[torch.Tensor]:
        """Take DDP's ``bucket`` (already scaled); start every agreed all-reduce whose
        gradients are now all in (none once ``failed``); the bucket's future."""
        buf = bucket.buffer()
        params = [self.index[id(p)] for p in bucket.parameters()]
        fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
        with self._lock:
            self.failed = self.failed or failed
            self._grads.update(zip(params, bucket.gradients(), strict=True))
            self._whole[tuple(params)] = buf
            self._waiting.append((set(params), buf, fut))
        while True:
            with self._lock:
                ready = self._next < len(self.layout) and all(
                    i in self._grads for i in self.layout[self._next]
                )
                if not ready:
                    break
                params, self._next = self.layout[self._next], self._next + 1
                give_up = self.failed
            if give_up:
                self._settle(params)
            else:
                self._start(params)
        if bucket.is_last():  # every gradient is in: nothing is left to start
            with self._lock:
                rest = [i for b in self.layout[self._next :] for i in b]
                self._next = len(self.layout)
            self._settle(rest)
        return fut

    def _start(self, params: list[int]) -> None:
        whole = self._whole.get(tuple(params))
        flat = whole if whole is not None else torch.cat([self._grads[i].reshape(-1) for i in params])
        start = time.perf_counter()
        try:
            work = self.comm.allreduce_work(flat, self.bound_s)
        except CommError as err:
            self._fail(err)
            self._settle(params)
            return

        def finish(fut: torch.futures.Future[list[torch.Tensor]]) -> None:
            try:
                fut.value()
                self._on_done((time.perf_counter() - start) * 1000.0)
                if whole is None:  # back into DDP's buckets, where each gradient lives
                    offset = 0
                    for i in params:
                        g = self._grads[i]
                        g.copy_(flat[offset : offset + g.numel()].view_as(g))
                        offset += g.numel()
            except Exception as exc:  # never raise into DDP: the step is redone instead
                self._fail(CommError(f"allreduce on {self.comm.prefix} failed: {exc}"[:2000]))
            self._settle(params)

        work.get_future().then(finish)

    def _fail(self, err: CommError) -> None:
        with self._lock:
            self.failed = True
        self._on_error(err)

    def _settle(self, params: list[int]) -> None:
        """``params`` are reduced (or given up): complete the DDP buckets now whole."""
        with self._lock:
            self._reduced.update(params)
            ready = [w for w in self._waiting if w[0] <= self._reduced]
            self._waiting = [w for w in self._waiting if not w[0] <= self._reduced]
        for _, buf, fut in ready:
            fut.set_result(buf)


__all__ = ["Layout", "LayoutError", "Remap", "done", "layout_of"]
