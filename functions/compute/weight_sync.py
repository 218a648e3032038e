"""Weight sync for full fine-tuning: the trainer publishes, samplers patch in place.

The trainer's `Publisher` (one per full run) turns the float32 master weights into the
serving dtype and publishes version V (the seq_id of the save request) as either a full
checkpoint or a sparse delta against the previous publication (`openrl_core.delta` says
which and how). Every publication also writes a manifest: the chain from the latest full
checkpoint to V, each link with its version, its base version, the checksum of the state it
leads to, and the blob holding it. Events carry only the manifest's blob reference.

A sampler's `Receiver` holds one run's weights at some version. Given a manifest it applies
only the links after the version it has, if that version is in the chain with the same
checksum; otherwise it loads the chain's full checkpoint and applies every delta. Before a
delta it checks that the delta's base is exactly what it holds (version and checksum); it
scatters the new bit patterns into its tensors in place (no other tensor is touched or
reloaded), moves its running checksum across the changed elements, and refuses the result
unless the checksum is the publisher's. So a sampler never applies a delta to the wrong
base, and what it serves is bitwise what was published.

Files: a full checkpoint is a plain safetensors file in the serving dtype (loadable by any
tool); a delta is `ORLD` + header length (u32) + JSON header + a few zstd frames (so both
ends compress and decompress on several threads) holding, per tensor, its gap-encoded index
planes then its value planes.
"""

from __future__ import annotations

import json
import os
import struct
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable, Mapping, Optional

import numpy as np
import torch
import zstandard
from safetensors import SafetensorError
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors

from openrl_core import delta
from openrl_core.errors import InvalidRequest, OpenRLError, ServerError
from openrl_core.events.lifecycle import BlobRef

# A few threads for applying deltas: the work is memory-bound gathers and scatters.
_POOL = ThreadPoolExecutor(max_workers=min(4, os.cpu_count() or 1), thread_name_prefix="weight-sync")

MANIFEST = "sampler_weights.json"
MANIFEST_FORMAT = "openrl.sampler-weights.v1"
DELTA_MAGIC = b"ORLD"
DELTA_FORMAT = "openrl.sampler-delta.v1"
TORCH_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
BITS_TORCH = {"bfloat16": torch.int16, "float16": torch.int16, "float32": torch.int32}

Put = Callable[[bytes], BlobRef]
Fetch = Callable[[BlobRef], bytes]


def serving_bits(tensor: torch.Tensor, dtype: str) -> torch.Tensor:
    """The tensor rounded to the serving dtype, as its bit patterns (a CPU integer tensor)."""
    narrow = tensor.detach().to(TORCH_DTYPES[dtype])
    return narrow.view(BITS_TORCH[dtype]).cpu()


def _numpy_bits(bits: torch.Tensor, dtype: str) -> np.ndarray:
    return bits.numpy().view(delta.BITS_DTYPE[dtype])


def _balanced(items: list, shares: int, size=lambda piece: piece.count) -> list[list]:
    """Items split into `shares` lists of about equal total size (largest first, greedy)."""
    buckets: list[list] = [[] for _ in range(max(1, shares))]
    totals = [0] * len(buckets)
    for item in sorted(items, key=size, reverse=True):
        smallest = totals.index(min(totals))
        buckets[smallest].append(item)
        totals[smallest] += size(item)
    return [bucket for bucket in buckets if bucket]


class _Target:
    """One held tensor, read and written as serving-dtype bit patterns at flat indices.

    On CPU the tensor's memory is read and written through a numpy view (numpy's fancy
    indexing is several times faster than torch's here). A float32 tensor that holds
    bfloat16 values keeps them exactly: their bf16 bits are the top 16 bits of the float32
    ones, so reading is a shift and writing a shift back, no rounding anywhere.
    """

    def __init__(self, param: torch.Tensor, dtype: str) -> None:
        self.param, self.dtype = param, dtype
        self.cpu = param.device.type == "cpu"
        self.upcast = dtype == "bfloat16" and param.dtype == torch.float32

    def bits_at(self, indices: np.ndarray) -> np.ndarray:
        if self.cpu and self.upcast:
            words = self.param.detach().view(-1).numpy().view(np.uint32)
            return (np.take(words, indices) >> np.uint32(16)).astype(np.uint16)
        held = self.param.detach().view(-1)[torch.from_numpy(indices).to(self.param.device)]
        return _numpy_bits(held.to(TORCH_DTYPES[self.dtype]).view(BITS_TORCH[self.dtype]).cpu(), self.dtype)

    def write(self, indices: np.ndarray, bits: np.ndarray) -> None:
        if self.cpu and self.upcast:
            words = self.param.detach().view(-1).numpy().view(np.uint32)
            np.put(words, indices, bits.astype(np.uint32) << np.uint32(16))
            return
        signed = bits.view(np.int16 if bits.dtype.itemsize == 2 else np.int32)
        narrow = torch.from_numpy(signed.copy()).view(TORCH_DTYPES[self.dtype])
        flat = self.param.detach().view(-1)
        flat[torch.from_numpy(indices).to(flat.device)] = narrow.to(device=flat.device, dtype=flat.dtype)


