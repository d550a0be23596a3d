"""Whether a Docker engine answers here (testcontainers needs one; CI machines have none)."""

from __future__ import annotations

import shutil
import subprocess


def docker_available() -> tuple[bool, str]:
    """Whether a Docker engine answers, and if not, why."""
    if shutil.which("docker") is None:
        return False, "no docker client on PATH"
    try:
        out = subprocess.run(
            ["docker", "info", "--format", "{{.ServerVersion}}"], capture_output=True, text=True, timeout=10
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return False, f"docker info failed: {exc}"
    if out.returncode != 0:
        last = (out.stderr.strip().splitlines() or ["?"])[-1]
        return False, f"no Docker engine answers (`docker info`: {last})"
    return True, out.stdout.strip()
