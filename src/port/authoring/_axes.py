"""Axes: logical axis names for a leaf's dimensions, read off the sizes `config.json` names.

A dimension whose size is `hidden_size` is `embed`, `num_attention_heads` is
`heads`, and so on; a size several axes share is settled by the leaf's name and
the axes before it, and marked `# CHECK`, with a warning atop the draft. Any
other integer of config.json names a dimension too: one that is no axis of port's
vocabulary (`port.nn.AXES`: a codebook count, say) is left unnamed (`""`: replicated),
with the config name in a comment. A reshape's sizes
are written back as the config names they come from, so that the mapping serves
every size of the family; a literal left is a `# CHECK`.

```python
dims = config_dims({"n_embd": 768, "n_head": 12, "vocab_size": 50257})
# {768: [("embed", "n_embd")], 50257: [("vocab", "vocab_size")], 12: [("heads", "n_head")],
#  3072: [("mlp", None)], 64: [("head_dim", None)]}: n_inner and head_dim derived
propose_axes(Leaf("wte", (50257, 768), float32), (), dims)      # (["vocab", "embed"], [])
rule_for("heads")                                                # '"model"'
```
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from collections.abc import Mapping as AnyMapping
from typing import Any

from .._mapping import EXPERT, LAYER
from .._transforms import Reshape, Size, Split, Transpose
from ._draft import shape_text
from ._keys import Shape
from ._names import tokens
from ._pairing import Leaf, Ops, builds

Dims = AnyMapping[int, list[tuple[str, str | None]]]  # size -> [(logical axis or "", config key or None)]

_AXIS_KEYS: dict[str, tuple[str, ...]] = {
    "embed": ("n_embd", "hidden_size", "d_model", "embed_dim", "dim"),
    "vocab": ("vocab_size",),
    "mlp": (
        "n_inner",
        "intermediate_size",
        "ffn_dim",
        "d_ff",
        "moe_intermediate_size",
        "shared_expert_intermediate_size",
        "intermediate_size_mlp",
    ),
    "heads": ("n_head", "num_attention_heads", "num_heads", "n_heads"),
    "kv_heads": ("num_key_value_heads", "n_kv_heads"),
    "head_dim": (  # and the sizes port.nn.REFINED tells apart, each a head_dim in a mapping
        "head_dim",
        "d_kv",
        "qk_head_dim",
        "qk_nope_head_dim",
        "qk_rope_head_dim",
        "v_head_dim",
        "linear_key_head_dim",
        "linear_value_head_dim",
    ),
    "positions": ("n_positions", "max_position_embeddings", "n_ctx"),
    "token_types": ("type_vocab_size",),
    "layers": ("n_layer", "num_hidden_layers", "num_layers", "n_layers"),
    "experts": ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts"),
    "lora": ("q_lora_rank", "kv_lora_rank"),
    "linear_heads": ("linear_num_key_heads",),
    "linear_v_heads": ("linear_num_value_heads",),
    "kernel": ("linear_conv_kernel_dim",),
    "channels": ("num_channels",),
    "buckets": ("relative_attention_num_buckets",),
}
_AXIS_ORDER = (
    "embed",
    "mlp",
    "heads",
    "head_dim",
    "vocab",
    "positions",
    "kv_heads",
    "token_types",
    "layers",
    "experts",
    "lora",
    "linear_heads",
    "linear_v_heads",
    "kernel",
    "channels",
    "buckets",
)
_KNOWN_KEYS = {key for keys in _AXIS_KEYS.values() for key in keys}
# A config key of no known name, but whose words name an axis (TinyLM's `max_positions`).
_KEY_WORDS = {
    "position": "positions",
    "positions": "positions",
    "vocab": "vocab",
    "channels": "channels",
    "intermediate": "mlp",
}
# A config key of no known name is a size when its words say so, and say nothing of a
# count of layers, a span of tokens, a step or a scale (`num_experts_per_tok`, `sliding_window`,
# `interleave_moe_layer_step`, `floor_scale`).
_SIZE_WORDS = {"num", "n", "size", "dim", "dims", "buckets", "channels", "rank", "max", "count", "width", "height"}
_NOT_SIZE_WORDS = {
    *("per", "tok", "token", "tokens", "seq", "length", "window", "chunk"),
    *("layer", "layers", "step", "interval", "every", "scale", "factor", "theta", "seed", "freq"),
}
# Words of a config key that say nothing of which leaf it sizes.
_PLAIN_WORDS = {"num", "n", "max", "min", "size", "dim", "of", "hidden", "attention", "attn", "layer", "layers"}
_MODEL_AXES = {"heads", "kv_heads", "mlp", "vocab", "experts"}
_STACK_AXES = {LAYER: "layers", EXPERT: "experts"}  # the axis a stack placeholder fills
UNNAMED = ""  # a dimension config.json sizes with a key of no axis of port's vocabulary: replicated


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def _words(key: str) -> list[str]:
    return [w for w in re.split(r"[^a-z0-9]+", key.lower()) if w]


def _sized(key: str, value: Any) -> bool:
    """An integer of config.json that may be a parameter's size: named so, no token id, not 1 (which
    every shape has)."""
    words = set(_words(key))
    return (_int(value) or 0) > 1 and bool(words & _SIZE_WORDS) and not words & (_NOT_SIZE_WORDS | {"id", "ids"})


def _tables(config: AnyMapping[str, Any]) -> list[tuple[str, AnyMapping[str, Any]]]:
    """config.json and its sub-configs (`text_config`, `vision_config`), each with the prefix of its keys."""
    nested = [
        (f"{key}.", value) for key, value in config.items() if key.endswith("_config") and isinstance(value, dict)
    ]
    return [("", config), *nested]


def config_dims(config: AnyMapping[str, Any]) -> dict[int, list[tuple[str, str | None]]]:
    """Sizes named by config.json: size -> [(logical axis, config key or None when derived)].

    The known keys of each axis first (`hidden_size` -> `embed`), then any other integer,
    as the axis its words name (`max_positions` -> `positions`) or `UNNAMED`; a
    sub-config's keys (`text_config.hidden_size`) after config.json's own.
    """
    dims: dict[int, list[tuple[str, str | None]]] = {}
    for prefix, table in _tables(config):
        found: dict[str, int] = {}
        for axis, keys in _AXIS_KEYS.items():
            for key in keys:
                if (value := _int(table.get(key))) is not None:
                    dims.setdefault(value, []).append((axis, prefix + key))
                    found.setdefault(axis, value)
        embed, heads = found.get("embed"), found.get("heads")
        if "mlp" not in found and embed:  # GPT-2: n_inner null means 4 * n_embd
            dims.setdefault(4 * embed, []).append(("mlp", None))
        if "head_dim" not in found and embed and heads and embed % heads == 0:
            dims.setdefault(embed // heads, []).append(("head_dim", None))
        for key, value in table.items():
            if key not in _KNOWN_KEYS and _sized(key, value):
                axis = next((_KEY_WORDS[w] for w in _words(key) if w in _KEY_WORDS), UNNAMED)
                dims.setdefault(value, []).append((axis, prefix + key))
    return dims


def _candidates(size: int, dims: Dims, path: str | None = None) -> list[tuple[str, str | None]]:
    """What may name a dimension of `size` of the leaf at `path`: every axis and key, except

    - `layers`, which only a stack fills (a non-stack dimension is `layers` only when
      nothing else has its size);
    - `positions` and `token_types`, which size only the tables named so (`wpe`,
      `pos_embed`, `token_type_embeddings`): Llama-2's 4096 positions never make its
      4096-wide weights a doubt.
    """
    found = list(dims.get(size, []))
    if path is not None:
        toks = set(tokens(path))
        named = {"positions": "position" in toks, "token_types": "token_type" in toks}
        found = [(a, k) for a, k in found if named.get(a, True)] or found
    return [(a, k) for a, k in found if a != "layers"] or found


def _choose_axis(names: list[tuple[str, str | None]], toks: set[str], words: set[str], before: list[str]) -> str:
    def score(named: tuple[str, str | None]) -> float:
        axis, key = named
        if axis == UNNAMED:  # below every known axis, unless the key's words are the leaf's
            mine = set(_words(key or "")) - _PLAIN_WORDS
            return -0.3 + (1.0 if mine & words else 0.0) - (1.5 if axis in before else 0.0)
        s = -0.01 * _AXIS_ORDER.index(axis)
        hints = {
            "positions": "position" in toks,
            "vocab": bool(toks & {"embed", "lm_head"}),
            "kv_heads": bool(toks & {"k", "v"}) and "q" not in toks,
            "token_types": "token_type" in toks,
            "experts": bool(toks & {"gate", "experts"}),  # a router (`mlp.gate`, `moe.router`), an expert
            "head_dim": bool(before) and before[-1] in ("heads", "kv_heads"),
        }
        s += 1.0 if hints.get(axis) else 0.0
        s -= 1.5 if axis in before else 0.0  # one axis twice in a leaf: only where nothing else fits
        return s

    return max(names, key=lambda n: (score(n), n[0], n[1] or ""))[0]


def _label(axis: str, key: str | None) -> str:
    return key if key is not None else f"{axis} (derived)"


def shared(size: int, dims: Dims, path: str | None = None) -> list[str]:
    """The config.json fields giving `size` to a dimension (of the leaf at `path`) when they
    disagree on its axis, else [].

    `shared(64, config_dims({"hidden_size": 64, "max_position_embeddings": 64}))` is
    `["hidden_size", "max_position_embeddings"]`; `n_embd` and `hidden_size` both 64 are no
    disagreement (both `embed`).
    """
    names = _candidates(size, dims, path)
    if len({a for a, _ in names}) < 2:
        return []
    return list(dict.fromkeys(_label(a, k) for a, k in names))


def propose_axes(leaf: Leaf, stack: Sequence[str], dims: Dims) -> tuple[list[str], list[str]]:
    """A logical axis name per leaf dimension, and the comments to put above its entry.

    The leading axes the keys' `stack` fills are `layers` and `experts`, the others named
    by their size; `propose_axes(Leaf("moe.w1", (2, 4, 8, 6), f32), ("{layer}", "{expert}"), dims)`
    gives `["layers", "experts", "mlp", "embed"]`. The comments: a TODO for a size no
    config.json integer gives, a note for one left `UNNAMED`, a CHECK for one several
    fields give (chosen by the leaf's name and the axes before it).
    """
    axes: list[str] = [_STACK_AXES[name] for name in stack]
    comments: list[str] = []
    toks = set(tokens(leaf.path))
    words = set(_words(leaf.path))
    where = shape_text(leaf.shape)
    for i, size in enumerate(leaf.shape):
        if i < len(stack):
            continue
        names = list(dict.fromkeys(_candidates(size, dims, leaf.path)))
        if not names:
            axes.append(f"dim{size}")
            comments.append(f"# TODO: name this axis: dim{size} (axis {i} of {where}) is no config.json size")
            continue
        axis = _choose_axis(names, toks, words, axes)
        axes.append(axis)
        if fields := shared(size, dims, leaf.path):
            comments.append(
                f"# CHECK: axis {i} of {where} is {size}, which several config.json fields give "
                f"({', '.join(fields)}): {_quoted_axis(axis)} chosen by the leaf's name"
            )
        elif axis == UNNAMED:
            keys = ", ".join(_label(a, k) for a, k in names)
            comments.append(
                f"# axis {i} of {where} is config.json's {keys} ({size}), no axis of port's vocabulary "
                '(port.nn.AXES): left unnamed (""), so replicated'
            )
    return axes, comments


def _quoted_axis(axis: str) -> str:
    """An axis as a draft's comment names it: `positions`, or `""` (unnamed)."""
    return axis if axis else '"" (unnamed)'


def size_warnings(leaves: Iterable[tuple[Leaf, Sequence[str]]], dims: Dims) -> list[str]:
    """Header comments for each size several config.json fields give, where a paired leaf has it.

    `leaves` are (leaf, the stack its keys fill) pairs; a stack's axes are named by the stack.

    ```python
    size_warnings([(Leaf("wpe", (64, 64), f32), ())], config_dims({"hidden_size": 64, "n_positions": 64}))
    # ["# sizes shared by several config.json fields: 64 = hidden_size, n_positions: the axes of ..."]
    ```
    """
    found: dict[int, list[str]] = {}
    for leaf, stack in leaves:
        for size in leaf.shape[len(stack) :]:
            if fields := shared(size, dims, leaf.path):
                found.setdefault(size, fields)
    return [
        f"# sizes shared by several config.json fields: {size} = {', '.join(fields)}: the axes of "
        f"leaves with a {size} dimension were chosen by name; check them (the entries marked CHECK), or make a "
        "test config with distinct sizes"
        for size, fields in sorted(found.items())
    ]


def rule_for(axis: str) -> str:
    """The draft's rule for a logical axis, as TOML: `embed` on `data`, heads, mlp, vocab and experts on `model`."""
    if axis == "embed":
        return '"data"'
    return '"model"' if axis in _MODEL_AXES else "[]"


def _top_level(dims: Dims, size: int) -> list[tuple[str, str]]:
    """The (axis, key) of config.json's own keys giving `size`: those a mapping's sizes can name."""
    return [(a, k) for a, k in dims.get(size, []) if k is not None and "." not in k]


def config_name(size: int, axis: str, config: AnyMapping[str, Any]) -> str | None:
    """The config.json key giving `size` to the logical `axis`, when exactly one does.

    `config_name(2, "kv_heads", {"num_key_value_heads": 2, "num_hidden_layers": 2})` is
    `"num_key_value_heads"`: the axis settles what the size alone cannot.
    """
    keys = {key for a, key in _top_level(config_dims(config), size) if a == axis}
    return keys.pop() if len(keys) == 1 else None


def _size_name(size: int, axis: str | None, dims: Dims) -> str | None:
    """The config.json name for a reshape size whose output dimension is `axis` (None: unknown)."""
    found = [(a, k) for a, k in _top_level(dims, size) if a != "experts"]  # an expert count: a stack
    if axis:  # the first key of that axis (`n_embd` or `hidden_size`: the same size)
        return next((k for a, k in found if a == axis), None)
    if axis == UNNAMED:
        found = [(a, k) for a, k in found if a == UNNAMED]
    keys = list(dict.fromkeys(k for _, k in found))
    return keys[0] if len(keys) == 1 else None


def _output_axes(ops: Ops, axes: Sequence[str] | None) -> list[Sequence[str] | None]:
    """The logical axes of each transform's output, walking back from the target's `axes`
    through transposes and splits (None before a reshape, or where `axes` is None)."""
    result: list[Sequence[str] | None] = [None] * len(ops)
    current: Sequence[str] | None = axes
    for i in reversed(range(len(ops))):
        result[i] = current
        t = ops[i]
        if current is None or isinstance(t, Split):
            continue
        if isinstance(t, Transpose) and len(t.perm) == len(current):
            before = [""] * len(current)
            for j, p in enumerate(t.perm):
                before[p] = current[j]
            current = before
        else:
            current = None
    return result


def named(
    ops: Ops, source: Shape, target: Shape, config: AnyMapping[str, Any], axes: Sequence[str] | None = None
) -> Ops:
    """`ops` with reshape sizes written as config.json names where one name fits unambiguously.

    With the target's logical `axes`, a size several keys give takes the key of its
    dimension's axis (`hidden_size`, not `max_position_embeddings`, for an `embed` of 64).
    """
    dims = config_dims(config)
    out = []
    for t, t_axes in zip(ops, _output_axes(ops, axes)):
        if isinstance(t, Reshape):
            sizes: list[int | str] = []
            for j, d in enumerate(t.target):
                axis = t_axes[j] if t_axes is not None and len(t_axes) == len(t.target) else None
                sizes.append((_size_name(d, axis, dims) or d) if isinstance(d, int) else d)
            literal = [i for i, d in enumerate(sizes) if isinstance(d, int) and d > 1]
            if len(literal) == 1 and len(literal) < len(sizes) and -1 not in sizes:
                sizes[literal[0]] = -1
            t = Reshape(tuple(sizes))
        out.append(t)
    result = tuple(out)
    return result if builds(result, source, target, config) else ops


def literal_sizes(ops: Ops) -> list[str]:
    """A CHECK for each reshape size written as a number: no config.json integer gives it (alone),
    so the mapping serves this size of the family only."""
    sizes: list[Size] = [d for t in ops if isinstance(t, Reshape) for d in t.target]
    literal = sorted({d for d in sizes if isinstance(d, int) and d > 1})
    return [
        f"# CHECK: reshape size {d} is written as a number: no config.json integer alone gives it, so the mapping "
        "serves this size only (write the config name, or delete this comment)"
        for d in literal
    ]
