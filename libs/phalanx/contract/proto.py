"""Generate and check ``proto/``, the wire contract, from the code.

``proto/`` is derived from the subject catalogue (:mod:`phalanx.contract.subjects`), the
stream topology (:mod:`phalanx.bus.topology`), the message models
(:mod:`phalanx.contract`) and the codec's header contract. It holds:

- ``subjects.json``: every subject with its transport, message kind, schema
  version and the stream it lands in, plus the streams and the KV bucket;
- ``schemas/<kind>.json``: the JSON Schema of each registered message, with its
  kind, schema version and headers;
- ``asyncapi.json``: an AsyncAPI 3.0 document (servers, channels, operations,
  messages with header and payload schemas, examples).

``proto/README.md`` is written by hand and left alone.

    python -m phalanx.contract.proto write proto     # make proto
    python -m phalanx.contract.proto check proto     # make proto-check: exit 1 on any drift
"""

from __future__ import annotations

import argparse
import difflib
import json
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from phalanx import __version__
from phalanx.contract import (
    Action,
    CapacityChanged,
    CheckpointEvent,
    CollectiveError,
    DigestEntry,
    ErrorEvent,
    FaultCause,
    HealthReply,
    Heartbeat,
    JobRecord,
    JobSpec,
    JobState,
    Member,
    Message,
    NodeAck,
    NodeDigest,
    NodeJoined,
    NodeLost,
    NodePlan,
    Phase,
    Ping,
    Plan,
    PlanAck,
    PlanDecision,
    PlanDelta,
    PreemptionNotice,
    Proposal,
    RankExited,
    RankFailed,
    RankHung,
    RecoveryDone,
    Registered,
    Role,
    SpawnWorkers,
    StepRecord,
    StepStats,
    registry,
)
from phalanx.contract.cluster import ClusterState
from phalanx.contract.codec import ENCODING, HDR_ENCODING, HDR_KIND, HDR_SCHEMA, headers_for
from phalanx.contract.streams import CLUSTER_BUCKET, DUPLICATE_WINDOW_S, JOBS_BUCKET, STREAMS, StreamSpec
from phalanx.contract.subjects import (
    ACK,
    CAPACITY,
    CATALOGUE,
    CHECKPOINT,
    COMM_ERROR,
    DECISION,
    DELTA,
    ERROR,
    EXITED,
    FAILED,
    HEALTH,
    HEARTBEAT,
    HUNG,
    INSTANCE_HEALTH,
    JOB_SPEC,
    JOINED,
    NODE_ACK,
    NODE_DIGEST,
    NODE_LOST,
    NODE_PROBE,
    PLAN,
    PREEMPT,
    PROPOSAL,
    RECOVERED,
    REGISTERED,
    SPAWN,
    STEPS,
    Subject,
    Transport,
)

CONTENT_TYPE = "application/msgpack"
JSON_SCHEMA_DIALECT = "https://json-schema.org/draft/2020-12/schema"
MSG_ID_HEADER = "Nats-Msg-Id"
TRACEPARENT_PATTERN = r"^[0-9a-f]{2}-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}$"
GENERATED = ("subjects.json", "asyncapi.json", "schemas/")

