"""The ``phalanx`` command: start the control plane, launch and watch jobs.

Built on click (one module per family of commands) with rich for tables and live
views; every command and option has help (``phalanx COMMAND --help``).

    phalanx up                                   NATS + the four services, live status
    phalanx run --nproc 4 --spares 1 -- python train.py
    phalanx status [JOB]                         members, generation, step rate, incidents
    phalanx report JOB -o run.png                a picture of the run
    phalanx trace summary                        the latest incident's phase table
    phalanx cluster offer|reclaim|show           the local cluster (elastic resizing)
    phalanx ckpt list|show|rm JOB                a job's tiered checkpoints (rm: everywhere)
    phalanx nats | service NAME | health NAME    the parts of `up`, one at a time

Exit status: 0 done, 1 failed, 2 bad input or nothing to talk to (with a message
saying what to start), 130 interrupted.
"""

from __future__ import annotations

import click

from phalanx.cli import ckpt, cluster, inspect, run, status, up


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(package_name="phalanx", prog_name="phalanx")
def cli() -> None:
    """Fault tolerance and elasticity for PyTorch training: checkpointless recovery,
    elastic data parallelism and tiered checkpoints, on a NATS bus."""


for _module in (up, run, status, inspect, cluster, ckpt):
    for _command in _module.COMMANDS:
        cli.add_command(_command)


def main(argv: list[str] | None = None) -> int:
    """Run ``phalanx`` with ``argv`` (default ``sys.argv[1:]``); returns the exit status."""
    try:
        result = cli.main(args=argv, prog_name="phalanx", standalone_mode=False)
    except click.exceptions.Abort:
        click.echo("interrupted", err=True)
        return 130
    except click.UsageError as exc:  # one line, like every other refusal
        prog = exc.ctx.command_path if exc.ctx is not None else "phalanx"
        click.echo(f"{prog}: {exc.format_message()} (see `{prog} --help`)", err=True)
        return exc.exit_code
    except click.ClickException as exc:
        exc.show()
        return exc.exit_code
    except click.exceptions.Exit as exc:
        return exc.exit_code
    return result if isinstance(result, int) else 0
