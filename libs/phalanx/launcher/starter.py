"""How a node's workers start: forked warm from the node's fork server, or cold.

A Python training command (``python script.py``, ``-m module``, ``-c code``) starts
warm: :class:`Starter` starts the node's fork server (:mod:`.forkserver`) as soon as
the launcher starts, so that its ``import torch`` overlaps the join, and forks each
worker from it. Any other command, a server that is not ready or said a fork is
unsafe, and ``warm=False`` start cold: the command as a plain process
(:func:`~phalanx.launcher.children.start_worker`). An unmodified torchrun script
(restart recovery) runs through :mod:`phalanx.runtime.unmodified` either way.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from phalanx.contract import Recovery, Role
from phalanx.launcher.children import Proc, start_worker, worker_env
from phalanx.launcher.config import LaunchConfig
from phalanx.launcher.forkserver import ForkServer, ForkServerError
from phalanx.settings import LauncherSettings, load
from phalanx.worker.pycommand import Target, parse

UNMODIFIED_MODULE = "phalanx.runtime.unmodified"
EXIT_NOTE_ENV = "PHALANX_EXIT_NOTE"  # phalanx.runtime.unmodified's (the launcher imports no torch)


class Starter:
    """Starts the node's workers; ``directory`` is the launcher's private one (exit notes)."""

    def __init__(self, config: LaunchConfig, log: Any, directory: Path) -> None:
        self.config, self.log, self.directory = config, log, directory
        self.target: Target | None = parse(config.cmd)
        if config.recovery is Recovery.RESTART and self.target is None:
            raise ValueError(
                "restart recovery runs a Python command (`python script.py ...`, `python -m module ...` or "
                f"`python -c code ...`), got {config.cmd[:3]}"
            )
        self.forks: ForkServer | None = None

    def start_fork_server(self, on_exit: Callable[[str], None]) -> None:
        """Start the fork server (or log why workers start cold)."""
        cfg = self.config
        if not cfg.warm or self.target is None:
            self.log.info("fork_server_off", reason="disabled" if not cfg.warm else "not a Python command")
            return
        base = worker_env(cfg, "fork-server", Role.SPARE, 0, {"PHALANX_JOB": cfg.job}, self.log)
        self.forks = ForkServer(self.target, base, self.log, load(LauncherSettings).warm_imports)
        self.forks.on_exit = on_exit
        self.forks.start()

    def wait_ready(self, timeout_s: float) -> None:
        """Wait for the fork server (blocking: run it in a thread); cold from then on if it failed."""
        if self.forks is not None and not self.forks.wait_ready(timeout_s):
            self.log.warning("starting_workers_cold", why=self.forks.why)

    def start(
        self, name: str, role: Role, slot: int, job_env: dict[str, str], generation: int | None = None
    ) -> Proc:
        """Worker ``name``'s process, with its environment (:func:`worker_env` of ``job_env``,
        and what restart recovery adds); forked when the fork server is ready, else cold."""
        job_env = {
            **job_env,
            "PHALANX_LAUNCHER_PID": str(os.getpid()),
            EXIT_NOTE_ENV: str(self.note_path(name)),
        }
        if self.config.recovery is Recovery.RESTART:
            job_env["PHALANX_GENERATION"] = str(generation or 1)
            job_env["PHALANX_MAX_RESTARTS"] = str(self.config.max_restarts)
        self.note_path(name).unlink(missing_ok=True)
        env = worker_env(self.config, name, role, slot, job_env, self.log)
        cfg, target = self.config, self.target
        restart = cfg.recovery is Recovery.RESTART
        if self.forks is not None and self.forks.ready and target is not None:
            log = cfg.log_dir / f"{name}.log" if cfg.log_dir is not None else None
            if log is not None:
                log.parent.mkdir(parents=True, exist_ok=True)
            try:
                return self.forks.spawn(
                    target.python_args(),
                    env,
                    mode="unmodified" if restart else "plain",
                    log=log,
                    cwd=os.getcwd(),
                )
            except ForkServerError as exc:
                self.log.warning("starting_worker_cold", worker=name, why=str(exc))
        cmd = cfg.cmd
        if restart:
            assert target is not None
            cmd = [target.interpreter, *target.flags, "-m", UNMODIFIED_MODULE, *target.python_args()]
        return start_worker(cmd, cfg, name, env)

    def note_path(self, name: str) -> Path:
        return self.directory / f"{name}.exit.json"

    def take_note(self, name: str) -> str | None:
        """The error a worker that could not start the script left (:mod:`phalanx.runtime.unmodified`)."""
        path = self.note_path(name)
        try:
            note = json.loads(path.read_bytes()[:8192])
            path.unlink()
        except (OSError, ValueError):
            return None
        return str(note.get("error"))[:2000] if isinstance(note, dict) else None

    def close(self) -> None:
        if self.forks is not None:
            self.forks.close()