# Who sends and who receives each subject. The subject catalogue says what travels
# where; this table says between which parties. "rank" is the runtime embedded in
# every training rank and spare, "launcher" is ``phalanx run``, "operator" is a
# person or tool (the CLI, a dashboard, a user's policy).
#
# It states what the code does, and tests/integration/test_parties.py holds it to
# that: it starts each party for real against a nats-server, records every subject
# the party subscribes to, consumes and publishes (bad input included, which a
# receiver reports on phalanx.err.<itself>), and fails when a party receives a
# subject not listed here, is listed as a receiver and never subscribes, or sends
# something it is not listed for. phalanx.natsauth derives every role's NATS
# permissions from this table, senders and receivers.
PARTIES: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    # Ranks under a launcher send their heartbeats to it over a unix socket; the
    # launcher sums them up in its node digest (not a NATS subscription).
    HEARTBEAT.pattern: (("rank",), ("failure-detector",)),
    NODE_DIGEST.pattern: (("launcher",), ("failure-detector", "policy")),
    REGISTERED.pattern: (("rank",), ("failure-detector", "elasticity-planner")),
    EXITED.pattern: (("launcher",), ("failure-detector", "elasticity-planner")),
    # The detector takes a failed collective as a survivor's word that a mass silence is real.
    COMM_ERROR.pattern: (("rank",), ("elasticity-planner", "failure-detector")),
    FAILED.pattern: (("failure-detector",), ("elasticity-planner",)),
    HUNG.pattern: (("failure-detector",), ("elasticity-planner",)),
    NODE_LOST.pattern: (("failure-detector",), ("elasticity-planner",)),
    # The detector learns from the join answers and spawn requests which node runs which
    # worker: a launcher speaks only for its own node's workers.
    JOINED.pattern: (("elasticity-planner",), ("launcher", "failure-detector")),
    DECISION.pattern: (("elasticity-planner",), ("launcher", "policy", "operator")),
    ACK.pattern: (("rank",), ("elasticity-planner",)),
    NODE_ACK.pattern: (("launcher",), ("elasticity-planner",)),
    RECOVERED.pattern: (("rank",), ("elasticity-planner", "state-replication", "policy", "operator")),
    STEPS.pattern: (("launcher",), ("operator",)),
    CHECKPOINT.pattern: (("state-replication",), ("policy", "operator")),
    JOB_SPEC.pattern: (("launcher",), ("elasticity-planner",)),
    # A rank without a launcher also follows the plan in the job's KV record
    # (phalanx_jobs/<job>.plan); a launcher reads that record only when a delta does not apply.
    PLAN.pattern: (
        ("elasticity-planner",),
        ("rank", "failure-detector", "state-replication", "policy"),
    ),
    # Launchers follow the deltas and hand their ranks their node's part (NodePlan) locally.
    DELTA.pattern: (("elasticity-planner",), ("launcher", "policy")),
    CAPACITY.pattern: (("scheduler-signal",), ("elasticity-planner", "policy", "operator")),
    PREEMPT.pattern: (("scheduler-signal",), ("elasticity-planner", "policy", "operator")),
    SPAWN.pattern: (("elasticity-planner",), ("launcher", "failure-detector")),
    PROPOSAL.pattern: (("policy",), ("elasticity-planner",)),
    # Whoever decodes input through the bus reports what it refused.
    ERROR.pattern: (
        ("failure-detector", "elasticity-planner", "state-replication", "rank", "launcher"),
        ("operator",),
    ),
    # request/reply: the requester "sends" the request, the service "receives" it and replies.
    HEALTH.pattern: (
        ("operator",),
        ("failure-detector", "scheduler-signal", "elasticity-planner", "state-replication"),
    ),
    # A standby planner asks the lease holder, which answers its own instance's subject.
    INSTANCE_HEALTH.pattern: (("elasticity-planner",), ("elasticity-planner",)),
    # The detector asks the launchers of a mass silence whether they are there.
    NODE_PROBE.pattern: (("failure-detector",), ("launcher",)),
}

# What the KV bucket's keys hold (no headers there: the reader knows the kind by the key).
KV_RECORDS: dict[str, type[Message]] = {"<job>.plan": JobRecord}
# What travels on a node only, over a unix datagram socket (no NATS): the launcher hands
# each of its workers the node's part of the plan (phalanx.worker.plansocket).
LOCAL_SOCKETS: dict[str, type[Message]] = {"$PHALANX_PLAN_SOCKET (launcher -> its worker)": NodePlan}
# The local cluster's records (phalanx.cluster): plain JSON, not messages, under the cluster's name.
CLUSTER_RECORDS: dict[str, type[ClusterState]] = {"<cluster>": ClusterState}

# The request each request/reply subject takes; its reply is ``Subject.message``.
REQUESTS: dict[str, type[Message]] = {
    HEALTH.pattern: Ping,
    INSTANCE_HEALTH.pattern: Ping,
    NODE_PROBE.pattern: Ping,
}

