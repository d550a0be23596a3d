"""The operator's path, through the public CLI only: ``phalanx up`` in one terminal,
``phalanx run`` in another, ``phalanx status`` to watch, a rank SIGKILLed, and
everything stopped by a signal with nothing left behind and no warning logged.

Every command runs as a subprocess, the way a person types it; the test reads what
they print (``phalanx status --json``) and what the processes leave (ports, pids).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from examples.train_gpt import SMALL
from phalanx.devstack.natsserver import free_port
from tests.procs import NOBODY, alive, as_uid, descendants, nats_connect_without_login, read_or_why

pytestmark = pytest.mark.slow

PHALANX = [sys.executable, "-m", "phalanx.cli"]


def _port_open(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def _until(what: str, check: Any, timeout_s: float = 90.0) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        got = check()
        if got:
            return got
        time.sleep(0.5)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.fixture
def up(tmp_path: Path) -> Iterator[tuple[subprocess.Popen[str], str, Path]]:
    """``phalanx up`` on a free port, as a subprocess; yields (process, NATS URL, workdir)."""
    port = free_port()
    work = tmp_path / "up"
    proc = subprocess.Popen(
        [*PHALANX, "up", "--no-live", "--port", str(port), "--metrics-port", "0", "--workdir", str(work)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        first = proc.stdout.readline()
        assert "services healthy" in first, first + (proc.stderr.read() if proc.poll() is not None else "")
        yield proc, f"nats://127.0.0.1:{port}", work
    finally:
        if proc.poll() is None:  # SIGTERM first: a SIGKILLed `up` cannot stop what it started
            proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)


def _status(url: str, job: str) -> dict[str, Any] | None:
    done = subprocess.run(
        [*PHALANX, "status", job, "--json"],
        env={**os.environ, "NATS_URL": url},
        capture_output=True,
        text=True,
        timeout=30,
    )
    return json.loads(done.stdout) if done.returncode == 0 else None


def test_up_run_status_through_a_recovery_then_sigterm_stops_everything(
    up: tuple[subprocess.Popen[str], str, Path], corpus: Path, tmp_path: Path
) -> None:
    proc, url, work = up
    job = "operate"
    # Another local user gets nothing: the server wants a login, and the logins `up` left
    # for the commands below (which use them unasked) are not its to read.
    assert "Authorization Violation" in as_uid(NOBODY, lambda: nats_connect_without_login(url))
    logins = next(Path(os.environ["PHALANX_LOGINS_DIR"]).glob(f"*-{url.rsplit(':', 1)[1]}"))
    assert as_uid(NOBODY, lambda: read_or_why(logins / "admin.env")).startswith("PermissionError")
    train = [sys.executable, "-m", "examples.train_gpt", "--steps", "100000", "--data", str(corpus), *SMALL]
    run = subprocess.Popen(
        [*PHALANX, "run", "--nproc", "2", "--spares", "1", "--job", job, "--log-dir", str(tmp_path / "logs"), "--",
         *train],
        env={**os.environ, "NATS_URL": url},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:

        def training(generation: int) -> dict[str, Any] | None:
            s = _status(url, job)
            ok = s and s["generation"] == generation and s["live"] and (s["step"] or 0) >= 3
            if ok and generation == 1:  # and the spare is up (it may register after the start)
                ok = any(w["role"] == "spare" and w["phase"] == "idle" for w in s["workers"])
            return s if ok else None

        first = _until("generation 1 training", lambda: training(1))
        ranks = {w["worker"]: w for w in first["workers"] if w["role"] == "rank"}
        spare = next(w["worker"] for w in first["workers"] if w["role"] == "spare")
        assert sorted(w["rank"] for w in ranks.values()) == [0, 1]
        victim = next(w for w in ranks.values() if w["rank"] == 1)
        os.kill(victim["pid"], signal.SIGKILL)

        after = _until("generation 2 training", lambda: training(2))
        now = {w["rank"]: w["worker"] for w in after["workers"] if w["role"] == "rank"}
        assert now == {0: next(w for w, v in ranks.items() if v["rank"] == 0), 1: spare}, now
        assert after["incidents"][-1]["generation"] == 2
        assert after["incidents"][-1]["incident"].startswith(f"{job}:{victim['worker']}:")
        assert after["world_size"] == 2 and after["state"] == "running"
    finally:
        run.send_signal(signal.SIGTERM)
        run.wait(60)

    # A service that dies under `phalanx up` is started again (health answers, new pid).
    def health(name: str) -> dict[str, Any] | None:
        done = subprocess.run(
            [*PHALANX, "health", name],
            env={**os.environ, "NATS_URL": url},
            capture_output=True,
            text=True,
            timeout=30,
        )
        return json.loads(done.stdout) if done.returncode == 0 else None

    before = health("scheduler-signal")
    assert before is not None
    pid = int(before["instance"].split(":")[1])
    os.kill(pid, signal.SIGKILL)
    again = _until(
        "scheduler-signal restarted",
        lambda: (h := health("scheduler-signal")) and h["instance"] != before["instance"] and h,
    )
    assert int(again["instance"].split(":")[1]) != pid

    # SIGTERM to `phalanx up`: it stops NATS and the services, exits 0, leaves nothing.
    port = int(url.rsplit(":", 1)[1])
    started = list(descendants(proc.pid))
    assert started, "phalanx up has no child processes?"
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(60) == 0
    assert not _port_open(port), "the nats-server outlived `phalanx up`"
    assert not [p for p in started if alive(p)], "processes `phalanx up` started outlived it"
    logs = "".join(p.read_text() for p in work.glob("*.log"))
    assert "service_stopped" in logs
    assert "nats_disconnected" not in logs and "nats_error" not in logs


def test_phalanx_run_without_nats_url_uses_a_private_control_plane(corpus: Path, tmp_path: Path) -> None:
    """No NATS_URL and nothing on 127.0.0.1:4222: the run starts its own NATS and services,
    trains to the end, and stops them."""
    if _port_open(4222):
        pytest.skip("something listens on 127.0.0.1:4222 (a `phalanx up`?): the private path is not taken")
    env = {k: v for k, v in os.environ.items() if k not in ("NATS_URL", "PHALANX_NATS_URL")}
    train = [
        sys.executable,
        "-m",
        "phalanx.examples.train_gpt",
        "--steps",
        "5",
        "--data",
        str(corpus),
        *SMALL,
    ]
    # PYTHONFAULTHANDLER: a run that hangs is sent SIGABRT and prints every thread's stack.
    run = subprocess.Popen(
        [*PHALANX, "run", "--nproc", "2", "--job", "private", "--", *train],
        env={**env, "PYTHONFAULTHANDLER": "1"},
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        try:
            _, stderr = run.communicate(timeout=240)
        except subprocess.TimeoutExpired:
            run.send_signal(signal.SIGABRT)
            _, stderr = run.communicate(timeout=30)
            pytest.fail(f"`phalanx run` still ran after 240 s; its stacks and log:\n{stderr[-8000:]}")
        assert run.returncode == 0, stderr[-3000:]
        assert "starting a private control plane" in stderr
        assert (tmp_path / ".phalanx" / "run-private" / "elasticity-planner.log").exists()
        assert not _port_open(4222)
        # nothing it started is left: no process (orphans included) still runs in its directory
        left = _running_in(tmp_path)
        assert not left, f"outlived `phalanx run`: {left}"
    finally:
        for pid in _running_in(tmp_path):  # on a failure too: nothing outlives the test
            with contextlib.suppress(OSError):
                os.kill(int(pid), signal.SIGKILL)


def _running_in(directory: Path) -> dict[str, bytes]:
    """Live processes whose working directory is ``directory``: pid -> command line."""
    left = {}
    for entry in Path("/proc").iterdir():
        with contextlib.suppress(OSError):
            if (
                entry.name.isdigit()
                and Path(os.readlink(entry / "cwd")) == directory
                and alive(int(entry.name))
            ):
                left[entry.name] = (entry / "cmdline").read_bytes()[:80]
    return left
