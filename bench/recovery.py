"""Downtime of a rank failure: Phalanx in-process recovery vs torchrun restart.

    python -m bench.recovery [--trials 10] [--baseline-trials 5] [--nproc 4] [--steps 40]
                             [--quick] [--nodes 3 [--rank-kills 10]] [--loop user]
                             [--parallel hsdp]

Both paths train the same byte-level GPT (examples/gpt.py) on the same corpus,
seed and global batch, with 4 ranks on this machine's CPUs, and lose the same
rank after the same step of each trial. The step varies between trials so that the
fault lands at different points of the baseline's 10-step checkpoint interval.

- Phalanx: ``phalanx run`` (the public CLI) with ``nproc`` ranks + 1 hot spare,
  the real failure-detector and elasticity-planner services on a real
  nats-server. Once rank 0 has logged step k done, the bench SIGKILLs the victim
  rank from outside a fraction f of a step later (f spread evenly over [0, 1)
  across the trials, shuffled: the kill lands in the forward/backward pass, the
  gradient all-reduce or the optimizer step); the fault time is taken just
  before the kill.
- Baseline: ``torchrun --max-restarts 3`` with plain DDP, torch.distributed.checkpoint
  every 10 steps; the rank SIGKILLs itself right after step k; torchrun restarts
  every rank, which reload the last checkpoint (bench/baseline/). It is slow, so
  it runs ``--baseline-trials`` (default min(trials, 5)) of the same fault steps;
  ``restart_trials`` in the JSON says how many.

Downtime = fault -> first training step completed after recovery (the slowest
rank): median, p90 and max over the trials. ``beyond_step_s`` (median, p90, max) is
each trial's downtime less the Phalanx job's median steady step: what a fault costs
beyond the step it redoes, a slow first step after recovery included. Lost steps = completed steps that had
to be computed again. The phase medians and p90s come from the incident traces
(the same spans Jaeger shows); ``verdict_to_plan_ms`` is the gap between the
detector's verdict stored (end of ``detect``) and the planner starting on it
(start of ``plan``), negative when the planner got the event before the detector
got the server's acknowledgement. Steady overhead compares the median step time of
a fault-free Phalanx run with plain DDP on the same model and batch
(bench/baseline/plain_ddp.py), interleaved.

With ``--nodes N`` (N >= 2; needs network namespaces, see phalanx.devstack.netns) it also
measures the loss of a whole node, at least 5 trials each side:

- Phalanx: N namespace nodes, each one ``phalanx run`` with 1 rank + 1 hot spare
  (world N), NATS and the services in a namespace of their own; once rank 0 has
  logged step k, every process of one node (launcher, rank, spare) is SIGKILLed.
  The failure-detector's NodeLost verdict (digests stopped) makes the planner
  give the node's rank to a spare on another node in one generation.
- torchrun: the same N nodes, one agent and 1 worker each, ``--nnodes N-1:N``
  elastic restart from the newest DCP checkpoint (bench/baseline/nodes.py); the
  node hosting torchrun's c10d store cannot be the victim (its loss ends the job).

Neither side loses the node hosting its rendezvous, so both see the same fault.
``node_loss_downtime_s`` is fault -> first step completed after recovery.
With ``--rank-kills R`` as well, the same cluster (1 rank + 1 hot spare per node)
loses one rank instead of a node, R jobs in a row, on the user-loop DDP port
(examples/ddp_phalanx.py), killed from outside at a spread fraction of a step:
``node_rank_kill_downtime_s`` (every trial in ``node_rank_kill_downtimes_s``) and
``node_rank_kill_abort_max_s``, the slowest survivor's abort phase over all trials,
to be read against the collective's 2 s floor (``--node-trials 0`` skips the
node losses).
With ``--loop user`` the same comparison runs on the user's own loop: the
Phalanx side is examples/ddp_phalanx.py (DDP, DataLoader, AdamW, a one-cycle
schedule, gradient clipping; ``phalanx.runtime.loop``), the reference its plain
torchrun script examples/ddp_plain.py, for the steady step time
(``steady_overhead_pct``: the median over five (``--pairs``) interleaved pairs of each pair's
overhead, each pair printed and listed in ``steady_overhead_pairs_pct``;
``steady_overhead_pooled_pct`` pools the step times) and for the restart (torchrun
restarts every worker and the plain script, having no checkpoint, starts over).
On this 2-core machine the ranks share the cores with the nats-server, the
services and the launcher, whose CPU share is reported
(``control_plane_cpu_pct_of_machine``); the pair is also run with heartbeats every
second instead of 100 ms (``steady_overhead_heartbeat_1s_pct``), which leaves the
rank-side cost of the port.

With ``--parallel hsdp`` (default ``ddp``: all of the above) the model is sharded:
the user-loop FSDP2 port examples/fsdp_phalanx.py with ``--replicas 2`` on
``nproc`` (4) ranks, a (2, nproc/2) HSDP mesh, an MLP of ``--model-hidden`` x
``--model-depth`` (2048 x 6: 21 M parameters, ``model_params``). Everything runs
on this machine's 2 CPU cores over gloo, so the figures are those of a
CPU-bound, core-starved host, not of GPUs and NCCL.

- Phalanx: the same fault trials as above (``phalanx run``, 1 hot spare, SIGKILL of
  rank 1..nproc-1 from outside at spread fractions of a step). The spare takes
  the lost rank's mesh position and its shard from the member holding the same
  shard in the other replica group; each trial reports the bytes that joiner
  received (``RecoveryDone.bytes_received``). One shard's state is the
  position's local shard of every parameter and of AdamW's two moments, fp32,
  sharded on dim 0 as FSDP2 does (``torch.chunk``, shard ``rank % (nproc/2)``):
  ``bytes_moved_ratio`` is the median over trials of received / that
  (``bytes_moved_ratio_max`` its max; it is a little above 1: the step counters,
  scheduler, sampler and RNG travel too).
- Steady overhead: the port's fault-free median step time against the plain
  script examples/fsdp_plain.py under torchrun, same arguments, three interleaved
  pairs (one with ``--quick``, in either mode), warmup steps dropped.
- Restart baseline: torchrun ``--max-restarts 1`` of bench/baseline/fsdp_restart.py,
  the plain script plus a DCP checkpoint of model and optimizer every 10 steps,
  loaded on start; one rank is SIGKILLed from outside once rank 0 logged step k, and
  every rank restarts from the newest complete checkpoint.

Prints one JSON line last.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import signal
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from bench.baseline.plain_ddp import measure_step_time
from bench.baseline.run import run_trial
from bench.baseline.torchrun import TorchrunFailed, plain_ddp_args, run_torchrun, torchrun
from examples.corpus import DEFAULT_OUT, build_corpus
from examples.gpt import GPT
from examples.mlp import MLP
from examples.train_gpt import command as train_command
from phalanx.contract import Elastic
from phalanx.devstack.jobwatch import JobResult, last_logged_step
from phalanx.devstack.localstack import LocalStack
from phalanx.devstack.netns import NetnsCluster
from phalanx.tracesummary import PHASES, _from_file, incidents

REPO = Path(__file__).resolve().parents[1]


def fault_steps(trials: int, steps: int, every: int = 10) -> list[int]:
    """Fault steps spread over the checkpoint interval: offsets 3, 9, 6, 1, 8, ..."""
    offsets = [3, 9, 6, 1, 8, 5, 2, 7, 4]
    out = []
    for i in range(trials):
        k = every * (1 + i % max(1, (steps - 5) // every - 1)) + offsets[i % len(offsets)]
        out.append(min(k, steps - 3))
    return out


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    return (
        [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []
    )


def find_process(*env: str) -> int:
    """The pid of the process whose environment holds every ``NAME=value`` of ``env``,
    and whose parent's does not (its children inherit the environment)."""
    want = {e.encode() for e in env}

    def matches(pid: int) -> bool:
        try:
            return want <= set(Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"))
        except OSError:
            return False

    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and matches(int(entry.name)):
            with contextlib.suppress(OSError, ValueError, IndexError):
                ppid = int(Path(f"/proc/{entry.name}/stat").read_text().rsplit(")", 1)[1].split()[1])
                if not matches(ppid):
                    return int(entry.name)
    raise LookupError(f"no process with {' '.join(env)}")


def find_worker(job: str, worker: str) -> int:
    """The pid of ``worker`` of ``job``, as the launcher started it."""
    return find_process(f"PHALANX_JOB={job}", f"PHALANX_WORKER={worker}")


def step_fractions(trials: int, seed: int = 7) -> list[float]:
    """Where in a step each trial's fault lands: evenly spread over [0, 1), shuffled."""
    fracs = [(i + 0.5) / trials for i in range(trials)]
    random.Random(seed).shuffle(fracs)
    return fracs


Command = Callable[[int, Path], list[str]]
"""(steps, steps_log) -> the training command a trial runs."""


def gpt_command(corpus: Path) -> Command:
    return lambda steps, log: train_command(steps, corpus, steps_log=log)


@dataclass(frozen=True)
class UserScripts:
    """A plain torchrun script and its user-loop port to Phalanx, which take the same
    arguments: ``--steps``, ``extra`` (the model's, the mesh's) and ``--steps-log``."""

    plain: str
    port: str
    extra: tuple[str, ...] = ()

    def args(self, steps: int, log: Path) -> list[str]:
        return plain_ddp_args(steps, *self.extra, steps_log=log)

    def command(self, steps: int, log: Path) -> list[str]:
        """The port's command line (a :data:`Command`)."""
        return [sys.executable, "-m", self.port, *self.args(steps, log)]


DDP_SCRIPTS = UserScripts("examples.ddp_plain", "examples.ddp_phalanx")


def hsdp_scripts(replicas: int, hidden: int, depth: int) -> UserScripts:
    """examples/fsdp_plain.py and its port examples/fsdp_phalanx.py on a (replicas, -1) mesh."""
    extra = ("--replicas", str(replicas), "--hidden", str(hidden), "--depth", str(depth))
    return UserScripts("examples.fsdp_plain", "examples.fsdp_phalanx", extra)


def port_command(steps: int, log: Path) -> list[str]:
    """examples/ddp_phalanx.py, the user-loop port of examples/ddp_plain.py."""
    return DDP_SCRIPTS.command(steps, log)


def phalanx_trial(
    stack: LocalStack,
    work: Path,
    i: int,
    *,
    nproc: int,
    steps: int,
    step: int,
    command: Command,
    fraction: float,
    group_size: int = 1,
    nodes: dict[str, tuple[int, int]] | None = None,
) -> dict[str, Any]:
    """One fault, from outside: ``phalanx run`` (the public CLI) trains with ``nproc``
    ranks and a hot spare; once rank 0 has logged step ``step`` done, rank
    ``1 + i % (nproc - 1)`` is SIGKILLed ``fraction`` of a step later (compute,
    all-reduce or optimizer step). The spare that replaces it reports the state bytes
    it received (``bytes_received``). ``group_size``: ``phalanx run --group-size`` (a
    sharded model's ranks per replica group). ``nodes``: one ``phalanx run`` per node,
    ``{node: (ranks, spares)}`` (default: every rank and one spare on ``n0``)."""
    job = f"bench{i}-{int(time.time())}"
    steps_log = work / f"{job}.steps"
    victim: list[str] = []
    cmd = command(steps, steps_log)
    fault: dict[str, float] = {}
    timers: list[threading.Timer] = []

    def strike(pid: int, delay: float) -> None:
        fault["ts"] = time.time()
        os.kill(pid, signal.SIGKILL)
        fault["delay_s"] = delay

    def kill(result: JobResult) -> None:
        lines = [x for x in steps_log.read_text().splitlines() if x.strip().endswith("}")]  # whole lines
        step_s = statistics.median(json.loads(x)["ms"] for x in lines[-3:]) / 1000.0
        delay = fraction * step_s
        rank = 1 + i % (nproc - 1)
        victim.append(next(m.worker for m in result.plans[-1].members if m.rank == rank))
        timers.append(threading.Timer(delay, strike, (find_worker(job, victim[0]), delay)))
        timers[0].start()

    result = stack.run_nodes(
        job,
        cmd,
        nodes=nodes or {"n0": (nproc, 1)},
        steps_log=steps_log,
        actions=[(step, kill)],
        launcher_args=("--group-size", str(group_size)) if group_size > 1 else (),
    )
    for t in timers:
        t.join()
    if result.returncode != 0 or "ts" not in fault or not result.faults:
        raise RuntimeError(f"phalanx trial {job} failed: {[d.reason for d in result.decisions]}")
    fault_ts = fault["ts"]
    gen = max(p.generation for p in result.plans)
    first = [r for r in result.recoveries if r.generation == gen]
    downtime = max(r.ts for r in first) - fault_ts
    start = min(result.plans, key=lambda p: p.generation)
    joiner = next((r for r in first if r.worker not in {m.worker for m in start.members}), None)
    if joiner is None:
        raise RuntimeError(f"phalanx trial {job}: no spare joined generation {gen}")
    log = _read_jsonl(steps_log)
    # Steps done before the fault, against the first step done after recovery (whose
    # count is the recovery's step): lost = done before - (that step - 1).
    before = max((e["step"] for e in log if e.get("ts", 0.0) < fault_ts), default=0)
    resumed = min(r.step for r in first)
    incident = result.faults[0].incident
    inc = None
    for _ in range(20):  # the services export spans every 200 ms
        time.sleep(0.25)
        inc = next(
            (
                x
                for x in incidents(_from_file(stack.span_file))
                if x.attributes.get("phalanx.incident") == incident
            ),
            None,
        )
        if inc is not None and {"plan", "first_step"} <= {r.phase for r in inc.rows}:
            break
    if inc is None:
        raise RuntimeError(f"phalanx trial {job}: no trace of incident {incident}")
    rows = {r.phase: r for r in inc.rows}
    gap = rows["plan"].start_ms - rows["detect"].end_ms if {"plan", "detect"} <= set(rows) else None
    return {
        "downtime_s": round(downtime, 4),
        "lost_steps": max(0, before - (resumed - 1)),
        "fault_step": step,
        "fault_delay_s": round(fault["delay_s"], 4),
        "fault_fraction": round(fraction, 3),
        "victim": victim[0],
        "joiner_rank": joiner.rank,
        "bytes_received": joiner.bytes_received,  # the state the spare got from its peer
        "phases": {p: round(r.dur_ms / 1000.0, 4) for p, r in rows.items()},
        "verdict_to_plan_ms": None if gap is None else round(gap, 1),
        "trace_downtime_s": round((inc.downtime_ms or 0) / 1000.0, 4),
        "detect_ms": round((result.faults[0].detected_at - fault_ts) * 1000.0, 1),
    }


def phalanx_steady(
    stack: LocalStack,
    work: Path,
    *,
    nproc: int,
    steps: int,
    command: Command,
    warmup: int = 3,
    group_size: int = 1,
) -> list[float]:
    """Step times of a fault-free run of ``command`` on the stack, warmup left out."""
    job = f"steady-{int(time.time() * 1000)}"
    steps_log = work / f"{job}.steps"
    cmd = command(steps, steps_log)
    elastic = Elastic(group_size=group_size) if group_size > 1 else None
    result = stack.run_job(job, cmd, nproc=nproc, elastic=elastic)
    if result.returncode != 0:
        raise RuntimeError(f"steady run failed: {result.decisions}")
    return [e["ms"] / 1000.0 for e in _read_jsonl(steps_log)][warmup:]


def plain_steady(
    work: Path, *, nproc: int, steps: int, scripts: UserScripts = DDP_SCRIPTS, warmup: int = 3
) -> list[float]:
    """Step times of the plain script (examples/ddp_plain.py) under torchrun (no Phalanx)."""
    log = work / f"plain-{int(time.time() * 1000)}.steps"
    run_torchrun(nproc, scripts.plain, scripts.args(steps, log), output=log.with_suffix(".out"))
    return [e["ms"] / 1000.0 for e in _read_jsonl(log)][warmup:]


class ControlPlaneCpu:
    """CPU time the control plane takes while a job trains on this machine: the
    nats-server, the services and this process (which hosts the job's launcher)."""

    def __init__(self) -> None:
        self.cpu_s = 0.0
        self.wall_s = 0.0

    @staticmethod
    def _sample() -> float:
        total = 0.0
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            with contextlib.suppress(OSError, ValueError, IndexError):
                cmd = (entry / "cmdline").read_bytes()
                if b"nats-server" in cmd or b"phalanx.services" in cmd or int(entry.name) == os.getpid():
                    fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
                    total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        return total

    @contextlib.contextmanager
    def measure(self) -> Iterator[None]:
        c0, t0 = self._sample(), time.monotonic()
        try:
            yield
        finally:
            self.cpu_s += self._sample() - c0
            self.wall_s += time.monotonic() - t0

    def pct_of_machine(self) -> float:
        return round(100.0 * self.cpu_s / max(self.wall_s, 1e-9) / (os.cpu_count() or 1), 2)


def quiet_control_plane_overhead(work: Path, *, nproc: int, steps: int) -> dict[str, Any]:
    """Steady overhead with heartbeats every second instead of 100 ms (services,
    launcher and ranks alike): what is left is the rank-side cost of the port."""
    plain: list[float] = []
    port: list[float] = []
    env = {"PHALANX_HEARTBEAT_MS": "1000"}
    with LocalStack(work / "quiet", services=("failure-detector", "elasticity-planner"), env=env) as stack:
        for _ in range(2):
            plain += plain_steady(work, nproc=nproc, steps=steps)
            port += phalanx_steady(stack, work, nproc=nproc, steps=steps, command=port_command)
    return {
        "steady_overhead_heartbeat_1s_pct": round(
            (statistics.median(port) / statistics.median(plain) - 1) * 100, 2
        ),
    }


def restart_name(i: int, attempt: int) -> str:
    """The files of restart trial ``i``'s ``attempt`` (a rerun starts from nothing)."""
    return f"restart{i}" if attempt == 0 else f"restart{i}.{attempt}"


def plain_restart_trial(
    work: Path,
    i: int,
    *,
    nproc: int,
    steps: int,
    step: int,
    attempt: int = 0,
    module: str = "examples.ddp_plain",
    args: tuple[str, ...] = (),
) -> dict[str, Any]:
    """The plain script's answer to the same fault: torchrun ``--max-restarts 1``
    restarts every worker; a script without checkpoints (examples/ddp_plain.py) starts
    over from step 0, bench/baseline/fsdp_restart.py from its newest checkpoint.
    Rank ``1 + i % (nproc - 1)`` is SIGKILLed from outside once rank 0 logged ``step``."""
    name = restart_name(i, attempt)
    log, out = work / f"{name}.steps", work / f"{name}.out"
    proc = torchrun(nproc, module, plain_ddp_args(steps, *args, steps_log=log), output=out, max_restarts=1)
    try:
        deadline = time.monotonic() + 300
        while last_logged_step(log) < step:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"plain run {i} ended before step {step}: {out.read_text()[-2000:]}")
            time.sleep(0.005)
        # torchrun's worker of that rank in its first attempt
        victim = find_process(f"RANK={1 + i % (nproc - 1)}", "TORCHELASTIC_RESTART_COUNT=0")
        fault_ts = time.time()
        os.kill(victim, signal.SIGKILL)
        if proc.wait(600) != 0:
            raise TorchrunFailed(f"plain run {name} failed after the restart: {out.read_text()[-2000:]}")
    finally:
        if proc.poll() is None:
            proc.kill()
    entries = _read_jsonl(log)
    before = max(e["step"] for e in entries if e["ts"] < fault_ts)
    after = [e for e in entries if e["ts"] > fault_ts]
    return {
        "downtime_s": round(after[0]["ts"] - fault_ts, 4),
        "lost_steps": before - (after[0]["step"] - 1),
        "fault_step": step,
    }