PARAMETERS: dict[str, str] = {
    "job": "Job id: letters, digits, '_' and '-' (at most 64).",
    "worker": "Worker slot in the job: w0..wN (one node) or <node>-w0.., spares included.",
    "node": "A node of the job (one launcher each): letters, digits, '_' and '-'.",
    "cluster": "Name of the cluster a scheduler signal is about.",
    "service": "Name of a Phalanx service, e.g. failure-detector.",
    "instance": "One process of a service: a digest of its instance name (host:pid:nonce).",
}


class ContractError(RuntimeError):
    """The code's wire contract is inconsistent (e.g. a subject lands in no stream)."""


# -- examples ----------------------------------------------------------------
def examples() -> dict[str, Message]:
    """One fixed, valid example of every message kind (documentation and tests)."""
    ts = 1767225600.0  # 2026-01-01T00:00:00Z
    ex: list[Message] = [
        Heartbeat(
            job="j1",
            ts=ts,
            worker="w0",
            rank=0,
            generation=1,
            step=120,
            step_ms=85.0,
            phase=Phase.COMPUTE,
            phase_ms=12.5,
            seq=4711,
            pid=4242,
            host="node-a",
            interval_ms=100.0,
        ),
        Registered(job="j1", ts=ts, worker="w4", role=Role.SPARE, host="node-b", pid=4250),
        RankExited(
            job="j1",
            ts=ts,
            worker="w2",
            pid=4244,
            host="node-a",
            exit_code=None,
            signal=9,
            exited_at=ts - 0.05,
        ),
        CollectiveError(
            job="j1",
            ts=ts,
            worker="w1",
            rank=1,
            generation=1,
            step=120,
            error="Connection closed by peer [127.0.0.1]:29500",
        ),
        RankFailed(
            job="j1",
            ts=ts,
            incident="j1-g1-w2-exit",
            worker="w2",
            rank=2,
            generation=1,
            cause=FaultCause.PROCESS_EXIT,
            fault_at=ts - 0.05,
            detected_at=ts,
            evidence={"signal": 9, "pid": 4244},
        ),
        RankHung(
            job="j1",
            ts=ts,
            incident="j1-g1-w3-stall",
            worker="w3",
            rank=3,
            generation=1,
            cause=FaultCause.STEP_STALL,
            fault_at=ts - 5.0,
            detected_at=ts,
            evidence={"phase": "compute", "phase_ms": 5000.0},
        ),
        NodeLost(
            job="j1",
            ts=ts,
            incident="j1:node:node-b:node-b-9f3e21c04a7b",
            node="node-b",
            launcher="node-b-9f3e21c04a7b",
            workers=["node-b-w0", "node-b-w1"],
            cause=FaultCause.HEARTBEAT_LOST,
            fault_at=ts - 0.25,
            detected_at=ts,
            evidence={"last_seq": 812, "interval_ms": 100.0},
        ),
        NodeDigest(
            job="j1",
            ts=ts,
            node="node-a",
            launcher="node-a-1a2b3c",
            host="node-a",
            seq=812,
            interval_ms=100.0,
            entries=[
                DigestEntry(
                    worker="node-a-w0",
                    pid=4242,
                    seq=4711,
                    rank=0,
                    generation=1,
                    step=120,
                    step_ms=85.0,
                    phase=Phase.COMPUTE,
                    phase_ms=12.5,
                    age_ms=31.0,
                )
            ],
        ),
        JobSpec(
            job="j1",
            ts=ts,
            node="node-a",
            launcher="node-a-1a2b3c",
            host="node-a",
            store_addr="10.0.0.1:29400",
            workers=["node-a-w0", "node-a-w1", "node-a-w2"],
            ranks=2,
            min_nodes=2,
            max_nodes=3,
            min_world_size=2,
            global_batch=64,
            command="sha256:5f1d7c0e9a41",
        ),
        NodeJoined(
            job="j1",
            ts=ts,
            node="node-a",
            launcher="node-a-1a2b3c",
            accepted=True,
            run="r-7c41e2a9b0d3",
            reason="node-a joined: 1 of min 2 nodes",
        ),
        Plan(
            job="j1",
            ts=ts,
            generation=2,
            members=[
                Member(rank=0, worker="w0"),
                Member(rank=1, worker="w1"),
                Member(rank=2, worker="w4"),
                Member(rank=3, worker="w3"),
            ],
            spares=[],
            removed=["w2"],
            incident="j1-g1-w2-exit",
            reason="replace w2 with spare w4",
            store_prefix="phalanx/j1/g2",
            store_addr="10.0.0.1:29400",
            launch="r-7c41e2a9b0d3",
            token=4711,
        ),
        JobRecord(
            job="j1",
            ts=ts,
            token=4711,
            plan=None,
            planner=JobState(
                spec=JobSpec(job="j1", ts=ts, launcher="L1", workers=["w0", "w1"], ranks=2, global_batch=8),
                run="r-7c41e2a9b0d3",
            ),
        ),
        PlanDecision(
            job="j1",
            ts=ts,
            incident="j1-g1-w2-exit",
            action=Action.REPLACE,
            reason="a hot spare is ready",
            generation=2,
        ),
        PlanAck(job="j1", ts=ts, generation=2, worker="w4", rank=2),
        NodeAck(job="j1", ts=ts, node="node-b", generation=2, workers=["node-b-w0", "node-b-w1"]),
        PlanDelta(
            job="j1",
            ts=ts,
            generation=2,
            token=4711,
            launch="r-7c41e2a9b0d3",
            reason="replace node-a-w2 with spare node-b-w4",
            incident="j1-g1-node-a-w2-exit",
            world_size=8,
            store_prefix="phalanx/j1/g2",
            store_addr="10.0.0.1:29400",
            base=1,
            moves=[(0, 2, 0), (3, 5, 3)],
            joined=[("node-b-w", 4, 1, 2)],
            removed=["node-a-w2"],
        ),
        NodePlan(
            job="j1",
            ts=ts,
            generation=2,
            token=4711,
            launch="r-7c41e2a9b0d3",
            reason="replace node-a-w2 with spare node-b-w4",
            world_size=8,
            store_prefix="phalanx/j1/g2",
            store_addr="10.0.0.1:29400",
            node="node-b",
            ranks={"node-b-w0": 4, "node-b-w1": 5, "node-b-w4": 2},
        ),
        RecoveryDone(
            job="j1",
            ts=ts,
            generation=2,
            worker="w4",
            rank=2,
            step=120,
            incident="j1-g1-w2-exit",
            phases_ms={
                "detect": 52.0,
                "plan": 3.1,
                "notify": 4.0,
                "abort": 20.0,
                "comm_init": 310.0,
                "state_transfer": 800.0,
                "data_restore": 1.2,
                "first_step": 90.0,
            },
        ),
        StepStats(
            job="j1",
            ts=ts,
            node="node-a",
            launcher="node-a-1a2b3c",
            seq=17,
            steps=[
                StepRecord(
                    worker="node-a-w0", rank=0, generation=2, step=121, step_ms=84.2, loss=2.31, at=ts - 0.4
                ),
                StepRecord(worker="node-a-w1", rank=1, generation=2, step=121, step_ms=85.0, at=ts - 0.4),
            ],
        ),
        CapacityChanged(
            cluster="local", available_slots=6, delta=2, source="local", ts=ts, offered={"node-b": 2}
        ),
        CheckpointEvent(
            job="j1",
            ts=ts,
            step=1200,
            tier="object",
            state="complete",
            node="node-a",
            bytes=1 << 30,
            seconds=21.4,
        ),
        PreemptionNotice(
            cluster="local",
            job="j1",
            nodes=["node-b"],
            deadline_s=10.0,
            source="local",
            reason="reclaim node-b",
            ts=ts,
        ),
        SpawnWorkers(
            job="j1",
            ts=ts,
            node="node-b",
            launcher="node-b-1a2b3c",
            run="r-7c41e2a9b0d3",
            workers=["node-b-w2"],
            reason="2 slots offered on node-b",
        ),
        Proposal(
            job="j1",
            ts=ts,
            id="p-1",
            policy="step-time",
            world_size=3,
            reason="time per sample fell 18% from 2 to 3 replicas",
        ),
        ErrorEvent(
            service="elasticity-planner",
            subject="phalanx.evt.j1.failed",
            reason="malformed msgpack payload for 'rank_failed'",
            kind="rank_failed",
            ts=ts,
        ),
        HealthReply(
            service="failure-detector",
            status="ok",
            uptime_s=42.0,
            instance="node-a:4100:1a2b3c",
            details={"jobs": 1},
        ),
        Ping(ts=ts),
    ]
    return {m.KIND: m for m in ex}


