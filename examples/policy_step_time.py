"""A custom elasticity policy: grow only while the time per sample improves.

    phalanx run --job gpt --nproc 2 --spares 2 --max-nproc 4 --no-auto-grow -- python -m examples.train_gpt
    python -m examples.policy_step_time --job gpt [--min-gain 0.05] [--window 10] [--max 4]

(with NATS and the services running: see "Your own elasticity policy" in README.md).

**What it measures.** The job trains a global batch of ``B`` samples per step
(the plan's batch split; the planner holds it constant across sizes). With
``T(W)`` the median step time at world size ``W``, the throughput is ``B / T(W)``
samples per second and the *time per sample* is ``T(W) / B``: the wall time the
whole job spends per sample. ``T(W)`` is rank 0's step time from its node's
digests: the first ``--discard`` steps of each generation are dropped (rendezvous,
state transfer, warm-up), the median of the next ``--window`` is the measurement.
Since ``B`` does not change, a bigger world is faster only if its step is shorter.
(This optimises speed. A cost-aware variant would compare ``W * T(W) / B``,
replica-seconds per sample.)

**What it does.** Once the current size ``W`` is measured, if the plan lists idle
spares (or the planner just reported a node joining or workers started) and ``W``
is below ``--max``, it proposes ``W+1`` and waits for the planner's decision:

- ``grow`` (committed): it measures the new size. If the time per sample fell by
  at least ``--min-gain`` (0.05: 5 %), it keeps it and tries the next size;
  otherwise it proposes shrinking back and never proposes that size, or a larger
  one, again.
- ``reject``: the reason is logged. "beyond max": no larger size is tried (without
  ``--max`` that is how it learns the maximum); "not an allowed size": that size is
  never tried again (the next one is, so allowed sizes 2, 4, 8 are found); anything
  else (no spares, job not running, cool-down): it asks again after the next plan,
  a join, or ``--retry-s`` seconds.

It holds still while a preemption notice for the job runs, and ends on SIGTERM
or SIGINT, or when the job completes or stops. Every plan, measurement, verdict,
proposal and answer is one JSON line on stderr. The logic is
:class:`StepTimePolicy`, a pure function of what it observed (tested in
``tests/unit/test_policy_client.py``); :func:`follow` feeds it from the bus.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import re
import signal
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Literal

from phalanx.contract import Action, Plan, PlanDecision, PreemptionNotice
from phalanx.policy import PolicyClient, ProposalTimeout, StepSample
from phalanx.telemetry import get_logger, setup_logging

NAME = "policy-step-time"


# -- measuring -------------------------------------------------------------------------
def median_window(samples: Sequence[tuple[int, float]], *, discard: int, window: int) -> float | None:
    """Median step time of a generation, or None while there are too few samples.

    ``samples`` are one generation's ``(step, step_ms)`` in step order. Steps before
    ``first + discard`` (``first``: the first step sampled) are dropped; the median
    is over the next ``window`` samples, so it is fixed once they are in.
    """
    if not samples or window < 1:
        return None
    first = samples[0][0]
    kept = [ms for step, ms in samples if step >= first + discard]
    if len(kept) < window:
        return None
    return float(statistics.median(kept[:window]))


@dataclass(frozen=True)
class Measurement:
    world: int
    generation: int
    step_ms: float  # the median step time T(W)
    batch: int  # samples per step B (the plan's effective batch; 0: not known)

    @property
    def per_sample_ms(self) -> float:
        """T(W) / B; T(W) when B is not known (a constant factor for comparisons)."""
        return self.step_ms / self.batch if self.batch else self.step_ms


def gain(before: Measurement, after: Measurement) -> float:
    """How much less time per sample ``after`` takes: 0.1 is 10 % less, negative is more."""
    if before.batch and after.batch:
        return 1.0 - after.per_sample_ms / before.per_sample_ms
    return 1.0 - after.step_ms / before.step_ms  # B unknown on one side: assume it held


# -- the planner's refusals --------------------------------------------------------------
class Refusal(StrEnum):
    BEYOND_MAX = "beyond_max"  # this size and every larger one
    NOT_ALLOWED = "not_allowed"  # this size, for good
    FOR_NOW = "for_now"  # ask again later (no spares, job not running, cool-down...)


_BEYOND_MAX = re.compile(
    r"\b(beyond|above|exceeds?|over|larger than|greater than|more than)\b.*\bmax|max_world_size"
)
_NOT_ALLOWED = re.compile(r"allowed sizes?\b|multiple of|size_step|below\b.*\bmin")


def classify_refusal(reason: str) -> Refusal:
    """What a ``reject`` means for the sizes to try (from the planner's reason text)."""
    text = reason.lower()
    if _BEYOND_MAX.search(text):
        return Refusal.BEYOND_MAX
    if _NOT_ALLOWED.search(text):
        return Refusal.NOT_ALLOWED
    return Refusal.FOR_NOW


# -- the policy, a pure function of what it saw -------------------------------------------
@dataclass(frozen=True)
class Intent:
    """A proposal to make: ``grow`` to try a size, ``revert`` to undo a grow that did not pay."""

    world_size: int
    kind: Literal["grow", "revert"]
    reason: str


@dataclass(frozen=True)
class Trial:
    before: int  # the size grown from
    after: int  # the size grown to
    generation: int  # the generation the grow committed


@dataclass(frozen=True)
class Verdict:
    before: Measurement
    after: Measurement
    gain: float
    kept: bool


@dataclass
class StepTimePolicy:
    """Grow while the time per sample improves by ``min_gain``; see the module docstring.

    Feed it with ``on_plan``, ``on_sample``, ``on_decision``, ``on_preempt``; ask
    ``judge`` after a measurement and ``next_intent`` after anything; report what
    came of an intent with ``on_answer`` or ``on_timeout``. ``now`` is any monotonic
    clock in seconds. Nothing here does I/O.
    """

    min_gain: float = 0.05
    window: int = 10
    discard: int = 3
    max_world: int = 0  # 0: not known (learned from "beyond max" refusals)
    retry_s: float = 30.0
    # What it has seen of the job.
    generation: int = 0
    world: int = 0
    spares: int = 0
    batch: int = 0
    spares_hint: bool = False  # a node joined / workers started since the last plan
    ended: bool = False
    # What it has learned and is doing.
    measured: dict[int, Measurement] = field(default_factory=dict)  # world -> its latest measurement
    ceiling: int = 0  # never propose this size or a larger one (0: no ceiling)
    banned: set[int] = field(default_factory=set)  # sizes the planner does not allow
    retry_at: float = 0.0  # no proposal before this (a refusal for now, a timeout)
    hold_until: float = 0.0  # a preemption is under way
    trial: Trial | None = None  # a grow being measured
    undo: Trial | None = None  # a grow to shrink back from
    _steps: list[tuple[int, float]] = field(default_factory=list)  # this generation's rank-0 samples
    _measured_generation: int = 0

    # -- observations ------------------------------------------------------------------
    def on_plan(self, generation: int, world: int, spares: int, batch: int) -> None:
        """A committed plan (older generations are ignored)."""
        if generation < self.generation:
            return
        if generation > self.generation:
            self._steps = []
            self.spares_hint = False
            self.retry_at = 0.0  # something changed: a refusal for now may not hold any more
        self.generation, self.world, self.spares, self.batch = generation, world, spares, batch
        if self.trial is not None and world != self.trial.after:
            self.trial = None  # a fault (or another policy) changed the size under the trial
        if self.undo is not None and world != self.undo.after:
            self.undo = None  # shrunk back, or changed otherwise: nothing left to undo

    def on_sample(self, generation: int, step: int, step_ms: float) -> Measurement | None:
        """Rank 0 finished ``step``; returns the measurement when this sample completes one."""
        if generation != self.generation or self.world == 0 or self._measured_generation == generation:
            return None
        if self._steps and step <= self._steps[-1][0]:
            return None
        self._steps.append((step, step_ms))
        median = median_window(self._steps, discard=self.discard, window=self.window)
        if median is None:
            return None
        m = Measurement(self.world, generation, median, self.batch)
        self.measured[self.world] = m
        self._measured_generation = generation
        return m

    def on_decision(self, action: Action) -> None:
        """A decision seen on the job's decision subject (answers to proposals come to on_answer)."""
        if action in (Action.COMPLETE, Action.STOP):
            self.ended = True
        elif action in (Action.JOIN, Action.SPAWN):
            self.spares_hint = True
            self.retry_at = 0.0

    def on_preempt(self, deadline_s: float, now: float) -> None:
        self.hold_until = max(self.hold_until, now + deadline_s)

    # -- judging and proposing -----------------------------------------------------------
    def judge(self) -> Verdict | None:
        """The verdict on the grow under trial, once its new size is measured."""
        t = self.trial
        if t is None:
            return None
        before, after = self.measured.get(t.before), self.measured.get(t.after)
        if before is None or after is None or after.generation < t.generation:
            return None
        g = gain(before, after)
        kept = g >= self.min_gain
        self.trial = None
        if not kept:
            self.ceiling = min(self.ceiling, t.after) if self.ceiling else t.after
            self.undo = t
        return Verdict(before, after, g, kept)

    def next_intent(self, now: float) -> Intent | None:
        """The proposal to make now, if any."""
        if self.ended or self.world == 0 or self.trial is not None:
            return None
        if now < self.hold_until or now < self.retry_at:
            return None
        if self.undo is not None:
            u = self.undo
            return Intent(
                u.before,
                "revert",
                f"time per sample at {u.after} replicas fell less than {self.min_gain:.0%} "
                f"from {u.before}: back to {u.before}",
            )
        here = self.measured.get(self.world)
        if here is None:
            return None  # measure the current size first
        target = self._grow_target()
        if target is None:
            return None
        return Intent(
            target,
            "grow",
            f"{self.spares} spare(s) idle, {here.per_sample_ms:.4g} ms per "
            f"{'sample' if here.batch else 'step'} at {self.world} replicas: try {target}",
        )

    def _grow_target(self) -> int | None:
        room = self.spares or (1 if self.spares_hint else 0)
        limit = self.world + room
        if self.max_world:
            limit = min(limit, self.max_world)
        if self.ceiling:
            limit = min(limit, self.ceiling - 1)
        return next((n for n in range(self.world + 1, limit + 1) if n not in self.banned), None)

    # -- what came of an intent -----------------------------------------------------------
    def on_answer(self, intent: Intent, decision: PlanDecision, now: float) -> Refusal | None:
        """The planner's decision on ``intent``; returns how a refusal was taken."""
        self.spares_hint = False
        committed = decision.action in (Action.GROW, Action.SHRINK) and decision.generation is not None
        if committed:
            assert decision.generation is not None
            before = self.world
            world = decision.world_size or intent.world_size
            batch = decision.batch.effective_batch if decision.batch is not None else self.batch
            self.on_plan(decision.generation, world, max(0, self.spares - (world - before)), batch)
            if intent.kind == "grow":
                self.trial = Trial(before, world, decision.generation)
            return None
        refusal = classify_refusal(decision.reason) if decision.action is Action.REJECT else Refusal.FOR_NOW
        if refusal is Refusal.FOR_NOW:
            self.retry_at = now + self.retry_s
        elif intent.kind == "revert":
            self.undo = None  # the planner will not go back there: stay (the ceiling holds)
        elif refusal is Refusal.BEYOND_MAX:
            limit = intent.world_size - 1
            self.max_world = min(self.max_world, limit) if self.max_world else limit
        else:
            self.banned.add(intent.world_size)
        return refusal

    def on_timeout(self, intent: Intent, now: float) -> None:
        self.spares_hint = False
        self.retry_at = now + self.retry_s


# -- the process ---------------------------------------------------------------------------
async def follow(
    client: PolicyClient,
    policy: StepTimePolicy,
    job: str,
    *,
    timeout_s: float = 10.0,
    clock: Callable[[], float] = time.monotonic,
) -> None:
    """Feed ``policy`` from the job's events and make its proposals, until the job ends."""
    log = get_logger(component="policy", policy=client.name, job=job)
    async with contextlib.aclosing(client.watch(job)) as events:
        async for event in events:
            now = clock()
            if isinstance(event, Plan):
                batch = event.batch.effective_batch if event.batch is not None else 0
                policy.on_plan(event.generation, event.world_size, len(event.spares), batch)
                log.info(
                    "plan",
                    generation=event.generation,
                    world_size=event.world_size,
                    spares=len(event.spares),
                    batch=batch,
                )
            elif isinstance(event, StepSample):
                m = policy.on_sample(event.generation, event.step, event.step_ms)
                if m is not None:
                    log.info("measured", **_measurement(m))
                    v = policy.judge()
                    if v is not None:
                        log.info(
                            "verdict",
                            kept=v.kept,
                            gain=round(v.gain, 4),
                            min_gain=policy.min_gain,
                            before=_measurement(v.before),
                            after=_measurement(v.after),
                        )
            elif isinstance(event, PlanDecision) and event.proposal is None:
                policy.on_decision(event.action)
                if policy.ended:
                    log.info("job_ended", action=event.action.value, reason=event.reason)
                    return
            elif isinstance(event, PreemptionNotice):
                policy.on_preempt(event.deadline_s, now)
                log.info("preemption_hold", deadline_s=event.deadline_s, reason=event.reason)
            intent = policy.next_intent(now)
            if intent is not None:
                await _propose(client, policy, job, intent, timeout_s, clock, log)


async def _propose(
    client: PolicyClient,
    policy: StepTimePolicy,
    job: str,
    intent: Intent,
    timeout_s: float,
    clock: Callable[[], float],
    log: Any,
) -> None:
    log.info("propose", kind=intent.kind, world_size=intent.world_size, reason=intent.reason)
    try:
        decision = await client.propose(job, intent.world_size, intent.reason, timeout_s=timeout_s)
    except ProposalTimeout as exc:
        policy.on_timeout(intent, clock())
        log.warning("proposal_timeout", world_size=intent.world_size, error=str(exc))
        return
    refusal = policy.on_answer(intent, decision, clock())
    log.info(
        "answer",
        kind=intent.kind,
        proposal=decision.proposal,
        world_size=intent.world_size,
        action=decision.action.value,
        reason=decision.reason,
        generation=decision.generation,
        refusal=refusal.value if refusal is not None else None,
    )


def _measurement(m: Measurement) -> dict[str, Any]:
    return {
        "world_size": m.world,
        "generation": m.generation,
        "step_ms": round(m.step_ms, 3),
        "batch": m.batch,
        "per_sample_ms": round(m.per_sample_ms, 6),
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m examples.policy_step_time",
        description="Grow a Phalanx job only while the time per sample improves.",
    )
    p.add_argument("--job", required=True, help="the job to follow")
    p.add_argument("--min-gain", type=float, default=0.05, help="least relative gain that keeps a grow")
    p.add_argument("--window", type=int, default=10, help="steps per measurement (their median)")
    p.add_argument("--discard", type=int, default=3, help="first steps of a generation not measured")
    p.add_argument("--max", type=int, default=0, help="largest world size to propose (0: ask the planner)")
    p.add_argument("--retry-s", type=float, default=30.0, help="wait after a refusal for now or a timeout")
    p.add_argument("--timeout-s", type=float, default=10.0, help="wait for the planner's decision")
    p.add_argument("--name", default=NAME, help="the policy's name in its proposals")
    p.add_argument("--nats-url", default=None, help="the NATS server (default: NATS_URL)")
    args = p.parse_args(argv)
    if args.window < 1 or args.discard < 0 or args.max < 0 or not 0 <= args.min_gain < 1:
        p.error("need --window >= 1, --discard >= 0, --max >= 0 and 0 <= --min-gain < 1")
    return args


async def run(args: argparse.Namespace) -> int:
    log = get_logger(component="policy", policy=args.name, job=args.job)
    policy = StepTimePolicy(
        min_gain=args.min_gain,
        window=args.window,
        discard=args.discard,
        max_world=args.max,
        retry_s=args.retry_s,
    )
    client = await PolicyClient.connect(args.nats_url, name=args.name)
    task = asyncio.create_task(follow(client, policy, args.job, timeout_s=args.timeout_s))
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    signals = (signal.SIGTERM, signal.SIGINT)
    for sig in signals:
        loop.add_signal_handler(sig, stop.set)
    log.info("policy_started", min_gain=args.min_gain, window=args.window, max=args.max)
    stopping = asyncio.create_task(stop.wait())
    try:
        await asyncio.wait({task, stopping}, return_when=asyncio.FIRST_COMPLETED)
        # Python 3.11's wait_for loses a cancel that lands as its inner future completes
        # (nats-py's requests use it): cancel until the task has ended.
        while not task.done():
            task.cancel()
            await asyncio.wait({task}, timeout=0.5)
        if not task.cancelled():
            task.result()  # the job's end, or follow's error
    finally:
        stopping.cancel()
        for sig in signals:
            loop.remove_signal_handler(sig)
        await client.close()
    log.info("policy_stopped", why="signal" if stop.is_set() else "job ended")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    setup_logging(NAME)
    return asyncio.run(run(args))


if __name__ == "__main__":
    sys.exit(main())
