"""Runs: where the bytes of a region of a tensor lie in its file, and where they land in a buffer.

A tensor is stored row-major from `TensorInfo.offset` on. A region of it is a set of
runs, each a stretch of bytes lying end to end both in the file and in the buffer it
is read into: one per index of the axes before those the region covers whole (`runs`).
A region of very many runs is cut into pieces (`pieces`), and the runs of a read's
regions handled in batches of about `MAX_RUNS` (`batches`), so the bookkeeping stays
bounded; each source reads a batch its own way (positioned reads, byte ranges).

```python
runs(info, ((0, 2), (1, 3)), out)   # a (2, 3) float32 tensor: offsets [o+4, o+16], lengths [8, 8]
```
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterator, Sequence

import numpy as np

from ._checkpoint import Region, TensorInfo

MAX_RUNS = 1 << 22
"""Runs (contiguous pieces) handled in one batch: bounds the bookkeeping."""


def _run_axis(shape: tuple[int, ...], region: Region) -> int:
    """The axis a run of `region` ranges over: the innermost one it does not cover whole
    (the axes after it are whole, so one run spans them); -1 for the whole tensor."""
    return next((i for i in range(len(region) - 1, -1, -1) if region[i] != (0, shape[i])), -1)


def _contiguous_from(out: np.ndarray) -> int:
    """The outermost axis from which `out`'s elements lie end to end (0 for a C-contiguous
    array; its number of axes when not even the innermost one is contiguous)."""
    if out.flags.c_contiguous:
        return 0
    axis, expected = out.ndim, out.itemsize
    for i in range(out.ndim - 1, -1, -1):
        if out.shape[i] != 1 and out.strides[i] != expected:
            break
        expected *= out.shape[i]
        axis = i
    return axis


def _runs_axis(info: TensorInfo, region: Region, out: np.ndarray) -> int:
    """The outermost axis a run spans: from it in, the region lies end to end both in the
    file and in `out`. There is one run per index of the axes before it."""
    return max(_run_axis(info.shape, region), 0, _contiguous_from(out))


def pieces(info: TensorInfo, region: Region, out: np.ndarray) -> Iterator[tuple[Region, np.ndarray]]:
    """`(region, out)` cut along its first axis into pieces of at most about `MAX_RUNS` runs.

    ```python
    list(pieces(info, ((0, 8), (0, 768)), out))   # [(((0, 8), (0, 768)), out)]: 8 runs, one piece
    ```
    """
    count = math.prod(b - a for a, b in region[: _runs_axis(info, region, out)])
    if count <= MAX_RUNS:
        yield region, out
        return
    (a, b), rest = region[0], region[1:]
    step = max(1, (b - a) * MAX_RUNS // count)
    for start in range(a, b, step):
        stop = min(b, start + step)
        yield ((start, stop), *rest), out[start - a : stop - a]


def _run_layout(shape: tuple[int, ...], itemsize: int, region: Region, axis: int) -> tuple[np.ndarray, int]:
    """Where the runs spanning `axis` on (see `_runs_axis`) start, relative to the tensor's
    first byte, and their length."""
    strides = [math.prod(shape[i + 1 :]) * itemsize for i in range(len(shape))]
    if axis < len(shape):
        a, b = region[axis]
        length, starts = (b - a) * strides[axis], np.array([a * strides[axis]], np.int64)
    else:  # single elements (a scalar, or a destination whose innermost axis is strided)
        length, starts = itemsize, np.zeros(1, np.int64)
    for (lo, hi), stride in zip(region[:axis], strides[:axis]):
        starts = (starts[:, None] + np.arange(lo, hi, dtype=np.int64)[None, :] * stride).reshape(-1)
    starts.setflags(write=False)
    return starts, length


_cached_run_layout = functools.lru_cache(maxsize=128)(_run_layout)
"""The same, remembered for regions of up to `_CACHED_RUNS` runs: the blocks of a stacked
leaf ask it once per layer (at most 128 x 128 KB kept)."""
_CACHED_RUNS = 1 << 14


def _addresses(out: np.ndarray, axis: int, count: int, length: int) -> np.ndarray:
    """Where each run lands in `out`: one per index of the axes before `axis`, in C order."""
    if out.flags.c_contiguous:
        return np.uint64(out.ctypes.data) + np.arange(count, dtype=np.uint64) * np.uint64(length)
    addresses = np.array([out.ctypes.data], np.uint64)
    for n, stride in zip(out.shape[:axis], out.strides[:axis]):
        addresses = (addresses[:, None] + np.arange(n, dtype=np.uint64)[None, :] * np.uint64(stride)).reshape(-1)
    return addresses


def runs(info: TensorInfo, region: Region, out: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The contiguous pieces of `region` in the file: (file offsets, lengths, addresses in `out`).

    A run spans the axes from `_runs_axis` on whole; there is one run per index of the
    axes before it, in C order. `out` may be a strided view (a block's part of a larger
    array): a run then also ends where `out`'s memory stops being contiguous.

    ```python
    runs(info, ((0, 2), (1, 3)), out)   # a (2, 3) float32 tensor: offsets [o+4, o+16], lengths [8, 8]
    ```
    """
    if out.size == 0:
        empty = np.zeros(0, np.int64)
        return empty, empty, empty.astype(np.uint64)
    region = tuple((a, b) for a, b in region)
    axis = _runs_axis(info, region, out)
    count = math.prod(b - a for a, b in region[:axis])
    layout = _cached_run_layout if count <= _CACHED_RUNS else _run_layout
    starts, length = layout(info.shape, info.dtype.itemsize, region, axis)
    return starts + info.offset, np.full(len(starts), length, np.int64), _addresses(out, axis, len(starts), length)


def batches(info: TensorInfo, requests: Sequence[tuple[Region, np.ndarray]]) -> Iterator[tuple[np.ndarray, ...]]:
    """The runs of all `requests` as (offsets, lengths, addresses), at most about `MAX_RUNS` at a time.

    ```python
    for offsets, lengths, addresses in batches(info, [(region, out)]):
        ...   # read each run's bytes from its offset into its address
    ```
    """
    batch: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
    count = 0
    for region, out in requests:
        for piece_region, piece_out in pieces(info, region, out):
            found = runs(info, piece_region, piece_out)
            if count and count + len(found[0]) > MAX_RUNS:
                yield tuple(np.concatenate(parts) for parts in zip(*batch))
                batch, count = [], 0
            batch.append(found)
            count += len(found[0])
    if count:
        yield tuple(np.concatenate(parts) for parts in zip(*batch))
