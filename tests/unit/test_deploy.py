"""deploy/ agrees with the code: modules, service names, versions, files.

The structural YAML checks need PyYAML and the schema checks kubernetes-validate
(both in the ``test`` extra): they are skipped with that reason where those are
not installed. The text checks always run. Nothing here needs a Docker engine or
a Kubernetes cluster: the manifests are validated offline against the API
schemas kubernetes-validate bundles (and built with `kubectl kustomize` where
kubectl is installed); the compose file's structure is checked explicitly.
"""

from __future__ import annotations

import copy
import importlib.util
import json
import os
import re
import shlex
import shutil
import socket
import subprocess
import tomllib
from pathlib import Path
from typing import Any

import pytest
from phalanx.services.scheduler_signal.sources import ClusterFile

from phalanx import natsauth
from phalanx.bus._connection import ENV_NATS_PASSWORD, ENV_NATS_USER
from phalanx.natsauth import ENV_WORKER_CREDENTIALS, ROLE_OF_SERVICE
from phalanx.natsserver import find_binary
from phalanx.runtime.launcher import worker_names

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
K8S = DEPLOY / "k8s"
SERVICES = {
    "failure-detector": "failure_detector",
    "scheduler-signal": "scheduler_signal",
    "elasticity-planner": "elasticity_planner",
    "state-replication": "state_replication",
}
NODES = ("node-a", "node-b")  # the "node" containers of the sample job in compose
YAML_FILES = sorted([DEPLOY / "docker-compose.yml", *K8S.glob("*.yaml")])


def _text(path: Path) -> str:
    return path.read_text()


# -- text checks (always) --------------------------------------------------------------
def test_every_service_module_named_in_deploy_exists() -> None:
    named: set[str] = set()
    for path in YAML_FILES:
        named |= set(re.findall(r"phalanx\.services\.([a-z_]+)", _text(path)))
    assert named == set(SERVICES.values())
    for module in named:
        assert importlib.util.find_spec(f"phalanx.services.{module}.__main__") is not None, module


def test_health_probes_ask_the_right_service() -> None:
    compose = _text(DEPLOY / "docker-compose.yml")
    probed = re.findall(r'\*ping, "([a-z-]+)"', compose)
    assert sorted(probed) == sorted(SERVICES)
    services = _text(K8S / "services.yaml")
    probed_k8s = re.findall(r'"/etc/phalanx/probe/ping.py", "([a-z-]+)"', services)
    assert sorted(set(probed_k8s)) == sorted(SERVICES) and len(probed_k8s) == 2 * len(SERVICES)
    # each probe sits in the block that runs that service's module
    for block in re.split(r"\n---\n", services):
        modules = re.findall(r"phalanx\.services\.([a-z_]+)", block)
        names = set(re.findall(r'ping.py", "([a-z-]+)"', block))
        if modules:
            assert names == {n for n, m in SERVICES.items() if m == modules[0]}


def test_image_installs_the_torch_the_project_pins() -> None:
    dockerfile = _text(DEPLOY / "Dockerfile")
    assert re.search(r"^FROM python:3\.11-slim$", dockerfile, re.M)
    pinned = [
        d
        for d in tomllib.loads(_text(ROOT / "pyproject.toml"))["project"]["dependencies"]
        if d.startswith("torch")
    ]
    assert pinned == ["torch==2.13.0"]
    assert "--index-url https://download.pytorch.org/whl/cpu torch==2.13.0" in dockerfile
    assert "pip install ." in dockerfile


def test_kustomization_lists_every_manifest() -> None:
    listed = set(re.findall(r"^  - ([\w.-]+\.yaml)$", _text(K8S / "kustomization.yaml"), re.M))
    assert listed == {p.name for p in K8S.glob("*.yaml")} - {"kustomization.yaml"}


def test_the_compose_cluster_file_is_valid() -> None:
    state = ClusterFile.model_validate_json(_text(DEPLOY / "cluster" / "cluster.json"))
    assert state.available_slots > 0


def test_the_sample_job_is_the_documented_one() -> None:
    # one launcher per node: the same training command in compose and Kubernetes
    node_cmd = '"--", "python", "-m", "examples.train_gpt", "--steps", "200"'
    assert _text(DEPLOY / "docker-compose.yml").count(node_cmd) == 2
    k8s = _text(K8S / "training-job.yaml")
    assert re.search(r"- --\n\s+- python\n\s+- -m\n\s+- examples\.train_gpt\n\s+- --steps\n", k8s)
    # the one-launcher form stays in compose, behind a profile
    assert (
        '"phalanx", "run", "--nproc", "4", "--spares", "1", "--", "python", "examples/train_gpt.py"'
        in _text(DEPLOY / "docker-compose.yml")
    )
    assert (ROOT / "examples" / "train_gpt.py").exists()
    assert importlib.util.find_spec("examples.train_gpt") is not None


