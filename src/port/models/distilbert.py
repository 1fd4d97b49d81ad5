"""DistilBERT (`DistilBertModel`) in Equinox: a BERT encoder without token types or pooler.

DistilBERT's layers are BERT's (post-LayerNorm, biases everywhere, its layer norms'
epsilon fixed at 1e-12), so the module runs a `port.models.bert.Bert` built without a
token type table or pooler. What is DistilBERT's own is its `config.json` (`dim`,
`hidden_dim`, `n_layers`, `n_heads`, `activation`), its key names (the mapping's), and
`sinusoidal_pos_embds`: the position table is then initialised with sines and cosines.
As in transformers, the table is a parameter either way, saved in every checkpoint and
read from it.

Example:
    ```python
    import jax
    import jax.numpy as jnp
    from port.models.distilbert import DistilBert

    config = {"model_type": "distilbert", "vocab_size": 30522, "dim": 64, "n_layers": 2,
              "n_heads": 4, "hidden_dim": 128, "max_position_embeddings": 512,
              "sinusoidal_pos_embds": True}
    model = DistilBert.from_config(config, key=jax.random.key(0))
    ids = jnp.zeros((2, 8), dtype=jnp.int32)
    hidden = model(ids, attention_mask=jnp.ones((2, 8), jnp.int32))   # (2, 8, 64)
    ```
"""

from __future__ import annotations

from typing import Any, ClassVar, final

import equinox as eqx
import jax.numpy as jnp
from jax.typing import ArrayLike
from jaxtyping import Array, Float, PRNGKeyArray

from port.models.bert import Bert, BertConfig, check_heads
from port.nn.config import MAX_LAYERS, ConfigFields, activation, check_model_type, get


def sinusoidal_positions(positions: int, dim: int) -> Float[Array, "positions dim"]:
    """transformers' DistilBERT table: `sin` (even columns) and `cos` (odd) of `pos / 10000 ** (2 * (j // 2) / dim)`."""
    pos = jnp.arange(positions, dtype=jnp.float32)[:, None]
    j = jnp.arange(dim)
    angle = pos / jnp.power(10000.0, 2 * (j // 2) / dim).astype(jnp.float32)
    return jnp.where(j % 2 == 0, jnp.sin(angle), jnp.cos(angle))


@final
class DistilBert(eqx.Module):
    """The DistilBERT encoder: `bert` (a `port.models.bert.Bert` with no token types or pooler)."""

    FIELDS: ClassVar[ConfigFields] = ConfigFields(
        "port.models.distilbert.DistilBert",
        read=(
            "vocab_size",
            "dim",
            "n_layers",
            "n_heads",
            "hidden_dim",
            "activation",
            "max_position_embeddings",
            "sinusoidal_pos_embds",
            # the masked-LM head's, which port does not build: any value runs alike
            "tie_word_embeddings",
        ),
        fixed={"is_encoder_decoder": (False,)},
    )

    bert: Bert

    def __init__(self, config: BertConfig, *, key: PRNGKeyArray, dtype: Any = jnp.float32):
        self.bert = Bert(config, key=key, dtype=dtype)

    @classmethod
    def from_config(cls, config: dict, *, key: PRNGKeyArray, dtype: Any = jnp.float32) -> DistilBert:
        """Randomly initialise from a DistilBERT `config.json` dict (sinusoidal positions if it says so)."""
        cls.FIELDS.check(config)
        check_model_type(config, ("distilbert",), cls.FIELDS.module)
        dim, heads = get(config, "dim", int), get(config, "n_heads", int)
        check_heads(dim, heads, ("dim", "n_heads"))
        bert = BertConfig(
            vocab_size=get(config, "vocab_size", int),
            hidden_size=dim,
            num_hidden_layers=get(config, "n_layers", int, maximum=MAX_LAYERS),
            num_attention_heads=heads,
            intermediate_size=get(config, "hidden_dim", int),
            hidden_act=activation(config, "activation", "gelu"),
            max_position_embeddings=get(config, "max_position_embeddings", int),
            type_vocab_size=0,
            pooler=False,
        )
        model = cls(bert, key=key, dtype=dtype)
        if not get(config, "sinusoidal_pos_embds", bool, False):
            return model
        table = sinusoidal_positions(bert.max_position_embeddings, dim).astype(dtype)
        return eqx.tree_at(lambda m: m.bert.position_embeddings, model, table)

    def __call__(
        self,
        input_ids: ArrayLike,
        attention_mask: Any = None,
        *,
        dtype: Any = None,
        remat: Any = None,
    ) -> Float[Array, "*batch seq embed"]:
        """The last hidden state, for `input_ids` of shape (batch, seq) or (seq,): `Bert.__call__`
        without token types (positions `0, 1, ...`, at most `max_position_embeddings`)."""
        return self.bert(input_ids, attention_mask, dtype=dtype, remat=remat)
