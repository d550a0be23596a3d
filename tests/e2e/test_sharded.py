"""FSDP2 HSDP under Phalanx, end to end: real processes, gloo, a real
nats-server and the real services, a (2, 2) mesh (examples/fsdp_plain.py and its
port examples/fsdp_phalanx.py).

Fault-free, the port gives the plain torchrun FSDP2 script's weights bit for bit
(same mesh). With faults it gives its own fault-free run's, and each joiner
receives one shard's state from the member holding the same shard in the other
replica group: the bytes it reports are within 10 % of that shard's parameters
and AdamW moments, half of the model's.
"""

from __future__ import annotations

import itertools
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from bench.baseline.torchrun import plain_ddp_args, run_torchrun
from examples.mlp import MLP
from phalanx.contract import Action, Elastic, FaultCause, RankHung
from phalanx.devstack.jobwatch import JobResult
from phalanx.devstack.localstack import LocalStack
from tests.e2e.test_recovery import actions, assert_bitwise_equal, assert_recovered

pytestmark = pytest.mark.slow

STEPS = 10
SIZE = ["--batch-size", "16", "--samples", "512", "--hidden", "256", "--depth", "3", "--replicas", "2"]
ELASTIC = Elastic(group_size=2)
PORT = [sys.executable, "-m", "examples.fsdp_phalanx", *SIZE]
NPROC, SHARDS = 4, 2

Run = Callable[..., tuple[JobResult, dict[str, torch.Tensor] | None]]


def shard_state_bytes() -> int:
    """One shard's parameters and AdamW moments: a half of each (even) tensor, three times."""
    params = sum(p.numel() for p in MLP(hidden=256, depth=3).parameters())
    return params // SHARDS * 4 * 3


@pytest.fixture(scope="module")
def run(stack: LocalStack, tmp_path_factory: pytest.TempPathFactory) -> Run:
    out = tmp_path_factory.mktemp("sharded")
    counter = itertools.count()

    def go(*, spares: int = 0, faults: str = "") -> tuple[JobResult, dict[str, torch.Tensor] | None]:
        job = f"sh{next(counter)}"
        save = out / f"{job}.pt"
        result = stack.run_job(
            job,
            [*PORT, "--steps", str(STEPS), "--save", str(save)],
            nproc=NPROC,
            spares=spares,
            faults=faults,
            global_batch=16 * NPROC,
            timeout_s=180,
            elastic=ELASTIC,
        )
        return result, (torch.load(save) if save.exists() else None)

    return go


@pytest.fixture(scope="module")
def reference(run: Run) -> dict[str, torch.Tensor]:
    result, weights = run()
    assert result.returncode == 0, result.decisions
    assert weights is not None
    return weights


def test_port_matches_plain_torchrun_fsdp2_bitwise(
    reference: dict[str, torch.Tensor], tmp_path: Path
) -> None:
    plain = tmp_path / "plain.pt"
    run_torchrun(
        NPROC, "examples.fsdp_plain", plain_ddp_args(STEPS, *SIZE, save=plain), output=tmp_path / "out"
    )
    assert_bitwise_equal(reference, torch.load(plain))


def assert_one_shard_moved(result: JobResult, joiners: set[str]) -> None:
    """Each joiner received about one shard's state; no survivor received anything."""
    shard = shard_state_bytes()
    moved = {r.worker: r.bytes_received for r in result.recoveries if r.incident}
    for worker, got in moved.items():
        if worker in joiners:
            assert shard <= got <= 1.1 * shard, (worker, got, shard)
        else:
            assert got == 0, (worker, got)
    assert joiners <= moved.keys(), moved


def test_sigkill_mid_step(run: Run, reference: dict[str, torch.Tensor]) -> None:
    # as step 5's first gradient reduce-scatter starts, peers blocked in it (a kill at
    # the step boundary, step=N, is the next-but-one test's)
    result, weights = run(spares=1, faults="kill:w1@reduce=5")
    assert actions(result) == [Action.START, Action.REPLACE]
    assert [f.cause for f in result.faults] == [FaultCause.PROCESS_EXIT]
    assert_recovered(result, generation=2, nproc=NPROC)
    assert_bitwise_equal(weights, reference)
    assert_one_shard_moved(result, {"w4"})


