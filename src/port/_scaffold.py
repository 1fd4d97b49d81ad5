"""Scaffold: a draft mapping from a checkpoint's headers and a module's skeleton.

`scaffold` pairs checkpoint keys with module leaves by shape and by name, proposes
the transforms (`transpose`, `reshape`) that turn one into the other and a logical
axis for every dimension, and writes what it could not pair as TODO comments, with
hints for fused tensors. It reads no tensor data and does no I/O: it returns text.

The draft parses with `parse_mapping`; when every key and leaf paired, it passes
`plan` as it is. Entries it is unsure of carry a `# CHECK:` comment.

```python
ckpt = port.open_checkpoint("path/to/checkpoint")              # config and headers only
skel = eqx.filter_eval_shape(MyModel.from_config, ckpt.config, key=jax.random.key(0))
text = scaffold(ckpt, skel, "my_package.my_model:MyModel")
Path("my_model.toml").write_text(text)          # review CHECK / TODO, then `port plan`
```
"""

from __future__ import annotations

import difflib
import functools
import itertools
import json
import math
import re
from collections import Counter
from collections.abc import Mapping as AnyMapping
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ._errors import PortError
from ._mapping import LAYER
from ._skeleton import leaves as skeleton_leaves
from ._source import Checkpoint, TensorInfo
from ._transforms import Chain, Reshape, Split, Transform, Transpose
from ._transforms import toml_inline as _toml

Shape = tuple[int, ...]
Ops = tuple[Transform, ...]  # transforms as a mapping file writes them (config names kept)

PREFIX_SHARE = 0.75  # a prefix is shared by at least this share of the keys
TIE_MARGIN = 0.1  # another candidate this close to the chosen one is worth a CHECK
WEAK_SCORE = 0.3  # below this, a pairing rests on shape alone
FUSED_PARTS = (2, 3, 4)

# --- names ------------------------------------------------------------------------

# Whole segments with a meaning of their own, looked up before splitting on `_`.
_SEGMENTS: dict[str, tuple[str, ...]] = {
    "wte": ("embed",),
    "word_embeddings": ("embed",),
    "embed_tokens": ("embed",),
    "tok_embeddings": ("embed",),
    "token_embedding": ("embed",),
    "wpe": ("position", "embed"),
    "token_type_embeddings": ("token_type", "embed"),
    "self_attn": ("attn",),
    "c_attn": ("attn", "qkv"),
    "qkv_proj": ("qkv",),
    "in_proj": ("qkv",),
    "query_key_value": ("qkv",),
    "wqkv": ("qkv", "weight"),
    "c_proj": ("o", "down"),
    "c_fc": ("up",),
    "fc1": ("up",),
    "fc2": ("down",),
    "ln_f": ("norm", "final"),
    "lm_head": ("lm_head",),
    "input_layernorm": ("norm", "attn", "1"),
    "post_attention_layernorm": ("norm", "mlp", "2"),
    "layer_norm": ("norm",),
    "feed_forward": ("mlp",),
    "token_type": ("token_type",),
    **{f"w{x}": (x, "weight") for x in ("q", "k", "v", "o")},
    **{f"b{x}": (x, "bias") for x in ("q", "k", "v", "o")},
}

# Single tokens (after splitting a segment on `_` and between letters and digits).
_SYNONYMS: dict[str, tuple[str, ...]] = {
    "embed": ("embed", "embedding", "embeddings", "emb", "embeds"),
    "position": ("position", "positions", "pos", "positional"),
    "norm": ("norm", "ln", "layernorm", "rmsnorm"),
    "attn": ("attn", "attention", "self"),
    "q": ("q", "query"),
    "k": ("k", "key"),
    "v": ("v", "value"),
    "o": ("o", "out", "dense"),
    "up": ("up", "fc", "intermediate", "wi"),
    "down": ("down", "proj", "output"),
    "gate": ("gate",),
    "mlp": ("mlp", "ffn", "ff", "feedforward"),
    "bias": ("bias", "b", "beta"),
    "weight": ("weight", "w", "gamma", "kernel", "scale"),
    "layers": ("layers", "layer", "h", "blocks", "block", "encoder"),
    "final": ("final", "f"),
    "lm_head": ("head", "unembed", "unembedding"),
    "qkv": ("qkv",),
}
_TOKEN = {word: canon for canon, words in _SYNONYMS.items() for word in words}
_DROP = {"c"}
_KINDS = {"weight", "bias"}
_TOKEN_WEIGHT = {"layers": 0.5, "weight": 0.5}
_FUSED_ORDER = ("q", "k", "v", "gate", "up")


