"""BERT (the `BertModel` encoder, as sentence-embedding checkpoints ship it) in Equinox.

A post-LayerNorm bidirectional encoder that returns the last hidden state, built from
`port.nn`: its `Attention` (q/k/v and output biases, no mask but padding), `LayerNorm`
and `MLP`. What is BERT's own is here: the word + token type + absolute position
embeddings and the post-norm residual order; the pooler (`tanh(dense(hidden[:, 0]))`) is
`port.nn.Pooler`, which ViT shares. The layers are stored *stacked*: every array in `Bert.layers` has a
leading axis of size `num_hidden_layers`, and the forward pass runs them batch-first
with `port.nn.scan`.

`Bert.FIELDS` is the `config.json` it runs: model_type `bert` only (RoBERTa's
positions differ: `port.models.roberta`), absolute positions, no decoder. RoBERTa and
DistilBERT (`port.models.roberta`, `port.models.distilbert`) run a `Bert` built from a
`BertConfig` of their own fields: positions given by the caller (`position_ids`), no
token types (`type_vocab_size=0`) or no pooler (`pooler=False`).

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
    # bfloat16 compute on float32 parameters, each layer recomputed in the backward pass:
    hidden = model(ids, attention_mask=mask, dtype=jnp.bfloat16, remat=True)

    # Shapes only, no memory allocated (e.g. before loading a checkpoint):
    abstract = eqx.filter_eval_shape(Bert.from_config, config, key=jax.random.key(0))
    ```
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar, final

import equinox as eqx
import jax
import jax.numpy as jnp
from jax.typing import ArrayLike
from jaxtyping import Array, Bool, Float, PRNGKeyArray

from port._errors import ConfigError
from port.nn import (
    MLP,
    Attention,
    LayerNorm,
    Pooler,
    cast,
    normal,
    prepare,
    scan,
    stacked,
)
from port.nn._inputs import batch_first, check_like
from port.nn.config import MAX_LAYERS, ConfigFields, activation, check_model_type, get


@final
@dataclasses.dataclass(frozen=True)
class BertConfig:
    """The hyperparameters of a BERT encoder, as read from a Hugging Face config.json.

    `type_vocab_size` 0 builds no token type table and `pooler` False no pooler (for
    DistilBERT, whose `config.json` names its fields otherwise).
    """

    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    intermediate_size: int
    hidden_act: str
    max_position_embeddings: int
    type_vocab_size: int = 2
    layer_norm_eps: float = 1e-12
    pooler: bool = True

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @classmethod
    def from_hf(cls, config: dict) -> BertConfig:
        """Build from a BERT `config.json` dict; raises `ConfigError` if unsupported."""
        Bert.FIELDS.check(config)
        check_model_type(config, ("bert",), Bert.FIELDS.module, default="bert")
        return cls.read(config)

    @classmethod
    def read(cls, config: dict) -> BertConfig:
        """Read BERT's fields from `config.json` (RoBERTa's too), with no check of its model type."""
        hidden = get(config, "hidden_size", int)
        heads = get(config, "num_attention_heads", int)
        check_heads(hidden, heads, ("hidden_size", "num_attention_heads"))
        return cls(
            vocab_size=get(config, "vocab_size", int),
            hidden_size=hidden,
            num_hidden_layers=get(config, "num_hidden_layers", int, maximum=MAX_LAYERS),
            num_attention_heads=heads,
            intermediate_size=get(config, "intermediate_size", int),
            hidden_act=activation(config, "hidden_act", "gelu"),
            max_position_embeddings=get(config, "max_position_embeddings", int),
            type_vocab_size=get(config, "type_vocab_size", int, 2),
            layer_norm_eps=get(config, "layer_norm_eps", float, 1e-12),
        )


def check_heads(hidden: int, heads: int, names: tuple[str, str]) -> None:
    """`ConfigError` unless the hidden size `hidden` splits into `heads` heads (`names`: their keys)."""
    if hidden % heads != 0:
        raise ConfigError(f"config.json: {names[0]!r} ({hidden}) must be divisible by {names[1]!r} ({heads})")


@final
class Layer(eqx.Module):
    """One post-LayerNorm encoder layer: `norm(x + attn(x))`, then `norm(x + mlp(x))`."""

    attn: Attention
    attn_norm: LayerNorm
    mlp: MLP
    mlp_norm: LayerNorm

    def __init__(self, config: BertConfig, dtype: Any, *, key: PRNGKeyArray):
        kattn, kmlp = jax.random.split(key)
        c, e = config, config.hidden_size
        self.attn = Attention(
            heads=c.num_attention_heads,
            kv_heads=c.num_attention_heads,
            head_dim=c.head_dim,
            embd=e,
            dtype=dtype,
            key=kattn,
            qkv_bias=True,
            o_bias=True,
        )
        self.attn_norm = LayerNorm(e, eps=c.layer_norm_eps, dtype=dtype)
        self.mlp = MLP(embd=e, inner=c.intermediate_size, activation=c.hidden_act, dtype=dtype, key=kmlp)
        self.mlp_norm = LayerNorm(e, eps=c.layer_norm_eps, dtype=dtype)

    def __call__(
        self, x: Float[Array, "batch seq embed"], mask: Bool[Array, "batch seq keys"]
    ) -> Float[Array, "batch seq embed"]:
        h, _ = self.attn(x, mask)
        x = self.attn_norm(x + h)
        return self.mlp_norm(x + self.mlp(x))


# BertConfig's fields, and the encoder-decoder switches transformers' BERT and RoBERTa define.
ENCODER_FIELDS = ConfigFields(
    "port.models.bert.Bert",
    read=(
        "vocab_size",
        "hidden_size",
        "num_hidden_layers",
        "num_attention_heads",
        "intermediate_size",
        "hidden_act",
        "max_position_embeddings",
        "type_vocab_size",
        "layer_norm_eps",
        "tie_word_embeddings",  # the masked-LM head's, which port does not build: any value runs alike
    ),
    fixed={
        "position_embedding_type": ("absolute",),  # older configs; relative_key(_query) is gone from transformers
        "is_decoder": (False,),
        "add_cross_attention": (False,),
        "is_encoder_decoder": (False,),
    },
)


@final
class Bert(eqx.Module):
    """The BERT encoder; `__call__` returns the last hidden state. `layers` is stacked."""

    FIELDS: ClassVar[ConfigFields] = ENCODER_FIELDS

    word_embeddings: Float[Array, "vocab embed"]
    position_embeddings: Float[Array, "positions embed"]
    token_type_embeddings: Float[Array, "token_types embed"] | None
    embed_norm: LayerNorm
    layers: Layer
    pooler: Pooler | None
    config: BertConfig = eqx.field(static=True)

    def __init__(self, config: BertConfig, *, key: PRNGKeyArray, dtype: Any = jnp.float32):
        kword, kpos, ktype, klayers, kpool = jax.random.split(key, 5)
        e = config.hidden_size
        self.word_embeddings = normal(kword, (config.vocab_size, e), dtype)
        self.position_embeddings = normal(kpos, (config.max_position_embeddings, e), dtype)
        self.token_type_embeddings = (
            normal(ktype, (config.type_vocab_size, e), dtype) if config.type_vocab_size else None
        )
        self.embed_norm = LayerNorm(e, eps=config.layer_norm_eps, dtype=dtype)
        self.layers = stacked(lambda k: Layer(config, dtype, key=k), klayers, config.num_hidden_layers)
        self.pooler = Pooler(e, e, dtype, key=kpool) if config.pooler else None
        self.config = config

    @classmethod
    def from_config(cls, config: dict, *, key: PRNGKeyArray, dtype: Any = jnp.float32) -> Bert:
        """Randomly initialise from a Hugging Face `config.json` dict (pooler included)."""
        return cls(BertConfig.from_hf(config), key=key, dtype=dtype)

    def __call__(
        self,
        input_ids: ArrayLike,  # integer (batch, seq) or (seq,); checked here, one line naming it
        attention_mask: Any = None,
        token_type_ids: ArrayLike | None = None,
        *,
        position_ids: ArrayLike | None = None,
        dtype: Any = None,
        remat: Any = None,
    ) -> Float[Array, "*batch seq embed"]:
        """The last hidden state, for `input_ids` of shape (batch, seq) or (seq,).

        **Arguments:**

        - `input_ids`: integer `(batch, seq)`, or `(seq,)` (run as a batch of one:
          `model(ids, mask)` is `model(ids[None], mask[None])[0]`).
        - `attention_mask`: `input_ids`' shape; nonzero/True to attend, 0 for padding
          (default all attended). Padded keys are never attended; padded queries still
          get an output, as in transformers.
        - `token_type_ids`: `input_ids`' shape, integer (default all 0).
        - `position_ids`: `input_ids`' shape, integer, each below `max_position_embeddings`
          (default `0, 1, ...` whatever the mask; RoBERTa's come from its ids).
        - `dtype`: the compute dtype (bfloat16 compute on float32 parameters).
        - `remat`: rematerialise each layer in the backward pass (`port.nn.scan`).

        Raises `ValueError` for another rank, mismatched shapes (no broadcasting), more
        than `max_position_embeddings` tokens or token types for a model without them,
        `TypeError` for non-integer ids, token types or positions; the checks read static
        shapes, so they work under `jax.jit`.

        ```python
        hidden = model(jnp.zeros((2, 8), jnp.int32), jnp.ones((2, 8), jnp.int32))  # (2, 8, embd)
        hidden = model(jnp.zeros((8,), jnp.int32), jnp.ones((8,), jnp.int32))      # (8, embd)
        ```
        """
        c = self.config
        limit = None if position_ids is not None else ("max_position_embeddings", c.max_position_embeddings)
        tokens = prepare(input_ids, attention_mask=attention_mask, positions=position_ids, causal=False, limit=limit)
        check_like("token_type_ids", token_type_ids, input_ids, integer=True)
        if token_type_ids is not None and self.token_type_embeddings is None:
            raise ValueError("`token_type_ids` given, but this model has no token type embeddings")
        (types,) = batch_first(tokens.batched, token_type_ids)
        model = cast(self, dtype)
        # transformers' order: (word + token type) + position.
        x = model.word_embeddings[tokens.ids]
        if model.token_type_embeddings is not None:
            x = x + model.token_type_embeddings[jnp.zeros_like(tokens.ids) if types is None else jnp.asarray(types)]
        positions = jnp.arange(tokens.ids.shape[1]) if position_ids is None else tokens.positions
        x = model.embed_norm(x + model.position_embeddings[positions])
        x, _ = scan(lambda layer, x: (layer(x, tokens.mask), None), x, model.layers, remat=remat)
        return tokens.output(x)

    def pooled(self, hidden: Float[Array, "... embed"]) -> Float[Array, "... embed_out"]:
        """BERT's pooler output, `tanh(dense(hidden[..., 0, :]))`, from `__call__`'s result.

        `hidden` is (batch, seq, embd), giving (batch, embd), or unbatched (seq, embd),
        giving (embd,). `ValueError` if the checkpoint has no pooler (e.g. one saved by
        `BertForMaskedLM`).

        ```python
        pooled = model.pooled(model(ids, attention_mask=mask))   # (batch, embd)
        ```
        """
        if self.pooler is None:
            raise ValueError("this model has no pooler; use the hidden state instead of the pooled output")
        return self.pooler(hidden, jnp.tanh, "BERT")
