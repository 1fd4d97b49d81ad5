"""GPT-2 as an Equinox model.

The transformer blocks are stored *stacked*: every array in `GPT2.blocks` has a
leading axis of size `n_layer`, and the forward pass runs them with
`jax.lax.scan`. This keeps compile time independent of depth.

Example:
    ```python
    import equinox as eqx
    import jax
    import jax.numpy as jnp
    from port.models.gpt2 import GPT2

    config = {"vocab_size": 50257, "n_positions": 1024, "n_embd": 768,
              "n_layer": 12, "n_head": 12}
    model = GPT2.from_config(config, key=jax.random.key(0))
    logits = eqx.filter_jit(model)(jnp.zeros((1, 8), dtype=jnp.int32))
    # logits.shape == (1, 8, 50257); without the batch axis, (8,) ids give (8, 50257)

    # Shapes only, no memory allocated (e.g. before loading a checkpoint):
    abstract = eqx.filter_eval_shape(GPT2.from_config, config, key=jax.random.key(0))
    ```
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int, PRNGKeyArray

from port._errors import ConfigError
from port.models._config import ACTIVATIONS, MAX_LAYERS, activation, get
from port.models._inputs import check_ids, per_sequence


@dataclasses.dataclass(frozen=True)
class GPT2Config:
    """The hyperparameters of a GPT-2 model, as read from a Hugging Face config.json."""

    vocab_size: int
    n_positions: int
    n_embd: int
    n_layer: int
    n_head: int
    n_inner: int
    layer_norm_epsilon: float
    activation_function: str
    scale_attn_weights: bool = True
    scale_attn_by_inverse_layer_idx: bool = False

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    @classmethod
    def from_hf(cls, config: dict) -> GPT2Config:
        """Build from a Hugging Face `config.json` dict; raises `ConfigError` if unsupported."""
        n_embd = get(config, "n_embd", int)
        n_head = get(config, "n_head", int)
        if n_embd % n_head != 0:
            raise ConfigError(
                f"config.json: 'n_embd' ({n_embd}) must be divisible by "
                f"'n_head' ({n_head})"
            )
        n_inner = get(config, "n_inner", int, 4 * n_embd)
        act = activation(config, "activation_function", "gelu_new")
        if get(config, "add_cross_attention", bool, False):
            raise ConfigError(
                "config.json: 'add_cross_attention' is true; "
                "cross-attention GPT-2 is not supported"
            )
        # `reorder_and_upcast_attn` only changes where the softmax is upcast; we
        # always compute the softmax in float32, so it needs no handling.
        get(config, "reorder_and_upcast_attn", bool, False)
        return cls(
            vocab_size=get(config, "vocab_size", int),
            n_positions=get(config, "n_positions", int),
            n_embd=n_embd,
            n_layer=get(config, "n_layer", int, maximum=MAX_LAYERS),
            n_head=n_head,
            n_inner=n_inner,
            layer_norm_epsilon=get(config, "layer_norm_epsilon", float, 1e-5),
            activation_function=act,
            scale_attn_weights=get(config, "scale_attn_weights", bool, True),
            scale_attn_by_inverse_layer_idx=get(
                config, "scale_attn_by_inverse_layer_idx", bool, False
            ),
        )


def _normal(key: PRNGKeyArray, shape: tuple[int, ...], dtype: Any) -> Array:
    return 0.02 * jax.random.normal(key, shape, dtype)


class Attention(eqx.Module):
    """Causal multi-head self-attention with per-head projection weights.

    Weights keep GPT-2's `Conv1D` orientation, (in, out), split per head: loading
    them is a copy, never a transpose.
    """

    wq: Float[Array, "embd head head_dim"]
    wk: Float[Array, "embd head head_dim"]
    wv: Float[Array, "embd head head_dim"]
    bq: Float[Array, "head head_dim"]
    bk: Float[Array, "head head_dim"]
    bv: Float[Array, "head head_dim"]
    wo: Float[Array, "head head_dim embd"]
    bo: Float[Array, " embd"]
    scale_attn_weights: bool = eqx.field(static=True)
    scale_attn_by_inverse_layer_idx: bool = eqx.field(static=True)

    def __init__(self, config: GPT2Config, dtype: Any, *, key: PRNGKeyArray):
        h, d, e = config.n_head, config.head_dim, config.n_embd
        kq, kk, kv, ko = jax.random.split(key, 4)
        self.wq = _normal(kq, (e, h, d), dtype)
        self.wk = _normal(kk, (e, h, d), dtype)
        self.wv = _normal(kv, (e, h, d), dtype)
        self.bq = jnp.zeros((h, d), dtype)
        self.bk = jnp.zeros((h, d), dtype)
        self.bv = jnp.zeros((h, d), dtype)
        self.wo = _normal(ko, (h, d, e), dtype)
        self.bo = jnp.zeros((e,), dtype)
        self.scale_attn_weights = config.scale_attn_weights
        self.scale_attn_by_inverse_layer_idx = config.scale_attn_by_inverse_layer_idx

    def __call__(
        self, x: Float[Array, "seq embd"], layer_idx: Int[Array, ""]
    ) -> Float[Array, "seq embd"]:
        q = jnp.einsum("te,ehd->thd", x, self.wq) + self.bq
        k = jnp.einsum("te,ehd->thd", x, self.wk) + self.bk
        v = jnp.einsum("te,ehd->thd", x, self.wv) + self.bv
        scores = jnp.einsum("qhd,khd->hqk", q, k).astype(jnp.float32)
        if self.scale_attn_weights:
            scores = scores / math.sqrt(q.shape[-1])
        if self.scale_attn_by_inverse_layer_idx:
            scores = scores / (layer_idx + 1).astype(jnp.float32)
        seq = x.shape[0]
        causal = jnp.tril(jnp.ones((seq, seq), dtype=bool))
        scores = jnp.where(causal, scores, jnp.finfo(jnp.float32).min)
        weights = jax.nn.softmax(scores, axis=-1).astype(x.dtype)
        attn = jnp.einsum("hqk,khd->qhd", weights, v)
        return jnp.einsum("thd,hde->te", attn, self.wo) + self.bo


class MLP(eqx.Module):
    """The position-wise feed-forward network, weights in `Conv1D` orientation (in, out)."""

    w_fc: Float[Array, "embd inner"]
    b_fc: Float[Array, " inner"]
    w_proj: Float[Array, "inner embd"]
    b_proj: Float[Array, " embd"]
    activation: str = eqx.field(static=True)

    def __init__(self, config: GPT2Config, dtype: Any, *, key: PRNGKeyArray):
        kfc, kproj = jax.random.split(key)
        self.w_fc = _normal(kfc, (config.n_embd, config.n_inner), dtype)
        self.b_fc = jnp.zeros((config.n_inner,), dtype)
        self.w_proj = _normal(kproj, (config.n_inner, config.n_embd), dtype)
        self.b_proj = jnp.zeros((config.n_embd,), dtype)
        self.activation = config.activation_function

    def __call__(self, x: Float[Array, "seq embd"]) -> Float[Array, "seq embd"]:
        x = ACTIVATIONS[self.activation](x @ self.w_fc + self.b_fc)
        return x @ self.w_proj + self.b_proj


class Block(eqx.Module):
    """One pre-LayerNorm transformer block."""

    ln_1: eqx.nn.LayerNorm
    attn: Attention
    ln_2: eqx.nn.LayerNorm
    mlp: MLP

    def __init__(self, config: GPT2Config, dtype: Any, *, key: PRNGKeyArray):
        kattn, kmlp = jax.random.split(key)
        eps = config.layer_norm_epsilon
        self.ln_1 = eqx.nn.LayerNorm(config.n_embd, eps=eps, dtype=dtype)
        self.attn = Attention(config, dtype, key=kattn)
        self.ln_2 = eqx.nn.LayerNorm(config.n_embd, eps=eps, dtype=dtype)
        self.mlp = MLP(config, dtype, key=kmlp)

    def __call__(
        self, x: Float[Array, "seq embd"], layer_idx: Int[Array, ""]
    ) -> Float[Array, "seq embd"]:
        x = x + self.attn(jax.vmap(self.ln_1)(x), layer_idx)
        return x + self.mlp(jax.vmap(self.ln_2)(x))


class GPT2(eqx.Module):
    """GPT-2 language model with a tied LM head. Arrays in `blocks` are stacked over layers."""

    wte: Float[Array, "vocab embd"]
    wpe: Float[Array, "n_positions embd"]
    blocks: Block
    ln_f: eqx.nn.LayerNorm
    config: GPT2Config = eqx.field(static=True)

    def __init__(
        self, config: GPT2Config, *, key: PRNGKeyArray, dtype: Any = jnp.float32
    ):
        kwte, kwpe, kblocks = jax.random.split(key, 3)
        self.wte = _normal(kwte, (config.vocab_size, config.n_embd), dtype)
        self.wpe = _normal(kwpe, (config.n_positions, config.n_embd), dtype)
        make_block = lambda k: Block(config, dtype, key=k)
        self.blocks = eqx.filter_vmap(make_block)(
            jax.random.split(kblocks, config.n_layer)
        )
        self.ln_f = eqx.nn.LayerNorm(
            config.n_embd, eps=config.layer_norm_epsilon, dtype=dtype
        )
        self.config = config

    @classmethod
    def from_config(
        cls, config: dict, *, key: PRNGKeyArray, dtype: Any = jnp.float32
    ) -> GPT2:
        """Randomly initialise from a Hugging Face `config.json` dict."""
        return cls(GPT2Config.from_hf(config), key=key, dtype=dtype)

    def __call__(
        self, input_ids: Int[Array, "*batch seq"]
    ) -> Float[Array, "*batch seq vocab"]:
        """Logits for `input_ids` of shape (batch, seq), or (seq,) without the batch axis.

        Unbatched ids run as a batch of one: `model(ids)` is `model(ids[None])[0]`.
        Raises `ValueError` for another rank or more than `n_positions` tokens and
        `TypeError` for non-integer ids; the checks read static shapes, so they work
        under `jax.jit`.

        ```python
        logits = model(jnp.zeros((2, 8), jnp.int32))  # (2, 8, vocab)
        logits = model(jnp.zeros((8,), jnp.int32))    # (8, vocab)
        ```
        """
        batched = check_ids(input_ids, limit=("n_positions", self.config.n_positions))
        return per_sequence(self._forward, batched, input_ids)

    def _forward(self, input_ids: Int[Array, " seq"]) -> Float[Array, "seq vocab"]:
        seq = input_ids.shape[0]
        x = self.wte[input_ids] + self.wpe[:seq]

        params, static = eqx.partition(self.blocks, eqx.is_array)

        def step(x, layer):
            block_params, layer_idx = layer
            block = eqx.combine(block_params, static)
            return block(x, layer_idx), None

        layers = (params, jnp.arange(self.config.n_layer))
        x, _ = jax.lax.scan(step, x, layers)
        x = jax.vmap(self.ln_f)(x)
        return x @ self.wte.T
