"""BERT (the `BertModel` encoder, as sentence-embedding checkpoints ship it) in Equinox.

A post-LayerNorm bidirectional encoder that returns the last hidden state. The
layers are stored *stacked*: every array in `Bert.layers` has a leading axis of
size `num_hidden_layers`, and the forward pass runs them with `jax.lax.scan`.

Example:
    ```python
    import equinox as eqx
    import jax
    import jax.numpy as jnp
    from port.models.bert import Bert

    config = {"vocab_size": 30522, "hidden_size": 384, "num_hidden_layers": 6,
              "num_attention_heads": 12, "intermediate_size": 1536,
              "hidden_act": "gelu", "max_position_embeddings": 512}
    model = Bert.from_config(config, key=jax.random.key(0))
    ids = jnp.zeros((2, 8), dtype=jnp.int32)
    mask = jnp.ones((2, 8), dtype=jnp.int32)  # 1 = attend, 0 = padding
    hidden = eqx.filter_jit(model)(ids, attention_mask=mask)  # (2, 8, 384)
    pooled = model.pooled(hidden)  # (2, 384): tanh(dense(hidden[:, 0]))
    # Without the batch axis: ids and mask of shape (8,) give hidden (8, 384), pooled (384,)

    # Shapes only, no memory allocated (e.g. before loading a checkpoint):
    abstract = eqx.filter_eval_shape(Bert.from_config, config, key=jax.random.key(0))
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
from port.models._inputs import check_ids, check_like, per_sequence


@dataclasses.dataclass(frozen=True)
class BertConfig:
    """The hyperparameters of a BERT encoder, as read from a Hugging Face config.json."""

    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    intermediate_size: int
    hidden_act: str
    max_position_embeddings: int
    type_vocab_size: int = 2
    layer_norm_eps: float = 1e-12

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @classmethod
    def from_hf(cls, config: dict) -> BertConfig:
        """Build from a Hugging Face `config.json` dict; raises `ConfigError` if unsupported."""
        hidden = get(config, "hidden_size", int)
        heads = get(config, "num_attention_heads", int)
        if hidden % heads != 0:
            raise ConfigError(
                f"config.json: 'hidden_size' ({hidden}) must be divisible by "
                f"'num_attention_heads' ({heads})"
            )
        act = activation(config, "hidden_act", "gelu")
        position = config.get("position_embedding_type", "absolute")
        if position != "absolute":
            raise ConfigError(
                f"config.json: 'position_embedding_type' {position!r} is not "
                "supported (only 'absolute')"
            )
        for key in ("is_decoder", "add_cross_attention"):
            if get(config, key, bool, False):
                raise ConfigError(
                    f"config.json: {key!r} is true; only the BERT encoder is supported"
                )
        return cls(
            vocab_size=get(config, "vocab_size", int),
            hidden_size=hidden,
            num_hidden_layers=get(config, "num_hidden_layers", int, maximum=MAX_LAYERS),
            num_attention_heads=heads,
            intermediate_size=get(config, "intermediate_size", int),
            hidden_act=act,
            max_position_embeddings=get(config, "max_position_embeddings", int),
            type_vocab_size=get(config, "type_vocab_size", int, 2),
            layer_norm_eps=get(config, "layer_norm_eps", float, 1e-12),
        )


def _normal(key: PRNGKeyArray, shape: tuple[int, ...], dtype: Any) -> Array:
    return 0.02 * jax.random.normal(key, shape, dtype)


def _linear(
    in_features: int, out_features: int, dtype: Any, *, key: PRNGKeyArray
) -> eqx.nn.Linear:
    """An `eqx.nn.Linear` with BERT's init: weights N(0, 0.02), zero bias."""
    linear = eqx.nn.Linear(in_features, out_features, dtype=dtype, key=key)
    weight = _normal(jax.random.fold_in(key, 1), (out_features, in_features), dtype)
    bias = jnp.zeros((out_features,), dtype)
    return eqx.tree_at(lambda l: (l.weight, l.bias), linear, (weight, bias))


