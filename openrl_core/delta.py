"""Sparse weight deltas for full fine-tuning: what changed in the serving dtype, compactly.

A full run's sampler serves its weights in a narrow dtype (bfloat16 by default). After an
optimizer step most elements keep their bfloat16 bit pattern (an Adam update smaller than
half a bf16 step rounds away), so a publication ships only the elements whose bit pattern
changed, as their NEW bit patterns (not differences): applying a delta is a scatter, exact
and idempotent, and the result is bitwise the publisher's weights.

Pure numpy, no I/O (the container and compression live in `functions/compute/weight_sync`):

- `changed(old_bits, new_bits)`: flat indices where the bit patterns differ (comparing bits,
  not values, so -0.0 vs 0.0 and NaN payloads count as changes and nothing is lost).
- `encode_indices` / `decode_indices`: sorted indices as gaps (the first index, then each
  distance minus one), in the narrowest unsigned width holding the largest gap (1, 2, 4 or
  8 bytes), split into byte planes (every element's low byte, then every next byte...) so
  that a general-purpose compressor sees the long runs of zeros in the high planes.
  `split_planes` / `join_planes` do the same for the new values' bit patterns.
- `checksum`: a 64-bit linear checksum of a whole state, sum over tensors of an odd
  per-name multiplier times sum over elements of (bits + 1) * (2 * index + 1).
  `update_checksum` moves it across a delta by the changed elements' terms alone, so a
  sampler verifies a delta in time proportional to the delta, and still checks the whole
  state it ends in (its running checksum is built from the bits it really holds).
- `choose_kind`: the publication policy: a full checkpoint when there is no base, every
  `full_every` publications, or when the delta would be larger than `max_share` of the
  full checkpoint; a delta otherwise.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Literal, Mapping, Optional

import numpy as np

MASK64 = (1 << 64) - 1
# bit-pattern dtype for each serving dtype name
BITS_DTYPE = {"bfloat16": np.uint16, "float16": np.uint16, "float32": np.uint32}
_WIDTHS = (1, 2, 4, 8)
_UNSIGNED = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}
_CHUNK = 1 << 20  # elements per numpy pass: bounds temporaries and keeps int64 dots exact


def changed(old_bits: np.ndarray, new_bits: np.ndarray) -> np.ndarray:
    """Sorted flat int64 indices where two same-shaped bit-pattern arrays differ."""
    if old_bits.shape != new_bits.shape or old_bits.dtype != new_bits.dtype:
        raise ValueError(
            f"cannot diff {old_bits.dtype}{list(old_bits.shape)} against {new_bits.dtype}{list(new_bits.shape)}"
        )
    return np.flatnonzero(old_bits.reshape(-1) != new_bits.reshape(-1)).astype(np.int64, copy=False)


def split_planes(values: np.ndarray) -> bytes:
    """Little-endian byte planes: byte 0 of every element, then byte 1, ..."""
    flat = np.ascontiguousarray(values.reshape(-1))
    width = flat.dtype.itemsize
    if width == 1:
        return flat.tobytes()
    planes = flat.astype(flat.dtype.newbyteorder("<"), copy=False).view(np.uint8).reshape(-1, width)
    return np.ascontiguousarray(planes.T).tobytes()


def join_planes(data: bytes, dtype, count: int) -> np.ndarray:
    dtype = np.dtype(dtype)
    width = dtype.itemsize
    if len(data) != width * count:
        raise ValueError(f"expected {width * count} bytes of {dtype} planes, got {len(data)}")
    planes = np.frombuffer(data, dtype=np.uint8).reshape(width, count)
    unsigned = np.dtype(f"<u{width}")
    # OR-ing shifted planes reads each plane once, sequentially (a transposing copy does not)
    out = planes[0].astype(unsigned)
    for byte in range(1, width):
        out |= planes[byte].astype(unsigned) << unsigned.type(8 * byte)
    return out.view(dtype.newbyteorder("<")).astype(dtype, copy=False)


def encode_indices(indices: np.ndarray) -> tuple[int, bytes]:
    """(byte width, planes) of the gaps of strictly increasing non-negative indices."""
    indices = np.asarray(indices, dtype=np.int64)
    if indices.size == 0:
        return 1, b""
    gaps = np.empty(indices.size, dtype=np.int64)
    gaps[0] = indices[0]
    np.subtract(indices[1:], indices[:-1], out=gaps[1:])
    gaps[1:] -= 1
    if gaps.min() < 0:
        raise ValueError("indices must be strictly increasing and non-negative")
    largest = int(gaps.max())
    width = next(w for w in _WIDTHS if largest < (1 << (8 * w)))
    return width, split_planes(gaps.astype(_UNSIGNED[width]))


def decode_indices(width: int, data: bytes, count: int) -> np.ndarray:
    if width not in _UNSIGNED:
        raise ValueError(f"index width must be one of {_WIDTHS}, got {width}")
    if count == 0:
        return np.empty(0, dtype=np.int64)
    gaps = join_planes(data, _UNSIGNED[width], count).astype(np.int64)
    gaps[1:] += 1
    return np.cumsum(gaps)


def tensor_salt(name: str) -> int:
    """An odd 64-bit multiplier per tensor name, so equal contents of two tensors differ."""
    return int.from_bytes(hashlib.sha256(b"openrl-delta:" + name.encode()).digest()[:8], "little") | 1


def weighted_sum(indices: np.ndarray, bits: np.ndarray) -> int:
    """Sum over elements of (bits + 1) * (2 * index + 1), exactly (a Python int).

    int64 numpy dots over pieces of 2**16 elements, with the values cut into 16-bit limbs
    and the weights into 21-bit limbs: every dot then stays below 2**16 * 2**17 * 2**21
    = 2**54 and never overflows, whatever the index or the bit width.
    """
    total = 0
    indices = np.asarray(indices).reshape(-1)
    bits = np.asarray(bits).reshape(-1)
    for start in range(0, indices.size, 1 << 16):
        values = bits[start : start + (1 << 16)].astype(np.int64) + 1
        weights = 2 * indices[start : start + (1 << 16)].astype(np.int64) + 1
        value_limbs = [(values & 0xFFFF, 0), (values >> 16, 16)]
        weight_limbs = [(weights & 0x1FFFFF, 0), ((weights >> 21) & 0x1FFFFF, 21), (weights >> 42, 42)]
        for v, v_shift in value_limbs:
            if not v.any():
                continue
            for w, w_shift in weight_limbs:
                if w.any():
                    total += int(np.dot(v, w)) << (v_shift + w_shift)
    return total


def tensor_checksum(name: str, bits: np.ndarray) -> int:
    """`tensor_salt(name) * weighted_sum(all elements)` mod 2**64, in chunks of positions."""
    flat = np.asarray(bits).reshape(-1)
    total = 0
    for start in range(0, flat.size, _CHUNK):
        chunk = flat[start : start + _CHUNK].astype(np.int64) + 1
        local = np.arange(chunk.size, dtype=np.int64) * 2 + 1
        # sum (b+1)(2(start+j)+1) = sum (b+1)(2j+1) + 2*start*sum(b+1)
        if flat.dtype.itemsize <= 2:
            total += int(np.dot(chunk, local)) + 2 * start * int(chunk.sum())
        else:
            total += weighted_sum(np.arange(start, start + chunk.size, dtype=np.int64), flat[start : start + _CHUNK])
    return (tensor_salt(name) * total) & MASK64


def checksum(tensors: Mapping[str, np.ndarray]) -> int:
    """The checksum of a whole state (name -> bit patterns); independent of tensor order.

    Linear, not cryptographic: any single changed element changes it, accidental
    corruption almost surely does, and a delta moves it in time proportional to the delta.
    """
    return sum(tensor_checksum(name, bits) for name, bits in tensors.items()) & MASK64


def update_checksum(current: int, name: str, indices: np.ndarray, old_bits: np.ndarray, new_bits: np.ndarray) -> int:
    """The checksum after replacing `old_bits` by `new_bits` at `indices` of tensor `name`."""
    old_bits, new_bits = np.asarray(old_bits).reshape(-1), np.asarray(new_bits).reshape(-1)
    if old_bits.dtype.itemsize <= 2 and new_bits.dtype.itemsize <= 2:
        change = _narrow_change(np.asarray(indices).reshape(-1), old_bits, new_bits)
    else:
        change = weighted_sum(indices, new_bits) - weighted_sum(indices, old_bits)
    return (current + tensor_salt(name) * change) & MASK64


def _narrow_change(indices: np.ndarray, old_bits: np.ndarray, new_bits: np.ndarray) -> int:
    """sum((new - old) * (2 * index + 1)) for bit patterns of at most 16 bits, exactly.

    The +1 of each term cancels in the difference, so one int64 dot per chunk does it: a
    difference is below 2**16 in size and a weight below 2**w, so a chunk of 2**(46 - w)
    terms stays under 2**62.
    """
    if indices.size == 0:
        return 0
    width = (2 * int(indices.max()) + 1).bit_length()
    chunk = 1 << max(0, 46 - width)
    total = 0
    for start in range(0, indices.size, chunk):
        diff = new_bits[start : start + chunk].astype(np.int64) - old_bits[start : start + chunk].astype(np.int64)
        weights = indices[start : start + chunk].astype(np.int64) * 2 + 1
        total += int(np.dot(diff, weights))
    return total


@dataclass(frozen=True)
class TensorDelta:
    """One tensor's changes: where (gap-encoded planes) and the new bit patterns (planes)."""

    name: str
    count: int
    index_width: int
    indices: bytes
    values: bytes

    @classmethod
    def of(cls, name: str, old_bits: np.ndarray, new_bits: np.ndarray) -> tuple["TensorDelta", np.ndarray]:
        """The delta taking old to new, and the changed indices (callers update checksums with them)."""
        where = changed(old_bits, new_bits)
        width, planes = encode_indices(where)
        values = split_planes(new_bits.reshape(-1)[where])
        return cls(name, int(where.size), width, planes, values), where

    def decode(self, bits_dtype) -> tuple[np.ndarray, np.ndarray]:
        return decode_indices(self.index_width, self.indices, self.count), join_planes(
            self.values, bits_dtype, self.count
        )

    @property
    def nbytes(self) -> int:
        return len(self.indices) + len(self.values)


Kind = Literal["full", "delta"]


def choose_kind(
    has_base: bool,
    deltas_since_full: int,
    full_every: int,
    delta_bytes: Optional[int],
    full_bytes: int,
    max_share: float,
) -> tuple[Kind, str]:
    """Full or delta for the next publication, and why (for logs and metrics).

    `deltas_since_full` is the length of the chain a sampler holding the last full
    checkpoint would apply; `full_every` bounds it, so a late sampler catches up in at
    most that many deltas (0: no bound).
    """
    if not has_base:
        return "full", "no base version"
    if full_every > 0 and deltas_since_full + 1 >= full_every:
        return "full", f"every {full_every} versions"
    if delta_bytes is None or delta_bytes > max_share * full_bytes:
        return "full", f"delta larger than {max_share:.0%} of the full checkpoint"
    return "delta", "sparse"