def _stats(xs: list[float]) -> dict[str, float]:
    ys = sorted(xs)
    p90 = ys[min(len(ys) - 1, round(0.9 * (len(ys) - 1)))]
    return {"median": round(statistics.median(ys), 4), "p90": round(p90, 4), "max": round(ys[-1], 4)}


def node_loss_trials(work: Path, *, nodes: int, trials: int, steps: int, corpus: Path) -> dict[str, Any]:
    """Phalanx and torchrun losing a whole node, ``trials`` each, in one cluster."""
    from bench.baseline.nodes import run_node_loss_trial

    names = [f"n{i}" for i in range(nodes)]
    ks = [min(steps - 3, 10 + o) for o in (3, 7, 1, 9, 5, 2, 8, 4, 6, 0)]
    px: list[dict[str, Any]] = []
    rs: list[dict[str, Any]] = []
    with NetnsCluster(["ctl", *names]) as cluster:
        with LocalStack(
            work / "mstack", services=("failure-detector", "elasticity-planner"), cluster=cluster
        ) as stack:
            for i in range(trials):
                k = ks[i % len(ks)]
                job, steps_log = f"nodes{i}-{int(time.time())}", work / f"nodes{i}.steps"
                victim: list[str] = []

                def kill(result: JobResult, victim: list[str] = victim, i: int = i) -> None:
                    plan = result.plans[-1]  # plans arrive in generation order
                    keep = {plan.nodes[m.worker] for m in plan.members if m.rank == 0}
                    keep.add(next(n for n in names if plan.store_addr.startswith(cluster.ip(n) + ":")))
                    victim.append(next(n for n in names[1 + i % (nodes - 1) :] + names if n not in keep))
                    cluster.kill_node(victim[0])

                cmd = train_command(steps, corpus, steps_log=steps_log)
                result = stack.run_nodes(
                    job, cmd, nodes={n: (1, 1) for n in names}, steps_log=steps_log, actions=[(k, kill)]
                )
                if result.returncode != 0 or len(result.node_losses) != 1:
                    raise RuntimeError(
                        f"node-loss trial {job} failed: {[d.reason for d in result.decisions]}"
                    )
                gen = max(p.generation for p in result.plans)
                done = max(r.ts for r in result.recoveries if r.generation == gen)
                loss = result.node_losses[0]
                px.append(
                    {
                        "downtime_s": done - result.actions_at[0],
                        "detect_ms": (loss.detected_at - result.actions_at[0]) * 1000.0,
                        "fault_step": k,
                        "victim": victim[0],
                    }
                )
                print(json.dumps({"phalanx_node_trial": i, **px[-1]}), flush=True)
        for i in range(trials):
            r = run_node_loss_trial(
                cluster,
                work / f"torchrun-nodes{i}",
                nodes=names,
                nproc_per_node=1,
                steps=steps,
                kill_node=names[1 + i % (nodes - 1)],
                kill_at_step=ks[i % len(ks)],
                data=corpus,
            )
            rs.append(r)
            print(json.dumps({"torchrun_node_trial": i, "downtime_s": r["downtime_s"]}), flush=True)
    px_down = [t["downtime_s"] for t in px]
    rs_down = [t["downtime_s"] for t in rs]
    return {
        "node_loss_downtime_s": _stats(px_down),
        "node_loss_detect_ms_median": round(statistics.median(t["detect_ms"] for t in px), 1),
        "torchrun_node_loss_downtime_s": _stats(rs_down),
        "torchrun_node_loss_lost_steps": statistics.median(t["lost_steps"] for t in rs),
        "node_loss_downtime_ratio": round(statistics.median(rs_down) / statistics.median(px_down), 2),
        "node_trials": trials,
        "nodes": nodes,
    }


