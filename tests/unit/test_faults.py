"""Fault injection (phalanx.runtime.faults): PHALANX_FAULTS parsing, matching, the
exit action and the PHALANX_FAULT_LOG line written before a fault strikes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from phalanx.runtime import faults
from phalanx.runtime.faults import Fault, FaultPlan

REPO = Path(__file__).resolve().parents[2]


def test_parse_valid_specs() -> None:
    plan = FaultPlan.parse(
        "kill:w2@step=5, stop:w1@recovery=2,stall:spare_0@step=0,exit:w-3@recovery=10,wedge:w1@step=7"
    )
    assert plan.faults == (
        Fault("kill", "w2", "step", 5),
        Fault("stop", "w1", "recovery", 2),
        Fault("stall", "spare_0", "step", 0),
        Fault("exit", "w-3", "recovery", 10),
        Fault("wedge", "w1", "step", 7),
    )


@pytest.mark.parametrize("spec", ["", "   ", ",", " , ,"])
def test_parse_empty_is_no_faults(spec: str) -> None:
    assert FaultPlan.parse(spec) == FaultPlan()
    assert FaultPlan.parse(spec).faults == ()


@pytest.mark.parametrize(
    "bad",
    [
        "boom:w1@step=1",  # unknown action
        "kill:w1@epoch=1",  # unknown point
        "kill:w1@step=",  # no value
        "kill:w1@step=-1",  # negative
        "kill:w1@step=1.5",
        "kill:@step=1",  # no worker
        "kill:w 1@step=1",
        "kill w1@step=1",
        "KILL:w1@step=1",
        "kill:w1@step=1;stop:w2@step=2",
        "wedge:w1@recovery=2",  # a wedge hangs inside the step's all-reduce
    ],
)
def test_parse_invalid_specs_raise_clear_value_error(bad: str) -> None:
    with pytest.raises(ValueError, match="bad fault") as ei:
        FaultPlan.parse(f"kill:w0@step=1,{bad}")
    assert repr(bad.strip()) in str(ei.value)  # names the offending entry
    assert "action:worker@step=N" in str(ei.value)


def test_from_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PHALANX_FAULTS", "exit:w4@step=9")
    assert FaultPlan.from_env().faults == (Fault("exit", "w4", "step", 9),)
    monkeypatch.delenv("PHALANX_FAULTS")
    assert FaultPlan.from_env().faults == ()


def test_fire_only_on_the_matching_worker_point_and_value(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    done: list[str] = []
    monkeypatch.setattr(faults, "_do", done.append)
    log = tmp_path / "faults.jsonl"
    monkeypatch.setenv("PHALANX_FAULT_LOG", str(log))
    plan = FaultPlan.parse("kill:w2@step=5,stop:w1@recovery=2,exit:w2@recovery=5")

    for worker, point, value in [
        ("w2", "step", 4),
        ("w2", "step", 6),
        ("w1", "step", 5),
        ("w3", "step", 5),
        ("w2", "recovery", 2),
        ("w1", "step", 2),
        ("w12", "step", 5),
        ("w", "step", 5),
    ]:
        plan.fire(worker, point, value)
    assert done == []
    assert not log.exists()

    plan.fire("w2", "step", 5)
    assert done == ["kill"]
    plan.fire("w1", "recovery", 2)
    plan.fire("w2", "recovery", 5)
    assert done == ["kill", "stop", "exit"]
    lines = [json.loads(x) for x in log.read_text().splitlines()]
    assert [(d["worker"], d["action"], d["point"], d["value"]) for d in lines] == [
        ("w2", "kill", "step", 5),
        ("w1", "stop", "recovery", 2),
        ("w2", "exit", "recovery", 5),
    ]


def test_wedge_enters_the_collective_phase_then_blocks(monkeypatch: pytest.MonkeyPatch) -> None:
    done: list[str] = []
    monkeypatch.setattr(faults, "_do", done.append)
    monkeypatch.delenv("PHALANX_FAULT_LOG", raising=False)
    plan = FaultPlan.parse("wedge:w1@step=4")
    assert not plan.fire("w1", "step", 3, enter_collective=lambda: done.append("collective"))
    assert done == []
    assert not plan.fire("w1", "step", 4, enter_collective=lambda: done.append("collective"))
    assert done == ["collective", "wedge"]  # the phase is set before the thread blocks
    assert not plan.fire("w1", "step", 4, enter_collective=lambda: done.append("collective"))
    assert done == ["collective", "wedge"]  # once


def test_wedge_blocks_the_calling_thread_only(monkeypatch: pytest.MonkeyPatch) -> None:
    import threading

    monkeypatch.delenv("PHALANX_FAULT_LOG", raising=False)
    entered = threading.Event()
    plan = FaultPlan.parse("wedge:w1@step=1")
    t = threading.Thread(target=plan.fire, args=("w1", "step", 1), kwargs={"enter_collective": entered.set})
    t.daemon = True
    t.start()
    assert entered.wait(5.0)
    t.join(0.2)
    assert t.is_alive()  # blocked for good; the test process goes on (a daemon thread)


def test_no_log_without_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(faults, "_do", lambda action: None)
    monkeypatch.delenv("PHALANX_FAULT_LOG", raising=False)
    monkeypatch.chdir(tmp_path)
    FaultPlan.parse("kill:w0@step=1").fire("w0", "step", 1)
    assert list(tmp_path.iterdir()) == []


def _child_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PHALANX_")}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO / "libs"), str(REPO)])
    env.update(extra)
    return env


_CHILD = """
import sys
from phalanx.runtime.faults import FaultPlan
plan = FaultPlan.from_env()
plan.fire("w1", "step", 2)  # no match: carries on
print("before", flush=True)
plan.fire("w1", "step", 3)
print("after", flush=True)
"""


def test_exit_action_exits_with_code_3_after_logging(tmp_path: Path) -> None:
    log = tmp_path / "sub" / "faults.jsonl"
    log.parent.mkdir()
    t0 = time.time()
    proc = subprocess.run(
        [sys.executable, "-c", _CHILD],
        env=_child_env(PHALANX_FAULTS="exit:w1@step=3", PHALANX_FAULT_LOG=str(log)),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 3, proc.stderr
    assert proc.stdout.split() == ["before"]
    lines = log.read_text().splitlines()
    assert len(lines) == 1
    d = json.loads(lines[0])
    assert {k: d[k] for k in ("worker", "action", "point", "value")} == {
        "worker": "w1",
        "action": "exit",
        "point": "step",
        "value": 3,
    }
    assert t0 <= d["ts"] <= time.time()


def test_exit_action_appends_to_an_existing_log(tmp_path: Path) -> None:
    log = tmp_path / "faults.jsonl"
    log.write_text('{"worker": "w0"}\n')
    proc = subprocess.run(
        [sys.executable, "-c", _CHILD],
        env=_child_env(PHALANX_FAULTS="exit:w1@step=3", PHALANX_FAULT_LOG=str(log)),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 3, proc.stderr
    lines = log.read_text().splitlines()
    assert lines[0] == '{"worker": "w0"}'
    assert json.loads(lines[1])["action"] == "exit"
