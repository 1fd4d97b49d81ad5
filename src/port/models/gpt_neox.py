"""GPT-NeoX and Pythia (decoder-only, LayerNorm, partial RoPE, parallel residual) as an Equinox model.

The fused `query_key_value` projection of GPT-NeoX interleaves its rows per head (for
each head: its query rows, then its key rows, then its value rows), so port keeps it
fused, one leaf `[heads, 3, head_dim, embed]`: a device holding some heads reads exactly
those heads' rows, q, k and v together. The transformer blocks are stored *stacked*:
every array in `GPTNeoX.blocks` has a leading axis of size `num_hidden_layers`, and the
forward pass runs them with `jax.lax.scan`.

Only the first `rotary_ndims` of each head get rotary embeddings (NeoX-style
`rotate_half`), from `rotary_pct` / `rotary_emb_base` (transformers 4) or
`rope_parameters.partial_rotary_factor` / `rope_theta` (transformers 5). The dtype of
the parameters is the compute dtype (bfloat16 params: bfloat16 compute, with LayerNorm
statistics and the attention softmax in float32, as in transformers).

Example:
    ```python
    import equinox as eqx
    import jax
    import jax.numpy as jnp
    from port.models.gpt_neox import GPTNeoX

    config = {"model_type": "gpt_neox", "vocab_size": 50304, "hidden_size": 2048,
              "intermediate_size": 8192, "num_hidden_layers": 24,
              "num_attention_heads": 16, "rotary_pct": 0.25, "rotary_emb_base": 10000}
    model = GPTNeoX.from_config(config, key=jax.random.key(0), dtype=jnp.bfloat16)
    logits = eqx.filter_jit(model)(jnp.zeros((1, 8), dtype=jnp.int32))
    # logits.shape == (1, 8, 50304); without the batch axis, (8,) ids give (8, 50304)

    # Shapes only, no memory allocated (e.g. before loading a checkpoint):
    abstract = eqx.filter_eval_shape(GPTNeoX.from_config, config, key=jax.random.key(0))
    ```
"""

from __future__ import annotations

import dataclasses
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Float, Int, PRNGKeyArray

from port._console import quoted
from port._errors import ConfigError
from port.models._config import ACTIVATIONS, MAX_LAYERS, activation, check, get
from port.models._inputs import check_ids, per_sequence

MODEL_TYPES = ("gpt_neox",)


def _rope(config: dict) -> tuple[str, float, float]:
    """(the key holding the RoPE settings, rope_theta, partial_rotary_factor), as transformers 5.23 reads them.

    `rope_scaling`, else `rope_parameters` (transformers 5); the theta and factor they
    lack come from `rotary_emb_base` and `rotary_pct` (transformers 4), else 10000 and
    0.25. Top-level `rope_theta` / `partial_rotary_factor` are not read (nor are they
    by transformers' GPTNeoXConfig).
    """
    key = "rope_scaling" if config.get("rope_scaling") else "rope_parameters"
    rope = config.get(key) or {}
    if not isinstance(rope, dict) or any(isinstance(v, dict) for v in rope.values()):
        raise ConfigError(
            f"config.json: {key!r} must be one flat dict (per-layer-type RoPE is not supported), got {quoted(rope)}"
        )
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type != "default":
        raise ConfigError(f"config.json: {key}: rope type {quoted(rope_type)} is not supported (supported: default)")
    theta = rope.get("rope_theta")
    if theta is None:
        theta = get(config, "rotary_emb_base", float, 10000.0)
    else:
        theta = check(f"{key}.rope_theta", theta, float)
    factor = rope.get("partial_rotary_factor")
    name = f"{key}.partial_rotary_factor"
    if factor is None:
        factor, name = config.get("rotary_pct", 0.25), "rotary_pct"
    if not isinstance(factor, (int, float)) or isinstance(factor, bool) or not 0 <= factor <= 1:
        raise ConfigError(f"config.json: {name!r} must be a number from 0 to 1, got {quoted(factor)}")
    return key, theta, float(factor)


