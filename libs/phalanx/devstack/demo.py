"""``make demo``: a 4-rank CPU training job that loses ranks and keeps going, then
gives capacity back and takes it again.

Starts a real nats-server (unless ``NATS_URL`` is set) and the four services,
trains the example byte-level GPT once without faults (the reference), then
again with 2 hot spares while one rank is SIGKILLed and, later, another is
SIGSTOPped (a hang). It prints each fault, its detection, the planner's
decision, every recovery phase (from the incident's trace), the first step
after recovery, and checks that the final weights equal the reference bit for bit.

Then elasticity: a job on two launchers ("nodes" a and b, two ranks each, on this
machine) is shrunk and grown through the public CLI while it trains --
``phalanx cluster reclaim b --grace 10s`` (b's ranks finish their step and exit
0), then ``phalanx cluster offer 1 --node b`` twice (b's launcher starts a worker,
the job grows when it is warm) -- and its per-step loss is compared with a
fixed-size run of the same job.

Last, tiered checkpoints: a 2-rank job snapshots every 5 steps; the newest checkpoint
is shown moving through the tiers -- the rank's shared memory, a replica on a second
keeper ("peer"), this node's disk, the shared path -- then listed with ``phalanx ckpt
list``, and the job, relaunched with the same command, resumes from it, restored from
memory. Logs, spans and the store directory go to ``.phalanx/demo/``.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

from phalanx.bus import Bus
from phalanx.contract import Action, CheckpointEvent
from phalanx.contract.subjects import CHECKPOINT
from phalanx.devstack.jobwatch import JobResult
from phalanx.devstack.localstack import LocalStack
from phalanx.telemetry import setup_logging
from phalanx.tracesummary import _from_file, format_incident, incidents

FAULT_NAMES = {"kill": "SIGKILL", "stop": "SIGSTOP (hang)", "stall": "stalled step", "exit": "exit 3"}


def _say(msg: str = "") -> None:
    print(msg, flush=True)


def _report(result: JobResult, fault_log: Path, steps_log: Path, span_file: Path) -> None:
    faults = [json.loads(x) for x in fault_log.read_text().splitlines()] if fault_log.exists() else []
    steps = [json.loads(x) for x in steps_log.read_text().splitlines()] if steps_log.exists() else []
    traces = {i.attributes.get("phalanx.incident"): i for i in incidents(_from_file(span_file))}
    for n, ev in enumerate(result.faults):
        injected = next((f for f in faults if f["worker"] == ev.worker), None)
        t0 = injected["ts"] if injected else ev.fault_at
        _say(f"\n--- incident {n + 1}: {ev.incident} ---")
        if injected:
            _say(
                f"  fault      {ev.worker} got {FAULT_NAMES[injected['action']]} in step {injected['value']}"
            )
        _say(
            f"  detected   {type(ev).__name__} cause={ev.cause.value} rank={ev.rank} generation={ev.generation}"
            f"  {1000 * (ev.detected_at - t0):.1f} ms after the fault"
        )
        _say(f"             evidence: {json.dumps(ev.evidence)}")
        decision = next((d for d in result.decisions if d.incident == ev.incident), None)
        if decision is not None:
            _say(
                f"  decision   {decision.action.value}: {decision.reason}"
                f"  ({1000 * (decision.ts - t0):.1f} ms after the fault)"
            )
        plan = next((p for p in result.plans if p.incident == ev.incident), None)
        if plan is None:
            continue
        members = ", ".join(f"{m.rank}:{m.worker}" for m in plan.members)
        _say(f"  plan       generation {plan.generation}: ranks {members}; fenced {plan.removed}")
        inc = traces.get(ev.incident)
        if inc is not None:
            _say("  phases (from the incident's trace; ms after the fault time the detector inferred):")
            for line in format_incident(inc).splitlines()[1:]:
                _say("    " + line)
        first = sorted((s for s in steps if s["generation"] == plan.generation), key=lambda s: s["step"])
        done = [r for r in result.recoveries if r.generation == plan.generation]
        if first and done:
            _say(
                f"  resumed    step {first[0]['step']} completed by all {len(done)} ranks "
                f"{max(r.ts for r in done) - t0:.3f} s after the fault (no checkpoint read)"
            )


MEMBERSHIP = (Action.START, Action.SHRINK, Action.GROW, Action.REPLACE, Action.SPAWN, Action.STOP)


def _cluster(stack: LocalStack, *args: str) -> None:
    """``phalanx cluster ...``, as an operator types it."""
    _say(f"  $ phalanx cluster {' '.join(args)}")
    done = subprocess.run(
        [sys.executable, "-m", "phalanx.cli", "cluster", *args],
        env={**stack.env, **stack.users.env("admin")},
        capture_output=True,
        text=True,
        timeout=30,
    )
    if done.returncode != 0:
        raise RuntimeError(f"phalanx cluster {' '.join(args)} failed: {done.stderr.strip()}")


def _elastic(stack: LocalStack, corpus: Path, work: Path, steps: int) -> bool:
    """Part 3: reclaim and offers on a two-node job; True when its losses match the fixed run's."""
    from phalanx.examples.train_gpt import SMALL
    from phalanx.examples.train_gpt import command as train_command

    args = ["--max-nproc", "4", "--min-nproc", "2", "--cooldown", "1s"]
    runs: dict[str, list[dict[str, float]]] = {}
    results: dict[str, JobResult] = {}
    for name in ("fixed", "elastic"):
        log = work / f"{name}.steps"
        acts = (
            [
                (10, lambda r: _cluster(stack, "reclaim", "b", "--grace", "10s")),
                (lambda r: r.world_size == 2, lambda r: _cluster(stack, "offer", "1", "--node", "b")),
                (lambda r: r.world_size == 3, lambda r: _cluster(stack, "offer", "1", "--node", "b")),
            ]
            if name == "elastic"
            else []
        )
        results[name] = stack.run_nodes(
            f"demo-{name}",
            train_command(steps, corpus, *SMALL, steps_log=log),
            nodes={"a": (2, 0), "b": (2, 0)},
            global_batch=12,
            steps_log=log,
            actions=acts,
            launcher_args=args,
            timeout_s=300,
        )
        runs[name] = [json.loads(x) for x in log.read_text().splitlines()] if log.exists() else []
    run = results["elastic"]
    for d in run.decisions:
        if d.action in MEMBERSHIP:
            size = f" -> {d.world_size} ranks" if d.world_size else ""
            _say(f"  decision   {d.action.value}{size}: {d.reason}")
    steps_run = runs["elastic"]
    for before, after in itertools.pairwise(steps_run):
        if after["world"] != before["world"]:
            _say(
                f"  resize     {int(before['world'])} -> {int(after['world'])} ranks after step "
                f"{int(before['step'])}: {1000 * (after['ts'] - before['ts']):.0f} ms from its last step to "
                f"the first at the new size (a step takes ~{after['ms']:.0f} ms)"
            )
    left = [e for e in run.exits if e.worker in ("b-w0", "b-w1")]
    _say(
        f"  reclaim    b-w0, b-w1 exited {sorted({str(e.exit_code) for e in left})}; "
        f"failed collectives: {len(run.comm_errors)}"
    )
    ref = {int(s["step"]): s["loss"] for s in runs["fixed"]}
    got = {int(s["step"]): s["loss"] for s in steps_run}
    ok = bool(ref) and ref.keys() == got.keys() and run.returncode == 0
    diff = (
        max((abs(got[k] - ref[k]) / abs(ref[k]) for k in ref), default=float("inf")) if ok else float("inf")
    )
    _say(
        f"  loss       every one of {len(ref)} steps within {diff:.2g} (relative) of the fixed 4-rank run "
        f"(global batch 12 at every size)"
    )
    return ok and diff <= 1e-5


