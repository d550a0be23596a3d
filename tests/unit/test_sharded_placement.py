"""A sharded job's membership (elastic.group_size > 1): ranks go by whole replica
groups and keep their shard (services.elasticity_planner: decisions.whole_groups,
the failure and scaling policies, placement)."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from phalanx.contract import Action, Elastic, JobSpec
from services.elasticity_planner.decisions import whole_groups
from services.elasticity_planner.failure_policy import ReplaceOrShrink
from services.elasticity_planner.placement import describe, lone_shards, place
from services.elasticity_planner.scaling_policy import GrowIntoSpares
from tests.unit.test_policy import fault, make_state, members_of


def sharded(members: list[str], spares: list[str] | None = None, *, min_world_size: int = 2, group: int = 2):  # type: ignore[no-untyped-def]
    state = make_state(members, spares, min_world_size=min_world_size)
    state.spec = state.spec.model_copy(update={"elastic": Elastic(group_size=group)})
    return state


def test_whole_groups_keeps_complete_groups_in_rank_order() -> None:
    assert whole_groups(["a", "b", None, "d", "e", "f"], 2) == (["a", "b", "e", "f"], ["d"])
    assert whole_groups(["a", None, "c"], 1) == (["a", "c"], [])
    assert whole_groups([None, None, "c", "d"], 2) == (["c", "d"], [])


def test_a_lost_rank_without_a_spare_shrinks_by_its_whole_group_and_keeps_every_shard() -> None:
    d = ReplaceOrShrink().on_fault(sharded(["w0", "w1", "w2", "w3"]), fault("w1"))
    assert d.action is Action.SHRINK
    # w2 and w3 (group 1) become group 0: rank 2 -> 0 and 3 -> 1, shards 0 and 1 as before
    assert members_of(d) == [(0, "w2"), (1, "w3")]
    assert d.leaving == ["w0"] and d.removed == ["w1"]
    assert "whole replica groups" in d.reason


def test_a_replicated_job_shrinks_rank_by_rank_as_before() -> None:
    d = ReplaceOrShrink().on_fault(make_state(["w0", "w1", "w2", "w3"], min_world_size=2), fault("w1"))
    assert d.action is Action.SHRINK
    assert members_of(d) == [(0, "w0"), (1, "w2"), (2, "w3")]


def test_a_lost_rank_with_a_spare_is_replaced_at_its_own_rank() -> None:
    d = ReplaceOrShrink().on_fault(sharded(["w0", "w1", "w2", "w3"], ["s0"]), fault("w2"))
    assert d.action is Action.REPLACE
    assert members_of(d) == [(0, "w0"), (1, "w1"), (2, "s0"), (3, "w3")]


def test_losses_in_every_group_with_no_spare_stop_the_job() -> None:
    state = sharded(["w0", "w1", "w2", "w3"])
    state.lost = {"w0"}
    d = ReplaceOrShrink()._replace(state, ["w0", "w3"], "two ranks lost", prefer=None)
    assert d.action is Action.STOP


def test_a_preempted_rank_takes_its_group_with_it() -> None:
    d = GrowIntoSpares().on_preemption(sharded(["w0", "w1", "w2", "w3"]), ["w3"], "preempted", 0.0)
    assert d.action is Action.SHRINK
    assert members_of(d) == [(0, "w0"), (1, "w1")]
    assert set(d.leaving) == {"w3", "w2"}


def test_growth_comes_by_whole_groups() -> None:
    state = sharded(["w0", "w1"], ["s0", "s1", "s2"], min_world_size=2)
    state.spec = state.spec.model_copy(update={"elastic": Elastic(group_size=2, max_world_size=6)})
    d = GrowIntoSpares().on_spares(state)
    assert d is not None and d.action is Action.GROW
    assert members_of(d) == [(0, "w0"), (1, "w1"), (2, "s0"), (3, "s1")]  # s2 alone makes no group


def test_sizes_that_are_not_whole_groups_are_refused_in_the_spec() -> None:
    with pytest.raises(ValidationError, match="group_size"):
        Elastic(group_size=2, max_world_size=3)
    with pytest.raises(ValidationError, match="group_size"):
        JobSpec(job="j", launcher="L", workers=["a", "b", "c"], ranks=3, global_batch=8, min_world_size=3,
                elastic=Elastic(group_size=2))  # fmt: skip
    assert not Elastic(group_size=2).allowed(3) and Elastic(group_size=2).allowed(4)


def test_placement_puts_each_group_on_one_node_and_groups_on_different_nodes() -> None:
    nodes = [("n0", ["a0", "a1", "a2", "a3"]), ("n1", ["b0", "b1", "b2", "b3"])]
    order = place(nodes, 2)
    assert order == ["a0", "a1", "b0", "b1", "a2", "a3", "b2", "b3"]
    node_of = {w: n for n, ws in nodes for w in ws}
    assert lone_shards(order, node_of, 2) == {}
    # replicated ranks keep the nodes' order
    assert place(nodes, 1) == [w for _, ws in nodes for w in ws]


def test_placement_says_which_shards_one_node_holds_every_replica_of() -> None:
    order = place([("n0", ["a0", "a1", "a2", "a3"])], 2)
    lone = lone_shards(order, dict.fromkeys(order, "n0"), 2)
    assert lone == {0: "n0", 1: "n0"}
    assert "shard(s) [0, 1] only on node n0" in describe(lone, 2)
    # groups spanning nodes (group of 4 over 2-rank nodes): every shard on one node
    order = place([("n0", ["a0", "a1"]), ("n1", ["b0", "b1"])], 4)
    assert lone_shards(order, {"a0": "n0", "a1": "n0", "b0": "n1", "b1": "n1"}, 4) == {
        0: "n0", 1: "n0", 2: "n1", 3: "n1"}  # fmt: skip