@dataclasses.dataclass(frozen=True)
class GPTNeoXConfig:
    """The hyperparameters of a GPT-NeoX model, as read from a Hugging Face config.json."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    layer_norm_eps: float = 1e-5
    hidden_act: str = "gelu"
    use_parallel_residual: bool = True
    attention_bias: bool = True  # query_key_value and dense
    tie_word_embeddings: bool = False
    rope_theta: float = 10000.0
    partial_rotary_factor: float = 0.25

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @classmethod
    def from_hf(cls, config: dict) -> GPTNeoXConfig:
        """Build from a Hugging Face `config.json` dict; raises `ConfigError` if unsupported."""
        model_type = config.get("model_type", "gpt_neox")
        if model_type not in MODEL_TYPES:
            raise ConfigError(
                f"config.json: 'model_type' {quoted(model_type)} is not supported by "
                f"port.models.gpt_neox (supported: {', '.join(MODEL_TYPES)})"
            )
        hidden = get(config, "hidden_size", int)
        heads = get(config, "num_attention_heads", int)
        if hidden % heads != 0:
            raise ConfigError(
                f"config.json: 'hidden_size' ({hidden}) must be divisible by 'num_attention_heads' ({heads})"
            )
        head_dim = config.get("head_dim")
        if head_dim is not None and head_dim != hidden // heads:
            raise ConfigError(
                f"config.json: 'head_dim' {quoted(head_dim)} is not supported: GPT-NeoX heads are "
                f"hidden_size // num_attention_heads ({hidden // heads})"
            )
        _, theta, factor = _rope(config)
        return cls(
            vocab_size=get(config, "vocab_size", int),
            hidden_size=hidden,
            intermediate_size=get(config, "intermediate_size", int),
            num_hidden_layers=get(config, "num_hidden_layers", int, maximum=MAX_LAYERS),
            num_attention_heads=heads,
            layer_norm_eps=get(config, "layer_norm_eps", float, 1e-5),
            hidden_act=activation(config, "hidden_act", "gelu"),
            use_parallel_residual=get(config, "use_parallel_residual", bool, True),
            attention_bias=get(config, "attention_bias", bool, True),
            tie_word_embeddings=get(config, "tie_word_embeddings", bool, False),
            rope_theta=theta,
            partial_rotary_factor=factor,
        )

    def inv_freq(self) -> np.ndarray:
        """RoPE inverse frequencies in float32, as transformers computes them.

        Over `dim = int(head_dim * partial_rotary_factor)`; the rotated dimensions of
        each head are the first `2 * len(inv_freq)` (dim rounded up to even).
        """
        dim = int(self.head_dim * self.partial_rotary_factor)
        exponents = np.arange(0, dim, 2).astype(np.float32) / np.float32(dim if dim else 1)
        return (np.float32(1.0) / np.float32(self.rope_theta) ** exponents).astype(np.float32)


def _normal(key: PRNGKeyArray, shape: tuple[int, ...], dtype: Any) -> Array:
    return 0.02 * jax.random.normal(key, shape, dtype)


def _zeros_if(flag: bool, shape: tuple[int, ...], dtype: Any) -> Array | None:
    return jnp.zeros(shape, dtype) if flag else None


class LayerNorm(eqx.Module):
    """transformers' `nn.LayerNorm` over the last axis: statistics in float32, cast back."""

    weight: Float[Array, " embd"]
    bias: Float[Array, " embd"]

    def __init__(self, size: int, dtype: Any):
        self.weight = jnp.ones((size,), dtype)
        self.bias = jnp.zeros((size,), dtype)

    def __call__(self, x: Float[Array, "seq embd"], eps: float) -> Float[Array, "seq embd"]:
        h = x.astype(jnp.float32)
        mean = jnp.mean(h, axis=-1, keepdims=True)
        var = jnp.mean(jnp.square(h - mean), axis=-1, keepdims=True)
        h = (h - mean) * jax.lax.rsqrt(var + eps)
        return (h * self.weight.astype(jnp.float32) + self.bias.astype(jnp.float32)).astype(x.dtype)


def _rotate_half(x: Array) -> Array:
    x1, x2 = jnp.split(x, 2, axis=-1)
    return jnp.concatenate((-x2, x1), axis=-1)


