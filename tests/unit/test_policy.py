"""The default failure policy (services.elasticity_planner.failure_policy.ReplaceOrShrink):
replace with a hot spare, drop a lost spare, shrink, stop, or hold."""

from __future__ import annotations

import pytest

from phalanx.contract import (
    Action,
    FaultCause,
    JobPhase,
    JobSpec,
    JobState,
    Member,
    NodeState,
    Plan,
    Recovery,
)
from services.elasticity_planner.decisions import Decision, Fault
from services.elasticity_planner.failure_policy import ReplaceOrShrink

JOB = "job-1"


def make_state(
    members: list[str],
    spares: list[str] | None = None,
    *,
    min_world_size: int = 1,
    phase: JobPhase = JobPhase.RUNNING,
    lost: set[str] | None = None,
    generation: int = 3,
) -> JobState:
    spares = list(spares or [])
    spec = JobSpec(
        job=JOB,
        launcher="L1",
        min_world_size=min_world_size,
        global_batch=8,
        workers=members + spares,
        ranks=len(members),
    )
    plan = Plan(
        job=JOB,
        generation=generation,
        members=[Member(rank=i, worker=w) for i, w in enumerate(members)],
        spares=spares,
        reason="test",
        store_prefix=f"{JOB}/g{generation}",
    )
    return JobState(
        spec=spec,
        phase=phase,
        plan=plan,
        nodes={
            "local": NodeState(
                launcher="L1",
                host="h",
                store_addr="127.0.0.1:1",
                workers=members + spares,
                ranks=len(members),
            )
        },
        ranks=list(members),
        spares=spares,
        lost=set(lost or ()),
        start_world=len(members),
    )


def fault(worker: str, cause: str = "process_exit", hung: bool = False) -> Fault:
    return Fault(incident="inc-1", worker=worker, cause=cause, hung=hung)


def decide(state: JobState, f: Fault) -> Decision:
    return ReplaceOrShrink().on_fault(state, f)


def next_plan(d: Decision) -> Plan:
    """The decision's members make a valid plan (dense ranks, no worker twice)."""
    assert d.members is not None
    return Plan(job=JOB, generation=4, members=d.members, reason=d.reason, store_prefix=f"{JOB}/g4")


def members_of(d: Decision) -> list[tuple[int, str]]:
    assert d.members is not None
    return sorted((m.rank, m.worker) for m in d.members)


def test_replace_with_first_spare_keeping_the_rank() -> None:
    state = make_state(["w0", "w1", "w2", "w3"], ["s0", "s1"])
    d = decide(state, fault("w2"))
    assert d.action is Action.REPLACE
    assert members_of(d) == [(0, "w0"), (1, "w1"), (2, "s0"), (3, "w3")]
    assert d.removed == ["w2"] and d.spares_used == ["s0"]
    assert "w2" in d.reason and "s0" in d.reason and "rank 2" in d.reason
    next_plan(d)


def test_replace_rank_zero_and_the_policy_is_pure() -> None:
    state = make_state(["w0", "w1"], ["s0", "s1"])
    before = (list(state.spares), set(state.lost), state.plan)
    d = decide(state, fault("w0", cause="heartbeat_lost", hung=True))
    assert d.action is Action.REPLACE
    assert members_of(d) == [(0, "s0"), (1, "w1")]
    assert (list(state.spares), set(state.lost), state.plan) == before


@pytest.mark.parametrize("recovery", [Recovery.IN_PROCESS, Recovery.RESTART])
def test_a_wedged_collective_re_forms_the_same_members_and_spends_no_spare(recovery: Recovery) -> None:
    state = make_state(["w0", "w1", "w2"], ["s0"])
    state.spec = state.spec.model_copy(update={"recovery": recovery})
    d = decide(state, fault("w1", cause=FaultCause.COLLECTIVE_WEDGED.value, hung=True))
    assert d.action is Action.REFORM and members_of(d) == [(0, "w0"), (1, "w1"), (2, "w2")]
    assert not d.spares_used and "same collective" in d.reason and "w1" in d.reason
    old = Fault(
        incident="inc-1", worker="w1", cause=FaultCause.COLLECTIVE_WEDGED.value, hung=True, generation=2
    )
    assert decide(state, old).action is Action.HOLD, "a wedge of a generation already left"


def test_lost_spare_is_dropped_from_the_pool() -> None:
    state = make_state(["w0", "w1"], ["s0", "s1"])
    d = decide(state, fault("s1"))
    assert d.action is Action.HOLD
    assert d.removed == ["s1"] and d.members is None and d.spares_used == []
    assert "s1" in d.reason


@pytest.mark.parametrize("worker", ["w9", "s7", ""])
def test_non_member_holds(worker: str) -> None:
    state = make_state(["w0", "w1"], ["s0"])
    d = decide(state, fault(worker))
    assert d.action is Action.HOLD
    assert d.members is None and d.removed == [] and d.spares_used == []
    assert "not a member of generation 3" in d.reason


def test_no_plan_yet_holds() -> None:
    state = make_state(["w0", "w1"], ["s0"], phase=JobPhase.WAITING)
    state.plan = None
    d = decide(state, fault("w0"))
    assert d.action is Action.HOLD and d.members is None
    assert "generation 0" in d.reason


