"""A ``job.steps`` script with tiered checkpoints, killed whole and relaunched: the DDP
port (examples/ddp_phalanx.py, ``--checkpoint-every``: ``job.checkpoint(every=N)``) as
a two-node job on the namespace cluster, a keeper per node, every process of both
nodes SIGKILLed (keepers too) once a checkpoint has landed, then the same command
again. The relaunch resumes from the newest complete checkpoint -- the first step it
trains is that checkpoint's + 1 -- and trains every later step, and ends, bitwise as an
uninterrupted run of the same command: the checkpoint held the weights, the optimizer,
the LR schedule, the sampler's position and the RNG state (the port trains with dropout)
exactly as the loop had them.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from phalanx.checkpoint import Checkpointer
from phalanx.devstack.jobwatch import last_logged_step
from phalanx.devstack.localstack import LocalStack
from tests.e2e.conftest import netns_cluster, stack_env
from tests.e2e.test_recovery import assert_bitwise_equal

pytestmark = pytest.mark.slow

STEPS, EVERY = 40, 4
# 3 ranks of 16 samples and 512 samples: an epoch ends every 11 steps, so the resumed
# run crosses an epoch boundary from a restored sampler; dropout draws from the RNG.
SIZE = ["--batch-size", "16", "--samples", "512", "--dropout", "0.1"]
NODES = {"a": (2, 0), "b": (1, 0)}  # (ranks, spares): 3 ranks, so the saver rotates over 2 nodes


def port(log: Path, save: Path) -> list[str]:
    return [
        sys.executable,
        "-m",
        "examples.ddp_phalanx",
        *SIZE,
        "--steps",
        str(STEPS),
        "--checkpoint-every",
        str(EVERY),
        "--steps-log",
        str(log),
        "--save",
        str(save),
    ]


def losses(lines: list[str]) -> dict[int, float]:
    """Rank 0's logged loss by step done (the first trained step after checkpoint C is C + 1)."""
    return {int(s["step"]): s["loss"] for s in (json.loads(line) for line in lines if line.strip())}


def test_a_user_loop_killed_whole_and_relaunched_resumes_bitwise_from_its_newest_checkpoint(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    work = tmp_path_factory.mktemp("resume")
    tiers = {"PHALANX_CKPT_DISK": str(work / "disk")}
    nodes = list(NODES)
    with (
        netns_cluster(["ctl", *nodes]) as cl,
        LocalStack(
            work / "stack",
            cluster=cl,
            services=("failure-detector", "elasticity-planner"),
            # every node dies at once: no holding the verdict back for a mass silence
            env={**stack_env(tmp_path_factory), "PHALANX_DETECTOR_MASS_HOLD_S": "0"},
        ) as stack,
    ):
        for node in nodes:
            stack.start_keeper(node, tiers)
        gb = 16 * sum(ranks for ranks, _ in NODES.values())

        # The uninterrupted run of the same command (checkpointing too, as a job of its own).
        ref_log, ref_out = work / "reference.jsonl", work / "reference.pt"
        ref = stack.run_nodes("ur", port(ref_log, ref_out), nodes=NODES, global_batch=gb)
        assert ref.returncode == 0, ref
        reference, ref_losses = torch.load(ref_out), losses(ref_log.read_text().splitlines())
        assert sorted(ref_losses) == list(range(1, STEPS + 1))
        saved = Checkpointer("ur", node="a", root=stack.shm_root).list()
        assert {i.step for i in saved} <= set(range(EVERY, STEPS + 1, EVERY)) and saved
        assert {i.origin for i in saved} == set(nodes), "every EVERY steps another member saves"

        # Killed whole once a checkpoint past the first epoch boundary has landed, and
        # the loop has trained beyond it.
        log, out = work / "steps.jsonl", work / "relaunched.pt"
        cmd = port(log, out)
        lister = Checkpointer("rl", node="a", root=stack.shm_root)

        def landed() -> int:
            return max((i.step for i in lister.list()), default=0)

        def kill_now(_: object) -> bool:
            newest = landed()
            return newest >= 20 and last_logged_step(log) > newest

        first = stack.run_nodes(
            "rl",
            cmd,
            nodes=NODES,
            global_batch=gb,
            steps_log=log,
            actions=[(kill_now, lambda r: [cl.kill_node(n) for n in nodes])],
        )
        assert not out.exists(), f"the first run must not have finished: {first}"
        assert stack.wait_ended("rl").action.value == "stop"  # its nodes were declared lost
        before = log.read_text().splitlines()
        trained = losses(before)
        assert max(trained) < STEPS
        assert all(trained[k] == ref_losses[k] for k in trained)  # the same run up to the kill

        # The nodes come back with their keepers, which re-adopt what they held.
        for node in nodes:
            stack.start_keeper(node, tiers)
        newest = Checkpointer("rl", node="a", root=stack.shm_root).latest()
        assert newest is not None and newest.step >= 20 and newest.step % EVERY == 0, first

        # Relaunched: no member holds state, so rank 0 loads the newest checkpoint and
        # sends it to the others (the Session's recovery of last resort).
        second = stack.run_nodes("rl", cmd, nodes=NODES, global_batch=gb)
        assert second.returncode == 0, second
        again = losses(log.read_text().splitlines()[len(before) :])
        assert min(again) == newest.step + 1, (newest.step, sorted(again))  # not from step 0
        assert sorted(again) == list(range(newest.step + 1, STEPS + 1))
        assert again == {k: ref_losses[k] for k in again}  # step by step, bitwise
        assert_bitwise_equal(torch.load(out), reference)

        # One member loaded it (rank 0, through its node's keeper); the others received it.
        restored = [
            json.loads(line)
            for path in (stack.workdir / "logs" / "rl").rglob("*.log")
            for line in path.read_text(errors="replace").splitlines()
            if line.startswith("{") and '"restored_from_checkpoint"' in line
        ]
        assert [r["step"] for r in restored] == [newest.step], restored
