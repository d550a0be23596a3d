"""Replay of journals recorded from real runs (``PHALANX_PLANNER_JOURNAL``): the planner's
reducer reproduces every plan the live planner committed.

- tests/data/planner_journal.jsonl: the scenario of tests/integration/test_planner_replay.py
  (a real nats-server): a start, a crash replaced by the spare, a planner restart, a broken
  group re-formed, a crash with no spare left (a wait for spares, then a stop).
- tests/data/planner_journal_e2e.jsonl: tests/e2e/test_recovery.py::
  test_broken_group_with_every_rank_alive_reforms (real ranks under a launcher): the job and
  its fault-free reference run, registrations, acknowledgements, collective errors, the re-form.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
from phalanx.services.elasticity_planner.journal import read, replay, unstamped

DATA = Path(__file__).parents[1] / "data"


@pytest.mark.parametrize(
    ("name", "committed"),
    [
        ("planner_journal.jsonl", [("pj", 1, None), ("pj", 2, "pj:w1:101"), ("pj", 3, "pj:gen2:collective")]),
        (
            "planner_journal_e2e.jsonl",
            [("e2e00", 1, None), ("e2e00", 2, "e2e00:gen1:collective"), ("e2e01", 1, None)],
        ),
    ],
)
def test_a_recorded_run_replays_to_the_same_plans(name: str, committed: list[tuple[str, int, str]]) -> None:
    pairs = replay(read(DATA / name))
    assert [(p.job, p.generation, p.incident) for p, _ in pairs] == committed
    for recorded, replayed in pairs:
        assert replayed is not None and unstamped(replayed) == unstamped(recorded)


def test_a_changed_input_does_not_replay_to_the_recorded_plans() -> None:
    """The comparison can fail: another worker crashing gives another generation 2."""
    changed = copy.deepcopy(read(DATA / "planner_journal.jsonl"))
    fault = next(line for line in changed if line.get("event", {}).get("type") == "failed")
    fault["event"]["msg"].update(worker="w0", rank=0)
    recorded, replayed = replay(changed)[1]
    assert replayed is not None and unstamped(replayed) != unstamped(recorded)
