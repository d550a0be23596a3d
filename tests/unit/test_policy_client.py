"""The pure parts of custom policies: phalanx.policy.StepSampler (node digests to
step samples) and examples/policy_step_time.py's StepTimePolicy (grow only while the
time per sample improves), driven by observations alone -- no bus, no clock."""

from __future__ import annotations

import pytest

from examples.policy_step_time import (
    Measurement,
    Refusal,
    StepTimePolicy,
    classify_refusal,
    gain,
    median_window,
    parse_args,
)
from phalanx.contract import (
    Action,
    BatchPlan,
    DigestEntry,
    NodeDigest,
    Phase,
    PlanDecision,
    Proposal,
)
from phalanx.policy import StepSampler, new_proposal_id

JOB = "j1"
BATCH = 12


# -- the median window -------------------------------------------------------------------
def test_median_window_discards_the_first_steps_of_the_generation() -> None:
    samples = [(10, 900.0), (11, 500.0), (12, 100.0), (13, 104.0), (14, 98.0)]
    # first sampled step 10, discard 2: steps 10 and 11 are warm-up
    assert median_window(samples, discard=2, window=3) == 100.0
    assert median_window(samples, discard=0, window=3) == 500.0


def test_median_window_waits_for_a_full_window_then_stays_fixed() -> None:
    samples = [(1, 50.0), (2, 10.0), (3, 30.0)]
    assert median_window([], discard=0, window=1) is None
    assert median_window(samples, discard=1, window=3) is None  # two after the discard
    samples.append((4, 20.0))
    assert median_window(samples, discard=1, window=3) == 20.0
    samples.append((5, 1000.0))  # later steps do not move a finished window
    assert median_window(samples, discard=1, window=3) == 20.0
    assert median_window([(1, 10.0), (2, 30.0)], discard=0, window=2) == 20.0  # even: the mean of two


def test_median_window_discards_by_step_not_by_sample() -> None:
    # digests sample steps: 3 steps to discard are over after the second sample
    samples = [(100, 900.0), (104, 60.0), (108, 62.0)]
    assert median_window(samples, discard=3, window=2) == 61.0


# -- gain and refusals -------------------------------------------------------------------
def test_gain_is_the_drop_in_time_per_sample() -> None:
    before = Measurement(world=2, generation=1, step_ms=100.0, batch=BATCH)
    after = Measurement(world=3, generation=2, step_ms=80.0, batch=BATCH)
    assert before.per_sample_ms == pytest.approx(100.0 / BATCH)
    assert gain(before, after) == pytest.approx(0.2)
    assert gain(after, before) == pytest.approx(-0.25)
    # a batch that was not held counts: 80 ms for 6 samples is worse than 100 ms for 12
    cut = Measurement(world=3, generation=2, step_ms=80.0, batch=6)
    assert gain(before, cut) == pytest.approx(1 - (80 / 6) / (100 / 12))
    unknown = Measurement(world=3, generation=2, step_ms=90.0, batch=0)
    assert gain(before, unknown) == pytest.approx(0.1)  # batch unknown: step times


@pytest.mark.parametrize(
    ("reason", "refusal"),
    [
        ("world size 5 is beyond max_world_size 4", Refusal.BEYOND_MAX),
        ("5 exceeds the max world size", Refusal.BEYOND_MAX),
        ("3 is not an allowed size (sizes [2, 4, 8])", Refusal.NOT_ALLOWED),
        ("3 is not a multiple of size_step 2", Refusal.NOT_ALLOWED),
        ("1 is below min_world_size 2", Refusal.NOT_ALLOWED),
        ("not enough spares: 0 registered for 1 more rank", Refusal.FOR_NOW),
        ("job not running (recovering)", Refusal.FOR_NOW),
        ("grow cool-down: 4.2 s left", Refusal.FOR_NOW),
    ],
)
def test_refusal_reasons(reason: str, refusal: Refusal) -> None:
    assert classify_refusal(reason) is refusal


# -- step samples from node digests ----------------------------------------------------
def entry(worker: str, rank: int, step: int, step_ms: float, generation: int = 1) -> DigestEntry:
    return DigestEntry(
        worker=worker,
        pid=1,
        seq=step,
        rank=rank,
        generation=generation,
        step=step,
        step_ms=step_ms,
        phase=Phase.COMPUTE if rank >= 0 else Phase.IDLE,
        phase_ms=1.0,
        age_ms=1.0,
    )


def digest(*entries: DigestEntry, seq: int = 1) -> NodeDigest:
    return NodeDigest(
        job=JOB, node="n1", launcher="L1", host="h", seq=seq, interval_ms=100.0, entries=list(entries)
    )


