"""The trees port fills: one adapter per framework, so the pipeline stays framework-free.

```python
target_of(eqx_module)     # PytreeTarget: Equinox modules, dicts of ShapeDtypeStruct, any pytree
target_of(nnx_module)     # NNXTarget: Flax NNX modules (Flax imported only when one is in use)
leaves(tree)              # every array leaf by dotted path, whatever the kind
fill(tree, arrays)        # the tree with those leaves replaced
```
"""

from collections.abc import Mapping as _Mapping
from typing import Any as _Any

from ._nnx import NNXTarget as NNXTarget
from ._nnx import is_nnx as is_nnx
from ._nnx import nnx as nnx
from ._pytree import PytreeTarget as PytreeTarget
from ._pytree import path_str as path_str
from ._target import Target as Target


def target_of(tree: _Any) -> Target:
    """The adapter for `tree`: `NNXTarget` for a Flax NNX module, else `PytreeTarget`."""
    return NNXTarget() if is_nnx(tree) else PytreeTarget()


def leaves(tree: _Any) -> dict[str, _Any]:
    """Every array leaf of `tree` (arrays, or their `ShapeDtypeStruct`s) by its dotted path."""
    return target_of(tree).leaves(tree)


def fill(tree: _Any, arrays: _Mapping[str, _Any]) -> _Any:
    """`tree` with the leaves at the paths of `arrays` replaced (None: a leaf left out)."""
    return target_of(tree).fill(tree, arrays)
