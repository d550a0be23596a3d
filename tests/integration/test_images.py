"""The images built without a registry (phalanx.devstack.images): what is in them, and
that a broken one fails its build with a clear message instead of hanging."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from phalanx.devstack import images
from phalanx.devstack.engine import Engine

# the first test builds the images (the session fixture: minutes on a cold machine)
pytestmark = [pytest.mark.docker, pytest.mark.slow, pytest.mark.timeout(900)]


def test_the_services_image_runs_without_torch_and_the_job_image_with_it(
    docker_engine: Engine, phalanx_images: dict[str, images.Built]
) -> None:
    for built in phalanx_images.values():
        print(built.line())
    probe = "import importlib.util as u; print(u.find_spec('torch') is not None)"
    run = ["run", "--rm", "--network", "host"]
    assert docker_engine.docker(*run, images.SERVICES, "python", "-c", probe).stdout.strip() == "False"
    assert docker_engine.docker(*run, images.JOB, "python", "-c", probe).stdout.strip() == "True"
    # non-root, and the CLI answers in both
    assert docker_engine.docker(*run, images.SERVICES, "id", "-u").stdout.strip() == "10001"
    for image in (images.SERVICES, images.JOB):
        assert (
            docker_engine.docker(*run, image, "phalanx", "--version").stdout.strip()
            == "phalanx, version 0.1.0"
        )


def test_a_broken_image_fails_its_build_saying_what_is_missing(
    docker_engine: Engine, phalanx_images: dict[str, images.Built], tmp_path: Path
) -> None:
    """A checkout missing a module a service imports: the build's import check fails it."""
    ctx = images.stage_context(tmp_path / "ctx", torch=False)
    (ctx / "services" / "failure_detector" / "detector.py").unlink()
    with pytest.raises(RuntimeError) as failed:
        images.build(docker_engine.docker, "phalanx-broken:test", ctx, *images.OFFLINE)
    message = str(failed.value)
    assert "building phalanx-broken:test failed" in message
    assert "No module named 'phalanx.services.failure_detector.detector'" in message
    shutil.rmtree(ctx)
