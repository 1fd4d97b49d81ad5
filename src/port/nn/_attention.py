"""Attention: the scores-to-output core every family shares, and the common self-attention layer.

`attend` runs `jax.nn.dot_product_attention` (with no `implementation` given: jax's
default, XLA's; `attend` does not ask for cuDNN's fused kernel) whenever it can express
the layer; soft-capped scores (Gemma 2) and attention sinks (gpt-oss) are outside what
it computes, and take the written-out path below, which does what transformers' eager
attention does.

`Attention` is multi-head, grouped-query or multi-query self-attention with torch
`Linear` layouts split per head (`wq` `[heads, head_dim, embd]`, `wo` `[embd, heads,
head_dim]`, so loading is a copy), optional biases, optional RMSNorm of queries and keys
per head (Qwen3, Gemma 3) or over the whole projection (OLMo 2 and 3), RoPE, a key/value cache, a scale override, soft-capping and
sinks.

```python
attn = Attention(heads=8, kv_heads=2, head_dim=64, embd=512, dtype=jnp.float32, key=key)
y, _ = attn(x, tokens.mask, cos=cos, sin=sin)           # x: [batch, seq, 512]
```
"""

from __future__ import annotations

from typing import Any, Literal, final

import equinox as eqx
import jax
import jax.numpy as jnp
from jax.typing import ArrayLike
from jaxtyping import Array, Bool, Float, PRNGKeyArray

from port.nn._cache import write
from port.nn._init import normal, zeros_if
from port.nn._norm import rms_norm
from port.nn._rope import apply_rope

QK_NORMS = (None, "head", "projection")
"""`Attention`'s q/k norms: none, per head, or over the whole projection."""

KV = tuple[Array, Array]
"""One layer's cached keys and values, `[batch, length, kv_heads, head_dim]` each."""