@dataclass
class Link:
    version: int
    kind: str
    base_version: Optional[int]
    base_checksum: Optional[int]
    checksum: int
    file: BlobRef
    changed: int
    elements: int

    def to_json(self) -> dict:
        return {**self.__dict__, "file": self.file.model_dump(), "checksum": str(self.checksum),
                "base_checksum": None if self.base_checksum is None else str(self.base_checksum)}  # fmt: skip

    @classmethod
    def from_json(cls, data: dict) -> "Link":
        base = data.get("base_checksum")
        return cls(
            version=int(data["version"]),
            kind=str(data["kind"]),
            base_version=data.get("base_version"),
            base_checksum=None if base is None else int(base),
            checksum=int(data["checksum"]),
            file=BlobRef.model_validate(data["file"]),
            changed=int(data["changed"]),
            elements=int(data["elements"]),
        )


@dataclass(frozen=True)
class Publication:
    """What one `publish` did, for the caller's result, logs and the delta report."""

    version: int
    kind: str
    reason: str
    manifest: BlobRef
    chain: list[BlobRef]
    changed: int
    elements: int
    file_bytes: int
    full_bytes: int
    seconds: float


# -- files -------------------------------------------------------------------------------


FRAMES = 4  # zstd frames per delta: compressed and decompressed in parallel


def encode_delta(header: dict, deltas: list[delta.TensorDelta]) -> bytes:
    frames = _balanced(deltas, FRAMES, size=lambda d: d.nbytes)
    tensors, bodies = [], []
    for number, frame in enumerate(frames):
        for d in frame:
            tensors.append({"name": d.name, "count": d.count, "index_width": d.index_width, "frame": number,
                            "index_bytes": len(d.indices), "value_bytes": len(d.values)})  # fmt: skip
        bodies.append(b"".join(d.indices + d.values for d in frame))
    compressed = list(_POOL.map(lambda body: zstandard.ZstdCompressor(level=3).compress(body), bodies))
    head = json.dumps({**header, "format": DELTA_FORMAT, "tensors": tensors, "frames": [len(c) for c in compressed]},
                      sort_keys=True).encode()  # fmt: skip
    return DELTA_MAGIC + struct.pack("<I", len(head)) + head + b"".join(compressed)


def decode_delta(data: bytes) -> tuple[dict, list[delta.TensorDelta]]:
    if data[:4] != DELTA_MAGIC or len(data) < 8:
        raise InvalidRequest("not an OpenRL weight delta")
    (length,) = struct.unpack("<I", data[4:8])
    header = json.loads(data[8 : 8 + length])
    if header.get("format") != DELTA_FORMAT:
        raise InvalidRequest(f"delta format {header.get('format')!r} is not {DELTA_FORMAT}")
    offset, frames = 8 + length, []
    for size in header["frames"]:
        frames.append(data[offset : offset + size])
        offset += size
    if offset != len(data):
        raise InvalidRequest("weight delta body does not match its header")
    bodies = list(
        _POOL.map(lambda frame: zstandard.ZstdDecompressor().decompress(frame, max_output_size=1 << 40), frames)
    )
    deltas, positions = [], [0] * len(bodies)
    for entry in header["tensors"]:
        number, start = entry["frame"], positions[entry["frame"]]
        body = bodies[number]
        indices = body[start : start + entry["index_bytes"]]
        values = body[start + entry["index_bytes"] : start + entry["index_bytes"] + entry["value_bytes"]]
        positions[number] = start + entry["index_bytes"] + entry["value_bytes"]
        deltas.append(
            delta.TensorDelta(entry["name"], entry["count"], entry["index_width"], bytes(indices), bytes(values))
        )
    if positions != [len(body) for body in bodies]:
        raise InvalidRequest("weight delta body does not match its header")
    return header, deltas


def manifest_bytes(run_id: str, base_model: str, dtype: str, chain: list[Link]) -> bytes:
    data = {"format": MANIFEST_FORMAT, "run_id": run_id, "base_model": base_model, "dtype": dtype,
            "version": chain[-1].version, "checksum": str(chain[-1].checksum), "chain": [link.to_json() for link in chain]}  # fmt: skip
    return json.dumps(data, sort_keys=True).encode()


