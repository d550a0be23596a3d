"""The settings model: defaults, refusal of bad values by name, aliases, and a
service that refuses to start on a bad value."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from phalanx.schemas import Role
from phalanx.settings import Settings, SettingsError, env_name, get_settings, settings_or_exit

NUMERIC = sorted(
    name
    for name, field in Settings.model_fields.items()
    if field.annotation in (int, float, int | None, float | None)
)


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """No PHALANX_* or NATS_URL from the outer environment (the shm root fixture's included)."""
    for k in list(os.environ):
        if k.startswith("PHALANX_") or k == "NATS_URL":
            monkeypatch.delenv(k)


def test_defaults() -> None:
    s = get_settings()
    assert s.nats_url == "nats://127.0.0.1:4222"
    assert (s.heartbeat_ms, s.detector_phi, s.detector_window, s.detector_mass_hold_s) == (
        100.0,
        8.0,
        100,
        10.0,
    )
    assert (s.detector_tick_ms, s.detector_job, s.detector_replica) == (None, None, "")
    assert (s.planner_comm_grace_s, s.planner_max_reforms, s.planner_lease_ttl_s) == (2.0, 5, 1.0)
    assert (s.collective_timeout_s, s.collective_floor_ms, s.state_max_bytes) == (120.0, 2000.0, 64 << 30)
    assert (s.shm_root, s.keeper_host, s.keeper_port, s.ckpt_replicas, s.ckpt_fsync) == (
        Path("/dev/shm/phalanx"),
        "127.0.0.1",
        0,
        1,
        True,
    )
    assert (s.local_slot, s.role, s.job, s.heartbeat_socket, s.faults) == (0, None, None, None, "")
    assert (s.log_level, s.span_file, s.stream_replicas) == (None, Path(".phalanx/spans.jsonl"), 1)
    assert (s.nats_user, s.nats_password.get_secret_value()) == (None, "")
    assert all(f.description for f in Settings.model_fields.values())


def test_values_come_from_the_environment_and_follow_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PHALANX_HEARTBEAT_MS", "50")
    monkeypatch.setenv("PHALANX_ROLE", "spare")
    monkeypatch.setenv("PHALANX_LOG_LEVEL", "debug")
    monkeypatch.setenv("PHALANX_CKPT_FSYNC", "0")
    s = get_settings()
    assert (s.heartbeat_ms, s.role, s.log_level, s.ckpt_fsync) == (50.0, Role.SPARE, "DEBUG", False)
    assert get_settings() is s  # cached while the environment is the same
    monkeypatch.setenv("PHALANX_HEARTBEAT_MS", "20")
    assert get_settings().heartbeat_ms == 20.0
    monkeypatch.setenv("PHALANX_HEARTBEAT_MS", "")  # empty: unset
    assert get_settings().heartbeat_ms == 100.0


def test_nats_url_aliases(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PHALANX_NATS_URL", "nats://b:4222")
    assert get_settings().nats_url == "nats://b:4222"
    monkeypatch.setenv("NATS_URL", "nats://a:4222")
    assert get_settings().nats_url == "nats://a:4222"  # the NATS tools' name wins
    assert env_name("nats_url") == "NATS_URL" and env_name("heartbeat_ms") == "PHALANX_HEARTBEAT_MS"


@pytest.mark.parametrize("bad", ["-1", "lots"])
@pytest.mark.parametrize("field", NUMERIC)
def test_each_numeric_knob_refuses_a_negative_or_malformed_value(
    monkeypatch: pytest.MonkeyPatch, field: str, bad: str
) -> None:
    var = env_name(field)
    monkeypatch.setenv(var, bad)
    with pytest.raises(SettingsError, match=rf"^bad setting: {var}='{bad}': "):
        get_settings()


@pytest.mark.parametrize(
    ("var", "value"),
    [
        ("PHALANX_HEARTBEAT_MS", "0"),
        ("PHALANX_DETECTOR_REPLICA", "a.b"),
        ("PHALANX_DETECTOR_JOB", "j.1"),
        ("PHALANX_ROLE", "leader"),
        ("PHALANX_LOG_LEVEL", "LOUD"),
        ("PHALANX_CKPT_FSYNC", "maybe"),
        ("PHALANX_CKPT_KEEP_DISK", "last=0"),
        ("PHALANX_FAULTS", "explode:w0"),
        ("PHALANX_METRICS_PORT", "70000"),
    ],
)
def test_other_malformed_values_are_refused_by_name(
    monkeypatch: pytest.MonkeyPatch, var: str, value: str
) -> None:
    monkeypatch.setenv(var, value)
    with pytest.raises(SettingsError, match=rf"{var}='{value}'"):
        get_settings()


def test_every_bad_variable_is_named_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PHALANX_HEARTBEAT_MS", "-5")
    monkeypatch.setenv("PHALANX_PLANNER_LEASE_TTL_S", "soon")
    with pytest.raises(SettingsError) as info:
        get_settings()
    assert "PHALANX_HEARTBEAT_MS='-5'" in str(info.value) and "PHALANX_PLANNER_LEASE_TTL_S='soon'" in str(
        info.value
    )


def test_settings_or_exit_prints_one_line_and_exits_2(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("PHALANX_AGENT_DRAIN_S", "-1")
    with pytest.raises(SystemExit) as info:
        settings_or_exit("prog")
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("prog: bad setting: PHALANX_AGENT_DRAIN_S='-1': ") and err.count("\n") == 1


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
