"""A draft mapping as data: the entries scaffold found, its hints, and what is left over.

`draft` builds a `Draft`; `render` writes it as a mapping file. The text forms of
shapes and transform chains here are the ones every comment of the draft uses.

```python
d = draft(ckpt, skel, "my_package.my_model:MyModel")
[e.path for e in d.entries]       # the leaves paired, in the module's order
d.unpaired, d.free                # key groups and leaves left for the author
```
"""

from __future__ import annotations

from collections.abc import Mapping as AnyMapping
from dataclasses import dataclass, field
from typing import Any

from ._keys import Group, Shape
from ._pairing import Leaf, Ops


@dataclass
class Entry:
    """One `[[params]]` entry to write, with the comments above it."""

    key: str
    path: str
    ops: Ops
    axes: list[str]  # one logical axis per dimension of the leaf ("": unnamed)
    comments: list[str] = field(default_factory=list)
    module_axes: bool = False  # `axes` are the module's own sharding names: written `axes = "module"`
    optional: str | None = None  # `optional = "model"`: drafted for a leaf this config.json leaves None


@dataclass
class FusedHint:
    """Comment lines for an unpaired key that looks fused, and draft entries for its parts."""

    lines: list[str]
    entries: list[Entry]


@dataclass
class Draft:
    """Everything `scaffold` found, before it is written out."""

    model: str
    source: str
    n_tensors: int
    config: AnyMapping[str, Any]
    prefix: str | None
    entries: list[Entry]
    ignore: list[str]
    tied: dict[str, str]
    unpaired: list[Group]
    hints: dict[str, FusedHint | None]  # by `Group.ident`
    free: list[Leaf]
    notes: list[str] = field(default_factory=list)  # header comments: layers no group holds, empty groups
    ignore_why: dict[str, str] = field(default_factory=dict)  # each `ignore` pattern: what it was inferred from
    prefix_keys: int = 0  # how many checkpoint keys begin with `prefix`
    warnings: list[str] = field(default_factory=list)  # header comments: sizes config.json fields share


def shape_text(shape: Shape) -> str:
    """`[64, 192]`."""
    return "[" + ", ".join(map(str, shape)) + "]"


def ops_text(ops: Ops) -> str:
    """A transform chain as a mapping file writes it: `[{ transpose = [1, 0] }]`."""
    return "[" + ", ".join(t.render() for t in ops) + "]"
