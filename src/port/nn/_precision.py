"""Computing in one dtype while the parameters stay in another (bfloat16 compute on float32 parameters).

```python
logits = model(ids, dtype=jnp.bfloat16)     # every family takes `dtype=`; it calls:
half = cast(model, jnp.bfloat16)            # floating arrays cast, the rest untouched
```
The cast is differentiable: under `jax.grad` the gradients arrive in the parameters'
own dtype (float32), as mixed-precision training wants.
"""

from __future__ import annotations

from typing import Any, TypeVar

import equinox as eqx
import jax
import jax.numpy as jnp

T = TypeVar("T")


def cast(module: T, dtype: Any) -> T:
    """`module` with every floating array cast to `dtype` (None: unchanged).

    **Arguments:**

    - `module`: any pytree (a model, a layer).
    - `dtype`: a floating dtype, or None.

    **Returns:** the same pytree, its floating arrays in `dtype`; integer and boolean
    arrays and non-array leaves untouched. Raises `TypeError` for a non-floating `dtype`.

    ```python
    half = cast(model, jnp.bfloat16)          # what model(ids, dtype=jnp.bfloat16) runs
    cast(jnp.ones(3), jnp.bfloat16).dtype     # bfloat16
    ```
    """
    if dtype is None:
        return module
    dtype = jnp.dtype(dtype)
    if not jnp.issubdtype(dtype, jnp.floating):
        raise TypeError(f"`dtype` must be a floating dtype, got {dtype}")

    def convert(leaf: Any) -> Any:
        if eqx.is_array(leaf) and jnp.issubdtype(leaf.dtype, jnp.floating):
            return leaf.astype(dtype)
        return leaf

    return jax.tree.map(convert, module)