def read_manifest(data: bytes) -> dict:
    try:
        manifest = json.loads(data)
    except ValueError as error:
        raise InvalidRequest(f"{MANIFEST} is not JSON: {error}") from error
    if not isinstance(manifest, dict) or manifest.get("format") != MANIFEST_FORMAT or not manifest.get("chain"):
        raise InvalidRequest(f"{MANIFEST} is not an {MANIFEST_FORMAT} manifest")
    manifest["chain"] = [Link.from_json(link) for link in manifest["chain"]]
    if manifest["chain"][0].kind != "full":
        raise InvalidRequest(f"{MANIFEST}: a chain starts with a full checkpoint")
    return manifest


def session_files(fetch: Fetch, adapter: Optional[Mapping], weights: Optional[Mapping]) -> set[str]:
    """Digests a sampling session's weights use (its projection row's `adapter` and `weights`):
    an adapter's files, or a full run's manifest and every file of its chain. A manifest that
    is gone or unreadable names nothing more (what it named is then no longer needed by it)."""
    digests = {ref["sha256"] for ref in (adapter or {}).values()}
    if weights is None:
        return digests
    manifest = BlobRef.model_validate(weights)
    digests.add(manifest.sha256)
    try:
        chain = read_manifest(fetch(manifest))["chain"]
    except OpenRLError:
        return digests
    return digests | {link.file.sha256 for link in chain}


# -- the trainer's side --------------------------------------------------------------------


@dataclass
class Publisher:
    """One full run's publication state: the bits last published and the chain since the
    last full checkpoint. Host memory only (a trainer that restarts publishes a full next)."""

    run_id: str
    base_model: str
    dtype: str = "bfloat16"
    full_every: int = 20
    max_share: float = 0.5
    bits: dict[str, torch.Tensor] = field(default_factory=dict)
    checksum: Optional[int] = None
    chain: list[Link] = field(default_factory=list)

    def publish(self, params: Mapping[str, torch.Tensor], version: int, put: Put) -> Publication:
        started = time.perf_counter()
        if self.chain and version <= self.chain[-1].version:
            raise ServerError(f"{self.run_id}: version {version} is not after {self.chain[-1].version}")
        new_bits = {name: serving_bits(p, self.dtype) for name, p in sorted(params.items())}
        elements = sum(b.numel() for b in new_bits.values())
        full_bytes = elements * new_bits[next(iter(new_bits))].element_size() if new_bits else 0
        deltas, checksum, changed, encoded = None, None, 0, None
        if self.bits and self.bits.keys() == new_bits.keys():
            deltas, checksum = [], self.checksum
            for name, bits in new_bits.items():
                old, new = _numpy_bits(self.bits[name], self.dtype), _numpy_bits(bits, self.dtype)
                piece, where = delta.TensorDelta.of(name, old, new)
                if piece.count:
                    deltas.append(piece)
                    checksum = delta.update_checksum(
                        checksum, name, where, old.reshape(-1)[where], new.reshape(-1)[where]
                    )
                changed += piece.count
            base = self.chain[-1]
            encoded = encode_delta(
                {
                    "version": version,
                    "base_version": base.version,
                    "base_checksum": str(base.checksum),
                    "checksum": str(checksum),
                    "dtype": self.dtype,
                    "run_id": self.run_id,
                },  # fmt: skip
                deltas,
            )
        deltas_since_full = len(self.chain) - 1 if self.chain else 0
        kind, reason = delta.choose_kind(
            bool(self.chain),
            deltas_since_full,
            self.full_every,
            None if encoded is None else len(encoded),
            full_bytes,
            self.max_share,
        )
        if kind == "full":
            checksum = delta.checksum({name: _numpy_bits(b, self.dtype) for name, b in new_bits.items()})
            tensors = {name: b.view(TORCH_DTYPES[self.dtype]) for name, b in new_bits.items()}
            data = save_safetensors(
                tensors,
                metadata={"format": "openrl.sampler-full.v1", "version": str(version), "checksum": str(checksum)},
            )
            link = Link(version, "full", None, None, checksum, put(data), elements, elements)
            self.chain = [link]
            changed = elements
        else:
            base = self.chain[-1]
            link = Link(version, "delta", base.version, base.checksum, checksum, put(encoded), changed, elements)
            self.chain.append(link)
        self.bits, self.checksum = new_bits, checksum
        manifest = put(manifest_bytes(self.run_id, self.base_model, self.dtype, self.chain))
        return Publication(
            version=version,
            kind=kind,
            reason=reason,
            manifest=manifest,
            chain=[step.file for step in self.chain],
            changed=changed,
            elements=elements,
            file_bytes=link.file.size,
            full_bytes=full_bytes,
            seconds=time.perf_counter() - started,
        )


# -- the sampler's side ------------------------------------------------------------------


