"""Running stacked layers: one compiled layer, whatever the depth, with optional rematerialisation.

```python
def layer(block, x, sliding, kv):
    return block(x, ...)                        # -> (x, per-layer output or None)

x, kvs = scan(layer, x, model.blocks, sliding_flags, cache_kvs, remat="full")
```
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

import equinox as eqx
import jax

from port.nn._lora import merged

REMAT = {
    "full": None,  # jax.checkpoint's default: save nothing, recompute the layer
    "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
    "nothing": jax.checkpoint_policies.nothing_saveable,
    "everything": jax.checkpoint_policies.everything_saveable,
}
"""Named rematerialisation policies for `scan`'s `remat`: what the backward pass keeps."""


def scan(
    layer: Callable[..., tuple[Any, Any]],
    carry: Any,
    blocks: Any,
    *per_layer: Any,
    remat: Any = None,  # bool, a policy's name, a policy or None: checked here, one line naming it
) -> tuple[Any, Any]:
    """Run `layer(block_i, carry, *per_layer_i) -> (carry, out_i)` over stacked `blocks`.

    **Arguments:**

    - `layer`: one layer's step.
    - `carry`: the hidden state passed from layer to layer.
    - `blocks`: a module whose arrays have a leading `[layers]` axis. Its adapters
      (`LoRA`) are merged layer by layer: `layer` gets plain weights.
    - `per_layer`: pytrees with the same leading axis (per-layer flags, cache slices),
      or None.
    - `remat`: None or False (keep every activation for the backward pass), True or
      "full" (recompute each layer in the backward pass: memory of one layer's
      activations), "dots" (keep matmul outputs without batch dimensions), "nothing"
      (`nothing_saveable`, as "full"), "everything" (`everything_saveable`), or a
      `jax.checkpoint` policy. It changes memory and time, never values; another
      string raises `ValueError`, another type `TypeError`.

    **Returns:** `(carry, outs)`: the last layer's carry and the `out_i` stacked over
    layers (None where every `out_i` is None).

    ```python
    x, _ = scan(lambda block, x: (block(x, mask), None), x, blocks, remat="full")

    def layer(block, x, kv):                      # kv: this layer's slice of the cache
        return block(x, mask, kv=kv, index=index)  # -> (x, kv)

    x, (keys, values) = scan(layer, x, blocks, (cache.keys, cache.values))   # [layers, ...] each
    ```
    """
    params, static = eqx.partition(blocks, eqx.is_array)

    def step(carry: Any, xs: tuple[Any, ...]) -> tuple[Any, Any]:
        block_params, *rest = xs
        return layer(merged(eqx.combine(block_params, static)), carry, *rest)

    return jax.lax.scan(checkpointed(step, remat), carry, (params, *per_layer))


def checkpointed(step: Callable[..., Any], remat: Any) -> Callable[..., Any]:
    """`step` under `jax.checkpoint` as `remat` asks (see `scan`); `step` itself for None or False."""
    if remat is None or remat is False:
        return step
    if remat is True:
        policy = None
    elif isinstance(remat, str):
        if remat not in REMAT:
            raise ValueError(f"`remat` {remat!r} is not one of {', '.join(map(repr, REMAT))}, True or a policy")
        policy = REMAT[remat]
    elif callable(remat):
        policy = cast(Callable[..., bool], remat)  # a jax.checkpoint policy: says whether to save a value
    else:
        raise TypeError(f"`remat` must be a bool, a policy name or a jax.checkpoint policy, got {remat!r}")
    return jax.checkpoint(step, policy=policy)
