"""Our kustomize subset against kubectl's kustomize, overlay by overlay, and its refusals."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from functions.deploy.errors import DeployConfigError
from functions.deploy.kustomize import build, identity, merge

KNATIVE = Path(__file__).resolve().parents[3] / "knative"
OVERLAYS = sorted(p.name for p in (KNATIVE / "overlays").iterdir() if p.is_dir())


def test_every_overlay_directory_is_rendered():
    assert OVERLAYS == ["distributed", "gpu", "single-node", "topics"]


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl is not installed here: only our renderer runs")
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_same_objects_as_kubectl_kustomize(overlay):
    done = subprocess.run(
        ["kubectl", "kustomize", str(KNATIVE / "overlays" / overlay)], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    theirs = {identity(o): o for o in yaml.safe_load_all(done.stdout) if o}
    ours = {identity(o): o for o in build(KNATIVE / "overlays" / overlay)}
    assert sorted(ours) == sorted(theirs)
    for key in ours:
        assert ours[key] == theirs[key], key


def test_strategic_merge_by_the_fields_merge_keys():
    base = {"spec": {"containers": [{"name": "a", "image": "x", "env": [{"name": "A", "value": "1"}]}],
                     "tolerations": [{"key": "t1"}]}}  # fmt: skip
    patch = {"spec": {"containers": [{"name": "a", "env": [{"name": "B", "value": "2"}]}, {"name": "b"}],
                      "tolerations": [{"key": "t2"}]}}  # fmt: skip
    merged = merge(base, patch)
    assert merged["spec"]["containers"] == [
        {"name": "b"},
        {"name": "a", "image": "x", "env": [{"name": "B", "value": "2"}, {"name": "A", "value": "1"}]},
    ]
    assert merged["spec"]["tolerations"] == [{"key": "t2"}]  # no merge key: replaced
    assert base["spec"]["containers"][0]["env"] == [{"name": "A", "value": "1"}]  # inputs untouched


def test_what_it_does_not_implement_is_refused_by_name(tmp_path):
    (tmp_path / "kustomization.yaml").write_text("resources: []\nnamePrefix: x-\n")
    with pytest.raises(DeployConfigError, match=r"does not implement: \['namePrefix'\]"):
        build(tmp_path)
    (tmp_path / "kustomization.yaml").write_text("resources: []\npatches:\n- path: p.yaml\n")
    (tmp_path / "p.yaml").write_text("apiVersion: v1\nkind: ConfigMap\nmetadata: {name: nope}\n")
    with pytest.raises(DeployConfigError, match="targets .*nope.*which is not here"):
        build(tmp_path)
    with pytest.raises(DeployConfigError, match="has no kustomization.yaml"):
        build(tmp_path / "missing")
