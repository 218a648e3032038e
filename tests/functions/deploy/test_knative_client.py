"""The Knative Serving client against kmock: every call, and waiting for Ready with its reason."""

from __future__ import annotations

import threading

import pytest

from functions.deploy.errors import NotReady
from functions.deploy.knative import KnativeServing, readiness


def service(name: str) -> dict:
    return {
        "apiVersion": "serving.knative.dev/v1", "kind": "Service",
        "metadata": {"name": name, "namespace": "ns", "labels": {"app.kubernetes.io/part-of": "openrl"}},
        "spec": {"template": {"spec": {"containers": [{"image": "openrl:1"}]}}},
    }  # fmt: skip


def ready_status(status: str, reason: str = "", message: str = "") -> dict:
    return {"status": {"conditions": [{"type": "Ready", "status": status, "reason": reason, "message": message}]}}


def test_create_get_list_patch_delete(kube):
    serving = KnativeServing(kube.api.client, "ns")
    serving.create(service("gateway"))
    serving.create({**service("audit"), "metadata": {"name": "audit", "namespace": "ns", "labels": {}}})
    assert serving.get("gateway")["spec"]["template"]["spec"]["containers"][0]["image"] == "openrl:1"
    assert [s["metadata"]["name"] for s in serving.list("app.kubernetes.io/part-of=openrl")] == ["gateway"]
    serving.patch("gateway", {"spec": {"template": {"spec": {"containers": [{"image": "openrl:2"}]}}}})
    assert serving.get("gateway")["spec"]["template"]["spec"]["containers"][0]["image"] == "openrl:2"
    assert serving.delete("gateway") and not serving.delete("gateway")
    assert serving.get("gateway") is None
    # the create went out with its Content-Type (the generated call omits it unless told)
    posts = kube.requests("POST")
    assert len(posts) == 2 and all(r.headers.get("Content-Type", "").startswith("application/json") for r in posts)


def test_wait_ready_returns_once_the_controller_reports_ready(kube):
    serving = KnativeServing(kube.api.client, "ns")
    serving.create(service("gateway"))
    serving.patch("gateway", ready_status("Unknown", "RevisionMissing", "Configuration is waiting for a Revision"))
    # Stands in for Knative's controller, which kmock does not run.
    later = threading.Timer(0.3, lambda: serving.patch("gateway", ready_status("True")))
    later.start()
    try:
        assert readiness(serving.wait_ready("gateway", timeout=10, poll=0.05)).ready
    finally:
        later.cancel()


def test_wait_ready_fails_with_the_last_reason(kube):
    serving = KnativeServing(kube.api.client, "ns")
    serving.create(service("gateway"))
    serving.patch("gateway", ready_status("False", "RevisionFailed", "Back-off pulling image openrl:1"))
    with pytest.raises(NotReady, match="RevisionFailed: Back-off pulling image openrl:1"):
        serving.wait_ready("gateway", timeout=0.2, poll=0.05)
    with pytest.raises(NotReady, match="not found"):
        serving.wait_ready("missing", timeout=0.1, poll=0.05)


def test_readiness_of_a_stale_generation_is_not_ready():
    stale = {"metadata": {"generation": 3}, **ready_status("True")}
    stale["status"]["observedGeneration"] = 2
    assert readiness(stale) == readiness(stale) and not readiness(stale).ready
    assert readiness({"status": {}}).reason == "no Ready condition yet"
