"""Plans as deltas and node parts (phalanx.contract.nodeplan): a launcher that applies
each delta to its node's part holds exactly what the whole plan says, whatever
changed; one that cannot (no base, another base, a full or bad delta) is told to read
the record; a delta stays small however large the job."""

from __future__ import annotations

import random

import pytest

from phalanx.contract import (
    Member,
    NodePlan,
    Plan,
    PlanDelta,
    apply_delta,
    decode,
    encode,
    node_plan,
    plan_delta,
    worker_plan,
)

JOB = "j1"


def _names(nodes: int, per: int) -> dict[str, list[str]]:
    return {f"n{i:04d}": [f"n{i:04d}-w{k}" for k in range(per)] for i in range(nodes)}


def _plan(generation: int, order: list[str], nodes: dict[str, list[str]], token: int = 7) -> Plan:
    where = {w: n for n, ws in nodes.items() for w in ws}
    return Plan(
        job=JOB,
        generation=generation,
        token=token,
        launch="r-1",
        members=[Member(rank=r, worker=w) for r, w in enumerate(order)],
        reason=f"gen {generation}",
        store_prefix=f"{JOB}/gen{generation}",
        store_secret="s3cret",
        store_addr="10.0.0.1:29400",
        nodes={w: where[w] for w in order},
    )


def _views(plan: Plan, nodes: dict[str, list[str]]) -> dict[str, NodePlan]:
    return {n: node_plan(plan, n, set(ws)) for n, ws in nodes.items()}


def _follow(prev: Plan, plan: Plan, nodes: dict[str, list[str]]) -> None:
    """Every node that applies the delta holds what the whole plan says."""
    delta = plan_delta(prev, plan)
    delta = decode(*encode(delta), PlanDelta)  # through the wire
    for node, view in _views(prev, nodes).items():
        got = apply_delta(view, delta, set(nodes[node]))
        assert got is not None, node
        assert got == node_plan(plan, node, set(nodes[node])), node


def test_a_replacement_a_shrink_and_a_grow_each_apply_to_every_node() -> None:
    nodes = _names(6, 5)  # 4 ranks + 1 spare per node
    start = [w for ws in nodes.values() for w in ws[:4]]
    g1 = _plan(1, start, nodes)
    replaced = [w if w != "n0002-w1" else "n0004-w4" for w in start]  # a spare takes the rank
    g2 = _plan(2, replaced, nodes)
    _follow(g1, g2, nodes)
    shrunk = [w for w in replaced if not w.startswith("n0003")]  # a node lost, no spare
    g3 = _plan(3, shrunk, nodes)
    _follow(g2, g3, nodes)
    grown = [*shrunk, "n0000-w4", "n0001-w4", "n0005-w4"]
    g4 = _plan(4, grown, nodes)
    _follow(g3, g4, nodes)
    view = apply_delta(node_plan(g3, "n0003", set(nodes["n0003"])), plan_delta(g3, g4), set(nodes["n0003"]))
    assert view is not None and view.ranks == {}  # a node with no member left holds an empty part


def test_a_delta_of_a_few_changes_is_small_whatever_the_job_size() -> None:
    nodes = _names(2048, 9)  # 16,384 ranks, a spare per node
    start = [w for ws in nodes.values() for w in ws[:8]]
    g1 = _plan(1, start, nodes)
    lost = set(nodes["n0100"][:8])
    spares = iter(nodes[n][8] for n in nodes if n != "n0100")
    g2 = _plan(2, [next(spares) if w in lost else w for w in start], nodes)
    data, _ = encode(plan_delta(g1, g2))
    assert len(data) < 1024
    _follow(g1, g2, {n: nodes[n] for n in ("n0000", "n0100", "n0101", "n2047")})
    full, _ = encode(g2)
    assert len(full) > 10 * len(data)


