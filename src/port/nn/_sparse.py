"""DeepSeek sparse attention (DSA: DeepSeek-V3.2, GLM-5): a lightning indexer picks, per query, the
`top_k` earlier keys that latent attention then attends to.

The indexer (transformers' `DeepseekV32Indexer`) has its own small projections: queries
`[index_heads, index_dim]` from the attention's normed query latent (`wq_b`), one key
`[index_dim]` per token from the hidden state (`wk`, then a LayerNorm with bias, eps
1e-6), RoPE on the first `rope_dim` dimensions of both (half-split in DeepSeek-V3.2,
interleaved pairs in GLM-5), and a weight per head from the hidden state
(`weights_proj`, times `index_heads**-0.5`). A query's score for a key is
`sum_h weight_h * relu(q_h . k * index_dim**-0.5)`, in float32; the keys the mask hides
score `-inf`, and the query keeps the `min(top_k, keys)` best. Where fewer keys are
visible than `top_k`, every visible key is kept (the hidden ones chosen besides stay
hidden). The selection is an integer: no gradient flows through the indexer (PyTorch
runs it under `no_grad`), so its weights' gradients are zero.

`SparseLatentAttention` is `LatentAttention` (`port.nn._mla`) with an `Indexer`. When
`top_k` covers every key it is exactly latent attention (everything visible is chosen).
Otherwise each query gathers its `top_k` latents and rotary keys and attends to them
with the latent projections absorbed into the query and the output (DeepSeek's own
decoding form): `q_nope . (W_k latent) = (q_nope W_k) . latent`. Its cost per query
follows `top_k`, not the number of keys; only the indexer's (small) scores see every
key. The cache keeps the indexer's keys beside the rotated shared key, in the
"values" buffer of the latent cache: `[batch, length, 1, rope_dim + index_dim]`.

```python
mla = LatentAttention(heads=4, embd=64, q_rank=24, kv_rank=16, nope_dim=8, rope_dim=4, v_dim=12,
                      dtype=jnp.float32, key=k1)
indexer = Indexer(heads=4, dim=16, q_rank=24, embd=64, rope_dim=4, top_k=3, dtype=jnp.float32, key=k2)
attn = SparseLatentAttention(mla, indexer)
tokens = prepare(jnp.zeros((2, 8), jnp.int32))
cos, sin = Rope(theta=10000.0, rotary_dim=4).angles(tokens.positions, jnp.float32)
y, _ = attn(jnp.ones((2, 8, 64)), tokens.mask, cos=cos, sin=sin)    # (2, 8, 64): 3 keys per query
attn.cache_sizes                                                      # (1, 16, 20)
```
"""

from __future__ import annotations

from typing import Any, final

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int, PRNGKeyArray

from port.nn._attention import KV, with_cache
from port.nn._init import normal
from port.nn._mla import LatentAttention, rotate
from port.nn._norm import layer_norm


