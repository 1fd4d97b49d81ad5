"""Scaffold: a draft mapping from a checkpoint's headers and a module's skeleton.

`scaffold` pairs checkpoint keys with module leaves by shape and by name, proposes
the transforms (`transpose`, `reshape`) that turn one into the other and a logical
axis for every dimension, and writes what it could not pair as TODO comments, with
hints for fused tensors. It reads no tensor data and writes no file: it returns text.

The draft parses with `parse_mapping`; when every key and leaf paired, it passes
`plan` as it is. Entries it is unsure of carry a `# CHECK:` comment.

```python
text = scaffold("path/to/checkpoint", MyModel, "my_package.my_model:MyModel")
Path("my_model.toml").write_text(text)          # review CHECK / TODO, then `port check`
```
"""

from __future__ import annotations

import os
from collections.abc import Mapping as AnyMapping
from collections.abc import Sequence
from typing import Any

import numpy as np

from .._console import printable, quoted
from .._errors import MappingError, PlanError
from .._mapping import import_object
from .._skeleton import leaves as skeleton_leaves
from .._skeleton import skeleton as make_skeleton
from .._source import Checkpoint, open_checkpoint
from ._axes import Dims, config_dims, named, propose_axes
from ._draft import Draft, Entry, ops_text, shape_text
from ._fused import fused_hint, tied_to
from ._keys import find_prefix, group_keys, ignore_pattern, is_buffer
from ._pairing import Candidate, Leaf, assign, candidate, is_matrix, orientation, pick, rivals, target_shape
from ._render import render

WEAK_SCORE = 0.3  # below this, a pairing rests on shape alone


def scaffold(checkpoint: str | os.PathLike | Checkpoint, skeleton: Any, model: str) -> str:
    """Write a draft mapping file pairing a checkpoint's keys with a module's leaves.

    Reads the checkpoint's `config.json` and tensor headers only, never tensor data.

    **Arguments:**

    - `checkpoint`: a checkpoint directory, a Hugging Face repo id, or an opened `Checkpoint`
      (one this opens, it closes).
    - `skeleton`: the module to fill: its skeleton (`eqx.filter_eval_shape(MyModel.from_config,
      config, key=...)`), its class (built from the checkpoint's `config.json` with
      `from_config`), or None to import the class `model` names.
    - `model`: the module's `"package.module:Class"`, written as the mapping's `model`.

    Returns the text of the mapping file. Entries it is unsure of carry a `# CHECK:`
    comment, keys and leaves it could not pair a `# TODO` block. Raises `PlanError`
    when no key fits any leaf.

    ```python
    text = port.scaffold("tinylm-checkpoint", TinyLM, "tinylm:TinyLM")
    Path("draft.toml").write_text(text)        # review CHECK / TODO, then `port check`
    ```
    """
    return render(draft(checkpoint, skeleton, model))


def draft(checkpoint: str | os.PathLike | Checkpoint, skeleton: Any, model: str) -> Draft:
    """Pair a checkpoint's keys with a module's leaves, pick transforms and axes, sort out the rest.

    **Arguments:** as for `scaffold`.

    Returns a `Draft`: its `entries` (one per pairing, with CHECK comments), the
    `prefix`, `ignore` and `tied` keys, and the `unpaired` key groups (with fused-tensor
    `hints`) and `free` leaves left for the author. `render` writes it as a mapping file.

    ```python
    d = draft("gpt2", GPT2, "port.models.gpt2:GPT2")
    [g.pattern for g in d.unpaired]      # ['h.{layer}.attn.c_attn.bias', 'h.{layer}.attn.c_attn.weight']
    ```
    """
    if not isinstance(model, str) or ":" not in model:
        raise MappingError(f"`model` {quoted(model)}: expected 'package.module:Class'")
    owned = not isinstance(checkpoint, Checkpoint)
    ckpt = open_checkpoint(checkpoint) if owned else checkpoint
    try:
        if skeleton is None:
            skeleton = import_object(model, "`model`")
        if isinstance(skeleton, type):
            skeleton = make_skeleton(skeleton, ckpt.config)
        return _draft(ckpt, skeleton, model)
    finally:
        if owned:
            ckpt.close()


