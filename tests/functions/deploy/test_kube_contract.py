"""The KubeApi contract, run against every implementation: here the official client on kmock."""

from __future__ import annotations

import pytest

from functions.deploy.errors import DeployConfigError
from functions.deploy.kube import KINDS, contains, kind_of

STS = ("apps/v1", "StatefulSet")
KSVC = ("serving.knative.dev/v1", "Service")


def statefulset(name: str, replicas: int = 1, **labels) -> dict:
    return {
        "apiVersion": "apps/v1", "kind": "StatefulSet",
        "metadata": {"name": name, "namespace": "ns", "labels": {"app": "openrl", **labels}},
        "spec": {"replicas": replicas},
    }  # fmt: skip


def test_create_get_list_patch_delete_a_core_kind(kube):
    api = kube.api
    assert api.get(STS, "a", "ns") is None
    api.create(statefulset("a", role="trainer"))
    api.create(statefulset("b", role="sampler"))
    assert api.get(STS, "a", "ns")["metadata"]["labels"]["role"] == "trainer"
    assert sorted(o["metadata"]["name"] for o in api.list(STS, "ns")) == ["a", "b"]
    assert [o["metadata"]["name"] for o in api.list(STS, "ns", "role=sampler")] == ["b"]
    api.patch(STS, "a", {"spec": {"replicas": 0}}, "ns")
    assert api.get(STS, "a", "ns")["spec"]["replicas"] == 0
    assert api.delete(STS, "a", "ns") is True
    assert api.delete(STS, "a", "ns") is False
    assert api.get(STS, "a", "ns") is None


def test_custom_objects_and_cluster_scoped_kinds(kube):
    api = kube.api
    service = {"apiVersion": "serving.knative.dev/v1", "kind": "Service", "metadata": {"name": "gw", "namespace": "ns"}}
    api.create(service)
    assert api.get(KSVC, "gw", "ns")["kind"] == "Service"
    api.create({"apiVersion": "v1", "kind": "Node", "metadata": {"name": "gpu-1"}})
    assert [n["metadata"]["name"] for n in api.list(("v1", "Node"))] == ["gpu-1"]


def test_creating_twice_is_a_conflict_with_the_status(kube):
    from functions.deploy.errors import ClusterError

    kube.api.create(statefulset("a"))
    with pytest.raises(ClusterError) as caught:
        kube.api.create(statefulset("a"))
    assert caught.value.status == 409


def test_unknown_kinds_and_missing_namespaces_are_refused_by_name():
    with pytest.raises(DeployConfigError, match="does not manage 'CronJob'"):
        kind_of({"apiVersion": "batch/v1", "kind": "CronJob"})
    with pytest.raises(DeployConfigError, match="StatefulSet is namespaced"):
        KINDS[STS].path(None, "x")


def test_contains_ignores_server_defaults_but_not_changes():
    desired = {"spec": {"containers": [{"name": "c", "image": "i:1"}], "replicas": 1}}
    live = {"spec": {"containers": [{"name": "c", "image": "i:1", "terminationMessagePath": "/dev/x"}], "replicas": 1},
            "status": {}}  # fmt: skip
    assert contains(live, desired)
    assert not contains(live, {"spec": {"containers": [{"name": "c", "image": "i:2"}]}})
    assert not contains(live, {"spec": {"containers": [{"name": "c"}, {"name": "d"}]}})
    assert not contains(live, {"spec": {"paused": True}})


def test_equality_label_selectors():
    from functions.deploy.kube import selects

    labels = {"app": "openrl", "role": "trainer"}
    assert selects("", labels) and selects("app=openrl,role=trainer", labels) and selects("app==openrl", labels)
    assert not selects("role=sampler", labels) and not selects("role!=trainer", labels)
    assert selects("role", labels) and not selects("!role", labels) and selects("!gpu", labels)
