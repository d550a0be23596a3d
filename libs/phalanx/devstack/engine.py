"""A private Docker engine for tests and the deploy check, touching nothing of the host's.

The machines Phalanx is developed and tested on reach no container registry and
have no Docker engine running. This starts one of their own: Debian's ``dockerd``
(``docker.io``, installed with apt-get when missing and running as root) with

- no default bridge, no iptables rules and no IP forwarding turned on
  (``--bridge=none --iptables=false --ip-forward=false``): a container runs on the
  host's network (``--network host``) unless it joins a network made for it
  (deploy/docker-compose.yml's two, whose bridges exist until the project is brought
  down); the host's firewall and its ``net.ipv4.ip_forward`` never change, and every
  address a test uses is on loopback or inside a namespace the test made. Two such
  networks are then apart by address as long as the host does not forward (a
  container reaches another network's address only through the host's routing);
  an engine with its defaults keeps them apart with its isolation rules instead;
- its own data root, exec root, socket and pidfile under one directory, removed
  when the engine stops (also when the test that started it fails);
- the ``overlay2`` storage driver where the kernel and the data root's file system
  take it (ext4 here: builds and container starts in seconds), else ``vfs``, which
  needs nothing from the file system below it but copies every layer whole
  (``PHALANX_ENGINE_STORAGE_DRIVER`` picks one).

Use it as a context manager::

    with private_engine() as engine:
        engine.docker("info")
        env = engine.env()            # DOCKER_HOST for docker, docker-compose, testcontainers

:class:`EngineUnavailable` says why an engine cannot start here (not root, no apt,
dockerd exits): tests skip with that reason.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

DEBIAN_PACKAGES = {"dockerd": "docker.io", "docker-compose": "docker-compose", "debootstrap": "debootstrap"}
START_TIMEOUT_S = 60.0


class EngineUnavailable(RuntimeError):
    """No private engine can run here; the message says why."""


def ensure_tools(tools: Sequence[str]) -> None:
    """Install Debian's packages for ``tools`` missing from PATH (root only).

    Raises :class:`EngineUnavailable` when one cannot be had."""
    missing = [t for t in tools if _which(t) is None]
    if not missing:
        return
    if os.geteuid() != 0:
        raise EngineUnavailable(f"{', '.join(missing)} missing and not root to apt-get install them")
    if shutil.which("apt-get") is None:
        raise EngineUnavailable(f"{', '.join(missing)} missing and no apt-get here")
    packages = sorted({DEBIAN_PACKAGES.get(t, t) for t in missing})
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for cmd in (
        ["apt-get", "update", "-q"],
        ["apt-get", "install", "-y", "-q", "--no-install-recommends", *packages],
    ):
        out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
        if out.returncode != 0:
            tail = "\n".join((out.stdout + out.stderr).strip().splitlines()[-5:])
            raise EngineUnavailable(f"`{' '.join(cmd)}` failed ({out.returncode}):\n{tail}")
    still = [t for t in missing if _which(t) is None]
    if still:
        raise EngineUnavailable(f"installed {packages} but {still} still missing")


def _which(tool: str) -> str | None:
    # dockerd lives in /usr/sbin, which a non-login PATH may lack
    return shutil.which(tool) or shutil.which(tool, path="/usr/sbin:/sbin:/usr/bin")


@dataclass
class Engine:
    """A running private engine: its directory, socket and process."""

    root: Path
    proc: subprocess.Popen[bytes] | None  # None: an engine someone else runs (attach)

    @property
    def host(self) -> str:
        """``DOCKER_HOST`` for this engine."""
        return f"unix://{self.root / 'docker.sock'}"

    @classmethod
    def attach(cls, root: Path) -> Engine:
        """The engine ``python -m phalanx.devstack.engine ROOT`` runs; :meth:`stop` leaves it running."""
        engine = cls(root=root, proc=None)
        if engine.docker("version", check=False, timeout=10).returncode != 0:
            raise EngineUnavailable(f"no engine answers at {engine.host}")
        return engine

    @property
    def log(self) -> Path:
        return self.root / "dockerd.log"

    def env(self, **extra: str) -> dict[str, str]:
        """The environment for docker, docker-compose and testcontainers against this engine."""
        return {**os.environ, "DOCKER_HOST": self.host, "DOCKER_BUILDKIT": "0", **extra}

    def docker(
        self, *args: str, timeout: float = 600, check: bool = True
    ) -> subprocess.CompletedProcess[str]:
        """Run the docker CLI against this engine; raise with its output on failure when ``check``."""
        return docker_cli(*args, env=self.env(), timeout=timeout, check=check)

    def stop(self) -> None:
        """SIGTERM the engine (its containers end with it), SIGKILL after 20 s, remove its data."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        _kill_strays(self.root)
        _unmount_under(self.root)
        shutil.rmtree(self.root, ignore_errors=True)