def test_the_sampler_reports_each_new_step_of_rank_zero_once() -> None:
    s = StepSampler()
    s.worlds[1] = 2
    first = s.feed(digest(entry("w0", 0, 5, 100.0), entry("w1", 1, 5, 101.0), entry("w2", -1, 0, 0.0)))
    assert [(x.worker, x.step, x.step_ms, x.world_size, x.generation) for x in first] == [
        ("w0", 5, 100.0, 2, 1)
    ]
    assert s.feed(digest(entry("w0", 0, 5, 100.0), seq=2)) == []  # the same heartbeat again
    assert [x.step for x in s.feed(digest(entry("w0", 0, 7, 90.0), seq=3))] == [7]


def test_the_sampler_skips_a_stale_step_after_a_new_generation() -> None:
    s = StepSampler()
    s.feed(digest(entry("w0", 0, 9, 100.0, generation=1)))
    # rank 0 switched to generation 2 but has not finished a step there: its step_ms is old
    assert s.feed(digest(entry("w0", 0, 9, 100.0, generation=2))) == []
    (x,) = s.feed(digest(entry("w0", 0, 10, 400.0, generation=2)))
    assert (x.generation, x.step, x.step_ms, x.world_size) == (2, 10, 400.0, 0)  # no plan of gen 2 seen


def test_the_sampler_with_all_ranks_and_no_step_yet() -> None:
    s = StepSampler(all_ranks=True)
    out = s.feed(digest(entry("w0", 0, 0, 0.0), entry("w1", 1, 3, 50.0), entry("w2", -1, 3, 50.0)))
    assert [(x.worker, x.rank) for x in out] == [("w1", 1)]


def test_proposal_ids_are_fresh_plain_names() -> None:
    a, b = new_proposal_id(), new_proposal_id()
    assert a != b
    Proposal(job=JOB, id=a, policy="p", world_size=2)  # the wire accepts it


# -- the step-time policy ------------------------------------------------------------------
def policy(**kwargs: object) -> StepTimePolicy:
    defaults: dict[str, object] = {"min_gain": 0.05, "window": 3, "discard": 1, "retry_s": 30.0}
    defaults.update(kwargs)
    return StepTimePolicy(**defaults)  # type: ignore[arg-type]


def measure(p: StepTimePolicy, step_ms: float, *, first_step: int = 1) -> Measurement:
    """Feed rank-0 samples of the current generation until a measurement completes."""
    for i in range(p.discard + p.window + 5):
        # the warm-up step is slow: it must not count
        m = p.on_sample(p.generation, first_step + i, step_ms * (5 if i == 0 else 1))
        if m is not None:
            return m
    raise AssertionError("no measurement")


