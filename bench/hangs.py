"""Hangs: a stopped, spinning or wedged rank, per rung, found and recovered from.

    python -m bench.hangs [--trials 5] [--rungs ddp,hsdp,unmodified] [--faults F,...]
                          [--baseline-cap 60] [--baseline-trials 1] [--smoke]
                          [--soak-s 600 [--eval-every-s 60] [--eval-s 5]]

Each trial is a real job: ``phalanx run`` (the public CLI) against a real nats-server,
failure-detector and elasticity-planner (``LocalStack``), two hot spares; the fault
strikes once rank 0 has logged step ``k`` (``k`` varies across trials).

Rungs: ``ddp`` is the user-loop port examples/ddp_phalanx.py (``job.ddp``, 3 ranks);
``hsdp`` the FSDP2 port examples/fsdp_phalanx.py on a (2, 2) mesh; ``unmodified``
the torchrun script examples/ddp_torchrun.py unchanged (3 ranks, restart recovery,
its own checkpoint every 5 steps).

Faults:

- ``sigstop``: SIGSTOP of a rank from outside (a frozen process).
- ``spin``: the rank's training thread enters a busy Python loop before its step's
  gradient all-reduce (``PHALANX_FAULTS=spin:...``), its process running and
  heartbeating; its peers wait in the all-reduce.
- ``peer_dies``: the rank SIGKILLs itself before its step's gradient all-reduce, its
  peers blocked in it (``kill:...@step=k``).
- ``first_allreduce``: another rank dies at step 3; in the generation that replaces
  it, the rank hangs inside that generation's first all-reduce (``wedge:...@collective=2``).
- ``job_first_allreduce``: a rank hangs inside the job's very first all-reduce
  (``wedge:...@collective=1``), before any step was timed: its peers' bound there
  is what moving the gradients takes, after a barrier (:mod:`phalanx.runtime.bounds`).
- ``spare_rendezvous``: another rank dies at step 3; the spares hang inside their
  first rendezvous (``wedge:...@rendezvous=2``).
- ``joiner_stall``: another rank dies at step 3; the spare that takes its rank stops
  short of generation 2's rendezvous, heartbeating (``stall:...@recovery=2``).

The unmodified rung runs ``sigstop``, ``peer_dies`` (a SIGKILL from outside),
``spin``, ``first_allreduce`` (its kill from outside at step 3: a restarted rank would
strike again) and ``job_first_allreduce`` (``PHALANX_FAULTS``, struck by its observed
default group, :mod:`phalanx.runtime.scriptgroup`, as an all-reduce starts); its
other cells are listed in ``not_run`` with the reason (:data:`UNMODIFIED`).

Per cell: fault -> the first step completed after recovery (the slowest member's
``RecoveryDone`` of the last generation; the unmodified script's first step of its
last attempt), median, p90 and max over the trials, each trial printed. Per survivor:
the abort, the committed plan (the incident's ``plan`` span end) -> its blocked
collective released (its ``abort`` span start, 0 when its collective had already
failed), pooled over the trials: ``abort_p99_s``. A survivor the plan found computing
its step, in no collective (``phalanx.abort.computing``), has none to release: its
plan -> next collective failed is reported apart, ``computing_p99_s``.

Baseline: the same script's plain torchrun version (examples/ddp_plain.py,
examples/fsdp_plain.py, examples/ddp_torchrun.py) under ``torchrun --max-restarts 3``
with a rank SIGSTOPped at step ``k``: torchrun sees no fault and the job waits for the
script's process-group timeout (30 min by default), so each baseline trial is cut at
``--baseline-cap`` seconds and reported as the cap (``capped``).

With ``--soak-s S`` and the ``ddp`` rung chosen: a fault-free run of it of about S seconds in which
rank 0 evaluates the model for ``--eval-s`` (5) every ``--eval-every-s`` (60) while
the others wait, inside ``job.pause``; its verdicts are false ones
(``soak.false_verdicts``); then two such evaluations without ``job.pause``
(``soak.undeclared``), for what a script that declares nothing gets. With the
``unmodified`` rung chosen, the same for examples/ddp_torchrun.py ``--eval-every``,
which declares nothing (``soak_unmodified``).

The last line is one JSON object: ``cells`` keyed ``"<rung>/<fault>"`` with
``median``, ``p90``, ``max`` (seconds) and every trial, ``abort_p99_s``,
``computing_p99_s``, ``baseline``, ``soak``, ``soak_unmodified``.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.baseline.torchrun import torchrun_command, torchrun_env
from bench.recovery import DDP_SCRIPTS, find_worker, hsdp_scripts
from bench.unmodified import events, rank_pid
from phalanx.devstack.jobwatch import JobResult
from phalanx.devstack.localstack import LocalStack
from phalanx.tracesummary import _from_file

FAULTS = (
    "sigstop",
    "spin",
    "peer_dies",
    "first_allreduce",
    "job_first_allreduce",
    "spare_rendezvous",
    "joiner_stall",
)
OUTSIDE = ("sigstop", "peer_dies")  # faults from outside the process
UNMODIFIED = {
    "spare_rendezvous": "an unmodified script's spare never joins a rendezvous: the launcher starts "
    "a fresh member in its place",
    "joiner_stall": "as spare_rendezvous",
}
"""The unmodified rung's cells that do not run, and why."""
SPARES = 2


