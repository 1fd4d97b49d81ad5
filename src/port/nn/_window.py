"""A bidirectional local window: an encoder's local-attention layers see only the keys near each query.

`prepare(..., causal=False)` gives an encoder's mask (every unpadded key); `local_window`
adds the mask of its local layers as `Tokens.sliding`, the keys within `radius` slots of
the query on either side (ModernBERT: `|query - key| <= local_attention // 2`, as
transformers' `create_bidirectional_sliding_window_mask`), which `run_layers` gives the
layers it marks sliding.

```python
tokens = local_window(prepare(input_ids, attention_mask=mask, causal=False), radius=64)
x, _ = run_layers(blocks, x, tokens, cos=cos, sin=sin, sliding=local_layers)
```
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from port.nn._tokens import Tokens


def local_window(tokens: Tokens, radius: int) -> Tokens:
    """`tokens` with `sliding` the keys of `tokens.mask` within `radius` slots of each query.

    **Arguments:**

    - `tokens`: an encoder call's tokens (`prepare(..., causal=False)`, no cache).
    - `radius`: how far on each side a query sees, in slots (inclusive); 0: itself only.

    **Returns:** `tokens` with `sliding` `[batch, seq, keys]`: `mask` where `|q - k| <= radius`.

    ```python
    tokens = local_window(prepare(jnp.zeros((1, 5), jnp.int32), causal=False), radius=1)
    tokens.sliding[0, 2]         # [False, True, True, True, False]
    ```
    """
    if tokens.cache is not None:
        raise ValueError("`local_window` is for an encoder's tokens, without a cache")
    if not isinstance(radius, int) or isinstance(radius, bool) or radius < 0:
        raise ValueError(f"`radius` must be an integer of at least 0, got {radius!r}")
    slots = jnp.arange(tokens.mask.shape[-1])
    near = jnp.abs(slots[:, None] - slots[None, :]) <= radius
    return dataclasses.replace(tokens, sliding=tokens.mask & near)
