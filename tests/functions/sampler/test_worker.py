"""The sampler worker over the real embedded log and tiny model: batching, failure
isolation, adapters by content hash with LRU eviction."""

from __future__ import annotations

import pytest

from eventing import topics
from eventing.blobs import BlobStore
from eventing.bus import EventPublisher
from eventing.codec import Codec
from eventing.embedded_log import EmbeddedLog
from functions.compute.models import ModelDirectory
from functions.sampler.worker import SamplerWorker
from functions.trainer.engine import TrainerEngine
from openrl_core.catalog import TINY_QWEN3, Catalog
from openrl_core.events import new_event
from openrl_core.events.sampling import SAMPLE, SampleRequested
from openrl_core.params import LoraConfig, SamplingParams

TENANT = "alice"


@pytest.fixture
def rig(tmp_path, tiny_files):
    log = EmbeddedLog(tmp_path / "log.db")
    codec = Codec(BlobStore(tmp_path / "blobs"))
    publisher = EventPublisher(log, codec)
    worker = SamplerWorker(
        log, publisher, codec.blobs, ModelDirectory(Catalog.from_names([TINY_QWEN3])), max_adapters=2
    )
    completions = log.consumer("test", pattern=topics.pattern("completions"))
    yield worker, publisher, completions, codec
    log.close()


def request(request_id, prompt=(1, 2, 3), adapter=None, num_samples=2, seed=5):
    return SampleRequested(
        request_id=request_id,
        sampling_session_id="s1:sample:0",
        seq_id=0,
        base_model=TINY_QWEN3,
        adapter=adapter,
        prompt_tokens=list(prompt),
        num_samples=num_samples,
        sampling_params=SamplingParams(max_tokens=4, seed=seed),
        sample_sequence_ids=[f"{request_id}:{i}" for i in range(num_samples)],
    )


def send(publisher, payload):
    event = new_event(SAMPLE["requested"], payload, tenant=TENANT, source="/test", key=payload.sampling_session_id)
    publisher.publish(topics.topic(TENANT, "sampling", TINY_QWEN3), event)


def collect(worker, completions, codec, expected):
    out = {}
    for _ in range(40):
        worker.run_once(timeout=0.1)
        for record in completions.poll(timeout=0.1):
            event = codec.decode(record.message)
            out[event.data.request_id] = event
        if len(out) >= expected:
            break
    return out


def test_a_bad_request_fails_alone_in_its_batch(rig):
    worker, publisher, completions, codec = rig
    send(publisher, request("good-1"))
    send(publisher, request("bad", prompt=(1, 10**7)))
    send(publisher, request("good-2", num_samples=3))
    done = collect(worker, completions, codec, 3)
    assert done["bad"].type == SAMPLE["failed"] and done["bad"].data.category == "user"
    assert len(done["good-1"].data.result["sequences"]) == 2
    assert len(done["good-2"].data.result["sequences"]) == 3
    for sequence in done["good-2"].data.result["sequences"]:
        assert len(sequence["tokens"]) == len(sequence["logprobs"]) <= 4


def test_adapters_are_cached_by_content_and_evicted_least_recently_used(rig, tiny_files):
    worker, publisher, completions, codec = rig
    trainer = TrainerEngine(tiny_files)
    refs = []
    for i in range(3):
        trainer.create_adapter(f"m{i}", LoraConfig(rank=2, seed=i))
        for name, param in trainer._adapters[f"m{i}"].params.items():  # non-zero B, so adapters differ
            if "lora_B" in name:
                param.data.fill_(0.01 * (i + 1))
        files = trainer.export_adapter(f"m{i}")
        refs.append({name: codec.blobs.put(TENANT, content) for name, content in files.items()})
    for i, ref in enumerate(refs):
        send(publisher, request(f"r{i}", adapter=ref))
        assert collect(worker, completions, codec, 1)[f"r{i}"].type == SAMPLE["completed"]
    engine = worker.engine(TINY_QWEN3)
    keys = [f"{TENANT}:{ref['adapter_model.safetensors'].sha256}" for ref in refs]
    assert not engine.has_adapter(keys[0]) and engine.has_adapter(keys[1]) and engine.has_adapter(keys[2])
    # the same weights again, from a fresh request: same tokens as before (same seed)
    send(publisher, request("again", adapter=refs[2]))
    send(publisher, request("first-again", adapter=refs[0]))  # reloaded after eviction
    done = collect(worker, completions, codec, 2)
    assert done["again"].type == done["first-again"].type == SAMPLE["completed"]


