"""Which exporter the standard OpenTelemetry variables choose (phalanx.telemetry.tracing)."""

from __future__ import annotations

import pytest

from phalanx.telemetry.tracing import _exporter_from_env, wants_otlp

OTEL = (
    "OTEL_TRACES_EXPORTER",
    "OTEL_EXPORTER_OTLP_ENDPOINT",
    "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
    "OTEL_EXPORTER_OTLP_PROTOCOL",
    "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL",
)


@pytest.mark.parametrize(
    ("env", "otlp"),
    [
        ({}, False),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4318"}, True),
        ({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://127.0.0.1:4318/v1/traces"}, True),
        ({"OTEL_TRACES_EXPORTER": "otlp"}, True),
        ({"OTEL_TRACES_EXPORTER": "none", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4318"}, False),
    ],
)
def test_standard_variables_choose_otlp(
    monkeypatch: pytest.MonkeyPatch, env: dict[str, str], otlp: bool
) -> None:
    for k in OTEL:
        monkeypatch.delenv(k, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    assert wants_otlp() is otlp


def test_grpc_is_refused_with_a_reason(monkeypatch: pytest.MonkeyPatch) -> None:
    for k in OTEL:
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:4317")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc")
    with pytest.raises(ValueError, match="http/protobuf"):
        _exporter_from_env()
