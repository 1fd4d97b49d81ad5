"""The causal language-modelling loss, as transformers computes it with `labels`.

```python
loss = next_token_loss(model(ids, attention_mask=mask), ids, mask)
grads = jax.grad(lambda m: next_token_loss(m(ids, attention_mask=mask), ids, mask))(model)
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
    logits = logits[..., :-1, :].astype(jnp.float32)
    targets = jnp.asarray(input_ids)[..., 1:]
    valid = jnp.ones(targets.shape, bool) if attention_mask is None else jnp.asarray(attention_mask)[..., 1:] != 0
    logp = jax.nn.log_softmax(logits, axis=-1)
    nll = -jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]
    return jnp.where(valid, nll, 0.0).sum() / jnp.maximum(valid.sum(), 1)
