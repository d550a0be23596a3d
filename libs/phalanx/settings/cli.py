"""The ``phalanx`` command's own settings (each process it starts reads its own model)."""

from __future__ import annotations

from pydantic import Field

from phalanx.settings.common import NatsSettings, StreamSettings, TelemetrySettings


class CliSettings(NatsSettings, StreamSettings, TelemetrySettings):
    """The bus, the span file and Jaeger, for the commands that inspect a job or a trace."""

    jaeger_url: str | None = Field(default=None, description="Jaeger's query API, for `phalanx trace`.")
