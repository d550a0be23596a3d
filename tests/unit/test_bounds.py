"""The bound of each collective a rank runs (phalanx.runtime.bounds): the gradient
all-reduce's, learned; the first of a generation's, from the members' steps; the
rendezvous' and the state transfer's; none above the backstop."""

from __future__ import annotations

import pytest

from phalanx.runtime.bounds import COLLECTIVE_WINDOW, MIN_BYTES_PER_S, Bounds


def bounds(**kw: float) -> Bounds:
    args = {"floor_s": 2.0, "factor": 4.0, "initial_s": 60.0, "backstop_s": 120.0, "rendezvous_s": 60.0}
    args.update(kw)
    return Bounds(**args)


def test_gradient_bound_is_learned_within_a_generation() -> None:
    b = bounds()
    assert b.first_of_generation and b.gradient_s() == 60.0  # the job's first: nobody has a step
    for ms in (10.0, 120.0, 30.0):
        b.record_collective(ms)
    assert not b.first_of_generation and b.gradient_s() == 2.0  # the floor
    b.record_collective(900.0)
    assert b.gradient_s() == pytest.approx(3.6)
    for _ in range(COLLECTIVE_WINDOW):
        b.record_collective(1.0)
    assert b.gradient_s() == 2.0  # the slow one slid out
    b.record_collective(1e6)
    assert b.gradient_s() == 120.0  # never above the backstop


def test_first_all_reduce_of_a_generation_is_bounded_by_the_members_slowest_step() -> None:
    b = bounds()
    b.record_collective(50.0)
    b.record_step(300.0)
    b.record_step(900.0)
    assert b.slowest_step_ms() == 900.0
    b.join(slowest_step_ms=1500.0)  # a peer's step was slower: it is what the joiner waits for
    assert b.first_of_generation and b.gradient_s() == pytest.approx(6.0)
    b.join(slowest_step_ms=100.0)
    assert b.gradient_s() == 2.0  # the floor
    b.join(slowest_step_ms=0.0)  # no member has completed a step: the job's first
    assert b.gradient_s() == 60.0
    b.record_collective(10.0)
    assert b.gradient_s() == 2.0  # from then on, this generation's own


def test_the_job_s_first_all_reduce_is_bounded_by_its_bytes_once_every_member_arrived() -> None:
    b = bounds()
    assert b.awaiting_arrival and b.gradient_s() == 60.0  # the barrier's: nobody has a step
    b.arrived(gradient_bytes=MIN_BYTES_PER_S)  # past the barrier: the members start it together
    # the inside floor (1 s: every member is known to be inside) and each byte sent twice
    assert not b.awaiting_arrival and b.gradient_s() == pytest.approx(1.0 + 2.0)
    b.record_collective(40.0)
    assert b.gradient_s() == 2.0  # learned from then on
    b.leave()
    b.join(slowest_step_ms=0.0)  # a generation formed before any step completed: again
    assert b.awaiting_arrival and b.gradient_s() == 60.0
    b.arrived(gradient_bytes=4 << 20)  # a small model's: the inside floor, near enough
    assert b.gradient_s() == pytest.approx(1.08)
    big = bounds(initial_s=500.0)
    assert big.gradient_s() == 120.0  # never above the backstop
    big.arrived(gradient_bytes=40 << 30)  # 40 GiB at the slowest rate: the backstop
    assert big.gradient_s() == 120.0


def test_every_generation_s_first_all_reduce_is_bounded_by_its_bytes_past_the_barrier() -> None:
    b = bounds()
    b.record_collective(30.0)
    b.join(slowest_step_ms=500.0)  # a member has a step: it bounds the barrier (a joiner's step)
    assert b.awaiting_arrival and b.gradient_s() == 2.0
    b.arrived(gradient_bytes=4 << 20)
    assert not b.awaiting_arrival and b.gradient_s() == pytest.approx(1.08)
    b.join(slowest_step_ms=100.0)  # the next generation: a barrier again
    assert b.awaiting_arrival and b.gradient_s() == 2.0
    b.arrived(gradient_bytes=10 * MIN_BYTES_PER_S)  # moving it takes longer than the barrier
    assert b.gradient_s() == 2.0  # no longer than the barrier was
    b.record_collective(10.0)
    assert not b.awaiting_arrival  # learned: no barrier until the next generation


def test_rendezvous_waits_for_peers_still_in_the_generation_left() -> None:
    b = bounds(rendezvous_s=30.0)
    assert b.arrival_s() == 30.0  # a first generation: the job's start, or a spare
    b.record_collective(1000.0)
    b.leave()  # its all-reduces took up to 4 s: a peer may still sit in one that long
    assert b.arrival_s() == pytest.approx(2.0 + 4.0)
    assert b.exchange_s() == b.store_s() == 2.0
    assert b.connect_s() == 1.0  # every member has arrived: the inside floor


def test_state_transfer_bound_grows_with_the_state_and_the_queue() -> None:
    b = bounds()
    assert b.transfer_s(0, 0) == 2.0
    assert b.transfer_s(MIN_BYTES_PER_S, 0) == pytest.approx(3.0)
    assert b.transfer_s(MIN_BYTES_PER_S, 2) == pytest.approx(5.0)  # two receivers served first
    assert b.transfer_s(10**15, 0) == 120.0
