"""Unmodified torchrun scripts under ``phalanx run``: torchrun's contract, restarts.

examples/ddp_torchrun.py never imports Phalanx (DistributedSampler, DDP, its own
``torch.save`` checkpoint every 10 steps, resumed on start). It runs unchanged under
``phalanx run`` (the public CLI, against a real nats-server, detector and planner)
and under torchrun; faults are real SIGKILLs from outside, at a step read from the
script's own event log. Every run that finishes must end with weights bitwise equal
to torchrun's fault-free run: resuming from the same checkpoint at the same world
size is the same computation, whoever restarts it.
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from bench.baseline.torchrun import torchrun_command, torchrun_env
from phalanx.contract import Action, FaultCause
from phalanx.devstack.jobwatch import JobResult
from phalanx.devstack.localstack import LocalStack
from tests.e2e.test_recovery import actions, assert_bitwise_equal

STEPS = 40
SCRIPT = ["-m", "examples.ddp_torchrun", "--hidden", "64", "--depth", "2", "--ckpt-every", "10"]


def script_args(out: Path, name: str, steps: int = STEPS) -> tuple[list[str], Path, Path]:
    """The script's arguments for run ``name``: (args, its event log, its final weights)."""
    events, save = out / f"{name}.events", out / f"{name}.pt"
    args = [*SCRIPT, "--steps", str(steps), "--ckpt", str(out / f"{name}.ckpt"), "--save", str(save)]
    return [*args, "--events", str(events)], events, save


def read_events(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip().endswith("}")]


def rank_pid(events: Path, rank: int) -> int:
    """The pid of the newest process that started as ``rank``."""
    return [e for e in read_events(events) if e["event"] == "start" and e["rank"] == rank][-1]["pid"]


def kill_rank(events: Path, rank: int, sig: int = signal.SIGKILL) -> Callable[[Any], None]:
    return lambda _: os.kill(rank_pid(events, rank), sig)


def torchrun(
    out: Path, name: str, *, nproc: int, max_restarts: int = 0, kill_at: int | None = None
) -> tuple[int, Path, Path]:
    """Run the script under torchrun (SIGKILL rank 1 once step ``kill_at`` is logged):
    (torchrun's exit code, event log, weights). torchrun's own output goes to
    ``<out>/<name>.torchrun.log``; its tail is printed when it fails (pytest shows it)."""
    args, events, save = script_args(out, name)
    log = out / f"{name}.torchrun.log"
    with open(log, "wb") as sink:
        proc = subprocess.Popen(
            torchrun_command(nproc, args, max_restarts=max_restarts),
            env=torchrun_env(),
            stdout=sink,
            stderr=subprocess.STDOUT,
        )
    try:
        deadline = time.monotonic() + 240
        while proc.poll() is None:
            if (
                kill_at is not None
                and max((e.get("step", 0) for e in read_events(events)), default=0) >= kill_at
            ):
                os.kill(rank_pid(events, 1), signal.SIGKILL)
                kill_at = None
            assert time.monotonic() < deadline, "torchrun did not end"
            time.sleep(0.02)
    finally:
        if proc.poll() is None:
            proc.kill()
    rc = proc.wait()
    if rc != 0:
        print(f"torchrun {name} exited {rc}; the end of {log}:\n{log.read_text(errors='replace')[-4000:]}")
    return rc, events, save


def torchrun_restarted(out: Path, name: str, *, nproc: int, kill_at: int) -> Path:
    """torchrun's weights after its own restart (``--max-restarts 1``, rank 1 SIGKILLed
    once step ``kill_at`` is logged). torchrun is the reference here, not what is tested:
    under load its restarted worker has aborted now and then ("terminate called without
    an active exception", exit -6, in clean-clone CI runs), so a failed run is printed and
    run once more under a name of its own (a fresh event log)."""
    for attempt in range(2):
        rc, _, save = torchrun(out, f"{name}-{attempt}", nproc=nproc, max_restarts=1, kill_at=kill_at)
        if rc == 0:
            return save
    raise AssertionError(f"torchrun's restart failed twice ({name}; its logs are printed above)")