# -- JSON Schema ---------------------------------------------------------------
def headers_schema(cls: type[Message], transport: Transport | None = None) -> dict[str, Any]:
    """JSON Schema of the NATS headers that carry a message of ``cls``."""
    props: dict[str, Any] = {
        HDR_KIND: {"type": "string", "const": cls.KIND, "description": "Message kind (wire tag)."},
        HDR_SCHEMA: {
            "type": "string",
            "const": str(cls.SCHEMA_VERSION),
            "description": "Schema version of the kind; a receiver refuses a version it does not speak.",
        },
        HDR_ENCODING: {
            "type": "string",
            "const": headers_for(cls)[HDR_ENCODING],
            "description": "Payload encoding (msgpack, or msgpack+zlib: zlib-compressed msgpack);"
            " receivers read either, and a missing header as msgpack.",
        },
        "traceparent": {
            "type": "string",
            "pattern": TRACEPARENT_PATTERN,
            "description": "W3C trace context of the publishing span (absent on untraced heartbeats).",
        },
        "tracestate": {"type": "string", "description": "W3C trace state, when there is one."},
    }
    if transport is None or transport is Transport.JETSTREAM:
        props[MSG_ID_HEADER] = {
            "type": "string",
            "minLength": 1,
            "description": (
                "JetStream de-duplication id: a repeat inside the stream's duplicate window "
                f"({DUPLICATE_WINDOW_S:g} s) is stored once."
            ),
        }
    return {
        "type": "object",
        "required": [HDR_KIND, HDR_SCHEMA, HDR_ENCODING],
        "properties": props,
    }


