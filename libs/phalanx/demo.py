"""``make demo``: a 4-rank CPU training job that loses ranks and keeps going.

Starts a real nats-server (unless ``NATS_URL`` is set) and the four services,
trains the example byte-level GPT once without faults (the reference), then
again with 2 hot spares while one rank is SIGKILLed and, later, another is
SIGSTOPped (a hang). It prints each fault, its detection, the planner's
decision, every recovery phase (from the incident's trace), the first step
after recovery, and checks that the final weights equal the reference bit for bit.
Logs, spans and the store directory go to ``.phalanx/demo/``.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

import torch

from phalanx.localstack import JobResult, LocalStack
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


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--nproc", type=int, default=4)
    ap.add_argument("--workdir", default=".phalanx/demo")
    ap.add_argument("--faults", default="kill:w2@step=12,stop:w1@step=26")
    args = ap.parse_args(argv)
    from examples.corpus import DEFAULT_OUT, build_corpus
    from examples.train_gpt import command as train_command

    setup_logging("demo", level="WARNING")  # the story goes to stdout, warnings as JSON to stderr
    work = Path(args.workdir)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    corpus = Path(DEFAULT_OUT)
    _say("Phalanx demo: checkpointless recovery of a 4-rank CPU training job")
    build_corpus(corpus)
    _say(f"[setup] corpus {corpus} ({corpus.stat().st_size} bytes)")
    t = time.time()
    with LocalStack(work) as stack:
        _say(
            f"[setup] nats-server {stack.url}; services up and healthy: {', '.join(stack.services)} "
            f"({time.time() - t:.1f} s); logs in {work}/"
        )
        spares = args.faults.count(":")
        _say(f"\n[1/2] fault-free reference: {args.nproc} ranks, {args.steps} steps")
        ref = stack.run_job(
            "demo-ref",
            train_command(args.steps, corpus, save=work / "ref.pt", steps_log=work / "ref.steps"),
            nproc=args.nproc,
        )
        _say(f"      exit {ref.returncode} in {ref.wall_s:.1f} s")
        _say(f"\n[2/2] the same job with {spares} hot spares and faults {args.faults}")
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
    _say(f"trace any incident again with: phalanx trace summary --spans {stack.span_file}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
