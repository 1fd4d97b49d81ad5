"""RoBERTa and XLM-RoBERTa (`RobertaModel`, `XLMRobertaModel`) in Equinox: BERT with positions from the ids.

What is RoBERTa's own is its positions: each token's is the count of non-padding ids up
to it, offset by the padding id (`pad_token_id`, 1 in every released checkpoint), so
real tokens take `pad + 1, pad + 2, ...` and a padding id keeps the position `pad`,
whatever the attention mask (transformers' `create_position_ids_from_input_ids`). The
rest is `port.models.bert.Bert`, run with those positions; a sequence may then be at
most `max_position_embeddings - pad_token_id - 1` tokens long (512 for 514 positions).

Example:
    ```python
    import jax
    import jax.numpy as jnp
    from port.models.roberta import Roberta, positions

    config = {"model_type": "roberta", "vocab_size": 50265, "hidden_size": 64,
              "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 128,
              "max_position_embeddings": 514, "type_vocab_size": 1, "pad_token_id": 1,
              "layer_norm_eps": 1e-5}
    model = Roberta.from_config(config, key=jax.random.key(0))
    ids = jnp.array([[0, 713, 16, 2], [0, 713, 2, 1]])   # 1: padding
    mask = (ids != 1).astype(jnp.int32)
    hidden = model(ids, attention_mask=mask)          # (2, 4, 64)
    positions(ids, 1)                                 # [[2, 3, 4, 5], [2, 3, 4, 1]]
    ```
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar, final

import equinox as eqx
import jax.numpy as jnp
from jax.typing import ArrayLike
from jaxtyping import Array, Float, Int, PRNGKeyArray

from port._errors import ConfigError
from port._text import quoted
from port.models.bert import ENCODER_FIELDS, Bert, BertConfig
from port.nn._inputs import check_ids
from port.nn.config import ConfigFields, check_model_type

MODEL_TYPES = ("roberta", "xlm-roberta")


def positions(input_ids: Int[Array, "*batch seq"], padding_idx: int) -> Int[Array, "*batch seq"]:
    """RoBERTa's positions: `padding_idx` plus the count of non-padding ids so far; a padding id's is `padding_idx`."""
    real = (input_ids != padding_idx).astype(jnp.int32)
    return jnp.cumsum(real, axis=-1) * real + padding_idx


def read_padding_idx(config: dict, max_positions: int) -> int:
    """`pad_token_id` (absent: RobertaConfig's 1), an integer leaving at least one position after it."""
    value = config.get("pad_token_id", 1)
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= max_positions - 2:
        raise ConfigError(
            f"config.json: 'pad_token_id' must be an integer from 0 to {max_positions - 2} "
            f"(RoBERTa's positions follow it, below 'max_position_embeddings' {max_positions}), got {quoted(value)}"
        )
    return value


@final
class Roberta(eqx.Module):
    """The RoBERTa / XLM-R encoder: `bert` (a `port.models.bert.Bert`) run on positions from the ids."""

    FIELDS: ClassVar[ConfigFields] = dataclasses.replace(ENCODER_FIELDS, module="port.models.roberta.Roberta")

    bert: Bert
    padding_idx: int = eqx.field(static=True)

    def __init__(self, config: BertConfig, padding_idx: int, *, key: Any, dtype: Any = jnp.float32):
        self.bert = Bert(config, key=key, dtype=dtype)
        self.padding_idx = padding_idx

    @classmethod
    def from_config(cls, config: dict, *, key: PRNGKeyArray, dtype: Any = jnp.float32) -> Roberta:
        """Randomly initialise from a RoBERTa or XLM-R `config.json` dict (pooler included)."""
        cls.FIELDS.check(config)
        check_model_type(config, MODEL_TYPES, cls.FIELDS.module)
        bert = BertConfig.read(config)
        return cls(bert, read_padding_idx(config, bert.max_position_embeddings), key=key, dtype=dtype)

    def __call__(
        self,
        input_ids: ArrayLike,
        attention_mask: Any = None,
        token_type_ids: ArrayLike | None = None,
        *,
        dtype: Any = None,
        remat: Any = None,
    ) -> Float[Array, "*batch seq embed"]:
        """The last hidden state, for `input_ids` of shape (batch, seq) or (seq,).

        The arguments are `Bert.__call__`'s; the positions come from `input_ids` (not
        from `attention_mask`), as in transformers. `ValueError` for a sequence longer
        than `max_position_embeddings - pad_token_id - 1`.
        """
        longest = self.bert.config.max_position_embeddings - self.padding_idx - 1
        check_ids(input_ids, limit=("max_position_embeddings - pad_token_id - 1", longest))
        return self.bert(
            input_ids,
            attention_mask,
            token_type_ids,
            position_ids=positions(jnp.asarray(input_ids), self.padding_idx),
            dtype=dtype,
            remat=remat,
        )

    def pooled(self, hidden: Float[Array, "... embed"]) -> Float[Array, "... embed_out"]:
        """The pooler output, `tanh(dense(hidden[..., 0, :]))` (`Bert.pooled`)."""
        return self.bert.pooled(hidden)