def attend(
    q: Float[ArrayLike, "batch seq heads head_dim"],
    k: Float[ArrayLike, "batch keys kv_heads head_dim"],
    v: Float[ArrayLike, "batch keys kv_heads head_dim"],
    mask: Bool[ArrayLike, "batch seq keys"],
    *,
    scale: float,
    softcap: float | None = None,
    sinks: Float[ArrayLike, " heads"] | None = None,
    bias: Float[ArrayLike, "#batch heads seq keys"] | None = None,
) -> Float[Array, "batch seq heads head_dim"]:
    """Softmax attention of `q` over `k`/`v` where `mask` allows; query head h uses kv head
    h // (heads / kv_heads).

    **Arguments:**

    - `q`: queries `[batch, seq, heads, head_dim]`.
    - `k`, `v`: keys and values `[batch, keys, kv_heads, head_dim]`, `q`'s dtype; `heads`
      a multiple of `kv_heads`.
    - `mask`: `[batch, seq, keys]`, True where a query may see a key (`Tokens.mask`).
    - `scale`: multiplies the scores (`head_dim**-0.5` in most families).
    - `softcap`: `softcap * tanh(scores / softcap)` before the mask (Gemma 2); None: none.
    - `sinks`: `[heads]`, a learned logit per head that joins every softmax and is then
      dropped (gpt-oss); None: none.
    - `bias`: `[batch or 1, heads, seq, keys]`, added to the scaled scores before the mask
      (T5's relative position bias); None: none.

    **Returns:** the attended values, `q`'s shape and dtype. The softmax is in float32
    (without `softcap` and `sinks` the scores are too; with either, as in transformers'
    eager attention, they are computed in `q`'s dtype and cast for the softmax); a query
    that may see no key gets a finite, meaningless output.

    ```python
    q = jnp.zeros((2, 5, 8, 64))                   # 8 query heads
    k = v = jnp.zeros((2, 5, 2, 64))               # 2 kv heads: 4 query heads each
    mask = prepare(jnp.zeros((2, 5), jnp.int32)).mask   # causal, [2, 5, 5]
    attend(q, k, v, mask, scale=64**-0.5).shape    # (2, 5, 8, 64)
    ```
    """
    q, k, v, mask = jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), jnp.asarray(mask)
    if softcap is None and sinks is None:
        if bias is not None:
            bias = jnp.asarray(bias).astype(q.dtype)
        return jax.nn.dot_product_attention(q, k, v, bias=bias, mask=mask[:, None], scale=scale)
    if bias is not None:
        raise ValueError("`bias` cannot be combined with `softcap` or `sinks`")
    # Written out: dot_product_attention has no soft-capping and no sinks.
    batch, seq, heads, dim = q.shape
    kv_heads = k.shape[2]
    q = q.reshape(batch, seq, kv_heads, heads // kv_heads, dim)
    scores = jnp.einsum("btkgd,bskd->bkgts", q, k) * jnp.asarray(scale, q.dtype)
    if softcap is not None:
        scores = jnp.tanh(scores / softcap) * softcap
    scores = jnp.where(mask[:, None, None], scores.astype(jnp.float32), jnp.finfo(jnp.float32).min)
    if sinks is not None:
        sink = jnp.broadcast_to(
            jnp.asarray(sinks).astype(jnp.float32).reshape(1, kv_heads, heads // kv_heads, 1, 1),
            scores.shape[:-1] + (1,),
        )
        scores = jnp.concatenate([scores, sink], axis=-1)
        scores = scores - jnp.max(scores, axis=-1, keepdims=True)
        weights = jax.nn.softmax(scores, axis=-1)[..., :-1]
    else:
        weights = jax.nn.softmax(scores, axis=-1)
    out = jnp.einsum("bkgts,bskd->btkgd", weights.astype(v.dtype), v)
    return out.reshape(batch, seq, heads, dim)


def with_cache(
    k: Float[Array, "batch seq kv_heads head_dim"],
    v: Float[Array, "batch seq kv_heads v_dim"],
    kv: KV | None,
    index: Array | None,
) -> tuple[Array, Array, KV | None]:
    """The keys and values to attend over: this call's, or (with a cache) the cache's
    buffers with this call's written at `index`; and the updated cache.

    **Arguments:**

    - `k`, `v`: this call's keys and values, `[batch, seq, kv_heads, head_dim]`.
    - `kv`: this layer's cache, `(keys, values)` `[batch, length, kv_heads, head_dim]`
      each, as `run_layers` passes it to a block; None: no cache.
    - `index`: the first slot this call's tokens take (`Tokens.index`); None without a
      cache.

    **Returns:** `(keys, values, kv)`: without a cache `k`, `v` and None; with one, the
    buffers `[batch, length, kv_heads, head_dim]` with `k` and `v` written (cast to the
    cache's dtype) at slots `index, index + 1, ...`, and those two again as the updated
    cache.

    ```python
    k, v, kv = with_cache(k, v, kv, index)         # in a block's attention, before attend
    out = attend(q, k, v, mask, scale=head_dim**-0.5)
    ```
    """
    if kv is None:
        return k, v, None
    assert index is not None, "a cache needs the slot its tokens start at"
    keys, values = write(kv[0], k, index), write(kv[1], v, index)
    return keys, values, (keys, values)


@final
class Attention(eqx.Module):
    """Self-attention with per-head torch-`Linear` weights (see the module's docstring).

    **Arguments:**

    - `heads`, `kv_heads`, `head_dim`, `embd`: the sizes (kv_heads divides heads).
    - `dtype`, `key`: the parameters' dtype and initialisation key.
    - `qkv_bias`, `o_bias`: whether q/k/v and the output projection have biases.
    - `qk_norm`: RMSNorm of queries and keys before RoPE: `"head"` over each head's
      `head_dim` (Qwen3, Gemma 3: `q_norm`, `k_norm` `[head_dim]`), `"projection"` over
      the whole projection, every head at once (OLMo 2 and 3: `q_norm` `[heads, head_dim]`,
      `k_norm` `[kv_heads, head_dim]`, checkpoints' `[heads * head_dim]` reshaped); None:
      none. `plus_one` for Gemma's `(1 + w)` form, `float32_scale` for OLMo 2's weight
      applied in float32 (as `rms_norm`); `norm_eps` their epsilon.
    - `scale`: the score scale (None: `head_dim**-0.5`); `softcap` as in `attend`.
    - `sinks`: whether there is a learned per-head sink logit (a `sinks` leaf `[heads]`,
      zeros at initialisation), used as in `attend` (gpt-oss).
    - `gate`: an output gate (Qwen3-Next): a `wg` leaf `[heads, head_dim, embd]` (and `bg`
      with `qkv_bias`) projecting `x`; the attended values are multiplied by its sigmoid
      before `wo`.

    Called as `attn(x, mask, cos=..., sin=..., kv=..., index=..., q_scale=...)` -> `(y, kv)`:
    `x` `[batch, seq, embd]`, `mask` from `Tokens`, `cos`/`sin` from `Rope.angles` (None: no
    RoPE), `kv`/`index` this layer's cache and the first slot (None: no cache), `q_scale`
    `[batch, seq]` a factor per query, applied (in the queries' dtype) after RoPE
    (Ministral 3's position-dependent scale; None: none), `bias` an additive score bias as
    in `attend` (T5's relative positions; None: none). `y` is
    `[batch, seq, embd]`; `kv` the updated cache (None without one).

    ```python
    attn = Attention(heads=8, kv_heads=2, head_dim=64, embd=512, dtype=jnp.float32, key=key)
    tokens = prepare(input_ids)                                # input_ids: [batch, seq]
    cos, sin = Rope(theta=10000.0, rotary_dim=64).angles(tokens.positions, jnp.float32)
    y, _ = attn(x, tokens.mask, cos=cos, sin=sin)              # x: [batch, seq, 512] -> y: same
    ```
    """

    wq: Float[Array, "heads head_dim embed"]
    wk: Float[Array, "kv_heads head_dim embed"]
    wv: Float[Array, "kv_heads head_dim embed"]
    wo: Float[Array, "embed heads head_dim"]
    bq: Float[Array, "heads head_dim"] | None
    bk: Float[Array, "kv_heads head_dim"] | None
    bv: Float[Array, "kv_heads head_dim"] | None
    bo: Float[Array, " embed"] | None
    q_norm: Float[Array, " head_dim"] | Float[Array, "heads head_dim"] | None
    k_norm: Float[Array, " head_dim"] | Float[Array, "kv_heads head_dim"] | None
    sinks: Float[Array, " heads"] | None
    wg: Float[Array, "heads head_dim embed"] | None
    bg: Float[Array, "heads head_dim"] | None
    scale: float = eqx.field(static=True)
    softcap: float | None = eqx.field(static=True)
    norm_eps: float = eqx.field(static=True)
    plus_one: bool = eqx.field(static=True)
    float32_scale: bool = eqx.field(static=True)

    def __init__(
        self,
        *,
        heads: int,
        kv_heads: int,
        head_dim: int,
        embd: int,
        dtype: Any,
        key: PRNGKeyArray,
        qkv_bias: bool = False,
        o_bias: bool = False,
        qk_norm: Literal["head", "projection"] | None = None,
        plus_one: bool = False,
        float32_scale: bool = False,
        norm_eps: float = 1e-6,
        scale: float | None = None,
        softcap: float | None = None,
        sinks: bool = False,
        gate: bool = False,
    ):
        kq, kk, kv, ko = jax.random.split(key, 4)
        h, g, d, e = heads, kv_heads, head_dim, embd
        self.wq, self.wk, self.wv = (
            normal(kq, (h, d, e), dtype),
            normal(kk, (g, d, e), dtype),
            normal(kv, (g, d, e), dtype),
        )
        self.wo = normal(ko, (e, h, d), dtype)
        self.bq, self.bk, self.bv = (
            zeros_if(qkv_bias, (h, d), dtype),
            zeros_if(qkv_bias, (g, d), dtype),
            zeros_if(qkv_bias, (g, d), dtype),
        )
        self.bo = zeros_if(o_bias, (e,), dtype)
        if qk_norm not in QK_NORMS:
            raise ValueError(f"`qk_norm` must be one of {QK_NORMS}, got {qk_norm!r}")
        start = jnp.zeros if plus_one else jnp.ones
        self.q_norm, self.k_norm = (
            None if qk_norm is None else start((d,) if qk_norm == "head" else (n, d), dtype) for n in (h, g)
        )
        self.sinks = jnp.zeros((h,), dtype) if sinks else None
        self.wg = normal(jax.random.fold_in(kq, 1), (h, d, e), dtype) if gate else None
        self.bg = zeros_if(gate and qkv_bias, (h, d), dtype)
        self.scale = d**-0.5 if scale is None else scale
        self.softcap = softcap
        self.norm_eps = norm_eps
        self.plus_one = plus_one
        self.float32_scale = float32_scale

    def project(
        self, x: Float[Array, "batch seq embed"], cos: Array | None, sin: Array | None
    ) -> tuple[Array, Array, Array]:
        """Queries, keys and values `[batch, seq, heads or kv_heads, head_dim]`, normed and rotated."""

        def linear(w: Array, b: Array | None, norm: Array | None) -> Array:
            y = jnp.einsum("bte,hde->bthd", x, w)
            y = y if b is None else y + b
            if norm is None:
                return y
            whole = norm.ndim == 2  # "projection": one norm over every head's features
            h = y.reshape(*y.shape[:2], -1) if whole else y
            h = rms_norm(h, norm.reshape(-1), self.norm_eps, plus_one=self.plus_one, float32_scale=self.float32_scale)
            return h.reshape(y.shape)

        q = linear(self.wq, self.bq, self.q_norm)
        k = linear(self.wk, self.bk, self.k_norm)
        v = linear(self.wv, self.bv, None)
        if cos is not None:
            assert sin is not None, "cos and sin come as a pair"
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        return q, k, v

    def __call__(
        self,
        x: Float[Array, "batch seq embed"],
        mask: Bool[Array, "batch seq keys"],
        *,
        cos: Array | None = None,
        sin: Array | None = None,
        kv: KV | None = None,
        index: Array | None = None,
        q_scale: Float[Array, "batch seq"] | None = None,
        bias: Float[Array, "#batch heads seq keys"] | None = None,
    ) -> tuple[Float[Array, "batch seq embed"], KV | None]:
        q, k, v = self.project(x, cos, sin)
        if q_scale is not None:
            q = q * q_scale[:, :, None, None].astype(q.dtype)
        k, v, kv = with_cache(k, v, kv, index)
        out = attend(q, k, v, mask, scale=self.scale, softcap=self.softcap, sinks=self.sinks, bias=bias)
        if self.wg is not None:
            g = jnp.einsum("bte,hde->bthd", x, self.wg)
            out = out * jax.nn.sigmoid(g if self.bg is None else g + self.bg)
        y = jnp.einsum("bthd,ehd->bte", out, self.wo)
        return (y if self.bo is None else y + self.bo), kv
