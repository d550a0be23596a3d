"""The local cluster's record (phalanx.cluster): grace durations, the model, offer and
reclaim as pure functions, and the signals a record's revision gives."""

from __future__ import annotations

import json
import math

import pytest
from phalanx.services.scheduler_signal.sources import ClusterFile, Ledger, Signal, state_signals
from pydantic import ValidationError

from phalanx.cluster import (
    MAX_SLOTS,
    RETAIN_S,
    BadInput,
    ClusterPreemption,
    ClusterRecord,
    ClusterState,
    apply_offer,
    apply_reclaim,
    check_name,
    describe,
    parse_grace,
    parse_record,
)
from phalanx.contract import CapacityChanged, PreemptionNotice

NOW = 1_700_000_000.0


# -- grace ------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("text", "seconds"),
    [("10s", 10.0), ("500ms", 0.5), ("2m", 120.0), ("1h", 3600.0), ("7", 7.0), ("1.5", 1.5), (" 0 ", 0.0)],
)
def test_grace_durations(text: str, seconds: float) -> None:
    assert parse_grace(text) == seconds


@pytest.mark.parametrize(
    ("text", "why"),
    [
        ("-5s", "negative"),
        ("-1", "negative"),
        ("abc", "not a duration"),
        ("10x", "not a duration"),
        ("", "not a duration"),
        ("inf", "not a duration"),
        ("nan", "not a duration"),
        ("1e3", "not a duration"),
        ("10 s s", "not a duration"),
        ("999999h", "between 0 and"),
    ],
)
def test_bad_grace_is_refused_clearly(text: str, why: str) -> None:
    with pytest.raises(BadInput, match=why):
        parse_grace(text)


# -- the record ------------------------------------------------------------------------------------
def test_record_round_trips_and_reads_the_documented_shape() -> None:
    doc = {
        "cluster": "local",
        "nodes": [{"name": "node-b", "slots": 2, "ready": True}],
        "preemptions": [
            {
                "id": "reclaim-node-b-1",
                "job": None,
                "workers": [],
                "nodes": ["node-b"],
                "deadline_s": 10.0,
                "at": NOW,
            }
        ],
    }
    state = parse_record("local", json.dumps(doc).encode())
    assert state.offered == {"node-b": 2} and state.available_slots == 2
    assert state.preemptions[0].remaining_s(NOW + 4) == pytest.approx(6.0)
    assert state.preemptions[0].remaining_s(NOW + 60) == 0.0
    assert ClusterState.model_validate_json(state.model_dump_json()) == state
    assert parse_record("local", b"") == ClusterState(cluster="local")
    assert ClusterFile is ClusterState  # the cluster file is the same model


@pytest.mark.parametrize(
    "doc",
    [
        {"nodes": [{"name": "a.b", "slots": 1}]},
        {"nodes": [{"name": "x" * 65, "slots": 1}]},
        {"nodes": [{"name": "a", "slots": -1}]},
        {"nodes": [{"name": "a", "slots": MAX_SLOTS + 1}]},
        {"nodes": [{"name": "a", "slots": 1}, {"name": "a", "slots": 2}]},
        {"nodes": [{"name": "a", "slots": 1, "colour": "red"}]},
        {"preemptions": [{"id": "p 1"}]},
        {"preemptions": [{"id": "p1", "deadline_s": -1}]},
        {"preemptions": [{"id": "p1", "nodes": ["a/b"]}]},
        {"preemptions": [{"id": "p1"}, {"id": "p1"}]},
        {"cluster": "a.b"},
    ],
)
def test_invalid_records_are_refused(doc: dict[str, object]) -> None:
    with pytest.raises(ValidationError):
        ClusterState.model_validate(doc)


def test_a_record_under_another_clusters_key_or_broken_is_refused() -> None:
    with pytest.raises(ValueError, match="names cluster 'other'"):
        parse_record("local", b'{"cluster": "other"}')
    with pytest.raises(ValueError, match="is invalid"):
        parse_record("local", b"{not json")


