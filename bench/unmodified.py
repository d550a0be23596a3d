"""Downtime of an unmodified torchrun script: ``phalanx run`` (restart recovery) vs torchrun.

    python -m bench.recovery --loop unmodified [--trials 5] [--nproc 4] [--steps 120] [--quick]
    python -m bench.unmodified ...                                   (the same)

The script is examples/ddp_torchrun.py as teams run it under torchrun: plain DDP over
a DistributedSampler, AdamW, its own ``torch.save`` checkpoint every ``--ckpt-every``
steps, resumed on start. It never imports Phalanx and runs unchanged on both sides:

- Phalanx: ``phalanx run --nproc-per-node N --spares-per-node 1`` (the public CLI)
  against a real nats-server, failure-detector and elasticity-planner; workers forked
  from the node's fork server (``warm``), and again with ``--no-warm`` (``cold``: plain
  processes, what the fork server saves);
- torchrun: ``torchrun --max-restarts 1`` with a c10d rendezvous.

Each trial SIGKILLs rank 1 from outside once rank 0 has logged step ``k`` (``k``
varies across trials within the checkpoint interval, the same list on every side).
Downtime = the kill -> the first step rank 0 completes in the restarted generation
(wall clock, from the script's own event log): median, p90 and max over the trials,
every trial printed. ``*_to_ready_s``: the kill -> the last new process ready to train
(its ``start`` event: interpreter, imports, rendezvous, DDP, checkpoint loaded).

The ladder (``ladder``; ``--no-ladder`` skips it): the same MLP, the same fault, one
rung up each -- the user-loop port (examples/ddp_phalanx.py: ``job.ddp`` + ``job.steps``,
about ten lines changed) and the Trainer (bench/elastic_mlp.py), both recovering in
process with a hot spare; their downtime is the kill -> the last member's first step
done in the new generation (its ``RecoveryDone``).

Steady overhead: the median step time of a fault-free run under ``phalanx run`` against
the same script under torchrun, in at least 5 interleaved pairs, each pair printed;
the figure is the median of the pairs' overheads. ``warm_process_*``: the memory of a
warm spare (a forked, idle worker that has imported torch): its RSS, and its PSS (the
pages it shares with the fork server counted by share), with the fork server's RSS.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.baseline.torchrun import torchrun_command, torchrun_env
from phalanx.devstack.jobwatch import JobResult
from phalanx.devstack.localstack import LocalStack

SCRIPT = ["-m", "examples.ddp_torchrun"]


def events(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip().endswith("}")]


def last_step(path: Path) -> int:
    return max((e.get("step", 0) for e in events(path)), default=0)


def rank_pid(path: Path, rank: int) -> int:
    return [e for e in events(path) if e["event"] == "start" and e["rank"] == rank][-1]["pid"]


def script(work: Path, name: str, args: argparse.Namespace, steps: int) -> tuple[list[str], Path]:
    log = work / f"{name}.events"
    argv = [*SCRIPT, "--steps", str(steps), "--ckpt", str(work / f"{name}.ckpt"), "--ckpt-every"]
    argv += [
        str(args.ckpt_every),
        "--hidden",
        str(args.hidden),
        "--depth",
        str(args.depth),
        "--events",
        str(log),
    ]
    return argv, log


def downtime(log: Path, fault_ts: float) -> dict[str, float]:
    """Fault -> first step of the restarted generation, and -> its last process ready."""
    ev = events(log)
    after = [e for e in ev if e.get("attempt", 0) > 0]
    first = min(e["ts"] for e in after if e["event"] == "step")
    ready = max(e["ts"] for e in after if e["event"] == "start")
    return {"downtime_s": round(first - fault_ts, 4), "to_ready_s": round(ready - fault_ts, 4)}


def fault_step(i: int, every: int) -> int:
    """Trial ``i``'s fault step: spread over one checkpoint interval (after the first)."""
    return every + 1 + (i * 3) % max(1, every - 1)