def _draft(checkpoint: Checkpoint, skeleton: Any, model: str) -> Draft:
    config, tensors = checkpoint.config, checkpoint.tensors
    leaves = [
        Leaf(path, tuple(leaf.shape), np.dtype(leaf.dtype))
        for path, leaf in skeleton_leaves(skeleton).items()
        if hasattr(leaf, "shape")
    ]
    prefix = find_prefix(sorted(tensors), [leaf.path for leaf in leaves])
    names = {(k[len(prefix) :] if prefix and k.startswith(prefix) else k): k for k in sorted(tensors)}
    stacks = {leaf.shape[:n] for leaf in leaves for n in (1, 2) if len(leaf.shape) >= n}
    groups = group_keys(names, tensors, stacks)
    candidates = [c for g in groups for leaf in leaves if (c := candidate(g, leaf)) is not None]
    pairs = assign(candidates)
    if not pairs:
        raise PlanError([f"{checkpoint.directory}: no checkpoint tensor fits any leaf of {model} by shape"])
    transposed, voters = orientation(pairs)
    dims = config_dims(config)
    by_group: dict[str, list[Candidate]] = {}
    by_leaf: dict[str, list[Candidate]] = {}
    for c in candidates:
        by_group.setdefault(c.group.pattern, []).append(c)
        by_leaf.setdefault(c.leaf.path, []).append(c)
    also = {c.group.pattern: rivals(c, by_group, by_leaf) for c in pairs}
    order = {leaf.path: i for i, leaf in enumerate(leaves)}
    entries = sorted(
        (_entry(c, also[c.group.pattern], transposed, voters, config, dims) for c in pairs),
        key=lambda e: order[e.path],
    )
    paired, filled = {c.group.pattern for c in pairs}, {c.leaf.path for c in pairs}
    free = [leaf for leaf in leaves if leaf.path not in filled]
    ignore, tied, unpaired = [], {}, []
    for group in groups:
        if group.pattern in paired:
            continue
        if is_buffer(group):
            ignore.append(ignore_pattern(group.pattern))
        elif (tie := tied_to(group, pairs, free)) is not None:
            tied[group.pattern] = tie
        else:
            unpaired.append(group)
    hints = {g.pattern: fused_hint(g, free, transposed, config, dims) for g in unpaired}
    return Draft(
        model, str(checkpoint.directory), len(tensors), config, prefix, entries, sorted(set(ignore)),
        tied, unpaired, hints, free,
    )


def _entry(
    c: Candidate,
    also: Sequence[str],
    transposed: bool,
    voters: Sequence[str],
    config: AnyMapping[str, Any],
    dims: Dims,
) -> Entry:
    """The entry for a pairing: its transforms and axes, and a CHECK for each doubt (`also`: its rivals)."""
    target = target_shape(c.group, c.leaf)
    assert target is not None
    ops, others = pick(c.options, c.group.shape, transposed)
    comments = []
    if c.score < WEAK_SCORE:
        comments.append(f"# CHECK: weak name match (score {c.score:.2f}): paired by shape")
    if also:
        comments.append("# CHECK: also matches " + printable(", ".join(also[:4])))
    if others:
        if not is_matrix(c.group.shape):
            why = "other transforms fit too"
        elif voters:
            why = f"{shape_text(c.group.shape)} is square: oriented like {printable(', '.join(voters[:2]))}"
        else:
            why = f"{shape_text(c.group.shape)} is square and no other 2-d weight shows the orientation: kept as stored"
        comments.append(f"# CHECK: {why}; also fits: {ops_text(others[0]) if others[0] else 'no transforms'}")
    axes, todo = propose_axes(c.leaf, c.group.stack, dims)
    return Entry(c.group.pattern, c.leaf.path, named(ops, c.group.shape, target, config), axes, comments + todo)

