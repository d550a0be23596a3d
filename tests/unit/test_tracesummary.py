"""``phalanx trace summary`` (phalanx.tracesummary): incidents from the JSON-lines span
file and from a recorded Jaeger query API response served on loopback."""

from __future__ import annotations

import json
import threading
import urllib.parse
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from phalanx.tracesummary import (
    PHASES,
    Incident,
    PhaseRow,
    SpanRecord,
    format_incident,
    incidents,
    load_spans,
    print_summary,
)

T0 = 1_700_000_000_000_000_000  # ns; every time below is a whole µs, as Jaeger stores it
TRACE_A = "00a1b2c3d4e5f60718293a4b5c6d7e8f"  # leading zeros: Jaeger drops them
TRACE_B = "f0e1d2c3b4a5968778695a4b3c2d1e0f"
TRACE_STARTUP = "11111111111111111111111111111111"

DETECTOR, PLANNER = "failure-detector", "elasticity-planner"

# (name, service, rank or None, start_ms, end_ms) relative to the incident's fault
INCIDENT_A: list[tuple[str, str, int | None, float, float]] = [
    ("detect", DETECTOR, None, 0.0, 21.4),
    ("plan", PLANNER, None, 21.9, 24.0),
    ("notify", PLANNER, None, 24.0, 30.5),
    ("abort", "rank", 0, 25.0, 25.5),
    ("abort", "rank", 1, 26.0, 26.25),
    ("abort", "rank", 3, 25.5, 28.0),
    ("comm_init", "rank", 0, 31.0, 80.0),
    ("comm_init", "rank", 1, 31.5, 81.0),
    ("comm_init", "rank", 2, 33.0, 79.5),
    ("comm_init", "rank", 3, 32.0, 80.5),
    ("state_transfer", "rank", 0, 81.0, 120.0),
    ("state_transfer", "rank", 2, 81.2, 122.5),
    ("data_restore", "rank", 2, 122.6, 123.0),
    ("first_step", "rank", 0, 123.0, 150.0),
    ("first_step", "rank", 1, 123.1, 151.0),
    ("first_step", "rank", 2, 123.2, 160.25),
    ("first_step", "rank", 3, 123.3, 149.0),
    ("publish", "rank", 0, 160.0, 161.0),  # not a phase: ignored
]
# A second, later incident (fault 60 s after the first): a shrink, no state transfer.
INCIDENT_B: list[tuple[str, str, int | None, float, float]] = [
    ("detect", DETECTOR, None, 0.0, 5.0),
    ("detect", DETECTOR, None, 2.0, 7.5),  # a second detector's report: the earliest start is the fault
    ("plan", PLANNER, None, 8.0, 9.0),
    ("notify", PLANNER, None, 9.0, 12.0),
    ("abort", "rank", 0, 10.0, 11.0),
    ("abort", "rank", 1, 10.5, 11.5),
    ("comm_init", "rank", 0, 12.0, 40.0),
    ("comm_init", "rank", 1, 12.5, 41.0),
    ("first_step", "rank", 0, 41.0, 70.0),
    ("first_step", "rank", 1, 41.5, 72.5),
]
FAULT_B = T0 + 60_000_000_000

# expected rows: (phase, start_ms, end_ms, dur_ms, spans)
ROWS_A = [
    ("detect", 0.0, 21.4, 21.4, 1),
    ("plan", 21.9, 24.0, 2.1, 1),
    ("notify", 24.0, 30.5, 6.5, 1),
    ("abort", 25.0, 28.0, 3.0, 3),
    ("comm_init", 31.0, 81.0, 50.0, 4),
    ("state_transfer", 81.0, 122.5, 41.5, 2),
    ("data_restore", 122.6, 123.0, 0.4, 1),
    ("first_step", 123.0, 160.25, 37.25, 4),
]
ROWS_B = [
    ("detect", 0.0, 7.5, 7.5, 2),
    ("plan", 8.0, 9.0, 1.0, 1),
    ("notify", 9.0, 12.0, 3.0, 1),
    ("abort", 10.0, 11.5, 1.5, 2),
    ("comm_init", 12.0, 41.0, 29.0, 2),
    ("first_step", 41.0, 72.5, 31.5, 2),
]


def _ns(fault_ns: int, ms: float) -> int:
    return fault_ns + round(ms * 1000) * 1000


def _attrs(name: str, rank: int | None, incident: str) -> dict[str, Any]:
    a: dict[str, Any] = {"phalanx.incident": incident}
    if name == "detect":
        a.update({"phalanx.worker": "w2", "phalanx.rank": 2, "phalanx.cause": "process_exit"})
    elif rank is not None:
        a.update({"phalanx.rank": rank, "phalanx.generation": 2})
    return a


