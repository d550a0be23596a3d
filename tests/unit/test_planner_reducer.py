"""The planner's reducer (services/elasticity_planner/reducer.py): step(state, event, now)
-> (state, effects), with no clock, no I/O, and its waits as deadlines in the state."""

from __future__ import annotations

import pytest
from phalanx.services.elasticity_planner import events as ev
from phalanx.services.elasticity_planner.effects import (
    Announce,
    ArmTimer,
    CancelTimer,
    Committed,
    Decided,
    Refuse,
    Reply,
    Traced,
)
from phalanx.services.elasticity_planner.failure_policy import ReplaceOrShrink
from phalanx.services.elasticity_planner.reducer import Reducer
from phalanx.services.elasticity_planner.scaling_policy import GrowIntoSpares

from phalanx.contract import Action, Elastic, JobPhase, Role
from tests.unit.planner_inputs import (
    RUN,
    T0,
    acked,
    comm_error,
    exited,
    failed,
    join,
    of,
    registered,
    spec,
    started,
    timer,
)

GRACE = 2.0
R = Reducer(ReplaceOrShrink(comm_grace_s=GRACE, spare_wait_s=5.0), GrowIntoSpares())


def test_generation_one_starts_once_every_rank_registered() -> None:
    state, effects = R.step(None, join(spec(2, 1)), T0)
    assert state is not None and state.phase is JobPhase.WAITING and state.run == RUN
    (reply,) = of(effects, Reply)
    assert reply.answer.accepted and reply.answer.workers == ["w0", "w1", "w2"]
    assert [d.decision.action for d in of(effects, Decided)] == [Action.JOIN]
    state, effects = R.step(state, registered("w0"), T0 + 1)
    assert state is not None and state.plan is None
    state, effects = R.step(state, registered("w1"), T0 + 2)
    assert state is not None and state.plan is not None
    assert [m.worker for m in state.plan.members] == ["w0", "w1"] and state.plan.generation == 1
    assert state.phase is JobPhase.RUNNING  # the first generation waits on no acknowledgement
    assert of(effects, Announce) == [Announce(1)]
    assert (
        state.plan.ts == T0 + 2 and state.plan.token == 0 and state.plan.store_secret == ""
    )  # stamped at commit


@pytest.mark.parametrize(
    "event",
    [
        failed("w1", 1, 1),
        join(spec(launcher="L2")),  # refused: node local is in the job already
        join(spec(ts=T0 - 1000)),  # refused: too old
        comm_error("w0", 0, 1),
        exited("w0", code=0),
    ],
)
def test_a_step_never_changes_the_state_it_is_given(event: ev.Event) -> None:
    state = started(R)
    before = state.model_copy(deep=True)
    R.step(state, event, T0 + 10)
    assert state == before and state.plan == before.plan


def test_the_same_inputs_give_the_same_outputs() -> None:
    state = started(R)
    a = R.step(state, failed("w1", 1, 1), T0 + 10)
    b = R.step(state, failed("w1", 1, 1), T0 + 10)
    assert a == b


def test_a_crash_is_replaced_by_the_spare_and_runs_again_once_acknowledged() -> None:
    state = started(R)
    state, effects = R.step(state, failed("w1", 1, 1), T0 + 10)
    assert state is not None and state.plan is not None and state.plan.generation == 2
    assert state.plan.rank_of("w3") == 1 and state.plan.removed == ["w1"] and "w1" in state.lost
    assert state.phase is JobPhase.RECOVERING
    (committed,) = of(effects, Committed)
    assert committed.fault is not None and committed.fault.cause == "crash" and committed.old_world == 3
    (traced,) = of(effects, Traced)
    assert traced.action == "replace" and traced.attributes["phalanx.incident"] == f"{state.spec.job}:w1:1"
    assert effects.index(traced) < effects.index(of(effects, Announce)[0])  # the plan in its span
    decided = next(d for d in of(effects, Decided) if d.decision.action is Action.REPLACE)
    assert decided.why == "crash" and decided.decision.generation == 2
    state, _ = R.step(state, acked(1), T0 + 11)  # a stale acknowledgement changes nothing
    assert state is not None and state.phase is JobPhase.RECOVERING
    state, _ = R.step(state, acked(2), T0 + 11)
    assert state is not None and state.phase is JobPhase.RUNNING


