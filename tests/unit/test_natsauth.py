"""The role table of phalanx.natsauth, checked against an explicit expectation.

The permissions are derived from the wire contract; these tests state, subject by
subject, who must and who must not be able to publish, so a change to the
derivation or to the contract that widens a role fails here. The server's own
enforcement is tested in tests/integration/test_auth.py.
"""

from __future__ import annotations

import json
import ssl
import stat
from pathlib import Path

import pytest

from phalanx.bus.auth import (
    ENV_NATS_PASSWORD,
    ENV_NATS_TLS_CA,
    ENV_NATS_TLS_CERT,
    ENV_NATS_TLS_HOSTNAME,
    ENV_NATS_TLS_KEY,
    ENV_NATS_USER,
    nats_auth_options,
)
from phalanx.bus.credentials import (
    ENV_RANK_PASSWORD,
    ENV_RANK_USER,
    ENV_WORKER_CREDENTIALS,
    worker_credentials,
)
from phalanx.contract.permissions import (
    ROLE_OF_PARTY,
    ROLES,
    SERVICES,
    WATCH_SLOTS,
    Permissions,
    permissions,
    received_by,
    user_name,
    watch_names,
)
from phalanx.contract.proto import PARTIES
from phalanx.contract.proto import subject_matches as matches
from phalanx.contract.subjects import (
    ACK,
    CAPACITY,
    CATALOGUE,
    CHECKPOINT,
    COMM_ERROR,
    DECISION,
    DELTA,
    ERROR,
    EXITED,
    FAILED,
    HEALTH,
    HEARTBEAT,
    HUNG,
    INSTANCE_HEALTH,
    JOB_SPEC,
    JOINED,
    NODE_ACK,
    NODE_DIGEST,
    NODE_LOST,
    NODE_PROBE,
    PLAN,
    PREEMPT,
    PROPOSAL,
    RECOVERED,
    REGISTERED,
    SPAWN,
    STEPS,
    Subject,
)
from phalanx.natsauth import NatsAuth, main

EXPECTED: dict[str, set[Subject]] = {
    "planner": {PLAN, DELTA, DECISION, JOINED, SPAWN},
    "detector": {FAILED, HUNG, NODE_LOST, NODE_PROBE},  # NODE_PROBE: a request to a launcher
    "launcher": {JOB_SPEC, EXITED, NODE_DIGEST, NODE_ACK, STEPS, ERROR},  # ERROR: as launcher-<job>-<node>
    "rank": {HEARTBEAT, REGISTERED, ACK, COMM_ERROR, RECOVERED, ERROR},  # ERROR: as rank-<worker>
    "scheduler": {CAPACITY, PREEMPT},
    "policy": {PROPOSAL},
    "replication": {CHECKPOINT},
    "observer": set(),
    "admin": set(CATALOGUE),
}


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
    reports = own in PARTIES[ERROR.pattern][0]  # scheduler-signal takes no input: reports nothing
    assert reports == (own != "scheduler-signal")
    for service in SERVICES:
        assert may_publish(perms, ERROR.format(service=service)) == (service == own and reports)
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
    consumes = role in ("planner", "detector", "replication", "policy", "observer", "admin")
    assert pulls == {"PHALANX_EVT": consumes, "PHALANX_CMD": consumes}
    assert may_publish(perms, "$JS.ACK.PHALANX_EVT.planner-events.1.2.3.4.5") == consumes


@pytest.mark.parametrize("role", list(EXPECTED))
def test_replies_come_to_the_users_own_inbox(role: str) -> None:
    perms = permissions(role)
    assert may_subscribe(perms, f"_INBOX.{role}.abc")
    others = [r for r in ROLES if r != role]
    assert all(may_subscribe(perms, f"_INBOX.{o}.abc") == (role == "admin") for o in others)


@pytest.mark.parametrize("role", [r for r in ROLES if ROLES[r].party])
def test_a_party_may_subscribe_to_what_it_receives_and_nothing_else(role: str) -> None:
    perms, party = permissions(role), ROLES[role].party
    assert party is not None
    for subject in CATALOGUE:
        tokens = {p: "x1" for p in subject.params}
        if subject in (HEALTH, INSTANCE_HEALTH) and ROLES[role].service:
            tokens["service"] = ROLES[role].service or ""
        concrete = subject.format(**tokens)
        assert may_subscribe(perms, concrete) == (subject in received_by(party)), (role, concrete)
    assert not may_subscribe(perms, "phalanx.>") and not may_subscribe(perms, "$KV.phalanx_jobs.j1.plan")


