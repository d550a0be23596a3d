"""``phalanx up`` and its parts: the control plane on one machine, in the foreground.

``phalanx up`` starts a nats-server (JetStream, store under ``--workdir``) and the
four services, restarts a service that exits, and shows a live view of services and
jobs until Ctrl-C or SIGTERM, when it stops everything it started. ``phalanx nats``,
``phalanx service NAME`` and ``phalanx health NAME`` are the same parts one at a time
(for systemd units, containers and probes).
"""

from __future__ import annotations

import asyncio
import contextlib
import runpy
import signal
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

import click
from rich.console import Group
from rich.live import Live
from rich.table import Table

from phalanx.cli._common import Failed, connect, console, server_url, settings
from phalanx.contract import HealthReply
from phalanx.services import SERVICE_MODULES
from phalanx.settings import DetectorSettings, KeeperSettings, PlannerSettings, SchedulerSignalSettings

if TYPE_CHECKING:  # both import torch: only when the command runs
    from phalanx.devstack.localstack import LocalStack
    from phalanx.jobstatus import JobSummary

SERVICE_SETTINGS = (DetectorSettings, SchedulerSignalSettings, PlannerSettings, KeeperSettings)
"""The settings models of the four services (:mod:`phalanx.settings`)."""
RESTART_BACKOFF_S = (1.0, 2.0, 5.0, 10.0, 30.0)


def _services_table(
    stack: LocalStack, health: dict[str, HealthReply | None], restarts: dict[str, int]
) -> Table:
    t = Table(title="services", title_justify="left", expand=False)
    for col in ("service", "pid", "status", "uptime", "restarts", "metrics"):
        t.add_column(col)
    for key, proc in stack.procs.items():
        h = health.get(key)
        code = proc.poll()
        if code is not None:
            status = f"[red]exited {code}[/]"
        elif h is None:
            status = "[yellow]not answering[/]"
        else:
            status = "[green]ok[/]" if h.status == "ok" else f"[yellow]{h.status}[/]"
        t.add_row(
            key,
            str(proc.pid),
            status,
            f"{h.uptime_s:.0f} s" if h else "-",
            str(restarts.get(key, 0)),
            str(h.details.get("metrics_url", "-")) if h else "-",
        )
    return t


def _jobs_table(jobs: list[JobSummary]) -> Table:
    t = Table(title="jobs (phalanx status JOB for one)", title_justify="left")
    for col in ("job", "generation", "ranks", "spares", "last plan"):
        t.add_column(col)
    for j in jobs:
        t.add_row(j.job, str(j.generation), str(j.world_size), str(j.spares), j.reason[:80])
    if not jobs:
        t.add_row("-", "", "", "", "none yet: phalanx run --nproc 2 -- python train.py")
    return t


async def _watch(stack: LocalStack, url: str, live: bool, refresh_s: float) -> None:
    """Refresh the view every ``refresh_s`` until SIGINT/SIGTERM; respawn exited services."""
    from phalanx.jobstatus import list_jobs
    from phalanx.service import ping

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    bus = await connect(url, name="phalanx-up")
    restarts: dict[str, int] = {}
    due: dict[str, float] = {}
    seen: dict[str, str] = {}

    async def health(key: str) -> HealthReply | None:
        try:
            return await ping(bus, key.split("#")[0], timeout=min(1.0, refresh_s))
        except Exception:
            return None

    try:
        with (
            Live(console=console, auto_refresh=False, transient=False)
            if live
            else contextlib.nullcontext() as view
        ):
            while not stop.is_set():
                for key, proc in stack.procs.items():
                    if proc.poll() is None:
                        continue
                    n = restarts.get(key, 0)
                    when = due.setdefault(
                        key, time.monotonic() + RESTART_BACKOFF_S[min(n, len(RESTART_BACKOFF_S) - 1)]
                    )
                    if time.monotonic() >= when:
                        stack.respawn(key)
                        restarts[key] = n + 1
                        due.pop(key, None)
                keys = list(stack.procs)
                replies = dict(zip(keys, await asyncio.gather(*(health(k) for k in keys)), strict=True))
                try:
                    jobs = await list_jobs(bus)
                except Exception:
                    jobs = []
                if view is not None:
                    view.update(
                        Group(_services_table(stack, replies, restarts), _jobs_table(jobs)), refresh=True
                    )
                else:
                    for key in keys:
                        state = "ok" if replies[key] is not None else "not answering"
                        if seen.get(key) != state:
                            console.print(f"{time.strftime('%H:%M:%S')} {key}: {state}")
                            seen[key] = state
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), refresh_s)
    finally:
        await bus.close()


