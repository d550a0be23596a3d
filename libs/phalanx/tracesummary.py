"""``phalanx trace summary``: the phase table of one recovery incident.

Reads spans from the JSON-lines span file (the default exporter) or from
Jaeger's query API (``--jaeger http://host:16686``), finds the incident's trace
(the latest one with a ``detect`` span, or ``--trace ID``) and prints, per
phase, when it started and ended relative to the fault and how long it took
(over all ranks: the earliest start and the latest end).

    phase            start_ms    end_ms   dur_ms  spans
    detect               0.0      21.4     21.4      1
    plan                21.9      24.0      2.1      1
    ...
    downtime (fault -> first step done): 412.7 ms
"""

from __future__ import annotations

import json
import sys
import urllib.request
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

PHASES = ("detect", "plan", "notify", "abort", "comm_init", "state_transfer", "data_restore", "first_step")
RESIZE_PHASES = (
    "signal",
    "plan",
    "notify",
    "abort",
    "comm_init",
    "state_transfer",
    "data_restore",
    "first_step",
)
"""A planned resize (grow, shrink, preemption) has no ``detect``: its trace begins
with the scheduler's ``signal ...`` span when a signal led to it, else with ``plan``."""


@dataclass(frozen=True)
class SpanRecord:
    trace_id: str
    name: str
    start_ns: int
    end_ns: int
    service: str
    attributes: dict[str, Any]


@dataclass(frozen=True)
class PhaseRow:
    phase: str
    start_ms: float
    end_ms: float
    dur_ms: float
    spans: int


@dataclass(frozen=True)
class Incident:
    trace_id: str
    fault_ns: int
    attributes: dict[str, Any]
    rows: list[PhaseRow]
    downtime_ms: float | None
    resize: str = ""  # "grow", "shrink", ...: a planned change; "": a fault


def _from_file(path: Path) -> list[SpanRecord]:
    out = []
    if not path.exists():
        raise FileNotFoundError(f"no span file at {path}")
    for line in path.read_text().splitlines():
        try:
            d = json.loads(line)
            out.append(
                SpanRecord(
                    d["trace_id"],
                    d["name"],
                    int(d["start_ns"]),
                    int(d["end_ns"]),
                    d.get("service") or "",
                    d.get("attributes") or {},
                )
            )
        except (ValueError, KeyError, TypeError):
            continue  # a torn line from a process killed mid-write
    return out


def _get_json(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=10) as resp:
        return json.loads(resp.read())


def _from_jaeger(base: str, trace_id: str | None) -> list[SpanRecord]:
    base = base.rstrip("/")
    if trace_id is None:
        found = _get_json(f"{base}/api/traces?service=failure-detector&operation=detect&limit=1")
        if not found.get("data"):
            return []
        trace_id = found["data"][0]["traceID"]
    data = _get_json(f"{base}/api/traces/{trace_id}")["data"]
    out = []
    for t in data:
        procs = t.get("processes", {})
        for s in t["spans"]:
            start = int(s["startTime"]) * 1000
            attrs = {tag["key"]: tag["value"] for tag in s.get("tags", [])}
            svc = procs.get(s.get("processID"), {}).get("serviceName", "")
            out.append(
                SpanRecord(
                    s["traceID"].rjust(32, "0"),
                    s["operationName"],
                    start,
                    start + int(s["duration"]) * 1000,
                    svc,
                    attrs,
                )
            )
    return out


def load_spans(*, spans_file: str | None, jaeger_url: str | None, trace_id: str | None) -> list[SpanRecord]:
    if jaeger_url:
        return _from_jaeger(jaeger_url, trace_id)
    return _from_file(Path(spans_file or ".phalanx/spans.jsonl"))


def _named(spans: list[SpanRecord], phase: str) -> list[SpanRecord]:
    return [s for s in spans if s.name == phase or s.name.startswith(phase + " ")]


def incidents(spans: list[SpanRecord]) -> list[Incident]:
    """Every incident, oldest first: a fault (a trace with a ``detect`` span) or a
    planned resize (a ``plan`` span marked ``phalanx.resize``)."""
    by_trace: dict[str, list[SpanRecord]] = defaultdict(list)
    for s in spans:
        by_trace[s.trace_id].append(s)
    out = []
    for tid, ss in by_trace.items():
        detect = _named(ss, "detect")
        resized = [s for s in ss if s.name == "plan" and s.attributes.get("phalanx.resize")]
        if not detect and not resized:
            continue
        first_spans = detect or _named(ss, "signal") or resized
        fault = min(s.start_ns for s in first_spans)
        rows = []
        for phase in PHASES if detect else RESIZE_PHASES:
            ps = _named(ss, phase)
            if ps:
                start, end = min(s.start_ns for s in ps), max(s.end_ns for s in ps)
                rows.append(
                    PhaseRow(phase, (start - fault) / 1e6, (end - fault) / 1e6, (end - start) / 1e6, len(ps))
                )
        first = _named(ss, "first_step")
        downtime = None
        if first and detect:
            downtime = (max(s.end_ns for s in first) - fault) / 1e6
        elif first:  # a resize: from the ranks leaving their last step to the first at the new size
            left = _named(ss, "abort")
            downtime = (max(s.end_ns for s in first) - min(s.start_ns for s in left or first)) / 1e6
        attrs = (detect or resized)[0].attributes
        out.append(
            Incident(tid, fault, attrs, rows, downtime, "" if detect else str(attrs["phalanx.resize"]))
        )
    return sorted(out, key=lambda i: i.fault_ns)


def format_incident(inc: Incident) -> str:
    a = inc.attributes
    who = (
        f"planned {inc.resize}: {a.get('phalanx.reason', '')}"
        if inc.resize
        else f"worker {a.get('phalanx.worker', '?')} rank {a.get('phalanx.rank', '?')}  cause {a.get('phalanx.cause', '?')}"
    )
    lines = [
        f"trace {inc.trace_id}  incident {a.get('phalanx.incident', '?')}  {who}",
        f"{'phase':<16}{'start_ms':>10}{'end_ms':>10}{'dur_ms':>10}{'spans':>7}",
    ]
    for r in inc.rows:
        lines.append(f"{r.phase:<16}{r.start_ms:>10.1f}{r.end_ms:>10.1f}{r.dur_ms:>10.1f}{r.spans:>7}")
    if inc.downtime_ms is not None and inc.resize:
        lines.append(
            f"pause (ranks leave their last step -> first step at the new size): {inc.downtime_ms:.1f} ms"
        )
    elif inc.downtime_ms is not None:
        lines.append(f"downtime (fault -> first step done): {inc.downtime_ms:.1f} ms")
    else:
        lines.append("no first_step span yet: recovery incomplete or still exporting")
    return "\n".join(lines)


def print_summary(spans: list[SpanRecord], trace_id: str | None = None) -> int:
    incs = incidents(spans)
    if trace_id:
        incs = [i for i in incs if i.trace_id == trace_id]
    if not incs:
        print("no incident found" + (f" with trace {trace_id}" if trace_id else ""), file=sys.stderr)
        return 1
    print(format_incident(incs[-1]))
    return 0
