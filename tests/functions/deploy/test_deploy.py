"""`openrl deploy` end to end through the CLI: dry-run output, apply twice, status, delete, and refusals."""

from __future__ import annotations

import pytest
import yaml

from functions.cli import main
from functions.deploy.apply import apply, owned
from functions.deploy.config import checked
from functions.deploy.errors import DeployConfigError
from functions.deploy.render import render
from tests.functions.deploy.schema_check import problems

IMAGE = "registry.example/openrl:0.1.0"


def kubeconfig(tmp_path, url: str):
    path = tmp_path / "kubeconfig"
    path.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "kmock",
        "clusters": [{"name": "kmock", "cluster": {"server": url}}],
        "contexts": [{"name": "kmock", "context": {"cluster": "kmock", "user": "me"}}],
        "users": [{"name": "me", "user": {"token": "t"}}],
    }))  # fmt: skip
    return str(path)


def namespace(kube, name="openrl"):
    # kmock cannot store Namespaces (its path parser takes `namespaces` for a namespace), so
    # the existing namespace is a canned answer to GET.
    kube.emulator[f"get /api/v1/namespaces/{name}"] << {
        "apiVersion": "v1",
        "kind": "Namespace",
        "metadata": {"name": name},
    }


def secrets(kube, namespace="openrl"):
    for name in ("openrl-api-keys", "openrl-database"):
        kube.api.create({"apiVersion": "v1", "kind": "Secret", "metadata": {"name": name, "namespace": namespace}})


def test_dry_run_prints_manifests_that_validate(capsys):
    assert (
        main(["deploy", "--dry-run", "--image", IMAGE, "--overlay", "gpu", "--overlay", "topics", "--tenant", "alice"])
        == 0
    )
    objects = [o for o in yaml.safe_load_all(capsys.readouterr().out) if o]
    assert len(objects) > 20 and [p for o in objects for p in problems(o)] == []
    assert {o["kind"] for o in objects} >= {"KafkaSource", "KafkaTopic", "DaemonSet", "Deployment", "ClusterRole"}


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--base-model", "meta/llama-9000"], "unknown base model(s) ['meta/llama-9000']; this build serves:"),
        (["--overlay", "aws"], "overlay(s) ['aws'] do not exist; choose from distributed, gpu, single-node, topics"),
        (["--overlay", "single-node", "--overlay", "gpu"], "choose exactly one of single-node, distributed, gpu"),
        (["--overlay", "single-node", "--overlay", "topics"], "overlay 'topics' goes with distributed or gpu"),
        (["--namespace", "Bad_NS"], "namespace 'Bad_NS' is not a Kubernetes name"),
        (["--tenant", "Alice!"], "tenant name 'Alice!' must be"),
        (["--scheduler-policy", "random"], "unknown scheduler policy 'random'"),
    ],
)
def test_bad_configuration_is_refused_naming_it(capsys, argv, message):
    assert main(["deploy", "--dry-run", "--image", IMAGE, *argv]) == 2
    assert message in capsys.readouterr().err


def test_no_image_is_refused(capsys):
    assert main(["deploy", "--dry-run"]) == 2
    assert "no container image: pass --image" in capsys.readouterr().err


def test_no_cluster_credentials_is_refused_before_anything(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "absent"))
    monkeypatch.setenv("HOME", str(tmp_path))
    assert main(["deploy", "--image", IMAGE]) == 2
    assert "no cluster credentials" in capsys.readouterr().err


def test_missing_namespace_and_secrets_are_named_before_anything_is_applied(kube, tmp_path, capsys):
    assert main(["deploy", "--image", IMAGE, "--kubeconfig", kubeconfig(tmp_path, kube.url)]) == 2
    assert (
        "namespace 'openrl' does not exist; create it first: kubectl create namespace openrl" in capsys.readouterr().err
    )
    namespace(kube)
    assert main(["deploy", "--image", IMAGE, "--kubeconfig", kubeconfig(tmp_path, kube.url)]) == 2
    err = capsys.readouterr().err
    assert (
        "missing Secret(s) ['openrl-api-keys', 'openrl-database']" in err and "kubectl -n openrl create secret" in err
    )
    assert owned(kube.api, "openrl") == [] and not kube.requests("POST")  # nothing applied