def phalanx_run(
    stack: LocalStack,
    work: Path,
    name: str,
    args: argparse.Namespace,
    *,
    steps: int,
    kill_at: int | None = None,
    warm: bool = True,
    probe: Any = None,
) -> tuple[JobResult, Path, float | None]:
    """The script under ``phalanx run``; rank 1 SIGKILLed once step ``kill_at`` is logged."""
    argv, log = script(work, name, args, steps)
    fault: list[float] = []

    def kill(_: JobResult) -> None:
        pid = rank_pid(log, 1)
        fault.append(time.time())
        os.kill(pid, signal.SIGKILL)

    actions = [(kill_at, kill)] if kill_at is not None else []
    if probe is not None:
        actions.append((args.ckpt_every + 2, probe))
    result = stack.run_nodes(
        name,
        [sys.executable, *argv],
        nodes={"n0": (args.nproc, 1)},
        steps_log=log,
        actions=sorted(actions, key=lambda a: a[0]),
        launcher_args=("--recovery", "restart", *(() if warm else ("--no-warm",))),
        global_batch=64,
        timeout_s=300,
    )
    if result.returncode != 0:
        raise RuntimeError(
            f"phalanx run {name} failed: {result.node_returncodes} {[d.reason for d in result.decisions]}"
        )
    return result, log, (fault[0] if fault else None)


def worker_pid(stack: LocalStack, job: str, worker: str) -> int:
    """``worker``'s pid, from its launcher's log (``worker_started``)."""
    for line in reversed((stack.workdir / f"launcher-{job}-n0.log").read_text().splitlines()):
        if line.startswith("{"):
            e = json.loads(line)
            if e.get("event") == "worker_started" and e.get("worker") == worker:
                return int(e["pid"])
    raise LookupError(f"{worker} of {job} never started")


LADDER = {  # rung: its command, a function of (steps, steps log), and its global batch at ``nproc`` ranks
    "user_loop": (
        lambda steps, log: ["-m", "examples.ddp_phalanx", "--steps", str(steps), "--steps-log", log],
        lambda nproc: 32 * nproc,  # examples.mlp's --batch-size 32 per rank, as the torchrun script's
    ),
    "trainer": (
        lambda steps, log: ["-m", "bench.elastic_mlp", "--steps", str(steps), "--steps-log", log],
        lambda nproc: 48,  # bench.elastic_mlp's global batch
    ),
}


def in_process_trial(
    stack: LocalStack, work: Path, rung: str, i: int, args: argparse.Namespace, k: int
) -> float:
    """One rung of the ladder: rank 1's worker SIGKILLed once step ``k`` is logged; the
    downtime to the last member's first step in the new generation."""
    job = f"{rung}{i}"
    log = work / f"{job}.steps"
    fault: list[float] = []

    def kill(_: JobResult) -> None:
        pid = worker_pid(stack, job, "w1")
        fault.append(time.time())
        os.kill(pid, signal.SIGKILL)

    result = stack.run_nodes(
        job,
        [sys.executable, *LADDER[rung][0](args.steps, str(log))],
        nodes={"n0": (args.nproc, 1)},
        steps_log=log,
        actions=[(k, kill)],
        global_batch=LADDER[rung][1](args.nproc),
        timeout_s=300,
    )
    if result.returncode != 0 or not fault:
        raise RuntimeError(f"{job} failed: {[d.reason for d in result.decisions]}")
    gen = max(p.generation for p in result.plans)
    return round(max(r.ts for r in result.recoveries if r.generation == gen) - fault[0], 4)


