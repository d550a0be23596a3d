"""How a simulated launcher (and a simulated rank) of ``bench.scale`` receives plans: the
one place that differs between plan-delivery designs.

A design hands out :class:`PlanSource` objects. The harness starts one per live simulated
launcher (and, where the design has ranks read plans from NATS themselves, one per
simulated rank it can afford, see ``--rank-followers``), hands it a callback and reads back
how many payload bytes it received, by channel. What a source delivers is a
:class:`Held`: the part of a plan the harness acts on (the generation, the job-level run,
the ranks of the node's own workers, whether the node was declared lost), so the harness
does not depend on the wire form of plans, which the designs are free to change.

- ``today``: every launcher and every rank follows the KV record ``<job>.plan`` with the
  project's :class:`~phalanx.worker.follow.PlanFollower` (the watch, the re-read while
  ``eager``, the plan subject), as ``phalanx.launcher.launcher`` and ``phalanx.worker.agent``
  do: launchers with ``poll_s=2.0`` and ``eager`` always on, ranks with ``poll_s=1.0``.
  :class:`CountingFollower` is that follower with byte counters on its three inputs.
- ``new``: each launcher follows the plan as the real one does
  (:class:`~phalanx.launcher.planview.NodePlanFollower`: a delta per generation, the
  record read only when a delta does not apply) and acknowledges its node's members in
  one :class:`~phalanx.contract.NodeAck`; its ranks get their part over the local socket,
  so :meth:`Design.rank_source` returns None and no per-rank traffic is counted.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from nats.aio.msg import Msg

from phalanx.bus import Bus
from phalanx.contract import NodePlan, Plan
from phalanx.launcher.planview import NodePlanFollower
from phalanx.worker.follow import PlanFollower


@dataclass(frozen=True)
class Held:
    """What a simulated node takes from a plan it received."""

    generation: int
    launch: str
    ranks: dict[str, int]
    """The node's (or the rank's) own workers that are members: worker -> rank."""
    lost: bool = False
    """This node's launcher was declared lost (it fences everything and ends)."""
    by_message: bool = False
    """Came on the plan subject (possibly a re-send: an acknowledgement may have been lost)."""


OnHeld = Callable[[Held], None]


@dataclass
class Counted:
    """Payload bytes (and messages) a source received, by channel."""

    bytes: dict[str, int] = field(default_factory=dict)
    msgs: dict[str, int] = field(default_factory=dict)

    def add(self, channel: str, n: int) -> None:
        self.bytes[channel] = self.bytes.get(channel, 0) + n
        self.msgs[channel] = self.msgs.get(channel, 0) + 1

    def take(self) -> tuple[dict[str, int], dict[str, int]]:
        """The counts so far, and zero again (one plan's window)."""
        out = (self.bytes, self.msgs)
        self.bytes, self.msgs = {}, {}
        return out


class PlanSource(Protocol):
    """One simulated launcher's (or rank's) way of receiving plans."""

    counted: Counted

    async def start(self, on_held: OnHeld) -> None:
        """Start receiving; ``on_held`` gets every plan seen (duplicates included)."""
        ...

    async def stop(self) -> None: ...


class Design(Protocol):
    name: str
    node_acks: bool  # the launcher acknowledges its node's members at once (NodeAck)

    def launcher_source(
        self, bus: Bus, job: str, node: str, launcher: str, workers: list[str], run: str = ""
    ) -> PlanSource:
        """The source of the launcher ``launcher`` of ``node``, whose workers are ``workers``
        (a list the harness keeps up to date as spares are added)."""
        ...

    def rank_source(self, bus: Bus, job: str, worker: str) -> PlanSource | None:
        """The source of one rank's own plans, or None: ranks read nothing from NATS."""
        ...


# -- today: the KV record, followed by everyone ---------------------------------------------
class CountingFollower(PlanFollower):
    """:class:`PlanFollower` counting the payload bytes of its inputs: ``read`` (a get of
    the record: at start, after a reconnect, every ``poll_s`` while eager), ``watch`` (a
    value of the KV watch) and ``message`` (the plan subject, the planner's sends and
    re-sends). Headers and protocol framing are not counted (the server's own figures in
    ``bench.scale`` are)."""

    def __init__(self, bus: Bus, job: str, on_plan: Callable[[Plan, bool], None], *, poll_s: float) -> None:
        super().__init__(bus, job, on_plan, poll_s=poll_s)
        self.counted = Counted()
        self._reading = False

    async def read(self) -> None:
        self._reading = True
        try:
            await super().read()
        finally:
            self._reading = False

    def _take(self, value: bytes | None) -> None:
        if value:
            self.counted.add("read" if self._reading else "watch", len(value))
        super()._take(value)

    async def _on_msg(self, plan: Plan, raw: Msg) -> None:
        self.counted.add("message", len(raw.data))
        await super()._on_msg(plan, raw)


