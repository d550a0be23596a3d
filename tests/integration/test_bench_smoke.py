"""Smoke runs of the benchmarks: each at tiny sizes, through the same code path as the
full run, must end with one JSON line carrying its headline figures. The figures
themselves are the benchmark's business (bench/), never asserted here; the one
exception is no timing: the sharded recovery's bytes moved per recovery, about
one shard's state whatever the machine."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from phalanx.devstack.netns import NetnsCluster

ROOT = Path(__file__).resolve().parents[2]

SMOKE = {  # module: (its tiny-size arguments, the keys its last JSON line must carry)
    # bench.checkpoint also runs bench/checkpoint_baselines.py (DCP stagers, direct to S3)
    "bench.checkpoint": (
        ["--gib", "0.01", "--saves", "1"],
        {
            "blocking_save_s",
            "step_compute_s",
            "fence_s",
            "shm_copy_s",
            "durable_lag_s",
            "drain_overhead_pct",
            "drain_overhead_runs_pct",
            "digest_s",
            "restore_remote_s",
            "direct_remote_save_s",
            "direct_remote_phases",
            "dcp_async_blocked_s",
        },
    ),
    "bench.failover": (
        ["--trials", "1"],
        {"planner_failover_s", "planner_failover_max_s", "samples_s", "partition"},
    ),
    "bench.recovery": (
        ["--quick", "--nproc", "2"],
        {
            "phalanx_downtime_s",
            "phalanx_downtime_max_s",
            "beyond_step_s",
            "restart_downtime_s",
            "downtime_ratio",
        },
    ),
}

UNMODIFIED_KEYS = {
    "phalanx_downtime_s",
    "phalanx_downtime_p90_s",
    "phalanx_downtime_max_s",
    "phalanx_cold_downtime_s",
    "torchrun_downtime_s",
    "downtime_ratio",
    "steady_overhead_pct",
    "steady_pairs",
    "warm_process_rss_mb",
    "warm_process_pss_mb",
    "fork_server_rss_mb",
}


HSDP_KEYS = {
    "parallel",
    "phalanx_downtime_s",
    "phalanx_downtime_p90_s",
    "phalanx_downtime_max_s",
    "beyond_step_s",
    "beyond_step_p90_s",
    "beyond_step_max_s",
    "restart_downtime_s",
    "steady_overhead_pct",
    "bytes_moved_ratio",
    "bytes_moved_ratio_max",
    "shard_state_bytes",
    "model_params",
    "mesh",
    "trials",
    "restart_trials",
    "phases",
    "phalanx_lost_steps",
}


def last_json_line(module: str, args: list[str], timeout_s: float = 240) -> dict[str, Any]:
    out = subprocess.run(
        [sys.executable, "-m", module, *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout_s
    )
    assert out.returncode == 0, out.stderr[-3000:]
    last: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    return last


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(SMOKE))
def test_the_benchmark_runs_at_tiny_size_and_prints_its_json_last(name: str) -> None:
    args, keys = SMOKE[name]
    last = last_json_line(name, args)
    assert keys <= last.keys(), sorted(last)


@pytest.mark.slow
@pytest.mark.timeout(480)  # five launches (torch imports) on two cores
def test_the_sharded_recovery_benchmark_moves_about_one_shard_per_recovery() -> None:
    # a (2, 1) mesh, 2 ranks + a spare, a 150 k-parameter MLP (1.8 MB of state per
    # shard: the sampler, RNG and step counters that travel too stay small); that a
    # joiner of a (2, 2) mesh gets one shard of two is tests/e2e/test_sharded.py's
    args = ["--parallel", "hsdp", "--quick", "--model-hidden", "256", "--model-depth", "3", "--nproc", "2"]
    last = last_json_line("bench.recovery", args, timeout_s=420)
    assert HSDP_KEYS <= last.keys(), sorted(last)
    assert last["parallel"] == "hsdp" and last["mesh"] == [2, 1]
    assert 1.0 <= last["bytes_moved_ratio"] <= last["bytes_moved_ratio_max"] <= 1.1, last


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_recovery_benchmark_kills_a_rank_on_the_namespace_cluster_at_tiny_size() -> None:
    # 2 namespace nodes of 1 rank + 1 spare, one rank kill, no node loss, no single-node part
    ok, why = NetnsCluster.available()
    if not ok:
        pytest.skip(f"network namespaces unavailable: {why}")
    args = ["--nodes", "2", "--node-trials", "0", "--rank-kills", "1", "--skip-single", "--steps", "20"]
    last = last_json_line("bench.recovery", args, timeout_s=280)
    assert last["node_rank_kills"] == 1 and len(last["node_rank_kill_downtimes_s"]) == 1, last
    assert {"node_rank_kill_downtime_s", "node_rank_kill_abort_max_s"} <= last.keys(), sorted(last)


@pytest.mark.slow
def test_the_rendezvous_benchmark_runs_both_designs_and_real_gloo_at_tiny_size() -> None:
    # 16 simulated ranks (the counted arrival's smallest world) over 2 worker processes
    # and 2 stores, then 4 real gloo ranks per design: ~20 s, most of it torch imports
    args = ["--ranks", "16", "--sizes", "4,16", "--procs", "2", "--stores", "2", "--repeat", "1"]
    last = last_json_line(
        "bench.rendezvous", [*args, "--limit-s", "20", "--e2e-ranks", "4", "--e2e-procs", "1"]
    )
    assert {"ranks", "today", "new", "spread", "e2e"} <= last.keys(), sorted(last)
    assert set(last["today"]) == set(last["new"]) == {"4", "16"}, last
    assert [run["design"] for run in last["e2e"]] == ["today", "new"], last


SCALE_KEYS = {
    "record_bytes",
    "plan_bytes_per_node",
    "node_loss_to_all_launchers_s",
    "planner_decision_ms",
    "planner_rss_mb",
    "nats_bytes_per_plan",
}


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_the_scale_benchmark_runs_simulated_launchers_through_node_losses() -> None:
    # 8 simulated nodes of 4 ranks + 2 spares (a lost node's members and the spares used
    # before leave enough for the second loss), today's plan delivery, every rank following
    args = ["--ranks", "32", "--ranks-per-node", "4", "--spares-per-node", "2", "--node-losses", "2"]
    last = last_json_line(
        "bench.scale", [*args, "--quiet-s", "0.5", "--rank-followers", "all"], timeout_s=100
    )
    assert SCALE_KEYS <= last.keys(), sorted(last)
    assert last["node_losses"] == 2 and not last["failures"], last
    # both plan-delivery designs of bench/scaleplan.py ran: "new", then the "today" baseline
    assert last["design"] == "new" and SCALE_KEYS <= last["today"].keys(), last.get("today")
    assert last["today"]["node_losses"] == 2 and not last["today"]["failures"], last["today"]


def test_the_scale_modules_run_at_tiny_size_in_process() -> None:
    """bench/scalerecord.py (the record built by the planner's reducer) and
    bench/scaleplan.py (the designs) directly, as ``bench.scale`` uses them."""
    from bench import scaleplan, scalerecord

    got = scalerecord.measure(64, 8, 1, repeats=1)
    assert got["ranks"] == 64 and got["nodes"] == 8 and got["workers"] == 72, got
    assert {"record_bytes", "delta_bytes", "node_plan_bytes", "exceeds_max_payload"} <= got.keys()
    assert {scaleplan.design(name).name for name in scaleplan.DESIGNS} == {"new", "today"}
    with pytest.raises(ValueError, match="unknown design"):
        scaleplan.design("neither")


@pytest.mark.slow
def test_the_scale_benchmark_measures_the_record_alone() -> None:
    last = last_json_line("bench.scale", ["--ranks", "256", "--record-only"], timeout_s=60)
    assert {"record_bytes", "record_encode_ms", "record_decode_ms", "exceeds_max_payload"} <= last.keys()


def test_the_unmodified_script_benchmark_runs_every_side_at_tiny_size() -> None:
    """bench.recovery --loop unmodified (bench/unmodified.py): warm and cold restarts under
    phalanx run, torchrun's, a steady pair and the warm spare's memory."""
    last = last_json_line(
        "bench.recovery", ["--loop", "unmodified", "--quick", "--nproc", "2"], timeout_s=400
    )
    assert UNMODIFIED_KEYS <= set(last), UNMODIFIED_KEYS - set(last)
    assert len(last["trials"]["phalanx_warm"]) == len(last["trials"]["torchrun"]) == 1


@pytest.mark.slow
@pytest.mark.timeout(480)
def test_the_hangs_benchmark_runs_a_cell_per_fault_kind_and_its_baseline() -> None:
    """bench.hangs --smoke: one trial of a fault from outside (SIGSTOP, on the unmodified
    script) and one injected (a rank hung inside the job's first all-reduce, on the user
    loop): each rung and each kind of fault once, the capped torchrun baseline of each
    rung, and short soaks with evaluation pauses. (The other cells run the same code;
    a spinning rank, injected the same way, is tests/e2e's: test_unmodified.py and
    test_user_loop.py.)"""
    soak = ["--soak-s", "6", "--eval-every-s", "3", "--eval-s", "1"]
    last = last_json_line(
        "bench.hangs",
        [
            "--smoke",
            "--rungs",
            "ddp,unmodified",
            "--faults",
            "sigstop,job_first_allreduce",
            "--cells",
            "unmodified/sigstop,ddp/job_first_allreduce",
            "--baseline-cap",
            "5",
            *soak,
        ],
        timeout_s=460,
    )
    assert {"cells", "abort_p99_s", "not_run", "baseline", "soak"} <= last.keys(), sorted(last)
    assert {"false_verdicts", "declared", "undeclared", "eval_every_steps"} <= last["soak"].keys()
    assert set(last["cells"]) == {"unmodified/sigstop", "ddp/job_first_allreduce"}
    assert [v[0] for v in last["cells"]["unmodified/sigstop"]["trials"][0]["verdicts"]] == ["heartbeat_lost"]
    assert last["cells"]["ddp/job_first_allreduce"]["trials"][0]["verdicts"][0][0] in (
        "collective_hang",
        "collective_wedged",
    )
    assert last["soak_unmodified"]["false_verdicts"] == 0
    for cell in last["cells"].values():
        assert {"median", "p90", "max", "trials"} <= cell.keys()
    assert last["baseline"]["cells"]["ddp/sigstop"]["runs"]
    assert last["baseline"]["cells"]["unmodified/sigstop"]["runs"]