@dataclass(frozen=True)
class Rung:
    """One way of running a job: its command and its shape."""

    name: str
    nproc: int
    victim: str
    command: Callable[[int, Path, Path], list[str]]
    """(steps, steps log, work dir) -> the command line."""
    plain: Callable[[int, Path, Path], list[str]]
    """The plain torchrun script's arguments (``-m module ...``)."""
    launcher_args: tuple[str, ...] = ()
    global_batch: int = 48


def _rungs(smoke: bool) -> dict[str, Rung]:
    hsdp = hsdp_scripts(2, 64 if smoke else 256, 2 if smoke else 3)

    def unmodified(steps: int, log: Path, work: Path) -> list[str]:
        return [
            "-m", "examples.ddp_torchrun", "--steps", str(steps), "--ckpt", str(work / f"{log.stem}.ckpt"),
            "--ckpt-every", "5", "--hidden", "128", "--depth", "2", "--samples", "2048", "--events", str(log),
        ]  # fmt: skip

    return {
        "ddp": Rung(
            "ddp",
            3,
            "w1",
            lambda steps, log, work: ["-m", DDP_SCRIPTS.port, *DDP_SCRIPTS.args(steps, log)],
            lambda steps, log, work: ["-m", DDP_SCRIPTS.plain, *DDP_SCRIPTS.args(steps, log)],
            global_batch=32 * 3,
        ),
        "hsdp": Rung(
            "hsdp",
            4,
            "w2",
            lambda steps, log, work: ["-m", hsdp.port, *hsdp.args(steps, log)],
            lambda steps, log, work: ["-m", hsdp.plain, *hsdp.args(steps, log)],
            launcher_args=("--group-size", "2"),
            global_batch=16 * 4,
        ),
        "unmodified": Rung(
            "unmodified",
            3,
            "w1",
            unmodified,
            unmodified,
            launcher_args=("--recovery", "restart"),
            global_batch=96,
        ),
    }


def _stats(xs: list[float]) -> dict[str, float]:
    s = sorted(xs)
    return {
        "median": round(statistics.median(s), 4),
        "p90": round(s[min(len(s) - 1, int(0.9 * len(s)))], 4),
        "max": round(s[-1], 4),
    }


def _p99(xs: list[float]) -> float | None:
    if not xs:
        return None
    s = sorted(xs)
    return round(s[min(len(s) - 1, int(0.99 * len(s)))], 4)


def _outside(rung: Rung, fault: str) -> tuple[int, signal.Signals] | None:
    """(step, signal) of a fault struck from outside (SIGSTOP, SIGKILL) at rank 0's
    step, or None. An unmodified script's ranks restart in place, and a fault they
    carried would strike again in the restarted process: its kills come from outside."""
    if fault == "sigstop":
        return 0, signal.SIGSTOP
    if rung.name == "unmodified" and fault == "peer_dies":
        return 0, signal.SIGKILL
    if rung.name == "unmodified" and fault == "first_allreduce":
        return 3, signal.SIGKILL
    return None


