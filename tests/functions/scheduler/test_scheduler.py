"""The scheduler against kmock (the API), a real event store and log, and a real node
timeslicer daemon on a loopback address (its /status read over HTTP, its residents real
worker clients). Full fine-tuning runs are created by their create_model event."""

from __future__ import annotations

from datetime import timedelta

import pytest
import yaml

from eventing.blobs import BlobStore
from eventing.bus import EventPublisher
from eventing.codec import Codec
from eventing.embedded_log import EmbeddedLog
from eventing.notify import LocalNotifier
from eventing.projector import Projector
from eventing.store import database
from eventing.store.event_store import EventStore
from eventing.store.queries import Projections
from functions.deploy.config import checked
from functions.deploy.render import worker_templates
from functions.scheduler.controller import STS, Scheduler, load_templates
from openrl_core.catalog import TINY_QWEN3
from openrl_core.events import new_event
from openrl_core.events import sampling as se
from openrl_core.events import sessions as sess
from openrl_core.settings import Settings
from openrl_core.workload import WorkerSpec
from tests.functions.audit.scenario import GATEWAY, T0, Stream
from tests.functions.scheduler.node_timeslicer import NodeTimeslicer

GiB = 1 << 30
TRAINER, SAMPLER = WorkerSpec("trainer", TINY_QWEN3), WorkerSpec("sampler", TINY_QWEN3)


class Clock:
    def __init__(self):
        self.now = T0

    def __call__(self):
        return self.now

    def at(self, **delta):
        self.now = T0 + timedelta(**delta)


@pytest.fixture
def rig(kube, tmp_path):
    engine = database.make_engine(f"sqlite:///{tmp_path / 'events.db'}")
    database.upgrade(engine)
    codec = Codec(BlobStore(tmp_path / "blobs"))
    store, log = EventStore(engine, codec), EmbeddedLog(tmp_path / "log.db", fsync=False)
    with NodeTimeslicer("127.0.0.2", "gpu-a", {"cuda:0": 6 * GiB, "cuda:1": 6 * GiB}) as daemon:
        kube.api.create(node("gpu-a", gpus=2))
        kube.api.create(node("cpu-only", gpus=0))
        kube.api.create(timeslicer_pod("gpu-a", "127.0.0.2"))
        yield Rig(kube, tmp_path, store, log, codec, daemon)
    log.close()
    engine.dispose()


class Rig:
    def __init__(self, kube, tmp_path, store, log, codec, daemon):
        self.kube, self.store, self.log, self.daemon = kube, store, log, daemon
        self.clock = Clock()
        self.templates = worker_templates(
            checked(image="registry.example/openrl:1", overlays=["gpu"], tenants=["alice"])
        )
        self.publisher = EventPublisher(log, codec)
        self.tmp_path = tmp_path

    def scheduler(self, **overrides) -> Scheduler:
        options = dict(device="cuda", namespace="openrl", data_dir=self.tmp_path, scheduler_job_memory={TINY_QWEN3: "2GiB"},
                       scheduler_timeslicer_port=self.daemon.port)  # fmt: skip
        settings = Settings(**{**options, **overrides})
        return Scheduler(self.kube.api, settings, self.templates, self.store, self.publisher, clock=self.clock)

    def append(self, events):
        for event in events:
            self.store.append(event)

    def worker(self, spec):
        return self.kube.api.get(STS, spec.name, "openrl")


def node(name, gpus):
    return {
        "apiVersion": "v1", "kind": "Node",
        "metadata": {"name": name, "labels": {"kubernetes.io/hostname": name}},
        "status": {"allocatable": {"cpu": "32", "nvidia.com/gpu": str(gpus)}, "conditions": [{"type": "Ready", "status": "True"}]},
    }  # fmt: skip


def timeslicer_pod(node_name, ip):
    return {
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": f"openrl-timeslicer-{node_name}", "namespace": "openrl",
                     "labels": {"app.kubernetes.io/name": "openrl", "app.kubernetes.io/component": "timeslicer"}},
        "spec": {"nodeName": node_name}, "status": {"podIP": ip},
    }  # fmt: skip


