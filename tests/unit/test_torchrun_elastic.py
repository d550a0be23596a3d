"""The torchrun-elastic baseline's pure parts (bench/baseline/torchrun_elastic.py and
bench/baseline/elastic_worker.py): trace parsing, steps-log parsing, the per-change
pauses and redone steps, goodput arithmetic, the agents' command line, and the
worker's batch split. No torchrun runs here."""

from __future__ import annotations

import itertools
import json

import pytest
import torch

from bench.baseline.elastic_worker import batch_indices, shard_range
from bench.baseline.torchrun_elastic import (
    ElasticRun,
    StepRecord,
    agent_command,
    agent_rounds,
    analyze_changes,
    check_trace,
    default_trace,
    goodput,
    offered_steps,
    parse_steps_log,
    parse_trace,
    rates_from_step_times,
    rdzv_conf_string,
    step_durations,
    summarize_durations,
    trained_steps,
)
from examples.mlp import MLP

T0 = 1_800_000_000.0


def rec(step: int, t: float, world: int, attempt: int = 1) -> StepRecord:
    return StepRecord(step=step, loss=0.5, world=world, ts=T0 + t, attempt=attempt)


# --- trace ------------------------------------------------------------------------


def test_default_trace() -> None:
    assert default_trace(15) == ([(0.0, 4), (15.0, 2), (30.0, 3), (45.0, 4)], 60.0)


def test_parse_trace() -> None:
    assert parse_trace("0:4, 15:2,30:3,45.5:4") == [(0.0, 4), (15.0, 2), (30.0, 3), (45.5, 4)]


@pytest.mark.parametrize(
    "text",
    ["", "1:4,15:2", "0:4,15", "0:4,15:2,10:3", "0:4,15:4", "0:4,15:0", "0:x"],
    ids=["empty", "not-at-0", "no-size", "time-back", "no-change", "size-0", "not-a-number"],
)
def test_parse_trace_rejects(text: str) -> None:
    with pytest.raises(ValueError):
        parse_trace(text)


def test_check_trace_end() -> None:
    check_trace([(0.0, 4), (10.0, 2)], 10.5)
    with pytest.raises(ValueError, match="ends at"):
        check_trace([(0.0, 4), (10.0, 2)], 10.0)


# --- steps log --------------------------------------------------------------------


def test_parse_steps_log_skips_torn_and_sorts() -> None:
    lines = [
        json.dumps({"step": 1, "loss": 0.4, "world": 4, "ts": T0 + 2.0, "attempt": 7}),
        "",
        json.dumps({"step": 0, "loss": 0.5, "world": 4, "ts": T0 + 1.0, "attempt": 7}),
        '{"step": 2, "loss": 0.3, "wor',  # a worker killed mid-write
        json.dumps({"step": 2, "loss": 0.3, "world": 2, "ts": T0 + 9.0}),  # no attempt: 0
    ]
    recs = parse_steps_log("\n".join(lines))
    assert [r.step for r in recs] == [0, 1, 2]
    assert recs[0] == StepRecord(0, 0.5, 4, T0 + 1.0, 7)
    assert recs[2].attempt == 0 and recs[2].world == 2


def test_step_durations_within_a_launch_only() -> None:
    recs = [rec(0, 0.0, 4), rec(1, 0.1, 4), rec(2, 0.3, 4), rec(0, 5.0, 2, attempt=2), rec(1, 5.5, 2, 2)]
    assert step_durations(recs) == pytest.approx([0.1, 0.2, 0.5])
    # a gap in the step numbers is not a step duration
    assert step_durations([rec(0, 0.0, 4), rec(2, 0.2, 4)]) == []


def test_summarize_durations() -> None:
    s = summarize_durations(3, [0.1, 0.3, 0.2, 0.4, 1.0])
    assert (s.world, s.p50, s.max, s.n) == (3, 0.3, 1.0, 5)
    assert s.p90 == 1.0 and s.mean == pytest.approx(0.4)
    with pytest.raises(ValueError):
        summarize_durations(2, [])


# --- changes, pauses, redone steps ------------------------------------------------


def scripted_run() -> ElasticRun:
    """4 ranks (steps 0..11 every second from t=2), scale down to 2 at t=14: the
    restart resumes from the checkpoint at step 10 and redoes 10 and 11 from t=20;
    scale up to 3 at t=30: the 2-rank round trains on until t=33, then the 3-rank round
    goes on with step 24 (as if the checkpoint were taken right there) from t=40."""
    steps = [rec(s, 2.0 + s, 4, attempt=1) for s in range(12)]  # 0..11 at t=2..13
    steps += [rec(10 + i, 20.0 + i, 2, attempt=2) for i in range(14)]  # 10..23 at t=20..33
    steps += [rec(24 + i, 40.0 + i, 3, attempt=3) for i in range(10)]  # 24..33 at t=40..49
    return ElasticRun(
        trace=[(0.0, 4), (14.0, 2), (30.0, 3)],
        end_s=50.0,
        start_ts=T0,
        end_ts=T0 + 50.0,
        global_batch=48,
        steps=steps,
        change_ts=[T0 + 14.0, T0 + 30.0],
    )