class Attention(eqx.Module):
    """Bidirectional multi-head self-attention with per-head projection weights."""

    wq: Float[Array, "head head_dim embd"]
    wk: Float[Array, "head head_dim embd"]
    wv: Float[Array, "head head_dim embd"]
    bq: Float[Array, "head head_dim"]
    bk: Float[Array, "head head_dim"]
    bv: Float[Array, "head head_dim"]
    wo: Float[Array, "embd head head_dim"]
    bo: Float[Array, " embd"]

    def __init__(self, config: BertConfig, dtype: Any, *, key: PRNGKeyArray):
        n, d, e = config.num_attention_heads, config.head_dim, config.hidden_size
        kq, kk, kv, ko = jax.random.split(key, 4)
        self.wq = _normal(kq, (n, d, e), dtype)
        self.wk = _normal(kk, (n, d, e), dtype)
        self.wv = _normal(kv, (n, d, e), dtype)
        self.bq = jnp.zeros((n, d), dtype)
        self.bk = jnp.zeros((n, d), dtype)
        self.bv = jnp.zeros((n, d), dtype)
        self.wo = _normal(ko, (e, n, d), dtype)
        self.bo = jnp.zeros((e,), dtype)

    def __call__(
        self, x: Float[Array, "seq embd"], bias: Float[Array, " seq"]
    ) -> Float[Array, "seq embd"]:
        """`bias` is added to every query's scores: 0 to attend to a key, very negative to not."""
        q = jnp.einsum("te,hde->thd", x, self.wq) + self.bq
        k = jnp.einsum("te,hde->thd", x, self.wk) + self.bk
        v = jnp.einsum("te,hde->thd", x, self.wv) + self.bv
        scores = jnp.einsum("qhd,khd->hqk", q, k).astype(jnp.float32)
        scores = scores / math.sqrt(q.shape[-1]) + bias
        weights = jax.nn.softmax(scores, axis=-1).astype(x.dtype)
        attn = jnp.einsum("hqk,khd->qhd", weights, v)
        return jnp.einsum("thd,ehd->te", attn, self.wo) + self.bo


class MLP(eqx.Module):
    """The position-wise feed-forward network (BERT's intermediate + output dense)."""

    fc: eqx.nn.Linear
    proj: eqx.nn.Linear
    activation: str = eqx.field(static=True)

    def __init__(self, config: BertConfig, dtype: Any, *, key: PRNGKeyArray):
        kfc, kproj = jax.random.split(key)
        e, i = config.hidden_size, config.intermediate_size
        self.fc = _linear(e, i, dtype, key=kfc)
        self.proj = _linear(i, e, dtype, key=kproj)
        self.activation = config.hidden_act

    def __call__(self, x: Float[Array, "seq embd"]) -> Float[Array, "seq embd"]:
        x = jax.vmap(self.fc)(x)
        x = ACTIVATIONS[self.activation](x)
        return jax.vmap(self.proj)(x)


class Layer(eqx.Module):
    """One post-LayerNorm encoder layer."""

    attn: Attention
    attn_norm: eqx.nn.LayerNorm
    mlp: MLP
    mlp_norm: eqx.nn.LayerNorm

    def __init__(self, config: BertConfig, dtype: Any, *, key: PRNGKeyArray):
        kattn, kmlp = jax.random.split(key)
        e, eps = config.hidden_size, config.layer_norm_eps
        self.attn = Attention(config, dtype, key=kattn)
        self.attn_norm = eqx.nn.LayerNorm(e, eps=eps, dtype=dtype)
        self.mlp = MLP(config, dtype, key=kmlp)
        self.mlp_norm = eqx.nn.LayerNorm(e, eps=eps, dtype=dtype)

    def __call__(
        self, x: Float[Array, "seq embd"], bias: Float[Array, " seq"]
    ) -> Float[Array, "seq embd"]:
        x = jax.vmap(self.attn_norm)(x + self.attn(x, bias))
        return jax.vmap(self.mlp_norm)(x + self.mlp(x))


