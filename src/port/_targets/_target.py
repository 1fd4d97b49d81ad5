"""Target: what port asks of the tree it fills, whatever framework wrote it.

The converter knows no framework: plan and place need a tree's leaves by path
(shapes and dtypes, or arrays), fill needs to put arrays back at those paths. A
`Target` answers for one kind of tree; `target_of` picks the one for a tree.

```python
target = target_of(skel)           # PytreeTarget for an Equinox module or a dict, NNXTarget for nnx
target.leaves(skel)["blocks.attn.wq"]     # ShapeDtypeStruct((12, 12, 64, 768), float32)
model = target.fill(skel, arrays)
```
"""

from __future__ import annotations

import abc
from collections.abc import Mapping
from typing import Any


class Target(abc.ABC):
    """One kind of tree port fills: its leaves by dotted path, and how arrays go back in."""

    name: str = ""
    """How messages name the kind: `"Equinox module"`, `"Flax NNX module"`, `"pytree"`."""

    @abc.abstractmethod
    def leaves(self, tree: Any) -> dict[str, Any]:
        """Every array leaf of `tree` (arrays or `ShapeDtypeStruct`s) by its dotted path."""

    @abc.abstractmethod
    def fill(self, tree: Any, arrays: Mapping[str, Any]) -> Any:
        """A new `tree` with the leaves at the paths of `arrays` replaced (None: left out); `tree` is unchanged."""

    def axes(self, tree: Any) -> dict[str, tuple[str | None, ...]]:
        """The logical axes the tree annotates its leaves with, by path, one name (or None) a dimension
        ({} where it annotates none)."""
        return {}

    def own(self, tree: Any) -> dict[str, str]:
        """The leaves a mapping need not fill, by path, each with what it is (`"RngKey"`): the
        module's own state, which keeps the value its constructor gives it."""
        return {}

    def tree(self, model: Any) -> Any:
        """`model` as a plain pytree whose key paths are its leaves' paths (what an output stores)."""
        return model
