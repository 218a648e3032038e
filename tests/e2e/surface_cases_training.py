"""Cases for `ServiceClient` and `TrainingClient` (see `surface_rig.py` for the contract)."""

from __future__ import annotations

import uuid

import httpx
import numpy as np
import pytest
import tinker
from tinker import types

from tests.e2e.sdk_close import close_service
from tests.e2e.surface_rig import MODEL, NOTE, case, same_logprobs, train_one_step

S, T = "ServiceClient.", "TrainingClient."
CONSOLE = "returns a URL of Thinking Machines' hosted console, which knows nothing of a self-hosted server (no request)"


# -- ServiceClient ---------------------------------------------------------------------------------


@case(S + "close", checked="finishes the session: the server then answers its heartbeat with 410")
def _close(w, call):
    service = tinker.ServiceClient()
    service.create_lora_training_client(base_model=MODEL, rank=2).result()
    session_id = service.holder.get_session_id()
    call(service, "close", "success")
    answer = httpx.post(
        f"{w.server.url}/api/v1/session_heartbeat",
        json={"session_id": session_id, "type": "session_heartbeat"},
        headers={"X-API-Key": w.api_key},
    )
    assert answer.status_code == 410, answer.text


@case(
    S + "copy_weights",
    status=NOTE,
    checked="the copy is a new run's checkpoint with the source's base model and rank",
    note="the SDK requires a destination project (ServiceClient(project_id=…) or TINKER_PROJECT_ID); it labels the copy's session",
)
def _service_copy_weights(w, call):
    archive = tinker.ServiceClient(project_id="archive")
    copied = call(archive, "copy_weights", w.state_path)
    assert copied != w.state_path and copied.endswith("/weights/surface-state")
    info = w.rest.get_weights_info_by_tinker_path(copied).result()
    assert (info.base_model, info.lora_rank) == (MODEL, 4)


@case(
    S + "create_custom_loss",
    checked="a traced weighted NLL runs client-side (custom_loss_server_side is off) and gives cross_entropy's loss:sum",
)
def _create_custom_loss(w, call):
    def neg_ll(logprobs, weights):
        loss = -(logprobs * weights).sum()
        return loss, {"custom/neg_ll:sum": loss}

    handle = call(w.service, "create_custom_loss", neg_ll, {"logprobs": 1, "weights": 1})
    assert handle.loss_id is None  # nothing uploaded
    custom = w.training.forward_backward_custom(w.batch, handle).result()
    builtin = w.training.forward(w.batch, "cross_entropy").result()
    assert custom.metrics["loss:sum"] == pytest.approx(builtin.metrics["loss:sum"], rel=1e-4)


@case(
    S + "create_lora_training_client",
    S + "create_lora_training_client_async",
    checked="get_info reports the base model, rank and a local tokenizer",
)
def _create_lora(w, call):
    training = call(w.service, "create_lora_training_client", base_model=MODEL, rank=3, seed=1)
    info = training.get_info()
    assert (info.model_data.model_name, info.lora_rank, info.is_lora) == (MODEL, 3, True)
    assert info.model_data.tokenizer_id.startswith("/")


@case(S + "create_rest_client", checked="(deprecated) the RestClient lists this tenant's runs")
def _create_rest_client(w, call):
    rest = call(w.service, "create_rest_client")
    assert w.training.model_id in {
        run.training_run_id for run in rest.list_training_runs(limit=1000).result().training_runs
    }


@case(
    S + "create_sampling_client",
    S + "create_sampling_client_async",
    checked="from a sampler path and from a base model name; both sample",
)
def _service_sampling_client(w, call):
    for kwargs in ({"model_path": w.sampler_path}, {"base_model": MODEL}):
        sampler = call(w.service, "create_sampling_client", **kwargs)
        assert sampler.get_base_model() == MODEL
        result = sampler.sample(
            w.prompt(), num_samples=2, sampling_params=types.SamplingParams(max_tokens=3, seed=1)
        ).result()
        assert [len(s.tokens) for s in result.sequences] == [3, 3]


@case(
    S + "create_training_client_from_state",
    S + "create_training_client_from_state_async",
    checked="a new model with the saved weights (same logprobs) and a fresh optimizer",
)
def _from_state(w, call):
    restored = call(w.service, "create_training_client_from_state", w.state_path)
    assert restored.model_id != w.training.model_id
    same_logprobs(w, restored, w.logprobs(w.training))


@case(
    S + "create_training_client_from_state_with_optimizer",
    S + "create_training_client_from_state_with_optimizer_async",
    checked="the saved weights and Adam state: the next step matches the original's",
)
def _from_state_with_optimizer(w, call):
    source = w.new_training(seed=2)
    train_one_step(source, w.batch)
    path = source.save_state("with-optimizer").result().path
    restored = call(w.service, "create_training_client_from_state_with_optimizer", path)
    for client in (source, restored):
        train_one_step(client, w.batch)
    same_logprobs(w, restored, w.logprobs(source))


