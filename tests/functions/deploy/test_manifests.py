"""Every manifest `openrl deploy --dry-run` renders, for every overlay, against the published schema of its kind."""

from __future__ import annotations

import copy

import pytest
import yaml

from functions.deploy.config import checked
from functions.deploy.render import render, topic_names, worker_templates
from functions.deploy.workers import Pin, stamp
from openrl_core.catalog import SMOLLM2_135M, TINY_QWEN3
from openrl_core.settings import Settings
from openrl_core.workload import WorkerSpec
from tests.functions.deploy.schema_check import problems

DEPLOYMENTS = {
    "single-node": dict(overlays=["single-node"]),
    "distributed": dict(overlays=["distributed"]),
    "distributed+topics": dict(overlays=["distributed", "topics"]),
    "distributed, external database": dict(overlays=["distributed"], external_database=True),
    "gpu": dict(overlays=["gpu"]),
    "gpu+topics": dict(overlays=["gpu", "topics"]),
}


def deployment(**options):
    options.setdefault("tenants", ["alice", "bob"])
    options.setdefault("base_models", [TINY_QWEN3, SMOLLM2_135M])
    return checked(image="registry.example/openrl:0.1.0", namespace="research", **options)


@pytest.mark.parametrize("name", DEPLOYMENTS)
def test_every_rendered_manifest_validates_strictly(name):
    config = deployment(**DEPLOYMENTS[name])
    objects = render(config)
    assert objects
    assert [p for obj in objects for p in problems(obj)] == []
    # what `--dry-run` prints parses back to the same objects
    assert list(yaml.safe_load_all(yaml.safe_dump_all(objects))) == objects


@pytest.mark.parametrize("overlays", [["distributed"], ["gpu"]])
def test_stamped_workers_validate_placed_or_not(overlays):
    templates = worker_templates(deployment(overlays=overlays))
    assert sorted(templates) == ["sampler", "trainer"]
    specs = [
        WorkerSpec("trainer", TINY_QWEN3),
        WorkerSpec("sampler", SMOLLM2_135M),
        WorkerSpec("trainer", TINY_QWEN3, "s1:train:3"),
    ]
    for spec in specs:
        for pin in (None, Pin("gpu-node-7", 2)):
            worker = stamp(templates[spec.role], spec, pin, memory_bytes=2**30)
            assert problems(worker) == [], worker["metadata"]["name"]


# -- the validator really fails bad manifests ----------------------------------------------


def _gateway():
    return next(o for o in render(deployment()) if o["kind"] == "Service" and o["metadata"]["name"] == "openrl-gateway")


def _source():
    return next(o for o in render(deployment()) if o["kind"] == "KafkaSource")


def _mutated(obj, path, value):
    obj = copy.deepcopy(obj)
    node = obj
    for step in path[:-1]:
        node = node[step]
    node[path[-1]] = value
    return obj


CONTAINER = ["spec", "template", "spec", "containers", 0]
BAD = [
    ("knative: unknown container field", _gateway, CONTAINER + ["imagePullSecret"], "x", "Additional properties"),
    (
        "knative: wrong type",
        _gateway,
        ["spec", "template", "spec", "containerConcurrency"],
        "0",
        "is not of type 'integer'",
    ),
    ("knative: unknown spec field", _gateway, ["spec", "minScale"], 1, "Additional properties"),
    ("knative: bad label value", _gateway, ["metadata", "labels", "x"], "-bad-", "does not match"),
    ("kafkasource: unknown field", _source, ["spec", "topic"], "t", "Additional properties"),
    ("kafkasource: bad ordering", _source, ["spec", "ordering"], "fifo", "is not one of"),
    ("kafkasource: bad backoff", _source, ["spec", "delivery", "backoffPolicy"], "fibonacci", "is not one of"),
    ("kafkasource: no topics", _source, ["spec", "topics"], [], "should be non-empty"),
]


@pytest.mark.parametrize("case, make, path, value, message", BAD, ids=[b[0] for b in BAD])
def test_custom_kinds_fail_unknown_fields_and_wrong_types(case, make, path, value, message):
    found = problems(_mutated(make(), path, value))
    assert found and message in " ".join(found)


def test_core_kinds_fail_unknown_fields_and_wrong_types():
    sts = next(o for o in render(deployment()) if o["kind"] == "Deployment")
    assert "replica" in " ".join(problems(_mutated(sts, ["spec", "replica"], 1)))
    assert problems(_mutated(sts, ["spec", "replicas"], "one"))
    assert problems({"apiVersion": "apps/v1", "kind": "Nonsense", "metadata": {"name": "x"}})


# -- what the manifests promise ------------------------------------------------------------