def _faults_spec(rung: Rung, fault: str, k: int) -> str:
    other = "w0" if rung.victim != "w0" else "w1"
    spares = [f"w{rung.nproc + i}" for i in range(SPARES)]
    if rung.name == "unmodified" and fault in ("peer_dies", "first_allreduce"):  # (the kill: _outside)
        return f"wedge:{other}@collective=2" if fault == "first_allreduce" else ""
    return {
        "sigstop": "",
        "spin": f"spin:{rung.victim}@step={k}",
        "peer_dies": f"kill:{rung.victim}@step={k}",
        "first_allreduce": f"kill:{rung.victim}@step=3,wedge:{other}@collective=2",
        "job_first_allreduce": f"wedge:{rung.victim}@collective=1",
        "spare_rendezvous": f"kill:{rung.victim}@step=3,"
        + ",".join(f"wedge:{s}@rendezvous=2" for s in spares),
        "joiner_stall": f"kill:{rung.victim}@step=3," + ",".join(f"stall:{s}@recovery=2" for s in spares),
    }[fault]


def _release_times(stack: LocalStack, incidents: set[str]) -> tuple[list[float], list[float]]:
    """Per survivor of each incident: its plan committed -> its collective released (0
    when it had failed already); apart, for the survivors the plan found computing,
    plan -> their next collective failed. From the incident's spans."""
    spans = _from_file(stack.span_file)
    traces = {s.trace_id for s in spans if s.attributes.get("phalanx.incident") in incidents}
    blocked: list[float] = []
    computing: list[float] = []
    for tid in traces:
        ss = [s for s in spans if s.trace_id == tid]
        plans = [s.end_ns for s in ss if s.name == "plan"]
        if not plans:
            continue
        committed = min(plans)
        for s in ss:
            if s.name == "abort":
                lag = max(0.0, (s.start_ns - committed) / 1e9)
                (computing if s.attributes.get("phalanx.abort.computing") else blocked).append(lag)
    return blocked, computing


def phalanx_trial(
    stack: LocalStack, work: Path, rung: Rung, fault: str, i: int, k: int, steps: int
) -> dict[str, Any]:
    job = f"h{rung.name[:3]}{fault[:4]}{i}-{int(time.time()) % 100000}"
    log = work / f"{job}.steps"
    fault_log = work / f"{job}.faults"
    struck: list[float] = []

    outside = _outside(rung, fault)

    def stop(_: JobResult) -> None:
        if rung.name == "unmodified":
            pid = rank_pid(log, int(rung.victim[1:]))
        else:
            pid = find_worker(job, rung.victim)
        struck.append(time.time())
        assert outside is not None
        os.kill(pid, outside[1])

    spec = _faults_spec(rung, fault, k)
    result = stack.run_nodes(
        job,
        [sys.executable, *rung.command(steps, log, work)],
        nodes={"n0": (rung.nproc, SPARES)},
        steps_log=log,
        actions=[(outside[0] or k, stop)] if outside else [],
        faults=spec,
        env={"PHALANX_FAULT_LOG": str(fault_log)},
        launcher_args=rung.launcher_args,
        global_batch=rung.global_batch,
        timeout_s=240,
    )
    if spec:
        lines = [json.loads(x) for x in fault_log.read_text().splitlines()] if fault_log.exists() else []
        hangs = [x["ts"] for x in lines if x["action"] != "kill" or fault == "peer_dies"]
        struck = hangs[:1]
    if result.returncode != 0 or not struck:
        raise RuntimeError(f"{job}: exit {result.node_returncodes}, {[d.reason for d in result.decisions]}")
    t0 = struck[0]
    if rung.name == "unmodified":
        last = max(e.get("attempt", 0) for e in events(log))
        first = min(e["ts"] for e in events(log) if e["event"] == "step" and e.get("attempt", 0) == last)
        releases: list[float] = []
        computing: list[float] = []
    else:
        gen = max(p.generation for p in result.plans)
        first = max(r.ts for r in result.recoveries if r.generation == gen)
        time.sleep(0.6)  # the services export their spans every 200 ms
        releases, computing = _release_times(stack, {f.incident for f in result.faults})
    verdicts = [(f.cause.value, f.worker) for f in result.faults]
    return {
        "downtime_s": round(first - t0, 4),
        "fault_step": k,
        "verdicts": verdicts,
        "decisions": [d.action.value for d in result.decisions],
        "release_s": [round(x, 4) for x in releases],
        "computing_s": [round(x, 4) for x in computing],
    }


