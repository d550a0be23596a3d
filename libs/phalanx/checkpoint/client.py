"""The one checkpoint API a training process uses: save, list, latest, load.

``save`` is one copy of the state into a shared-memory slot and returns; the
node's keeper (state-replication) replicates and drains it. ``list``,
``latest`` and ``load`` ask that keeper, which knows every tier through the
catalog and reads from the fastest one that holds a good copy::

    ckpt = Checkpointer("j1")                      # node and worker from the launcher's env
    ckpt.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, step)
    ...
    ckpt.guard(opt)                                # overlapped saves: opt.step() fences them
    ckpt.save_async({"model": model.state_dict(), "optimizer": opt.state_dict()}, step)
    loss_fn(model(x), y).backward()                # runs beside the copy into the slot
    opt.step()                                     # waits only for what is left of the copy
    ...
    loaded = ckpt.load()                           # the newest complete checkpoint
    model.load_state_dict(loaded.state["model"])
    loaded.step, loaded.tier                       # 1200, "peer"

The keeper listens on ``<shm_root>/<node>/keeper.sock``; ``shm_root`` is
``PHALANX_SHM_ROOT`` (default ``/dev/shm/phalanx``) and ``node`` is
``PHALANX_KEEPER_NODE``, else ``PHALANX_NODE`` (the launcher's ``--node-id``),
else the host name: the keeper's ``PHALANX_NODE``. Where the launcher's node id is
not the keeper's node name (a Kubernetes pod per node: ``train-demo-0`` on node
``gpu-17``), set ``PHALANX_KEEPER_NODE`` in the training pod.
"""

from __future__ import annotations

import dataclasses
import errno
import mmap
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

import phalanx.checkpoint.wire as wire
from phalanx.checkpoint.manifest import Manifest
from phalanx.checkpoint.overlap import Copier, PendingSave
from phalanx.checkpoint.packing import Packing, unpack
from phalanx.checkpoint.slots import SlotsBusy, SnapshotSlots, Written, node_name, shm_root
from phalanx.settings import RankSettings, load
from phalanx.telemetry import get_logger


class NoCheckpoint(LookupError):
    """No tier holds a complete, intact copy of the checkpoint asked for."""


@dataclass(frozen=True)
class CheckpointInfo:
    step: int
    bytes: int
    kind: str
    origin: str  # the node that took it
    tiers: dict[str, list[str]]  # tier -> nodes holding a complete copy ("-": shared, object)


@dataclass(frozen=True)
class Loaded:
    """A loaded checkpoint. For a snapshot, ``state``'s tensors are read-only views into
    this node's shared memory: copy them into the model (``load_state_dict`` does) and do
    not keep them across the next ``save``."""

    step: int
    tier: str  # memory, disk, peer, shared or object: where the keeper found it
    manifest: Manifest
    files: dict[str, tuple[Path, int]]  # name -> (file in shared memory, offset of its bytes)
    state: Any = None
    seconds: float = 0.0  # the keeper's time to find, fetch and verify it
    fetched_bytes: int = 0  # what the keeper read from the serving tier (0 from its own memory)


def _check_step(step: int) -> None:
    if type(step) is not int or step < 0:
        raise ValueError(f"step must be an int >= 0, got {step!r}")


