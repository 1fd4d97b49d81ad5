"""Pairing: which key group fills which module leaf, and through which transforms.

A group and a leaf are a candidate when some `[transpose] [reshape]` chain turns
the group's (per-layer) shape into the leaf's; the candidate's score is how alike
their names are. The leaves of a list of layers are paired as one listed leaf
(`list_leaves`: `layers.{layer}.attn.wq`), with the `{layer}` groups of keys only.
`assign` takes the best candidates greedily, each group and leaf once; `orientation` learns from the unambiguous 2-d weights whether this checkpoint
stores them transposed, and `pick` uses that for the square ones.

```python
c = candidate(group, leaf)        # Candidate(score=0.83, options=((Transpose((1, 0)),), ...)) or None
pairs = assign(candidates)
transposed, voters = orientation(pairs)
ops, others = pick(c.options, group.shape, transposed)
```
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Mapping as AnyMapping
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from .._dtypes import floating
from .._errors import PortError
from .._mapping import LAYER, STACKS
from .._transforms import Chain, Reshape, Transform, Transpose
from ._keys import INDEXED, Group, Shape
from ._names import similarity, tokens, weight_or_bias

Ops = tuple[Transform, ...]  # transforms as a mapping file writes them (config names kept)

TIE_MARGIN = 0.1  # another candidate this close to the chosen one is worth a CHECK


@dataclass(frozen=True)
class Leaf:
    """A leaf of the module to fill: its dotted path, shape and dtype.

    A listed leaf stands for one leaf per layer (and expert) of a module keeping them in a
    list (`layers.0.attn.wq`, `layers.1.attn.wq`, ...): its path holds the placeholders
    (`layers.{layer}.attn.wq`), `listed` names them, and its shape leads with their counts,
    as a stacked leaf's does: [layers, *each leaf's shape].
    """

    path: str
    shape: Shape
    dtype: np.dtype
    listed: tuple[str, ...] = ()  # the placeholders of the path, outermost first

    @property
    def each(self) -> Shape:
        """The shape of each leaf it stands for (its own shape, unless listed)."""
        return self.shape[len(self.listed) :]


def list_leaves(leaves: Sequence[Leaf], layers: int | None = None) -> tuple[list[Leaf], dict[str, list[str]]]:
    """The leaves with those of a list (one per layer, and expert) as one listed leaf each,
    in the place of the first; and the paths each listed leaf stands for.

    Leaves are one of a list as keys are one of a `{layer}` group (`group_keys`): their paths
    differ only in integer segments, their indices fill an n (x m) grid of two or more, and
    they share a shape and dtype. A list of layers holds `layers` of them (config.json's
    count, as `plan` wants of a `{layer}` path); one of another length is left as it is.

    ```python
    list_leaves([Leaf("layers.0.wq", (8, 6), f32), Leaf("layers.1.wq", (8, 6), f32)])
    # ([Leaf("layers.{layer}.wq", (2, 8, 6), f32, listed=("{layer}",))], {"layers.{layer}.wq": [...]})
    ```
    """
    by_path = {leaf.path: leaf for leaf in leaves}
    listed: dict[str, Leaf] = {}  # each member's path -> the listed leaf
    members: dict[str, list[str]] = {}
    for where in INDEXED:
        grids: dict[str, dict[tuple[int, ...], Leaf]] = {}
        for leaf in leaves:
            if leaf.path not in listed and (found := where(leaf.path.split("."))) is not None:
                grids.setdefault(found[0], {})[found[1]] = leaf
        for pattern, grid in grids.items():
            counts = tuple(max(index[i] for index in grid) + 1 for i in range(len(next(iter(grid)))))
            first = grid[min(grid)]
            stack = tuple(name for name in STACKS if name in pattern.split("."))
            if len(grid) < 2 or len(grid) != math.prod(counts) or pattern in by_path:
                continue
            if stack[0] == LAYER and layers is not None and counts[0] != layers:
                continue
            if any(leaf.shape != first.shape or leaf.dtype != first.dtype for leaf in grid.values()):
                continue
            one = Leaf(pattern, counts + first.shape, first.dtype, stack)
            members[pattern] = [grid[index].path for index in sorted(grid)]
            listed.update({leaf.path: one for leaf in grid.values()})
    out, seen = [], set()
    for leaf in leaves:
        one = listed.get(leaf.path, leaf)
        if one.path not in seen:
            seen.add(one.path)
            out.append(one)
    return out, members


@dataclass(frozen=True)
class Candidate:
    """A possible pairing of a key group with a leaf, scored by name."""

    group: Group
    leaf: Leaf
    score: float
    options: tuple[Ops, ...]  # chains from the per-key source shape to the per-key target


def builds(ops: Ops, source: Shape, target: Shape, config: AnyMapping[str, Any]) -> bool:
    """Whether `ops` (config names allowed) turn `source` into `target`, per `Chain.build`."""
    try:
        chain = Chain.build([t.resolve(config) for t in ops], source)
    except (ValueError, PortError):
        return False
    return chain.shape == tuple(target)


@functools.lru_cache(maxsize=4096)
def chains(source: Shape, target: Shape) -> tuple[Ops, ...]:
    """Every `[transpose] [reshape]` chain from `source` to `target`, simplest first."""
    if math.prod(source) != math.prod(target):
        return ()
    n = len(source)
    identity = tuple(range(n))
    perms = list(itertools.permutations(identity)) if n <= 4 else [identity, identity[::-1]]
    found = []
    for perm in perms:
        ops: Ops = () if perm == identity else (Transpose(perm),)
        if tuple(source[p] for p in perm) != tuple(target):
            ops += (Reshape(tuple(target)),)
        if builds(ops, source, target, {}):
            found.append(ops)
    return tuple(sorted(found, key=lambda ops: (len(ops), transposes(ops))))


def transposes(ops: Ops) -> bool:
    """Whether the chain starts with a transpose."""
    return bool(ops) and isinstance(ops[0], Transpose)


def is_matrix(shape: Shape) -> bool:
    """A 2-d shape whose orientation matters (a [1, n] row reads the same either way)."""
    return len(shape) == 2 and min(shape) > 1


def target_shape(group: Group, leaf: Leaf) -> Shape | None:
    """The per-key shape `group` must reach to fill `leaf`, or None when it cannot.

    A stacked group fills the leaf's leading axes, one per stack: `layers.{layer}.experts.{expert}.w1`
    of 2 x 4 keys [8, 6] fills a leaf [2, 4, 8, 6], whose per-key shape is [8, 6].
    """
    if floating(group.dtype) != floating(leaf.dtype):
        return None
    if group.stack[: len(leaf.listed)] != leaf.listed:  # a leaf per layer: the keys hold the layers, outermost
        return None
    n = len(group.counts)
    if leaf.shape[:n] != group.counts:
        return None
    return leaf.shape[n:]


def candidate(group: Group, leaf: Leaf) -> Candidate | None:
    """A scored pairing of `group` with `leaf`, or None when no chain fits."""
    target = target_shape(group, leaf)
    if target is None:
        return None
    options = chains(group.shape, target)
    if not options:
        return None
    score = similarity(group.pattern, leaf.path)
    score += {0: 0.03, 1: 0.02 if transposes(options[0]) else 0.0}.get(len(options[0]), 0.0)
    key_kind, leaf_kind = weight_or_bias(tokens(group.pattern)), weight_or_bias(tokens(leaf.path))
    if key_kind and leaf_kind and key_kind != leaf_kind:
        score -= 0.5
    elif key_kind == "bias" and leaf_kind is None and len(target) >= 2:  # a weight-like leaf
        score -= 0.5
    return Candidate(group, leaf, score, options)


def assign(candidates: Sequence[Candidate], leaf_order: AnyMapping[str, int] | None = None) -> list[Candidate]:
    """Greedy by best score; each group and each leaf at most once.

    Given `leaf_order` (each leaf's place in the module), two pairings whose swap scores
    as well within `ORDER_SLACK` are swapped to keep the keys' order in the module's: T5's
    `layer.0.layer_norm` (before attention) and `layer.1.layer_norm` (before the MLP)
    name nothing that tells `attn_norm` from `mlp_norm`, but their order does.
    """
    used_groups: set[str] = set()
    used_leaves: set[str] = set()
    chosen = []
    for c in sorted(candidates, key=lambda c: (-c.score, c.group.pattern, c.leaf.path)):
        if c.group.pattern in used_groups or c.leaf.path in used_leaves:
            continue
        chosen.append(c)
        used_groups.add(c.group.pattern)
        used_leaves.add(c.leaf.path)
    return chosen if leaf_order is None else _in_order(chosen, candidates, leaf_order)


ORDER_SLACK = 0.01  # two pairings swapped for order when the swap loses less score than this


def _natural(pattern: str) -> tuple[tuple[int, int | str], ...]:
    """A key pattern's sort key, indices as numbers: `layer.2.x` before `layer.10.x`."""
    return tuple((0, int(s)) if s.isdigit() else (1, s) for s in pattern.split("."))


def _in_order(
    chosen: list[Candidate], candidates: Sequence[Candidate], leaf_order: AnyMapping[str, int]
) -> list[Candidate]:
    """`chosen`, near-ties swapped so that key order follows leaf order (see `assign`)."""
    found = {(c.group.pattern, c.leaf.path): c for c in candidates}
    chosen = list(chosen)
    for _ in range(len(chosen)):
        swapped = False
        for i, j in itertools.combinations(range(len(chosen)), 2):
            a, b = chosen[i], chosen[j]
            keys_first = _natural(a.group.pattern) < _natural(b.group.pattern)
            if keys_first == (leaf_order[a.leaf.path] < leaf_order[b.leaf.path]):
                continue  # already in order
            x, y = found.get((a.group.pattern, b.leaf.path)), found.get((b.group.pattern, a.leaf.path))
            if x is not None and y is not None and x.score + y.score >= a.score + b.score - ORDER_SLACK:
                chosen[i], chosen[j] = x, y
                swapped = True
        if not swapped:
            break
    return chosen


def rivals(
    c: Candidate, by_group: AnyMapping[str, list[Candidate]], by_leaf: AnyMapping[str, list[Candidate]]
) -> list[str]:
    """Other leaves of `c`'s keys, and other keys for its leaf, scoring nearly as well."""
    close = [o for o in by_group[c.group.pattern] + by_leaf[c.leaf.path] if o.score >= c.score - TIE_MARGIN]
    found = {o.leaf.path for o in close if o.group == c.group and o.leaf != c.leaf}
    found |= {o.group.pattern for o in close if o.leaf == c.leaf and o.group != c.group}
    return sorted(found)


def orientation(pairs: Sequence[Candidate]) -> tuple[bool, list[str]]:
    """Whether this checkpoint stores 2-d weights transposed relative to the module.

    Decided by the non-square 2-d weights (embeddings aside), whose orientation is
    not in doubt; used for square ones, which fit either way.
    """
    votes: dict[bool, list[str]] = {True: [], False: []}
    for c in pairs:
        if not is_matrix(c.group.shape) or "embed" in tokens(c.group.pattern):
            continue
        sides = {transposes(ops) for ops in c.options}
        if len(sides) == 1:
            votes[sides.pop()].append(c.group.pattern)
    transposed = len(votes[True]) > len(votes[False])
    return transposed, votes[transposed]


def pick(options: Sequence[Ops], source: Shape, transposed: bool) -> tuple[Ops, list[Ops]]:
    """The chain to write, and the others that fit as well (a square weight: both orientations)."""
    if is_matrix(source):
        mine = [ops for ops in options if transposes(ops) == transposed]
        other = [ops for ops in options if transposes(ops) != transposed]
        if mine:
            return mine[0], other[:1]
        return other[0], []
    simplest = [ops for ops in options if len(ops) == len(options[0])]
    return options[0], simplest[1:3]
