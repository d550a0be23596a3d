"""The NATS login a process connects with, from its environment.

A launcher is handed its workers' logins (``PHALANX_NATS_WORKER_CREDENTIALS``) and passes each
worker its own; ``phalanx run`` may load a node's logins from a file first
(``PHALANX_NATS_ENV_FILE``). :class:`phalanx.bus.Bus` connects with ``PHALANX_NATS_USER`` /
``PHALANX_NATS_PASSWORD``. :mod:`phalanx.natsauth` writes all of these.

A control plane this user started on this machine (``phalanx up``, ``phalanx run``'s private
one) enforces logins too, and leaves them where only this user can read them
(:class:`LocalLogins`: ``~/.phalanx/logins/<host>-<port>/``, mode 0700, files 0600):
``admin.env`` for the CLI, ``run.env`` for ``phalanx run`` (the launcher's login and its
ranks'). A client with no login of its own takes it from there, so another local user,
who cannot read them, is refused by the server.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import stat
from collections.abc import Mapping
from pathlib import Path
from urllib.parse import urlsplit

from phalanx.bus.auth import ENV_NATS_PASSWORD, ENV_NATS_USER

# What a launcher hands its workers (phalanx.launcher.launcher): per-worker users, and
# the one user of every worker not listed there.
ENV_WORKER_CREDENTIALS = "PHALANX_NATS_WORKER_CREDENTIALS"
ENV_RANK_USER = "PHALANX_NATS_RANK_USER"
ENV_RANK_PASSWORD = "PHALANX_NATS_RANK_PASSWORD"
# A file of KEY=value lines (launcher-<job>-<node>.env) that ``phalanx run`` loads
# into its environment first: one node's logins, where a deployment can hand a pod
# a file chosen by its index but not environment variables (Kubernetes Indexed Jobs).
ENV_NATS_ENV_FILE = "PHALANX_NATS_ENV_FILE"
# Where local control planes leave their logins (LocalLogins), default ~/.phalanx/logins.
ENV_LOGINS_DIR = "PHALANX_LOGINS_DIR"


def worker_credentials(spec: str | None, worker: str) -> dict[str, str]:
    """``worker``'s login from a launcher's ``PHALANX_NATS_WORKER_CREDENTIALS``.

    ``spec`` is JSON, ``{"<worker>": {"user": ..., "password": ...}, ...}``
    (:meth:`NatsAuth.launcher_env` writes it). Empty for no spec or a worker not in
    it (it then logs in as the launcher's ``PHALANX_NATS_RANK_USER``, if any).
    """
    if not spec:
        return {}
    try:
        table = json.loads(spec)
        entry = table.get(worker) if isinstance(table, dict) else None
        if entry is None:
            return {}
        return {ENV_NATS_USER: str(entry["user"]), ENV_NATS_PASSWORD: str(entry["password"])}
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise ValueError(
            f"{ENV_WORKER_CREDENTIALS} is not a JSON object of worker -> {{user, password}}: {exc!r}"
        ) from None


def read_env_file(path: str | os.PathLike[str]) -> dict[str, str]:
    """The ``KEY=value`` lines of ``path`` as :meth:`NatsAuth.write_env_files` writes
    them (values taken as they are, no quoting; blank lines and ``#`` lines skipped)."""
    out: dict[str, str] = {}
    for n, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        key, sep, value = line.partition("=")
        if not sep or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", key):
            raise ValueError(f"{path}:{n}: not a KEY=value line")
        out[key] = value
    return out


class LocalLogins:
    """The logins of a local control plane at ``url``, kept for the user who started it.

    ``PHALANX_LOGINS_DIR`` moves the base directory (default ``~/.phalanx/logins``). A
    directory or file that is a symlink, not this user's own, or open to its group or
    others is never read (a login planted by another user would be someone else's).
    """

    def __init__(self, url: str) -> None:
        base = Path(os.environ.get(ENV_LOGINS_DIR) or Path.home() / ".phalanx" / "logins")
        parts = urlsplit(url.split(",")[0].strip())
        self.dir = base / f"{parts.hostname or '127.0.0.1'}-{parts.port or 4222}"

    def write(self, files: Mapping[str, Mapping[str, str]]) -> None:
        """Write ``<name>.env`` for each of ``files`` (name -> variables), replacing any."""
        for d in (self.dir.parent, self.dir):
            d.mkdir(mode=0o700, parents=True, exist_ok=True)
            _require_private(d)
        for name, env in files.items():
            path = self.dir / f"{name}.env"
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write("".join(f"{k}={v}\n" for k, v in env.items()))

    def read(self, name: str) -> dict[str, str]:
        """``<name>.env``, or nothing when there is none; PermissionError when it is
        there but not this user's alone."""
        path = self.dir / f"{name}.env"
        try:
            _require_private(self.dir)
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
        except FileNotFoundError:
            return {}
        except PermissionError:
            raise
        except OSError as exc:  # ELOOP: a symlink
            raise PermissionError(f"{path} is not this user's alone: {exc.strerror}") from None
        with os.fdopen(fd) as f:
            _require_private(path, os.fstat(f.fileno()))
            text = f.read()
        out: dict[str, str] = {}
        for line in text.splitlines():
            key, sep, value = line.partition("=")
            if sep and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", key):
                out[key] = value
        return out

    def remove(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)


def _require_private(path: Path, st: os.stat_result | None = None) -> None:
    """PermissionError unless ``path`` is this user's own, not a symlink, and closed to others."""
    st = st or os.lstat(path)
    if stat.S_ISLNK(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o077:
        raise PermissionError(
            f"{path} is not this user's alone (uid {st.st_uid}, mode {stat.filemode(st.st_mode)}): not used"
        )