@functools.lru_cache(maxsize=None)
def tokens(name: str) -> tuple[str, ...]:
    """Canonical tokens of a key or path: `h.{layer}.attn.c_proj.weight` -> layers attn o down weight.

    A `{layer}` segment is dropped; another integer segment (a layer of an unstacked
    model) is kept as `#n`, so that layer 3 pairs with layer 3.
    """
    out: list[str] = []
    for segment in name.lower().split("."):
        if segment == LAYER:
            continue
        if segment.isdigit():
            out.append(f"#{int(segment)}")
        elif segment in _SEGMENTS:
            out.extend(_SEGMENTS[segment])
        else:
            pieces = [p for p in re.split(r"_|(?<=[a-z])(?=\d)", segment) if p]
            if len(pieces) > 1 and pieces[-1] == "proj":  # q_proj, up_proj, out_proj
                pieces = pieces[:-1]
            out.extend(_TOKEN.get(p, p) for p in pieces if p not in _DROP)
    return tuple(dict.fromkeys(out))


def _kind(toks: Sequence[str]) -> str | None:
    found = _KINDS.intersection(toks)
    return found.pop() if len(found) == 1 else None


def similarity(key: str, path: str) -> float:
    """How alike a source key (pattern) and a module path are, from 0 to 1."""
    a, b = set(tokens(key)), set(tokens(path))
    if not (a & _KINDS) or not (b & _KINDS):  # `wte.weight` ~ `wte`: an implicit weight
        a.discard("weight")
        b.discard("weight")
    union = sum(_TOKEN_WEIGHT.get(t, 1.0) for t in a | b)
    jaccard = sum(_TOKEN_WEIGHT.get(t, 1.0) for t in a & b) / union if union else 0.0
    ratio = difflib.SequenceMatcher(None, _plain(key), _plain(path)).ratio()
    return 0.8 * jaccard + 0.2 * ratio


def _plain(name: str) -> str:
    return ".".join(s for s in name.lower().split(".") if s != LAYER and not s.isdigit())


# --- shapes and transforms ----------------------------------------------------------


def _builds(ops: Ops, source: Shape, target: Shape, config: AnyMapping[str, Any]) -> bool:
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
        if _builds(ops, source, target, {}):
            found.append(ops)
    return tuple(sorted(found, key=lambda ops: (len(ops), _transposed(ops))))


def _transposed(ops: Ops) -> bool:
    return bool(ops) and isinstance(ops[0], Transpose)


def _matrix(shape: Shape) -> bool:
    """A 2-d shape whose orientation matters (a [1, n] row reads the same either way)."""
    return len(shape) == 2 and min(shape) > 1


# --- the pieces -----------------------------------------------------------------------


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


@dataclass(frozen=True)
class Leaf:
    path: str
    shape: Shape
    dtype: np.dtype


@dataclass(frozen=True)
class Candidate:
    group: Group
    leaf: Leaf
    score: float
    options: tuple[Ops, ...]  # chains from the per-layer source shape to the per-layer target


@dataclass
class Entry:
    """One `[[params]]` entry to write, with the comments above it."""

    key: str
    path: str
    ops: Ops
    axes: list[str]
    comments: list[str] = field(default_factory=list)


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

    A group needs indices 0..n-1 with the same shape and dtype, and a skeleton with
    some leaf of leading size n; otherwise its keys stay single.
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