def test_the_observer_reads_everything_and_the_parties_are_the_roles() -> None:
    perms = permissions("observer")
    assert all(may_subscribe(perms, s.format(**{p: "x1" for p in s.params})) for s in CATALOGUE)
    parties = {p for senders, receivers in PARTIES.values() for p in (*senders, *receivers)} - {"operator"}
    assert parties == set(ROLE_OF_PARTY)


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
    assert "accounts" in block and "listen" not in block and "store_dir" not in block  # to include
    a, b = NatsAuth.generate(), NatsAuth.generate()
    assert a.env("rank")[ENV_NATS_PASSWORD] != b.env("rank")[ENV_NATS_PASSWORD]  # random per deployment


# -- per job, per worker -------------------------------------------------------------------
JOB_SENDS: dict[str, set[Subject]] = {
    "launcher": {JOB_SPEC, EXITED, NODE_DIGEST, NODE_ACK, STEPS, ERROR},
    "rank": {HEARTBEAT, REGISTERED, ACK, COMM_ERROR, RECOVERED, ERROR},
}


def _in_job(subject: Subject, job: str, worker: str = "w0") -> str:
    tokens = {
        "job": job,
        "worker": worker,
        "node": "n1",
        "cluster": "c1",
        "service": f"rank-{worker}",
        "instance": "i1",
    }
    return subject.format(**{p: tokens[p] for p in subject.params})


@pytest.mark.parametrize("role", ["launcher", "rank"])
def test_a_jobs_user_publishes_only_into_its_job(role: str) -> None:
    perms = permissions(role, job="j1")
    assert perms == NatsAuth.generate([], jobs={"j1": []}).credentials(role, "j1").permissions()
    for subject in CATALOGUE:
        mine = may_publish(perms, _in_job(subject, "j1"))
        assert mine == (subject in JOB_SENDS[role]), (role, subject.pattern)
        if "job" in subject.params:  # another job's subject: never
            assert not may_publish(perms, _in_job(subject, "j2")), (role, subject.pattern)
    for service in SERVICES:
        assert not may_publish(perms, ERROR.format(service=service))


def test_a_worker_heartbeats_and_reports_only_as_itself() -> None:
    perms = permissions("rank", job="j1", worker="w0")
    assert may_publish(perms, "phalanx.hb.j1.w0")
    assert not may_publish(perms, "phalanx.hb.j1.w1") and not may_publish(perms, "phalanx.hb.j2.w0")
    assert may_publish(perms, "phalanx.err.rank-w0") and not may_publish(perms, "phalanx.err.rank-w1")
    for event in (REGISTERED, ACK, COMM_ERROR, RECOVERED):  # the worker is in the subject: its own only
        assert may_publish(perms, event.format(job="j1", worker="w0"))
        assert not may_publish(perms, event.format(job="j1", worker="w1"))
        assert not may_publish(perms, event.format(job="j2", worker="w0"))
        assert not may_publish(perms, event.wildcard(job="j1"))
    assert not may_publish(perms, PLAN.format(job="j1"))
    assert not may_publish(perms, JOB_SPEC.format(job="j1", node="n1"))
    assert not may_publish(perms, EXITED.format(job="j1", node="n1"))


def test_a_nodes_launcher_speaks_only_for_its_node() -> None:
    auth = NatsAuth.generate([], jobs={"j1": ["a-w0", "a-w1", "b-w0"]})
    users = ["launcher@j1/a", "launcher@j1/b", "rank@j1/a-w0", "rank@j1/a-w1", "rank@j1/b-w0"]
    assert sorted(auth.users) == users
    perms = auth.credentials("launcher", "j1", node="a").permissions()
    assert perms == permissions("launcher", job="j1", node="a")
    for subject in (JOB_SPEC, EXITED, NODE_DIGEST):
        assert may_publish(perms, subject.format(job="j1", node="a")), subject.pattern
        assert not may_publish(perms, subject.format(job="j1", node="b")), subject.pattern
        assert not may_publish(perms, subject.format(job="j2", node="a")), subject.pattern
    # It answers the detector's question about its own node only (a reply needs allow_responses).
    assert may_subscribe(perms, NODE_PROBE.format(job="j1", node="a")) and perms.allow_responses
    assert not may_subscribe(perms, NODE_PROBE.format(job="j1", node="b"))
    assert not may_publish(perms, NODE_PROBE.format(job="j1", node="b"))
    # It is handed its own workers' logins only: never another node's.
    env = auth.launcher_env("j1", "a")
    assert env[ENV_NATS_USER] == "launcher@j1/a"
    assert sorted(json.loads(env["PHALANX_NATS_WORKER_CREDENTIALS"])) == ["a-w0", "a-w1"]
    with pytest.raises(ValueError, match="per-node"):
        permissions("rank", job="j1", node="a")
    # A one-node job (workers w0..): one launcher for the job; explicit nodes must hold every worker.
    assert "launcher@j2" in NatsAuth.generate([], jobs={"j2": ["w0", "w1"]}).users
    one = NatsAuth({}).with_job("j3", ["w0"], ["n"])
    assert one.credentials("rank", "j3", "w0").node == "n" and "launcher@j3/n" in one.users
    with pytest.raises(ValueError, match="on none of the nodes"):
        NatsAuth({}).with_job("j4", ["a-w0", "c-w0"], ["a", "b"])


