"""bench/gpu_check.py: its helpers, and (slow) the whole script as a CPU dry run: the
same orchestration a GPU machine runs over NCCL, here over gloo."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bench import gpu_check
from phalanx.checkpoint.packing import pack, unpack

REPO = Path(__file__).resolve().parents[2]


def test_pattern_is_exact_and_finite() -> None:
    a = gpu_check._pattern(1000, 3, torch.device("cpu"))
    b = gpu_check._pattern(1000, 3, torch.device("cpu"))
    assert a.dtype == torch.float32 and torch.isfinite(a).all()
    assert torch.equal(a.view(torch.int32), b.view(torch.int32))
    assert not torch.equal(a, gpu_check._pattern(1000, 4, torch.device("cpu")))


def test_make_state_size_and_round_trip() -> None:
    state = gpu_check.make_state(1 << 20, torch.device("cpu"), layers=4)
    meta, buf = pack(state)
    assert (1 << 20) - 4096 <= buf.numel() <= (1 << 20) + 8192  # + the RNG state, steps, padding
    assert gpu_check.same_state(unpack(meta, buf), state, torch.device("cpu"))
    other = gpu_check.make_state(1 << 20, torch.device("cpu"), layers=4)
    other["model"]["layer0.weight"][0] += 1
    assert not gpu_check.same_state(other, state, torch.device("cpu"))


def test_rates() -> None:
    r = gpu_check.rates(2_000_000_000, [1.0, 2.0, 4.0])
    assert r == {"median_gbps": 1.0, "max_gbps": 2.0, "median_ms": 2000.0, "repeats": 3}


def test_gpu_parts_say_why_they_are_skipped(tmp_path: Path) -> None:
    if torch.cuda.device_count() >= 3:
        pytest.skip("this machine can run the GPU parts")
    out = gpu_check.nccl_recovery(tmp_path, dry_run=False, steps=10, fault_step=3)
    assert out == {"skipped": f"needs >= 3 GPUs (2 ranks + 1 spare), found {torch.cuda.device_count()}"}


@pytest.mark.slow
def test_cpu_dry_run(tmp_path: Path) -> None:
    """The whole script on CPU/gloo (about 30 s here): the state transfer between two
    processes, and a LocalStack job losing w1 that ends bitwise equal to its
    fault-free run."""
    args = ["--cpu-dry-run", "--mib", "4", "--repeats", "2", "--steps", "8", "--fault-step", "3"]
    proc = subprocess.run(
        [sys.executable, "-m", "bench.gpu_check", *args, "--out", str(tmp_path)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result == json.loads((tmp_path / "result.json").read_text())
    st = result["state_transfer"]
    assert st["on_device"]["round_trip_bitwise_equal"] and st["on_device"]["checksum_repeatable"]
    sr = st["send_recv"]
    assert sr["backend"] == "gloo" and sr["checksum_verified"] and sr["bitwise_equal"] and sr["raw_equal"]
    assert sr["send_recv_state"]["repeats"] == 2 and sr["send_recv_state"]["median_gbps"] > 0
    rec = result["nccl_recovery"]
    assert rec["decisions"].count("replace") == 1 and rec["final_generation"] == 2, rec
    assert rec["weights_bitwise_equal"], rec
    assert 0 < rec["downtime_s"] < 30 and rec["resumed_at_step"] <= 4, rec
