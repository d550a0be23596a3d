"""The checkpoint keeper's settings (``python -m phalanx.services.state_replication``)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

from pydantic import BeforeValidator, Field, SecretStr
from pydantic_settings import NoDecode

from phalanx.settings.common import NodeSettings, ServiceSettings
from phalanx.settings.parsing import RetentionPolicy, parse_job_uids


def _retention(value: Any) -> Any:
    return RetentionPolicy.parse(value) if isinstance(value, str) else value


def _job_uids(value: Any) -> Any:
    return parse_job_uids(value) if isinstance(value, str) else value


Retention = Annotated[RetentionPolicy | None, NoDecode, BeforeValidator(_retention)]
"""``N`` or ``last=N,every=M``, parsed once here (:meth:`RetentionPolicy.parse`)."""


class KeeperSettings(ServiceSettings, NodeSettings):
    """Tiers, retention, the peer protocol's key and bounds, and the shared memory it serves."""

    keeper_host: str = Field(default="127.0.0.1", description="Address the keeper listens on for peers.")
    keeper_port: int = Field(
        default=0, ge=0, le=65535, description="Port the keeper listens on; 0 picks a free one."
    )
    ckpt_replicas: int = Field(default=1, ge=0, description="Peer keepers that get each snapshot.")
    ckpt_fsync: bool = Field(
        default=True, description="fsync each file written to the disk and shared tiers."
    )
    ckpt_disk: Path | None = Field(default=None, description="The local-disk tier (unset: none).")
    ckpt_shared: Path | None = Field(default=None, description="The shared file system tier (unset: none).")
    ckpt_object: str | None = Field(
        default=None, description="The object store tier, s3://bucket/prefix (unset: none)."
    )
    ckpt_keep_memory: Retention = Field(
        default=None, description="Retention of the memory tier: N or last=N,every=M."
    )
    ckpt_keep_disk: Retention = Field(default=None, description="Retention of the disk tier.")
    ckpt_keep_shared: Retention = Field(default=None, description="Retention of the shared tier.")
    ckpt_keep_object: Retention = Field(default=None, description="Retention of the object tier.")
    keeper_key: SecretStr | None = Field(
        default=None,
        description="The cluster's keeper key (>= 32 bytes, the same on every node): keepers prove it to each other.",
    )
    keeper_key_file: Path | None = Field(default=None, description="A file holding the keeper key instead.")
    keeper_timeout_s: float = Field(
        default=30.0, gt=0, description="Longest wait for any read from, or write to, a peer keeper."
    )
    keeper_auth_timeout_s: float = Field(
        default=5.0, gt=0, description="A peer that has not authenticated in this long is dropped."
    )
    keeper_min_rate_bytes_per_s: float = Field(
        default=float(8 << 20),
        gt=0,
        validation_alias="PHALANX_KEEPER_MIN_RATE",
        description="Bytes/s below which a whole transfer with a peer is dropped.",
    )
    keeper_max_connections: int = Field(
        default=64, ge=1, description="Peer connections a keeper serves at once."
    )
    keeper_max_connections_per_peer: int = Field(default=8, ge=1, description="Of those, from one address.")
    keeper_max_fills: int = Field(
        default=2, ge=1, description="Copies a keeper receives or restores into shared memory at once."
    )
    ckpt_max_bytes: int = Field(
        default=64 << 30, ge=1, description="The largest checkpoint a keeper receives or restores."
    )
    keeper_shm_reserve_bytes: int = Field(
        default=256 << 20,
        ge=0,
        description="Shared memory a keeper leaves free when it receives or restores.",
    )
    ckpt_job_uids: Annotated[dict[str, int], NoDecode, BeforeValidator(_job_uids)] = Field(
        default_factory=dict,
        description="The uid each job's ranks run as on this node, job=uid[,job=uid...]; a job not listed"
        " runs as the keeper's uid. The keeper takes slots and registrations of a job only from that uid.",
    )
    ckpt_retry_max_s: float = Field(
        default=300.0, gt=0, description="Longest wait between retries of a failed tier or catalog write."
    )
