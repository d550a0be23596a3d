"""The drains' plan (phalanx.checkpoint.drainplan): lanes and rates as the settings give
them, bad ones refused at load, a throttle that paces, and drain threads that really
run at a lower CPU priority and in the idle IO class."""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from phalanx.checkpoint.drainplan import DrainPlan, Throttle, io_class_of_thread
from phalanx.checkpoint.tiers import Tier
from phalanx.settings import KeeperSettings, SettingsError, load


def test_the_default_streams_the_object_copy_beside_disk_then_shared() -> None:
    plan = DrainPlan()
    assert plan.lanes == ((Tier.OBJECT,), (Tier.DISK, Tier.SHARED))
    assert plan.lane_of(Tier.SHARED) == plan.lane_of(Tier.DISK) != plan.lane_of(Tier.OBJECT)
    assert DrainPlan.parse("disk,shared,object").lanes == ((Tier.DISK, Tier.SHARED, Tier.OBJECT),)


@pytest.mark.parametrize(
    ("lanes", "rates", "says"),
    [
        ("object | disk", "", "exactly once"),
        ("object | disk, shared, disk", "", "exactly once"),
        ("object || disk, shared", "", "an empty lane"),
        ("memory | disk, shared, object", "", "not a durable tier"),
        ("tape | disk, shared, object", "", "not a durable tier"),
        ("object | disk, shared", "disk=fast", "not a rate"),
        ("object | disk, shared", "disk=0", "> 0"),
        ("object | disk, shared", "disk=1M,disk=2M", "expected"),
        ("object | disk, shared", "memory=1M", "expected"),
        ("object | disk, shared", "disk", "expected"),
    ],
)
def test_a_bad_plan_is_refused_saying_why(lanes: str, rates: str, says: str) -> None:
    with pytest.raises(ValueError, match=says):
        DrainPlan.parse(lanes, rates)


def test_the_keeper_settings_refuse_a_bad_plan_at_load(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PHALANX_CKPT_DRAIN", "object | disk")
    with pytest.raises(SettingsError, match="PHALANX_CKPT_DRAIN"):
        load(KeeperSettings)
    monkeypatch.setenv("PHALANX_CKPT_DRAIN", "disk, shared | object")
    monkeypatch.setenv("PHALANX_CKPT_RATE", "object=12x")
    with pytest.raises(SettingsError, match="PHALANX_CKPT_RATE"):
        load(KeeperSettings)
    monkeypatch.setenv("PHALANX_CKPT_RATE", "object=100M, disk=1.5G")
    got = load(KeeperSettings)
    plan = DrainPlan.parse(got.ckpt_drain, got.ckpt_rate)
    assert plan.rates == {Tier.OBJECT: 100e6, Tier.DISK: 1.5e9}


def test_a_throttle_keeps_a_copy_at_its_rate(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = [0.0]
    slept: list[float] = []
    monkeypatch.setattr("phalanx.checkpoint.drainplan.time.monotonic", lambda: clock[0])

    def sleep(s: float) -> None:
        slept.append(s)
        clock[0] += s

    monkeypatch.setattr("phalanx.checkpoint.drainplan.time.sleep", sleep)
    t = Throttle(100.0)  # bytes/s
    for _ in range(10):
        t.pace(50)  # written instantly: 500 bytes take 5 s at 100 bytes/s
    assert clock[0] == pytest.approx(5.0)
    assert t.slept_s == pytest.approx(5.0)
    clock[0] += 10.0  # a slow piece: no sleep owed
    t.pace(10)
    assert t.slept_s == pytest.approx(5.0)


def test_drain_threads_run_nicer_and_in_the_idle_io_class() -> None:
    plan = DrainPlan(nice=7, idle_io=True)
    me = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    with ThreadPoolExecutor(1, initializer=plan.lower_priority) as pool:
        tid, nice = pool.submit(
            lambda: (threading.get_native_id(), os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))
        ).result()
        assert nice == min(19, me + 7)
        assert io_class_of_thread(tid) == 3  # IOPRIO_CLASS_IDLE
    # the calling thread (the keeper's loop, which serves restores) is untouched
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == me
    assert io_class_of_thread(threading.get_native_id()) != 3
