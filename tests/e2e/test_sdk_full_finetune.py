"""Full fine-tuning through the unmodified SDK: asked for with user_metadata, reported as
such, bitwise the same steps done with plain torch, every loss, checkpoints and their
loads, an export transformers loads, and sampling from weights synced by delta."""

from __future__ import annotations

import json

import numpy as np
import pytest
import tinker
import torch
from sqlalchemy import create_engine, select
from tinker import types

from eventing.store import tables
from tests.e2e.sdk_close import close_service
from tests.e2e.test_sdk_losses import DEFAULTS, reference_loss, rl_batch
from tests.e2e.test_sdk_rest import download
from tests.functions.trainer.conftest import sft_batch
from tests.functions.trainer.test_full import STEPS, reference_steps

pytestmark = pytest.mark.e2e

MODEL = "openrl/tiny-qwen3"
FULL = {"openrl.full_finetune": "true"}


def datums(batch):
    return [
        types.Datum(
            model_input=types.ModelInput.from_ints(d.tokens_N.tolist()),
            loss_fn_inputs={
                "target_tokens": d.loss_fn_inputs["target_tokens"].tolist(),
                "weights": d.loss_fn_inputs["weights"].tolist(),
            },
        )
        for d in batch
    ]


def adam(hp):
    return types.AdamParams(learning_rate=hp.learning_rate, beta1=hp.beta1, beta2=hp.beta2, eps=hp.eps,
                            weight_decay=hp.weight_decay, grad_clip_norm=hp.grad_clip_norm)  # fmt: skip


def events(server, type_fragment):
    engine = create_engine(f"sqlite:///{server.data_dir / 'events.db'}")
    with engine.connect() as conn:
        rows = conn.execute(select(tables.events).where(tables.events.c.type.contains(type_fragment))).all()
    engine.dispose()
    return rows


def test_a_full_run_is_asked_for_with_metadata_and_reported_as_full(sdk_env):
    service = tinker.ServiceClient()
    training = service.create_lora_training_client(base_model=MODEL, user_metadata=FULL).result()
    info = training.get_info()
    assert info.is_lora is False and info.lora_rank is None and info.model_data.model_name == MODEL
    state = training.save_state("full-0").result().path
    weights_info = tinker.RestClient().get_weights_info_by_tinker_path(state).result()
    assert weights_info.is_lora is False and weights_info.lora_rank is None
    rest = tinker.RestClient()
    run = rest.get_training_run(training.model_id).result()
    assert run.is_lora is False and run.last_checkpoint.tinker_path == state
    listed = {c.checkpoint_id: c for c in rest.list_checkpoints(training.model_id).result().checkpoints}
    assert listed["weights/full-0"].size_bytes > 4 * 19_000_000  # float32 weights and the optimizer's moments
    copied = rest.copy_weights(state, "full-copy").result()
    assert rest.get_weights_info_by_tinker_path(copied).result().is_lora is False
    assert service.create_training_client_from_state(copied).result().get_info().is_lora is False
    with pytest.raises(tinker.BadRequestError, match="train_mlp=False only applies to LoRA runs"):
        service.create_lora_training_client(base_model=MODEL, train_mlp=False, user_metadata=FULL).result()
    with pytest.raises(tinker.BadRequestError, match="must be 'true' or 'false'"):
        service.create_lora_training_client(base_model=MODEL, user_metadata={"openrl.full_finetune": "maybe"}).result()
    # a LoRA checkpoint does not load into a full run, nor the other way round
    lora = service.create_lora_training_client(base_model=MODEL, rank=4).result()
    lora_state = lora.save_state("lora-0").result().path
    with pytest.raises(
        tinker.BadRequestError, match="holds a LoRA adapter's weights; model .* is a full fine-tuning run"
    ):
        training.load_state(lora_state).result()
    with pytest.raises(tinker.BadRequestError, match="holds a full fine-tuning run's weights"):
        lora.load_state(state).result()
    close_service(service)


