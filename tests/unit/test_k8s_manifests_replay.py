"""The Kubernetes manifests, offline: their pods' preemptions reach the planner as the right workers.

No cluster and no kustomize here, so each step is done the way Kubernetes does it,
in the test, and the rest is the real code:

1. the overlays are rendered by deploy/k8s/render.py (the part of kustomize these
   files use; generators left out), which is checked against ``kubectl kustomize``
   where kubectl (or kustomize) is installed;
2. the Indexed Job's template becomes the pods the Job controller creates
   (``train-sample-<index>-<random>``, ``spec.hostname`` ``train-sample-<index>``,
   the completion-index annotation and labels), scheduled on machines whose names
   are not the pods'; the kubelet's downward API and ``$(VAR)`` expansion give each
   launcher its command line, which the real ``phalanx run`` parses into the
   launcher's config and the job spec it sends the planner (its worker names);
3. a fake API server on loopback (tests/k8s_api.py: the list and watch wire format)
   serves those pods and machines and streams watch events as the API server sends
   them: a scheduler preemption (``DisruptionTarget``), an eviction (the condition,
   the deletion, the pod failing, its removal), a cordon, a pending pod of higher
   priority. The real ``KubeWatchSource`` (kubernetes_asyncio, configured from the
   rendered scheduler-signal Deployment's environment) turns them into notices;
4. each notice goes into the planner's real reducer, holding the job the two
   launchers started, and the plan it commits moves exactly that pod's workers,
   also when the pod replaced a lost one and the planner renamed its workers
   (which is why a pod names its node, not its workers: kube.py's module docstring).

What this cannot show: that the objects are valid for the API server (test_deploy.py,
with kustomize), scheduling, admission, the kubelet, or training across pods.
"""

from __future__ import annotations

import asyncio
import copy
import hashlib
import importlib.util
import json
import re
import shutil
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import pytest
from phalanx.services.elasticity_planner import events as ev
from phalanx.services.elasticity_planner.effects import Decided
from phalanx.services.elasticity_planner.reducer import Reducer
from phalanx.services.scheduler_signal.kube import KubeConfig, KubeWatchSource, pod_node, pod_request
from phalanx.services.scheduler_signal.sources import Ledger, Signal

from k8s_api import FakeKubeApi, node
from phalanx.contract import (
    Action,
    FaultCause,
    JobRecord,
    JobSpec,
    JobState,
    NodeLost,
    PreemptionNotice,
    Registered,
    Role,
)
from phalanx.launcher.config import LaunchConfig
from phalanx.launcher.launcher import job_spec

yaml = pytest.importorskip("yaml", reason="PyYAML is not installed (pip install -e .[test])")

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
JOB = "sample"
MACHINES = ("pool-a-7xk2", "pool-b-9qd4", "pool-c-3mf8")  # Kubernetes nodes: never a --node-id
RUN = "run-1"
WAIT_S = 10.0
Obj = dict[str, Any]


