"""phalanx.runtime.nccl_shrink: the pure parts of shrinking an NCCL communicator (the
rank arithmetic, the "can this member shrink?" decision, the mode), and that the
CPU/gloo path of the Communicator is unchanged by a plan that names ``shrunk``.
The NCCL path itself needs two GPUs: bench/gpu_check.py measures it."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist

from phalanx.contract import Member, Plan
from phalanx.runtime.comm import Communicator
from phalanx.runtime.nccl_shrink import (
    SHRINK_ABORT,
    SHRINK_DEFAULT,
    Parked,
    ShrinkMode,
    ShrinkRequest,
    backend_ready,
    can_shrink,
    flags_for,
    resolve_mode,
    shrink_rank,
)
from phalanx.runtime.storeserver import ThreadedStore
from tests.stores import SECRET, hosted


@pytest.fixture(scope="module")
def gloo() -> dist.ProcessGroupGloo:
    """A real one-rank gloo backend: what a parked backend is typed as, and one
    that cannot shrink."""
    return dist.ProcessGroupGloo(dist.HashStore(), 0, 1, timedelta(seconds=10))


@pytest.fixture(scope="module")
def store() -> Iterator[ThreadedStore]:
    s = hosted(SECRET)
    yield s
    s.close()


def parked(backend: Any, generation: int = 4, rank: int = 3, world_size: int = 6) -> Parked:
    return Parked(backend, generation, rank, world_size, f"j/gen{generation}")


def test_shrink_rank_subtracts_the_left_out_ranks_below() -> None:
    assert shrink_rank(0, 4, [3]) == 0
    assert shrink_rank(3, 4, [1]) == 2
    assert shrink_rank(5, 8, [0, 2, 6]) == 3
    assert shrink_rank(7, 8, [0, 1, 2, 3, 4, 5, 6]) == 0  # down to one rank
    # every survivor gets a distinct rank, in the old order, 0..n-k-1
    world, out = 10, [1, 4, 5, 9]
    new = [shrink_rank(r, world, out) for r in range(world) if r not in out]
    assert new == list(range(world - len(out)))


@pytest.mark.parametrize(
    ("rank", "world", "out"),
    [
        (1, 4, [1]),  # this rank is left out: it does not take part
        (0, 4, []),  # nobody left out: no shrink
        (0, 4, [2, 1]),  # unsorted
        (0, 4, [2, 2]),  # repeated
        (0, 4, [4]),  # out of range
        (0, 4, [-1]),
        (0, 2, [0, 1]),  # everyone
        (5, 4, [1]),  # this rank out of range
    ],
)
def test_shrink_rank_refuses_what_is_no_exclusion(rank: int, world: int, out: list[int]) -> None:
    assert shrink_rank(rank, world, out) is None


def test_can_shrink_when_everything_matches(gloo: dist.ProcessGroupGloo) -> None:
    p = parked(gloo)  # rank 3 of 6 in generation 4
    ok: dict[str, Any] = {
        "generation": 5,
        "rank": 2,
        "world_size": 4,
        "shrunk": [0, 5],
        "mode": ShrinkMode.AUTO,
    }
    assert can_shrink(p, **ok) is None
    assert can_shrink(p, **{**ok, "mode": ShrinkMode.REQUIRE}) is None


@pytest.mark.parametrize(
    ("change", "why"),
    [
        ({"mode": ShrinkMode.OFF}, "off"),
        ({"shrunk": []}, "no shrink"),
        ({"generation": 6}, "generation 4, not 5"),  # a plan in between was abandoned
        ({"world_size": 5}, "not the plan's 5"),
        ({"shrunk": [3, 5], "rank": 3}, "keeps rank 3"),  # this rank is the one left out
        ({"rank": 3}, "the plan says 3"),  # the planner renumbered otherwise
        ({"shrunk": [5, 0]}, "no exclusion"),
    ],
)
def test_can_shrink_says_why_not(gloo: dist.ProcessGroupGloo, change: dict[str, Any], why: str) -> None:
    args: dict[str, Any] = {
        "generation": 5,
        "rank": 2,
        "world_size": 4,
        "shrunk": [0, 5],
        "mode": ShrinkMode.AUTO,
    }
    reason = can_shrink(parked(gloo), **{**args, **change})
    assert reason is not None and why in reason, reason


def test_can_shrink_without_a_parked_communicator() -> None:
    reason = can_shrink(None, generation=5, rank=0, world_size=1, shrunk=[1], mode=ShrinkMode.AUTO)
    assert reason is not None and "no communicator" in reason


def test_a_gloo_backend_cannot_shrink(gloo: dist.ProcessGroupGloo) -> None:
    """The check that asks the backend itself, on a real one: gloo does not shrink,
    so a request over it says so (NCCL < 2.27 says the same)."""
    reason = backend_ready(gloo)
    assert reason is not None and "does not support shrinking" in reason
    req = ShrinkRequest(parked(gloo), [0, 5], planned=False, mode=ShrinkMode.AUTO, generation=5)
    why = req.why_not(2, 4)
    assert why is not None and "does not support shrinking" in why


def test_flags_follow_whether_the_change_was_planned() -> None:
    assert flags_for(planned=True) == SHRINK_DEFAULT  # drained at the step boundary
    assert flags_for(planned=False) == SHRINK_ABORT  # ops may wait on the lost rank
    assert (SHRINK_DEFAULT, SHRINK_ABORT) == (
        dist.distributed_c10d.SHRINK_DEFAULT,
        dist.distributed_c10d.SHRINK_ABORT,
    )


def test_mode_from_argument_environment_or_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PHALANX_NCCL_SHRINK", raising=False)
    assert resolve_mode() is ShrinkMode.AUTO
    assert resolve_mode("OFF") is ShrinkMode.OFF
    monkeypatch.setenv("PHALANX_NCCL_SHRINK", "require")
    assert resolve_mode() is ShrinkMode.REQUIRE
    assert resolve_mode(ShrinkMode.OFF) is ShrinkMode.OFF  # the argument wins
    with pytest.raises(ValueError, match="one of auto, off, require"):
        resolve_mode("sometimes")
    with pytest.raises(ValueError, match="NCCL shrink mode"):
        Communicator("w0", "127.0.0.1:1", nccl_shrink="sometimes")


def test_release_aborts_what_it_cannot_park(gloo: dist.ProcessGroupGloo) -> None:
    """A request whose parent is released twice aborts once and then holds nothing."""
    req = ShrinkRequest(parked(gloo), [0], planned=True, mode=ShrinkMode.AUTO, generation=5)
    req.release()
    assert req.parked is None
    req.release()


def _plan(store: ThreadedStore, generation: int, workers: list[str], shrunk: list[int]) -> Plan:
    return Plan(
        job="j1",
        generation=generation,
        members=[Member(worker=w, rank=r) for r, w in enumerate(workers)],
        reason="test",
        store_prefix=f"test-nccl-shrink/j1/gen{generation}",
        store_secret=SECRET,
        store_addr=f"127.0.0.1:{store.port}",
        shrunk=shrunk,
    )


def test_cpu_path_unchanged_by_a_plan_that_names_shrunk(store: ThreadedStore) -> None:
    """On gloo a shrink plan is an ordinary generation: no vote, nothing parked,
    the survivors' group works (3 ranks, then rank 1 left out)."""
    first = _plan(store, 1, ["w0", "w1", "w2"], [])
    second = _plan(store, 2, ["w0", "w2"], [1])
    comms = {w: Communicator(w, f"127.0.0.1:{store.port}", nccl_shrink="require") for w in ("w0", "w1", "w2")}
    sums: dict[str, float] = {}
    errors: list[BaseException] = []

    def run(worker: str) -> None:
        comm = comms[worker]
        try:
            comm.configure(first, cancelled=lambda: False, arrival_s=30.0, connect_s=30.0)
            t = torch.ones(1)
            comm.allreduce_sum_(t, 30.0)
            assert float(t) == 3.0
            # nobody tears down while a peer may still read its last bytes: release cuts
            # the group's sockets (a peer's all-reduce failed once without this barrier)
            comm.barrier(30.0)
            comm.release()
            if worker == "w1":
                return
            comm.configure(second, cancelled=lambda: False, arrival_s=30.0, connect_s=30.0)
            assert comm._parked is None and comm.held().nccl_built == {}
            t = torch.ones(1)
            comm.allreduce_sum_(t, 30.0)
            sums[worker] = float(t)
            comm.barrier(30.0)
            comm.release()
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(w,), daemon=True) for w in comms]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60.0)
    assert not any(t.is_alive() for t in threads), "a rank is still blocked"
    assert not errors, errors
    assert sums == {"w0": 2.0, "w2": 2.0}
    assert comms["w2"].rank == 1 and comms["w2"].world_size == 2


def test_gpu_check_says_why_the_shrink_part_is_skipped() -> None:
    from bench import gpu_check

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if gpus >= 2:
        pytest.skip("this machine can run the shrink part")
    out = gpu_check.shrink_paths(dry_run=False, repeats=1)
    assert out == {
        "skipped": f"needs >= 2 GPUs (one rank per GPU: NCCL refuses two ranks on one GPU), found {gpus}"
    }
