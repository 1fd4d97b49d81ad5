"""Scaffold: a draft mapping from a checkpoint's headers and a module's skeleton.

`scaffold` pairs checkpoint keys with module leaves by shape and by name, proposes
the transforms (`transpose`, `reshape`) that turn one into the other and a logical
axis for every dimension, and writes what it could not pair as TODO comments, with
hints for fused tensors. Keys no unfilled leaf fits or resembles are drafted as `ignore`
patterns, a whole subtree the model takes no key from as one (`decoder.*`). It reads no tensor data and writes no file: it returns text.

A module that keeps its layers in a list (an `nnx.List`, a Python list of Equinox blocks:
leaves `layers.0.attn.wq`, `layers.1.attn.wq`, ...) gets one entry per role, `{layer}` in its
key and its path (`path = "layers.{layer}.attn.wq"`), as a stacked module does. A Flax NNX
module's variables annotated with sharding names get `axes = "module"` (and a rule for each
name); its own state (RNG keys and counts) is no leaf to fill and is not drafted.

A module with `layer_groups` (one stack per kind of layer) is paired group by group:
each group's leaves with its layers' keys only, so a key pattern both groups hold gets
one entry per group; a group with no layer (a None stack) gets none (a header note says
so), and the keys of a layer no group holds are ignored as `layers.{num_hidden_layers}.*`
when that is the one such layer (DeepSeek-V3's multi-token-prediction layer), else
listed unpaired with a TODO.

The draft parses with `parse_mapping`; when every key and leaf paired, it passes
`plan` as it is. Entries it is unsure of carry a `# CHECK:` comment.

```python
text = scaffold("path/to/checkpoint", MyModel, "my_package.my_model:MyModel")
Path("my_model.toml").write_text(text)          # review CHECK / TODO, then `port check`
```
"""

from __future__ import annotations

import fnmatch
import inspect
import os
from collections.abc import Mapping as AnyMapping
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from .._errors import MappingError, PlanError
from .._mapping import import_object
from .._plan import LAYER_COUNTS, layer_groups
from .._skeleton import skeleton as make_skeleton
from .._sources import Checkpoint, TensorInfo, open_checkpoint
from .._targets import target_of
from .._text import plural, printable, quoted
from ._axes import Dims, config_dims, literal_sizes, named, propose_axes, size_warnings
from ._draft import Draft, Entry, ops_text, shape_text
from ._fused import fused_hint, tied_to
from ._keys import (
    Group,
    find_prefix,
    group_keys,
    ignore_pattern,
    is_buffer,
    layer_container,
    layer_of,
    unused_patterns,
)
from ._names import similarity
from ._optional import Absent, absent_leaves, stored
from ._pairing import (
    Candidate,
    Leaf,
    assign,
    candidate,
    is_matrix,
    list_leaves,
    orientation,
    pick,
    rivals,
    target_shape,
)
from ._render import render

WEAK_SCORE = 0.3  # below this, a pairing rests on shape alone