# -- YAML structure (PyYAML) --------------------------------------------------------------
def _yaml() -> Any:
    return pytest.importorskip("yaml", reason="PyYAML is not installed (not a project dependency)")


@pytest.mark.parametrize("path", YAML_FILES, ids=lambda p: p.name)
def test_yaml_parses(path: Path) -> None:
    yaml = _yaml()
    docs = [d for d in yaml.safe_load_all(_text(path)) if d is not None]
    assert docs


def test_kubernetes_objects_are_complete() -> None:
    yaml = _yaml()
    cluster_scoped = {"Namespace", "ClusterRole", "ClusterRoleBinding"}
    kinds: dict[str, set[str]] = {}
    for path in K8S.glob("*.yaml"):
        if path.name == "kustomization.yaml":
            continue
        for doc in yaml.safe_load_all(_text(path)):
            if doc is None:
                continue
            assert doc.get("apiVersion") and doc.get("kind"), path
            name = doc["metadata"]["name"]
            kinds.setdefault(doc["kind"], set()).add(name)
            if doc["kind"] not in cluster_scoped:
                assert doc["metadata"].get("namespace") == "phalanx", (path, name)
            spec = doc.get("spec", {})
            if "selector" in spec and "template" in spec:
                labels = spec["template"]["metadata"]["labels"]
                assert spec["selector"]["matchLabels"].items() <= labels.items(), (path, name)
    assert kinds["StatefulSet"] == {"nats"}
    assert kinds["Deployment"] == {"failure-detector", "scheduler-signal", "elasticity-planner", "jaeger"}
    assert kinds["DaemonSet"] == {"state-replication"}
    assert kinds["Job"] == {"train-demo"}
    assert kinds["PodDisruptionBudget"] == {"train-demo"}
    assert kinds["Service"] >= {"nats", "nats-headless", "jaeger", "train-demo"}
    assert {"ServiceAccount", "ClusterRole", "ClusterRoleBinding"} <= kinds.keys()


def test_nats_statefulset_is_a_three_node_jetstream_cluster() -> None:
    yaml = _yaml()
    docs = list(yaml.safe_load_all(_text(K8S / "nats.yaml")))
    sts = next(d for d in docs if d["kind"] == "StatefulSet")
    assert sts["spec"]["replicas"] == 3 and sts["spec"]["serviceName"] == "nats-headless"
    conf = next(d for d in docs if d["kind"] == "ConfigMap")["data"]["nats.conf"]
    assert "jetstream" in conf
    assert len(re.findall(r"nats://nats-\d\.nats-headless\.phalanx\.svc\.cluster\.local:6222", conf)) == 3
    headless = next(d for d in docs if d["kind"] == "Service" and d["metadata"]["name"] == "nats-headless")
    assert headless["spec"]["clusterIP"] == "None"


def test_scheduler_signal_may_watch_nodes_and_pods() -> None:
    yaml = _yaml()
    docs = list(yaml.safe_load_all(_text(K8S / "rbac.yaml")))
    role = next(d for d in docs if d["kind"] == "ClusterRole")
    granted = {(res, verb) for rule in role["rules"] for res in rule["resources"] for verb in rule["verbs"]}
    assert {(r, v) for r in ("nodes", "pods") for v in ("list", "watch")} <= granted
    binding = next(d for d in docs if d["kind"] == "ClusterRoleBinding")
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": "scheduler-signal", "namespace": "phalanx"}
    ]
    services = list(yaml.safe_load_all(_text(K8S / "services.yaml")))
    deploy = next(d for d in services if d["metadata"]["name"] == "scheduler-signal")
    assert deploy["spec"]["template"]["spec"]["serviceAccountName"] == "scheduler-signal"


