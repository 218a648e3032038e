"""The rig for one case per public method of the tinker SDK's five clients (the cases live in
`surface_cases_*.py`, the reflection over the SDK in `test_sdk_surface.py`).

A case is a function of a shared `World` (one live server, clients and checkpoints made once,
on demand) and a `call` that invokes the method under test: `call(obj, "forward", …)` calls
`obj.forward(…)` and waits for its future, or, for the `_async` row, awaits
`obj.forward_async(…)`. So a sync method and its `_async` twin share one body but are two
rows, each really called: in 0.38 the `_async` variants are separate (mostly deprecated)
code paths, and some return futures where others return values.

Statuses, as `docs/compatibility.md` shows them:
  works     the method does what the SDK documents, checked as `checked` says
  note      works, with a caveat a self-hosted user should know (`note`)
  refused   makes no sense self-hosted; the server answers 404 with a detail saying why
  other     neither: a client-side refusal, or not offered yet (with a clear 4xx)
"""

from __future__ import annotations

import asyncio
import inspect
import sqlite3
import uuid
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Callable

import numpy as np
import pytest
import tinker
from tinker import types

WORKS, NOTE, REFUSED, OTHER = "works", "works, with a note", "refused", "other"
MODEL = "Qwen/Qwen3-8B"  # the tiny model under a hub name, so SamplingClient.get_tokenizer resolves offline
NOT_OFFERED = ("not offered by a self-hosted OpenRL server", "not offered by this OpenRL server yet")


@dataclass(frozen=True)
class Case:
    status: str
    checked: str
    run: Callable
    note: str = ""


CASES: dict[str, Case] = {}


def case(*methods: str, status: str = WORKS, checked: str, note: str = ""):
    def register(run: Callable) -> Callable:
        for method in methods:
            if method in CASES:
                raise AssertionError(f"two cases for {method}")
            CASES[method] = Case(status, checked, run, note)
        return run

    return register


def make_call(is_async: bool) -> Callable:
    def call(obj, name: str, *args, **kwargs):
        if is_async:

            async def awaited():
                value = getattr(obj, name + "_async")(*args, **kwargs)
                while inspect.isawaitable(value):  # deprecated async wrappers may return futures
                    value = await value
                return value

            return asyncio.run(awaited())
        value = getattr(obj, name)(*args, **kwargs)
        return value.result() if callable(getattr(value, "result", None)) else value

    return call


class World:
    """The clients and checkpoints the cases share, each made on first use."""

    def __init__(self, server, hf_home: Path, api_key: str) -> None:
        self.server, self.hf_home, self.api_key = server, hf_home, api_key
        self.service = tinker.ServiceClient()
        self.rest = tinker.RestClient()
        self.admin = tinker.AdminClient()

    def new_training(self, seed: int = 0) -> tinker.TrainingClient:
        return self.service.create_lora_training_client(
            base_model=MODEL, rank=4, seed=seed, user_metadata={"renderer_name": "qwen3"}
        ).result()

    @cached_property
    def training(self) -> tinker.TrainingClient:
        return self.new_training()

    @cached_property
    def tokenizer(self):
        return self.training.get_tokenizer()

    @cached_property
    def batch(self) -> list[types.Datum]:
        data = []
        for text in ("The quick brown fox jumps over the lazy dog.", "OpenRL speaks the Tinker API."):
            tokens = self.tokenizer.encode(text)
            data.append(
                types.Datum(
                    model_input=types.ModelInput.from_ints(tokens[:-1]),
                    loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)},
                )
            )
        return data

    @cached_property
    def probe_sampler(self) -> str:
        """A sampling session of its own for the refusal probes (surface_fields.REFUSED)."""
        return self.service.create_sampling_client(base_model=MODEL).result()._sampling_session_id

    @cached_property
    def probe_training(self) -> tinker.TrainingClient:
        """A training run of its own for the probes: a refused seq_id stays used."""
        return self.new_training(seed=11)

    def next_probe_seq(self) -> int:
        self._probe_seq = getattr(self, "_probe_seq", 100_000) + 1
        return self._probe_seq

    @property
    def session_id(self) -> str:
        return self.training.model_id.split(":train:")[0]

    @cached_property
    def state_path(self) -> str:
        return self.training.save_state("surface-state").result().path

    @cached_property
    def sampler_path(self) -> str:
        return self.training.save_weights_for_sampler("surface-sampler").result().path

    @cached_property
    def external_path(self) -> str:
        return self.training.save_weights_external("surface-export").result().path

    @cached_property
    def sampler(self) -> tinker.SamplingClient:
        return self.service.create_sampling_client(model_path=self.sampler_path).result()

    def fresh_checkpoint(self, kind: str = "weights") -> str:
        name = f"surface-{uuid.uuid4().hex[:8]}"
        if kind == "weights":
            return self.training.save_state(name).result().path
        return self.training.save_weights_for_sampler(name).result().path

    def logprobs(self, client) -> list[np.ndarray]:
        return [
            out["logprobs"].to_numpy() for out in client.forward(self.batch, "cross_entropy").result().loss_fn_outputs
        ]

    def prompt(self) -> types.ModelInput:
        return types.ModelInput.from_ints(self.tokenizer.encode("The quick brown fox"))

    def events(self, type_fragment: str) -> list[tuple]:
        database = sqlite3.connect(f"file:{self.server.data_dir / 'events.db'}?mode=ro", uri=True)
        try:
            rows = database.execute(
                "SELECT subject, data FROM events WHERE type LIKE ?", (f"%{type_fragment}%",)
            ).fetchall()
            return [(subject, bytes(data).decode() if data is not None else "") for subject, data in rows]
        finally:
            database.close()


def refused_with_reason(action: Callable, feature: str) -> None:
    with pytest.raises(tinker.NotFoundError) as refused:
        action()
    message = str(refused.value)
    assert any(reason in message for reason in NOT_OFFERED) and feature in message, message


def same_logprobs(w: World, client, reference: list[np.ndarray]) -> None:
    for got, want in zip(w.logprobs(client), reference):
        np.testing.assert_allclose(got, want, atol=1e-5)


def train_one_step(client, batch) -> None:
    client.forward_backward(batch, "cross_entropy").result()
    client.optim_step(types.AdamParams(learning_rate=5e-2)).result()
