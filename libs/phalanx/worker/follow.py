"""Following a job's plan so that none can be missed: what ranks and launchers share.

The plan lives in the job's KV record (``phalanx_jobs``, key ``<job>.plan``, a
:class:`~phalanx.contract.JobRecord`). A :class:`PlanFollower` hands every plan
it sees to one callback, from three sources:

- a KV watch of the record (:class:`~phalanx.bus.keywatch.KeyWatch`: a consumer
  named with the record's key, the only watch a job's users are allowed): it
  replays the latest value when it starts, and it is started again after every
  reconnect and whenever it may have missed a value (it only notices a lost
  server after its idle heartbeats, seconds later);
- a re-read of the record every ``poll_s`` while :attr:`PlanFollower.eager` is set
  (a rank waiting for a plan), the backstop if the watch itself stalls;
- the plan subject ``phalanx.cmd.<job>.plan``, which the planner re-publishes
  until every member acknowledged: the fast path, and the one a re-sent plan
  comes back on (``by_message=True``), so that a lost acknowledgement is sent again.

The callback de-duplicates (:meth:`Plan.supersedes <phalanx.contract.Plan.supersedes>`).

>>> follower = PlanFollower(bus, "j1", on_plan)
>>> await follower.start()
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from typing import Any

from nats.aio.msg import Msg

from phalanx.bus import Bucket, Bus
from phalanx.bus.kv import kv_decode
from phalanx.contract import DecodeError, JobRecord, Plan
from phalanx.contract.streams import JOBS_BUCKET
from phalanx.contract.subjects import PLAN
from phalanx.telemetry import get_logger

OnPlan = Callable[[Plan, bool], None]  # (plan, came as a message: possibly a re-send)


def record_key(job: str) -> str:
    return f"{job}.plan"


class PlanFollower:
    def __init__(self, bus: Bus, job: str, on_plan: OnPlan, *, poll_s: float = 1.0) -> None:
        self.bus = bus
        self.job = job
        self.on_plan = on_plan
        self.poll_s = poll_s
        self.eager = False  # re-read the record every poll_s (set while waiting for a plan)
        self.log = get_logger(component="plan-follower", job=job)
        self._kv: Bucket | None = None
        self._watch: asyncio.Task[None] | None = None
        self._poll: asyncio.Task[None] | None = None
        self._sub: Any = None
        self.watch_restarts = 0

    async def start(self) -> None:
        self._sub = await self.bus.subscribe(
            PLAN.format(job=self.job), self._on_msg, Plan, trace_messages=False
        )
        self.bus.reconnect_hooks.append(self.resume)
        await self.read()
        self._watch = asyncio.create_task(self._watch_loop(), name=f"watch:{self.job}")
        self._poll = asyncio.create_task(self._poll_loop(), name=f"poll:{self.job}")

    async def stop(self) -> None:
        for task in (self._watch, self._poll):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
        if self._sub is not None:
            with contextlib.suppress(Exception):
                await self._sub.unsubscribe()

    async def resume(self) -> None:
        """After a reconnect: read the record and watch it again."""
        if self._watch is not None:
            self._watch.cancel()
            self.watch_restarts += 1
            self._watch = asyncio.create_task(self._watch_loop(), name=f"watch:{self.job}")
        await self.read()

    async def _bucket(self) -> Bucket:
        if self._kv is None:
            self._kv = await self.bus.kv.bucket(JOBS_BUCKET)
        return self._kv

    async def read(self) -> None:
        """Read the record once; a missing record or bucket is not an error."""
        try:
            entry = await (await self._bucket()).get(record_key(self.job))
        except Exception as exc:  # no bucket yet, NATS away: the watch or the next read gets it
            self.log.debug("record_unreadable", error=repr(exc))
            self._kv = None  # looked up again: the bucket may have gained direct gets since
            return
        if entry is not None:
            self._take(entry.value)

    def _take(self, value: bytes | None) -> None:
        if not value:
            return
        try:
            record = kv_decode(value, JobRecord)
        except DecodeError as exc:
            self.log.error("bad_job_record", error=str(exc))
            return
        if record.job == self.job and record.plan is not None:
            self.on_plan(record.plan, False)

    async def _watch_loop(self) -> None:
        while True:
            watcher = None
            try:
                # Not cancelled half-way: a watch whose subscription exists but was never
                # returned could not be stopped, and would hold up the connection's drain.
                starting = asyncio.ensure_future(self.bus.kv.watch(JOBS_BUCKET, record_key(self.job)))
                try:
                    watcher = await asyncio.shield(starting)
                except asyncio.CancelledError:
                    with contextlib.suppress(BaseException):
                        await (await starting).stop()
                    raise
                async for entry in watcher:
                    if entry.operation is None:
                        self._take(entry.value)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # NATS away, no bucket yet, WatchLost: watch again shortly
                self.log.debug("watch_failed", error=repr(exc))
            finally:
                if watcher is not None:
                    with contextlib.suppress(Exception):
                        await asyncio.shield(watcher.stop())
            await asyncio.sleep(0.5)

    async def _poll_loop(self) -> None:
        while True:
            await asyncio.sleep(self.poll_s)
            if self.eager:
                await self.read()

    async def _on_msg(self, plan: Plan, raw: Msg) -> None:
        if plan.job == self.job:
            self.on_plan(plan, True)