def test_compose_wires_nats_jaeger_and_the_services() -> None:
    yaml = _yaml()
    compose = yaml.safe_load(_text(DEPLOY / "docker-compose.yml"))
    services = compose["services"]
    assert set(services) == {"nats", "jaeger", "train", *NODES, *SERVICES}
    assert services["nats"]["command"] == ["nats-server", "--config", "/etc/nats/nats.conf"]
    assert "nats-data:/data" in services["nats"]["volumes"]  # the store dir of the generated config
    assert services["jaeger"]["environment"]["COLLECTOR_OTLP_ENABLED"] == "true"
    assert {"16686:16686", "4318:4318"} <= set(services["jaeger"]["ports"])
    for name, module in SERVICES.items():
        svc = services[name]
        assert svc["command"] == ["python", "-m", f"phalanx.services.{module}"]
        assert svc["environment"]["NATS_URL"] == "nats://nats:4222"
        assert svc["environment"]["OTEL_EXPORTER_OTLP_ENDPOINT"] == "http://jaeger:4318"
        assert svc["healthcheck"]["test"][-1] == name
        assert svc["depends_on"]["nats"]["condition"] == "service_healthy"


# -- Kubernetes: every manifest against the API schemas, offline (kubernetes-validate) ----
# The oldest Kubernetes the manifests are written for, and the newest schemas the
# installed kubernetes-validate bundles. Strict: unknown fields are errors, as
# `kubectl apply --validate=strict` would make them.
K8S_MIN_VERSION = "1.28"
K8S_VERSIONS = (K8S_MIN_VERSION, "latest")
K8S_MANIFESTS = sorted(p for p in K8S.glob("*.yaml") if p.name != "kustomization.yaml")
COMPLETION_INDEX_ANNOTATION = "batch.kubernetes.io/job-completion-index"
NODE_ID = re.compile(r"^[A-Za-z0-9_-]{1,64}$")  # what a launcher accepts as --node-id


def _kubernetes_validate() -> Any:
    return pytest.importorskip(
        "kubernetes_validate", reason="kubernetes-validate is not installed (pip install -e .[test])"
    )


def _docs(path: Path) -> list[dict[str, Any]]:
    yaml = _yaml()
    return [d for d in yaml.safe_load_all(_text(path)) if d is not None]


@pytest.fixture
def no_network(monkeypatch: pytest.MonkeyPatch) -> None:
    """Any connection or name lookup from this process fails the test."""

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError(f"network access in an offline test: {args[1:]!r}")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket.socket, "connect_ex", refuse)
    monkeypatch.setattr(socket, "getaddrinfo", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)


def _validate_strict(kv: Any, doc: dict[str, Any], version: str, where: str) -> str:
    """The Kubernetes version validated against; fails the test with one line (not
    the whole schema) when ``doc`` does not validate."""
    what = f"{where} {doc.get('kind')}/{doc.get('metadata', {}).get('name')} (Kubernetes {version})"
    try:
        return str(kv.validate(doc, version, strict=True))
    except kv.ValidationError as e:
        problem = f"{'.'.join(str(p) for p in e.path)}: {e.message}"
    except kv.SchemaNotFoundError as e:
        problem = e.message
    pytest.fail(f"{what}: {problem}", pytrace=False)


@pytest.mark.parametrize("version", K8S_VERSIONS)
@pytest.mark.parametrize("path", K8S_MANIFESTS, ids=lambda p: p.name)
def test_kubernetes_manifest_is_valid_for_the_api_server(path: Path, version: str, no_network: None) -> None:
    kv = _kubernetes_validate()
    version = kv.latest_version() if version == "latest" else version
    docs = _docs(path)
    assert docs
    for doc in docs:
        assert _validate_strict(kv, doc, version, path.name) == re.sub(r"^(\d+\.\d+).*", r"\1", version)


def test_strict_validation_catches_what_the_api_server_would_refuse(no_network: None) -> None:
    """The schema check is not vacuous: a misspelt field, a wrong type and a missing
    required field in the training Job are each refused."""
    kv = _kubernetes_validate()
    job = _training()[0]
    misspelt = copy.deepcopy(job)
    misspelt["spec"]["template"]["spec"]["containers"][0]["comand"] = ["phalanx"]
    wrong_type = copy.deepcopy(job)
    wrong_type["spec"]["completions"] = "two"
    missing = copy.deepcopy(job)
    del missing["spec"]["template"]["spec"]["containers"][0]["name"]
    for bad in (misspelt, wrong_type, missing):
        with pytest.raises(kv.ValidationError):
            kv.validate(bad, K8S_MIN_VERSION, strict=True)
    with pytest.raises(kv.SchemaNotFoundError):  # an unknown kind is an error, not a pass
        kv.validate({**job, "kind": "Jobb"}, K8S_MIN_VERSION, strict=True)


