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
  keeps the `index_topk` best entries per query, and the query attends to those alone,
  gathered (its cost follows `index_topk`, not the number of entries; only the indexer's
  scores see every entry). Where fewer than `index_topk` are visible, the hidden ones
  chosen besides stay hidden (zero weight).

A query at position `p` sees the entries `w < (p + 1) // rate`; windows are counted in
slots from the start of the row, as transformers counts them (`DeepseekV4HCACompressor`,
`DeepseekV4CSACompressor`, `DeepseekV4Indexer`, `DeepseekV4Attention`, eager). With a cache
(`CompressedAttention.cached`), each compressor keeps the projections of its last whole
window's and unfinished window's slots and every entry made so far, in fixed-size buffers
(`Compressor.empty_state`, `Compressor.step`).

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


def gather(entries: Float[Array, "batch entries dim"], chosen: Int[Array, "batch seq top"]) -> Array:
    """Each query's `chosen` entries, `[batch, seq, top, dim]`."""
    return jax.vmap(lambda a, i: a[i])(entries, chosen)


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

    def project(self, x: Float[Array, "batch seq embed"]) -> tuple[Array, Array]:
        """Each token's `(kv, gate)`, `[batch, seq, series * dim]` each (the gate without `ape`):
        what the cache keeps of the slots of unfinished windows."""
        return linear(x, self.wkv, None), linear(x, self.wgate, None)

    def pool(
        self, kv: Array, gate: Array, first: Int[Array, ""] | int, angles: Angles
    ) -> Float[Array, "batch entries head_dim"]:
        """The entries of windows `first, first + 1, ...` from `project`'s `(kv, gate)` of their
        slots after one window before them (`[batch, (entries + 1) * rate, ...]`; with
        `overlap`, its first series is read, its gate -inf where there is none), each rotated at
        its first slot."""
        batch, r, dim = kv.shape[0], self.rate, self.norm.shape[0]
        n = kv.shape[1] // r - 1
        kv = kv.reshape(batch, n + 1, r, -1)
        gate = gate.reshape(batch, n + 1, r, -1) + self.ape
        if self.overlap:  # window w's second series, after window w - 1's first
            kv = jnp.concatenate((kv[:, :-1, :, :dim], kv[:, 1:, :, dim:]), axis=2)
            gate = jnp.concatenate((gate[:, :-1, :, :dim], gate[:, 1:, :, dim:]), axis=2)
        else:
            kv, gate = kv[:, 1:], gate[:, 1:]
        weights = jax.nn.softmax(gate.astype(jnp.float32), axis=2).astype(kv.dtype)
        pooled = rms_norm((kv * weights).sum(axis=2), self.norm, self.eps, float32_scale=True)
        cos, sin = angles(jnp.broadcast_to((first + jnp.arange(n)) * r, (batch, n)))
        return interleaved_rope(pooled[:, :, None, :], cos, sin)[:, :, 0, :]

    def __call__(self, x: Float[Array, "batch seq embed"], angles: Angles) -> Float[Array, "batch entries head_dim"]:
        """The entries of the row's whole windows (`seq // rate` of them), rotated at their first slot."""
        n = x.shape[1] // self.rate
        kv, gate = self.project(x[:, : n * self.rate])
        before = ((0, 0), (self.rate, 0), (0, 0))  # no window before the first
        return self.pool(jnp.pad(kv, before), jnp.pad(gate, before, constant_values=-jnp.inf), 0, angles)

    def empty_state(self, batch: int, length: int, dtype: Any) -> dict[str, Array]:
        """An empty cache of this compressor: the `(kv, gate)` of the last whole window and the
        unfinished one (`[batch, 2 * rate, series * dim]`; no window before the first: gate
        -inf) and room for every entry `length` slots make (`[batch, max(length // rate, 1), dim]`)."""
        width = self.wkv.shape[-2]  # [-2] and [-1]: also for a stack's (one layer's sizes)
        gate = jnp.zeros((batch, 2 * self.rate, width), dtype).at[:, : self.rate].set(-jnp.inf)
        entries = jnp.zeros((batch, max(length // self.rate, 1), self.norm.shape[-1]), dtype)
        return {"kv": jnp.zeros((batch, 2 * self.rate, width), dtype), "gate": gate, "entries": entries}

    def step(
        self, x: Float[Array, "batch seq embed"], state: dict[str, Array], start: Int[Array, ""], angles: Angles
    ) -> dict[str, Array]:
        """`state` after the tokens `x` at slots `start, start + 1, ...`: every window they
        finish pooled into `entries`, the slots of the last whole window and the unfinished
        one kept (fixed sizes: one compile per `x` shape)."""
        batch, seq, _ = x.shape
        r = self.rate
        window = start // r  # the unfinished window; state["kv"] holds it after the one before
        size = r * (3 + -(-seq // r))
        kv, gate = self.project(x)
        run_kv = jnp.zeros((batch, size, kv.shape[-1]), state["kv"].dtype).at[:, : 2 * r].set(state["kv"])
        run_gate = jnp.zeros((batch, size, kv.shape[-1]), state["gate"].dtype).at[:, : 2 * r].set(state["gate"])
        run_kv = jax.lax.dynamic_update_slice_in_dim(run_kv, kv.astype(run_kv.dtype), r + start % r, axis=1)
        run_gate = jax.lax.dynamic_update_slice_in_dim(run_gate, gate.astype(run_gate.dtype), r + start % r, axis=1)
        made = self.pool(run_kv, run_gate, window, angles)
        index = window + jnp.arange(made.shape[1])
        finished = (index + 1) * r <= start + seq
        entries = state["entries"]
        entries = entries.at[:, jnp.where(finished, index, entries.shape[1])].set(
            made.astype(entries.dtype), mode="drop"
        )
        keep = ((start + seq) // r - window) * r  # from the last whole window on
        return {
            "kv": jax.lax.dynamic_slice_in_dim(run_kv, keep, 2 * r, axis=1),
            "gate": jax.lax.dynamic_slice_in_dim(run_gate, keep, 2 * r, axis=1),
            "entries": entries,
        }


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
    ) -> tuple[Int[Array, "batch seq top"], Bool[Array, "batch seq top"]]:
        """Which entries each query keeps: its `topk` best among those it may see (see `select`)."""
        keys = self.compressor(x, angles)
        return self.select(
            x, q_latent, positions, keys, visible(positions, keys.shape[1], self.compressor.rate), angles
        )

    def select(
        self,
        x: Float[Array, "batch seq embed"],
        q_latent: Float[Array, "batch seq q_rank"],
        positions: Int[Array, "batch seq"],
        keys: Float[Array, "batch entries index_dim"],
        allowed: Bool[Array, "batch seq entries"],
        angles: Angles,
    ) -> tuple[Int[Array, "batch seq top"], Bool[Array, "batch seq top"]]:
        """The `min(topk, entries)` best of the compressed `keys` each query is `allowed`:
        their indices into `keys`' axis 1, and whether each is allowed (those that are not
        are chosen only where fewer are allowed than `topk`)."""
        batch, seq, _ = x.shape
        entries, dim = keys.shape[1], keys.shape[2]
        q = linear(q_latent, self.wq_b, None).reshape(batch, seq, self.heads, dim)
        q = interleaved_rope(q, *angles(positions))
        scores = jax.nn.relu(jnp.einsum("bshd,btd->bsht", q.astype(jnp.float32), keys.astype(jnp.float32)))
        weights = linear(x, self.weights_proj, None).astype(jnp.float32) * self.heads**-0.5
        scores = jnp.einsum("bsht,bsh->bst", scores * dim**-0.5, weights)
        scores = jnp.where(allowed, scores, -jnp.inf)
        _, best = jax.lax.top_k(scores, min(self.topk, entries))
        return best, jnp.take_along_axis(allowed, best, axis=-1)


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
        q_latent, q, kv = self.queries_and_keys(x, rope)
        keys, allowed = kv, mask
        if self.compressor is not None and x.shape[1] >= self.compressor.rate:
            entries = self.compressor(x, angles)
            if self.indexer is not None:
                chosen, seen = self.indexer(x, q_latent, positions, angles)
                return self.attend(q, kv, mask, rope, (gather(entries, chosen), seen))
            keys = jnp.concatenate((kv, entries), axis=1)
            allowed = jnp.concatenate((mask, visible(positions, entries.shape[1], self.compressor.rate)), axis=-1)
        return self.attend(q, keys, allowed, rope)

    def empty_state(self, batch: int, length: int, dtype: Any) -> dict[str, dict[str, Array]]:
        """The cache of this layer besides its sliding keys: each compressor's (see
        `Compressor.empty_state`), by name (`compressor`, `indexer`; none on a sliding layer)."""
        state = {}
        if self.compressor is not None:
            state["compressor"] = self.compressor.empty_state(batch, length, dtype)
        if self.indexer is not None:
            state["indexer"] = self.indexer.compressor.empty_state(batch, length, dtype)
        return state

    def cached(
        self,
        x: Float[Array, "batch seq embed"],
        mask: Bool[Array, "batch seq length"],
        positions: Int[Array, "batch seq"],
        rope: tuple[Array, Array],
        angles: Angles,
        keys: Float[Array, "batch length head_dim"],
        state: dict[str, dict[str, Array]],
        start: Int[Array, ""],
    ) -> tuple[Float[Array, "batch seq embed"], Array, dict[str, dict[str, Array]]]:
        """As a call, with a cache: the tokens `x` take slots `start, start + 1, ...`; `mask`
        over the cache's `keys` (`[batch, length, head_dim]`, the sliding keys, every slot
        kept) and `state` (`empty_state`). Returns the output, the keys and the state after
        `x`. The entries a query sees, as transformers' `DeepseekV4HCACache` /
        `DeepseekV4CSACache` give them: those of windows finished by its call's slots and
        `w < (position + 1) // rate`, or every finished one for a single heavily compressed
        token; the indexer picks among the former."""
        q_latent, q, kv = self.queries_and_keys(x, rope)
        keys = jax.lax.dynamic_update_slice_in_dim(keys, kv.astype(keys.dtype), start, axis=1)
        every, allowed = keys, mask
        if self.compressor is not None:
            state = dict(state)
            rate, seq = self.compressor.rate, x.shape[1]
            state["compressor"] = self.compressor.step(x, state["compressor"], start, angles)
            entries = state["compressor"]["entries"]
            finished = jnp.arange(entries.shape[1]) < (start + seq) // rate
            seen = visible(positions, entries.shape[1], rate) & finished
            if self.indexer is not None:
                state["indexer"] = self.indexer.compressor.step(x, state["indexer"], start, angles)
                chosen, kept = self.indexer.select(x, q_latent, positions, state["indexer"]["entries"], seen, angles)
                picked = (gather(entries.astype(keys.dtype), chosen).astype(q.dtype), kept)
                return self.attend(q, keys.astype(q.dtype), mask, rope, picked), keys, state
            if seq == 1:  # transformers' single token sees every finished window
                seen = jnp.broadcast_to(finished, seen.shape)
            every = jnp.concatenate((keys, entries.astype(keys.dtype)), axis=1)
            allowed = jnp.concatenate((mask, seen), axis=-1)
        return self.attend(q, every.astype(q.dtype), allowed, rope), keys, state

    def queries_and_keys(
        self, x: Float[Array, "batch seq embed"], rope: tuple[Array, Array]
    ) -> tuple[Array, Array, Array]:
        """The query latent (the indexer reads it), the rotated queries `[batch, seq, heads,
        head_dim]` and the rotated shared key/value `[batch, seq, head_dim]`."""
        q_latent = rms_norm(linear(x, self.wq_a, None), self.q_norm, self.eps, float32_scale=True)
        q = unweighted_rms_norm(jnp.einsum("bsr,hdr->bshd", q_latent, self.wq_b), self.eps)
        q = interleaved_rope(q, *rope)
        kv = rms_norm(linear(x, self.wkv, None), self.kv_norm, self.eps, float32_scale=True)
        kv = interleaved_rope(kv[:, :, None, :], *rope)[:, :, 0, :]
        return q_latent, q, kv

    def attend(
        self,
        q: Array,
        keys: Float[Array, "batch keys head_dim"],
        allowed: Bool[Array, "batch seq keys"],
        rope: tuple[Array, Array],
        picked: tuple[Float[Array, "batch seq top head_dim"], Bool[Array, "batch seq top"]] | None = None,
    ) -> Float[Array, "batch seq embed"]:
        """Attention over `keys` (which are the values) where `allowed`, and over each query's
        own `picked` entries (gathered, and whether each is allowed) in the same softmax, with
        the sinks, the conjugate rotation and the grouped output projection."""
        batch, seq, heads, head_dim = q.shape
        scale, low = jnp.asarray(head_dim**-0.5, q.dtype), jnp.finfo(jnp.float32).min
        scores = jnp.einsum("bshd,btd->bhst", q, keys) * scale
        scores = jnp.where(allowed[:, None], scores.astype(jnp.float32), low)
        sinks = jnp.broadcast_to(self.sinks.astype(jnp.float32)[None, :, None, None], (batch, heads, seq, 1))
        if picked is None:
            probs = jax.nn.softmax(jnp.concatenate((scores, sinks), axis=-1), axis=-1)[..., :-1]
            out = jnp.einsum("bhst,btd->bshd", probs.astype(keys.dtype), keys)
        else:
            entries, kept = picked
            own = jnp.einsum("bshd,bskd->bhsk", q, entries) * scale
            own = jnp.where(kept[:, None], own.astype(jnp.float32), low)
            probs = jax.nn.softmax(jnp.concatenate((scores, own, sinks), axis=-1), axis=-1)
            # the values in `keys`' dtype, summed in float32 (one rounding, as one product would)
            f32, n, weights = jnp.float32, keys.shape[1], probs.astype(keys.dtype).astype(jnp.float32)
            out = jnp.einsum("bhst,btd->bshd", weights[..., :n], keys.astype(f32))
            own_out = jnp.einsum("bhsk,bskd->bshd", weights[..., n:-1], entries.astype(f32))
            out = (out + own_out).astype(keys.dtype)
        cos, sin = rope
        out = interleaved_rope(out, cos, -sin)
        grouped = out.reshape(batch, seq, self.wo_a.shape[0], -1)
        grouped = jnp.einsum("bsgi,gri->bsgr", grouped, self.wo_a).reshape(batch, seq, -1)
        return linear(grouped, self.wo_b, None)
