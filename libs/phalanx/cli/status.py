"""``phalanx status [JOB]``: the jobs on the bus, or one job live.

Without JOB: a table of every job with a committed plan. With JOB: its generation,
members and spares with their step, step time, phase and loss, the step rate, and
its last decisions and incidents, refreshed until Ctrl-C (``--once`` prints one
snapshot and exits, ``--json`` prints it as JSON for scripts).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import signal
import time

import click
from rich.console import Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

from phalanx.cli._common import Failed, connect, console, server_url
from phalanx.jobstatus import JobView, job_view, list_jobs


def render(view: JobView) -> Group:
    """The rich view of one job (what ``phalanx status JOB`` shows)."""
    rate = f"{view.steps_per_s:.2f} steps/s" if view.steps_per_s is not None else "-"
    head = Text.from_markup(
        f"[bold]{view.job}[/]  {view.state}  generation [bold]{view.generation}[/]  "
        f"world {view.world_size}  spares {len(view.spares)}  step {view.step if view.step is not None else '-'}  "
        f"{rate}{'' if view.live else '  (no heartbeats: not running here now)'}"
    )
    members = Table(title="members", title_justify="left")
    for col in ("rank", "worker", "node", "role", "step", "step ms", "phase", "loss", "heartbeat age"):
        members.add_column(col)
    for w in [*view.ranks, *view.spares, *(w for w in view.workers if w.role == "left")]:
        members.add_row(
            str(w.rank) if w.rank is not None else "-",
            w.worker,
            w.node,
            w.role,
            str(w.step) if w.step is not None else "-",
            f"{w.step_ms:.1f}" if w.step_ms is not None else "-",
            w.phase or "-",
            f"{w.loss:.4f}" if w.loss is not None else "-",
            f"{w.age_ms:.0f} ms" if w.age_ms is not None else "-",
        )
    decisions = Table(title="last decisions", title_justify="left")
    for col in ("time", "action", "world", "reason"):
        decisions.add_column(col)
    for d in view.decisions:
        decisions.add_row(
            time.strftime("%H:%M:%S", time.localtime(d.ts)),
            d.action.value,
            str(d.world_size or "-"),
            d.reason,
        )
    incidents = Table(title="last recoveries and resizes", title_justify="left")
    for col in ("time", "generation", "incident", "ranks", "slowest rank's phases ms"):
        incidents.add_column(col)
    for i in view.incidents:
        incidents.add_row(
            time.strftime("%H:%M:%S", time.localtime(i.at)),
            str(i.generation),
            i.incident or "(planned)",
            str(i.ranks),
            f"{i.rank_phases_ms:.0f}",
        )
    return Group(head, members, decisions, incidents)


def as_json(view: JobView) -> str:
    data = dataclasses.asdict(view)
    data["decisions"] = [d.model_dump(mode="json") for d in view.decisions]
    return json.dumps(data, default=str)


async def _status(job: str | None, once: bool, as_json_out: bool, interval_s: float) -> int:
    url = server_url()
    bus = await connect(url, name="phalanx-status")
    try:
        if job is None:
            jobs = await list_jobs(bus)
            if as_json_out:
                console.print_json(json.dumps([dataclasses.asdict(j) for j in jobs]))
                return 0
            t = Table(title=f"jobs on {url}", title_justify="left")
            for col in ("job", "generation", "ranks", "spares", "last plan"):
                t.add_column(col)
            for j in jobs:
                t.add_row(j.job, str(j.generation), str(j.world_size), str(j.spares), j.reason)
            console.print(t if jobs else f"no jobs on {url}")
            return 0
        view = await job_view(bus, job, listen_s=interval_s)
        if view is None:
            raise Failed(f"no job {job!r} on {url} (`phalanx status` lists them)", code=1)
        if once or as_json_out:
            if as_json_out:
                print(as_json(view), flush=True)
            else:
                console.print(render(view))
            return 0
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        with Live(render(view), console=console, auto_refresh=False) as live:
            while not stop.is_set():
                listening = asyncio.ensure_future(job_view(bus, job, listen_s=interval_s))
                done, _ = await asyncio.wait(
                    {listening, asyncio.ensure_future(stop.wait())}, return_when=asyncio.FIRST_COMPLETED
                )
                if listening in done and listening.result() is not None:
                    live.update(render(listening.result()), refresh=True)  # type: ignore[arg-type]
                else:
                    listening.cancel()
                    with contextlib.suppress(BaseException):
                        await listening
        return 0
    finally:
        await bus.close()


@click.command("status")
@click.argument("job", required=False)
@click.option(
    "--once", is_flag=True, help="Print one snapshot and exit (default with JOB: live until Ctrl-C)."
)
@click.option("--json", "as_json_out", is_flag=True, help="One snapshot as JSON, for scripts.")
@click.option(
    "--interval",
    type=click.FloatRange(min=0.2),
    default=1.0,
    show_default=True,
    help="Seconds of heartbeats behind each refresh (the step rate's window).",
)
def status_command(job: str | None, once: bool, as_json_out: bool, interval: float) -> int:
    """Show the jobs on the bus, or JOB live: members, generation, step rate, spares,
    last decisions and incidents."""
    return asyncio.run(_status(job, once, as_json_out, interval))


COMMANDS = [status_command]