def test_changes_pause_and_redone() -> None:
    run = scripted_run()
    down, up = run.changes
    assert (down.world_from, down.world_to) == (4, 2)
    assert down.last_step_before == rec(11, 13.0, 4, 1)
    assert down.first_step_after == rec(10, 20.0, 2, 2)
    assert down.pause_s == pytest.approx(7.0)  # t=13 -> t=20
    assert down.since_change_s == pytest.approx(6.0)
    assert down.redone_steps == 2  # steps 10 and 11
    # the scale-up: the old round trains on after the change; the pause runs from its
    # last step (t=33), not from the last step before the change (t=30)
    assert up.last_step_before == rec(23, 33.0, 2, 2)
    assert up.first_step_after == rec(24, 40.0, 3, 3)
    assert up.pause_s == pytest.approx(7.0)
    assert up.since_change_s == pytest.approx(10.0)
    assert up.redone_steps == 0
    assert run.pauses_s == [pytest.approx(7.0), pytest.approx(7.0)]
    assert run.redone_steps == [2, 0]
    assert run.overlapping_rounds() == 0


def test_change_not_recovered_before_the_end() -> None:
    steps = [rec(s, 1.0 + s, 4) for s in range(5)]  # 0..4 at t=1..5
    changes = analyze_changes(steps, [(0.0, 4), (5.5, 2)], [T0 + 5.5], T0 + 20.0)
    (c,) = changes
    assert c.first_step_after is None and c.pause_s is None and c.since_change_s is None
    assert c.pause_at_least_s(T0 + 20.0) == pytest.approx(15.0)


def test_repeated_redo_counted_per_completion() -> None:
    # two restarts after one change (e.g. a round closed before a slow agent joined):
    # steps 10..12 done, then 10..11 again at size 2, then 10..13 at size 3
    steps = [rec(s, float(s), 4, 1) for s in range(13)]
    steps += [rec(10, 20.0, 2, 2), rec(11, 21.0, 2, 2)]
    steps += [rec(10 + i, 30.0 + i, 3, 3) for i in range(4)]
    (c,) = analyze_changes(steps, [(0.0, 4), (15.0, 3)], [T0 + 15.0], T0 + 40.0)
    assert c.first_step_after == rec(10, 30.0, 3, 3)  # the first step at the new size
    assert c.last_step_before == rec(12, 12.0, 4, 1)
    assert c.redone_steps == 2 + 3  # 10, 11 (size 2); 10, 11, 12 (size 3)


def test_overlapping_rounds() -> None:
    steps = [rec(0, 0.0, 2, 1), rec(1, 2.0, 2, 1), rec(0, 1.0, 2, 2), rec(1, 3.0, 2, 2)]
    run = ElasticRun([(0.0, 2)], 5.0, T0, T0 + 5.0, 48, sorted(steps, key=lambda r: r.ts), [])
    assert run.overlapping_rounds() == 1


def test_restart_phases() -> None:
    run = scripted_run()
    run.starts = [{"attempt": 2, "proc_start": T0 + 16.0, "imported": T0 + 18.0, "pg_ready": T0 + 18.5}]
    assert run.restart_phases(run.changes[0]) == {
        "proc_start": 2.0,
        "imported": 4.0,
        "pg_ready": 4.5,
        "first_step": 6.0,
    }
    assert run.restart_phases(run.changes[1]) is None  # no start line for attempt 3


# --- goodput ----------------------------------------------------------------------


def test_goodput_arithmetic() -> None:
    run = scripted_run()
    # first completed step at t=2: the window is (2, 50]
    assert run.first_ts == T0 + 2.0
    assert run.segments() == [(T0, T0 + 14.0, 4), (T0 + 14.0, T0 + 30.0, 2), (T0 + 30.0, T0 + 50.0, 3)]
    # distinct step numbers completed in (t=2, t=50]: 1..33 (step 0 is the origin)
    assert trained_steps(run) == 33
    rates = {4: 1.0, 2: 2.0, 3: 1.5}  # steps per second
    offered = (14.0 - 2.0) * 1.0 + 16.0 * 2.0 + 20.0 * 1.5
    assert offered_steps(run, rates) == pytest.approx(offered)
    assert goodput(run, rates) == pytest.approx(33 / offered)