@pytest.mark.parametrize("role", ["launcher", "rank"])
def test_a_jobs_user_reads_only_its_job(role: str) -> None:
    perms = permissions(role, job="j1", worker="w0" if role == "rank" else None)
    receives = {PLAN} if role == "rank" else {DELTA, DECISION, JOINED, SPAWN, NODE_PROBE}
    for subject in CATALOGUE:
        assert may_subscribe(perms, _in_job(subject, "j1")) == (subject in receives), subject.pattern
        assert not may_subscribe(perms, _in_job(subject, "j2")), subject.pattern
    assert not may_subscribe(perms, "phalanx.cmd.*.plan")  # a wildcard over jobs is refused too
    assert not may_subscribe(perms, "$KV.phalanx_jobs.j1.plan")  # the record: through JetStream only


@pytest.mark.parametrize("role", ["launcher", "rank"])
def test_a_jobs_user_follows_its_record_and_nothing_else_of_jetstream(role: str) -> None:
    perms = permissions(role, job="j1")
    key, other = "$KV.phalanx_jobs.j1.plan", "$KV.phalanx_jobs.j2.plan"
    kv = "KV_phalanx_jobs"
    # its record: read by a direct get that names the key, never by a message get (key in the body)
    assert may_publish(perms, f"$JS.API.STREAM.INFO.{kv}")
    assert may_publish(perms, f"$JS.API.DIRECT.GET.{kv}.{key}")
    assert not may_publish(perms, f"$JS.API.DIRECT.GET.{kv}.{other}")
    assert not may_publish(perms, f"$JS.API.DIRECT.GET.{kv}")  # the form with the subject in the body
    assert not may_publish(perms, f"$JS.API.STREAM.MSG.GET.{kv}")
    # ... and watched by a consumer named with the key (KeyWatch), never nats.py's unnamed one,
    # and only under one of its user's few names (no user can fill the bucket's consumer limit)
    names = watch_names(user_name(role, "j1"))
    assert len(names) == WATCH_SLOTS and not set(names) & set(watch_names(user_name(role, "j2")))
    for w in names:
        assert may_publish(perms, f"$JS.API.CONSUMER.CREATE.{kv}.{w}.{key}")
        assert may_publish(perms, f"$JS.API.CONSUMER.DELETE.{kv}.{w}")  # its own watch, stopped
        assert not may_publish(perms, f"$JS.API.CONSUMER.CREATE.{kv}.{w}.{other}")
        assert not may_publish(perms, f"$JS.API.CONSUMER.CREATE.{kv}.{w}.$KV.phalanx_jobs.>")
        assert not may_publish(perms, f"$JS.API.CONSUMER.CREATE.{kv}.{w}")
    assert not may_publish(perms, f"$JS.API.CONSUMER.CREATE.{kv}.w1.{key}")  # a name of its choosing
    assert not may_publish(perms, f"$JS.API.CONSUMER.DELETE.{kv}.w1")  # nor another's
    assert not may_publish(perms, f"$JS.API.CONSUMER.CREATE.{kv}")
    assert not may_publish(perms, f"$JS.API.CONSUMER.INFO.{kv}.w1")  # nor another's watch consumer
    assert not may_publish(perms, f"$JS.API.CONSUMER.DURABLE.CREATE.{kv}.w1")
    assert not may_publish(perms, key) and not may_publish(perms, f"$JS.API.STREAM.PURGE.{kv}")
    # the event, command, scheduler and error streams: no reads, no consumers, no info
    for stream in ("PHALANX_EVT", "PHALANX_CMD", "PHALANX_SCHED", "PHALANX_ERR"):
        for api in (
            f"STREAM.MSG.GET.{stream}",
            f"DIRECT.GET.{stream}",
            f"DIRECT.GET.{stream}.phalanx.evt.j2.failed",
            f"STREAM.INFO.{stream}",
            f"CONSUMER.CREATE.{stream}",
            f"CONSUMER.CREATE.{stream}.c.phalanx.evt.j1.failed",
            f"CONSUMER.DURABLE.CREATE.{stream}.c",
            f"CONSUMER.MSG.NEXT.{stream}.c",
        ):
            assert not may_publish(perms, f"$JS.API.{api}"), api
    # a launcher creates the topology if it is missing (Bus.connect(ensure=True)); a rank does not
    assert may_publish(perms, "$JS.API.STREAM.CREATE.PHALANX_EVT") == (role == "launcher")


