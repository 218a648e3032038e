"""Accelerators from Node objects: which nodes count, and where each device's memory comes from."""

from functions.scheduler.inventory import devices_from
from functions.scheduler.timeslicer_status import parse_status
from openrl_core.placement import Device

GiB = 1 << 30


def node(name, gpus=1, labels=None, ready="True", cordoned=False):
    return {
        "metadata": {"name": name, "labels": labels or {}},
        "spec": {"unschedulable": True} if cordoned else {},
        "status": {"allocatable": {"nvidia.com/gpu": str(gpus)}, "conditions": [{"type": "Ready", "status": ready}]},
    }


def test_memory_from_the_timeslicer_then_the_operator_label_then_gpu_feature_discovery():
    nodes = [
        node("sliced", gpus=2, labels={"openrl.ai/accelerator-memory": "80GiB"}),
        node("labelled", labels={"openrl.ai/accelerator-memory": "40GiB", "nvidia.com/gpu.memory": "81920"}),
        node("discovered", labels={"nvidia.com/gpu.memory": "15360"}),
        node("unknown"),
        node("down", ready="False"),
        node("cordoned", cordoned=True),
        node("cpu", gpus=0),
    ]
    status = parse_status(
        '{"node": "sliced", "policy": "fifo", "devices": ['
        '{"device": "cuda:0", "budget_bytes": 6442450944, "resident_bytes": 0, "residents": '
        '[{"job": "openrl-trainer-a-0", "bytes": 1073741824, "parked": false}, {"job": "x", "bytes": 2147483648, "parked": false}]},'
        '{"device": "cuda:1", "budget_bytes": 6442450944, "resident_bytes": 0}]}'
    )
    devices, skipped = devices_from(nodes, {"sliced": status}, lambda job: job.startswith("openrl-trainer-a"))
    assert devices == [
        Device("sliced", 0, 6 * GiB, 2 * GiB), Device("sliced", 1, 6 * GiB),
        Device("labelled", 0, 40 * GiB), Device("discovered", 0, 15 * GiB),
    ]  # fmt: skip
    assert skipped == {
        "unknown": "no timeslicer status and no openrl.ai/accelerator-memory or nvidia.com/gpu.memory label",
        "down": "not Ready", "cordoned": "cordoned (unschedulable)", "cpu": "no nvidia.com/gpu allocatable",
    }  # fmt: skip