def span_dicts() -> list[dict[str, Any]]:
    """What the JSON-lines exporter writes for both incidents, plus an unrelated trace."""
    out = []
    for tid, fault_ns, incident, spans in [
        (TRACE_B, FAULT_B, "inc-b", INCIDENT_B),  # written first: order in the file must not matter
        (TRACE_A, T0, "inc-a", INCIDENT_A),
    ]:
        for i, (name, service, rank, s, e) in enumerate(spans):
            out.append(
                {
                    "trace_id": tid,
                    "span_id": f"{i + 1:016x}",
                    "parent_id": None,
                    "name": name,
                    "kind": "INTERNAL",
                    "service": service if rank is None else f"worker-{rank}",
                    "start_ns": _ns(fault_ns, s),
                    "end_ns": _ns(fault_ns, e),
                    "status": "UNSET",
                    "attributes": _attrs(name, rank, incident),
                    "events": [],
                }
            )
    # a trace without a detect span (a job's start) is no incident
    out.append(
        {
            "trace_id": TRACE_STARTUP,
            "span_id": "1" * 16,
            "name": "comm_init",
            "service": "worker-0",
            "start_ns": T0 - 10**9,
            "end_ns": T0 - 10**8,
            "attributes": {},
        }
    )
    return out


@pytest.fixture
def span_file(tmp_path: Path) -> Path:
    p = tmp_path / "spans.jsonl"
    lines = [json.dumps(d) for d in span_dicts()]
    lines.insert(3, '{"trace_id": "x", "name": "detect"}')  # a line missing fields: skipped
    lines.insert(5, "")
    torn = json.dumps(span_dicts()[0])[:57]  # a process killed mid-write
    p.write_text("\n".join(lines) + "\n" + torn)
    return p


def rows_of(inc: Incident) -> list[tuple[str, float, float, float, int]]:
    return [(r.phase, r.start_ms, r.end_ms, r.dur_ms, r.spans) for r in inc.rows]


def assert_rows(inc: Incident, want: list[tuple[str, float, float, float, int]]) -> None:
    got = rows_of(inc)
    assert [g[0] for g in got] == [w[0] for w in want]
    for g, w in zip(got, want, strict=True):
        assert g[1:4] == pytest.approx(w[1:4], abs=1e-9), g[0]
        assert g[4] == w[4], g[0]


# -- span file -----------------------------------------------------------------------------------


def test_phases_in_recovery_order() -> None:
    assert PHASES == (
        "detect",
        "plan",
        "notify",
        "abort",
        "comm_init",
        "state_transfer",
        "data_restore",
        "first_step",
    )


def test_load_spans_from_file_skips_torn_and_bad_lines(span_file: Path) -> None:
    spans = load_spans(spans_file=str(span_file), jaeger_url=None, trace_id=None)
    assert len(spans) == len(INCIDENT_A) + len(INCIDENT_B) + 1
    assert all(isinstance(s, SpanRecord) for s in spans)
    first = spans[0]
    assert (first.trace_id, first.name, first.start_ns, first.end_ns, first.service) == (
        TRACE_B,
        "detect",
        FAULT_B,
        _ns(FAULT_B, 5.0),
        DETECTOR,
    )


def test_load_spans_missing_file(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="no span file"):
        load_spans(spans_file=str(tmp_path / "nope.jsonl"), jaeger_url=None, trace_id=None)


def test_incidents_rows_and_downtime(span_file: Path) -> None:
    incs = incidents(load_spans(spans_file=str(span_file), jaeger_url=None, trace_id=None))
    assert [i.trace_id for i in incs] == [TRACE_A, TRACE_B]  # oldest first, startup trace left out
    a, b = incs
    assert a.fault_ns == T0 and b.fault_ns == FAULT_B
    assert a.attributes["phalanx.incident"] == "inc-a" and a.attributes["phalanx.worker"] == "w2"
    assert_rows(a, ROWS_A)
    assert_rows(b, ROWS_B)
    assert a.downtime_ms == pytest.approx(160.25)
    assert b.downtime_ms == pytest.approx(72.5)


def test_incident_without_first_step_has_no_downtime(span_file: Path) -> None:
    spans = [
        s
        for s in load_spans(spans_file=str(span_file), jaeger_url=None, trace_id=None)
        if s.name != "first_step"
    ]
    incs = incidents(spans)
    assert all(i.downtime_ms is None for i in incs)
    assert "first_step" not in [r.phase for r in incs[-1].rows]


