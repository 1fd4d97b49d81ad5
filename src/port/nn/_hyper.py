"""Manifold-constrained hyper-connections (mHC, DeepSeek-V4): `hc` residual streams instead of one.

The residual is `[batch, seq, hc, embed]`. Before a branch (attention or feed-forward)
`HyperConnection` computes, from the flattened RMS-normalised streams and one learned
projection, three weights: `pre` collapses the streams into the branch's input, `post`
spreads its output back over them, and `comb` (a matrix made doubly stochastic by
Sinkhorn-Knopp iterations) mixes the streams into themselves:
`streams' = post * out + comb^T @ streams`. `HyperHead` collapses the streams once more
before the final norm. Everything as transformers' `DeepseekV4HyperConnection` /
`DeepseekV4HyperHead`: the weights in float32, the streams mixed in their own dtype.

```python
hc = HyperConnection(streams=4, embd=64, iterations=20, eps=1e-6, norm_eps=1e-6, key=key)
post, comb, collapsed = hc(x)             # x: [batch, seq, 4, 64] -> collapsed [batch, seq, 64]
x = hc.mix(x, branch(collapsed), post, comb)
```
"""

from __future__ import annotations

from typing import final

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, PRNGKeyArray

from port.nn._init import normal


def _flat_norm(streams: Array, eps: float) -> Array:
    """The streams flattened to `[..., hc * embed]` in float32, RMS-normalised (no weight)."""
    flat = streams.reshape(*streams.shape[:-2], -1).astype(jnp.float32)
    return flat * jax.lax.rsqrt(jnp.mean(flat * flat, axis=-1, keepdims=True) + eps)


def _collapse(pre: Array, streams: Array) -> Array:
    """`sum_n pre[n] * streams[n]`, computed in float32, in the streams' dtype."""
    return (pre[..., None] * streams).sum(axis=-2).astype(streams.dtype)


@final
class HyperConnection(eqx.Module):
    """The mHC weights around one branch. Leaves: `fn` `[(2 + hc) * hc, hc * embed]`, `base`
    `[(2 + hc) * hc]`, `scale` `[3]` (transformers' `hc_attn_fn` / `hc_attn_base` / `hc_attn_scale`).

    **Arguments:** `streams` (`hc_mult`), `embd`, `iterations` (`hc_sinkhorn_iters`), `eps`
    (`hc_eps`), `norm_eps` (`rms_norm_eps`, the streams' normalisation), `key`; the leaves
    are float32, as transformers keeps them.

    ```python
    hc = HyperConnection(streams=4, embd=64, iterations=20, eps=1e-6, norm_eps=1e-6, key=key)
    post, comb, collapsed = hc(x)             # x: [batch, seq, 4, 64] -> collapsed [batch, seq, 64]
    x = hc.mix(x, branch(collapsed), post, comb)
    ```
    """

    fn: Float[Array, "hc_mix hc_embed"]
    base: Float[Array, " hc_mix"]
    scale: Float[Array, " hc_scale"]
    streams: int = eqx.field(static=True)
    iterations: int = eqx.field(static=True)
    eps: float = eqx.field(static=True)
    norm_eps: float = eqx.field(static=True)

    def __init__(self, *, streams: int, embd: int, iterations: int, eps: float, norm_eps: float, key: PRNGKeyArray):
        mixes = (2 + streams) * streams
        self.fn = normal(key, (mixes, streams * embd), jnp.float32)
        self.base = jnp.zeros((mixes,), jnp.float32)
        self.scale = jnp.ones((3,), jnp.float32)
        self.streams, self.iterations, self.eps, self.norm_eps = streams, iterations, eps, norm_eps

    def __call__(
        self, streams: Float[Array, "*batch hc embed"]
    ) -> tuple[Float[Array, "*batch hc"], Float[Array, "*batch hc hc"], Float[Array, "*batch embed"]]:
        """`(post, comb, collapsed)`: the weights (float32) and the branch's input."""
        n = self.streams
        mixes = _flat_norm(streams, self.norm_eps) @ self.fn.astype(jnp.float32).T
        pre_w, post_w, comb_w = mixes[..., :n], mixes[..., n : 2 * n], mixes[..., 2 * n :]
        base, scale = self.base.astype(jnp.float32), self.scale.astype(jnp.float32)
        pre = jax.nn.sigmoid(pre_w * scale[0] + base[:n]) + self.eps
        post = 2 * jax.nn.sigmoid(post_w * scale[1] + base[n : 2 * n])
        comb_w = comb_w.reshape(*comb_w.shape[:-1], n, n)
        comb = jax.nn.softmax(comb_w * scale[2] + base[2 * n :].reshape(n, n), axis=-1) + self.eps
        comb = comb / (comb.sum(axis=-2, keepdims=True) + self.eps)
        for _ in range(self.iterations - 1):  # Sinkhorn-Knopp: rows, then columns, sum to 1
            comb = comb / (comb.sum(axis=-1, keepdims=True) + self.eps)
            comb = comb / (comb.sum(axis=-2, keepdims=True) + self.eps)
        return post, comb, _collapse(pre, streams)

    @staticmethod
    def mix(
        streams: Float[Array, "*batch hc embed"],
        out: Float[Array, "*batch embed"],
        post: Float[Array, "*batch hc"],
        comb: Float[Array, "*batch hc hc"],
    ) -> Float[Array, "*batch hc embed"]:
        """The new streams: `post * out` plus the streams mixed by `comb` (transposed), in their dtype."""
        dtype = streams.dtype
        mixed = jnp.einsum("...jk,...jd->...kd", comb.astype(dtype), streams)
        return post.astype(dtype)[..., None] * out[..., None, :] + mixed


@final
class HyperHead(eqx.Module):
    """The last collapse of the streams, before the final norm. Leaves: `fn` `[hc, hc * embed]`,
    `base` `[hc]`, `scale` `[1]` (transformers' `hc_head.hc_fn` / `hc_base` / `hc_scale`).

    **Arguments:** `streams` (`hc_mult`), `embd`, `eps` (`hc_eps`), `norm_eps` (`rms_norm_eps`), `key`.

    ```python
    head = HyperHead(streams=4, embd=64, eps=1e-6, norm_eps=1e-6, key=key)
    x = head(streams)                         # [batch, seq, 4, 64] -> [batch, seq, 64]
    ```
    """

    fn: Float[Array, "hc hc_embed"]
    base: Float[Array, " hc"]
    scale: Float[Array, " scalar"]
    eps: float = eqx.field(static=True)
    norm_eps: float = eqx.field(static=True)

    def __init__(self, *, streams: int, embd: int, eps: float, norm_eps: float, key: PRNGKeyArray):
        self.fn = normal(key, (streams, streams * embd), jnp.float32)
        self.base = jnp.zeros((streams,), jnp.float32)
        self.scale = jnp.ones((1,), jnp.float32)
        self.eps, self.norm_eps = eps, norm_eps

    def __call__(self, streams: Float[Array, "*batch hc embed"]) -> Float[Array, "*batch embed"]:
        mixes = _flat_norm(streams, self.norm_eps) @ self.fn.astype(jnp.float32).T
        pre = jax.nn.sigmoid(mixes * self.scale.astype(jnp.float32) + self.base.astype(jnp.float32)) + self.eps
        return _collapse(pre, streams)
