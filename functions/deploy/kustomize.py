"""The part of kustomize that `knative/` uses, so `openrl deploy` needs no kubectl.

A kustomization lists `resources` (YAML files, or directories holding a kustomization) and
`patches` (strategic-merge patch files, each naming its target by kind and name). That is
all `knative/` uses; anything else in a kustomization is refused by name rather than
silently ignored. Strategic merge follows the Kubernetes patch strategies of the fields
these manifests carry: containers, volumes and env merge by `name`, volume mounts by
`mountPath`, ports by `containerPort` (items only the patch has go first, as kustomize
puts them); other lists are replaced; maps merge.

tests/functions/deploy/test_kustomize.py renders every overlay with this and with
`kubectl kustomize` (where kubectl exists) and compares the objects.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import yaml

from functions.deploy.errors import DeployConfigError

Obj = dict[str, Any]
SUPPORTED = {"apiVersion", "kind", "resources", "patches"}
MERGE_KEYS = {
    "containers": "name",
    "initContainers": "name",
    "volumes": "name",
    "env": "name",
    "imagePullSecrets": "name",
    "volumeMounts": "mountPath",
    "ports": "containerPort",
}


def identity(obj: Obj) -> tuple[str, str, str]:
    return (obj.get("apiVersion", ""), obj.get("kind", ""), (obj.get("metadata") or {}).get("name", ""))


def load_documents(path: Path) -> list[Obj]:
    try:
        return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]
    except yaml.YAMLError as exc:
        raise DeployConfigError(f"{path} is not valid YAML: {exc}") from None


def build(directory: Path) -> list[Obj]:
    """The objects a kustomization directory renders to, in the order its resources list them."""
    file = directory / "kustomization.yaml"
    if not file.is_file():
        raise DeployConfigError(f"{directory} has no kustomization.yaml")
    spec = yaml.safe_load(file.read_text()) or {}
    unknown = set(spec) - SUPPORTED
    if unknown:
        raise DeployConfigError(f"{file}: fields this renderer does not implement: {sorted(unknown)}")
    objects: list[Obj] = []
    for entry in spec.get("resources") or []:
        target = (directory / entry).resolve()
        documents = build(target) if target.is_dir() else load_documents(target)
        for obj in documents:
            if any(identity(obj) == identity(seen) for seen in objects):
                raise DeployConfigError(f"{file}: {identity(obj)} is defined twice")
            objects.append(obj)
    for entry in spec.get("patches") or []:
        if set(entry) != {"path"}:
            raise DeployConfigError(f"{file}: only `patches: - path: FILE` is supported, not {entry}")
        for patch in load_documents(directory / entry["path"]):
            matches = [i for i, obj in enumerate(objects) if identity(obj)[1:] == identity(patch)[1:]]
            if not matches:
                raise DeployConfigError(
                    f"{file}: patch {entry['path']} targets {identity(patch)[1:]}, which is not here"
                )
            for i in matches:
                objects[i] = merge(objects[i], patch)
    return objects


def merge(base: Any, patch: Any, field: str = "") -> Any:
    """Strategic merge of `patch` into `base` (neither is modified)."""
    if isinstance(base, dict) and isinstance(patch, dict):
        merged = copy.deepcopy(base)
        for key, value in patch.items():
            merged[key] = merge(base[key], value, key) if key in base else copy.deepcopy(value)
        return merged
    key = MERGE_KEYS.get(field)
    if key and isinstance(base, list) and isinstance(patch, list):
        merged = copy.deepcopy(base)
        added = []
        for item in patch:
            at = next(
                (i for i, old in enumerate(merged) if isinstance(old, dict) and old.get(key) == item.get(key)), None
            )
            if at is None:
                added.append(copy.deepcopy(item))
            else:
                merged[at] = merge(merged[at], item)
        # kustomize puts the items only the patch has before the base's (order matters for env).
        return added + merged
    return copy.deepcopy(patch)
