"""The user's own loop under Phalanx (phalanx.runtime.loop), end to end: real
processes, real gloo, a real nats-server and the real services.

The port (examples/ddp_phalanx.py, and tests/workers/user_loop_worker.py, which
trains the same way and dumps each rank's end state) keeps its DDP model,
DataLoader, AdamW, one-cycle LR schedule and gradient clipping. Fault-free it
must give the plain torchrun script's weights bit for bit; with faults, its own
fault-free run's, with the joiner's optimizer, scheduler and sampler in step
with the ranks it joined.
"""

from __future__ import annotations

import itertools
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from bench.baseline.torchrun import plain_ddp_args, run_torchrun
from phalanx.contract import Action, FaultCause, RankHung
from phalanx.devstack.jobwatch import JobResult
from phalanx.devstack.localstack import LocalStack
from tests.e2e.test_recovery import actions, assert_bitwise_equal, assert_recovered

pytestmark = pytest.mark.slow

STEPS = 12
# 3 ranks: 11 steps an epoch, so one epoch boundary; dropout, so every rank's RNG
# stream must be where the plain script's is, step after step, also on a joiner.
SIZE = ["--batch-size", "16", "--samples", "512", "--dropout", "0.1"]
WORKER = [sys.executable, "-m", "tests.workers.user_loop_worker", *SIZE]

Run = Callable[..., tuple[JobResult, dict[str, torch.Tensor] | None, dict[str, dict[str, Any]]]]


@pytest.fixture(scope="module")
def run(stack: LocalStack, tmp_path_factory: pytest.TempPathFactory) -> Run:
    out = tmp_path_factory.mktemp("userloop")
    counter = itertools.count()

    def go(
        *,
        nproc: int = 3,
        spares: int = 0,
        faults: str = "",
        extra: tuple[str, ...] = (),
        cmd: list[str] | None = None,
    ) -> tuple[JobResult, dict[str, torch.Tensor] | None, dict[str, dict[str, Any]]]:
        job = f"ul{next(counter)}"
        save, dump = out / f"{job}.pt", out / job
        dump.mkdir()
        base = cmd or [*WORKER, "--dump", str(dump)]
        full = [*base, "--steps", str(STEPS), "--save", str(save), *extra]
        result = stack.run_job(
            job, full, nproc=nproc, spares=spares, faults=faults, global_batch=16 * nproc, timeout_s=180
        )
        weights = torch.load(save) if save.exists() else None
        dumps = {p.stem: torch.load(p, weights_only=False) for p in dump.glob("*.pt")}
        return result, weights, dumps

    return go


@pytest.fixture(scope="module")
def reference(run: Run) -> dict[str, torch.Tensor]:
    result, weights, _ = run()
    assert result.returncode == 0, result.decisions
    assert weights is not None
    return weights


def test_port_matches_plain_torchrun_bitwise(
    run: Run, reference: dict[str, torch.Tensor], tmp_path: Path
) -> None:
    plain = tmp_path / "plain.pt"
    run_torchrun(3, "examples.ddp_plain", plain_ddp_args(STEPS, *SIZE, save=plain), output=tmp_path / "out")
    port, weights, _ = run(cmd=[sys.executable, "-m", "examples.ddp_phalanx", *SIZE])
    assert port.returncode == 0, port.decisions
    assert_bitwise_equal(weights, torch.load(plain))
    assert_bitwise_equal(reference, torch.load(plain))  # the test worker trains as the port does


def assert_joiner_in_step(dumps: dict[str, dict[str, Any]], joiners: list[str]) -> None:
    """Every member ends with the same weights, optimizer, scheduler and sampler state."""
    members = sorted(dumps, key=lambda w: dumps[w]["rank"])
    assert set(joiners) <= set(members), members
    first = dumps[members[0]]
    for w in members[1:]:
        d = dumps[w]
        assert d["steps"] == first["steps"] == STEPS
        assert_bitwise_equal(d["model"], first["model"])
        assert d["scheduler"] == first["scheduler"], w
        assert d["sampler"] == first["sampler"], w
        mine, theirs = d["optimizer"]["state"], first["optimizer"]["state"]
        assert mine.keys() == theirs.keys()
        for k in mine:
            assert all(torch.equal(mine[k][n], theirs[k][n]) for n in mine[k]), (w, k)


