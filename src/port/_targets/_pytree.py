"""Pytree targets: Equinox modules, nested dicts of parameters (Linen, MaxText), any JAX pytree.

A leaf's path is its key path, dotted: `blocks.attn.wq` (attributes), `layers.3.weight`
(list items), `params.decoder.layers_0.mlp.kernel` (dict keys).

```python
skel = {"params": {"wte": jax.ShapeDtypeStruct((50257, 768), jnp.float32)}}
PytreeTarget().leaves(skel)          # {"params.wte": ShapeDtypeStruct(...)}
PytreeTarget().fill(skel, {"params.wte": array})["params"]["wte"] is array   # True
```
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax

from .._errors import PortError
from ._target import Target


def path_str(keypath: tuple) -> str:
    """A pytree key path as a dotted path: `blocks.attn.wq`, `layers.0.weight`, `params.wte`."""
    parts = []
    for k in keypath:
        for attr in ("name", "key", "idx"):
            if hasattr(k, attr):
                parts.append(str(getattr(k, attr)))
                break
        else:
            parts.append(str(k))
    return ".".join(parts)


class PytreeTarget(Target):
    """Any JAX pytree: an Equinox module, a dict of `ShapeDtypeStruct`s, a tuple of arrays."""

    name = "pytree"

    def leaves(self, tree: Any) -> dict[str, Any]:
        flat, _ = jax.tree_util.tree_flatten_with_path(tree)
        found: dict[str, Any] = {}
        for keypath, leaf in flat:
            path = path_str(keypath)
            if path in found:
                raise PortError(
                    f"two leaves of the {type(tree).__name__} target have the path '{path}' (a key holding '.'?): "
                    "a mapping could not tell them apart"
                )
            found[path] = leaf
        return found

    def fill(self, tree: Any, arrays: Mapping[str, Any]) -> Any:
        flat, treedef = jax.tree_util.tree_flatten_with_path(tree)
        paths = [path_str(keypath) for keypath, _ in flat]
        unknown = set(arrays) - set(paths)
        if unknown:
            raise PortError(f"fill: '{sorted(unknown)[0]}' is not a leaf of the {type(tree).__name__} target")
        return jax.tree_util.tree_unflatten(
            treedef, [arrays[path] if path in arrays else leaf for path, (_, leaf) in zip(paths, flat)]
        )