class TodaySource:
    """A launcher (``workers``: its node's) or a rank (``workers``: itself) following the
    record as today's processes do."""

    def __init__(
        self, bus: Bus, job: str, *, launcher: str, workers: list[str], poll_s: float, eager: bool
    ) -> None:
        self.bus, self.job, self.launcher, self.workers = bus, job, launcher, workers
        self.poll_s, self.eager = poll_s, eager
        self.follower: CountingFollower | None = None
        self.counted = Counted()

    async def start(self, on_held: OnHeld) -> None:
        def on_plan(plan: Plan, by_message: bool) -> None:
            ranks = {w: r for w in self.workers if (r := plan.rank_of(w)) is not None}
            lost = bool(self.launcher) and self.launcher in plan.lost_launchers
            on_held(Held(plan.generation, plan.launch, ranks, lost, by_message))

        self.follower = CountingFollower(self.bus, self.job, on_plan, poll_s=self.poll_s)
        self.follower.counted = self.counted
        self.follower.eager = self.eager
        await self.follower.start()

    async def stop(self) -> None:
        if self.follower is not None:
            with contextlib.suppress(Exception):
                await self.follower.stop()


class Today:
    name = "today"

    node_acks = False  # every member acknowledges on NATS itself

    def launcher_source(
        self, bus: Bus, job: str, node: str, launcher: str, workers: list[str], run: str = ""
    ) -> PlanSource:
        # phalanx.launcher.launcher: PlanFollower(bus, job, ..., poll_s=2.0), eager always
        return TodaySource(bus, job, launcher=launcher, workers=workers, poll_s=2.0, eager=True)

    def rank_source(self, bus: Bus, job: str, worker: str) -> PlanSource | None:
        # phalanx.worker.agent: PlanFollower(bus, job, ...) (poll_s=1.0), eager only in wait_plan
        return TodaySource(bus, job, launcher="", workers=[worker], poll_s=1.0, eager=False)


# -- new: deltas to launchers, the node's part handed to ranks locally ---------------------
class NewSource:
    """A launcher following the plan as the real one does (:class:`NodePlanFollower`: the
    deltas, a read of the record when one does not apply), counting ``delta`` and ``read``
    bytes. Its ranks get their part over the local socket: nothing on NATS."""

    def __init__(self, bus: Bus, job: str, node: str, *, launcher: str, workers: list[str], run: str) -> None:
        self.bus, self.job, self.node, self.launcher, self.workers, self.run = (
            bus,
            job,
            node,
            launcher,
            workers,
            run,
        )
        self.follower: NodePlanFollower | None = None
        self.counted = Counted()

    async def start(self, on_held: OnHeld) -> None:
        def on_plan(view: NodePlan, resend: bool) -> None:
            lost = self.launcher in view.lost_launchers
            on_held(Held(view.generation, view.launch, dict(view.ranks), lost, resend))

        self.follower = NodePlanFollower(self.bus, self.job, self.node, lambda: self.workers, on_plan)
        self.follower.on_bytes = self.counted.add
        await self.follower.start()
        await self.follower.follow(self.run)

    async def stop(self) -> None:
        if self.follower is not None:
            with contextlib.suppress(Exception):
                await self.follower.stop()


class New:
    name = "new"
    node_acks = True  # the launcher acknowledges its node's members in one NodeAck

    def launcher_source(
        self, bus: Bus, job: str, node: str, launcher: str, workers: list[str], run: str = ""
    ) -> PlanSource:
        return NewSource(bus, job, node, launcher=launcher, workers=workers, run=run)

    def rank_source(self, bus: Bus, job: str, worker: str) -> PlanSource | None:
        return None  # ranks read nothing from NATS: their launcher hands them their part


DESIGNS: dict[str, Callable[[], Any]] = {"today": Today, "new": New}


def design(name: str) -> Design:
    """The design called ``name`` (``today`` or ``new``)."""
    if name not in DESIGNS:
        raise ValueError(f"unknown design {name!r}: {sorted(DESIGNS)}")
    made: Design = DESIGNS[name]()
    return made