def scaffold(checkpoint: str | os.PathLike | Checkpoint, skeleton: Any, model: str) -> str:
    """Write a draft mapping file pairing a checkpoint's keys with a module's leaves.

    Reads the checkpoint's `config.json` and tensor headers only, never tensor data.

    **Arguments:**

    - `checkpoint`: a checkpoint directory, a Hugging Face repo id, or an opened `Checkpoint`
      (one this opens, it closes).
    - `skeleton`: the module to fill: its skeleton (`eqx.filter_eval_shape(MyModel.from_config,
      config, key=...)`, an `nnx.eval_shape` of an NNX module), what a mapping's `model` may
      name (a class with `from_config`, a Flax NNX module class, a factory function), built
      from the checkpoint's `config.json` as `port.skeleton` builds it, or None to import what
      `model` names.
    - `model`: the module's `"package.module:Class"` (or `"package.module:build"`, a factory),
      written as the mapping's `model`.

    Returns the text of the mapping file. Entries it is unsure of carry a `# CHECK:`
    comment, keys and leaves it could not pair a `# TODO` block. Raises `PlanError`
    when no key fits any leaf.

    ```python
    text = port.scaffold("tinylm-checkpoint", TinyLM, "tinylm:TinyLM")
    Path("draft.toml").write_text(text)        # review CHECK / TODO, then `port check`
    text = port.scaffold("llama-checkpoint", llama.build, "llama:build")   # an NNX module's factory
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
        if isinstance(skeleton, type) or inspect.isfunction(skeleton):  # a class or a factory: built
            skeleton = make_skeleton(skeleton, ckpt.config)
        return _draft(ckpt, skeleton, model)
    finally:
        if owned:
            ckpt.close()


def _draft(checkpoint: Checkpoint, skeleton: Any, model: str) -> Draft:
    config, tensors = checkpoint.config, checkpoint.tensors
    n_layers = next((config[k] for k in LAYER_COUNTS if type(config.get(k)) is int), None)
    leaves, annotated = _leaves(skeleton, n_layers)
    prefix = find_prefix(sorted(tensors), [leaf.path for leaf in leaves])
    names = {(k[len(prefix) :] if prefix and k.startswith(prefix) else k): k for k in sorted(tensors)}
    passes, notes, beyond_ignore, beyond = _passes(names, tensors, leaves, layer_groups(skeleton), config)
    ignore = list(beyond_ignore)
    order = {leaf.path: i for i, leaf in enumerate(leaves)}
    found = []  # per pass: its groups, candidates and pairs
    for p in passes:
        stacks = {leaf.shape[:n] for leaf in p.leaves for n in (1, 2) if len(leaf.shape) >= n}
        groups = _in_group(group_keys(p.names, tensors, stacks, single=p.label is not None), p, names)
        candidates = [c for g in groups for leaf in p.leaves if (c := candidate(g, leaf)) is not None]
        found.append((p, groups, candidates, assign(candidates, order)))
    pairs = [c for *_, chosen in found for c in chosen]
    if not pairs:
        raise PlanError([f"{checkpoint.directory}: no checkpoint tensor fits any leaf of {model} by shape"])
    transposed, voters = orientation(pairs)
    dims = config_dims(config)
    entries, free, tied, unpaired, hints = [], [], {}, list(beyond), {}
    buffers: set[str] = set()  # keys of known buffers, ignored
    spare: set[str] = set()  # keys no leaf is left for, ignored
    for p, groups, _, chosen in found:
        paired, filled = {c.group.pattern for c in chosen}, {c.leaf.path for c in chosen}
        mine = [leaf for leaf in p.leaves if leaf.path not in filled]
        free += mine
        for group in groups:
            if group.pattern in paired:
                continue
            if is_buffer(group):
                ignore.append(ignore_pattern(group.pattern))
                buffers.update(group.keys)
            elif (tie := tied_to(group, chosen, mine)) is not None:
                tied[group.pattern] = tie
            elif (hint := fused_hint(group, mine, transposed, config, dims)) is None and not any(
                similarity(group.pattern, leaf.path) >= WEAK_SCORE for leaf in mine
            ):
                spare.update(group.keys)  # no leaf left that it fits or resembles
            else:
                hints[group.ident] = hint
                unpaired.append(group)
    why = {pattern: "a known buffer, not a parameter" for pattern in ignore}
    why |= {pattern: "the layer stored after the last one (see the CHECK above)" for pattern in beyond_ignore}
    unused, subtrees = _unused(names, spare, buffers)
    ignore += unused
    why |= unused
    name_of = {key: name for name, key in names.items()}

    def rival(c: Candidate) -> bool:  # a pairing worth naming as another choice: not from a subtree left out
        return not any(fnmatch.fnmatchcase(name_of[c.group.keys[0]], s + "*") for s in subtrees)

    for _, _, candidates, chosen in found:
        by_group: dict[str, list[Candidate]] = {}
        by_leaf: dict[str, list[Candidate]] = {}
        for c in filter(rival, candidates):
            by_group.setdefault(c.group.pattern, []).append(c)
            by_leaf.setdefault(c.leaf.path, []).append(c)
        entries += [
            _entry(c, rivals(c, by_group, by_leaf), transposed, voters, config, dims, annotated.get(c.leaf.path))
            for c in chosen
        ]
    by_path = {leaf.path: leaf for leaf in leaves}
    for hint in hints.values():
        if hint is not None:
            hint.entries = [_for_leaf(e, by_path[e.path], annotated.get(e.path)) for e in hint.entries]
    entries.sort(key=lambda e: order[e.path])
    entries = _with_optional(entries, absent_leaves(skeleton), transposed, voters, config, dims)
    free.sort(key=lambda leaf: order[leaf.path])
    unpaired.sort(key=lambda g: (g.pattern, g.layer_group or ""))
    return Draft(
        model,
        str(checkpoint.directory),
        len(tensors),
        config,
        prefix,
        entries,
        sorted(set(ignore)),
        tied,
        unpaired,
        hints,
        free,
        notes,
        ignore_why=why,
        prefix_keys=sum(k.startswith(prefix) for k in tensors) if prefix else 0,
        warnings=size_warnings([(c.leaf, c.group.stack) for c in pairs if c.leaf.path not in annotated], dims),
    )


def _leaves(skeleton: Any, layers: int | None) -> tuple[list[Leaf], dict[str, tuple[str | None, ...]]]:
    """The leaves a mapping fills, those of a list of `layers` layers as one listed leaf each (`list_leaves`),
    and the sharding names the module annotates them with, by path (a listed leaf's when every
    leaf it stands for has the same).

    A module's own state (an NNX module's RNG keys and counts: `Target.own`) is no leaf to fill.
    """
    target = target_of(skeleton)
    own = target.own(skeleton)
    found = [
        Leaf(path, tuple(leaf.shape), np.dtype(leaf.dtype))
        for path, leaf in target.leaves(skeleton).items()
        if hasattr(leaf, "shape") and path not in own
    ]
    leaves, members = list_leaves(found, layers)
    axes = target.axes(skeleton)
    annotated = {}
    for leaf in leaves:
        names = {axes.get(path) for path in members.get(leaf.path, [leaf.path])}
        if len(names) == 1 and (one := names.pop()) is not None and len(one) == len(leaf.each):
            annotated[leaf.path] = one
    return leaves, annotated


def _unused(names: AnyMapping[str, str], spare: set[str], buffers: set[str]) -> tuple[dict[str, str], list[str]]:
    """The `ignore` patterns of the keys no leaf is left for, each with why; and the subtrees
    (`decoder.`) the model takes no key from."""
    why, subtrees = {}, []
    for pattern, (count, subtree) in unused_patterns(names, spare, buffers).items():
        if subtree:
            subtrees.append(subtree)
            why[pattern] = (
                f"not paired with any leaf: {plural(count, 'key')}, every key under {quoted(printable(subtree))}"
            )
        else:
            why[pattern] = f"not paired with any leaf: {plural(count, 'key')}; no unfilled leaf fits or resembles it"
    return why, subtrees


@dataclass(frozen=True)
class _Pass:
    """Keys and leaves paired among themselves: the whole model, or one layer group and its layers.

    `names` maps the names to group to checkpoint keys; a layer group's names count their
    layers by row of the group's stack (`layers.0.x` for its first layer, whichever it is).
    """

    names: dict[str, str]
    leaves: list[Leaf]
    label: str | None = None  # the layer group's prefix
    ids: tuple[int, ...] = ()  # the checkpoint layers of its rows
    container: str = ""  # the key segments holding the layers (`layers`)


def _passes(
    names: AnyMapping[str, str],
    tensors: AnyMapping[str, TensorInfo],
    leaves: Sequence[Leaf],
    groups: AnyMapping[str, Sequence[int]],
    config: AnyMapping[str, Any],
) -> tuple[list[_Pass], list[str], list[str], list[Group]]:
    """The pairing passes, header notes, ignore patterns and unpaired groups of layers no group holds.

    Without layer groups (or without keys laid out by layer) one pass pairs everything.
    With them, each group's leaves pair with its layers' keys only, and the other leaves
    with the keys outside the layers. Keys of a layer no group holds are ignored as
    `layers.{num_hidden_layers}.*` when that is the one such layer (DeepSeek-V3's
    multi-token-prediction layer), else left unpaired.
    """
    union = {i for ids in groups.values() for i in ids}
    container = layer_container(names, union) if union else None
    if container is None:
        return [_Pass(dict(names), list(leaves))], [], [], []
    labels = {label: tuple(ids) for label, ids in groups.items()}

    def under(path: str, label: str) -> bool:
        return path == label or path.startswith(label + ".")

    notes = [
        f"# layer group {quoted(printable(label))} holds no layer with this config.json: its entries "
        '(a copy of another group\'s, with optional = "model") are not drafted'
        for label, ids in labels.items()
        if not ids
    ]
    rest = [leaf for leaf in leaves if not any(under(leaf.path, label) for label in labels)]
    row_of = {label: {layer: row for row, layer in enumerate(ids)} for label, ids in labels.items()}
    outside, by_label, others = {}, {label: {} for label in labels}, {}
    for name, key in names.items():
        if (at := layer_of(name, container)) is None:
            outside[name] = key
            continue
        layer, tail = at
        homes = [label for label in labels if layer in row_of[label]]
        for label in homes:
            by_label[label][f"{container}.{row_of[label][layer]}.{tail}"] = key
        if not homes:
            others.setdefault(layer, {})[name] = key
    passes = [_Pass(outside, rest)] + [
        _Pass(by_label[label], [leaf for leaf in leaves if under(leaf.path, label)], label, ids, container)
        for label, ids in labels.items()
        if ids
    ]
    ignore, beyond = [], []
    n_layers = config.get("num_hidden_layers")
    if set(others) == {n_layers}:
        ignore.append(f"{container}.{{num_hidden_layers}}.*")
        notes.append(
            f"# CHECK: {len(others[n_layers])} tensors of layer {n_layers} ({container}.{n_layers}.*), which no layer "
            "group of the model holds, are ignored as "
            f"'{container}.{{num_hidden_layers}}.*' (a layer stored after the last one, such as DeepSeek-V3's "
            "multi-token-prediction layer)"
        )
    else:
        for _, members in sorted(others.items()):
            for name, key in sorted(members.items()):
                beyond.append(Group(name, (key,), tensors[key].shape, tensors[key].dtype))
        if others:
            notes.append(
                f"# TODO: the keys of layer(s) {', '.join(map(str, sorted(others)))}, which no layer group of the "
                "model holds, are listed unpaired below: ignore them (or give the model those layers)"
            )
    return passes, notes, ignore, beyond


def _in_group(groups: list[Group], p: _Pass, names: AnyMapping[str, str]) -> list[Group]:
    """A pass's groups, those of a layer group labelled with it and named as the checkpoint names them."""
    if p.label is None:
        return groups
    name_of = {key: name for name, key in names.items()}
    return [replace(g, layer_group=p.label, pattern=g.pattern if g.stacked else name_of[g.keys[0]]) for g in groups]


