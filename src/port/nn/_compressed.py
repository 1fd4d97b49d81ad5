"""DeepSeek-V4's attention: a sliding window plus compressed (CSA) or heavily compressed (HCA) entries.

One shared key/value head (keys are values), queries through a low-rank bottleneck with
an unweighted per-head RMSNorm, interleaved RoPE on each head's trailing
`rope_dim` features (and the conjugate rotation on the output), a learned sink per head,
and a grouped low-rank output projection (`o_groups` blocks of heads, each to
`o_lora_rank`, then one projection to `embed`). The keys are the sliding window's
(`tokens.sliding`) and, on compressed layers, the entries a `Compressor` makes of every
`rate` tokens:

- HCA (`overlap=False`): each window of `rate` tokens is one entry, its tokens weighted
  by a softmax of learned gates plus a per-slot bias (`ape`), RMS-normed, rotated at
  its first token's slot.
- CSA (`overlap=True`): two series per token; entry `w` pools window `w`'s second series
  with window `w - 1`'s first (width `2 * rate`, stride `rate`). A lightning `Indexer`
  (its own compressor, query heads and per-head weights: `sum_h w_h relu(q_h . k)`)
  keeps the `index_topk` best entries per query.

A query at position `p` sees the entries `w < (p + 1) // rate`; windows are counted in
slots from the start of the row, as transformers counts them (`DeepseekV4HCACompressor`,
`DeepseekV4CSACompressor`, `DeepseekV4Indexer`, `DeepseekV4Attention`, eager, no cache).

```python
attn = CompressedAttention(heads=4, head_dim=16, embd=48, q_rank=24, groups=2, group_rank=12, rate=4,
                           overlap=False, index=None, eps=1e-6, dtype=jnp.float32, key=key)
y = attn(x, tokens.sliding, tokens.positions, (cos, sin), angles)   # x: [batch, seq, 48] -> y: the same
```
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, final

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int, PRNGKeyArray

from port.nn._init import normal
from port.nn._mlp import linear
from port.nn._norm import rms_norm

Angles = Callable[[Array], tuple[Array, Array]]
"""positions `[batch, n]` -> the compressed RoPE's `(cos, sin)`, `[batch, n, rope_dim // 2]` each."""


def interleaved_rope(x: Array, cos: Array, sin: Array) -> Array:
    """Rotate the trailing `2 * cos.shape[-1]` features of `x` `[..., seq, heads, dim]` by
    consecutive pairs (DeepSeek-V4's interleaved RoPE), in float32, cast back to `x`'s dtype;
    `cos` / `sin` `[..., seq, rope_dim // 2]`."""
    half = cos.shape[-1]
    rest, rot = x[..., : -2 * half], x[..., -2 * half :].astype(jnp.float32)
    even, odd = rot[..., 0::2], rot[..., 1::2]
    c, s = cos[..., None, :].astype(jnp.float32), sin[..., None, :].astype(jnp.float32)
    rotated = jnp.stack((even * c - odd * s, odd * c + even * s), axis=-1).reshape(rot.shape)
    return jnp.concatenate((rest, rotated.astype(x.dtype)), axis=-1)


def unweighted_rms_norm(x: Array, eps: float) -> Array:
    """`x * rsqrt(mean(x^2) + eps)`, the statistic in float32, the product in `x`'s dtype."""
    h = x.astype(jnp.float32)
    return x * jax.lax.rsqrt(jnp.mean(h * h, axis=-1, keepdims=True) + eps).astype(x.dtype)


