"""What the detector decides: :class:`Incident` about one process incarnation,
:class:`NodeIncident` about one node's launcher, and their stable ids (the
``Nats-Msg-Id`` of the event, so a second path to the same fault, a duplicate or a
restarted detector never makes a second event)."""

from __future__ import annotations

from dataclasses import dataclass, field

from phalanx.contract import Evidence, FaultCause, NodeLost, RankFailed, RankHung

__all__ = ["Incident", "NodeIncident", "Verdict", "incident_id", "node_incident_id"]


def incident_id(job: str, worker: str, pid: int) -> str:
    """The stable id of the incident of one process incarnation.

    >>> incident_id("j1", "w3", 4242)
    'j1:w3:4242'
    """
    return f"{job}:{worker}:{pid}"


def node_incident_id(job: str, node: str, launcher: str) -> str:
    """The stable id of the incident of one node's launcher.

    >>> node_incident_id("j1", "node-b", "7001")
    'j1:node:node-b:7001'
    """
    return f"{job}:node:{node}:{launcher}"


@dataclass(frozen=True)
class Incident:
    """One verdict about one process incarnation."""

    job: str
    worker: str
    pid: int
    rank: int
    generation: int
    cause: FaultCause
    fault_at: float
    """Wall-clock seconds when the fault is inferred to have happened."""
    evidence: Evidence = field(default_factory=dict)

    @property
    def id(self) -> str:
        return incident_id(self.job, self.worker, self.pid)

    def to_event(self) -> RankFailed | RankHung:
        """The bus message: :class:`RankFailed` for an exit, else :class:`RankHung`."""
        cls = RankFailed if self.cause is FaultCause.PROCESS_EXIT else RankHung
        return cls(
            job=self.job,
            incident=self.id,
            worker=self.worker,
            rank=self.rank,
            generation=self.generation,
            cause=self.cause,
            fault_at=self.fault_at,
            evidence=dict(self.evidence),
        )


@dataclass(frozen=True)
class NodeIncident:
    """One verdict about one node's launcher: its digests stopped."""

    job: str
    node: str
    launcher: str
    workers: tuple[str, ...]
    fault_at: float
    """Wall-clock arrival of the node's last digest."""
    evidence: Evidence = field(default_factory=dict)
    cause: FaultCause = FaultCause.HEARTBEAT_LOST

    @property
    def id(self) -> str:
        return node_incident_id(self.job, self.node, self.launcher)

    def to_event(self) -> NodeLost:
        return NodeLost(
            job=self.job,
            incident=self.id,
            node=self.node,
            workers=list(self.workers),
            cause=self.cause,
            fault_at=self.fault_at,
            evidence=dict(self.evidence),
        )


Verdict = Incident | NodeIncident
