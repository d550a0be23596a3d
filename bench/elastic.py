"""Elastic training on a capacity trace: Phalanx against torchrun elastic, in one run.

    python -m bench.elastic [--period 20] [--skip-torchrun]

The trace (4 -> 2 -> 3 -> 4 ranks, one size every ``--period`` seconds) is applied
to the same MLP job (bench/elastic_mlp.py; its torchrun twin is
bench/baseline/elastic_worker.py: same data, global batch 48, optimizer):

- Phalanx: two launchers on this machine ("nodes" a and b, two ranks each, no
  spares), NATS and the four services from LocalStack. At ``T``: ``phalanx cluster
  reclaim b --grace 10s`` (b's ranks finish their step and leave); at ``2T`` and
  ``3T``: ``phalanx cluster offer 1 --node b`` (b's launcher forks a worker from its
  fork server, torch already imported; the job grows once it is warm). The global
  batch is held at every size.
- torchrun elastic (bench/baseline/torchrun_elastic.py): one agent per node slot,
  ``--nnodes 2:4``, c10d rendezvous with tuned-down timeouts, a checkpoint every 10
  steps; agents stopped and started on the trace; every change restarts the workers
  from the last checkpoint.

Measured, each for both:

- ``scale_down_pause_s`` / ``scale_up_pause_s``: the last completed step before a
  change -> the first completed step at the new size (rank 0's steps log);
- ``goodput``: from the first completed step to the end of the trace, samples whose
  optimizer step survived / samples the offered capacity could have trained at the
  steady step rate of each size (measured in fixed-size runs of the same system in
  this run: p50, with p90 and max reported);
- ``loss_max_rel_diff`` (Phalanx): the largest relative difference, over every step,
  between the resized run's loss and a fixed 4-rank run's. The job sums its
  gradients in float64 (``Trainer(exact_reduce=True)``, micro-batches of 4): the
  resized run is then bitwise the fixed run, and any difference is a bug. (With
  fp32 sums, the order of additions changes with the size and the difference grows
  with the steps: 3.9e-5 after 3139 steps of this MLP.)

One JSON line last. Everything runs on loopback; no process is left behind.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.baseline import torchrun_elastic as tre
from phalanx.cluster import offer, reclaim
from phalanx.devstack.jobwatch import JobResult
from phalanx.devstack.localstack import LocalStack

G = 48
ELASTIC_ARGS = ["--max-nproc", "4", "--min-nproc", "2", "--cooldown", "0s", "--grace", "10s"]
LAYOUTS = {2: {"a": (2, 0)}, 3: {"a": (2, 0), "b": (1, 0)}, 4: {"a": (2, 0), "b": (2, 0)}}
WARMUP = 20


MLP_ARGS = ["--global-batch", str(G), "--micro-batch", "4", "--exact-reduce"]
"""Micro-batches of 4 (shards of 24, 16, 12: every size cuts the same chunks) summed in
float64: a step's update is bitwise the same at every size, so the loss may not drift."""


def _cmd(steps: int, log: Path) -> list[str]:
    return [
        sys.executable,
        "-m",
        "bench.elastic_mlp",
        "--steps",
        str(steps),
        *MLP_ARGS,
        "--steps-log",
        str(log),
    ]


def _records(log: Path) -> list[tre.StepRecord]:
    """Rank 0's steps log as the baseline's records (a generation is a "round")."""
    out = []
    for line in log.read_text().splitlines() if log.exists() else []:
        e = json.loads(line)
        out.append(
            tre.StepRecord(
                int(e["step"]), float(e["loss"]), int(e["world"]), float(e["ts"]), int(e["generation"])
            )
        )
    return sorted(out, key=lambda r: r.ts)


def _run(
    stack: LocalStack, job: str, layout: dict[str, tuple[int, int]], steps: int, log: Path, **kw: Any
) -> JobResult:
    result = stack.run_nodes(
        job,
        _cmd(steps, log),
        nodes=layout,
        nnodes=str(len(layout)),
        global_batch=G,
        steps_log=log,
        launcher_args=ELASTIC_ARGS,
        timeout_s=900,
        **kw,
    )
    if result.returncode != 0:
        raise RuntimeError(f"{job} failed: {result.node_returncodes}; see {stack.workdir}/logs/{job}")
    return result


def phalanx_steady(stack: LocalStack, work: Path, steps: int) -> dict[int, tre.StepTimes]:
    """Step times of fixed-size Phalanx runs of 2, 3 and 4 ranks (after the warm-up)."""
    out = {}
    for w, layout in LAYOUTS.items():
        log = work / f"steady{w}.jsonl"
        _run(stack, f"steady{w}-{int(time.time())}", layout, steps, log)
        recs = [r for r in _records(log) if r.step >= WARMUP]
        out[w] = tre.summarize_durations(w, tre.step_durations(recs))
    return out