def kind_schema(cls: type[Message]) -> dict[str, Any]:
    """The file ``schemas/<kind>.json``: payload schema plus the kind's header contract."""
    body = cls.model_json_schema(mode="validation")
    out: dict[str, Any] = {
        "$schema": JSON_SCHEMA_DIALECT,
        "$id": f"urn:phalanx:schema:{cls.KIND}:v{cls.SCHEMA_VERSION}",
        "x-phalanx-kind": cls.KIND,
        "x-phalanx-schema-version": cls.SCHEMA_VERSION,
        "x-phalanx-encoding": headers_for(cls)[HDR_ENCODING],
        "x-phalanx-content-type": CONTENT_TYPE,
        "x-phalanx-headers": headers_schema(cls),
        "x-phalanx-subjects": [s.pattern for s in CATALOGUE if s.message is cls]
        + [p for p, req in REQUESTS.items() if req is cls],
    }
    out.update(body)
    return out


# -- subjects ------------------------------------------------------------------
def subject_matches(filter_: str, subject: str) -> bool:
    """NATS subject matching: ``*`` is one token, ``>`` the rest (one or more)."""
    f, s = filter_.split("."), subject.split(".")
    for i, tok in enumerate(f):
        if tok == ">":
            return len(s) > i
        if i >= len(s) or (tok != "*" and tok != s[i]):
            return False
    return len(f) == len(s)


