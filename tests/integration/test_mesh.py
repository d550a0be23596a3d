"""FSDP2 HSDP on Phalanx's mesh (phalanx.runtime.mesh), four real processes over
gloo and a loopback store, no bus: the same training as torchrun's
``init_device_mesh`` bitwise, also when the groups FSDP2 holds are re-pointed at a
new generation mid-run; and a rank that dies mid-step fails its peers' step
without raising into the training code."""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
from pathlib import Path

import torch

from phalanx.runtime.store import host_store

ROOT = Path(__file__).resolve().parents[2]
_runs = itertools.count()


def _run(tmp_path: Path, mode: str, *extra: str) -> list[subprocess.CompletedProcess[str]]:
    prefix = f"mesh-{os.getpid()}-{next(_runs)}"  # also the generations' secret (mesh_worker)
    store = host_store(secrets=(prefix,))
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "tests.workers.mesh_worker",
                "--mode",
                mode,
                "--store",
                f"127.0.0.1:{store.port}",
                "--prefix",
                prefix,
                "--rank",
                str(r),
                "--out",
                str(tmp_path / f"{mode}{r}.out"),
                *extra,
            ],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in range(4)
    ]
    done = []
    try:
        for p in procs:
            out, _ = p.communicate(timeout=120)
            done.append(subprocess.CompletedProcess(p.args, p.returncode, out, ""))
    finally:
        for p in procs:
            p.kill()
    del store
    return done


def _weights(tmp_path: Path, mode: str) -> list[dict[str, torch.Tensor]]:
    return [torch.load(tmp_path / f"{mode}{r}.out") for r in range(4)]


def test_hsdp_on_the_phalanx_mesh_equals_init_device_mesh_bitwise_across_generations(tmp_path: Path) -> None:
    # the model is wrapped before the first generation, as under job.steps(), and the
    # groups FSDP2 holds are re-pointed at a second generation before step 2
    for res in _run(tmp_path, "ref"):
        assert res.returncode == 0, res.stdout[-3000:]
    for res in _run(tmp_path, "phalanx", "--regroup-at", "2"):
        assert res.returncode == 0, res.stdout[-3000:]
    ref, got = _weights(tmp_path, "ref"), _weights(tmp_path, "phalanx")
    assert set(ref[0]) == set(got[0])
    for r in range(4):
        for name, t in ref[r].items():
            assert torch.equal(t, got[r][name]), f"rank {r} {name} differs"


def test_a_rank_dying_mid_step_fails_its_peers_step_without_raising(tmp_path: Path) -> None:
    import json

    results = _run(tmp_path, "phalanx", "--die-at", "2", "--die-rank", "3")
    assert results[3].returncode == 3
    for r in range(3):
        assert results[r].returncode == 0, results[r].stdout[-3000:]
        report = json.loads((tmp_path / f"phalanx{r}.out").read_text())
        # a rank grouped with the dead one fails in step 2; the other (rank 0) finishes
        # step 2 and fails in step 3, when its peers have left
        assert report["raised"] is None and report["step"] in (2, 3), report