def test_sigstop(run: Run, reference: dict[str, torch.Tensor]) -> None:
    result, weights = run(spares=1, faults="stop:w2@step=4")
    assert [f.cause for f in result.faults if isinstance(f, RankHung)] == [FaultCause.HEARTBEAT_LOST]
    assert_recovered(result, generation=result.plans[-1].generation, nproc=NPROC)
    assert_bitwise_equal(weights, reference)


def test_a_rank_spinning_while_its_mesh_peers_wait_is_the_straggler(
    run: Run, reference: dict[str, torch.Tensor]
) -> None:
    result, weights = run(spares=1, faults="spin:w2@step=4")
    [hung] = [f for f in result.faults if isinstance(f, RankHung)]
    assert (hung.cause, hung.worker) == (FaultCause.STEP_STALL, "w2")
    assert hung.evidence["peers_waiting_count"] >= 1, hung.evidence
    assert_recovered(result, generation=result.plans[-1].generation, nproc=NPROC)
    assert_bitwise_equal(weights, reference)


@pytest.mark.parametrize(
    "hang",
    ["wedge:w0@collective=2", "wedge:w4@rendezvous=2,wedge:w5@rendezvous=2"],
    ids=["first_allreduce", "spare_rendezvous"],
)
def test_a_rank_hung_joining_a_new_generation_is_replaced(
    run: Run, reference: dict[str, torch.Tensor], hang: str
) -> None:
    # w2 dies in step 3; in generation 2, a survivor hangs inside the first step's
    # first collective, or the spare that joins hangs inside its first rendezvous
    result, weights = run(spares=2, faults=f"kill:w2@step=3,{hang}")
    assert [f.cause for f in result.faults] == [FaultCause.PROCESS_EXIT, FaultCause.COLLECTIVE_HANG]
    assert actions(result) == [Action.START, Action.REPLACE, Action.REPLACE]
    assert_recovered(result, generation=3, nproc=NPROC)
    assert_bitwise_equal(weights, reference)


def test_a_rank_that_took_its_generation_and_never_reaches_it_is_replaced(
    run: Run, reference: dict[str, torch.Tensor]
) -> None:
    # w2 dies in step 3; w3 (the other shard's replica) takes generation 2's plan and
    # stops short of its rendezvous, heartbeating: the joiner rule finds it
    result, weights = run(spares=2, faults="kill:w2@step=3,stall:w3@recovery=2")
    hung = result.faults[-1]
    assert isinstance(hung, RankHung) and (hung.cause, hung.worker) == (FaultCause.STEP_STALL, "w3")
    assert hung.generation == 2 and hung.evidence["phase"] == "recovering", hung.evidence
    assert actions(result) == [Action.START, Action.REPLACE, Action.REPLACE]
    assert_recovered(result, generation=3, nproc=NPROC)
    assert_bitwise_equal(weights, reference)


def test_a_rank_hung_inside_the_job_s_first_collective_costs_seconds_not_a_minute(
    run: Run, reference: dict[str, torch.Tensor]
) -> None:
    # before any step was timed, every member passes a barrier at the forward's first
    # all-gather; past it, w1 hangs inside that all-gather, whose bound is the inside floor
    # plus what the model's bytes take at the slowest rate (1 s, near enough, here)
    result, weights = run(spares=1, faults="wedge:w1@collective=1")
    [hung] = result.faults
    assert isinstance(hung, RankHung) and (hung.cause, hung.worker) == (FaultCause.COLLECTIVE_HANG, "w1")
    assert hung.generation == 1 and 1000.0 <= hung.evidence["bound_ms"] < 1100.0, hung.evidence
    assert actions(result) == [Action.START, Action.REPLACE]
    assert_recovered(result, generation=2, nproc=NPROC)
    assert_bitwise_equal(weights, reference)


