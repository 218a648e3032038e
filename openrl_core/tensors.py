"""Dense arrays as they travel inside events: dtype, shape and base64 little-endian bytes.

Events carry tensors this way rather than as JSON number lists because a forward_backward
batch is mostly token ids and floats: base64 is a third larger than the raw bytes, a JSON
list is three to five times larger and slow to parse. Everything here is numpy only.
"""

from __future__ import annotations

import base64
from typing import Annotated, Literal, Sequence, cast

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from openrl_core.errors import InvalidRequest

DType = Literal["int64", "int32", "float32"]
_NP_DTYPES: dict[str, np.dtype] = {
    "int64": np.dtype("<i8"),
    "int32": np.dtype("<i4"),
    "float32": np.dtype("<f4"),
}


class Array(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    dtype: DType
    # Non-negative dimensions, checked by pydantic's core (a Python validator ran per array of
    # every event decoded, a third of a forward_backward payload's decode).
    shape: tuple[Annotated[int, Field(ge=0)], ...]
    b64: str

    @classmethod
    def from_numpy(cls, array: np.ndarray) -> "Array":
        name = str(array.dtype)
        if name not in _NP_DTYPES:
            raise InvalidRequest(f"unsupported dtype {name}")
        data = np.ascontiguousarray(array, dtype=_NP_DTYPES[name]).tobytes()
        return cls(
            dtype=cast(DType, name), shape=tuple(int(d) for d in array.shape), b64=base64.b64encode(data).decode()
        )

    def to_numpy(self) -> np.ndarray:
        raw = base64.b64decode(self.b64)
        array = np.frombuffer(raw, dtype=_NP_DTYPES[self.dtype])
        expected = int(np.prod(self.shape)) if self.shape else 1
        if array.size != expected:
            raise InvalidRequest(f"array holds {array.size} values but its shape {list(self.shape)} needs {expected}")
        return array.reshape(self.shape).copy()


def numpy_dtype(name: str) -> np.dtype:
    if name not in _NP_DTYPES:
        raise InvalidRequest(f"unsupported dtype {name!r}; expected one of {sorted(_NP_DTYPES)}")
    return _NP_DTYPES[name]


def dense_from_csr(
    values: np.ndarray,
    crow_indices: Sequence[int] | np.ndarray,
    col_indices: Sequence[int] | np.ndarray,
    shape: Sequence[int],
    pad_value: float = 0,
) -> np.ndarray:
    """Expand a 2-D CSR tensor; unlisted entries take `pad_value` (the SDK's convention)."""
    if len(shape) != 2:
        raise InvalidRequest(f"sparse CSR tensors must be 2-D, got shape {list(shape)}")
    rows, cols = int(shape[0]), int(shape[1])
    crow = np.asarray(crow_indices, dtype=np.int64)
    col = np.asarray(col_indices, dtype=np.int64)
    if crow.shape != (rows + 1,):
        raise InvalidRequest(f"sparse_crow_indices must have {rows + 1} entries, got {crow.size}")
    if crow[0] != 0 or np.any(np.diff(crow) < 0) or crow[-1] != col.size:
        raise InvalidRequest("sparse_crow_indices must start at 0, never decrease and end at the number of values")
    if values.size != col.size:
        raise InvalidRequest(f"sparse tensor has {values.size} values but {col.size} column indices")
    if col.size and (col.min() < 0 or col.max() >= cols):
        raise InvalidRequest(f"sparse column index out of range for {cols} columns")
    dense = np.full((rows, cols), pad_value, dtype=values.dtype)
    row_of_value = np.repeat(np.arange(rows), np.diff(crow))
    dense[row_of_value, col] = values
    return dense
