"""A throwaway Phalanx control plane in containers, for a user's integration tests.

NATS (JetStream) and the four services, each a container started through
testcontainers from Phalanx's images (:mod:`phalanx.devstack.images`), on the
host's network with NATS on a free loopback port. A test runs its job against
:attr:`ControlPlane.url` (``phalanx run`` on the host, or a job container)::

    with ControlPlane() as plane:
        subprocess.run(["phalanx", "run", "--nproc-per-node", "2", "--", "python", "train.py"],
                       env={**os.environ, "NATS_URL": plane.url}, check=True)

``DOCKER_HOST`` names the engine. Ryuk, testcontainers' reaper, is an image pulled
from Docker Hub; where none can be pulled set ``TESTCONTAINERS_RYUK_DISABLED=true``:
:meth:`ControlPlane.stop` removes every container it started, also when a start fails.
NATS runs without authorization here: a throwaway plane on loopback for one test.
"""

from __future__ import annotations

import secrets
import time
from types import TracebackType
from typing import TYPE_CHECKING, Self

from phalanx.devstack.images import NATS, SERVICES
from phalanx.devstack.natsserver import free_port

if TYPE_CHECKING:
    from testcontainers.core.container import DockerContainer

SERVICE_MODULES = {
    "failure-detector": "failure_detector",
    "scheduler-signal": "scheduler_signal",
    "elasticity-planner": "elasticity_planner",
    "state-replication": "state_replication",
}


class ControlPlane:
    """NATS and the four services in containers; :attr:`url` once started."""

    def __init__(self, services_image: str = SERVICES, nats_image: str = NATS, start_timeout_s: float = 90.0):
        self.services_image = services_image
        self.nats_image = nats_image
        self.start_timeout_s = start_timeout_s
        self.port = free_port()
        self.keeper_key = secrets.token_hex(32)  # this plane's keepers' cluster key
        self.containers: dict[str, DockerContainer] = {}

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"

    def start(self) -> Self:
        """Start NATS, then the services, and wait until each answers its health check."""
        from testcontainers.core.container import DockerContainer

        try:
            monitor = free_port()
            nats = DockerContainer(self.nats_image).with_kwargs(network_mode="host")
            nats.with_command(
                ["-js", "-a", "127.0.0.1", "-p", str(self.port), "-m", str(monitor), "-sd", "/tmp/js"]
            )
            self.containers["nats"] = nats.start()
            self._until_healthy("nats", ["python3", "-c", _HEALTHZ, f"http://127.0.0.1:{monitor}/healthz"])
            for name, module in SERVICE_MODULES.items():
                svc = DockerContainer(self.services_image).with_kwargs(network_mode="host")
                svc.with_command(["python", "-m", f"phalanx.services.{module}"])
                svc.with_envs(NATS_URL=self.url, PHALANX_METRICS_ENABLED="0", OTEL_SERVICE_NAME=name)
                if name == "state-replication":
                    svc.with_env("PHALANX_KEEPER_KEY", self.keeper_key)
                self.containers[name] = svc.start()
            for name in SERVICE_MODULES:
                self._until_healthy(name, ["phalanx", "health", name])
        except BaseException:
            self.stop()
            raise
        return self

    def _until_healthy(self, name: str, check: list[str]) -> None:
        container = self.containers[name]
        deadline = time.monotonic() + self.start_timeout_s
        while True:
            state = container.get_wrapped_container()
            state.reload()
            code, output = container.exec(check) if state.status == "running" else (None, b"exited")
            if code == 0:
                return
            if state.status != "running" or time.monotonic() > deadline:
                out, err = container.get_logs()
                tail = "\n".join((out + err).decode(errors="replace").strip().splitlines()[-20:])
                raise RuntimeError(
                    f"{name} ({state.status}) did not pass its health check in {self.start_timeout_s:.0f} s: "
                    f"{output.decode(errors='replace').strip()}\n{tail}"
                )
            time.sleep(0.5)

    def logs(self, name: str) -> str:
        """A container's output so far (stdout and stderr)."""
        out, err = self.containers[name].get_logs()
        return (out + err).decode(errors="replace")

    def stop(self) -> None:
        """Remove every container started, the services before NATS."""
        for name in reversed(list(self.containers)):
            self.containers.pop(name).stop()

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()


_HEALTHZ = "import sys, urllib.request; urllib.request.urlopen(sys.argv[1], timeout=2)"
