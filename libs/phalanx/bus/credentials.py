"""The NATS login a process connects with, from its environment.

A launcher is handed its workers' logins (``PHALANX_NATS_WORKER_CREDENTIALS``) and passes each
worker its own; ``phalanx run`` may load a node's logins from a file first
(``PHALANX_NATS_ENV_FILE``). :class:`phalanx.bus.Bus` connects with ``PHALANX_NATS_USER`` /
``PHALANX_NATS_PASSWORD``. :mod:`phalanx.natsauth` writes all of these.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

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
