"""Fixtures of the integration tests (the server fixtures are in tests/conftest.py)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from phalanx.bus import Bus
from phalanx.contract.subjects import CHECKPOINT, DECISION, PLAN
from tests.integration.planning import JOB, Watcher
from tests.integration.test_checkpoint import JOB as CHECKPOINT_JOB
from tests.integration.test_checkpoint import Cluster


@pytest.fixture
async def watcher(bus: Bus) -> Watcher:
    """Plans and decisions of the planner tests' job, as they are published."""
    w = Watcher()
    await bus.nc.subscribe(PLAN.format(job=JOB), cb=w.on_msg)
    await bus.nc.subscribe(DECISION.format(job=JOB), cb=w.on_msg)
    return w


@pytest.fixture
async def cluster(bus: Bus, tmp_path: Path) -> AsyncIterator[Cluster]:
    """Keepers in this process, each a node of its own (memory and local disk: a lost node
    takes its disk), and the checkpoint events of their job. Closing it removes the shared
    memory root. (test_checkpoint.py and test_netns.py have a ``cluster`` of their own.)"""
    c = Cluster(bus, tmp_path, None)
    await bus.nc.subscribe(CHECKPOINT.format(job=CHECKPOINT_JOB), cb=c.on_event)
    try:
        yield c
    finally:
        await c.close()