def _apply_rope(x: Float[Array, "seq head dim"], cos: Array, sin: Array) -> Array:
    """RoPE on the first `cos.shape[-1]` dimensions of each head; the rest pass through."""
    rot = cos.shape[-1]
    if rot == 0:
        return x
    x_rot, x_pass = x[..., :rot], x[..., rot:]
    x_rot = x_rot * cos[:, None, :] + _rotate_half(x_rot) * sin[:, None, :]
    return jnp.concatenate((x_rot, x_pass), axis=-1)


class Attention(eqx.Module):
    """Causal multi-head self-attention, q, k and v fused per head as in the checkpoint."""

    wqkv: Float[Array, "head 3 head_dim embd"]
    bqkv: Float[Array, "head 3 head_dim"] | None
    wo: Float[Array, "embd head head_dim"]
    bo: Float[Array, " embd"] | None

    def __init__(self, config: GPTNeoXConfig, dtype: Any, *, key: PRNGKeyArray):
        h, d, e = config.num_attention_heads, config.head_dim, config.hidden_size
        kqkv, ko = jax.random.split(key)
        self.wqkv = _normal(kqkv, (h, 3, d, e), dtype)
        self.bqkv = _zeros_if(config.attention_bias, (h, 3, d), dtype)
        self.wo = _normal(ko, (e, h, d), dtype)
        self.bo = _zeros_if(config.attention_bias, (e,), dtype)

    def __call__(
        self,
        x: Float[Array, "seq embd"],
        cos: Float[Array, "seq rot"],
        sin: Float[Array, "seq rot"],
        mask: Bool[Array, "seq seq"],
    ) -> Float[Array, "seq embd"]:
        qkv = jnp.einsum("te,hcde->thcd", x, self.wqkv)
        if self.bqkv is not None:
            qkv = qkv + self.bqkv
        q = _apply_rope(qkv[:, :, 0], cos, sin)
        k = _apply_rope(qkv[:, :, 1], cos, sin)
        v = qkv[:, :, 2]
        scores = jnp.einsum("qhd,khd->hqk", q, k) * (q.shape[-1] ** -0.5)
        scores = jnp.where(mask, scores.astype(jnp.float32), jnp.finfo(jnp.float32).min)
        weights = jax.nn.softmax(scores, axis=-1).astype(x.dtype)
        out = jnp.einsum("hqk,khd->qhd", weights, v)
        y = jnp.einsum("thd,ehd->te", out, self.wo)
        return y if self.bo is None else y + self.bo


class MLP(eqx.Module):
    """`dense_4h_to_h(act(dense_h_to_4h x))`, torch `Linear` orientation (out, in)."""

    up: Float[Array, "inter embd"]
    bup: Float[Array, " inter"]
    down: Float[Array, "embd inter"]
    bdown: Float[Array, " embd"]
    activation: str = eqx.field(static=True)

    def __init__(self, config: GPTNeoXConfig, dtype: Any, *, key: PRNGKeyArray):
        e, i = config.hidden_size, config.intermediate_size
        ku, kd = jax.random.split(key)
        self.up = _normal(ku, (i, e), dtype)
        self.bup = jnp.zeros((i,), dtype)
        self.down = _normal(kd, (e, i), dtype)
        self.bdown = jnp.zeros((e,), dtype)
        self.activation = config.hidden_act

    def __call__(self, x: Float[Array, "seq embd"]) -> Float[Array, "seq embd"]:
        h = ACTIVATIONS[self.activation](jnp.einsum("te,ie->ti", x, self.up) + self.bup)
        return jnp.einsum("ti,ei->te", h, self.down) + self.bdown


