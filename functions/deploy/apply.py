"""Applying, reporting and removing a rendered deployment through a `KubeApi`.

`apply` is idempotent: an object missing from the cluster is created; one whose live state
already says everything the manifest says (`kube.contains`: server defaults are fine) is
left alone, with no request sent; otherwise the manifest is sent as a JSON merge patch.
Applying the same manifests twice therefore changes nothing the second time.
`preflight` refuses, before anything is applied, a deployment whose namespace or Secrets
are missing, naming each and the command that creates it.
`status` and `delete` find what OpenRL owns by its labels: `app.kubernetes.io/part-of=openrl`
in the namespace (the deploy's objects and the scheduler's workers) and
`openrl.ai/namespace=<ns>` for cluster-scoped ones. `delete` stops the scheduler first, so
it does not recreate the workers being removed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

from functions.deploy.config import DeployConfig
from functions.deploy.errors import DeployConfigError
from functions.deploy.knative import readiness
from functions.deploy.kube import KINDS, KubeApi, contains, kind_of

PART_OF = "app.kubernetes.io/part-of=openrl"
SECRETS = {
    "openrl-api-keys": "kubectl -n {ns} create secret generic openrl-api-keys --from-literal=OPENRL_API_KEYS=alice=tml-...",
    "openrl-database": "kubectl -n {ns} create secret generic openrl-database "
    "--from-literal=POSTGRES_PASSWORD=... --from-literal=OPENRL_DATABASE_URL=postgresql+psycopg://openrl:...@openrl-postgres:5432/openrl",
}
# Cluster objects only read by OpenRL: never listed for status, never deleted.
FOREIGN = {("v1", "Node"), ("v1", "Pod"), ("v1", "Namespace"), ("v1", "Secret")}


@dataclass(frozen=True)
class Change:
    action: str  # created | patched | unchanged | deleted
    kind: str
    name: str

    def __str__(self) -> str:
        return f"{self.action:9} {self.kind}/{self.name}"


def preflight(api: KubeApi, config: DeployConfig) -> None:
    if api.get(("v1", "Namespace"), config.namespace) is None:
        # Not created here: a namespace usually carries quotas and policies an operator sets.
        raise DeployConfigError(
            f"namespace {config.namespace!r} does not exist; create it first: kubectl create namespace {config.namespace}"
        )
    if not config.distributed:
        return  # single-node: the API-key Secret is optional, the store is SQLite
    missing = [name for name in SECRETS if api.get(("v1", "Secret"), name, config.namespace) is None]
    if missing:
        how = "\n  ".join(SECRETS[name].format(ns=config.namespace) for name in missing)
        raise DeployConfigError(
            f"missing Secret(s) {missing} in namespace {config.namespace!r}; create them first:\n  {how}"
        )


def apply(api: KubeApi, objects: Iterable[dict]) -> list[Change]:
    changes = []
    for obj in objects:
        kind = kind_of(obj)
        meta = obj["metadata"]
        live = api.get(kind.key, meta["name"], meta.get("namespace"))
        if live is None:
            api.create(obj)
            action = "created"
        elif contains(live, obj):
            action = "unchanged"
        else:
            api.patch(kind.key, meta["name"], obj, meta.get("namespace"))
            action = "patched"
        changes.append(Change(action, obj["kind"], meta["name"]))
    return changes


def owned(api: KubeApi, namespace: str) -> list[dict]:
    found = []
    for key, kind in KINDS.items():
        if key in FOREIGN:
            continue
        selector = PART_OF if kind.namespaced else f"{PART_OF},openrl.ai/namespace={namespace}"
        found.extend(api.list(key, namespace if kind.namespaced else None, selector))
    return found


def state_of(obj: dict) -> str:
    status = obj.get("status") or {}
    if obj["apiVersion"].startswith("serving.knative.dev/"):
        ready = readiness(obj)
        return "Ready" if ready.ready else f"not ready ({ready.reason})"
    if obj["kind"] in ("StatefulSet", "Deployment"):
        return f"{status.get('readyReplicas', 0)}/{obj['spec'].get('replicas', 1)} ready"
    if obj["kind"] == "DaemonSet":
        return f"{status.get('numberReady', 0)}/{status.get('desiredNumberScheduled', 0)} ready"
    return "-"


def status(api: KubeApi, namespace: str) -> list[tuple[str, str, str]]:
    rows = [(o["kind"] if not o["apiVersion"].startswith("serving.") else "KnativeService", o["metadata"]["name"], state_of(o))
            for o in owned(api, namespace)]  # fmt: skip
    return sorted(rows)


def delete(api: KubeApi, namespace: str) -> list[Change]:
    objects = owned(api, namespace)

    # The scheduler first (it would recreate workers), then workloads, then the rest.
    def first(o: dict) -> tuple[bool, bool]:
        return o["metadata"]["name"] != "openrl-scheduler", o["kind"] not in ("StatefulSet", "Deployment", "DaemonSet")

    changes = []
    for obj in sorted(objects, key=first):
        kind = kind_of(obj)
        if api.delete(kind.key, obj["metadata"]["name"], obj["metadata"].get("namespace")):
            changes.append(Change("deleted", obj["kind"], obj["metadata"]["name"]))
    return changes