def node_rank_kill_trials(work: Path, *, nodes: int, trials: int, steps: int) -> dict[str, Any]:
    """``trials`` rank kills in a row on ``nodes`` namespace nodes, each one ``phalanx
    run`` with 1 rank + 1 hot spare, the user-loop DDP port (examples/ddp_phalanx.py):
    one rank (never rank 0, whose steps log paces the trial) SIGKILLed from outside at
    a spread fraction of a step. ``abort_s``: the slowest survivor's abort phase (plan
    -> its collective released), against the collective's 2 s floor."""
    names = [f"n{i}" for i in range(nodes)]
    ks, fracs = fault_steps(trials, steps), step_fractions(trials)
    out: list[dict[str, Any]] = []
    with NetnsCluster(["ctl", *names]) as cluster:
        with LocalStack(
            work / "rkstack", services=("failure-detector", "elasticity-planner"), cluster=cluster
        ) as stack:
            for i, (k, frac) in enumerate(zip(ks, fracs, strict=True)):
                t = phalanx_trial(
                    stack,
                    work,
                    100 + i,
                    nproc=nodes,
                    steps=steps,
                    step=k,
                    command=port_command,
                    fraction=frac,
                    nodes={n: (1, 1) for n in names},
                )
                out.append(t)
                print(json.dumps({"node_rank_kill_trial": i, **t}), flush=True)
    aborts = [t["phases"].get("abort", 0.0) for t in out]
    return {
        "node_rank_kill_downtime_s": _stats([t["downtime_s"] for t in out]),
        "node_rank_kill_downtimes_s": [t["downtime_s"] for t in out],
        "node_rank_kill_abort_max_s": round(max(aborts), 4),
        "node_rank_kill_detect_ms_median": round(statistics.median(t["detect_ms"] for t in out), 1),
        "node_rank_kills": trials,
    }