@case(S + "get_console_url", status=NOTE, checked="returns a string", note=CONSOLE)
def _service_console(w, call):
    assert call(w.service, "get_console_url").startswith("http")


@case(
    S + "get_server_capabilities",
    S + "get_server_capabilities_async",
    checked="(deprecated) lists the served models, the cookbook aliases among them, as trainable and sampleable",
)
def _service_capabilities(w, call):
    models = {m.model_name: m for m in call(w.service, "get_server_capabilities").supported_models}
    assert {"openrl/tiny-qwen3", "Qwen/Qwen3-8B", "Qwen/Qwen3-8B-Base"} <= set(models)
    assert models[MODEL].trainable and models[MODEL].sampleable and models[MODEL].max_context_length == 4096


@case(S + "get_telemetry", checked="with telemetry on, a logged event reaches the server (POST /telemetry) by close()")
def _service_telemetry(w, call):
    with pytest.MonkeyPatch.context() as env:
        env.delenv("TINKER_TELEMETRY", raising=False)
        service = tinker.ServiceClient()
        session_id = service.holder.get_session_id()
        telemetry = call(service, "get_telemetry")
        assert telemetry is not None and telemetry.log("openrl-compat", {"case": "get_telemetry"})
        close_service(service)
    assert any(session_id in (data or "") for _subject, data in w.events("telemetry"))


@case(
    S + "holder",
    status=NOTE,
    checked="(deprecated property) the session's internal holder",
    note="an SDK internal, not an API",
)
def _holder(w, call):
    assert w.service.holder.get_session_id() == w.session_id


# -- TrainingClient --------------------------------------------------------------------------------


@case(
    T + "create_sampling_client", T + "create_sampling_client_async", checked="samples from a saved sampler checkpoint"
)
def _training_sampling_client(w, call):
    sampler = call(w.training, "create_sampling_client", w.sampler_path)
    result = sampler.sample(w.prompt(), num_samples=1, sampling_params=types.SamplingParams(max_tokens=2)).result()
    assert len(result.sequences[0].tokens) == 2 and len(result.sequences[0].logprobs) == 2


@case(
    T + "forward",
    T + "forward_async",
    checked="per-datum logprobs shaped like the targets; loss:sum their weighted NLL",
)
def _forward(w, call):
    output = call(w.training, "forward", w.batch, "cross_entropy")
    nll = -sum(float(out["logprobs"].to_numpy().sum()) for out in output.loss_fn_outputs)
    assert output.metrics["loss:sum"] == pytest.approx(nll, rel=1e-4)
    assert [len(out["logprobs"].data) for out in output.loss_fn_outputs] == [
        len(d.loss_fn_inputs["target_tokens"].data) for d in w.batch
    ]


@case(T + "forward_backward", T + "forward_backward_async", checked="then optim_step: the loss falls")
def _forward_backward(w, call):
    client = w.new_training(seed=4)
    first = call(client, "forward_backward", w.batch, "cross_entropy")
    client.optim_step(types.AdamParams(learning_rate=5e-2)).result()
    assert client.forward(w.batch, "cross_entropy").result().metrics["loss:sum"] < first.metrics["loss:sum"]


@case(
    T + "forward_backward_custom",
    T + "forward_backward_custom_async",
    checked="a client-side loss through forward logprobs: loss:sum is the custom loss, its metrics come back",
)
def _forward_backward_custom(w, call):
    def half_nll(data, logprobs_list):
        loss = sum(-(lp * d.loss_fn_inputs["weights"].to_torch()).sum() for d, lp in zip(data, logprobs_list)) / 2
        return loss, {"custom/half:sum": float(loss)}

    output = call(w.training, "forward_backward_custom", w.batch, half_nll)
    reference = w.training.forward(w.batch, "cross_entropy").result().metrics["loss:sum"] / 2
    assert output.metrics["loss:sum"] == pytest.approx(reference, rel=1e-4)
    assert output.metrics["custom/half:sum"] == pytest.approx(reference, rel=1e-4)


@case(T + "get_console_url", status=NOTE, checked="returns a string", note=CONSOLE)
def _training_console(w, call):
    assert call(w.training, "get_console_url").startswith("http")


@case(T + "get_info", T + "get_info_async", checked="model id, base model, LoRA rank, architecture")
def _get_info(w, call):
    info = call(w.training, "get_info")
    assert (info.model_id, info.model_data.model_name, info.lora_rank, info.model_data.arch) == (
        w.training.model_id,
        MODEL,
        4,
        "qwen3",
    )


@case(T + "get_telemetry", checked="the holder's telemetry (None when TINKER_TELEMETRY=0; no request)")
def _training_telemetry(w, call):
    assert call(w.training, "get_telemetry") is None


