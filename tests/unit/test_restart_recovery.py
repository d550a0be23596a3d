"""The pieces of restart recovery that need no job: the command's target, torchrun's
environment, which workers a generation restarts, the planner's restart budget. (The
fork server forking real workers: tests/integration/test_fork_server.py.)"""

from __future__ import annotations

import signal
import sys
from pathlib import Path

import pytest
from phalanx.services.elasticity_planner.decisions import Decision
from phalanx.services.elasticity_planner.reducer import _within_restarts

from phalanx.contract import Action, JobSpec, JobState, NodePlan, Recovery, Role
from phalanx.launcher.children import Worker
from phalanx.launcher.restarts import members_to_restart
from phalanx.runtime.unmodified import torchrun_env
from phalanx.worker.pycommand import Target, parse, run_target, uses_phalanx


# -- the command ---------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("cmd", "kind", "value", "args", "flags"),
    [
        (["python", "train.py", "--lr", "1"], "script", "train.py", ("--lr", "1"), ()),
        (["/usr/bin/python3.11", "-u", "-X", "dev", "-m", "pkg.mod", "a"], "module", "pkg.mod", ("a",), ("-u", "-X", "dev")),
        (["python3", "-c", "print(1)", "x"], "code", "print(1)", ("x",), ()),
    ],
)  # fmt: skip
def test_a_python_command_is_read_as_python_reads_it(
    cmd: list[str], kind: str, value: str, args: tuple[str, ...], flags: tuple[str, ...]
) -> None:
    t = parse(cmd)
    assert t is not None and (t.kind, t.value, t.args, t.flags) == (kind, value, args, flags)
    assert t.python_args()[-len(args) :] == list(args)


@pytest.mark.parametrize(
    "cmd", [["bash", "run.sh"], ["python"], ["python", "-i", "x.py"], ["python", "-"], ["torchrun", "x.py"]]
)
def test_anything_else_starts_cold(cmd: list[str]) -> None:
    assert parse(cmd) is None


def test_a_script_that_imports_phalanx_is_told_from_one_that_does_not(tmp_path: Path) -> None:
    (tmp_path / "plain.py").write_text("import torch\nimport phalanx_like\n")
    (tmp_path / "ported.py").write_text("def main():\n    from phalanx.runtime import init\n")
    (tmp_path / "broken.py").write_text("def (:\n")
    t = lambda name: Target("python", (), "script", name, ())  # noqa: E731
    assert uses_phalanx(t("plain.py"), tmp_path) is False
    assert uses_phalanx(t("ported.py"), tmp_path) is True
    assert uses_phalanx(t("broken.py"), tmp_path) is None  # unreadable: in-process, as before
    assert uses_phalanx(t("missing.py"), tmp_path) is None
    assert uses_phalanx(Target("python", (), "code", "import phalanx.runtime", ()), tmp_path) is True
    assert uses_phalanx(Target("python", (), "module", "examples.ddp_torchrun", ())) is False
    assert uses_phalanx(Target("python", (), "module", "examples.ddp_phalanx", ())) is True


