"""The ``phalanx`` command's own processes: ``phalanx nats`` serves and cleans up;
``phalanx run`` fails clearly, changing nothing, when it cannot join its job."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import nats
from nats.aio.msg import Msg

from phalanx.bus import Bus
from phalanx.contract import JobSpec, NodeJoined, decode
from phalanx.contract.streams import JOBS_BUCKET
from phalanx.contract.subjects import JOB_SPEC, JOINED
from phalanx.devstack.natsserver import free_port
from phalanx.service import ping


def _port_open(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


async def test_phalanx_nats_serves_until_sigterm_and_stops_its_server(tmp_path: Path) -> None:
    port = free_port()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "phalanx.cli",
            "nats",
            "--port",
            str(port),
            "--store",
            str(tmp_path / "store"),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        url = proc.stdout.readline().strip()  # printed once the server is ready
        assert url == f"nats://127.0.0.1:{port}"
        nc = await nats.connect(url)
        assert nc.is_connected
        await nc.close()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
        assert not _port_open(port), "the nats-server outlived `phalanx nats`"
    finally:
        if proc.poll() is None:
            proc.kill()


def _phalanx_run(url: str, *args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    """``phalanx run`` as an operator types it; the training command never starts here."""
    argv = [sys.executable, "-m", "phalanx.cli", "run", *args, "--", sys.executable, "-c", "pass"]
    endpoint = url.split("://", 1)[1]
    return subprocess.run(
        [*argv[:4], "--rdzv-endpoint", endpoint, *argv[4:]], capture_output=True, text=True, timeout=timeout
    )


def test_phalanx_run_against_no_server_fails_within_seconds_saying_what_to_start() -> None:
    """NATS_URL where nothing listens: a clear message and exit 2, well inside 10 s
    (the subprocess timeout is the bound; nats.py alone would retry forever)."""
    port = free_port()  # nothing listens on it
    done = subprocess.run(
        [sys.executable, "-m", "phalanx.cli", "run", "--nproc", "1", "--", sys.executable, "-c", "pass"],
        env={**os.environ, "NATS_URL": f"nats://127.0.0.1:{port}"},
        capture_output=True,
        text=True,
        timeout=10,
    )
    assert done.returncode == 2, done.stderr
    assert f"no NATS server at 127.0.0.1:{port}" in done.stderr and "phalanx up" in done.stderr
    assert done.stderr.count("\n") == 1, done.stderr  # one line, no traceback, no retry noise


async def test_phalanx_run_without_a_planner_fails_with_what_to_start(nats_url: str) -> None:
    done = _phalanx_run(nats_url, "--nproc", "1", "--job", "lonely", "--join-timeout", "2")
    assert done.returncode == 2
    assert "no elasticity-planner answered" in done.stderr and "phalanx service" in done.stderr


async def test_a_node_that_disagrees_with_the_job_is_refused_and_changes_nothing(
    nats_url: str, bus: Bus, tmp_path: Path
) -> None:
    log = open(tmp_path / "services.log", "wb")
    planner, detector = (
        subprocess.Popen(
            [sys.executable, "-m", "phalanx.cli", "service", name],
            env={**os.environ, "NATS_URL": nats_url},
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        for name in ("elasticity-planner", "failure-detector")
    )
    try:
        await _until_healthy(bus, "elasticity-planner", planner)
        await _until_healthy(bus, "failure-detector", detector)
        # node a is in the job (waiting for a second node), with a global batch of 32
        answers: asyncio.Queue[NodeJoined] = asyncio.Queue()

        async def on_answer(raw: Msg) -> None:
            answers.put_nowait(decode(raw.data, raw.headers, NodeJoined))

        await bus.nc.subscribe(JOINED.format(job="mn"), cb=on_answer)
        spec = JobSpec(job="mn", node="a", launcher="La", workers=["a-w0"], ranks=1, global_batch=32, min_nodes=2, max_nodes=2)  # fmt: skip
        await bus.publish(JOB_SPEC, spec, job="mn", msg_id="spec-a")
        assert (await asyncio.wait_for(answers.get(), 15)).accepted
        kv = await bus.js.key_value(JOBS_BUCKET)
        before = (await kv.get("mn.plan")).revision
        args = [
            "--nnodes",
            "2",
            "--node-id",
            "b",
            "--nproc-per-node",
            "1",
            "--job",
            "mn",
            "--global-batch",
            "16",
        ]
        done = await asyncio.to_thread(_phalanx_run, nats_url, *args)
        assert done.returncode == 2, done.stderr
        assert "refused node 'b'" in done.stderr and "global_batch=16 (the job has 32)" in done.stderr
        refusal = await asyncio.wait_for(answers.get(), 15)
        assert not refusal.accepted and not refusal.retry  # settings never change: no use asking again
        assert (await kv.get("mn.plan")).revision == before  # the job's record did not move
    finally:
        for proc in (planner, detector):
            proc.terminate()
            proc.wait(30)
        log.close()


async def _until_healthy(
    bus: Bus, service: str, proc: subprocess.Popen[bytes], timeout_s: float = 60
) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while True:
        assert proc.poll() is None, f"{service} exited with {proc.returncode}"
        try:
            await ping(bus, service, timeout=1.0)
            return
        except Exception:
            if asyncio.get_running_loop().time() > deadline:
                raise
            await asyncio.sleep(0.2)
