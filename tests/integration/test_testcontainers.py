"""testcontainers with Phalanx's own images, as a user's integration tests would use them.

A private engine (tests/_docker.py) with the images built here, no registry: NATS
from the wheel's static binary, the services image without torch. Containers run on
the host's network (the engine has no bridge), Ryuk is off (its image cannot be
pulled; the engine's teardown removes every container anyway).

- the bus against a NATS container: publish, a durable consumer, deduplication;
- :class:`phalanx.devstack.containers.ControlPlane`: NATS and the four services in
  containers, and a short two-rank job run against it from the host with
  ``phalanx run``; ``phalanx status`` then shows the job completed.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from nats.aio.msg import Msg

from examples.train_gpt import SMALL
from examples.train_gpt import command as train_command
from phalanx.bus import Bus
from phalanx.contract import FaultCause, Message, RankFailed
from phalanx.contract.streams import EVENTS
from phalanx.contract.subjects import FAILED
from phalanx.devstack import images
from phalanx.devstack.containers import ControlPlane
from phalanx.devstack.natsserver import free_port

# the first test builds the images (the session fixture: minutes on a cold machine)
pytestmark = [pytest.mark.docker, pytest.mark.slow, pytest.mark.timeout(900)]


@pytest.fixture(scope="module")
def container_url(phalanx_images: dict[str, images.Built]) -> Iterator[str]:
    from testcontainers.core.container import DockerContainer

    port = free_port()
    nats = DockerContainer(images.NATS).with_kwargs(network_mode="host")
    nats.with_command(["-js", "-a", "127.0.0.1", "-p", str(port), "-sd", "/tmp/js"])
    with nats:
        deadline = time.monotonic() + 30
        while b"Server is ready" not in b"".join(nats.get_logs()):
            assert time.monotonic() < deadline, nats.get_logs()
            time.sleep(0.1)
        yield f"nats://127.0.0.1:{port}"


async def test_publish_and_durable_consume_through_testcontainers(container_url: str) -> None:
    bus = await Bus.connect(container_url, name="tc")
    got: list[str] = []

    async def handler(msg: Message, raw: Msg) -> None:
        assert isinstance(msg, RankFailed)
        got.append(msg.incident)

    bus.consume(EVENTS, "tc-consumer", [FAILED.wildcard()], handler, (RankFailed,))
    for i in range(3):
        event = RankFailed(
            job="j1",
            incident=f"tc{i}",
            worker="w1",
            rank=1,
            generation=1,
            cause=FaultCause.PROCESS_EXIT,
            fault_at=1.0,
        )
        await bus.publish(FAILED, event, job="j1", msg_id=f"tc{i}")
    await bus.publish(FAILED, event, job="j1", msg_id="tc2")  # a duplicate
    deadline = asyncio.get_running_loop().time() + 30
    while len(got) < 3:
        assert asyncio.get_running_loop().time() < deadline, got
        await asyncio.sleep(0.05)
    info = await bus.js.stream_info(EVENTS.name)
    assert info.state.messages == 3
    assert got == ["tc0", "tc1", "tc2"]
    await bus.close()


def test_a_job_runs_against_a_control_plane_in_containers(
    phalanx_images: dict[str, images.Built], tmp_path: Path
) -> None:
    with ControlPlane() as plane:
        env = {"NATS_URL": plane.url, "PHALANX_METRICS_PORT": "0"}
        train = train_command(8, tmp_path / "data", *SMALL)
        run = subprocess.run(
            [
                sys.executable,
                "-m",
                "phalanx.cli",
                "run",
                "--job",
                "tc",
                "--nproc-per-node",
                "2",
                "--",
                *train,
            ],
            env={**_host_env(), **env},
            capture_output=True,
            text=True,
            timeout=240,
        )
        assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:] + plane.logs("elasticity-planner")
        status = subprocess.run(
            [sys.executable, "-m", "phalanx.cli", "status", "tc", "--json"],
            env={**_host_env(), **env},
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert status.returncode == 0, status.stderr
        snap = json.loads(status.stdout)
        assert snap["generation"] >= 1 and snap["state"] == "ended", snap
        # the services in the containers did the work: the planner logged the plan
        assert "tc" in plane.logs("elasticity-planner")


def _host_env() -> dict[str, str]:
    import os

    return {k: v for k, v in os.environ.items() if not k.startswith(("NATS_", "PHALANX_NATS_"))}