def _tiers_env(work: Path) -> dict[str, str]:
    """The keepers' tiers in the demo: disk and a shared path, one replica."""
    return {
        "PHALANX_CKPT_DISK": str(work / "ckpt-disk"),
        "PHALANX_CKPT_SHARED": str(work / "ckpt-shared"),
        "PHALANX_CKPT_REPLICAS": "1",
    }


async def _watched(stack: LocalStack, job: str, cmd: list[str]) -> tuple[JobResult, list[CheckpointEvent]]:
    """Run ``job`` (2 ranks) to its end, with every CheckpointEvent it causes; waits for
    the newest checkpoint to reach the shared path."""
    bus = await Bus.connect(stack.url, name=f"demo-{job}-events", ensure=False, report_errors=False)
    seen: list[CheckpointEvent] = []

    async def on(event: CheckpointEvent, raw: Any) -> None:
        seen.append(event)

    try:
        await bus.subscribe(CHECKPOINT.format(job=job), on, CheckpointEvent)
        result = await stack.run_job_async(job, cmd, nproc=2, global_batch=12, timeout_s=120)
        taken = [e.step for e in seen if e.tier == "memory" and e.state == "complete"]
        deadline = time.monotonic() + 10
        while taken and time.monotonic() < deadline:
            if any((e.step, e.tier, e.state) == (max(taken), "shared", "complete") for e in seen):
                break
            await asyncio.sleep(0.05)
    finally:
        await bus.close()
    return result, seen


