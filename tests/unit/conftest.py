"""Fixtures shared by the unit tests."""

from __future__ import annotations

import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest


@pytest.fixture
def quiet() -> Iterator[int]:
    """The pid of a process that does no I/O, for a stillness sampler to count its tree's
    I/O instead of pytest's (its servers and other threads read and write all along)."""
    proc = subprocess.Popen(["sleep", "120"])
    try:
        _asleep(proc.pid)
        yield proc.pid
    finally:
        proc.kill()
        proc.wait()


def _asleep(pid: int) -> None:
    """Until ``sleep`` sleeps: a process just started still reads its libraries, and its
    I/O counters move under a sampler that began meanwhile."""
    stat, io = Path(f"/proc/{pid}/stat"), Path(f"/proc/{pid}/io")
    deadline, last = time.monotonic() + 10, ""
    while time.monotonic() < deadline:
        state = stat.read_text().rsplit(")", 1)[1].split()[0]
        now = io.read_text()
        if state == "S" and now == last:
            return
        last = now
        time.sleep(0.02)
    raise AssertionError(f"sleep ({pid}) never settled")
