"""Builders of the planner reducer's inputs for the unit and property tests: a job's
spec, registrations, faults, collective errors, acknowledgements, timers."""

from __future__ import annotations

from phalanx.services.elasticity_planner import events as ev
from phalanx.services.elasticity_planner.effects import Effect
from phalanx.services.elasticity_planner.reducer import Reducer

from phalanx.contract import (
    CollectiveError,
    FaultCause,
    JobSpec,
    JobState,
    RankExited,
    RankFailed,
    RankHung,
    Registered,
    Role,
)

JOB = "rj"
T0 = 1_000_000.0
RUN = "r-test"


def spec(
    ranks: int = 3,
    spares: int = 1,
    *,
    node: str = "local",
    launcher: str = "L1",
    workers: list[str] | None = None,
    ts: float = T0,
    **settings: object,
) -> JobSpec:
    names = workers or [f"w{i}" for i in range(ranks + spares)]
    return JobSpec(
        job=JOB,
        ts=ts,
        node=node,
        launcher=launcher,
        store_addr=f"10.0.0.1:{29400 + len(launcher)}",
        workers=names,
        ranks=ranks,
        **{"global_batch": 12, **settings},  # type: ignore[arg-type]
    )


def join(s: JobSpec, run: str = RUN) -> ev.JoinRequest:
    return ev.JoinRequest(msg=s, run=run)


def registered(worker: str, role: Role = Role.RANK, run: str = RUN, ts: float = T0) -> ev.Registration:
    msg = Registered(job=JOB, ts=ts, worker=worker, role=role, host="h", pid=100, launch=run)
    return ev.Registration(msg=msg)


def failed(worker: str, rank: int, generation: int, incident: str = "", ts: float = T0) -> ev.Failure:
    msg = RankFailed(
        job=JOB,
        ts=ts,
        incident=incident or f"{JOB}:{worker}:{generation}",
        worker=worker,
        rank=rank,
        generation=generation,
        cause=FaultCause.PROCESS_EXIT,
        fault_at=ts - 0.5,
        detected_at=ts,
    )
    return ev.Failure(msg=msg)


def hung(worker: str, rank: int, generation: int, ts: float = T0) -> ev.Hang:
    msg = RankHung(
        job=JOB,
        ts=ts,
        incident=f"{JOB}:{worker}:hang:{generation}",
        worker=worker,
        rank=rank,
        generation=generation,
        cause=FaultCause.HEARTBEAT_LOST,
        fault_at=ts - 1.0,
        detected_at=ts,
    )
    return ev.Hang(msg=msg)


def comm_error(
    worker: str,
    rank: int,
    generation: int,
    ts: float = T0,
    run: str = RUN,
    error: str = "reset",
    unrecoverable: bool = False,
) -> ev.CommFailure:
    msg = CollectiveError(
        job=JOB,
        ts=ts,
        worker=worker,
        rank=rank,
        generation=generation,
        step=3,
        error=error,
        launch=run,
        unrecoverable=unrecoverable,
    )
    return ev.CommFailure(msg=msg)


def exited(worker: str, code: int = 1, node: str = "local", ts: float = T0) -> ev.Exit:
    msg = RankExited(
        job=JOB, ts=ts, worker=worker, node=node, pid=100, host="h", exit_code=code, exited_at=ts
    )
    return ev.Exit(msg=msg)


def acked(generation: int) -> ev.AllAcked:
    return ev.AllAcked(job=JOB, generation=generation)


def timer(name: str) -> ev.TimerFired:
    return ev.TimerFired(job=JOB, name=name)


def started(reducer: Reducer, ranks: int = 3, spares: int = 1, now: float = T0) -> JobState:
    """A job whose generation 1 is running: its spec joined, every worker registered."""
    state, _ = reducer.step(None, join(spec(ranks, spares)), now)
    for i in range(ranks + spares):
        state, _ = reducer.step(state, registered(f"w{i}", Role.RANK if i < ranks else Role.SPARE), now)
    assert state is not None and state.plan is not None
    return state


def of(effects: list[Effect], kind: type) -> list:  # type: ignore[type-arg]
    return [e for e in effects if isinstance(e, kind)]
