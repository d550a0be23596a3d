"""The ``phalanx`` command explains itself: help on every command and option, one-line
refusals of bad input (exit 2), nothing started when the input is wrong."""

from __future__ import annotations

import subprocess
import sys

import click
import pytest

from phalanx.cli import cli, main


def _commands(group: click.Group, prefix: str = "phalanx") -> list[tuple[str, click.Command]]:
    out: list[tuple[str, click.Command]] = []
    for name, cmd in group.commands.items():
        out.append((f"{prefix} {name}", cmd))
        if isinstance(cmd, click.Group):
            out += _commands(cmd, f"{prefix} {name}")
    return out


COMMANDS = _commands(cli)


def test_the_commands_operators_expect_are_there() -> None:
    names = {path for path, _ in COMMANDS}
    for expected in ("up", "run", "status", "report", "trace summary", "cluster offer", "cluster reclaim",
                     "cluster show", "nats", "service", "health", "ckpt list", "ckpt show",
                     "ckpt rm"):  # fmt: skip
        assert f"phalanx {expected}" in names


@pytest.mark.parametrize(("path", "command"), COMMANDS, ids=[p for p, _ in COMMANDS])
def test_every_command_and_option_has_help(path: str, command: click.Command) -> None:
    assert (command.help or "").strip(), f"{path} has no help text"
    for param in command.params:
        if isinstance(param, click.Option) and "--help" not in param.opts:
            assert (param.help or "").strip(), f"{path} {param.opts[0]} has no help text"


@pytest.mark.parametrize(("path", "command"), COMMANDS, ids=[p for p, _ in COMMANDS])
def test_help_renders(path: str, command: click.Command, capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*path.split()[1:], "--help"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"Usage: {path}"), out


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["run", "--nproc", "0", "--", "python", "t.py"], "--nproc 0 starts a node of hot spares only"),
        (["run", "--nproc", "-1", "--", "python", "t.py"], "-1 is not in the range x>=0"),
        (["run", "--nproc", "2"], "give the training command after --"),
        (
            ["run", "--nproc", "2", "--nnodes", "3:2", "--", "python", "t.py"],
            "--nnodes needs 1 <= MIN <= MAX",
        ),
        (["run", "--nproc", "2", "--nnodes", "1:2", "--", "python", "t.py"], "needs --node-id"),
        (["run", "--nproc", "2", "--lr-rule", "cubic", "--", "python", "t.py"], "'cubic' is not one of"),
        (["run", "--nproc", "2", "--max-accum", "2", "--", "python", "t.py"], "max_accum needs micro_batch"),
        (["status", "--interval", "0"], "0 is not in the range x>=0.2"),
        (["ckpt", "rm", "a.b", "1"], "'a.b' is not a job name"),
        (["ckpt", "show", "j", "--", "-1"], "-1 is not in the range x>=0"),
        (["nosuch"], "No such command"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(argv: list[str], says: str) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "phalanx.cli", *argv], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 2, done
    assert says in done.stderr, done.stderr
    assert done.stderr.count("\n") == 1 and done.stderr.startswith("phalanx"), done.stderr
    assert done.stdout == ""


def test_a_malformed_setting_is_refused_before_anything_starts() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "phalanx.cli", "run", "--nproc", "1", "--", "python", "t.py"],
        env={"PATH": "/usr/bin:/bin", "PHALANX_HEARTBEAT_MS": "-100"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2
    assert "PHALANX_HEARTBEAT_MS='-100'" in done.stderr and "Traceback" not in done.stderr