class Block(eqx.Module):
    """One GPT-NeoX layer: pre-LayerNorm attention and MLP, in parallel or in sequence."""

    attn_norm: LayerNorm
    attn: Attention
    mlp_norm: LayerNorm
    mlp: MLP

    def __init__(self, config: GPTNeoXConfig, dtype: Any, *, key: PRNGKeyArray):
        kattn, kmlp = jax.random.split(key)
        self.attn_norm = LayerNorm(config.hidden_size, dtype)
        self.attn = Attention(config, dtype, key=kattn)
        self.mlp_norm = LayerNorm(config.hidden_size, dtype)
        self.mlp = MLP(config, dtype, key=kmlp)

    def __call__(
        self,
        x: Float[Array, "seq embd"],
        cos: Array,
        sin: Array,
        mask: Bool[Array, "seq seq"],
        eps: float,
        parallel: bool,
    ) -> Float[Array, "seq embd"]:
        attn = self.attn(self.attn_norm(x, eps), cos, sin, mask)
        if parallel:  # x + attn(ln1(x)) + mlp(ln2(x)), summed in transformers' order
            return self.mlp(self.mlp_norm(x, eps)) + attn + x
        h = attn + x
        return self.mlp(self.mlp_norm(h, eps)) + h


class GPTNeoX(eqx.Module):
    """GPT-NeoX / Pythia causal LM. Arrays in `blocks` are stacked over layers."""

    embed: Float[Array, "vocab embd"]
    blocks: Block
    norm: LayerNorm
    lm_head: Float[Array, "vocab embd"] | None
    config: GPTNeoXConfig = eqx.field(static=True)

    def __init__(
        self, config: GPTNeoXConfig, *, key: PRNGKeyArray, dtype: Any = jnp.float32
    ):
        kembed, kblocks, khead = jax.random.split(key, 3)
        self.embed = _normal(kembed, (config.vocab_size, config.hidden_size), dtype)
        make_block = lambda k: Block(config, dtype, key=k)
        self.blocks = eqx.filter_vmap(make_block)(
            jax.random.split(kblocks, config.num_hidden_layers)
        )
        self.norm = LayerNorm(config.hidden_size, dtype)
        self.lm_head = (
            None
            if config.tie_word_embeddings
            else _normal(khead, (config.vocab_size, config.hidden_size), dtype)
        )
        self.config = config

    @classmethod
    def from_config(
        cls, config: dict, *, key: PRNGKeyArray, dtype: Any = jnp.float32
    ) -> GPTNeoX:
        """Randomly initialise from a Hugging Face `config.json` dict."""
        return cls(GPTNeoXConfig.from_hf(config), key=key, dtype=dtype)

    def __call__(
        self, input_ids: Int[Array, "*batch seq"]
    ) -> Float[Array, "*batch seq vocab"]:
        """Logits for `input_ids` of shape (batch, seq), or (seq,) without the batch axis.

        Unbatched ids run as a batch of one: `model(ids)` is `model(ids[None])[0]`.
        Raises `ValueError` for another rank and `TypeError` for non-integer ids; the
        checks read static shapes, so they work under `jax.jit`. (RoPE has no length
        limit, so neither does the sequence.)

        ```python
        logits = model(jnp.zeros((2, 8), jnp.int32))  # (2, 8, vocab)
        logits = model(jnp.zeros((8,), jnp.int32))    # (8, vocab)
        ```
        """
        return per_sequence(self._forward, check_ids(input_ids), input_ids)

    def _forward(self, input_ids: Int[Array, " seq"]) -> Float[Array, "seq vocab"]:
        config = self.config
        x = self.embed[input_ids]
        seq = input_ids.shape[0]

        positions = jnp.arange(seq, dtype=jnp.float32)
        freqs = positions[:, None] * jnp.asarray(config.inv_freq())
        angles = jnp.concatenate((freqs, freqs), axis=-1)
        cos, sin = jnp.cos(angles).astype(x.dtype), jnp.sin(angles).astype(x.dtype)
        mask = jnp.arange(seq)[None, :] <= jnp.arange(seq)[:, None]

        params, static = eqx.partition(self.blocks, eqx.is_array)

        def step(x: Array, block_params: Block) -> tuple[Array, None]:
            block = eqx.combine(block_params, static)
            return block(x, cos, sin, mask, config.layer_norm_eps, config.use_parallel_residual), None

        x, _ = jax.lax.scan(step, x, params)
        x = self.norm(x, config.layer_norm_eps)
        head = self.embed if self.lm_head is None else self.lm_head
        return jnp.einsum("te,ve->tv", x, head)
