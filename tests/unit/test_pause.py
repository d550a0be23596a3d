"""job.pause (phalanx.runtime.pause) on one rank: what it reports, what it waits
for, and what a failed wait leaves for the loop. The many-rank behaviour (no
verdict for rank 0's evaluation, a rank lost in a pause) is tests/e2e/test_user_loop.py's."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import pytest
import torch.distributed as dist

from phalanx.contract import Phase
from phalanx.runtime.comm import Group
from phalanx.runtime.faults import FaultPlan
from phalanx.runtime.pause import Pauses
from phalanx.worker.status import RankStatus


class OneRankGroup(Group):
    """A one-rank gloo group with the job communicator's ``release`` (the rank drops
    its generation, as an injected ``break`` makes it)."""

    def release(self) -> None:
        self.released = True
        self.abort()


@dataclass
class OneRank:
    """The part of a job a pause uses: its status, a one-rank gloo group, its faults."""

    comm: OneRankGroup
    faults: FaultPlan = field(default_factory=FaultPlan)
    worker: str = "w0"
    status: RankStatus = field(default_factory=lambda: RankStatus("j", "w0"))


@pytest.fixture
def rank() -> OneRank:
    return OneRank(OneRankGroup(dist.HashStore(), "pause-test", 0, 1))


@pytest.mark.parametrize("bad", [0.0, -1.0, math.nan])
def test_a_pause_needs_a_positive_bound(rank: OneRank, bad: float) -> None:
    with pytest.raises(ValueError, match="max_s must be > 0"):
        Pauses(rank).pause(bad)  # type: ignore[arg-type]


def test_outside_a_step_a_pause_does_nothing(rank: OneRank) -> None:
    pauses = Pauses(rank)  # type: ignore[arg-type]
    rank.status.enter(Phase.COMPUTE)
    with pauses.pause(5.0):
        assert rank.status.phase is Phase.COMPUTE
    pauses.begin(3, 2.0)
    pauses.end()
    with pauses.pause(5.0):
        assert rank.status.phase is Phase.COMPUTE
    assert pauses.seconds == 0.0


def test_inside_a_step_the_rank_reports_a_bounded_collective_then_computes_again(rank: OneRank) -> None:
    pauses = Pauses(rank)  # type: ignore[arg-type]
    pauses.begin(3, 2.0)
    with pauses.pause(7.5):
        assert rank.status.phase is Phase.COLLECTIVE
        assert rank.status.collective_bound_ms == 7500.0
    assert rank.status.phase is Phase.COMPUTE
    assert pauses.failed is None and pauses.seconds > 0.0
    pauses.begin(4, 2.0)  # a new step counts afresh
    assert pauses.seconds == 0.0


def test_a_failed_wait_is_kept_for_after_the_step_and_does_not_raise(rank: OneRank) -> None:
    pauses = Pauses(rank)  # type: ignore[arg-type]
    pauses.begin(3, 2.0)
    with pauses.pause(5.0):
        rank.comm.abort()  # what a newer plan does to the generation
    assert pauses.failed is not None and "aborted" in str(pauses.failed)
    assert rank.status.phase is Phase.COMPUTE


def test_an_error_inside_the_pause_propagates_without_waiting(rank: OneRank) -> None:
    pauses = Pauses(rank)  # type: ignore[arg-type]
    pauses.begin(3, 2.0)
    with pytest.raises(KeyError), pauses.pause(5.0):
        rank.comm.abort()  # a wait would fail: there is none
        raise KeyError("the user's evaluation failed")
    assert pauses.failed is None and rank.status.phase is Phase.COMPUTE


def test_an_injected_break_at_the_pause_fails_its_wait(rank: OneRank) -> None:
    rank.faults = FaultPlan.parse("break:w0@pause=3")
    pauses = Pauses(rank)  # type: ignore[arg-type]
    pauses.begin(3, 2.0)
    with pauses.pause(5.0):
        assert rank.comm.released
    assert pauses.failed is not None
