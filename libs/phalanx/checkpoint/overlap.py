"""Saves that overlap compute: the copy into a snapshot slot runs beside the next step.

:meth:`Checkpointer.save_async <phalanx.checkpoint.client.Checkpointer.save_async>`
lays the state out (:class:`~phalanx.checkpoint.packing.Packing`), claims a free slot
(:meth:`~phalanx.checkpoint.slots.SnapshotSlots.claim`: WRITING, so the keeper reads
none of it), copies the small tensors at once (under :data:`SYNC_BELOW` bytes:
buffers a forward may write in place, BatchNorm's running statistics, an
optimizer's ``step``) and hands the rest to a :class:`Copier`, in pieces of
:data:`PIECE` bytes. It returns a :class:`PendingSave`; the training thread goes
on with the next forward and backward, which read the state but do not change it.

The fence: whatever would change the state in place -- the optimizer's step --
calls :meth:`PendingSave.fence` first (``Checkpointer.guard(optimizer)`` installs it
as a step pre-hook). The fence waits only for what is left of the copy, and helps
with it: the training thread takes the pieces the copier has not started and
copies them itself, then waits for the piece in flight. Once every piece is
copied the copier publishes the slot READY, and the keeper takes it as any
snapshot: the bytes are those a synchronous copy at ``save_async`` time would have
written (a test compares them while an optimizer runs).

Where the copier runs. On CPU it is a thread of this process and needs a core the
training thread does not use, or it only takes turns with the step: give it one
(``copy_cpus``; a training node's spare cores, where the keeper runs). When the
copy is longer than the step the fence costs what is left of the copy, split
between the two threads. On a GPU a state on the device is copied by a side
stream into the slot's mapping registered as pinned memory (``cudaHostRegister``),
behind an event the copier thread waits for before publishing; the fence makes
the current stream wait for that event, so the optimizer's kernels queue behind
the copy and the host does not wait at all. (The GPU path has not run on a GPU
here: see the README.)
"""

from __future__ import annotations

import contextlib
import os
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from phalanx.checkpoint.packing import Packing
from phalanx.checkpoint.slots import Claim, Written

if TYPE_CHECKING:
    from phalanx.checkpoint.slots import SnapshotSlots

PIECE = 32 << 20
"""Bytes per piece of the copy: the unit the fence takes over from the copier."""
SYNC_BELOW = 1 << 20
"""Tensors smaller than this are copied before ``save_async`` returns."""


@dataclass(eq=False)
class PendingSave:
    """A snapshot being copied into its slot beside the training step.

    :meth:`fence` before anything changes the state in place; :meth:`result` for
    what was written (None: the copy failed and the save was skipped)."""

    step: int
    claim: Claim
    pieces: list[tuple[torch.Tensor, torch.Tensor]]  # (source, destination in the slot)
    started: float
    device_event: torch.cuda.Event | None = None
    fenced_s: float = 0.0  # how long the training thread spent in fence()
    _stream_fenced: bool = False
    _next: int = 0
    _left: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _copied: threading.Event = field(default_factory=threading.Event)
    _finished: threading.Event = field(default_factory=threading.Event)
    _written: Written | None = None
    error: BaseException | None = None

    def __post_init__(self) -> None:
        self._left = len(self.pieces)
        if not self.pieces:
            self._copied.set()

    def _work(self) -> None:
        """Copy pieces nobody has started until none is left (either thread)."""
        while True:
            with self._lock:
                if self._next >= len(self.pieces) or self.error is not None:
                    return
                src, dst = self.pieces[self._next]
                self._next += 1
            try:
                dst.copy_(src)
            except BaseException as exc:  # a fault of the mapping: the save is skipped
                with self._lock:
                    self.error = self.error or exc
                self._copied.set()
                return
            with self._lock:
                self._left -= 1
                if self._left == 0:
                    self._copied.set()

    def fence(self) -> None:
        """Return once the state may change: every piece copied (this thread copies
        the ones the copier has not started), or on a GPU once the current stream
        waits for the side stream's copy. Idempotent; never raises for a failed copy
        (the save is skipped and reported)."""
        if self.device_event is not None:
            if not self._stream_fenced:  # once: the stream waits, the host does not
                torch.cuda.current_stream().wait_event(self.device_event)
                self._stream_fenced = True
            return
        if self._copied.is_set():
            return
        t0 = time.perf_counter()
        self._work()
        self._copied.wait()
        self.fenced_s += time.perf_counter() - t0

    @property
    def done(self) -> bool:
        """Published (or skipped): the slot is the keeper's now."""
        return self._finished.is_set()

    def result(self, timeout_s: float | None = None) -> Written | None:
        """Wait until published; what was written, or None when the save was skipped."""
        if not self._finished.wait(timeout_s):
            raise TimeoutError(f"snapshot {self.step} still being copied after {timeout_s} s")
        return self._written


