"""The planner's elastic decisions (GrowIntoSpares.on_spares / on_preemption /
on_proposal) and the batch split every plan carries (phalanx.batchplan)."""

from __future__ import annotations

import math

import pytest
from pydantic import ValidationError

from phalanx.batchplan import plan_batch, plan_for, shard_sizes
from phalanx.contract import (
    Action,
    Elastic,
    JobPhase,
    JobRecord,
    JobSpec,
    JobState,
    LrRule,
    Member,
    NodeState,
    Plan,
    decode,
    encode,
)
from services.elasticity_planner.decisions import largest_allowed
from services.elasticity_planner.scaling_policy import GrowIntoSpares

JOB = "el"
POLICY = GrowIntoSpares()


def make_state(
    members: list[str],
    spares: list[str] | None = None,
    *,
    elastic: Elastic | None = None,
    min_world_size: int = 2,
    start_world: int = 4,
    phase: JobPhase = JobPhase.RUNNING,
) -> JobState:
    spares = list(spares or [])
    workers = members + spares
    spec = JobSpec(
        job=JOB,
        launcher="La",
        min_world_size=min_world_size,
        global_batch=12,
        workers=workers,
        ranks=len(members),
        elastic=elastic or Elastic(max_world_size=4),
    )
    plan = Plan(
        job=JOB,
        generation=2,
        members=[Member(rank=i, worker=w) for i, w in enumerate(members)],
        spares=spares,
        reason="test",
        store_prefix=f"{JOB}/g2",
    )
    a = [w for w in workers if w.startswith("a-")]
    b = [w for w in workers if w.startswith("b-")]
    return JobState(
        spec=spec,
        phase=phase,
        plan=plan,
        nodes={
            "a": NodeState(
                launcher="La", host="ha", store_addr="10.0.0.1:1", workers=a, ranks=len(a), slots=len(a)
            ),
            "b": NodeState(
                launcher="Lb", host="hb", store_addr="10.0.0.2:1", workers=b, ranks=len(b), slots=len(b)
            ),
        },
        ranks=list(members),
        spares=spares,
        start_world=start_world,
    )


# -- the batch split -------------------------------------------------------------------
@pytest.mark.parametrize("world", [1, 2, 3, 4, 5, 7, 12])
def test_shards_cover_the_global_batch_in_rank_order(world: int) -> None:
    sizes = shard_sizes(12, world)
    assert sum(sizes) == 12 and max(sizes) - min(sizes) <= 1 and sizes == sorted(sizes, reverse=True)


def test_a_world_larger_than_the_batch_is_refused() -> None:
    with pytest.raises(ValueError, match="cannot split a global batch of 4 over 5"):
        shard_sizes(4, 5)


def test_the_global_batch_is_held_when_the_cap_allows() -> None:
    p = plan_batch(12, 3, micro_batch=2, max_accum=2, lr_rule=LrRule.SQRT)
    assert p.held and p.effective_batch == 12 and p.shards == [4, 4, 4] and p.accum == 2 and p.lr_scale == 1.0
    assert p.describe() == "global batch 12 held: 3 replicas x 4 samples (2 micro-batch(es) of 2)"


@pytest.mark.parametrize(
    ("rule", "scale"), [(LrRule.NONE, 1.0), (LrRule.LINEAR, 8 / 12), (LrRule.SQRT, math.sqrt(8 / 12))]
)
def test_a_capped_replica_cuts_the_effective_batch_and_the_rule_scales_the_lr(
    rule: LrRule, scale: float
) -> None:
    p = plan_batch(12, 2, micro_batch=2, max_accum=2, lr_rule=rule)
    assert p.shards == [4, 4] and p.effective_batch == 8 and not p.held
    assert math.isclose(p.lr_scale, scale)
    assert f"effective batch 8, lr x {scale:.4g} ({rule.value})" in p.describe()


def test_uneven_shards_still_hold_the_batch() -> None:
    p = plan_for(Elastic(), 12, 5)
    assert p.held and p.shards == [3, 3, 2, 2, 2]


# -- the job's sizes -------------------------------------------------------------------
def test_elastic_settings_are_checked() -> None:
    with pytest.raises(ValidationError, match="max_accum needs micro_batch"):
        Elastic(max_accum=2)
    with pytest.raises(ValidationError, match="allowed sizes must be >= 1"):
        Elastic(sizes=[0, 2])
    with pytest.raises(ValidationError, match="min_world_size 5 > max_world_size 4"):
        JobSpec(
            job=JOB, launcher="L", workers=["w0"], ranks=1, global_batch=8, min_world_size=5,
            elastic=Elastic(max_world_size=4),
        )  # fmt: skip


def test_allowed_sizes_combine_min_max_list_and_step() -> None:
    state = make_state(
        ["a-w0", "a-w1"], elastic=Elastic(max_world_size=8, sizes=[2, 3, 4, 6, 8], size_step=2)
    )
    assert [n for n in range(10) if state.allowed(n)] == [2, 4, 6, 8]
    assert largest_allowed(state, 7) == 6 and largest_allowed(state, 1) is None


def test_the_new_fields_survive_the_record() -> None:
    state = make_state(["a-w0", "a-w1"])
    state.offered, state.spawned, state.changed_at, state.sched_seq = {"b": 2}, {"b-w2": 5.0}, 7.0, 42
    state.nodes["b"].slots, state.nodes["b"].reserve = 3, 1
    back = decode(*encode(JobRecord(job=JOB, token=1, plan=state.plan, planner=state)), JobRecord).planner
    assert back == state