def test_gateway_timeouts_exceed_the_longest_long_poll_and_it_never_scales_to_zero():
    longest = next(m.le for m in Settings.model_fields["long_poll_seconds"].metadata if hasattr(m, "le"))
    template = _gateway()["spec"]["template"]
    spec = template["spec"]
    assert min(spec["timeoutSeconds"], spec["responseStartTimeoutSeconds"], spec["idleTimeoutSeconds"]) > longest
    assert template["metadata"]["annotations"]["autoscaling.knative.dev/min-scale"] == "1"
    probes = spec["containers"][0]
    assert probes["readinessProbe"]["httpGet"]["path"] == "/health/readiness"
    assert probes["livenessProbe"]["httpGet"]["path"] == "/health/liveness"


def test_kafka_sources_are_ordered_with_backoff_and_a_dead_letter_sink_that_exists():
    objects = render(deployment())
    services = {o["metadata"]["name"] for o in objects if o["apiVersion"] == "serving.knative.dev/v1"}
    sources = [o for o in objects if o["kind"] == "KafkaSource"]
    assert sorted(s["metadata"]["name"] for s in sources) == ["openrl-audit", "openrl-metrics"]
    every_topic = topic_names(["alice", "bob"], [TINY_QWEN3, SMOLLM2_135M])
    # per tenant: training, training-full and sampling per model, then completions and control
    assert len(every_topic) == 2 * (3 * 2 + 2)
    for source in sources:
        spec = source["spec"]
        assert spec["ordering"] == "ordered" and spec["topics"] == every_topic
        assert spec["delivery"]["backoffPolicy"] == "exponential" and spec["delivery"]["retry"] > 0
        assert spec["delivery"]["deadLetterSink"]["ref"]["name"] in services
        assert spec["sink"]["ref"]["name"] == source["metadata"]["name"] in services


def test_topics_overlay_writes_one_kafka_topic_per_topic():
    topics = [o for o in render(deployment(overlays=["gpu", "topics"])) if o["kind"] == "KafkaTopic"]
    assert sorted(t["spec"]["topicName"] for t in topics) == topic_names(["alice", "bob"], [TINY_QWEN3, SMOLLM2_135M])
    assert all(t["spec"]["partitions"] == Settings().log_partitions for t in topics)


def test_settings_image_namespace_and_labels_are_filled_in():
    objects = render(deployment(overlays=["gpu"]))
    keys = set()
    for obj in objects:
        assert obj["metadata"]["labels"]["app.kubernetes.io/part-of"] == "openrl"
        if obj["kind"] in ("ClusterRole", "ClusterRoleBinding"):
            assert "namespace" not in obj["metadata"] and obj["metadata"]["labels"]["openrl.ai/namespace"] == "research"
        else:
            assert obj["metadata"]["namespace"] == "research"
        for subject in obj.get("subjects", []):
            assert subject["namespace"] == "research"
        pod = obj.get("spec", {}).get("template", {}).get("spec", {})
        for container in pod.get("containers", []):
            assert container["image"] in ("registry.example/openrl:0.1.0", "postgres:17")
            keys |= {e["name"] for e in container.get("env", []) if e["name"].startswith("OPENRL_")}
        if obj["kind"] == "ConfigMap" and obj["metadata"]["name"] == "openrl-config":
            keys |= set(obj["data"])
            assert obj["data"]["OPENRL_MODELS"] == f"{TINY_QWEN3},{SMOLLM2_135M}"
            assert obj["data"]["OPENRL_SCHEDULER_BASE_MODELS"] == obj["data"]["OPENRL_MODELS"]
            assert obj["data"]["OPENRL_DEVICE"] == "cuda"
    fields = {f"OPENRL_{name.upper()}" for name in Settings.model_fields}
    assert keys <= fields, keys - fields


def test_workers_are_templates_for_the_scheduler_not_applied():
    objects = render(deployment(overlays=["gpu"]))
    assert not [
        o
        for o in objects
        if o["kind"] == "StatefulSet" and o["metadata"]["name"] in ("openrl-trainer", "openrl-sampler")
    ]
    templates = next(o for o in objects if o["metadata"]["name"] == "openrl-worker-templates")["data"]
    trainer = yaml.safe_load(templates["trainer.yaml"])
    pod = trainer["spec"]["template"]["spec"]
    assert {"name": "timeslicer", "hostPath": {"path": "/run/openrl", "type": "DirectoryOrCreate"}} in pod["volumes"]
    assert {"name": "timeslicer", "mountPath": "/run/openrl"} in pod["containers"][0]["volumeMounts"]
    assert trainer["spec"]["template"]["spec"]["containers"][0]["image"] == "registry.example/openrl:0.1.0"
    daemon = next(o for o in objects if o["kind"] == "DaemonSet")
    assert "--http-port" in daemon["spec"]["template"]["spec"]["containers"][0]["args"]


def test_external_database_leaves_postgres_out():
    names = {o["metadata"]["name"] for o in render(deployment(external_database=True))}
    assert "openrl-postgres" not in names and "openrl-gateway" in names
    assert "openrl-postgres" in {o["metadata"]["name"] for o in render(deployment())}