@final
class Indexer(eqx.Module):
    """The lightning indexer of DeepSeek sparse attention (see the module's docstring).

    **Arguments:**

    - `heads`, `dim`: the indexer's heads and head size (`index_n_heads`, `index_head_dim`).
    - `q_rank`, `embd`: the attention's query latent size (`q_lora_rank`) and the hidden size.
    - `rope_dim`: the rotated leading dimensions of each indexer head (`qk_rope_head_dim`).
    - `top_k`: the keys each query keeps (`index_topk`).
    - `dtype`, `key`: the parameters' dtype and initialisation key.
    - `interleave`: RoPE on interleaved pairs (GLM-5) rather than halves (DeepSeek-V3.2).

    Leaves (torch layouts): `wq` `[heads, dim, q_rank]` (`wq_b`), `wk` `[dim, embd]`,
    `k_norm`, `k_norm_bias` `[dim]` (a LayerNorm's `weight` and `bias`, eps 1e-6),
    `weights` `[heads, embd]` (`weights_proj`).

    ```python
    indexer = Indexer(heads=4, dim=16, q_rank=24, embd=64, rope_dim=4, top_k=3, dtype=jnp.float32, key=key)
    keys = indexer.keys(x, cos, sin)                                   # [batch, seq, 16]
    chosen = indexer.select(x, q_latent, keys, tokens.mask, cos, sin)  # [batch, seq, 3] key indices
    ```
    """

    wq: Float[Array, "heads index_dim q_rank"]
    wk: Float[Array, "index_dim embed"]
    k_norm: Float[Array, " index_dim"]
    k_norm_bias: Float[Array, " index_dim"]
    weights: Float[Array, "heads embed"]
    rope_dim: int = eqx.field(static=True)
    top_k: int = eqx.field(static=True)
    interleave: bool = eqx.field(static=True)

    def __init__(
        self,
        *,
        heads: int,
        dim: int,
        q_rank: int,
        embd: int,
        rope_dim: int,
        top_k: int,
        dtype: Any,
        key: PRNGKeyArray,
        interleave: bool = False,
    ):
        if not 0 <= rope_dim <= dim:
            raise ValueError(f"`rope_dim` ({rope_dim}) must be within the indexer's head size `dim` ({dim})")
        if top_k < 1:
            raise ValueError(f"`top_k` must be a positive integer, got {top_k!r}")
        kq, kk, kw = jax.random.split(key, 3)
        self.wq = normal(kq, (heads, dim, q_rank), dtype)
        self.wk = normal(kk, (dim, embd), dtype)
        self.k_norm, self.k_norm_bias = jnp.ones((dim,), dtype), jnp.zeros((dim,), dtype)
        self.weights = normal(kw, (heads, embd), dtype)
        self.rope_dim, self.top_k, self.interleave = rope_dim, top_k, interleave

    @property
    def dim(self) -> int:
        """Each indexer head's size (`index_head_dim`): one cached key's."""
        return self.wk.shape[0]

    def keys(self, x: Float[Array, "batch seq embed"], cos: Array | None, sin: Array | None) -> Array:
        """The indexer's key of each token, `[batch, seq, dim]`: normed, then rotated."""
        k = layer_norm(jnp.einsum("bte,de->btd", x, self.wk), self.k_norm, self.k_norm_bias, 1e-6)
        return rotate(k[:, :, None], cos, sin, interleave=self.interleave)[:, :, 0]

    def select(
        self,
        x: Float[Array, "batch seq embed"],
        q_latent: Float[Array, "batch seq q_rank"],
        keys: Float[Array, "batch keys index_dim"],
        mask: Bool[Array, "batch seq keys"],
        cos: Array | None,
        sin: Array | None,
    ) -> Int[Array, "batch seq top"]:
        """The `min(top_k, keys)` keys each query attends to, best first (int32 indices into
        `keys`' axis 1); those `mask` hides come last, and only where fewer are visible."""
        x, q_latent, keys = (jax.lax.stop_gradient(a) for a in (x, q_latent, keys))
        q = rotate(jnp.einsum("btr,hdr->bthd", q_latent, self.wq), cos, sin, interleave=self.interleave)
        f32 = jnp.float32
        scores = jax.nn.relu(jnp.einsum("bthd,bsd->bths", q.astype(f32), keys.astype(f32)) * self.dim**-0.5)
        weights = jnp.einsum("bte,he->bth", x.astype(f32), self.weights.astype(f32)) * self.wq.shape[0] ** -0.5
        index = jnp.where(mask, jnp.einsum("bth,bths->bts", weights, scores), -jnp.inf)
        return jax.lax.top_k(index, min(self.top_k, index.shape[-1]))[1].astype(jnp.int32)


