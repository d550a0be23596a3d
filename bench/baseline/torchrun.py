"""Run a plain torchrun script, as its users run it, for comparisons with Phalanx.

:func:`torchrun` starts ``python -m torch.distributed.run`` (this interpreter,
so the same virtualenv) with ``nproc`` workers, a c10d rendezvous on a free
loopback port and ``--max-restarts``; :func:`plain_ddp_command` is the command of
examples/ddp_plain.py, the script examples/ddp_phalanx.py ports.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

from phalanx.devstack.natsserver import free_port

REPO = Path(__file__).resolve().parents[2]


class TorchrunFailed(RuntimeError):
    """The baseline itself failed: torchrun exited non-zero (e.g. a restarted worker
    aborted), so there is nothing to compare against in this run."""


def plain_ddp_args(
    steps: int, *extra: str, save: Path | None = None, steps_log: Path | None = None
) -> list[str]:
    """Arguments of examples/ddp_plain.py and examples/ddp_phalanx.py (they share them)."""
    args = ["--steps", str(steps), *extra]
    if save is not None:
        args += ["--save", str(save)]
    if steps_log is not None:
        args += ["--steps-log", str(steps_log)]
    return args


def torchrun_command(nproc: int, target: Sequence[str], *, max_restarts: int = 0) -> list[str]:
    """``torchrun`` of ``target`` (``["-m", module, ...]`` or ``[script, ...]``): ``nproc``
    workers, a c10d rendezvous on a free loopback port, ``--max-restarts``."""
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        str(nproc),
        "--max-restarts",
        str(max_restarts),
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        f"127.0.0.1:{free_port()}",
        *target,
    ]


def torchrun_env() -> dict[str, str]:
    """The environment torchrun runs with here: this checkout importable, one thread."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"  # restarts otherwise reuse stale gloo peers
    env["OMP_NUM_THREADS"] = "1"
    return env


def torchrun(
    nproc: int,
    module: str,
    args: Sequence[str],
    *,
    output: Path,
    max_restarts: int = 0,
) -> subprocess.Popen[bytes]:
    """Start ``torchrun --nproc-per-node nproc -m module args``; its output goes to ``output``."""
    cmd = torchrun_command(nproc, ["-m", module, *args], max_restarts=max_restarts)
    with open(output, "wb") as out:
        return subprocess.Popen(cmd, cwd=REPO, env=torchrun_env(), stdout=out, stderr=subprocess.STDOUT)


def run_torchrun(
    nproc: int, module: str, args: Sequence[str], *, output: Path, timeout_s: float = 600.0
) -> None:
    """Run it to its end; raises with the output's tail when it fails."""
    proc = torchrun(nproc, module, args, output=output)
    try:
        code = proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        raise
    if code != 0:
        raise RuntimeError(f"torchrun exited with {code}:\n{output.read_text(errors='replace')[-3000:]}")