def test_kustomization_builds_every_manifest() -> None:
    # kubernetes-validate has no schema for a Kustomization: checked by hand, and
    # built with `kubectl kustomize` (offline) where kubectl is installed.
    kustomization = _docs(K8S / "kustomization.yaml")[0]
    assert kustomization["apiVersion"] == "kustomize.config.k8s.io/v1beta1"
    assert kustomization["kind"] == "Kustomization" and kustomization["namespace"] == "phalanx"
    assert sorted(kustomization["resources"]) == sorted(p.name for p in K8S_MANIFESTS)
    images = {
        c["image"].split(":")[0]
        for path in K8S_MANIFESTS
        for doc in _docs(path)
        for c in doc.get("spec", {}).get("template", {}).get("spec", {}).get("containers", [])
    }
    assert {i["name"] for i in kustomization["images"]} <= images
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not installed: kustomization.yaml checked by hand only")
    out = subprocess.run(
        [kubectl, "kustomize", str(K8S)], capture_output=True, text=True, timeout=60, check=True
    ).stdout
    yaml = _yaml()
    built = [d for d in yaml.safe_load_all(out) if d]
    expected = [d for p in K8S_MANIFESTS for d in _docs(p)]
    assert sorted((d["kind"], d["metadata"]["name"]) for d in built) == sorted(
        (d["kind"], d["metadata"]["name"]) for d in expected
    )
    kv = _kubernetes_validate()
    for doc in built:
        _validate_strict(kv, doc, K8S_MIN_VERSION, "kubectl kustomize")


# -- Kubernetes: one pod per node --------------------------------------------------------
def _training() -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """The training Job, its headless Service and its PodDisruptionBudget."""
    docs = _docs(K8S / "training-job.yaml")
    by_kind = {d["kind"]: d for d in docs}
    assert sorted(by_kind) == sorted(d["kind"] for d in docs) == ["Job", "PodDisruptionBudget", "Service"]
    return by_kind["Job"], by_kind["Service"], by_kind["PodDisruptionBudget"]


def _run_flags(command: list[str]) -> tuple[dict[str, str], list[str]]:
    """`phalanx run --flag value ... -- training command` -> ({flag: value}, command)."""
    assert command[:2] == ["phalanx", "run"], command
    sep = command.index("--")
    flags, words = {}, iter(command[2:sep])
    for flag in words:
        assert flag.startswith("--") and flag not in flags, (flag, command)
        flags[flag] = next(words)
    return flags, command[sep + 1 :]


def _nnodes(value: str) -> tuple[int, int]:
    lo, _, hi = value.partition(":")
    return int(lo), int(hi or lo)


def _train_container(job: dict[str, Any]) -> dict[str, Any]:
    (container,) = job["spec"]["template"]["spec"]["containers"]
    return container


