"""Tracing (OpenTelemetry), trace propagation through NATS headers, and logging."""

from phalanx.telemetry.logging import get_logger, setup_logging
from phalanx.telemetry.propagation import extract_context, inject_headers
from phalanx.telemetry.tracing import (
    JsonLinesSpanExporter,
    flush_tracing,
    setup_tracing,
    shutdown_tracing,
    span_to_dict,
    tracer,
)

__all__ = [
    "JsonLinesSpanExporter",
    "extract_context",
    "flush_tracing",
    "get_logger",
    "inject_headers",
    "setup_logging",
    "setup_tracing",
    "shutdown_tracing",
    "span_to_dict",
    "tracer",
]