def test_sigkill(run: Run, reference: dict[str, torch.Tensor]) -> None:
    result, weights, dumps = run(spares=1, faults="kill:w1@step=5")
    assert actions(result) == [Action.START, Action.REPLACE]
    assert [f.cause for f in result.faults] == [FaultCause.PROCESS_EXIT]
    assert_recovered(result, generation=2)
    assert next(r for r in result.recoveries if r.worker == "w3").step == 6  # step 5 redone
    assert_bitwise_equal(weights, reference)
    assert_joiner_in_step(dumps, ["w3"])  # the scheduler's and the sampler's state moved


def test_sigstop(run: Run, reference: dict[str, torch.Tensor]) -> None:
    result, weights, dumps = run(spares=1, faults="stop:w1@step=4")
    assert [f.cause for f in result.faults if isinstance(f, RankHung)] == [FaultCause.HEARTBEAT_LOST]
    assert actions(result) == [Action.START, Action.REPLACE]
    assert_recovered(result, generation=2)
    assert_bitwise_equal(weights, reference)
    assert_joiner_in_step(dumps, ["w3"])


@pytest.mark.parametrize(
    "hang",
    ["wedge:w2@collective=2", "wedge:w3@rendezvous=2,wedge:w4@rendezvous=2"],
    ids=["first_allreduce", "spare_rendezvous"],
)
def test_a_rank_hung_joining_a_new_generation_is_replaced(
    run: Run, reference: dict[str, torch.Tensor], hang: str
) -> None:
    # w1 dies in step 3; in generation 2, a survivor hangs inside its first gradient
    # all-reduce, or the spare that joins hangs inside its first rendezvous: the
    # others' bounds fire and the hung one is replaced by the other spare
    result, weights, _ = run(spares=2, faults=f"kill:w1@step=3,{hang}")
    assert [f.cause for f in result.faults] == [FaultCause.PROCESS_EXIT, FaultCause.COLLECTIVE_HANG]
    assert actions(result) == [Action.START, Action.REPLACE, Action.REPLACE]
    assert_recovered(result, generation=3)
    assert_bitwise_equal(weights, reference)


def test_a_rank_hung_inside_the_job_s_first_all_reduce_costs_seconds_not_a_minute(
    run: Run, reference: dict[str, torch.Tensor]
) -> None:
    """Before any step was timed, every member passes a barrier (under the initial
    minute) in its first bucket's hook, and the step's all-reduces are bounded by the
    gradients' bytes from there (a small model's: the 1 s inside floor, near enough): w2
    hung inside the first one is found after that, not after the minute."""
    result, weights, _ = run(spares=1, faults="wedge:w2@collective=1")
    [hung] = result.faults
    assert isinstance(hung, RankHung) and hung.cause is FaultCause.COLLECTIVE_HANG, result.faults
    assert hung.worker == "w2" and hung.generation == 1
    assert 1000.0 <= hung.evidence["bound_ms"] < 1100.0, hung.evidence
    assert actions(result) == [Action.START, Action.REPLACE]
    assert_recovered(result, generation=2)
    assert_bitwise_equal(weights, reference)
    print(f"\nhung in the job's first all-reduce: {hung.evidence}")


@pytest.mark.parametrize(
    ("faults", "stuck", "generation"),
    [("stall:w1@recovery=1", "w1", 1), ("kill:w1@step=3,stall:w2@recovery=2", "w2", 2)],
    ids=["job_start", "new_generation"],
)
def test_a_rank_that_took_its_generation_and_never_reaches_it_is_replaced(
    run: Run, reference: dict[str, torch.Tensor], faults: str, stuck: str, generation: int
) -> None:
    """The stuck rank took the plan (it reports the generation, RECOVERING) and stops
    short of its rendezvous, heartbeating, while its peers wait there: judged by the
    joiner rule in seconds, where its peers re-formed with it until the job stopped."""
    result, weights, _ = run(spares=2, faults=faults)
    hung = result.faults[-1]
    assert isinstance(hung, RankHung) and hung.cause is FaultCause.STEP_STALL, result.faults
    assert (hung.worker, hung.generation, hung.evidence["phase"]) == (stuck, generation, "recovering")
    assert actions(result)[-1] is Action.REPLACE
    assert_recovered(result, generation=generation + 1)
    assert_bitwise_equal(weights, reference)
    print(f"\nstuck short of generation {generation}: {hung.evidence}")