# -- grow ----------------------------------------------------------------------------
def test_ready_spares_grow_the_job_up_to_its_max() -> None:
    state = make_state(["a-w0", "a-w1"], ["b-w2", "b-w3", "b-w4"])
    d = POLICY.on_spares(state)
    assert d is not None and d.action is Action.GROW and d.planned
    assert [m.worker for m in d.members or []] == ["a-w0", "a-w1", "b-w2", "b-w3"]
    assert d.spares_used == ["b-w2", "b-w3"] and "grow 2->4" in d.reason


def test_grow_stops_at_an_allowed_size() -> None:
    state = make_state(["a-w0", "a-w1"], ["b-w2"], elastic=Elastic(max_world_size=4, sizes=[2, 4]))
    assert POLICY.on_spares(state) is None  # 3 is not allowed, 4 needs two spares


def test_no_grow_without_auto_grow_or_at_max() -> None:
    assert (
        POLICY.on_spares(
            make_state(["a-w0", "a-w1"], ["b-w2"], elastic=Elastic(max_world_size=4, auto_grow=False))
        )
        is None
    )
    assert POLICY.on_spares(make_state(["a-w0", "a-w1", "b-w0", "b-w1"], ["b-w2"])) is None


# -- preemption ----------------------------------------------------------------------
def test_a_reclaimed_node_leaves_at_a_step_boundary_and_the_job_shrinks() -> None:
    state = make_state(["a-w0", "a-w1", "b-w0", "b-w1"])
    d = POLICY.on_preemption(state, ["b-w0", "b-w1"], "reclaim b", leave_by=100.0)
    assert d.action is Action.SHRINK and d.planned and d.leave_by == 100.0
    assert [m.worker for m in d.members or []] == ["a-w0", "a-w1"] and sorted(d.leaving) == ["b-w0", "b-w1"]
    assert not d.removed  # nobody is fenced unless the deadline passes


def test_spares_elsewhere_take_the_preempted_ranks() -> None:
    state = make_state(["a-w0", "b-w0", "b-w1"], ["a-w1"], start_world=3)
    d = POLICY.on_preemption(state, ["b-w1"], "pod evicted", leave_by=1.0)
    assert d.action is Action.REPLACE and [m.worker for m in d.members or []] == ["a-w0", "b-w0", "a-w1"]


def test_a_shrink_below_the_minimum_stops_the_job_with_the_reason() -> None:
    state = make_state(["a-w0", "b-w0", "b-w1"], min_world_size=3, start_world=3)
    d = POLICY.on_preemption(state, ["b-w0"], "reclaim", leave_by=1.0)
    assert d.action is Action.STOP and "below min_world_size=3" in d.reason and d.leaving == ["b-w0"]


def test_a_size_not_allowed_makes_extra_members_leave() -> None:
    state = make_state(["a-w0", "a-w1", "a-w2", "b-w0"], elastic=Elastic(max_world_size=4, sizes=[2, 4]))
    d = POLICY.on_preemption(state, ["b-w0"], "reclaim b", leave_by=1.0)
    assert [m.worker for m in d.members or []] == ["a-w0", "a-w1"] and d.leaving == ["b-w0", "a-w2"]


def test_preempted_spares_alone_leave_with_the_same_members() -> None:
    state = make_state(["a-w0", "a-w1"], ["b-w2"])
    d = POLICY.on_preemption(state, ["b-w2"], "reclaim b", leave_by=1.0)
    assert d.action is Action.REFORM and d.planned and d.leaving == ["b-w2"]
    assert d.members == (state.plan.members if state.plan else None)


# -- proposals -----------------------------------------------------------------------
@pytest.mark.parametrize(
    ("world", "why"),
    [
        (5, "5 ranks is not allowed: min 2, max 4"),
        (1, "1 ranks is not allowed: min 2, max 4"),
        (2, "the job already runs 2 ranks"),
        (4, "growing 2->4 needs 2 spare(s), 1 ready"),
    ],
)
def test_invalid_proposals_are_rejected_with_the_reason(world: int, why: str) -> None:
    d = POLICY.on_proposal(make_state(["a-w0", "a-w1"], ["b-w2"]), world, "policy p")
    assert d.action is Action.REJECT and d.members is None and why in d.reason


def test_a_size_outside_the_allowed_list_is_rejected() -> None:
    state = make_state(["a-w0", "a-w1"], ["b-w2"], elastic=Elastic(max_world_size=4, sizes=[2, 4]))
    d = POLICY.on_proposal(state, 3, "p")
    assert d.action is Action.REJECT and "sizes [2, 4]" in d.reason


def test_proposals_wait_for_a_running_job() -> None:
    d = POLICY.on_proposal(make_state(["a-w0", "a-w1"], ["b-w2"], phase=JobPhase.RECOVERING), 3, "p")
    assert d.action is Action.REJECT and "recovering" in d.reason


def test_valid_proposals_grow_and_shrink_at_a_step_boundary() -> None:
    state = make_state(["a-w0", "a-w1", "b-w0"], ["b-w2"])
    grow = POLICY.on_proposal(state, 4, "p")
    assert grow.action is Action.GROW and grow.planned and grow.spares_used == ["b-w2"]
    shrink = POLICY.on_proposal(state, 2, "p")
    assert shrink.action is Action.SHRINK and shrink.planned and shrink.leaving == ["b-w0"]