@click.command("up")
@click.option(
    "--host",
    default="127.0.0.1",
    show_default=True,
    help="Address NATS listens on; the one other nodes reach, for a multi-node job.",
)
@click.option(
    "--port",
    type=click.IntRange(1, 65535),
    default=4222,
    show_default=True,
    help="NATS client port (`phalanx run` looks on 4222 when NATS_URL is not set).",
)
@click.option(
    "--workdir",
    type=click.Path(file_okay=False, path_type=Path),
    default=Path(".phalanx/up"),
    show_default=True,
    help="JetStream store, service logs and spans.",
)
@click.option(
    "--metrics-port",
    type=click.IntRange(0, 65535),
    default=9401,
    show_default=True,
    help="First of four consecutive /metrics ports, one per service (0: free ports, shown below).",
)
@click.option(
    "--live/--no-live",
    default=None,
    help="A live table (default when the output is a terminal), or one line per change.",
)
@click.option(
    "--refresh",
    type=click.FloatRange(min=0.2),
    default=1.0,
    show_default=True,
    help="Seconds between refreshes of the view.",
)
def up_command(
    host: str, port: int, workdir: Path, metrics_port: int, live: bool | None, refresh: float
) -> int:
    """Start NATS and the four services here, in the foreground, with a live status.

    Then, in another terminal: phalanx run --nproc 2 -- python train.py.
    Ctrl-C (or SIGTERM) stops everything this command started.
    """
    from phalanx.bus.probe import Unreachable, probe
    from phalanx.devstack.localstack import LocalStack

    settings(*SERVICE_SETTINGS)  # the four services start here: a bad value of any stops them all
    url = f"nats://{host}:{port}"
    with contextlib.suppress(Unreachable):
        asyncio.run(probe(url, timeout_s=1.0))
        raise Failed(
            f"a NATS server already answers on {url}: is `phalanx up` running already? (or use --port)"
        )
    env = {
        name: {"PHALANX_METRICS_PORT": str(metrics_port + i if metrics_port else 0)}
        for i, name in enumerate(SERVICE_MODULES)
    }
    t = time.monotonic()
    # the services' spans go where this machine's ranks write theirs (PHALANX_SPAN_FILE, by
    # default .phalanx/spans.jsonl), so `phalanx trace summary` finds whole incidents
    spans = str(settings().span_file.resolve())
    stack = LocalStack(
        workdir,
        nats_host=host,
        nats_port=port,
        service_env=env,
        env={"PHALANX_SPAN_FILE": spans},
        auth=True,
        publish_logins=True,
    )
    try:
        stack.start()
    except Exception as exc:
        stack.stop()
        raise Failed(f"the control plane did not start: {exc}", code=1) from None
    try:
        console.print(
            f"[bold]phalanx up[/]: NATS {stack.url} (JetStream, store {workdir}/nats), "
            f"{len(stack.procs)} services healthy in {time.monotonic() - t:.1f} s; logs in {workdir}/. "
            "Ctrl-C stops them.",
            soft_wrap=True,
        )
        console.print(
            "  in another terminal: [bold]phalanx run --nproc 2 -- python -m phalanx.examples.train_gpt[/]",
            soft_wrap=True,
        )
        if stack.users.logins is not None:
            console.print(
                f"  logins required: yours are in {stack.users.logins.dir}/ (mode 0700; `phalanx` commands of "
                "this user read them); on another machine: PHALANX_NATS_ENV_FILE=<a copy of run.env> phalanx run ...",
                soft_wrap=True,
            )
        asyncio.run(_watch(stack, stack.url, console.is_terminal if live is None else live, refresh))
    finally:
        stack.stop()
        console.print("phalanx up: stopped nats-server and the services")
    return 0


@click.command("nats")
@click.option(
    "--host",
    default="127.0.0.1",
    show_default=True,
    help="Address to listen on (the one other nodes reach, for several).",
)
@click.option("--port", type=click.IntRange(1, 65535), default=4222, show_default=True, help="Client port.")
@click.option(
    "--store",
    type=click.Path(file_okay=False, path_type=Path),
    default=Path(".phalanx/nats"),
    show_default=True,
    help="JetStream store directory.",
)
def nats_command(host: str, port: int, store: Path) -> int:
    """Run an embedded nats-server with JetStream until SIGTERM/SIGINT; prints its URL when ready."""
    from phalanx.devstack.natsserver import NatsServer, NatsServerError

    stop = {signal.SIGINT, signal.SIGTERM}
    signal.pthread_sigmask(signal.SIG_BLOCK, stop)  # delivered to sigwait, not fatal
    try:
        srv = NatsServer(port=port, store_dir=store, host=host).start()
    except NatsServerError as exc:
        raise Failed(str(exc), code=1) from None
    print(srv.url, flush=True)
    try:
        signal.sigwait(stop)
    finally:
        srv.stop()
    return 0


@click.command("service")
@click.argument("name", type=click.Choice(sorted(SERVICE_MODULES)))
def service_command(name: str) -> int:
    """Run one service in the foreground (NATS_URL says where the bus is)."""
    settings()
    sys.argv = [SERVICE_MODULES[name]]
    runpy.run_module(SERVICE_MODULES[name], run_name="__main__", alter_sys=True)
    return 0


@click.command("health")
@click.argument("name", type=click.Choice(sorted(SERVICE_MODULES)))
@click.option(
    "--timeout",
    type=click.FloatRange(min=0, min_open=True),
    default=2.0,
    show_default=True,
    help="Seconds to wait for the answer.",
)
def health_command(name: str, timeout: float) -> int:
    """Ask a service for its health over the bus: exit 0 when it answers ok (a readiness probe)."""
    from phalanx.service import ping

    async def ask() -> HealthReply:
        url = server_url()
        bus = await connect(url, name=f"phalanx-health-{name}")
        try:
            return await ping(bus, name, timeout=timeout)
        except Exception:
            raise Failed(f"{name} did not answer on {url} within {timeout:g} s", code=1) from None
        finally:
            await bus.close()

    reply = asyncio.run(ask())
    console.print_json(reply.model_dump_json())
    return 0 if reply.status == "ok" else 1


COMMANDS = [up_command, nats_command, service_command, health_command]
