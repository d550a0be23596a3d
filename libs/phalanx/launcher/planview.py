"""A launcher's view of its job's plan: its node's part, kept current by deltas.

The planner publishes each committed generation as a
:class:`~phalanx.contract.PlanDelta` of the one before on ``phalanx.cmd.<job>.delta``.
:class:`NodePlanFollower` applies each to the node's part it holds
(:func:`~phalanx.contract.apply_delta`) and hands the result to one callback. It
reads the job's record (``phalanx_jobs/<job>.plan``, the whole plan) only when it must:

- once when it starts, and after every reconnect (a delta may have gone by while
  the connection was down);
- when a delta does not apply: it holds no base, a generation was missed, the
  change was too big for a delta (``full``), or the delta is not one of its view.

Re-reads are bounded: one at a time, later asks folded into it, retried with a
doubling pause on failure. There is no periodic polling and no watch of the record:
a launcher costs NATS one small message per generation, whatever the job's size.
A delta may be lost (core delivery, a slow consumer); the planner sends it again
until the node's members acknowledged, and a re-send whose base the launcher missed
triggers a read.

The callback de-duplicates (``NodePlan.supersedes``); a re-send of the generation
held is handed on with ``by_message=True`` (the launcher re-acknowledges).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Collection
from typing import Any

from nats.aio.msg import Msg

from phalanx.bus import Bucket, Bus
from phalanx.contract import DecodeError, NodePlan, PlanDelta, apply_delta, record_node_plan
from phalanx.contract.streams import JOBS_BUCKET
from phalanx.contract.subjects import DELTA
from phalanx.telemetry import get_logger
from phalanx.worker.follow import record_key

OnNodePlan = Callable[[NodePlan, bool], None]  # (the node's part, came as a re-send)


class NodePlanFollower:
    def __init__(
        self,
        bus: Bus,
        job: str,
        node: str,
        workers: Callable[[], Collection[str]],
        on_plan: OnNodePlan,
        *,
        retry_s: float = 0.25,
        retry_max_s: float = 8.0,
    ) -> None:
        self.bus, self.job, self.node = bus, job, node
        self.workers = workers
        self.on_plan = on_plan
        self.retry_s, self.retry_max_s = retry_s, retry_max_s
        self.launch = (
            ""  # the run followed: deltas and records of any other (or before it is known) are ignored
        )
        self.view: NodePlan | None = None
        self.reads = 0  # records read (start, reconnects, deltas that did not apply)
        self.applied = 0  # deltas applied
        self.on_bytes: Callable[[str, int], None] | None = None
        """Told the payload size of each delta (``"delta"``) and record read (``"read"``)."""
        self.log = get_logger(component="plan-view", job=job, node=node)
        self._kv: Bucket | None = None
        self._sub: Any = None
        self._reading: asyncio.Task[None] | None = None
        self._again = False

    async def start(self) -> None:
        """Subscribe to the deltas (before the launcher joins: none is missed after); deltas
        are taken once :meth:`follow` names the run."""
        self._sub = await self.bus.subscribe(DELTA.format(job=self.job), self._on_delta, PlanDelta)
        self.bus.reconnect_hooks.append(self.resume)

    async def follow(self, launch: str) -> None:
        """Follow run ``launch`` (the planner's answer to the join): read the record once."""
        self.launch = launch
        await self.read()

    async def stop(self) -> None:
        if self._reading is not None:
            self._reading.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._reading
        if self._sub is not None:
            with contextlib.suppress(Exception):
                await self._sub.unsubscribe()
        with contextlib.suppress(ValueError):
            self.bus.reconnect_hooks.remove(self.resume)

    async def resume(self) -> None:
        """After a reconnect: a delta may have gone by; read the record."""
        if self.launch:
            self.read_soon()

    async def read(self) -> None:
        """Read the record now (also what a pending read would do)."""
        self.read_soon()
        if self._reading is not None:
            await asyncio.shield(self._reading)

    def read_soon(self) -> None:
        """Ask for a read of the record: one at a time, asks made meanwhile fold into one more."""
        if self._reading is not None and not self._reading.done():
            self._again = True
            return
        self._reading = asyncio.get_running_loop().create_task(
            self._read_loop(), name=f"plan-read:{self.job}"
        )

    async def _read_loop(self) -> None:
        pause = self.retry_s
        while True:
            self._again = False
            if await self._read_once():
                if not self._again:
                    return
                continue
            await asyncio.sleep(pause)
            pause = min(pause * 2, self.retry_max_s)

    async def _read_once(self) -> bool:
        try:
            if self._kv is None:
                self._kv = await self.bus.kv.bucket(JOBS_BUCKET)
            entry = await self._kv.get(record_key(self.job))
        except Exception as exc:  # NATS away, no bucket yet: retried
            self.log.debug("record_unreadable", error=repr(exc))
            self._kv = None
            return False
        self.reads += 1
        if entry is None or not entry.value:
            return True
        if self.on_bytes is not None:
            self.on_bytes("read", len(entry.value))
        try:  # the node's part only, run by run: not 16,000 members decoded per launcher
            view = record_node_plan(entry.value, self.node, set(self.workers()))
        except DecodeError as exc:
            self.log.error("bad_job_record", error=str(exc))
            return True
        if view is not None and view.job == self.job and view.launch == self.launch:
            self._take(view, False)
        return True

    async def _on_delta(self, delta: PlanDelta, raw: Msg) -> None:
        if self.on_bytes is not None:
            self.on_bytes("delta", len(raw.data))
        if delta.job != self.job or not self.launch or delta.launch != self.launch:
            return
        view = self.view
        if view is not None and not delta.supersedes(view):
            if (delta.token, delta.generation) == (view.token, view.generation):
                self.on_plan(view, True)  # a re-send of what we hold: acknowledge again
            return
        new = apply_delta(view, delta, set(self.workers()))
        if new is None:
            self.read_soon()  # no base, a gap, too big a change: the record has it
            return
        self.applied += 1
        self._take(new, False)

    def _take(self, view: NodePlan, resend: bool) -> None:
        if self.view is not None and not view.supersedes(self.view):
            return
        self.view = view
        self.on_plan(view, resend)
