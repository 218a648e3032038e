"""The manifests of one deployment: the overlays rendered (kustomize subset), then made concrete.

`render(config)` builds each chosen overlay and then fills in what kustomize cannot know:

- the image (every container whose image is the placeholder `openrl`) and the namespace
  (namespaced objects, and the ServiceAccount subjects of role bindings);
- the settings in the ConfigMap openrl-config: served models, the Kafka bootstrap, the
  scheduler's namespace, floor models and policy;
- the worker templates (annotated `openrl.ai/template: worker`) are not applied: they go
  into the ConfigMap openrl-worker-templates, from which the scheduler stamps workers;
- the KafkaSources' fixed topic list: every tenant's streams of every base model (a
  KafkaSource cannot subscribe by pattern), and with the `topics` overlay one Strimzi
  KafkaTopic per topic from its template;
- labels that let `openrl deploy status/delete` find all of it: part-of=openrl,
  managed-by=openrl-deploy, and openrl.ai/namespace on cluster-scoped objects.

The result is in apply order (accounts and RBAC, config, storage, services, workloads,
Knative Services, then the KafkaSources that point at them).
"""

from __future__ import annotations

import copy
from typing import Any

import yaml

from eventing import topics
from functions.deploy.config import DeployConfig
from functions.deploy.kube import KINDS
from functions.deploy.kustomize import build, identity

Obj = dict[str, Any]
PLACEHOLDER_IMAGE = "openrl"
ORDER = [
    "Namespace", "ServiceAccount", "ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding", "Secret", "ConfigMap",
    "PersistentVolumeClaim", "KafkaTopic", "Service", "StatefulSet", "Deployment", "DaemonSet", "KnativeService",
    "KafkaSource",
]  # fmt: skip


def _rank(obj: Obj) -> tuple[int, str]:
    kind = "KnativeService" if obj["apiVersion"].startswith("serving.knative.dev/") else obj["kind"]
    return (ORDER.index(kind) if kind in ORDER else len(ORDER), obj["metadata"]["name"])


def topic_names(tenants: list[str], base_models: list[str]) -> list[str]:
    return sorted(
        topics.topic(tenant, stream, model if stream in topics.WORK_STREAMS else None)
        for tenant in tenants
        for stream in topics.STREAMS
        for model in (base_models if stream in topics.WORK_STREAMS else [None])
    )


def render(config: DeployConfig) -> list[Obj]:
    objects: dict[tuple, Obj] = {}
    for overlay in config.overlays:
        for obj in build(config.manifests / "overlays" / overlay):
            objects[identity(obj)] = obj
    rendered = [_concrete(obj, config) for obj in objects.values()]
    templates = [o for o in rendered if _template(o) == "worker"]
    topic_templates = [o for o in rendered if _template(o) == "topic"]
    rendered = [o for o in rendered if _template(o) is None]
    if config.external_database:
        rendered = [o for o in rendered if _component(o) != "postgres"]
    names = topic_names(config.tenants, config.base_models)
    for obj in rendered:
        if obj["kind"] == "ConfigMap" and obj["metadata"]["name"] == "openrl-config":
            obj["data"].update(_settings(config))
        if obj["kind"] == "ConfigMap" and obj["metadata"]["name"] == "openrl-worker-templates":
            obj["data"] = {f"{_component(t)}.yaml": yaml.safe_dump(t, sort_keys=False) for t in templates}
        if obj["kind"] == "KafkaSource":
            obj["spec"]["bootstrapServers"] = [config.kafka_bootstrap]
            obj["spec"]["topics"] = names
    for template in topic_templates:
        rendered.extend(_topic(template, name, config) for name in names)
    return sorted(rendered, key=_rank)


def worker_templates(config: DeployConfig) -> dict[str, Obj]:
    """The concrete worker templates of a deployment (what the scheduler reads), by role."""
    found: dict[str, Obj] = {}
    for overlay in config.overlays:
        for obj in build(config.manifests / "overlays" / overlay):
            if _template(obj) == "worker":
                found[_component(obj)] = _concrete(obj, config)
    return found


def _template(obj: Obj):
    return (obj["metadata"].get("annotations") or {}).get("openrl.ai/template")


def _component(obj: Obj) -> str:
    return (obj["metadata"].get("labels") or {}).get("app.kubernetes.io/component", "")


def _settings(config: DeployConfig) -> dict[str, str]:
    values = {"OPENRL_MODELS": ",".join(config.base_models)}
    if config.distributed:
        values.update(
            OPENRL_KAFKA_BOOTSTRAP=config.kafka_bootstrap,
            OPENRL_NAMESPACE=config.namespace,
            OPENRL_SCHEDULER_BASE_MODELS=",".join(config.base_models),
            OPENRL_SCHEDULER_POLICY=config.scheduler_policy,
            OPENRL_LOG_PARTITIONS=str(config.partitions),
        )
    return values


def _concrete(obj: Obj, config: DeployConfig) -> Obj:
    obj = copy.deepcopy(obj)
    kind = KINDS.get((obj["apiVersion"], obj["kind"]))
    meta = obj["metadata"]
    labels = meta.setdefault("labels", {})
    labels.update({"app.kubernetes.io/part-of": "openrl", "app.kubernetes.io/managed-by": "openrl-deploy"})
    if kind is not None and kind.namespaced:
        meta["namespace"] = config.namespace
    else:
        labels["openrl.ai/namespace"] = config.namespace
    for subject in obj.get("subjects") or []:
        if subject.get("kind") == "ServiceAccount":
            subject["namespace"] = config.namespace
    for container in _containers(obj):
        if container.get("image") == PLACEHOLDER_IMAGE:
            container["image"] = config.image
    return obj


def _containers(obj: Obj) -> list[Obj]:
    spec = obj.get("spec") or {}
    pod = (spec.get("template") or {}).get("spec") or {}
    return [*pod.get("containers", []), *pod.get("initContainers", [])]


def _topic(template: Obj, name: str, config: DeployConfig) -> Obj:
    topic = copy.deepcopy(template)
    topic["metadata"]["name"] = name  # topic names are valid DNS subdomains: letters, digits, '-', '.'
    topic["metadata"]["annotations"].pop("openrl.ai/template")
    if not topic["metadata"]["annotations"]:
        del topic["metadata"]["annotations"]
    topic["metadata"]["labels"]["strimzi.io/cluster"] = config.kafka_cluster
    topic["spec"].update(topicName=name, partitions=config.partitions)
    return topic
