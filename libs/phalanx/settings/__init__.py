"""Settings per kind of process: each Phalanx process reads the ``PHALANX_*`` variables
it uses, and only those, into one validated model at start.

=====================  =============================  ==========================================
process                model                          entry point
=====================  =============================  ==========================================
failure detector       :class:`DetectorSettings`      ``python -m phalanx.services.failure_detector``
elasticity planner     :class:`PlannerSettings`       ``python -m phalanx.services.elasticity_planner``
state replication      :class:`KeeperSettings`        ``python -m phalanx.services.state_replication``
scheduler signal       :class:`SchedulerSignalSettings`  ``python -m phalanx.services.scheduler_signal``
node launcher          :class:`LauncherSettings`      ``phalanx run``
rank (training)        :class:`RankSettings`          ``phalanx worker`` (started by the launcher)
the ``phalanx`` CLI    :class:`CliSettings`           ``phalanx ...``
=====================  =============================  ==========================================

They share groups by inheritance (:mod:`phalanx.settings.common`: the NATS connection,
stream limits, telemetry, /metrics, the heartbeat interval, the node); library code reads
the group it needs (``load(NatsSettings)``). A negative or malformed value stops the
process at start with one line naming each bad variable and exit status 2, instead of
surfacing later as a confusing failure deep inside a recovery::

    $ PHALANX_HEARTBEAT_MS=-5 python -m phalanx.services.failure_detector
    failure-detector: bad setting: PHALANX_HEARTBEAT_MS='-5': Input should be greater than 0

Field names carry their unit (``heartbeat_interval_ms``) while the variables keep their
names (``PHALANX_HEARTBEAT_MS``); a duration set in ms is read in seconds through one
property (``heartbeat_interval_s``), the one conversion, and travels in seconds from there.

This package imports only :mod:`phalanx.contract` and pydantic: the grammars of the
structured values (the checkpoint tier policy, fault plans, job uids) live in
:mod:`phalanx.settings.parsing` and the checkpoint tiers and the fault injector take
them from there.
"""

from phalanx.settings.cli import CliSettings
from phalanx.settings.common import (
    HeartbeatSettings,
    MetricsSettings,
    NatsSettings,
    NodeSettings,
    ServiceSettings,
    StreamSettings,
    TelemetrySettings,
)
from phalanx.settings.detector import DetectorSettings
from phalanx.settings.keeper import KeeperSettings
from phalanx.settings.launcher import LauncherSettings
from phalanx.settings.loading import PhalanxSettings, SettingsError, env_name, load, load_or_exit
from phalanx.settings.parsing import (
    Fault,
    RetentionPolicy,
    TierPolicy,
    TierRule,
    parse_drain_lanes,
    parse_faults,
    parse_job_uids,
    parse_rates,
)
from phalanx.settings.planner import PlannerSettings
from phalanx.settings.rank import RankSettings
from phalanx.settings.scheduler import SchedulerSignalSettings

PROCESS_KINDS: tuple[type[PhalanxSettings], ...] = (
    DetectorSettings,
    PlannerSettings,
    KeeperSettings,
    SchedulerSignalSettings,
    LauncherSettings,
    RankSettings,
    CliSettings,
)
"""Every process kind's model (the README's settings table and the tests walk it)."""

__all__ = [
    "PROCESS_KINDS",
    "CliSettings",
    "DetectorSettings",
    "Fault",
    "HeartbeatSettings",
    "KeeperSettings",
    "LauncherSettings",
    "MetricsSettings",
    "NatsSettings",
    "NodeSettings",
    "PhalanxSettings",
    "PlannerSettings",
    "RankSettings",
    "RetentionPolicy",
    "SchedulerSignalSettings",
    "ServiceSettings",
    "SettingsError",
    "StreamSettings",
    "TelemetrySettings",
    "TierPolicy",
    "TierRule",
    "env_name",
    "load",
    "load_or_exit",
    "parse_drain_lanes",
    "parse_faults",
    "parse_job_uids",
    "parse_rates",
]
