"""Keys: a checkpoint's keys sorted into what one mapping entry covers.

A prefix nearly every key shares and no module path has (`transformer.`) is set
aside; keys differing only in a layer index become one `{layer}` group, and keys
differing in a layer and an expert index one `{layer}`/`{expert}` group; known
buffers (causal masks, rotary frequencies) are recognised, to be ignored.

```python
find_prefix(["transformer.wte.weight", "transformer.h.0.ln_1.weight", ...], paths)   # "transformer."
group_keys({"h.0.ln_1.weight": "transformer.h.0.ln_1.weight", ...}, tensors, {(12,)})
# [Group("h.{layer}.ln_1.weight", keys=(12 keys), shape=(768,), dtype=float32, counts=(12,)), ...]
```
"""

from __future__ import annotations

import fnmatch
import math
from collections import Counter
from collections.abc import Collection, Iterable, Sequence
from collections.abc import Mapping as AnyMapping
from dataclasses import dataclass

import numpy as np

from .._dtypes import floating
from .._mapping import EXPERT, LAYER, STACKS
from .._sources import TensorInfo

Shape = tuple[int, ...]

PREFIX_SHARE = 0.75  # a prefix is shared by at least this share of the keys
_BUFFERS = ("attn.bias", "attn.masked_bias", "position_ids", "rotary_emb.inv_freq", "num_batches_tracked")


@dataclass(frozen=True)
class Group:
    """Source keys that become one mapping entry: one key, or one key per layer (and expert).

    ```python
    Group("layers.{layer}.experts.{expert}.w1", keys, (8, 6), float32, counts=(2, 4)).stack
    # ('{layer}', '{expert}'): a leaf [2, 4, 8, 6]
    ```
    """

    pattern: str  # the stripped name, `{layer}` for the layer index, `{expert}` for the expert's
    keys: tuple[str, ...]  # checkpoint keys, layer-major
    shape: Shape  # of each key
    dtype: np.dtype
    counts: Shape = ()  # the size of each stack axis: (layers,), (layers, experts), (experts,)
    layer_group: str | None = None  # the model's layer group (its path prefix) whose layers the keys are

    @property
    def ident(self) -> str:
        """The pattern, told apart from the same pattern of another layer group: `moe:layers.{layer}.x`."""
        return self.pattern if self.layer_group is None else f"{self.layer_group}:{self.pattern}"

    @property
    def stack(self) -> tuple[str, ...]:
        """The placeholders of the pattern, outermost first, as `Param.stack`."""
        return tuple(name for name in STACKS if name in self.pattern.split("."))

    @property
    def stacked(self) -> bool:
        return bool(self.stack)


def find_prefix(keys: Sequence[str], paths: Sequence[str]) -> str | None:
    """A leading key segment shared by nearly all keys that no module path starts with.

    Deeper segments join it only when every prefixed key shares them (`model.decoder.`).
    Never a container of layers (`h.` of `h.0.attn`), nor, unless every key has it, a
    segment holding only one (`encoder.` of BERT's `encoder.layer.0`).
    """
    prefix = ""
    while True:
        rest = [k[len(prefix) :] for k in keys if k.startswith(prefix)]
        heads = Counter(k.split(".", 1)[0] + "." for k in rest if "." in k)
        if not heads:
            break
        head, count = min(heads.items(), key=lambda kv: (-kv[1], kv[0]))
        needed = len(rest) if prefix else PREFIX_SHARE * len(keys)
        if count < needed or not _prefix_ok(prefix + head, keys, paths, count == len(keys)):
            break
        prefix += head
    return prefix or None


def _prefix_ok(prefix: str, keys: Sequence[str], paths: Sequence[str], everywhere: bool) -> bool:
    after = [k[len(prefix) :].split(".") for k in keys if k.startswith(prefix)]
    stripped = [k.removeprefix(prefix) for k in keys]
    return not (
        prefix[:-1].split(".")[-1].isdigit()
        or any(a[0].isdigit() for a in after)  # `h.` of `h.0.attn`
        or (not everywhere and all(len(a) > 1 and a[1].isdigit() for a in after))  # `encoder.layer.0`
        or any(p.startswith(prefix) or p + "." == prefix for p in paths)
        or len(set(stripped)) != len(stripped)
        or "" in stripped
    )