@case(T + "get_tokenizer", checked="the real Qwen tokenizer from the local directory get_info names (no hub)")
def _training_tokenizer(w, call):
    assert call(w.training, "get_tokenizer").encode("Hello world") == [9707, 1879]


@case(
    T + "load_state",
    T + "load_state_async",
    checked="(deprecated) in place: the saved weights come back after a step moved them",
)
def _load_state(w, call):
    client = w.new_training(seed=5)
    path = client.save_state("before").result().path
    before = w.logprobs(client)
    train_one_step(client, w.batch)
    call(client, "load_state", path)
    same_logprobs(w, client, before)


@case(
    T + "load_state_with_optimizer",
    T + "load_state_with_optimizer_async",
    checked="(deprecated) in place, with Adam state: the next step repeats the one after the save",
)
def _load_state_with_optimizer(w, call):
    client = w.new_training(seed=6)
    train_one_step(client, w.batch)
    path = client.save_state("mid").result().path
    train_one_step(client, w.batch)
    after_one = w.logprobs(client)
    call(client, "load_state_with_optimizer", path)
    train_one_step(client, w.batch)
    same_logprobs(w, client, after_one)


@case(
    T + "optim_step",
    T + "optim_step_async",
    checked="AdamW applies the accumulated gradient and reports optim/grad_norm",
)
def _optim_step(w, call):
    client = w.new_training(seed=7)
    client.forward_backward(w.batch, "cross_entropy").result()
    metrics = call(
        client, "optim_step", types.AdamParams(learning_rate=1e-2, weight_decay=0.1, grad_clip_norm=1.0)
    ).metrics
    assert any("grad_norm" in key and np.isfinite(value) and value > 0 for key, value in metrics.items()), metrics


@case(
    T + "save_state",
    T + "save_state_async",
    checked="tinker://<run>/weights/<name>, listed with its TTL and user_metadata",
)
def _save_state(w, call):
    path = call(
        w.training, "save_state", f"saved-{uuid.uuid4().hex[:8]}", ttl_seconds=7200, user_metadata={"k": "v"}
    ).path
    assert path.startswith(f"tinker://{w.training.model_id}/weights/saved-")
    listed = {c.tinker_path: c for c in w.rest.list_checkpoints(w.training.model_id).result().checkpoints}
    assert listed[path].expires_at is not None and listed[path].user_metadata == {"k": "v"}


@case(
    T + "save_weights_and_get_sampling_client",
    T + "save_weights_and_get_sampling_client_async",
    checked="a sampler on the current weights: its prompt logprobs equal the trainer's forward",
)
def _save_and_sample(w, call):
    sampler = call(w.training, "save_weights_and_get_sampling_client")
    tokens = w.batch[0].model_input.to_ints() + [int(w.batch[0].loss_fn_inputs["target_tokens"].data[-1])]
    logprobs = sampler.compute_logprobs(types.ModelInput.from_ints(tokens)).result()
    np.testing.assert_allclose(np.array(logprobs[1:], dtype=np.float32), w.logprobs(w.training)[0], atol=2e-4)


@case(
    T + "save_weights_external",
    T + "save_weights_external_async",
    checked="tinker://<run>/external_weights/<name> with signed download links; with age_encryption_recipients "
    "the files are age-encrypted (pyrage) as <name>.age (tinker_cookbook.weights.download is checked end to end "
    "in test_cookbook_weights.py)",
)
def _save_external(w, call):
    import pyrage

    response = call(w.training, "save_weights_external", f"export-{uuid.uuid4().hex[:8]}")
    assert "/external_weights/export-" in response.path
    assert set(w.rest.get_external_weights_urls(response.path).result().urls) == {
        "adapter_model.safetensors",
        "adapter_config.json",
    }
    key = pyrage.x25519.Identity.generate()
    sealed = call(
        w.training, "save_weights_external", f"sealed-{uuid.uuid4().hex[:8]}",
        age_encryption_recipients=[str(key.to_public())],
    )  # fmt: skip
    urls = w.rest.get_external_weights_urls(sealed.path).result().urls
    assert set(urls) == {"adapter_model.safetensors.age", "adapter_config.json.age"}


@case(
    T + "save_weights_for_sampler",
    T + "save_weights_for_sampler_async",
    checked="tinker://<run>/sampler_weights/<name>; sampling from it works",
)
def _save_for_sampler(w, call):
    path = call(w.training, "save_weights_for_sampler", "for-sampler").path
    assert path == f"tinker://{w.training.model_id}/sampler_weights/for-sampler"
    sampler = w.service.create_sampling_client(model_path=path).result()
    assert (
        sampler.sample(w.prompt(), num_samples=1, sampling_params=types.SamplingParams(max_tokens=1)).result().sequences
    )
