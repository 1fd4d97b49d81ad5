"""Fill: put the placed arrays into the skeleton with one `eqx.tree_at`.

```python
model = fill(skel, arrays)    # every ShapeDtypeStruct replaced by its jax.Array
```
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import equinox as eqx
import jax

from ._skeleton import leaves


def fill(skeleton: Any, arrays: Mapping[str, jax.Array | None]) -> Any:
    """The module `skeleton` with the leaves at the paths of `arrays` replaced, in one `eqx.tree_at` call.

    **Arguments:**

    - `skeleton`: the module to fill, usually the `eqx.filter_eval_shape` skeleton from
      `port.skeleton` (a concrete module works too).
    - `arrays`: dotted module paths (`"blocks.attn.wq"`) to arrays, as `place` returns them;
      None for a leaf left out (a partial load's excluded leaves are None in the model).

    Returns a new module; `skeleton` is unchanged.

    ```python
    model = port.fill(skel, port.place(recipe, ckpt, mesh))
    ```
    """
    paths = list(arrays)

    def where(module: Any) -> list[Any]:
        by_path = leaves(module)
        return [by_path[p] for p in paths]

    return eqx.tree_at(where, skeleton, [arrays[p] for p in paths])