def stream_of(subject: Subject) -> StreamSpec | None:
    """The stream a subject's messages land in (None for core and request subjects).

    Raises :class:`ContractError` when a JetStream subject lands in no stream or in
    several, or when an ephemeral subject would be captured by a stream.
    """
    probe = subject.format(**{p: "x" for p in subject.params})
    hits = [s for s in STREAMS if any(subject_matches(f, probe) for f in s.subjects)]
    if subject.transport is Transport.JETSTREAM:
        if len(hits) != 1:
            raise ContractError(
                f"{subject.pattern} is a JetStream subject but lands in {len(hits)} streams "
                f"({[s.name for s in hits]})"
            )
        return hits[0]
    if hits:
        raise ContractError(f"{subject.pattern} is {subject.transport} but stream {hits[0].name} captures it")
    return None


def channel_id(subject: Subject) -> str:
    """A stable channel name: the message kind; a later subject of the same kind (the
    health of one instance) adds its last parameter (``health_by_instance``)."""
    first = next(s for s in CATALOGUE if s.message is subject.message)
    if first is subject:
        return subject.message.KIND
    return f"{subject.message.KIND}_by_{subject.params[-1]}"


def subjects_doc() -> dict[str, Any]:
    subjects = []
    for s in CATALOGUE:
        stream = stream_of(s)
        entry: dict[str, Any] = {
            "pattern": s.pattern,
            "subscribe": s.wildcard(),
            "params": s.params,
            "transport": str(s.transport),
            "kind": s.message.KIND,
            "schema_version": s.message.SCHEMA_VERSION,
            "schema": f"schemas/{s.message.KIND}.json",
            "stream": stream.name if stream else None,
            "description": s.description,
        }
        if s.pattern in REQUESTS:
            req = REQUESTS[s.pattern]
            entry["request_kind"] = req.KIND
            entry["request_schema"] = f"schemas/{req.KIND}.json"
        senders, receivers = PARTIES.get(s.pattern, ((), ()))
        entry["senders"] = list(senders)
        entry["receivers"] = list(receivers)
        subjects.append(entry)
    return {
        "encoding": ENCODING,
        "content_type": CONTENT_TYPE,
        "headers": {
            "kind": HDR_KIND,
            "schema": HDR_SCHEMA,
            "encoding": HDR_ENCODING,
            "msg_id": MSG_ID_HEADER,
            "trace": ["traceparent", "tracestate"],
        },
        "streams": [
            {
                "name": st.name,
                "subjects": list(st.subjects),
                "max_age_s": st.max_age_s,
                "duplicate_window_s": DUPLICATE_WINDOW_S,
                "description": st.description,
            }
            for st in STREAMS
        ],
        "kv_buckets": [
            {
                "name": JOBS_BUCKET,
                "keys": {key: cls.KIND for key, cls in KV_RECORDS.items()},
                "description": "Each job's record (its committed plan and the planner's state), "
                "written only by the planner leader by compare-and-set; 'planner-leader' holds the "
                "leader's lease (msgpack: holder, ttl_s, at).",
            },
            {
                "name": CLUSTER_BUCKET,
                "keys": {key: "cluster_state" for key in CLUSTER_RECORDS},
                "encoding": "json",
                "schemas": {
                    key: cls.model_json_schema(mode="validation") for key, cls in CLUSTER_RECORDS.items()
                },
                "description": "The local cluster that `phalanx cluster offer/reclaim` drive: per cluster, "
                "the worker slots each node offers beyond what its launchers started with, and the "
                "preemptions of reclaimed nodes. Written only by admin, by compare-and-set; "
                "scheduler-signal watches it and publishes capacity_changed / preemption_notice.",
            },
        ],
        "local_sockets": [
            {
                "socket": where,
                "kind": cls.KIND,
                "schema": f"schemas/{cls.KIND}.json",
                "description": "The node's part of each plan, one datagram per plan and worker, from the "
                "launcher that started the worker (the worker checks the sender's pid with the kernel); "
                "the worker acknowledges by heartbeat (Heartbeat.plan).",
            }
            for where, cls in LOCAL_SOCKETS.items()
        ],
        "subjects": subjects,
    }