def _entry(
    c: Candidate,
    also: Sequence[str],
    transposed: bool,
    voters: Sequence[str],
    config: AnyMapping[str, Any],
    dims: Dims,
    annotated: tuple[str | None, ...] | None = None,
) -> Entry:
    """The entry for a pairing: its transforms and axes, and a CHECK for each doubt (`also`: its rivals).

    `annotated`: the leaf's sharding names in the module, its axes then (no guess to comment on).
    """
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
    axes, notes = propose_axes(c.leaf, c.group.stack, dims)
    ops = named(ops, c.group.shape, target, config, axes[len(c.group.stack) :])
    notes = [] if annotated is not None else notes
    return _for_leaf(
        Entry(c.group.pattern, c.leaf.path, ops, axes, comments + notes + literal_sizes(ops)), c.leaf, annotated
    )


def _with_optional(
    entries: list[Entry],
    absent: Sequence[Absent],
    transposed: bool,
    voters: Sequence[str],
    config: AnyMapping[str, Any],
    dims: Dims,
) -> list[Entry]:
    """`entries` and, after its weight's (or at the end), an `optional = "model"` entry for each leaf
    the module may hold but holds None with this config.json (a bias, an untied head), its key
    guessed from its weight's (`_optional.stored`)."""
    out = list(entries)
    for leaf in absent:
        found = stored(leaf, {e.path: e.key for e in entries})
        if found is None or (c := candidate(found[0], found[1])) is None:
            continue
        source = f"its weight's, {printable(found[2])}" if found[2] else "its path"
        check = f"# CHECK: optional: {leaf.path} is None with this config.json; its key guessed from {source}"
        entry = _entry(c, (), transposed, voters, config, dims)
        entry = replace(entry, comments=[check, *entry.comments], optional="model")
        after = [i for i, e in enumerate(out) if found[2] and e.key == found[2]]
        out.insert(after[0] + 1 if after else len(out), entry)
    return out


def _for_leaf(entry: Entry, leaf: Leaf, annotated: tuple[str | None, ...] | None) -> Entry:
    """`entry` (axes proposed for `leaf`'s dimensions) with the axes of each leaf it fills: a listed
    leaf's without its list's (`layers`), or the module's own sharding names (`annotated`)."""
    if annotated is not None:
        return replace(entry, axes=[a or "" for a in annotated], module_axes=True)
    return replace(entry, axes=entry.axes[len(leaf.listed) :])