def test_infinite_deadlines_are_refused() -> None:
    with pytest.raises(ValidationError):
        ClusterPreemption(id="p1", deadline_s=math.inf)


def test_a_node_that_is_not_ready_offers_nothing() -> None:
    state = ClusterState.model_validate(
        {"nodes": [{"name": "a", "slots": 3, "ready": False}, {"name": "b", "slots": 2}]}
    )
    assert state.offered == {"a": 0, "b": 2} and state.available_slots == 2


@pytest.mark.parametrize("name", ["node-a", "n_1", "A" * 64])
def test_good_names(name: str) -> None:
    assert check_name("node", name) == name


@pytest.mark.parametrize("name", ["", "a.b", "a b", "a/b", "A" * 65, "ü"])
def test_bad_names(name: str) -> None:
    with pytest.raises(BadInput, match="bad node name"):
        check_name("node", name)


# -- offer and reclaim ----------------------------------------------------------------------------------
def test_offer_adds_to_a_node_or_creates_it() -> None:
    empty = ClusterState()
    one = apply_offer(empty, "node-b", 2, NOW)
    assert one.offered == {"node-b": 2} and one.nodes[0].ready
    two = apply_offer(one, "node-b", 3, NOW)
    assert two.offered == {"node-b": 5}
    three = apply_offer(two, "node-c", 1, NOW)
    assert three.offered == {"node-b": 5, "node-c": 1} and three.available_slots == 6
    assert empty == ClusterState()  # frozen: the input is left alone


@pytest.mark.parametrize(
    ("node", "slots", "why"),
    [
        ("node-b", 0, "at least 1"),
        ("node-b", -2, "at least 1"),
        ("a.b", 1, "bad node name"),
        ("node-b", MAX_SLOTS + 1, "at most"),
    ],
)
def test_bad_offers(node: str, slots: int, why: str) -> None:
    with pytest.raises(BadInput, match=why):
        apply_offer(ClusterState(), node, slots, NOW)


def test_reclaim_zeroes_the_node_and_adds_a_new_preemption_each_time() -> None:
    state = apply_offer(ClusterState(), "node-b", 2, NOW)
    state, first = apply_reclaim(state, "node-b", 10.0, NOW)
    assert state.offered == {"node-b": 0}
    assert (first.id, first.nodes, first.deadline_s, first.at, first.reason) == (
        "reclaim-node-b-1",
        ["node-b"],
        10.0,
        NOW,
        "reclaim node-b",
    )
    assert first.job is None and first.workers == []
    state = apply_offer(state, "node-b", 1, NOW + 1)
    state, second = apply_reclaim(state, "node-b", 0.5, NOW + 2)
    assert second.id == "reclaim-node-b-2"
    assert [p.id for p in state.preemptions] == ["reclaim-node-b-1", "reclaim-node-b-2"]
    # a node never offered can be reclaimed too (its launchers' workers leave)
    state, other = apply_reclaim(state, "node-a", 5.0, NOW + 3)
    assert other.id == "reclaim-node-a-1" and state.offered["node-a"] == 0


def test_old_preemptions_are_dropped_but_ids_are_never_reused() -> None:
    state, _ = apply_reclaim(ClusterState(), "node-b", 10.0, NOW)
    later = NOW + 10 + RETAIN_S + 1
    state, again = apply_reclaim(state, "node-b", 10.0, later)
    assert [p.id for p in state.preemptions] == ["reclaim-node-b-2"] and again.id == "reclaim-node-b-2"
    assert apply_offer(state, "node-c", 1, later + 10 + RETAIN_S + 1).preemptions == []


def test_reclaim_skips_an_id_a_hand_written_record_already_uses() -> None:
    state = ClusterState.model_validate({"preemptions": [{"id": "reclaim-node-b-1", "nodes": ["node-b"]}]})
    _, notice = apply_reclaim(state, "node-b", 1.0, NOW)
    assert notice.id == "reclaim-node-b-2"