def test_a_runs_superseded_versions_are_dropped_first(tmp_path, tiny_files):
    log = EmbeddedLog(tmp_path / "log.db")
    codec = Codec(BlobStore(tmp_path / "blobs"))
    publisher = EventPublisher(log, codec)
    models = ModelDirectory(Catalog.from_names([TINY_QWEN3]))
    worker = SamplerWorker(log, publisher, codec.blobs, models, max_adapters=8, max_run_versions=2)
    completions = log.consumer("test", pattern=topics.pattern("completions"))
    trainer = TrainerEngine(tiny_files)
    trainer.create_adapter("m", LoraConfig(rank=2, seed=1))
    versions = []
    for i in range(4):  # four published versions of one adapter: new bytes, new keys
        for name, param in trainer._adapters["m"].params.items():
            if "lora_B" in name:
                param.data.fill_(0.01 * (i + 1))
        files = trainer.export_adapter("m")
        versions.append({name: codec.blobs.put(TENANT, content) for name, content in files.items()})
    other = versions[0]  # another run's session made from the same bytes is another run's version
    plan = [("q", other, "q0"), ("r", versions[1], "r1"), ("r", versions[2], "r2"), ("r", versions[3], "r3")]
    for run, ref, request_id in plan:
        send(publisher, request(request_id, adapter=ref).model_copy(update={"run_id": run}))
        assert collect(worker, completions, codec, 1)[request_id].type == SAMPLE["completed"]
    engine = worker.engine(TINY_QWEN3)
    key = lambda ref: f"{TENANT}:{ref['adapter_model.safetensors'].sha256}"  # noqa: E731
    # run r keeps its two newest versions; run q's only one stays although it is the oldest
    assert [engine.has_adapter(key(v)) for v in (other, versions[1], versions[2], versions[3])] == [
        True,
        False,
        True,
        True,
    ]
    log.close()


def sample_calls(worker, monkeypatch) -> list[list[int]]:
    """Spy on the engine: the number of rows of each batched generation it runs."""
    engine = worker.engine(TINY_QWEN3)
    calls: list[list[int]] = []
    sample = engine.sample

    def spy(jobs):
        calls.append([job.num_samples for job in jobs])
        return sample(jobs)

    monkeypatch.setattr(engine, "sample", spy)
    return calls


def test_requests_that_arrive_while_a_batch_waits_for_its_turn_join_it(rig, monkeypatch):
    """The accelerator is busy (another job's turn) when a batch wants it; the requests that
    reach the log meanwhile run in that batch once its turn comes, not in one after it."""
    worker, publisher, completions, codec = rig
    calls = sample_calls(worker, monkeypatch)
    turn = worker.slicer.turn

    def busy_device(job, *args, **kwargs):  # what arrives while the turn is being waited for
        if not calls:
            send(publisher, request("late-1"))
            send(publisher, request("late-2", num_samples=3))
        return turn(job, *args, **kwargs)

    monkeypatch.setattr(worker.slicer, "turn", busy_device)
    send(publisher, request("first"))
    done = collect(worker, completions, codec, 3)
    assert sorted(done) == ["first", "late-1", "late-2"]
    assert calls == [[2, 2, 3]]  # one generation for all three
    assert len({done[r].lease for r in done}) == 1