def _unmount_under(root: Path) -> None:
    """Lazily unmount what the engine left mounted under ``root`` (overlay layers, shm,
    the netns bind mount in the exec root), deepest first, so its directory can go."""
    prefix = str(root.resolve()) + "/"
    with open("/proc/mounts") as f:
        points = [line.split()[1].encode().decode("unicode_escape") for line in f]
    for point in sorted((p for p in points if p.startswith(prefix)), key=len, reverse=True):
        subprocess.run(["umount", "-l", point], capture_output=True)


def docker_cli(
    *args: str, env: dict[str, str] | None = None, timeout: float = 600, check: bool = True
) -> subprocess.CompletedProcess[str]:
    """The docker CLI with ``env`` (default: this process's, with the legacy builder, which
    needs no BuildKit frontend image); raise with its output on failure when ``check``."""
    docker = _which("docker")
    if docker is None:
        raise EngineUnavailable("no docker client")
    env = {**os.environ, "DOCKER_BUILDKIT": "0"} if env is None else env
    out = subprocess.run([docker, *args], capture_output=True, text=True, env=env, timeout=timeout)
    if check and out.returncode != 0:
        raise RuntimeError(f"docker {' '.join(args)} exited {out.returncode}:\n{out.stdout}{out.stderr}")
    return out


def _kill_strays(root: Path) -> None:
    """containerd shims of this engine outlive a killed dockerd; end them by their root."""
    out = subprocess.run(["pgrep", "-f", str(root)], capture_output=True, text=True)
    for pid in out.stdout.split():
        if int(pid) == os.getpid():  # `python -m phalanx.devstack.engine ROOT` names the root too
            continue
        try:
            os.kill(int(pid), signal.SIGKILL)
        except (ProcessLookupError, ValueError):
            pass


def start_engine(root: Path | None = None, timeout_s: float = START_TIMEOUT_S) -> Engine:
    """Start a private dockerd under ``root`` (a new temporary directory by default):
    with overlay2, and with vfs if dockerd refuses overlay2 here."""
    chosen = os.environ.get("PHALANX_ENGINE_STORAGE_DRIVER")
    drivers = [chosen] if chosen else ["overlay2", "vfs"]
    for driver in drivers[:-1]:
        try:
            return _start(root, driver, timeout_s)
        except EngineUnavailable:
            pass
    return _start(root, drivers[-1], timeout_s)


def _start(root: Path | None, driver: str, timeout_s: float) -> Engine:
    ensure_tools(["dockerd", "docker"])
    dockerd = _which("dockerd")
    assert dockerd is not None
    # a short path: the socket's must fit a sockaddr_un (108 bytes)
    root = Path(tempfile.mkdtemp(prefix="phx-dk-", dir="/tmp")) if root is None else root
    root.mkdir(parents=True, exist_ok=True)
    cmd = [
        dockerd,
        "--bridge=none",
        "--iptables=false",
        "--ip6tables=false",
        "--ip-masq=false",
        "--ip-forward=false",
        f"--storage-driver={driver}",
        f"--data-root={root / 'data'}",
        f"--exec-root={root / 'exec'}",
        f"--pidfile={root / 'dockerd.pid'}",
        f"--host=unix://{root / 'docker.sock'}",
    ]
    log = (root / "dockerd.log").open("wb")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    engine = Engine(root=root, proc=proc)
    deadline = time.monotonic() + timeout_s
    while True:
        if proc.poll() is not None:
            tail = engine.log.read_text(errors="replace").strip().splitlines()[-5:]
            engine.stop()
            raise EngineUnavailable(f"dockerd ({driver}) exited {proc.returncode}: " + "\n".join(tail))
        if (
            engine.docker("version", "--format", "{{.Server.Version}}", check=False, timeout=10).returncode
            == 0
        ):
            return engine
        if time.monotonic() > deadline:
            engine.stop()
            raise EngineUnavailable(f"dockerd did not answer within {timeout_s:.0f} s")
        time.sleep(0.2)


@contextmanager
def private_engine() -> Iterator[Engine]:
    """A private engine for the block; stopped and its data removed afterwards."""
    engine = start_engine()
    try:
        yield engine
    finally:
        engine.stop()


def main(argv: list[str] | None = None) -> int:
    """``python -m phalanx.devstack.engine [ROOT]``: a private engine until Ctrl-C or SIGTERM.

    Prints the ``DOCKER_HOST`` to export in another shell; on the way out the engine
    stops and ``ROOT`` (default /tmp/phalanx-engine) is removed, images included."""
    import sys

    args = sys.argv[1:] if argv is None else argv
    root = Path(args[0] if args else "/tmp/phalanx-engine")
    try:
        engine = start_engine(root)
    except EngineUnavailable as exc:
        print(f"no private engine: {exc}", file=sys.stderr)
        return 1
    print(
        f"export DOCKER_HOST={engine.host}   # private dockerd, log {engine.log}; Ctrl-C stops it", flush=True
    )
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt))
    try:
        assert engine.proc is not None
        engine.proc.wait()
    except KeyboardInterrupt:
        pass
    finally:
        engine.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