def _soak_job(
    stack: LocalStack, work: Path, rung: Rung, name: str, steps: int, extra: list[str], *, timeout_s: float
) -> tuple[JobResult, float, Path]:
    """One fault-free soak job of ``rung`` (its steps log ``soak-<name>.steps``): its
    result, how long it took, and the log."""
    job, log = f"soak{name.replace('-', '')}-{int(time.time()) % 100000}", work / f"soak-{name}.steps"
    t0 = time.time()
    result = stack.run_nodes(
        job,
        [sys.executable, *rung.command(steps, log, work), *extra],
        nodes={"n0": (rung.nproc, SPARES)},
        steps_log=log,
        launcher_args=rung.launcher_args,
        global_batch=rung.global_batch,
        timeout_s=timeout_s,
    )
    return result, time.time() - t0, log


def soak_unmodified(
    stack: LocalStack,
    work: Path,
    rung: Rung,
    *,
    seconds: float,
    every_s: float,
    eval_s: float,
    step_s: float | None = None,
) -> dict[str, Any]:
    """The unmodified rung's soak: examples/ddp_torchrun.py fault-free for about
    ``seconds``, rank 0 evaluating alone for ``eval_s`` every ``every_s`` (``--eval-every``)
    while the others wait in the next step's all-reduce. The script declares nothing (it
    cannot): its rank is told from a hung one by moving (:mod:`phalanx.worker.stillness`),
    so every verdict is a false one. The interval in steps comes from a calibration run,
    or from ``step_s`` when given (the smoke run's)."""

    def run(name: str, steps: int, extra: list[str]) -> tuple[JobResult, float, Path]:
        return _soak_job(stack, work, rung, f"un-{name}", steps, extra, timeout_s=3 * seconds + 300)

    step_s = step_s or 0.0
    if not step_s:
        cal, _, log = run("cal", 200, [])
        if cal.returncode != 0 or cal.faults:
            raise RuntimeError(f"unmodified soak calibration failed: {[d.reason for d in cal.decisions]}")
        ts = [e["ts"] for e in events(log) if e["event"] == "step"][50:]
        step_s = statistics.median(b - a for a, b in itertools.pairwise(ts))
    every = max(1, round(every_s / step_s))
    steps = max(every, round(seconds / step_s))
    result, took, _ = run("eval", steps, ["--eval-every", str(every), "--eval-s", str(eval_s)])
    out = {
        "step_s": round(step_s, 4),
        "eval_every_steps": every,
        "eval_s": eval_s,
        "seconds": round(took, 1),
        "steps": steps,
        "evaluations": steps // every,
        "verdicts": [(f.cause.value, f.worker) for f in result.faults],
        "decisions": [d.action.value for d in result.decisions],
        "exit": result.returncode,
        "false_verdicts": len(result.faults),
    }
    print(json.dumps({"soak": "unmodified", **out}), flush=True)
    return out


