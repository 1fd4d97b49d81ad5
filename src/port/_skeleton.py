"""Skeleton: the target module's shapes and dtypes, built with no memory.

```python
model = skeleton(mapping, config)   # leaves are jax.ShapeDtypeStruct
leaves(model)["blocks.attn.wq"]      # ShapeDtypeStruct((12, 12, 64, 768), float32)
```
"""

from __future__ import annotations

from collections.abc import Mapping as AnyMapping
from typing import Any

import equinox as eqx
import jax

from ._errors import PortError
from ._mapping import Mapping
from ._model import is_model


def skeleton(model: Mapping | type, config: AnyMapping[str, Any]) -> eqx.Module:
    """The module built from `config` as shapes only, with `eqx.filter_eval_shape`: no memory used.

    **Arguments:**

    - `model`: a model class (`port.Model`: an Equinox module class with
      `from_config(config, *, key)`), or a `Mapping` (its `model` class).
    - `config`: the checkpoint's `config.json` as a dict.

    ```python
    from port.models.gpt2 import GPT2

    skel = port.skeleton(GPT2, ckpt.config)
    skel.blocks.attn.wq          # ShapeDtypeStruct(shape=(12, 768, 12, 64), dtype=float32)
    ```
    """
    cls = model.model_class() if isinstance(model, Mapping) else model
    if not is_model(cls):
        raise PortError(f"model '{cls.__module__}:{cls.__qualname__}' has no from_config(config, *, key)")
    return eqx.filter_eval_shape(lambda: cls.from_config(dict(config), key=jax.random.key(0)))


def path_str(keypath: tuple) -> str:
    """A pytree key path as a dotted module path: `blocks.attn.wq`, `layers.0.weight`."""
    parts = []
    for k in keypath:
        for attr in ("name", "key", "idx"):
            if hasattr(k, attr):
                parts.append(str(getattr(k, attr)))
                break
        else:
            parts.append(str(k))
    return ".".join(parts)


def leaves(module: Any) -> dict[str, Any]:
    """Every leaf of `module` by its dotted path (arrays, or their ShapeDtypeStructs)."""
    flat, _ = jax.tree_util.tree_flatten_with_path(module)
    return {path_str(p): leaf for p, leaf in flat}
