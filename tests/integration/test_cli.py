"""The ``phalanx`` command's own processes: ``phalanx nats`` serves and cleans up."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
from pathlib import Path

import nats

from phalanx.natsserver import free_port


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
