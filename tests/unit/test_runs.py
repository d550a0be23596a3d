"""Compact wire forms (phalanx.contract.runs) and the planner's cheap private copy:
what a 16k-rank plan and record look like on the wire, and what a bad run does."""

from __future__ import annotations

import random

import msgpack
import pytest
from phalanx.services.elasticity_planner import events as ev
from phalanx.services.elasticity_planner.reducer import Reducer

from phalanx.contract import BatchPlan, DecodeError, JobRecord, Member, Plan, Role, decode, encode
from phalanx.contract.codec import HDR_ENCODING, MAX_INFLATED
from phalanx.contract.jobrecord import NodeState
from phalanx.contract.runs import MAX_EXPANDED, from_runs, int_runs, node_runs, split_name, to_runs
from tests.unit.planner_inputs import JOB, registered, spec


@pytest.mark.parametrize(
    "names",
    [
        [],
        ["w0", "w1", "w2"],
        ["n1-w0", "n1-w1", "n2-w0", "n1-w2", "solo", "x007", "x7", "n1-w3"],
        [f"node{i:04d}-w{k}" for i in range(50) for k in range(9)],
        ["a9", "a10", "a11", "b"],
    ],
)
def test_names_survive_their_runs(names: list[str]) -> None:
    assert from_runs(to_runs(names)) == names


def _runs_by_splitting(names: list[str]) -> list[list[object]]:
    """The runs by the definition: split every name, extend the last run when it continues."""
    runs: list[list[object]] = []
    for name in names:
        prefix, n = split_name(name)
        if n >= 0 and runs and runs[-1][0] == prefix and runs[-1][1] != -1:
            first, count = runs[-1][1], runs[-1][2]
            assert isinstance(first, int) and isinstance(count, int)
            if first + count == n:
                runs[-1][2] = count + 1
                continue
        runs.append([prefix, n, 1])
    return runs


@pytest.mark.parametrize("seed", range(20))
def test_the_fast_path_gives_the_runs_splitting_every_name_gives(seed: int) -> None:
    rng = random.Random(seed)
    pool = ["w", "n1-w", "n12-w", "x0", "a-", ""]
    names = []
    for _ in range(300):
        if rng.random() < 0.7 and names:  # mostly continuing, as a node's workers do
            prefix, n = split_name(names[-1])
            names.append(f"{prefix}{n + 1}" if n >= 0 else f"{names[-1]}{rng.randrange(3)}")
        else:
            names.append(rng.choice(pool) + rng.choice(["", "0", "07", str(rng.randrange(20))]))
    assert to_runs(names) == _runs_by_splitting(names)
    assert from_runs(to_runs(names)) == names
    nodes = {w: f"node{i // 7}" for i, w in enumerate(dict.fromkeys(names))}
    runs = node_runs(nodes)
    assert {w: r[0] for r in runs for w in from_runs([r[1:]])} == nodes
    by_node: list[list[object]] = []  # the definition again: a run continues only on its own node
    for w, node in nodes.items():
        prefix, n = split_name(w)
        last = by_node[-1] if by_node else None
        if last is not None and n >= 0 and last[:2] == [node, prefix] and last[2] != -1:
            if last[2] + last[3] == n:  # type: ignore[operator]
                last[3] += 1  # type: ignore[operator]
                continue
        by_node.append([node, prefix, n, 1])
    assert runs == by_node


def test_a_node_of_consecutive_workers_is_one_run() -> None:
    names = [f"n{i}-w{k}" for i in range(3) for k in range(8)]
    assert to_runs(names) == [["n0-w", 0, 8], ["n1-w", 0, 8], ["n2-w", 0, 8]]
    nodes = {w: w.split("-")[0] for w in names}
    assert node_runs(nodes) == [["n0", "n0-w", 0, 8], ["n1", "n1-w", 0, 8], ["n2", "n2-w", 0, 8]]
    assert int_runs([3, 3, 3, 2, 2]) == [[3, 3], [2, 2]]


