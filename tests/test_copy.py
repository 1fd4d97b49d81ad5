"""Tiled copies between layouts (`port._copy`): the same values as NumPy's own copy, in any shape."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from port._copy import TILE, contiguous, copy


@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16])
@pytest.mark.parametrize("shape", [(TILE * 2 + 3, TILE + 17), (3, TILE + 5, TILE * 2 - 1), (TILE + 1, TILE * 3)])
def test_a_transposed_copy_in_tiles_equals_numpys(shape, dtype):
    rng = np.random.default_rng(0)
    source = rng.standard_normal(shape[:-2] + shape[:-3:-1]).astype(np.float32)
    view = np.swapaxes(source, -1, -2)  # the last axis strided: copied in tiles
    target = np.empty(view.shape, dtype)
    copy(target, view)
    expected = np.empty(view.shape, dtype)
    np.copyto(expected, view, casting="unsafe")
    assert target.tobytes() == expected.tobytes()
    assert contiguous(view).tobytes() == np.ascontiguousarray(view).tobytes()


def test_a_copy_in_order_and_a_contiguous_array_are_left_to_numpy():
    source = np.arange(TILE * TILE * 2, dtype=np.float32).reshape(TILE * 2, TILE)
    assert contiguous(source) is source
    target = np.empty((TILE * 2, TILE), np.float16)
    copy(target, source)  # a cast in order
    assert np.array_equal(target, source.astype(np.float16))
