"""The pre-norm decoder layer: `x + attn(norm(x))`, then `x + mlp(norm(x))`.

Llama, Mistral, Qwen2/3, Phi-3, the MoE families, DeepSeek-V3, gpt-oss and Qwen3-Next's
full-attention layers are this layer with another attention or feed-forward inside; a
family builds the two and hands them over, so its file holds only what is new in them.

```python
attn = Attention(heads=4, kv_heads=2, head_dim=16, embd=64, dtype=jnp.float32, key=k1)
mlp = GatedMLP(embd=64, inner=128, activation="silu", dtype=jnp.float32, key=k2)
block = PreNormBlock(attn, mlp, embd=64, eps=1e-6, dtype=jnp.float32)
y, kv = block(x, tokens.mask, cos=cos, sin=sin, kv=None, index=None, layer=0)
```
"""

from __future__ import annotations

from typing import Any, final

import equinox as eqx
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float

from port.nn._norm import rms_norm


@final
class PreNormBlock(eqx.Module):
    """One decoder layer with an RMSNorm before its attention and before its feed-forward.

    **Arguments:**

    - `attn`: the attention, called as `attn(h, mask, cos=, sin=, kv=, index=)` and
      returning `(out, kv)` (`Attention`, `LatentAttention`).
    - `mlp`: the feed-forward, called as `mlp(h)` (`GatedMLP`, `MoE`).
    - `embd`: the hidden size (the norms' length).
    - `eps`: the norms' epsilon (config.json's `rms_norm_eps`).
    - `dtype`: the norms' dtype.
    - `plus_one`: `(1 + w)` norms whose weights start at 0 (Gemma, Qwen3-Next).

    **Returns** (of the call): `(x, kv)`, the layer's output and its keys and values
    (what `port.nn.run_layers` threads through a cache).

    The fields `attn_norm`, `attn`, `mlp_norm` and `mlp` are the paths mappings name
    (`blocks.attn_norm`, `blocks.mlp.experts.gate`).

    ```python
    k1, k2 = jax.random.split(jax.random.key(0))
    attn = Attention(heads=4, kv_heads=2, head_dim=16, embd=64, dtype=jnp.float32, key=k1)
    mlp = GatedMLP(embd=64, inner=128, activation="silu", dtype=jnp.float32, key=k2)
    block = PreNormBlock(attn, mlp, embd=64, eps=1e-6, dtype=jnp.float32)
    y, kv = block(x, prepare(input_ids).mask, cos=None, sin=None, kv=None, index=None)
    ```
    """

    attn_norm: Float[Array, " embed"]
    attn: Any
    mlp_norm: Float[Array, " embed"]
    mlp: Any
    eps: float = eqx.field(static=True)
    plus_one: bool = eqx.field(static=True)

    def __init__(self, attn: Any, mlp: Any, *, embd: int, eps: float, dtype: Any, plus_one: bool = False):
        start = jnp.zeros if plus_one else jnp.ones
        self.attn_norm, self.attn = start((embd,), dtype), attn
        self.mlp_norm, self.mlp = start((embd,), dtype), mlp
        self.eps, self.plus_one = eps, plus_one

    def __call__(
        self,
        x: Float[Array, "batch seq embed"],
        mask: Bool[Array, "batch seq keys"],
        *,
        cos: Array | None,
        sin: Array | None,
        kv: Any,
        index: Array | None,
        layer: Array | None = None,
    ) -> tuple[Float[Array, "batch seq embed"], Any]:
        h, kv = self.attn(
            rms_norm(x, self.attn_norm, self.eps, plus_one=self.plus_one), mask, cos=cos, sin=sin, kv=kv, index=index
        )
        x = x + h
        return x + self.mlp(rms_norm(x, self.mlp_norm, self.eps, plus_one=self.plus_one)), kv