def shard_state_bytes(model: nn.Module, shard: int, shards: int) -> int:
    """One mesh position's state: its shard of every parameter and of AdamW's two
    moments, fp32. FSDP2 shards dim 0 as ``torch.chunk`` does (the last shards may be
    smaller or empty)."""
    elems = 0
    for p in model.parameters():
        pieces = torch.chunk(p.detach(), shards, dim=0)
        elems += pieces[shard].numel() if shard < len(pieces) else 0
    return elems * 4 * 3


@dataclass
class Runs:
    """One comparison's measurements: the Phalanx fault trials (``px``), the restart
    trials (``rs``) and the steady step times of the port and of its plain reference."""

    ks: list[int]
    fracs: list[float]
    px: list[dict[str, Any]] = field(default_factory=list)
    rs: list[dict[str, Any]] = field(default_factory=list)
    port_s: list[float] = field(default_factory=list)
    plain_s: list[float] = field(default_factory=list)
    cpu: ControlPlaneCpu = field(default_factory=ControlPlaneCpu)
    restart_failures: int = 0

    def headline(self) -> dict[str, Any]:
        """The figures every mode prints."""
        px, rs = self.px, self.rs
        down = _stats([t["downtime_s"] for t in px])
        gaps = [t["verdict_to_plan_ms"] for t in px if t["verdict_to_plan_ms"] is not None]
        rs_down = statistics.median(t["downtime_s"] for t in rs) if rs else None
        port_step, plain_step = statistics.median(self.port_s), statistics.median(self.plain_s)
        # What a fault costs beyond the redone step: a first step after recovery that runs
        # slower than a steady one counts against Phalanx.
        beyond = _stats([t["downtime_s"] - port_step for t in px])
        return {
            "phalanx_downtime_s": down["median"],
            "phalanx_downtime_p90_s": down["p90"],
            "phalanx_downtime_max_s": down["max"],
            "beyond_step_s": beyond["median"],
            "beyond_step_p90_s": beyond["p90"],
            "beyond_step_max_s": beyond["max"],
            "restart_downtime_s": None if rs_down is None else round(rs_down, 4),
            "downtime_ratio": None if rs_down is None else round(rs_down / down["median"], 2),
            "phalanx_lost_steps": max(t["lost_steps"] for t in px),
            "restart_lost_steps": statistics.median(t["lost_steps"] for t in rs) if rs else None,
            "restart_runs_failed": self.restart_failures,
            "phases": {p: round(statistics.median(t["phases"].get(p, 0.0) for t in px), 4) for p in PHASES},
            "phases_p90": {p: _stats([t["phases"].get(p, 0.0) for t in px])["p90"] for p in PHASES},
            "verdict_to_plan_ms": _stats(gaps) if gaps else None,
            "phalanx_detect_ms": round(statistics.median(t["detect_ms"] for t in px), 1),
            "steady_overhead_pct": round((port_step / plain_step - 1.0) * 100.0, 2),
            "control_plane_cpu_pct_of_machine": self.cpu.pct_of_machine(),
            "phalanx_step_s": round(port_step, 4),
        }

    def fault_fields(self) -> dict[str, Any]:
        return {
            "fault_steps": self.ks,
            "fault_step_fractions": [round(f, 3) for f in self.fracs],
            "trials": len(self.px),
            "restart_trials": len(self.rs),
        }


