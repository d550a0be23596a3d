"""The elasticity planner's settings (``python -m phalanx.services.elasticity_planner``)."""

from __future__ import annotations

from pydantic import Field

from phalanx.settings.common import ServiceSettings


class PlannerSettings(ServiceSettings):
    """Re-forms, the leader's lease, republishing, spares and spawns."""

    planner_comm_grace_s: float = Field(
        default=2.0,
        ge=0,
        description="How long comm errors of a generation are gathered before it is re-formed.",
    )
    planner_max_reforms: int = Field(
        default=5, ge=0, description="Re-forms of a job in a row before it is failed."
    )
    planner_reform_backoff_max_s: float = Field(
        default=30.0, ge=0, description="Ceiling of the backoff between re-forms."
    )
    planner_republish_s: float = Field(
        default=1.0, gt=0, description="How often an unanswered plan is published again."
    )
    planner_lease_ttl_s: float = Field(
        default=1.0, gt=0, description="The leader's lease; a standby takes over after it."
    )
    planner_spec_max_age_s: float = Field(
        default=300.0, gt=0, description="Job specs older than this are not acted on."
    )
    planner_spare_wait_s: float = Field(
        default=30.0, ge=0, description="How long a lost rank waits for a spare to appear."
    )
    planner_spawn_timeout_s: float = Field(
        default=120.0, gt=0, description="How long a requested worker has to register."
    )
    planner_journal: str = Field(
        default="",
        description="A file the planner leader appends its inputs to, one JSON line each (replayable).",
    )