def test_sdk_steps_are_bitwise_plain_torch_and_the_export_loads_in_transformers(sdk_env, tiny_files, tmp_path):
    from transformers import AutoModelForCausalLM

    service = tinker.ServiceClient()
    training = service.create_lora_training_client(base_model=MODEL, user_metadata=FULL).result()
    batches = [sft_batch(step, [5, 9, 14]) for step in range(len(STEPS))]
    losses = []
    for batch, hp in zip(batches, STEPS):
        fb = training.forward_backward(datums(batch), "cross_entropy")
        step = training.optim_step(adam(hp))
        losses.append(fb.result().metrics["loss:sum"])
        assert step.result().metrics["optim/lr"] == pytest.approx(hp.learning_rate)
    export = training.save_weights_external("full-export").result().path
    links = tinker.RestClient().get_external_weights_urls(export).result()
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= set(links.urls)
    download(links.urls, tmp_path / "export")
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "export", local_files_only=True, dtype=torch.float32)
    reference, expected_losses = reference_steps(tiny_files, batches, STEPS)
    named = dict(reference.named_parameters())
    mismatched = {k: int((p.detach() != named[k].detach()).sum()) for k, p in loaded.named_parameters()}
    assert sum(mismatched.values()) == 0, {k: v for k, v in mismatched.items() if v}
    assert losses == pytest.approx(expected_losses, rel=1e-6)
    close_service(service)


@pytest.fixture(scope="module")
def full_rig(server):
    from tests.e2e.conftest import API_KEY
    from tests.e2e.test_sdk_losses import COMPLETIONS, PROMPTS

    service = tinker.ServiceClient(base_url=server.url, api_key=API_KEY)
    training = service.create_lora_training_client(base_model=MODEL, user_metadata=FULL).result()
    tokenizer = training.get_tokenizer()
    sequences = [(tokenizer.encode(p), tokenizer.encode(c)) for p, c in zip(PROMPTS, COMPLETIONS)]
    probe = [types.Datum(model_input=types.ModelInput.from_ints((p + c)[:-1]), loss_fn_inputs={"target_tokens": (p + c)[1:]})
             for p, c in sequences]  # fmt: skip
    current = [
        out["logprobs"].to_numpy().astype(np.float64)
        for out in training.forward(probe, "cross_entropy").result().loss_fn_outputs
    ]
    yield training, sequences, current
    close_service(service)


@pytest.mark.parametrize("loss_fn", ["importance_sampling", "ppo", "cispo", "dro", "gspo"])
def test_every_rl_loss_on_a_full_run(full_rig, loss_fn):
    training, sequences, current = full_rig
    data, inputs = rl_batch(sequences, current, with_mask=loss_fn == "gspo")
    output = training.forward_backward(data, loss_fn).result()
    returned = [out["logprobs"].to_numpy() for out in output.loss_fn_outputs]
    for lp, before in zip(returned, current):
        np.testing.assert_allclose(lp, before, atol=1e-5)
    expected = reference_loss(loss_fn, returned, inputs, DEFAULTS.get(loss_fn, {}))
    assert output.metrics["loss:sum"] == pytest.approx(expected, rel=1e-4, abs=1e-4)


def test_custom_loss_and_forward_on_a_full_run(full_rig):
    training, sequences, current = full_rig
    data = [types.Datum(model_input=types.ModelInput.from_ints((p + c)[:-1]), loss_fn_inputs={"target_tokens": (p + c)[1:]})
            for p, c in sequences]  # fmt: skip

    def nll(batch, logprobs_list):
        return sum(-lp.sum() for lp in logprobs_list), {}

    result = training.forward_backward_custom(data, nll).result()
    assert result.metrics["loss:sum"] == pytest.approx(-sum(lp.sum() for lp in current), rel=1e-4)


