"""A full run's checkpoint files, sharded or whole, and the conversions between the two.

Whole (`full.py`): `model.safetensors` (float32 weights by parameter name), the optimizer
files (`optimizer.safetensors` with `exp_avg/NAME` and `exp_avg_sq/NAME`, `optimizer.json`)
and the marker `openrl_full.json`. Sharded (`sharded.py`, FSDP2 ranks): the same marker and
`optimizer.json`, the marker saying `"shards": W`, and one safetensors file per rank with
that rank's rows of the weights and moments (layout: `openrl_core/sharding.py`).

`whole(files)` turns a sharded checkpoint into the whole one, bitwise (the shards
concatenated in rank order), so everything that reads full checkpoints (a single-device
engine's load, export, recovery by replay on a trainer with another shard count) reads both;
`split(tensors, world)` cuts whole tensors into each rank's rows.
"""

from __future__ import annotations

import json
from typing import Mapping

import torch

from functions.trainer import optimizer, tensor_files
from openrl_core import sharding
from openrl_core.errors import InvalidRequest

MARKER_FILE = "openrl_full.json"
WEIGHTS_FILE = "model.safetensors"


def marker(files: Mapping[str, bytes]) -> dict:
    try:
        value = json.loads(files[MARKER_FILE])
    except (KeyError, ValueError) as error:
        raise InvalidRequest(f"the checkpoint's {MARKER_FILE} is missing or unreadable: {error}") from error
    if not isinstance(value, dict):
        raise InvalidRequest(f"the checkpoint's {MARKER_FILE} is not a JSON object")
    return value


def shards(files: Mapping[str, bytes]) -> int:
    try:
        return sharding.shards_of(marker(files))
    except ValueError as error:
        raise InvalidRequest(str(error)) from error


def sharded_files(marker_: dict, step: int, world: int, pieces: list[dict[str, torch.Tensor]]) -> dict[str, bytes]:
    """The files of a checkpoint from each rank's `local_state` tensors, in rank order, and
    the AdamW step count (the optimizer's own meta file, as a whole checkpoint has it)."""
    out = {sharding.shard_file(rank, world): tensor_files.save(piece) for rank, piece in enumerate(pieces)}
    out[MARKER_FILE] = json.dumps({**marker_, sharding.SHARDS_KEY: world}, sort_keys=True).encode()
    meta = {"format": optimizer.STATE_FORMAT, "step": step}
    out[optimizer.STATE_META] = json.dumps(meta, sort_keys=True).encode()
    return out


def merged_tensors(files: Mapping[str, bytes]) -> dict[str, torch.Tensor]:
    """A sharded checkpoint's tensors, whole: `model/NAME`, `exp_avg/NAME`, `exp_avg_sq/NAME`."""
    world = shards(files)
    missing = sharding.missing_shards(set(files), world)
    if missing:
        raise InvalidRequest(f"the checkpoint has {world} shards but lacks {', '.join(missing)}")
    pieces = [tensor_files.read(files, name) for name in sharding.shard_files(world)]
    names = set(pieces[0])
    for rank, piece in enumerate(pieces):
        if set(piece) != names:
            raise InvalidRequest(f"shard {rank} of the checkpoint holds other tensors than shard 0")
    try:
        return {name: torch.cat([piece[name] for piece in pieces], dim=0) for name in sorted(names)}
    except RuntimeError as error:
        raise InvalidRequest(f"the checkpoint's shards do not fit together: {error}") from error


def whole(files: Mapping[str, bytes]) -> dict[str, bytes]:
    """`files` as a whole checkpoint (unchanged if it already is one)."""
    if shards(files) == 1 and sharding.shard_file(0, 1) not in files:
        return dict(files)
    tensors = merged_tensors(files)
    weights = {name[len("model/") :]: t for name, t in tensors.items() if name.startswith("model/")}
    moments = {name: t for name, t in tensors.items() if not name.startswith("model/")}
    out = {name: content for name, content in files.items() if not name.startswith("shard-")}
    out[MARKER_FILE] = json.dumps({k: v for k, v in marker(files).items() if k != sharding.SHARDS_KEY},
                                  sort_keys=True).encode()  # fmt: skip
    out[WEIGHTS_FILE] = tensor_files.save(weights)
    if moments:
        out[optimizer.STATE_TENSORS] = tensor_files.save(moments)
    return out


def split(tensors: Mapping[str, torch.Tensor], world: int) -> list[dict[str, torch.Tensor]]:
    """Each rank's rows of whole tensors (FSDP2's dim-0 chunks)."""
    pieces: list[dict[str, torch.Tensor]] = [{} for _ in range(world)]
    for name, tensor in tensors.items():
        for rank, (start, stop) in enumerate(sharding.rows_of(tensor.shape[0], world)):
            pieces[rank][name] = tensor[start:stop].contiguous()
    return pieces