def _floating(dtype: np.dtype) -> bool:
    return np.dtype(dtype).kind in "fV"


def _target(group: Group, leaf: Leaf) -> Shape | None:
    """The per-layer shape `group` must reach to fill `leaf`, or None when it cannot."""
    if _floating(group.dtype) != _floating(leaf.dtype):
        return None
    if group.stacked:
        if not leaf.shape or leaf.shape[0] != len(group.keys):
            return None
        return leaf.shape[1:]
    return leaf.shape


def candidate(group: Group, leaf: Leaf) -> Candidate | None:
    """A scored pairing of `group` with `leaf`, or None when no chain fits."""
    target = _target(group, leaf)
    if target is None:
        return None
    options = chains(group.shape, target)
    if not options:
        return None
    score = similarity(group.pattern, leaf.path)
    score += {0: 0.03, 1: 0.02 if _transposed(options[0]) else 0.0}.get(len(options[0]), 0.0)
    key_kind, leaf_kind = _kind(tokens(group.pattern)), _kind(tokens(leaf.path))
    if key_kind and leaf_kind and key_kind != leaf_kind:
        score -= 0.5
    elif key_kind == "bias" and leaf_kind is None and len(target) >= 2:  # a weight-like leaf
        score -= 0.5
    return Candidate(group, leaf, score, options)


def assign(candidates: Sequence[Candidate]) -> list[Candidate]:
    """Greedy by best score; each group and each leaf at most once."""
    used_groups: set[str] = set()
    used_leaves: set[str] = set()
    chosen = []
    for c in sorted(candidates, key=lambda c: (-c.score, c.group.pattern, c.leaf.path)):
        if c.group.pattern in used_groups or c.leaf.path in used_leaves:
            continue
        chosen.append(c)
        used_groups.add(c.group.pattern)
        used_leaves.add(c.leaf.path)
    return chosen


def orientation(pairs: Sequence[Candidate]) -> tuple[bool, list[str]]:
    """Whether this checkpoint stores 2-d weights transposed relative to the module.

    Decided by the non-square 2-d weights (embeddings aside), whose orientation is
    not in doubt; used for square ones, which fit either way.
    """
    votes: dict[bool, list[str]] = {True: [], False: []}
    for c in pairs:
        if not _matrix(c.group.shape) or "embed" in tokens(c.group.pattern):
            continue
        sides = {_transposed(ops) for ops in c.options}
        if len(sides) == 1:
            votes[sides.pop()].append(c.group.pattern)
    transposed = len(votes[True]) > len(votes[False])
    return transposed, votes[transposed]


def pick(options: Sequence[Ops], source: Shape, transposed: bool) -> tuple[Ops, list[Ops]]:
    """The chain to write, and the others that fit as well (a square weight: both orientations)."""
    if _matrix(source):
        mine = [ops for ops in options if _transposed(ops) == transposed]
        other = [ops for ops in options if _transposed(ops) != transposed]
        if mine:
            return mine[0], other[:1]
        return other[0], []
    simplest = [ops for ops in options if len(ops) == len(options[0])]
    return options[0], simplest[1:3]


# --- axes ---------------------------------------------------------------------------