def test_state_checkpoints_resume_bitwise_with_and_without_the_optimizer(sdk_env):
    service = tinker.ServiceClient()
    first = service.create_lora_training_client(base_model=MODEL, user_metadata=FULL).result()
    batches = [datums(sft_batch(20 + i, [6, 13])) for i in range(3)]
    step = types.AdamParams(learning_rate=1e-3)
    first.forward_backward(batches[0], "cross_entropy").result()
    first.optim_step(step).result()
    state = first.save_state("mid").result().path
    for batch in batches[1:]:
        first.forward_backward(batch, "cross_entropy").result()
        first.optim_step(step).result()
    probe = batches[0]
    expected = [o["logprobs"].to_numpy() for o in first.forward(probe, "cross_entropy").result().loss_fn_outputs]

    resumed = service.create_training_client_from_state_with_optimizer(state).result()
    assert resumed.get_info().is_lora is False
    for batch in batches[1:]:
        resumed.forward_backward(batch, "cross_entropy").result()
        resumed.optim_step(step).result()
    got = [o["logprobs"].to_numpy() for o in resumed.forward(probe, "cross_entropy").result().loss_fn_outputs]
    for a, b in zip(got, expected):
        np.testing.assert_array_equal(a, b)  # the same float32 state: bitwise

    fresh_moments = service.create_training_client_from_state(state).result()
    for batch in batches[1:]:
        fresh_moments.forward_backward(batch, "cross_entropy").result()
        fresh_moments.optim_step(step).result()
    other = [o["logprobs"].to_numpy() for o in fresh_moments.forward(probe, "cross_entropy").result().loss_fn_outputs]
    assert not all(np.array_equal(a, b) for a, b in zip(other, expected)), "without the optimizer the moments restart"
    close_service(service)


def test_sampling_serves_the_published_bf16_weights_synced_by_deltas(sdk_env, tiny_files):
    from functions.compute.models import load_causal_lm

    service = tinker.ServiceClient()
    training = service.create_lora_training_client(base_model=MODEL, user_metadata=FULL).result()
    tokenizer = training.get_tokenizer()
    prompt = types.ModelInput.from_ints(tokenizer.encode("The quick brown fox"))
    params = types.SamplingParams(max_tokens=6, temperature=0.0)
    batch = datums(sft_batch(40, [7, 12]))
    samplers = []
    for _ in range(3):
        training.forward_backward(batch, "cross_entropy").result()
        training.optim_step(types.AdamParams(learning_rate=1e-4)).result()
        samplers.append(training.save_weights_and_get_sampling_client())
    sampler = samplers[-1].result()
    named = training.save_weights_for_sampler("synced").result().path
    got = sampler.sample(prompt, num_samples=1, sampling_params=params).result().sequences[0]
    by_path = (
        service.create_sampling_client(model_path=named)
        .result()
        .sample(prompt, num_samples=1, sampling_params=params)
        .result()
        .sequences[0]
    )

    # the reference: the trainer's weights rounded to bf16 (the serving dtype), greedy
    state = _final_weights(training)
    model = load_causal_lm(tiny_files)
    with torch.no_grad():
        for key, param in model.named_parameters():
            param.copy_(state[key].to(torch.bfloat16).to(torch.float32))
        ids = torch.tensor([prompt.to_ints()])
        expected = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=6, do_sample=False)[
            0, ids.shape[1] :
        ].tolist()
        logits = model(torch.tensor([prompt.to_ints() + got.tokens[:-1]])).logits[0, len(prompt.to_ints()) - 1 :]
        want_logprobs = torch.log_softmax(logits.double(), -1)[torch.arange(len(got.tokens)), torch.tensor(got.tokens)]
    assert got.tokens == expected == by_path.tokens
    np.testing.assert_allclose(got.logprobs, want_logprobs.numpy(), atol=1e-4)

    published = [row for row in events(sdk_env, "save_weights_for_sampler.completed")]
    kinds = [json.loads(row.data)["details"]["publication"]["kind"] for row in published[-4:]]
    assert kinds[0] == "full" and "delta" in kinds[1:], kinds
    close_service(service)


def _final_weights(training):
    import tempfile
    from pathlib import Path

    from safetensors.torch import load_file

    path = training.save_weights_external("final").result().path
    links = tinker.RestClient().get_external_weights_urls(path).result()
    target = Path(tempfile.mkdtemp())
    download({"model.safetensors": links.urls["model.safetensors"]}, target)
    return load_file(target / "model.safetensors")