def _load_render() -> Any:
    spec = importlib.util.spec_from_file_location("deploy_k8s_render", K8S / "render.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclass looks its module up
    spec.loader.exec_module(module)
    return module


render = _load_render()


def _one(objects: list[Obj], kind: str, name: str) -> Obj:
    (obj,) = [o for o in objects if o["kind"] == kind and o["metadata"]["name"] == name]
    return obj


# -- what the controllers, the scheduler and the kubelet do ------------------------------------
def _suffix(seed: str) -> str:
    """The 5 random characters of a generated name (here from ``seed``)."""
    return "".join("bcdfghjklmnpqrstvwxz2456789"[b % 27] for b in hashlib.sha256(seed.encode()).digest()[:5])


def _uid(seed: str) -> str:
    return str(uuid.uuid5(uuid.NAMESPACE_URL, seed))


def indexed_job_pod(job: Obj, index: int, machine: str, attempt: int = 0) -> Obj:
    """The pod the Job controller creates for ``index`` of an Indexed Job (``attempt``:
    its replacements), as the API server returns it once running on ``machine``."""
    name, ns = job["metadata"]["name"], job["metadata"]["namespace"]
    template = copy.deepcopy(job["spec"]["template"])
    job_uid = _uid(f"job/{ns}/{name}")
    pod_name = f"{name}-{index}-{_suffix(f'{name}/{index}/{attempt}')}"
    meta = template.get("metadata", {})
    controller = {
        "batch.kubernetes.io/controller-uid": job_uid,
        "batch.kubernetes.io/job-name": name,
        "controller-uid": job_uid,
        "job-name": name,
        "batch.kubernetes.io/job-completion-index": str(index),
    }
    return {
        "kind": "Pod",
        "apiVersion": "v1",
        "metadata": {
            "name": pod_name,
            "generateName": f"{name}-{index}-",
            "namespace": ns,
            "uid": _uid(f"pod/{ns}/{pod_name}"),
            "creationTimestamp": f"2026-03-02T10:0{attempt}:0{index}Z",
            "labels": {**meta.get("labels", {}), **controller},
            "annotations": {
                **meta.get("annotations", {}),
                "batch.kubernetes.io/job-completion-index": str(index),
            },
            "ownerReferences": [
                {
                    "apiVersion": "batch/v1",
                    "kind": "Job",
                    "name": name,
                    "uid": job_uid,
                    "controller": True,
                    "blockOwnerDeletion": True,
                }
            ],
            "finalizers": ["batch.kubernetes.io/job-tracking"],
        },
        "spec": {
            **template["spec"],
            "hostname": f"{name}-{index}",  # the Job controller's, for Indexed Jobs
            "nodeName": machine,
            "priority": 0,
            "schedulerName": "default-scheduler",
            "serviceAccountName": "default",
        },
        "status": {
            "phase": "Running",
            "hostIP": f"10.0.0.{MACHINES.index(machine) + 1}",
            "podIP": f"10.244.{MACHINES.index(machine) + 1}.{10 + attempt}",
            "startTime": f"2026-03-02T10:0{attempt}:1{index}Z",
            "conditions": [
                {"type": "PodScheduled", "status": "True"},
                {"type": "Initialized", "status": "True"},
                {"type": "ContainersReady", "status": "True"},
                {"type": "Ready", "status": "True"},
            ],
        },
    }


def _field(pod: Obj, path: str) -> str:
    """A downward API ``fieldRef`` of ``pod``."""
    if m := re.fullmatch(r"metadata\.(labels|annotations)\['([^']+)'\]", path):
        return str(pod["metadata"][m.group(1)][m.group(2)])
    known = ("metadata.name", "metadata.namespace", "metadata.uid", "spec.nodeName")
    assert path in (*known, "spec.serviceAccountName", "status.podIP", "status.hostIP"), path
    value: Any = pod
    for part in path.split("."):
        value = value[part]
    return str(value)


def _expand(text: str, env: dict[str, str]) -> str:
    """The kubelet's ``$(VAR)``: a variable defined so far, ``$$`` a ``$``, else left as is."""
    return re.sub(
        r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_]*)\)",
        lambda m: "$" if m.group(0) == "$$" else env.get(m.group(1), m.group(0)),
        text,
    )


def container_command(pod: Obj, container: str) -> list[str]:
    """``container``'s command as the kubelet starts it: its ``env`` (plain values and
    downward API fields, each expanded with those before it) expanded into each word.
    ``envFrom`` is left out (the ConfigMaps are generators, not rendered here)."""
    (c,) = [c for c in pod["spec"]["containers"] if c["name"] == container]
    env: dict[str, str] = {}
    for e in c.get("env", []):
        ref = (e.get("valueFrom") or {}).get("fieldRef")
        if ref is not None:
            env[e["name"]] = _field(pod, ref["fieldPath"])
        elif "value" in e:
            env[e["name"]] = _expand(e["value"], env)
    return [_expand(w, env) for w in c["command"]]


