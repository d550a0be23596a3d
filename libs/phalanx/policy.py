"""Write your own elasticity policy as a process of its own.

A policy follows a job on the bus and proposes world sizes; the elasticity-planner
stays the single writer of membership: it validates each proposal (min and max
world size, allowed sizes, spares at hand, the job running) and either commits a
new generation (a ``grow`` or ``shrink`` :class:`~phalanx.contract.PlanDecision`) or
answers ``reject`` with the reason. Start the job with ``phalanx run --no-auto-grow``
so that growing is the policy's call (shrinks on faults and preemption still happen
on their own).

What a policy reads (:meth:`PolicyClient.watch`): the committed plans (generation,
members, spares, batch split), the planner's decisions, recoveries, one
:class:`StepSample` per new step a rank reports in its node's digest, and the
scheduler's capacity and preemption signals. What it publishes
(:meth:`PolicyClient.propose`): a :class:`~phalanx.contract.Proposal` on
``phalanx.cmd.<job>.proposal``. Under an authorizing NATS server it connects as
the ``policy`` role (``PHALANX_NATS_USER=policy``), which allows exactly that.

A complete policy, "grow whenever a spare is idle, trying each size once"::

    import asyncio

    from phalanx.policy import PolicyClient
    from phalanx.contract import Action, Plan, PlanDecision


    async def main(job: str) -> None:
        async with await PolicyClient.connect(name="grow-on-spares") as client:
            world, spares, tried = 0, 0, set[int]()
            async for event in client.watch(job):
                if isinstance(event, Plan):
                    world, spares = event.world_size, len(event.spares)
                elif isinstance(event, PlanDecision) and event.action in (Action.COMPLETE, Action.STOP):
                    return
                if spares and world + 1 not in tried:
                    tried.add(world + 1)
                    decision = await client.propose(job, world + 1, f"{spares} spare(s) idle")
                    print(decision.action.value, decision.reason)


    asyncio.run(main("demo"))

``examples/policy_step_time.py`` is a fuller one: it grows only while the time
per sample improves, and shrinks back when a grow did not pay.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncGenerator
from dataclasses import dataclass
from types import TracebackType

from nats.aio.msg import Msg

from phalanx.bus import Bus
from phalanx.contract import (
    CapacityChanged,
    Message,
    NodeDigest,
    Plan,
    PlanDecision,
    PreemptionNotice,
    Proposal,
    RecoveryDone,
)
from phalanx.contract.streams import COMMANDS, EVENTS
from phalanx.contract.subjects import (
    CAPACITY,
    DECISION,
    NODE_DIGEST,
    PLAN,
    PREEMPT,
    PROPOSAL,
    RECOVERED,
)
from phalanx.telemetry import get_logger

__all__ = [
    "Event",
    "PolicyClient",
    "ProposalTimeout",
    "StepSample",
    "StepSampler",
    "new_proposal_id",
]


@dataclass(frozen=True)
class StepSample:
    """A rank finished a step it had not reported before (from its node's digest).

    ``step_ms`` is that step's duration; ``world_size`` is the size of the
    generation's plan (0 when no plan of ``generation`` was seen yet). Digests come
    once per heartbeat interval, so steps shorter than that are sampled, not all seen.
    """

    job: str
    node: str
    worker: str
    rank: int
    generation: int
    world_size: int
    step: int
    step_ms: float
    ts: float


Event = Plan | PlanDecision | RecoveryDone | StepSample | CapacityChanged | PreemptionNotice
"""What :meth:`PolicyClient.watch` yields; tell them apart with ``isinstance`` (or ``match``)."""


class ProposalTimeout(TimeoutError):
    """No decision named the proposal within the time asked for."""

    def __init__(self, job: str, proposal: str, world_size: int, timeout_s: float) -> None:
        super().__init__(
            f"no decision on proposal {proposal!r} (job {job!r}, world size {world_size}) within "
            f"{timeout_s:g} s: is an elasticity-planner running for job {job!r}, on this NATS server?"
        )
        self.job = job
        self.proposal = proposal
        self.world_size = world_size
        self.timeout_s = timeout_s


def new_proposal_id() -> str:
    """A fresh proposal id (a plain name, as the wire wants it)."""
    return f"p-{uuid.uuid4().hex[:16]}"


class StepSampler:
    """Turns node digests into :class:`StepSample` s: one per step a rank newly reports.

    A digest repeats a rank's latest heartbeat until the rank reports again, and a
    rank that moved to a new generation keeps reporting its last step (and that
    step's duration) until it finishes one there: only a change of step is a sample.
    Spares (rank -1) are skipped; with ``all_ranks=False`` only rank 0 is sampled
    (every rank of a data-parallel step takes the same time, give or take).
    """

    def __init__(self, *, all_ranks: bool = False) -> None:
        self.all_ranks = all_ranks
        self.worlds: dict[int, int] = {}  # generation -> world size, from plans and decisions
        self._last: dict[str, int] = {}  # worker -> the step last sampled

    def feed(self, digest: NodeDigest) -> list[StepSample]:
        out: list[StepSample] = []
        for e in digest.entries:
            if e.rank < 0 or (e.rank != 0 and not self.all_ranks):
                continue
            if self._last.get(e.worker) == e.step:
                continue
            self._last[e.worker] = e.step
            if e.step == 0 or e.step_ms <= 0:
                continue  # no step done yet
            out.append(
                StepSample(
                    job=digest.job,
                    node=digest.node,
                    worker=e.worker,
                    rank=e.rank,
                    generation=e.generation,
                    world_size=self.worlds.get(e.generation, 0),
                    step=e.step,
                    step_ms=e.step_ms,
                    ts=digest.ts,
                )
            )
        return out


class PolicyClient:
    """One policy process's connection: :meth:`watch` a job, :meth:`propose` sizes."""

    def __init__(self, bus: Bus, name: str) -> None:
        self.bus = bus
        # A policy is no error publisher (phalanx.err.*): what it refuses is logged only.
        bus.bad_input.publish_events = False
        self.name = name
        self.log = get_logger(component="policy", policy=name)
        self.dropped = 0  # events a slow consumer of watch() lost (its queue was full)

    @classmethod
    async def connect(cls, url: str | None = None, *, name: str, ensure: bool = False) -> PolicyClient:
        """Connect to NATS (``url`` or ``NATS_URL``) as the policy ``name``.

        ``name`` (at most 64 characters) goes into every proposal. The ``policy``
        role may not create streams: the services create them (``ensure=True`` is for
        a bare server, e.g. in a test).
        """
        if not 0 < len(name) <= 64:
            raise ValueError(f"a policy name has 1 to 64 characters, got {name!r}")
        return cls(await Bus.connect(url, name=name, ensure=ensure), name)

    async def close(self) -> None:
        await self.bus.close()

    async def __aenter__(self) -> PolicyClient:
        return self

    async def __aexit__(
        self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()

    # -- proposing -----------------------------------------------------------------
    async def propose(
        self,
        job: str,
        world_size: int,
        reason: str = "",
        *,
        timeout_s: float = 10.0,
        proposal_id: str | None = None,
    ) -> PlanDecision:
        """Ask the planner to take ``job`` to ``world_size``; returns its decision.

        The decision is ``grow``/``shrink`` (committed: ``generation``, ``world_size``,
        ``batch``) or ``reject`` (``reason`` says why); check ``decision.action``.
        Raises :class:`ProposalTimeout` when no decision names the proposal within
        ``timeout_s`` (publishing included), and the bus's error when the proposal
        cannot be published (e.g. :class:`~phalanx.bus.PermissionDenied`).
        """
        pid = proposal_id or new_proposal_id()
        proposal = Proposal(job=job, id=pid, policy=self.name, world_size=world_size, reason=reason[:500])
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        answer: asyncio.Future[PlanDecision] = loop.create_future()

        async def on_decision(msg: PlanDecision, raw: Msg) -> None:
            if msg.proposal == pid and not answer.done():
                answer.set_result(msg)

        # Subscribed before publishing: the answer cannot come before we listen.
        sub = await self.bus.subscribe(
            DECISION.format(job=job), on_decision, PlanDecision, trace_messages=False
        )
        try:
            self.log.info("proposal", job=job, proposal=pid, world_size=world_size, reason=reason)
            await self.bus.publish(
                PROPOSAL, proposal, job=job, msg_id=f"{job}:proposal:{pid}", retry_for_s=timeout_s
            )
            try:
                decision = await asyncio.wait_for(answer, max(0.0, deadline - loop.time()))
            except TimeoutError:
                # Missed while the connection was away? The stream keeps the last decision.
                stored = await self._stored_decision(job)
                if stored is None or stored.proposal != pid:
                    raise ProposalTimeout(job, pid, world_size, timeout_s) from None
                decision = stored
        finally:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()
        self.log.info(
            "proposal_decided",
            job=job,
            proposal=pid,
            action=decision.action.value,
            reason=decision.reason,
            generation=decision.generation,
            world_size=decision.world_size,
        )
        return decision

    async def _stored_decision(self, job: str) -> PlanDecision | None:
        stored = await self.bus.streams.last(EVENTS, DECISION.format(job=job), PlanDecision)
        return stored.msg if stored is not None else None

    # -- following -----------------------------------------------------------------
    async def latest_plan(self, job: str) -> Plan | None:
        """The last plan published for ``job`` (from the command stream), or None."""
        stored = await self.bus.streams.last(COMMANDS, PLAN.format(job=job), Plan)
        return stored.msg if stored is not None else None

    async def watch(
        self,
        job: str,
        *,
        cluster: str | None = None,
        all_ranks: bool = False,
        queue_size: int = 10_000,
    ) -> AsyncGenerator[Event, None]:
        """Everything a policy of ``job`` may follow, as it happens.

        First the latest committed plan (when there is one), then: newer plans
        (each generation once, however often the planner re-publishes it),
        decisions, recoveries, step samples (rank 0's, or every rank's with
        ``all_ranks``), capacity changes of ``cluster`` (default: every cluster)
        and preemption notices of ``job`` or of no job in particular.

        Core NATS subscriptions: what happens while the connection is away is not
        seen (a reconnect is followed by the next plan, decision, digest). Events
        beyond ``queue_size`` not yet taken are dropped and counted in ``dropped``.
        Use ``contextlib.aclosing`` (or :meth:`close`) to unsubscribe when leaving early.
        """
        kinds: tuple[type[Message], ...] = (
            Plan,
            NodeDigest,
            PlanDecision,
            RecoveryDone,
            CapacityChanged,
            PreemptionNotice,
        )
        queue: asyncio.Queue[Event] = asyncio.Queue(queue_size)
        sampler = StepSampler(all_ranks=all_ranks)
        newest: Plan | None = None  # the newest plan handed out (Plan.supersedes)

        def put(event: Event) -> None:
            try:
                queue.put_nowait(event)
            except asyncio.QueueFull:
                self.dropped += 1
                if self.dropped == 1 or self.dropped % 1000 == 0:
                    self.log.warning("policy_events_dropped", job=job, dropped=self.dropped)

        def on_plan(plan: Plan) -> None:
            nonlocal newest
            if not plan.supersedes(newest):
                return
            newest = plan
            sampler.worlds[plan.generation] = plan.world_size
            put(plan)

        async def on_msg(msg: Message, raw: Msg) -> None:
            if isinstance(msg, Plan):
                on_plan(msg)
            elif isinstance(msg, NodeDigest):
                for sample in sampler.feed(msg):
                    put(sample)
            elif isinstance(msg, PlanDecision):
                if msg.generation is not None and msg.world_size is not None:
                    sampler.worlds[msg.generation] = msg.world_size
                put(msg)
            elif isinstance(msg, PreemptionNotice):
                if msg.job in (None, job):
                    put(msg)
            elif isinstance(msg, RecoveryDone | CapacityChanged):
                put(msg)

        where = {"cluster": cluster} if cluster else {}
        subjects = [
            PLAN.format(job=job),
            NODE_DIGEST.wildcard(job=job),
            DECISION.format(job=job),
            RECOVERED.wildcard(job=job),
            CAPACITY.wildcard(**where),
            PREEMPT.wildcard(**where),
        ]
        subs = [await self.bus.subscribe(s, on_msg, kinds, trace_messages=False) for s in subjects]
        try:
            plan = await self.latest_plan(job)  # after subscribing: nothing newer slips between
            if plan is not None:
                on_plan(plan)
            while True:
                yield await queue.get()
        finally:
            for sub in subs:
                with contextlib.suppress(Exception):
                    await sub.unsubscribe()