def group_keys(
    names: AnyMapping[str, str], tensors: AnyMapping[str, TensorInfo], stacks: Collection[Shape], single: bool = False
) -> list[Group]:
    """Keys differing only in integer segments become one `{layer}` (and `{expert}`) group.

    `names` maps each stripped name to its checkpoint key; `stacks` holds the leading
    shapes some leaf has ((n,) and (n, m)). A group needs every index of an n x m (or n)
    grid, one shape and dtype, and a leaf whose leading shape is the grid's; otherwise
    its keys stay single (`single`: a grid of one layer, `{layer}` of a layer group
    holding one layer, is a group too). In order of preference, keys are grouped on:

    1. their first two integer segments: `layers.{layer}.experts.{expert}.w1` (leaf [n, m, ...]);
    2. their first one: `h.{layer}.ln_1`, or `experts.{expert}.w1` after an `experts` segment;
    3. their last one, after an `experts` segment: `layers.0.experts.{expert}.w1` (layers unstacked).

    ```python
    group_keys({"layers.0.experts.1.w": "model.layers.0.experts.1.w", ...}, tensors, {(2,), (2, 4)})
    # [Group("layers.{layer}.experts.{expert}.w", keys=(8 keys, layer-major), counts=(2, 4)), ...]
    ```
    """
    grouped: set[str] = set()
    groups = []
    for where in INDEXED:
        by_pattern: dict[str, dict[tuple[int, ...], str]] = {}
        for name in sorted(set(names) - grouped):
            if (found := where(name.split("."))) is not None:
                pattern, index = found
                by_pattern.setdefault(pattern, {})[index] = name
        for pattern, members in sorted(by_pattern.items()):
            if (group := _grid(pattern, members, names, tensors, stacks, single)) is not None:
                groups.append(group)
                grouped.update(members.values())
    for name in sorted(set(names) - grouped):
        info = tensors[names[name]]
        groups.append(Group(name, (info.key,), info.shape, info.dtype))
    return sorted(groups, key=lambda g: g.pattern)


Found = tuple[str, tuple[int, ...]] | None  # a pattern and the index of the name in its grid


def _is_experts(segment: str) -> bool:
    """A segment holding experts (`experts`, `local_experts`): the index after it is `{expert}`."""
    return "expert" in segment.lower()


def _with(segments: list[str], at: AnyMapping[int, str]) -> str:
    """The name with the segments at some positions replaced: `(["h", "3", "x"], {1: "{layer}"})` -> `h.{layer}.x`."""
    return ".".join(at.get(i, s) for i, s in enumerate(segments))


def _digits(segments: list[str]) -> list[int]:
    """The positions of the integer segments: `["h", "3", "x"]` -> `[1]`."""
    return [i for i, s in enumerate(segments) if s.isdigit()]


def _first_two(segments: list[str]) -> Found:
    """`layers.3.experts.5.w1` -> `layers.{layer}.experts.{expert}.w1` at (3, 5)."""
    found = _digits(segments)
    if len(found) < 2:
        return None
    a, b = found[:2]
    return _with(segments, {a: LAYER, b: EXPERT}), (int(segments[a]), int(segments[b]))


def _first(segments: list[str]) -> Found:
    """`h.3.ln_1` -> `h.{layer}.ln_1` at (3,); `experts.5.w1` -> `experts.{expert}.w1` at (5,)."""
    found = _digits(segments)
    if not found:
        return None
    a = found[0]
    name = EXPERT if a and _is_experts(segments[a - 1]) else LAYER
    return _with(segments, {a: name}), (int(segments[a]),)


def _last_expert(segments: list[str]) -> Found:
    """`layers.0.experts.5.w1` -> `layers.0.experts.{expert}.w1` at (5,): experts of an unstacked layer."""
    found = _digits(segments)
    if len(found) < 2 or not _is_experts(segments[found[-1] - 1]):
        return None
    a = found[-1]
    return _with(segments, {a: EXPERT}), (int(segments[a]),)


INDEXED = (_first_two, _first, _last_expert)
"""The ways a dotted name's integer segments make it one of a grid, in order of preference (see
`group_keys`): each takes the name's segments and gives its pattern and index, or None."""


def _grid(
    pattern: str,
    members: AnyMapping[tuple[int, ...], str],
    names: AnyMapping[str, str],
    tensors: AnyMapping[str, TensorInfo],
    stacks: Collection[Shape],
    single: bool = False,
) -> Group | None:
    """The group of `members` when they fill an n (x m) grid of one shape and dtype that some leaf stacks."""
    counts = tuple(max(index[i] for index in members) + 1 for i in range(len(next(iter(members)))))
    one_layer = single and LAYER in pattern.split(".")
    if (len(members) < 2 and not one_layer) or len(members) != math.prod(counts) or counts not in stacks:
        return None
    infos = [tensors[names[members[index]]] for index in sorted(members)]  # layer-major
    if any(i.shape != infos[0].shape or i.dtype != infos[0].dtype for i in infos):
        return None
    return Group(pattern, tuple(i.key for i in infos), infos[0].shape, infos[0].dtype, counts)


