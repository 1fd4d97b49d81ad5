"""Multi-head latent attention (MLA, DeepSeek-V2/V3, Kimi K2): keys and values from a shared low-rank latent.

Each token's hidden state is compressed to a latent of `kv_rank` (`kv_a_proj_with_mqa`,
then an RMSNorm) plus one rotary key part `rope_dim` wide shared by all heads; each head's
non-rotary key (`nope_dim`) and value (`v_dim`) are linear in the latent (`kv_b_proj`).
Queries come from a plain projection, or through a low-rank bottleneck of `q_rank` with
its own RMSNorm (`q_a_proj` -> `q_a_layernorm` -> `q_b_proj`). Only the last `rope_dim`
dimensions of each query and key rotate; `interleave` (transformers' `rope_interleave`,
DeepSeek's default) takes them as pairs `(x0, x1), (x2, x3), ...` and lays the rotated
result out as transformers does (evens first, then odds).

The cache holds what transformers' cache holds: the normed latent (keys, one "head" of
`kv_rank`) and the rotated shared key (values, one "head" of `rope_dim`); each call expands
the whole cache into per-head keys and values. That is `(kv_rank + rope_dim)` numbers per
token and layer instead of `heads * (nope_dim + rope_dim + v_dim)`.

```python
attn = LatentAttention(heads=8, embd=256, q_rank=64, kv_rank=32, nope_dim=16, rope_dim=8, v_dim=16,
                       dtype=jnp.float32, key=key)
cos, sin = Rope(theta=10000.0, rotary_dim=8).angles(tokens.positions, jnp.float32)
y, _ = attn(x, tokens.mask, cos=cos, sin=sin)       # x: [batch, seq, 256] -> y: same
```
"""

from __future__ import annotations

from typing import Any, final

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, PRNGKeyArray

from port.nn._attention import KV, attend, with_cache
from port.nn._init import normal, zeros_if
from port.nn._norm import rms_norm
from port.nn._rope import apply_rope


