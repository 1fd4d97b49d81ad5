"""Keys: a checkpoint's keys sorted into what one mapping entry covers.

A prefix nearly every key shares and no module path has (`transformer.`) is set
aside; keys differing only in a layer index become one `{layer}` group; known
buffers (causal masks, rotary frequencies) are recognised, to be ignored.

```python
find_prefix(["transformer.wte.weight", "transformer.h.0.ln_1.weight", ...], paths)   # "transformer."
group_keys({"h.0.ln_1.weight": "transformer.h.0.ln_1.weight", ...}, tensors, {12})
# [Group("h.{layer}.ln_1.weight", keys=(12 keys), shape=(768,), dtype=float32), ...]
```
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping as AnyMapping
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from .._dtypes import floating
from .._mapping import LAYER
from .._source import TensorInfo

Shape = tuple[int, ...]

PREFIX_SHARE = 0.75  # a prefix is shared by at least this share of the keys
_BUFFERS = ("attn.bias", "attn.masked_bias", "position_ids", "rotary_emb.inv_freq", "num_batches_tracked")


@dataclass(frozen=True)
class Group:
    """Source keys that become one mapping entry: one key, or one key per layer."""

    pattern: str  # the stripped name, `{layer}` for the layer index
    keys: tuple[str, ...]  # checkpoint keys, by layer
    shape: Shape  # of each key
    dtype: np.dtype

    @property
    def stacked(self) -> bool:
        return LAYER in self.pattern


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
    stripped = [k[len(prefix) :] if k.startswith(prefix) else k for k in keys]
    return not (
        prefix[:-1].split(".")[-1].isdigit()
        or any(a[0].isdigit() for a in after)  # `h.` of `h.0.attn`
        or (not everywhere and all(len(a) > 1 and a[1].isdigit() for a in after))  # `encoder.layer.0`
        or any(p.startswith(prefix) or p + "." == prefix for p in paths)
        or len(set(stripped)) != len(stripped)
        or "" in stripped
    )


def group_keys(
    names: AnyMapping[str, str], tensors: AnyMapping[str, TensorInfo], layer_counts: set[int]
) -> list[Group]:
    """Keys differing only in one integer segment become one `{layer}` group.

    `names` maps each stripped name to its checkpoint key. A group needs indices
    0..n-1 with the same shape and dtype, and a skeleton with some leaf of leading
    size n (`layer_counts`); otherwise its keys stay single.
    """
    by_pattern: dict[str, dict[int, str]] = {}
    for name in names:
        segments = name.split(".")
        first = next((i for i, s in enumerate(segments) if s.isdigit()), None)
        if first is None:
            continue
        pattern = ".".join(segments[:first] + [LAYER] + segments[first + 1 :])
        by_pattern.setdefault(pattern, {})[int(segments[first])] = name
    grouped: set[str] = set()
    groups = []
    for pattern, members in sorted(by_pattern.items()):
        infos = [tensors[names[members[i]]] for i in sorted(members)]
        if (
            len(members) < 2
            or sorted(members) != list(range(len(members)))
            or len(members) not in layer_counts
            or any(i.shape != infos[0].shape or i.dtype != infos[0].dtype for i in infos)
        ):
            continue
        groups.append(Group(pattern, tuple(i.key for i in infos), infos[0].shape, infos[0].dtype))
        grouped.update(members.values())
    for name in sorted(set(names) - grouped):
        info = tensors[names[name]]
        groups.append(Group(name, (info.key,), info.shape, info.dtype))
    return sorted(groups, key=lambda g: g.pattern)


def is_buffer(group: Group) -> bool:
    """A known non-parameter buffer (causal masks, rotary frequencies, batch-norm counters)."""
    name = group.pattern
    for buffer in _BUFFERS:
        if name == buffer or name.endswith("." + buffer):
            # a real attention bias is 1-d floating; GPT-2's mask buffer is [1, 1, n, n]
            return buffer != "attn.bias" or len(group.shape) >= 2 or not floating(group.dtype)
    return False


def ignore_pattern(name: str) -> str:
    """The `ignore` glob of a key pattern: each layer index a `*` (`h.{layer}.attn.bias` -> `h.*.attn.bias`)."""
    return ".".join("*" if s == LAYER or s.isdigit() else s for s in name.split("."))
