"""A rank hung inside the gradient all-reduce, end to end: real processes, real
gloo, real nats-server, detector and planner.

``wedge:w1@step=N`` puts w1's training thread into phase COLLECTIVE and blocks it
for good; its heartbeats go on, so neither the silence nor the compute-stall rule
can see it. Its peers' all-reduces end at their learned per-op timeout (2 s here:
4 x their recent all-reduce times, floored), they go RECOVERING, and the detector
finds w1 left behind in COLLECTIVE past its own reported bound:
``collective_hang``. A hot spare takes rank 1 and the run ends bitwise equal to
the fault-free one.

The same holds for every collective of recovery itself and for the first
all-reduce of a generation (:mod:`phalanx.runtime.bounds`): after w1 is killed in
step 5, w2 hangs in generation 2's rendezvous, its state transfer or its first
gradient all-reduce (``wedge:w2@rendezvous=2`` / ``transfer=2`` / ``collective=2``);
its peers' bounds fire, the detector finds it left behind, and a second spare
takes its rank. The time from the hang to the verdict and to the first step of
generation 3 is printed (the issue's target: under 5 s), not asserted. In the job's
very first all-reduce (``collective=1``), before any step was timed, the hang costs
the bound the members' all-reduce gets once all of them passed the barrier before it
(the floor plus what its bytes take at the slowest rate), not the initial minute.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from examples.train_gpt import command as train_command
from phalanx.contract import Action, FaultCause, RankHung
from phalanx.devstack.localstack import LocalStack
from tests.e2e.conftest import SMALL_GPT, STEPS, Reference
from tests.e2e.test_recovery import actions, assert_bitwise_equal, assert_recovered

pytestmark = pytest.mark.slow


def test_rank_hung_inside_the_all_reduce_is_replaced_within_seconds(
    stack: LocalStack, corpus: Path, reference: Reference, tmp_path: Path
) -> None:
    import torch

    save, fault_log = tmp_path / "weights.pt", tmp_path / "faults.jsonl"
    result = stack.run_job(
        "e2e-wedge",
        train_command(STEPS, corpus, *SMALL_GPT, save=save),
        nproc=3,
        spares=1,
        faults="wedge:w1@step=6",
        global_batch=12,
        timeout_s=180.0,
        env={"PHALANX_FAULT_LOG": str(fault_log)},
    )
    assert [(f.cause, f.worker) for f in result.faults] == [(FaultCause.COLLECTIVE_HANG, "w1")], result.faults
    [hung] = result.faults
    assert isinstance(hung, RankHung) and hung.generation == 1
    assert hung.evidence["phase"] == "collective"
    assert set(str(hung.evidence["peers_left"]).split(",")) <= {"w0", "w2"}
    assert actions(result) == [Action.START, Action.REPLACE]
    assert result.plans[-1].rank_of("w3") == 1 and result.plans[-1].removed == ["w1"]
    assert_recovered(result, generation=2)
    joiner = next(r for r in result.recoveries if r.worker == "w3")
    assert joiner.step == 7  # step 6 was in flight: redone, nothing else lost
    assert_bitwise_equal(torch.load(save) if save.exists() else None, reference(3))

    # Timings, reported (not asserted: a 2-core box shared with other tests).
    [wedge] = [json.loads(line) for line in fault_log.read_text().splitlines()]
    assert (wedge["worker"], wedge["action"]) == ("w1", "wedge")
    first_step_done = max(r.ts for r in result.recoveries if r.generation == 2)
    print(
        f"\nwedge -> verdict {hung.detected_at - wedge['ts']:.2f} s"
        f" (fault_at off by {hung.fault_at - wedge['ts']:+.3f} s, bound {hung.evidence['bound_ms']} ms,"
        f" in COLLECTIVE {hung.evidence['phase_ms']} ms, first peer left {hung.evidence['first_left_ms']} ms before)"
        f"\nwedge -> first step of generation 2 done {first_step_done - wedge['ts']:.2f} s"
    )


def test_rank_hung_inside_the_job_s_first_all_reduce_costs_seconds_not_a_minute(
    stack: LocalStack, corpus: Path, reference: Reference, tmp_path: Path
) -> None:
    """Before any step was timed, the members pass a barrier under the initial bound
    (60 s) and then start the all-reduce together, bounded by its bytes (this small
    model's: the 1 s inside floor, near enough): w1 hung inside it (past the barrier) is
    found after that, not after a minute."""
    import torch

    save, fault_log = tmp_path / "weights.pt", tmp_path / "faults.jsonl"
    result = stack.run_job(
        "e2e-wedge-first",
        train_command(STEPS, corpus, *SMALL_GPT, save=save),
        nproc=3,
        spares=1,
        faults="wedge:w1@collective=1",
        global_batch=12,
        timeout_s=180.0,
        env={"PHALANX_FAULT_LOG": str(fault_log)},
    )
    assert [(f.cause, f.worker) for f in result.faults] == [(FaultCause.COLLECTIVE_HANG, "w1")], result.faults
    [hung] = result.faults
    assert isinstance(hung, RankHung) and hung.generation == 1
    assert hung.evidence["phase"] == "collective" and 1000.0 <= hung.evidence["bound_ms"] < 1100.0, (
        hung.evidence
    )
    assert actions(result) == [Action.START, Action.REPLACE]
    assert result.plans[-1].rank_of("w3") == 1 and result.plans[-1].removed == ["w1"]
    assert_recovered(result, generation=2)
    assert_bitwise_equal(torch.load(save) if save.exists() else None, reference(3))
    [wedge] = [json.loads(line) for line in fault_log.read_text().splitlines()]
    assert (wedge["worker"], wedge["point"], wedge["value"]) == ("w1", "collective", 1)
    first_step_done = max(r.ts for r in result.recoveries if r.generation == 2)
    print(
        f"\nfirst all-reduce hang -> verdict {hung.detected_at - wedge['ts']:.2f} s"
        f" (bound {hung.evidence['bound_ms']} ms, in COLLECTIVE {hung.evidence['phase_ms']} ms)"
        f"\nfirst all-reduce hang -> first step of generation 2 done {first_step_done - wedge['ts']:.2f} s"
    )


@pytest.mark.parametrize("place", ["collective", "rendezvous", "transfer"])
def test_rank_hung_in_a_recovery_collective_is_replaced_within_seconds(
    stack: LocalStack, corpus: Path, reference: Reference, tmp_path: Path, place: str
) -> None:
    import torch

    save, fault_log = tmp_path / "weights.pt", tmp_path / "faults.jsonl"
    result = stack.run_job(
        f"e2e-hang-{place}",
        train_command(STEPS, corpus, *SMALL_GPT, save=save),
        nproc=3,
        spares=2,
        faults=f"kill:w1@step=5,wedge:w2@{place}=2",
        global_batch=12,
        timeout_s=180.0,
        env={"PHALANX_FAULT_LOG": str(fault_log)},
    )
    assert [(f.cause, f.worker) for f in result.faults] == [
        (FaultCause.PROCESS_EXIT, "w1"),
        (FaultCause.COLLECTIVE_HANG, "w2"),
    ], result.faults
    hung = result.faults[1]
    assert isinstance(hung, RankHung) and hung.generation == 2
    assert hung.evidence["phase"] == "collective"
    assert actions(result) == [Action.START, Action.REPLACE, Action.REPLACE]
    second, last = (next(p for p in result.plans if p.generation == g) for g in (2, 3))
    assert second.rank_of("w1") is None and second.world_size == 3, second
    joiner = next(w for w in ("w3", "w4") if second.rank_of(w) is not None)
    assert second.rank_of(joiner) == 1  # each spare takes the lost rank's index
    assert last.generation == 3 and last.rank_of("w2") is None and last.rank_of(joiner) == 1, last
    assert {last.rank_of("w3"), last.rank_of("w4")} == {1, 2}, last
    assert_recovered(result, generation=3)
    assert_bitwise_equal(torch.load(save) if save.exists() else None, reference(3))

    # Timings, reported (not asserted: a 2-core box shared with other tests).
    wedge = next(
        e
        for e in map(json.loads, fault_log.read_text().splitlines())
        if (e["worker"], e["action"]) == ("w2", "wedge")
    )
    assert (wedge["point"], wedge["value"]) == (place, 2)
    first_step_done = max(r.ts for r in result.recoveries if r.generation == 3)
    print(
        f"\n{place} hang -> verdict {hung.detected_at - wedge['ts']:.2f} s"
        f" (bound {hung.evidence['bound_ms']} ms, in COLLECTIVE {hung.evidence['phase_ms']} ms)"
        f"\n{place} hang -> first step of generation 3 done {first_step_done - wedge['ts']:.2f} s"
    )


def test_a_rank_that_took_generation_2_and_never_reaches_it_is_replaced(
    stack: LocalStack, corpus: Path, reference: Reference, tmp_path: Path
) -> None:
    """The Trainer: after w1 is killed in step 5, w2 takes generation 2's plan and stops
    short of its rendezvous (``stall:w2@recovery=2``, heartbeating): a joiner that never
    arrives while its peers wait, judged ``step_stall`` in phase ``recovering``."""
    import torch

    save = tmp_path / "weights.pt"
    result = stack.run_job(
        "e2e-hang-joiner",
        train_command(STEPS, corpus, *SMALL_GPT, save=save),
        nproc=3,
        spares=2,
        faults="kill:w1@step=5,stall:w2@recovery=2",
        global_batch=12,
        timeout_s=180.0,
    )
    assert [(f.cause, f.worker) for f in result.faults] == [
        (FaultCause.PROCESS_EXIT, "w1"),
        (FaultCause.STEP_STALL, "w2"),
    ], result.faults
    hung = result.faults[1]
    assert isinstance(hung, RankHung) and hung.generation == 2 and hung.evidence["phase"] == "recovering"
    assert actions(result) == [Action.START, Action.REPLACE, Action.REPLACE]
    assert_recovered(result, generation=3)
    assert_bitwise_equal(torch.load(save) if save.exists() else None, reference(3))
