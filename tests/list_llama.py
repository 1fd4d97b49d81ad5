"""A Llama in Equinox that keeps its layers in a list (`layers: list[Block]`), for tests/test_scaffold_targets.py.

Its leaves are one per layer, `layers.0.attn.wq`, `layers.1.attn.wq`, ..., not stacked:
a mapping fills them with `{layer}` in the path. The attention keeps a heads axis
(`wq` [heads, head_dim, embed], reshaped from transformers' `q_proj`), the MLP is
`eqx.nn.Linear` (transformers' layout) and the unembedding is [embed, vocab]
(transformers' `lm_head` transposed). It knows port only by `from_config`.

```python
model = port.load(checkpoint, mapping="draft.toml")      # the draft's model = "list_llama:ListLlama"
logits = eqx.filter_jit(lambda m, ids: m(ids))(model, ids)
```
"""

from __future__ import annotations

from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp


def _rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps) * weight


def _rope(x: jax.Array, theta: float) -> jax.Array:
    """Rotary embedding of x [seq, heads, head_dim], halves rotated (transformers' `rotate_half`)."""
    half = x.shape[-1] // 2
    freq = 1.0 / theta ** (jnp.arange(half, dtype=jnp.float32) / half)
    angle = jnp.arange(x.shape[0], dtype=jnp.float32)[:, None] * freq
    cos, sin = jnp.cos(angle)[:, None], jnp.sin(angle)[:, None]
    x1, x2 = x[..., :half], x[..., half:]
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


class Attention(eqx.Module):
    wq: jax.Array  # [heads, head_dim, embed]
    wk: jax.Array  # [kv_heads, head_dim, embed]
    wv: jax.Array
    wo: jax.Array  # [embed, heads, head_dim]
    theta: float = eqx.field(static=True)

    def __call__(self, x: jax.Array) -> jax.Array:
        q = _rope(jnp.einsum("te,hde->thd", x, self.wq), self.theta)
        k = _rope(jnp.einsum("te,hde->thd", x, self.wk), self.theta)
        v = jnp.einsum("te,hde->thd", x, self.wv)
        repeat = q.shape[1] // k.shape[1]
        k, v = jnp.repeat(k, repeat, axis=1), jnp.repeat(v, repeat, axis=1)
        scores = jnp.einsum("qhd,khd->hqk", q, k) / jnp.sqrt(q.shape[-1])
        causal = jnp.tril(jnp.ones(scores.shape[1:], bool))
        weights = jax.nn.softmax(jnp.where(causal, scores, -jnp.inf), axis=-1)
        return jnp.einsum("ehd,qhd->qe", self.wo, jnp.einsum("hqk,khd->qhd", weights, v))


class Block(eqx.Module):
    attn_norm: jax.Array  # [embed]
    attn: Attention
    mlp_norm: jax.Array
    gate: eqx.nn.Linear  # weight [mlp, embed]
    up: eqx.nn.Linear
    down: eqx.nn.Linear
    eps: float = eqx.field(static=True)

    def __call__(self, x: jax.Array) -> jax.Array:
        x = x + self.attn(_rms_norm(x, self.attn_norm, self.eps))
        h = _rms_norm(x, self.mlp_norm, self.eps)
        return x + jax.vmap(self.down)(jax.nn.silu(jax.vmap(self.gate)(h)) * jax.vmap(self.up)(h))


class ListLlama(eqx.Module):
    embed: jax.Array  # [vocab, embed]
    layers: list[Block]
    norm: jax.Array
    unembed: jax.Array  # [embed, vocab]
    eps: float = eqx.field(static=True)

    @classmethod
    def from_config(cls, config: dict[str, Any], *, key: jax.Array) -> ListLlama:
        e, f, v = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
        h, kv, d = config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]
        eps, theta = config["rms_norm_eps"], config["rope_parameters"]["rope_theta"]

        def block(key: jax.Array) -> Block:
            k = jax.random.split(key, 7)
            attn = Attention(
                jax.random.normal(k[0], (h, d, e)),
                jax.random.normal(k[1], (kv, d, e)),
                jax.random.normal(k[2], (kv, d, e)),
                jax.random.normal(k[3], (e, h, d)),
                theta,
            )
            linear = lambda n_in, n_out, key: eqx.nn.Linear(n_in, n_out, use_bias=False, key=key)  # noqa: E731
            return Block(
                jnp.ones(e), attn, jnp.ones(e), linear(e, f, k[4]), linear(e, f, k[5]), linear(f, e, k[6]), eps
            )

        keys = jax.random.split(key, config["num_hidden_layers"] + 2)
        layers = [block(k) for k in keys[2:]]
        return cls(jax.random.normal(keys[0], (v, e)), layers, jnp.ones(e), jax.random.normal(keys[1], (e, v)), eps)

    def __call__(self, input_ids: jax.Array) -> jax.Array:
        """Logits [batch, seq, vocab] of token ids [batch, seq]."""

        def one(ids: jax.Array) -> jax.Array:
            x = self.embed[ids]
            for layer in self.layers:
                x = layer(x)
            return _rms_norm(x, self.norm, self.eps) @ self.unembed

        return jax.vmap(one)(input_ids)
