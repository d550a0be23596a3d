"""``phalanx run``: this node's ranks and hot spares for a training command, like torchrun.

The control plane is checked before anything starts: with ``NATS_URL`` (or
``--rdzv-endpoint``) the server must answer and the planner and detector must answer
their health pings, else the command fails within seconds saying what to start.
Without either, a single-node run uses the control plane ``phalanx up`` serves on
127.0.0.1:4222, or, when nothing is there, starts a private one (nats-server and the
four services, logs under ``.phalanx/run-<job>/``) for the length of the run.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import click
from pydantic import ValidationError

from phalanx.bus.credentials import ENV_NATS_ENV_FILE, read_env_file
from phalanx.cli._common import (
    REQUIRED_SERVICES,
    Failed,
    connect,
    err_console,
    require_services,
    server_url,
    settings,
    use_local_login,
)
from phalanx.contract import Elastic, LrRule, Recovery
from phalanx.settings import LauncherSettings, RankSettings
from phalanx.worker.pycommand import parse, uses_phalanx

if TYPE_CHECKING:  # imports torch: only when a job is launched
    from phalanx.launcher.launcher import LaunchConfig

DEFAULT_URL = "nats://127.0.0.1:4222"


def parse_nnodes(text: str) -> tuple[int, int]:
    """``"2"`` -> (2, 2); ``"2:4"`` -> (2, 4); a clear ValueError otherwise."""
    lo, _, hi = text.partition(":")
    try:
        low, high = int(lo), int(hi or lo)
    except ValueError:
        raise ValueError(f"--nnodes must be MIN or MIN:MAX, got {text!r}") from None
    if not 1 <= low <= high:
        raise ValueError(f"--nnodes needs 1 <= MIN <= MAX, got {text!r}")
    return low, high


def elastic_settings(
    *,
    max_nproc: int,
    sizes: str | None,
    size_step: int,
    cooldown: str,
    grace: str,
    micro_batch: int,
    max_accum: int,
    lr_rule: str,
    auto_grow: bool,
    group_size: int = 1,
) -> Elastic:
    """The job's elasticity from ``phalanx run``'s options (a clear ValueError if inconsistent)."""
    from phalanx.cluster import parse_grace

    try:
        allowed = [int(x) for x in sizes.split(",") if x.strip()] if sizes else []
    except ValueError:
        raise ValueError(f"--sizes must be a comma-separated list of world sizes, got {sizes!r}") from None
    try:
        return Elastic(
            max_world_size=max_nproc,
            sizes=allowed,
            size_step=size_step,
            cooldown_s=parse_grace(cooldown, "--cooldown"),
            grace_s=parse_grace(grace, "--grace"),
            micro_batch=micro_batch,
            max_accum=max_accum,
            lr_rule=LrRule(lr_rule),
            auto_grow=auto_grow,
            group_size=group_size,
        )
    except ValidationError as exc:
        first = exc.errors(include_url=False)[0]
        where = ".".join(str(x) for x in first["loc"])
        raise ValueError(f"elastic setting {where or ''}: {first['msg']}") from None


@contextlib.contextmanager
def _private_control_plane(job: str, workdir: Path) -> Iterator[tuple[str, dict[str, str]]]:
    """A nats-server and the four services for this run only; yields (url, worker env)."""
    from phalanx.devstack.localstack import LocalStack

    stack = LocalStack(
        workdir,
        env={"PHALANX_SPAN_FILE": str(settings().span_file.resolve())},
        auth=True,
        publish_logins=True,
    )
    err_console.print(
        f"[dim]phalanx run: no NATS_URL and nothing on {DEFAULT_URL}: starting a private control plane "
        f"(nats-server + 4 services, logins required) for job {job}; logs in {workdir}/[/]",
        soft_wrap=True,
    )
    with stack:
        use_local_login(stack.url, "run")  # this launcher's, and the one it hands its ranks
        yield stack.url, {"PHALANX_SHM_ROOT": str(stack.shm_root)}


async def _check_control_plane(url: str, job: str) -> None:
    bus = await connect(url, name=f"phalanx-run-{job}")
    try:
        await require_services(bus, url, REQUIRED_SERVICES)
    finally:
        await bus.close()


def _plain_default_available() -> bool:
    from phalanx.bus.probe import Unreachable, probe

    try:
        asyncio.run(probe(DEFAULT_URL, timeout_s=1.0))
        return True
    except Unreachable:
        return False


def launch(
    config: LaunchConfig, timeout_s: float | None, private: bool, workdir: Path, notice: str | None = None
) -> int:
    """Check the control plane (or start a private one), then run the launcher to its end
    (``notice``: a line to print once the control plane answers)."""
    from phalanx.launcher.launcher import LaunchError, run
    from phalanx.telemetry import setup_logging, setup_tracing, shutdown_tracing

    with contextlib.ExitStack() as stack:
        if private:
            url, env = stack.enter_context(_private_control_plane(config.job, workdir))
            config.nats_url, config.env = url, {**env, **config.env}
        else:
            use_local_login(config.nats_url or DEFAULT_URL, "run")  # a `phalanx up` of this user's
            asyncio.run(_check_control_plane(config.nats_url or DEFAULT_URL, config.job))
        if notice:
            err_console.print(f"[dim]phalanx run: {notice}[/]", soft_wrap=True)
        setup_logging("launcher")
        setup_tracing("phalanx-launcher")
        try:
            rc, why = asyncio.run(run(config, timeout_s))
            if rc != 0:
                err_console.print(
                    f"phalanx run: job {config.job} did not complete here (exit {rc}): {why or 'see the log above'}",
                    soft_wrap=True,
                    markup=False,
                )
            return rc
        except (LaunchError, ValueError) as exc:
            raise Failed(str(exc)) from None
        except TimeoutError:
            raise Failed(
                f"job {config.job} ran past --timeout {timeout_s:g} s: its workers were stopped", 1
            ) from None
        finally:
            shutdown_tracing()


def torchrun_command(cmd: tuple[str, ...], module: bool, no_python: bool) -> list[str]:
    """The command as torchrun reads its target: ``train.py ARGS`` and ``-m pkg ARGS`` run
    with this interpreter, ``--no-python`` runs it as it is, and so does a full command
    (``python train.py``, ``bash run.sh``).

    >>> torchrun_command(("train.py", "--lr", "1"), False, False)[1:]
    ['train.py', '--lr', '1']
    """
    if no_python:
        return list(cmd)
    if module:
        return [sys.executable, "-m", *cmd]
    if cmd[0].endswith(".py"):
        return [sys.executable, *cmd]
    return list(cmd)


def choose_recovery(choice: str, cmd: list[str]) -> Recovery:
    """``--recovery``: ``auto`` restarts a Python script whose own source never imports
    ``phalanx`` (an unmodified torchrun script), and recovers any other in process."""
    if choice != "auto":
        return Recovery(choice.replace("-", "_"))
    target = parse(cmd)
    if target is not None and uses_phalanx(target) is False:
        return Recovery.RESTART
    return Recovery.IN_PROCESS


@click.command(
    "run",
    context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False},
    epilog="Examples: phalanx run --nproc 4 --spares 1 --global-batch 64 -- python train.py --lr 3e-4;"
    " as torchrun: phalanx run --nnodes 1 --nproc-per-node 4 --max-restarts 3 train.py --lr 3e-4",
)
@click.option(
    "--nproc",
    "--nproc-per-node",
    "--nproc_per_node",
    "nproc",
    type=click.IntRange(min=0),
    required=True,
    help="Ranks to start on this node (0: a node of hot spares only, with --spares).",
)
@click.option(
    "--spares",
    "--spares-per-node",
    "spares",
    type=click.IntRange(min=0),
    help="Hot spares on this node: warm workers that replace a lost rank in place"
    " (default: 0; 1 with restart recovery, so that a crashed rank restarts on its node as under torchrun).",
)
@click.option(
    "--job",
    "--rdzv-id",
    "--rdzv_id",
    "job",
    envvar="PHALANX_JOB",
    show_envvar=True,
    help="The job's name, the same on every node (default: a random one for a single node).",
)
@click.option(
    "--rdzv-backend",
    "--rdzv_backend",
    "rdzv_backend",
    type=click.Choice(["c10d", "static", "etcd", "etcd-v2"]),
    help="torchrun's, accepted and not needed: the nodes meet through Phalanx's control plane (NATS).",
)
@click.option(
    "--nnodes", default="1", show_default=True, help="MIN[:MAX] nodes; the job starts when MIN have joined."
)
@click.option("--node-id", help="This node's name in the job, unique per node (needed when MAX > 1).")
@click.option(
    "--node-rank",
    "--node_rank",
    "node_rank",
    type=click.IntRange(min=0),
    help="torchrun's: this node's index; names the node node<N> when --node-id is not given.",
)
@click.option(
    "--standalone",
    is_flag=True,
    help="torchrun's: a single-node job on a local control plane (the one on 127.0.0.1:4222, or a private one).",
)
@click.option(
    "--max-restarts",
    "--max_restarts",
    "max_restarts",
    type=click.IntRange(min=0),
    help="torchrun's: recover from at most N faults, then stop the job with exit code 1 (default: no limit).",
)
@click.option(
    "--recovery",
    type=click.Choice(["auto", "restart", "in-process"]),
    default="auto",
    show_default=True,
    help="restart: every member restarts on a change and resumes from the script's own checkpoint (an"
    " unmodified torchrun script); in-process: survivors stay alive (the script uses phalanx.runtime);"
    " auto: restart when the script's own source never imports phalanx.",
)
@click.option(
    "--warm/--no-warm",
    default=True,
    show_default=True,
    help="Start Python workers from the node's fork server, torch already imported (--no-warm: plain processes).",
)
@click.option("-m", "--module", is_flag=True, help="torchrun's: the target is a Python module (python -m).")
@click.option("--no-python", is_flag=True, help="torchrun's: run the command as it is, not with python.")
@click.option(
    "--rdzv-endpoint",
    "--rdzv_endpoint",
    "rdzv_endpoint",
    metavar="HOST:PORT",
    help="The NATS server the nodes meet through (default: NATS_URL).",
)
@click.option(
    "--bind",
    metavar="ADDR",
    help="Address the rendezvous store and gloo listen on (default: the one that reaches NATS).",
)
@click.option(
    "--global-batch",
    type=click.IntRange(min=1),
    default=32,
    show_default=True,
    help="Samples per optimizer step, whole job; held constant across resizes.",
)
@click.option(
    "--min-nproc",
    type=click.IntRange(min=1),
    help="Smallest world a shrink may leave when a rank is lost with no spare (default: no shrink).",
)
@click.option(
    "--max-nproc",
    type=click.IntRange(min=0),
    default=0,
    help="Largest world (ranks, whole job) a grow may reach (default: the starting world).",
)
@click.option(
    "--sizes", metavar="N,N,..", help="Allowed world sizes, e.g. 2,4,8 (default: any from min to max)."
)
@click.option(
    "--size-step",
    type=click.IntRange(min=1),
    default=1,
    show_default=True,
    help="World sizes must be multiples of this.",
)
@click.option(
    "--group-size",
    type=click.IntRange(min=1),
    default=1,
    show_default=True,
    help="Ranks per replica group of a sharded model (FSDP2/HSDP: the shard count of job.mesh); the job"
    " grows and shrinks by whole groups and each rank keeps its shard.",
)
@click.option("--cooldown", default="10s", show_default=True, help="No grow sooner than this after a change.")
@click.option(
    "--grace",
    default="30s",
    show_default=True,
    help="Time leaving ranks get when a preemption notice gives none.",
)
@click.option(
    "--micro-batch",
    type=click.IntRange(min=0),
    default=0,
    show_default=True,
    help="Samples per forward of one replica (0: the whole shard at once).",
)
@click.option(
    "--max-accum",
    type=click.IntRange(min=0),
    default=0,
    show_default=True,
    help="Most micro-batches per replica per step, a memory/time cap (0: none).",
)
@click.option(
    "--lr-rule",
    type=click.Choice(["none", "linear", "sqrt"]),
    default="none",
    show_default=True,
    help="How the learning rate follows the effective batch when the global batch cannot be held.",
)
@click.option(
    "--auto-grow/--no-auto-grow",
    default=True,
    show_default=True,
    help="Grow into ready spares on the planner's own initiative (off: only a policy's proposals).",
)
@click.option(
    "--log-dir",
    type=click.Path(file_okay=False, path_type=Path),
    help="Write each worker's output to DIR/<worker>.log (default: this terminal).",
)
@click.option(
    "--join-timeout",
    type=click.FloatRange(min=0, min_open=True),
    default=10.0,
    show_default=True,
    help="Seconds to wait for the planner's answer to this node's join.",
)
@click.option(
    "--timeout",
    type=click.FloatRange(min=0, min_open=True),
    help="Give up (and stop the workers) after this many seconds.",
)
@click.argument("cmd", nargs=-1, type=click.UNPROCESSED, metavar="-- COMMAND [ARGS]...")
def run_command(
    nproc: int,
    spares: int | None,
    job: str | None,
    rdzv_backend: str | None,
    nnodes: str,
    node_id: str | None,
    node_rank: int | None,
    standalone: bool,
    max_restarts: int | None,
    recovery: str,
    warm: bool,
    module: bool,
    no_python: bool,
    rdzv_endpoint: str | None,
    bind: str | None,
    global_batch: int,
    min_nproc: int | None,
    max_nproc: int,
    sizes: str | None,
    size_step: int,
    group_size: int,
    cooldown: str,
    grace: str,
    micro_batch: int,
    max_accum: int,
    lr_rule: str,
    auto_grow: bool,
    log_dir: Path | None,
    join_timeout: float,
    timeout: float | None,
    cmd: tuple[str, ...],
) -> int:
    """Launch this node's ranks and hot spares for a training command.

    The command is started once per rank and spare. A script using phalanx.runtime
    goes on through crashes, hangs and resizes without a restart; an unmodified
    torchrun script gets torchrun's environment (RANK, WORLD_SIZE, MASTER_ADDR, ...)
    and restarts, warm, from its own checkpoint. Fails within seconds, saying what
    to start, when the control plane is not there.
    """
    from phalanx.launcher.launcher import LaunchConfig

    if not cmd:
        raise Failed("give the training command after --, e.g. `phalanx run --nproc 2 -- python train.py`")
    if standalone and nnodes not in ("1", "1:1"):
        raise Failed("--standalone is a single-node job: drop --nnodes")
    if standalone and rdzv_endpoint:
        raise Failed("--standalone uses a local control plane: drop --rdzv-endpoint")
    node_id = node_id or (f"node{node_rank}" if node_rank is not None else None)
    command = torchrun_command(cmd, module, no_python)
    mode = choose_recovery(recovery, command)
    if spares is None:
        spares = 1 if mode is Recovery.RESTART else 0
    notice = (
        "the script never imports phalanx: restart recovery (torchrun's environment; every member restarts,"
        " warm, on a change and resumes from the script's checkpoint); see --recovery"
        if recovery == "auto" and mode is Recovery.RESTART
        else None
    )
    if nproc + (spares or 0) < 1:
        raise Failed("--nproc 0 starts a node of hot spares only: give it --spares N")
    try:
        min_nodes, max_nodes = parse_nnodes(nnodes)
        elastic = elastic_settings(
            max_nproc=max_nproc, sizes=sizes, size_step=size_step, cooldown=cooldown, grace=grace,
            micro_batch=micro_batch, max_accum=max_accum, lr_rule=lr_rule, auto_grow=auto_grow,
            group_size=group_size,
        )  # fmt: skip
    except ValueError as exc:
        raise Failed(str(exc)) from None
    if max_nodes > 1 and not node_id:
        raise Failed("a job that may span nodes needs --node-id (unique per node)")
    if max_nodes > 1 and not job:
        raise Failed("every node of a multi-node job must name it with --job")
    if env_file := os.environ.get(ENV_NATS_ENV_FILE):  # this node's logins, from a file
        try:
            os.environ.update(read_env_file(env_file))
        except (OSError, ValueError) as exc:
            raise Failed(f"{ENV_NATS_ENV_FILE}={env_file}: {exc}") from None
    # this process runs the launcher, which starts the ranks with this environment
    explicit = bool(rdzv_endpoint) or "nats_url" in settings(LauncherSettings, RankSettings).model_fields_set
    private = not explicit and not _plain_default_available()
    if private and max_nodes > 1:
        raise Failed(
            f"nothing answers on {DEFAULT_URL} and NATS_URL is not set: a multi-node job needs a control plane "
            "all nodes reach (`phalanx up --host ADDR` on one machine, then --rdzv-endpoint ADDR:4222)"
        )
    name = job or f"job-{uuid.uuid4().hex[:8]}"
    config = LaunchConfig(
        job=name,
        cmd=command,
        nproc=nproc,
        spares=spares,
        global_batch=global_batch,
        min_nproc=min_nproc,
        nats_url=server_url(rdzv_endpoint) if explicit else DEFAULT_URL,
        log_dir=log_dir,
        node=node_id or "local",
        min_nodes=min_nodes,
        max_nodes=max_nodes,
        bind=bind,
        join_timeout_s=join_timeout,
        elastic=elastic,
        recovery=mode,
        max_restarts=-1 if max_restarts is None else max_restarts,
        warm=warm,
    )
    return launch(config, timeout, private, Path(".phalanx") / f"run-{name}", notice)


COMMANDS = [run_command]
