"""Fixtures of the integration tests (the server fixtures are in tests/conftest.py)."""

from __future__ import annotations

import pytest

from phalanx.bus import Bus
from phalanx.contract.subjects import DECISION, PLAN
from tests.integration.planning import JOB, Watcher


@pytest.fixture
async def watcher(bus: Bus) -> Watcher:
    """Plans and decisions of the planner tests' job, as they are published."""
    w = Watcher()
    await bus.nc.subscribe(PLAN.format(job=JOB), cb=w.on_msg)
    await bus.nc.subscribe(DECISION.format(job=JOB), cb=w.on_msg)
    return w
