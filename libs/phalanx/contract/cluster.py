"""The cluster record (``phalanx_cluster`` KV): nodes with the worker slots they offer, and preemptions.

Part of the contract: scheduler-signal reads it, ``phalanx cluster`` writes it (:mod:`phalanx.cluster`),
and proto/ documents it.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, model_validator

NAME_PATTERN = r"^[A-Za-z0-9_-]+$"
DEFAULT_CLUSTER = "local"
MAX_SLOTS = 100_000  # per node: far beyond any machine, small enough to catch a typo

NodeName = Annotated[str, Field(pattern=NAME_PATTERN, max_length=64)]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ClusterNode(_Strict):
    """A node: the slots it offers beyond what its launchers started with."""

    name: NodeName
    slots: int = Field(ge=0, le=MAX_SLOTS)
    ready: bool = True
    reclaims: int = Field(default=0, ge=0, description="Times reclaimed: numbers its preemptions.")


class ClusterPreemption(_Strict):
    """The scheduler takes ``nodes`` (every worker on them) or ``workers`` of ``job`` back."""

    id: str = Field(pattern=NAME_PATTERN, max_length=128)
    job: str | None = Field(default=None, pattern=NAME_PATTERN, max_length=64)
    workers: list[str] = Field(default_factory=list)
    nodes: list[NodeName] = Field(default_factory=list)
    deadline_s: float = Field(default=30.0, ge=0, allow_inf_nan=False)
    at: float | None = Field(
        default=None, ge=0, allow_inf_nan=False, description="Wall time the deadline counts from."
    )
    reason: str = Field(default="", max_length=500)

    def remaining_s(self, now: float) -> float:
        """Seconds left at wall time ``now`` (the whole ``deadline_s`` when ``at`` is unset)."""
        if self.at is None:
            return self.deadline_s
        return max(0.0, self.at + self.deadline_s - now)


class ClusterState(_Strict):
    """A cluster: its nodes (slots each) and pending preemptions."""

    cluster: str = Field(default=DEFAULT_CLUSTER, pattern=NAME_PATTERN, max_length=64)
    nodes: list[ClusterNode] = Field(default_factory=list)
    preemptions: list[ClusterPreemption] = Field(default_factory=list)

    @model_validator(mode="after")
    def _unique(self) -> ClusterState:
        for what, names in (
            ("node", [n.name for n in self.nodes]),
            ("preemption", [p.id for p in self.preemptions]),
        ):
            dup = {n for n in names if names.count(n) > 1}
            if dup:
                raise ValueError(f"{what} names appear twice: {sorted(dup)}")
        return self

    @property
    def available_slots(self) -> int:
        return sum(n.slots for n in self.nodes if n.ready)

    @property
    def offered(self) -> dict[str, int]:
        """Slots offered per node (0 for a node that is not ready)."""
        return {n.name: n.slots if n.ready else 0 for n in self.nodes}

    def node(self, name: str) -> ClusterNode | None:
        return next((n for n in self.nodes if n.name == name), None)
