"""Arrays in events and CSR expansion, against hand-built expectations."""

import numpy as np
import pytest

from openrl_core.errors import InvalidRequest
from openrl_core.tensors import Array, dense_from_csr


@pytest.mark.parametrize("array", [np.arange(6, dtype=np.int64).reshape(2, 3), np.array([0.5, -1.25], dtype=np.float32),
                                   np.zeros((0,), dtype=np.float32), np.array([7], dtype=np.int32)])  # fmt: skip
def test_array_round_trip_is_exact(array):
    back = Array.from_numpy(array).to_numpy()
    assert back.dtype == array.dtype and back.shape == array.shape
    assert np.array_equal(back, array)


def test_array_rejects_a_shape_that_does_not_fit_its_bytes():
    good = Array.from_numpy(np.arange(4, dtype=np.int64))
    with pytest.raises(InvalidRequest):
        Array(dtype="int64", shape=(5,), b64=good.b64).to_numpy()


def test_csr_expands_with_zero_padding():
    # [[0, 2, 0], [0, 0, 0], [5, 0, 7]]
    dense = dense_from_csr(np.array([2, 5, 7], dtype=np.float32), [0, 1, 1, 3], [1, 0, 2], [3, 3])
    assert np.array_equal(dense, np.array([[0, 2, 0], [0, 0, 0], [5, 0, 7]], dtype=np.float32))


@pytest.mark.parametrize(
    "values,crow,col,shape",
    [
        ([1.0], [0, 1], [3], [1, 3]),  # column out of range
        ([1.0], [0, 2], [0], [1, 3]),  # crow ends past the values
        ([1.0, 2.0], [0, 1], [0], [1, 3]),  # values and columns disagree
        ([1.0], [0, 1, 0], [0], [2, 3]),  # decreasing crow
        ([1.0], [0, 1], [0], [3]),  # not 2-D
    ],
)
def test_csr_rejects_malformed_indices(values, crow, col, shape):
    with pytest.raises(InvalidRequest):
        dense_from_csr(np.array(values, dtype=np.float32), crow, col, shape)