def soak(
    stack: LocalStack, work: Path, rung: Rung, *, seconds: float, every_s: float, eval_s: float
) -> dict[str, Any]:
    """A fault-free run of about ``seconds`` in which rank 0 evaluates for ``eval_s``
    every ``every_s`` while the other ranks wait (examples/ddp_phalanx.py
    ``--eval-every``, inside ``job.pause``): every verdict in it is a false one. Then
    the same evaluation twice without ``job.pause``, for what a script that declares
    nothing gets. The evaluation interval in steps comes from a calibration run's
    step time."""

    def run(name: str, steps: int, extra: list[str]) -> tuple[JobResult, float]:
        result, took, _ = _soak_job(stack, work, rung, name, steps, extra, timeout_s=3 * seconds + 300)
        return result, took

    cal, _ = run("cal", 200, [])
    if cal.returncode != 0 or cal.faults:
        raise RuntimeError(f"soak calibration failed: {[d.reason for d in cal.decisions]}")
    ms = [json.loads(x)["ms"] for x in (work / "soak-cal.steps").read_text().splitlines()[50:]]
    step_s = statistics.median(ms) / 1000.0
    every = max(1, round(every_s / step_s))
    steps = max(every, round(seconds / step_s))
    out: dict[str, Any] = {"step_s": round(step_s, 4), "eval_every_steps": every, "eval_s": eval_s}
    for name, n, flags in (("declared", steps, []), ("undeclared", 2 * every + 2, ["--eval-undeclared"])):
        result, took = run(name, n, ["--eval-every", str(every), "--eval-s", str(eval_s), *flags])
        out[name] = {
            "seconds": round(took, 1),
            "steps": n,
            "evaluations": n // every,
            "verdicts": [(f.cause.value, f.worker) for f in result.faults],
            "decisions": [d.action.value for d in result.decisions],
            "exit": result.returncode,
        }
        print(json.dumps({"soak": name, **out[name]}), flush=True)
    out["false_verdicts"] = len(out["declared"]["verdicts"])
    return out


def torchrun_trial(work: Path, rung: Rung, i: int, k: int, steps: int, cap_s: float) -> dict[str, Any]:
    """The plain script under torchrun, a rank SIGSTOPped at step ``k``: the time to its
    first step after the fault, or the cap."""
    log = work / f"plain-{rung.name}{i}.steps"
    proc = subprocess.Popen(
        torchrun_command(rung.nproc, rung.plain(steps, log, work), max_restarts=3),
        env=torchrun_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    struck: float | None = None
    victim = -1
    try:
        deadline = time.monotonic() + 120
        while proc.poll() is None and struck is None and time.monotonic() < deadline:
            done = [e for e in events(log) if "step" in e]
            if done and max(e["step"] for e in done) >= k:
                victim = _plain_victim(proc.pid, int(rung.victim[1:]))
                struck = time.time()
                os.kill(victim, signal.SIGSTOP)
            time.sleep(0.005)
        if struck is None:
            raise RuntimeError(f"torchrun {rung.name}: never reached step {k}")
        seen = len(events(log))
        while proc.poll() is None and time.time() - struck < cap_s:
            after = [e for e in events(log)[seen:] if "step" in e and e.get("ts", 0) > struck]
            if after:
                return {"downtime_s": round(after[0]["ts"] - struck, 4), "capped": False}
            time.sleep(0.05)
        return {"downtime_s": cap_s, "capped": True, "exit": proc.poll()}
    finally:
        for pid in [*_descendants(proc.pid), *([victim] if struck is not None else [])]:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)  # a stopped process too
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def _descendants(root: int) -> list[int]:
    """Every live process under ``root`` (torchrun starts its workers in sessions of
    their own, so a process group does not reach them)."""
    parent: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parent[int(entry.name)] = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue

    def under(pid: int) -> bool:
        while pid > 1:
            pid = parent.get(pid, 0)
            if pid == root:
                return True
        return False

    return [pid for pid in parent if under(pid)]


