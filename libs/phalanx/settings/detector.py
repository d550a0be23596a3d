"""The failure detector's settings (``python -m phalanx.services.failure_detector``)."""

from __future__ import annotations

from pydantic import Field

from phalanx.settings.common import PLAIN_NAME, HeartbeatSettings, ServiceSettings


def _s(ms: float | None) -> float | None:
    return None if ms is None else ms / 1e3


class DetectorSettings(ServiceSettings, HeartbeatSettings):
    """The accrual detector's thresholds, the stall bounds and the tick; durations set in
    ms are read in seconds through the ``_s`` properties (the one conversion)."""

    detector_phi: float = Field(default=8.0, gt=0, description="Phi threshold of the accrual detector.")
    detector_window: int = Field(default=100, gt=0, description="Inter-arrival samples kept per worker.")
    detector_min_std_ratio: float = Field(
        default=0.2, gt=0, description="Floor of sigma, as a fraction of the mean interval."
    )
    detector_min_std_ms: float = Field(default=20.0, gt=0, description="Floor of sigma, absolute.")
    detector_pause_ratio: float = Field(
        default=0.15, gt=0, description="Acceptable pause added to the mean interval, as a fraction of it."
    )
    detector_digest_slack_ratio: float = Field(
        default=0.5,
        gt=0,
        validation_alias="PHALANX_DETECTOR_DIGEST_SLACK",
        description="Added to a digest-fed worker's silence deadline, as a fraction of the digest interval.",
    )
    stall_floor_ms: float = Field(
        default=30000.0,
        gt=0,
        description="A rank in COMPUTE that no peer waits for stalls after max(floor, factor x step).",
    )
    stall_factor: float = Field(default=4.0, gt=0, description="See stall_floor_ms.")
    stall_initial_ms: float = Field(
        default=60000.0, gt=0, description="Stall bound before a rank has completed any step."
    )
    detector_worker_floor_ms: float = Field(
        default=500.0,
        ge=0,
        allow_inf_nan=False,
        description="A worker is lost after at least this much silence of its heartbeats.",
    )
    detector_node_floor_ms: float = Field(
        default=750.0,
        ge=0,
        allow_inf_nan=False,
        description="A node is lost after at least this much silence of its launcher's digests.",
    )
    straggle_floor_ms: float = Field(
        default=1500.0,
        gt=0,
        description="A rank in COMPUTE while a peer waits in COLLECTIVE at the same step is the "
        "straggler after max(floor, stall_factor x the peers' compute time of the step).",
    )
    detector_tick_ms: float | None = Field(
        default=None, gt=0, description="Tick period (unset: interval/10, within 5..100)."
    )
    detector_max_lag_ms: float | None = Field(
        default=None, gt=0, description="A tick this late holds verdicts (unset: interval/2, at least 50)."
    )
    detector_grace_ms: float | None = Field(
        default=None, gt=0, description="Hold kept after a reconnect (unset: 2 x interval)."
    )
    detector_job: str | None = Field(
        default=None, pattern=PLAIN_NAME, description="Watch this one job only (unset: all)."
    )
    detector_exit_max_age_s: float = Field(
        default=3600.0, gt=0, description="Exit reports older than this are logged, not judged."
    )
    detector_replica: str = Field(
        default="",
        pattern=r"^[A-Za-z0-9_-]{0,32}$",
        description="This replica's name in its durable consumer names (empty: a single detector's).",
    )
    detector_mass_hold_s: float = Field(
        default=120.0,
        ge=0,
        allow_inf_nan=False,
        description="The longest a mass silence holds a job's verdicts when nothing confirms them;"
        " 0 never holds.",
    )

    @property
    def detector_min_std_s(self) -> float:
        return self.detector_min_std_ms / 1e3

    @property
    def stall_floor_s(self) -> float:
        return self.stall_floor_ms / 1e3

    @property
    def stall_initial_s(self) -> float:
        return self.stall_initial_ms / 1e3

    @property
    def detector_worker_floor_s(self) -> float:
        return self.detector_worker_floor_ms / 1e3

    @property
    def detector_node_floor_s(self) -> float:
        return self.detector_node_floor_ms / 1e3

    @property
    def straggle_floor_s(self) -> float:
        return self.straggle_floor_ms / 1e3

    @property
    def detector_tick_s(self) -> float | None:
        return _s(self.detector_tick_ms)

    @property
    def detector_max_lag_s(self) -> float | None:
        return _s(self.detector_max_lag_ms)

    @property
    def detector_grace_s(self) -> float | None:
        return _s(self.detector_grace_ms)
