"""Handing the node's plan to its workers, and acknowledging it for them.

The launcher's half of :mod:`phalanx.worker.plansocket`. Each worker has its own
datagram socket in the launcher's private directory; :class:`Handout` sends every new
:class:`~phalanx.contract.NodePlan` to each live worker, learns from their heartbeats
(``Heartbeat.plan``, checked by pid with the kernel) which generation each holds,
sends the plan again to one that is behind (at most every ``resend_s``), and
publishes one :class:`~phalanx.contract.NodeAck` naming the node's members that
hold the current generation -- as they catch up, so a member that never does (it
died) holds back only itself, and again, whole, when the planner re-sends the plan.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
from collections.abc import Awaitable, Callable, Collection
from pathlib import Path

from phalanx.contract import Heartbeat, NodeAck, NodePlan
from phalanx.worker.plansocket import send_plan

PublishAck = Callable[[NodeAck], Awaitable[None]]


class Handout:
    def __init__(
        self, job: str, node: str, directory: Path, publish: PublishAck, resend_s: float = 0.2
    ) -> None:
        self.job, self.node = job, node
        self.directory = directory
        self.publish = publish
        self.resend_s = resend_s
        self.plan: NodePlan | None = None
        self.sent = 0  # datagrams handed out
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._sock.setblocking(False)
        self._last_sent: dict[str, float] = {}
        self._acked: set[str] = set()  # members named in a NodeAck of the current generation
        self._holding: set[str] = set()  # members known to hold the current generation
        self._flush: asyncio.Task[None] | None = None

    def path_of(self, worker: str) -> str:
        """The worker's plan socket (``PHALANX_PLAN_SOCKET``)."""
        return str(self.directory / f"{worker}.plan")

    def hand_out(self, plan: NodePlan, workers: Collection[str], resend: bool = False) -> None:
        """A newer part for this node (or, ``resend``, the planner sent the held one again)."""
        if resend and self.plan is not None and plan.generation == self.plan.generation:
            self._acked.clear()  # the planner has not heard us: say it all again
            self._ack_soon()
            return
        self.plan = plan
        self._acked.clear()
        self._holding.clear()
        self._last_sent.clear()
        for w in workers:
            self._send(w)

    def started(self, worker: str) -> None:
        """A new process runs as ``worker`` (a restart under the same name): its first
        heartbeat gets the plan at once, whatever was sent to the one before it."""
        self._last_sent.pop(worker, None)
        self._holding.discard(worker)

    def heard(self, hb: Heartbeat) -> None:
        """A heartbeat accepted from ``hb.worker``: send the plan again if it is behind,
        count it as holding the plan if it is not."""
        plan = self.plan
        if plan is None:
            return
        if hb.plan < plan.generation:
            if time.monotonic() - self._last_sent.get(hb.worker, 0.0) >= self.resend_s:
                self._send(hb.worker)
            return
        if hb.worker in plan.ranks and hb.worker not in self._holding:
            self._holding.add(hb.worker)
            self._ack_soon()

    def _send(self, worker: str) -> None:
        assert self.plan is not None
        self._last_sent[worker] = time.monotonic()
        if send_plan(self._sock, self.path_of(worker), self.plan):
            self.sent += 1

    def _ack_soon(self) -> None:
        if self._flush is None or self._flush.done():
            self._flush = asyncio.get_running_loop().create_task(self._ack())

    async def _ack(self) -> None:
        await asyncio.sleep(0)  # heartbeats read in the same turn go in one message
        while True:  # members that caught up while a publish was in flight go in the next
            plan = self.plan
            new = self._holding - self._acked
            if plan is None or not new:
                return
            self._acked |= new
            ack = NodeAck(
                job=self.job, node=self.node, generation=plan.generation, workers=sorted(self._holding)
            )
            with contextlib.suppress(Exception):  # cut off: the planner sends the plan again, we ack again
                await self.publish(ack)

    def close(self) -> None:
        if self._flush is not None:
            self._flush.cancel()
        self._sock.close()