def compare(
    work: Path,
    *,
    nproc: int,
    steps: int,
    steady_steps: int,
    trials: int,
    baseline_trials: int,
    command: Command,
    plain: Callable[[], list[float]],
    restart: Callable[[int, int, int], dict[str, Any]],
    pairs: int,
    group_size: int = 1,
) -> Runs:
    """Phalanx against its reference, on one stack: ``pairs`` interleaved steady runs
    (``plain()``'s step times, then the port's, fault-free, so machine noise hits both
    alike), ``trials`` fault trials (``group_size``: see :func:`phalanx_trial`), then ``baseline_trials`` of
    ``restart(i, k, attempt)`` at the same fault steps. Each trial's JSON line is printed as it ends.
    The baseline is torchrun's restart, not what is measured: under load its restarted
    worker has aborted now and then (exit -6), so a trial whose torchrun failed is
    printed, counted (``restart_runs_failed``) and run once more from nothing."""
    runs = Runs(fault_steps(trials, steps), step_fractions(trials))
    with LocalStack(work / "stack", services=("failure-detector", "elasticity-planner")) as stack:
        for _ in range(pairs):
            runs.plain_s += plain()
            with runs.cpu.measure():
                runs.port_s += phalanx_steady(
                    stack, work, nproc=nproc, steps=steady_steps, command=command, group_size=group_size
                )
        for i, (k, frac) in enumerate(zip(runs.ks, runs.fracs, strict=True)):
            runs.px.append(
                phalanx_trial(
                    stack,
                    work,
                    i,
                    nproc=nproc,
                    steps=steps,
                    step=k,
                    command=command,
                    fraction=frac,
                    group_size=group_size,
                )
            )
            print(json.dumps({"phalanx_trial": i, **runs.px[-1]}), flush=True)
    for i, k in enumerate(runs.ks[:baseline_trials]):
        for attempt in range(2):
            try:
                r = restart(i, k, attempt)
                break
            except TorchrunFailed as exc:
                runs.restart_failures += 1
                print(
                    json.dumps({"restart_trial": i, "attempt": attempt, "torchrun_failed": str(exc)[-600:]}),
                    flush=True,
                )
                if attempt == 1:
                    raise
        runs.rs.append(r)
        print(
            json.dumps(
                {"restart_trial": i, **{k2: r[k2] for k2 in ("downtime_s", "lost_steps", "fault_step")}}
            ),
            flush=True,
        )
    return runs


