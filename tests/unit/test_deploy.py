"""deploy/ agrees with the code: modules, service names, versions, files.

The structural YAML checks need PyYAML, which is not a project dependency: they
are skipped with that reason where it is not installed. The checks below them
read the files as text and always run.
"""

from __future__ import annotations

import importlib.util
import re
import tomllib
from pathlib import Path
from typing import Any

import pytest
from phalanx.services.scheduler_signal.sources import ClusterFile

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
K8S = DEPLOY / "k8s"
SERVICES = {
    "failure-detector": "failure_detector",
    "scheduler-signal": "scheduler_signal",
    "elasticity-planner": "elasticity_planner",
    "state-replication": "state_replication",
}
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
    for path in (DEPLOY / "docker-compose.yml", K8S / "training-job.yaml"):
        assert (
            '"phalanx", "run", "--nproc", "4", "--spares", "1", "--", "python", "examples/train_gpt.py"'
            in _text(path)
        )
    assert (ROOT / "examples" / "train_gpt.py").exists()


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
    assert set(services) == {"nats", "jaeger", "train", *SERVICES}
    assert "--jetstream" in services["nats"]["command"] and services["nats"]["volumes"]
    assert services["jaeger"]["environment"]["COLLECTOR_OTLP_ENABLED"] == "true"
    assert {"16686:16686", "4318:4318"} <= set(services["jaeger"]["ports"])
    for name, module in SERVICES.items():
        svc = services[name]
        assert svc["command"] == ["python", "-m", f"phalanx.services.{module}"]
        assert svc["environment"]["NATS_URL"] == "nats://nats:4222"
        assert svc["environment"]["OTEL_EXPORTER_OTLP_ENDPOINT"] == "http://jaeger:4318"
        assert svc["healthcheck"]["test"][-1] == name
        assert svc["depends_on"]["nats"]["condition"] == "service_healthy"
