"""``phalanx report`` end to end: a real job loses a rank, and the picture of its
run is drawn afterwards from what the run left in JetStream and in its traces."""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path

import pytest

from phalanx.bus import Bus
from phalanx.devstack.localstack import LocalStack
from phalanx.report import RunReport, load_run, render
from phalanx.tracesummary import Incident, incidents, load_spans
from tests.e2e.conftest import STEPS, RunJob

pytestmark = pytest.mark.slow

EXAMPLE = Path("/tmp/phalanx-report-example.png")


async def _load(stack: LocalStack, job: str) -> tuple[RunReport, list[Incident]]:
    spans = load_spans(spans_file=str(stack.span_file), jaeger_url=None, trace_id=None)
    bus = await Bus.connect(stack.url, name=f"report-{job}")
    try:
        run = await load_run(bus, job, spans=spans)
    finally:
        await bus.close()
    traced = [i for i in incidents(spans) if str(i.attributes.get("phalanx.incident", "")).startswith(job)]
    return run, traced


def test_report_of_a_run_with_a_crash(run_job: RunJob, stack: LocalStack, tmp_path: Path) -> None:
    result, _ = run_job(nproc=3, spares=1, faults="kill:w1@step=5")
    assert result.returncode == 0, result.decisions
    run, traced = asyncio.run(_load(stack, result.job))

    # The incidents are the traces' incidents: same ids, same new generations.
    assert [i.incident for i in run.incidents] == [f.incident for f in result.faults]
    assert [i.incident for i in run.incidents] == [t.attributes["phalanx.incident"] for t in traced]
    spans = load_spans(spans_file=str(stack.span_file), jaeger_url=None, trace_id=None)
    for inc, t in zip(run.incidents, traced, strict=True):
        first = {
            s.attributes["phalanx.generation"]
            for s in spans
            if s.trace_id == t.trace_id and s.name == "first_step"
        }
        assert first == {inc.generation} == {2}
        assert (inc.kind, inc.action, inc.cause, inc.workers) == ("fault", "replace", "process_exit", ["w1"])
        assert inc.trace_id == t.trace_id and inc.trace_downtime_ms == t.downtime_ms
        # The events' downtime ends when the last rank *reported* its first step: never
        # before the trace's end of first_step (same fault time, the detector's estimate).
        assert inc.downtime_ms is not None and t.downtime_ms is not None
        assert t.downtime_ms <= inc.downtime_ms + 1.0, (t.downtime_ms, inc.downtime_ms)
        assert set(inc.phases_ms) == {r.phase for r in t.rows} >= {"detect", "plan", "first_step"}
    assert [(g.generation, g.world_size) for g in run.generations] == [(1, 3), (2, 3)]

    # Every rank's steps, each with the global batch's loss (all-reduced: the same on every rank).
    by_worker: dict[str, list[int]] = {}
    for r in run.steps:
        by_worker.setdefault(r.worker, []).append(r.step)
        assert r.loss is not None and r.step_ms > 0
    assert by_worker["w0"] == by_worker["w2"] == list(range(1, STEPS + 1))
    joiner = next(r for r in result.recoveries if r.worker == "w3")
    assert by_worker["w3"] == list(range(joiner.step, STEPS + 1))
    assert by_worker["w1"] and max(by_worker["w1"]) < joiner.step  # the victim, until it died
    assert {r.rank for r in run.steps if r.generation == 2} == {0, 1, 2}
    for step in range(1, STEPS + 1):
        losses = {r.loss for r in run.steps if r.step == step}
        assert len(losses) == 1, (step, losses)

    out = tmp_path / "run.png"
    render(run, out)
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    import matplotlib.image

    h, w, _ = matplotlib.image.imread(out).shape
    assert w >= 1000 and h >= 800
    shutil.copy(out, EXAMPLE)