def test_print_summary_picks_the_latest(span_file: Path, capsys: pytest.CaptureFixture[str]) -> None:
    spans = load_spans(spans_file=str(span_file), jaeger_url=None, trace_id=None)
    assert print_summary(spans) == 0
    out = capsys.readouterr().out
    assert f"trace {TRACE_B}" in out and "incident inc-b" in out and "cause process_exit" in out
    assert TRACE_A not in out
    assert "downtime (fault -> first step done): 72.5 ms" in out
    assert any(line.split() == ["comm_init", "12.0", "41.0", "29.0", "2"] for line in out.splitlines())
    assert "state_transfer" not in out


def test_print_summary_by_trace_id(span_file: Path, capsys: pytest.CaptureFixture[str]) -> None:
    spans = load_spans(spans_file=str(span_file), jaeger_url=None, trace_id=None)
    assert print_summary(spans, trace_id=TRACE_A) == 0
    out = capsys.readouterr().out
    assert f"trace {TRACE_A}" in out and "downtime (fault -> first step done): 160.2 ms" in out
    assert any(line.split() == ["abort", "25.0", "28.0", "3.0", "3"] for line in out.splitlines())


def test_print_summary_without_incident_returns_1(
    span_file: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    spans = load_spans(spans_file=str(span_file), jaeger_url=None, trace_id=None)
    assert print_summary([s for s in spans if s.name != "detect"]) == 1
    assert "no incident found" in capsys.readouterr().err
    assert print_summary([]) == 1
    assert print_summary(spans, trace_id=TRACE_STARTUP) == 1
    assert TRACE_STARTUP in capsys.readouterr().err


def test_print_summary_incomplete_recovery(span_file: Path, capsys: pytest.CaptureFixture[str]) -> None:
    spans = load_spans(spans_file=str(span_file), jaeger_url=None, trace_id=None)
    assert print_summary([s for s in spans if s.name != "first_step"]) == 0
    assert "no first_step span yet" in capsys.readouterr().out


# -- Jaeger query API ----------------------------------------------------------------------------


def jaeger_trace(trace_id: str) -> dict[str, Any]:
    """One trace as Jaeger's /api/traces returns it, from the same spans the file holds."""
    spans, processes, pids = [], {}, {}
    for d in span_dicts():
        if d["trace_id"] != trace_id:
            continue
        svc = d["service"]
        if svc not in pids:
            pids[svc] = f"p{len(pids) + 1}"
            processes[pids[svc]] = {
                "serviceName": svc,
                "tags": [{"key": "hostname", "type": "string", "value": "node-1"}],
            }
        tags = [
            {"key": k, "type": "int64" if isinstance(v, int) else "string", "value": v}
            for k, v in d["attributes"].items()
        ]
        tags.append({"key": "otel.library.name", "type": "string", "value": "phalanx"})
        spans.append(
            {
                "traceID": trace_id.lstrip("0"),
                "spanID": d["span_id"],
                "operationName": d["name"],
                "references": [],
                "startTime": d["start_ns"] // 1000,
                "duration": (d["end_ns"] - d["start_ns"]) // 1000,
                "tags": tags,
                "logs": [],
                "processID": pids[svc],
                "warnings": None,
                "flags": 1,
            }
        )
    return {"traceID": trace_id.lstrip("0"), "spans": spans, "processes": processes, "warnings": None}


def _response(data: list[dict[str, Any]]) -> dict[str, Any]:
    return {"data": data, "total": 0, "limit": 0, "offset": 0, "errors": None}


class FakeJaeger(ThreadingHTTPServer):
    def __init__(self, latest: str | None) -> None:
        super().__init__(("127.0.0.1", 0), JaegerHandler)
        self.latest = latest
        self.requests: list[tuple[str, dict[str, list[str]]]] = []

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


class JaegerHandler(BaseHTTPRequestHandler):
    server: FakeJaeger

    def do_GET(self) -> None:
        u = urllib.parse.urlsplit(self.path)
        query = urllib.parse.parse_qs(u.query)
        self.server.requests.append((u.path, query))
        known = {t.lstrip("0"): t for t in (TRACE_A, TRACE_B)}
        if u.path == "/api/traces":
            body = _response([jaeger_trace(self.server.latest)] if self.server.latest else [])
        elif u.path.startswith("/api/traces/") and u.path.rsplit("/", 1)[1].lstrip("0") in known:
            body = _response([jaeger_trace(known[u.path.rsplit("/", 1)[1].lstrip("0")])])
        else:
            self.send_error(404)
            return
        raw = json.dumps(body).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(raw)))
        self.end_headers()
        self.wfile.write(raw)

    def log_message(self, *args: Any) -> None:
        pass


