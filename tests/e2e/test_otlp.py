"""OTLP export end to end: with only the standard ``OTEL_EXPORTER_OTLP_ENDPOINT``
set, every process of a real job (services, the ``phalanx run`` launcher, every
rank) sends its spans over OTLP/HTTP protobuf to a receiver on loopback, and each
incident arrives there as one trace holding the detector's, the planner's and
every new member's phases. Checked on what the receiver decoded, nothing else."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from examples.train_gpt import command as train_command
from phalanx.devstack.jobwatch import JobResult
from phalanx.devstack.localstack import LocalStack
from phalanx.tracesummary import PHASES
from tests.e2e.conftest import SMALL_GPT, STEPS, stack_env
from tests.otlp_receiver import OtlpReceiver, ReceivedSpan

pytestmark = pytest.mark.slow

RANK_PHASES = {"comm_init", "state_transfer", "data_restore", "first_step"}


def required(result: JobResult, incident: str) -> list[str]:
    """The members of the generation ``incident`` led to whose spans must arrive: all
    but one SIGKILLed later (spans still in its exporter's batch die with it)."""
    plan = next(p for p in result.plans if p.incident == incident)
    killed = {w for p in result.plans for w in p.removed}
    return [m.worker for m in plan.members if m.worker not in killed]


def _wait_for_traces(rx: OtlpReceiver, result: JobResult, timeout_s: float = 60.0) -> list[ReceivedSpan]:
    """The spans once every required member's first_step of every incident has arrived
    (exporters batch and flush on their own schedule)."""
    deadline = time.monotonic() + timeout_s
    want = {(f.incident, w) for f in result.faults for w in required(result, f.incident)}
    while True:
        spans = rx.spans()
        have = {
            (s.attributes.get("phalanx.incident"), s.attributes.get("phalanx.worker"))
            for s in spans
            if s.name == "first_step"
        }
        if want <= have or time.monotonic() > deadline:
            return spans
        time.sleep(0.2)


def test_every_process_exports_each_incident_as_one_trace(
    corpus: Path, tmp_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    env = {
        **stack_env(tmp_path_factory),
        "OTEL_EXPORTER_OTLP_COMPRESSION": "gzip",
        "PHALANX_SPAN_FILE": str(tmp_path / "spans.jsonl"),  # must stay empty: OTLP replaces it
    }
    with OtlpReceiver() as rx:
        env["OTEL_EXPORTER_OTLP_ENDPOINT"] = rx.endpoint
        with LocalStack(
            tmp_path / "stack", services=("failure-detector", "elasticity-planner"), env=env
        ) as stack:
            cmd = train_command(STEPS, corpus, *SMALL_GPT, save=tmp_path / "w.pt")
            result = stack.run_nodes(
                "otlp",
                cmd,
                nodes={"local": (3, 2)},
                global_batch=12,
                faults="kill:w1@step=5,kill:w2@step=10",
                timeout_s=240.0,
            )
            assert result.returncode == 0, result.decisions
            spans = _wait_for_traces(rx, result)
    assert rx.rejected == 0 and rx.gzipped == rx.requests > 0
    assert not (tmp_path / "spans.jsonl").exists()

    services = {s.service for s in spans}
    assert {"failure-detector", "elasticity-planner", "phalanx-launcher", "phalanx-rank"} <= services, (
        services
    )
    incidents = [f.incident for f in result.faults]
    assert len(incidents) == 2, result.faults
    for incident in incidents:
        mine = [s for s in spans if s.attributes.get("phalanx.incident") == incident]
        traces = {s.trace_id for s in mine}
        assert len(traces) == 1, (incident, traces)
        [trace] = traces
        in_trace = [s for s in spans if s.trace_id == trace]
        by_service = {s.service for s in in_trace}
        assert {"failure-detector", "elasticity-planner", "phalanx-rank"} <= by_service, by_service
        names = {s.name.split(" ")[0] for s in in_trace}
        assert set(PHASES) - {"abort"} <= names, names
        workers = required(result, incident)
        for w in workers:
            phases = {s.name for s in in_trace if s.attributes.get("phalanx.worker") == w}
            assert RANK_PHASES <= phases, (incident, w, phases)
        # each of those ranks from its own process
        ranks = {s.instance for s in in_trace if s.name == "first_step" and s.service == "phalanx-rank"}
        assert len(ranks) >= len(workers) >= 2
        [detect] = [s for s in in_trace if s.name == "detect"]
        assert detect.service == "failure-detector" and detect.parent_id == ""  # the incident's root
    # the last incident's generation: every member, none of them killed later
    last = next(p for p in result.plans if p.incident == incidents[-1])
    assert required(result, incidents[-1]) == [m.worker for m in last.members]