def phalanx_trace(
    stack: LocalStack, work: Path, period: float, steps: int
) -> tuple[tre.ElasticRun, JobResult]:
    """The 4 -> 2 -> 3 -> 4 trace through the local cluster's offers and reclaims."""
    trace, end_s = tre.default_trace(period)
    log = work / "trace.jsonl"
    change_ts: list[float] = []
    start = time.time()

    def at(t: float, what: Any) -> tuple[Any, Any]:
        def act(result: JobResult) -> None:
            change_ts.append(time.time())
            _async(what())

        return (lambda r: time.time() >= start + t, act)

    url = stack.url
    actions = [
        at(period, lambda: reclaim("b", 10.0, url=url)),
        at(2 * period, lambda: offer(1, "b", url=url)),
        at(3 * period, lambda: offer(1, "b", url=url)),
    ]
    result = _run(stack, f"trace-{int(start)}", LAYOUTS[4], steps, log, actions=actions)
    run = tre.ElasticRun(
        trace=trace,
        end_s=end_s,
        start_ts=start,
        end_ts=start + end_s,
        global_batch=G,
        steps=_records(log),
        change_ts=change_ts,
        settings={"layout": "a: 2 ranks, b: 2 ranks, no spares", "launcher": " ".join(ELASTIC_ARGS)},
    )
    return run, result


def _async(coro: Any) -> None:
    """Run a coroutine to its end from inside LocalStack's event loop (its actions are plain calls)."""
    import threading

    box: list[BaseException] = []

    def go() -> None:
        try:
            asyncio.run(coro)
        except BaseException as exc:  # re-raised in the caller's thread
            box.append(exc)

    t = threading.Thread(target=go)
    t.start()
    t.join()
    if box:
        raise box[0]


def loss_max_rel_diff(run: list[tre.StepRecord], fixed: list[tre.StepRecord]) -> tuple[float, int]:
    ref = {r.step: r.loss for r in fixed}
    got = {r.step: r.loss for r in run}
    common = sorted(set(ref) & set(got))
    return max(abs(got[s] - ref[s]) / abs(ref[s]) for s in common), len(common)


def _pauses(run: tre.ElasticRun) -> dict[str, list[float | None]]:
    down = [c.pause_s for c in run.changes if c.world_to < c.world_from]
    up = [c.pause_s for c in run.changes if c.world_to > c.world_from]
    return {
        "down": [None if p is None else round(p, 3) for p in down],
        "up": [None if p is None else round(p, 3) for p in up],
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.elastic", description=__doc__.split("\n\n")[0])
    ap.add_argument("--period", type=float, default=20.0, help="seconds per size of the 4-2-3-4 trace")
    ap.add_argument("--steady-steps", type=int, default=150, help="steps of each fixed-size run")
    ap.add_argument("--skip-torchrun", action="store_true", help="Phalanx only (no baseline)")
    ap.add_argument("--workdir", type=Path, default=None)
    args = ap.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # `timeout`, kill: the stack still stops
    work = args.workdir or Path(tempfile.mkdtemp(prefix="phalanx-bench-elastic-"))
    work.mkdir(parents=True, exist_ok=True)
    with LocalStack(work / "stack") as stack:
        steady = phalanx_steady(stack, work, args.steady_steps)
        rates = tre.rates_from_step_times({w: s.p50 for w, s in steady.items()})
        trace, end_s = tre.default_trace(args.period)
        ideal = int(
            sum(
                (b - a) * rates[w]
                for (a, w), b in zip(trace, [t for t, _ in trace[1:]] + [end_s], strict=True)
            )
        )
        run, result = phalanx_trace(stack, work, args.period, ideal)
        fixed_log = work / "fixed4.jsonl"
        _run(stack, f"fixed4-{int(time.time())}", LAYOUTS[4], max(r.step for r in run.steps) + 1, fixed_log)
    diff, compared = loss_max_rel_diff(run.steps, _records(fixed_log))
    phalanx = tre.report(run, steady)
    pauses = _pauses(run)
    phalanx.update(
        {
            "scale_down_pause_s": pauses["down"],
            "scale_up_pause_s": pauses["up"],
            "loss_max_rel_diff": diff,
            "loss_steps_compared": compared,
            "decisions": [
                f"{d.action.value}: {d.reason}"
                for d in result.decisions
                if d.world_size or d.action.value == "spawn"
            ],
            "comm_errors": len(result.comm_errors),
        }
    )
    out: dict[str, Any] = {"bench": "elastic", "period_s": args.period, "global_batch": G, "phalanx": phalanx}
    if not args.skip_torchrun:
        base_steady = tre.measure_step_times([2, 3, 4], args.steady_steps, warmup=WARMUP, global_batch=G)
        base = tre.run_trace(
            trace, end_s=end_s, steps_cap=1_000_000, global_batch=G, workdir=work / "torchrun"
        )
        baseline = tre.report(base, base_steady)
        bp = _pauses(base)
        baseline.update({"scale_down_pause_s": bp["down"], "scale_up_pause_s": bp["up"]})
        out["torchrun_elastic"] = baseline
        out["goodput_ratio"] = (
            round(phalanx["goodput"] / baseline["goodput"], 3) if baseline["goodput"] else None
        )
    flat = [p for p in pauses["down"] + pauses["up"] if p is not None]
    out.update(
        {
            "scale_down_pause_s": max((p for p in pauses["down"] if p is not None), default=None),
            "scale_up_pause_s": max((p for p in pauses["up"] if p is not None), default=None),
            "pause_p50_s": round(statistics.median(flat), 3) if flat else None,
            "loss_max_rel_diff": diff,
            "goodput": phalanx["goodput"],
            "torchrun_goodput": out.get("torchrun_elastic", {}).get("goodput"),
            "workdir": str(work),
        }
    )
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