# -- AsyncAPI --------------------------------------------------------------------
def _merge_defs(target: dict[str, Any], defs: dict[str, Any], owner: str) -> None:
    for name, schema in defs.items():
        if name in target and target[name] != schema:
            raise ContractError(f"two different schemas named {name!r} (seen again in {owner})")
        target[name] = schema


def asyncapi_doc() -> dict[str, Any]:
    ref = "#/components/schemas/{model}"
    ex = examples()
    schemas: dict[str, Any] = {}
    messages: dict[str, Any] = {}
    channels: dict[str, Any] = {}
    operations: dict[str, Any] = {}

    def add_message(cls: type[Message], transport: Transport | None) -> str:
        key = cls.KIND
        if key in messages:
            return key
        body = cls.model_json_schema(mode="validation", ref_template=ref)
        _merge_defs(schemas, body.pop("$defs", {}), cls.__name__)
        _merge_defs(schemas, {cls.__name__: body}, cls.__name__)
        msg: dict[str, Any] = {
            "name": key,
            "title": cls.__name__,
            "contentType": CONTENT_TYPE,
            "headers": headers_schema(cls, transport),
            "payload": {"$ref": ref.format(model=cls.__name__)},
            "x-phalanx-schema-version": cls.SCHEMA_VERSION,
        }
        if cls.__doc__ and cls.__doc__.strip():
            msg["summary"] = " ".join(cls.__doc__.split())
        if key in ex:
            sample = ex[key]
            hdrs = headers_for(cls)
            msg["examples"] = [
                {"name": f"{key}-example", "headers": hdrs, "payload": sample.model_dump(mode="json")}
            ]
        messages[key] = msg
        return key

    for s in CATALOGUE:
        cid = channel_id(s)
        stream = stream_of(s)
        request = REQUESTS.get(s.pattern)
        reply_kind = add_message(s.message, s.transport)
        # A request/reply subject carries the request; the reply goes to the inbox.
        kinds = [add_message(request, s.transport)] if request is not None else [reply_kind]
        channel: dict[str, Any] = {
            "address": s.pattern,
            "title": cid,
            "description": s.description,
            "messages": {k: {"$ref": f"#/components/messages/{k}"} for k in kinds},
            "x-phalanx-transport": str(s.transport),
            "x-phalanx-stream": stream.name if stream else None,
            "x-phalanx-subscribe": s.wildcard(),
        }
        if s.params:
            channel["parameters"] = {p: {"description": PARAMETERS.get(p, p)} for p in s.params}
        channels[cid] = channel
        reply_channel = None
        if request is not None:
            reply_channel = f"{cid}_reply"
            channels[reply_channel] = {
                "address": None,
                "title": reply_channel,
                "description": f"The requester's inbox: the reply to a request on {s.pattern}.",
                "messages": {s.message.KIND: {"$ref": f"#/components/messages/{s.message.KIND}"}},
                "x-phalanx-transport": "core",
            }

        senders, receivers = PARTIES.get(s.pattern, ((), ()))
        first = request.KIND if request is not None else s.message.KIND
        for action, parties in (("send", senders), ("receive", receivers)):
            for party in parties:
                op: dict[str, Any] = {
                    "action": action,
                    "channel": {"$ref": f"#/channels/{cid}"},
                    "messages": [{"$ref": f"#/channels/{cid}/messages/{first}"}],
                    "summary": f"{party} {action}s {first} on {s.pattern}",
                    "tags": [{"name": party}],
                    "x-phalanx-service": party,
                }
                if reply_channel is not None:
                    op["reply"] = {
                        "channel": {"$ref": f"#/channels/{reply_channel}"},
                        "messages": [{"$ref": f"#/channels/{reply_channel}/messages/{s.message.KIND}"}],
                    }
                operations[f"{party}.{action}.{cid}"] = op

    return {
        "asyncapi": "3.0.0",
        "id": "urn:phalanx:bus",
        "info": {
            "title": "Phalanx bus",
            "version": __version__,
            "description": (
                "Control plane of Phalanx: events, commands and scheduler signals on NATS. "
                "Payloads are msgpack maps of the schemas below; the Phalanx-Kind, "
                "Phalanx-Schema and Phalanx-Encoding headers tag every message. JetStream "
                "subjects are persisted in the stream named by x-phalanx-stream and "
                "de-duplicated on Nats-Msg-Id. Generated by `python -m phalanx.contract.proto write "
                "proto`; do not edit."
            ),
        },
        "defaultContentType": CONTENT_TYPE,
        "servers": {
            "nats": {
                "host": "localhost:4222",
                "protocol": "nats",
                "description": "A NATS server (2.11+) with JetStream; set NATS_URL to point at another.",
            }
        },
        "channels": channels,
        "operations": operations,
        "components": {"messages": messages, "schemas": schemas},
    }


