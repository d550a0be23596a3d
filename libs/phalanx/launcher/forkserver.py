"""The launcher's side of the node's fork server (:mod:`phalanx.runtime.zygote`).

:class:`ForkServer` starts the server once per job, with the training command's
interpreter and flags (so a fork runs what the command would), and asks it for
workers; each comes back as a :class:`ForkedProc`, which the launcher handles as it
handles a ``Popen`` (``pid``, ``poll``, ``wait``, ``send_signal``...). The workers
are the server's children, so the server reports their exits; a reader thread
delivers them.

The server is ready within seconds (it imports torch); until then, or when it
cannot start or said a fork is unsafe (:func:`phalanx.runtime.zygote.fork_hazard`),
:attr:`ForkServer.ready` is False and the launcher starts workers cold. A server
that dies under the job takes its workers with it (``PR_SET_PDEATHSIG``): the
launcher ends, as a lost node (:attr:`ForkServer.on_exit`).
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

from phalanx.launcher.children import die_with_parent
from phalanx.worker.pycommand import Target

ZYGOTE_MODULE = "phalanx.runtime.zygote"
ROOM_ENV, ENV_ROOM = "PHALANX_ZYGOTE_ROOM", 16384  # phalanx.runtime.zygote's (room the worker retitles into)
ROOM = "x" * 2048
MAX_LINE_BYTES = 1 << 16


class ForkedProc:
    """A worker forked by the server: a ``Popen`` lookalike whose exit the server reports."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.returncode: int | None = None
        self._done = threading.Event()

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if not self._done.wait(timeout):
            raise subprocess.TimeoutExpired(f"pid {self.pid}", timeout or 0.0)
        assert self.returncode is not None
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def exited(self, code: int) -> None:
        self.returncode = code
        self._done.set()


class ForkServerError(RuntimeError):
    """The server did not answer a request."""


class ForkServer:
    def __init__(self, target: Target, env: dict[str, str], log: Any, imports: str = "") -> None:
        self.target, self.log, self.imports = target, log, imports
        self._env = env
        self.proc: subprocess.Popen[bytes] | None = None
        self._sock: socket.socket | None = None
        self._ready = threading.Event()
        self.ready = False
        self.why = "not started"
        self.info: dict[str, Any] = {}
        self._ids = itertools.count()
        self._lock = threading.Lock()
        self._answers: dict[int, int] = {}
        self._answered = threading.Condition(self._lock)
        self._procs: dict[int, ForkedProc] = {}
        self._early: dict[int, int] = {}  # exits reported before the spawn's answer was taken
        self._closing = False
        self.on_exit: Callable[[str], None] | None = None
        """Called (on the reader thread) with why when the server dies under the job."""

    def start(self) -> None:
        """Start the server; it becomes :attr:`ready` once it has imported torch."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        t = self.target
        try:
            self.proc = subprocess.Popen(
                [
                    t.interpreter,
                    *t.flags,
                    "-m",
                    ZYGOTE_MODULE,
                    "--fd",
                    str(theirs.fileno()),
                    "--imports",
                    self.imports,
                    "--room",
                    ROOM,
                ],
                env={**self._env, ROOM_ENV: "x" * ENV_ROOM},
                stdin=subprocess.DEVNULL,
                pass_fds=(theirs.fileno(),),
                preexec_fn=die_with_parent,
            )
        except OSError as exc:
            ours.close()
            self.why = f"the fork server did not start: {exc}"
            self._ready.set()
            return
        finally:
            theirs.close()
        self._sock = ours
        threading.Thread(target=self._read, name="forkserver-reader", daemon=True).start()

    def wait_ready(self, timeout_s: float) -> bool:
        """Whether the server is ready within ``timeout_s`` (False: start workers cold)."""
        if not self._ready.wait(timeout_s):
            self.why = f"the fork server was not ready within {timeout_s:g}s"
        return self.ready

    def spawn(
        self,
        args: list[str],
        env: dict[str, str],
        *,
        mode: Literal["unmodified", "plain"],
        log: Path | None,
        cwd: str,
        timeout_s: float = 10.0,
    ) -> ForkedProc:
        """Fork a worker running ``args`` (Python's arguments after the flags) in ``mode``."""
        if not self.ready or self._sock is None:
            raise ForkServerError(f"the fork server is not ready: {self.why}")
        rid = next(self._ids)
        req = {"op": "spawn", "id": rid, "args": args, "env": env, "mode": mode, "cwd": cwd}
        req["log"] = str(log) if log is not None else None
        self._sock.sendall(json.dumps(req).encode() + b"\n")
        deadline = time.monotonic() + timeout_s
        with self._answered:
            while rid not in self._answers:
                left = deadline - time.monotonic()
                if left <= 0 or not self.ready:
                    raise ForkServerError(f"the fork server did not fork within {timeout_s:g}s: {self.why}")
                self._answered.wait(left)
            pid = self._answers.pop(rid)
            proc = ForkedProc(pid)
            if pid in self._early:
                proc.exited(self._early.pop(pid))
            else:
                self._procs[pid] = proc
        return proc

    def _read(self) -> None:
        assert self._sock is not None
        f = self._sock.makefile("rb")
        try:
            for line in iter(lambda: f.readline(MAX_LINE_BYTES), b""):
                self._take(json.loads(line))
        except (OSError, ValueError) as exc:
            self.why = f"the fork server's answer could not be read: {exc!r}"
        self._lost()

    def _take(self, msg: dict[str, Any]) -> None:
        if "ready" in msg:
            self.ready = bool(msg["ready"])
            self.why = str(msg.get("why", ""))
            self.info = msg
            self._ready.set()
            if self.ready:
                self.log.info("fork_server_ready", **{k: v for k, v in msg.items() if k != "ready"})
            else:
                self.log.warning("fork_server_unsafe", why=self.why)
            return
        with self._answered:
            if "exit" in msg:
                pid, code = int(msg["exit"]), int(msg["code"])
                proc = self._procs.pop(pid, None)
                if proc is None:
                    self._early[pid] = code
                else:
                    proc.exited(code)
            else:
                self._answers[int(msg["id"])] = int(msg["pid"])
                self._answered.notify_all()

    def _lost(self) -> None:
        """The server ended: its workers die with it (``PR_SET_PDEATHSIG``)."""
        was_ready = self.ready
        with self._answered:
            self.ready = False
            self._answered.notify_all()
            procs, self._procs = list(self._procs.values()), {}
        self._ready.set()
        for p in procs:
            p.exited(-signal.SIGKILL)
        rc = self.proc.wait() if self.proc is not None else None
        if not self._closing and was_ready:
            self.why = (
                f"the fork server (pid {self.proc.pid if self.proc else '?'}) ended with exit code {rc}"
            )
            self.log.error("fork_server_exited", returncode=rc)
            if self.on_exit is not None:
                self.on_exit(self.why)

    def close(self, grace_s: float = 2.0) -> None:
        """End the server (its workers are stopped first, by the launcher)."""
        self._closing = True
        if self._sock is not None:
            with contextlib.suppress(OSError):
                self._sock.shutdown(socket.SHUT_RDWR)
            self._sock.close()
        if self.proc is not None:
            try:
                self.proc.wait(grace_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
