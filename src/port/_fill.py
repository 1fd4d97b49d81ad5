"""Fill: put the placed arrays into the skeleton, whatever framework wrote it.

```python
model = fill(skel, arrays)    # every ShapeDtypeStruct replaced by its jax.Array
```
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax

from ._targets import target_of


def fill(skeleton: Any, arrays: Mapping[str, jax.Array | None]) -> Any:
    """The module `skeleton` with the leaves at the paths of `arrays` replaced, in one pass.

    **Arguments:**

    - `skeleton`: the module to fill, usually the skeleton from `port.skeleton` (an Equinox
      module, a Flax NNX module or a pytree of `ShapeDtypeStruct`s; a concrete one works too).
    - `arrays`: dotted paths (`"blocks.attn.wq"`, an NNX state path `"layers.3.attn.wq.kernel"`,
      a dict's `"params.wte"`) to arrays, as `place` returns them; None for a leaf left out
      (a partial load's excluded leaves are None in the model).

    Returns a new module; `skeleton` is unchanged (an Equinox module or pytree is rebuilt
    from its leaves, an NNX module merged from its graph and the filled state).

    ```python
    model = port.fill(skel, port.place(recipe, ckpt, mesh))
    ```
    """
    return target_of(skeleton).fill(skeleton, arrays)