def _plain_victim(root: int, rank: int) -> int:
    """The pid of rank ``rank`` among the descendants of torchrun's process ``root``."""
    want = f"RANK={rank}".encode()
    for pid in _descendants(root):
        try:
            if want in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"):
                return pid
        except OSError:
            continue
    raise LookupError(f"no rank {rank} under torchrun's process {root}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trials", type=int, default=5)
    ap.add_argument("--rungs", default="ddp,hsdp,unmodified")
    ap.add_argument("--faults", default=",".join(FAULTS))
    ap.add_argument(
        "--cells",
        default="",
        help="run only these <rung>/<fault> cells (comma-separated) of --rungs x --faults",
    )
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--baseline-trials", type=int, default=1, help="per rung; 0 skips the baseline")
    ap.add_argument("--baseline-cap", type=float, default=60.0, help="seconds a hung torchrun job is given")
    ap.add_argument("--smoke", action="store_true", help="1 trial, small models, short runs (the suite's)")
    ap.add_argument(
        "--soak-s", type=float, default=0.0, help="also a fault-free run this long with evaluation pauses"
    )
    ap.add_argument("--eval-every-s", type=float, default=60.0, help="soak: rank 0 evaluates this often")
    ap.add_argument("--eval-s", type=float, default=5.0, help="soak: for this long, the others waiting")
    args = ap.parse_args(argv)
    rungs = _rungs(args.smoke)
    chosen = [r.strip() for r in args.rungs.split(",") if r.strip()]
    faults = [f.strip() for f in args.faults.split(",") if f.strip()]
    only = {c.strip() for c in args.cells.split(",") if c.strip()}
    bad = [r for r in chosen if r not in rungs] + [f for f in faults if f not in FAULTS]
    bad += sorted(only - {f"{r}/{f}" for r in chosen for f in faults})
    if bad or args.trials < 1:
        ap.error(f"unknown rung, fault or cell {bad}, or --trials < 1")
    if args.smoke:
        args.trials, args.steps = 1, 12
    cells: dict[str, Any] = {}
    not_run: dict[str, str] = {}
    releases: list[float] = []
    computing: list[float] = []
    baseline: dict[str, Any] = {}
    soaked: dict[str, Any] | None = None
    soaked_unmodified: dict[str, Any] | None = None
    with tempfile.TemporaryDirectory(prefix="phalanx-bench-hangs-") as tmp:
        work = Path(tmp)
        with LocalStack(work / "stack", env={"PHALANX_COLLECTIVE_TIMEOUT_S": "120"}) as stack:
            for name in chosen:
                rung = rungs[name]
                for fault in faults:
                    key = f"{name}/{fault}"
                    if only and key not in only:
                        continue
                    if name == "unmodified" and fault in UNMODIFIED:
                        not_run[key] = UNMODIFIED[fault]
                        continue
                    trials = []
                    for i in range(args.trials):
                        k = 5 + (i * 3) % max(1, args.steps - 12)
                        t = phalanx_trial(stack, work, rung, fault, i, k, args.steps)
                        print(json.dumps({"cell": key, "trial": i, **t}), flush=True)
                        trials.append(t)
                        releases += t["release_s"]
                        computing += t["computing_s"]
                    cells[key] = {**_stats([t["downtime_s"] for t in trials]), "trials": trials}
            if args.soak_s > 0 and "ddp" in chosen:
                soaked = soak(
                    stack,
                    work,
                    rungs["ddp"],
                    seconds=args.soak_s,
                    every_s=args.eval_every_s,
                    eval_s=args.eval_s,
                )
            if args.soak_s > 0 and "unmodified" in chosen:
                soaked_unmodified = soak_unmodified(
                    stack,
                    work,
                    rungs["unmodified"],
                    seconds=args.soak_s,
                    every_s=args.eval_every_s,
                    eval_s=args.eval_s,
                    step_s=0.05 if args.smoke else None,
                )
        for name in chosen:
            rung = rungs[name]
            runs = [
                torchrun_trial(work, rung, i, 5 + i, args.steps, args.baseline_cap)
                for i in range(args.baseline_trials)
            ]
            for r in runs:
                print(json.dumps({"baseline": f"{name}/sigstop", **r}), flush=True)
            if runs:
                baseline[f"{name}/sigstop"] = {**_stats([r["downtime_s"] for r in runs]), "runs": runs}
    out = {
        "bench": "hangs",
        "trials": args.trials,
        "cells": cells,
        "abort_p99_s": _p99(releases),
        "abort_survivors": len(releases),
        "computing_p99_s": _p99(computing),
        "computing_survivors": len(computing),
        "not_run": not_run,
        "baseline": {"cap_s": args.baseline_cap, "cells": baseline},
        "soak": soaked,
        "soak_unmodified": soaked_unmodified,
    }
    print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
