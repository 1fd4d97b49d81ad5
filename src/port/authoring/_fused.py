"""Leftovers: hints for a key no leaf fits whole (a fused tensor), and a head tied to an embedding.

GPT-2's `c_attn` holds q, k and v side by side: no leaf has its shape, but three
equal parts of it each fit a leaf. Phi-3's `qkv_proj` under grouped-query attention
holds q's rows, then k's and v's, fewer: parts of the leaves' own sizes. `fused_hint`
finds such a split and drafts the entries for its parts (commented out: the order of
the parts is a guess). `tied_to` recognises an `lm_head.weight` the model has no leaf
for as a copy of the embedding.

```python
hint = fused_hint(group, free, transposed, config, dims)
hint.lines     # ["#     fused? [64, 192] on axis 1 is 3 x [64, 64]: try { split = ... }", ...]
hint.entries   # three Entry, one per part, in q, k, v order
# Phi-3: [{ reshape = [-1, 4, "hidden_size"] },
#         { split = { axis = 0, sizes = ["num_attention_heads", "num_key_value_heads", ...], index = 0 } }]
```
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping as AnyMapping
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from .._dtypes import floating
from .._transforms import Reshape, Split, Transpose
from ._axes import Dims, config_name, named, propose_axes
from ._draft import Entry, FusedHint, shape_text
from ._keys import Group, Shape
from ._names import similarity, tokens, weight_or_bias
from ._pairing import Candidate, Leaf, Ops, builds, chains, pick, target_shape

FUSED_PARTS = (2, 3, 4)
MAX_PARTS = 4  # of an unequal split
MAX_FITS = 12  # leaves to choose unequal parts from when the key names none
_FUSED_ORDER = ("q", "k", "v", "gate", "up")
_FUSED_NAMES = {"qkv": ("q", "k", "v")}  # a token that names several parts


@dataclass(frozen=True)
class Part:
    """An unfilled leaf as a part of a fused tensor: `size` of its split axis, then `ops` to the leaf."""

    leaf: Leaf
    size: int
    ops: Ops  # from the part (per key) to the leaf's per-key `target`
    target: Shape


def _fused_rank(path: str) -> tuple[int, str]:
    """q, k, v (or gate, up) order for the parts of a fused tensor."""
    return min((_FUSED_ORDER.index(t) for t in tokens(path) if t in _FUSED_ORDER), default=9), path


def fused_hint(
    group: Group, free: Sequence[Leaf], transposed: bool, config: AnyMapping[str, Any], dims: Dims
) -> FusedHint | None:
    """For an unpaired key that is several parts along one axis, each fitting an unfilled leaf.

    Equal parts first (GPT-2's `c_attn`: `{ split = { axis = 1, parts = 3, index = 0 } }`); when
    they give no draft, parts of the leaves' own sizes (Phi-3's `qkv_proj` under grouped-query
    attention: `sizes`), see `unequal_hint`.
    """
    equal = _equal_hint(group, free, transposed, config, dims)
    if equal is not None and equal.entries:
        return equal
    return unequal_hint(group, free, transposed, config, dims) or equal


def _equal_hint(
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
                    leaf_axes = propose_axes(leaf, group.stack, dims)[0]
                    all_ops = (split_op, *named(ops, part, target, config, leaf_axes[len(group.stack) :]))
                    if not builds(all_ops, group.shape, target, config):
                        entries = []
                        break
                    entries.append(Entry(group.pattern, leaf.path, all_ops, leaf_axes))
                if entries:
                    lines.append("#     a draft, parts in q, k, v order (CHECK the order; uncomment to use):")
            return FusedHint(lines, entries)
    return None


def unequal_hint(
    group: Group, free: Sequence[Leaf], transposed: bool, config: AnyMapping[str, Any], dims: Dims
) -> FusedHint | None:
    """For an unpaired key whose axis is the concatenation of unfilled leaves of their own sizes.

    The parts are the leaves the key names (`qkv`: q, k and v; `gate_up`: gate and up), or
    else the only set of leaves whose sizes add up; `draft_parts` writes their entries.

    ```python
    hint = unequal_hint(qkv_proj, free, False, config, dims)    # [40, 24]: q [6, 4, 24], k and v [2, 4, 24]
    hint.entries[1].ops    # (Reshape((-1, 4, "hidden_size")),
                           #  Split(0, 1, sizes=("num_attention_heads", "num_key_value_heads", ...)))
    ```
    """
    for axis, size in enumerate(group.shape):
        parts = choose_parts(group, fitting_parts(group, axis, free, transposed), size)
        if parts is None or (drafted := draft_parts(group, axis, parts, config, dims)) is None:
            continue
        shared, entries = drafted
        sizes = shape_text(tuple(p.size for p in parts))
        shown = ", ".join(f"{p.leaf.path} {shape_text(p.leaf.shape)}" for p in parts)
        lines = [
            f"#     fused? {shape_text(group.shape)} on axis {axis} is {len(parts)} parts of sizes {sizes}: "
            f"try {', '.join(t.render() for t in shared)}",
            f"#     fits {shown}",
            "#     a draft, parts in the order above (CHECK it against the model's code; uncomment to use):",
        ]
        return FusedHint(lines, entries)
    return None


def fitting_parts(group: Group, axis: int, free: Sequence[Leaf], transposed: bool) -> list[Part]:
    """Each unfilled leaf that a run of `group`'s `axis` would fill, by some transpose/reshape chain."""
    shape = group.shape
    size, rest = shape[axis], math.prod(shape[:axis]) * math.prod(shape[axis + 1 :])
    found = []
    for leaf in free:
        target = target_shape(group, leaf)
        if target is None or not rest or math.prod(target) % rest:
            continue
        n = math.prod(target) // rest
        part = shape[:axis] + (n,) + shape[axis + 1 :]
        if 0 < n < size and (options := chains(part, target)):
            found.append(Part(leaf, n, pick(options, part, transposed)[0], target))
    return found


