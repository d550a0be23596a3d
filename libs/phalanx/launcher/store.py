"""The job's rendezvous store on this node, hosted by a process of its own.

A store hosted by a rank would die with it, so the launcher hosts it; but the store
is torch's ``TCPStore``, and the launcher imports no torch (it starts in milliseconds
beside the ranks). So the launcher binds the store's socket itself (its address goes
into the join before anything else), and hands it to one child process,
``python -m phalanx.runtime.store``, started once per job and stopped with it:

- started at once, so that its torch import overlaps the join;
- ready when it says so (a ``ready <port>`` line on its stdout), never slept on: the
  launcher starts no worker before;
- told each generation it serves (:meth:`StoreProcess.allow`: a line on its stdin,
  written before the plan is handed to a rank): the store serves no client that cannot
  prove the generation's secret (:mod:`phalanx.runtime.storeserver`);
- it ends when the launcher closes its stdin (or dies: ``PR_SET_PDEATHSIG`` and end
  of file both); any other end is a death, reported (:attr:`StoreProcess.on_exit`).
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import sys
import time
from collections.abc import Callable
from typing import Any

from phalanx.launcher.children import die_with_parent

STORE_MODULE = "phalanx.runtime.store"  # run by name: nothing of torch is imported here


class StoreError(RuntimeError):
    """The store process ended, or said nothing, before it served."""


class StoreProcess:
    def __init__(self, listener: socket.socket, host: str, log: Any) -> None:
        self.host, self.log = host, log
        self._listener = listener
        self.port = int(listener.getsockname()[1])
        self.proc: asyncio.subprocess.Process | None = None
        self._ready = False
        self._stopping = False
        self._watch: asyncio.Task[None] | None = None
        self.on_exit: Callable[[str], None] | None = None
        """Called with why when the store ends while the launcher still needs it."""

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    async def start(self) -> None:
        """Start the store process; the listening socket is its from now on (closed here)."""
        fd = self._listener.fileno()
        try:
            self.proc = await asyncio.create_subprocess_exec(
                sys.executable,
                "-m",
                STORE_MODULE,
                "--fd",
                str(fd),
                "--host",
                self.host,
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
                pass_fds=(fd,),
                preexec_fn=die_with_parent,
            )
        finally:
            self._listener.close()

    async def ready(self, timeout_s: float) -> None:
        """Return once the store serves; :class:`StoreError` if it ends first or does not
        say so within ``timeout_s``. From then on its end is watched."""
        proc = self.proc
        assert proc is not None and proc.stdout is not None
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                line = await asyncio.wait_for(proc.stdout.readline(), max(0.0, deadline - time.monotonic()))
            except TimeoutError:
                raise StoreError(
                    f"the rendezvous store (pid {proc.pid}) did not serve within {timeout_s:g}s"
                ) from None
            if not line:
                rc = await proc.wait()
                raise StoreError(
                    f"the rendezvous store (pid {proc.pid}) ended with exit code {rc} before it served"
                )
            if line.startswith(b"ready "):
                break
            self.log.info("store_output", line=line.decode(errors="replace").rstrip()[:500])
        self._ready = True
        self.log.info("store_ready", pid=proc.pid, port=self.port)
        self._watch = asyncio.create_task(self._watch_exit(proc), name="store-watch")

    def allow(self, secret: str) -> None:
        """Serve the generation of ``secret`` from now on (a line on the store's stdin;
        the pipe's buffer takes it at once, and a proof arriving first waits for it)."""
        proc = self.proc
        if not secret or proc is None or proc.stdin is None or proc.stdin.is_closing():
            return
        if not secret.replace("-", "").replace("_", "").isalnum() or len(secret) > 64:
            raise ValueError("a store secret is up to 64 of [A-Za-z0-9_-]")
        proc.stdin.write(f"allow {secret}\n".encode())

    async def _watch_exit(self, proc: asyncio.subprocess.Process) -> None:
        rc = await proc.wait()
        if self._stopping:
            return
        why = f"the job's rendezvous store on this node (pid {proc.pid}) ended with exit code {rc}"
        self.log.error("store_exited", pid=proc.pid, returncode=rc)
        if self.on_exit is not None:
            self.on_exit(why)

    async def stop(self, grace_s: float = 2.0) -> None:
        """End the store: told to (end of file on its stdin) once it serves, killed before
        that or after ``grace_s``."""
        self._stopping = True
        proc = self.proc
        if proc is None:
            return
        if proc.returncode is None:
            if self._ready and proc.stdin is not None:
                proc.stdin.close()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(proc.wait(), grace_s)
            if proc.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
        await proc.wait()
        if self._watch is not None:
            await self._watch
