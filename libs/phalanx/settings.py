"""Every ``PHALANX_*`` setting of every Phalanx process, in one validated model.

A process reads its settings from its environment (``get_settings()``); a negative
or malformed value stops it at start with one message naming each bad variable,
instead of surfacing later as a confusing failure deep inside a recovery.

>>> s = get_settings()            # PHALANX_HEARTBEAT_MS=50 in the environment
>>> s.heartbeat_ms
50.0
>>> PHALANX_HEARTBEAT_MS=-1 phalanx run ...
phalanx: bad setting: PHALANX_HEARTBEAT_MS='-1': Input should be greater than 0

``NATS_URL`` (no prefix, as the NATS tools spell it) is the server; the rest is
``PHALANX_<FIELD>``. An empty variable counts as unset. Entry points call
:func:`settings_or_exit` first.

The model is cached per value of the process's ``PHALANX_*``/``NATS_URL``
variables: a process that changes its own environment (``LocalStack`` logging
in-process services in as their roles, tests with ``monkeypatch.setenv``) reads
the new values, as the ``os.environ`` reads this replaced did.
"""

from __future__ import annotations

import os
import re
import sys
from functools import lru_cache
from pathlib import Path
from typing import Any, Literal

from pydantic import AliasChoices, Field, SecretStr, ValidationError, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from phalanx.schemas.messages import Role

LogLevel = Literal["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"]
# A job, worker or replica name as it goes into a NATS subject or a durable name.
_PLAIN_NAME = r"^[A-Za-z0-9_-]+$"
_JOB = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


class SettingsError(ValueError):
    """One or more ``PHALANX_*`` variables are malformed; the message names each."""


