"""Place: each leaf becomes a `jax.Array` under its final `NamedSharding`.

`jax.make_array_from_callback` asks for one block per addressable device; the
callback reads only the source region that block needs and transforms only that.
Devices holding the same block (replicated axes) share one read. In a
multi-process run JAX asks each process only for its own devices' blocks.

```python
arrays = place(p, ckpt, mesh)          # {"wte": jax.Array, ...}
arrays["wte"].sharding                  # NamedSharding(mesh, P(None, 'data'))
```
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding

from ._plan import LeafPlan, Plan
from ._source import Checkpoint, Region


def read_block(leaf: LeafPlan, checkpoint: Checkpoint, box: Region) -> np.ndarray:
    """The target block `box` of `leaf`, from only the source bytes it needs."""
    region, keys = leaf.source_region(box)
    inner = box[1:] if leaf.stacked else box
    regions = leaf.chain.regions(inner)
    if not leaf.stacked:
        return np.ascontiguousarray(leaf.chain.apply(checkpoint.read(keys[0], region), regions))
    out = np.empty(tuple(b - a for a, b in box), leaf.dtype)
    for i, key in enumerate(keys):
        out[i] = leaf.chain.apply(checkpoint.read(key, region), regions)
    return out


def place_leaf(leaf: LeafPlan, checkpoint: Checkpoint, mesh: Mesh) -> jax.Array:
    """One leaf as a sharded `jax.Array`, each distinct block read once."""
    blocks: dict[Region, np.ndarray] = {}

    def callback(index: tuple[slice, ...]) -> np.ndarray:
        box = tuple(s.indices(n)[:2] for s, n in zip(index, leaf.shape))
        if box not in blocks:
            blocks[box] = read_block(leaf, checkpoint, box)
        return blocks[box]

    return jax.make_array_from_callback(leaf.shape, NamedSharding(mesh, leaf.spec), callback)


def place(
    plan: Plan,
    checkpoint: Checkpoint,
    mesh: Mesh,
    progress: Callable[[LeafPlan], None] | None = None,
) -> dict[str, jax.Array | None]:
    """Every leaf of `plan`, one at a time; `progress` is called after each.

    Optional leaves the checkpoint lacks (`plan.empty`) are None.
    """
    arrays: dict[str, jax.Array | None] = dict.fromkeys(plan.empty)
    for leaf in plan.leaves:
        arrays[leaf.path] = place_leaf(leaf, checkpoint, mesh)
        if progress is not None:
            progress(leaf)
    return arrays
