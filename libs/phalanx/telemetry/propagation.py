"""W3C trace context in NATS message headers (``traceparent`` / ``tracestate``)."""

from __future__ import annotations

from opentelemetry import context as otel_context
from opentelemetry.propagate import extract, inject
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

_W3C = TraceContextTextMapPropagator()


def inject_headers(headers: dict[str, str], ctx: otel_context.Context | None = None) -> dict[str, str]:
    """Write the current (or given) span context into ``headers`` and return them."""
    _W3C.inject(headers, context=ctx)
    return headers


def extract_context(headers: dict[str, str] | None) -> otel_context.Context:
    """The context a message was published in (empty if it carries none)."""
    return _W3C.extract(headers or {})


def traceparent(headers: dict[str, str] | None) -> str | None:
    return (headers or {}).get("traceparent")


__all__ = ["extract", "extract_context", "inject", "inject_headers", "traceparent"]
