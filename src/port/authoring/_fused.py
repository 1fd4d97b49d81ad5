"""Leftovers: hints for a key no leaf fits whole (a fused tensor), and a head tied to an embedding.

GPT-2's `c_attn` holds q, k and v side by side: no leaf has its shape, but three
equal parts of it each fit a leaf. `fused_hint` finds such a split and drafts the
entries for its parts (commented out: the order of the parts is a guess). `tied_to`
recognises an `lm_head.weight` the model has no leaf for as a copy of the embedding.

```python
hint = fused_hint(group, free, transposed, config, dims)
hint.lines     # ["#     fused? [64, 192] on axis 1 is 3 x [64, 64]: try { split = ... }", ...]
hint.entries   # three Entry, one per part, in q, k, v order
```
"""

from __future__ import annotations

import math
from collections.abc import Mapping as AnyMapping
from collections.abc import Sequence
from typing import Any

from .._transforms import Split
from ._axes import Dims, named, propose_axes
from ._draft import Entry, FusedHint, shape_text
from .._dtypes import floating
from ._keys import Group
from ._names import tokens
from ._pairing import Candidate, Leaf, builds, chains, pick, target_shape

FUSED_PARTS = (2, 3, 4)
_FUSED_ORDER = ("q", "k", "v", "gate", "up")


def _fused_rank(path: str) -> tuple[int, str]:
    """q, k, v (or gate, up) order for the parts of a fused tensor."""
    return min((_FUSED_ORDER.index(t) for t in tokens(path) if t in _FUSED_ORDER), default=9), path


def fused_hint(
    group: Group, free: Sequence[Leaf], transposed: bool, config: AnyMapping[str, Any], dims: Dims
) -> FusedHint | None:
    """For an unpaired key that is k equal parts along one axis, each fitting an unfilled leaf."""
    for parts in FUSED_PARTS:
        for axis, size in enumerate(group.shape):
            if size % parts:
                continue
            part = group.shape[:axis] + (size // parts,) + group.shape[axis + 1 :]
            fits = []
            for leaf in free:
                target = target_shape(group, leaf)
                options = chains(part, target) if target is not None else ()
                if options:
                    fits.append((leaf, pick(options, part, transposed)[0], target))
            if not fits:
                continue
            split = Split(axis, 0, parts=parts)
            shown = ", ".join(f"{leaf.path} {shape_text(leaf.shape)}" for leaf, _, _ in fits[:6])
            lines = [
                f"#     fused? {shape_text(group.shape)} on axis {axis} is {parts} x {shape_text(part)}: "
                f"try {split.render()}",
                f"#     fits {shown}" + (f" and {len(fits) - 6} more" if len(fits) > 6 else ""),
            ]
            entries = []
            if len(fits) == parts:
                for index, (leaf, ops, target) in enumerate(sorted(fits, key=lambda f: _fused_rank(f[0].path))):
                    split_op = Split(axis, index, parts=parts)
                    all_ops = (split_op, *named(ops, part, target, config))
                    if not builds(all_ops, group.shape, target, config):
                        entries = []
                        break
                    entries.append(Entry(group.pattern, leaf.path, all_ops, propose_axes(leaf, group.stacked, dims)[0]))
                if entries:
                    lines.append("#     a draft, parts in q, k, v order (CHECK the order; uncomment to use):")
            return FusedHint(lines, entries)
    return None


def tied_to(group: Group, pairs: Sequence[Candidate], free: Sequence[Leaf]) -> str | None:
    """For an unpaired `lm_head.weight` the model has no leaf for: the paired key it likely copies."""
    if not group.pattern.endswith("lm_head.weight") or group.stacked:
        return None
    size = math.prod(group.shape)
    if any(math.prod(leaf.shape) == size and floating(leaf.dtype) == floating(group.dtype) for leaf in free):
        return None
    same = [c.group.pattern for c in pairs if not c.group.stacked and c.group.shape == group.shape]
    if not same:
        return None
    return min(same, key=lambda p: ("embed" not in tokens(p), p))
