"""Worker StatefulSets stamped from the templates in knative/ (trainer, sampler) for one `WorkerSpec`.

The template carries everything operators tune (image, resources, tolerations, volumes,
the gpu overlay's patches); `stamp` fills in what is per worker: the name (which is also
the pod name prefix, hence the static Kafka group membership id `<name>-0`), the selector
and labels that tie pods to it, the command line (`trainer --base-model X --kind lora`, or
`--kind full --model-id RUN` for a full fine-tuning run's own trainer, or `sampler`), and the
placement the scheduler chose: the node (`kubernetes.io/hostname`) and the device, pinned
with NVIDIA_VISIBLE_DEVICES instead of a device-plugin request, because binpack may put
several workers on one device and the device plugin hands each device to one pod only.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, Optional

from functions.deploy.errors import DeployConfigError
from openrl_core.workload import WorkerSpec

Obj = dict[str, Any]
MANAGED_BY = "openrl-scheduler"
GPU_RESOURCE = "nvidia.com/gpu"


@dataclass(frozen=True)
class Pin:
    node: str
    device: int


def args_for(spec: WorkerSpec) -> list[str]:
    if spec.role == "sampler":
        return ["sampler", "--base-model", spec.base_model]
    args = ["trainer", "--base-model", spec.base_model, "--kind", spec.kind]
    return args + (["--model-id", spec.model_id] if spec.model_id else [])


def stamp(template: Obj, spec: WorkerSpec, pin: Optional[Pin] = None, memory_bytes: Optional[int] = None) -> Obj:
    if template.get("kind") != "StatefulSet":
        raise DeployConfigError(f"a worker template must be a StatefulSet, not {template.get('kind')!r}")
    worker = copy.deepcopy(template)
    meta = worker["metadata"]
    meta["name"] = spec.name
    meta.setdefault("labels", {}).update(
        {
            "app.kubernetes.io/component": spec.role,
            "app.kubernetes.io/managed-by": MANAGED_BY,
            "openrl.ai/worker": spec.name,
        }
    )
    annotations = meta.setdefault("annotations", {})
    annotations.pop("openrl.ai/template", None)
    annotations.update(
        {"openrl.ai/base-model": spec.base_model, "openrl.ai/placement": f"{pin.node}/{pin.device}" if pin else ""}
    )
    if spec.model_id:
        annotations["openrl.ai/model-id"] = spec.model_id
    if memory_bytes is not None:
        annotations["openrl.ai/memory-bytes"] = str(memory_bytes)
    selector = {"app.kubernetes.io/name": "openrl", "openrl.ai/worker": spec.name}
    worker["spec"]["selector"] = {"matchLabels": selector}
    worker["spec"]["replicas"] = 1
    pod = worker["spec"]["template"]
    pod.setdefault("metadata", {}).setdefault("labels", {}).update(
        {**selector, "app.kubernetes.io/component": spec.role}
    )
    containers = pod["spec"]["containers"]
    if len(containers) != 1:
        raise DeployConfigError(f"a worker template has one container, not {len(containers)}")
    container = containers[0]
    container["args"] = args_for(spec)
    if pin is not None:
        pod["spec"]["nodeSelector"] = {"kubernetes.io/hostname": pin.node}
        for limits in ("limits", "requests"):
            container.get("resources", {}).get(limits, {}).pop(GPU_RESOURCE, None)
        env = [e for e in container.get("env", []) if e["name"] not in ("NVIDIA_VISIBLE_DEVICES", "OPENRL_DEVICE")]
        container["env"] = env + [
            {"name": "NVIDIA_VISIBLE_DEVICES", "value": str(pin.device)},
            {"name": "OPENRL_DEVICE", "value": "cuda:0"},  # the one device the container sees
        ]
    return worker


def placement_of(worker: Obj) -> Optional[Pin]:
    text = (worker.get("metadata", {}).get("annotations") or {}).get("openrl.ai/placement") or ""
    node, sep, device = text.rpartition("/")
    return Pin(node, int(device)) if sep and device.isdigit() else None
