"""Parameter initialisation and stacking, shared by every layer and family.

```python
w = normal(key, (64, 32), jnp.float32)                 # N(0, 0.02), transformers' default
b = zeros_if(config.bias, (64,), jnp.float32)           # None without a bias
blocks = stacked(lambda k: Block(config, key=k), key, 12)   # arrays gain a leading [12] axis
```
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, PRNGKeyArray

T = TypeVar("T")

_SHAPES_ONLY = contextvars.ContextVar("port_shapes_only", default=False)


@contextlib.contextmanager
def shapes_only() -> Iterator[None]:
    """Within it, `normal` makes zeros and `stacked` repeats its key instead of drawing random
    numbers: the same shapes and dtypes, traced in a fraction of the time. `port.skeleton`
    builds under it, since under `eval_shape` only the shapes are kept (the random number
    generator's first trace alone took 0.1-0.2 s of a GPT-2 medium load).

    **Arguments:** none.

    **Returns:** a context manager.

    ```python
    with shapes_only():
        skel = jax.eval_shape(lambda: GPT2.from_config(config, key=jax.random.key(0)))
    ```
    """
    token = _SHAPES_ONLY.set(True)
    try:
        yield
    finally:
        _SHAPES_ONLY.reset(token)


def normal(key: PRNGKeyArray, shape: tuple[int, ...], dtype: Any, std: float = 0.02) -> Array:
    """A weight drawn from a normal distribution of mean 0 and standard deviation `std`,
    the initialisation transformers gives linear layers.

    **Arguments:**

    - `key`: the PRNG key.
    - `shape`: the weight's shape.
    - `dtype`: its dtype (a floating one).
    - `std`: the standard deviation (default 0.02, transformers' usual `initializer_range`).

    **Returns:** an array of `shape` and `dtype`.

    ```python
    w = normal(jax.random.key(0), (64, 32), jnp.float32)   # (64, 32), std 0.02
    ```
    """
    if _SHAPES_ONLY.get():
        return jnp.zeros(shape, dtype)
    return std * jax.random.normal(key, shape, dtype)


def zeros_if(flag: bool, shape: tuple[int, ...], dtype: Any) -> Array | None:
    """Zeros of `shape` when `flag` (a bias the config asks for), else None.

    **Arguments:**

    - `flag`: whether the parameter exists.
    - `shape`: its shape.
    - `dtype`: its dtype.

    **Returns:** zeros of `shape` and `dtype`, or None (an absent leaf).

    ```python
    zeros_if(True, (64,), jnp.float32).shape    # (64,)
    zeros_if(False, (64,), jnp.float32)         # None
    ```
    """
    return jnp.zeros(shape, dtype) if flag else None


def stacked(make: Callable[[PRNGKeyArray], T], key: PRNGKeyArray, count: int) -> T:
    """`count` modules made by `make(key)`, their arrays stacked on a new leading axis.

    The stacked form is what `scan` runs (one compiled layer, whatever the depth) and
    what mappings fill with `{layer}` / `{expert}` keys.

    **Arguments:**

    - `make`: makes one module from a key (under `eqx.filter_vmap`, once for all).
    - `key`: split into `count` keys, one per module.
    - `count`: how many (layers, experts).

    **Returns:** one module of `make`'s type whose arrays have a leading `[count]` axis;
    its non-array fields (static settings) are shared.

    ```python
    make = lambda k: GatedMLP(embd=64, inner=128, activation="silu", dtype=jnp.float32, key=k)
    experts = stacked(make, jax.random.key(0), 8)
    experts.gate.shape                          # (8, 128, 64)
    ```
    """
    keys = jnp.broadcast_to(key, (count,)) if _SHAPES_ONLY.get() else jax.random.split(key, count)
    return eqx.filter_vmap(make)(keys)