def visible(positions: Int[Array, "batch seq"], entries: int, rate: int) -> Bool[Array, "batch seq entries"]:
    """Which compressed entries each query may see: `w < (position + 1) // rate`."""
    return jnp.arange(entries)[None, None, :] < ((positions + 1) // rate)[:, :, None]


@final
class Compressor(eqx.Module):
    """Every `rate` tokens into one entry of `dim` features (two series per token with `overlap`).

    Leaves (transformers' names in the checkpoint): `wkv`, `wgate` `[series * dim, embed]`,
    `ape` `[rate, series * dim]` (float32), `norm` `[dim]`.
    """

    wkv: Float[Array, "comp_dim embed"]
    wgate: Float[Array, "comp_dim embed"]
    ape: Float[Array, "rate comp_dim"]
    norm: Float[Array, " head_dim"]
    rate: int = eqx.field(static=True)
    overlap: bool = eqx.field(static=True)
    eps: float = eqx.field(static=True)

    def __init__(self, *, embd: int, dim: int, rate: int, overlap: bool, eps: float, dtype: Any, key: PRNGKeyArray):
        kkv, kgate = jax.random.split(key)
        width = (2 if overlap else 1) * dim
        self.wkv, self.wgate = normal(kkv, (width, embd), dtype), normal(kgate, (width, embd), dtype)
        self.ape = jnp.zeros((rate, width), jnp.float32)
        self.norm = jnp.ones((dim,), jnp.float32)
        self.rate, self.overlap, self.eps = rate, overlap, eps

    def __call__(self, x: Float[Array, "batch seq embed"], angles: Angles) -> Float[Array, "batch entries head_dim"]:
        """The entries of the row's whole windows (`seq // rate` of them), rotated at their first slot."""
        batch, seq, _ = x.shape
        n, r, dim = seq // self.rate, self.rate, self.norm.shape[0]
        kv = linear(x[:, : n * r], self.wkv, None).reshape(batch, n, r, -1)
        gate = linear(x[:, : n * r], self.wgate, None).reshape(batch, n, r, -1) + self.ape
        if self.overlap:  # window w's second series, after window w - 1's first (none before window 0)
            first_kv = jnp.pad(kv[:, :-1, :, :dim], ((0, 0), (1, 0), (0, 0), (0, 0)))
            first_gate = jnp.pad(gate[:, :-1, :, :dim], ((0, 0), (1, 0), (0, 0), (0, 0)), constant_values=-jnp.inf)
            kv = jnp.concatenate((first_kv, kv[..., dim:]), axis=2)
            gate = jnp.concatenate((first_gate, gate[..., dim:]), axis=2)
        weights = jax.nn.softmax(gate.astype(jnp.float32), axis=2).astype(kv.dtype)
        pooled = rms_norm((kv * weights).sum(axis=2), self.norm, self.eps, float32_scale=True)
        cos, sin = angles(jnp.broadcast_to(jnp.arange(n) * r, (batch, n)))
        return interleaved_rope(pooled[:, :, None, :], cos, sin)[:, :, 0, :]


@final
class Indexer(eqx.Module):
    """The lightning indexer: scores every compressed entry for every query, keeps the top `topk`.

    Leaves: `compressor` (overlapping, `index_head_dim` features), `wq_b` `[index_heads *
    index_head_dim, q_rank]`, `weights_proj` `[index_heads, embed]`.
    """

    compressor: Compressor
    wq_b: Float[Array, "index_q q_rank"]
    weights_proj: Float[Array, "index_heads embed"]
    heads: int = eqx.field(static=True)
    topk: int = eqx.field(static=True)

    def __init__(
        self,
        *,
        embd: int,
        q_rank: int,
        heads: int,
        dim: int,
        rate: int,
        topk: int,
        eps: float,
        dtype: Any,
        key: PRNGKeyArray,
    ):
        kc, kq, kw = jax.random.split(key, 3)
        self.compressor = Compressor(embd=embd, dim=dim, rate=rate, overlap=True, eps=eps, dtype=dtype, key=kc)
        self.wq_b = normal(kq, (heads * dim, q_rank), dtype)
        self.weights_proj = normal(kw, (heads, embd), dtype)
        self.heads, self.topk = heads, topk

    def __call__(
        self,
        x: Float[Array, "batch seq embed"],
        q_latent: Float[Array, "batch seq q_rank"],
        positions: Int[Array, "batch seq"],
        angles: Angles,
    ) -> Bool[Array, "batch seq entries"]:
        """Which entries each query keeps: its `topk` best among those it may see."""
        keys = self.compressor(x, angles)
        batch, seq, _ = x.shape
        entries, dim = keys.shape[1], keys.shape[2]
        q = linear(q_latent, self.wq_b, None).reshape(batch, seq, self.heads, dim)
        q = interleaved_rope(q, *angles(positions))
        scores = jax.nn.relu(jnp.einsum("bshd,btd->bsht", q.astype(jnp.float32), keys.astype(jnp.float32)))
        weights = linear(x, self.weights_proj, None).astype(jnp.float32) * self.heads**-0.5
        scores = jnp.einsum("bsht,bsh->bst", scores * dim**-0.5, weights)
        allowed = visible(positions, entries, self.compressor.rate)
        scores = jnp.where(allowed, scores, -jnp.inf)
        _, best = jax.lax.top_k(scores, min(self.topk, entries))
        chosen = (
            jnp.zeros((batch, seq, entries), bool)
            .at[jnp.arange(batch)[:, None, None], jnp.arange(seq)[None, :, None], best]
            .set(True)
        )
        return chosen & allowed


@final
class CompressedAttention(eqx.Module):
    """DeepSeek-V4's attention (see the module docstring); `compressor` and `indexer` None as the
    layer type needs (sliding: neither; HCA: a compressor; CSA: both).

    **Arguments:** `heads`, `head_dim`, `embd`, `q_rank` (`q_lora_rank`), `groups` and
    `group_rank` (`o_groups`, `o_lora_rank`), `rate` (the compression rate; None: a sliding
    layer), `overlap` (CSA's overlapping windows), `index` (the indexer's `heads`, `dim` and
    `topk`; None: no indexer), `eps` (`rms_norm_eps`), `dtype`, `key`.

    Leaves: `wq_a` `[q_rank, embed]`, `q_norm` `[q_rank]`, `wq_b` `[heads, head_dim, q_rank]`,
    `wkv` `[head_dim, embed]`, `kv_norm` `[head_dim]`, `wo_a` `[groups, group_rank, heads / groups
    * head_dim]`, `wo_b` `[embed, groups * group_rank]`, `sinks` `[heads]` (float32).

    ```python
    attn = CompressedAttention(heads=4, head_dim=16, embd=48, q_rank=24, groups=2, group_rank=12, rate=4,
                               overlap=False, index=None, eps=1e-6, dtype=jnp.float32, key=key)
    y = attn(x, tokens.sliding, tokens.positions, (cos, sin), angles)   # x: [batch, seq, 48] -> y: the same
    ```
    """

    wq_a: Float[Array, "q_rank embed"]
    q_norm: Float[Array, " q_rank"]
    wq_b: Float[Array, "heads head_dim q_rank"]
    wkv: Float[Array, "head_dim embed"]
    kv_norm: Float[Array, " head_dim"]
    wo_a: Float[Array, "o_groups o_rank group_in"]
    wo_b: Float[Array, "embed o_in"]
    sinks: Float[Array, " heads"]
    compressor: Compressor | None
    indexer: Indexer | None
    eps: float = eqx.field(static=True)

    def __init__(
        self,
        *,
        heads: int,
        head_dim: int,
        embd: int,
        q_rank: int,
        groups: int,
        group_rank: int,
        rate: int | None,
        overlap: bool,
        index: dict[str, int] | None,
        eps: float,
        dtype: Any,
        key: PRNGKeyArray,
    ):
        """`rate` None: a sliding-window layer; `index` (`heads`, `dim`, `topk`): the CSA indexer's sizes."""
        ks = jax.random.split(key, 7)
        self.wq_a, self.q_norm = normal(ks[0], (q_rank, embd), dtype), jnp.ones((q_rank,), jnp.float32)
        self.wq_b = normal(ks[1], (heads, head_dim, q_rank), dtype)
        self.wkv, self.kv_norm = normal(ks[2], (head_dim, embd), dtype), jnp.ones((head_dim,), jnp.float32)
        self.wo_a = normal(ks[3], (groups, group_rank, heads * head_dim // groups), dtype)
        self.wo_b = normal(ks[4], (embd, groups * group_rank), dtype)
        self.sinks = jnp.zeros((heads,), jnp.float32)
        self.compressor = (
            None
            if rate is None
            else Compressor(embd=embd, dim=head_dim, rate=rate, overlap=overlap, eps=eps, dtype=dtype, key=ks[5])
        )
        self.indexer = (
            None
            if rate is None or index is None
            else Indexer(embd=embd, q_rank=q_rank, rate=rate, eps=eps, dtype=dtype, key=ks[6], **index)
        )
        self.eps = eps

    def __call__(
        self,
        x: Float[Array, "batch seq embed"],
        mask: Bool[Array, "batch seq keys"],
        positions: Int[Array, "batch seq"],
        rope: tuple[Array, Array],
        angles: Angles,
    ) -> Float[Array, "batch seq embed"]:
        """`mask`: the sliding window's; `rope`: this layer's `(cos, sin)` at `positions` (half
        size); `angles`: the compressed RoPE, for the entries and the indexer's queries."""
        batch, seq, _ = x.shape
        heads, head_dim = self.wq_b.shape[0], self.wq_b.shape[1]
        q_latent = rms_norm(linear(x, self.wq_a, None), self.q_norm, self.eps, float32_scale=True)
        q = unweighted_rms_norm(jnp.einsum("bsr,hdr->bshd", q_latent, self.wq_b), self.eps)
        q = interleaved_rope(q, *rope)
        kv = rms_norm(linear(x, self.wkv, None), self.kv_norm, self.eps, float32_scale=True)
        kv = interleaved_rope(kv[:, :, None, :], *rope)[:, :, 0, :]
        keys, allowed = kv, mask
        if self.compressor is not None and seq >= self.compressor.rate:
            entries = self.compressor(x, angles)
            seen = visible(positions, entries.shape[1], self.compressor.rate)
            if self.indexer is not None:
                seen = self.indexer(x, q_latent, positions, angles)
            keys = jnp.concatenate((kv, entries), axis=1)
            allowed = jnp.concatenate((mask, seen), axis=-1)
        scores = jnp.einsum("bshd,btd->bhst", q, keys) * jnp.asarray(head_dim**-0.5, q.dtype)
        scores = jnp.where(allowed[:, None], scores.astype(jnp.float32), jnp.finfo(jnp.float32).min)
        sinks = jnp.broadcast_to(self.sinks.astype(jnp.float32)[None, :, None, None], (batch, heads, seq, 1))
        probs = jax.nn.softmax(jnp.concatenate((scores, sinks), axis=-1), axis=-1)[..., :-1]
        out = jnp.einsum("bhst,btd->bshd", probs.astype(keys.dtype), keys)
        cos, sin = rope
        out = interleaved_rope(out, cos, -sin)
        grouped = out.reshape(batch, seq, self.wo_a.shape[0], -1)
        grouped = jnp.einsum("bsgi,gri->bsgr", grouped, self.wo_a).reshape(batch, seq, -1)
        return linear(grouped, self.wo_b, None)
