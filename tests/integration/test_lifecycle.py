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
from tests.procs import alive, descendants


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
            started = descendants(bench.pid)
            if any(b"nats-server" in c for c in started.values()) and len(started) >= 3:
                break
            assert bench.poll() is None, (tmp_path / "bench.err").read_text()[-2000:]
            time.sleep(0.2)
        servers = [p for p, c in started.items() if b"nats-server" in c]
        assert servers, f"the benchmark started no nats-server: {started}"
        time.sleep(1.0)  # well into its run
        started = descendants(bench.pid)
        bench.send_signal(sig)
        bench.wait(60)
        left = [(p, started[p][:80]) for p in started if alive(p)]
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


def test_the_exit_watchdog_ends_a_process_stuck_at_its_end_and_says_where() -> None:
    """A process whose shutdown hangs (here: a thread joined forever) is ended by the
    watchdog with the code it gives, every thread's stack on stderr."""
    script = (
        "import threading, time\n"
        "from phalanx.lifecycle import exit_watchdog\n"
        "exit_watchdog(0.3, lambda: 7, 'test-process')\n"
        "def stuck_forever():\n"
        "    time.sleep(3600)\n"
        "t = threading.Thread(target=stuck_forever); t.start(); t.join()\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert done.returncode == 7
    assert "test-process: still running 0.3 s after it should end" in done.stderr
    assert "stuck_forever" in done.stderr  # the stuck thread's stack


def test_the_exit_watchdog_leaves_a_process_that_ends_in_time_alone() -> None:
    script = "from phalanx.lifecycle import exit_watchdog\nexit_watchdog(30, lambda: 7, 'p')\nprint('ok')\n"
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.strip() == "ok" and not done.stderr
