"""Replay: the inputs a live planner journaled (``PHALANX_PLANNER_JOURNAL``), fed again
through its reducer, give exactly the plans it committed.

The planner runs against a real nats-server through a start, a crash replaced by
the hot spare, acknowledgements, a broken group re-formed after its grace, a second
crash with no spare left (a stop, once the wait for the spare asked for is over), and the leader's restart in the middle (the new
leader's takeover loads the record: the journal holds that state too).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from phalanx.services.elasticity_planner.journal import read, replay, unstamped

from phalanx.bus import Bus
from phalanx.contract import Action, CollectiveError, PlanAck
from phalanx.contract.subjects import ACK, COMM_ERROR, FAILED
from tests.integration.planning import JOB, Watcher, failed, planner, start_job


async def _ack(bus: Bus, generation: int, members: list[tuple[int, str]]) -> None:
    for rank, worker in members:
        ack = PlanAck(job=JOB, generation=generation, worker=worker, rank=rank)
        await bus.publish(ACK, ack, job=JOB, msg_id=f"ack-{generation}-{worker}")


async def test_a_live_run_replayed_through_the_reducer_commits_the_same_plans(
    nats_url: str, bus: Bus, watcher: Watcher, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    journal = tmp_path / "planner.jsonl"
    monkeypatch.setenv("PHALANX_PLANNER_JOURNAL", str(journal))
    monkeypatch.setenv("PHALANX_PLANNER_COMM_GRACE_S", "0.3")
    monkeypatch.setenv("PHALANX_PLANNER_SPARE_WAIT_S", "0.3")  # w4, asked for as a spare, never starts
    async with planner(nats_url):
        run = (await start_job(bus)).run
        await watcher.wait_for(lambda: {p.generation for p in watcher.plans} == {1})
        event = failed("w1", 1)
        await bus.publish(FAILED, event, job=JOB, msg_id=event.incident)
        await watcher.wait_for(lambda: any(p.generation == 2 for p in watcher.plans))
        await _ack(bus, 2, [(0, "w0"), (1, "w3"), (2, "w2")])
    async with planner(nats_url):  # a restart: the new leader reads the record
        for worker, rank in (("w0", 0), ("w3", 1), ("w2", 2)):
            err = CollectiveError(
                job=JOB, worker=worker, rank=rank, generation=2, step=4, error="reset", launch=run
            )
            await bus.publish(COMM_ERROR, err, job=JOB)
        await watcher.wait_for(lambda: any(p.generation == 3 for p in watcher.plans))
        crash = failed("w2", 2, generation=3, pid=202)
        await bus.publish(FAILED, crash, job=JOB, msg_id=crash.incident)
        await watcher.wait_for(lambda: any(d.action is Action.STOP for d in watcher.decisions))

    lines = read(journal)
    assert sum("state" in line for line in lines) >= 1, "the second leader's takeover is in the journal"
    pairs = replay(lines)
    assert [rec.generation for rec, _ in pairs] == [1, 2, 3]
    for recorded, replayed in pairs:
        assert replayed is not None and unstamped(replayed) == unstamped(recorded)
    published = {p.generation: p for p in watcher.plans}
    assert [published[rec.generation] for rec, _ in pairs] == [rec for rec, _ in pairs]  # what went out
