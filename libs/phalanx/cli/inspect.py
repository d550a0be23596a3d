"""``phalanx trace summary`` and ``phalanx report``: what happened in a run, after the fact.

Traces come from the JSON-lines span file every process writes by default
(``PHALANX_SPAN_FILE``) or from Jaeger's query API; the report's steps, plans and
recoveries come from the job's events on the bus.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import click

from phalanx.cli._common import Failed, connect, console, server_url, settings


def _span_options(f: click.decorators.FC) -> click.decorators.FC:
    f = click.option(
        "--jaeger",
        envvar="PHALANX_JAEGER_URL",
        show_envvar=True,
        metavar="URL",
        help="Read spans from Jaeger's query API instead, e.g. http://localhost:16686.",
    )(f)
    return click.option(
        "--spans",
        type=click.Path(dir_okay=False, path_type=Path),
        help="The span file to read (default: PHALANX_SPAN_FILE, else .phalanx/spans.jsonl).",
    )(f)


def _spans_path(spans: Path | None) -> str:
    return str(spans or settings().span_file or ".phalanx/spans.jsonl")


@click.group("trace")
def trace_group() -> None:
    """Inspect recovery and resize traces."""


@trace_group.command("summary")
@click.option("--trace", "trace_id", metavar="ID", help="Trace id (default: the latest incident).")
@_span_options
def trace_summary(trace_id: str | None, spans: Path | None, jaeger: str | None) -> int:
    """Phase table of the latest (or a chosen) incident: when each phase started and ended
    after the fault, over all processes, and the downtime."""
    from phalanx.tracesummary import load_spans, print_summary

    try:
        found = load_spans(spans_file=_spans_path(spans), jaeger_url=jaeger, trace_id=trace_id)
    except (OSError, ValueError) as exc:
        raise Failed(f"cannot read spans: {exc}", code=1) from None
    return print_summary(found, trace_id=trace_id)


@click.command("report")
@click.argument("job")
@click.option(
    "-o",
    "--output",
    type=click.Path(dir_okay=False, path_type=Path),
    default=Path("run.png"),
    show_default=True,
    help="The picture to write (PNG, or any format matplotlib knows by suffix).",
)
@_span_options
def report_command(job: str, output: Path, spans: Path | None, jaeger: str | None) -> int:
    """Draw JOB's run: step time and loss over time, every incident and resize marked,
    and a phase bar per incident (phases from the traces when they can be read)."""
    from phalanx.report import load_run, render
    from phalanx.tracesummary import load_spans

    try:
        found = load_spans(spans_file=_spans_path(spans), jaeger_url=jaeger, trace_id=None)
    except (OSError, ValueError):
        found = None  # no traces: phases come from the ranks' own reports

    async def load() -> object:
        url = server_url()
        bus = await connect(url, name=f"phalanx-report-{job}")
        try:
            return await load_run(bus, job, spans=found)
        finally:
            await bus.close()

    run = asyncio.run(load())
    if not getattr(run, "steps", None) and not getattr(run, "generations", None):
        raise Failed(
            f"nothing recorded for job {job!r} on {server_url()} (`phalanx status` lists jobs)", code=1
        )
    render(run, output)  # type: ignore[arg-type]
    console.print(f"wrote {output}")
    return 0


COMMANDS = [trace_group, report_command]
