"""Message schemas (pydantic v2) and their msgpack codec."""

from phalanx.schemas._base import JobMessage, Message, message_class, now, registry
from phalanx.schemas.codec import DecodeError, decode, encode, headers_for
from phalanx.schemas.messages import (
    Action,
    CapacityChanged,
    CollectiveError,
    ErrorEvent,
    Evidence,
    FaultCause,
    HealthReply,
    Heartbeat,
    JobSpec,
    Member,
    Phase,
    Ping,
    Plan,
    PlanAck,
    PlanDecision,
    PreemptionNotice,
    RankExited,
    RankFailed,
    RankHung,
    RecoveryDone,
    Registered,
    Role,
)

__all__ = [
    "Action", "CapacityChanged", "CollectiveError", "DecodeError", "ErrorEvent", "Evidence",
    "FaultCause", "HealthReply", "Heartbeat", "JobMessage", "JobSpec", "Member", "Message",
    "Phase", "Ping", "Plan", "PlanAck", "PlanDecision", "PreemptionNotice", "RankExited",
    "RankFailed", "RankHung", "RecoveryDone", "Registered", "Role", "decode", "encode", "headers_for",
    "message_class", "now", "registry",
]