@pytest.fixture(scope="module")
def out(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("unmodified")


@pytest.fixture(scope="module")
def torchrun_reference(out: Path) -> dict[str, torch.Tensor]:
    rc, _, save = torchrun(out, "torchrun-ref", nproc=2)
    assert rc == 0
    return torch.load(save)


def run_phalanx(
    stack: LocalStack,
    out: Path,
    name: str,
    *,
    layout: dict[str, tuple[int, int]] | None = None,
    launcher_args: tuple[str, ...] = (),
    kill_at: int | None = None,
    sig: int = signal.SIGKILL,
    timeout_s: float = 180,
    args: list[str] | None = None,
    env: dict[str, str] | None = None,
    more: list[tuple[int, Callable[[Any], object]]] | None = None,
) -> tuple[JobResult, Path, Path]:
    """The script under ``phalanx run`` on ``stack`` (2 ranks and a spare by default);
    rank 1 gets ``sig`` once step ``kill_at`` is logged; ``more``: other actions, by step."""
    script, events, save = script_args(out, name)
    acts: list[tuple[int, Callable[[Any], object]]] = [*(more or [])]
    if kill_at is not None:
        acts.append((kill_at, kill_rank(events, 1, sig)))
    result = stack.run_nodes(
        name,
        [sys.executable, *(args or script)],
        nodes=layout or {"local": (2, 1)},
        steps_log=events,
        actions=acts,
        launcher_args=launcher_args,
        global_batch=64,
        timeout_s=timeout_s,
        env=env,
    )
    return result, events, save


def environs_holding(marker: bytes) -> dict[int, bool]:
    """Every process of this machine with a Phalanx worker's environment (a rank, a
    spare, the fork server): pid -> whether its ``/proc/<pid>/environ`` holds ``marker``."""
    out: dict[int, bool] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            environ = (entry / "environ").read_bytes()
        except OSError:
            continue  # gone meanwhile
        if b"PHALANX_WORKER=" in environ:
            out[int(entry.name)] = marker in environ
    return out


def test_unmodified_script_gets_torchrun_env_and_ends_bitwise_as_torchrun(
    stack: LocalStack, out: Path, torchrun_reference: dict[str, torch.Tensor]
) -> None:
    # The operator's shell exported the keeper key (and a key file): the launcher has
    # both, no worker process may (a rank holding it could fetch any job's checkpoint).
    key = secrets.token_hex(32)
    seen: list[dict[int, bool]] = []
    result, events, save = run_phalanx(
        stack,
        out,
        "plain",
        env={"PHALANX_KEEPER_KEY": key, "PHALANX_KEEPER_KEY_FILE": f"/nonexistent/{key}"},
        more=[(5, lambda _: seen.append(environs_holding(key.encode())))],
    )
    assert result.returncode == 0, result.node_returncodes
    assert seen and len(seen[0]) >= 3, seen  # two ranks, a spare, the fork server
    assert not any(seen[0].values()), seen
    starts = [e for e in read_events(events) if e["event"] == "start"]
    assert sorted(e["rank"] for e in starts) == [0, 1] and all(e["world"] == 2 for e in starts)
    assert_bitwise_equal(torch.load(save), torchrun_reference)


def test_rank_killed_restarts_every_member_from_the_scripts_checkpoint(
    stack: LocalStack, out: Path, torchrun_reference: dict[str, torch.Tensor]
) -> None:
    result, events, save = run_phalanx(stack, out, "rank-kill", kill_at=14)
    assert result.returncode == 0, result.node_returncodes
    # the node still has the slot: the same members restart in place, no spare spent
    assert actions(result) == [Action.START, Action.REFORM], [d.reason for d in result.decisions]
    again = [e for e in read_events(events) if e["event"] == "start" and e["attempt"] == 1]
    assert sorted(e["rank"] for e in again) == [0, 1], "every member restarts, as under torchrun"
    assert {e["resume"] for e in again} == {10}, "from the script's own checkpoint"
    same_fault = torchrun_restarted(out, "torchrun-kill", nproc=2, kill_at=14)
    assert_bitwise_equal(torch.load(same_fault), torchrun_reference)
    assert_bitwise_equal(torch.load(save), torchrun_reference)


def test_a_stopped_rank_is_found_by_its_silence_and_the_job_restarts_from_the_checkpoint(
    stack: LocalStack, out: Path, torchrun_reference: dict[str, torch.Tensor]
) -> None:
    # torchrun never notices a SIGSTOPped rank (its peers wait for the script's own
    # process-group timeout); here its heartbeats stop, the detector's verdict fences
    # it, and every member restarts from the script's step-10 checkpoint, as the
    # SIGKILL test's torchrun run does: the same computation, so torchrun's weights
    result, events, save = run_phalanx(stack, out, "rank-stop", kill_at=14, sig=signal.SIGSTOP)
    assert result.returncode == 0, result.node_returncodes
    assert [(f.cause, f.worker) for f in result.faults] == [(FaultCause.HEARTBEAT_LOST, "w1")]
    again = [e for e in read_events(events) if e["event"] == "start" and e["attempt"] == 1]
    assert sorted(e["rank"] for e in again) == [0, 1] and {e["resume"] for e in again} == {10}
    assert_bitwise_equal(torch.load(save), torchrun_reference)
    stopped = result.actions_at[0]
    first = min(e["ts"] for e in read_events(events) if e["event"] == "step" and e.get("attempt") == 1)
    print(
        f"\nSIGSTOP -> verdict {result.faults[0].detected_at - stopped:.2f} s, -> first step {first - stopped:.2f} s"
    )


def test_a_spinning_rank_its_peers_wait_for_is_judged_and_the_job_restarts_from_the_checkpoint(
    stack: LocalStack, out: Path, torchrun_reference: dict[str, torch.Tensor]
) -> None:
    # w1 spins in Python as step 14 starts its gradient all-reduce, its process running
    # and heartbeating; w0 waits in that all-reduce. The observed default group says
    # so (w0 COLLECTIVE, w1 standing still: COMPUTE), and the straggler rule judges w1.
    result, events, save = run_phalanx(stack, out, "rank-spin", env={"PHALANX_FAULTS": "spin:w1@step=14"})
    assert result.returncode == 0, result.node_returncodes
    assert [(f.cause, f.worker) for f in result.faults] == [(FaultCause.STEP_STALL, "w1")], result.faults
    assert result.faults[0].evidence.get("peers_waiting") == "w0", result.faults[0].evidence
    again = [e for e in read_events(events) if e["event"] == "start" and e["attempt"] == 1]
    assert sorted(e["rank"] for e in again) == [0, 1] and {e["resume"] for e in again} == {10}
    assert_bitwise_equal(torch.load(save), torchrun_reference)


def test_a_rank_hung_inside_the_jobs_first_all_reduce_is_a_wedge_and_every_member_restarts(
    stack: LocalStack, out: Path, torchrun_reference: dict[str, torch.Tensor]
) -> None:
    # w1 enters the job's first all-reduce and never moves again, heartbeating; w0 is
    # inside the same one, waiting for it. Nobody times out an unmodified script's
    # collective but the script (60 s here): every member inside past what its bytes
    # take is a wedge, and the same members restart in place (no checkpoint yet: from
    # the start), as they would after the script's own timeout.
    result, events, save = run_phalanx(
        stack, out, "job-wedge", env={"PHALANX_FAULTS": "wedge:w1@collective=1"}
    )
    assert result.returncode == 0, result.node_returncodes
    assert [f.cause for f in result.faults] == [FaultCause.COLLECTIVE_WEDGED], result.faults
    evidence = result.faults[0].evidence
    assert evidence["peers_inside_count"] == 1 and evidence["op"] == evidence["peers_op"], evidence
    assert actions(result) == [Action.START, Action.REFORM], [d.reason for d in result.decisions]
    again = [e for e in read_events(events) if e["event"] == "start" and e["attempt"] == 1]
    assert sorted(e["rank"] for e in again) == [0, 1] and {e["resume"] for e in again} == {0}
    assert_bitwise_equal(torch.load(save), torchrun_reference)


def test_a_rank_hung_inside_a_new_generations_first_all_reduce_is_a_wedge_too(
    stack: LocalStack, out: Path, torchrun_reference: dict[str, torch.Tensor]
) -> None:
    # w1 is killed at step 14 (restart in place from step 10); in generation 2, w0 hangs
    # inside its first all-reduce: a second restart, from the same checkpoint
    result, events, save = run_phalanx(
        stack, out, "gen-wedge", kill_at=14, env={"PHALANX_FAULTS": "wedge:w0@collective=2"}
    )
    assert result.returncode == 0, result.node_returncodes
    assert [(f.cause, f.generation) for f in result.faults] == [
        (FaultCause.PROCESS_EXIT, 1),
        (FaultCause.COLLECTIVE_WEDGED, 2),
    ], result.faults
    assert actions(result) == [Action.START, Action.REFORM, Action.REFORM]
    last = [e for e in read_events(events) if e["event"] == "start" and e["attempt"] == 2]
    assert sorted(e["rank"] for e in last) == [0, 1] and {e["resume"] for e in last} == {10}
    assert_bitwise_equal(torch.load(save), torchrun_reference)


def test_rank_zero_evaluating_alone_while_its_peer_waits_is_no_fault(
    stack: LocalStack, out: Path, torchrun_reference: dict[str, torch.Tensor]
) -> None:
    # Every 16 steps rank 0 evaluates the bare module for 3 s (twice the straggle floor)
    # while rank 1 waits in the next step's all-reduce: it moves, so nobody is judged.
    script, _, save = script_args(out, "eval-pause")
    result, _, _ = run_phalanx(
        stack, out, "eval-pause", args=[*script, "--eval-every", "16", "--eval-s", "3"]
    )
    assert result.returncode == 0, result.node_returncodes
    assert result.faults == [] and actions(result) == [Action.START], [d.reason for d in result.decisions]
    assert_bitwise_equal(torch.load(save), torchrun_reference)


def test_max_restarts_exhausted_ends_with_torchruns_exit_code(stack: LocalStack, out: Path) -> None:
    rc, _, _ = torchrun(out, "torchrun-exhausted", nproc=2, max_restarts=0, kill_at=5)
    result, _, save = run_phalanx(stack, out, "exhausted", launcher_args=("--max-restarts", "0"), kill_at=5)
    assert result.node_returncodes == {"local": rc} and rc == 1
    assert actions(result)[-1] is Action.STOP
    assert "max_restarts=0" in result.decisions[-1].reason
    assert not save.exists()


def test_a_script_that_fails_at_import_ends_the_job_without_a_restart_loop(
    stack: LocalStack, out: Path
) -> None:
    t0 = time.monotonic()
    code = "import no_such_module_for_phalanx_tests"
    result, _, _ = run_phalanx(stack, out, "broken", args=["-c", code], timeout_s=60)
    assert result.node_returncodes == {"local": 1}
    log = (stack.workdir / "launcher-broken-local.log").read_text()
    assert "could not start" in log and "ModuleNotFoundError" in log, log[-2000:]
    assert log.count('"worker_started"') == 3, "each worker started once: no restart loop"
    assert time.monotonic() - t0 < 60