def launcher_config(command: list[str], monkeypatch: pytest.MonkeyPatch) -> LaunchConfig:
    """What the real ``phalanx run`` makes of ``command``: its launcher's config (not run)."""
    import phalanx.cli.run as run_cli

    got: list[LaunchConfig] = []

    def launch(config: LaunchConfig, *args: object) -> int:
        got.append(config)
        return 0

    assert command[:2] == ["phalanx", "run"], command
    monkeypatch.setattr(run_cli, "launch", launch)
    monkeypatch.delenv("PHALANX_NATS_ENV_FILE", raising=False)
    run_cli.run_command.main(command[2:], standalone_mode=False)
    (config,) = got
    return config


def launcher_spec(pod: Obj, monkeypatch: pytest.MonkeyPatch) -> JobSpec:
    """The job spec the launcher of ``pod`` sends the planner."""
    cfg = launcher_config(container_command(pod, "train"), monkeypatch)
    launcher = f"{cfg.node}-{pod['metadata']['uid'][:8]}"
    return job_spec(cfg, launcher, f"{pod['status']['podIP']}:29400")


# -- watch events, as the API server sends them --------------------------------------------------
def _with_condition(pod: Obj, reason: str, message: str) -> Obj:
    out = copy.deepcopy(pod)
    out["status"]["conditions"].append(
        {
            "type": "DisruptionTarget",
            "status": "True",
            "reason": reason,
            "message": message,
            "lastTransitionTime": "2026-03-02T11:00:00Z",
        }
    )
    return out


def preempted(pod: Obj) -> list[Obj]:
    """The scheduler preempts ``pod`` for a pod of higher priority."""
    cond = _with_condition(
        pod, "PreemptionByScheduler", "default-scheduler: preempting to accommodate a higher priority pod"
    )
    return [{"type": "MODIFIED", "object": cond}]


def evicted(pod: Obj) -> list[Obj]:
    """``kubectl drain`` evicts ``pod`` (the Eviction API): the condition, the deletion with
    the pod's grace, the containers stopped (a Job pod that never restarts: Failed), gone."""
    cond = _with_condition(pod, "EvictionByEvictionAPI", "Eviction API: evicting")
    deleting = copy.deepcopy(cond)
    grace = pod["spec"]["terminationGracePeriodSeconds"]
    deleting["metadata"].update(deletionTimestamp="2026-03-02T11:00:45Z", deletionGracePeriodSeconds=grace)
    failed = copy.deepcopy(deleting)
    failed["status"]["phase"] = "Failed"
    failed["status"]["conditions"] = [
        {**c, "status": "False"} if c["type"] in ("Ready", "ContainersReady") else c
        for c in failed["status"]["conditions"]
    ]
    gone = copy.deepcopy(failed)
    gone["metadata"]["finalizers"] = []
    return [{"type": "MODIFIED", "object": o} for o in (cond, deleting, failed)] + [
        {"type": "DELETED", "object": gone}
    ]


def cordoned(machine: Obj) -> list[Obj]:
    """``kubectl cordon`` (the first step of a drain)."""
    out = copy.deepcopy(machine)
    out["spec"] = {
        "unschedulable": True,
        "taints": [
            {
                "key": "node.kubernetes.io/unschedulable",
                "effect": "NoSchedule",
                "timeAdded": "2026-03-02T11:00:00Z",
            }
        ],
    }
    return [{"type": "MODIFIED", "object": out}]


