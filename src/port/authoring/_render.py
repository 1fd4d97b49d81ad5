"""Render: a `Draft` written out as a mapping file, with its CHECK and TODO comments.

The header says what was paired and what was not; then come the top-level keys
(`model`, `model_types`, `prefixes`, `ignore`, `tied`), a rule for every logical
axis the entries use (an entry taking the module's own sharding names, `axes = "module"`,
says them in a comment), one `[[params]]` entry per pairing, and, as comments, the
keys and leaves left for the author. Key names from the checkpoint are written
with their control characters escaped, so that none can end a comment line.

```python
text = render(draft(ckpt, skel, "my_package.my_model:MyModel"))
port.parse_mapping(text)           # it parses as it is
```
"""

from __future__ import annotations

import json
from collections.abc import Mapping as AnyMapping
from typing import Any

import numpy as np

from .._mapping import EXPERT, LAYER, MODULE_AXES
from .._text import printable
from .._transforms import toml_inline as _toml
from ._axes import rule_for
from ._draft import Draft, Entry, ops_text, shape_text
from ._keys import Group
from ._pairing import Leaf

_STACK_NAMES = {LAYER: "layers", EXPERT: "experts"}  # `2 layers x 4 experts of [8, 6] float32`


def render(d: Draft) -> str:
    """The mapping file: header, top-level keys, rules, entries, then the TODO blocks."""
    drafts = [e for h in d.hints.values() if h for e in h.entries]
    axes = sorted({a for e in d.entries + drafts for a in e.axes if a})  # "": unnamed, no rule
    lines = _header(d) + ["", "[rules]                                   # logical axis -> mesh axis; [] = replicated"]
    lines += [f"{axis} = {rule_for(axis)}" for axis in axes]
    for entry in d.entries:
        lines += ["", *_entry_lines(entry)]
    if d.unpaired:
        lines += ["", "# TODO unpaired source keys (map them, or add them to ignore):"]
        for group in d.unpaired:
            lines.append(f"#   {_describe(group)}")
            if hint := d.hints.get(group.ident):
                lines += hint.lines
                for entry in hint.entries:
                    lines += ["#", *_entry_lines(entry, "# ")]
                lines.append("#")
    if d.free:
        lines += ["", "# TODO unfilled leaves (no checkpoint key fits them):"]
        lines += [f"#   {_describe_leaf(leaf)}" for leaf in d.free]
    return "\n".join(lines).rstrip() + "\n"


def _entry_lines(entry: Entry, prefix: str = "") -> list[str]:
    lines = [*entry.comments, "[[params]]", f"key = {_toml(entry.key)}", f"path = {_toml(entry.path)}"]
    if entry.ops:
        lines.append(f"transforms = {ops_text(entry.ops)}")
    if entry.optional:
        lines.append(f"optional = {_toml(entry.optional)}")
    if entry.module_axes:
        lines.append(f"axes = {_toml(MODULE_AXES)}   # the module's sharding names: {_toml(entry.axes)}")
    else:
        lines.append(f"axes = {_toml(entry.axes)}")
    return [prefix + line for line in lines]


def _describe(group: Group) -> str:
    stack = " x ".join(f"{n} {_STACK_NAMES[name]}" for name, n in zip(group.stack, group.counts))
    of = f"{stack} of " if stack else ""
    where = f" (layer group {printable(group.layer_group)})" if group.layer_group is not None else ""
    return f"{printable(group.pattern)}{where}  {of}{shape_text(group.shape)} {np.dtype(group.dtype).name}"


def _describe_leaf(leaf: Leaf) -> str:
    """`blocks.wq  [2, 8] float32`; a listed leaf `layers.{layer}.wq  2 layers of [8] float32`."""
    stack = " x ".join(f"{n} {_STACK_NAMES[name]}" for name, n in zip(leaf.listed, leaf.shape))
    of = f"{stack} of " if stack else ""
    return f"{printable(leaf.path)}  {of}{shape_text(leaf.each)} {leaf.dtype.name}"


def _reference(config: AnyMapping[str, Any]) -> str | None:
    """The `transformers` class that wrote the checkpoint (config.json's first `architectures`), if named plainly."""
    names = config.get("architectures")
    if isinstance(names, list) and names and isinstance(names[0], str) and names[0].isidentifier():
        return names[0]
    return None


def _header(d: Draft) -> list[str]:
    n_unpaired = sum(len(g.keys) for g in d.unpaired)
    n_optional = sum(e.optional is not None for e in d.entries)
    drafted = f" (and {n_optional} optional, for leaves this config.json leaves None)" if n_optional else ""
    lines = [
        f"# Draft mapping made by port scaffold for {d.model}",
        f"# from the checkpoint {d.source} ({d.n_tensors} tensors; headers and config.json only).",
        "#",
        f"# {len(d.entries) - n_optional} entries paired{drafted}, {n_unpaired} source keys unpaired ({len(d.unpaired)} patterns), "
        f"{len(d.free)} leaves unfilled; {len(d.ignore)} ignore patterns, {len(d.tied)} tied.",
        "# This is a draft: review every entry marked CHECK/TODO, then run `port plan` on it.",
        *d.warnings,
        "",
        f"model = {_toml(d.model)}",
    ]
    model_type = d.config.get("model_type")
    if isinstance(model_type, str):
        lines.append(f"model_types = {_toml([model_type])}")
    else:
        lines += ["# TODO: config.json has no model_type", "model_types = []"]
    reference = _reference(d.config)
    if reference is not None:
        output = (
            "logits" if "For" in reference or "Head" in reference else "last_hidden_state"
        )  # a task head, or the base
        lines.append(
            f"reference = {{ class = {_toml('transformers:' + reference)}, output = {_toml(output)} }}"
            "   # config.json's architectures: what `port verify` compares with"
        )
    lines += _prefix_lines(d)
    lines += d.notes
    lines += _ignore_lines(d)
    lines += _tied_lines(d)
    return lines


def _prefix_lines(d: Draft) -> list[str]:
    """`prefixes`, with what it was inferred from: how many keys begin with it (the key layout)."""
    if not d.prefix:
        return []
    return [
        f"prefixes = {_toml([d.prefix])}   # key layout: {d.prefix_keys} of {d.n_tensors} keys begin with it, "
        "no path of the model does"
    ]


def _ignore_lines(d: Draft) -> list[str]:
    """`ignore`, one pattern a line, each with why it is ignored."""
    if not d.ignore:
        return []
    lines = ["ignore = [                                # keys never read"]
    for pattern in d.ignore:
        why = d.ignore_why.get(pattern)
        lines.append(f"    {_toml(pattern)},{f'   # {printable(why)}' if why else ''}")
    return [*lines, "]"]


def _tied_lines(d: Draft) -> list[str]:
    """`tied`: confirmed by config.json's `tie_word_embeddings`, a CHECK otherwise."""
    if not d.tied:
        return []
    tied = f"tied = {_toml({json.dumps(k): v for k, v in sorted(d.tied.items())})}"
    said = d.config.get("tie_word_embeddings")
    if said is True:
        return [f"{tied}   # config.json's tie_word_embeddings = true: a copy of a paired key, never read"]
    if said is False:
        return [
            "# CHECK: config.json says tie_word_embeddings = false, but the model has no leaf for it",
            f"{tied}   # a copy of a paired key, never read",
        ]
    return [f"{tied}   # CHECK: the same shape as a paired key (config.json has no tie_word_embeddings); never read"]