def _part_names(pattern: str) -> list[str]:
    """The parts a fused key names, in its order: `qkv_proj` -> q, k, v; `gate_up_proj` -> gate, up."""
    names = [n for t in tokens(pattern) for n in _FUSED_NAMES.get(t, (t,)) if n in _FUSED_ORDER]
    return list(dict.fromkeys(names))


def _kind_fits(key: str, part: Part) -> bool:
    """A weight's parts are weights and a bias's biases (as `candidate` pairs them)."""
    key_kind, leaf_kind = weight_or_bias(tokens(key)), weight_or_bias(tokens(part.leaf.path))
    if key_kind and leaf_kind:
        return key_kind == leaf_kind
    return not (key_kind == "bias" and leaf_kind is None and len(part.target) >= 2)


def choose_parts(group: Group, parts: Sequence[Part], size: int) -> list[Part] | None:
    """The parts that make up `size`, in order, or None when not exactly one set does.

    A key naming its parts (`qkv_proj`) takes, for each name, the best-named leaf with that
    name alone (`wq`); a key naming none takes the only set of at most `MAX_PARTS` leaves
    whose sizes add up to `size`, in q, k, v order.
    """
    parts = [p for p in parts if _kind_fits(group.pattern, p)]
    names = _part_names(group.pattern)
    if len(names) >= 2:
        chosen = []
        for name in names:
            mine = [p for p in parts if set(tokens(p.leaf.path)) & set(names) == {name}]
            scores = [similarity(group.pattern, p.leaf.path) for p in mine]
            best = [p for p, s in zip(mine, scores) if s == max(scores)]
            if len(best) != 1:
                return None
            chosen.append(best[0])
    elif len(parts) <= MAX_FITS:
        sets = [
            c
            for n in range(2, MAX_PARTS + 1)
            for c in itertools.combinations(parts, n)
            if sum(p.size for p in c) == size
        ]
        if len(sets) != 1:
            return None
        chosen = sorted(sets[0], key=lambda p: _fused_rank(p.leaf.path))
    else:
        return None
    return chosen if sum(p.size for p in chosen) == size else None