def _env(container: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {e["name"]: e for e in container.get("env", [])}


def _refs(value: str) -> list[str]:
    return re.findall(r"\$\((\w+)\)", value)


PER_NODE_FLAGS = {
    "--nnodes",
    "--node-id",
    "--nproc-per-node",
    "--spares-per-node",
    "--job",
    "--rdzv-endpoint",
    "--bind",
    "--min-nproc",
}


def test_training_runs_one_pod_per_node_as_an_indexed_job() -> None:
    job, service, _ = _training()
    spec, pod = job["spec"], job["spec"]["template"]["spec"]
    assert spec["completionMode"] == "Indexed"
    nodes = spec["completions"]
    assert spec["parallelism"] == nodes >= 2
    assert pod["restartPolicy"] == "Never"
    # headless Service: the pods' subdomain, selecting exactly them
    assert service["spec"]["clusterIP"] == "None"
    assert pod["subdomain"] == service["metadata"]["name"]
    assert "hostname" not in pod  # an Indexed Job names each pod's host <job>-<index>
    labels = job["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= labels.items()
    container = _train_container(job)
    flags, training = _run_flags(container["command"])
    assert PER_NODE_FLAGS <= flags.keys()
    lo, hi = _nnodes(flags["--nnodes"])
    assert lo == hi == nodes  # generation 1 waits for every pod (later nodes only bring spares)
    assert int(flags["--nproc-per-node"]) >= 1 and int(flags["--spares-per-node"]) >= 0
    assert flags["--job"] == labels["phalanx.io/job"] == _env(container)["PHALANX_JOB"]["value"]
    assert training[:3] == ["python", "-m", "examples.train_gpt"]
    # --bind is the pod IP (downward API)
    (bind_var,) = _refs(flags["--bind"])
    assert flags["--bind"] == f"$({bind_var})"
    assert _env(container)[bind_var]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    resources = container["resources"]
    assert {"cpu", "memory"} <= resources["requests"].keys() and "memory" in resources["limits"]


def test_node_ids_are_unique_per_pod_and_stable_for_its_index() -> None:
    job, service, _ = _training()
    container = _train_container(job)
    template = _run_flags(container["command"])[0]["--node-id"]
    env = _env(container)
    refs = _refs(template)
    assert refs, "the node id must come from the completion index"
    for var in refs:  # $(VAR) expands only variables of the container's env
        if var == "JOB_COMPLETION_INDEX":  # set by the Job controller itself
            continue
        field = env[var]["valueFrom"]["fieldRef"]["fieldPath"]
        assert field == f"metadata.annotations['{COMPLETION_INDEX_ANNOTATION}']", (var, field)
    ids = [re.sub(r"\$\(\w+\)", str(i), template) for i in range(job["spec"]["completions"])]
    assert len(set(ids)) == len(ids)
    assert all(NODE_ID.match(i) for i in ids), ids
    # the node id is the pod's hostname, so <node id>.<service> is its DNS name
    assert ids == [f"{job['metadata']['name']}-{i}" for i in range(len(ids))]
    assert service["metadata"]["name"] == job["spec"]["template"]["spec"]["subdomain"]


def test_rdzv_endpoint_is_the_nats_service() -> None:
    job, _, _ = _training()
    container = _train_container(job)
    endpoint = _run_flags(container["command"])[0]["--rdzv-endpoint"]
    host, _, port = endpoint.rpartition(":")
    nats = next(
        d for d in _docs(K8S / "nats.yaml") if d["kind"] == "Service" and d["metadata"]["name"] == "nats"
    )
    assert host == f"nats.{nats['metadata']['namespace']}.svc.cluster.local"
    assert int(port) in {p["port"] for p in nats["spec"]["ports"]}
    env_map = next(
        d
        for d in _docs(K8S / "services.yaml")
        if d["kind"] == "ConfigMap" and d["metadata"]["name"] == "phalanx-env"
    )
    assert {"configMapRef": {"name": "phalanx-env"}} in container["envFrom"]
    assert env_map["data"]["NATS_URL"] == f"nats://{endpoint}"


def test_disruption_budget_keeps_the_minimum_of_nodes() -> None:
    job, _, pdb = _training()
    labels = job["spec"]["template"]["metadata"]["labels"]
    assert pdb["spec"]["selector"]["matchLabels"].items() <= labels.items()
    # Job pods have no scale subresource: only an integer minAvailable works for them
    assert "maxUnavailable" not in pdb["spec"]
    flags = _run_flags(_train_container(job)["command"])[0]
    per_node, min_world = int(flags["--nproc-per-node"]), int(flags["--min-nproc"])
    # the nodes whose ranks the job can shrink to: evictions down to them, never below
    needed = -(-min_world // per_node)
    assert pdb["spec"]["minAvailable"] == needed < job["spec"]["completions"]


def _expand(word: str, env: dict[str, str]) -> str:
    """Kubernetes' $(VAR) expansion of a command word."""
    return re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], word)


def _node_commands() -> dict[str, list[str]]:
    """Every `phalanx run` of deploy/, $(VAR)s of the pod spec filled in as a pod would."""
    services = _compose()["services"]
    commands = {f"compose {n}": services[n]["command"] for n in (*NODES, "train")}
    job = _training()[0]
    for i in range(job["spec"]["completions"]):
        filled = {"POD_IP": f"10.0.0.{i + 1}", "PHALANX_NODE_INDEX": str(i), "JOB_COMPLETION_INDEX": str(i)}
        commands[f"k8s index {i}"] = [_expand(w, filled) for w in _train_container(job)["command"]]
    return commands


def test_node_commands_parse_with_the_phalanx_cli(monkeypatch: pytest.MonkeyPatch) -> None:
    """The real `phalanx` argument parser accepts every launcher command of deploy/."""
    from phalanx import cli

    parsed: list[Any] = []
    monkeypatch.setattr(cli, "_cmd_run", lambda args: parsed.append(args) or 0)
    for where, command in _node_commands().items():
        assert command[0] == "phalanx", where
        assert cli.main(command[1:]) == 0, where
        args = parsed.pop()
        flags, training = _run_flags(command)
        assert args.nproc == int(flags.get("--nproc-per-node", flags.get("--nproc", "0"))), where
        assert [w for w in args.cmd if w != "--"] == training, where
        if "--nnodes" in flags:
            assert (args.node_id, args.rdzv_endpoint, args.job) == (
                flags["--node-id"],
                flags["--rdzv-endpoint"],
                flags["--job"],
            ), where
            assert NODE_ID.match(args.node_id), where


# -- Compose: two "node" containers -----------------------------------------------------
# No JSON schema of the Compose Specification ships in a PyPI package (checked:
# compose-spec and compose-pydantic carry parsers, not the schema), and there is
# no `docker compose` here: the structure is checked explicitly below.
COMPOSE_TOP_LEVEL = {"name", "services", "volumes", "networks", "configs", "secrets", "include", "version"}
COMPOSE_SERVICE_KEYS = {
    "build", "command", "container_name", "depends_on", "deploy", "entrypoint", "env_file",
    "environment", "expose", "extra_hosts", "healthcheck", "hostname", "image", "init", "labels",
    "logging", "networks", "ports", "profiles", "restart", "secrets", "shm_size", "stop_grace_period",
    "stop_signal", "ulimits", "user", "volumes", "working_dir",
}  # fmt: skip
COMPOSE_HEALTHCHECK_KEYS = {
    "test",
    "interval",
    "timeout",
    "retries",
    "start_period",
    "start_interval",
    "disable",
}
COMPOSE_CONDITIONS = {"service_started", "service_healthy", "service_completed_successfully"}
COMPOSE_RESTART = {"no", "always", "on-failure", "unless-stopped"}


def _compose() -> dict[str, Any]:
    return _docs(DEPLOY / "docker-compose.yml")[0]


def test_compose_file_structure() -> None:
    compose = _compose()
    assert {k for k in compose if not k.startswith("x-")} <= COMPOSE_TOP_LEVEL
    services, volumes = compose["services"], compose.get("volumes") or {}
    default = {n for n, s in services.items() if not s.get("profiles")}
    for name, svc in services.items():
        assert re.match(r"^[a-zA-Z0-9._-]+$", name)
        assert set(svc) <= COMPOSE_SERVICE_KEYS, (name, set(svc) - COMPOSE_SERVICE_KEYS)
        assert "image" in svc or "build" in svc, name
        assert str(svc.get("restart", "no")) in COMPOSE_RESTART, name
        if "command" in svc:
            assert isinstance(svc["command"], list) and all(isinstance(w, str) for w in svc["command"])
        env = svc.get("environment", {})
        assert isinstance(env, dict) and all(isinstance(v, str) for v in env.values()), name
        if "healthcheck" in svc:
            assert set(svc["healthcheck"]) <= COMPOSE_HEALTHCHECK_KEYS, name
        for dep, cond in svc.get("depends_on", {}).items():
            assert dep in services and set(cond) <= {"condition", "restart", "required"}, (name, dep)
            assert cond["condition"] in COMPOSE_CONDITIONS, (name, dep)
            if cond["condition"] == "service_healthy":
                assert "healthcheck" in services[dep], (name, dep)
            if name in default:  # a service started by default waits only on such services
                assert dep in default, (name, dep)
        for mount in svc.get("volumes", []):
            source = mount.split(":")[0]
            if not source.startswith((".", "/")):
                assert source in volumes, (name, source)


def test_compose_runs_the_sample_job_on_two_node_containers() -> None:
    services = _compose()["services"]
    runs = {n: _run_flags(services[n]["command"]) for n in NODES}
    ids = [flags["--node-id"] for flags, _ in runs.values()]
    assert ids == [services[n]["hostname"] for n in NODES] and len(set(ids)) == len(NODES)
    assert all(NODE_ID.match(i) for i in ids)
    # the same job and settings on every node: only --node-id differs
    shared = [({k: v for k, v in flags.items() if k != "--node-id"}, cmd) for flags, cmd in runs.values()]
    assert all(s == shared[0] for s in shared)
    flags, training = shared[0]
    assert PER_NODE_FLAGS - {"--bind", "--node-id"} <= flags.keys()  # --bind: detected in compose
    assert _nnodes(flags["--nnodes"]) == (len(NODES), len(NODES))
    # a lost node leaves the other's ranks, enough to keep training
    assert int(flags["--min-nproc"]) <= (len(NODES) - 1) * int(flags["--nproc-per-node"])
    assert training[:3] == ["python", "-m", "examples.train_gpt"]
    assert flags["--rdzv-endpoint"] == "nats:4222" and "4222:4222" in services["nats"]["ports"]
    data = set()
    for name in NODES:
        svc = services[name]
        assert svc["environment"]["NATS_URL"] == f"nats://{flags['--rdzv-endpoint']}"
        assert "profiles" not in svc and svc["restart"] == "no"
        for dep in ("nats", "elasticity-planner", "failure-detector"):
            assert svc["depends_on"][dep]["condition"] == "service_healthy", (name, dep)
        data |= {m for m in svc["volumes"] if m.endswith(":/app/data")}
    assert len(data) == len(NODES)  # each node its own data volume
    # the one-launcher form is kept for `--profile single-node`, under another job id
    train = services["train"]
    assert train["profiles"] == ["single-node"] and train["environment"]["PHALANX_JOB"] != flags["--job"]


# -- NATS authorization: on by default in both ----------------------------------------------
# These files cannot run here (no Docker, no Kubernetes): what is checked is that the
# documented commands write every file and Secret the deployments refer to, that every
# process gets a login of its own role (each job's launcher: its job's, with one per
# worker it starts), and that nats-server itself accepts the resulting configurations
# (`nats-server -t`, the binary the tests use).
def _documented(text: str, start: str) -> list[str]:
    """The shell command beginning with ``start`` in ``text`` (comments, continuations joined)."""
    lines = [re.sub(r"^\s*#?\s*", "", line) for line in text.splitlines()]
    at = next(i for i, line in enumerate(lines) if line.startswith(start))
    words = []
    for line in lines[at:]:
        words.append(line.rstrip("\\ "))
        if not line.rstrip().endswith("\\"):
            break
    return shlex.split(" ".join(words))


def _write(command: list[str], tmp: Path) -> None:
    """Run a documented ``python -m phalanx.natsauth write ...``, into ``tmp`` instead of deploy/secrets."""
    assert command[:4] == ["python", "-m", "phalanx.natsauth", "write"], command
    assert natsauth.main([w.replace("deploy/secrets", str(tmp)) for w in command[3:]]) == 0


def _env_file(path: Path) -> dict[str, str]:
    return dict(line.split("=", 1) for line in path.read_text().splitlines() if line)


def _nats_server_accepts(conf: Path, **env: str) -> None:
    check = subprocess.run(
        [find_binary(), "-c", str(conf), "-t"],
        capture_output=True,
        text=True,
        timeout=30,
        env={**os.environ, **env},
    )
    assert check.returncode == 0, check.stderr + check.stdout


def _workers_of(command: list[str], env: dict[str, str]) -> tuple[str, list[str]]:
    """The job a `phalanx run` command joins and the workers its launcher starts."""
    flags, _ = _run_flags(command)
    job = flags.get("--job") or env["PHALANX_JOB"]
    count = int(flags.get("--nproc-per-node", flags.get("--nproc", "0")))
    count += int(flags.get("--spares-per-node", flags.get("--spares", "0")))
    qualified = _nnodes(flags.get("--nnodes", "1"))[1] > 1
    return job, worker_names(flags.get("--node-id", "local"), count, qualified)


def test_compose_runs_nats_with_authorization_and_every_container_logs_in(tmp_path: Path) -> None:
    text = _text(DEPLOY / "docker-compose.yml")
    command = _documented(text, "python -m phalanx.natsauth write")
    readme = _text(DEPLOY / "README.md")
    assert command == _documented(
        readme, "python -m phalanx.natsauth write --config deploy/secrets/nats.conf"
    )
    _write(command, tmp_path)
    services = _compose()["services"]
    # the server: the generated config, with authorization, where the command mounts it
    assert "./secrets/nats.conf:/etc/nats/nats.conf:ro" in services["nats"]["volumes"]
    conf = (tmp_path / "nats.conf").read_text()
    assert "authorization" in conf and 'store_dir: "/data"' in conf and "http_port: 8222" in conf
    assert 'listen: "0.0.0.0:4222"' in conf  # the port compose publishes and the clients use
    _nats_server_accepts(tmp_path / "nats.conf")
    # every container that talks to NATS logs in: a service as its role, a launcher as its job's
    jobs: dict[str, set[str]] = {}
    for name, svc in services.items():
        if "NATS_URL" not in svc.get("environment", {}):
            continue
        (env_file,) = svc["env_file"]
        assert env_file.startswith("./secrets/env/"), (name, env_file)
        login = _env_file(tmp_path / "env" / env_file.removeprefix("./secrets/env/"))
        assert f'user: "{login[ENV_NATS_USER]}"' in conf and f'"{login[ENV_NATS_PASSWORD]}"' in conf
        if name in SERVICES:
            assert login[ENV_NATS_USER] == ROLE_OF_SERVICE[name], name
            continue
        job, workers = _workers_of(svc["command"], svc["environment"])
        assert login[ENV_NATS_USER] == f"launcher@{job}", name
        jobs.setdefault(job, set()).update(workers)
        table = json.loads(login[ENV_WORKER_CREDENTIALS])
        assert set(workers) <= set(table), (name, workers)  # each worker it starts: a login of its own
        for w in workers:
            assert table[w]["user"] == f"rank@{job}/{w}" and f'"{table[w]["password"]}"' in conf
    assert set(jobs) == {"demo", "demo-single"}
    for job, started in jobs.items():  # and no login for a worker no launcher starts
        table = json.loads(_env_file(tmp_path / "env" / f"launcher-{job}.env")[ENV_WORKER_CREDENTIALS])
        assert set(table) == started, job
    assert 'user: "rank"' not in conf and 'user: "launcher"' not in conf  # none for every job


def test_kubernetes_runs_nats_with_authorization_and_every_pod_logs_in(tmp_path: Path) -> None:
    readme = _text(DEPLOY / "README.md")
    _write(_documented(readme, "python -m phalanx.natsauth write --authorization-only"), tmp_path)
    made = {
        m.group(1): m.group(2) for m in re.finditer(r"create secret generic (\S+) --from-\S+?=(\S+)", readme)
    }
    secrets = {name: tmp_path / src.removeprefix("deploy/secrets/") for name, src in made.items()}
    assert all(p.exists() for p in secrets.values()), secrets
    # the server: the ConfigMap's config includes the users, projected beside it from nats-auth
    docs = _docs(K8S / "nats.yaml")
    conf = next(d for d in docs if d["kind"] == "ConfigMap")["data"]["nats.conf"]
    assert re.search(r"^include \./auth\.conf$", conf, re.M)
    sts = next(d for d in docs if d["kind"] == "StatefulSet")
    pod = sts["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    config_path = container["args"][container["args"].index("--config") + 1]
    mount = next(m for m in container["volumeMounts"] if m["mountPath"] == str(Path(config_path).parent))
    volume = next(v for v in pod["volumes"] if v["name"] == mount["name"])
    sources = volume["projected"]["sources"]
    assert {"key": "nats.conf", "path": Path(config_path).name} in sources[0]["configMap"]["items"]
    assert sources[1]["secret"] == {"name": "nats-auth", "items": [{"key": "auth.conf", "path": "auth.conf"}]}
    assert secrets["nats-auth"].name == "auth.conf"
    (tmp_path / "server").mkdir()
    (tmp_path / "server" / "nats.conf").write_text(conf)
    shutil.copy(secrets["nats-auth"], tmp_path / "server" / "auth.conf")
    _nats_server_accepts(tmp_path / "server" / "nats.conf", SERVER_NAME="nats-0")
    users = secrets["nats-auth"].read_text()
    # the services: each its role's login, required
    for doc in _docs(K8S / "services.yaml"):
        if doc["kind"] not in ("Deployment", "DaemonSet"):
            continue
        (c,) = doc["spec"]["template"]["spec"]["containers"]
        service = next(n for n, m in SERVICES.items() if c["command"][-1] == f"phalanx.services.{m}")
        name = f"phalanx-{ROLE_OF_SERVICE[service]}"
        assert {"secretRef": {"name": name}} in c["envFrom"], service
        assert _env_file(secrets[name])[ENV_NATS_USER] == ROLE_OF_SERVICE[service]
    # the training pods: job demo's launcher login, and one per worker any index starts
    job = _training()[0]
    train = _train_container(job)
    flags = _run_flags(train["command"])[0]
    name = f"phalanx-launcher-{flags['--job']}"
    assert {"secretRef": {"name": name}} in train["envFrom"]
    login = _env_file(secrets[name])
    assert login[ENV_NATS_USER] == f"launcher@{flags['--job']}" and f'"{login[ENV_NATS_PASSWORD]}"' in users
    started: set[str] = set()
    for command in (c for where, c in _node_commands().items() if where.startswith("k8s")):
        started |= set(_workers_of(command, {})[1])
    table = json.loads(login[ENV_WORKER_CREDENTIALS])
    assert set(table) == started and all(f'"{t["password"]}"' in users for t in table.values())
    # every Secret a manifest names is one the README makes
    named = set()
    for path in K8S_MANIFESTS:
        named |= set(re.findall(r"secretRef: \{name: ([\w-]+)", _text(path)))
        named |= set(re.findall(r"secret:\s+name: ([\w-]+)", _text(path)))
    assert named == set(made), (named, set(made))