def test_every_replica_of_a_shard_lost_without_a_checkpoint_stops_naming_the_shard(run: Run) -> None:
    # w1 and w3 hold shard 1 in replica groups 0 and 1; two spares join, but no member
    # holds shard 1 and no checkpoint was configured: the stop says that, not the sizes
    result, weights = run(spares=2, faults="kill:w1@step=6,kill:w3@step=6")
    [stop] = [d for d in result.decisions if d.action is Action.STOP]
    assert "every replica of shard (1,) was lost" in stop.reason, stop.reason
    assert "job.checkpoint(every=N)" in stop.reason and "min_world_size" not in stop.reason, stop.reason
    assert result.returncode != 0 and weights is None


def test_two_ranks_of_different_shards_killed_at_once(run: Run, reference: dict[str, torch.Tensor]) -> None:
    # at the step boundary (step=6: as the forward's first all-gather starts, before
    # anything of step 6 was exchanged); w0 holds shard 0 of replica group 0, w3
    # shard 1 of group 1: each joiner is served by a different peer (w2 and w1)
    result, weights = run(spares=2, faults="kill:w0@step=6,kill:w3@step=6")
    assert sorted(f.worker for f in result.faults) == ["w0", "w3"]
    assert_recovered(result, generation=result.plans[-1].generation, nproc=NPROC)
    assert_bitwise_equal(weights, reference)
    assert_one_shard_moved(result, {"w4", "w5"})


def test_kill_during_recovery(run: Run, reference: dict[str, torch.Tensor]) -> None:
    result, weights = run(spares=2, faults="kill:w1@step=5,kill:w2@recovery=2")
    assert result.plans[-1].generation == 3
    assert_recovered(result, generation=3, nproc=NPROC)
    assert_bitwise_equal(weights, reference)


# Plain FSDP: one replica group of two shards, so a lost rank's shard has no other copy.
PLAIN_FSDP = [sys.executable, "-m", "examples.fsdp_phalanx", *SIZE[:-1], "1", "--checkpoint-every", "4"]


def checkpointed_model(stack: LocalStack, job: str, step: int) -> dict[str, torch.Tensor]:
    """The model of checkpoint ``job@step``, read in this process through the keeper
    (full tensors: DCP puts the shards together)."""
    import torch.distributed.checkpoint as dcp

    from phalanx.checkpoint import Checkpointer
    from phalanx.checkpoint.dcp import TieredReader

    state = {"model": MLP(hidden=256, depth=3).state_dict()}
    reader = TieredReader(job, step, checkpointer=Checkpointer(job, node="local", root=stack.shm_root))
    dcp.load(state, storage_reader=reader, no_dist=True)
    return state["model"]


def test_every_replica_of_a_shard_lost_resumes_from_the_newest_tiered_checkpoint(
    stack: LocalStack, tmp_path: Path
) -> None:
    keeper = stack.start_keeper("local")  # the node's state-replication: the checkpoints' keeper
    try:

        def go(job: str, faults: str = "") -> tuple[JobResult, dict[str, torch.Tensor]]:
            save = tmp_path / f"{job}.pt"
            result = stack.run_job(
                job,
                [*PLAIN_FSDP, "--steps", str(STEPS), "--save", str(save)],
                nproc=2,
                spares=1,
                faults=faults,
                global_batch=32,
                timeout_s=180,
                elastic=ELASTIC,
            )
            assert result.returncode == 0, (result.decisions, result.faults)
            return result, torch.load(save)

        _, fixed = go("shck-fixed")
        # w1 dies in step 7: its shard is gone with it; checkpoint 4 is the newest
        result, weights = go("shck", faults="kill:w1@reduce=7")
        assert actions(result) == [Action.START, Action.REPLACE]
        resumed = {r.worker: (r.step, r.bytes_received) for r in result.recoveries if r.incident}
        # both from the checkpoint (at step 4: a recovery is reported as its first step, the
        # fifth, commits), nothing from a peer
        assert resumed == {"w0": (5, 0), "w2": (5, 0)}, resumed
        assert_bitwise_equal(weights, fixed)  # ... and on from there, as the fault-free run
        # the checkpoints themselves: the fault-free run's, before and after the resume
        for step in (4, 8):
            assert_bitwise_equal(
                checkpointed_model(stack, "shck", step), checkpointed_model(stack, "shck-fixed", step)
            )
    finally:
        stack.procs[keeper].kill()
        stack.procs[keeper].wait()
