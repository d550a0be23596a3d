"""The tests' Docker engine and images: a private dockerd and images built without a registry.

``docker_engine`` (session) starts :func:`phalanx.devstack.engine.start_engine` once
for the whole run and stops it (removing its data) at the end, also after failures;
``phalanx_images`` builds the base and the four images into it once
(:mod:`phalanx.devstack.images`: the base's tarball and the wheels are cached by
content under ~/.cache/phalanx/images, the images themselves are built per run).
Where no engine can start, every test using them skips with the reason.
``PHALANX_TEST_ENGINE=/tmp/phalanx-engine`` uses the engine ``make engine`` runs
instead (left running), and ``PHALANX_TEST_REUSE_IMAGES=1`` the images already in it.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from phalanx.devstack import images
from phalanx.devstack.engine import Engine, EngineUnavailable, start_engine


def docker_available() -> tuple[bool, str]:
    """Whether a Docker engine answers at ``DOCKER_HOST`` (or the default socket), and if not, why."""
    if shutil.which("docker") is None:
        return False, "no docker client on PATH"
    try:
        out = subprocess.run(
            ["docker", "info", "--format", "{{.ServerVersion}}"], capture_output=True, text=True, timeout=10
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return False, f"docker info failed: {exc}"
    if out.returncode != 0:
        last = (out.stderr.strip().splitlines() or ["?"])[-1]
        return False, f"no Docker engine answers (`docker info`: {last})"
    return True, out.stdout.strip()


@pytest.fixture(scope="session")
def docker_engine() -> Iterator[Engine]:
    """The private engine of this test run; ``DOCKER_HOST`` points at it while it runs."""
    try:
        attach = os.environ.get("PHALANX_TEST_ENGINE")
        engine = Engine.attach(Path(attach)) if attach else start_engine()
    except EngineUnavailable as exc:
        pytest.skip(f"no private Docker engine here: {exc}")
    env = pytest.MonkeyPatch()  # session-wide, undone below
    env.setenv("DOCKER_HOST", engine.host)
    env.setenv("DOCKER_BUILDKIT", "0")
    # Ryuk (testcontainers' reaper) is an image from Docker Hub: none can be pulled here,
    # and the engine's teardown removes every container anyway
    env.setenv("TESTCONTAINERS_RYUK_DISABLED", "true")
    try:
        yield engine
    finally:
        env.undo()
        engine.stop()


@pytest.fixture(scope="session")
def phalanx_images(docker_engine: Engine) -> dict[str, images.Built]:
    """The base, services, job, NATS and Prometheus images, built once per run."""
    if os.environ.get("PHALANX_TEST_ENGINE") and os.environ.get("PHALANX_TEST_REUSE_IMAGES"):
        return {}  # a developer's loop: the attached engine has them (python -m phalanx.devstack.images)
    built = images.build_all(docker_engine.docker)
    for b in built:
        print(b.line())
    return {b.tag: b for b in built}
