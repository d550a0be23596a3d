"""The role table of phalanx.natsauth, checked against an explicit expectation.

The permissions are derived from the wire contract; these tests state, subject by
subject, who must and who must not be able to publish, so a change to the
derivation or to the contract that widens a role fails here. The server's own
enforcement is tested in tests/integration/test_auth.py.
"""

from __future__ import annotations

import stat
from pathlib import Path

import pytest

from phalanx.bus._connection import ENV_NATS_PASSWORD, ENV_NATS_USER, nats_auth_options
from phalanx.bus.subjects import (
    ACK,
    CAPACITY,
    CATALOGUE,
    COMM_ERROR,
    DECISION,
    ERROR,
    EXITED,
    FAILED,
    HEALTH,
    HEARTBEAT,
    HUNG,
    JOB_SPEC,
    JOINED,
    NODE_DIGEST,
    NODE_LOST,
    PLAN,
    PREEMPT,
    RECOVERED,
    REGISTERED,
    Subject,
)
from phalanx.natsauth import ROLES, SERVICES, NatsAuth, Permissions, main, permissions

EXPECTED: dict[str, set[Subject]] = {
    "planner": {PLAN, DECISION, JOINED},
    "detector": {FAILED, HUNG, NODE_LOST},
    "launcher": {JOB_SPEC, EXITED, NODE_DIGEST},
    "rank": {HEARTBEAT, REGISTERED, ACK, COMM_ERROR, RECOVERED, ERROR},  # ERROR: as rank-<worker>
    "scheduler": {CAPACITY, PREEMPT},
    "replication": set(),
    "observer": set(),
    "admin": set(CATALOGUE),
}


def matches(pattern: str, subject: str) -> bool:
    """NATS subject matching: ``*`` one token, ``>`` one or more at the end."""
    p, s = pattern.split("."), subject.split(".")
    for i, tok in enumerate(p):
        if tok == ">":
            return len(s) > i
        if i >= len(s) or (tok != "*" and tok != s[i]):
            return False
    return len(p) == len(s)


def may_publish(perms: Permissions, subject: str) -> bool:
    return any(matches(a, subject) for a in perms.publish_allow) and not any(
        matches(d, subject) for d in perms.publish_deny
    )


def may_subscribe(perms: Permissions, subject: str) -> bool:
    return any(matches(a, subject) for a in perms.subscribe_allow) and not any(
        matches(d, subject) for d in perms.subscribe_deny
    )


def test_the_matcher() -> None:
    assert matches("phalanx.cmd.*.plan", "phalanx.cmd.j1.plan")
    assert not matches("phalanx.cmd.*.plan", "phalanx.cmd.j1.plan.x")
    assert matches("$KV.phalanx_jobs.>", "$KV.phalanx_jobs.j1.plan")
    assert not matches("$KV.phalanx_jobs.>", "$KV.phalanx_jobs")


def test_the_roles_are_the_expected_ones() -> None:
    assert set(ROLES) == set(EXPECTED)


@pytest.mark.parametrize("role", list(EXPECTED))
def test_who_may_publish_each_subject(role: str) -> None:
    perms = permissions(role)
    for subject in CATALOGUE:
        concrete = subject.format(**{p: "x1" for p in subject.params})
        assert may_publish(perms, concrete) == (subject in EXPECTED[role]), (role, concrete)


@pytest.mark.parametrize("role", [r.name for r in ROLES.values() if r.service])
def test_a_service_reports_and_is_probed_only_under_its_own_name(role: str) -> None:
    perms, own = permissions(role), ROLES[role].service
    for service in SERVICES:
        assert may_publish(perms, ERROR.format(service=service)) == (service == own)
        assert may_publish(perms, HEALTH.format(service=service)) == (service == own)
        assert may_subscribe(perms, HEALTH.format(service=service)) == (service == own)
    assert perms.allow_responses  # answers health pings in the asker's inbox


def test_a_rank_cannot_speak_for_a_service() -> None:
    perms = permissions("rank")
    assert may_publish(perms, ERROR.format(service="rank-w3"))
    for service in SERVICES:
        assert not may_publish(perms, ERROR.format(service=service))
        assert not may_subscribe(perms, HEALTH.format(service=service))
    assert not perms.allow_responses


