"""Who the processes of a local stack log in as, when its nats-server enforces users.

:class:`StackUsers` holds the stack's :class:`~phalanx.natsauth.NatsAuth` (role-wide
users, random passwords) and hands each process its role's login; with none (auth
off) every login is empty. :meth:`StackUsers.publish` leaves the logins for the user
who started the stack (:class:`~phalanx.bus.credentials.LocalLogins`), which is how
``phalanx up`` and ``phalanx run``'s private control plane let that user's own
commands in and nobody else's.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

from phalanx.bus.auth import ENV_NATS_PASSWORD, ENV_NATS_USER
from phalanx.bus.credentials import ENV_RANK_PASSWORD, ENV_RANK_USER, LocalLogins
from phalanx.contract.permissions import ROLE_OF_SERVICE
from phalanx.natsauth import NatsAuth


class StackUsers:
    def __init__(self, auth: NatsAuth | None = None) -> None:
        self.auth = auth
        self.logins: LocalLogins | None = None  # once published

    def env(self, role: str) -> dict[str, str]:
        """The login of a process of ``role`` (nothing with auth off)."""
        return self.auth.env(role) if self.auth is not None else {}

    def run_env(self) -> dict[str, str]:
        """The logins of ``phalanx run``: the launcher's own, and the one it hands its ranks."""
        out = self.env("launcher")
        rank = self.env("rank")
        if rank:
            out[ENV_RANK_USER] = rank[ENV_NATS_USER]
            out[ENV_RANK_PASSWORD] = rank[ENV_NATS_PASSWORD]
        return out

    @contextlib.contextmanager
    def credentials(self, role: str) -> Iterator[None]:
        """This process's environment holds ``role``'s login while Bus.connect reads it."""
        saved = {k: os.environ.get(k) for k in (ENV_NATS_USER, ENV_NATS_PASSWORD)}
        os.environ.update(self.env(role))
        try:
            yield
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v

    def publish(self, url: str) -> None:
        """Leave the logins of the server at ``url`` for this user: ``admin`` (the CLI's),
        ``run`` and each service's role."""
        if self.auth is None:
            return
        self.logins = LocalLogins(url)
        services = {role: self.env(role) for role in ROLE_OF_SERVICE.values()}
        self.logins.write({**services, "admin": self.env("admin"), "run": self.run_env()})

    def withdraw(self) -> None:
        if self.logins is not None:
            self.logins.remove()
            self.logins = None
