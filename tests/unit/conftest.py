"""Fixtures shared by the unit tests."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator

import pytest


@pytest.fixture
def quiet() -> Iterator[int]:
    """The pid of a process that does no I/O, for a stillness sampler to count its tree's
    I/O instead of pytest's (its servers and other threads read and write all along)."""
    proc = subprocess.Popen(["sleep", "120"])
    try:
        yield proc.pid
    finally:
        proc.kill()
        proc.wait()
