"""The node's fork server, for real: workers forked with torch imported, their own
environment, command line, output and exit code, and their death with the server."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from phalanx.launcher.forkserver import ForkedProc, ForkServer
from phalanx.telemetry import get_logger
from phalanx.worker.pycommand import Target


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


@pytest.fixture(scope="module")
def forks() -> Iterator[ForkServer]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    server = ForkServer(Target(sys.executable, (), "code", "", ()), env, get_logger(component="test"))
    server.start()
    assert server.wait_ready(120), server.why
    yield server
    server.close()


def _fork(forks: ForkServer, code: str, tmp_path: Path, **env: str) -> tuple[ForkedProc, Path]:
    log = tmp_path / "out.log"
    proc = forks.spawn(["-c", code], {**os.environ, **env}, mode="plain", log=log, cwd=str(tmp_path))
    return proc, log


def test_a_forked_worker_has_torch_and_its_own_environment_and_exit_code(
    forks: ForkServer, tmp_path: Path
) -> None:
    code = (
        "import os, sys, torch; assert 'torch._dynamo' in sys.modules; "
        "print(os.environ['MINE'], torch.get_num_threads(), os.getcwd()); sys.exit(5)"
    )
    proc, log = _fork(forks, code, tmp_path, MINE="yes", OMP_NUM_THREADS="1")
    assert proc.wait(30) == 5
    assert log.read_text().split() == ["yes", "1", str(tmp_path)]
    assert forks.info["threads"] >= 1 and forks.info["import_s"] > 0


def test_a_forked_worker_shows_its_own_command_line_and_environment(
    forks: ForkServer, tmp_path: Path
) -> None:
    proc, _ = _fork(forks, "import time; time.sleep(30)", tmp_path, PHALANX_WORKER="w9")
    try:
        deadline = time.monotonic() + 10
        while b"time.sleep" not in Path(f"/proc/{proc.pid}/cmdline").read_bytes():
            assert time.monotonic() < deadline, "the worker never retitled itself"
            time.sleep(0.02)
        assert b"PHALANX_WORKER=w9" in Path(f"/proc/{proc.pid}/environ").read_bytes().split(b"\0")
        listed = subprocess.run(
            ["pgrep", "-f", "time.sleep.30"], capture_output=True, text=True
        ).stdout.split()
        assert str(proc.pid) in listed
    finally:
        proc.kill()
    assert proc.wait(10) == -signal.SIGKILL


def test_workers_die_with_the_fork_server(tmp_path: Path) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    server = ForkServer(Target(sys.executable, (), "code", "", ()), env, get_logger(component="test"))
    lost: list[str] = []
    server.on_exit = lost.append
    server.start()
    assert server.wait_ready(120), server.why
    proc = server.spawn(["-c", "import time; time.sleep(60)"], env, mode="plain", log=None, cwd=str(tmp_path))
    assert server.proc is not None
    server.proc.kill()
    assert proc.wait(10) == -signal.SIGKILL
    deadline = time.monotonic() + 10
    while alive(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not alive(proc.pid), "a worker outlived its fork server"
    assert lost and "ended" in lost[0]


def test_a_forked_workers_collector_does_not_walk_the_servers_objects(
    forks: ForkServer, tmp_path: Path
) -> None:
    code = "import gc, sys; sys.exit(0 if gc.isenabled() and gc.get_freeze_count() > 100_000 else 1)"
    proc, _ = _fork(forks, code, tmp_path)
    assert proc.wait(30) == 0