PORT = [sys.executable, "-m", "examples.ddp_phalanx", *SIZE]
# rank 0 evaluates 3 s every 4 steps while the others wait: past the straggler
# floor (1.5 s) and the gradient all-reduce's (2 s) each time
EVAL = ("--eval-every", "4", "--eval-s", "3")


def test_a_declared_evaluation_pause_on_rank_0_is_no_fault(
    run: Run, reference: dict[str, torch.Tensor]
) -> None:
    result, weights, _ = run(cmd=PORT, extra=EVAL)
    assert result.returncode == 0, result.decisions
    assert result.faults == [] and actions(result) == [Action.START], result.decisions
    assert_bitwise_equal(weights, reference)  # evaluation draws no random numbers


def test_a_rank_lost_while_rank_0_evaluates_is_replaced_after_the_pause(
    run: Run, reference: dict[str, torch.Tensor]
) -> None:
    # w1 dies entering the pause of step 3; w2 waits in it and rank 0 evaluates: the
    # plan releases w2 at once and rank 0 when its evaluation ends; step 3 stands
    result, weights, _ = run(cmd=PORT, extra=EVAL, spares=1, faults="kill:w1@pause=3")
    assert [f.cause for f in result.faults] == [FaultCause.PROCESS_EXIT]
    assert actions(result) == [Action.START, Action.REPLACE]
    assert_recovered(result, generation=2)
    assert next(r for r in result.recoveries if r.worker == "w3").step == 5  # nothing redone
    assert_bitwise_equal(weights, reference)


def test_a_rank_spinning_in_the_first_step_is_found_by_its_waiting_peers(
    run: Run, reference: dict[str, torch.Tensor]
) -> None:
    """A busy loop before any step completed: its peers wait in the gradient all-reduce,
    so it is the straggler, judged by their pace (4x their time to reach the collective),
    replaced, and the run stays bitwise. Where the first step is slow (this box under the
    whole suite: peers 2.5 s to their first collective) that bound can pass the stall
    floor of these tests (10 s; 60 s by default), which then judges first: either way
    the spinning rank is found within the floor."""
    result, weights, _ = run(spares=1, faults="spin:w1@step=0")
    [hung] = [f for f in result.faults if isinstance(f, RankHung)]
    assert hung.cause is FaultCause.STEP_STALL and hung.worker == "w1"
    assert hung.evidence["bound_ms"] <= 10_000, hung.evidence
    rule = "straggler" if hung.evidence.get("peers_waiting_count", 0) >= 1 else "stall floor"
    print(f"\nspinning w1 judged by the {rule} rule: {hung.evidence}")
    assert actions(result) == [Action.START, Action.REPLACE]
    assert_recovered(result, generation=2)
    assert_bitwise_equal(weights, reference)


def test_kill_during_recovery(run: Run, reference: dict[str, torch.Tensor]) -> None:
    result, weights, dumps = run(spares=2, faults="kill:w1@step=5,kill:w2@recovery=2")
    assert actions(result) == [Action.START, Action.REPLACE, Action.REPLACE]
    assert result.plans[-1].generation == 3
    assert_recovered(result, generation=3)
    assert_bitwise_equal(weights, reference)
    assert_joiner_in_step(dumps, ["w3", "w4"])


def test_two_kills_at_once(run: Run, reference: dict[str, torch.Tensor]) -> None:
    result, weights, dumps = run(spares=2, faults="kill:w0@step=7,kill:w2@step=7")
    assert sorted(f.worker for f in result.faults) == ["w0", "w2"]
    assert {m.worker for m in result.plans[-1].members} == {"w1", "w3", "w4"}
    assert_recovered(result, generation=result.plans[-1].generation)
    assert_bitwise_equal(weights, reference)
    assert_joiner_in_step(dumps, ["w3", "w4"])