def test_run_target_ends_as_python_would(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    saved = sys.argv[:], sys.path[0]
    try:
        ok = run_target(Target("python", (), "code", "import sys; assert sys.argv == ['-c', 'a']", ("a",)))
        assert ok.code == 0 and ok.error is None
        assert run_target(Target("python", (), "code", "raise SystemExit(7)", ())).code == 7
        assert run_target(Target("python", (), "code", "raise SystemExit('bad')", ())).code == 1
        failed = run_target(Target("python", (), "code", "1 / 0", ()))
        assert failed.code == 1 and isinstance(failed.error, ZeroDivisionError) and not failed.at_start
        missing = run_target(Target("python", (), "code", "import no_such_module_here", ()))
        assert missing.code == 1 and missing.at_start
        gone = run_target(Target("python", (), "script", str(tmp_path / "nope.py"), ()))
        assert gone.code == 2 and gone.at_start
        (tmp_path / "s.py").write_text("import sys\nsys.exit(0 if __name__ == '__main__' else 3)\n")
        assert run_target(Target("python", (), "script", str(tmp_path / "s.py"), ())).code == 0
        assert sys.path[0] == str(tmp_path)  # the script's directory, as python sets it
    finally:
        sys.argv[:], sys.path[0] = saved
    assert "ZeroDivisionError" in capsys.readouterr().err


# -- torchrun's environment ----------------------------------------------------------------------
def test_torchrun_env_of_a_two_node_generation() -> None:
    plan = NodePlan(job="j", generation=4, world_size=4, store_prefix="j/gen4", ranks={"b-w0": 2, "b-w1": 3})
    env = torchrun_env(plan, "b-w0", "10.0.0.1:2999", run_id="j", max_restarts=3)
    assert env["RANK"] == "2" and env["WORLD_SIZE"] == "4" and env["LOCAL_RANK"] == "0"
    assert env["LOCAL_WORLD_SIZE"] == "2" and env["GROUP_RANK"] == "1" and env["GROUP_WORLD_SIZE"] == "2"
    assert (env["MASTER_ADDR"], env["MASTER_PORT"]) == ("10.0.0.1", "2999")
    assert env["TORCHELASTIC_RESTART_COUNT"] == "3" and env["TORCHELASTIC_MAX_RESTARTS"] == "3"
    assert env["TORCHELASTIC_USE_AGENT_STORE"] == "True" and env["TORCHELASTIC_RUN_ID"] == "j"
    with pytest.raises(ValueError, match="no member"):
        torchrun_env(plan, "a-w0", "10.0.0.1:2999", run_id="j", max_restarts=3)


# -- which workers a generation restarts ---------------------------------------------------------
class _Proc:
    def __init__(self, pid: int, alive: bool = True) -> None:
        self.pid, self.returncode = pid, None if alive else 0

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        return self.returncode or 0

    def send_signal(self, sig: int) -> None:
        self.returncode = -sig

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def test_a_new_generation_restarts_every_member_but_those_already_running_it() -> None:
    workers = {
        "w0": Worker("w0", Role.RANK, _Proc(1), generation=0),  # waiting for its first plan
        "w1": Worker("w1", Role.RANK, _Proc(2), generation=1),  # ran generation 1
        "w2": Worker("w2", Role.SPARE, _Proc(3)),  # an idle spare, now given a rank
        "w3": Worker("w3", Role.SPARE, _Proc(4)),  # a spare that stays one
    }
    first = NodePlan(job="j", generation=1, world_size=2, store_prefix="p", ranks={"w0": 0, "w1": 1})
    stale, start = members_to_restart(workers, first)
    assert (stale, start) == ([], []) and workers["w0"].generation == 1
    second = NodePlan(
        job="j", generation=2, world_size=3, store_prefix="p", ranks={"w0": 0, "w1": 1, "w2": 2}
    )
    stale, start = members_to_restart(workers, second)
    assert [w.name for w in stale] == ["w0", "w1", "w2"] and start == ["w0", "w1", "w2"]
    assert all(w.restarting for w in stale) and not workers["w3"].restarting


# -- the planner's restart budget ------------------------------------------------------------------
def test_a_recovery_past_max_restarts_is_a_stop() -> None:
    spec = JobSpec(job="j", launcher="l", workers=["w0", "w1"], ranks=2, global_batch=8, max_restarts=1)
    state = JobState(spec=spec)
    replace = Decision(Action.REPLACE, "w1 died: spare w2 takes rank 1", removed=["w1"])
    assert _within_restarts(state, replace) is replace and state.restarts == 1
    stop = _within_restarts(state, replace)
    assert stop.action is Action.STOP and "max_restarts=1" in stop.reason and stop.removed == ["w1"]
    hold = Decision(Action.HOLD, "nothing to do")
    assert _within_restarts(state, hold) is hold
    unlimited = JobState(spec=spec.model_copy(update={"max_restarts": -1}))
    assert all(_within_restarts(unlimited, replace) is replace for _ in range(10))


# -- phalanx run reads torchrun's command line ------------------------------------------------------
def test_phalanx_run_reads_the_target_as_torchrun_does() -> None:
    from phalanx.cli.run import choose_recovery, torchrun_command

    assert torchrun_command(("train.py", "--lr", "1"), False, False) == [
        sys.executable,
        "train.py",
        "--lr",
        "1",
    ]
    assert torchrun_command(("pkg.train", "x"), True, False) == [sys.executable, "-m", "pkg.train", "x"]
    assert torchrun_command(("./run.sh", "x"), False, True) == ["./run.sh", "x"]
    assert torchrun_command(("python", "t.py"), False, False) == ["python", "t.py"]
    plain = [sys.executable, "-m", "examples.ddp_torchrun"]
    assert choose_recovery("auto", plain) is Recovery.RESTART
    assert choose_recovery("auto", [sys.executable, "-m", "examples.ddp_phalanx"]) is Recovery.IN_PROCESS
    assert choose_recovery("auto", ["bash", "run.sh"]) is Recovery.IN_PROCESS
    assert choose_recovery("in-process", plain) is Recovery.IN_PROCESS


def test_torchruns_spellings_of_its_flags_are_accepted() -> None:
    from click.testing import CliRunner

    from phalanx.cli.run import run_command

    ctx = run_command.make_context(
        "run",
        ["--nproc_per_node=2", "--max_restarts=1", "--rdzv_backend=c10d", "--rdzv_id=j", "--node_rank", "1",
         "--standalone", "-m", "pkg.train", "--lr", "1"],
    )  # fmt: skip
    p = ctx.params
    assert (p["nproc"], p["max_restarts"], p["job"], p["node_rank"], p["standalone"], p["module"]) == (
        2, 1, "j", 1, True, True,
    )  # fmt: skip
    assert p["cmd"] == ("pkg.train", "--lr", "1")
    bad = CliRunner().invoke(run_command, ["--nproc-per-node", "1", "--standalone", "--nnodes", "2", "x.py"])
    assert bad.exit_code != 0 and "--standalone is a single-node job" in bad.output


def test_a_restart_job_keeps_its_members_when_a_process_ends_on_a_live_node() -> None:
    from phalanx.services.elasticity_planner.decisions import Fault
    from phalanx.services.elasticity_planner.failure_policy import ReplaceOrShrink

    from phalanx.contract import Member, Plan

    spec = JobSpec(job="j", launcher="l", workers=["w0", "w1", "w2"], ranks=2, global_batch=8,
                   recovery=Recovery.RESTART)  # fmt: skip
    state = JobState(spec=spec, spares=["w2"])
    members = [Member(rank=0, worker="w0"), Member(rank=1, worker="w1")]
    state.plan = Plan(job="j", generation=1, members=members, reason="start", store_prefix="p")
    exited = ReplaceOrShrink().on_fault(state, Fault("i1", "w1", "process_exit", False))
    assert exited.action is Action.REFORM and exited.members == members and not exited.spares_used
    assert ReplaceOrShrink().on_fault(state, Fault("i1", "w1", "process_exit", False, 1)) == exited
    # A process of generation 0 ending once generation 1 is planned (its exit crossed the
    # plan): generation 1 restarts it anyway, so no second restart is spent on it.
    late = ReplaceOrShrink().on_fault(state, Fault("i4", "w1", "process_exit", False, 0))
    assert late.action is Action.HOLD and late.members is None and "generation 1 already" in late.reason
    hung = ReplaceOrShrink().on_fault(state, Fault("i2", "w1", "heartbeat_lost", True))
    assert hung.action is not Action.REFORM  # a hung process may be its node's trouble: the spares' rule
    in_process = JobState(spec=spec.model_copy(update={"recovery": Recovery.IN_PROCESS}), spares=["w2"])
    in_process.plan = state.plan
    assert (
        ReplaceOrShrink().on_fault(in_process, Fault("i3", "w1", "process_exit", False)).action
        is not Action.REFORM
    )