def test_user_names_keep_inboxes_apart() -> None:
    auth = NatsAuth.generate(jobs={"j1": ["w0", "w1"], "j1-w0": [], "j2": []})
    names = list(auth.users)
    assert "rank@j1/w0" in names and "launcher@j1" in names and "rank@j2" in names and "rank" in names
    for a in names:
        assert "." not in a and " " not in a
        for b in names:
            if a != b and a != "admin":  # no user (but admin) may read another's replies
                assert not may_subscribe(auth.users[a].permissions(), f"_INBOX.{b}.x")
    assert user_name("rank", "j1", "w0") == "rank@j1/w0"
    with pytest.raises(ValueError):
        user_name("rank", worker="w0")


def test_job_users_and_what_a_launcher_hands_its_workers() -> None:
    auth = NatsAuth.generate(["planner"], jobs={"j1": ["w0", "w1"]}).with_job("j2")
    assert auth.jobs == ["j1", "j2"]
    env = auth.launcher_env("j1")
    assert env[ENV_NATS_USER] == "launcher@j1" and env[ENV_NATS_PASSWORD]
    assert ENV_RANK_USER not in env  # every worker has its own user
    for w in ("w0", "w1"):
        assert worker_credentials(env[ENV_WORKER_CREDENTIALS], w) == auth.env("rank", "j1", w)
    assert worker_credentials(env[ENV_WORKER_CREDENTIALS], "w9") == {}  # not listed: the rank user
    assert worker_credentials(None, "w0") == {} and worker_credentials("", "w0") == {}
    with pytest.raises(ValueError, match=ENV_WORKER_CREDENTIALS):
        worker_credentials("{not json", "w0")
    with pytest.raises(ValueError, match=ENV_WORKER_CREDENTIALS):
        worker_credentials('{"w0": {"user": "u"}}', "w0")
    env2 = auth.launcher_env("j2")  # no worker list: one rank user for the job
    assert (env2[ENV_RANK_USER], env2[ENV_RANK_PASSWORD]) == tuple(auth.env("rank", "j2").values())
    assert ENV_WORKER_CREDENTIALS not in env2
    with pytest.raises(ValueError, match="already"):
        auth.with_job("j1")
    bad_jobs: list[dict[str, list[str]]] = [{"j.1": []}, {"j1": ["w*"]}, {"j1": ["w0", "w0"]}]
    for bad in bad_jobs:
        with pytest.raises(ValueError):
            NatsAuth.generate([], jobs=bad)
    with pytest.raises(ValueError):
        permissions("planner", job="j1")
    with pytest.raises(ValueError):
        permissions("launcher", job="j1", worker="w0")


