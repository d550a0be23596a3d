"""Smoke runs of the benchmarks: each at tiny sizes, through the same code path as the
full run, must end with one JSON line carrying its headline figures. The figures
themselves are the benchmark's business (bench/), never asserted here."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

SMOKE = {  # module: (its tiny-size arguments, the keys its last JSON line must carry)
    # bench.checkpoint also runs bench/checkpoint_baselines.py (DCP stagers, direct to S3)
    "bench.checkpoint": (
        ["--gib", "0.01", "--saves", "1"],
        {"blocking_save_s", "digest_s", "restore_remote_s", "direct_remote_save_s", "dcp_async_blocked_s"},
    ),
    "bench.failover": (["--trials", "1"], {"planner_failover_s", "planner_failover_max_s", "samples_s"}),
    "bench.recovery": (
        ["--quick", "--nproc", "2"],
        {"phalanx_downtime_s", "phalanx_downtime_max_s", "restart_downtime_s", "downtime_ratio"},
    ),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(SMOKE))
def test_the_benchmark_runs_at_tiny_size_and_prints_its_json_last(name: str) -> None:
    args, keys = SMOKE[name]
    out = subprocess.run(
        [sys.executable, "-m", name, *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    last = json.loads(out.stdout.strip().splitlines()[-1])
    assert keys <= last.keys(), sorted(last)
