"""The state-replication service: one keeper per node, following plans and recoveries.

Inputs, through durable JetStream consumers named after the node (so each keeper
sees every message, and a restarted keeper resumes where it stopped):

- ``Plan`` on ``phalanx.cmd.*.plan`` (stream ``PHALANX_CMD``): a new generation's
  membership, which says who holds what state and who must receive it;
- ``RecoveryDone`` on ``phalanx.evt.*.recovered`` (stream ``PHALANX_EVT``): a rank
  finished its first step in a generation, so transfers for it are over.

Each message is handled in the consumer span of its trace (so it joins the
incident's trace) and recorded in :class:`JobView`. Snapshot replication, serving
recovering ranks and tier draining hook in at :meth:`StateReplication.on_plan`
and :meth:`StateReplication.on_recovery_done`.

Environment: ``PHALANX_NODE`` (default: the host name) names the node.
"""

from __future__ import annotations

import os
import re
import socket
from dataclasses import dataclass, field

from nats.aio.msg import Msg
from opentelemetry import trace

from phalanx.bus import COMMANDS, EVENTS, Bus
from phalanx.bus.subjects import PLAN, RECOVERED
from phalanx.schemas import Message, Plan, RecoveryDone
from phalanx.service import Service


def node_name() -> str:
    """This keeper's node, usable in a consumer name (letters, digits, '_' and '-')."""
    raw = os.environ.get("PHALANX_NODE") or socket.gethostname()
    return re.sub(r"[^A-Za-z0-9_-]", "_", raw)[:48] or "node"


@dataclass
class JobView:
    """What this keeper knows of one job."""

    generation: int = 0
    members: dict[str, int] = field(default_factory=dict)  # worker -> rank
    recovered: set[str] = field(default_factory=set)  # workers done in ``generation``


class StateReplication(Service):
    name = "state-replication"

    def __init__(self, bus: Bus, node: str | None = None) -> None:
        super().__init__(bus)
        self.node = node or node_name()
        self.jobs: dict[str, JobView] = {}
        self.plans = 0
        self.recoveries = 0
        self.stale = 0
        self.durables = (f"state-repl-{self.node}-plan", f"state-repl-{self.node}-recovered")

    async def start(self) -> None:
        plan_durable, recovered_durable = self.durables
        # deliver_new: the current plan of a job is in the KV bucket; the stream is
        # for what happens from now on (and, once the consumer exists, across restarts).
        self.bus.consume(COMMANDS, plan_durable, [PLAN.wildcard()], self._on_plan, (Plan,), deliver_new=True)
        self.bus.consume(
            EVENTS,
            recovered_durable,
            [RECOVERED.wildcard()],
            self._on_recovered,
            (RecoveryDone,),
            deliver_new=True,
        )
        self.log.info("following", node=self.node, durables=list(self.durables))

    async def _on_plan(self, msg: Message, raw: Msg) -> None:
        assert isinstance(msg, Plan)
        self.plans += 1
        view = self.jobs.setdefault(msg.job, JobView())
        span = trace.get_current_span()
        span.set_attribute("phalanx.job", msg.job)
        span.set_attribute("phalanx.generation", msg.generation)
        if msg.generation <= view.generation:
            self.stale += 1
            self.log.info("plan_stale", job=msg.job, generation=msg.generation, current=view.generation)
            return
        view.generation = msg.generation
        view.members = {m.worker: m.rank for m in msg.members}
        view.recovered = set()
        self.log.info(
            "plan",
            job=msg.job,
            generation=msg.generation,
            world_size=msg.world_size,
            members=view.members,
            spares=msg.spares,
            removed=msg.removed,
            incident=msg.incident,
        )
        await self.on_plan(msg)

    async def _on_recovered(self, msg: Message, raw: Msg) -> None:
        assert isinstance(msg, RecoveryDone)
        self.recoveries += 1
        view = self.jobs.setdefault(msg.job, JobView())
        span = trace.get_current_span()
        span.set_attribute("phalanx.job", msg.job)
        span.set_attribute("phalanx.generation", msg.generation)
        if msg.generation == view.generation:
            view.recovered.add(msg.worker)
        self.log.info(
            "recovery_done",
            job=msg.job,
            generation=msg.generation,
            worker=msg.worker,
            rank=msg.rank,
            step=msg.step,
            incident=msg.incident,
            phases_ms=msg.phases_ms,
        )
        await self.on_recovery_done(msg)

    async def on_plan(self, plan: Plan) -> None:
        """A newer generation of ``plan.job`` was committed (hook for replication)."""

    async def on_recovery_done(self, done: RecoveryDone) -> None:
        """A rank completed its first step in a generation (hook for replication)."""

    def health_details(self) -> dict[str, str | int | float | bool]:
        return {
            "node": self.node,
            "jobs": len(self.jobs),
            "plans": self.plans,
            "stale_plans": self.stale,
            "recoveries": self.recoveries,
            "consumers": ",".join(self.durables),
        }