def _serve(latest: str | None) -> Iterator[FakeJaeger]:
    srv = FakeJaeger(latest)
    t = threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.01}, daemon=True)
    t.start()
    try:
        yield srv
    finally:
        srv.shutdown()
        srv.server_close()
        t.join(10)


@pytest.fixture
def jaeger() -> Iterator[FakeJaeger]:
    yield from _serve(TRACE_B)


@pytest.fixture
def empty_jaeger() -> Iterator[FakeJaeger]:
    yield from _serve(None)


def test_jaeger_latest_trace_gives_the_same_table(jaeger: FakeJaeger, span_file: Path) -> None:
    spans = load_spans(spans_file=None, jaeger_url=jaeger.url + "/", trace_id=None)
    search, fetch = jaeger.requests
    assert search == (
        "/api/traces",
        {"service": ["failure-detector"], "operation": ["detect"], "limit": ["1"]},
    )
    assert fetch[0] == f"/api/traces/{TRACE_B.lstrip('0')}"

    assert {s.trace_id for s in spans} == {TRACE_B}
    det = next(s for s in spans if s.name == "detect")
    assert det.service == DETECTOR and det.attributes["phalanx.rank"] == 2

    (got,) = incidents(spans)
    want = incidents(load_spans(spans_file=str(span_file), jaeger_url=None, trace_id=None))[-1]
    assert got.trace_id == want.trace_id == TRACE_B
    assert got.fault_ns == want.fault_ns
    assert rows_of(got) == rows_of(want)
    assert got.downtime_ms == want.downtime_ms
    assert got.attributes["phalanx.incident"] == "inc-b"


def test_jaeger_explicit_trace_pads_the_id(jaeger: FakeJaeger, span_file: Path) -> None:
    spans = load_spans(spans_file=None, jaeger_url=jaeger.url, trace_id=TRACE_A)
    assert [p for p, _ in jaeger.requests] == [f"/api/traces/{TRACE_A}"]  # no search
    assert {s.trace_id for s in spans} == {TRACE_A}  # "a1b2..." back to 32 hex digits
    (got,) = incidents(spans)
    assert_rows(got, ROWS_A)
    want = incidents(load_spans(spans_file=str(span_file), jaeger_url=None, trace_id=None))[0]
    assert got.rows == want.rows and got.downtime_ms == want.downtime_ms
    assert isinstance(got.rows[0], PhaseRow)


def test_jaeger_without_incident(empty_jaeger: FakeJaeger, capsys: pytest.CaptureFixture[str]) -> None:
    spans = load_spans(spans_file=None, jaeger_url=empty_jaeger.url, trace_id=None)
    assert spans == []
    assert [p for p, _ in empty_jaeger.requests] == ["/api/traces"]
    assert print_summary(spans) == 1


def test_a_planned_resize_is_an_incident_from_its_signal_with_its_pause() -> None:
    trace, t0 = "22222222222222222222222222222222", T0 + 120 * 10**9

    def span(name: str, start_ms: float, end_ms: float, **attrs: Any) -> SpanRecord:
        return SpanRecord(trace, name, t0 + int(start_ms * 1e6), t0 + int(end_ms * 1e6), "x", attrs)

    spans = [
        span("signal preemption_notice", 0.0, 1.0),
        span("process phalanx.sched.local.preempt", 2.0, 9.0),  # the planner's consumer span: no phase
        span("plan", 3.0, 8.0, **{"phalanx.resize": "shrink", "phalanx.reason": "reclaim b: shrink to 2"}),
        span("notify", 8.0, 12.0),
        span("abort", 40.0, 40.5),  # the ranks finished the step in flight first
        span("abort", 41.0, 41.2),
        span("comm_init", 41.0, 60.0),
        span("first_step", 60.0, 95.0),
        span("first_step", 60.5, 96.0),
    ]
    (inc,) = incidents(spans)
    assert inc.resize == "shrink" and inc.fault_ns == t0
    assert [r.phase for r in inc.rows] == ["signal", "plan", "notify", "abort", "comm_init", "first_step"]
    assert inc.downtime_ms == pytest.approx(56.0)  # first abort start -> last first_step end
    text = format_incident(inc)
    assert "planned shrink: reclaim b: shrink to 2" in text and "pause (" in text and "56.0 ms" in text