_AXIS_KEYS: dict[str, tuple[str, ...]] = {
    "embed": ("n_embd", "hidden_size", "d_model", "embed_dim", "dim"),
    "vocab": ("vocab_size",),
    "mlp": ("n_inner", "intermediate_size", "ffn_dim", "d_ff"),
    "heads": ("n_head", "num_attention_heads", "num_heads", "n_heads"),
    "kv_heads": ("num_key_value_heads", "n_kv_heads"),
    "head_dim": ("head_dim", "d_kv"),
    "positions": ("n_positions", "max_position_embeddings", "n_ctx"),
    "token_types": ("type_vocab_size",),
    "layers": ("n_layer", "num_hidden_layers", "num_layers", "n_layers"),
}
_AXIS_ORDER = ("embed", "mlp", "heads", "head_dim", "vocab", "positions", "kv_heads", "token_types", "layers")
_MODEL_AXES = {"heads", "kv_heads", "mlp", "vocab"}


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def config_dims(config: AnyMapping[str, Any]) -> dict[int, list[tuple[str, str | None]]]:
    """Sizes named by config.json: size -> [(logical axis, config key or None when derived)]."""
    dims: dict[int, list[tuple[str, str | None]]] = {}
    found: dict[str, int] = {}
    for axis, keys in _AXIS_KEYS.items():
        for key in keys:
            if (value := _int(config.get(key))) is not None:
                dims.setdefault(value, []).append((axis, key))
                found.setdefault(axis, value)
    embed, heads = found.get("embed"), found.get("heads")
    if "mlp" not in found and embed:  # GPT-2: n_inner null means 4 * n_embd
        dims.setdefault(4 * embed, []).append(("mlp", None))
    if "head_dim" not in found and embed and heads and embed % heads == 0:
        dims.setdefault(embed // heads, []).append(("head_dim", None))
    return dims


def _choose_axis(names: list[str], toks: set[str], before: list[str]) -> str:
    def score(axis: str) -> float:
        s = -0.01 * _AXIS_ORDER.index(axis)
        hints = {
            "positions": "position" in toks,
            "vocab": bool(toks & {"embed", "lm_head"}),
            "kv_heads": bool(toks & {"k", "v"}) and "q" not in toks,
            "token_types": "token_type" in toks,
            "head_dim": bool(before) and before[-1] in ("heads", "kv_heads"),
        }
        s += 1.0 if hints.get(axis) else 0.0
        s -= 0.5 if axis in before else 0.0
        return s

    return max(names, key=lambda a: (score(a), a))


def propose_axes(
    leaf: Leaf, stacked: bool, dims: AnyMapping[int, list[tuple[str, str | None]]]
) -> tuple[list[str], list[str]]:
    """A logical axis name per leaf dimension, and TODO comments for those it cannot name."""
    axes: list[str] = []
    todo: list[str] = []
    toks = set(tokens(leaf.path))
    for i, size in enumerate(leaf.shape):
        if stacked and i == 0:
            axes.append("layers")
            continue
        names = list(dict.fromkeys(axis for axis, _ in dims.get(size, [])))
        if not names:
            axes.append(f"dim{size}")
            todo.append(f"# TODO: name this axis: dim{size} (axis {i} of {_shape(leaf.shape)}) is no config.json size")
            continue
        axes.append(_choose_axis(names, toks, axes))
    return axes, todo


def rule_for(axis: str) -> str:
    if axis == "embed":
        return '"data"'
    return '"model"' if axis in _MODEL_AXES else "[]"


# --- writing ------------------------------------------------------------------------


def named(ops: Ops, source: Shape, target: Shape, config: AnyMapping[str, Any]) -> Ops:
    """`ops` with reshape sizes written as config.json names where one name fits unambiguously."""
    names: dict[int, list[str]] = {}
    for axis_names in config_dims(config).values():
        for _, key in axis_names:
            if key is not None:
                names.setdefault(config[key], []).append(key)
    out = []
    for t in ops:
        if isinstance(t, Reshape):
            sizes: list[int | str] = [names[d][0] if len(names.get(d, [])) == 1 else d for d in t.target]
            literal = [i for i, d in enumerate(sizes) if isinstance(d, int) and d > 1]
            if len(literal) == 1 and len(literal) < len(sizes):
                sizes[literal[0]] = -1
            t = Reshape(tuple(sizes))
        out.append(t)
    result = tuple(out)
    return result if _builds(result, source, target, config) else ops


def _ops_text(ops: Ops) -> str:
    return "[" + ", ".join(t.render() for t in ops) + "]"


def _entry_lines(entry: Entry, prefix: str = "") -> list[str]:
    lines = [*entry.comments, "[[params]]", f"key = {_toml(entry.key)}", f"path = {_toml(entry.path)}"]
    if entry.ops:
        lines.append(f"transforms = {_ops_text(entry.ops)}")
    lines.append(f"axes = {_toml(entry.axes)}")
    return [prefix + line for line in lines]


def _shape(shape: Shape) -> str:
    return "[" + ", ".join(map(str, shape)) + "]"


def _describe(group: Group) -> str:
    layers = f"{len(group.keys)} layers of " if group.stacked else ""
    return f"{group.pattern}  {layers}{_shape(group.shape)} {np.dtype(group.dtype).name}"


_BUFFERS = ("attn.bias", "attn.masked_bias", "position_ids", "rotary_emb.inv_freq", "num_batches_tracked")


def is_buffer(group: Group) -> bool:
    """A known non-parameter buffer (causal masks, rotary frequencies, batch-norm counters)."""
    name = group.pattern
    for buffer in _BUFFERS:
        if name == buffer or name.endswith("." + buffer):
            # a real attention bias is 1-d floating; GPT-2's mask buffer is [1, 1, n, n]
            return buffer != "attn.bias" or len(group.shape) >= 2 or not _floating(group.dtype)
    return False


def _glob(name: str) -> str:
    return ".".join("*" if s == LAYER or s.isdigit() else s for s in name.split("."))


@dataclass
class FusedHint:
    """Comment lines for an unpaired key that looks fused, and draft entries for its parts."""

    lines: list[str]
    entries: list[Entry]


def _fused_rank(path: str) -> tuple[int, str]:
    """q, k, v (or gate, up) order for the parts of a fused tensor."""
    return min((_FUSED_ORDER.index(t) for t in tokens(path) if t in _FUSED_ORDER), default=9), path


def fused_hint(
    group: Group,
    free: Sequence[Leaf],
    transposed: bool,
    config: AnyMapping[str, Any],
    dims: AnyMapping[int, list[tuple[str, str | None]]],
) -> FusedHint | None:
    """For an unpaired key that is k equal parts along one axis, each fitting an unfilled leaf."""
    for parts in FUSED_PARTS:
        for axis, size in enumerate(group.shape):
            if size % parts:
                continue
            part = group.shape[:axis] + (size // parts,) + group.shape[axis + 1 :]
            fits = []
            for leaf in free:
                target = _target(group, leaf)
                options = chains(part, target) if target is not None else ()
                if options:
                    fits.append((leaf, pick(options, part, transposed)[0], target))
            if not fits:
                continue
            split = Split(axis, 0, parts=parts)
            shown = ", ".join(f"{leaf.path} {_shape(leaf.shape)}" for leaf, _, _ in fits[:6])
            lines = [
                f"#     fused? {_shape(group.shape)} on axis {axis} is {parts} x {_shape(part)}: "
                f"try {split.render()}",
                f"#     fits {shown}" + (f" and {len(fits) - 6} more" if len(fits) > 6 else ""),
            ]
            entries = []
            if len(fits) == parts:
                for index, (leaf, ops, target) in enumerate(sorted(fits, key=lambda f: _fused_rank(f[0].path))):
                    split_op = Split(axis, index, parts=parts)
                    all_ops = (split_op, *named(ops, part, target, config))
                    if not _builds(all_ops, group.shape, target, config):
                        entries = []
                        break
                    entries.append(Entry(group.pattern, leaf.path, all_ops, propose_axes(leaf, group.stacked, dims)[0]))
                if entries:
                    lines.append("#     a draft, parts in q, k, v order (CHECK the order; uncomment to use):")
            return FusedHint(lines, entries)
    return None


def _tie(group: Group, pairs: Sequence[Candidate], free: Sequence[Leaf]) -> str | None:
    """For an unpaired `lm_head.weight` the model has no leaf for: the paired key it likely copies."""
    if not group.pattern.endswith("lm_head.weight") or group.stacked:
        return None
    size = math.prod(group.shape)
    if any(math.prod(leaf.shape) == size and _floating(leaf.dtype) == _floating(group.dtype) for leaf in free):
        return None
    same = [c.group.pattern for c in pairs if not c.group.stacked and c.group.shape == group.shape]
    if not same:
        return None
    return min(same, key=lambda p: ("embed" not in tokens(p), p))


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
    hints: dict[str, FusedHint | None]
    free: list[Leaf]


def scaffold(checkpoint: Checkpoint, skeleton: Any, model: str) -> str:
    """The text of a draft mapping pairing `checkpoint`'s keys with `skeleton`'s leaves.

    `skeleton` is `eqx.filter_eval_shape(Class.from_config, config, key=...)`; `model`
    is its `"package.module:Class"`. Uses only what `checkpoint` already holds (config
    and headers). Raises `PortError` when no key fits any leaf.
    """
    if ":" not in model:
        raise PortError(f"model '{model}' must be 'package.module:Class'")
    return render(draft(checkpoint, skeleton, model))


def draft(checkpoint: Checkpoint, skeleton: Any, model: str) -> Draft:
    """Pair keys with leaves, pick transforms and axes, and sort out what is left."""
    config, tensors = checkpoint.config, checkpoint.tensors
    leaves = [
        Leaf(path, tuple(leaf.shape), np.dtype(leaf.dtype))
        for path, leaf in skeleton_leaves(skeleton).items()
        if hasattr(leaf, "shape")
    ]
    prefix = find_prefix(sorted(tensors), [leaf.path for leaf in leaves])
    names = {(k[len(prefix) :] if prefix and k.startswith(prefix) else k): k for k in sorted(tensors)}
    groups = group_keys(names, tensors, {leaf.shape[0] for leaf in leaves if leaf.shape})
    candidates = [c for g in groups for leaf in leaves if (c := candidate(g, leaf)) is not None]
    pairs = assign(candidates)
    if not pairs:
        raise PortError(f"{checkpoint.directory}: no checkpoint tensor fits any leaf of {model} by shape")
    transposed, voters = orientation(pairs)
    dims = config_dims(config)
    by_group: dict[str, list[Candidate]] = {}
    by_leaf: dict[str, list[Candidate]] = {}
    for c in candidates:
        by_group.setdefault(c.group.pattern, []).append(c)
        by_leaf.setdefault(c.leaf.path, []).append(c)
    rivals = {c.group.pattern: _rivals(c, by_group, by_leaf) for c in pairs}
    order = {leaf.path: i for i, leaf in enumerate(leaves)}
    entries = sorted(
        (_entry(c, rivals[c.group.pattern], transposed, voters, config, dims) for c in pairs),
        key=lambda e: order[e.path],
    )
    paired, filled = {c.group.pattern for c in pairs}, {c.leaf.path for c in pairs}
    free = [leaf for leaf in leaves if leaf.path not in filled]
    ignore, tied, unpaired = [], {}, []
    for group in groups:
        if group.pattern in paired:
            continue
        if is_buffer(group):
            ignore.append(_glob(group.pattern))
        elif (tie := _tie(group, pairs, free)) is not None:
            tied[group.pattern] = tie
        else:
            unpaired.append(group)
    hints = {g.pattern: fused_hint(g, free, transposed, config, dims) for g in unpaired}
    return Draft(
        model, str(checkpoint.directory), len(tensors), config, prefix, entries, sorted(set(ignore)),
        tied, unpaired, hints, free,
    )


def _rivals(
    c: Candidate, by_group: AnyMapping[str, list[Candidate]], by_leaf: AnyMapping[str, list[Candidate]]
) -> list[str]:
    """Other leaves of `c`'s keys, and other keys for its leaf, scoring nearly as well."""
    close = [o for o in by_group[c.group.pattern] + by_leaf[c.leaf.path] if o.score >= c.score - TIE_MARGIN]
    found = {o.leaf.path for o in close if o.group == c.group and o.leaf != c.leaf}
    found |= {o.group.pattern for o in close if o.leaf == c.leaf and o.group != c.group}
    return sorted(found)


def _entry(
    c: Candidate,
    rivals: Sequence[str],
    transposed: bool,
    voters: Sequence[str],
    config: AnyMapping[str, Any],
    dims: AnyMapping[int, list[tuple[str, str | None]]],
) -> Entry:
    target = _target(c.group, c.leaf)
    assert target is not None
    ops, others = pick(c.options, c.group.shape, transposed)
    comments = []
    if c.score < WEAK_SCORE:
        comments.append(f"# CHECK: weak name match (score {c.score:.2f}): paired by shape")
    if rivals:
        comments.append("# CHECK: also matches " + ", ".join(rivals[:4]))
    if others:
        if not _matrix(c.group.shape):
            why = "other transforms fit too"
        elif voters:
            why = f"{_shape(c.group.shape)} is square: oriented like {', '.join(voters[:2])}"
        else:
            why = f"{_shape(c.group.shape)} is square and no other 2-d weight shows the orientation: kept as stored"
        comments.append(f"# CHECK: {why}; also fits: {_ops_text(others[0]) if others[0] else 'no transforms'}")
    axes, todo = propose_axes(c.leaf, c.group.stacked, dims)
    return Entry(c.group.pattern, c.leaf.path, named(ops, c.group.shape, target, config), axes, comments + todo)


def render(d: Draft) -> str:
    """The mapping file: header, top-level keys, rules, entries, then the TODO blocks."""
    drafts = [e for h in d.hints.values() if h for e in h.entries]
    axes = sorted({a for e in d.entries + drafts for a in e.axes})
    lines = _header(d) + ["", "[rules]                                   # logical axis -> mesh axis; [] = replicated"]
    lines += [f"{axis} = {rule_for(axis)}" for axis in axes]
    for entry in d.entries:
        lines += ["", *_entry_lines(entry)]
    if d.unpaired:
        lines += ["", "# TODO unpaired source keys (map them, or add them to ignore):"]
        for group in d.unpaired:
            lines.append(f"#   {_describe(group)}")
            if hint := d.hints[group.pattern]:
                lines += hint.lines
                for entry in hint.entries:
                    lines += ["#", *_entry_lines(entry, "# ")]
                lines.append("#")
    if d.free:
        lines += ["", "# TODO unfilled leaves (no checkpoint key fits them):"]
        lines += [f"#   {leaf.path}  {_shape(leaf.shape)} {leaf.dtype.name}" for leaf in d.free]
    return "\n".join(lines).rstrip() + "\n"


def _header(d: Draft) -> list[str]:
    n_unpaired = sum(len(g.keys) for g in d.unpaired)
    lines = [
        f"# Draft mapping made by port scaffold for {d.model}",
        f"# from the checkpoint {d.source} ({d.n_tensors} tensors; headers and config.json only).",
        "#",
        f"# {len(d.entries)} entries paired, {n_unpaired} source keys unpaired ({len(d.unpaired)} patterns), "
        f"{len(d.free)} leaves unfilled; {len(d.ignore)} ignore patterns, {len(d.tied)} tied.",
        "# This is a draft: review every entry marked CHECK/TODO, then run `port plan` on it.",
        "",
        f"model = {_toml(d.model)}",
    ]
    model_type = d.config.get("model_type")
    if isinstance(model_type, str):
        lines.append(f"model_types = {_toml([model_type])}")
    else:
        lines += ["# TODO: config.json has no model_type", "model_types = []"]
    if d.prefix:
        lines.append(f"prefixes = {_toml([d.prefix])}")
    if d.ignore:
        lines.append(f"ignore = {_toml(d.ignore)}   # known buffers, never read")
    if d.tied:
        if d.config.get("tie_word_embeddings") is False:
            lines.append("# CHECK: config.json says tie_word_embeddings = false, but the model has no leaf for it")
        tied = {json.dumps(k): v for k, v in sorted(d.tied.items())}
        lines.append(f"tied = {_toml(tied)}   # CHECK: a copy of a paired key, never read")
    return lines