def test_a_broken_group_re_forms_at_the_deadline_in_its_record() -> None:
    state = started(R)
    for t, (w, r) in enumerate((("w0", 0), ("w1", 1), ("w2", 2))):
        state, effects = R.step(state, comm_error(w, r, 1, ts=T0 + 5), T0 + 5 + t)
        assert state is not None and state.phase is JobPhase.BROKEN
        assert of(effects, ArmTimer) == ([ArmTimer("reform", T0 + 5 + GRACE)] if t == 0 else [])
    assert state.timers == {"reform": T0 + 5 + GRACE}
    state, effects = R.step(state, timer("reform"), T0 + 5 + GRACE)
    assert state is not None and state.plan is not None and state.plan.generation == 2
    assert [m.worker for m in state.plan.members] == ["w0", "w1", "w2"] and state.reforms == 1
    assert [d.decision.action for d in of(effects, Decided)] == [Action.REFORM]
    (traced,) = of(effects, Traced)
    assert traced.detect is not None and traced.detect.start == T0 + 5  # the grace was the detection
    assert state.timers == {} and state.phase is JobPhase.RECOVERING


def test_a_silent_member_gets_a_second_grace_and_one_its_launcher_saw_exit_is_fenced() -> None:
    state = started(R)
    state, _ = R.step(state, comm_error("w0", 0, 1, ts=T0 + 5), T0 + 5)
    assert state is not None
    state, effects = R.step(state, timer("reform"), T0 + 5 + GRACE)
    assert state is not None and state.plan is not None and state.plan.generation == 1
    assert of(effects, ArmTimer) == [ArmTimer("reform", T0 + 5 + 2 * GRACE)]  # w1 and w2 are silent
    state, _ = R.step(state, exited("w2"), T0 + 6)
    state, effects = R.step(state, timer("reform"), T0 + 5 + 2 * GRACE)
    assert state is not None and state.plan is not None and state.plan.generation == 2
    assert state.plan.removed == ["w2"] and state.plan.rank_of("w3") == 2
    assert of(effects, Committed)[0].fault is not None


def test_a_fault_waits_for_spares_still_starting_then_stops_at_its_deadline() -> None:
    state, _ = R.step(None, join(spec(2, 1)), T0)
    for w in ("w0", "w1"):
        state, _ = R.step(state, registered(w), T0)
    state, effects = R.step(state, failed("w1", 1, 1), T0 + 1)
    assert state is not None and state.phase is JobPhase.HOLDING
    assert of(effects, ArmTimer) == [ArmTimer(f"spares:{state.spec.job}:w1:1", T0 + 6)]
    assert [d.decision.action for d in of(effects, Decided)] == [Action.HOLD]
    same, effects = R.step(state, failed("w1", 1, 1), T0 + 2)  # a redelivery waits once
    assert same == state and not of(effects, Decided)
    state, effects = R.step(state, timer(f"spares:{state.spec.job}:w1:1"), T0 + 6)
    assert state is not None and state.phase is JobPhase.STOPPED and state.timers == {}
    assert [d.decision.action for d in of(effects, Decided)] == [Action.STOP]


def test_a_spare_registering_during_the_wait_takes_the_rank() -> None:
    state, _ = R.step(None, join(spec(2, 1)), T0)
    for w in ("w0", "w1"):
        state, _ = R.step(state, registered(w), T0)
    state, _ = R.step(state, failed("w1", 1, 1), T0 + 1)
    state, effects = R.step(state, registered("w2", Role.SPARE), T0 + 2)
    assert state is not None and state.plan is not None and state.plan.rank_of("w2") == 1
    assert of(effects, CancelTimer) == [CancelTimer(f"spares:{state.spec.job}:w1:1")]