def test_apply_twice_changes_nothing_then_status_and_delete(kube, tmp_path, capsys):
    config = kubeconfig(tmp_path, kube.url)
    namespace(kube)
    secrets(kube)
    assert main(["deploy", "--image", IMAGE, "--overlay", "gpu", "--tenant", "alice", "--kubeconfig", config]) == 0
    first = capsys.readouterr().out.splitlines()
    assert first and all(line.startswith("created") for line in first)
    writes = len(kube.requests("POST")) + len(kube.requests("PATCH"))

    assert main(["deploy", "--image", IMAGE, "--overlay", "gpu", "--tenant", "alice", "--kubeconfig", config]) == 0
    second = capsys.readouterr().out.splitlines()
    assert len(second) == len(first) and all(line.startswith("unchanged") for line in second)
    assert len(kube.requests("POST")) + len(kube.requests("PATCH")) == writes  # not one write

    assert (
        main(
            [
                "deploy",
                "--image",
                "registry.example/openrl:0.2.0",
                "--overlay",
                "gpu",
                "--tenant",
                "alice",
                "--kubeconfig",
                config,
            ]
        )
        == 0
    )
    third = capsys.readouterr().out
    assert "patched   Deployment/openrl-projector" in third and "unchanged ServiceAccount/openrl" in third

    assert main(["deploy", "status", "--kubeconfig", config]) == 0
    report = capsys.readouterr().out
    assert "KnativeService         openrl-gateway" in report and "not ready (no Ready condition yet)" in report
    assert "DaemonSet              openrl-timeslicer" in report

    assert main(["deploy", "delete", "--kubeconfig", config]) == 0
    deleted = capsys.readouterr().out.splitlines()
    assert deleted[0] == "deleted   Deployment/openrl-scheduler"  # first, so it recreates nothing
    assert owned(kube.api, "openrl") == []
    assert kube.api.get(("v1", "Secret"), "openrl-api-keys", "openrl") is not None  # secrets are the operator's


def test_apply_reports_each_object_once_in_apply_order(kube):
    objects = render(checked(image=IMAGE, overlays=["distributed"], tenants=["alice"]))
    changes = apply(kube.api, objects)
    assert [c.name for c in changes] == [o["metadata"]["name"] for o in objects]
    kinds = [c.kind for c in changes]
    assert (
        kinds.index("ServiceAccount")
        < kinds.index("ConfigMap")
        < kinds.index("Deployment")
        < kinds.index("KafkaSource")
    )


def test_config_refuses_a_missing_manifest_directory(tmp_path):
    with pytest.raises(DeployConfigError, match="no overlays under"):
        checked(image=IMAGE, manifests=tmp_path)


def test_wait_reports_each_knative_service_ready_or_fails_with_its_reason(kube, tmp_path, capsys):
    import threading

    from functions.deploy.knative import KnativeServing

    config = kubeconfig(tmp_path, kube.url)
    namespace(kube)
    argv = ["deploy", "--image", IMAGE, "--overlay", "single-node", "--kubeconfig", config, "--wait", "0.5"]
    assert main(argv) == 0  # single-node has no Knative Service: nothing to wait for
    capsys.readouterr()
    secrets(kube)
    argv = ["deploy", "--image", IMAGE, "--tenant", "alice", "--kubeconfig", config, "--wait", "0.3"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "Knative Service openrl/openrl-audit not Ready after 0 s: no Ready condition yet" in err

    serving = KnativeServing(kube.api.client, "openrl")
    ready = {"status": {"conditions": [{"type": "Ready", "status": "True"}]}}
    names = ["openrl-audit", "openrl-dead-letters", "openrl-gateway", "openrl-metrics"]
    # Stands in for Knative's controller, which kmock does not run.
    timer = threading.Timer(0.3, lambda: [serving.patch(name, ready) for name in names])
    timer.start()
    assert main([*argv[:-1], "10"]) == 0
    timer.join()
    out = capsys.readouterr().out
    assert [line for line in out.splitlines() if line.startswith("ready")] == [
        f"ready     KnativeService/{n}" for n in names
    ]
