"""``bench.scale --record-only``: the job record of an N-rank job, built by the planner's own
reducer, its encoded size and its encode/decode times.

The record is what the planner commits after generation 1: every node's
:class:`~phalanx.contract.JobSpec` (``ranks_per_node`` ranks and ``spares_per_node``
spares each, as ``bench.scalesim`` sends them) taken as a
:class:`~phalanx.services.elasticity_planner.events.JoinRequest`, then every worker's
:class:`~phalanx.contract.Registered` as a ``Registration``, in a seeded random order (the
launchers register concurrently). Two ways to drive the reducer:

- ``inplace`` (default): the reducer's own dispatch (``Reducer._join``, ``Reducer._handle``)
  on one state, which is what ``Reducer.step`` runs after it has copied the state. The
  copy per input makes ``step`` O(record) per input, hours at 65,536 ranks; the decisions
  are the same.
- ``step``: ``Reducer.step`` for every input, as the planner service runs it.

The figures: ``record_bytes`` (the encoded :class:`~phalanx.contract.JobRecord`, what the
planner writes to ``<job>.plan``), ``plan_bytes`` (its plan alone, what the plan subject
carries), encode and decode ms (median of ``repeats``), and whether the record exceeds
NATS's default ``max_payload`` of 1 MiB (the server refuses the write).
"""

from __future__ import annotations

import random
import statistics
import sys
import time
from typing import Any

from phalanx.services.elasticity_planner import events as ev
from phalanx.services.elasticity_planner.plans import Ctx
from phalanx.services.elasticity_planner.reducer import Reducer, trigger_of

from bench.scalesim import COMMAND, PID_BASE, node_name, store_addr
from phalanx.contract import (
    FaultCause,
    JobRecord,
    JobSpec,
    JobState,
    NodeLost,
    Registered,
    Role,
    decode,
    encode,
    node_plan,
    plan_delta,
)
from phalanx.launcher.children import worker_names
from phalanx.launcher.launcher import command_fingerprint

NATS_MAX_PAYLOAD = 1 << 20
JOB = "scale"
RUN = "r-scale"


def log(msg: str) -> None:
    print(f"[bench.scale {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def specs(nodes: int, per: int, spares: int, now: float) -> list[JobSpec]:
    """Every node's spec, as the simulated launchers send them."""
    return [
        JobSpec(
            job=JOB,
            ts=now,
            node=node_name(k),
            launcher=f"{node_name(k)}-L",
            host=f"sim-{k}",
            store_addr=store_addr(k),
            workers=worker_names(node_name(k), per + spares, qualified=True),
            ranks=per,
            min_nodes=nodes,
            max_nodes=nodes,
            global_batch=nodes * per * 4,
            command=command_fingerprint(COMMAND),
        )
        for k in range(nodes)
    ]


def build(ranks: int, per: int, spares: int, *, mode: str = "step", seed: int = 1) -> tuple[JobState, float]:
    """The planner's state once generation 1 is committed, and the seconds it took."""
    nodes = max(1, ranks // per)
    now = time.time()
    reducer = Reducer()
    joins = [ev.JoinRequest(msg=s, run=RUN) for s in specs(nodes, per, spares, now)]
    regs = [
        ev.Registration(
            msg=Registered(
                job=JOB,
                ts=now,
                worker=w,
                role=Role.RANK if i < per else Role.SPARE,
                host=f"sim-{k}",
                pid=PID_BASE + k * (per + spares) + i,
                launch=RUN,
            )
        )
        for k, j in enumerate(joins)
        for i, w in enumerate(j.msg.workers)
    ]
    random.Random(seed).shuffle(regs)
    t0 = time.perf_counter()
    state: JobState | None = None
    if mode == "step":
        for k, e in enumerate([*joins, *regs]):
            state, _ = reducer.step(state, e, now)
            if k % 5000 == 4999:
                log(f"record: {k + 1} of {len(joins) + len(regs)} inputs stepped")
    else:
        for e in joins:
            state = reducer._join(state, e, now, [])
        assert state is not None
        for k, r in enumerate(regs):
            reducer._handle(Ctx(state, now, trigger_of(r), reducer.failure, reducer.scaling, []), r)
            if k % 20000 == 19999:
                log(f"record: {k + 1} of {len(regs)} registrations taken")
        state.settle()
    if state is None or state.plan is None:
        raise RuntimeError("generation 1 was not committed")
    return state, time.perf_counter() - t0


def _ms(fn: Any, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t) * 1e3)
    return round(statistics.median(times), 2)


def measure(ranks: int, per: int, spares: int, *, mode: str = "step", repeats: int = 3) -> dict[str, Any]:
    """The record of an N-rank job: sizes, times, the payload limit."""
    log(
        f"record: building the job record of {ranks} ranks ({per}/node + {spares} spare/node) via the reducer ({mode})"
    )
    state, build_s = build(ranks, per, spares, mode=mode)
    assert state.plan is not None
    record = JobRecord(job=JOB, ts=time.time(), token=1, plan=state.plan, planner=state)
    payload, headers = encode(record)
    plan_payload, _ = encode(state.plan)
    encode_ms = _ms(lambda: encode(record), repeats)
    decode_ms = _ms(lambda: decode(payload, headers, JobRecord), repeats)
    # One node lost: the planner's decision (a reducer step), the delta every launcher
    # gets, and the part a launcher of an untouched node hands its ranks.
    lost = sorted(state.nodes)[len(state.nodes) // 2]
    loss = ev.NodeLoss(
        msg=NodeLost(
            job=JOB,
            incident=f"{JOB}:node:{lost}",
            node=lost,
            launcher=state.nodes[lost].launcher,
            workers=list(state.nodes[lost].workers),
            cause=FaultCause.HEARTBEAT_LOST,
            fault_at=time.time() - 1.0,
        )
    )
    after, _ = Reducer().step(state, loss, time.time())
    step_ms = _ms(lambda: Reducer().step(state, loss, time.time()), repeats)
    assert after is not None and after.plan is not None
    delta, _ = encode(plan_delta(state.plan, after.plan))
    other = sorted(state.nodes)[0]
    part, _ = encode(node_plan(after.plan, other, set(state.nodes[other].workers)))
    return {
        "ranks": state.plan.world_size,
        "nodes": len(state.nodes),
        "workers": sum(len(n.workers) for n in state.nodes.values()),
        "record_bytes": len(payload),
        "record_bytes_per_rank": round(len(payload) / state.plan.world_size, 1),
        "plan_bytes": len(plan_payload),
        "record_encode_ms": encode_ms,
        "record_decode_ms": decode_ms,
        "record_encoding": headers.get("Phalanx-Encoding", "msgpack"),
        "nats_max_payload": NATS_MAX_PAYLOAD,
        "exceeds_max_payload": len(payload) > NATS_MAX_PAYLOAD,
        "node_loss_step_ms": step_ms,
        "node_loss_world": after.plan.world_size,
        "delta_bytes": len(delta),
        "node_plan_bytes": len(part),
        "record_build_s": round(build_s, 2),
        "record_build_mode": mode,
    }