def test_a_new_leader_resumes_the_timers_of_the_record() -> None:
    state = started(R)
    state, _ = R.step(state, comm_error("w0", 0, 1, ts=T0 + 5), T0 + 5)
    assert state is not None
    resumed, effects = R.step(state, ev.Resumed(job=state.spec.job), T0 + 100)
    assert resumed is not None
    # the grace counts from the takeover: replayed verdicts come first
    assert of(effects, ArmTimer) == [ArmTimer("reform", T0 + 100 + GRACE)]


def test_a_new_leader_sends_an_unacknowledged_plan_again() -> None:
    state, _ = R.step(started(R), failed("w1", 1, 1), T0 + 10)
    assert state is not None
    _, effects = R.step(state, ev.Resumed(job=state.spec.job), T0 + 20)
    assert of(effects, Announce) == [Announce(2, resend=True)]


def test_ready_spares_grow_the_job_after_the_cool_down() -> None:
    elastic = Elastic(max_world_size=3, cooldown_s=30.0)
    state, _ = R.step(None, join(spec(2, 1, elastic=elastic)), T0)
    for w in ("w0", "w1"):
        state, _ = R.step(state, registered(w), T0)
    state, effects = R.step(state, registered("w2", Role.SPARE), T0 + 1)
    assert state is not None and state.plan is not None and state.plan.world_size == 2
    assert of(effects, ArmTimer) == [ArmTimer("cooldown", T0 + 30.01)]
    state, effects = R.step(state, timer("cooldown"), T0 + 30.01)
    assert state is not None and state.plan is not None and state.plan.world_size == 3
    assert state.plan.planned and next(d.decision.action for d in of(effects, Decided)) is Action.GROW


def test_a_member_finishing_completes_the_job_and_clears_its_timers() -> None:
    state = started(R)
    state, _ = R.step(state, comm_error("w0", 0, 1, ts=T0 + 5), T0 + 5)
    state, effects = R.step(state, exited("w0", code=0), T0 + 6)
    assert state is not None and state.phase is JobPhase.COMPLETED and state.timers == {}
    assert of(effects, CancelTimer) == [CancelTimer("reform")]


@pytest.mark.parametrize(
    ("event", "why"),
    [
        (comm_error("w0", 0, 7), "generation 7 is not the current 1"),
        (comm_error("w0", 1, 1), "w0 is not rank 1 of generation 1"),
        (comm_error("w0", 0, 1, run="r-other"), "run 'r-other' is not the job's run"),
        (exited("w0", node="other"), "reported by the launcher of node other"),
    ],
)
def test_inputs_that_cannot_be_placed_are_refused(event: ev.Event, why: str) -> None:
    state = started(R)
    new, effects = R.step(state, event, T0 + 5)
    (refusal,) = of(effects, Refuse)
    assert why in refusal.why and new == state


def test_a_stale_spec_is_refused_and_unknown_jobs_change_nothing() -> None:
    _, effects = R.step(None, join(spec(ts=T0 - 1000)), T0)
    assert "old" in of(effects, Refuse)[0].why
    assert R.step(None, failed("w1", 1, 1), T0)[0] is None
    assert R.step(None, acked(1), T0) == (None, [])


def test_a_spare_that_became_a_member_is_not_waited_for_as_starting() -> None:
    state, _ = R.step(started(R), failed("w1", 1, 1), T0 + 10)  # spare w3 takes rank 1
    assert state is not None and not state.spawned  # w1's slot is not used again: nothing starts
    state, effects = R.step(state, failed("w2", 2, 2), T0 + 20)  # no spare left, below the minimum
    assert state is not None and state.phase is JobPhase.STOPPED
    assert [d.decision.action for d in of(effects, Decided)] == [Action.STOP]


def _stops(effects: list) -> list[str]:  # type: ignore[type-arg]
    return [d.decision.reason for d in of(effects, Decided) if d.decision.action is Action.STOP]


