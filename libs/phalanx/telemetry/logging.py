"""structlog JSON logs that carry the current trace and span ids."""

from __future__ import annotations

import logging
import sys
from collections.abc import MutableMapping
from typing import Any

import structlog
from opentelemetry import trace

from phalanx.settings import TelemetrySettings, load

_configured = False


def _add_trace_ids(_: Any, __: str, event: MutableMapping[str, Any]) -> MutableMapping[str, Any]:
    ctx = trace.get_current_span().get_span_context()
    if ctx.is_valid:
        event["trace_id"] = trace.format_trace_id(ctx.trace_id)
        event["span_id"] = trace.format_span_id(ctx.span_id)
    return event


def setup_logging(service: str, level: str | None = None) -> None:
    """JSON lines to stderr, one per event, with service, trace_id and span_id."""
    global _configured
    if _configured:
        return
    lvl = getattr(logging, (level or load(TelemetrySettings).log_level or "INFO").upper())
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            _add_trace_ids,
            structlog.processors.format_exc_info,
            structlog.processors.JSONRenderer(),
        ],
        wrapper_class=structlog.make_filtering_bound_logger(lvl),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=True,
    )
    structlog.contextvars.bind_contextvars(service=service)
    _configured = True


def get_logger(**bound: Any) -> Any:
    return structlog.get_logger().bind(**bound)
