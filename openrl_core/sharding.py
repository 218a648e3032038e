"""How a full run's tensors are split over the ranks of an FSDP2 group, and how its sharded
checkpoint names its files. Pure: no torch, no I/O.

FSDP2 (`fully_shard`) shards every parameter along its first dimension the way `torch.chunk`
does: ceil(rows / world) rows to each rank in rank order, so the last ranks may hold fewer
rows or none. Concatenating the ranks' shards in rank order is therefore the whole tensor,
bit for bit, which is what lets a checkpoint written by W ranks be read by one process, by
an export, or by W' ranks (merge, then split again).

A sharded checkpoint is the files of an unsharded one with `model.safetensors` and
`optimizer.safetensors` replaced by one file per rank (`shard_file`), each holding that
rank's rows of the weights (`model/NAME`) and of both AdamW moments (`exp_avg/NAME`,
`exp_avg_sq/NAME`); the marker (`openrl_full.json`) says how many shards there are.
"""

from __future__ import annotations

from typing import Mapping

SHARDS_KEY = "shards"


def rows_of(rows: int, world: int) -> list[tuple[int, int]]:
    """Each rank's [start, stop) rows of a tensor with `rows` rows (torch.chunk's split)."""
    if world < 1:
        raise ValueError(f"a process group has at least one rank, not {world}")
    size = -(-rows // world)  # ceil
    return [(min(rank * size, rows), min((rank + 1) * size, rows)) for rank in range(world)]


def shard_file(rank: int, world: int) -> str:
    return f"shard-{rank:05d}-of-{world:05d}.safetensors"


def shard_files(world: int) -> list[str]:
    return [shard_file(rank, world) for rank in range(world)]


def shards_of(marker: Mapping) -> int:
    """Shards a checkpoint's marker declares (1: an unsharded checkpoint)."""
    value = marker.get(SHARDS_KEY, 1)
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"the checkpoint's marker says {SHARDS_KEY}={value!r}; expected a positive integer")
    return value


def missing_shards(names: set[str], world: int) -> list[str]:
    """The shard files a checkpoint of `world` shards lacks (none: it is whole)."""
    return [name for name in shard_files(world) if name not in names]