class Copier:
    """One thread that copies pending saves' pieces (pinned to ``cpus`` when given) and
    publishes each slot once all of its pieces are copied."""

    def __init__(
        self, slots: SnapshotSlots, cpus: set[int] | None, on_skip: Callable[[int, str], None]
    ) -> None:
        self.slots, self.cpus, self.on_skip = slots, cpus, on_skip
        self._queue: queue.SimpleQueue[PendingSave | None] = queue.SimpleQueue()
        self._stream: torch.cuda.Stream | None = None
        self._registered: dict[int, int] = {}  # data_ptr of a slot mapping -> bytes, pinned for the GPU
        self._thread = threading.Thread(target=self._run, name="checkpoint-copier", daemon=True)
        self._thread.start()

    def start(self, step: int, packing: Packing, claim: Claim, started: float) -> PendingSave:
        """Copy the small tensors now, queue the rest; returns the pending save."""
        dst = claim.data
        pieces: list[tuple[torch.Tensor, torch.Tensor]] = []
        device = any(t.device.type == "cuda" for t in packing.tensors)
        for off, src in zip(packing.offsets, packing.tensors, strict=True):
            n = src.numel()
            if n < SYNC_BELOW and not device:
                dst[off : off + n].copy_(src)
                continue
            pieces += [
                (src[i : i + PIECE], dst[off + i : off + min(n, i + PIECE)]) for i in range(0, n, PIECE)
            ]
        pending = PendingSave(step, claim, pieces, started)
        if device:
            self._device_copy(pending)
        self._queue.put(pending)
        return pending

    def _device_copy(self, pending: PendingSave) -> None:
        """Queue every piece on a side stream into the pinned slot, behind the current
        stream's work (the step that produced the state), and record its event."""
        if self._stream is None:
            self._stream = torch.cuda.Stream()
        self._pin(pending.claim)
        side = self._stream
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for src, dst in pending.pieces:
                if src.device.type == "cuda":
                    src.record_stream(side)  # not reused by the allocator before the copy ran
                dst.copy_(src, non_blocking=True)
            event = torch.cuda.Event()
            event.record(side)
        pending.device_event = event
        pending.pieces = []  # nothing left for the threads: the stream has it
        pending._left = 0
        pending._copied.set()

    def _pin(self, claim: Claim) -> None:
        """Register the slot's mapping with CUDA once (page-locked: a DMA target)."""
        whole = claim.file.tensor()
        ptr, size = whole.data_ptr(), whole.numel()
        if self._registered.get(ptr) == size:
            return
        err = torch.cuda.cudart().cudaHostRegister(ptr, size, 0)
        if int(err) != 0:
            raise RuntimeError(f"cudaHostRegister of {claim.file.path} failed: {err}")
        self._registered[ptr] = size

    def _run(self) -> None:
        if self.cpus:
            with contextlib.suppress(OSError):
                os.sched_setaffinity(0, self.cpus)  # this thread only
        while True:
            pending = self._queue.get()
            if pending is None:
                return
            try:
                if pending.device_event is not None:
                    pending.device_event.synchronize()  # the side stream's copy is in the slot
                pending._work()
                pending._copied.wait()
                if pending.error is None:
                    pending._written = self.slots.publish(pending.claim, pending.started)
            except BaseException as exc:
                pending.error = pending.error or exc
            finally:
                if pending.error is not None:
                    self.on_skip(pending.step, f"the copy into the slot failed: {pending.error!r}")
                pending._finished.set()

    def close(self) -> None:
        """Finish what is queued, then stop the thread and unpin the mappings."""
        self._queue.put(None)
        self._thread.join()
        for ptr in self._registered:
            with contextlib.suppress(Exception):
                torch.cuda.cudart().cudaHostUnregister(ptr)
        self._registered.clear()
