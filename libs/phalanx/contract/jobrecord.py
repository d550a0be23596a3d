"""The job's record in the ``phalanx_jobs`` bucket: the committed plan and the planner's state.

:class:`JobRecord` is the one truth about a job (``<job>.plan``). Ranks and launchers
read only its ``plan``; ``planner`` is the elasticity planner's :class:`JobState`,
typed so that a newly elected leader reads exactly what the last one wrote, its
timers included: each pending timer is a deadline (wall time) in ``timers``, so a
new leader arms them again as they are, without rebuilding anything from flags.

The phase is the job's lifecycle, and the one place it is kept:

- ``waiting``: nodes joining, not every rank registered yet (no plan);
- ``recovering``: a generation is committed, some member has not acknowledged it;
- ``running``: every member acknowledged the current generation;
- ``broken``: members reported failed collectives of the current generation; the
  same members re-form when the ``reform`` timer fires unless a fault explains it;
- ``holding``: an incident waits for spares still starting (a ``spares:<incident>``
  timer ends the wait);
- ``stopped`` / ``completed``: the run ended (a new spec opens the next run).

The planner (services/elasticity_planner/reducer.py) derives the phase from the
data beside it after every input (:meth:`JobState.settle`), so it never disagrees
with them.
"""

from __future__ import annotations

from collections.abc import Collection
from enum import StrEnum
from typing import Any, TypeVar

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, model_validator

from phalanx.contract.messages import JobMessage, JobSpec, Plan
from phalanx.contract.runs import Names, NameSet

ENDED_PHASES = ("stopped", "completed")


class JobPhase(StrEnum):
    WAITING = "waiting"
    RECOVERING = "recovering"
    RUNNING = "running"
    BROKEN = "broken"
    HOLDING = "holding"
    STOPPED = "stopped"
    COMPLETED = "completed"

    @property
    def ended(self) -> bool:
        return self.value in ENDED_PHASES


class _State(BaseModel):
    """Mutable (the planner changes a private copy), strict about unknown fields."""

    model_config = ConfigDict(extra="forbid", validate_assignment=False)

    def __eq__(self, other: object) -> bool:
        # The fields only: pydantic would compare the private caches too (node_of's index).
        return type(other) is type(self) and self.__dict__ == other.__dict__

    __hash__ = None  # type: ignore[assignment]  # mutable

    def clone(self: S) -> S:
        """A private copy for one planner step, in time linear in the state and ~50x
        faster than ``model_copy(deep=True)``: containers are copied, frozen messages
        (the spec, the plan) shared, nested states cloned. Private caches are not copied."""
        twin = self.__copy__()  # shallow: fields set, private caches (replaced, never changed in place)
        twin.__dict__.update({name: _cloned(value) for name, value in self.__dict__.items()})
        return twin


S = TypeVar("S", bound=_State)


def _cloned(value: Any) -> Any:
    if isinstance(value, _State):
        return value.clone()
    if isinstance(value, list):
        return [_cloned(v) for v in value] if value and isinstance(value[0], _State) else list(value)
    if isinstance(value, dict):
        if value and isinstance(next(iter(value.values())), _State | list | dict | set):
            return {k: _cloned(v) for k, v in value.items()}
        return dict(value)
    if isinstance(value, set):
        return set(value)
    return value  # str, numbers, enums, frozen messages (Message is frozen)


class NodeState(_State):
    """One node's launcher in the job, as it joined."""

    launcher: str
    host: str
    store_addr: str
    workers: Names = Field(description="Its workers, in start order (runs of names on the wire).")
    ranks: int = Field(description="How many of ``workers`` started as ranks.")
    lost: bool = False
    slots: int = Field(
        default=-1,
        description="Worker slots the job may use here: what it joined with, plus capacity offered since,"
        " minus slots whose worker crashed; 0 once reclaimed. -1: not known (len(workers)).",
    )
    reserve: int = Field(default=0, description="Hot spares the node brought: kept up by asking for more.")


