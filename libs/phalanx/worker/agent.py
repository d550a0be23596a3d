"""A rank's link to the control plane, on its own thread and event loop.

The training thread is plain synchronous PyTorch; the agent runs the NATS
client beside it: it registers the worker, heartbeats (so a long step never
looks like a hang, while a stopped or dead process falls silent), follows the
job's plans, acknowledges them at once, and publishes what the trainer reports.

Plans are ordered by :meth:`Plan.supersedes <phalanx.contract.Plan.supersedes>` (the
planner's fencing token, then the generation): :meth:`Agent.wait_plan` only returns a
plan newer than the one the caller has, a stale or duplicated plan is dropped, and so
is one from a planner replaced by a newer leader.

A worker started by a launcher gets its node's part of each plan
(:class:`~phalanx.contract.NodePlan`) from the launcher over a local socket
(:mod:`phalanx.worker.plansocket`) and acknowledges it by heartbeat
(``Heartbeat.plan``): it never reads the job's record, so a 16,000-rank job costs
NATS nothing per rank and plan. A worker without a launcher follows the job's KV
record, watched, and the plan subject (:class:`~phalanx.worker.follow.PlanFollower`),
takes its own part of each whole plan (:func:`~phalanx.contract.worker_plan`) and
acknowledges on NATS; either way a worker that started after the plan was committed,
or was cut off while it was, still gets it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from opentelemetry import context as otel_context

from phalanx.bus import Bus
from phalanx.contract import (
    CollectiveError,
    Message,
    NodePlan,
    Plan,
    PlanAck,
    Registered,
    Role,
    worker_plan,
)
from phalanx.contract.subjects import ACK, COMM_ERROR, REGISTERED, Subject
from phalanx.settings import RankSettings, load
from phalanx.telemetry import extract_context, get_logger
from phalanx.worker.follow import PlanFollower
from phalanx.worker.heartbeat import HeartbeatPublisher
from phalanx.worker.plansocket import PlanInbox
from phalanx.worker.sever import sever
from phalanx.worker.status import RankStatus


@dataclass(frozen=True)
class PlanEnvelope:
    plan: NodePlan
    received_at: float  # time.time() when the agent got it
    context: otel_context.Context  # the incident's trace, from the message headers


class Agent:
    def __init__(
        self,
        status: RankStatus,
        role: Role,
        *,
        url: str | None = None,
        heartbeat_s: float | None = None,
        incarnation: int = 0,
        launch: str = "",
    ) -> None:
        self.status = status
        self.launch = launch
        self.role = role
        self.url = url
        self.incarnation = incarnation
        self.log = get_logger(component="agent", worker=status.worker)
        self._heartbeat_s = heartbeat_s
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="phalanx-agent", daemon=True)
        self._cond = threading.Condition()
        self._latest: PlanEnvelope | None = None
        self._bus: Bus | None = None
        self._hb_task: asyncio.Task[None] | None = None
        self._hb: HeartbeatPublisher | None = None
        self._severed: set[str] = set()
        self._follower: PlanFollower | None = None
        self._inbox: PlanInbox | None = None
        self._listeners: list[Callable[[NodePlan], None]] = []
        self._in_flight: set[concurrent.futures.Future[None]] = set()  # publish() calls not yet done

    # -- lifecycle ------------------------------------------------------------
    def start(self, timeout_s: float = 30.0) -> Agent:
        self._thread.start()
        self._call(self._start(), timeout_s)
        return self

    async def _start(self) -> None:
        self._bus = bus = await Bus.connect(self.url, name=f"rank-{self.status.worker}", ensure=False)
        settings = load(RankSettings)
        if settings.plan_socket is not None:  # the launcher hands us our node's part
            self._inbox = PlanInbox(
                str(settings.plan_socket), lambda plan: self._offer(plan, False), settings.launcher_pid
            )
            self._inbox.start()
        else:  # the job's record in KV, watched (replayed after a cut), and the plan subject
            self._follower = PlanFollower(bus, self.status.job, self._offer_whole)
            await self._follower.start()
        await bus.publish(
            REGISTERED,
            Registered(
                job=self.status.job,
                worker=self.status.worker,
                role=self.role,
                host=self.status.host,
                pid=os.getpid(),
                incarnation=self.incarnation,
                launch=self.launch,
            ),
            job=self.status.job,
            worker=self.status.worker,
            msg_id=f"{self.status.job}:{self.status.worker}:{os.getpid()}:registered",
        )
        # Heartbeats after the registration: the detector takes them from this pid only.
        self._hb = hb = HeartbeatPublisher(bus, self.status, self._heartbeat_s)
        self._hb_task = asyncio.create_task(hb.run())

    def close(self, timeout_s: float = 5.0, drain_s: float | None = None, *, goodbye: bool = True) -> None:
        """Say goodbye, then disconnect. Events still being published (a JetStream
        publish retries while the server restarts) get up to ``drain_s`` in between
        (``PHALANX_AGENT_DRAIN_S``, 15 s): a rank that finishes its last steps while
        NATS is away must not drop its RecoveryDone on the way out.

        ``goodbye`` (a DONE heartbeat) tells the detector this worker is finished, so
        that its exit is no fault; a process exiting on an error must not say it."""
        if not self._thread.is_alive():
            return
        if drain_s is None:
            drain_s = load(RankSettings).agent_drain_s

        async def _goodbye() -> None:
            # First, so that the wait for events below is not taken for a stalled step:
            # the work is done, and the silence that follows is no fault.
            if self._hb_task:
                self._hb_task.cancel()
            if self._hb is not None:
                await self._hb.goodbye()  # the launcher's socket or NATS, as the heartbeats went

        if goodbye:  # (a process exiting on an error heartbeats on while it drains)
            with contextlib.suppress(Exception):
                self._call(_goodbye(), timeout_s)
        pending = [f for f in list(self._in_flight) if not f.done()]
        if pending:
            _, left = concurrent.futures.wait(pending, timeout=max(0.0, drain_s))
            if left:
                self.log.warning("events_dropped_at_exit", count=len(left), waited_s=drain_s)

        async def _close() -> None:
            if self._hb_task:
                self._hb_task.cancel()
            if self._inbox is not None:
                self._inbox.stop()
            if self._bus:
                if self._follower is not None:
                    await self._follower.stop()
                await self._bus.close()

        with contextlib.suppress(Exception):
            self._call(_close(), timeout_s)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout_s)

    def _call(self, coro: Any, timeout_s: float) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout_s)

    # -- plans ----------------------------------------------------------------
    def _offer_whole(self, plan: Plan, by_message: bool) -> None:
        self._offer(worker_plan(plan, self.status.worker), by_message)

    def _offer(self, plan: NodePlan, by_message: bool) -> None:
        if plan.job != self.status.job or plan.launch != self.launch:
            return  # another job, or a plan an earlier launch of this job left in KV
        received = time.time()
        with self._cond:
            latest = self._latest
            if latest is not None and not plan.supersedes(latest.plan):
                if latest.plan.supersedes(plan):  # older: from a replaced planner, or overtaken
                    self.log.info(
                        "plan_stale",
                        generation=plan.generation,
                        token=plan.token,
                        current=latest.plan.generation,
                        current_token=latest.plan.token,
                    )
                elif by_message and received - latest.received_at > 0.5:
                    # A re-send of our plan some time after we got it: our ack may be lost.
                    self._ack(plan)
                return  # stale or duplicate
            self._latest = PlanEnvelope(plan, received, extract_context(plan.trace))
            self._cond.notify_all()
        self.log.info("plan_received", generation=plan.generation, reason=plan.reason, by_message=by_message)
        self._cut_lost_hosts(plan)
        for listener in self._listeners:
            try:
                listener(plan)
            except Exception as exc:  # a listener's bug must not stop plans from being acked
                self.log.error("plan_listener_failed", error=repr(exc))
        self._ack(plan)

    def on_plan(self, listener: Callable[[NodePlan], None]) -> None:
        """Call ``listener(plan)`` on the agent's thread for every newer plan, before
        it is acknowledged; it must not block (start a thread for slow work)."""
        self._listeners.append(listener)

    def _ack(self, plan: NodePlan) -> None:
        self.status.plan = max(self.status.plan, plan.generation)
        if self._inbox is not None:  # the next heartbeat tells the launcher, which tells the planner
            return
        rank = plan.rank_of(self.status.worker)
        if rank is not None and self._bus is not None:
            ack = PlanAck(job=plan.job, generation=plan.generation, worker=self.status.worker, rank=rank)
            asyncio.get_running_loop().create_task(self._publish_quietly(ACK, ack, plan.job, ack.worker))

    def _cut_lost_hosts(self, plan: NodePlan) -> None:
        """Release a collective blocked on a node that was cut off (see :mod:`.sever`)."""
        hosts = set(plan.lost_hosts) - self._severed - {load(RankSettings).bind or ""}
        if hosts:
            self._severed |= hosts
            cut = sever(hosts)
            self.log.warning(
                "connections_cut", hosts=sorted(hosts), connections=cut, generation=plan.generation
            )

    async def _publish_quietly(self, subject: Subject, msg: Message, job: str, worker: str) -> None:
        try:
            assert self._bus is not None
            await self._bus.publish(subject, msg, job=job, worker=worker)
        except Exception as exc:
            self.log.warning("publish_failed", subject=subject.pattern, error=repr(exc))

    @property
    def latest(self) -> PlanEnvelope | None:
        return self._latest

    def wait_plan(self, newer_than: int, timeout_s: float | None = None) -> PlanEnvelope | None:
        """Block until a plan with ``generation > newer_than`` arrives (None on timeout)."""
        follower = self._follower
        if follower is not None:
            follower.eager = True  # re-read the record while waiting, in case the watch stalled
        try:
            with self._cond:
                ok = self._cond.wait_for(
                    lambda: self._latest is not None and self._latest.plan.generation > newer_than,
                    timeout_s,
                )
                return self._latest if ok else None
        finally:
            if follower is not None:
                follower.eager = False

    def superseded(self, generation: int) -> bool:
        """A newer plan ends ``generation`` now: its group broke, or it is not the
        planned successor (which waits for the step boundary, :meth:`resize_pending`)."""
        latest = self._latest
        if latest is None or latest.plan.generation <= generation:
            return False
        return not (latest.plan.planned and latest.plan.generation == generation + 1)

    def resize_pending(self, generation: int) -> bool:
        """A newer plan exists: this rank votes to switch after the step in flight."""
        latest = self._latest
        return latest is not None and latest.plan.generation > generation

    # -- publishing from the training thread ------------------------------------
    def publish(
        self,
        subject: Subject,
        msg: Message,
        *,
        wait_s: float | None = None,
        context: otel_context.Context | None = None,
        **tokens: str,
    ) -> None:
        """Publish from any thread; waits for the server's ack when ``wait_s`` is given."""

        async def _pub() -> None:
            assert self._bus is not None
            token = otel_context.attach(context) if context is not None else None
            try:
                await self._bus.publish(subject, msg, **tokens)  # type: ignore[arg-type]
            finally:
                if token is not None:
                    otel_context.detach(token)

        fut = asyncio.run_coroutine_threadsafe(_pub(), self._loop)
        self._in_flight.add(fut)
        fut.add_done_callback(self._in_flight.discard)
        if wait_s is not None:
            with contextlib.suppress(concurrent.futures.TimeoutError):
                fut.result(wait_s)

    def report_collective_error(
        self, rank: int, generation: int, step: int, error: str, *, unrecoverable: bool = False
    ) -> None:
        """Tell the planner that this rank's collective of ``generation`` failed with
        ``error``; ``unrecoverable``: the generation cannot go on whoever joins it (the
        planner stops the job with ``error`` as the reason), sent before the process
        ends on it, so it waits for the server's ack (at most 5 s)."""
        status = self.status
        msg = CollectiveError(
            job=status.job,
            worker=status.worker,
            rank=rank,
            generation=generation,
            step=step,
            error=error[:2000],
            launch=self.launch,
            unrecoverable=unrecoverable,
        )
        self.publish(
            COMM_ERROR, msg, wait_s=5.0 if unrecoverable else None, job=status.job, worker=status.worker
        )
