"""Weight sync: the sampler's copy is bitwise the published weights, by delta or by full
checkpoint, and a delta never lands on the wrong base."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
import torch

from functions.compute import weight_sync
from functions.compute.weight_sync import Publisher, Receiver, decode_delta, read_manifest
from openrl_core.errors import InvalidRequest
from openrl_core.events.lifecycle import BlobRef


class Blobs:
    def __init__(self):
        self.data: dict[str, bytes] = {}

    def put(self, content: bytes) -> BlobRef:
        digest = hashlib.sha256(content).hexdigest()
        self.data[digest] = content
        return BlobRef(sha256=digest, size=len(content))

    def get(self, ref: BlobRef) -> bytes:
        return self.data[ref.sha256]


def master(seed=0):
    g = torch.Generator().manual_seed(seed)
    return {
        "a.weight": torch.randn(64, 48, generator=g) * 0.05,
        "b.bias": torch.randn(300, generator=g),
        "c": torch.randn(7, 7, generator=g),
    }


def adam_like_update(params, step, lr=1e-5):
    """An optimizer's step: every element moves a little, and only those whose move crosses
    a bf16 rounding boundary (small weights, mostly) change bit pattern."""
    g = torch.Generator().manual_seed(100 + step)
    for p in params.values():
        p.add_(torch.randn(p.shape, generator=g).sign() * lr)


def served(receiver):
    return {k: p.detach().to(torch.bfloat16) for k, p in receiver.params.items()}


def published(params):
    return {k: p.detach().to(torch.bfloat16) for k, p in params.items()}


def fresh_receiver(shapes):
    return Receiver(
        {k: torch.nn.Parameter(torch.zeros(v.shape), requires_grad=False) for k, v in shapes.items()}, "bfloat16"
    )


def assert_bitwise(a, b):
    for key in a:
        assert torch.equal(a[key].view(torch.int16), b[key].view(torch.int16)), key


def test_deltas_follow_a_full_checkpoint_and_the_copy_is_bitwise_the_published_weights():
    blobs, params = Blobs(), master()
    publisher = Publisher("run", "base", full_every=0)
    receiver = fresh_receiver(params)
    kinds = []
    for version in range(1, 8):
        if version > 1:
            adam_like_update(params, version)
        publication = publisher.publish(params, version * 3, blobs.put)  # versions are seq_ids: gaps are fine
        kinds.append(publication.kind)
        receiver.update(read_manifest(blobs.get(publication.manifest)), blobs.get)
        assert_bitwise(served(receiver), published(params))
        assert receiver.version == version * 3
    assert kinds == ["full"] + ["delta"] * 6
    assert 0 < publication.changed < publication.elements
    assert receiver.last_update["kind"] == "delta" and receiver.last_update["links"] == 1


def test_a_sampler_that_missed_versions_applies_the_chain_and_a_new_one_loads_the_full():
    blobs, params = Blobs(), master(1)
    publisher = Publisher("run", "base", full_every=0)
    early = fresh_receiver(params)
    for version in range(1, 6):
        if version > 1:
            adam_like_update(params, version)
        publication = publisher.publish(params, version, blobs.put)
        if version == 2:
            early.update(read_manifest(blobs.get(publication.manifest)), blobs.get)
    manifest = read_manifest(blobs.get(publication.manifest))
    assert [link.kind for link in manifest["chain"]] == ["full", "delta", "delta", "delta", "delta"]
    update = early.update(manifest, blobs.get)
    assert update["kind"] == "delta" and update["links"] == 3
    late = fresh_receiver(params)
    assert late.update(manifest, blobs.get)["links"] == 5
    for receiver in (early, late):
        assert_bitwise(served(receiver), published(params))


def test_full_every_k_and_too_dense_deltas_publish_full_checkpoints():
    blobs, params = Blobs(), master(2)
    publisher = Publisher("run", "base", full_every=3)
    kinds = []
    for version in range(1, 8):
        adam_like_update(params, version)
        kinds.append(publisher.publish(params, version, blobs.put).kind)
    assert kinds == ["full", "delta", "delta", "full", "delta", "delta", "full"]
    dense = Publisher("run", "base", full_every=0, max_share=0.5)
    dense.publish(params, 1, blobs.put)
    for p in params.values():
        p.mul_(1.5)  # every element changes
    publication = dense.publish(params, 2, blobs.put)
    assert publication.kind == "full" and "larger than 50%" in publication.reason


def test_a_delta_is_refused_on_the_wrong_base_and_on_a_bad_checksum_leaving_the_weights_alone():
    blobs, params = Blobs(), master(3)
    publisher = Publisher("run", "base", full_every=0)
    v1 = publisher.publish(params, 1, blobs.put)
    adam_like_update(params, 2)
    v2 = publisher.publish(params, 2, blobs.put)
    delta_link = read_manifest(blobs.get(v2.manifest))["chain"][1]
    stranger = fresh_receiver(params)  # holds nothing published
    with pytest.raises(InvalidRequest, match="does not apply to the held version"):
        stranger.apply_delta(blobs.get(delta_link.file), delta_link)

    receiver = fresh_receiver(params)
    receiver.update(read_manifest(blobs.get(v1.manifest)), blobs.get)
    before = {k: p.detach().clone() for k, p in receiver.params.items()}
    header, pieces = decode_delta(blobs.get(delta_link.file))
    tampered = list(pieces)
    values = bytearray(tampered[0].values)
    values[0] ^= 0x01  # one bit of one new value
    tampered[0] = type(tampered[0])(
        tampered[0].name, tampered[0].count, tampered[0].index_width, tampered[0].indices, bytes(values)
    )
    bad = weight_sync.encode_delta({k: v for k, v in header.items() if k not in ("format", "tensors")}, tampered)
    with pytest.raises(InvalidRequest, match="fails its checksum"):
        receiver.apply_delta(bad, delta_link)
    for key, value in before.items():
        assert torch.equal(receiver.params[key], value), "a refused delta wrote nothing"
    receiver.apply_delta(blobs.get(delta_link.file), delta_link)
    assert_bitwise(served(receiver), published(params))


def test_delta_bytes_are_small_when_few_elements_change():
    blobs = Blobs()
    g = torch.Generator().manual_seed(4)
    params = {"w": torch.randn(512, 512, generator=g)}
    publisher = Publisher("run", "base", full_every=0)
    full = publisher.publish(params, 1, blobs.put)
    with torch.no_grad():
        mask = torch.rand(params["w"].shape, generator=g) < 0.04
        params["w"][mask] *= 1.1
    publication = publisher.publish(params, 2, blobs.put)
    share = publication.changed / publication.elements
    assert 0.03 < share < 0.05
    # 4% changed: 2 bytes of value plus about a byte of gap-encoded index each, compressed
    assert publication.file_bytes < 0.07 * full.file_bytes


def test_checksums_match_an_independent_recount():
    blobs, params = Blobs(), master(5)
    publisher = Publisher("run", "base")
    publication = publisher.publish(params, 1, blobs.put)
    link = read_manifest(blobs.get(publication.manifest))["chain"][0]
    from openrl_core import delta

    bits = {k: v.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16) for k, v in params.items()}
    assert link.checksum == delta.checksum(bits)


def test_loaded_weights_are_aligned_so_parking_does_not_change_the_samplers_bits(tiny_files):
    """MKL's single-row products (a sampler's last-position logits) round differently for
    weights at another alignment; parking re-allocates (64-byte aligned), so loaded weights
    must already be aligned, or a parked-and-restored copy would sample other logprobs."""
    from functions.compute.models import load_causal_lm
    from functions.sampler.engine import SamplerEngine
    from functions.sampler.full_runs import FullRunCopies
    from functions.sampler.types import SampleJob
    from openrl_core.params import SamplingParams

    model = load_causal_lm(tiny_files)
    assert {p.data_ptr() % 64 for p in model.parameters()} == {0}
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight, "still tied"
    copies = FullRunCopies(lambda files: SamplerEngine(files), 2)
    copy = copies.create("alice:run", tiny_files, "bfloat16")
    job = SampleJob(
        prompt_tokens=list(range(100, 160)), num_samples=4, params=SamplingParams(max_tokens=4, temperature=1.0, seed=3)
    )
    before = [s.logprobs for s in copy.engine.sample([job])[0].sequences]
    copies.park("alice:run")
    assert all(p.numel() == 0 for p in copy.receiver.params.values())
    copies.restore("alice:run")
    assert [s.logprobs for s in copy.engine.sample([job])[0].sequences] == before


def test_an_update_names_the_tensors_it_wrote():
    """`touched` lists the tensors a delta changed (an engine copies only those in place) and
    every tensor after a full checkpoint."""
    blobs, params = Blobs(), master()
    publisher = Publisher("run", "base", full_every=0)
    receiver = fresh_receiver(params)
    first = receiver.update(read_manifest(blobs.get(publisher.publish(params, 1, blobs.put).manifest)), blobs.get)
    assert first["touched"] == sorted(params)
    with torch.no_grad():
        params["b.bias"][:5] += 1.0  # far above bf16's rounding: these five change bits
    second = receiver.update(read_manifest(blobs.get(publisher.publish(params, 2, blobs.put).manifest)), blobs.get)
    assert second["kind"] == "delta" and second["touched"] == ["b.bias"]
    assert_bitwise(served(receiver), published(params))
