"""Zarr: how an output stores each array, as Orbax stores one without OCDBT (zarr format 2).

An array is a directory of chunk files beside its `.zarray` (JSON: shape, chunk shape,
dtype; no compressor, no filters, C order). Chunk `(i, j)` is the file `i.j` (a
scalar's is `0`): the bytes of the array's box `[i*ci : (i+1)*ci, j*cj : (j+1)*cj]`,
row-major, every chunk full size (an edge chunk padded past the array's end). Port
chunks an array by the blocks of the mesh it was saved from, so each device's block
is one file, written from the device's own buffer and read back straight into one;
on another mesh each block reads the pieces of the chunks it overlaps.

A chunk file is a row-major region of a file, like a tensor in a safetensors file, so
`restore` reads it with the same positioned reads (`Checkpoint.read_into`).

```python
zarray((50257, 768), (50257, 192), np.dtype("float32"))["chunks"]   # [50257, 192]
list(grid((8, 6), (4, 3)))                  # [(0, 0), (0, 1), (1, 0), (1, 1)]
chunk_name((1, 0))                          # '1.0'
```
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator
from typing import Any

import numpy as np

from ._dtypes import NAMES

ZARRAY = ".zarray"


def zarr_dtype(dtype: np.dtype) -> str:
    """The `.zarray` name of `dtype`: NumPy's type string (`<f4`), or the name of an ml_dtypes type (`bfloat16`)."""
    dtype = np.dtype(dtype)
    return dtype.str if dtype.type.__module__ == "numpy" else dtype.name


ZARR_DTYPES: dict[str, np.dtype] = {zarr_dtype(d): d for d in NAMES.values()}
"""The dtypes an output may hold, by their `.zarray` names."""


def zarray(shape: tuple[int, ...], chunks: tuple[int, ...], dtype: np.dtype) -> dict[str, Any]:
    """The `.zarray` of an array of `shape` stored in `chunks`, uncompressed, as Orbax writes one."""
    return {
        "chunks": list(chunks),
        "compressor": None,
        "dimension_separator": ".",
        "dtype": zarr_dtype(dtype),
        "fill_value": None,
        "filters": None,
        "order": "C",
        "shape": list(shape),
        "zarr_format": 2,
    }


def chunk_shape(shape: tuple[int, ...], block: tuple[int, ...]) -> tuple[int, ...]:
    """The chunk shape for blocks of shape `block`: the block, at least 1 along each axis (zarr's minimum)."""
    return tuple(max(1, n) for n in block) if shape else ()


def grid_shape(shape: tuple[int, ...], chunks: tuple[int, ...]) -> tuple[int, ...]:
    """How many chunks along each axis (none along an empty axis)."""
    return tuple(-(-n // c) for n, c in zip(shape, chunks))


def grid(shape: tuple[int, ...], chunks: tuple[int, ...]) -> Iterator[tuple[int, ...]]:
    """Every chunk's index, in C order (a scalar has the one chunk `()`)."""
    return itertools.product(*(range(n) for n in grid_shape(shape, chunks)))


def chunk_count(shape: tuple[int, ...], chunks: tuple[int, ...]) -> int:
    return math.prod(grid_shape(shape, chunks))


def chunk_name(index: tuple[int, ...]) -> str:
    """The file name of the chunk at `index`: `"1.0"`; a scalar's chunk is `"0"`."""
    return ".".join(map(str, index)) if index else "0"


def overlapping(
    box: tuple[tuple[int, int], ...], chunks: tuple[int, ...]
) -> Iterator[tuple[tuple[int, ...], tuple[tuple[int, int], ...], tuple[tuple[int, int], ...]]]:
    """The chunks a (non-empty) `box` of the array overlaps: (chunk index, the overlap in the
    chunk's coordinates, the overlap in the box's coordinates)."""
    ranges = [range(a // c, -(-b // c)) for (a, b), c in zip(box, chunks)]
    for index in itertools.product(*ranges):
        inside, within = [], []
        for i, (a, b), c in zip(index, box, chunks):
            lo, hi = max(a, i * c), min(b, (i + 1) * c)
            inside.append((lo - i * c, hi - i * c))
            within.append((lo - a, hi - a))
        yield index, tuple(inside), tuple(within)
