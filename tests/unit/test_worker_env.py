"""A worker's environment (phalanx.launcher.children.worker_env): the launcher's and the
job's, less every service secret, wherever it came from."""

from __future__ import annotations

import pytest

from phalanx.contract import Role
from phalanx.launcher.children import worker_env
from phalanx.launcher.config import LaunchConfig
from phalanx.settings import KeeperSettings
from phalanx.settings.keeper import SERVICE_SECRET_ENV
from phalanx.telemetry import get_logger


def test_the_keeper_key_never_reaches_a_worker(monkeypatch: pytest.MonkeyPatch) -> None:
    # the operator's shell exported both, as the multi-node recipe leads one to do
    monkeypatch.setenv("PHALANX_KEEPER_KEY", "k" * 40)
    monkeypatch.setenv("PHALANX_KEEPER_KEY_FILE", "/etc/phalanx/keeper.key")
    monkeypatch.setenv("MY_DATA_TOKEN", "the script's own")
    cfg = LaunchConfig(job="j1", cmd=["true"], nproc=2, env={"PHALANX_KEEPER_KEY": "k" * 40})
    log = get_logger(component="test")
    for role in (Role.RANK, Role.SPARE):
        env = worker_env(cfg, "w0", role, 0, {"PHALANX_KEEPER_KEY_FILE": "/x"}, log)
        assert not set(SERVICE_SECRET_ENV) & env.keys()
        assert env["MY_DATA_TOKEN"] == "the script's own"  # what is not Phalanx's travels on


def test_every_secret_setting_of_a_service_is_listed() -> None:
    """A secret field added to the keeper's settings without listing it would reach ranks."""
    secret = {
        name
        for name, field in KeeperSettings.model_fields.items()
        if "key" in name or "SecretStr" in str(field.annotation)
    }
    # the NATS login (a password replaced per worker; a client certificate's key that
    # ranks need as well to reach NATS under mutual TLS): not a service's own secret
    secret -= {"nats_password", "nats_tls_key"}
    assert {f"PHALANX_{name.upper()}" for name in secret} == set(SERVICE_SECRET_ENV)
