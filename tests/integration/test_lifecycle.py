"""Whatever starts a nats-server or services stops them when it is itself stopped by a
signal, and a clean shutdown logs nothing at warning level.

``timeout 60 python -m bench.detect`` used to leave its nats-server running: servers
run in their own session (a terminal's Ctrl-C does not reach them) and SIGTERM
killed the benchmark before its ``finally`` could stop them.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import structlog

from phalanx.bus import Bus


def _descendants(pid: int) -> dict[int, bytes]:
    """pid -> command line of every descendant of ``pid`` (from /proc)."""
    parents: dict[int, int] = {}
    cmdlines: dict[int, bytes] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            parents[int(entry.name)] = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            cmdlines[int(entry.name)] = (entry / "cmdline").read_bytes()
        except OSError:
            continue
    out: dict[int, bytes] = {}
    frontier = [pid]
    while frontier:
        p = frontier.pop()
        for c, pp in parents.items():
            if pp == p:
                out[c] = cmdlines.get(c, b"")
                frontier.append(c)
    return out


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_benchmark_stopped_by_a_signal_stops_its_nats_server_and_workers(sig: int, tmp_path: Path) -> None:
    bench = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "bench.detect",
            "--quick",
            "--ranks",
            "2",
            "--spares",
            "0",
            "--sim-procs",
            "1",
        ],
        stdout=subprocess.DEVNULL,
        stderr=open(tmp_path / "bench.err", "wb"),
        cwd=Path(__file__).parents[2],
    )
    try:
        deadline = time.monotonic() + 90
        started: dict[int, bytes] = {}
        while time.monotonic() < deadline:
            started = _descendants(bench.pid)
            if any(b"nats-server" in c for c in started.values()) and len(started) >= 3:
                break
            assert bench.poll() is None, (tmp_path / "bench.err").read_text()[-2000:]
            time.sleep(0.2)
        servers = [p for p, c in started.items() if b"nats-server" in c]
        assert servers, f"the benchmark started no nats-server: {started}"
        time.sleep(1.0)  # well into its run
        started = _descendants(bench.pid)
        bench.send_signal(sig)
        bench.wait(60)
        left = [(p, started[p][:80]) for p in started if _alive(p)]
        assert not left, f"left running after the benchmark got signal {sig}: {left}"
    finally:
        if bench.poll() is None:
            bench.kill()
            bench.wait(10)


async def test_closing_the_bus_logs_no_warning(nats_url: str) -> None:
    # capture_logs, not the process's logging set-up: that would bind structlog to a
    # captured stderr that later tests find closed
    with structlog.testing.capture_logs() as logs:
        bus = await Bus.connect(nats_url, name="closing")
        await bus.close()
    assert not [e for e in logs if e["log_level"] in ("warning", "error")], logs
