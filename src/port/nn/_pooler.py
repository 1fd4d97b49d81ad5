"""An encoder's pooler: the first token's hidden state through a dense layer and an activation.

```python
pooler = Pooler(64, 64, jnp.float32, key=jax.random.key(0))
pooled = pooler(hidden, jnp.tanh, "BERT")      # hidden: (batch, seq, 64) -> (batch, 64)
```
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, final

import equinox as eqx
import jax.numpy as jnp
from jaxtyping import Array, Float, PRNGKeyArray

from port.nn._init import normal
from port.nn._mlp import linear


@final
class Pooler(eqx.Module):
    """An encoder's pooler: `activation(dense(hidden[..., 0, :]))`, the first token's state.

    BERT's (`tanh`) and ViT's (`pooler_act`). The leaves are torch `Linear`'s, `weight`
    `[out, embd]` and `bias` `[out]`, so mappings name them `pooler.weight` /
    `pooler.bias`; a checkpoint without a pooler leaves both None, and calling it then
    raises.

    **Arguments:**

    - `embd`, `out`: the input and output sizes.
    - `dtype`, `key`: the parameters' dtype and initialisation key (N(0, 0.02), zero bias).

    Called as `pooler(hidden, activation, name)`: `hidden` `(batch, seq, embd)` gives
    `(batch, out)`, unbatched `(seq, embd)` gives `(out,)`; `name` is the family, for
    the error message.

    ```python
    pooler = Pooler(64, 64, jnp.float32, key=jax.random.key(0))
    pooler(jnp.zeros((2, 8, 64)), jnp.tanh, "BERT").shape   # (2, 64)
    ```
    """

    weight: Float[Array, "embed_out embed"] | None
    bias: Float[Array, " embed_out"] | None

    def __init__(self, embd: int, out: int, dtype: Any, *, key: PRNGKeyArray):
        self.weight = normal(key, (out, embd), dtype)
        self.bias = jnp.zeros((out,), dtype)

    def __call__(
        self, hidden: Float[Array, "... embed"], activation: Callable[[Array], Array], name: str
    ) -> Float[Array, "... embed_out"]:  # hidden (batch, seq, embed) or (seq, embed): checked here
        if self.weight is None:  # port leaves absent leaves None
            raise ValueError(
                f"this {name} checkpoint has no pooler weights ('pooler.dense.weight'); "
                "use the hidden state instead of the pooled output"
            )
        if jnp.ndim(hidden) not in (2, 3):
            raise ValueError(
                f"`hidden` must have shape (batch, seq, embd) or (seq, embd), got {tuple(jnp.shape(hidden))}"
            )
        return activation(linear(hidden[..., 0, :], self.weight, self.bias))