@final
class LatentAttention(eqx.Module):
    """Multi-head latent attention with torch-`Linear` weights split per head (see the module's docstring).

    **Arguments:**

    - `heads`, `embd`: query heads and the hidden size.
    - `q_rank`: the queries' low-rank bottleneck (`q_lora_rank`); None: one projection.
    - `kv_rank`: the latent's size (`kv_lora_rank`).
    - `nope_dim`, `rope_dim`: each query/key head's non-rotary and rotary sizes
      (`qk_nope_head_dim`, `qk_rope_head_dim`); `v_dim`: each value head's (`v_head_dim`).
    - `dtype`, `key`: the parameters' dtype and initialisation key.
    - `bias`: biases on `q_a_proj`, `kv_a_proj_with_mqa` and `o_proj` (`attention_bias`).
    - `scale`: the score scale (None: `(nope_dim + rope_dim)**-0.5`; DeepSeek-V3 with
      YaRN multiplies it by mscale squared).
    - `interleave`: the rotary dimensions are interleaved pairs (`rope_interleave`).
    - `norm_eps`: the epsilon of the two latent RMSNorms (transformers: 1e-6, not
      `rms_norm_eps`).

    Leaves (torch layouts, per head where there are heads): `wq` `[heads, nope+rope, embd]`
    or `wq_a` `[q_rank, embd]`, `q_norm` `[q_rank]`, `wq_b` `[heads, nope+rope, q_rank]`;
    `wkv_a` `[kv_rank, embd]` and `wk_rope` `[rope_dim, embd]` (the two parts of
    `kv_a_proj_with_mqa`), `kv_norm` `[kv_rank]`; `wk_b` `[heads, nope_dim, kv_rank]` and
    `wv_b` `[heads, v_dim, kv_rank]` (the two parts of `kv_b_proj`); `wo` `[embd, heads,
    v_dim]`; biases `bq_a`, `bkv_a`, `bk_rope`, `bo` or None.

    Called as `port.nn.Attention`: `attn(x, mask, cos=, sin=, kv=, index=)` -> `(y, kv)`,
    `cos`/`sin` of `rope_dim` from `Rope.angles`; `kv` is this layer's cache, `(latents
    [batch, length, 1, kv_rank], rotary keys [batch, length, 1, rope_dim])` (see
    `cache_sizes`), or None.

    ```python
    attn = LatentAttention(heads=8, embd=256, q_rank=None, kv_rank=32, nope_dim=16, rope_dim=8,
                           v_dim=24, dtype=jnp.float32, key=jax.random.key(0))
    tokens = prepare(jnp.zeros((2, 5), jnp.int32))
    cos, sin = Rope(theta=10000.0, rotary_dim=8).angles(tokens.positions, jnp.float32)
    y, _ = attn(jnp.ones((2, 5, 256)), tokens.mask, cos=cos, sin=sin)     # (2, 5, 256)
    attn.cache_sizes                                                       # (1, 32, 8)
    ```
    """

    wq: Float[Array, "heads qk_dim embed"] | None
    wq_a: Float[Array, "q_rank embed"] | None
    bq_a: Float[Array, " q_rank"] | None
    q_norm: Float[Array, " q_rank"] | None
    wq_b: Float[Array, "heads qk_dim q_rank"] | None
    wkv_a: Float[Array, "kv_rank embed"]
    bkv_a: Float[Array, " kv_rank"] | None
    wk_rope: Float[Array, "rope_dim embed"]
    bk_rope: Float[Array, " rope_dim"] | None
    kv_norm: Float[Array, " kv_rank"]
    wk_b: Float[Array, "heads nope_dim kv_rank"]
    wv_b: Float[Array, "heads v_dim kv_rank"]
    wo: Float[Array, "embed heads v_dim"]
    bo: Float[Array, " embed"] | None
    nope_dim: int = eqx.field(static=True)
    rope_dim: int = eqx.field(static=True)
    scale: float = eqx.field(static=True)
    interleave: bool = eqx.field(static=True)
    norm_eps: float = eqx.field(static=True)

    def __init__(
        self,
        *,
        heads: int,
        embd: int,
        q_rank: int | None,
        kv_rank: int,
        nope_dim: int,
        rope_dim: int,
        v_dim: int,
        dtype: Any,
        key: PRNGKeyArray,
        bias: bool = False,
        scale: float | None = None,
        interleave: bool = True,
        norm_eps: float = 1e-6,
    ):
        keys = jax.random.split(key, 8)
        qk = nope_dim + rope_dim
        low_rank = q_rank is not None
        self.wq = None if low_rank else normal(keys[0], (heads, qk, embd), dtype)
        self.wq_a = normal(keys[1], (q_rank, embd), dtype) if low_rank else None
        self.bq_a = zeros_if(bias, (q_rank,), dtype) if low_rank else None
        self.q_norm = jnp.ones((q_rank,), dtype) if low_rank else None
        self.wq_b = normal(keys[2], (heads, qk, q_rank), dtype) if low_rank else None
        self.wkv_a = normal(keys[3], (kv_rank, embd), dtype)
        self.bkv_a = zeros_if(bias, (kv_rank,), dtype)
        self.wk_rope = normal(keys[4], (rope_dim, embd), dtype)
        self.bk_rope = zeros_if(bias, (rope_dim,), dtype)
        self.kv_norm = jnp.ones((kv_rank,), dtype)
        self.wk_b = normal(keys[5], (heads, nope_dim, kv_rank), dtype)
        self.wv_b = normal(keys[6], (heads, v_dim, kv_rank), dtype)
        self.wo = normal(keys[7], (embd, heads, v_dim), dtype)
        self.bo = zeros_if(bias, (embd,), dtype)
        self.nope_dim, self.rope_dim = nope_dim, rope_dim
        self.scale = qk**-0.5 if scale is None else scale
        self.interleave = interleave
        self.norm_eps = norm_eps

    @property
    def cache_sizes(self) -> tuple[int, int, int]:
        """`(kv_heads, key size, value size)` of this layer's cache entry: one latent of
        `kv_rank` (keys) and one rotary key of `rope_dim` (values) per token."""
        return 1, self.kv_norm.shape[-1], self.rope_dim

    def _rotate(self, x: Array, cos: Array | None, sin: Array | None) -> Array:
        """RoPE on the rotary part `x` `[..., heads, rope_dim]`, pairs de-interleaved first."""
        return rotate(x, cos, sin, interleave=self.interleave)

    def q_latent(self, x: Float[Array, "batch seq embed"]) -> Float[Array, "batch seq q_rank"] | None:
        """The queries' normed low-rank latent (`q_a_layernorm(q_a_proj(x))`); None without `q_rank`."""
        if self.wq is not None:
            return None
        assert self.q_norm is not None, "without wq, the low-rank wq_a, q_norm and wq_b are set"
        a = jnp.einsum("bte,re->btr", x, self.wq_a)
        a = a if self.bq_a is None else a + self.bq_a
        return rms_norm(a, self.q_norm, self.norm_eps)

    def queries(
        self,
        x: Float[Array, "batch seq embed"],
        cos: Array | None,
        sin: Array | None,
        latent: Array | None = None,
    ) -> Array:
        """Queries `[batch, seq, heads, nope_dim + rope_dim]`, their rotary part rotated
        (`latent`: `q_latent(x)` where the caller has it already)."""
        if self.wq is not None:
            q = jnp.einsum("bte,hde->bthd", x, self.wq)
        else:
            q = jnp.einsum("btr,hdr->bthd", self.q_latent(x) if latent is None else latent, self.wq_b)
        return jnp.concatenate((q[..., : self.nope_dim], self._rotate(q[..., self.nope_dim :], cos, sin)), axis=-1)

    def latents(self, x: Float[Array, "batch seq embed"], cos: Array | None, sin: Array | None) -> KV:
        """What the cache holds for `x`: the normed latent `[batch, seq, 1, kv_rank]` and the
        rotated shared key `[batch, seq, 1, rope_dim]`."""
        latent = jnp.einsum("bte,re->btr", x, self.wkv_a)
        latent = latent if self.bkv_a is None else latent + self.bkv_a
        rope = jnp.einsum("bte,re->btr", x, self.wk_rope)
        rope = rope if self.bk_rope is None else rope + self.bk_rope
        return rms_norm(latent, self.kv_norm, self.norm_eps)[:, :, None], self._rotate(rope[:, :, None], cos, sin)

    def __call__(
        self,
        x: Float[Array, "batch seq embed"],
        mask: Bool[Array, "batch seq keys"],
        *,
        cos: Array | None = None,
        sin: Array | None = None,
        kv: KV | None = None,
        index: Array | None = None,
    ) -> tuple[Float[Array, "batch seq embed"], KV | None]:
        q = self.queries(x, cos, sin)
        latent, rope = self.latents(x, cos, sin)
        latent, rope, kv = with_cache(latent, rope, kv, index)
        return self.attend(q, latent, rope, mask), kv

    def attend(
        self,
        q: Float[Array, "batch seq heads qk_dim"],
        latent: Float[Array, "batch keys 1 kv_rank"],
        rope: Float[Array, "batch keys 1 rope_dim"],
        mask: Bool[Array, "batch seq keys"],
    ) -> Float[Array, "batch seq embed"]:
        """The layer's output for queries `q` over the keys' latents and rotary keys (this
        call's, or the cache's), where `mask` allows."""
        latent, rope = latent[:, :, 0].astype(q.dtype), rope.astype(q.dtype)
        k_nope = jnp.einsum("bsr,hdr->bshd", latent, self.wk_b)
        v = jnp.einsum("bsr,hdr->bshd", latent, self.wv_b)
        k = jnp.concatenate((k_nope, jnp.broadcast_to(rope, (*k_nope.shape[:-1], self.rope_dim))), axis=-1)
        return self.output(_attend_padded(q, k, v, mask, self.scale))

    def output(self, heads: Float[Array, "batch seq heads v_dim"]) -> Float[Array, "batch seq embed"]:
        """The output projection (`o_proj`) of the attended values per head."""
        y = jnp.einsum("bthd,ehd->bte", heads, self.wo)
        return y if self.bo is None else y + self.bo