def _tiered(stack: LocalStack, corpus: Path, work: Path) -> bool:
    """Part 4: a checkpoint through the tiers, ``phalanx ckpt list``, and a relaunch
    restored from memory; True when the relaunch resumed right after the checkpoint."""
    from phalanx.examples.train_gpt import SMALL
    from phalanx.examples.train_gpt import command as train_command

    stack.start_keeper("peer", _tiers_env(work))  # another node's keeper: the replica goes there
    job, log = "demo-ckpt", work / "ckpt.steps"
    cmd = train_command(12, corpus, *SMALL, "--checkpoint-every", "5", steps_log=log)
    first, seen = asyncio.run(_watched(stack, job, cmd))
    taken = [e for e in seen if e.tier == "memory" and e.state == "complete"]
    if first.returncode != 0 or not taken:
        _say(f"  the job failed (exit {first.returncode}) or took no checkpoint; see the logs")
        return False
    step = max(e.step for e in taken)
    story = sorted((e for e in seen if e.step == step and e.state == "complete"), key=lambda e: e.ts)
    _say(f"  checkpoint {step} ({story[0].bytes} bytes), as its keepers report it:")
    for e in story:
        what = e.detail or ("the rank's slot, taken" if e.tier == "memory" else "drained")
        _say(f"    +{1000 * (e.ts - story[0].ts):6.1f} ms  {e.tier:<7} complete on {e.node:<6} {what}")
    _say(f"  $ phalanx ckpt list {job}")
    listed = subprocess.run(
        [sys.executable, "-m", "phalanx.cli", "ckpt", "list", job],
        env={**stack.env, **stack.users.env("observer"), "COLUMNS": "100"},
        capture_output=True,
        text=True,
        timeout=30,
    )
    for line in listed.stdout.splitlines()[1:]:  # the table (its title is this line's command)
        _say(f"    {line}")
    before = len(log.read_text().splitlines()) if log.exists() else 0
    stack.wait_ended(job)
    second, seen = asyncio.run(_watched(stack, job, cmd))  # relaunched: nobody holds its state
    served = [e for e in seen if e.state == "served"]
    again = [json.loads(x)["step"] for x in log.read_text().splitlines()[before:]] if log.exists() else []
    if served:
        _say(
            f"  relaunch   rank 0 restored step {served[0].step} {served[0].detail} in "
            f"{1000 * served[0].seconds:.1f} ms; first step trained {min(again, default='-')}, "
            f"exit {second.returncode}"
        )
    return (
        second.returncode == 0
        and bool(served)
        and served[0].detail == "from memory"
        and (min(again, default=-1) == step + 1)
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--nproc", type=int, default=4)
    ap.add_argument("--workdir", default=".phalanx/demo")
    ap.add_argument("--faults", default="kill:w2@step=12,stop:w1@step=26")
    ap.add_argument("--elastic-steps", type=int, default=500, help="steps of the elastic part")
    args = ap.parse_args(argv)
    from phalanx.examples.corpus import DEFAULT_OUT, build_corpus
    from phalanx.examples.train_gpt import command as train_command

    setup_logging("demo", level="WARNING")  # the story goes to stdout, warnings as JSON to stderr
    work = Path(args.workdir)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    corpus = Path(DEFAULT_OUT)
    _say("Phalanx demo: checkpointless recovery and elastic resizing of a 4-rank CPU training job")
    build_corpus(corpus)
    _say(f"[setup] corpus {corpus} ({corpus.stat().st_size} bytes)")
    t = time.time()
    with LocalStack(work, service_env={"state-replication": _tiers_env(work)}) as stack:
        _say(
            f"[setup] nats-server {stack.url}; services up and healthy: {', '.join(stack.services)} "
            f"({time.time() - t:.1f} s); logs in {work}/"
        )
        spares = args.faults.count(":")
        _say(f"\n[1/4] fault-free reference: {args.nproc} ranks, {args.steps} steps")
        ref = stack.run_job(
            "demo-ref",
            train_command(args.steps, corpus, save=work / "ref.pt", steps_log=work / "ref.steps"),
            nproc=args.nproc,
        )
        _say(f"      exit {ref.returncode} in {ref.wall_s:.1f} s")
        _say(f"\n[2/4] the same job with {spares} hot spares and faults {args.faults}")
        run = stack.run_job(
            "demo-faults",
            train_command(args.steps, corpus, save=work / "run.pt", steps_log=work / "run.steps"),
            nproc=args.nproc,
            spares=spares,
            faults=args.faults,
            env={"PHALANX_FAULT_LOG": str(work / "faults.jsonl")},
        )
        _say(
            f"      exit {run.returncode} in {run.wall_s:.1f} s; decisions: "
            f"{[d.action.value for d in run.decisions]}"
        )
        time.sleep(0.5)  # services export spans every 200 ms
        _report(run, work / "faults.jsonl", work / "run.steps", stack.span_file)
        if ref.returncode != 0 or run.returncode != 0:
            _say("\nFAILED: a job did not complete; see the logs")
            return 1
        a, b = torch.load(work / "ref.pt"), torch.load(work / "run.pt")
        same = a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
        _say(
            f"\nfinal check: {len(a)} weight tensors after {args.steps} steps are "
            f"{'bitwise EQUAL to' if same else 'DIFFERENT from'} the fault-free run"
        )
        _say(
            f"\n[3/4] elasticity: nodes a and b, 2 ranks each, {args.elastic_steps} steps; "
            "capacity taken back and offered again through `phalanx cluster`"
        )
        elastic = _elastic(stack, corpus, work, args.elastic_steps)
        _say(
            "\n[4/4] tiered checkpoints: 2 ranks snapshot every 5 steps; a second keeper takes"
            " replicas; the job is relaunched"
        )
        tiered = _tiered(stack, corpus, work)
    _say(f"trace any incident again with: phalanx trace summary --spans {stack.span_file}")
    return 0 if same and elastic and tiered else 1


if __name__ == "__main__":
    sys.exit(main())
