"""What one node's launcher is told: its part of a job (:class:`LaunchConfig`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from phalanx.contract import Elastic, Recovery


@dataclass
class LaunchConfig:
    """One node's part of a job. ``nproc`` ranks and ``spares`` hot spares start on
    this node; ``min_nodes``..``max_nodes``, ``global_batch``, ``min_nproc`` and the
    command are job-level settings every node's launcher must agree on."""

    job: str
    cmd: list[str]
    nproc: int
    spares: int = 0
    global_batch: int = 32
    min_nproc: int | None = None  # smallest world a shrink may leave (default: no shrink)
    nats_url: str | None = None
    env: dict[str, str] = field(default_factory=dict)
    log_dir: Path | None = None
    node: str = "local"
    min_nodes: int = 1
    max_nodes: int = 1
    bind: str | None = None  # the address store and gloo listen on; None: towards NATS
    join_timeout_s: float = 10.0  # for the planner's answer
    join_retry_s: float = 30.0  # for a refusal that may lift (the node's old launcher not yet lost)
    store_timeout_s: float = 60.0  # for the store process to serve (it imports torch)
    elastic: Elastic = field(default_factory=Elastic)  # sizes, cool-down, grace, batch split, LR rule
    recovery: Recovery = (
        Recovery.IN_PROCESS
    )  # restart: an unmodified torchrun script (phalanx.runtime.unmodified)
    max_restarts: int = -1  # faults the job recovers from before it stops (-1: no limit)
    warm: bool = True  # start Python workers from the node's fork server (phalanx.runtime.zygote)
    restart_grace_s: float = 3.0  # a member ended for a restart: SIGTERM, then SIGKILL after this
