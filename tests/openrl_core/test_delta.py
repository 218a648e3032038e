"""Delta encoding, the linear checksum and the publication policy, against plain references."""

from __future__ import annotations

import numpy as np
import pytest

from openrl_core import delta


def brute_checksum(tensors):
    total = 0
    for name, bits in tensors.items():
        salt = delta.tensor_salt(name)
        total += salt * sum((int(b) + 1) * (2 * i + 1) for i, b in enumerate(bits.reshape(-1).tolist()))
    return total % (1 << 64)


@pytest.mark.parametrize("dtype", [np.uint16, np.uint32])
def test_checksum_equals_the_definition_and_moves_with_a_delta(dtype):
    rng = np.random.default_rng(0)
    tensors = {
        "a": rng.integers(0, np.iinfo(dtype).max, (30, 7), dtype=dtype),
        "b": rng.integers(0, 9, 101, dtype=dtype),
    }
    assert delta.checksum(tensors) == brute_checksum(tensors)
    new = tensors["a"].copy()
    new[3, 4] ^= 1
    new[29, 0] = 0
    d, where = delta.TensorDelta.of("a", tensors["a"], new)
    moved = delta.update_checksum(
        delta.checksum(tensors), "a", where, tensors["a"].reshape(-1)[where], new.reshape(-1)[where]
    )
    assert moved == brute_checksum({"a": new, "b": tensors["b"]})


def test_weighted_sum_is_exact_for_huge_indices_and_wide_values():
    indices = np.array([0, 2**31 + 5, 2**40 + 3], dtype=np.int64)
    bits = np.array([2**32 - 1, 7, 2**31], dtype=np.uint32)
    expected = sum((int(b) + 1) * (2 * int(i) + 1) for i, b in zip(indices, bits))
    assert delta.weighted_sum(indices, bits) == expected


def test_any_single_bit_change_changes_the_checksum():
    rng = np.random.default_rng(1)
    bits = rng.integers(0, 2**16, 4096, dtype=np.uint16)
    base = delta.tensor_checksum("w", bits)
    for position in rng.choice(4096, 64, replace=False):
        for bit in (0, 7, 15):
            flipped = bits.copy()
            flipped[position] ^= np.uint16(1 << bit)
            assert delta.tensor_checksum("w", flipped) != base
    assert delta.tensor_checksum("v", bits) != base  # same contents, another tensor


@pytest.mark.parametrize("gap", [1, 200, 70_000, 5_000_000_000])
def test_indices_round_trip_in_the_narrowest_width(gap):
    indices = np.cumsum(np.full(50, gap, dtype=np.int64)) - gap + 3
    width, planes = delta.encode_indices(indices)
    assert width == next(w for w in (1, 2, 4, 8) if gap - 1 < 1 << (8 * w) and 3 < 1 << (8 * w))
    assert len(planes) == width * indices.size
    np.testing.assert_array_equal(delta.decode_indices(width, planes, indices.size), indices)


def test_planes_put_each_byte_position_together():
    values = np.array([0x0102, 0x0304, 0x0506], dtype=np.uint16)
    assert delta.split_planes(values) == bytes([0x02, 0x04, 0x06, 0x01, 0x03, 0x05])
    np.testing.assert_array_equal(delta.join_planes(delta.split_planes(values), np.uint16, 3), values)


def test_empty_and_bad_inputs():
    assert delta.encode_indices(np.array([], dtype=np.int64)) == (1, b"")
    assert delta.decode_indices(1, b"", 0).size == 0
    with pytest.raises(ValueError, match="strictly increasing"):
        delta.encode_indices(np.array([3, 3]))
    with pytest.raises(ValueError, match="cannot diff"):
        delta.changed(np.zeros(3, np.uint16), np.zeros(4, np.uint16))
    with pytest.raises(ValueError, match="planes"):
        delta.join_planes(b"abc", np.uint16, 2)


def test_a_delta_holds_new_values_found_by_bit_pattern():
    old = np.array([0.0, 1.0, 2.0, np.nan], dtype=np.float32).view(np.uint32)
    new = np.array([-0.0, 1.0, 2.5, np.nan], dtype=np.float32).view(np.uint32)
    d, where = delta.TensorDelta.of("t", old, new)
    assert list(where) == [0, 2]  # -0.0 == 0.0 as values, but the bits differ; equal NaN bits are no change
    indices, values = d.decode(np.uint32)
    applied = old.copy()
    applied[indices] = values
    np.testing.assert_array_equal(applied, new)


@pytest.mark.parametrize(
    "has_base, since_full, full_every, delta_bytes, expected",
    [
        (False, 0, 10, 5, ("full", "no base version")),
        (True, 9, 10, 5, ("full", "every 10 versions")),
        (True, 8, 10, 5, ("delta", "sparse")),
        (True, 100, 0, 5, ("delta", "sparse")),  # 0: no periodic full
        (True, 1, 10, 60, ("full", "delta larger than 50% of the full checkpoint")),
    ],
)
def test_choose_kind(has_base, since_full, full_every, delta_bytes, expected):
    assert delta.choose_kind(has_base, since_full, full_every, delta_bytes, 100, 0.5) == expected
