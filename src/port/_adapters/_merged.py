"""`MergedCheckpoint`: a base checkpoint read as if a LoRA adapter had been merged into it.

Composed around the opened base and an opened `Adapter`: the same config, the same
tensors (keys, shapes, dtypes), so plan, place, sharding and the output see the base's
checkpoint. Reading a region of an adapted weight reads that region of the base, plus
only the rows of `lora_B` and the columns of `lora_A` the region covers, and writes
`base + scale * B[rows] @ A[:, cols]` into the caller's buffer, summed in float32 and
rounded once to the tensor's dtype (`[in, out]` weights, GPT-2's `Conv1D`, and
embeddings take the product transposed). A `modules_to_save` weight reads the adapter's
replacement instead. DoRA rescales each output's merged row by `magnitude / norm`: the
norm needs the whole row, so a block holding part of a row reads the base's whole rows
(and the whole of `lora_A`). `bytes_read` counts the base's bytes and the adapter's.

```python
with open_checkpoint("tiny-llama") as base:
    ckpt = MergedCheckpoint(base, open_adapter("tiny-llama-lora", base))
    ckpt.read("model.layers.0.self_attn.q_proj.weight", ((0, 8), (0, 16)))   # merged rows 0..7
```
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from typing import final

import numpy as np

from .._dtypes import floating
from .._sources import Checkpoint, Region
from .._sources._checkpoint import check_buffer
from ._peft import Adapter, Target

_TRANSPOSED = ("conv1d", "embedding")
"""Target kinds whose base weight holds inputs first (`[in, out]`, `[vocab, dim]`)."""


@final
class MergedCheckpoint(Checkpoint):
    """`base` with `adapter` merged into its weights as they are read (see the module)."""

    def __init__(self, base: Checkpoint, adapter: Adapter) -> None:
        self.base = base
        self.adapter = adapter
        self.directory = base.directory
        self.config = base.config
        self.tensors = base.tensors

    @property
    def bytes_read(self) -> int:  # pyright: ignore[reportIncompatibleVariableOverride]  # both checkpoints' counts
        return self.base.bytes_read + self.adapter.checkpoint.bytes_read

    @property
    def bytes_over_read(self) -> int:  # pyright: ignore[reportIncompatibleVariableOverride]  # both checkpoints' counts
        return self.base.bytes_over_read + self.adapter.checkpoint.bytes_over_read

    def expect(self, reads: Mapping[str, Collection[Region]]) -> None:
        """Tell the base and the adapter the regions each will be asked for."""
        base: dict[str, set[Region]] = {}
        adapter: dict[str, set[Region]] = {}
        for key, regions in reads.items():
            if key in self.adapter.saved:
                adapter.setdefault(self.adapter.saved[key], set()).update(regions)
                continue
            target = self.adapter.targets.get(key)
            for region in regions:
                if target is None:
                    base.setdefault(key, set()).add(region)
                    continue
                outs, ins = _oriented(target, region)
                if target.magnitude is not None:  # DoRA: whole rows, for the norm
                    shape = self.tensors[key].shape
                    region, ins = _whole_rows(target, shape, outs), (0, _inputs(target, shape))
                    adapter.setdefault(target.magnitude, set()).add((outs,))
                base.setdefault(key, set()).add(region)
                for factor, part in _factor_regions(target, outs, ins):
                    adapter.setdefault(factor, set()).add(part)
        self.base.expect(base)
        self.adapter.checkpoint.expect(adapter)

    def read_into(self, key: str, requests: Sequence[tuple[Region, np.ndarray]]) -> None:
        """Read regions of tensor `key` (see `Checkpoint.read_into`): an adapted weight's merged,
        a replaced one's from the adapter, any other the base's. The base checks the buffers (a
        quantized base's may be of a narrower floating dtype: the sum is rounded once to it)."""
        if key in self.adapter.saved:
            self._replaced(self.adapter.saved[key], requests)
            return
        target = self.adapter.targets.get(key)
        if target is None:
            self.base.read_into(key, requests)
            return
        if target.magnitude is not None:
            for region, out in requests:
                check_buffer(self.tensors[key], region, out, (out.dtype,) if floating(out.dtype) else ())
                self._dora(target, region, out)
            return
        self.base.read_into(key, requests)
        for region, out in requests:
            if out.size:
                merged = self._delta(target, *_oriented(target, region))
                merged += out  # in float32, the block's one temporary; rounded once into `out`
                out[...] = merged

    def _replaced(self, key: str, requests: Sequence[tuple[Region, np.ndarray]]) -> None:
        """Regions of the adapter's replacement tensor `key`, rounded once to the buffers' dtype if it differs."""
        info = self.adapter.checkpoint.tensors[key]
        for region, out in requests:
            check_buffer(info, region, out, (out.dtype,) if floating(out.dtype) else ())
            if out.dtype == info.dtype:
                self.adapter.checkpoint.read_into(key, [(region, out)])
            else:
                out[...] = self.adapter.checkpoint.read(key, region).astype(out.dtype)

    def _delta(self, target: Target, outs: tuple[int, int], ins: tuple[int, int]) -> np.ndarray:
        """`scale * B[outs] @ A[:, ins]` in float32, in the base weight's layout (transposed for `[in, out]`)."""
        (_, b_region), (_, a_region) = _factor_regions(target, outs, ins)
        b = self.adapter.checkpoint.read(target.b, b_region).astype(np.float32)
        a = self.adapter.checkpoint.read(target.a, a_region).astype(np.float32)
        delta = _product(b, a, outs[0], ins[0])
        delta *= np.float32(target.scale)
        return delta.T if target.kind in _TRANSPOSED else delta

    def _dora(self, target: Target, region: Region, out: np.ndarray) -> None:
        """A DoRA weight's region: the whole merged rows of its outputs, each rescaled by
        `magnitude / norm` (PEFT's merge), then the region's columns."""
        shape = self.tensors[target.weight].shape
        outs, ins = _oriented(target, region)
        if not out.size:
            return
        rows = self.base.read(target.weight, _whole_rows(target, shape, outs)).astype(np.float32)
        delta = self._delta(target, outs, (0, _inputs(target, shape)))
        merged = rows + delta
        oriented = merged.T if target.kind in _TRANSPOSED else merged
        assert target.magnitude is not None
        magnitude = self.adapter.checkpoint.read(target.magnitude, (outs,)).astype(np.float32)
        oriented = oriented * (magnitude / np.linalg.norm(oriented, axis=1))[:, None]
        block = oriented[:, ins[0] : ins[1]]
        out[...] = (block.T if target.kind in _TRANSPOSED else block).astype(out.dtype)

    def close(self) -> None:
        """Close the base and the adapter."""
        try:
            self.adapter.checkpoint.close()
        finally:
            self.base.close()


SMALL_PRODUCT = 262_143
"""Multiply-adds (rows x columns x rank) of one product below which OpenBLAS computes it on the calling
thread (its `GEMM_MULTITHREAD_THRESHOLD` of 4 x 65536): larger ones start its own threads, which in each
of port's reading threads oversubscribe the cores (9x slower measured on 2 cores, docs/benchmarks.md)."""


def _tile(rank: int) -> tuple[int, int]:
    """The (rows, columns) of `_product`'s tiles for factors of `rank`: powers of two whose product
    with the rank stays under `SMALL_PRODUCT`, so that block edges (halves, quarters) fall on them."""
    width = 1 << max(0, (SMALL_PRODUCT // (rank * 8)).bit_length() - 1)
    height = 1 << max(0, (SMALL_PRODUCT // (width * rank)).bit_length() - 1)
    return height, width


def _product(b: np.ndarray, a: np.ndarray, row: int = 0, column: int = 0) -> np.ndarray:
    """`b @ a` (float32 `[out, rank] @ [rank, in]`, the rows from `row` and the columns from `column`
    of the whole product) in tiles small enough to stay on this thread.

    The tiles lie on one grid of the whole product, every one computed at its full size (the factors'
    rows and columns beyond the block are zeros): BLAS computes an element alike in every tile of one
    shape, but not in tiles of other shapes (OpenBLAS's edge kernels), so a block's elements are then
    bit for bit those of the whole weight, however the weight is cut.

    ```python
    _product(b[16:48], a[:, 8:24], 16, 8)   # equal to (b @ a)[16:48, 8:24], bit for bit
    ```
    """
    rows, rank = b.shape
    columns = a.shape[1]
    out = np.empty((rows, columns), np.float32)
    height, width = _tile(rank)
    tile_b = np.zeros((height, rank), np.float32)
    tile_a = np.zeros((rank, width), np.float32)
    product = np.empty((height, width), np.float32)
    for c in range(column - column % width, column + columns, width):
        lo, hi = max(c, column), min(c + width, column + columns)  # this tile's columns in the block
        tile_a[:] = 0
        tile_a[:, lo - c : hi - c] = a[:, lo - column : hi - column]
        whole = lo == c and hi == c + width
        for r in range(row - row % height, row + rows, height):
            top, bottom = max(r, row), min(r + height, row + rows)
            if whole and top == r and bottom == r + height:  # a tile inside the block: straight into it
                np.matmul(
                    b[top - row : bottom - row], tile_a, out=out[top - row : bottom - row, lo - column : hi - column]
                )
                continue
            tile_b[:] = 0
            tile_b[top - r : bottom - r] = b[top - row : bottom - row]
            np.matmul(tile_b, tile_a, out=product)
            out[top - row : bottom - row, lo - column : hi - column] = product[top - r : bottom - r, lo - c : hi - c]
    return out


def _oriented(target: Target, region: Region) -> tuple[tuple[int, int], tuple[int, int]]:
    """A region of `target`'s base weight as (outputs, inputs) ranges."""
    first, second = region
    return (second, first) if target.kind in _TRANSPOSED else (first, second)


def _whole_rows(target: Target, shape: tuple[int, ...], outs: tuple[int, int]) -> Region:
    """The region of the base weight holding outputs `outs` whole (every input)."""
    return ((0, shape[0]), outs) if target.kind in _TRANSPOSED else (outs, (0, shape[1]))


def _inputs(target: Target, shape: tuple[int, ...]) -> int:
    """How many inputs `target`'s base weight of `shape` has."""
    return shape[0] if target.kind in _TRANSPOSED else shape[1]


def _factor_regions(target: Target, outs: tuple[int, int], ins: tuple[int, int]) -> list[tuple[str, Region]]:
    """The regions of `lora_B` (rows `outs`) and `lora_A` (columns `ins`) a block needs."""
    rank = (0, target.rank)
    return [(target.b, (outs, rank)), (target.a, (rank, ins))]