def test_every_stop_names_its_cause() -> None:
    """One case per way the default policies stop a job: the reason says what happened."""
    # no spare left and too few ranks to shrink: the sizes, and the lost rank
    [why] = _stops(R.step(started(R, ranks=3, spares=0), failed("w1", 1, 1), T0 + 10)[1])
    assert "w1" in why and "no spare left" in why and "min_world_size=3" in why, why
    # the spare wait ran out
    state, _ = R.step(None, join(spec(2, 1)), T0)
    for w in ("w0", "w1"):
        state, _ = R.step(state, registered(w), T0)
    state, _ = R.step(state, failed("w1", 1, 1), T0 + 1)
    [why] = _stops(R.step(state, timer(f"spares:{state.spec.job}:w1:1"), T0 + 6)[1])
    assert "w1" in why, why
    # the group broke too many times in a row
    state = started(R)
    effects: list = []  # type: ignore[type-arg]
    for n in range(R.failure.max_reforms + 1):  # type: ignore[attr-defined]
        gen = state.generation
        at = T0 + 10 + 10 * n
        for w, r in (("w0", 0), ("w1", 1), ("w2", 2)):
            state, _ = R.step(state, comm_error(w, r, gen, ts=at), at)
        state, effects = R.step(state, timer("reform"), at + 5)
        assert state is not None
    [why] = _stops(effects)
    assert "broke" in why and "max_reforms" in why, why
    # every replica of a shard lost: the ranks' own words
    lost = "every replica of shard (1,) was lost: rank 1 takes it and no member at step 20 holds it"
    state = started(R)
    state, effects = R.step(state, comm_error("w1", 1, 1, T0 + 5, error=lost, unrecoverable=True), T0 + 5)
    assert state is not None and state.phase is JobPhase.STOPPED
    [why] = _stops(effects)
    assert why.startswith("generation 1 cannot recover: w1 (rank 1) reports every replica of shard (1,)"), why
    assert "min_world_size" not in why


def test_an_unrecoverable_report_of_another_generation_is_refused() -> None:
    state = started(R)
    state2, effects = R.step(state, comm_error("w1", 1, 7, T0 + 5, unrecoverable=True), T0 + 5)
    assert state2 == state and "generation 7" in of(effects, Refuse)[0].why


def test_a_shrink_with_no_joiner_names_the_ranks_left_out_and_a_replacement_names_none() -> None:
    state, _ = R.step(None, join(spec(4, 0, min_world_size=2)), T0)
    for i in range(4):
        state, _ = R.step(state, registered(f"w{i}"), T0)
    state, _ = R.step(state, failed("w1", 1, 1), T0 + 10)
    assert state is not None and state.plan is not None and state.plan.world_size == 3
    assert [m.worker for m in sorted(state.plan.members, key=lambda m: m.rank)] == ["w0", "w2", "w3"]
    assert state.plan.shrunk == [1]  # an NCCL communicator may be shrunk: the survivors keep their order
    state, _ = R.step(started(R), failed("w1", 1, 1), T0 + 10)  # the spare takes the rank: a joiner
    assert state is not None and state.plan is not None and state.plan.shrunk == []


def test_a_restart_job_restarts_once_for_the_exits_of_one_generation() -> None:
    """Restart recovery: every member of a broken group exits; those whose exit is judged
    after the re-form ran the old generation, which that re-form already restarts."""
    from phalanx.contract import Recovery

    state, _ = R.step(None, join(spec(3, 1, recovery=Recovery.RESTART)), T0)
    for i in range(4):
        state, _ = R.step(state, registered(f"w{i}", Role.RANK if i < 3 else Role.SPARE), T0)
    state, _ = R.step(state, failed("w1", 1, 1, incident="a"), T0 + 10)
    assert state is not None and state.plan is not None and state.plan.generation == 2
    state, effects = R.step(state, failed("w2", 2, 1, incident="b"), T0 + 10.1)  # crossed the plan
    assert state is not None and state.plan is not None and state.plan.generation == 2
    assert [d.decision.action for d in of(effects, Decided)] == [Action.HOLD] and not of(effects, Announce)
    state, _ = R.step(state, failed("w2", 2, 2, incident="c"), T0 + 20)  # generation 2's own exit
    assert state is not None and state.plan is not None and state.plan.generation == 3
