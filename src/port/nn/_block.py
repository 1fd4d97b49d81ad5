"""The decoder layer: an attention and a feed-forward, each in a residual branch with RMSNorms
before it (pre-norm), after it (post-norm) or both (sandwich).

| `norms` | the layer | families |
|---|---|---|
| `"pre"` | `x + attn(norm(x))`, then `x + mlp(norm(x))` | Llama, Mistral, Qwen2/3, Phi-3, the MoE families, DeepSeek-V3, gpt-oss, Qwen3-Next's full-attention layers |
| `"post"` | `x + norm(attn(x))`, then `x + norm(mlp(x))` | OLMo 2, OLMo 3 |
| `"sandwich"` | `x + norm(attn(norm(x)))`, then `x + norm(mlp(norm(x)))` | Gemma 2, Gemma 3 |

A family builds the attention and the feed-forward and hands them over, so its file holds
only what is new in them. The norms are `rms_norm`'s: `plus_one` for Gemma's `(1 + w)`
(weights start at 0), `float32_scale` for OLMo 2's weight applied in float32.

```python
attn = Attention(heads=4, kv_heads=2, head_dim=16, embd=64, dtype=jnp.float32, key=k1)
mlp = GatedMLP(embd=64, inner=128, activation="silu", dtype=jnp.float32, key=k2)
block = Block(attn, mlp, embd=64, eps=1e-6, dtype=jnp.float32)                   # Llama
block = Block(attn, mlp, embd=64, eps=1e-6, dtype=jnp.float32, norms="post", float32_scale=True)  # OLMo 2
block = Block(attn, mlp, embd=64, eps=1e-6, dtype=jnp.float32, norms="sandwich", plus_one=True)  # Gemma 2
y, kv = block(x, tokens.mask, cos=cos, sin=sin, kv=None, index=None, layer=0)
```
"""

from __future__ import annotations

from typing import Any, Literal, final

import equinox as eqx
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float

from port.nn._norm import rms_norm

NORMS = ("pre", "post", "sandwich")
"""Where a `Block`'s RMSNorms sit: before each branch, after it, or both."""


@final
class Block(eqx.Module):
    """One decoder layer: attention, then feed-forward, each a residual branch with its norms.

    **Arguments:**

    - `attn`: the attention, called as `attn(h, mask, cos=, sin=, kv=, index=)` and
      returning `(out, kv)` (`Attention`, `LatentAttention`).
    - `mlp`: the feed-forward, called as `mlp(h)` (`GatedMLP`, `MoE`).
    - `embd`: the hidden size (the norms' length).
    - `eps`: the norms' epsilon (config.json's `rms_norm_eps`).
    - `dtype`: the norms' dtype.
    - `norms`: `"pre"` (a norm before each branch), `"post"` (after each branch's output,
      before the residual sum: OLMo 2) or `"sandwich"` (both: Gemma 2 and 3).
    - `plus_one`: `(1 + w)` norms whose weights start at 0 (Gemma, Qwen3-Next).
    - `float32_scale`: the weight applied in float32 before the cast (OLMo 2's RMSNorm).

    **Returns** (of the call): `(x, kv)`, the layer's output and its keys and values
    (what `port.nn.run_layers` threads through a cache). A call's `q_scale` (from
    `run_layers`) is handed to the attention (`Attention`'s per-query factor).

    The fields are the paths mappings name: `attn_norm`, `attn`, `post_attn_norm`,
    `mlp_norm`, `mlp`, `post_mlp_norm` (`blocks.attn_norm`, `blocks.mlp.experts.gate`);
    the norms a layout lacks are None (`attn_norm` and `mlp_norm` under `"post"`, the
    `post_` ones under `"pre"`).

    ```python
    k1, k2 = jax.random.split(jax.random.key(0))
    attn = Attention(heads=4, kv_heads=2, head_dim=16, embd=64, dtype=jnp.float32, key=k1)
    mlp = GatedMLP(embd=64, inner=128, activation="silu", dtype=jnp.float32, key=k2)
    block = Block(attn, mlp, embd=64, eps=1e-6, dtype=jnp.float32, norms="post")
    y, kv = block(x, prepare(input_ids).mask, cos=None, sin=None, kv=None, index=None)
    block.attn_norm is None and block.post_attn_norm.shape == (64,)   # True
    ```
    """

    attn_norm: Float[Array, " embed"] | None
    attn: Any
    post_attn_norm: Float[Array, " embed"] | None
    mlp_norm: Float[Array, " embed"] | None
    mlp: Any
    post_mlp_norm: Float[Array, " embed"] | None
    eps: float = eqx.field(static=True)
    plus_one: bool = eqx.field(static=True)
    float32_scale: bool = eqx.field(static=True)

    def __init__(
        self,
        attn: Any,
        mlp: Any,
        *,
        embd: int,
        eps: float,
        dtype: Any,
        norms: Literal["pre", "post", "sandwich"] = "pre",
        plus_one: bool = False,
        float32_scale: bool = False,
    ):
        if norms not in NORMS:
            raise ValueError(f"`norms` must be one of {NORMS}, got {norms!r}")
        start = jnp.zeros if plus_one else jnp.ones
        pre, post = norms != "post", norms != "pre"
        self.attn_norm = start((embd,), dtype) if pre else None
        self.attn = attn
        self.post_attn_norm = start((embd,), dtype) if post else None
        self.mlp_norm = start((embd,), dtype) if pre else None
        self.mlp = mlp
        self.post_mlp_norm = start((embd,), dtype) if post else None
        self.eps, self.plus_one, self.float32_scale = eps, plus_one, float32_scale

    def norm(self, x: Float[Array, "batch seq embed"], weight: Array | None) -> Float[Array, "batch seq embed"]:
        """`x` normed by `weight` as this block's norms are (`x` itself where `weight` is None)."""
        if weight is None:
            return x
        return rms_norm(x, weight, self.eps, plus_one=self.plus_one, float32_scale=self.float32_scale)

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
        q_scale: Float[Array, "batch seq"] | None = None,
    ) -> tuple[Float[Array, "batch seq embed"], Any]:
        scaled = {} if q_scale is None else {"q_scale": q_scale}  # only an attention that takes one is given one
        h, kv = self.attn(self.norm(x, self.attn_norm), mask, cos=cos, sin=sin, kv=kv, index=index, **scaled)
        x = x + self.norm(h, self.post_attn_norm)
        return x + self.norm(self.mlp(self.norm(x, self.mlp_norm)), self.post_mlp_norm), kv