# -- files -------------------------------------------------------------------------
def _dump(doc: Any) -> str:
    return json.dumps(doc, indent=2, ensure_ascii=False) + "\n"


def generate() -> dict[str, str]:
    """Every generated file of ``proto/``, by path relative to it."""
    files = {
        "subjects.json": _dump(subjects_doc()),
        "asyncapi.json": _dump(asyncapi_doc()),
    }
    for kind, cls in sorted(registry().items()):
        files[f"schemas/{kind}.json"] = _dump(kind_schema(cls))
    return files


def _existing(root: Path) -> dict[str, str]:
    found: dict[str, str] = {}
    for name in ("subjects.json", "asyncapi.json"):
        if (root / name).is_file():
            found[name] = (root / name).read_text()
    schemas = root / "schemas"
    if schemas.is_dir():
        for p in sorted(schemas.glob("*.json")):
            found[f"schemas/{p.name}"] = p.read_text()
    return found


def diff(root: Path, max_lines: int = 60) -> list[str]:
    """Human-readable differences between ``root`` and what the code generates."""
    want, have = generate(), _existing(root)
    problems: list[str] = []
    for path in sorted(want.keys() | have.keys()):
        if path not in have:
            problems.append(f"missing: {root / path}")
        elif path not in want:
            problems.append(f"stale (no such message kind any more): {root / path}")
        elif have[path] != want[path]:
            lines = list(
                difflib.unified_diff(
                    have[path].splitlines(),
                    want[path].splitlines(),
                    fromfile=f"{root / path} (on disk)",
                    tofile=f"{root / path} (from the code)",
                    lineterm="",
                    n=2,
                )
            )
            if len(lines) > max_lines:
                lines = [*lines[:max_lines], f"... {len(lines) - max_lines} more diff lines"]
            problems.append("differs:\n" + "\n".join(lines))
    return problems


def write(root: Path) -> list[str]:
    """Write the generated files, remove stale schema files; returns what changed."""
    want, have = generate(), _existing(root)
    changed: list[str] = []
    for path, text in want.items():
        if have.get(path) != text:
            target = root / path
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(text)
            changed.append(path)
    for path in have.keys() - want.keys():
        (root / path).unlink()
        changed.append(path)
    return sorted(changed)


def main(argv: Iterable[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m phalanx.contract.proto", description="Generate or check proto/, the wire contract."
    )
    parser.add_argument("command", choices=["write", "check"])
    parser.add_argument("root", nargs="?", default="proto", help="the proto/ directory")
    args = parser.parse_args(list(argv) if argv is not None else None)
    root = Path(args.root)
    try:
        if args.command == "write":
            changed = write(root)
            print(f"proto: {len(changed)} file(s) updated in {root}" + "".join(f"\n  {c}" for c in changed))
            return 0
        problems = diff(root)
    except ContractError as exc:
        print(f"proto: the code's wire contract is inconsistent: {exc}", file=sys.stderr)
        return 2
    if problems:
        print(f"proto: {root} does not match the code ({len(problems)} file(s)):", file=sys.stderr)
        for p in problems:
            print(p, file=sys.stderr)
        print(
            "run `make proto` (python -m phalanx.contract.proto write proto) and commit the result",
            file=sys.stderr,
        )
        return 1
    print(f"proto: {root} matches the code")
    return 0


if __name__ == "__main__":
    sys.exit(main())
