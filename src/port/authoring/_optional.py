"""Optional leaves: what a module may hold that the variant in front of scaffold does not.

An Equinox module says which leaves a config may switch off by annotating them
`Float[Array, "heads head_dim"] | None` (Llama's `bq`, an untied `lm_head`); built from a
config without the feature, the field is None and the skeleton has no leaf for it. Its
shape is known all the same: each dimension's name is a dimension of a leaf beside it
(`wq: Float[Array, "heads head_dim embed"]`), and the leading axes of a stack are those
of its siblings. Its key is guessed from a sibling's: a bias from its weight's key
(`...q_proj.weight` -> `...q_proj.bias`, stored flat as a torch bias is), a weight with no
sibling from its own path (`lm_head` -> `lm_head.weight`).

```python
[(a.path, a.shape) for a in absent_leaves(skeleton)]   # [("blocks.attn.bq", (2, 6, 12)), ...]
```
"""

from __future__ import annotations

import dataclasses
import math
import typing
from collections.abc import Iterator, Sequence
from collections.abc import Mapping as AnyMapping
from typing import Any

import equinox as eqx
import numpy as np

from .._mapping import STACKS
from ._keys import Group
from ._names import tokens, weight_or_bias
from ._pairing import Leaf


@dataclasses.dataclass(frozen=True)
class Absent:
    """A leaf the module may hold but holds None here: its path, the shape it would have, its dtype."""

    path: str
    shape: tuple[int, ...]
    dtype: np.dtype


def absent_leaves(skeleton: Any) -> list[Absent]:
    """The array fields of an Equinox skeleton that are None here and annotated `X | None`, with the
    shape the annotation gives them (from the named sizes of the arrays beside them); fields
    whose sizes cannot be told, or under a list of layers, are left out."""
    if not isinstance(skeleton, eqx.Module):
        return []
    return list(_walk(skeleton, ""))


def _walk(module: eqx.Module, path: str) -> Iterator[Absent]:
    hints = _hints(type(module))
    present: list[tuple[tuple[str, ...], Any]] = []
    missing: list[tuple[str, tuple[str, ...]]] = []
    for f in dataclasses.fields(module):
        if f.metadata.get("static"):
            continue
        value, dims = getattr(module, f.name, None), _array_dims(hints.get(f.name))
        here = f"{path}.{f.name}" if path else f.name
        if isinstance(value, eqx.Module):
            yield from _walk(value, here)
        elif value is None and dims is not None and _optional(hints.get(f.name)):
            missing.append((here, dims))
        elif dims is not None and len(getattr(value, "shape", ())) >= len(dims) > 0:
            present.append((dims, value))
    sizes, lead, dtype = _sizes(present)
    for here, dims in missing:
        if lead is not None and all(d in sizes for d in dims):
            yield Absent(here, (*lead, *(sizes[d] for d in dims)), dtype)


def _hints(cls: type) -> dict[str, Any]:
    try:
        return typing.get_type_hints(cls)
    except Exception:  # an annotation that does not resolve: no field of it is told optional
        return {}


def _optional(hint: Any) -> bool:
    return type(None) in typing.get_args(hint)


def _array_dims(hint: Any) -> tuple[str, ...] | None:
    """The dimension names of a jaxtyping array annotation (`X` or `X | None`); None for anything else
    or a dimension that is not a plain name (`*batch`, `...`, a number)."""
    for arg in (hint, *typing.get_args(hint)):
        named = getattr(arg, "dims", None)
        if isinstance(getattr(arg, "dim_str", None), str) and isinstance(named, tuple):
            names = [getattr(d, "name", None) for d in named]
            plain = [n for n in names if isinstance(n, str) and n.isidentifier()]
            return tuple(plain) if len(plain) == len(names) else None
    return None


def _sizes(present: Sequence[tuple[tuple[str, ...], Any]]) -> tuple[dict[str, int], tuple[int, ...] | None, Any]:
    """Each dimension name's size, the leading (stack) axes and the dtype of a module's arrays."""
    sizes: dict[str, int] = {}
    leads = set()
    dtype = None
    for dims, value in present:
        shape = tuple(value.shape)
        lead = len(shape) - len(dims)
        leads.add(shape[:lead])
        sizes.update(zip(dims, shape[lead:]))
        dtype = dtype or np.dtype(value.dtype)
    return sizes, (leads.pop() if len(leads) == 1 else None), dtype


def stored(absent: Absent, keys: AnyMapping[str, str]) -> tuple[Group, Leaf, str] | None:
    """The key group an absent leaf would take, the leaf, and the key its key was guessed from ("": its path).

    `keys`: the drafted entries' key patterns by leaf path. A bias takes its weight's key with
    `bias` for `weight`, stored flat (one axis) on the weight's stack; a leaf at the top of the
    module with no weight beside it, its own path with `.weight`, stored in its shape. None when
    neither applies.
    """
    leaf = Leaf(absent.path, absent.shape, absent.dtype)
    if weight_or_bias(tokens(absent.path)) == "bias":
        partner = _weight_of(absent.path, keys)
        if partner is None or not keys[partner].endswith(".weight"):
            return None
        key = keys[partner][: -len("weight")] + "bias"
        stack = sum(segment in STACKS for segment in key.split("."))
        if stack >= len(absent.shape):
            return None
        each = math.prod(absent.shape[stack:])
        return Group(key, (), (each,), absent.dtype, counts=absent.shape[:stack]), leaf, keys[partner]
    if "." in absent.path:
        return None
    return Group(f"{absent.path}.weight", (), absent.shape, absent.dtype), leaf, ""


def _weight_of(path: str, keys: AnyMapping[str, str]) -> str | None:
    """The drafted leaf beside `path` that is its weight: the same tokens, `weight` for `bias`."""
    parent = path.rpartition(".")[0]
    want = tuple("weight" if t == "bias" else t for t in tokens(path))
    for other in keys:
        if other.rpartition(".")[0] == parent and tokens(other) == want:
            return other
    return None