def is_buffer(group: Group) -> bool:
    """A known non-parameter buffer (causal masks, rotary frequencies, batch-norm counters)."""
    name = group.pattern
    for buffer in _BUFFERS:
        if name == buffer or name.endswith("." + buffer):
            # a real attention bias is 1-d floating; GPT-2's mask buffer is [1, 1, n, n]
            return buffer != "attn.bias" or len(group.shape) >= 2 or not floating(group.dtype)
    return False


def ignore_pattern(name: str) -> str:
    """The `ignore` glob of a key pattern: each layer or expert index a `*` (`h.{layer}.attn.bias` -> `h.*.attn.bias`)."""
    return ".".join("*" if s in STACKS or s.isdigit() else s for s in name.split("."))


def layer_container(names: Iterable[str], ids: Collection[int]) -> str | None:
    """The segments holding a model's layers (`layers` of `layers.3.mlp.w`), or None.

    The part of a name before its first integer segment, among those whose indices
    include every layer of `ids` (the layers of the model's layer groups), of the most keys.
    """
    found: dict[str, set[int]] = {}
    count: Counter[str] = Counter()
    for name in names:
        segments = name.split(".")
        at = _digits(segments)
        if not at or at[0] == 0:
            continue
        head = ".".join(segments[: at[0]])
        found.setdefault(head, set()).add(int(segments[at[0]]))
        count[head] += 1
    fits = [head for head, indices in found.items() if set(ids) <= indices]
    return max(fits, key=lambda h: (count[h], h)) if fits else None


def layer_of(name: str, container: str) -> tuple[int, str] | None:
    """The layer of a name under `container` and the rest of it: `layers.3.mlp.w` -> (3, "mlp.w")."""
    if not name.startswith(container + "."):
        return None
    index, _, rest = name[len(container) + 1 :].partition(".")
    return (int(index), rest) if index.isdigit() else None


def unused_patterns(
    names: AnyMapping[str, str], unused: Collection[str], free: Collection[str] = ()
) -> dict[str, tuple[int, str]]:
    """`ignore` patterns covering the `unused` checkpoint keys and no other key, grouped.

    `names` maps every stripped name to its checkpoint key; `unused` holds the keys to
    cover; `free` keys (ignored anyway: buffers) may be covered or not. Each unused key
    is covered by the shortest wholly unused subtree of more than one pattern
    (`decoder.*`), else by its own pattern, layer and expert indices as `*`
    (`encoder.block.*.layer.*.SelfAttention.relative_attention_bias.weight`). Returns
    pattern -> (keys covered, the subtree's prefix or "").

    ```python
    unused_patterns({"decoder.block.0.q": "decoder.block.0.q", "decoder.norm": "decoder.norm", "q": "q"},
                    {"decoder.block.0.q", "decoder.norm"})    # {"decoder.*": (2, "decoder.")}
    ```
    """
    mine = Counter(ignore_pattern(name) for name, key in names.items() if key in unused)  # pattern -> keys
    others = [name for name, key in names.items() if key not in unused and key not in free]
    other_forms = sorted({ignore_pattern(name) for name in others})  # few: layers and experts as `*`
    clear: dict[str, bool] = {}  # glob -> whether it covers no other key

    def covers_none(glob: str) -> bool:
        if glob not in clear:
            clear[glob] = not any(fnmatch.fnmatchcase(o, glob) for o in other_forms) and not any(
                fnmatch.fnmatchcase(o, glob) for o in others
            )
        return clear[glob]

    found: dict[str, tuple[int, str]] = {}
    for form, count in sorted(mine.items()):
        segments = form.split(".")
        pattern, subtree = form, ""
        for n in range(1, len(segments) - 1):
            head = ".".join(segments[:n]) + "."
            if sum(fnmatch.fnmatchcase(f, head + "*") for f in mine) > 1 and covers_none(head + "*"):
                pattern, subtree = head + "*", head
                break
        total, _ = found.get(pattern, (0, subtree))
        found[pattern] = (total + count, subtree)
    return found