def session_with_run_and_sampler(stream: Stream, t: float):
    stream.session_created(t=t)
    create = stream.create_model(f"{stream.session}-create", t=t + 1)
    stream.completed(create, t + 2, {"model_id": stream.model})
    payload = se.SamplingSessionCreated(sampling_session_id=stream.sampler, session_id=stream.session,
                                        sampling_session_seq_id=0, base_model=TINY_QWEN3)  # fmt: skip
    stream.emit(se.SAMPLING_SESSION_CREATED, payload, t=t + 3, source=GATEWAY, key=stream.sampler, stream="control")
    return stream.events


def finished(session: str, t: float):
    event = new_event(sess.SESSION_FINISHED, sess.SessionFinished(session_id=session, reason="client"), tenant="alice",
                      source=GATEWAY, key=session)  # fmt: skip
    return event.model_copy(update={"time": T0 + timedelta(seconds=t)})


def env_of(worker):
    return {e["name"]: e.get("value") for e in worker["spec"]["template"]["spec"]["containers"][0].get("env", [])}


def test_places_workers_keeps_them_through_brief_idleness_and_releases_them_after_the_timeout(rig):
    rig.append(session_with_run_and_sampler(Stream("alice", session="s1"), t=0))
    scheduler = rig.scheduler()
    rig.clock.at(minutes=1)
    report = scheduler.reconcile()
    assert sorted(report.created) == sorted([TRAINER.name, SAMPLER.name])
    assert report.skipped_nodes == {"cpu-only": "no nvidia.com/gpu allocatable"}
    trainer, sampler = rig.worker(TRAINER), rig.worker(SAMPLER)
    # binpack: both fit one 6 GiB device (2 GiB each), time-sliced by the node's timeslicer
    for worker in (trainer, sampler):
        pod = worker["spec"]["template"]["spec"]
        assert pod["nodeSelector"] == {"kubernetes.io/hostname": "gpu-a"}
        assert env_of(worker)["NVIDIA_VISIBLE_DEVICES"] == "0" and env_of(worker)["OPENRL_DEVICE"] == "cuda:0"
        assert "nvidia.com/gpu" not in pod["containers"][0]["resources"].get("limits", {})
    assert trainer["spec"]["template"]["spec"]["containers"][0]["args"] == [
        "trainer",
        "--base-model",
        TINY_QWEN3,
        "--kind",
        "lora",
    ]
    assert trainer["spec"]["replicas"] == 1 and trainer["metadata"]["annotations"]["openrl.ai/placement"] == "gpu-a/0"

    writes = len(rig.kube.requests("POST")) + len(rig.kube.requests("PATCH"))
    for minutes in (2, 10, 14):  # briefly idle: minutes, not seconds, before anything is released
        rig.clock.at(minutes=minutes)
        assert scheduler.reconcile().lines() == ["node       cpu-only: no nvidia.com/gpu allocatable"]
    assert len(rig.kube.requests("POST")) + len(rig.kube.requests("PATCH")) == writes

    rig.clock.at(minutes=16)
    assert sorted(scheduler.reconcile().released) == sorted([TRAINER.name, SAMPLER.name])
    assert rig.worker(TRAINER)["spec"]["replicas"] == 0

    # a new request brings the trainer back (it restores its snapshot and replays)
    stream = Stream("alice", session="s1")
    rig.append([stream.forward_backward("req-late", t=20 * 60)])
    rig.clock.at(minutes=20, seconds=5)
    assert scheduler.reconcile().scaled_up == [TRAINER.name]
    assert rig.worker(TRAINER)["spec"]["replicas"] == 1


