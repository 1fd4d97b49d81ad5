"""Axes: logical axis names for a leaf's dimensions, read off the sizes `config.json` names.

A dimension whose size is `hidden_size` is `embed`, `num_attention_heads` is
`heads`, and so on; a size several axes share is settled by the leaf's name and
the axes before it. A reshape's sizes are written back as the config names they
come from, so that the mapping serves every size of the family.

```python
dims = config_dims({"n_embd": 768, "n_head": 12, "vocab_size": 50257})
# {768: [("embed", "n_embd")], 50257: [("vocab", "vocab_size")], 12: [("heads", "n_head")],
#  3072: [("mlp", None)], 64: [("head_dim", None)]}: n_inner and head_dim derived
propose_axes(Leaf("wte", (50257, 768), float32), (), dims)      # (["vocab", "embed"], [])
rule_for("heads")                                                # '"model"'
```
"""

from __future__ import annotations

from collections.abc import Mapping as AnyMapping
from collections.abc import Sequence
from typing import Any

from .._mapping import EXPERT, LAYER
from .._transforms import Reshape, Size
from ._draft import shape_text
from ._keys import Shape
from ._names import tokens
from ._pairing import Leaf, Ops, builds

Dims = AnyMapping[int, list[tuple[str, str | None]]]  # size -> [(logical axis, config key or None)]

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
    ),
    "heads": ("n_head", "num_attention_heads", "num_heads", "n_heads"),
    "kv_heads": ("num_key_value_heads", "n_kv_heads"),
    "head_dim": ("head_dim", "d_kv"),
    "positions": ("n_positions", "max_position_embeddings", "n_ctx"),
    "token_types": ("type_vocab_size",),
    "layers": ("n_layer", "num_hidden_layers", "num_layers", "n_layers"),
    "experts": ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts"),
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
)
_MODEL_AXES = {"heads", "kv_heads", "mlp", "vocab", "experts"}
_STACK_AXES = {LAYER: "layers", EXPERT: "experts"}  # the axis a stack placeholder fills


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
            "experts": bool(toks & {"gate", "experts"}),  # a router (`mlp.gate`, `moe.router`), an expert
            "head_dim": bool(before) and before[-1] in ("heads", "kv_heads"),
        }
        s += 1.0 if hints.get(axis) else 0.0
        s -= 0.5 if axis in before else 0.0
        return s

    return max(names, key=lambda a: (score(a), a))


def propose_axes(leaf: Leaf, stack: Sequence[str], dims: Dims) -> tuple[list[str], list[str]]:
    """A logical axis name per leaf dimension, and TODO comments for those it cannot name.

    The leading axes the keys' `stack` fills are `layers` and `experts`, the others named
    by their size; `propose_axes(Leaf("moe.w1", (2, 4, 8, 6), f32), ("{layer}", "{expert}"), dims)`
    gives `["layers", "experts", "mlp", "embed"]`.
    """
    axes: list[str] = [_STACK_AXES[name] for name in stack]
    todo: list[str] = []
    toks = set(tokens(leaf.path))
    for i, size in enumerate(leaf.shape):
        if i < len(stack):
            continue
        names = list(dict.fromkeys(axis for axis, _ in dims.get(size, [])))
        if not names:
            axes.append(f"dim{size}")
            todo.append(
                f"# TODO: name this axis: dim{size} (axis {i} of {shape_text(leaf.shape)}) is no config.json size"
            )
            continue
        axes.append(_choose_axis(names, toks, axes))
    return axes, todo


def rule_for(axis: str) -> str:
    """The draft's rule for a logical axis, as TOML: `embed` on `data`, heads, mlp, vocab and experts on `model`."""
    if axis == "embed":
        return '"data"'
    return '"model"' if axis in _MODEL_AXES else "[]"


def config_name(size: int, axis: str, config: AnyMapping[str, Any]) -> str | None:
    """The config.json key giving `size` to the logical `axis`, when exactly one does.

    `config_name(2, "kv_heads", {"num_key_value_heads": 2, "num_hidden_layers": 2})` is
    `"num_key_value_heads"`: the axis settles what the size alone cannot.
    """
    keys = {key for a, key in config_dims(config).get(size, []) if a == axis and key is not None}
    return keys.pop() if len(keys) == 1 else None


def named(ops: Ops, source: Shape, target: Shape, config: AnyMapping[str, Any]) -> Ops:
    """`ops` with reshape sizes written as config.json names where one name fits unambiguously."""
    names: dict[Size, list[str]] = {}  # a size (config.json's value) to the names that give it
    for axis_names in config_dims(config).values():
        for axis, key in axis_names:
            if key is not None and axis != "experts":  # an expert count: a stack, never reshaped
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
    return result if builds(result, source, target, config) else ops