@pytest.mark.parametrize(
    ("runs", "why"),
    [
        ([["w", 0, MAX_EXPANDED + 1]], "expand past"),
        ([["w", 0, MAX_EXPANDED // 2], ["v", 0, MAX_EXPANDED // 2 + 1]], "expand past"),
        ([["w", 0]], "a run is a list of 3"),
        ([["w", -5, 2]], "first >= 0"),
        ([["w", 0, 0]], "count >= 1"),
        ([[1, 0, 2]], "a name run is"),
    ],
)
def test_a_bad_run_is_refused_before_anything_is_built(runs: list[object], why: str) -> None:
    with pytest.raises(ValueError, match=why):
        from_runs(runs)


def _plan(world: int) -> Plan:
    workers = [f"n{i // 8:04d}-w{i % 8}" for i in range(world)]
    spares = [f"n{i:04d}-w8" for i in range(world // 8)]
    return Plan(
        job=JOB,
        generation=3,
        members=[Member(rank=r, worker=w) for r, w in enumerate(workers)],
        spares=spares,
        reason="r",
        store_prefix="j/gen3",
        nodes={w: w.split("-")[0] for w in workers + spares},
        batch=BatchPlan(
            global_batch=world * 4 + 3,
            effective_batch=world * 4 + 3,
            world_size=world,
            shards=[5] * 3 + [4] * (world - 3),
        ),
    )


def test_a_plan_of_thousands_travels_in_kilobytes_and_comes_back_equal() -> None:
    plan = _plan(4096)
    data, headers = encode(plan)
    assert headers[HDR_ENCODING] == "msgpack+zlib"
    assert len(data) < 16_000  # spelled out, one entry per rank: ~400 KB
    back = decode(data, headers, Plan)
    assert back == plan and back.rank_of("n0100-w3") == 803 and back.batch is not None
    assert back.batch.shards[:4] == [5, 5, 5, 4] and len(back.batch.shards) == 4096


def test_the_spelled_out_form_is_still_read() -> None:
    plan = _plan(16)
    wire = plan.model_dump(mode="json")
    wire["members"] = [{"rank": m.rank, "worker": m.worker} for m in plan.members]
    wire["spares"] = list(plan.spares)
    wire["nodes"] = dict(plan.nodes)
    assert Plan.model_validate(wire) == plan


def test_a_payload_that_inflates_past_the_bound_is_refused() -> None:
    import zlib

    bomb = zlib.compress(msgpack.packb({"pad": "x" * (MAX_INFLATED + 1)}), 9)
    with pytest.raises(DecodeError, match="inflates past"):
        decode(bomb, {"Phalanx-Kind": "plan", "Phalanx-Schema": "2", "Phalanx-Encoding": "msgpack+zlib"})
    with pytest.raises(DecodeError, match="malformed zlib"):
        decode(
            b"not zlib", {"Phalanx-Kind": "plan", "Phalanx-Schema": "2", "Phalanx-Encoding": "msgpack+zlib"}
        )


def _job(nodes: int) -> object:
    r, state = Reducer(), None
    for i in range(nodes):
        names = [f"n{i}-w{k}" for k in range(3)]
        s = spec(2, 1, node=f"n{i}", launcher=f"L{i}", workers=names, min_nodes=nodes, max_nodes=nodes)
        state, _ = r.step(state, ev.JoinRequest(msg=s, run="r-test"), 1.0)
    for i in range(nodes):
        for k in range(3):
            state, _ = r.step(state, registered(f"n{i}-w{k}", Role.RANK if k < 2 else Role.SPARE), 1.0)
    return state


def test_a_step_never_changes_the_state_it_was_given_and_shares_untouched_nodes() -> None:
    state = _job(4)
    assert state.plan is not None and state.world_size == 8  # type: ignore[attr-defined]
    before = state.model_dump(mode="json")  # type: ignore[attr-defined]
    twin = state.clone()  # type: ignore[attr-defined]
    assert twin == state and twin.nodes["n1"] is state.nodes["n1"]  # type: ignore[attr-defined]
    twin.node("n1").slots = 0
    twin.node("n1").workers.append("n1-w9")
    assert twin.nodes["n1"] is not state.nodes["n1"]  # type: ignore[attr-defined]
    assert state.model_dump(mode="json") == before  # type: ignore[attr-defined]
    assert twin.node_of("n1-w9") == "n1" and state.node_of("n1-w9") is None  # type: ignore[attr-defined]


def test_the_record_of_a_job_round_trips_with_its_books() -> None:
    state = _job(3)
    rec = JobRecord(job=JOB, token=1, plan=state.plan, planner=state)  # type: ignore[attr-defined]
    back = decode(*encode(rec), JobRecord)
    assert back.planner == state and back.plan == rec.plan
    assert isinstance(back.planner.nodes["n0"], NodeState) and back.planner.node_of("n2-w2") == "n2"