@pytest.mark.parametrize("step", [0, 1], ids=["first-step", "second-step"])
def test_fault_in_the_first_steps(run: Run, reference: dict[str, torch.Tensor], step: int) -> None:
    # DDP rebuilds its buckets after the first iteration: the joiner must use
    # the bucket layout its peers use, before and after the rebuild.
    result, weights, dumps = run(spares=1, faults=f"kill:w1@step={step}")
    assert_recovered(result, generation=2)
    assert_bitwise_equal(weights, reference)
    assert_joiner_in_step(dumps, ["w3"])


def test_script_that_registers_nothing_recovers_model_and_optimizer(
    run: Run, reference: dict[str, torch.Tensor]
) -> None:
    result, weights, dumps = run(spares=1, faults="kill:w2@step=6", extra=("--no-track",))
    assert_recovered(result, generation=2)
    assert_bitwise_equal(weights, reference)
    assert_joiner_in_step(dumps, ["w3"])


def test_broken_communicator_with_every_rank_alive_reforms(
    run: Run, reference: dict[str, torch.Tensor]
) -> None:
    result, weights, _ = run(faults="break:w1@step=5")
    assert result.returncode == 0, result.decisions
    assert Action.REFORM in actions(result)
    assert_bitwise_equal(weights, reference)


def test_a_rank_that_raises_in_the_first_sync_stops_the_job(run: Run) -> None:
    # Rank 0 is the first sync's source; its exception must end the job with a
    # decision, not leave the others waiting (its exit is no clean leave).
    result, weights, _ = run(extra=("--fail-sync", "w0"))
    assert result.returncode == 1
    stop = [d for d in result.decisions if d.action is Action.STOP]
    assert len(stop) == 1 and "w0" in stop[0].reason, result.decisions
    assert weights is None


# job.steps(..., accumulate=True): 2 micro-batches of 8 per rank and step hold the
# global batch of 48 (16 x 3 ranks) that the tests above train in one batch of 16.
ACCUM = ("--accumulate", "--batch-size", "8")


@pytest.fixture(scope="module")
def accumulated(run: Run) -> dict[str, torch.Tensor]:
    result, weights, _ = run(extra=ACCUM)
    assert result.returncode == 0, result.decisions
    assert weights is not None
    return weights


def test_micro_batches_train_as_the_one_batch_they_hold(run: Run) -> None:
    # The same samples per step, the mean over them in another order of sums (without
    # dropout: its masks are drawn per forward; SGD: linear in the gradient; epochs of
    # whole global batches: an epoch's short last micro-batch would weigh as a whole one).
    plain = ("--dropout", "0", "--sgd", "--samples", "480")
    one, one_weights, _ = run(extra=plain)
    micro, micro_weights, _ = run(extra=(*ACCUM, *plain))
    assert one.returncode == micro.returncode == 0, (one.decisions, micro.decisions)
    assert one_weights is not None and micro_weights is not None
    for name, want in one_weights.items():
        # absolute error of the tensor's scale: rounding follows the terms summed (test_elastic)
        scale = float(want.abs().max())
        torch.testing.assert_close(micro_weights[name], want, rtol=1e-5, atol=1e-5 * scale)


def test_a_kill_inside_an_accumulation_step_redoes_it_as_a_unit(
    run: Run, accumulated: dict[str, torch.Tensor], tmp_path: Path
) -> None:
    # w1 dies in step 5's last micro-batch (its first bucket's all-reduce), after the
    # first one's backward ran under no_sync: every member redoes both micro-batches.
    result, weights, dumps = run(
        spares=1, faults="kill:w1@step=5", extra=(*ACCUM, "--rank-log", str(tmp_path))
    )
    assert actions(result) == [Action.START, Action.REPLACE]
    assert_recovered(result, generation=2)
    assert next(r for r in result.recoveries if r.worker == "w3").step == 6  # step 5 redone
    assert_bitwise_equal(weights, accumulated)
    assert_joiner_in_step(dumps, ["w3"])
    # job.step_ok: a survivor logged the failed attempt of step 5 not at all, its redo once
    for worker in ("w0", "w2"):
        lines = [json.loads(x) for x in (tmp_path / f"{worker}.jsonl").read_text().splitlines()]
        assert [x["step"] for x in lines] == list(range(1, STEPS + 1)), worker
        assert all(x["batch"] == 48 and x["lr_scale"] == 1.0 for x in lines)
        assert {x["samples"] for x in lines} == {16, 11}  # 2 x 8, and the epoch's short step