@final
class SparseLatentAttention(eqx.Module):
    """Latent attention over the keys an `Indexer` picks per query (see the module's docstring).

    **Arguments:** `mla`, the `LatentAttention` (it needs `q_rank`: the indexer's queries
    come from its query latent); `indexer`, the `Indexer`.

    Called as `LatentAttention`: `attn(x, mask, cos=, sin=, kv=, index=)` -> `(y, kv)`;
    `kv`, this layer's cache, is `(latents [batch, length, 1, kv_rank], rotary and
    indexer keys [batch, length, 1, rope_dim + index_dim])` (see `cache_sizes`), or None.

    ```python
    attn = SparseLatentAttention(mla, indexer)
    y, kv = attn(x, tokens.mask, cos=cos, sin=sin, kv=kv, index=tokens.index)
    ```
    """

    mla: LatentAttention
    indexer: Indexer

    def __init__(self, mla: LatentAttention, indexer: Indexer):
        if mla.q_norm is None:
            raise ValueError("sparse attention's indexer reads the query latent: `mla` needs a `q_rank`")
        self.mla, self.indexer = mla, indexer

    @property
    def cache_sizes(self) -> tuple[int, int, int]:
        """`(kv_heads, key size, value size)` of this layer's cache entry: the latent (keys),
        and the rotary key and the indexer's key side by side (values)."""
        heads, latent, rope = self.mla.cache_sizes
        return heads, latent, rope + self.indexer.dim

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
        mla = self.mla
        q_latent = mla.q_latent(x)
        assert q_latent is not None, "checked at construction"
        q = mla.queries(x, cos, sin, q_latent)
        latent, rope = mla.latents(x, cos, sin)
        side = jnp.concatenate((rope, self.indexer.keys(x, cos, sin)[:, :, None].astype(rope.dtype)), axis=-1)
        latent, side, kv = with_cache(latent, side, kv, index)
        rope, keys = side[..., : mla.rope_dim], side[:, :, 0, mla.rope_dim :]
        if self.indexer.top_k >= latent.shape[1]:  # every key is chosen: latent attention itself
            return mla.attend(q, latent, rope, mask), kv
        chosen = self.indexer.select(x, q_latent, keys, mask, cos, sin)
        return sparse_attend(mla, q, latent, rope, mask, chosen), kv


def sparse_attend(
    mla: LatentAttention,
    q: Float[Array, "batch seq heads qk_dim"],
    latent: Float[Array, "batch keys 1 kv_rank"],
    rope: Float[Array, "batch keys 1 rope_dim"],
    mask: Bool[Array, "batch seq keys"],
    chosen: Int[Array, "batch seq top"],
) -> Float[Array, "batch seq embed"]:
    """`mla`'s output for queries `q`, each over its `chosen` keys only (those `mask` hides
    stay hidden): the keys' latents and rotary keys gathered per query, `kv_b_proj` absorbed
    into the queries (scores) and the output (values). Softmax in float32.

    **Arguments:**

    - `mla`: the latent attention whose projections and scale are used.
    - `q`: the queries, rotated (`mla.queries`).
    - `latent`, `rope`: every key's latent and rotated shared key (`mla.latents`, or the cache's).
    - `mask`: which keys each query may see.
    - `chosen`: each query's keys (`Indexer.select`), indices into `keys`.

    **Returns:** the attention's output, after `o_proj`.

    ```python
    q = mla.queries(x, cos, sin)                            # [batch, seq, heads, qk_dim]
    latent, rope = mla.latents(x, cos, sin)                 # [batch, keys, 1, kv_rank], [..., rope_dim]
    keys = indexer.keys(x, cos, sin)                        # [batch, keys, index_dim]
    chosen = indexer.select(x, mla.q_latent(x), keys, mask, cos, sin)   # [batch, seq, top]
    y = sparse_attend(mla, q, latent, rope, mask, chosen)   # [batch, seq, embed]
    ```
    """
    dtype = q.dtype
    gather = jax.vmap(lambda a, i: a[i])  # per sequence: [keys, ...] at [seq, top] -> [seq, top, ...]
    latents = gather(latent[:, :, 0].astype(dtype), chosen)  # [batch, seq, top, kv_rank]
    ropes = gather(rope[:, :, 0].astype(dtype), chosen)  # [batch, seq, top, rope_dim]
    visible = jnp.take_along_axis(mask, chosen, axis=-1)  # [batch, seq, top]
    f32 = jnp.float32
    q_nope, q_rope = q[..., : mla.nope_dim], q[..., mla.nope_dim :]
    absorbed = jnp.einsum("bthd,hdr->bthr", q_nope, mla.wk_b.astype(dtype))
    scores = jnp.einsum("bthr,btkr->bthk", absorbed, latents, preferred_element_type=f32)
    scores = scores + jnp.einsum("bthd,btkd->bthk", q_rope, ropes, preferred_element_type=f32)
    scores = jnp.where(visible[:, :, None], scores * mla.scale, jnp.finfo(f32).min)
    weights = jax.nn.softmax(scores, axis=-1).astype(dtype)
    attended = jnp.einsum("bthk,btkr->bthr", weights, latents)
    return mla.output(jnp.einsum("bthr,hvr->bthv", attended, mla.wv_b.astype(dtype)))
