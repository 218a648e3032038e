"""A realistic stream of catalogue events, with known times, as the gateway and workers emit them.

`Stream` builds real `Event`s (registered types, real payload models), stamps each with a
time `t` seconds after T0, and publishes each to the topic the real code uses: requests on
the tenant's training/sampling topic of their base model, worker replies on `completions`,
gateway-only events on `control`. Used by the audit and the metrics tests.
"""

from __future__ import annotations

from datetime import datetime, timedelta, timezone
from typing import Optional

import numpy as np

from eventing import topics
from eventing.bus import EventPublisher
from openrl_core.catalog import TINY_QWEN3
from openrl_core.datum import Datum, DatumRecord
from openrl_core.events import Event, new_event
from openrl_core.events import checkpoints as ce
from openrl_core.events import sampling as se
from openrl_core.events import sessions as sess
from openrl_core.events import training as te
from openrl_core.events.lifecycle import BlobRef, CheckpointSaved, RequestCompleted, RequestFailed
from openrl_core.params import AdamParams, LoraConfig, SamplingParams

T0 = datetime(2026, 3, 1, 12, 0, 0, tzinfo=timezone.utc)
BASE = TINY_QWEN3
GATEWAY, TRAINER, SAMPLER = "/openrl/gateway", "/openrl/trainer", "/openrl/sampler"


def datum(n_tokens: int) -> DatumRecord:
    """A cross-entropy datum with `n_tokens` input tokens and as many target tokens."""
    tokens = np.arange(n_tokens, dtype=np.int64)
    return DatumRecord.from_datum(
        Datum(tokens, {"target_tokens": tokens + 1, "weights": np.ones(n_tokens, dtype=np.float32)})
    )


class Stream:
    def __init__(self, tenant: str, publisher: Optional[EventPublisher] = None, session: str = "s1") -> None:
        self.tenant = tenant
        self.publisher = publisher
        self.session = session
        self.model = f"{session}:train:0"
        self.sampler = f"{session}:sample:0"
        self.events: list[Event] = []
        self._seq = 0

    def emit(self, type_, payload, *, t: float, source: str, key: Optional[str], stream: str) -> Event:
        event = new_event(
            type_, payload, tenant=self.tenant, source=source, key=key, subject=getattr(payload, "request_id", None)
        )
        event = event.model_copy(update={"time": T0 + timedelta(seconds=t)})
        self.events.append(event)
        if self.publisher is not None:
            where = topics.topic(self.tenant, stream, BASE if stream in topics.WORK_STREAMS else None)
            self.publisher.publish(where, event)
        return event

    # -- gateway ---------------------------------------------------------------------------

    def session_created(self, t: float) -> Event:
        payload = sess.SessionCreated(session_id=self.session, sdk_version="0.38.0")
        return self.emit(sess.SESSION_CREATED, payload, t=t, source=GATEWAY, key=self.session, stream="control")

    def create_model(self, request_id: str, t: float, full: bool = False) -> Event:
        payload = te.CreateModelRequested(
            request_id=request_id, session_id=self.session, model_id=self.model, model_seq_id=0, base_model=BASE,
            lora_config=LoraConfig(rank=8), full_finetune=full,
        )  # fmt: skip
        stream = "training-full" if full else "training"
        return self.emit(te.CREATE_MODEL["requested"], payload, t=t, source=GATEWAY, key=self.model, stream=stream)

    def forward_backward(self, request_id: str, t: float, lengths=(5, 7), forward_only: bool = False) -> Event:
        self._seq += 1
        payload = te.ForwardBackwardRequested(
            request_id=request_id, model_id=self.model, seq_id=self._seq, loss_fn="cross_entropy",
            forward_only=forward_only, data=[datum(n) for n in lengths],
        )  # fmt: skip
        return self.emit(
            te.FORWARD_BACKWARD["requested"], payload, t=t, source=GATEWAY, key=self.model, stream="training"
        )

    def optim_step(self, request_id: str, t: float) -> Event:
        self._seq += 1
        payload = te.OptimStepRequested(
            request_id=request_id, model_id=self.model, seq_id=self._seq, adam_params=AdamParams()
        )
        return self.emit(te.OPTIM_STEP["requested"], payload, t=t, source=GATEWAY, key=self.model, stream="training")

    def save_weights(self, request_id: str, t: float, name: str = "ckpt-1") -> Event:
        self._seq += 1
        payload = te.SaveWeightsRequested(request_id=request_id, model_id=self.model, seq_id=self._seq, name=name)
        return self.emit(te.SAVE_WEIGHTS["requested"], payload, t=t, source=GATEWAY, key=self.model, stream="training")

    def sample(self, request_id: str, t: float, num_samples: int = 2) -> Event:
        payload = se.SampleRequested(
            request_id=request_id, sampling_session_id=self.sampler, seq_id=0, base_model=BASE, prompt_tokens=[1, 2, 3],
            num_samples=num_samples, sampling_params=SamplingParams(max_tokens=4),
            sample_sequence_ids=[f"{request_id}-{i}" for i in range(num_samples)],
        )  # fmt: skip
        return self.emit(se.SAMPLE["requested"], payload, t=t, source=GATEWAY, key=self.sampler, stream="sampling")

    def checkpoint_deleted(self, t: float, name: str = "ckpt-1") -> Event:
        payload = ce.CheckpointRemoved(run_id=self.model, checkpoint_id=f"weights/{name}", files={"adapter": _blob()})
        return self.emit(ce.CHECKPOINT_DELETED, payload, t=t, source=GATEWAY, key=self.model, stream="control")

    # -- workers ---------------------------------------------------------------------------

    def completed(self, request: Event, t: float, result: Optional[dict] = None, **facts) -> Event:
        types = _lifecycle_of(request.type)
        payload = RequestCompleted(request_id=request.data.request_id, result=result or {}, **facts)
        source = SAMPLER if request.family == "sampling" else TRAINER
        return self.emit(types["completed"], payload, t=t, source=source, key=request.key, stream="completions")

    def failed(self, request: Event, t: float, error: str, category: str = "user") -> Event:
        types = _lifecycle_of(request.type)
        payload = RequestFailed(request_id=request.data.request_id, error=error, category=category)
        source = SAMPLER if request.family == "sampling" else TRAINER
        return self.emit(types["failed"], payload, t=t, source=source, key=request.key, stream="completions")

    def saved(self, request: Event, t: float) -> Event:
        checkpoint = CheckpointSaved(
            run_id=self.model, kind="weights", name=request.data.name, files={"adapter": _blob()}
        )
        return self.completed(request, t, {"path": checkpoint.tinker_path}, checkpoint=checkpoint)

    def sampled(self, request: Event, t: float, lengths=(3, 2)) -> Event:
        sequences = [{"tokens": list(range(n)), "logprobs": [0.0] * n, "stop_reason": "length"} for n in lengths]
        return self.completed(request, t, {"sequences": sequences, "prompt_logprobs": None})


def _blob() -> BlobRef:
    return BlobRef(sha256="ab" * 32, size=1024)


def _lifecycle_of(type_: str) -> dict[str, str]:
    for family in (te.CREATE_MODEL, te.FORWARD_BACKWARD, te.OPTIM_STEP, te.SAVE_WEIGHTS, se.SAMPLE):
        if type_ in family.values():
            return family
    raise KeyError(type_)
