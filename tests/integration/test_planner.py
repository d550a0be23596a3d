"""elasticity-planner against a real nats-server: generation 1 from registrations,
replacement by a hot spare, a planner restart in the middle of a job, idempotent
handling of redelivered faults, and refusal of faults it cannot place."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import pytest
from nats.aio.msg import Msg
from phalanx.services.elasticity_planner.decisions import Decision, Fault
from phalanx.services.elasticity_planner.failure_policy import ReplaceOrShrink
from phalanx.services.elasticity_planner.service import ElasticityPlanner
from structlog.testing import capture_logs

from phalanx.bus import Bus
from phalanx.contract import (
    Action,
    CollectiveError,
    ErrorEvent,
    FaultCause,
    JobRecord,
    JobState,
    Member,
    NodeLost,
    RankExited,
    RankFailed,
    RankHung,
    Registered,
    Role,
    decode,
    headers_for,
)
from phalanx.contract.streams import JOBS_BUCKET
from phalanx.contract.subjects import (
    COMM_ERROR,
    ERROR,
    EXITED,
    FAILED,
    HUNG,
    NODE_LOST,
    REGISTERED,
)
from tests.integration.planning import JOB, Watcher, failed, join, planner, start_job


async def test_replace_survives_a_planner_restart(nats_url: str, bus: Bus, watcher: Watcher) -> None:
    async with planner(nats_url):
        await start_job(bus)
        await watcher.wait_for(lambda: len(watcher.plans) == 1)
    gen1 = watcher.plans[0]
    assert gen1.generation == 1 and [m.worker for m in gen1.members] == ["w0", "w1", "w2"]

    # A new planner process: it must know the job, its spare and its generation.
    async with planner(nats_url):
        event = failed("w1", 1)
        await bus.publish(FAILED, event, job=JOB, msg_id=event.incident)
        await watcher.wait_for(lambda: len(watcher.plans) == 2)
        gen2 = watcher.plans[1]
        assert gen2.generation == 2 and gen2.rank_of("w3") == 1 and gen2.removed == ["w1"]
        assert gen2.incident == event.incident

        # The same fault again (a redelivery with a new message id): no new generation.
        await bus.publish(FAILED, event, job=JOB, msg_id=event.incident + "-again")
        # A hang of a worker that is no member any more: a HOLD decision, no plan.
        stale = RankHung(
            job=JOB,
            incident=f"{JOB}:w1:999",
            worker="w1",
            rank=1,
            generation=1,
            cause=FaultCause.HEARTBEAT_LOST,
            fault_at=1.0,
        )
        await bus.publish(HUNG, stale, job=JOB, msg_id=stale.incident)
        await watcher.wait_for(lambda: any(d.incident == stale.incident for d in watcher.decisions))
    assert len(watcher.plans) == 2
    hold = next(d for d in watcher.decisions if d.incident == stale.incident)
    assert hold.action is Action.HOLD and "already handled" in hold.reason

    kv = await bus.js.key_value(JOBS_BUCKET)
    entry = await kv.get(f"{JOB}.plan")
    assert entry.value is not None
    record = decode(entry.value, headers_for(JobRecord), JobRecord)
    assert record.plan is not None and record.plan.generation == 2


async def test_no_spare_left_is_a_stop_decision(nats_url: str, bus: Bus, watcher: Watcher) -> None:
    async with planner(nats_url):
        await start_job(bus, ranks=2, spares=0)
        await watcher.wait_for(lambda: len(watcher.plans) == 1)
        event = failed("w0", 0, pid=100)
        await bus.publish(FAILED, event, job=JOB, msg_id=event.incident)
        await watcher.wait_for(lambda: any(d.action is Action.STOP for d in watcher.decisions))
    stop = next(d for d in watcher.decisions if d.action is Action.STOP)
    assert "no spare left" in stop.reason and "min_world_size=2" in stop.reason
    assert len(watcher.plans) == 1


async def test_fault_of_an_unknown_job_changes_nothing(nats_url: str, bus: Bus, watcher: Watcher) -> None:
    async with planner(nats_url):
        await start_job(bus)
        await watcher.wait_for(lambda: len(watcher.plans) == 1)
        other = RankFailed(
            job="nojob",
            incident="nojob:w1:1",
            worker="w1",
            rank=1,
            generation=7,
            cause=FaultCause.PROCESS_EXIT,
            fault_at=1.0,
        )
        await bus.publish(FAILED, other, job="nojob", msg_id=other.incident)
        # A later fault of the real job is planned as usual: the unknown one did no harm.
        event = failed("w2", 2, pid=102)
        await bus.publish(FAILED, event, job=JOB, msg_id=event.incident)
        await watcher.wait_for(lambda: len(watcher.plans) == 2)
    assert watcher.plans[1].rank_of("w3") == 2
    assert all(d.job == JOB for d in watcher.decisions)


async def test_a_relaunch_continues_the_generations(nats_url: str, bus: Bus, watcher: Watcher) -> None:
    async with planner(nats_url):
        first_run = (await join(bus, launcher="first")).run
        await watcher.wait_for(lambda: len(watcher.plans) == 1)
        # While that run lives, another launch for the same node is refused.
        refused = await join(bus, launcher="intruder")
        assert not refused.accepted and "already in the job" in refused.reason
        done = RankExited(job=JOB, worker="w0", pid=100, host="h", exit_code=0, exited_at=1.0)
        await bus.publish(EXITED, done, job=JOB, msg_id="w0-done")
        await watcher.wait_for(lambda: any(d.action is Action.COMPLETE for d in watcher.decisions))
        second_run = (await join(bus, launcher="second")).run  # the job, launched again
        await watcher.wait_for(lambda: len(watcher.plans) == 2)
    first, second = watcher.plans
    assert first_run != second_run
    assert (first.launch, first.generation) == (first_run, 1)
    # Ranks of the second run ignore the first run's plan (another run id), and the
    # job's generation still only moves forward.
    assert (second.launch, second.generation) == (second_run, 2)


async def test_nodes_join_start_at_min_nodes_and_disagreeing_settings_are_refused(
    nats_url: str, bus: Bus, watcher: Watcher
) -> None:
    settings = {"min_nodes": 2, "max_nodes": 3}
    async with planner(nats_url):
        a = await join(bus, 2, 1, launcher="La", node="a", workers=["a-w0", "a-w1", "a-w2"], **settings)
        assert a.accepted and not a.as_spares and a.workers == ["a-w0", "a-w1", "a-w2"]
        bad = await join(bus, 2, 0, launcher="Lx", node="x", workers=["x-w0", "x-w1"], min_nodes=2, max_nodes=3,
                         global_batch=16)  # fmt: skip
        assert not bad.accepted and "global_batch=16" in bad.reason
        assert not watcher.plans  # one node of min 2: no generation yet; the refusal changed nothing
        b = await join(bus, 1, 1, launcher="Lb", node="b", workers=["b-w0", "b-w1"], **settings)
        assert b.accepted and b.run == a.run
        await watcher.wait_for(lambda: len(watcher.plans) == 1)
        gen1 = watcher.plans[0]
        assert [m.worker for m in gen1.members] == ["a-w0", "a-w1", "b-w0"]
        assert gen1.store_addr == "store-La:29400"  # the first node's store
        assert {w: gen1.nodes[w] for w in ("a-w0", "a-w1", "b-w0")} == {"a-w0": "a", "a-w1": "a", "b-w0": "b"}
        # A node joining the running job brings spares, under names not used before.
        c = await join(bus, 0, 2, launcher="Lc", node="c", workers=["c-w0", "c-w1"], **settings)
        assert c.accepted and c.as_spares
        # A rank of b dies: b's own spare takes it (its node holds the prepared shards).
        event = failed("b-w0", 2, pid=100)
        await bus.publish(FAILED, event, job=JOB, msg_id=event.incident)
        await watcher.wait_for(lambda: len(watcher.plans) == 2)
        assert watcher.plans[1].rank_of("b-w1") == 2
        # Node a is lost: both its ranks go to spares elsewhere in one generation,
        # and the rendezvous moves off it.
        lost = NodeLost(
            job=JOB, incident=f"{JOB}:node:a:La", node="a", launcher="La", workers=["a-w0", "a-w1", "a-w2"],
            cause=FaultCause.HEARTBEAT_LOST, fault_at=1.0,
        )  # fmt: skip
        await bus.publish(NODE_LOST, lost, job=JOB, msg_id=lost.incident)
        await watcher.wait_for(lambda: len(watcher.plans) == 3)
        gen3 = watcher.plans[2]
        assert len(watcher.plans) == 3 and gen3.world_size == 3
        assert set(gen3.removed) == {"a-w0", "a-w1", "a-w2"} and gen3.lost_launchers == ["La"]
        assert [(m.rank, m.worker) for m in gen3.members] == [(0, "c-w0"), (1, "c-w1"), (2, "b-w1")]
        assert gen3.store_addr == "store-Lb:29400"
        # Node a's launcher, started again, joins as new spare capacity.
        again = await join(bus, 2, 1, launcher="La2", node="a", workers=["a-w0", "a-w1", "a-w2"], **settings)
        assert again.accepted and again.as_spares and again.workers == ["a-w3", "a-w4", "a-w5"]


async def test_a_broken_group_with_nobody_dead_reforms(
    nats_url: str, bus: Bus, watcher: Watcher, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PHALANX_PLANNER_COMM_GRACE_S", "0.3")
    async with planner(nats_url):
        run = (await start_job(bus)).run
        await watcher.wait_for(lambda: len(watcher.plans) == 1)
        for w, r in (("w0", 0), ("w1", 1), ("w2", 2)):
            err = CollectiveError(
                job=JOB, worker=w, rank=r, generation=1, step=4, error="Connection reset by peer", launch=run
            )
            await bus.publish(COMM_ERROR, err, job=JOB)
        await watcher.wait_for(lambda: len(watcher.plans) == 2)
    reform = watcher.plans[1]
    assert reform.generation == 2 and reform.removed == []
    assert reform.members == watcher.plans[0].members
    decision = next(d for d in watcher.decisions if d.action is Action.REFORM)
    assert "['w0', 'w1', 'w2']" in decision.reason and decision.generation == 2


async def test_a_crash_explains_the_collective_errors(
    nats_url: str, bus: Bus, watcher: Watcher, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PHALANX_PLANNER_COMM_GRACE_S", "0.3")
    async with planner(nats_url):
        run = (await start_job(bus)).run
        await watcher.wait_for(lambda: len(watcher.plans) == 1)
        err = CollectiveError(
            job=JOB, worker="w0", rank=0, generation=1, step=4, error="Connection closed by peer", launch=run
        )
        await bus.publish(COMM_ERROR, err, job=JOB)
        event = failed("w1", 1)
        await bus.publish(FAILED, event, job=JOB, msg_id=event.incident)
        await watcher.wait_for(lambda: len(watcher.plans) == 2)
        # Past the grace: the errors of generation 1 were explained, no re-form follows.
        probe = failed("w9", 9, pid=999)  # not a member: answered by a HOLD decision
        await asyncio.sleep(0.6)
        await bus.publish(FAILED, probe, job=JOB, msg_id=probe.incident)
        await watcher.wait_for(lambda: any(d.incident == probe.incident for d in watcher.decisions))
    assert [p.generation for p in watcher.plans] == [1, 2]
    assert Action.REFORM not in [d.action for d in watcher.decisions]


def comm_error(worker: str, rank: int, run: str, generation: int = 1) -> CollectiveError:
    return CollectiveError(
        job=JOB,
        worker=worker,
        rank=rank,
        generation=generation,
        step=4,
        error="Connection closed by peer",
        launch=run,
    )


async def test_a_silent_member_whose_launcher_saw_it_die_is_replaced(
    nats_url: str, bus: Bus, watcher: Watcher, monkeypatch: pytest.MonkeyPatch
) -> None:
    # w1 died and no detector reported it (none is running): w0 and w2 report their
    # collectives failing, w1 says nothing, and its launcher saw it exit. That
    # corroborates the silence: w1 is replaced, not re-formed into the group.
    monkeypatch.setenv("PHALANX_PLANNER_COMM_GRACE_S", "0.3")
    async with planner(nats_url):
        run = (await start_job(bus)).run
        await watcher.wait_for(lambda: len(watcher.plans) == 1)
        died = RankExited(job=JOB, worker="w1", pid=101, host="h", exit_code=None, signal=9, exited_at=1.0)
        await bus.publish(EXITED, died, job=JOB, msg_id="w1-died")
        for w, r in (("w0", 0), ("w2", 2)):
            await bus.publish(COMM_ERROR, comm_error(w, r, run), job=JOB)
        await watcher.wait_for(lambda: len(watcher.plans) == 2)
    replaced = watcher.plans[1]
    assert replaced.rank_of("w3") == 1 and replaced.removed == ["w1"]
    decision = next(d for d in watcher.decisions if d.generation == 2)
    assert decision.action is Action.REPLACE and "while ['w0', 'w2']" in decision.reason


async def test_a_silent_member_without_corroboration_is_not_fenced(
    nats_url: str, bus: Bus, watcher: Watcher, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Two members claim their collectives failed; the third says nothing and nobody
    # (no detector verdict, no launcher) says it is dead: it is not fenced on that
    # word alone, the same members re-form. Re-forms back off and are capped.
    monkeypatch.setenv("PHALANX_PLANNER_COMM_GRACE_S", "0.2")
    monkeypatch.setenv("PHALANX_PLANNER_MAX_REFORMS", "2")
    async with planner(nats_url):
        run = (await start_job(bus)).run
        await watcher.wait_for(lambda: len(watcher.plans) == 1)
        for generation in (1, 2, 3):
            for w, r in (("w0", 0), ("w2", 2)):
                await bus.publish(COMM_ERROR, comm_error(w, r, run, generation), job=JOB)
            await watcher.wait_for(
                lambda g=generation: any(
                    d.generation == g + 1 or d.action is Action.STOP for d in watcher.decisions
                )
            )
    actions = [d.action for d in watcher.decisions if d.incident and d.incident.endswith(":collective")]
    assert actions == [Action.REFORM, Action.REFORM, Action.STOP]
    assert all(p.removed == [] for p in watcher.plans)  # nobody fenced
    assert "['w1'] silent but alive" in watcher.decisions[-1].reason
    assert "max_reforms=2" in watcher.decisions[-1].reason


async def test_forged_comm_errors_are_refused_and_change_nothing(
    nats_url: str, bus: Bus, watcher: Watcher, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PHALANX_PLANNER_COMM_GRACE_S", "0.2")
    errors: list[ErrorEvent] = []

    async def on_error(raw: Msg) -> None:
        errors.append(decode(raw.data, raw.headers, ErrorEvent))

    await bus.nc.subscribe(ERROR.format(service="elasticity-planner"), cb=on_error)
    async with planner(nats_url):
        run = (await start_job(bus)).run
        await watcher.wait_for(lambda: len(watcher.plans) == 1)
        forged = [
            comm_error("w9", 1, run),  # no member
            comm_error("w3", 1, run),  # the spare, not a member
            comm_error("w0", 2, run),  # a member, with another's rank
            comm_error("w0", 0, "r-another"),  # another run
            comm_error("w0", 0, run, generation=7),  # a generation that does not exist
        ]
        for err in forged:
            await bus.publish(COMM_ERROR, err, job=JOB)
        # And one on another job's subject: the payload's job does not match it.
        await bus.publish(COMM_ERROR, comm_error("w0", 0, run).model_copy(update={"job": "other"}), job=JOB)
        await asyncio.wait_for(_until(lambda: len(errors) == len(forged) + 1), 15)
        await asyncio.sleep(0.5)  # past the grace: no re-form, no fence
    assert len(watcher.plans) == 1
    assert [d.action for d in watcher.decisions if d.action not in (Action.JOIN, Action.START)] == []
    reasons = " | ".join(e.reason for e in errors)
    for why in (
        "w9 is not rank 1",
        "w3 is not rank 1",
        "w0 is not rank 2",
        "run 'r-another'",
        "generation 7",
    ):
        assert why in reasons
    assert "collective_error of job 'other' on phalanx.evt.pj.comm_error.w0" in reasons


async def _until(pred: object) -> None:
    while not pred():  # type: ignore[operator]
        await asyncio.sleep(0.02)


async def _register(bus: Bus, run: str, worker: str, role: Role, pid: int) -> None:
    reg = Registered(job=JOB, worker=worker, role=role, host="h", pid=pid, launch=run)
    await bus.publish(REGISTERED, reg, job=JOB, msg_id=f"reg-{run}-{worker}")


async def _two_ranks_and_a_spare_starting(bus: Bus, watcher: Watcher) -> str:
    """Ranks w0, w1 registered and started; the spare w2 still warming up. Returns the run."""
    run = (await join(bus, 2, 1, register=False)).run
    await _register(bus, run, "w0", Role.RANK, 100)
    await _register(bus, run, "w1", Role.RANK, 101)
    await watcher.wait_for(lambda: len(watcher.plans) == 1)
    return run


async def test_a_fault_before_the_spare_registered_waits_for_it(
    nats_url: str, bus: Bus, watcher: Watcher
) -> None:
    async with planner(nats_url):
        run = await _two_ranks_and_a_spare_starting(bus, watcher)
        event = failed("w1", 1)  # in the first step: the spare w2 is still warming up
        await bus.publish(FAILED, event, job=JOB, msg_id=event.incident)
        await watcher.wait_for(lambda: any(d.action is Action.HOLD for d in watcher.decisions))
        hold = next(d for d in watcher.decisions if d.action is Action.HOLD)
        assert "waiting up to 30s for spare(s) ['w2'] still starting" in hold.reason
        assert len(watcher.plans) == 1  # no stop, no shrink
        await _register(bus, run, "w2", Role.SPARE, 102)
        await watcher.wait_for(lambda: len(watcher.plans) == 2)
    assert watcher.plans[1].rank_of("w2") == 1 and watcher.plans[1].removed == ["w1"]
    assert Action.STOP not in [d.action for d in watcher.decisions]


async def test_failed_collectives_do_not_re_form_while_a_fault_waits_for_a_spare(
    nats_url: str, bus: Bus, watcher: Watcher, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The fault's decision (HOLD until the spare registers) will move the generation:
    # the survivor's failed collectives must not re-form the group with the dead rank.
    monkeypatch.setenv("PHALANX_PLANNER_COMM_GRACE_S", "0.2")
    async with planner(nats_url):
        run = await _two_ranks_and_a_spare_starting(bus, watcher)
        event = failed("w1", 1)
        await bus.publish(FAILED, event, job=JOB, msg_id=event.incident)
        await watcher.wait_for(lambda: any(d.action is Action.HOLD for d in watcher.decisions))
        await bus.publish(COMM_ERROR, comm_error("w0", 0, run), job=JOB)
        await asyncio.sleep(1.0)  # both graces (0.2 s each) are long over
        assert {p.generation for p in watcher.plans} == {1}
        await _register(bus, run, "w2", Role.SPARE, 102)
        await watcher.wait_for(lambda: any(p.generation == 2 for p in watcher.plans))
        await asyncio.sleep(0.5)
    assert Action.REFORM not in [d.action for d in watcher.decisions]
    assert {p.generation for p in watcher.plans} == {1, 2}
    assert next(p for p in watcher.plans if p.generation == 2).rank_of("w2") == 1


async def test_a_spare_that_never_registers_is_waited_for_only_so_long(
    nats_url: str, bus: Bus, watcher: Watcher, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PHALANX_PLANNER_SPARE_WAIT_S", "0.3")
    async with planner(nats_url):
        await _two_ranks_and_a_spare_starting(bus, watcher)
        event = failed("w1", 1)
        await bus.publish(FAILED, event, job=JOB, msg_id=event.incident)
        await watcher.wait_for(lambda: any(d.action is Action.STOP for d in watcher.decisions))
    assert [d.action for d in watcher.decisions if d.incident == event.incident] == [Action.HOLD, Action.STOP]


async def test_every_generation_meets_under_its_own_secret_which_is_never_logged(
    nats_url: str, bus: Bus, watcher: Watcher
) -> None:
    """Each plan names its generation's store prefix and a fresh random ``store_secret``
    (what keeps non-members out of the rendezvous keys, phalanx.runtime.comm); the record
    holds it for the members, and no log line of the planner carries it."""
    planner_bus = await Bus.connect(nats_url, name="elasticity-planner")
    svc = ElasticityPlanner(planner_bus)
    with capture_logs() as logs:
        await svc.start()
        try:
            await start_job(bus)
            await watcher.wait_for(lambda: len(watcher.plans) == 1)
            event = failed("w1", 1)
            await bus.publish(FAILED, event, job=JOB, msg_id=event.incident)
            await watcher.wait_for(lambda: len(watcher.plans) == 2)
        finally:
            await svc.stop()
            await planner_bus.close()
    assert [p.store_prefix for p in watcher.plans] == [f"{JOB}/gen1", f"{JOB}/gen2"]
    secrets = [p.store_secret for p in watcher.plans]
    assert len(set(secrets)) == 2 and all(len(s) >= 32 for s in secrets), "random, 24 bytes or more"
    entry = await (await bus.js.key_value(JOBS_BUCKET)).get(f"{JOB}.plan")
    record = decode(entry.value or b"", headers_for(JobRecord), JobRecord)
    assert record.plan is not None and record.plan.store_secret == secrets[1]
    assert {"planner_leader", "node_joined"} <= {line.get("event") for line in logs}  # it did log
    leaked = [line for line in logs for s in secrets if s in repr(line)]
    assert not leaked, leaked
    assert not any(s in repr(p) or s in str(p) for p in watcher.plans for s in secrets)  # repr=False


@dataclass(frozen=True)
class _NeverReplace(ReplaceOrShrink):
    """A user's failure policy: a lost rank is never replaced, the job shrinks instead."""

    def on_fault(self, state: JobState, fault: Fault) -> Decision:
        d = super().on_fault(state, fault)
        if d.action is not Action.REPLACE or state.plan is None:
            return d
        left = [
            m.worker for m in sorted(state.plan.members, key=lambda m: m.rank) if m.worker != fault.worker
        ]
        members = [Member(rank=i, worker=w) for i, w in enumerate(left)]
        return Decision(
            Action.SHRINK, f"{fault.worker} lost: my policy shrinks", members, removed=[fault.worker]
        )


async def test_a_custom_failure_policy_decides_instead_of_the_default(
    nats_url: str, bus: Bus, watcher: Watcher
) -> None:
    async with planner(nats_url, failure=_NeverReplace()):
        await start_job(bus)
        await watcher.wait_for(lambda: len(watcher.plans) == 1)
        event = failed("w1", 1)
        await bus.publish(FAILED, event, job=JOB, msg_id=event.incident)
        await watcher.wait_for(lambda: any(p.generation == 2 for p in watcher.plans))
        await watcher.wait_for(lambda: any(d.incident == event.incident for d in watcher.decisions))
    gen2 = next(p for p in watcher.plans if p.generation == 2)
    assert [m.worker for m in gen2.members] == ["w0", "w2"] and gen2.spares == ["w3"]  # the spare stays one
    decision = next(d for d in watcher.decisions if d.incident == event.incident)
    assert decision.action is Action.SHRINK and "my policy shrinks" in decision.reason
