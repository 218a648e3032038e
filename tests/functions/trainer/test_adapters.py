"""Adapter files: PEFT-loadable exports, state round trips, and refusal of files that do not fit."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from safetensors.numpy import load as load_numpy

from functions.compute.models import load_causal_lm
from functions.trainer import adapters
from functions.trainer.engine import TrainerEngine
from openrl_core.errors import Conflict, InvalidRequest
from openrl_core.params import AdamParams, LoraConfig
from tests.functions.trainer.conftest import sft_batch
from tests.functions.trainer.test_engine import reference_logprobs

ADAM = AdamParams(learning_rate=2e-2, eps=1e-8)


def trained(engine: TrainerEngine, model_id: str, lora: LoraConfig, steps: int = 2) -> None:
    engine.create_adapter(model_id, lora)
    for step in range(steps):
        engine.forward_backward(model_id, sft_batch(step, [9, 5]), "cross_entropy", None, forward_only=False)
        engine.optim_step(model_id, ADAM)


@pytest.mark.filterwarnings("ignore:.*tie_word_embeddings.*:UserWarning")
def test_export_adapter_loads_with_peft_and_gives_the_same_logprobs(engine, tiny_files, tmp_path):
    from peft import PeftModel

    trained(engine, "run:1", LoraConfig(rank=4, seed=0))
    files = engine.export_adapter("run:1")
    assert set(files) == {"adapter_model.safetensors", "adapter_config.json"}
    config = json.loads(files["adapter_config.json"])
    assert config["r"] == 4 and config["lora_alpha"] == 32 and config["peft_type"] == "LORA"
    keys = set(load_numpy(files["adapter_model.safetensors"]))
    assert "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight" in keys
    assert "base_model.model.lm_head.lora_B.weight" in keys
    for name, data in files.items():
        (tmp_path / name).write_bytes(data)

    probe = sft_batch(7, [10])[0]
    plain = load_causal_lm(tiny_files)
    base_logprobs = reference_logprobs(plain, probe)
    peft_model = PeftModel.from_pretrained(load_causal_lm(tiny_files), str(tmp_path))
    peft_model.eval()
    expected = reference_logprobs(peft_model, probe)
    assert np.abs(expected - base_logprobs).max() > 1e-2, "training must have moved the model, or this test is vacuous"
    got = engine.forward_backward("run:1", [probe], "cross_entropy", None, forward_only=True).logprobs[0]
    np.testing.assert_allclose(got, expected, rtol=0, atol=5e-5)


def test_state_round_trip_into_a_new_engine_continues_identically(engine, tiny_files):
    trained(engine, "a", LoraConfig(rank=4, seed=1, train_unembed=False))
    files = engine.export_state("a")
    assert {"optimizer.safetensors", "optimizer.json"} <= set(files)

    restored = TrainerEngine(tiny_files)
    restored.import_state("b", files, with_optimizer=True)
    assert restored.lora_config_of(files) == LoraConfig(rank=4, train_unembed=False)
    probe = sft_batch(8, [7, 4])
    for got, want in zip(
        restored.forward_backward("b", probe, "cross_entropy", None, forward_only=True).logprobs,
        engine.forward_backward("a", probe, "cross_entropy", None, forward_only=True).logprobs,
    ):
        np.testing.assert_array_equal(got, want)

    step = AdamParams(learning_rate=1e-2, beta1=0.8, weight_decay=0.1, grad_clip_norm=1.0)
    engine.forward_backward("a", probe, "cross_entropy", None, forward_only=False)
    restored.forward_backward("b", probe, "cross_entropy", None, forward_only=False)
    assert engine.optim_step("a", step) == restored.optim_step("b", step)
    after_a, after_b = engine.adapter_weights("a"), restored.adapter_weights("b")
    for key in after_a:
        np.testing.assert_array_equal(after_a[key], after_b[key])


def test_import_without_optimizer_starts_fresh_moments(engine):
    trained(engine, "a", LoraConfig(rank=4, seed=1))
    files = engine.export_state("a")
    engine.import_state("fresh", files, with_optimizer=False)
    engine.import_state("warm", files, with_optimizer=True)
    for model_id in ("fresh", "warm"):
        engine.forward_backward(model_id, sft_batch(3, [6]), "cross_entropy", None, forward_only=False)
        engine.optim_step(model_id, ADAM)
    fresh, warm = engine.adapter_weights("fresh"), engine.adapter_weights("warm")
    assert any(not np.array_equal(fresh[k], warm[k]) for k in fresh)


def test_import_into_an_existing_adapter_overwrites_weights_and_clears_gradients(engine):
    trained(engine, "src", LoraConfig(rank=4, seed=1))
    engine.create_adapter("dst", LoraConfig(rank=4, seed=2))
    engine.forward_backward("dst", sft_batch(0, [5]), "cross_entropy", None, forward_only=False)
    engine.import_state("dst", engine.export_adapter("src"), with_optimizer=False)
    for key, value in engine.adapter_weights("src").items():
        np.testing.assert_array_equal(engine.adapter_weights("dst")[key], value)
    assert all(not g.any() for g in engine.adapter_gradients("dst").values())


def test_a_refused_import_leaves_the_existing_adapter_unchanged(engine):
    from safetensors.torch import load, save

    trained(engine, "src", LoraConfig(rank=4, seed=1), steps=1)
    engine.create_adapter("dst", LoraConfig(rank=4, seed=2))
    before = engine.adapter_weights("dst")
    files = engine.export_adapter("src")
    tensors = load(files["adapter_model.safetensors"])
    last = sorted(tensors)[-1]
    tensors[last] = tensors[last][:, :-1].contiguous()  # one tensor of the wrong shape, the rest fine
    with pytest.raises(InvalidRequest):
        engine.import_state("dst", {**files, "adapter_model.safetensors": save(tensors)}, with_optimizer=False)
    for key, value in engine.adapter_weights("dst").items():
        np.testing.assert_array_equal(value, before[key])


def test_lora_config_round_trips_through_the_files(engine):
    for lora in (LoraConfig(rank=3, train_mlp=False), LoraConfig(rank=16, train_attn=False, train_unembed=False)):
        model_id = f"r{lora.rank}"
        engine.create_adapter(model_id, lora)
        assert engine.lora_config_of(engine.export_adapter(model_id)) == lora


def _files_with_config(files: dict[str, bytes], **changes) -> dict[str, bytes]:
    config = json.loads(files["adapter_config.json"])
    config.update(changes)
    return {**files, "adapter_config.json": json.dumps(config).encode()}


def test_files_that_do_not_fit_are_refused(engine):
    engine.create_adapter("m", LoraConfig(rank=4, seed=0))
    files = engine.export_state("m")
    with pytest.raises(InvalidRequest):
        engine.import_state("x1", {k: v for k, v in files.items() if k != "adapter_config.json"}, with_optimizer=False)
    with pytest.raises(InvalidRequest):
        engine.import_state("x2", _files_with_config(files, lora_alpha=16), with_optimizer=False)
    with pytest.raises(InvalidRequest):
        not_tinker = _files_with_config(files, target_modules=["q_proj", "embed_tokens"])
        engine.import_state("x3", not_tinker, with_optimizer=False)
    with pytest.raises(InvalidRequest):  # config says rank 8, tensors are rank 4
        engine.import_state("x4", _files_with_config(files, r=8), with_optimizer=False)
    with pytest.raises(InvalidRequest):
        engine.import_state("x5", engine.export_adapter("m"), with_optimizer=True)
    assert not any(engine.has_adapter(f"x{i}") for i in range(1, 6)), "a refused import leaves no adapter behind"

    engine.create_adapter("rank8", LoraConfig(rank=8))
    with pytest.raises(Conflict):
        engine.import_state("rank8", files, with_optimizer=False)


def test_internal_names_are_safe_module_keys():
    name = adapters.internal_name("tenant:run/1.step")
    assert name.isidentifier() and "." not in name
    assert name == adapters.internal_name("tenant:run/1.step") != adapters.internal_name("tenant:run/2.step")


def test_initialisation_leaves_the_global_rng_alone(engine):
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    engine.create_adapter("m", LoraConfig(rank=4))
    np.testing.assert_array_equal(torch.rand(3).numpy(), expected.numpy())