def test_already_lost_worker_holds() -> None:
    state = make_state(["w0", "w1"], ["s0"], lost={"w1"})
    d = decide(state, fault("w1"))
    assert d.action is Action.HOLD
    assert d.members is None and d.removed == [] and d.spares_used == []
    assert "already handled" in d.reason


def test_shrink_without_spare_renumbers_densely() -> None:
    state = make_state(["w0", "w1", "w2", "w3"], min_world_size=2)
    d = decide(state, fault("w1"))
    assert d.action is Action.SHRINK
    assert members_of(d) == [(0, "w0"), (1, "w2"), (2, "w3")]
    assert d.removed == ["w1"] and d.spares_used == []
    assert "shrink to 3" in d.reason
    assert next_plan(d).world_size == 3


def test_shrink_exactly_to_min_world_size() -> None:
    state = make_state(["w0", "w1", "w2"], min_world_size=2)
    d = decide(state, fault("w2"))
    assert d.action is Action.SHRINK
    assert members_of(d) == [(0, "w0"), (1, "w1")]


def test_stop_below_min_world_size() -> None:
    state = make_state(["w0", "w1", "w2"], min_world_size=3)
    d = decide(state, fault("w0"))
    assert d.action is Action.STOP
    assert d.members is None and d.removed == ["w0"]
    assert "min_world_size=3" in d.reason and "2 ranks" in d.reason


def test_stop_when_the_last_rank_is_lost() -> None:
    state = make_state(["w0"], min_world_size=1)
    d = decide(state, fault("w0"))
    assert d.action is Action.STOP
    assert "min_world_size=1" in d.reason


@pytest.mark.parametrize("phase", [JobPhase.STOPPED, JobPhase.COMPLETED])
@pytest.mark.parametrize("worker", ["w0", "s0"])
def test_finished_job_holds(phase: JobPhase, worker: str) -> None:
    state = make_state(["w0", "w1"], ["s0"], phase=phase)
    d = decide(state, fault(worker))
    assert d.action is Action.HOLD
    assert d.members is None and d.removed == [] and d.spares_used == []
    assert phase.value in d.reason


def test_fault_while_recovering_is_still_planned() -> None:
    state = make_state(["w0", "w1"], ["s0"], phase=JobPhase.RECOVERING)
    assert decide(state, fault("w1")).action is Action.REPLACE


def two_node_state(spares_a: list[str], spares_b: list[str], min_world_size: int = 0) -> JobState:
    """Ranks a-w0, a-w1, b-w0, b-w1 (world 4) on nodes a and b, with their spares."""
    state = make_state(["a-w0", "a-w1", "b-w0", "b-w1"], spares_a + spares_b, min_world_size=min_world_size)
    state.nodes = {
        "a": NodeState(
            launcher="La", host="ha", store_addr="10.0.0.1:1", workers=["a-w0", "a-w1", *spares_a], ranks=2
        ),
        "b": NodeState(
            launcher="Lb", host="hb", store_addr="10.0.0.2:1", workers=["b-w0", "b-w1", *spares_b], ranks=2
        ),
    }
    return state


def test_a_single_lost_rank_takes_a_spare_on_its_own_node_first() -> None:
    state = two_node_state(["a-s0"], ["b-s0"])
    d = decide(state, fault("b-w1"))
    assert d.action is Action.REPLACE and d.spares_used == ["b-s0"]
    assert members_of(d)[3] == (3, "b-s0")


def test_a_lost_node_is_replaced_in_one_decision_by_spares_elsewhere() -> None:
    state = two_node_state(["a-s0", "a-s1"], ["b-s0"])
    d = ReplaceOrShrink().on_node_lost(state, "b", "lost (heartbeat_lost)")
    assert d.action is Action.REPLACE
    assert sorted(d.removed) == ["b-s0", "b-w0", "b-w1"]  # its spare goes with it
    assert members_of(d) == [(0, "a-w0"), (1, "a-w1"), (2, "a-s0"), (3, "a-s1")]
    next_plan(d)


def test_a_lost_node_with_too_few_spares_elsewhere_shrinks_or_stops() -> None:
    shrink = ReplaceOrShrink().on_node_lost(two_node_state(["a-s0"], ["b-s0"], 2), "b", "lost")
    assert shrink.action is Action.SHRINK and "only 1 spare(s) for 2 lost ranks" in shrink.reason
    assert members_of(shrink) == [(0, "a-w0"), (1, "a-w1"), (2, "a-s0")]
    stop = ReplaceOrShrink().on_node_lost(two_node_state([], ["b-s0"]), "b", "lost")
    assert stop.action is Action.STOP and "min_world_size=4" in stop.reason


def test_a_lost_node_without_members_only_drops_its_spares() -> None:
    state = two_node_state([], [])
    state.nodes["c"] = NodeState(launcher="Lc", host="hc", store_addr="10.0.0.3:1", workers=["c-s0"], ranks=0)
    state.spares.append("c-s0")
    d = ReplaceOrShrink().on_node_lost(state, "c", "lost")
    assert d.action is Action.HOLD and d.members is None and d.removed == ["c-s0"]