def _tensors(obj: Any, depth: int = 0) -> list[torch.Tensor]:
    """The tensors in ``obj`` (containers walked as :func:`~.packing.pack` walks them)."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    if depth > 64:
        return []
    if isinstance(obj, dict):
        return [t for v in obj.values() for t in _tensors(v, depth + 1)]
    if isinstance(obj, (list, tuple)):
        return [t for v in obj for t in _tensors(v, depth + 1)]
    return []


class Checkpointer:
    """``slots`` shared-memory buffers for this process's snapshots: the keeper holds the
    newest ones it keeps in memory (memory's ``last`` in ``PHALANX_CKPT_TIERS``, 2) until newer ones
    replace them, so ``slots`` must exceed that for every save to find a free one."""

    def __init__(
        self,
        job: str,
        *,
        node: str | None = None,
        worker: str | None = None,
        root: Path | None = None,
        slots: int = 3,
        timeout_s: float = 600.0,
        copy_cpus: set[int] | None = None,
    ) -> None:
        """``copy_cpus``: the cores the copier thread of :meth:`save_async` runs on (a CPU
        state): cores the training thread does not use, or the copy only takes turns
        with the step (default: wherever this process may run)."""
        self.job = job
        settings = load(RankSettings)
        self.node = node or settings.keeper_node or node_name()
        self.worker = worker or settings.worker or f"pid{os.getpid()}"
        self.root = root or shm_root()
        self.slot_count = slots
        self.timeout_s = timeout_s
        self.socket = str(self.root / self.node / "keeper.sock")
        self._slots: SnapshotSlots | None = None
        self.copy_cpus = copy_cpus
        self._copier: Copier | None = None
        self._pending: PendingSave | None = None
        self.skipped = 0
        self.log = get_logger(component="checkpoint", job=job, worker=self.worker)

    # -- save ------------------------------------------------------------------------------
    def save(self, state: Any, step: int) -> Written | None:
        """Put ``state`` (what :func:`phalanx.checkpoint.packing.pack` takes: a model's and an
        optimizer's ``state_dict``, ints, strings...) in shared memory as checkpoint ``step``.

        Returns once the copy is in memory (it outlives this process, not the node);
        the keeper makes it durable. Returns None, and counts it in ``skipped``, when
        the keeper still holds every slot, or the slot cannot be had (shared memory
        full: ENOSPC, or any other OSError): the training loop is never blocked, nor
        stopped, by it; the keeper is told and publishes a ``skipped`` CheckpointEvent.
        """
        _check_step(step)
        self._settle()
        packing = Packing.of(state, torch.device("cpu"))
        try:
            return self._open().write(step, packing)
        except (SlotsBusy, OSError) as exc:
            self._refused(step, exc)
        return None

    def save_async(self, state: Any, step: int) -> PendingSave | None:
        """Start saving ``state`` as checkpoint ``step`` and return at once: the copy into
        the slot runs beside the next forward and backward (:mod:`~phalanx.checkpoint.overlap`).

        Nothing may change the state in place until :meth:`PendingSave.fence` (or
        :meth:`fence`) returns: call :meth:`guard` once with the optimizer and its
        step fences every save. Tensors under 1 MiB (buffers a forward writes) are
        copied before this returns. A save still in flight is finished first. None
        (counted in ``skipped``, reported) when no slot can be had, as :meth:`save`.
        """
        _check_step(step)
        self._settle()
        started = time.perf_counter()
        devices = {t.device for t in _tensors(state)}
        target = next((d for d in devices if d.type == "cuda"), torch.device("cpu"))
        packing = Packing.of(state, target)
        try:
            slots = self._open()
            claim = slots.claim(step, packing)
        except (SlotsBusy, OSError) as exc:
            self._refused(step, exc)
            return None
        if self._copier is None:
            self._copier = Copier(slots, self.copy_cpus, self._skip)
        self._pending = self._copier.start(step, packing, claim, started)
        return self._pending

    def fence(self) -> None:
        """Return once the state may change: the save in flight (if any) is copied."""
        pending = self._pending
        if pending is not None:
            pending.fence()

    def guard(self, optimizer: torch.optim.Optimizer) -> None:
        """Make ``optimizer.step()`` fence the save in flight first (a step pre-hook)."""
        optimizer.register_step_pre_hook(lambda *_: self.fence())

    def _settle(self) -> None:
        """Finish the save in flight (fenced, published) before a slot is claimed again:
        a slot being written reads as free to :meth:`SnapshotSlots.free_slot`."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.fence()
            pending.result()

    def _open(self) -> SnapshotSlots:
        if self._slots is None:
            self._slots = SnapshotSlots(self.root, self.node, self.job, self.worker, self.slot_count)
        return self._slots

    def _refused(self, step: int, exc: SlotsBusy | OSError) -> None:
        if isinstance(exc, SlotsBusy):
            self._skip(step, str(exc))
            return
        # A slot that could not grow is half set up: the next save opens them afresh.
        self.close()
        code = errno.errorcode.get(exc.errno or 0, "OSError")
        self._skip(step, f"{code}: {exc.strerror or exc} (shared memory {self.root})")

    def _skip(self, step: int, reason: str) -> None:
        """Count and log a skipped save, and tell the keeper (it publishes the event),
        best effort and off this thread: a keeper that is down is not waited for."""
        self.skipped += 1
        self.log.warning("checkpoint_skipped", step=step, reason=reason)
        request = {
            "op": "skipped",
            "job": self.job,
            "step": step,
            "worker": self.worker,
            "reason": reason[:400],
        }

        def tell() -> None:
            try:
                wire.call(self.socket, request, 2.0)
            except (OSError, wire.WireError) as exc:
                self.log.warning("checkpoint_skip_unreported", step=step, error=str(exc))

        threading.Thread(target=tell, name="checkpoint-skip", daemon=True).start()

    def reserve(self, state: Any) -> int:
        """Size every free slot for ``state`` and fault its pages in now, so that no later
        ``save`` of a state this size pays for page faults (a fresh 1 GiB buffer costs
        about 20x a reused one). Call it once at start, off the critical path; returns
        the slots prepared."""
        return self._open().reserve(Packing.of(state, torch.device("cpu")))

    def close(self) -> None:
        """Finish the save in flight, stop the copier and unmap the slots."""
        self._settle()
        if self._copier is not None:
            self._copier.close()
            self._copier = None
        if self._slots is not None:
            self._slots.close()
            self._slots = None

    # -- read ------------------------------------------------------------------------------
    def list(self) -> list[CheckpointInfo]:
        """Every checkpoint of the job with a complete copy in some tier, newest first."""
        reply = wire.call(self.socket, {"op": "list", "job": self.job}, self.timeout_s)
        return [
            CheckpointInfo(
                int(c["step"]), int(c["bytes"]), str(c["kind"]), str(c["origin"]), dict(c["tiers"])
            )
            for c in reply.get("checkpoints", [])
        ]

    def latest(self) -> CheckpointInfo | None:
        got = self.list()
        return got[0] if got else None

    def fetch(self, step: int | None = None) -> Loaded:
        """Make checkpoint ``step`` (None: the newest complete one) readable in this node's
        memory without decoding it; :class:`NoCheckpoint` when no tier has a good copy."""
        request: dict[str, Any] = {"op": "load", "job": self.job}
        if step is not None:
            request["step"] = step
        try:
            reply = wire.call(self.socket, request, self.timeout_s)
        except wire.WireError as exc:
            raise NoCheckpoint(str(exc)) from None
        manifest = Manifest.parse(reply["manifest"], "the keeper's manifest")
        files = {str(n): (Path(p), int(off)) for n, (p, off) in reply["files"].items()}
        return Loaded(
            manifest.step,
            str(reply["tier"]),
            manifest,
            files,
            seconds=float(reply.get("seconds", 0)),
            fetched_bytes=int(reply.get("fetched_bytes", 0)),
        )

    def load(self, step: int | None = None) -> Loaded:
        """:meth:`fetch`, then decode a snapshot's state into ``Loaded.state``.

        The keeper verified the bytes against the manifest's checksums. The tensors
        map the shared-memory copy privately (copy on write): nothing is read twice,
        and writing to them never changes the copy."""
        loaded = self.fetch(step)
        if loaded.manifest.kind != "snapshot":
            return loaded  # a DCP checkpoint: read it with phalanx.checkpoint.dcp.TieredReader
        size = loaded.manifest.file("state.phx").size
        path, offset = loaded.files["state.phx"]
        with open(path, "rb") as f:
            mm = mmap.mmap(f.fileno(), offset + size, access=mmap.ACCESS_COPY)
        buf = (
            torch.frombuffer(mm, dtype=torch.uint8)[offset : offset + size]
            if size
            else torch.empty(0, dtype=torch.uint8)
        )
        return dataclasses.replace(loaded, state=unpack(loaded.manifest.meta, buf))
