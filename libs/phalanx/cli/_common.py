"""What the ``phalanx`` commands share: errors, settings, and finding the control plane."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Iterable
from urllib.parse import urlsplit

import click
from rich.console import Console

from phalanx.bus import Bus
from phalanx.bus.auth import ENV_NATS_USER
from phalanx.bus.credentials import LocalLogins
from phalanx.bus.probe import Unreachable, probe
from phalanx.settings import CliSettings, PhalanxSettings, SettingsError, load

console = Console(highlight=False, soft_wrap=True)  # one-line messages stay one line
err_console = Console(stderr=True, highlight=False, soft_wrap=True)

REQUIRED_SERVICES = ("elasticity-planner", "failure-detector")
"""Without these a job cannot start or recover; the other two only add elasticity signals
and checkpoint tiers."""


class Failed(click.ClickException):
    """A command that cannot go on: one line on stderr, ``phalanx <command>: <why>``."""

    def __init__(self, message: str, code: int = 2) -> None:
        super().__init__(message)
        self.exit_code = code  # type: ignore[misc]  # click declares it on the class
        ctx = click.get_current_context(silent=True)
        self.prog = ctx.command_path if ctx is not None else "phalanx"

    def show(self, file: object = None) -> None:
        err_console.print(f"[bold red]{self.prog}:[/] {self.format_message()}", soft_wrap=True)


def settings(*started: type[PhalanxSettings]) -> CliSettings:
    """The command's settings; ``started`` are the models of the processes the command
    starts, read too so that a bad value stops it before anything starts. A malformed
    ``PHALANX_*`` value is a :class:`Failed`."""
    try:
        for model in started:
            load(model)
        return load(CliSettings)
    except SettingsError as exc:
        raise Failed(str(exc)) from None


def server_url(endpoint: str | None = None) -> str:
    """``HOST:PORT`` (``--rdzv-endpoint``) as a URL, else ``NATS_URL``, else the default."""
    if endpoint:
        return endpoint if "://" in endpoint else f"nats://{endpoint}"
    return settings().nats_url


def use_local_login(url: str, name: str) -> None:
    """Log in with this user's login ``name`` (``admin``, ``run``) of the local control
    plane at ``url`` (:class:`~phalanx.bus.credentials.LocalLogins`, left by ``phalanx
    up`` or a private control plane), unless a login is given already; none there: none."""
    if os.environ.get(ENV_NATS_USER) or urlsplit(url.split(",")[0].strip()).username:
        return
    try:
        os.environ.update(LocalLogins(url).read(name))
    except PermissionError as exc:
        raise Failed(str(exc)) from None


async def connect(url: str, name: str, *, timeout_s: float = 5.0, ensure: bool = True) -> Bus:
    """A bus connection, or a :class:`Failed` that says what to start, within seconds
    (``ensure``: the streams and buckets created if missing; a read-only command says no).
    With no login given, the operator's of a local control plane (``admin``), if any."""
    use_local_login(url, "admin")
    try:
        await probe(url, timeout_s=min(timeout_s, 3.0))
    except Unreachable as exc:
        raise Failed(
            f"{exc}. Start the control plane with `phalanx up` (NATS and the four services), "
            "or point NATS_URL at a running one."
        ) from None
    try:
        return await asyncio.wait_for(
            Bus.connect(url, name=name, report_errors=False, ensure=ensure), timeout_s
        )
    except TimeoutError:
        raise Failed(
            f"the NATS server at {url} answered but did not accept a client in {timeout_s:g} s"
        ) from None
    except Exception as exc:  # refused credentials, TLS that does not verify
        raise Failed(f"cannot use the NATS server at {url}: {exc}") from None


async def require_services(bus: Bus, url: str, names: Iterable[str], timeout_s: float = 2.0) -> None:
    """Every service in ``names`` answers its health ping, or a :class:`Failed` naming the missing."""
    from phalanx.service import ping

    async def answers(name: str) -> bool:
        try:
            await ping(bus, name, timeout=timeout_s)
            return True
        except Exception:
            return False

    names = list(names)
    missing = [
        n for n, ok in zip(names, await asyncio.gather(*(answers(n) for n in names)), strict=True) if not ok
    ]
    if missing:
        nor = f" (nor {', '.join(missing[1:])})" if len(missing) > 1 else ""
        raise Failed(
            f"no {missing[0]} answered{nor} on {url} within {timeout_s:g} s: start the services "
            f"with `phalanx up` (or `phalanx service {missing[0]}`)"
        )
