"""The losses transformers computes with `labels`: a decoder's next-token loss, and an
encoder-decoder's loss on the decoder's labels.

```python
loss = next_token_loss(model(ids, attention_mask=mask), ids, mask)
grads = jax.grad(lambda m: next_token_loss(m(ids, attention_mask=mask), ids, mask))(model)
loss = seq2seq_loss(t5(input_ids, decoder_input_ids, attention_mask=mask), labels)   # labels: -100 ignored
```
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike
from jaxtyping import Array, Float, Int


def next_token_loss(
    logits: Float[Array, "*batch seq vocab"], input_ids: Int[ArrayLike, "*batch seq"], attention_mask: Any = None
) -> Float[Array, ""]:
    """Mean cross-entropy of predicting each token from those before it, over real tokens.

    **Arguments:**

    - `logits`: the model's, `[batch, seq, vocab]` (or `[seq, vocab]`).
    - `input_ids`: the labels, `[batch, seq]` (or `[seq]`); the logits at slot t predict
      the token at t + 1.
    - `attention_mask`: `input_ids`' shape, 0 on padding: a padding label is ignored, as
      transformers' -100 is; None: every token counts.

    **Returns:** a float32 scalar: transformers' `model(ids, labels=ids with -100 on
    padding).loss`.

    ```python
    loss = next_token_loss(model(ids, attention_mask=mask), ids, mask)
    grads = jax.grad(lambda m: next_token_loss(m(ids, attention_mask=mask), ids, mask))(model)
    ```
    """
    targets = jnp.asarray(input_ids)[..., 1:]
    valid = jnp.ones(targets.shape, bool) if attention_mask is None else jnp.asarray(attention_mask)[..., 1:] != 0
    return _mean_nll(logits[..., :-1, :], targets, valid)


IGNORED = -100
"""The label transformers' losses skip."""


def seq2seq_loss(
    logits: Float[ArrayLike, "*batch seq vocab"], labels: Int[ArrayLike, "*batch seq"]
) -> Float[Array, ""]:
    """Mean cross-entropy of an encoder-decoder's logits against its labels, skipping -100.

    **Arguments:**

    - `logits`: the model's, `[batch, seq, vocab]` (or `[seq, vocab]`), for
      `decoder_input_ids` that are the labels shifted right (the logits at slot t predict
      the label at t: no shift here).
    - `labels`: `[batch, seq]` (or `[seq]`); -100 (`IGNORED`) where no loss is taken.

    **Returns:** a float32 scalar: transformers' `model(..., labels=labels).loss` (T5,
    Whisper, BART).

    ```python
    loss = seq2seq_loss(model(input_ids, decoder_input_ids, attention_mask=mask), labels)
    grads = jax.grad(lambda m: seq2seq_loss(m(input_ids, decoder_input_ids), labels))(model)
    ```
    """
    labels = jnp.asarray(labels)
    valid = labels != IGNORED
    return _mean_nll(jnp.asarray(logits), jnp.where(valid, labels, 0), valid)


def _mean_nll(logits: Array, targets: Array, valid: Array) -> Array:
    """The mean, over `valid` slots, of `-log softmax(logits)[target]`, in float32."""
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    nll = -jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]
    return jnp.where(valid, nll, 0.0).sum() / jnp.maximum(valid.sum(), 1)