def committed(action: Action, generation: int, world: int, proposal: str = "p-1") -> PlanDecision:
    batch = BatchPlan(
        global_batch=BATCH, effective_batch=BATCH, world_size=world, shards=[BATCH // world] * world
    )
    return PlanDecision(
        job=JOB,
        incident=None,
        action=action,
        reason="ok",
        generation=generation,
        world_size=world,
        proposal=proposal,
        batch=batch,
    )


def rejected(reason: str, proposal: str = "p-1") -> PlanDecision:
    return PlanDecision(job=JOB, incident=None, action=Action.REJECT, reason=reason, proposal=proposal)


def test_it_measures_the_current_size_before_proposing() -> None:
    p = policy()
    assert p.next_intent(0.0) is None  # no plan yet
    p.on_plan(1, 2, spares=2, batch=BATCH)
    assert p.next_intent(0.0) is None  # not measured
    m = measure(p, 100.0)
    assert (m.world, m.generation, m.step_ms, m.batch) == (2, 1, 100.0, BATCH)
    intent = p.next_intent(0.0)
    assert intent is not None and (intent.world_size, intent.kind) == (3, "grow")
    assert "2 spare(s)" in intent.reason


def test_no_spares_no_grow_until_a_node_joins() -> None:
    p = policy()
    p.on_plan(1, 2, spares=0, batch=BATCH)
    measure(p, 100.0)
    assert p.next_intent(0.0) is None
    p.on_decision(Action.JOIN)  # the plan does not list the newcomers: ask once
    intent = p.next_intent(0.0)
    assert intent is not None and intent.world_size == 3
    p.on_answer(intent, rejected("not enough spares"), now=0.0)
    assert p.next_intent(1.0) is None


def test_a_grow_that_pays_is_kept_and_the_next_size_tried() -> None:
    p = policy()
    p.on_plan(1, 2, spares=2, batch=BATCH)
    measure(p, 100.0)
    grow = p.next_intent(0.0)
    assert grow is not None
    assert p.on_answer(grow, committed(Action.GROW, 2, 3), now=0.0) is None
    assert (p.generation, p.world, p.spares) == (2, 3, 1)
    assert p.next_intent(0.0) is None  # measuring the trial
    p.on_sample(1, 50, 10.0)  # a late sample of the old generation does not count
    measure(p, 80.0, first_step=20)
    verdict = p.judge()
    assert verdict is not None and verdict.kept and verdict.gain == pytest.approx(0.2)
    nxt = p.next_intent(0.0)
    assert nxt is not None and (nxt.world_size, nxt.kind) == (4, "grow")


def test_a_grow_that_does_not_pay_is_undone_and_never_tried_again() -> None:
    p = policy()
    p.on_plan(1, 2, spares=3, batch=BATCH)
    measure(p, 100.0)
    grow = p.next_intent(0.0)
    assert grow is not None
    p.on_answer(grow, committed(Action.GROW, 2, 3), now=0.0)
    measure(p, 97.0, first_step=20)  # 3 % better: under min_gain 5 %
    verdict = p.judge()
    assert verdict is not None and not verdict.kept
    assert p.judge() is None  # judged once
    back = p.next_intent(0.0)
    assert back is not None and (back.world_size, back.kind) == (2, "revert")
    assert "back to 2" in back.reason
    p.on_answer(back, committed(Action.SHRINK, 3, 2), now=0.0)
    assert (p.world, p.undo, p.ceiling) == (2, None, 3)
    # measured at 2 already, spares idle: still no grow to 3 (nor 4)
    p.on_plan(4, 2, spares=3, batch=BATCH)
    measure(p, 100.0, first_step=40)
    assert p.next_intent(0.0) is None


def test_beyond_max_ends_growth_and_allowed_sizes_are_searched() -> None:
    p = policy()
    p.on_plan(1, 2, spares=3, batch=BATCH)
    measure(p, 100.0)
    three = p.next_intent(0.0)
    assert three is not None and three.world_size == 3
    assert (
        p.on_answer(three, rejected("3 is not an allowed size (sizes [2, 4])"), now=0.0)
        is Refusal.NOT_ALLOWED
    )
    four = p.next_intent(0.0)
    assert four is not None and four.world_size == 4  # the next size, 3 never again
    assert (
        p.on_answer(four, rejected("world size 4 is beyond max_world_size 3"), now=0.0) is Refusal.BEYOND_MAX
    )
    assert p.max_world == 3
    assert p.next_intent(0.0) is None  # 3 not allowed, 4 and up beyond the max


def test_max_from_the_command_line_is_respected() -> None:
    p = policy(max_world=2)
    p.on_plan(1, 2, spares=2, batch=BATCH)
    measure(p, 100.0)
    assert p.next_intent(0.0) is None


def test_a_refusal_for_now_waits_for_a_change_or_the_retry_time() -> None:
    p = policy(retry_s=30.0)
    p.on_plan(1, 2, spares=1, batch=BATCH)
    measure(p, 100.0)
    grow = p.next_intent(0.0)
    assert grow is not None
    assert p.on_answer(grow, rejected("job not running"), now=100.0) is Refusal.FOR_NOW
    assert p.next_intent(129.0) is None
    again = p.next_intent(130.0)
    assert again is not None and again.world_size == 3
    p.on_timeout(again, now=200.0)  # no answer at all: the same
    assert p.next_intent(201.0) is None
    p.on_plan(2, 2, spares=1, batch=BATCH)  # a new generation (a spare replaced a rank): ask again
    measure(p, 100.0, first_step=30)
    assert p.next_intent(202.0) is not None


def test_a_fault_during_a_trial_abandons_it() -> None:
    p = policy()
    p.on_plan(1, 2, spares=1, batch=BATCH)
    measure(p, 100.0)
    grow = p.next_intent(0.0)
    assert grow is not None
    p.on_answer(grow, committed(Action.GROW, 2, 3), now=0.0)
    p.on_plan(3, 2, spares=0, batch=BATCH)  # a rank died, no spare: shrunk by the planner
    assert p.trial is None
    p.on_plan(2, 3, spares=0, batch=BATCH)  # an older plan arriving late changes nothing
    assert (p.generation, p.world) == (3, 2)
    measure(p, 100.0, first_step=30)
    assert p.judge() is None


def test_preemption_holds_and_the_end_of_the_job_ends_it() -> None:
    p = policy()
    p.on_plan(1, 2, spares=1, batch=BATCH)
    measure(p, 100.0)
    p.on_preempt(deadline_s=10.0, now=0.0)
    assert p.next_intent(5.0) is None
    assert p.next_intent(10.0) is not None
    p.on_decision(Action.COMPLETE)
    assert p.ended and p.next_intent(11.0) is None


def test_command_line() -> None:
    args = parse_args(["--job", "demo", "--min-gain", "0.1", "--window", "5", "--max", "8"])
    assert (args.job, args.min_gain, args.window, args.max, args.discard) == ("demo", 0.1, 5, 8, 3)
    with pytest.raises(SystemExit):
        parse_args(["--job", "demo", "--window", "0"])
