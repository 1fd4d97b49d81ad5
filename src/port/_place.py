"""Place: each leaf becomes a `jax.Array` under its final `NamedSharding`.

Every distinct block a process's devices hold is built once, on a small thread
pool: a view of the source region straight from the memory-mapped checkpoint,
the transform chain's views over it, and one copy (casting on the way) into a
64-byte-aligned buffer. On CPU, JAX adopts such a buffer as the device buffer
without copying it, so each byte is read and written once; a device that shares
its block with another (a replicated axis) gets its own copy of the block, not a
second read. `jax.make_array_from_callback` asks each process only for its own
devices' blocks, so a process reads only what its devices hold.

```python
arrays = place(p, ckpt, mesh)          # {"wte": jax.Array, ...}
arrays["wte"].sharding                  # NamedSharding(mesh, P(None, 'data'))
```
"""

from __future__ import annotations

import os
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding

from ._plan import LeafPlan, Plan
from ._source import Checkpoint, Region

ALIGN = 64  # XLA's CPU client adopts host buffers aligned like this without a copy


def aligned_empty(shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    """An uninitialised array whose data starts on a 64-byte boundary."""
    dtype = np.dtype(dtype)
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    raw = np.empty(nbytes + ALIGN, np.uint8)
    start = -raw.ctypes.data % ALIGN
    return raw[start : start + nbytes].view(dtype).reshape(shape)


def read_block(leaf: LeafPlan, checkpoint: Checkpoint, box: Region) -> np.ndarray:
    """The target block `box` of `leaf`, from only the source bytes it needs, in one copy."""
    region, keys = leaf.source_region(box)
    inner = box[1:] if leaf.stacked else box
    regions = leaf.chain.regions(inner)
    out = aligned_empty(tuple(b - a for a, b in box), leaf.dtype)
    targets = out if leaf.stacked else out[None]
    for target, key in zip(targets, keys):
        np.copyto(target, leaf.chain.apply(checkpoint.view(key, region), regions), casting="unsafe")
    return out


def _box(index: tuple[slice, ...], shape: tuple[int, ...]) -> Region:
    """JAX's device index (slices, possibly open-ended) as a box."""
    return tuple(s.indices(n)[:2] for s, n in zip(index, shape))


def _boxes(leaf: LeafPlan, sharding: NamedSharding) -> list[Region]:
    """The distinct blocks of `leaf` this process's devices hold, in device order."""
    boxes = []
    for index in sharding.addressable_devices_indices_map(leaf.shape).values():
        box = _box(index, leaf.shape)
        if box not in boxes:
            boxes.append(box)
    return boxes


def _assemble(leaf: LeafPlan, sharding: NamedSharding, blocks: dict[Region, np.ndarray]) -> jax.Array:
    handed: set[Region] = set()

    def callback(index: tuple[slice, ...]) -> np.ndarray:
        box = _box(index, leaf.shape)
        if box not in handed:  # the first device adopts the block itself
            handed.add(box)
            return blocks[box]
        copy = aligned_empty(blocks[box].shape, blocks[box].dtype)
        np.copyto(copy, blocks[box])
        return copy

    return jax.make_array_from_callback(leaf.shape, sharding, callback)


def place(
    plan: Plan,
    checkpoint: Checkpoint,
    mesh: Mesh,
    progress: Callable[[LeafPlan], None] | None = None,
    workers: int | None = None,
) -> dict[str, jax.Array | None]:
    """Every leaf of `plan` as a sharded array; `progress` is called after each leaf.

    Blocks are read by `workers` threads (default: the CPU count, at most 8), at most
    two leaves ahead of the leaf being assembled. Optional leaves the checkpoint
    lacks (`plan.empty`) are None.
    """
    arrays: dict[str, jax.Array | None] = dict.fromkeys(plan.empty)
    shardings = [NamedSharding(mesh, leaf.spec) for leaf in plan.leaves]
    with ThreadPoolExecutor(workers or min(8, os.cpu_count() or 1)) as pool:
        pending: deque[dict[Region, Future]] = deque()

        def submit(i: int) -> None:
            leaf = plan.leaves[i]
            pending.append({box: pool.submit(read_block, leaf, checkpoint, box) for box in _boxes(leaf, shardings[i])})

        for i in range(min(2, len(plan.leaves))):
            submit(i)
        for i, leaf in enumerate(plan.leaves):
            if i + 2 < len(plan.leaves):
                submit(i + 2)
            blocks = {box: future.result() for box, future in pending.popleft().items()}
            arrays[leaf.path] = _assemble(leaf, shardings[i], blocks)
            del blocks
            if progress is not None:
                progress(leaf)
    return arrays