def test_a_random_reorder_still_applies() -> None:
    nodes = _names(8, 4)
    start = [w for ws in nodes.values() for w in ws]
    rng = random.Random(5)
    prev = _plan(1, start, nodes)
    for g in range(2, 6):
        order = rng.sample(start, k=len(start) - rng.randrange(4))
        plan = _plan(g, order, nodes)
        _follow(prev, plan, nodes)
        prev = plan


def test_a_launcher_without_the_base_reads_the_record() -> None:
    nodes = _names(3, 2)
    start = [w for ws in nodes.values() for w in ws]
    g1, g2, g3 = (_plan(g, start[: 6 - g], nodes) for g in (1, 2, 3))
    view1 = node_plan(g1, "n0000", set(nodes["n0000"]))
    assert apply_delta(None, plan_delta(g2, g3), set(nodes["n0000"])) is None  # holds nothing
    assert apply_delta(view1, plan_delta(g2, g3), set(nodes["n0000"])) is None  # missed generation 2
    assert apply_delta(view1, plan_delta(None, g2), set(nodes["n0000"])) is None  # a full delta
    lower = plan_delta(g1, _plan(2, start, nodes, token=6))
    assert apply_delta(view1, lower, set(nodes["n0000"])) is None  # a deposed planner's


def test_a_delta_that_puts_two_workers_on_one_rank_is_not_applied() -> None:
    nodes = _names(1, 2)
    g1 = _plan(1, nodes["n0000"], nodes)
    delta = plan_delta(g1, _plan(2, nodes["n0000"], nodes))
    bad = delta.model_copy(update={"moves": [(0, 1, 0), (1, 1, 0)]})
    assert apply_delta(node_plan(g1, "n0000", set(nodes["n0000"])), bad, set(nodes["n0000"])) is None


@pytest.mark.parametrize(
    "field",
    [
        {"moves": [(0, 0, 1)]},
        {"moves": [(-1, 1, 0)]},
        {"joined": [("w", 0, 0, 1)]},
        {"joined": [("w", -1, 2, 0)]},
    ],
)
def test_a_malformed_run_is_refused_on_decode(field: dict[str, object]) -> None:
    nodes = _names(1, 2)
    g1 = _plan(1, nodes["n0000"], nodes)
    wire = plan_delta(g1, g1.model_copy(update={"generation": 2})).model_dump(mode="json") | field
    with pytest.raises(ValueError, match=r"run|move"):
        PlanDelta.model_validate(wire)


def test_a_worker_without_a_launcher_sees_its_own_part() -> None:
    nodes = _names(2, 2)
    plan = _plan(1, [w for ws in nodes.values() for w in ws], nodes)
    part = worker_plan(plan, "n0001-w1")
    assert part.ranks == {"n0001-w1": 3} and part.node == "n0001" and part.world_size == 4
    assert part.rank_of("n0001-w0") is None and part.supersedes(None) and not part.supersedes(part)


def test_a_launcher_reads_its_part_of_the_record_run_by_run() -> None:
    from phalanx.contract import DecodeError, JobRecord, record_node_plan

    nodes = _names(64, 9)
    order = [w for ws in nodes.values() for w in ws[:8]]
    order[17] = "n0063-w8"  # a spare took a rank: a run of its own
    plan = _plan(3, order, nodes).model_copy(update={"removed": ["n0002-w1"]})
    data, _ = encode(JobRecord(job=JOB, token=7, plan=plan))
    for node in ("n0000", "n0002", "n0063"):
        workers = set(nodes[node])
        assert record_node_plan(data, node, workers) == node_plan(plan, node, workers), node
    assert record_node_plan(encode(JobRecord(job=JOB, token=7))[0], "n0000", set()) is None
    bad = JobRecord(job=JOB, token=7, plan=plan).model_dump(mode="json")
    bad["plan"]["members"] = [["n0000-w", 0, "eight"]]
    import zlib

    import msgpack

    with pytest.raises(DecodeError, match="malformed"):
        record_node_plan(zlib.compress(msgpack.packb(bad)), "n0000", set(nodes["n0000"]))
