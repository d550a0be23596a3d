"""Planner replicas against a real nats-server: one leader by lease, a fencing token
in every record and plan, compare-and-set on the revision a decision was computed
from, a standby that takes over a SIGKILLed leader, and a KV error at commit that
loses no incident."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import msgpack
import pytest
from nats.js.errors import KeyWrongLastSequenceError
from phalanx.services.elasticity_planner.events import Failure
from phalanx.services.elasticity_planner.lease import LEASE_KEY, NotLeader, leader_pid
from phalanx.services.elasticity_planner.service import ElasticityPlanner

from phalanx.bus import Bus
from phalanx.contract import (
    Action,
    CollectiveError,
    FaultCause,
    JobRecord,
    NodeLost,
    Plan,
    PlanAck,
    Registered,
    Role,
    decode,
    headers_for,
)
from phalanx.contract.streams import JOBS_BUCKET
from phalanx.contract.subjects import ACK, COMM_ERROR, FAILED, NODE_LOST, REGISTERED
from phalanx.service import ping
from phalanx.worker.follow import record_key
from tests.integration.planning import JOB, Watcher, failed, join, start_job


@pytest.fixture(autouse=True)
def _fast_lease(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PHALANX_PLANNER_LEASE_TTL_S", "0.6")


async def _planner(url: str, name: str) -> ElasticityPlanner:
    """A planner replica in this process, on its own connection."""
    bus = await Bus.connect(url, name=name)
    p = ElasticityPlanner(bus)
    await p.serve_health()
    await p.start()
    return p


async def _close(p: ElasticityPlanner) -> None:
    await p.stop()
    await p.bus.close()


@pytest.fixture
async def replicas(nats_url: str) -> AsyncIterator[list[ElasticityPlanner]]:
    made: list[ElasticityPlanner] = []
    yield made
    for p in made:
        await _close(p)


async def _until(pred: object, timeout: float = 15.0) -> None:
    async def loop() -> None:
        while not pred():  # type: ignore[operator]
            await asyncio.sleep(0.02)

    await asyncio.wait_for(loop(), timeout)


async def _history(bus: Bus) -> list[JobRecord]:
    kv = await bus.js.key_value(JOBS_BUCKET)
    return [
        decode(e.value, headers_for(JobRecord), JobRecord)
        for e in await kv.history(record_key(JOB))
        if e.value
    ]


def _assert_one_plan_per_generation(plans: list[Plan]) -> None:
    by_gen: dict[int, set[str]] = {}
    for p in plans:
        by_gen.setdefault(p.generation, set()).add(repr(sorted((m.rank, m.worker) for m in p.members)))
    forks = {g: v for g, v in by_gen.items() if len(v) > 1}
    assert not forks, f"generations with two different plans: {forks}"


async def test_one_leader_and_a_standby_that_consumes_nothing(
    nats_url: str, bus: Bus, watcher: Watcher, replicas: list[ElasticityPlanner]
) -> None:
    a = await _planner(nats_url, "planner-a")
    b = await _planner(nats_url, "planner-b")
    replicas += [a, b]
    assert a.lease.is_leader() and not b.lease.is_leader()
    await start_job(bus)
    await watcher.wait_for(lambda: len(watcher.plans) == 1)
    assert watcher.plans[0].token == a.lease.token
    assert b.jobs == {} and b.decisions == 0  # the standby decided nothing
    health = await ping(bus, "elasticity-planner")
    assert health.details["token"] in (a.lease.token, 0)


async def test_a_lagging_planner_can_neither_overwrite_nor_roll_back(
    nats_url: str, bus: Bus, watcher: Watcher, replicas: list[ElasticityPlanner]
) -> None:
    # B leads and starts the job, then stalls (its lease task stops, as in a long GC
    # pause or a frozen VM) while still believing it leads. A takes over and plans a
    # replacement. When B wakes up and handles a fault from its stale memory, its
    # compare-and-set fails, the record tells it a newer leader wrote, and it steps down.
    b = await _planner(nats_url, "planner-b")
    replicas.append(b)
    await start_job(bus)
    await watcher.wait_for(lambda: len(watcher.plans) == 1)
    for t in b._tasks:
        t.cancel()
    a = await _planner(nats_url, "planner-a")
    replicas.append(a)
    await _until(lambda: a.lease.is_leader())
    assert a.lease.token > b.lease.token
    event = failed("w1", 1)
    await bus.publish(FAILED, event, job=JOB, msg_id=event.incident)
    await watcher.wait_for(lambda: len(watcher.plans) == 2)

    b.lease.is_leader = lambda: True  # type: ignore[method-assign]  # it believes it still leads
    stale = failed("w2", 2, pid=102)
    with pytest.raises(NotLeader):
        await b._txn(JOB, Failure(msg=stale))
    assert b.conflicts == 1
    await asyncio.sleep(0.3)
    records = await _history(bus)
    assert [r.plan.generation for r in records if r.plan] == sorted(
        r.plan.generation for r in records if r.plan
    )
    assert records[-1].plan is not None and records[-1].plan.generation == 2
    assert records[-1].token == a.lease.token
    assert [p.generation for p in watcher.plans] == [1, 2]  # B published nothing


async def test_two_planners_through_a_series_of_faults_never_fork(
    nats_url: str, bus: Bus, watcher: Watcher, replicas: list[ElasticityPlanner]
) -> None:
    a = await _planner(nats_url, "planner-a")
    b = await _planner(nats_url, "planner-b")
    replicas += [a, b]
    await start_job(bus, ranks=3, spares=3)
    await watcher.wait_for(lambda: len(watcher.plans) == 1)
    leader, standby = a, b
    for i, worker in enumerate(("w0", "w1", "w2")):
        event = failed(worker, i, generation=i + 1, pid=200 + i)
        await bus.publish(FAILED, event, job=JOB, msg_id=event.incident)
        if i == 1:  # the leader stops right after the fault was published: the standby goes on
            replicas.remove(leader)
            await _close(leader)
            leader, standby = standby, leader
        await watcher.wait_for(lambda n=i: len(watcher.plans) == n + 2)
    _assert_one_plan_per_generation(watcher.plans)
    assert [p.generation for p in watcher.plans] == [1, 2, 3, 4]
    assert sorted(m.worker for m in watcher.plans[-1].members) == ["w3", "w4", "w5"]
    records = await _history(bus)
    gens = [r.plan.generation for r in records if r.plan]
    tokens = [r.token for r in records]
    assert gens == sorted(gens) and tokens == sorted(tokens), (gens, tokens)
    assert watcher.plans[-1].token == leader.lease.token > watcher.plans[0].token


async def test_a_kv_error_at_commit_still_plans_the_incident(
    nats_url: str, bus: Bus, watcher: Watcher, replicas: list[ElasticityPlanner]
) -> None:
    p = await _planner(nats_url, "planner")
    replicas.append(p)
    await start_job(bus)
    await watcher.wait_for(lambda: len(watcher.plans) == 1)
    await _until(lambda: p.jobs[JOB].spares == ["w3"])  # every registration handled
    real_update, calls = p.kv.update, []

    async def flaky(*args: object, **kwargs: object) -> int:
        calls.append(args[0])
        if len(calls) == 1:
            raise TimeoutError("injected: KV did not answer")
        return await real_update(*args, **kwargs)  # type: ignore[arg-type]

    p.kv.update = flaky  # type: ignore[method-assign]
    before = p.jobs[JOB]
    event = failed("w1", 1)
    await bus.publish(FAILED, event, job=JOB, msg_id=event.incident)
    await watcher.wait_for(lambda: any(d.incident == event.incident for d in watcher.decisions))
    decision = next(d for d in watcher.decisions if d.incident == event.incident)
    assert decision.action is Action.REPLACE  # not "already handled" from a half-applied first try
    # (generation 1 may have been sent again meanwhile: nobody acknowledges it here)
    assert next(p for p in watcher.plans if p.generation == 2).rank_of("w3") == 1
    assert len(calls) >= 2 and before.spares == ["w3"]  # the failed try left the old state untouched


async def test_a_conflicting_write_is_decided_again_on_the_new_record(
    nats_url: str, bus: Bus, watcher: Watcher, replicas: list[ElasticityPlanner]
) -> None:
    # Someone (an operator's tool, a bug) writes the record behind the leader's back:
    # the leader's compare-and-set fails, it reloads and decides on what is there.
    p = await _planner(nats_url, "planner")
    replicas.append(p)
    await start_job(bus)
    await watcher.wait_for(lambda: len(watcher.plans) == 1)
    await _until(lambda: p.jobs[JOB].spares == ["w3"])  # every registration handled
    kv = await bus.js.key_value(JOBS_BUCKET)
    entry = await kv.get(record_key(JOB))
    await kv.update(record_key(JOB), entry.value, last=entry.revision)  # same content, new revision
    event = failed("w1", 1)
    await bus.publish(FAILED, event, job=JOB, msg_id=event.incident)
    await watcher.wait_for(lambda: len(watcher.plans) == 2)
    assert p.conflicts == 1 and watcher.plans[1].generation == 2
    with pytest.raises(KeyWrongLastSequenceError):
        await kv.update(record_key(JOB), entry.value, last=entry.revision)


async def test_a_launcher_declared_lost_cannot_join_again(
    nats_url: str, bus: Bus, watcher: Watcher, replicas: list[ElasticityPlanner]
) -> None:
    replicas.append(await _planner(nats_url, "planner"))
    await join(bus, 1, 0, launcher="La", node="a", workers=["a-w0"], min_nodes=2, max_nodes=3)
    await join(bus, 1, 1, launcher="Lb", node="b", workers=["b-w0", "b-w1"], min_nodes=2, max_nodes=3)
    await watcher.wait_for(lambda: len(watcher.plans) == 1)
    lost = NodeLost(
        job=JOB,
        incident=f"{JOB}:node:a:La",
        node="a",
        launcher="La",
        workers=["a-w0"],
        cause=FaultCause.HEARTBEAT_LOST,
        fault_at=1.0,
    )
    await bus.publish(NODE_LOST, lost, job=JOB, msg_id=lost.incident)
    await watcher.wait_for(lambda: len(watcher.plans) == 2)
    again = await join(
        bus, 1, 0, launcher="La", node="a", workers=["a-w0"], min_nodes=2, max_nodes=3, register=False
    )
    assert not again.accepted and not again.retry and "declared lost" in again.reason


# -- a leader killed for real ---------------------------------------------------------
def _planner_process(url: str, log: Path) -> subprocess.Popen[bytes]:
    out = open(log, "ab")
    try:
        return subprocess.Popen(
            [sys.executable, "-m", "phalanx.services.elasticity_planner"],
            env={**os.environ, "NATS_URL": url},
            stdout=out,
            stderr=out,
        )
    finally:
        out.close()


async def test_the_standby_completes_an_incident_whose_leader_was_sigkilled(
    nats_url: str, bus: Bus, watcher: Watcher, tmp_path: Path
) -> None:
    first = _planner_process(nats_url, tmp_path / "a.log")
    procs = [first]
    try:
        await _until_answers(bus)
        procs.append(_planner_process(nats_url, tmp_path / "b.log"))
        await asyncio.sleep(1.0)  # the second one is up, standing by
        await start_job(bus)
        await watcher.wait_for(lambda: len(watcher.plans) == 1)
        first.send_signal(signal.SIGKILL)  # the leader dies as the fault is reported
        event = failed("w1", 1)
        await bus.publish(FAILED, event, job=JOB, msg_id=event.incident)
        await watcher.wait_for(lambda: len(watcher.plans) == 2, timeout=15)
    finally:
        for p in procs:
            if p.poll() is None:
                p.terminate()
        for i, p in enumerate(procs):
            try:
                p.wait(15)
            except subprocess.TimeoutExpired:  # say where it is stuck (the service logs its tasks)
                p.send_signal(signal.SIGUSR1)
                await asyncio.sleep(1.0)
                p.kill()
                log = (tmp_path / f"{'ab'[i]}.log").read_text()
                raise AssertionError(f"planner {'ab'[i]} did not stop on SIGTERM:\n{log[-8000:]}") from None
    gen1, gen2 = watcher.plans
    assert gen2.generation == 2 and gen2.rank_of("w3") == 1 and gen2.token > gen1.token
    assert "lease_acquired" in (tmp_path / "b.log").read_text()


async def _until_answers(bus: Bus) -> None:
    for _ in range(300):
        try:
            await ping(bus, "elasticity-planner", timeout=0.5)
            return
        except Exception:
            await asyncio.sleep(0.1)
    raise TimeoutError("no planner answered")


async def test_a_plan_is_sent_again_until_every_member_acknowledged(
    nats_url: str,
    bus: Bus,
    watcher: Watcher,
    replicas: list[ElasticityPlanner],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("PHALANX_PLANNER_REPUBLISH_S", "0.2")
    replicas.append(await _planner(nats_url, "planner"))
    await start_job(bus)
    await watcher.wait_for(lambda: len(watcher.plans) >= 3)  # sent, then sent again: nobody acked
    assert {p.generation for p in watcher.plans} == {1}
    for rank, worker in enumerate(("w0", "w1", "w2")):
        await bus.publish(ACK, PlanAck(job=JOB, generation=1, worker=worker, rank=rank), job=JOB)
    await _until(lambda: JOB not in replicas[0].runner.pending)
    sent = len(watcher.plans)
    await asyncio.sleep(1.0)
    assert len(watcher.plans) == sent  # all acknowledged: no more sends


async def test_a_wait_for_spares_outlives_the_leader(
    nats_url: str,
    bus: Bus,
    watcher: Watcher,
    replicas: list[ElasticityPlanner],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A fault in the first step waits for a spare still starting (HOLD). The leader
    # stops during that wait: the wait is in the record, so the new leader ends it.
    monkeypatch.setenv("PHALANX_PLANNER_SPARE_WAIT_S", "1.5")
    a = await _planner(nats_url, "planner-a")
    b = await _planner(nats_url, "planner-b")
    replicas.append(b)
    run = (await join(bus, 2, 1, register=False)).run
    for i, worker in enumerate(("w0", "w1")):
        reg = Registered(job=JOB, worker=worker, role=Role.RANK, host="h", pid=100 + i, launch=run)
        await bus.publish(REGISTERED, reg, job=JOB, msg_id=f"reg-{worker}")
    await watcher.wait_for(lambda: len(watcher.plans) == 1)
    event = failed("w1", 1)
    await bus.publish(FAILED, event, job=JOB, msg_id=event.incident)
    await watcher.wait_for(lambda: any(d.action is Action.HOLD for d in watcher.decisions))
    await _close(a)
    await watcher.wait_for(lambda: any(d.action is Action.STOP for d in watcher.decisions))
    assert b.lease.is_leader()
    assert [d.action for d in watcher.decisions if d.incident == event.incident] == [Action.HOLD, Action.STOP]
    last = (await _history(bus))[-1]
    assert (
        last.token == b.lease.token and last.planner is not None and last.planner.phase == "stopped"
    )  # decided by the new leader


async def test_a_new_leader_reads_the_verdict_before_re_forming_a_broken_group(
    nats_url: str,
    bus: Bus,
    watcher: Watcher,
    replicas: list[ElasticityPlanner],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The leader recorded the peers' failed collectives, then died; w1's crash verdict
    # reached the stream after that; the next leader comes up after the re-form grace
    # ran out. It must read the verdict (replace w1) before re-forming the same members.
    monkeypatch.setenv("PHALANX_PLANNER_COMM_GRACE_S", "0.5")
    a = await _planner(nats_url, "planner-a")
    run = (await start_job(bus)).run
    await watcher.wait_for(lambda: len(watcher.plans) == 1)
    for worker, rank in (("w0", 0), ("w2", 2)):
        err = CollectiveError(
            job=JOB, worker=worker, rank=rank, generation=1, step=4, error="Connection reset", launch=run
        )
        await bus.publish(COMM_ERROR, err, job=JOB)
    await _until(lambda: (s := a.jobs.get(JOB)) is not None and len(s.broken) == 2, timeout=5)
    await _close(a)  # within the first grace: a decided nothing
    event = failed("w1", 1)
    await bus.publish(FAILED, event, job=JOB, msg_id=event.incident)
    await asyncio.sleep(1.5)  # both graces of the broken generation are over
    replicas.append(await _planner(nats_url, "planner-b"))
    await watcher.wait_for(lambda: any(p.generation == 2 for p in watcher.plans))
    await asyncio.sleep(1.0)  # a re-form, had one been armed, would have come by now
    assert [d.action for d in watcher.decisions if d.generation and d.generation > 1] == [Action.REPLACE]
    assert {p.generation for p in watcher.plans} == {1, 2}
    assert next(p for p in watcher.plans if p.generation == 2).rank_of("w3") == 1


# -- a leader whose connection closed is taken over at once ----------------------------
async def _leader_pid(bus: Bus) -> int | None:
    return await leader_pid(await bus.kv.bucket(JOBS_BUCKET))


async def _leading_process(url: str, bus: Bus, log: Path) -> subprocess.Popen[bytes]:
    """A planner process, once it holds the lease."""
    proc = _planner_process(url, log)
    await _until_answers(bus)
    for _ in range(100):
        if await _leader_pid(bus) == proc.pid:
            return proc
        await asyncio.sleep(0.1)
    proc.kill()
    proc.wait()
    raise AssertionError(f"the planner never led: {log.read_text()[-4000:]}")


async def test_a_sigkilled_leader_is_taken_over_without_waiting_out_the_ttl(
    nats_url: str,
    bus: Bus,
    replicas: list[ElasticityPlanner],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With a 60 s TTL only the server's "no responders" on the holder's own subject can
    make the standby lead within the test's wait."""
    monkeypatch.setenv("PHALANX_PLANNER_LEASE_TTL_S", "60")
    first = await _leading_process(nats_url, bus, tmp_path / "a.log")
    try:
        standby = await _planner(nats_url, "planner-b")
        replicas.append(standby)
        await asyncio.sleep(0.5)  # steps of the standby (every 100 ms), each asking the live holder
        assert not standby.lease.is_leader(), "a holder that answers is not taken over"
        first.send_signal(signal.SIGKILL)
        first.wait(10)
        await _until(standby.lease.is_leader, timeout=10.0)
    finally:
        if first.poll() is None:
            first.kill()
            first.wait()


