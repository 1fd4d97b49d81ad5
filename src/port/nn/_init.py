"""Parameter initialisation and stacking, shared by every layer and family.

```python
w = normal(key, (64, 32), jnp.float32)                 # N(0, 0.02), transformers' default
b = zeros_if(config.bias, (64,), jnp.float32)           # None without a bias
blocks = stacked(lambda k: Block(config, key=k), key, 12)   # arrays gain a leading [12] axis
```
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, PRNGKeyArray

T = TypeVar("T")


def normal(key: PRNGKeyArray, shape: tuple[int, ...], dtype: Any, std: float = 0.02) -> Array:
    """A weight drawn from N(0, `std`), the initialisation transformers gives linear layers."""
    return std * jax.random.normal(key, shape, dtype)


def zeros_if(flag: bool, shape: tuple[int, ...], dtype: Any) -> Array | None:
    """Zeros of `shape` when `flag` (a bias the config asks for), else None."""
    return jnp.zeros(shape, dtype) if flag else None


def stacked(make: Callable[[PRNGKeyArray], T], key: PRNGKeyArray, count: int) -> T:
    """`count` modules made by `make(key)`, their arrays stacked on a new leading axis.

    The stacked form is what `scan` runs (one compiled layer, whatever the depth) and
    what mappings fill with `{layer}` / `{expert}` keys.
    """
    return eqx.filter_vmap(make)(jax.random.split(key, count))