def ddp(args: argparse.Namespace, work: Path, baseline_trials: int) -> dict[str, Any]:
    """The replicated (DDP) comparison: the GPT on the Trainer, or the user-loop port."""
    corpus = REPO / DEFAULT_OUT
    build_corpus(corpus)
    nodes: dict[str, Any] = {}
    if args.nodes:
        if args.node_trials:
            nodes = node_loss_trials(
                work, nodes=args.nodes, trials=args.node_trials, steps=args.node_steps, corpus=corpus
            )
        if args.rank_kills:
            nodes |= node_rank_kill_trials(work, nodes=args.nodes, trials=args.rank_kills, steps=args.steps)
        if args.skip_single:
            return nodes
    user = args.loop == "user"
    quiet: dict[str, Any] = {}
    if user:  # the same pair with the control plane at a tenth of its heartbeat traffic
        quiet = quiet_control_plane_overhead(work, nproc=args.nproc, steps=args.steady_steps)

    plain_runs: list[list[float]] = []  # each steady pair's plain run, in order

    def plain() -> list[float]:
        if user:
            plain_runs.append(plain_steady(work, nproc=args.nproc, steps=args.steady_steps))
            return plain_runs[-1]
        return list(measure_step_time(args.nproc, args.steady_steps, 3, data=corpus)["step_s"][3:])

    def restart(i: int, k: int, attempt: int) -> dict[str, Any]:
        if user:
            return plain_restart_trial(work, i, nproc=args.nproc, steps=args.steps, step=k, attempt=attempt)
        return run_trial(
            work / restart_name(i, attempt),
            nproc=args.nproc,
            steps=args.steps,
            kill_at_step=k,
            kill_rank=1 + i % (args.nproc - 1),
            ckpt_every=10,
            data=corpus,
        )

    runs = compare(
        work,
        nproc=args.nproc,
        steps=args.steps,
        steady_steps=args.steady_steps,
        trials=args.trials,
        baseline_trials=baseline_trials,
        command=port_command if user else gpt_command(corpus),
        plain=plain,
        restart=restart,
        pairs=args.pairs or (1 if args.quick else 5 if user else 2),
    )
    pairs = steady_pairs(plain_runs, runs.port_s) if user else {}
    return {
        "loop": args.loop,
        **runs.headline(),
        **pairs,
        **quiet,
        "ddp_step_s": round(statistics.median(runs.plain_s), 4),
        **runs.fault_fields(),
        "nproc": args.nproc,
        "spares": 1,
        "model_params": sum(p.numel() for p in MLP().parameters()) if user else GPT().num_params(),
        "restart_baseline": "torchrun --max-restarts 1, the plain script (no checkpoint: starts over)"
        if user
        else "torchrun --max-restarts 3, plain DDP + DCP checkpoint every 10 steps",
        **nodes,
    }


