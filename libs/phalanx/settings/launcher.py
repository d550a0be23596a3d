"""The node launcher's settings (the ``phalanx run`` process on each node)."""

from __future__ import annotations

from pydantic import Field

from phalanx.settings.common import (
    HeartbeatSettings,
    MetricsSettings,
    NatsSettings,
    StreamSettings,
    TelemetrySettings,
)


class LauncherSettings(NatsSettings, StreamSettings, TelemetrySettings, MetricsSettings, HeartbeatSettings):
    """The digest interval (the heartbeat's) and how a stopped launcher drains its workers."""

    launcher_drain_s: float = Field(
        default=0.0, ge=0, description="How long a launcher told to stop takes its workers out gracefully."
    )
    warm_imports: str = Field(
        default="",
        max_length=4000,
        pattern=r"^[A-Za-z0-9_., ]*$",
        description="More modules (comma-separated) the node's fork server imports before it forks workers.",
    )