def rotate(x: Array, cos: Array | None, sin: Array | None, *, interleave: bool) -> Array:
    """RoPE on the first `cos.shape[-1]` dimensions of each head of `x` `[..., heads, dim]`
    (the rest pass); `interleave`: those dimensions are pairs `(x0, x1), ...`, laid out
    evens first, then odds, before rotating (transformers' `apply_rotary_pos_emb_interleave`)."""
    if cos is None:
        return x
    assert sin is not None, "cos and sin come as a pair"
    if interleave:
        n = cos.shape[-1]
        x = jnp.concatenate((x[..., 0:n:2], x[..., 1:n:2], x[..., n:]), axis=-1)
    return apply_rope(x, cos, sin)


def _attend_padded(q: Array, k: Array, v: Array, mask: Array, scale: float) -> Array:
    """`attend` where the values' head size differs from the queries' and keys': the smaller
    side is zero-padded (zeros change neither the scores nor the weighted sum) and cut off."""
    qk, vd = q.shape[-1], v.shape[-1]

    def pad(a, n):
        return jnp.pad(a, [(0, 0)] * (a.ndim - 1) + [(0, n - a.shape[-1])])

    if vd < qk:
        return attend(q, k, pad(v, qk), mask, scale=scale)[..., :vd]
    if vd > qk:
        return attend(pad(q, vd), pad(k, vd), v, mask, scale=scale)
    return attend(q, k, v, mask, scale=scale)