def steady_pairs(plain_runs: list[list[float]], port_s: list[float]) -> dict[str, Any]:
    """The steady overhead as the median over the interleaved pairs of each pair's
    own (port median / plain median - 1): a pair's two runs share the machine's state
    of the moment, so machine drift between pairs cancels. The port's step times are
    its runs' in order, each as long as its plain twin (both log every step once, the
    same warmup dropped). Each pair is printed as a JSON line."""
    if sum(map(len, plain_runs)) != len(port_s):
        raise RuntimeError(f"{len(port_s)} port step times do not pair with {list(map(len, plain_runs))}")
    overheads, start = [], 0
    for i, plain in enumerate(plain_runs):
        port, start = port_s[start : start + len(plain)], start + len(plain)
        port_step, plain_step = statistics.median(port), statistics.median(plain)
        overheads.append(round((port_step / plain_step - 1.0) * 100.0, 2))
        pair = {"port_step_s": round(port_step, 5), "plain_step_s": round(plain_step, 5)}
        print(json.dumps({"steady_pair": i, **pair, "overhead_pct": overheads[-1]}), flush=True)
    return {
        "steady_overhead_pct": round(statistics.median(overheads), 2),
        "steady_overhead_pairs_pct": overheads,
        "steady_overhead_pooled_pct": round(
            (statistics.median(port_s) / statistics.median(x for r in plain_runs for x in r) - 1.0) * 100.0, 2
        ),
    }