class Incident(_State):
    """A fault whose decision waits for spares still starting (kept in the record)."""

    incident: str
    worker: str = ""  # a rank's fault ...
    node: str = ""  # ... or a node lost
    cause: str
    hung: bool = False
    generation: int | None = Field(default=None, description="The generation a rank's verdict is on.")
    cause_class: str = Field(description="The metrics' cause label (crash, hang, node_lost, ...).")
    fault_at: float = 0.0
    detected_at: float = 0.0
    attributes: dict[str, str] = Field(default_factory=dict)
    since: float = Field(default=0.0, description="Wall time the wait for spares began (0: not waiting).")


class JobState(_State):
    """The planner's state of one job (its part of :class:`JobRecord`)."""

    spec: JobSpec = Field(description="The first node's spec: the run's settings.")
    run: str = Field(default="", description="The job-level run id every plan of this run carries.")
    phase: JobPhase = JobPhase.WAITING
    plan: Plan | None = Field(default=None, exclude=True, description="Stored beside, as JobRecord.plan.")
    acked: int = Field(default=0, description="The newest generation every member acknowledged.")
    nodes: dict[str, NodeState] = Field(default_factory=dict, description="In join order.")
    ranks: NameSet = Field(
        default_factory=set,
        description="Registered rank-role workers (a set: sorted runs on the wire, O(1) to look up).",
    )
    spares: Names = Field(default_factory=list, description="Warm spares, first to be used first.")
    lost: NameSet = Field(default_factory=set)
    lost_launchers: list[str] = Field(default_factory=list)
    base_generation: int = Field(default=0, description="The job's generation when this run began.")
    start_world: int = 0
    exited: NameSet = Field(default_factory=set, description="Workers their launcher saw die.")
    reforms: int = Field(default=0, description="Re-forms of the same members in a row.")
    restarts: int = Field(default=0, description="Faults recovered from (against JobSpec.max_restarts).")
    reform_at: float = Field(default=0.0, description="Wall time of the last re-form.")
    broken: dict[str, str] = Field(
        default_factory=dict, description="Worker -> its failed collective, this generation."
    )
    broken_at: float = Field(default=0.0, description="Wall time of the first such report.")
    deferred: list[Incident] = Field(default_factory=list, description="Incidents waiting for spares.")
    changed_at: float = Field(default=0.0, description="Wall time of the last change of members.")
    offered: dict[str, int] = Field(
        default_factory=dict, description="Node -> the cluster's offer last seen."
    )
    spawned: dict[str, float] = Field(
        default_factory=dict, description="Worker a launcher was asked to start -> when."
    )
    notices: list[str] = Field(default_factory=list, description="Proposals handled (newest last).")
    sched_seq: int = Field(default=0, description="The newest scheduler signal this job took.")
    timers: dict[str, float] = Field(
        default_factory=dict, description="Pending timers: name -> deadline (wall time)."
    )

    def clone(self) -> JobState:
        """A private copy for one planner step (:meth:`_State.clone`), sharing the nodes'
        records until :meth:`node` is asked for one to change: at 2,000 nodes, copying
        them all would be most of a step's time."""
        nodes = self.nodes
        self.__dict__["nodes"] = {}
        try:
            twin = super().clone()
        finally:
            self.__dict__["nodes"] = nodes
        twin.__dict__["nodes"] = dict(nodes)
        twin._owned = set()
        return twin

    def node(self, name: str) -> NodeState:
        """Node ``name``'s record, to change: the only way a step may change one (the
        records are shared with the state the step was given until then)."""
        if name not in self._owned:
            self.nodes[name] = self.nodes[name].clone()
            self._owned.add(name)
        return self.nodes[name]

    _owned: set[str] = PrivateAttr(default_factory=set)

    @property
    def generation(self) -> int:
        return self.plan.generation if self.plan else self.base_generation

    @property
    def min_world_size(self) -> int:
        return self.spec.min_world_size or self.start_world

    @property
    def max_world_size(self) -> int:
        return max(self.spec.elastic.max_world_size or self.start_world, self.min_world_size)

    @property
    def world_size(self) -> int:
        return self.plan.world_size if self.plan else 0

    def allowed(self, world: int) -> bool:
        """Whether the job may run at ``world`` ranks (min, max, allowed sizes)."""
        return self.min_world_size <= world <= self.max_world_size and self.spec.elastic.allowed(world)

    def usable_spares(self, exclude: Collection[str] = ()) -> list[str]:
        """Registered spares on live nodes, minus ``exclude``."""
        return [
            s
            for s in self.spares
            if s not in exclude and (n := self.node_of(s)) is not None and not self.nodes[n].lost
        ]

    def alive(self, node: str) -> list[str]:
        """Workers of ``node`` not lost or gone (ranks, spares and those starting)."""
        return [w for w in self.nodes[node].workers if w not in self.lost]

    def node_of(self, worker: str) -> str | None:
        """The node ``worker`` was started on (None: no worker of this job), from an index:
        a lookup per worker must not scan every node's workers (18,000 at 16k ranks).

        Workers are only ever added to a node (spawns) or the node is replaced whole by
        :meth:`put_node` (a launcher joining, or rejoining as a lost node's name with
        other workers), which drops the index; a name the index lacks rebuilds it once
        the number of workers changed since it was built."""
        node = self._nodes_index.get(worker)
        return node if node is not None else self.worker_nodes().get(worker)

    def worker_nodes(self) -> dict[str, str]:
        """worker -> node for every worker of the job (the index :meth:`node_of` reads;
        loops over many workers read it once). Do not change it."""
        total = sum(len(s.workers) for s in self.nodes.values())
        if total != self._indexed:
            self._nodes_index = {w: n for n, s in self.nodes.items() for w in s.workers}
            self._indexed = total
        return self._nodes_index

    def put_node(self, name: str, node: NodeState) -> None:
        """Add ``node`` as ``name``, or replace the node of that name (its workers too)."""
        self.nodes[name] = node
        self._indexed = -1

    _nodes_index: dict[str, str] = PrivateAttr(default_factory=dict)
    _indexed: int = PrivateAttr(default=-1)

    def live_nodes(self) -> list[str]:
        return [n for n, s in self.nodes.items() if not s.lost]

    def settle(self) -> None:
        """Derive the phase from the data beside it (an ended run stays ended)."""
        if self.phase.ended:
            return
        if self.plan is None:
            self.phase = JobPhase.WAITING
        elif self.deferred:
            self.phase = JobPhase.HOLDING
        elif self.broken:
            self.phase = JobPhase.BROKEN
        elif self.acked < self.plan.generation:
            self.phase = JobPhase.RECOVERING
        else:
            self.phase = JobPhase.RUNNING


class JobRecord(JobMessage):
    """The one truth about a job: its committed plan and the planner's state, in the
    ``phalanx_jobs`` KV bucket under ``<job>.plan``. Written only by the planner
    leader, by compare-and-set on the revision its decision was computed from;
    ranks and launchers watch it and read only ``plan``."""

    KIND = "job_record"
    SCHEMA_VERSION = 2  # 2: runs of names (runs.py); zlib
    COMPRESSED = True
    token: int = Field(ge=0, description="Fencing token of the planner leader that wrote it.")
    plan: Plan | None = None
    planner: JobState | None = Field(
        default=None, description="The planner's own state (nodes, spares, timers): read only by the planner."
    )

    @model_validator(mode="after")
    def _link(self) -> JobRecord:
        # The plan is stored once, beside the planner's state; the state reads it from there.
        if self.planner is not None:
            self.planner.plan = self.plan
        return self