def pending(namespace: str, resource: str, need: str, nominated: str) -> list[Obj]:
    """A pod of priority class ``eval-critical`` (1000000) that fits on no node; the
    scheduler nominated ``nominated`` for it (preemption decided, victims not yet gone)."""
    pod = {
        "kind": "Pod",
        "apiVersion": "v1",
        "metadata": {
            "name": "eval-0",
            "namespace": namespace,
            "uid": _uid("pod/eval-0"),
            "creationTimestamp": "2026-03-02T11:00:00Z",
            "labels": {"app": "eval"},
        },
        "spec": {
            "containers": [{"name": "eval", "image": "eval:1", "resources": {"requests": {resource: need}}}],
            "priorityClassName": "eval-critical",
            "priority": 1000000,
            "preemptionPolicy": "PreemptLowerPriority",
            "schedulerName": "default-scheduler",
            "terminationGracePeriodSeconds": 30,
        },
        "status": {
            "phase": "Pending",
            "nominatedNodeName": nominated,
            "conditions": [
                {
                    "type": "PodScheduled",
                    "status": "False",
                    "reason": "Unschedulable",
                    "message": f"0/3 nodes are available: 3 Insufficient {resource}.",
                }
            ],
        },
    }
    return [{"type": "ADDED", "object": pod}]


# -- the cluster ----------------------------------------------------------------------------------
class NothingPublished:
    """The scheduler stream of a cluster nobody published anything for yet."""

    async def last_capacity(self, cluster: str) -> None:
        return None

    async def announced(self, cluster: str) -> set[str]:
        return set()


