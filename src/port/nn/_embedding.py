"""Token embeddings and the language-model head, tied to them or not.

```python
embed, lm_head = embeddings(key, vocab=32000, embd=2048, dtype=jnp.float32, tied=False)
logits = head(x, embed, lm_head)          # x: [batch, seq, embd] -> [batch, seq, vocab]
```
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, PRNGKeyArray

from port.nn._init import normal


def embeddings(
    key: PRNGKeyArray, *, vocab: int, embd: int, dtype: Any, tied: bool
) -> tuple[Float[Array, "vocab embed"], Float[Array, "vocab embed"] | None]:
    """A token embedding table and an output head of the same shape, or None when tied.

    **Arguments:**

    - `key`: the initialisation key (N(0, 0.02) weights).
    - `vocab`, `embd`: the table's shape.
    - `dtype`: the parameters' dtype.
    - `tied`: config.json's `tie_word_embeddings`: the head is the embedding table.

    **Returns:** `(embed, lm_head)`, `lm_head` None when tied.

    ```python
    embed, lm_head = embeddings(jax.random.key(0), vocab=100, embd=16, dtype=jnp.float32, tied=True)
    lm_head is None   # True
    ```
    """
    kembed, khead = jax.random.split(key)
    shape = (vocab, embd)
    return normal(kembed, shape, dtype), None if tied else normal(khead, shape, dtype)


def head(
    x: Float[Array, "*batch seq embed"], embed: Float[Array, "vocab embed"], lm_head: Float[Array, "vocab embed"] | None
) -> Float[Array, "*batch seq vocab"]:
    """The logits of hidden states `x`: `x @ lm_head.T`, or `x @ embed.T` when the head is tied.

    **Arguments:**

    - `x`: the final hidden states.
    - `embed`: the token embedding table.
    - `lm_head`: the untied head, or None.

    **Returns:** logits `[..., vocab]`.

    ```python
    logits = head(x, model.embed, model.lm_head)
    ```
    """
    return jnp.einsum("...e,ve->...v", x, embed if lm_head is None else lm_head)
