"""The groups of settings more than one kind of process reads.

Each group is a model of its own, so that the library code that needs it (the bus, the
stream topology, logging, /metrics, the node's shared memory) reads just that group
(``load(NatsSettings)``); each process's model (:mod:`phalanx.settings`) inherits the
groups that process uses, so that a bad value in any of them stops it at start.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import AliasChoices, Field, SecretStr, field_validator

from phalanx.settings.loading import PhalanxSettings

LogLevel = Literal["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"]
PLAIN_NAME = r"^[A-Za-z0-9_-]+$"
"""A job, worker or replica name as it goes into a NATS subject or a durable name."""


class NatsSettings(PhalanxSettings):
    """The bus: server, authorization and TLS (:mod:`phalanx.bus`); every process."""

    nats_url: str = Field(
        default="nats://127.0.0.1:4222",
        validation_alias=AliasChoices("NATS_URL", "PHALANX_NATS_URL"),
        description="The NATS server (NATS_URL, or PHALANX_NATS_URL).",
    )
    nats_user: str | None = Field(
        default=None,
        description="NATS user to log in as (wins over user:pass in the URL); see phalanx.natsauth.",
    )
    nats_password: SecretStr = Field(default=SecretStr(""), description="Password of nats_user.")
    nats_tls_ca: Path | None = Field(
        default=None,
        description="PEM bundle of the CAs to trust for the server (default: the system's); turns TLS on.",
    )
    nats_tls_cert: Path | None = Field(
        default=None,
        description="This client's certificate chain, for a server that verifies clients; turns TLS on.",
    )
    nats_tls_key: Path | None = Field(
        default=None, description="This client's private key (needs nats_tls_cert)."
    )
    nats_tls_hostname: str | None = Field(
        default=None, description="The host the server's certificate must be for (default: the URL's host)."
    )


class StreamSettings(PhalanxSettings):
    """Replicas and limits of the streams and buckets, per replica (:mod:`phalanx.bus.topology`
    says how they are sized); read by the processes that create the topology. The rendered
    server config gives the account a JetStream quota of their sum (:mod:`phalanx.natsauth`)."""

    stream_replicas: int = Field(
        default=1, ge=1, description="Replicas of each stream and bucket (3 on a 3-node cluster)."
    )
    evt_max_bytes: int = Field(default=2 << 30, ge=1 << 20, description="PHALANX_EVT: bytes kept.")
    evt_max_msgs_per_subject: int = Field(
        default=2048, ge=16, description="PHALANX_EVT: messages kept per subject (the newest)."
    )
    cmd_max_bytes: int = Field(default=1 << 30, ge=1 << 20, description="PHALANX_CMD: bytes kept.")
    sched_max_bytes: int = Field(default=256 << 20, ge=1 << 20, description="PHALANX_SCHED: bytes kept.")
    err_max_bytes: int = Field(default=256 << 20, ge=1 << 20, description="PHALANX_ERR: bytes kept.")
    err_max_msgs_per_subject: int = Field(
        default=1024, ge=16, description="PHALANX_ERR: messages kept per subject (the newest)."
    )
    jobs_kv_max_bytes: int = Field(default=1 << 30, ge=1 << 20, description="Bucket phalanx_jobs: bytes.")
    cluster_kv_max_bytes: int = Field(
        default=64 << 20, ge=1 << 20, description="Bucket phalanx_cluster: bytes."
    )
    ckpt_kv_max_bytes: int = Field(default=1 << 30, ge=1 << 20, description="Bucket phalanx_ckpt: bytes.")
    kv_max_value_bytes: int = Field(
        default=4 << 20,
        ge=64 << 10,
        validation_alias="PHALANX_KV_MAX_VALUE_SIZE",
        description="The largest value of any bucket (a job record: ~100 B/rank).",
    )


class TelemetrySettings(PhalanxSettings):
    """Logging and spans (:mod:`phalanx.telemetry`); every process."""

    log_level: LogLevel | None = Field(
        default=None, description="Log level (unset: INFO, or the program's own default)."
    )
    span_file: Path = Field(
        default=Path(".phalanx/spans.jsonl"), description="Spans as JSON lines, without an OTLP endpoint."
    )

    @field_validator("log_level", mode="before")
    @classmethod
    def _upper(cls, value: Any) -> Any:
        return value.upper() if isinstance(value, str) else value


class MetricsSettings(PhalanxSettings):
    """The Prometheus /metrics endpoint (:func:`phalanx.metrics.serve_metrics`): the four
    services and the launcher."""

    metrics_host: str = Field(default="127.0.0.1", description="Address the /metrics endpoint listens on.")
    metrics_port: int = Field(
        default=0, ge=0, le=65535, description="Port of the /metrics endpoint; 0 picks a free one (logged)."
    )
    metrics_enabled: bool = Field(default=True, description="Serve /metrics at all.")


class HeartbeatSettings(PhalanxSettings):
    """The heartbeat interval: ranks send at it, launchers send their digests at it, the
    detector assumes it. Milliseconds in the environment; :attr:`heartbeat_interval_s`
    is the one conversion, and every reader takes seconds from it."""

    heartbeat_interval_ms: float = Field(
        default=100.0,
        gt=0,
        validation_alias="PHALANX_HEARTBEAT_MS",
        description="Heartbeat interval of ranks and launchers; the detector's assumed interval.",
    )

    @property
    def heartbeat_interval_s(self) -> float:
        """:attr:`heartbeat_interval_ms` in seconds."""
        return self.heartbeat_interval_ms / 1e3


class ServiceSettings(NatsSettings, StreamSettings, TelemetrySettings, MetricsSettings):
    """What each of the four services reads besides its own knobs (:class:`phalanx.service.Service`)."""


class NodeSettings(PhalanxSettings):
    """This node as ranks and keepers share it (:mod:`phalanx.checkpoint.slots`)."""

    node: str | None = Field(default=None, description="This node's name (default: the host name).")
    shm_root: Path = Field(
        default=Path("/dev/shm/phalanx"), description="Shared memory of ranks and keepers."
    )
