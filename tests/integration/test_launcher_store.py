"""The launcher without torch, and the job's store in a process of its own.

The launcher imports no torch anywhere under its package (``tests/unit/test_layering.py``
checks the imports as written; here a real launcher runs in a process where importing
torch raises). It hosts the job's rendezvous store in a child process
(``python -m phalanx.runtime.store``), started once per job, waited for until it serves,
stopped with the launcher; a store that dies under a running job ends its launcher
with the reason.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

import phalanx.launcher.store as store_mod
from phalanx.devstack.localstack import LocalStack
from phalanx.launcher.launcher import LaunchConfig, Launcher
from phalanx.launcher.store import StoreError, StoreProcess
from phalanx.telemetry import get_logger
from phalanx.worker.addr import listen_socket

ROOT = Path(__file__).resolve().parents[2]

# A worker that meets the launcher's store at the address it is given (the store greets
# it), proves a generation's secret when it is given one, and exits 0.
WORKER = textwrap.dedent(
    """
    import os
    from phalanx.runtime.comm import connect_store, generation_store
    s = connect_store(os.environ["PHALANX_STORE_ADDR"], timeout_s=30)
    if os.environ.get("SECRET"):
        g = generation_store(s, os.environ["SECRET"])
        g.set("from-" + os.environ["PHALANX_WORKER"], "here")
        assert g.get("from-" + os.environ["PHALANX_WORKER"]) == b"here"
    """
)

# The launcher's process: torch cannot be imported in it at all.
NO_TORCH_LAUNCHER = textwrap.dedent(
    """
    import asyncio, importlib, os, pkgutil, sys

    class NoTorch:
        def find_spec(self, name, path=None, target=None):
            if name == "torch" or name.startswith("torch."):
                raise ImportError(f"torch must not be imported by the launcher ({name})")
            return None

    sys.meta_path.insert(0, NoTorch())
    import phalanx.launcher
    for info in pkgutil.walk_packages(phalanx.launcher.__path__, "phalanx.launcher."):
        importlib.import_module(info.name)
    from phalanx.launcher.launcher import LaunchConfig, Launcher

    async def main() -> None:
        cfg = LaunchConfig(job="notorch", cmd=[sys.executable, "-c", os.environ["WORKER"]], nproc=1,
                           nats_url=os.environ["NATS_URL"])
        launcher = Launcher(cfg)
        try:
            await launcher.start()
            worker = launcher.workers["w0"]
            assert await asyncio.to_thread(worker.proc.wait, 60) == 0, "the worker did not meet the store"
            store = launcher.store
        finally:
            await launcher.stop()
        assert store is not None and store.proc is not None and store.proc.returncode == 0, store
        torch = sorted(m for m in sys.modules if m == "torch" or m.startswith("torch."))
        assert not torch, torch
        print("launcher ran without torch; store pid", store.pid)

    asyncio.run(main())
    """
)


@pytest.fixture(scope="module")
def planner(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalStack]:
    with LocalStack(tmp_path_factory.mktemp("stack"), services=("elasticity-planner",)) as s:
        yield s


def test_a_launcher_runs_a_job_where_torch_cannot_be_imported(planner: LocalStack) -> None:
    env = {**planner.env, "WORKER": WORKER, "PYTHONPATH": os.pathsep.join([str(ROOT / "libs"), str(ROOT)])}
    done = subprocess.run(
        [sys.executable, "-c", NO_TORCH_LAUNCHER], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "launcher ran without torch" in done.stdout


async def test_a_store_that_dies_under_a_job_ends_its_launcher(planner: LocalStack) -> None:
    # A worker that stays until it is stopped: the job is running when its store dies.
    cmd = [sys.executable, "-c", "import time; time.sleep(120)"]
    launcher = Launcher(LaunchConfig(job="storedies", cmd=cmd, nproc=1, nats_url=planner.url))
    try:
        await launcher.start()
        assert launcher.store is not None and launcher.store.pid is not None
        os.kill(launcher.store.pid, signal.SIGKILL)
        assert await launcher.wait(30) == 1
        assert launcher.removed_reason is not None
        assert "rendezvous store" in launcher.removed_reason and "-9" in launcher.removed_reason
    finally:
        await launcher.stop()
    assert all(w.proc.poll() is not None for w in launcher.workers.values())


async def test_a_store_that_cannot_start_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(store_mod, "STORE_MODULE", "phalanx.no_such_module")
    store = StoreProcess(listen_socket("127.0.0.1"), "127.0.0.1", get_logger(component="test"))
    try:
        await store.start()
        with pytest.raises(StoreError, match="ended with exit code 1 before it served"):
            await store.ready(30)
    finally:
        await store.stop()


async def test_a_store_serves_until_stopped_then_ends_cleanly() -> None:
    listener = listen_socket("127.0.0.1")
    port = listener.getsockname()[1]
    ended: list[str] = []
    store = StoreProcess(listener, "127.0.0.1", get_logger(component="test"))
    store.on_exit = ended.append
    await store.start()
    try:
        await store.ready(60)
        store.allow("gen-s3cret")  # what the launcher does for each plan
        client = subprocess.run(
            [sys.executable, "-c", WORKER],
            env={
                **os.environ,
                "PHALANX_STORE_ADDR": f"127.0.0.1:{port}",
                "PHALANX_WORKER": "w9",
                "SECRET": "gen-s3cret",
            },
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert client.returncode == 0, client.stderr
    finally:
        await store.stop()
    assert store.proc is not None and store.proc.returncode == 0
    assert not ended  # stopped, not died