def hsdp(args: argparse.Namespace, work: Path, baseline_trials: int) -> dict[str, Any]:
    """The sharded (FSDP2 HSDP) comparison: the port of examples/fsdp_plain.py on a
    (2, nproc/2) mesh, its bytes moved per recovery, the torchrun + DCP restart."""
    replicas, shards = 2, args.nproc // 2
    scripts = hsdp_scripts(replicas, args.model_hidden, args.model_depth)
    every = 10

    def restart(i: int, k: int, attempt: int) -> dict[str, Any]:
        ckpt = ("--ckpt-dir", str(work / f"{restart_name(i, attempt)}.dcp"), "--ckpt-every", str(every))
        return plain_restart_trial(
            work,
            i,
            nproc=args.nproc,
            steps=args.steps,
            step=k,
            attempt=attempt,
            module="bench.baseline.fsdp_restart",
            args=(*scripts.extra, *ckpt),
        )

    runs = compare(
        work,
        nproc=args.nproc,
        steps=args.steps,
        steady_steps=args.steady_steps,
        trials=args.trials,
        baseline_trials=baseline_trials,
        command=scripts.command,
        plain=lambda: plain_steady(work, nproc=args.nproc, steps=args.steady_steps, scripts=scripts),
        restart=restart,
        pairs=1 if args.quick else 3,
        group_size=shards,  # each replica group: one rank per shard
    )
    with torch.device("meta"):  # shapes only
        model = MLP(hidden=args.model_hidden, depth=args.model_depth)
    shard_bytes = [shard_state_bytes(model, t["joiner_rank"] % shards, shards) for t in runs.px]
    ratios = [t["bytes_received"] / b for t, b in zip(runs.px, shard_bytes, strict=True)]
    return {
        "parallel": "hsdp",
        "loop": "user",
        **runs.headline(),
        "fsdp_step_s": round(statistics.median(runs.plain_s), 4),
        "bytes_moved_ratio": round(statistics.median(ratios), 5),
        "bytes_moved_ratio_max": round(max(ratios), 5),
        "bytes_received_median": int(statistics.median(t["bytes_received"] for t in runs.px)),
        "shard_state_bytes": int(statistics.median(shard_bytes)),
        **runs.fault_fields(),
        "mesh": [replicas, shards],
        "nproc": args.nproc,
        "spares": 1,
        "model_params": sum(p.numel() for p in model.parameters()),
        "model": {"hidden": args.model_hidden, "depth": args.model_depth},
        "restart_baseline": f"torchrun --max-restarts 1, the plain FSDP2 script + DCP checkpoint every {every}"
        " steps (bench/baseline/fsdp_restart.py)",
    }


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if any(
        a == "--loop=unmodified" or (a == "unmodified" and i and argv[i - 1] == "--loop")
        for i, a in enumerate(argv)
    ):
        from bench import unmodified  # its own options: an unmodified torchrun script, restarted

        drop = {
            i
            for i, a in enumerate(argv)
            if a in ("--loop", "--loop=unmodified") or (i and argv[i - 1] == "--loop")
        }
        return unmodified.main([a for i, a in enumerate(argv) if i not in drop])
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trials", type=int, default=10, help="Phalanx fault trials")
    ap.add_argument(
        "--baseline-trials",
        type=int,
        default=None,
        help="torchrun restart trials (default: min(trials, 5); 0 skips the baseline)",
    )
    ap.add_argument("--nproc", type=int, default=4)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--steady-steps", type=int, default=30)
    ap.add_argument("--quick", action="store_true", help="1 trial each, shorter runs")
    ap.add_argument(
        "--pairs",
        type=int,
        default=0,
        help="ddp: interleaved steady pairs (default 5 with --loop user, else 2)",
    )
    ap.add_argument("--nodes", type=int, default=0, help="also lose a whole node of N (namespaces)")
    ap.add_argument("--node-trials", type=int, default=5)
    ap.add_argument("--node-steps", type=int, default=30)
    ap.add_argument("--skip-single", action="store_true", help="with --nodes: only the node-loss part")
    ap.add_argument(
        "--rank-kills",
        type=int,
        default=0,
        help="with --nodes: also kill one rank (not a node) this many times in a row, one job each, "
        "on the user-loop DDP port",
    )
    ap.add_argument(
        "--loop",
        choices=("trainer", "user", "unmodified"),
        default=None,
        help="trainer (default with ddp): the GPT on phalanx's Trainer vs torchrun + DCP restarts; user: "
        "the user-loop port examples/ddp_phalanx.py vs its plain torchrun script examples/ddp_plain.py "
        "(hsdp always runs its user-loop port); unmodified: examples/ddp_torchrun.py unchanged under "
        "phalanx run and torchrun, restarted from its own checkpoint (bench/unmodified.py, its own options)",
    )
    ap.add_argument(
        "--parallel",
        choices=("ddp", "hsdp"),
        default="ddp",
        help="ddp: replicated state (the above); hsdp: the FSDP2 HSDP port examples/fsdp_phalanx.py "
        "on a (2, nproc/2) mesh vs examples/fsdp_plain.py and torchrun + DCP restarts",
    )
    ap.add_argument("--model-hidden", type=int, default=2048, help="hsdp: the MLP's hidden width")
    ap.add_argument("--model-depth", type=int, default=6, help="hsdp: the MLP's hidden layers")
    args = ap.parse_args(argv)
    sharded = args.parallel == "hsdp"
    args.loop = args.loop or ("user" if sharded else "trainer")
    if args.nodes == 1 or args.nodes < 0:
        ap.error("--nodes must be >= 2")
    if args.loop == "user" and args.nodes:
        ap.error("--nodes measures the Trainer path; run it without --loop user")
    if sharded and (args.loop != "user" or args.nodes or args.nproc < 2 or args.nproc % 2):
        ap.error("--parallel hsdp runs its user-loop port on an even --nproc, without --nodes")
    if args.quick:
        args.trials, args.steps, args.steady_steps = 1, 30, 15
    if args.loop == "user" and not sharded:  # an MLP step takes milliseconds, a GPT step a quarter second
        args.steady_steps *= 10
    if args.trials < 1:
        ap.error("--trials must be >= 1")
    baseline_trials = min(args.trials, 5) if args.baseline_trials is None else args.baseline_trials
    with tempfile.TemporaryDirectory(prefix="phalanx-bench-recovery-") as tmp:
        work = Path(tmp)
        out = hsdp(args, work, baseline_trials) if sharded else ddp(args, work, baseline_trials)
    print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
