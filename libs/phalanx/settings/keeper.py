"""The checkpoint keeper's settings (``python -m phalanx.services.state_replication``)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

from pydantic import BeforeValidator, Field, SecretStr, ValidationInfo, field_validator
from pydantic_settings import NoDecode

from phalanx.settings.common import NodeSettings, ServiceSettings
from phalanx.settings.parsing import TierPolicy, parse_drain_lanes, parse_job_uids, parse_rates


def _tier_policy(value: Any) -> Any:
    return TierPolicy.parse(value) if isinstance(value, str) else value


def _job_uids(value: Any) -> Any:
    return parse_job_uids(value) if isinstance(value, str) else value


Tiers = Annotated[TierPolicy | None, NoDecode, BeforeValidator(_tier_policy)]
"""``tier:every=N,last=N,pin=M; ...``, parsed once here (:meth:`TierPolicy.parse`)."""


SERVICE_SECRET_ENV = ("PHALANX_KEEPER_KEY", "PHALANX_KEEPER_KEY_FILE")
"""The variables that carry a service's secret (the keepers' cluster key, or where it
is): only services read them, and a launcher never passes them on to a worker
(:func:`phalanx.launcher.children.worker_env`) -- a rank that held the key could fetch
any job's checkpoint from any keeper."""


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
    ckpt_tiers: Tiers = Field(
        default=None,
        description="Which checkpoints each tier takes and keeps, tier:every=N,last=N,pin=M; ..."
        " (unset: every checkpoint to every configured tier, keeping memory 2, disk 5, shared 5, object 3).",
    )
    ckpt_drain: str = Field(
        default="object | disk, shared",
        description="Drain lanes: tiers of a lane in order (','), lanes side by side ('|');"
        " each of disk, shared, object once.",
    )
    ckpt_rate: str = Field(
        default="", description="Bytes/s cap per tier while draining, tier=N[K|M|G],... (unset: none)."
    )
    ckpt_object_part_bytes: int = Field(
        default=16 << 20, ge=5 << 20, description="Part size of the object tier's multipart uploads."
    )
    ckpt_object_concurrency: int = Field(
        default=8, ge=1, le=64, description="Parts of one object uploaded at once."
    )
    keeper_drain_nice: int = Field(
        default=10, ge=0, le=19, description="Niceness added to the keeper's drain threads (restores keep 0)."
    )
    keeper_drain_idle_io: bool = Field(
        default=True, description="Run the keeper's drain threads in the idle IO class."
    )
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
        default=64, ge=1, description="Authenticated peer connections a keeper serves at once."
    )
    keeper_max_connections_per_peer: int = Field(default=8, ge=1, description="Of those, from one address.")
    keeper_max_handshakes: int = Field(
        default=64, ge=1, description="Peer connections not yet authenticated a keeper holds at once."
    )
    keeper_max_handshakes_per_peer: int = Field(default=4, ge=1, description="Of those, from one address.")
    keeper_auth_failure_burst: int = Field(
        default=8,
        ge=1,
        description="Failed handshakes an address may make in a row before it is refused at once.",
    )
    keeper_auth_failure_refill_s: float = Field(
        default=10.0, gt=0, description="Then one more try is allowed every this many seconds."
    )
    keeper_rank_max_connections: int = Field(
        default=64, ge=1, description="Connections to the ranks' Unix socket a keeper holds at once."
    )
    keeper_rank_max_connections_per_uid: int = Field(default=32, ge=1, description="Of those, from one uid.")
    keeper_max_request_bytes: int = Field(
        default=1 << 20,
        ge=4096,
        description="The largest request a rank may send to its keeper (a register of a DCP set"
        " of 4096 ranks is ~350 KiB).",
    )
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
    keeper_refresh_s: float = Field(
        default=5.0, gt=0, description="How often a keeper refreshes its registration in the catalog."
    )
    keeper_lost_after_s: float = Field(
        default=30.0,
        gt=0,
        description="A keeper whose registration is older than this and that does not answer on its"
        " port is lost: a keeper holding its replicas finishes their drains.",
    )

    @field_validator("keeper_lost_after_s")
    @classmethod
    def _lost_after_refresh(cls, lost_after: float, info: ValidationInfo) -> float:
        """Several refresh periods: a live keeper must not look lost between two refreshes."""
        refresh = info.data.get("keeper_refresh_s")
        if refresh is not None and lost_after <= refresh:
            raise ValueError(f"must exceed PHALANX_KEEPER_REFRESH_S ({refresh:g}), by several periods")
        return lost_after

    @field_validator("ckpt_drain")
    @classmethod
    def _lanes(cls, text: str) -> str:
        parse_drain_lanes(text)
        return text

    @field_validator("ckpt_rate")
    @classmethod
    def _rates(cls, text: str) -> str:
        parse_rates(text)
        return text

    @field_validator("ckpt_tiers")
    @classmethod
    def _tiers_configured(cls, policy: TierPolicy | None, info: ValidationInfo) -> TierPolicy | None:
        """The policy names only tiers this keeper has (``ckpt_disk`` and the others are
        declared, so validated, before it; one that failed is left to its own error)."""
        if policy is not None:
            fields = {"disk": "ckpt_disk", "shared": "ckpt_shared", "object": "ckpt_object"}
            policy.check(t for t, f in fields.items() if f not in info.data or info.data[f])
        return policy

    @property
    def tier_policy(self) -> TierPolicy:
        """:attr:`ckpt_tiers`, or the default policy where it is unset."""
        return self.ckpt_tiers or TierPolicy()
