"""An unmodified script's default group, observed: its rank's phase from its collectives
and its main thread; results and the backend's name as torch's own gloo group gives."""

from __future__ import annotations

import json
import linecache
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from phalanx.contract import Phase
from phalanx.devstack.natsserver import free_port
from phalanx.runtime.scriptgroup import ScriptActivity
from phalanx.worker.status import RankStatus
from phalanx.worker.stillness import Stillness


def activity_on(
    thread: threading.Thread, quiet: int, still_s: float = 0.2
) -> tuple[ScriptActivity, RankStatus]:
    status = RankStatus(job="j", worker="w0")
    status.enter(Phase.RUNNING)
    return ScriptActivity(status, still_s=still_s, stillness=Stillness(thread, io_root=quiet)), status


def parked(thread: threading.Thread) -> None:
    """Until the thread blocks in ``Event.wait`` (its innermost frame at the lock's
    ``acquire``): started, a thread runs through ``threading``'s bootstrap first, and a
    sample taken there differs from the next one."""
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        frame = sys._current_frames().get(thread.ident or -1)
        if frame is not None and frame.f_code is threading.Condition.wait.__code__:
            if "acquire(" in linecache.getline(frame.f_code.co_filename, frame.f_lineno):
                return
        time.sleep(0.005)
    raise AssertionError("the thread never blocked")


def test_a_still_thread_is_compute_from_where_it_stopped_and_a_collective_is_collective(quiet: int) -> None:
    stop = threading.Event()
    t = threading.Thread(target=stop.wait, daemon=True)
    t.start()
    parked(t)
    act, status = activity_on(t, quiet)
    act.timeout_s = 42.0
    t0 = time.monotonic()
    act.tick(t0)
    act.tick(t0 + 0.1)  # the same stack: its I/O counters read from here
    act.tick(t0 + 0.25)
    assert status.phase is Phase.RUNNING  # not still long enough
    act.tick(t0 + 0.35)
    assert status.phase is Phase.COMPUTE and status.phase_since == t0 + 0.1, "timed from where it stood"
    mib = 2**20
    act.entered(50 * mib)
    assert status.collective_bound_ms == 1_000.0 + 1_000.0, "the inside floor, then 2 x 50 MiB at 100 MiB/s"
    act.entered(100 * mib)  # two in flight (DDP's buckets): the bytes of both
    assert (status.phase, status.op, status.collective_bound_ms) == (Phase.COLLECTIVE, 2, 4_000.0)
    act.tick(t0 + 5)
    assert status.phase is Phase.COLLECTIVE, "never COMPUTE while a collective is in flight"
    act.left(50 * mib)
    assert status.phase is Phase.COLLECTIVE
    act.left(100 * mib)
    assert status.phase is Phase.RUNNING
    act.entered(40_000 * mib)
    assert status.collective_bound_ms == 42_000.0, "never past the script's own timeout"
    act.left(40_000 * mib)
    act.tick(t0 + 5.1)
    assert status.phase is Phase.RUNNING, "the streak starts again after a collective"
    stop.set()


def test_a_thread_that_moves_on_leaves_compute(quiet: int) -> None:
    first, second, end = threading.Event(), threading.Event(), threading.Event()

    def body() -> None:
        first.wait()
        second.set()
        end.wait()  # another line: it moved

    t = threading.Thread(target=body, daemon=True)
    t.start()
    parked(t)
    act, status = activity_on(t, quiet, still_s=0.1)
    t0 = time.monotonic()
    for dt in (0.0, 0.1, 0.25):
        act.tick(t0 + dt)
    assert status.phase is Phase.COMPUTE
    first.set()
    assert second.wait(5)
    act.tick(t0 + 0.3)
    assert status.phase is Phase.RUNNING
    act.tick(t0 + 0.4)
    act.tick(t0 + 0.6)
    assert status.phase is Phase.COMPUTE and status.phase_since == t0 + 0.4
    end.set()


SCRIPT = r"""
import json, os, sys, threading, time
import torch, torch.distributed as dist
observe = sys.argv[1] == "1"
if observe:
    from phalanx.runtime.scriptgroup import observe_default_group
    from phalanx.worker.status import RankStatus
    status = RankStatus(job="j", worker="w")
    observe_default_group(status)
dist.init_process_group(backend="gloo")
rank = dist.get_rank()
torch.manual_seed(0)
model = torch.nn.parallel.DistributedDataParallel(torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Linear(32, 2)))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
g = torch.Generator().manual_seed(rank)
for _ in range(5):
    opt.zero_grad()
    model(torch.randn(4, 8, generator=g)).square().mean().backward()
    opt.step()
seen = {}
if observe:
    ops = status.op
    if rank == 0:  # in the all-reduce while rank 1 is late: COLLECTIVE, counted
        threading.Timer(0.5, lambda: seen.update(phase=status.phase.value, op=status.op)).start()
    else:
        time.sleep(1.0)
t = torch.ones(3)
dist.all_reduce(t)
if observe:
    seen.update(after=status.phase.value, ops=ops)
dist.barrier()
print(json.dumps({"backend": dist.get_backend(), "config": dist.get_backend_config(), "sum": t.tolist(),
                  "weights": [p.detach().double().sum().item() for p in model.parameters()], **seen}))
dist.destroy_process_group()
"""


def start_pair(tmp_path: Path, observe: bool) -> list[subprocess.Popen[bytes]]:
    script = tmp_path / "pair.py"
    script.write_text(SCRIPT)
    port = free_port()
    procs = []
    for rank in range(2):
        env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1"}  # fmt: skip
        procs.append(subprocess.Popen([sys.executable, str(script), "1" if observe else "0"], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE))  # fmt: skip
    return procs


def results(procs: list[subprocess.Popen[bytes]]) -> list[dict[str, Any]]:
    """Each rank's JSON line. torch 2.13's gloo group aborts now and then as it is
    destroyed at the end ("terminate called without an active exception", SIGABRT):
    6 of 30 plain pairs of this script here, with no Phalanx in them (0 of 60 observed
    ones). A rank that printed its line before that is taken; any other end fails."""
    outs = []
    for p in procs:
        out, err = p.communicate(timeout=120)
        text = err.decode()
        lines = out.decode().strip().splitlines()
        torn_down = p.returncode == -6 and "terminate called without an active exception" in text
        assert lines and (p.returncode == 0 or torn_down), (p.returncode, text[-3000:])
        outs.append(json.loads(lines[-1]))
    return outs


def test_the_observed_group_computes_what_torchs_gloo_group_does_and_is_seen(tmp_path: Path) -> None:
    plain_procs, observed_procs = start_pair(tmp_path, False), start_pair(tmp_path, True)  # side by side
    plain, observed = results(plain_procs), results(observed_procs)
    for p, o in zip(plain, observed, strict=True):
        assert o["weights"] == p["weights"] and o["sum"] == p["sum"] == [2.0, 2.0, 2.0]
        assert (o["backend"], o["config"]) == (p["backend"], p["config"]) == ("gloo", "cpu:gloo,cuda:gloo")
    # rank 0 in the all-reduce while rank 1 is late: COLLECTIVE, one more collective counted
    # (no step counter here: DDP's construction and steps are counted too)
    assert observed[0]["phase"] == "collective", observed[0]
    assert observed[0]["op"] == observed[0]["ops"] + 1 and observed[0]["ops"] > 5, observed[0]
    assert observed[0]["after"] == "running", observed[0]