def test_goodput_clips_to_the_end_and_needs_every_rate() -> None:
    run = scripted_run()
    run.end_ts = T0 + 35.0  # the job ended early: steps after it do not count
    assert trained_steps(run) == 23  # 1..23
    assert offered_steps(run, {4: 1.0, 2: 1.0, 3: 1.0}) == pytest.approx(33.0)
    with pytest.raises(KeyError):
        offered_steps(run, {4: 1.0, 2: 1.0})


def test_goodput_one_without_changes() -> None:
    steps = [rec(s, 1.0 + 0.5 * s, 2) for s in range(21)]  # every 0.5 s from t=1 to t=11
    run = ElasticRun([(0.0, 2)], 11.0, T0, T0 + 11.0, 48, steps, [])
    assert goodput(run, rates_from_step_times({2: 0.5})) == pytest.approx(1.0)


# --- the agents -------------------------------------------------------------------


def test_agent_command() -> None:
    conf = {"join_timeout": 60, "last_call_timeout": 1}
    assert rdzv_conf_string(conf) == "join_timeout=60,last_call_timeout=1"

    def cmd(slot: int) -> list[str]:
        return agent_command(
            slot,
            nnodes="2:4",
            endpoint="127.0.0.1:29400",
            rdzv_id="x",
            rdzv_conf=conf,
            monitor_interval=0.1,
            worker_args=["w.py", "--steps", "5"],
        )

    host, other = cmd(0), cmd(2)
    assert host[1:3] == ["-m", "torch.distributed.run"]
    assert host[host.index("--nnodes") + 1] == "2:4"
    assert host[host.index("--nproc-per-node") + 1] == "1"
    assert host[host.index("--rdzv-conf") + 1].endswith(",is_host=1")
    assert other[other.index("--rdzv-conf") + 1].endswith(",is_host=0")
    assert host[-3:] == ["w.py", "--steps", "5"]


def test_agent_rounds() -> None:
    api = ".venv/lib/python3.11/site-packages/torch/distributed/elastic/agent/server/api.py:553]"
    text = "\n".join(
        [
            f"I1201 00:56:12.136000 16845 {api} [default] Rendezvous complete for workers. Result:",
            f"I1201 00:56:12.136000 16845 {api}   restart_count=0",
            f"I1201 00:56:12.136000 16845 {api}   group_world_size=4",
            f"I1201 00:56:12.136000 16845 {api}   role_world_sizes=[4]",
            "[rank0]: group_world_size=9 (a worker's line)",
            f"I1201 00:56:27.756000 16845 {api}   group_world_size=2",
        ]
    )
    assert agent_rounds(text) == [4, 2]


# --- the worker's batch -----------------------------------------------------------


def test_batch_indices_wrap() -> None:
    perm = torch.tensor([3, 1, 4, 0, 2])
    assert batch_indices(0, 2, perm).tolist() == [3, 1]
    assert batch_indices(2, 2, perm).tolist() == [2, 3]  # samples 4, 5 -> wraps


@pytest.mark.parametrize("world", [1, 2, 3, 4, 5, 7])
def test_shards_cover_the_batch(world: int) -> None:
    ranges = [shard_range(48, world, r) for r in range(world)]
    assert ranges[0][0] == 0 and ranges[-1][1] == 48
    assert all(a[1] == b[0] for a, b in itertools.pairwise(ranges))


@pytest.mark.parametrize("world", [2, 3, 4])
def test_summed_weighted_shard_gradients_are_the_global_mean_gradient(world: int) -> None:
    torch.manual_seed(0)
    model = MLP(d_in=8, hidden=16, depth=2, d_out=3)
    g = 10  # not a multiple of 3 or 4: unequal shards
    x, y = torch.randn(g, 8), torch.randn(g, 3)
    model.zero_grad()
    torch.nn.functional.mse_loss(model(x), y).backward()
    want = [p.grad.clone() for p in model.parameters()]  # type: ignore[union-attr]
    model.zero_grad()
    total = 0.0
    for r in range(world):  # what the all-reduce SUM adds up
        lo, hi = shard_range(g, world, r)
        loss = torch.nn.functional.mse_loss(model(x[lo:hi]), y[lo:hi]) * ((hi - lo) / g)
        loss.backward()
        total += float(loss.detach())
    for p, w in zip(model.parameters(), want, strict=True):
        torch.testing.assert_close(p.grad, w)
    full = torch.nn.functional.mse_loss(model(x), y).detach()
    assert total == pytest.approx(float(full), rel=1e-5)
