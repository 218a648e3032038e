"""`SampleRequest.target_prompt_logprobs` on the wire: parsed, checked, and answered in kind.

SDK 0.38 defines the field as an int64 `TensorData` of shape `[len(prompt) - 1, K]`: cell
`[i, j]` names a token id scored at prompt position `i + 1` (position 0 has no context), and
`-1` names nothing. It may be sparse CSR (`TensorData.from_torch_sparse(ids, pad_value=-1)`),
in which case only the listed cells ask for anything. `SampleResponse.target_prompt_logprobs`
is a float32 tensor "of the same shape and layout, 0.0 where the request had -1": a sparse
request is answered sparse, with the request's own row pointers and columns, a dense one
dense. This module is that contract, in numpy, shared by the gateway (which refuses a bad
tensor with a 400 before anything is stored) and the sampler (which answers it).

Invariants: `dense_ids_R_K` always has `len(prompt) - 1` rows, every entry in
`[-1, vocab)`, at least one entry not -1; `answer` keeps the request's layout exactly.
The cost, len(prompt) x distinct ids, is bounded by the caller (as a top-k width is).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import numpy as np

from openrl_core.errors import InvalidRequest
from openrl_core.tensors import dense_from_csr

FIELD = "target_prompt_logprobs"
NONE = -1  # the id that asks for nothing


@dataclass(frozen=True)
class TargetIds:
    dense_ids_R_K: np.ndarray  # int64, R = len(prompt) - 1, -1 where nothing is asked
    crow_indices: Optional[list[int]] = None  # the request's CSR layout, None when dense
    col_indices: Optional[list[int]] = None

    @property
    def first_row(self) -> int:
        """The first row naming an id: rows before it are not scored (the SDK documents it)."""
        return int(np.flatnonzero((self.dense_ids_R_K != NONE).any(axis=1))[0])

    @property
    def distinct_ids(self) -> int:
        ids = self.dense_ids_R_K
        return int(np.unique(ids[ids != NONE]).size)

    @classmethod
    def from_wire(cls, tensor: dict[str, Any], prompt_length: int, vocab_size: int) -> "TargetIds":
        """Check the request's tensor against its prompt and vocabulary; InvalidRequest
        says what is wrong."""
        if not isinstance(tensor, dict):
            raise InvalidRequest(f"{FIELD} must be a TensorData object")
        if tensor.get("dtype") != "int64":
            raise InvalidRequest(f"{FIELD} must be an int64 tensor of token ids, got {tensor.get('dtype')!r}")
        shape = tensor.get("shape")
        rows = prompt_length - 1
        if not (isinstance(shape, list) and len(shape) == 2 and all(isinstance(d, int) for d in shape)):
            raise InvalidRequest(f"{FIELD} must be 2-D, [len(prompt) - 1, K], got shape {shape}")
        if shape[0] != rows or shape[1] < 1:
            raise InvalidRequest(
                f"{FIELD} must have shape [{rows}, K] with K >= 1 for a prompt of {prompt_length} tokens, got {shape}"
            )
        data = tensor.get("data")
        if not isinstance(data, list) or not all(isinstance(v, int) and not isinstance(v, bool) for v in data):
            raise InvalidRequest(f"{FIELD}.data must be a list of integer token ids")
        values = np.asarray(data, dtype=np.int64)
        crow, col = tensor.get("sparse_crow_indices"), tensor.get("sparse_col_indices")
        if (crow is None) != (col is None):
            raise InvalidRequest(f"{FIELD} needs both sparse_crow_indices and sparse_col_indices, or neither")
        if crow is not None and col is not None:
            if not all(isinstance(v, int) for v in list(crow) + list(col)):
                raise InvalidRequest(f"{FIELD} sparse indices must be integers")
            dense = dense_from_csr(values, crow, col, shape, pad_value=NONE)
        else:
            if values.size != rows * shape[1]:
                raise InvalidRequest(f"{FIELD} has {values.size} values but shape {shape}")
            dense = values.reshape(shape)
        if dense.size and (dense.min() < NONE or dense.max() >= vocab_size):
            raise InvalidRequest(f"{FIELD} holds ids outside [0, {vocab_size}) other than -1 (which asks for nothing)")
        if not (dense != NONE).any():
            raise InvalidRequest(f"{FIELD} names no token id (every cell is -1)")
        return cls(dense, None if crow is None else list(crow), None if col is None else list(col))

    def answer(self, logprobs_R_K: np.ndarray) -> dict[str, Any]:
        """The response tensor (wire TensorData) for logprobs of every cell, in the
        request's layout; 0.0 wherever the request had -1."""
        values_R_K = np.where(self.dense_ids_R_K == NONE, 0.0, logprobs_R_K).astype(np.float32)
        shape = list(self.dense_ids_R_K.shape)
        if self.crow_indices is None:
            return {"data": values_R_K.ravel().tolist(), "dtype": "float32", "shape": shape}
        if self.col_indices is None:
            raise ValueError("a sparse request keeps its column indices with its row pointers")
        crow = np.asarray(self.crow_indices, dtype=np.int64)
        rows_of_values = np.repeat(np.arange(shape[0]), np.diff(crow))
        listed = values_R_K[rows_of_values, np.asarray(self.col_indices, dtype=np.int64)]
        return {
            "data": listed.tolist(),
            "dtype": "float32",
            "shape": shape,
            "sparse_crow_indices": list(self.crow_indices),
            "sparse_col_indices": list(self.col_indices),
        }


def dense_tensor(array: np.ndarray) -> dict[str, Any]:
    """A dense wire TensorData of an int64 or float32 array."""
    dtype = "int64" if array.dtype.kind in "iu" else "float32"
    return {"data": array.astype(dtype).ravel().tolist(), "dtype": dtype, "shape": list(array.shape)}


def check_prompt_cells(name: str, prompt_length: int, width: int, max_cells: int) -> None:
    """len(prompt) x width must stay within what the largest top-k request costs."""
    if prompt_length * width > max_cells:
        raise InvalidRequest(
            f"{name}: len(prompt) ({prompt_length}) x {width} is {prompt_length * width} cells, above this server's "
            f"bound of {max_cells} (the cost of the widest top-k it serves); ask for fewer"
        )
