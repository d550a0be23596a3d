"""The settings models: one per process kind, defaults, refusal of bad values by name,
aliases, units, and a service that refuses to start on a bad value."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from phalanx.contract import Role
from phalanx.settings import (
    PROCESS_KINDS,
    CliSettings,
    DetectorSettings,
    Fault,
    KeeperSettings,
    LauncherSettings,
    PhalanxSettings,
    PlannerSettings,
    RankSettings,
    RetentionPolicy,
    SchedulerSignalSettings,
    SettingsError,
    TierPolicy,
    env_name,
    load,
    load_or_exit,
)

# (model, field) of every numeric knob of every process kind, once per variable
NUMERIC = sorted(
    {
        env_name(name, model): (model, name)
        for model in PROCESS_KINDS
        for name, field in model.model_fields.items()
        if field.annotation in (int, float, int | None, float | None)
    }.items()
)


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """No PHALANX_* or NATS_URL from the outer environment (the shm root fixture's included)."""
    for k in list(os.environ):
        if k.startswith("PHALANX_") or k == "NATS_URL":
            monkeypatch.delenv(k)


def test_defaults() -> None:
    d = load(DetectorSettings)
    assert d.nats_url == "nats://127.0.0.1:4222"
    assert (d.heartbeat_interval_ms, d.detector_phi, d.detector_window, d.detector_mass_hold_s) == (
        100.0,
        8.0,
        100,
        120.0,
    )
    assert (d.detector_tick_ms, d.detector_job, d.detector_replica) == (None, None, "")
    p = load(PlannerSettings)
    assert (p.planner_comm_grace_s, p.planner_max_reforms, p.planner_lease_ttl_s) == (2.0, 5, 1.0)
    r = load(RankSettings)
    assert (r.collective_timeout_s, r.collective_floor_ms, r.state_max_bytes) == (120.0, 2000.0, 64 << 30)
    assert (r.local_slot, r.role, r.job, r.heartbeat_socket, r.faults) == (0, None, None, None, ())
    k = load(KeeperSettings)
    assert (k.shm_root, k.keeper_host, k.keeper_port, k.ckpt_replicas, k.ckpt_fsync) == (
        Path("/dev/shm/phalanx"),
        "127.0.0.1",
        0,
        1,
        True,
    )
    assert (k.ckpt_job_uids, k.ckpt_tiers, k.tier_policy) == ({}, None, TierPolicy())
    assert r.ckpt_snapshot_every is None
    c = load(CliSettings)
    assert (c.log_level, c.span_file, c.stream_replicas) == (None, Path(".phalanx/spans.jsonl"), 1)
    assert (c.nats_user, c.nats_password.get_secret_value()) == (None, "")
    assert all(f.description for m in PROCESS_KINDS for f in m.model_fields.values())


def test_values_come_from_the_environment_and_follow_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PHALANX_HEARTBEAT_MS", "50")
    monkeypatch.setenv("PHALANX_ROLE", "spare")
    monkeypatch.setenv("PHALANX_LOG_LEVEL", "debug")
    monkeypatch.setenv("PHALANX_CKPT_FSYNC", "0")
    r = load(RankSettings)
    assert (r.heartbeat_interval_ms, r.role, r.log_level) == (50.0, Role.SPARE, "DEBUG")
    assert load(KeeperSettings).ckpt_fsync is False
    assert load(RankSettings) is r  # cached while the environment is the same
    monkeypatch.setenv("PHALANX_HEARTBEAT_MS", "20")
    assert load(RankSettings).heartbeat_interval_ms == 20.0
    monkeypatch.setenv("PHALANX_HEARTBEAT_MS", "")  # empty: unset
    assert load(RankSettings).heartbeat_interval_ms == 100.0


def test_nats_url_aliases(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PHALANX_NATS_URL", "nats://b:4222")
    assert load(CliSettings).nats_url == "nats://b:4222"
    monkeypatch.setenv("NATS_URL", "nats://a:4222")
    assert load(CliSettings).nats_url == "nats://a:4222"  # the NATS tools' name wins
    assert env_name("nats_url", CliSettings) == "NATS_URL"


def test_field_names_carry_units_and_the_variables_keep_theirs(monkeypatch: pytest.MonkeyPatch) -> None:
    assert env_name("heartbeat_interval_ms", DetectorSettings) == "PHALANX_HEARTBEAT_MS"
    assert env_name("kv_max_value_bytes", CliSettings) == "PHALANX_KV_MAX_VALUE_SIZE"
    assert env_name("keeper_min_rate_bytes_per_s", KeeperSettings) == "PHALANX_KEEPER_MIN_RATE"
    assert env_name("detector_digest_slack_ratio", DetectorSettings) == "PHALANX_DETECTOR_DIGEST_SLACK"
    monkeypatch.setenv("PHALANX_HEARTBEAT_MS", "250")
    monkeypatch.setenv("PHALANX_KV_MAX_VALUE_SIZE", str(1 << 20))
    monkeypatch.setenv("PHALANX_KEEPER_MIN_RATE", "1000")
    monkeypatch.setenv("PHALANX_DETECTOR_DIGEST_SLACK", "0.25")
    d = load(DetectorSettings)
    assert (d.heartbeat_interval_ms, d.heartbeat_interval_s, d.detector_digest_slack_ratio) == (
        250.0,
        0.25,
        0.25,
    )
    assert load(CliSettings).kv_max_value_bytes == 1 << 20
    assert load(KeeperSettings).keeper_min_rate_bytes_per_s == 1000.0
    # every process that reads the interval gets the same seconds from the one property
    assert {m.heartbeat_interval_s for m in (d, load(LauncherSettings), load(RankSettings))} == {0.25}


def test_durations_set_in_ms_are_read_in_seconds_once(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PHALANX_DETECTOR_TICK_MS", "20")
    monkeypatch.setenv("PHALANX_STALL_FLOOR_MS", "1500")
    monkeypatch.setenv("PHALANX_COLLECTIVE_FLOOR_MS", "500")
    d = load(DetectorSettings)
    assert (d.detector_tick_s, d.detector_max_lag_s, d.stall_floor_s, d.detector_min_std_s) == (
        0.02,
        None,
        1.5,
        0.02,
    )
    r = load(RankSettings)
    assert (r.collective_floor_s, r.collective_initial_s) == (0.5, 60.0)


def test_structured_values_are_parsed_once_by_the_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PHALANX_CKPT_DISK", "/var/lib/phalanx/ckpt")
    monkeypatch.setenv("PHALANX_CKPT_TIERS", "memory:every=50; disk:every=100,last=2,pin=1000")
    monkeypatch.setenv("PHALANX_CKPT_JOB_UIDS", "a=1001, b=1002")
    monkeypatch.setenv("PHALANX_FAULTS", "kill:w1@step=3")
    k = load(KeeperSettings)
    assert k.ckpt_tiers is not None and k.ckpt_tiers.retention()["disk"] == RetentionPolicy(2, 1000)
    assert k.ckpt_job_uids == {"a": 1001, "b": 1002}
    r = load(RankSettings)
    assert (r.faults, r.ckpt_snapshot_every) == ((Fault("kill", "w1", "step", 3),), 50)


@pytest.mark.parametrize("bad", ["-1", "lots"])
@pytest.mark.parametrize(("var", "model_field"), NUMERIC, ids=[v for v, _ in NUMERIC])
def test_each_numeric_knob_refuses_a_negative_or_malformed_value(
    monkeypatch: pytest.MonkeyPatch, var: str, model_field: tuple[type[PhalanxSettings], str], bad: str
) -> None:
    model, _ = model_field
    monkeypatch.setenv(var, bad)
    with pytest.raises(SettingsError, match=rf"^bad setting: {var}='{bad}': "):
        load(model)


@pytest.mark.parametrize(
    ("model", "var", "value"),
    [
        (DetectorSettings, "PHALANX_HEARTBEAT_MS", "0"),
        (DetectorSettings, "PHALANX_DETECTOR_REPLICA", "a.b"),
        (DetectorSettings, "PHALANX_DETECTOR_JOB", "j.1"),
        (RankSettings, "PHALANX_ROLE", "leader"),
        (CliSettings, "PHALANX_LOG_LEVEL", "LOUD"),
        (KeeperSettings, "PHALANX_CKPT_FSYNC", "maybe"),
        (KeeperSettings, "PHALANX_CKPT_TIERS", "disk:last=0"),
        (KeeperSettings, "PHALANX_CKPT_TIERS", "object:last=3"),  # no PHALANX_CKPT_OBJECT
        (RankSettings, "PHALANX_CKPT_TIERS", "memory:every=0"),
        (KeeperSettings, "PHALANX_CKPT_JOB_UIDS", "a=x"),
        (RankSettings, "PHALANX_FAULTS", "explode:w0"),
        (PlannerSettings, "PHALANX_METRICS_PORT", "70000"),
    ],
)
def test_other_malformed_values_are_refused_by_name(
    monkeypatch: pytest.MonkeyPatch, model: type[PhalanxSettings], var: str, value: str
) -> None:
    monkeypatch.setenv(var, value)
    with pytest.raises(SettingsError, match=rf"{var}='{value}'"):
        load(model)


def test_every_bad_variable_is_named_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PHALANX_HEARTBEAT_MS", "-5")
    monkeypatch.setenv("PHALANX_DETECTOR_PHI", "soon")
    with pytest.raises(SettingsError) as info:
        load(DetectorSettings)
    assert "PHALANX_HEARTBEAT_MS='-5'" in str(info.value) and "PHALANX_DETECTOR_PHI='soon'" in str(info.value)


# A variable that only this kind of process reads: a good value, as read, and a bad one.
OWN: dict[type[PhalanxSettings], tuple[str, str, object, str | None]] = {
    DetectorSettings: ("PHALANX_DETECTOR_PHI", "4", 4.0, "-4"),
    PlannerSettings: ("PHALANX_PLANNER_LEASE_TTL_S", "2", 2.0, "soon"),
    KeeperSettings: ("PHALANX_KEEPER_MAX_FILLS", "3", 3, "0"),
    SchedulerSignalSettings: ("PHALANX_CLUSTER_POLL_S", "2", 2.0, "-1"),
    LauncherSettings: ("PHALANX_LAUNCHER_DRAIN_S", "2", 2.0, "-2"),
    RankSettings: ("PHALANX_AGENT_DRAIN_S", "2", 2.0, "-1"),
    CliSettings: ("PHALANX_JAEGER_URL", "http://j:16686", "http://j:16686", None),
}


@pytest.mark.parametrize("model", PROCESS_KINDS, ids=lambda m: m.__name__)
def test_each_process_kind_loads_its_own_knobs_and_refuses_a_bad_value(
    monkeypatch: pytest.MonkeyPatch, model: type[PhalanxSettings]
) -> None:
    var, good, expected, bad = OWN[model]
    field = next(name for name in model.model_fields if env_name(name, model) == var)
    monkeypatch.setenv(var, good)
    assert getattr(load(model), field) == expected
    # a knob of another kind of process is not this one's business
    others = [m for m in PROCESS_KINDS if field not in m.model_fields]
    assert others, f"{var} is read by every kind of process"
    monkeypatch.setenv("PHALANX_HEARTBEAT_MS", "-5")  # read by the detector, launchers and ranks
    reads_heartbeat = "heartbeat_interval_ms" in model.model_fields
    if reads_heartbeat:
        with pytest.raises(SettingsError, match="PHALANX_HEARTBEAT_MS='-5'"):
            load(model)
    else:
        load(model)  # not read here: no refusal
    monkeypatch.delenv("PHALANX_HEARTBEAT_MS")
    if bad is not None:
        monkeypatch.setenv(var, bad)
        with pytest.raises(SettingsError, match=rf"^bad setting: {var}='{bad}': "):
            load(model)
    monkeypatch.setenv("PHALANX_STREAM_REPLICAS", "0")  # a shared group, checked by those that read it
    if "stream_replicas" in model.model_fields:
        with pytest.raises(SettingsError, match="PHALANX_STREAM_REPLICAS='0'"):
            load(model)


def test_each_kind_reads_only_its_groups() -> None:
    assert "planner_lease_ttl_s" not in DetectorSettings.model_fields
    assert "detector_phi" not in PlannerSettings.model_fields
    assert "keeper_key" not in RankSettings.model_fields and "faults" not in KeeperSettings.model_fields
    assert "metrics_port" not in RankSettings.model_fields  # a rank serves no /metrics
    assert "jaeger_url" in CliSettings.model_fields and "jaeger_url" not in LauncherSettings.model_fields


def test_load_or_exit_prints_one_line_and_exits_2(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("PHALANX_AGENT_DRAIN_S", "-1")
    with pytest.raises(SystemExit) as info:
        load_or_exit(RankSettings, "prog")
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("prog: bad setting: PHALANX_AGENT_DRAIN_S='-1': ") and err.count("\n") == 1


def test_the_settings_import_nothing_above_the_contract() -> None:
    code = (
        "import sys, phalanx.settings; "
        "print(sorted({m.split('.')[1] for m in sys.modules if m.startswith('phalanx.')}))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "['contract', 'settings']"


def test_a_service_refuses_to_start_on_a_bad_setting() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PHALANX_")}
    env["PHALANX_HEARTBEAT_MS"] = "-5"
    proc = subprocess.run(
        [sys.executable, "-m", "phalanx.services.failure_detector"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2, proc.stderr
    assert "failure-detector: bad setting: PHALANX_HEARTBEAT_MS='-5'" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_the_keeper_refuses_to_start_on_a_bad_setting_of_its_own() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PHALANX_")}
    env["PHALANX_CKPT_TIERS"] = "disk:last=0"
    proc = subprocess.run(
        [sys.executable, "-m", "phalanx.services.state_replication"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.startswith("state-replication: bad setting: PHALANX_CKPT_TIERS='disk:last=0'")
    assert proc.stderr.count("\n") == 1


def test_the_readme_says_which_process_reads_each_variable() -> None:
    """Each row of README's settings table names the processes whose model reads its variables."""
    kinds = {
        "detector": DetectorSettings,
        "planner": PlannerSettings,
        "keeper": KeeperSettings,
        "scheduler-signal": SchedulerSignalSettings,
        "launcher": LauncherSettings,
        "rank": RankSettings,
        "CLI": CliSettings,
    }
    readme = (Path(__file__).parents[2] / "README.md").read_text()
    table = readme[readme.index("| variable | default | read by | meaning |") :].split("\n\n")[0]
    checked = 0
    for row in table.splitlines()[2:]:
        variables, _, read_by, _ = row.strip("| ").split(" | ", 3)
        for var in re.findall(r"`((?:PHALANX_[A-Z0-9_]+[A-Z0-9])|NATS_URL)`", variables):
            readers = {
                name
                for name, model in kinds.items()
                if any(env_name(f, model) == var for f in model.model_fields)
            }
            assert readers, f"{var} is read by no process's settings"
            expected = set(kinds) if read_by == "all" else set(read_by.split(", "))
            assert readers == expected, f"README: {var} read by {read_by!r}; the models: {sorted(readers)}"
            checked += 1
    assert checked > 30