def test_the_launcher_gives_each_worker_its_own_login(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Launcher.spawn: a listed worker gets its own user, another the job's rank user."""
    import subprocess
    import tempfile

    from phalanx.contract import Role as WorkerRole
    from phalanx.launcher.launcher import LaunchConfig, Launcher

    auth = NatsAuth.generate([], jobs={"j1": ["w0"]})
    envs: dict[str, dict[str, str]] = {}

    class FakeProc:
        pid = 1

        def __init__(self, cmd: list[str], env: dict[str, str], **kwargs: object) -> None:
            envs[env["PHALANX_WORKER"]] = env

        def wait(self) -> int:
            return 0

        def poll(self) -> int:
            return 0

    monkeypatch.setattr(subprocess, "Popen", FakeProc)
    monkeypatch.setattr(Launcher, "_watch", lambda self, w: None)  # no exit to report
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # the launchers' own directories, never stopped
    env = {**auth.launcher_env("j1"), ENV_RANK_USER: "rank@j1", ENV_RANK_PASSWORD: "pw"}
    launcher = Launcher(LaunchConfig(job="j1", cmd=["true"], nproc=2, env=env))
    launcher.spawn("w0", WorkerRole.RANK)
    launcher.spawn("w1", WorkerRole.RANK)
    assert {k: envs["w0"][k] for k in (ENV_NATS_USER, ENV_NATS_PASSWORD)} == auth.env("rank", "j1", "w0")
    assert (envs["w1"][ENV_NATS_USER], envs["w1"][ENV_NATS_PASSWORD]) == ("rank@j1", "pw")
    for e in envs.values():  # nobody else's credentials travel on
        assert not {ENV_WORKER_CREDENTIALS, ENV_RANK_USER, ENV_RANK_PASSWORD} & e.keys()
    # A worker the deployment has no user for gets no login at all, never the launcher's
    # (which speaks for the whole node: its exits and digests).
    node_env = auth.launcher_env("j1")
    launcher = Launcher(LaunchConfig(job="j1", cmd=["true"], nproc=2, env=node_env))
    launcher.spawn("w7", WorkerRole.SPARE)
    assert ENV_NATS_USER not in envs["w7"] and ENV_NATS_PASSWORD not in envs["w7"]


def test_the_cli_writes_a_jobs_users(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    args = ["write", "--config", str(tmp_path / "nats.conf"), "--env-dir", str(tmp_path / "env")]
    assert main([*args, "--job", "demo:node-a-w0,node-a-w1", "--job", "other"]) == 0
    envs = sorted(p.name for p in (tmp_path / "env").iterdir())
    services = ["admin", "detector", "observer", "planner", "policy", "replication", "scheduler"]
    assert envs == sorted([*(f"{r}.env" for r in services), "launcher-demo-node-a.env", "launcher-other.env"])
    conf = (tmp_path / "nats.conf").read_text()
    for user in (
        "launcher@demo/node-a",
        "rank@demo/node-a-w0",
        "rank@demo/node-a-w1",
        "launcher@other",
        "rank@other",
    ):
        assert f'user: "{user}"' in conf
    assert 'user: "rank"' not in conf and 'user: "launcher"' not in conf  # no user for every job
    lines = dict(
        line.split("=", 1)
        for line in (tmp_path / "env" / "launcher-demo-node-a.env").read_text().splitlines()
    )
    table = json.loads(lines[ENV_WORKER_CREDENTIALS])
    assert sorted(table) == ["node-a-w0", "node-a-w1"] and f'"{table["node-a-w0"]["password"]}"' in conf
    assert stat.S_IMODE((tmp_path / "env" / "launcher-demo-node-a.env").stat().st_mode) == 0o600
    capsys.readouterr()
    assert main(["show", "rank", "--job", "demo", "--worker", "node-a-w0"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert "phalanx.hb.demo.node-a-w0" in shown["publish"]["allow"]
    with pytest.raises(SystemExit):
        main(["show", "planner", "--job", "demo"])


# -- TLS ----------------------------------------------------------------------------------------
def test_tls_from_the_environment_or_a_tls_url(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for k in (ENV_NATS_USER, ENV_NATS_TLS_CA, ENV_NATS_TLS_CERT, ENV_NATS_TLS_KEY, ENV_NATS_TLS_HOSTNAME):
        monkeypatch.delenv(k, raising=False)
    assert "tls" not in nats_auth_options("nats://127.0.0.1:4222")
    opts = nats_auth_options("nats://a:4222,tls://b:4222")
    assert isinstance(opts["tls"], ssl.SSLContext) and opts["tls"].verify_mode == ssl.CERT_REQUIRED
    assert opts["tls"].check_hostname
    monkeypatch.setenv(ENV_NATS_TLS_KEY, str(tmp_path / "client.key"))
    with pytest.raises(ValueError, match=ENV_NATS_TLS_CERT):
        nats_auth_options("nats://127.0.0.1:4222")
    monkeypatch.delenv(ENV_NATS_TLS_KEY)
    monkeypatch.setenv(ENV_NATS_TLS_CA, str(tmp_path / "missing-ca.pem"))
    with pytest.raises(OSError):  # a CA file that is not there is an error, not "no TLS"
        nats_auth_options("nats://127.0.0.1:4222")
    monkeypatch.delenv(ENV_NATS_TLS_CA)
    monkeypatch.setenv(ENV_NATS_TLS_HOSTNAME, "nats.example")
    assert nats_auth_options("tls://127.0.0.1:4222")["tls_hostname"] == "nats.example"
