"""The node's fork server: workers that start with torch already imported.

Starting a worker costs an interpreter and ``import torch`` (1.5-3 s here, more on
a loaded node), and the first DDP wrap or optimizer imports ``torch._dynamo`` (up
to 4 s more): that is most of a torchrun restart's downtime, and of a joiner's
start. The launcher therefore starts one process per job and node,
``PYTHON [FLAGS] -m phalanx.runtime.zygote --fd N`` (the training command's own
interpreter and flags), which imports torch, ``torch.distributed``, DDP,
``torch._dynamo``, DCP, the data loader and Phalanx's worker side -- without running
any of it: no thread pool is started, no device is touched -- and then forks a
worker on each request (:class:`~phalanx.launcher.forkserver.ForkServer` is the
launcher's side). A fork takes a few milliseconds; the worker shares the imported
pages with the server until it writes them.

The server collects no garbage and freezes what it imported (``gc.freeze``) before it
forks: a worker's collector never walks those objects, so it neither copies every
shared page nor pauses for hundreds of milliseconds (a heartbeat's silence) in its
first full collection.

In the forked worker, before the script runs: the signal handlers are Python's
defaults again, stdin is ``/dev/null`` and stdout/stderr the worker's log, the
environment is the worker's (``os.environ`` replaced), the working directory is the
command's, ``random`` (and numpy's global generator, if imported) are reseeded from
the OS as in a fresh interpreter, and torch's intra-op threads follow the worker's
``OMP_NUM_THREADS``. It then runs the script (:func:`phalanx.worker.pycommand.run_target`),
through :mod:`phalanx.runtime.unmodified` for an unmodified torchrun script, and
exits through the interpreter's normal finalization (``atexit``, thread joins).

When a fork is not safe, the server says so instead of ``ready`` and the launcher
starts every worker cold (a plain process, as before):

- a device was initialized (CUDA) while importing: forked children cannot use it;
- a Python thread other than the main one runs (it may hold a lock the child needs).

Native pools are safe here: torch's OpenMP pool starts on the first parallel
region, which the server never runs, and OpenBLAS (numpy's; one thread per core
unless ``OMP_NUM_THREADS``/``OPENBLAS_NUM_THREADS`` say otherwise) re-initializes
itself in the child through its ``pthread_atfork`` handler. Differences from a
fresh interpreter that remain: ``PYTHONHASHSEED`` (string hashing) is the server's
for every worker, and modules are imported before the environment is the
worker's, so an import that reads a variable at import time reads the launcher's.

Protocol (JSON lines on the socket the launcher passed; the launcher is its only
client): the server sends ``{"ready": true, "pid", "threads", "import_s"}`` once, or
``{"ready": false, "why"}``; for each ``{"op": "spawn", "id", "env", "args", "mode",
"log", "cwd"}`` it answers ``{"id", "pid"}``, and ``{"exit": pid, "code": rc}`` when a
worker ends (``rc`` negative for a signal, as ``Popen.returncode``). It ends when the
socket closes; its workers die with it (``PR_SET_PDEATHSIG``), and it with the launcher.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import gc
import importlib
import json
import os
import random
import selectors
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

ROOM_ENV = "PHALANX_ZYGOTE_ROOM"
"""The launcher starts the server with room in its command line (a ``--room`` argument)
and environment (this variable), into which a forked worker writes its own (:func:`retitle`)."""
MAX_REQUEST_BYTES = 4 << 20
"""A request line longer than this ends the server (its one client never sends one)."""
WARM_MODULES = (
    "torch",
    "torch.distributed",
    "torch.nn.parallel",
    "torch._dynamo",  # the first DDP wrap or optimizer imports it: seconds
    "torch.distributed.checkpoint",
    "torch.utils.data",
    "torch.optim",
    "phalanx.runtime.unmodified",
    "phalanx.runtime.job",
)
OPTIONAL_MODULES = ("numpy",)


def warm_up(extra: str = "") -> float:
    """Import what workers would; returns the seconds it took."""
    t0 = time.perf_counter()
    for name in WARM_MODULES:
        importlib.import_module(name)
    for name in (*OPTIONAL_MODULES, *(m.strip() for m in extra.split(",") if m.strip())):
        with contextlib.suppress(ImportError):
            importlib.import_module(name)
    return time.perf_counter() - t0


def fork_hazard() -> str | None:
    """Why forking this process is unsafe now, or None."""
    import torch

    if torch.cuda.is_initialized():
        return "CUDA was initialized while importing: forked workers could not use it"
    others = [t.name for t in threading.enumerate() if t is not threading.main_thread()]
    if others:
        return f"Python threads run in the fork server ({', '.join(others)})"
    return None


def thread_count() -> int:
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return threading.active_count()


class Server:
    """The request loop; :meth:`serve` returns in a forked child only: what it must run."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.pid = os.getpid()  # the server's: a child whose parent is another was orphaned
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._sel = selectors.DefaultSelector()
        self._buf = b""

    def send(self, msg: dict[str, Any]) -> None:
        self.sock.sendall(json.dumps(msg).encode() + b"\n")

    def serve(self) -> Callable[[], int] | None:
        signal.set_wakeup_fd(self._wake_w)
        signal.signal(signal.SIGCHLD, lambda signum, frame: None)  # wakes the selector
        self._sel.register(self.sock, selectors.EVENT_READ)
        self._sel.register(self._wake_r, selectors.EVENT_READ)
        while True:
            for key, _ in self._sel.select():
                if key.fileobj is self.sock:
                    data = self.sock.recv(65536)
                    if not data:
                        return None  # the launcher is gone or done
                    self._buf += data
                    if len(self._buf) > MAX_REQUEST_BYTES:
                        raise ValueError("fork server: request too long")
                    while b"\n" in self._buf:
                        line, self._buf = self._buf.split(b"\n", 1)
                        child = self._spawn(json.loads(line))
                        if child is not None:
                            return child
                else:
                    with contextlib.suppress(BlockingIOError):
                        os.read(self._wake_r, 4096)
                    self._reap()

    def _reap(self) -> None:
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            self.send({"exit": pid, "code": os.waitstatus_to_exitcode(status)})

    def _spawn(self, req: dict[str, Any]) -> Callable[[], int] | None:
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            return lambda: self._child(req)
        self.send({"id": req["id"], "pid": pid})
        return None

    def _child(self, req: dict[str, Any]) -> int:
        """In the forked worker: become it (the module doc), then run the script."""
        from phalanx.launcher.children import die_with_parent

        signal.set_wakeup_fd(-1)
        for sig in (signal.SIGCHLD, signal.SIGTERM, signal.SIGHUP):
            signal.signal(sig, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        gc.enable()
        self._sel.close()
        self.sock.close()
        os.close(self._wake_r)
        os.close(self._wake_w)
        die_with_parent()
        if os.getppid() != self.pid:  # the server died before PDEATHSIG was set
            os._exit(1)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.close(null)
        if req.get("log"):
            out = os.open(req["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
            os.dup2(out, 1)
            os.dup2(out, 2)
            os.close(out)
        os.chdir(req["cwd"])
        os.environ.clear()
        os.environ.update(req["env"])
        retitle([sys.executable, *req["args"]], req["env"])
        _reseed()
        _threads_from_env()
        from phalanx.worker.pycommand import parse, run_target

        target = parse([sys.executable, *req["args"]])
        if target is None:
            print(f"phalanx fork server: cannot run {req['args']}", file=sys.stderr)
            return 2
        if req.get("mode") == "unmodified":
            from phalanx.runtime.unmodified import run

            return run(target, lambda env: retitle([sys.executable, *req["args"]], env))
        return run_target(target).code


def retitle(argv: list[str], env: dict[str, str]) -> bool:
    """Make ``/proc/<pid>/cmdline`` and ``environ`` show the worker, not the server: what
    ``ps``, ``pgrep -f train.py`` and tools reading a process's environment see.

    A process cannot move those areas without ``CAP_SYS_RESOURCE``, so the server was
    started with room in both, and the worker writes its own over them in place (as
    ``setproctitle`` does): the command line as one string, its last byte left non-zero
    so that the kernel reads it as a title; the environment as ``NAME=value`` entries,
    zero-padded. Nothing references the old strings any more (``os.environ`` was
    replaced through ``putenv``, ``sys.argv`` is Python's copy). False when they do not fit.
    """
    try:
        fields = open("/proc/self/stat").read().rsplit(")", 1)[1].split()
        arg_start, arg_end, env_start, env_end = (int(x) for x in fields[45:49])
    except (OSError, ValueError, IndexError):
        return False
    title = " ".join(argv).encode(errors="replace")[: arg_end - arg_start - 2] + b"\0"
    entries = b"".join(f"{k}={v}".encode(errors="replace") + b"\0" for k, v in env.items())
    if len(entries) > env_end - env_start:
        return False
    ctypes.memmove(arg_start, title.ljust(arg_end - arg_start - 1, b"\0") + b" ", arg_end - arg_start)
    ctypes.memmove(env_start, entries.ljust(env_end - env_start, b"\0"), env_end - env_start)
    return True


def _reseed() -> None:
    random.seed()
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        numpy.random.seed()


def _threads_from_env() -> None:
    n = os.environ.get("OMP_NUM_THREADS", "")
    if n.isdigit() and int(n) > 0:
        import torch

        if torch.get_num_threads() != int(n):
            torch.set_num_threads(int(n))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m phalanx.runtime.zygote", description="The fork server.")
    parser.add_argument("--fd", type=int, required=True, help="the socket to the launcher, inherited")
    parser.add_argument("--imports", default="", help="more modules to import (PHALANX_WARM_IMPORTS)")
    parser.add_argument("--room", default="", help="room for a worker's command line (retitle)")
    args = parser.parse_args(argv)
    os.environ.pop(ROOM_ENV, None)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the launcher's; workers get it themselves
    # As the gc module advises for fork without exec: no collection here (no freed holes
    # in the pages workers share), everything imported frozen out of the collector's
    # reach before the first fork, collection again in each worker. A worker's collector
    # then never walks the server's objects: no copy-on-write of every shared page, no
    # pause of hundreds of milliseconds in a worker's first full collection.
    gc.disable()
    sock = socket.socket(fileno=args.fd)
    server = Server(sock)
    try:
        import_s = warm_up(args.imports)
    except Exception as exc:
        server.send({"ready": False, "why": f"warm imports failed: {exc!r}"})
        return 1
    why = fork_hazard()
    if why is not None:
        server.send({"ready": False, "why": why})
        return 1
    gc.freeze()
    server.send(
        {"ready": True, "pid": os.getpid(), "threads": thread_count(), "import_s": round(import_s, 3)}
    )
    child = server.serve()
    if child is None:
        return 0
    return child()


if __name__ == "__main__":
    sys.exit(main())
