"""The part of `kustomize build` these manifests use, for tests on machines without kustomize.

Not kustomize, and not a way to deploy (use ``kubectl apply -k``): it renders the
objects of ``base`` and the overlays so that an offline test can turn the pod
templates into pods (tests/unit/test_k8s_manifests_replay.py, which also checks
that this rendering is kustomize's where ``kubectl`` or ``kustomize`` is
installed). tests/unit/test_deploy.py validates kustomize's own output, never this.

What it applies, in kustomize's order: ``resources`` (files, and directories
holding a kustomization: an overlay's ``../../base``), ``patches`` (strategic
merge by kind and name: maps merge, ``null`` deletes, lists of containers,
env, volumes, volume mounts, ports and topology spread constraints merge by
their key, the patch's items first as kustomize orders them, a ``$patch: replace``
list replaces, any other list replaces),
``namespace`` (``metadata.namespace`` of the namespaced kinds), ``labels``
(``metadata.labels``, without ``includeSelectors`` or ``includeTemplates``),
``replicas``, ``images`` (``newName``, ``newTag``).

What it leaves out, listed in :attr:`Rendering.skipped`: the generators
(``configMapGenerator``, ``secretGenerator``): kustomize names their objects with a
hash of the content and rewrites every reference, which is not repeated here. Any
other field of a kustomization is refused (ValueError), so a new feature of the
files cannot be rendered silently wrong.

    python deploy/k8s/render.py overlays/production    # the objects, as YAML
"""

from __future__ import annotations

import copy
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

HERE = Path(__file__).resolve().parent
KNOWN = {"apiVersion", "kind", "resources", "patches", "namespace", "labels", "replicas", "images"}
KNOWN |= {"configMapGenerator", "secretGenerator"}
GENERATORS = ("configMapGenerator", "secretGenerator")
CLUSTER_SCOPED = {"Namespace", "ClusterRole", "ClusterRoleBinding", "PriorityClass", "Node"}
CLUSTER_SCOPED |= {"PersistentVolume", "StorageClass", "CustomResourceDefinition"}
# The merge keys of the lists these manifests patch (the API's patchMergeKey).
MERGE_KEYS = {
    "containers": "name",
    "initContainers": "name",
    "env": "name",
    "volumes": "name",
    "volumeMounts": "mountPath",
    "ports": "containerPort",
    "topologySpreadConstraints": "topologyKey",
}
WORKLOADS = ("Deployment", "StatefulSet", "DaemonSet", "Job", "ReplicaSet")

Obj = dict[str, Any]


@dataclass
class Rendering:
    objects: list[Obj]
    skipped: list[str] = field(default_factory=list)  # what kustomize would add and this does not


def _docs(path: Path) -> list[Obj]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d is not None]


def merge(base: Any, patch: Any, key: str = "") -> Any:
    """A strategic merge patch of ``base`` by ``patch`` (see the module's docstring)."""
    if isinstance(base, dict) and isinstance(patch, dict):
        out = copy.deepcopy(base)
        for k, v in patch.items():
            if v is None:
                out.pop(k, None)
            else:
                out[k] = merge(out[k], v, k) if k in out else copy.deepcopy(v)
        return out
    if isinstance(patch, list):
        items = [i for i in patch if not (isinstance(i, dict) and i.get("$patch") == "replace")]
        by = MERGE_KEYS.get(key)
        if len(items) < len(patch) or by is None or not isinstance(base, list):
            return copy.deepcopy(items)
        rest = copy.deepcopy(base)
        merged = []
        for item in items:  # kustomize's order: the patch's items first, then the others
            at = next((i for i, b in enumerate(rest) if b.get(by) == item.get(by)), None)
            merged.append(copy.deepcopy(item) if at is None else merge(rest.pop(at), item))
        return merged + rest
    return copy.deepcopy(patch)


def _target(objects: list[Obj], patch: Obj, where: Path) -> int:
    found = [
        i
        for i, o in enumerate(objects)
        if o.get("kind") == patch.get("kind") and o["metadata"]["name"] == patch["metadata"]["name"]
    ]
    if len(found) != 1:
        raise ValueError(f"{where}: patch of {patch.get('kind')}/{patch['metadata']['name']} matches {found}")
    return found[0]


def _containers(obj: Obj) -> list[Obj]:
    pod = ((obj.get("spec") or {}).get("template") or {}).get("spec") or {}
    return [*pod.get("initContainers", []), *pod.get("containers", [])]


def build(path: Path) -> Rendering:
    """The objects of the kustomization in directory ``path``."""
    k = _docs(path / "kustomization.yaml")[0]
    unknown = set(k) - KNOWN
    if unknown:
        raise ValueError(f"{path}/kustomization.yaml: not rendered here: {sorted(unknown)}")
    out = Rendering([])
    for res in k.get("resources", []):
        src = path / res
        if src.is_dir():
            sub = build(src)
            out.objects += sub.objects
            out.skipped += sub.skipped
        else:
            out.objects += _docs(src)
    for entry in k.get("patches", []):
        if set(entry) != {"path"}:
            raise ValueError(f"{path}: only patches of a file are rendered here, not {entry}")
        for patch in _docs(path / entry["path"]):
            i = _target(out.objects, patch, path / entry["path"])
            out.objects[i] = merge(out.objects[i], patch)
    for obj in out.objects:
        if "namespace" in k and obj.get("kind") not in CLUSTER_SCOPED:
            obj["metadata"]["namespace"] = k["namespace"]
        for entry in k.get("labels", []):
            if entry.get("includeSelectors") or entry.get("includeTemplates"):
                raise ValueError(f"{path}: labels of selectors and templates are not rendered here")
            obj.setdefault("metadata", {}).setdefault("labels", {}).update(entry["pairs"])
    for r in k.get("replicas", []):
        (obj,) = [o for o in out.objects if o["kind"] in WORKLOADS and o["metadata"]["name"] == r["name"]]
        obj["spec"]["replicas"] = r["count"]
    for image in k.get("images", []):
        for obj in out.objects:
            for c in _containers(obj):
                name, _, tag = c["image"].partition(":")
                if name == image["name"]:
                    c["image"] = f"{image.get('newName', name)}:{image.get('newTag', tag)}".rstrip(":")
    for gen in GENERATORS:
        out.skipped += [f"{path.name}: {gen} {g['name']}" for g in k.get(gen, [])]
    return out


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: render.py DIR   (base, overlays/dev, overlays/production)", file=sys.stderr)
        return 2
    rendering = build(HERE / args[0])
    sys.stdout.write(yaml.safe_dump_all(rendering.objects, sort_keys=False))
    for what in rendering.skipped:
        print(f"not rendered: {what}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
