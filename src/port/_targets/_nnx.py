"""Flax NNX targets: a module's variables by their state paths, filled with `nnx.merge`.

A leaf's path is its path in `nnx.state(module)`: `layers.3.attn.q_proj.kernel` for a
kernel inside the fourth block of an `nnx.List`. Every variable is a leaf; the ones that
are not `nnx.Param` (an `nnx.Rngs`' key and count, a cache) are the module's own state:
a mapping may fill them, and need not. A variable annotated with sharding names
(`nnx.with_partitioning(init, ("embed", "mlp"))`: the `out_sharding`, `sharding_names` or
`sharding` metadata) gives its leaf those logical axes, unless the mapping names others.

port never imports Flax: it uses the `flax.nnx` the code that made the module imported
(`sys.modules`), so a tree of another kind never loads it.

```python
abstract = nnx.eval_shape(lambda: Llama(cfg, rngs=nnx.Rngs(0)))
NNXTarget().leaves(abstract)["layers.0.attn.q_proj.kernel"]    # ShapeDtypeStruct((64, 64), float32)
NNXTarget().axes(abstract)["embed.embedding"]                  # ("vocab", "embed")
```
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from typing import Any

from .._errors import PortError
from ._target import Target

SHARDING_METADATA = ("out_sharding", "sharding_names", "sharding")
"""The metadata names Flax has kept a variable's sharding names under (0.12, 0.11, earlier)."""


def nnx() -> Any:
    """`flax.nnx`, as the code that made an NNX tree imported it (port imports no Flax of its own)."""
    return sys.modules["flax.nnx"]


def is_nnx(tree: Any) -> bool:
    """Whether `tree` is a Flax NNX module (False, and nothing imported, when Flax is not in use)."""
    module = sys.modules.get("flax.nnx")
    return module is not None and isinstance(tree, module.Module)


def _path(keys: tuple) -> str:
    return ".".join(str(k) for k in keys)


class NNXTarget(Target):
    """A Flax NNX module (`nnx.Module`), abstract (`nnx.eval_shape`) or concrete."""

    name = "Flax NNX module"

    @staticmethod
    def _flat(tree: Any) -> tuple[Any, list[tuple[tuple, Any]]]:
        graphdef, state = nnx().split(tree)
        return graphdef, list(nnx().to_flat_state(state))

    def leaves(self, tree: Any) -> dict[str, Any]:
        _, flat = self._flat(tree)
        return {_path(keys): variable.get_value() for keys, variable in flat}

    def fill(self, tree: Any, arrays: Mapping[str, Any]) -> Any:
        graphdef, flat = self._flat(tree)
        paths = [_path(keys) for keys, _ in flat]
        unknown = set(arrays) - set(paths)
        if unknown:
            raise PortError(f"fill: '{sorted(unknown)[0]}' is not a variable of the {type(tree).__name__} module")
        filled = [
            (keys, variable.replace(arrays[path]) if path in arrays else variable)
            for path, (keys, variable) in zip(paths, flat)
        ]
        return nnx().merge(graphdef, nnx().from_flat_state(filled))

    def axes(self, tree: Any) -> dict[str, tuple[str | None, ...]]:
        _, flat = self._flat(tree)
        found = {}
        for keys, variable in flat:
            metadata = variable.get_metadata()
            names = next((metadata[m] for m in SHARDING_METADATA if metadata.get(m)), None)
            if names is not None:  # a dimension named by several mesh axes has no one logical axis: None
                found[_path(keys)] = tuple(name if isinstance(name, str) else None for name in names)
        return found

    def own(self, tree: Any) -> dict[str, str]:
        _, flat = self._flat(tree)
        return {_path(keys): type(v).__name__ for keys, v in flat if not isinstance(v, nnx().Param)}

    def tree(self, model: Any) -> Any:
        return nnx().to_pure_dict(nnx().state(model))