def torchrun_run(
    work: Path, name: str, args: argparse.Namespace, *, steps: int, kill_at: int | None = None
) -> tuple[Path, float | None]:
    argv, log = script(work, name, args, steps)
    proc = subprocess.Popen(
        torchrun_command(args.nproc, argv, max_restarts=1),
        env=torchrun_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    fault: float | None = None
    deadline = time.monotonic() + 300
    try:
        while proc.poll() is None:
            if kill_at is not None and fault is None and last_step(log) >= kill_at:
                pid = rank_pid(log, 1)
                fault = time.time()
                os.kill(pid, signal.SIGKILL)
            if time.monotonic() > deadline:
                raise RuntimeError(f"torchrun {name} did not end")
            time.sleep(0.005)
    finally:
        if proc.poll() is None:
            proc.kill()
    if proc.wait() != 0:
        raise RuntimeError(f"torchrun {name} failed: exit {proc.returncode}")
    return log, fault


def step_time(log: Path, warmup: int) -> float:
    """Median wall time between rank 0's consecutive steps, ``warmup`` steps left out."""
    ts = [e["ts"] for e in events(log) if e["event"] == "step"][warmup:]
    return statistics.median(b - a for a, b in itertools.pairwise(ts))


def memory_mb(pid: int) -> dict[str, float]:
    """RSS and PSS of ``pid`` (``/proc/<pid>/smaps_rollup``), MiB."""
    out: dict[str, float] = {}
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
        key, _, rest = line.partition(":")
        if key in ("Rss", "Pss"):
            out[key.lower()] = round(int(rest.split()[0]) / 1024, 1)
    return out


def warm_memory(stack: LocalStack, job: str) -> dict[str, float]:
    """The memory of the job's warm spare and of its fork server, read from the launcher's log."""
    lines = (stack.workdir / f"launcher-{job}-n0.log").read_text().splitlines()
    spare = server = None
    for line in lines:
        if not line.startswith("{"):
            continue
        e = json.loads(line)
        if e.get("event") == "worker_started" and e.get("role") == "spare":
            spare = e["pid"]
        elif e.get("event") == "fork_server_ready":
            server = e["pid"]
    if spare is None or server is None:
        raise RuntimeError(f"no warm spare or fork server in the launcher log of {job}")
    s, z = memory_mb(spare), memory_mb(server)
    return {"warm_process_rss_mb": s["rss"], "warm_process_pss_mb": s["pss"], "fork_server_rss_mb": z["rss"]}


def stats(xs: list[float]) -> dict[str, float]:
    ordered = sorted(xs)
    p90 = ordered[min(len(ordered) - 1, round(0.9 * (len(ordered) - 1)))]
    return {"median": round(statistics.median(xs), 4), "p90": round(p90, 4), "max": round(max(xs), 4)}


def say(**fields: Any) -> None:
    print(json.dumps(fields), file=sys.stderr, flush=True)


def run(args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="bench-unmodified-") as tmp:
        work = Path(tmp)
        with LocalStack(work / "stack", services=("failure-detector", "elasticity-planner")) as stack:
            memory: dict[str, float] = {}
            warm: list[dict[str, float]] = []
            cold: list[dict[str, float]] = []
            torchrun: list[dict[str, float]] = []
            for i in range(args.trials):
                k = fault_step(i, args.ckpt_every)
                _, log, fault = phalanx_run(stack, work, f"warm{i}", args, steps=args.steps, kill_at=k)
                assert fault is not None
                warm.append({**downtime(log, fault), "fault_step": k})
                say(side="phalanx_warm", trial=i, **warm[-1])
                tlog, tfault = torchrun_run(work, f"torchrun{i}", args, steps=args.steps, kill_at=k)
                assert tfault is not None
                torchrun.append({**downtime(tlog, tfault), "fault_step": k})
                say(side="torchrun", trial=i, **torchrun[-1])
                if i < args.cold_trials:
                    _, clog, cfault = phalanx_run(
                        stack, work, f"cold{i}", args, steps=args.steps, kill_at=k, warm=False
                    )
                    assert cfault is not None
                    cold.append({**downtime(clog, cfault), "fault_step": k})
                    say(side="phalanx_cold", trial=i, **cold[-1])
            ladder: dict[str, list[float]] = {}
            for rung in LADDER if args.ladder else ():
                for i in range(args.trials):
                    ladder.setdefault(rung, []).append(
                        in_process_trial(stack, work, rung, i, args, fault_step(i, args.ckpt_every))
                    )
                    say(side=rung, trial=i, downtime_s=ladder[rung][-1])
            pairs: list[dict[str, float]] = []
            for i in range(args.pairs):
                job = f"steady{i}"

                def probe(_: JobResult, job: str = job) -> None:
                    if not memory:
                        memory.update(warm_memory(stack, job))

                _, plog, _ = phalanx_run(stack, work, job, args, steps=args.steady_steps, probe=probe)
                tlog, _ = torchrun_run(work, f"tsteady{i}", args, steps=args.steady_steps)
                px, tr = step_time(plog, args.warmup), step_time(tlog, args.warmup)
                pairs.append({"phalanx_step_s": round(px, 5), "torchrun_step_s": round(tr, 5),
                              "overhead_pct": round((px / tr - 1) * 100, 2)})  # fmt: skip
                say(side="steady_pair", pair=i, **pairs[-1])
    w, t = stats([x["downtime_s"] for x in warm]), stats([x["downtime_s"] for x in torchrun])
    c = stats([x["downtime_s"] for x in cold]) if cold else None
    return {
        "loop": "unmodified",
        "phalanx_downtime_s": w["median"],
        "phalanx_downtime_p90_s": w["p90"],
        "phalanx_downtime_max_s": w["max"],
        "phalanx_to_ready_s": stats([x["to_ready_s"] for x in warm])["median"],
        "phalanx_cold_downtime_s": c["median"] if c else None,
        "phalanx_cold_downtime_max_s": c["max"] if c else None,
        "torchrun_downtime_s": t["median"],
        "torchrun_downtime_p90_s": t["p90"],
        "torchrun_downtime_max_s": t["max"],
        "torchrun_to_ready_s": stats([x["to_ready_s"] for x in torchrun])["median"],
        "downtime_ratio": round(w["median"] / t["median"], 3),
        "steady_overhead_pct": round(statistics.median(p["overhead_pct"] for p in pairs), 2),
        "ladder": {
            "unmodified_restart_warm_s": w["median"],
            **{f"{rung}_in_process_s": stats(xs)["median"] for rung, xs in ladder.items()},
            "torchrun_restart_s": t["median"],
        },
        "steady_pairs": pairs,
        **memory,
        "trials": {"phalanx_warm": warm, "phalanx_cold": cold, "torchrun": torchrun, **ladder},
        "nproc": args.nproc,
        "spares": 1,
        "steps": args.steps,
        "ckpt_every": args.ckpt_every,
        "model": {"hidden": args.hidden, "depth": args.depth},
        "baseline": "torchrun --max-restarts 1 (c10d rendezvous) of the same unmodified script",
    }


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trials", type=int, default=5, help="fault trials per side (>= 5 for the figures)")
    ap.add_argument("--cold-trials", type=int, default=3, help="phalanx run --no-warm trials")
    ap.add_argument("--pairs", type=int, default=5, help="interleaved fault-free pairs (steady overhead)")
    ap.add_argument("--nproc", type=int, default=4)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--steady-steps", type=int, default=200)
    ap.add_argument("--warmup", type=int, default=20, help="steps left out of the steady figure")
    ap.add_argument("--ckpt-every", type=int, default=10)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--depth", type=int, default=4)
    ap.add_argument(
        "--ladder",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also the user-loop port and the Trainer on the same MLP and fault",
    )
    ap.add_argument(
        "--quick", action="store_true", help="1 trial each side, 1 pair, short runs (a smoke run)"
    )
    return ap


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.quick:
        args.trials, args.cold_trials, args.pairs = 1, 1, 1
        args.steps, args.steady_steps, args.warmup = 30, 40, 5
    if args.trials < 1 or args.pairs < 1 or args.steps <= 2 * args.ckpt_every + 2:
        parser().error("need --trials >= 1, --pairs >= 1 and --steps > 2 x --ckpt-every + 2")
    print(json.dumps(run(args)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