def test_a_batch_waits_for_the_runs_active_lately_and_not_when_alone(tmp_path, tiny_files, monkeypatch):
    import threading

    log = EmbeddedLog(tmp_path / "log.db")
    codec = Codec(BlobStore(tmp_path / "blobs"))
    publisher = EventPublisher(log, codec)
    worker = SamplerWorker(
        log, publisher, codec.blobs, ModelDirectory(Catalog.from_names([TINY_QWEN3])), cohort_wait=2.0
    )
    completions = log.consumer("test", pattern=topics.pattern("completions"))
    calls = sample_calls(worker, monkeypatch)
    waits: list[float] = []  # the timeouts of the polls a batch makes after its first
    poll = worker.consumer.poll

    def timed_poll(max_records=100, timeout=1.0):
        waits.append(timeout)
        return poll(max_records=max_records, timeout=timeout)

    monkeypatch.setattr(worker.consumer, "poll", timed_poll)
    # Alone: run a's request runs at once, though the cohort wait is long.
    send(publisher, request("a-0").model_copy(update={"run_id": "run-a"}))
    assert collect(worker, completions, codec, 1)["a-0"].type == SAMPLE["completed"]
    assert max(waits) <= max(worker.linger, 0.1)  # the usual linger, never the cohort's 2 s
    # Run b samples too: both are now active. Next, a's request waits for b's, sent later.
    send(publisher, request("b-0").model_copy(update={"run_id": "run-b"}))
    collect(worker, completions, codec, 1)
    calls.clear()
    send(publisher, request("a-1").model_copy(update={"run_id": "run-a"}))
    later = threading.Timer(
        0.3, lambda: send(publisher, request("b-1", num_samples=3).model_copy(update={"run_id": "run-b"}))
    )
    later.start()
    done = collect(worker, completions, codec, 2)
    later.join()
    assert sorted(done) == ["a-1", "b-1"] and calls == [[2, 3]]  # one batch for both
    log.close()


def test_an_engine_that_can_sleep_is_parked_by_the_timeslicer_and_wakes_in_its_turn(rig, monkeypatch):
    """The wiring vLLM's sleep mode uses on CUDA (`VllmEngine.can_sleep`), on CPU: here the
    torch engine sleeps by moving its weights to host memory and back (functions/compute/parking)
    so that parking really empties them. The base job is then registered parkable; the
    timeslicer's park puts the engine to sleep; the next batch wakes it in its own turn, says
    so to the timeslicer, and samples what it sampled before."""
    from functions.compute import parking
    from functions.sampler.engine import SamplerEngine

    class SleepingEngine(SamplerEngine):
        can_sleep = True
        parked = None

        @property
        def asleep(self) -> bool:
            return self.parked is not None

        def park(self):
            return parking.park_once(self, parking.param_slots("w/", dict(self.model.named_parameters()), False))

        def restore(self):
            return parking.restore_once(self, parking.param_slots("w/", dict(self.model.named_parameters()), False))

    worker, publisher, completions, codec = rig
    monkeypatch.setattr(worker, "_make_engine", lambda files, share=False: SleepingEngine(files, share_base=False))
    restored = []
    report = worker.slicer.report_restored
    monkeypatch.setattr(worker.slicer, "report_restored", lambda *a: (restored.append(a), report(*a)))
    send(publisher, request("awake"))
    before = collect(worker, completions, codec, 1)["awake"]
    job = worker._base_job(TINY_QWEN3)
    assert worker.slicer._jobs[job]["parkable"] is True
    engine = worker.engine(TINY_QWEN3)
    weight_bytes = engine.weight_bytes
    _seconds, nbytes = worker._park(job)
    assert engine.asleep and nbytes == weight_bytes > 0
    assert all(p.numel() == 0 for p in engine.model.parameters())  # the weights really left
    send(publisher, request("woken"))
    after = collect(worker, completions, codec, 1)["woken"]
    assert not engine.asleep and [r[0] for r in restored] == [job] and restored[0][2] == nbytes
    tokens = [[s["tokens"] for s in e.data.result["sequences"]] for e in (before, after)]
    assert tokens[0] == tokens[1]  # same seed, same prompt: the same samples