class Cluster:
    """An overlay's rendering, its training pods on MACHINES (index ``i``'s ``attempt``
    on MACHINES[i + attempt]), and those machines, each with exactly the slots one
    training pod asks for: a pod of more priority that needs them must preempt one."""

    def __init__(self, overlay: str, attempts: dict[int, int] | None = None) -> None:
        self.rendering = render.build(K8S / "overlays" / overlay)
        objects = self.rendering.objects
        self.job = _one(objects, "Job", "train-sample")
        self.signal = _one(objects, "Deployment", "scheduler-signal")
        env = self.signal["spec"]["template"]["spec"]["containers"][0]["env"]
        self.signal_env = {e["name"]: e["value"] for e in env if "value" in e}
        self.resource = self.signal_env["PHALANX_K8S_SLOT_RESOURCE"]
        self.namespace = self.job["metadata"]["namespace"]
        self.pods = []
        for i in range(self.job["spec"]["completions"]):
            attempt = (attempts or {}).get(i, 0)
            self.pods.append(indexed_job_pod(self.job, i, MACHINES[i + attempt], attempt))
        self.need = pod_request(self.pods[0], self.resource)
        assert self.need > 0, f"the training pods ask for no {self.resource}"
        used = [p["spec"]["nodeName"] for p in self.pods]
        self.machines = [node(m, slots=self.need, resource=self.resource) for m in used]

    def config(self, url: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> KubeConfig:
        """scheduler-signal's configuration from its Deployment's environment; the API
        server is ``url`` (in its pod: the in-cluster service, its own namespace)."""
        monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
        for name, value in self.signal_env.items():
            if name.startswith(("PHALANX_K8S_", "PHALANX_CLUSTER_NAME")):
                monkeypatch.setenv(name, value)
        monkeypatch.setenv("PHALANX_K8S", "1")
        monkeypatch.setenv("PHALANX_K8S_API", url)
        monkeypatch.setenv("PHALANX_K8S_NAMESPACE", self.namespace)
        cfg = KubeConfig.from_env(sa_dir=tmp_path)
        assert cfg is not None
        return cfg


async def _until(ready: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not ready():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}")
        await asyncio.sleep(0.02)


async def replay(
    cluster: Cluster, events: list[tuple[str, Obj]], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> list[PreemptionNotice]:
    """The notices the real watcher publishes for ``cluster`` and ``events`` ((kind, event))."""
    got: list[Signal] = []

    async def emit(sig: Signal) -> None:
        got.append(sig)

    with FakeKubeApi(cluster.machines, cluster.pods, namespace=cluster.namespace) as api:
        cfg = cluster.config(api.url, monkeypatch, tmp_path)
        source = KubeWatchSource(cfg, Ledger(NothingPublished(), "k8s"))
        task = asyncio.create_task(source.run(emit))
        try:
            await asyncio.to_thread(api.wait_watching, "nodes", 1)
            await asyncio.to_thread(api.wait_watching, "pods", 2)  # the job's pods, pending pods
            for kind, event in events:
                api.push(kind, event)
            # A bookmark after them on every watch: once the source holds its version,
            # it has handled every event before it (each watch is handled in order).
            marks = {
                k: api.push(k, {"type": "BOOKMARK", "object": {"metadata": {}}}) for k in ("nodes", "pods")
            }
            rv = {k: m["object"]["metadata"]["resourceVersion"] for k, m in marks.items()}
            trackers = [(source.nodes, "nodes"), (source.pods, "pods"), (source.pending, "pods")]
            await _until(
                lambda: all(t.resource_version == rv[k] for t, k in trackers), "the events to be handled"
            )
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    assert source.bad_objects == 0 and source.last_error == ""
    return [s.message for s in got if isinstance(s.message, PreemptionNotice)]


# -- the planner -----------------------------------------------------------------------------------
PLANNER = Reducer()


def registered(spec: JobSpec, workers: list[str], role: Callable[[int], Role]) -> list[ev.Registration]:
    return [
        ev.Registration(
            msg=Registered(job=spec.job, worker=w, role=role(i), host=spec.host, pid=100 + i, launch=RUN)
        )
        for i, w in enumerate(workers)
    ]


def started(specs: list[JobSpec]) -> JobState:
    """The planner's state once every launcher joined and every worker registered."""
    state: JobState | None = None
    for s in specs:
        state, _ = PLANNER.step(state, ev.JoinRequest(msg=s, run=RUN), time.time())
    for s in specs:
        for r in registered(s, s.workers, lambda i, s=s: Role.RANK if i < s.ranks else Role.SPARE):
            state, _ = PLANNER.step(state, r, time.time())
    assert state is not None and state.plan is not None and state.plan.generation == 1
    return state


def on_notice(state: JobState, notice: PreemptionNotice, seq: int = 1) -> tuple[JobState, Decided]:
    """The planner's step on ``notice``: its new state and the decision it publishes."""
    new, effects = PLANNER.step(state, ev.Preemption(msg=notice, seq=seq), notice.ts)
    assert new is not None
    (decided,) = [e for e in effects if isinstance(e, Decided)]
    return new, decided


# -- the tests ---------------------------------------------------------------------------------------
OVERLAYS = ("dev", "production")


def _kustomize(path: Path) -> list[Obj]:
    """``kustomize build`` (or ``kubectl kustomize``) of ``path``; skipped where neither is."""
    found = shutil.which("kustomize") or shutil.which("kubectl")
    if found is None:
        pytest.skip("neither kustomize nor kubectl is installed: the renderer is not compared")
    command = [found, "build" if found.endswith("kustomize") else "kustomize", str(path)]
    out = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return [d for d in yaml.safe_load_all(out.stdout) if d]


@pytest.mark.parametrize("which", ["base", *(f"overlays/{o}" for o in OVERLAYS)])
def test_the_renderer_renders_what_kustomize_builds(which: str) -> None:
    """Every object but the generated ConfigMaps, whose names kustomize suffixes with a
    hash of their content (references to them compared without it)."""
    built = _kustomize(K8S / which)
    rendering = render.build(K8S / which)
    generated = {s.rsplit(" ", 1)[1] for s in rendering.skipped}
    assert generated == {"nats-config", "phalanx-env"}
    hashed = re.compile(r'"(' + "|".join(generated) + r')-[a-z0-9]{10}"')

    def key(o: Obj) -> tuple[str, str]:
        return o["kind"], o["metadata"]["name"]

    theirs = {key(o): o for o in built if o["kind"] != "ConfigMap"}
    assert sorted(theirs) == sorted(key(o) for o in rendering.objects)
    for o in rendering.objects:
        assert json.loads(hashed.sub(r'"\1"', json.dumps(theirs[key(o)]))) == o, key(o)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_each_pod_names_the_node_its_launcher_runs(overlay: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The pod's phalanx.io/node-id, as scheduler-signal reads it, is its launcher's --node-id,
    whose workers are <node>-w0..w2; the machine and the pod's name are neither."""
    cluster = Cluster(overlay)
    assert all("configMapGenerator" in s for s in cluster.rendering.skipped)  # all else is rendered
    labels = cluster.job["spec"]["template"]["metadata"]["labels"]
    assert labels["phalanx.io/job"] == JOB
    assert cluster.signal_env["PHALANX_K8S_POD_SELECTOR"] == "phalanx.io/job"
    for i, pod in enumerate(cluster.pods):
        spec = launcher_spec(pod, monkeypatch)
        assert (spec.job, spec.node) == (JOB, f"train-sample-{i}") and pod_node(pod) == spec.node
        assert spec.workers == [f"train-sample-{i}-w{w}" for w in range(3)] and spec.ranks == 2
        assert pod_node(pod) not in (pod["metadata"]["name"], pod["spec"]["nodeName"])
        assert "$(" not in " ".join(container_command(pod, "train"))


def test_pod_node_reads_the_annotation_and_the_hostname() -> None:
    def pod(annotation: str | None, hostname: str | None = None) -> Obj:
        notes = {} if annotation is None else {"phalanx.io/node-id": annotation}
        spec = {} if hostname is None else {"hostname": hostname}
        return {"metadata": {"name": "p-0-x7k2q", "annotations": notes}, "spec": spec}

    assert pod_node(pod("hostname", "train-0")) == "train-0"  # an Indexed Job's, a StatefulSet's
    assert pod_node(pod("hostname")) == "p-0-x7k2q"  # no spec.hostname: the pod's name is its hostname
    assert pod_node(pod("node-a", "train-0")) == "node-a"  # a node id of its own
    assert pod_node(pod(None, "train-0")) == pod_node(pod(" ")) == ""  # names no node: workers only


def _planned(decided: Decided, state: JobState) -> tuple[Action, list[str], set[str]]:
    """The decision's action, who leaves, and the nodes of the new generation's members."""
    assert state.plan is not None
    members = {state.plan.nodes[m.worker] for m in state.plan.members}
    return decided.decision.action, sorted(state.plan.leaving), members


class Scenario(NamedTuple):
    events: Callable[[Cluster], list[tuple[str, Obj]]]  # (kind, watch event)
    taken: int  # the index of the pod taken
    machine: bool  # whether the notice names the pod's machine too (node trouble)
    reason: str  # in the notice's reason


SCENARIOS = {
    "preempted": Scenario(
        lambda c: [("pods", e) for e in preempted(c.pods[1])], 1, False, "PreemptionByScheduler"
    ),
    "evicted": Scenario(
        lambda c: [("pods", e) for e in evicted(c.pods[0])], 0, False, "EvictionByEvictionAPI"
    ),
    "cordoned": Scenario(lambda c: [("nodes", e) for e in cordoned(c.machines[1])], 1, True, "cordoned"),
    "pending": Scenario(
        lambda c: [("pods", e) for e in pending(c.namespace, c.resource, str(c.need), MACHINES[1])],
        1,
        False,
        "pending pod phalanx/eval-0 (priority 1000000) needs",
    ),
}


@pytest.mark.parametrize("overlay", OVERLAYS)
@pytest.mark.parametrize("scenario", list(SCENARIOS))
async def test_a_recorded_disruption_moves_exactly_that_pods_workers(
    overlay: str, scenario: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """One notice, for the pod's job and its launcher's node (with the machine, when the
    machine is in trouble), with the pod's grace; the planner's next plan lets exactly
    that node's workers go, and keeps the other pod's."""
    cluster = Cluster(overlay)
    sc = SCENARIOS[scenario]
    (notice,) = await replay(cluster, sc.events(cluster), monkeypatch, tmp_path)
    pod, node_id = cluster.pods[sc.taken], f"train-sample-{sc.taken}"
    nodes = [MACHINES[sc.taken], node_id] if sc.machine else [node_id]
    assert (notice.cluster, notice.job, notice.workers, notice.nodes) == ("k8s", JOB, [], nodes)
    assert notice.deadline_s == pod["spec"]["terminationGracePeriodSeconds"] == 45
    assert sc.reason in notice.reason
    if scenario in ("preempted", "evicted"):
        assert f"pod phalanx/{pod['metadata']['name']} on {MACHINES[sc.taken]}" in notice.reason

    specs = [launcher_spec(p, monkeypatch) for p in cluster.pods]
    state, decided = on_notice(started(specs), notice)
    action, leaving, member_nodes = _planned(decided, state)
    assert leaving == [f"{node_id}-w{i}" for i in range(3)]  # its 2 ranks and its hot spare
    assert member_nodes == {f"train-sample-{1 - sc.taken}"} and action is Action.SHRINK
    assert decided.decision.world_size == 3  # the other pod's 2 ranks and its spare
    assert decided.decision.reason.startswith(notice.reason)


@pytest.mark.parametrize("overlay", OVERLAYS)
@pytest.mark.parametrize(
    "planner",
    ["read back", "in memory"],
)
async def test_a_replacement_pods_workers_are_found_by_its_node_not_their_names(
    overlay: str, planner: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Index 1's first pod was lost; its replacement (another pod name, another machine,
    the same --node-id) joined the running job, where the planner named its workers
    train-sample-1-w3..w5, not the w0..w2 its launcher proposed. Its eviction moves those.

    ``read back``: the planner's state as a leader reads it from the job's record
    after the join; ``in memory``: as the leader that stepped the join keeps it."""
    first, later = Cluster(overlay), Cluster(overlay, attempts={1: 1})
    old, new = first.pods[1], later.pods[1]
    assert old["metadata"]["name"] != new["metadata"]["name"]
    assert old["spec"]["nodeName"] != new["spec"]["nodeName"]
    assert pod_node(old) == pod_node(new) == "train-sample-1"

    state: JobState | None = started([launcher_spec(p, monkeypatch) for p in first.pods])
    old_spec, new_spec = launcher_spec(old, monkeypatch), launcher_spec(new, monkeypatch)
    lost = NodeLost(
        job=JOB,
        incident=f"{JOB}:node:train-sample-1",
        node="train-sample-1",
        launcher=old_spec.launcher,
        workers=old_spec.workers,
        cause=FaultCause.HEARTBEAT_LOST,
        fault_at=time.time() - 5,
    )
    state, _ = PLANNER.step(state, ev.NodeLoss(msg=lost), time.time())
    state, _ = PLANNER.step(state, ev.JoinRequest(msg=new_spec, run=RUN), time.time())
    assert state is not None
    if planner == "read back":  # the job's record, as the planner writes and loads it
        record = JobRecord(job=JOB, ts=time.time(), token=0, plan=state.plan, planner=state)
        state = JobRecord.model_validate_json(record.model_dump_json()).planner
        assert state is not None
    renamed = state.nodes["train-sample-1"].workers
    assert new_spec.workers == ["train-sample-1-w0", "train-sample-1-w1", "train-sample-1-w2"]
    assert renamed == ["train-sample-1-w3", "train-sample-1-w4", "train-sample-1-w5"]
    for r in registered(new_spec, renamed, lambda i: Role.SPARE):
        state, _ = PLANNER.step(state, r, time.time())
    assert state is not None

    events = [("pods", e) for e in evicted(new)]
    notices = await replay(later, events, monkeypatch, tmp_path)
    (notice,) = notices
    assert (notice.job, notice.workers, notice.nodes) == (JOB, [], ["train-sample-1"])
    assert new["metadata"]["name"] in notice.reason and MACHINES[2] in notice.reason
    state, decided = on_notice(state, notice)
    action, leaving, member_nodes = _planned(decided, state)
    assert (action, leaving, member_nodes) == (Action.REFORM, renamed, {"train-sample-0"})
