"""tinker-cookbook's weights workflow against a real server: `weights.download` of a training
checkpoint (which exports it with `save_weights_external`, age-encrypted to a key made for the
download, then fetches and decrypts it), `weights.build_hf_model` (a merged model whose
logprobs must be the server's `compute_logprobs` on the matching sampler checkpoint) and
`weights.build_lora_adapter` (a PEFT adapter that loads). Also an encrypted export fetched
as is: the signed links serve ciphertext, which only the recipient's identity opens."""

from __future__ import annotations

import urllib.request

import numpy as np
import pyrage
import pytest
import tinker
import torch
from tinker import types
from tinker_cookbook import weights

from tests.e2e.sdk_close import close_service

pytestmark = pytest.mark.e2e
MODEL = "openrl/tiny-qwen3"
TEXT = "the quick brown fox jumps over the lazy dog again and again"


def _trained(service):
    training = service.create_lora_training_client(base_model=MODEL, rank=4, seed=5).result()
    tokens = training.get_tokenizer().encode(TEXT)
    datum = types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)},
    )
    for _ in range(2):
        training.forward_backward([datum], "cross_entropy").result()
        training.optim_step(types.AdamParams(learning_rate=2e-2)).result()
    return training, tokens


def _logprobs(model, tokens) -> np.ndarray:
    """log p(token i | tokens before it) for i >= 1, a plain forward in float32."""
    with torch.no_grad():
        logits_T_V = model(torch.tensor([tokens[:-1]])).logits[0].float()
    return torch.log_softmax(logits_T_V, -1)[torch.arange(len(tokens) - 1), torch.tensor(tokens[1:])].numpy()


def _untied_base(tiny_files, into):
    """The tiny model saved with its own lm_head: it ties lm_head to the input embeddings,
    and merging an lm_head LoRA into a tied weight would change the embeddings too (the
    cookbook's shard merge finds no `lm_head.weight` to merge into). Untied, as Qwen3-8B
    and larger are, the numbers are the same as the served model's."""
    import shutil

    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_files.path, dtype=torch.float32)
    model.lm_head.weight = torch.nn.Parameter(model.model.embed_tokens.weight.detach().clone())
    model.config.tie_word_embeddings = False
    model.save_pretrained(into)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
        if (tiny_files.path / name).exists():
            shutil.copy(tiny_files.path / name, into / name)
    return into


def test_download_build_hf_model_and_lora_adapter(sdk_env, tiny_files, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    service = tinker.ServiceClient()
    training, tokens = _trained(service)
    state = training.save_state("state").result().path
    sampler_path = training.save_weights_for_sampler("sampler").result().path
    sampler = service.create_sampling_client(model_path=sampler_path).result()
    server = sampler.compute_logprobs(types.ModelInput.from_ints(tokens)).result()
    assert server[0] is None
    server_N = np.array(server[1:], dtype=np.float32)

    adapter_dir = weights.download(tinker_path=state, output_dir=str(tmp_path / "adapter"))
    names = sorted(p.name for p in (tmp_path / "adapter").iterdir())
    assert names == ["adapter_config.json", "adapter_model.safetensors"]  # decrypted, .age stripped
    # the temporary encrypted export is deleted again by the cookbook
    rest = tinker.RestClient()
    kinds = {c.checkpoint_type for c in rest.list_checkpoints(training.model_id).result().checkpoints}
    assert "external" not in kinds

    base_dir = _untied_base(tiny_files, tmp_path / "base")
    weights.build_hf_model(base_model=str(base_dir), adapter_path=adapter_dir, output_path=str(tmp_path / "merged"))
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32).eval()
    np.testing.assert_allclose(_logprobs(merged, tokens), server_N, atol=1e-4)

    weights.build_lora_adapter(base_model=str(base_dir), adapter_path=adapter_dir, output_path=str(tmp_path / "peft"))
    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    assert np.abs(_logprobs(base.eval(), tokens) - server_N).max() > 1e-2  # training moved them: the check can fail
    peft_model = PeftModel.from_pretrained(base, tmp_path / "peft").eval()
    np.testing.assert_allclose(_logprobs(peft_model, tokens), server_N, atol=1e-4)
    close_service(service)


def test_an_encrypted_export_is_served_as_ciphertext(sdk_env, tmp_path):
    service = tinker.ServiceClient()
    training, _tokens = _trained(service)
    identity = pyrage.x25519.Identity.generate()
    other = pyrage.x25519.Identity.generate()
    plain = training.save_weights_external("plain").result().path
    sealed = (
        training.save_weights_external(
            "sealed", age_encryption_recipients=[str(identity.to_public()), str(other.to_public())]
        )
        .result()
        .path
    )
    rest = tinker.RestClient()
    plain_urls = rest.get_external_weights_urls(plain).result().urls
    sealed_urls = rest.get_external_weights_urls(sealed).result().urls
    assert set(sealed_urls) == {name + ".age" for name in plain_urls}
    for name, url in plain_urls.items():
        clear = urllib.request.urlopen(url, timeout=60).read()
        cipher = urllib.request.urlopen(sealed_urls[name + ".age"], timeout=60).read()
        assert cipher.startswith(b"age-encryption.org/v1\n") and clear not in cipher
        # either recipient opens it; a stranger cannot
        assert pyrage.decrypt(cipher, [identity]) == clear == pyrage.decrypt(cipher, [other])
        with pytest.raises(pyrage.DecryptError):
            pyrage.decrypt(cipher, [pyrage.x25519.Identity.generate()])
    # the cookbook's download of an external_weights path keeps the .age names, as it documents
    weights.download(tinker_path=sealed, output_dir=str(tmp_path / "sealed"))
    assert sorted(p.name for p in (tmp_path / "sealed").iterdir()) == sorted(sealed_urls)
    # a key age does not accept is a 400, and nothing is exported
    with pytest.raises(tinker.BadRequestError, match="not an age recipient"):
        training.save_weights_external("bad", age_encryption_recipients=["age1notakey"]).result()
    listed = {c.checkpoint_id for c in rest.list_checkpoints(training.model_id).result().checkpoints}
    assert listed == {"external_weights/plain", "external_weights/sealed"}
    close_service(service)