async def test_a_stopped_leader_is_taken_over_only_when_its_lease_runs_out(
    nats_url: str,
    bus: Bus,
    replicas: list[ElasticityPlanner],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """SIGSTOPped, the leader's connection stays open: the standby's question goes
    unanswered, which is no verdict, and the TTL decides; the leader, continued, has lost
    the lease."""
    monkeypatch.setenv("PHALANX_PLANNER_LEASE_TTL_S", "2")
    first = await _leading_process(nats_url, bus, tmp_path / "a.log")
    try:
        standby = await _planner(nats_url, "planner-b")
        replicas.append(standby)
        first.send_signal(signal.SIGSTOP)
        stopped = asyncio.get_running_loop().time()
        await _until(standby.lease.is_leader, timeout=15.0)
        waited = asyncio.get_running_loop().time() - stopped
        # the standby saw the holder's last renewal at most ttl/3 before the stop
        assert waited >= 2.0 - 2.0 / 3, f"taken over {waited:.2f} s after the stop, inside the TTL"
        first.send_signal(signal.SIGCONT)
        for _ in range(100):
            if "lease_lost" in (tmp_path / "a.log").read_text():
                break
            await asyncio.sleep(0.1)
        assert "lease_lost" in (tmp_path / "a.log").read_text()
        assert await _leader_pid(bus) == os.getpid()  # the standby, in this process
    finally:
        if first.poll() is None:
            first.send_signal(signal.SIGCONT)
            first.kill()
            first.wait()


async def test_a_record_written_before_presence_is_never_probed(
    nats_url: str, bus: Bus, replicas: list[ElasticityPlanner], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A holder that answers no subject of its own (a planner from before it did) would
    look gone to every probe: its record carries no ``presence``, and the TTL decides."""
    monkeypatch.setenv("PHALANX_PLANNER_LEASE_TTL_S", "60")
    kv = await bus.kv.bucket(JOBS_BUCKET, leader=True)
    await kv.create(LEASE_KEY, msgpack.packb({"holder": "old-host:1:abc", "ttl_s": 60.0, "at": 0.0}))
    standby = await _planner(nats_url, "planner-b")
    replicas.append(standby)
    await asyncio.sleep(1.0)
    assert not standby.lease.is_leader()
    assert await _leader_pid(bus) == 1