class Settings(BaseSettings):
    model_config = SettingsConfigDict(
        env_prefix="PHALANX_", extra="ignore", frozen=True, env_ignore_empty=True
    )

    # --- the bus: server, authorization, TLS, JetStream -----------------------------------
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
    stream_replicas: int = Field(
        default=1, ge=1, description="Replicas of each stream and bucket (3 on a 3-node cluster)."
    )
    # Limits of the streams and buckets, per replica (phalanx.bus.topology says how they are sized);
    # the rendered server config gives the account a JetStream quota of their sum (phalanx.natsauth).
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
    kv_max_value_size: int = Field(
        default=4 << 20,
        ge=64 << 10,
        description="The largest value of any bucket (a job record: ~100 B/rank).",
    )

    # --- metrics (Prometheus) --------------------------------------------------------
    metrics_host: str = Field(default="127.0.0.1", description="Address the /metrics endpoint listens on.")
    metrics_port: int = Field(
        default=0, ge=0, le=65535, description="Port of the /metrics endpoint; 0 picks a free one (logged)."
    )
    metrics_enabled: bool = Field(default=True, description="Serve /metrics at all.")

    # --- heartbeat and failure detector ----------------------------------------------
    heartbeat_ms: float = Field(
        default=100.0,
        gt=0,
        description="Heartbeat interval of ranks and launchers; the detector's assumed interval.",
    )
    detector_phi: float = Field(default=8.0, gt=0, description="Phi threshold of the accrual detector.")
    detector_window: int = Field(default=100, gt=0, description="Inter-arrival samples kept per worker.")
    detector_min_std_ratio: float = Field(
        default=0.2, gt=0, description="Floor of sigma, as a fraction of the mean interval."
    )
    detector_min_std_ms: float = Field(default=20.0, gt=0, description="Floor of sigma, absolute.")
    detector_pause_ratio: float = Field(
        default=0.15, gt=0, description="Acceptable pause added to the mean interval, as a fraction of it."
    )
    detector_digest_slack: float = Field(
        default=0.5,
        gt=0,
        description="Added to a digest-fed worker's silence deadline, as a fraction of the digest interval.",
    )
    stall_floor_ms: float = Field(
        default=5000.0, gt=0, description="A rank in COMPUTE stalls after max(floor, factor x step)."
    )
    stall_factor: float = Field(default=4.0, gt=0, description="See stall_floor_ms.")
    stall_initial_ms: float = Field(
        default=60000.0, gt=0, description="Stall bound before a rank has completed any step."
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
        default=None, pattern=_PLAIN_NAME, description="Watch this one job only (unset: all)."
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
        default=10.0,
        ge=0,
        allow_inf_nan=False,
        description="How long a mass silence holds a job's verdicts; 0 never holds.",
    )

    # --- elasticity planner ----------------------------------------------------------
    planner_comm_grace_s: float = Field(
        default=2.0,
        ge=0,
        description="How long comm errors of a generation are gathered before it is re-formed.",
    )
    planner_max_reforms: int = Field(
        default=5, ge=0, description="Re-forms of a job in a row before it is failed."
    )
    planner_reform_backoff_max_s: float = Field(
        default=30.0, ge=0, description="Ceiling of the backoff between re-forms."
    )
    planner_republish_s: float = Field(
        default=1.0, gt=0, description="How often an unanswered plan is published again."
    )
    planner_lease_ttl_s: float = Field(
        default=1.0, gt=0, description="The leader's lease; a standby takes over after it."
    )
    planner_spec_max_age_s: float = Field(
        default=300.0, gt=0, description="Job specs older than this are not acted on."
    )
    planner_spare_wait_s: float = Field(
        default=30.0, ge=0, description="How long a lost rank waits for a spare to appear."
    )
    planner_spawn_timeout_s: float = Field(
        default=120.0, gt=0, description="How long a requested worker has to register."
    )

    # --- scheduler signal --------------------------------------------------------------
    local_cluster: bool = Field(
        default=True, description="Watch the local cluster (`phalanx cluster offer`)."
    )
    cluster_file: Path | None = Field(default=None, description="A JSON file describing a simulated cluster.")
    cluster_poll_s: float = Field(default=0.5, gt=0, description="How often cluster_file is read.")
    cluster_name: str = Field(
        default="k8s", pattern=_PLAIN_NAME, description="The Kubernetes cluster's name in signals."
    )
    k8s: bool = Field(default=False, description="Watch the Kubernetes API also outside a pod.")
    k8s_api: str | None = Field(
        default=None, description="The Kubernetes API server (e.g. kubectl proxy's URL)."
    )
    k8s_namespace: str | None = Field(
        default=None, description="The job's namespace (default: the pod's, else default)."
    )
    k8s_pod_selector: str = Field(default="phalanx.io/job", description="Label selector of the job's pods.")
    k8s_node_selector: str = Field(default="", description="Label selector of the nodes whose slots count.")
    k8s_slot_resource: str = Field(
        default="nvidia.com/gpu", description="The allocatable resource that counts as slots."
    )
    k8s_health_label: str = Field(
        default="phalanx.io/unhealthy", description="Node label that marks a node unhealthy."
    )
    k8s_all_namespaces: bool = Field(default=False, description="Watch pending pods of every namespace.")

    # --- training: collectives, state transfer, data, drains ---------------------------------
    collective_timeout_s: float = Field(default=120.0, gt=0, description="Backstop of every collective.")
    collective_floor_ms: float = Field(
        default=2000.0, gt=0, description="Floor of the learned all-reduce bound."
    )
    collective_factor: float = Field(
        default=4.0, gt=0, description="The all-reduce bound is factor x the slowest recent."
    )
    collective_initial_ms: float = Field(
        default=60000.0, gt=0, description="The all-reduce bound before one completed."
    )
    state_max_bytes: int = Field(
        default=64 << 30, ge=0, description="The largest state buffer a joiner accepts."
    )
    data_cache_dir: Path | None = Field(
        default=None,
        description="Node-local data caches (default /dev/shm/phalanx-data-<uid>, else the temp dir).",
    )
    agent_drain_s: float = Field(
        default=15.0, ge=0, description="How long a closing rank waits for events in flight."
    )
    launcher_drain_s: float = Field(
        default=0.0, ge=0, description="How long a launcher told to stop takes its workers out gracefully."
    )

    # --- checkpoint tiers and keeper -----------------------------------------------------------
    shm_root: Path = Field(
        default=Path("/dev/shm/phalanx"), description="Shared memory of ranks and keepers."
    )
    keeper_node: str | None = Field(
        default=None, description="The keeper's node, where it differs from node."
    )
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
    ckpt_keep_memory: str | None = Field(
        default=None, description="Retention of the memory tier: N or last=N,every=M."
    )
    ckpt_keep_disk: str | None = Field(default=None, description="Retention of the disk tier.")
    ckpt_keep_shared: str | None = Field(default=None, description="Retention of the shared tier.")
    ckpt_keep_object: str | None = Field(default=None, description="Retention of the object tier.")
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
    keeper_min_rate: float = Field(
        default=float(8 << 20),
        gt=0,
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
    ckpt_job_uids: str | None = Field(
        default=None,
        description="The uid each job's ranks run as on this node, job=uid[,job=uid...]; a job not listed"
        " runs as the keeper's uid. The keeper takes slots and registrations of a job only from that uid.",
    )
    ckpt_retry_max_s: float = Field(
        default=300.0, gt=0, description="Longest wait between retries of a failed tier or catalog write."
    )

    # --- telemetry and logging -----------------------------------------------------------------
    log_level: LogLevel | None = Field(
        default=None, description="Log level (unset: INFO, or the program's own default)."
    )
    span_file: Path = Field(
        default=Path(".phalanx/spans.jsonl"), description="Spans as JSON lines, without an OTLP endpoint."
    )
    jaeger_url: str | None = Field(default=None, description="Jaeger's query API, for `phalanx trace`.")

    # --- a worker's hand-off, set by its launcher ----------------------------------------------
    job: str | None = Field(default=None, pattern=_PLAIN_NAME, description="The job's name.")
    worker: str | None = Field(default=None, pattern=_PLAIN_NAME, description="This worker's name.")
    role: Role | None = Field(default=None, description="rank or spare.")
    node: str | None = Field(default=None, description="This node's name (default: the host name).")
    store_addr: str | None = Field(default=None, description="host:port of this node's launcher's store.")
    bind: str | None = Field(default=None, description="The address gloo listens on.")
    launch: str = Field(default="", description="The launcher run's id.")
    local_slot: int = Field(default=0, ge=0, description="The worker's slot on its node; picks its GPU.")
    heartbeat_socket: Path | None = Field(
        default=None, description="The launcher's unix socket for heartbeats (unset: heartbeats go to NATS)."
    )

    # --- fault injection (tests, demo, benchmarks) -------------------------------------------------
    faults: str = Field(
        default="", description="Faults to strike: action:worker@step=N,... (phalanx.runtime.faults)."
    )
    fault_log: Path | None = Field(
        default=None, description="Each fault struck is appended here as a JSON line."
    )

    @field_validator("log_level", mode="before")
    @classmethod
    def _upper(cls, value: Any) -> Any:
        return value.upper() if isinstance(value, str) else value

    @field_validator("ckpt_keep_memory", "ckpt_keep_disk", "ckpt_keep_shared", "ckpt_keep_object")
    @classmethod
    def _retention(cls, value: str | None) -> str | None:
        if value is not None:
            from phalanx.checkpoint.retention import RetentionPolicy

            RetentionPolicy.parse(value)  # ValueError says what is wrong
        return value

    @field_validator("ckpt_job_uids")
    @classmethod
    def _job_uids(cls, value: str | None) -> str | None:
        if value is not None:
            parse_job_uids(value)  # ValueError says what is wrong
        return value

    @field_validator("faults")
    @classmethod
    def _faults(cls, value: str) -> str:
        from phalanx.runtime.faults import FaultPlan

        FaultPlan.parse(value)
        return value


def parse_job_uids(text: str) -> dict[str, int]:
    """``job=uid[,job=uid...]`` (``PHALANX_CKPT_JOB_UIDS``): the uid each job's ranks run
    as on this node, which must own its directories; a ValueError saying what is wrong.

    >>> parse_job_uids("sample=20001, eval=20002")
    {'sample': 20001, 'eval': 20002}
    """
    out: dict[str, int] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        job, sep, uid = part.partition("=")
        if not sep or not _JOB.match(job.strip()) or not uid.strip().isdigit() or job.strip() in out:
            raise ValueError(f"job uids {text!r}: expected 'job=uid[,job=uid...]', got {part!r}")
        out[job.strip()] = int(uid)
    return out


def env_name(field: str) -> str:
    """The environment variable of a :class:`Settings` field."""
    return "NATS_URL" if field in ("nats_url", "NATS_URL") else f"PHALANX_{field.upper()}"


def _explain(exc: ValidationError) -> str:
    lines = []
    for err in exc.errors():
        field = str(err["loc"][0]) if err["loc"] else "?"
        lines.append(f"{env_name(field)}={err.get('input')!r}: {err['msg']}")
    return "bad setting: " + "; ".join(lines)


def _ours(name: str) -> bool:
    upper = name.upper()
    return upper.startswith("PHALANX_") or upper == "NATS_URL"


def get_settings() -> Settings:
    """The process's settings from its environment; :class:`SettingsError` if malformed."""
    return _load(tuple(sorted((k, v) for k, v in os.environ.items() if _ours(k))))


@lru_cache(maxsize=16)
def _load(environ: tuple[tuple[str, str], ...]) -> Settings:
    """``environ`` is the cache key only: ``Settings()`` reads the same from os.environ."""
    try:
        return Settings()
    except ValidationError as exc:
        raise SettingsError(_explain(exc)) from None


def settings_or_exit(program: str) -> Settings:
    """:func:`get_settings` for an entry point: on a bad setting, print
    ``<program>: bad setting: PHALANX_X='-1': ...`` to stderr and exit with status 2."""
    try:
        return get_settings()
    except SettingsError as exc:
        print(f"{program}: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
