"""openrl_core/sharding.py: the row split is torch.chunk's (FSDP2's dim-0 sharding), checked
against torch itself; the checkpoint file names and the marker's shard count."""

from __future__ import annotations

import pytest
import torch

from openrl_core import sharding


@pytest.mark.parametrize("world", [1, 2, 3, 4, 7])
def test_rows_are_torch_chunks_padded_with_empty_ranks(world):
    for rows in range(0, 41):
        chunks = [c.shape[0] for c in torch.arange(rows).chunk(world)] if rows else []
        chunks += [0] * (world - len(chunks))  # FSDP2 gives the ranks past the last chunk nothing
        split = sharding.rows_of(rows, world)
        assert [stop - start for start, stop in split] == chunks, (rows, world)
        assert split[0][0] == 0 and split[-1][1] == rows
        assert all(a[1] == b[0] for a, b in zip(split, split[1:]))  # contiguous, in rank order


def test_a_group_has_a_rank():
    with pytest.raises(ValueError):
        sharding.rows_of(4, 0)


def test_file_names_and_the_markers_shard_count():
    assert sharding.shard_files(2) == ["shard-00000-of-00002.safetensors", "shard-00001-of-00002.safetensors"]
    assert sharding.missing_shards({"shard-00001-of-00002.safetensors", "x"}, 2) == ["shard-00000-of-00002.safetensors"]
    assert sharding.missing_shards(set(sharding.shard_files(3)), 3) == []
    assert sharding.shards_of({"format": "openrl.full.v1"}) == 1
    assert sharding.shards_of({"shards": 4}) == 4
    for bad in (0, -1, "2", True, 1.5):
        with pytest.raises(ValueError, match="positive integer"):
            sharding.shards_of({"shards": bad})
