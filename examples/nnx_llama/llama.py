"""A small Llama in Flax NNX, written the way the Flax docs write one, for port's worked example.

Nothing here knows port: the layers live in an `nnx.List`, the constructor takes this
module's own config dataclass and `rngs`, and the parameters are annotated with logical
sharding names (`nnx.with_partitioning`). `build` is the factory a mapping names
(`model = "llama:build"`): it turns a Hugging Face `config.json` dict into `LlamaConfig`.

```python
model = port.load("ckpt/llama", mapping="examples/nnx_llama/llama.toml", mesh="4x2")
logits = nnx.jit(lambda m, ids: m(ids))(model, ids)
```
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    vocab_size: int
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    hidden_dim: int
    norm_eps: float
    rope_theta: float
    tie_embeddings: bool

    @classmethod
    def from_hf(cls, config: dict[str, Any]) -> LlamaConfig:
        heads = config["num_attention_heads"]
        rope = config.get("rope_parameters") or {}
        return cls(
            vocab_size=config["vocab_size"],
            dim=config["hidden_size"],
            n_layers=config["num_hidden_layers"],
            n_heads=heads,
            n_kv_heads=config.get("num_key_value_heads") or heads,
            head_dim=config.get("head_dim") or config["hidden_size"] // heads,
            hidden_dim=config["intermediate_size"],
            norm_eps=config["rms_norm_eps"],
            rope_theta=rope.get("rope_theta", config.get("rope_theta", 10000.0)),
            tie_embeddings=bool(config.get("tie_word_embeddings", False)),
        )


def _dense(n_in: int, n_out: int, axes: tuple[str, str], rngs: nnx.Rngs) -> nnx.Linear:
    init = nnx.with_partitioning(nnx.initializers.lecun_normal(), axes)
    return nnx.Linear(n_in, n_out, use_bias=False, kernel_init=init, rngs=rngs)


class RMSNorm(nnx.Module):
    def __init__(self, dim: int, eps: float):
        self.scale = nnx.Param(jnp.ones((dim,)), out_sharding=("embed",))
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return (normed * self.scale[...].astype(jnp.float32)).astype(x.dtype)


def rope(x: jax.Array, positions: jax.Array, theta: float) -> jax.Array:
    """Rotary embedding, halves rotated (transformers' `rotate_half`): x is [batch, seq, heads, head_dim]."""
    half = x.shape[-1] // 2
    freq = 1.0 / theta ** (jnp.arange(half, dtype=jnp.float32) / half)
    angle = positions[..., None].astype(jnp.float32) * freq  # [batch, seq, half]
    cos, sin = jnp.cos(angle)[:, :, None, :], jnp.sin(angle)[:, :, None, :]
    x1, x2 = x[..., :half].astype(jnp.float32), x[..., half:].astype(jnp.float32)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


class Attention(nnx.Module):
    def __init__(self, cfg: LlamaConfig, rngs: nnx.Rngs):
        self.cfg = cfg
        self.q_proj = _dense(cfg.dim, cfg.n_heads * cfg.head_dim, ("embed", "heads"), rngs)
        self.k_proj = _dense(cfg.dim, cfg.n_kv_heads * cfg.head_dim, ("embed", "kv_heads"), rngs)
        self.v_proj = _dense(cfg.dim, cfg.n_kv_heads * cfg.head_dim, ("embed", "kv_heads"), rngs)
        self.o_proj = _dense(cfg.n_heads * cfg.head_dim, cfg.dim, ("heads", "embed"), rngs)

    def __call__(self, x: jax.Array, positions: jax.Array, mask: jax.Array) -> jax.Array:
        cfg = self.cfg
        b, t, _ = x.shape
        q = rope(self.q_proj(x).reshape(b, t, cfg.n_heads, cfg.head_dim), positions, cfg.rope_theta)
        k = rope(self.k_proj(x).reshape(b, t, cfg.n_kv_heads, cfg.head_dim), positions, cfg.rope_theta)
        v = self.v_proj(x).reshape(b, t, cfg.n_kv_heads, cfg.head_dim)
        repeat = cfg.n_heads // cfg.n_kv_heads
        k, v = jnp.repeat(k, repeat, axis=2), jnp.repeat(v, repeat, axis=2)
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k).astype(jnp.float32) / jnp.sqrt(cfg.head_dim)
        scores = jnp.where(mask[:, None], scores, jnp.finfo(jnp.float32).min)
        weights = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
        out = jnp.einsum("bhqk,bkhd->bqhd", weights, v).reshape(b, t, cfg.n_heads * cfg.head_dim)
        return self.o_proj(out)


class MLP(nnx.Module):
    def __init__(self, cfg: LlamaConfig, rngs: nnx.Rngs):
        self.gate_proj = _dense(cfg.dim, cfg.hidden_dim, ("embed", "mlp"), rngs)
        self.up_proj = _dense(cfg.dim, cfg.hidden_dim, ("embed", "mlp"), rngs)
        self.down_proj = _dense(cfg.hidden_dim, cfg.dim, ("mlp", "embed"), rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.down_proj(jax.nn.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nnx.Module):
    def __init__(self, cfg: LlamaConfig, rngs: nnx.Rngs):
        self.attn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attn = Attention(cfg, rngs)
        self.mlp_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.mlp = MLP(cfg, rngs)

    def __call__(self, x: jax.Array, positions: jax.Array, mask: jax.Array) -> jax.Array:
        x = x + self.attn(self.attn_norm(x), positions, mask)
        return x + self.mlp(self.mlp_norm(x))


class Llama(nnx.Module):
    def __init__(self, cfg: LlamaConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        embed_init = nnx.with_partitioning(nnx.initializers.normal(0.02), ("vocab", "embed"))
        self.embed = nnx.Embed(cfg.vocab_size, cfg.dim, embedding_init=embed_init, rngs=rngs)
        self.layers = nnx.List([Block(cfg, rngs) for _ in range(cfg.n_layers)])
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.lm_head = None if cfg.tie_embeddings else _dense(cfg.dim, cfg.vocab_size, ("embed", "vocab"), rngs)

    def __call__(self, input_ids: jax.Array, attention_mask: jax.Array | None = None) -> jax.Array:
        b, t = input_ids.shape
        mask = jnp.ones((b, t), bool) if attention_mask is None else attention_mask.astype(bool)
        positions = jnp.maximum(jnp.cumsum(mask, axis=-1) - 1, 0)
        causal = jnp.tril(jnp.ones((t, t), bool))[None] & mask[:, None, :]
        x = self.embed(input_ids)
        for layer in self.layers:
            x = layer(x, positions, causal)
        x = self.norm(x)
        if self.lm_head is None:
            return self.embed.attend(x)
        return self.lm_head(x)


def build(config: dict[str, Any]) -> Llama:
    """The factory port's mapping names: a Hugging Face `config.json` dict in, the module out."""
    return Llama(LlamaConfig.from_hf(config), rngs=nnx.Rngs(0))