class Bert(eqx.Module):
    """The BERT encoder; `__call__` returns the last hidden state. `layers` is stacked."""

    word_embeddings: Float[Array, "vocab embd"]
    position_embeddings: Float[Array, "positions embd"]
    token_type_embeddings: Float[Array, "types embd"]
    embed_norm: eqx.nn.LayerNorm
    layers: Layer
    pooler: eqx.nn.Linear | None
    config: BertConfig = eqx.field(static=True)

    def __init__(
        self, config: BertConfig, *, key: PRNGKeyArray, dtype: Any = jnp.float32
    ):
        kword, kpos, ktype, klayers, kpool = jax.random.split(key, 5)
        e = config.hidden_size
        self.word_embeddings = _normal(kword, (config.vocab_size, e), dtype)
        self.position_embeddings = _normal(
            kpos, (config.max_position_embeddings, e), dtype
        )
        self.token_type_embeddings = _normal(ktype, (config.type_vocab_size, e), dtype)
        self.embed_norm = eqx.nn.LayerNorm(e, eps=config.layer_norm_eps, dtype=dtype)
        make_layer = lambda k: Layer(config, dtype, key=k)
        self.layers = eqx.filter_vmap(make_layer)(
            jax.random.split(klayers, config.num_hidden_layers)
        )
        self.pooler = _linear(e, e, dtype, key=kpool)
        self.config = config

    @classmethod
    def from_config(
        cls, config: dict, *, key: PRNGKeyArray, dtype: Any = jnp.float32
    ) -> Bert:
        """Randomly initialise from a Hugging Face `config.json` dict (pooler included)."""
        return cls(BertConfig.from_hf(config), key=key, dtype=dtype)

    def __call__(
        self,
        input_ids: Int[Array, "*batch seq"],
        attention_mask: Int[Array, "*batch seq"] | None = None,
        token_type_ids: Int[Array, "*batch seq"] | None = None,
    ) -> Float[Array, "*batch seq embd"]:
        """The last hidden state, for `input_ids` of shape (batch, seq) or (seq,).

        `attention_mask` (1 = attend, 0 = padding; default all 1) and `token_type_ids`
        (default all 0), when given, must have exactly `input_ids`' shape: both 1-D
        for unbatched ids, no broadcasting. Unbatched inputs run as a batch of one:
        `model(ids, mask)` is `model(ids[None], mask[None])[0]`. Raises `ValueError`
        for another rank, mismatched shapes or more than `max_position_embeddings`
        tokens, `TypeError` for non-integer ids or token types; the checks read static
        shapes, so they work under `jax.jit`.

        ```python
        hidden = model(jnp.zeros((2, 8), jnp.int32), jnp.ones((2, 8), jnp.int32))  # (2, 8, embd)
        hidden = model(jnp.zeros((8,), jnp.int32), jnp.ones((8,), jnp.int32))      # (8, embd)
        ```
        """
        batched = check_ids(
            input_ids, limit=("max_position_embeddings", self.config.max_position_embeddings)
        )
        check_like("attention_mask", attention_mask, input_ids)
        check_like("token_type_ids", token_type_ids, input_ids, integer=True)
        if attention_mask is None:
            attention_mask = jnp.ones_like(input_ids)
        if token_type_ids is None:
            token_type_ids = jnp.zeros_like(input_ids)
        return per_sequence(
            self._forward, batched, input_ids, attention_mask, token_type_ids
        )

    def _forward(
        self,
        input_ids: Int[Array, " seq"],
        attention_mask: Int[Array, " seq"],
        token_type_ids: Int[Array, " seq"],
    ) -> Float[Array, "seq embd"]:
        seq = input_ids.shape[0]
        x = (
            self.word_embeddings[input_ids]
            + self.position_embeddings[:seq]
            + self.token_type_embeddings[token_type_ids]
        )
        x = jax.vmap(self.embed_norm)(x)
        # Like transformers' extended mask: the dtype's min added to masked keys' scores.
        bias = jnp.where(attention_mask != 0, 0.0, jnp.finfo(jnp.float32).min)
        bias = bias.astype(jnp.float32)

        params, static = eqx.partition(self.layers, eqx.is_array)

        def step(x, layer_params):
            return eqx.combine(layer_params, static)(x, bias), None

        x, _ = jax.lax.scan(step, x, params)
        return x

    def pooled(self, hidden: Float[Array, "*batch seq embd"]) -> Float[Array, "*batch embd"]:
        """BERT's pooler output, `tanh(dense(hidden[..., 0, :]))`, from `__call__`'s result.

        `hidden` is (batch, seq, embd), giving (batch, embd), or unbatched (seq, embd),
        giving (embd,).
        """
        if self.pooler is None or self.pooler.weight is None:  # port leaves absent leaves None
            raise ValueError(
                "this BERT checkpoint has no pooler weights ('pooler.dense.weight'); "
                "use the hidden state instead of the pooled output"
            )
        batched = jnp.ndim(hidden) == 3
        if not batched and jnp.ndim(hidden) != 2:
            raise ValueError(
                "`hidden` must have shape (batch, seq, embd) or (seq, embd), "
                f"got {tuple(jnp.shape(hidden))}"
            )
        first = hidden[:, 0] if batched else hidden[None, 0]  # unbatched: a batch of one
        pooled = jnp.tanh(jax.vmap(self.pooler)(first))
        return pooled if batched else pooled[0]