def test_the_last_session_finishing_releases_at_once_and_a_full_runs_trainer_is_removed(rig):
    rig.append(session_with_run_and_sampler(Stream("alice", session="s1"), t=0))
    full = Stream("alice", session="s2")
    full.session_created(t=0)
    full.completed(full.create_model("full-create", t=1, full=True), 2, {"model_id": full.model})
    rig.append(full.events)
    full_trainer = WorkerSpec("trainer", TINY_QWEN3, model_id=full.model)
    scheduler = rig.scheduler(scheduler_full_finetune_factor=2.5)
    rig.clock.at(minutes=1)
    assert full_trainer.name in scheduler.reconcile().created
    worker = rig.worker(full_trainer)
    assert worker["spec"]["template"]["spec"]["containers"][0]["args"][-4:] == [
        "--kind",
        "full",
        "--model-id",
        full.model,
    ]
    assert worker["metadata"]["annotations"]["openrl.ai/memory-bytes"] == str(5 * GiB)  # 2 GiB x the full-FT factor

    rig.append([finished("s2", t=90), finished("s1", t=100)])
    rig.clock.at(minutes=2)  # well within the idle timeout: finishing is what releases them
    report = scheduler.reconcile()
    assert report.deleted == [full_trainer.name] and rig.worker(full_trainer) is None
    assert sorted(report.released) == sorted([TRAINER.name, SAMPLER.name])


def test_a_deleted_worker_is_recreated_under_the_same_name_so_its_replacement_resumes(rig):
    rig.append(session_with_run_and_sampler(Stream("alice", session="s1"), t=0))
    stream = Stream("alice", session="s1")
    rig.append([stream.forward_backward("req-in-flight", t=5)])
    scheduler = rig.scheduler()
    rig.clock.at(minutes=1)
    scheduler.reconcile()
    before = rig.worker(TRAINER)
    assert rig.kube.api.delete(STS, TRAINER.name, "openrl")  # someone deletes the worker
    rig.clock.at(minutes=1, seconds=10)
    assert scheduler.reconcile().created == [TRAINER.name]
    after = rig.worker(TRAINER)
    # same name, so the pod is <name>-0 again: the same OPENRL_INSTANCE_ID (static membership)
    assert after["metadata"]["name"] == before["metadata"]["name"]
    assert after["spec"]["template"]["spec"] == before["spec"]["template"]["spec"]


def test_requests_waiting_on_a_worker_that_cannot_be_placed_fail_with_the_reason_after_the_grace(rig, tmp_path):
    stream = Stream("alice", session="s1")
    rig.append(session_with_run_and_sampler(stream, t=0))
    rig.append([stream.forward_backward("req-stuck", t=10)])
    scheduler = rig.scheduler(scheduler_job_memory={TINY_QWEN3: "7GiB"}, scheduler_unplaced_grace_seconds=300)
    rig.clock.at(minutes=2)
    report = scheduler.reconcile()
    assert TRAINER.name in report.unplaced and "the most any accelerator has free is" in report.unplaced[TRAINER.name]
    assert report.failed_requests == [] and rig.worker(TRAINER) is None
    rig.clock.at(minutes=6)
    assert scheduler.reconcile().failed_requests == ["req-stuck"]
    assert scheduler.reconcile().failed_requests == []  # once, not every pass

    projector = Projector(rig.log, rig.store, LocalNotifier())
    while projector.run_once(timeout=0.2):
        pass
    future = Projections(rig.store.engine).future("alice", "req-stuck")
    assert future.state == "failed" and future.category == "server"
    assert future.error.startswith(f"no worker could be placed for trainer of {TINY_QWEN3} (needs {7 * GiB} bytes")
    assert "waited 350 s" in future.error


def test_spread_gives_each_worker_its_own_device_and_foreign_residents_take_room(rig):
    rig.append(session_with_run_and_sampler(Stream("alice", session="s1"), t=0))
    rig.clock.at(minutes=1)
    rig.scheduler(scheduler_policy="spread").reconcile()
    devices = {env_of(rig.worker(s))["NVIDIA_VISIBLE_DEVICES"] for s in (TRAINER, SAMPLER)}
    assert devices == {"0", "1"}

    for spec in (TRAINER, SAMPLER):
        rig.kube.api.delete(STS, spec.name, "openrl")
    # another job (not ours) holds 5 of device 0's 6 GiB: binpack now uses device 1
    rig.daemon.worker("other-team").register("other-team/model/x", 5 * GiB, "cuda:0", resident=True)
    rig.scheduler().reconcile()
    assert {env_of(rig.worker(s))["NVIDIA_VISIBLE_DEVICES"] for s in (TRAINER, SAMPLER)} == {"1"}