class Receiver:
    """One run's weights in a sampler's model, at a known version and checksum."""

    def __init__(self, params: Mapping[str, torch.nn.Parameter], dtype: str) -> None:
        self.params = dict(params)
        self.dtype = dtype
        self.version: Optional[int] = None
        self.checksum: Optional[int] = None
        self.last_update: dict = {}

    def update(self, manifest: dict, fetch: Fetch) -> dict:
        """Bring the weights to the manifest's version; returns what it did (kind, seconds)."""
        started = time.perf_counter()
        chain: list[Link] = manifest["chain"]
        if manifest["dtype"] != self.dtype:
            raise InvalidRequest(f"weights published in {manifest['dtype']}, this sampler serves {self.dtype}")
        if self.version == chain[-1].version and self.checksum == chain[-1].checksum:
            return {"kind": "none", "seconds": 0.0, "bytes": 0}
        position = next(
            (i for i, link in enumerate(chain) if link.version == self.version and link.checksum == self.checksum), None
        )
        todo = chain[position + 1 :] if position is not None else chain
        moved, touched = 0, set()
        for link in todo:
            data = fetch(link.file)
            moved += len(data)
            if link.kind == "full":
                self.load_full(data, link)
                touched |= set(self.params)
            else:
                touched |= self.apply_delta(data, link)
        # `touched`: the tensors with any element written, for an engine that copies changed
        # tensors into its own (vLLM on CUDA) instead of reloading them all.
        self.last_update = {"kind": "delta" if position is not None else "full", "links": len(todo),
                            "seconds": time.perf_counter() - started, "bytes": moved,
                            "touched": sorted(touched)}  # fmt: skip
        return self.last_update

    @torch.no_grad()
    def load_full(self, data: bytes, link: Link) -> None:
        try:
            tensors = load_safetensors(data)
        except SafetensorError as error:
            raise InvalidRequest(f"full weights of version {link.version} are unreadable: {error}") from error
        if set(tensors) != set(self.params):
            missing, extra = sorted(set(self.params) - set(tensors))[:3], sorted(set(tensors) - set(self.params))[:3]
            raise InvalidRequest(f"full weights do not fit this model: missing {missing}, unexpected {extra}")
        for name, tensor in tensors.items():
            if tuple(tensor.shape) != tuple(self.params[name].shape):
                raise InvalidRequest(
                    f"full weights: {name} has shape {list(tensor.shape)}, expected {list(self.params[name].shape)}"
                )
        checksum = delta.checksum(
            {name: _numpy_bits(t.view(BITS_TORCH[self.dtype]), self.dtype) for name, t in tensors.items()}
        )
        if checksum != link.checksum:
            raise InvalidRequest(f"full weights of version {link.version} fail their checksum")
        for name, tensor in tensors.items():
            self.params[name].copy_(tensor.to(self.params[name].dtype))
        self.version, self.checksum = link.version, checksum

    @torch.no_grad()
    def apply_delta(self, data: bytes, link: Link) -> set[str]:
        """Write the delta's elements in place; returns the names of the tensors it changed."""
        header, deltas = decode_delta(data)
        if int(header["base_version"]) != self.version or int(header["base_checksum"]) != self.checksum:
            raise InvalidRequest(
                f"delta {header['base_version']} -> {header['version']} does not apply to the held version {self.version}"
            )
        bits_np = delta.BITS_DTYPE[self.dtype]
        missing = [piece.name for piece in deltas if piece.name not in self.params]
        if missing:
            raise InvalidRequest(f"delta names tensors this model does not have: {missing[:3]}")

        def plan(piece: delta.TensorDelta):
            param = self.params[piece.name]
            indices, values = piece.decode(bits_np)
            if indices.size and int(indices[-1]) >= param.numel():
                raise InvalidRequest(f"delta index out of range for {piece.name}")
            target = _Target(param, self.dtype)
            # the checksum's move for this tensor alone (it is a sum over tensors)
            change = delta.update_checksum(0, piece.name, indices, target.bits_at(indices), values)
            return target, indices, values, change

        # Reading and writing 2% of a model's elements touches most of its memory: the
        # tensors are split into balanced shares, one per thread (numpy's take and put, and
        # the checksum's dots, run without the GIL).
        shares = _balanced(deltas, _POOL._max_workers)
        plans = [p for share in _POOL.map(lambda share: [plan(piece) for piece in share], shares) for p in share]
        checksum = (self.checksum + sum(change for *_, change in plans)) & delta.MASK64
        if checksum != int(header["checksum"]) or checksum != link.checksum:
            raise InvalidRequest(
                f"delta to version {header['version']} fails its checksum; the held weights are unchanged"
            )
        # every check passed: now write, in place
        written = _balanced(plans, _POOL._max_workers, size=lambda p: p[1].size)
        list(_POOL.map(lambda share: [target.write(indices, values) for target, indices, values, _ in share], written))
        self.version, self.checksum = int(header["version"]), checksum
        return {piece.name for piece in deltas if piece.count}
