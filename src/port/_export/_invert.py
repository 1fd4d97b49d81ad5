"""Invert: the forward plan walked backwards, to the checkpoint tensors an export writes.

The forward plan says, for every leaf, which source tensors, which transforms and which
layer made it; `invert` walks it backwards. Every source tensor becomes one output
tensor (a fused `c_attn` or `qkv_proj` from all of its parts, a stacked leaf one tensor
per layer), with the source's name, shape and dtype; ignored buffers and tied
duplicates are not written, as `save_pretrained` leaves them out. Pure: no tensor data.

```python
inverse = invert(port.plan(skel, mapping, ckpt.tensors, ckpt.config, {"data": 1, "model": 1}), headers)
[t.key for t in inverse.tensors]      # the checkpoint's keys but ignored and tied ones
inverse.parts["h.0.attn.c_attn.weight"]   # the leaves (and layer) q, k and v come from
```
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from collections.abc import Mapping as AnyMapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from .._dtypes import dtype as dtype_named
from .._dtypes import floating
from .._errors import PlanError
from .._plan import LeafPlan, Plan
from ._safetensors import OutTensor


@dataclass(frozen=True)
class Part:
    """One leaf, or one layer (expert) of a stacked leaf, that an output tensor is rebuilt from."""

    leaf: LeafPlan
    index: tuple[int, ...] = ()  # its place in the leaf's stack dimensions: (layer,), (layer, expert), ()


@dataclass(frozen=True)
class Inverse:
    """The plan walked backwards: the output tensors, in the source's order, and their parts."""

    tensors: tuple[OutTensor, ...]
    parts: dict[str, tuple[Part, ...]]
    source_dtypes: dict[str, np.dtype]

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)

    def renamed(self, name: Callable[[str], str], source: str = "mapping") -> Inverse:
        """The same tensors written under `name(key)` (a multimodal checkpoint's language model in
        its text-only class's layout); `PlanError` where two keys get one name.

        ```python
        inverse.renamed(mapping.export["gemma3"].key)    # language_model.model.* -> model.*
        ```
        """
        names = {t.key: name(t.key) for t in self.tensors}
        taken: dict[str, str] = {}
        for key, new in names.items():
            if new in taken:
                raise PlanError([f"{source}: tensors '{taken[new]}' and '{key}' would both be written as '{new}'"])
            taken[new] = key
        return Inverse(
            tuple(dataclasses.replace(t, key=names[t.key]) for t in self.tensors),
            {names[k]: parts for k, parts in self.parts.items()},
            {names[k]: d for k, d in self.source_dtypes.items()},
        )


def _fused_at(chain: Any) -> int | None:
    fused = [i for i, t in enumerate(chain.transforms) if t.fused]
    return fused[0] if fused else None


def _invertible(key: str, parts: list[Part], source: str) -> str | None:
    """Why the parts of `key` cannot rebuild it, or None (the checks `Chain.inverse` makes, without data)."""
    chains = [p.leaf.chain for p in parts]
    entries = ", ".join(f"'{p.leaf.pattern}' -> '{p.leaf.path}'" for p in parts[:3])
    k = _fused_at(chains[0])
    if k is None:
        if len(parts) > 1:
            return f"{source}: tensor '{key}' fills {len(parts)} leaves ({entries}) without a split"
        return None
    split = chains[0].transforms[k]
    family = split.siblings(chains[0].shapes[k])
    kept = set()
    for chain in chains:
        if _fused_at(chain) != k or chain.transforms[:k] != chains[0].transforms[:k]:
            return f"{source}: tensor '{key}' is cut differently by its entries ({entries})"
        if chain.transforms[k] not in family or any(t.fused for t in chain.transforms[k + 1 :]):
            return f"{source}: tensor '{key}': the entries ({entries}) split it twice or in two ways"
        kept.add(family.index(chain.transforms[k]))
    missing = [i for i in range(len(family)) if i not in kept]
    if missing:
        return (
            f"{source}: entry '{parts[0].leaf.pattern}': the fused tensor '{key}' has {len(family)} parts but the "
            f"entries keep only {sorted(kept)}; without part{'s' if len(missing) > 1 else ''} {missing} it cannot "
            "be written back"
        )
    return None


def invert(
    recipe: Plan,
    sources: AnyMapping[str, tuple[tuple[int, ...], np.dtype]],
    source: str = "mapping",
    dtype: str | np.dtype | None = None,
) -> Inverse:
    """The output tensors of `recipe` walked backwards; `PlanError` naming every entry that cannot be.

    **Arguments:**

    - `recipe`: the forward `Plan` (for the source's headers).
    - `sources`: the source tensors' shapes and dtypes by name, in the order to write them.
    - `source`: how messages name the mapping.
    - `dtype`: write floating tensors in this dtype; default: each source tensor's own.

    ```python
    inverse = invert(port.plan(skel, mapping, ckpt.tensors, ckpt.config, {"data": 1, "model": 1}), headers)
    [t.key for t in inverse.tensors]      # the checkpoint's keys but ignored and tied ones
    ```
    """
    target = None if dtype is None else dtype_named(dtype)
    grouped: dict[str, list[Part]] = {}
    for leaf in recipe.leaves:
        for i, key in enumerate(leaf.keys):
            index = tuple(int(i) for i in np.unravel_index(i, leaf.stack)) if leaf.stacked else ()
            grouped.setdefault(key, []).append(Part(leaf, index))
    problems = [why for key, parts in grouped.items() if (why := _invertible(key, parts, source))]
    if problems:
        raise PlanError(problems)
    tensors, parts, source_dtypes = [], {}, {}
    for key, (shape, source_dtype) in sources.items():
        if key not in grouped:
            continue  # ignored or tied: `save_pretrained` leaves them out too
        out = target if target is not None and floating(source_dtype) else np.dtype(source_dtype)
        tensors.append(OutTensor(key, tuple(shape), out))
        parts[key] = tuple(grouped[key])
        source_dtypes[key] = np.dtype(source_dtype)
    return Inverse(tuple(tensors), parts, source_dtypes)
