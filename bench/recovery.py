"""Downtime of a rank failure: Phalanx in-process recovery vs torchrun restart.

    python -m bench.recovery [--trials 3] [--nproc 4] [--steps 40] [--quick] [--nodes 3]

Both paths train the same byte-level GPT (examples/gpt.py) on the same corpus,
seed and global batch, with 4 ranks on this machine's CPUs, and lose the same
rank at the same step of each trial. The step varies between trials so that the
fault lands at different points of the baseline's 10-step checkpoint interval.

- Phalanx: ``nproc`` ranks + 1 hot spare under the launcher, with the real
  failure-detector and elasticity-planner services on a real nats-server. The
  rank SIGKILLs itself in the middle of step k (after backward, before the
  all-reduce); the fault time is written just before the kill.
- Baseline: ``torchrun --max-restarts 3`` with plain DDP, torch.distributed.checkpoint
  every 10 steps; the rank SIGKILLs itself right after step k; torchrun restarts
  every rank, which reload the last checkpoint (bench/baseline/).

Downtime = fault -> first training step completed after recovery (the slowest
rank). Lost steps = completed steps that had to be computed again. The phase
medians come from the incident traces (the same spans Jaeger shows). Steady
overhead compares the median step time of a fault-free Phalanx run with plain
DDP on the same model and batch (bench/baseline/plain_ddp.py), interleaved.

With ``--nodes N`` (N >= 2; needs network namespaces, see phalanx.netns) it also
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
Prints one JSON line last.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.baseline.plain_ddp import measure_step_time
from bench.baseline.run import run_trial
from examples.corpus import DEFAULT_OUT, build_corpus
from examples.gpt import GPT
from examples.train_gpt import command as train_command
from phalanx.localstack import JobResult, LocalStack
from phalanx.netns import NetnsCluster
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


def phalanx_trial(
    stack: LocalStack, work: Path, i: int, *, nproc: int, steps: int, step: int, corpus: Path
) -> dict[str, Any]:
    job = f"bench{i}-{int(time.time())}"
    fault_log, steps_log = work / f"{job}.faults", work / f"{job}.steps"
    victim = f"w{1 + i % (nproc - 1)}"
    cmd = train_command(steps, corpus, steps_log=steps_log)
    result = stack.run_job(
        job,
        cmd,
        nproc=nproc,
        spares=1,
        faults=f"kill:{victim}@step={step}",
        env={"PHALANX_FAULT_LOG": str(fault_log)},
    )
    if result.returncode != 0:
        raise RuntimeError(f"phalanx trial {job} failed: {[d.reason for d in result.decisions]}")
    fault_ts = _read_jsonl(fault_log)[0]["ts"]
    gen = max(p.generation for p in result.plans)
    first = [r for r in result.recoveries if r.generation == gen]
    downtime = max(r.ts for r in first) - fault_ts
    log = _read_jsonl(steps_log)
    before = max((e["step"] for e in log if e["generation"] < gen), default=0)
    resumed = min(e["step"] for e in log if e["generation"] == gen)
    time.sleep(0.5)  # the services export spans every 200 ms
    incident = result.faults[0].incident
    inc = next(
        x for x in incidents(_from_file(stack.span_file)) if x.attributes.get("phalanx.incident") == incident
    )
    phases = {r.phase: r.dur_ms / 1000.0 for r in inc.rows}
    return {
        "downtime_s": downtime,
        "lost_steps": max(0, before - (resumed - 1)),
        "fault_step": step,
        "victim": victim,
        "phases": phases,
        "trace_downtime_s": (inc.downtime_ms or 0) / 1000.0,
        "detect_ms": (result.faults[0].detected_at - fault_ts) * 1000.0,
    }


def phalanx_steady(
    stack: LocalStack, work: Path, *, nproc: int, steps: int, corpus: Path, warmup: int = 3
) -> list[float]:
    job = f"steady-{int(time.time() * 1000)}"
    steps_log = work / f"{job}.steps"
    cmd = train_command(steps, corpus, steps_log=steps_log)
    result = stack.run_job(job, cmd, nproc=nproc)
    if result.returncode != 0:
        raise RuntimeError(f"steady run failed: {result.decisions}")
    return [e["ms"] / 1000.0 for e in _read_jsonl(steps_log)][warmup:]


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


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument("--nproc", type=int, default=4)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--steady-steps", type=int, default=30)
    ap.add_argument("--quick", action="store_true", help="1 trial each, shorter runs")
    ap.add_argument("--nodes", type=int, default=0, help="also lose a whole node of N (namespaces)")
    ap.add_argument("--node-trials", type=int, default=5)
    ap.add_argument("--node-steps", type=int, default=30)
    ap.add_argument("--skip-single", action="store_true", help="with --nodes: only the node-loss part")
    args = ap.parse_args(argv)
    if args.nodes == 1 or args.nodes < 0:
        ap.error("--nodes must be >= 2")
    if args.quick:
        args.trials, args.steps, args.steady_steps = 1, 30, 15
    corpus = REPO / DEFAULT_OUT
    build_corpus(corpus)
    work = Path(tempfile.mkdtemp(prefix="phalanx-bench-recovery-"))
    nodes: dict[str, Any] = {}
    if args.nodes:
        nodes = node_loss_trials(
            work, nodes=args.nodes, trials=args.node_trials, steps=args.node_steps, corpus=corpus
        )
        if args.skip_single:
            print(json.dumps(nodes), flush=True)
            return 0
    ks = fault_steps(args.trials, args.steps)
    px: list[dict[str, Any]] = []
    rs: list[dict[str, Any]] = []
    px_steady: list[float] = []
    ddp_steady: list[float] = []
    with LocalStack(work / "stack", services=("failure-detector", "elasticity-planner")) as stack:
        for _ in range(2):  # interleaved, so machine noise hits both alike
            ddp_steady += measure_step_time(args.nproc, args.steady_steps, 3, data=corpus)["step_s"][3:]
            px_steady += phalanx_steady(stack, work, nproc=args.nproc, steps=args.steady_steps, corpus=corpus)
        for i, k in enumerate(ks):
            px.append(
                phalanx_trial(stack, work, i, nproc=args.nproc, steps=args.steps, step=k, corpus=corpus)
            )
            print(json.dumps({"phalanx_trial": i, **px[-1]}), flush=True)
    for i, k in enumerate(ks):
        r = run_trial(
            work / f"restart{i}",
            nproc=args.nproc,
            steps=args.steps,
            kill_at_step=k,
            kill_rank=1 + i % (args.nproc - 1),
            ckpt_every=10,
            data=corpus,
        )
        rs.append(r)
        print(
            json.dumps(
                {"restart_trial": i, **{k2: r[k2] for k2 in ("downtime_s", "lost_steps", "fault_step")}}
            ),
            flush=True,
        )
    px_down = statistics.median(t["downtime_s"] for t in px)
    rs_down = statistics.median(t["downtime_s"] for t in rs)
    px_step, ddp_step = statistics.median(px_steady), statistics.median(ddp_steady)
    out = {
        "phalanx_downtime_s": round(px_down, 4),
        "restart_downtime_s": round(rs_down, 4),
        "downtime_ratio": round(rs_down / px_down, 2),
        "phalanx_lost_steps": max(t["lost_steps"] for t in px),
        "restart_lost_steps": statistics.median(t["lost_steps"] for t in rs),
        "phases": {p: round(statistics.median(t["phases"].get(p, 0.0) for t in px), 4) for p in PHASES},
        "phalanx_detect_ms": round(statistics.median(t["detect_ms"] for t in px), 1),
        "steady_overhead_pct": round((px_step / ddp_step - 1.0) * 100.0, 2),
        "phalanx_step_s": round(px_step, 4),
        "ddp_step_s": round(ddp_step, 4),
        "fault_steps": ks,
        "trials": args.trials,
        "nproc": args.nproc,
        "spares": 1,
        "model_params": GPT().num_params(),
        **nodes,
    }
    print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
