"""Blocks: a sharded model's device blocks as boxes of the checkpoint tensors an export writes.

Each distinct device block of a leaf (of one layer or expert of it) is, through the
leaf's transform chain, one box of its output tensor (`blocks`); `block_data` turns the
block back into that box, so the process holding a block writes it at its offset,
without the rest of the tensor. Where a block is not one box (a reshape that cuts a
dimension the block divides), the tensor is assembled whole on the host (`gather`).

```python
found = blocks(inverse, leaves(model))          # None: assemble with `gather` instead
gather(model.blocks.attn.wq, (3,))              # layer 3, from every device's block
```
"""

from __future__ import annotations

import math
from collections.abc import Mapping as AnyMapping
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np

from .._errors import PortError
from ._invert import Inverse, Part


def gather(array: jax.Array, index: tuple[int, ...] = ()) -> np.ndarray:
    """The whole of `array` (or of its entry `index` along the leading dimensions) on the host,
    each distinct block copied once.

    ```python
    gather(model.blocks.attn.wq, (3,))    # numpy, (embd, heads, head_dim): layer 3, from every device's block
    ```
    """
    k = len(index)
    out = np.empty(array.shape[k:], array.dtype)
    filled = 0
    for bounds, block in local_shards(array).items():
        outer, bounds = bounds[:k], bounds[k:]
        if not all(a <= i < b for i, (a, b) in zip(index, outer)):
            continue
        part = np.asarray(block[tuple(i - a for i, (a, _) in zip(index, outer))])
        out[tuple(slice(a, b) for a, b in bounds)] = part
        filled += part.size
    if filled != out.size:  # blocks on another process's devices: only `blocks` writes those
        raise PortError("port export: part of an array lives on another process's devices")
    return out


@dataclass(frozen=True)
class Block:
    """One distinct block of a leaf (of one layer or expert of it), as one box of an output tensor."""

    key: str
    part: Part
    bounds: tuple[tuple[int, int], ...]  # the block in the whole leaf array (every dimension)
    regions: tuple[tuple[tuple[int, int], ...], ...]  # the box at each stage of the chain, source first
    owner: int  # the process that writes it: the first holding it


def extent(region: tuple[tuple[int, int], ...]) -> int:
    return math.prod(b - a for a, b in region)


def blocks(inverse: Inverse, arrays: AnyMapping[str, Any]) -> list[Block] | None:
    """Every distinct device block of every part, as the box of its output tensor it fills, in tensor order.

    None when some block is not exactly one box of its tensor (a reshape that cuts a
    dimension the block divides): such tensors are assembled whole (`gather`) instead.
    """
    distinct: dict[str, dict[tuple, list]] = {}
    found = []
    for tensor in inverse.tensors:
        for part in inverse.parts[tensor.key]:
            leaf, array = part.leaf, arrays[part.leaf.path]
            if leaf.path not in distinct:
                held: dict[tuple, list] = {}
                for device, index in array.sharding.devices_indices_map(array.shape).items():
                    bounds = tuple(sl.indices(n)[:2] for sl, n in zip(index, array.shape))
                    held.setdefault(bounds, []).append(device)
                distinct[leaf.path] = held
            k = len(part.index)
            for bounds, devices in distinct[leaf.path].items():
                if not all(a <= i < b for i, (a, b) in zip(part.index, bounds)):
                    continue
                box = bounds[k:]
                regions = tuple(leaf.chain.regions(box))
                if extent(regions[0]) != extent(box):
                    return None
                owner = min(d.process_index for d in devices)
                found.append(Block(tensor.key, part, bounds, regions, owner))
    return found


def block_data(block: Block, shards: AnyMapping[Any, Any], source_dtype: np.dtype) -> np.ndarray:
    """The block's data turned back into its box of the source tensor (still in the chain's source dtype)."""
    leaf = block.part.leaf
    data = shards[block.bounds]
    data = np.asarray(data[tuple(i - a for i, (a, _) in zip(block.part.index, block.bounds))])
    dtypes = leaf.chain.dtypes(source_dtype)
    for i in reversed(range(len(leaf.chain.transforms))):
        step = leaf.chain.transforms[i]
        if not step.fused:  # a part's block is already its own box of the fused tensor
            data = step.inverse(data, tuple(b - a for a, b in block.regions[i]), dtypes[i])
    return data


def local_shards(array: jax.Array) -> dict[tuple, Any]:
    """This process's blocks of `array` by their bounds (one device's, for a replicated block).

    On the host CPU a block is viewed as NumPy without a copy (a layer of it is then a
    slice, not a compiled JAX op); on an accelerator it stays there until its layer is
    taken, so only that layer is copied to the host.
    """
    found = {}
    for shard in array.addressable_shards:
        bounds = tuple(sl.indices(n)[:2] for sl, n in zip(shard.index, array.shape))
        if bounds not in found:
            found[bounds] = np.asarray(shard.data) if shard.device.platform == "cpu" else shard.data
    return found
