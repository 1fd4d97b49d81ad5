"""Running a family's stacked blocks over prepared tokens: masks per layer, the cache, remat.

Every decoder family calls `run_layers` between its embedding and its head; each block
takes `block(x, mask, cos=, sin=, kv=, index=, layer=)` and returns `(x, kv)`.

```python
tokens = prepare(input_ids, attention_mask=mask, cache=cache, window=config.sliding_window)
x = embed[tokens.ids]
cos, sin = config.rope.angles(tokens.positions, x.dtype)
x, kv = run_layers(blocks, x, tokens, cos=cos, sin=sin, sliding=config.sliding_layers, remat=remat)
return tokens.output(head(x), *kv)
```
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float

from port.nn._scan import scan
from port.nn._tokens import Tokens


def run_layers(
    blocks: Any,
    x: Float[Array, "batch seq embd"],
    tokens: Tokens,
    *,
    cos: Array | None = None,
    sin: Array | None = None,
    sliding: Sequence[bool] | None = None,
    sliding_rope: tuple[Array, Array] | None = None,
    remat: bool | str | Callable[..., bool] | None = None,
) -> tuple[Float[Array, "batch seq embd"], tuple[Array | None, Array | None]]:
    """Run stacked `blocks` over `x`.

    **Arguments:**

    - `blocks`: the stacked blocks (from `stacked`), arrays `[layers, ...]`; each is
      called `block(x, mask, cos=, sin=, kv=, index=, layer=)` and returns `(x, kv)`.
    - `x`: the embedded tokens, `[batch, seq, embd]`.
    - `tokens`: from `prepare` (its masks and cache).
    - `cos`, `sin`: the rotary angles (None: no RoPE).
    - `sliding`: per layer, whether it is a local layer: it uses `tokens.sliding` (the
      window, when `prepare` was given one) rather than `tokens.mask`...
    - `sliding_rope`: ...and these `(cos, sin)` rather than `cos`, `sin` (a per-layer RoPE
      base, as Gemma 3's local layers have); None: every layer rotates alike.
    - `remat`: as in `scan`.

    **Returns:** `(x, (keys, values))`: the last block's output `[batch, seq, embd]` and,
    with a cache, every layer's updated keys and values, `[layers, batch, length,
    kv_heads, head_dim]` each (else `(None, None)`), for `tokens.output`.

    ```python
    tokens = prepare(input_ids, attention_mask=mask, window=config.sliding_window)
    cos, sin = config.rope.angles(tokens.positions, jnp.float32)
    x, kv = run_layers(blocks, embed[tokens.ids], tokens, cos=cos, sin=sin,
                       sliding=config.sliding_layers, remat="full")
    ```
    """
    layers = jnp.arange(jnp.shape(_first_leaf(blocks))[0])
    flags = jnp.asarray(sliding, bool) if sliding else jnp.zeros(layers.shape, bool)
    kv = None if tokens.cache is None else (tokens.cache.keys, tokens.cache.values)
    index = tokens.index

    def layer(block: Any, x: Array, i: Array, slides: Array, kv: Any) -> tuple[Array, Any]:
        mask = tokens.mask if tokens.sliding is None else jnp.where(slides, tokens.sliding, tokens.mask)
        c, s = cos, sin
        if sliding_rope is not None:
            c, s = (jnp.where(slides, local, default) for local, default in zip(sliding_rope, (cos, sin)))
        return block(x, mask, cos=c, sin=s, kv=kv, index=index, layer=i)

    x, kv = scan(layer, x, blocks, layers, flags, kv, remat=remat)
    return x, (None, None) if kv is None else kv


def _first_leaf(tree: Any) -> Array:
    return jax.tree.leaves(eqx.filter(tree, eqx.is_array))[0]
