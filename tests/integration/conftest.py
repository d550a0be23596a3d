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
def cluster_bucket() -> str | None:
    """The object tier of :func:`cluster`'s keepers (``s3://...``): none here; a module
    that needs one overrides this fixture (test_checkpoint.py)."""
    return None


@pytest.fixture
async def cluster(bus: Bus, tmp_path: Path, cluster_bucket: str | None) -> AsyncIterator[Cluster]:
    """Keepers in this process, each a node of its own (memory and local disk: a lost node
    takes its disk; object storage where ``cluster_bucket`` names a bucket), and the
    checkpoint events of their job. Closing it removes the shared memory root.
    (test_netns.py has a ``cluster`` of its own.)"""
    c = Cluster(bus, tmp_path, cluster_bucket)
    await bus.nc.subscribe(CHECKPOINT.format(job=CHECKPOINT_JOB), cb=c.on_event)
    try:
        yield c
    finally:
        await c.close()
