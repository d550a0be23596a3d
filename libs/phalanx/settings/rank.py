"""A training process's settings (``phalanx worker``, started by its launcher)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

from pydantic import BeforeValidator, Field
from pydantic_settings import NoDecode

from phalanx.contract import Role
from phalanx.settings.common import (
    PLAIN_NAME,
    HeartbeatSettings,
    NatsSettings,
    NodeSettings,
    TelemetrySettings,
)
from phalanx.settings.parsing import Fault, TierPolicy, parse_faults


def _faults(value: Any) -> Any:
    return parse_faults(value) if isinstance(value, str) else value


def _tier_policy(value: Any) -> Any:
    return TierPolicy.parse(value) if isinstance(value, str) else value


class RankSettings(NatsSettings, TelemetrySettings, HeartbeatSettings, NodeSettings):
    """The launcher's hand-off, the collective bounds, state transfer, data, checkpoints
    and fault injection; ``_s`` properties give the durations set in ms in seconds."""

    # --- the hand-off, set by the launcher ---------------------------------------------------
    job: str | None = Field(default=None, pattern=PLAIN_NAME, description="The job's name.")
    worker: str | None = Field(default=None, pattern=PLAIN_NAME, description="This worker's name.")
    role: Role | None = Field(default=None, description="rank or spare.")
    store_addr: str | None = Field(default=None, description="host:port of this node's launcher's store.")
    bind: str | None = Field(default=None, description="The address gloo listens on.")
    launch: str = Field(default="", description="The launcher run's id.")
    local_slot: int = Field(default=0, ge=0, description="The worker's slot on its node; picks its GPU.")
    heartbeat_socket: Path | None = Field(
        default=None, description="The launcher's unix socket for heartbeats (unset: heartbeats go to NATS)."
    )
    plan_socket: Path | None = Field(
        default=None,
        description="This worker's unix socket on which its launcher hands it the node's plan"
        " (unset: the worker follows the job's record and plan subject itself).",
    )
    launcher_pid: int | None = Field(
        default=None,
        gt=0,
        description="The launcher's pid, the one sender the plan socket accepts (unset: the parent's; a worker"
        " forked by the node's fork server has that server for parent).",
    )

    # --- collectives, state transfer, data, drains, checkpoints ------------------------------
    collective_timeout_s: float = Field(default=120.0, gt=0, description="Backstop of every collective.")
    collective_floor_ms: float = Field(
        default=2000.0, gt=0, description="Floor of the learned all-reduce bound."
    )
    collective_inside_floor_ms: float = Field(
        default=1000.0,
        gt=0,
        description="Floor of the bound of a collective every member is known to be inside (a "
        "generation's first all-reduce after its barrier; an unmodified script's collectives).",
    )
    collective_factor: float = Field(
        default=4.0, gt=0, description="The all-reduce bound is factor x the slowest recent."
    )
    collective_initial_ms: float = Field(
        default=60000.0, gt=0, description="The all-reduce bound before one completed."
    )
    state_max_bytes: int = Field(
        default=64 << 30, ge=0, description="The largest state buffer a joiner accepts."
    )
    data_cache_dir: Path | None = Field(
        default=None,
        description="Node-local data caches (default /dev/shm/phalanx-data-<uid>, else the temp dir).",
    )
    agent_drain_s: float = Field(
        default=15.0, ge=0, description="How long a closing rank waits for events in flight."
    )
    keeper_node: str | None = Field(
        default=None, description="The keeper's node, where it differs from node."
    )
    ckpt_tiers: Annotated[TierPolicy | None, NoDecode, BeforeValidator(_tier_policy)] = Field(
        default=None,
        description="The node's tier policy (the keeper's); a rank reads memory's every, its snapshot interval.",
    )

    # --- fault injection (tests, demo, benchmarks) -------------------------------------------
    faults: Annotated[tuple[Fault, ...], NoDecode, BeforeValidator(_faults)] = Field(
        default=(), description="Faults to strike: action:worker@step=N,... (phalanx.runtime.faults)."
    )
    fault_log: Path | None = Field(
        default=None, description="Each fault struck is appended here as a JSON line."
    )

    @property
    def ckpt_snapshot_every(self) -> int | None:
        """Steps between a rank's snapshots as ``PHALANX_CKPT_TIERS`` says (memory's
        ``every``); None where it does not say (the job's ``checkpoint(every)`` stands)."""
        return self.ckpt_tiers.snapshot_every if self.ckpt_tiers is not None else None

    @property
    def collective_floor_s(self) -> float:
        return self.collective_floor_ms / 1e3

    @property
    def collective_inside_floor_s(self) -> float:
        return self.collective_inside_floor_ms / 1e3

    @property
    def collective_initial_s(self) -> float:
        return self.collective_initial_ms / 1e3