def test_describe_shows_nodes_and_preemptions() -> None:
    state = apply_offer(ClusterState(), "node-c", 3, NOW)
    state, _ = apply_reclaim(state, "node-b", 10.0, NOW)
    text = describe(ClusterRecord(state, 7), now=NOW + 4)
    assert "cluster local (revision 7): 3 slot(s)" in text
    assert "node-c  3" in text and "reclaim-node-b-1" in text and "6.0s" in text
    assert "no record yet" in describe(ClusterRecord(ClusterState(), 0))


# -- a record's revision as signals ------------------------------------------------------------------------
class Published:
    """A history holding one earlier CapacityChanged (or none)."""

    def __init__(self, last: CapacityChanged | None = None, announced: set[str] | None = None) -> None:
        self.last = last
        self.ids = announced or set()

    async def last_capacity(self, cluster: str) -> CapacityChanged | None:
        return self.last

    async def announced(self, cluster: str) -> set[str]:
        return self.ids


async def _signals(ledger: Ledger, state: ClusterState, revision: str, now: float) -> list[Signal]:
    out = await state_signals(ledger, state, revision, now)
    for sig in out:
        ledger.published(sig)
    return out


async def test_a_revision_publishes_offered_slots_and_new_preemptions_once() -> None:
    ledger = Ledger(Published(), "local")
    state = apply_offer(ClusterState(), "node-b", 2, NOW)
    (cap,) = await _signals(ledger, state, "kv1", NOW)
    assert isinstance(cap.message, CapacityChanged) and cap.msg_id == "local:capacity:kv1"
    assert (cap.message.available_slots, cap.message.delta, cap.message.offered) == (2, 2, {"node-b": 2})
    assert await _signals(ledger, state, "kv1", NOW) == []

    state, _ = apply_reclaim(state, "node-b", 10.0, NOW)
    cap2, notice = await _signals(ledger, state, "kv2", NOW + 0.5)
    assert isinstance(cap2.message, CapacityChanged) and cap2.message.offered == {"node-b": 0}
    assert cap2.message.delta == -2
    assert isinstance(notice.message, PreemptionNotice) and notice.msg_id == "local:preempt:reclaim-node-b-1"
    n = notice.message
    assert (n.nodes, n.job, n.workers, n.reason, n.source) == (
        ["node-b"],
        None,
        [],
        "reclaim node-b",
        "local",
    )
    assert n.deadline_s == pytest.approx(9.5)
    assert await _signals(ledger, state, "kv2", NOW + 1) == []


async def test_the_same_sum_on_other_nodes_is_a_change() -> None:
    before = CapacityChanged(
        cluster="local", available_slots=2, delta=2, source="local", offered={"node-b": 2}
    )
    ledger = Ledger(Published(before), "local")
    state = ClusterState.model_validate(
        {"nodes": [{"name": "node-b", "slots": 0}, {"name": "node-c", "slots": 2}]}
    )
    (cap,) = await _signals(ledger, state, "kv5", NOW)
    assert isinstance(cap.message, CapacityChanged)
    assert (cap.message.available_slots, cap.message.delta) == (2, 0)
    assert cap.message.offered == {"node-b": 0, "node-c": 2}


async def test_after_a_restart_nothing_already_published_comes_again() -> None:
    state = apply_offer(ClusterState(), "node-b", 2, NOW)
    state, _ = apply_reclaim(state, "node-b", 10.0, NOW)
    last = CapacityChanged(
        cluster="local", available_slots=0, delta=-2, source="local", offered={"node-b": 0}
    )
    ledger = Ledger(Published(last, {"local:preempt:reclaim-node-b-1"}), "local")
    assert await _signals(ledger, state, "kv2", NOW + 1) == []


async def test_a_late_notice_has_no_time_left() -> None:
    state, _ = apply_reclaim(ClusterState(), "node-b", 10.0, NOW)
    sigs = await _signals(Ledger(Published(), "local"), state, "kv1", NOW + 60)
    notice = next(s.message for s in sigs if isinstance(s.message, PreemptionNotice))
    assert notice.deadline_s == 0.0