@pytest.mark.parametrize("role", list(EXPECTED))
def test_only_the_planner_writes_the_jobs_bucket(role: str) -> None:
    perms = permissions(role)
    writes = [
        "$KV.phalanx_jobs.j1.plan",
        "$KV.phalanx_jobs.j1.planner",
        "$JS.API.STREAM.PURGE.KV_phalanx_jobs",
        "$JS.API.STREAM.MSG.DELETE.KV_phalanx_jobs",
        "$JS.API.STREAM.DELETE.KV_phalanx_jobs",
    ]
    assert may_publish(perms, writes[0]) == (role in ("planner", "admin"))
    assert may_publish(perms, writes[1]) == (role in ("planner", "admin"))
    for subject in writes[2:]:  # not even the planner: an operator's job
        assert may_publish(perms, subject) == (role == "admin"), (role, subject)
    assert may_publish(perms, "$JS.API.STREAM.UPDATE.KV_phalanx_jobs") == (role in ("planner", "admin"))
    # everybody may read it (a late rank learns the committed plan there)
    assert may_publish(perms, "$JS.API.DIRECT.GET.KV_phalanx_jobs.$KV.phalanx_jobs.j1.plan")
    assert may_publish(perms, "$JS.API.STREAM.INFO.KV_phalanx_jobs")


@pytest.mark.parametrize("role", list(EXPECTED))
def test_consumers_only_on_the_streams_a_role_consumes(role: str) -> None:
    perms = permissions(role)
    pulls = {
        "PHALANX_EVT": may_publish(perms, "$JS.API.CONSUMER.MSG.NEXT.PHALANX_EVT.planner-events"),
        "PHALANX_CMD": may_publish(perms, "$JS.API.CONSUMER.MSG.NEXT.PHALANX_CMD.planner-spec"),
    }
    consumes = role in ("planner", "detector", "replication", "observer", "admin")
    assert pulls == {"PHALANX_EVT": consumes, "PHALANX_CMD": consumes}
    assert may_publish(perms, "$JS.ACK.PHALANX_EVT.planner-events.1.2.3.4.5") == consumes


@pytest.mark.parametrize("role", list(EXPECTED))
def test_replies_come_to_the_users_own_inbox(role: str) -> None:
    perms = permissions(role)
    assert may_subscribe(perms, f"_INBOX.{role}.abc")
    others = [r for r in ROLES if r != role]
    assert all(may_subscribe(perms, f"_INBOX.{o}.abc") == (role == "admin") for o in others)
    assert may_subscribe(perms, "phalanx.cmd.j1.plan") and may_subscribe(perms, "phalanx.hb.j1.w0")


def test_the_client_logs_in_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ENV_NATS_USER, raising=False)
    monkeypatch.delenv(ENV_NATS_PASSWORD, raising=False)
    assert nats_auth_options("nats://127.0.0.1:4222") == {}  # an open server: nothing changes
    assert nats_auth_options("nats://rank:pw@127.0.0.1:4222") == {"inbox_prefix": "_INBOX.rank"}
    monkeypatch.setenv(ENV_NATS_USER, "planner")
    monkeypatch.setenv(ENV_NATS_PASSWORD, "s3cret")
    assert nats_auth_options("nats://rank:pw@127.0.0.1:4222") == {
        "user": "planner",
        "password": "s3cret",
        "inbox_prefix": "_INBOX.planner",
    }


def test_generated_files(tmp_path: Path) -> None:
    assert main(["write", "--config", str(tmp_path / "nats.conf"), "--env-dir", str(tmp_path / "env")]) == 0
    conf = (tmp_path / "nats.conf").read_text()
    envs = sorted(p.name for p in (tmp_path / "env").iterdir())
    assert envs == sorted(f"{r}.env" for r in ROLES)
    for path in [tmp_path / "nats.conf", *(tmp_path / "env").iterdir()]:
        assert stat.S_IMODE(path.stat().st_mode) == 0o600, path
    for line in (tmp_path / "env" / "rank.env").read_text().splitlines():
        key, value = line.split("=", 1)
        assert key in (ENV_NATS_USER, ENV_NATS_PASSWORD)
        assert f'"{value}"' in conf  # the password the server checks
    assert 'listen: "0.0.0.0:4222"' in conf and 'store_dir: "/data"' in conf
    block = NatsAuth.generate().render_config(authorization_only=True, store_dir="/data")
    assert "authorization" in block and "listen" not in block and "jetstream" not in block  # to include
    a, b = NatsAuth.generate(), NatsAuth.generate()
    assert a.env("rank")[ENV_NATS_PASSWORD] != b.env("rank")[ENV_NATS_PASSWORD]  # random per deployment