def draft_parts(
    group: Group, axis: int, parts: Sequence[Part], config: AnyMapping[str, Any], dims: Dims
) -> tuple[Ops, list[Entry]] | None:
    """The entries splitting `group` into `parts`, and the transforms they share (up to the split).

    Per head when the leaves differ in one axis whose sizes config.json names (q [heads, ...],
    k and v [kv_heads, ...]): reshape the fused tensor to that axis, then split it by those
    names, so that the mapping serves every size of the family. Otherwise split the fused
    axis by plain sizes (by config names where the split axis is the leaves' own), then
    reshape each part. None when the chain does not build.
    """
    leaf_axes = [propose_axes(p.leaf, group.stack, dims)[0] for p in parts]
    axes = [a[len(group.stack) :] for a in leaf_axes]  # of the per-key target
    shared, tails = _per_head(group, axis, parts, axes, config) or _on_axis(group, axis, parts, axes, config)
    split = shared[-1]
    assert isinstance(split, Split)  # both builders end the shared chain with the split
    entries = []
    for index, (part, tail, all_axes) in enumerate(zip(parts, tails, leaf_axes)):
        ops = (*shared[:-1], replace(split, index=index), *tail)
        if not builds(ops, group.shape, part.target, config):
            return None
        entries.append(Entry(group.pattern, part.leaf.path, ops, all_axes))
    return shared, entries


def _per_head(
    group: Group, axis: int, parts: Sequence[Part], axes: Sequence[list[str]], config: AnyMapping[str, Any]
) -> tuple[Ops, list[Ops]] | None:
    """`[reshape, split by config names]`, when the parts are runs of whole heads (or rows of any axis).

    Needs reshape-only parts whose targets differ in one axis `d` only, a fused tensor that,
    reshaped with the sum of their sizes at `d`, is cut where the fused axis is, and a
    config.json name for each size: Phi-3's qkv_proj [(6 + 2 + 2) * 4, 24] is
    [-1, 4, "hidden_size"] split by heads, kv heads, kv heads.
    """
    if not all(all(isinstance(t, Reshape) for t in p.ops) for p in parts):
        return None
    targets = [p.target for p in parts]
    if len({len(t) for t in targets}) != 1:
        return None
    differ = [d for d in range(len(targets[0])) if len({t[d] for t in targets}) > 1]
    if len(differ) != 1:
        return None
    d = differ[0]
    whole = targets[0][:d] + (sum(t[d] for t in targets),) + targets[0][d + 1 :]
    shape = group.shape
    inner, whole_inner = math.prod(shape[axis + 1 :]), math.prod(whole[d + 1 :])
    if (
        whole == shape
        or math.prod(shape[:axis]) != math.prod(whole[:d])
        or any(p.size * inner != t[d] * whole_inner for p, t in zip(parts, targets))
    ):
        return None
    names = [config_name(t[d], a[d], config) for t, a in zip(targets, axes)]
    if not all(names):
        return None
    dims = tuple(-1 if j == d else config_name(n, axes[0][j], config) or n for j, n in enumerate(whole))
    return (Reshape(dims), _split(d, [n for n in names if n])), [() for _ in parts]


def _on_axis(
    group: Group, axis: int, parts: Sequence[Part], axes: Sequence[list[str]], config: AnyMapping[str, Any]
) -> tuple[Ops, list[Ops]]:
    """`[split]` of the fused axis, then each part's own chain (reshape sizes named as elsewhere)."""
    sizes: list[int | str] = [p.size for p in parts]
    kept = [_kept_axis(p.ops, axis) for p in parts]
    if all(j is not None for j in kept):  # the split axis is each leaf's own: its sizes are the leaves'
        names = [config_name(p.size, a[j], config) for p, a, j in zip(parts, axes, kept) if j is not None]
        if all(names):
            sizes = [n for n in names if n]
    tails = []
    for p, a in zip(parts, axes):
        cut = group.shape[:axis] + (p.size,) + group.shape[axis + 1 :]
        tails.append(named(p.ops, cut, p.target, config, a))
    return (_split(axis, sizes),), tails


def _kept_axis(ops: Ops, axis: int) -> int | None:
    """The leaf axis that `axis` of a part becomes through `ops`, when no reshape mixes it."""
    if not ops:
        return axis
    if len(ops) == 1 and isinstance(ops[0], Transpose):
        return ops[0].perm.index(axis)
    return None


def _split(axis: int, sizes: Sequence[int | str]) -> Split:
    """Part 0 of a split into `sizes`: `parts = n` when they are equal."""
    if len(set(sizes)) == 1:
        return Split(axis, 0, parts=len(sizes))
    return Split(axis, 0, sizes=tuple(sizes))


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
