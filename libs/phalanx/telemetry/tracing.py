"""OpenTelemetry tracing set-up for services and ranks.

Where the standard OpenTelemetry variables ask for OTLP (``OTEL_EXPORTER_OTLP_ENDPOINT``
or ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` set, or ``OTEL_TRACES_EXPORTER=otlp``), spans
go to that collector over OTLP/HTTP protobuf (Jaeger all-in-one takes it on :4318;
``OTEL_EXPORTER_OTLP_COMPRESSION``, ``_HEADERS`` and ``_TIMEOUT`` apply as the SDK
reads them). Every Phalanx process (services, launcher, ranks) sets up here, and the
launcher passes its ``OTEL_*`` variables on to its ranks. Otherwise each process appends
its spans as JSON lines to ``PHALANX_SPAN_FILE`` (default ``.phalanx/spans.jsonl``),
which ``phalanx trace summary`` reads. One line per span, written with a single
``write`` on an ``O_APPEND`` descriptor, so many processes can share the file.
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import (
    BatchSpanProcessor,
    SimpleSpanProcessor,
    SpanExporter,
    SpanExportResult,
)

from phalanx.settings import TelemetrySettings, load

_lock = threading.Lock()
_provider: TracerProvider | None = None


def span_to_dict(span: ReadableSpan) -> dict[str, Any]:
    ctx = span.get_span_context()
    parent = span.parent
    return {
        "trace_id": trace.format_trace_id(ctx.trace_id) if ctx else None,
        "span_id": trace.format_span_id(ctx.span_id) if ctx else None,
        "parent_id": trace.format_span_id(parent.span_id) if parent else None,
        "name": span.name,
        "kind": span.kind.name,
        "service": span.resource.attributes.get("service.name"),
        "start_ns": span.start_time,
        "end_ns": span.end_time,
        "status": span.status.status_code.name,
        "attributes": dict(span.attributes or {}),
        "events": [
            {"name": e.name, "ts_ns": e.timestamp, "attributes": dict(e.attributes or {})}
            for e in span.events
        ],
    }


class JsonLinesSpanExporter(SpanExporter):
    """Appends each finished span as one JSON line to a file shared by processes."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        data = b"".join((json.dumps(span_to_dict(s), default=str) + "\n").encode() for s in spans)
        if data:
            os.write(self._fd, data)
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        try:
            os.close(self._fd)
        except OSError:
            pass


def wants_otlp() -> bool:
    """Whether the standard OpenTelemetry variables ask for OTLP export of traces
    (they are the SDK's own contract, read as it reads them, not Phalanx settings)."""
    chosen = os.environ.get("OTEL_TRACES_EXPORTER", "").strip().lower()
    if chosen:
        return chosen == "otlp"
    return bool(
        os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")
    )


def _exporter_from_env() -> SpanExporter:
    if wants_otlp():
        protocol = (
            os.environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
            or os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL")
            or "http/protobuf"
        )
        if protocol != "http/protobuf":
            raise ValueError(f"OTLP protocol {protocol!r}: Phalanx exports traces over http/protobuf only")
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        return OTLPSpanExporter()  # endpoint, headers, compression, timeout: from the OTEL_* variables
    return JsonLinesSpanExporter(load(TelemetrySettings).span_file)


def setup_tracing(
    service: str, *, exporter: SpanExporter | None = None, batch: bool = True
) -> TracerProvider:
    """Install the process-wide tracer provider once; later calls return it.

    ``exporter`` overrides the environment's choice (tests pass an in-memory one).
    """
    global _provider
    with _lock:
        if _provider is not None:
            return _provider
        attrs = {"service.name": service, "service.instance.id": f"{os.uname().nodename}:{os.getpid()}"}
        provider = TracerProvider(resource=Resource.create(attrs))
        if exporter is None:
            exporter = _exporter_from_env()
        processor = (
            BatchSpanProcessor(exporter, schedule_delay_millis=200)
            if batch
            else SimpleSpanProcessor(exporter)
        )
        provider.add_span_processor(processor)
        trace.set_tracer_provider(provider)
        _provider = provider
        return provider


def shutdown_tracing() -> None:
    """Flush and close the exporter (call before a process exits)."""
    global _provider
    with _lock:
        if _provider is not None:
            _provider.force_flush(2000)
            _provider.shutdown()
            _provider = None


def flush_tracing() -> None:
    if _provider is not None:
        _provider.force_flush(2000)


def tracer(name: str = "phalanx") -> trace.Tracer:
    return trace.get_tracer(name)