def test_on_a_cpu_deployment_workers_are_scaled_without_placement(rig):
    rig.append(session_with_run_and_sampler(Stream("alice", session="s1"), t=0))
    rig.clock.at(minutes=1)
    report = rig.scheduler(device="cpu", scheduler_base_models=[TINY_QWEN3]).reconcile()
    assert sorted(report.created) == sorted([TRAINER.name, SAMPLER.name]) and not report.skipped_nodes
    assert "kubernetes.io/hostname" not in (rig.worker(TRAINER)["spec"]["template"]["spec"].get("nodeSelector") or {})
    assert "NVIDIA_VISIBLE_DEVICES" not in env_of(rig.worker(TRAINER))
    rig.clock.at(hours=5)  # floor models stay up whatever the idleness
    assert rig.scheduler(device="cpu", scheduler_base_models=[TINY_QWEN3]).reconcile().released == []


def test_templates_are_read_from_the_mounted_config_map(tmp_path):
    from functions.deploy.errors import DeployConfigError

    templates = worker_templates(checked(image="i:1", overlays=["distributed"], tenants=["alice"]))
    for role, template in templates.items():
        (tmp_path / f"{role}.yaml").write_text(yaml.safe_dump(template))
    assert load_templates(tmp_path) == templates
    (tmp_path / "sampler.yaml").unlink()
    with pytest.raises(DeployConfigError, match="no sampler template"):
        load_templates(tmp_path)


def test_openrl_scheduler_once_through_the_cli(rig, tmp_path, monkeypatch, capsys):
    from functions.cli import main
    from tests.functions.deploy.test_deploy import kubeconfig

    templates = tmp_path / "templates"
    templates.mkdir()
    for role, template in rig.templates.items():
        (templates / f"{role}.yaml").write_text(yaml.safe_dump(template))
    monkeypatch.setenv("OPENRL_DATA_DIR", str(tmp_path))
    monkeypatch.setenv("OPENRL_DEVICE", "cpu")
    monkeypatch.setenv("OPENRL_SCHEDULER_BASE_MODELS", TINY_QWEN3)
    argv = ["scheduler", "--once", "--templates", str(templates), "--kubeconfig", kubeconfig(tmp_path, rig.kube.url)]
    assert main(argv) == 0
    assert capsys.readouterr().out.splitlines() == [f"created    {SAMPLER.name}", f"created    {TRAINER.name}"]
    assert main(argv) == 0
    assert capsys.readouterr().out.splitlines() == ["nothing to change"]
    assert main([*argv[:3], str(tmp_path / "nowhere"), *argv[4:]]) == 2
    assert "no trainer template at" in capsys.readouterr().err


def test_a_trainer_of_a_model_of_known_shape_is_placed_by_the_memory_model(rig):
    """No scheduler_job_memory entry: a trainer of a model whose dimensions the catalogue knows
    needs the memory model's peak (bf16 on CUDA, one pass of trainer_pack_max_tokens); a
    sampler, which the model does not cover, the default."""
    from openrl_core import memory

    rig.append(session_with_run_and_sampler(Stream("alice", session="s1"), t=0))
    scheduler = rig.scheduler(scheduler_job_memory={}, scheduler_default_job_memory="3GiB")
    rig.clock.at(minutes=1)
    report = scheduler.reconcile()
    assert TRAINER.name in report.created and SAMPLER.name in report.created
    want = memory.trainer_bytes(memory.shape_of(TINY_QWEN3), "lora", "bfloat16", 8192)
    shape = memory.shape_of(TINY_QWEN3)
    # by hand: bf16 base, rank-32 adapter in float32 x 4, and one 8192-token pass
    assert want == 2 * shape.parameters() + 16 * shape.lora_parameters(32) + memory.activation_bytes(
        shape, memory.Batch(1, 8192), "bfloat16", "lora", lora_rank=32
    )
    assert rig.worker(TRAINER)["metadata"]["annotations"]["openrl.ai/memory-bytes"] == str(want)
    assert rig.worker(SAMPLER)["metadata"]["annotations"]["openrl.ai/memory-bytes"] == str(3 * GiB)
