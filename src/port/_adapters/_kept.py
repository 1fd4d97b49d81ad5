"""Keep mode: a PEFT adapter loaded as `port.nn.LoRA` leaves, the base frozen beside them.

The mapping is extended, not the pipeline: each adapted entry's path `P` becomes
`P.base`, and new entries fill `P.a` (from `<module>.lora_A.weight`, reshaped to
`[rank, *in]`), `P.b` (`lora_B`, `[*out, rank]`) and, for DoRA, `P.magnitude`
(`lora_magnitude_vector`, `[*out]`), their logical axes the leaf's own (plus `rank`,
replicated): `a` and `b` are sharded as the leaf's inputs and outputs are. The
checkpoint is the base's and the adapter's tensors under one set of names (the
adapter's keys renamed after the base weights they adapt), and the skeleton holds a
`LoRA` of shapes at each `P`. Plan, place, fill, save and export then run unchanged.

Only weights of the stacked layers are kept (the model's own top-level leaves, an
embedding or a head, are read by its `__call__`, which a `LoRA` there would break),
each stacked entry adapted in every layer with one rank and scale; the rest (and
`modules_to_save`, and fused tensors) is refused in one line: load it merged.

```python
adapter = open_adapter("tiny-llama-lora", base)
kept = keep(mapping, base.config, base, adapter)
model = port.convert(kept.checkpoint, kept.skeleton(port.skeleton(mapping, base.config)), kept.mapping).model
model.blocks.attn.wq.a.shape       # (layers, rank, embed)
```
"""

from __future__ import annotations

import dataclasses
import json
import math
import tomllib
from collections.abc import Collection, Sequence
from collections.abc import Mapping as AnyMapping
from dataclasses import dataclass
from typing import Any, final

import equinox as eqx
import jax.numpy as jnp
import numpy as np

from .._errors import OutputError, PlanError
from .._mapping import Mapping, Param, mapping_for, parse_mapping
from .._plan import config_names, layer_group
from .._skeleton import skeleton as make_skeleton
from .._sources import Checkpoint, Region, TensorInfo
from .._targets import leaves
from .._text import quoted
from ._layout import Layout, layout
from ._peft import Adapter, Target

RANK = "rank"
"""The logical axis of a factor's rank: replicated unless the mapping's rules say otherwise."""
SUFFIXES = {"a": ".lora_A.weight", "b": ".lora_B.weight", "magnitude": ".lora_magnitude_vector"}
"""What a kept factor's key is named in the union checkpoint: the adapted weight's module name plus these."""
_MERGED = "load it merged (adapter_mode='merge', the default)"
ADAPTER = "port_adapter"
"""The key of the kept checkpoint's config (so of an output's recorded config) that holds the kept
adapter: its `adapter_config.json` and each `LoRA`'s static fields, which `restore` and
`export_adapter` read back (the model built from the config ignores it)."""


@dataclass(frozen=True)
class Node:
    """One kept `LoRA`: the leaf path it sits at, its layout, rank, scale, whether DoRA, the factors' dtype."""

    path: str
    layout: Layout
    rank: int
    scale: float
    dora: bool
    dtype: np.dtype


@dataclass(frozen=True)
class Kept:
    """The pipeline's inputs for a model with an adapter kept (see the module).

    **Fields:** `mapping` (the base's, extended; a real `Mapping` whose `text` parses back
    to it), `checkpoint` (base and adapter tensors under one set of names), `nodes` (each
    kept `LoRA` by its path), `adapter_config` (the adapter's `adapter_config.json`, as read).
    """

    mapping: Mapping
    checkpoint: Checkpoint
    nodes: dict[str, Node]
    adapter_config: dict

    def skeleton(self, skeleton: Any) -> Any:
        """`skeleton` (the base model's, of `jax.ShapeDtypeStruct`) with a `LoRA` of shapes at each adapted path.

        ```python
        kept.skeleton(port.skeleton(mapping, config)).blocks.attn.wq     # LoRA(base=..., a=..., b=...)
        ```
        """
        found = leaves(skeleton)
        paths = list(self.nodes)
        replacements = [self._lora(found[path], self.nodes[path]) for path in paths]
        return eqx.tree_at(lambda m: [node_at(m, path) for path in paths], skeleton, replacements)

    @staticmethod
    def _lora(base: Any, node: Node) -> Any:
        """A `LoRA` of `jax.ShapeDtypeStruct`s on the leaf `base` (made under `eval_shape`: no memory)."""
        from ..nn import LoRA

        stack = tuple(base.shape[: node.layout.stack])
        lay, dtype = node.layout, node.dtype

        def make() -> LoRA:
            a = jnp.zeros((*stack, *lay.a_shape(node.rank)), dtype)
            b = jnp.zeros((*stack, *lay.b_shape(node.rank)), dtype)
            magnitude = jnp.zeros((*stack, *lay.out_shape), dtype) if node.dora else None
            return LoRA(jnp.zeros(base.shape, base.dtype), a, b, magnitude, node.scale, lay.inputs, lay.transposed)

        return eqx.filter_eval_shape(make)


def recorded(config: AnyMapping[str, Any], where: str) -> dict[str, Any] | None:
    """The adapter an output's `config` records (`Kept.output_config`), checked: None if none;
    an `OutputError` naming `where` for one that is malformed (an output is untrusted)."""
    value = config.get(ADAPTER)
    if value is None:
        return None
    nodes = value.get("nodes") if isinstance(value, dict) else None
    if not isinstance(value, dict) or not isinstance(value.get("adapter_config"), dict) or not isinstance(nodes, dict):
        raise OutputError(f"{where}: config: '{ADAPTER}' must hold 'adapter_config' and 'nodes' tables")
    for path, node in nodes.items():
        scale = node.get("scale") if isinstance(node, dict) else None
        inputs = node.get("inputs") if isinstance(node, dict) else None
        if not (
            isinstance(node, dict)
            and isinstance(scale, (int, float))
            and not isinstance(scale, bool)
            and math.isfinite(scale)
            and isinstance(inputs, int)
            and not isinstance(inputs, bool)
            and inputs >= 1
            and isinstance(node.get("transposed"), bool)
        ):
            raise OutputError(
                f"{where}: config: '{ADAPTER}' node {quoted(path, 200)} must be {{scale, inputs, transposed}}"
            )
    return value


def restored_skeleton(skeleton: Any, config: AnyMapping[str, Any], shapes: AnyMapping[str, Any], where: str) -> Any:
    """`skeleton` with the `LoRA` nodes an output's `config` records (see `recorded`), their
    factors' shapes and dtypes from `shapes` (the output's leaves by path: `.shape`, `.dtype`);
    `skeleton` itself where it records none. An `OutputError` naming `where` for a node the
    skeleton or the output's leaves do not hold."""
    from ..nn import LoRA

    adapter = recorded(config, where)
    if adapter is None:
        return skeleton
    found = leaves(skeleton)
    replacements = []
    for path, node in adapter["nodes"].items():
        base, a, b = found.get(path), shapes.get(f"{path}.a"), shapes.get(f"{path}.b")
        magnitude = shapes.get(f"{path}.magnitude")
        if base is None or a is None or b is None or not 0 < node["inputs"] < len(base.shape):
            raise OutputError(
                f"{where}: config: '{ADAPTER}' names an adapter at {quoted(path, 200)}, which it does not hold"
            )
        if not _fits(tuple(base.shape), tuple(a.shape), tuple(b.shape), magnitude, node["inputs"], node["transposed"]):
            raise OutputError(
                f"{where}: config: '{ADAPTER}' node {quoted(path, 200)}: factors {list(a.shape)} and "
                f"{list(b.shape)} do not fit the leaf {list(base.shape)}"
            )

        def make(base=base, a=a, b=b, magnitude=magnitude, node=node) -> LoRA:
            w, fa, fb = (jnp.zeros(x.shape, x.dtype) for x in (base, a, b))
            m = None if magnitude is None else jnp.zeros(magnitude.shape, magnitude.dtype)
            return LoRA(w, fa, fb, m, float(node["scale"]), node["inputs"], node["transposed"])

        replacements.append(eqx.filter_eval_shape(make))
    paths = list(adapter["nodes"])
    return eqx.tree_at(lambda m: [node_at(m, path) for path in paths], skeleton, replacements)


def _fits(
    base: tuple[int, ...], a: tuple[int, ...], b: tuple[int, ...], magnitude: Any, inputs: int, transposed: bool
) -> bool:
    """Whether factors `a` `[*stack, rank, *in]`, `b` `[*stack, *out, rank]` (and a magnitude `[*stack, *out]`)
    fit a leaf `base` with `inputs` input axes, inputs first when `transposed`."""
    stack = len(a) - 1 - inputs
    if stack < 0 or len(b) < stack + 2 or a[:stack] != b[:stack] or a[stack] != b[-1]:
        return False
    ins, outs = a[stack + 1 :], b[stack:-1]
    if base != a[:stack] + (ins + outs if transposed else outs + ins):
        return False
    return magnitude is None or tuple(magnitude.shape) == a[:stack] + outs


def plain(mapping: Mapping, headers: AnyMapping[str, Any], config: AnyMapping[str, Any]) -> tuple[Mapping, dict, dict]:
    """A kept mapping, source headers and config as the base's alone (what `port export` writes a
    model with its adapters merged by): `P.base` entries back at `P`, the factors' entries and
    tensors and the recorded adapter dropped. Those of a base come back as they are."""
    factors = [
        p
        for p in mapping.params
        if p.path.rsplit(".", 1)[-1] in SUFFIXES
        and any(q.path == p.path.rsplit(".", 1)[0] + ".base" for q in mapping.params)
    ]
    config = {k: v for k, v in config.items() if k != ADAPTER}
    if not factors:
        return mapping, dict(headers), config
    data = tomllib.loads(mapping.text)
    dropped = {(p.key, p.path) for p in factors}
    entries = []
    for entry in data.get("params", []):
        path = entry["path"].replace("/", ".")
        if (entry["key"], path) in dropped:
            continue
        if path.endswith(".base"):
            entry["path"] = path.removesuffix(".base")
        entries.append(entry)
    data["params"] = entries
    base = parse_mapping(render_toml(data), mapping.source)
    base = dataclasses.replace(base, prefixes=mapping.prefixes, ignore=mapping.ignore, export=mapping.export)
    patterns = [p.pattern() for p in factors]
    kept = {k: v for k, v in headers.items() if not any(r.match(mapping.key_name(k)) for r in patterns)}
    return base, kept, config


def node_at(tree: Any, path: str) -> Any:
    """The node of `tree` at dotted `path` (attributes, keys of dicts, or indices of lists and tuples)."""
    for part in path.split("."):
        if isinstance(tree, dict):
            tree = tree[part]
        else:
            tree = tree[int(part)] if isinstance(tree, (list, tuple)) else getattr(tree, part)
    return tree


def keep(mapping: Mapping | None, config: AnyMapping[str, Any], base: Checkpoint, adapter: Adapter) -> Kept:
    """The mapping, checkpoint and skeleton maker that load `adapter` kept on `base` (see the module).

    **Arguments:**

    - `mapping`: the base's mapping (None: the shipped one for `config`).
    - `config`: the config the model is built from (the base's `config.json`).
    - `base`: the opened base checkpoint.
    - `adapter`: the opened adapter (`open_adapter`).

    **Returns:** a `Kept`; a `PlanError` naming the module and saying "load it merged" for
    what cannot be kept (see the module).

    ```python
    kept = keep(None, base.config, base, open_adapter("tiny-llama-lora", base))
    ```
    """
    mapping = mapping_for(base.config, mapping, keys=base.tensors)
    if adapter.saved:
        first = next(iter(adapter.saved))
        raise PlanError(
            [
                f"{adapter.source}: modules_to_save replaces {quoted(first, 200)} whole, which keep mode does not hold; "
                f"{_MERGED}"
            ]
        )
    skeleton = make_skeleton(mapping, config)
    names = config_names(skeleton, config)
    shapes = leaves(skeleton)
    grouped: dict[Param, dict[tuple[int, ...], Target]] = {}
    for target in adapter.targets.values():
        param, index = _entry(mapping, target, skeleton)
        grouped.setdefault(param, {})[index] = target
    nodes: dict[str, Node] = {}
    renames: dict[str, tuple[str, str]] = {}
    for param, targets in grouped.items():
        node = _node(param, targets, names, shapes, base, adapter, layer_group(skeleton, param))
        nodes[param.path] = node
        for target in targets.values():
            stem = target.weight.removesuffix(".weight")
            for field, suffix in SUFFIXES.items():
                key = getattr(target, field)
                if key is not None:
                    renames[stem + suffix] = (key, field)
    text = _extended_text(mapping, grouped, nodes)
    extended = parse_mapping(text, mapping.source)
    recorded = {**base.config, ADAPTER: _record(adapter.config, nodes)}
    return Kept(extended, UnionCheckpoint(base, adapter.checkpoint, renames, recorded), nodes, dict(adapter.config))


def _record(adapter_config: AnyMapping[str, Any], nodes: AnyMapping[str, Node]) -> dict[str, Any]:
    """What an output records of a kept adapter (see `ADAPTER`, `recorded`)."""
    fields = {
        path: {"scale": n.scale, "inputs": n.layout.inputs, "transposed": n.layout.transposed}
        for path, n in nodes.items()
    }
    return {"adapter_config": dict(adapter_config), "nodes": fields}


def _entry(mapping: Mapping, target: Target, skeleton: Any) -> tuple[Param, tuple[int, ...]]:
    """The stacked mapping entry filling `target`'s weight, and the weight's checkpoint index in its
    stack; of the entries one key pattern names (a layer group's each), the one whose group holds the layer."""
    name = mapping.key_name(target.weight)
    for param in mapping.params:
        match = param.pattern().match(name)
        if match is None:
            continue
        ids = layer_group(skeleton, param)
        if ids is not None and param.index(match)[0] not in ids:
            continue
        if target.kind == "embedding" or not param.stacked:
            raise PlanError(
                [
                    f"{target.module}: '{param.path}' is the model's own leaf, outside its stacked layers, where a "
                    f"kept adapter cannot sit; {_MERGED}"
                ]
            )
        if param.path_stack or param.axes is None or not param.key.endswith(".weight"):
            raise PlanError(
                [
                    f"{target.module}: mapping entry '{param.key}' fills '{param.path}', which keep mode cannot hold "
                    f"an adapter on (one leaf per layer, module axes, or a key not ending in .weight); {_MERGED}"
                ]
            )
        return param, param.index(match)
    raise PlanError([f"{target.module}: the mapping {mapping.source} has no entry for {quoted(target.weight, 200)}"])


def _node(
    param: Param,
    targets: dict[tuple[int, ...], Target],
    names: AnyMapping[str, Any],
    shapes: AnyMapping[str, Any],
    base: Checkpoint,
    adapter: Adapter,
    ids: tuple[int, ...] | None = None,
) -> Node:
    """The kept `LoRA` of one stacked entry: every layer (and expert) adapted alike; `ids`: the
    checkpoint layers of its rows, for a layer group's stack (`targets` are keyed by checkpoint index)."""
    first = next(iter(targets.values()))
    leaf = shapes.get(param.path)
    if leaf is None:
        raise PlanError([f"{first.module}: the model has no leaf '{param.path}' for an adapter"])
    stack = tuple(leaf.shape[: len(param.stack)])
    grid = math.prod(stack)
    indices = [tuple(i) if ids is None else (ids[i[0]], *i[1:]) for i in np.ndindex(*stack)]
    if len(targets) != grid or any(i not in targets for i in indices):
        missing = next((i for i in indices if i not in targets), None)
        which = "" if missing is None else f" ({quoted(param.key_at(tuple(missing)), 200)} not)"
        raise PlanError(
            [
                f"{first.module}: the adapter adapts {len(targets)} of the {grid} weights '{param.path}' stacks"
                f"{which}, and a kept adapter covers all, each once; {_MERGED}"
            ]
        )
    for target in targets.values():
        if (target.rank, target.scale, target.kind) != (first.rank, first.scale, first.kind):
            raise PlanError(
                [
                    f"{target.module}: rank {target.rank} and scale {target.scale:g} differ from {first.module}'s "
                    f"({first.rank}, {first.scale:g}), one stacked leaf '{param.path}' holding both; {_MERGED}"
                ]
            )
    shape = base.tensors[first.weight].shape
    lay = layout(param, names, shape, first.kind, first.module)
    dtype = adapter.checkpoint.tensors[first.a].dtype
    return Node(param.path, lay, first.rank, first.scale, first.magnitude is not None, dtype)


def _extended_text(mapping: Mapping, grouped: AnyMapping[Param, Any], nodes: AnyMapping[str, Node]) -> str:
    """The mapping's TOML with each adapted entry's path `P` made `P.base` and entries for `P.a`, `P.b`
    (and `P.magnitude`) added; `rank` replicated unless its rules say otherwise."""
    data = tomllib.loads(mapping.text)
    data.setdefault("rules", {}).setdefault(RANK, [])
    adapted = {(p.key, p.path) for p in grouped}
    added = []
    for entry in data.get("params", []):
        if (entry["key"], entry["path"].replace("/", ".")) not in adapted:
            continue
        param = next(p for p in grouped if (p.key, p.path) == (entry["key"], entry["path"].replace("/", ".")))
        node = nodes[param.path]
        entry["path"] = f"{param.path}.base"
        added.extend(_factor_entries(param, node))
    data["params"] = [*data.get("params", []), *added]
    return render_toml(data)


def _factor_entries(param: Param, node: Node) -> list[dict[str, Any]]:
    """The mapping entries of one kept `LoRA`'s factors (see the module)."""
    assert param.axes is not None  # refused in `_entry`
    lay = node.layout
    k = lay.stack
    lead, own = list(param.axes[:k]), list(param.axes[k:])
    ins, outs = (own[: lay.inputs], own[lay.inputs :]) if lay.transposed else (own[-lay.inputs :], own[: -lay.inputs])
    stem = param.key.removesuffix(".weight")
    entries = [
        _entry_table(stem + SUFFIXES["a"], f"{param.path}.a", [*lead, RANK, *ins], [node.rank, *lay.in_shape]),
        _entry_table(stem + SUFFIXES["b"], f"{param.path}.b", [*lead, *outs, RANK], [*lay.out_shape, node.rank]),
    ]
    if node.dora:
        entries.append(_entry_table(stem + SUFFIXES["magnitude"], f"{param.path}.magnitude", [*lead, *outs], None))
        if len(lay.out_shape) > 1:
            entries[-1]["transforms"] = [{"reshape": list(lay.out_shape)}]
    return entries


def _entry_table(key: str, path: str, axes: list[Any], shape: list[int] | None) -> dict[str, Any]:
    table: dict[str, Any] = {"key": key, "path": path, "axes": [a or "" for a in axes]}
    if shape is not None:
        table["transforms"] = [{"reshape": shape}]
    return table


def render_toml(data: AnyMapping[str, Any]) -> str:
    """A TOML document of `data` (parsed TOML: tables, arrays, strings, numbers, booleans), every
    table but the array `params` inline. `tomllib.loads(render_toml(d)) == d`."""
    lines = [f"{_key(k)} = {_value(v)}" for k, v in data.items() if k != "params"]
    for entry in data.get("params", []):
        lines.append("\n[[params]]")
        lines.extend(f"{_key(k)} = {_value(v)}" for k, v in entry.items())
    return "\n".join(lines) + "\n"


def _key(key: str) -> str:
    return _string(key)


def _string(text: str) -> str:
    return json.dumps(text, ensure_ascii=False).replace("\x7f", "\\u007f")


def _value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return _string(value)
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{ " + ", ".join(f"{_key(k)} = {_value(v)}" for k, v in value.items()) + " }"
    raise TypeError(f"cannot write {value!r} as TOML")


@final
class UnionCheckpoint(Checkpoint):
    """The base checkpoint's tensors and an adapter's under one set of names: `renames` gives each
    adapter tensor's name here -> (its key in the adapter, what it is); `config`, the base's config
    with what an output records of the adapter (`ADAPTER`)."""

    def __init__(
        self, base: Checkpoint, adapter: Checkpoint, renames: AnyMapping[str, tuple[str, str]], config: dict
    ) -> None:
        self.base, self.adapter = base, adapter
        self.renames = {name: key for name, (key, _) in renames.items()}
        self.directory = base.directory
        self.config = config
        clash = next((name for name in self.renames if name in base.tensors), None)
        if clash is not None:
            raise PlanError([f"{quoted(clash, 200)}: the base checkpoint already has a tensor of that name"])
        renamed = {name: dataclasses.replace(adapter.tensors[key], key=name) for name, key in self.renames.items()}
        self.tensors: dict[str, TensorInfo] = {**base.tensors, **renamed}

    @property
    def bytes_read(self) -> int:  # pyright: ignore[reportIncompatibleVariableOverride]  # both checkpoints' counts
        return self.base.bytes_read + self.adapter.bytes_read

    @property
    def bytes_over_read(self) -> int:  # pyright: ignore[reportIncompatibleVariableOverride]  # both checkpoints' counts
        return self.base.bytes_over_read + self.adapter.bytes_over_read

    def expect(self, reads: AnyMapping[str, Collection[Region]]) -> None:
        """Tell the base and the adapter the regions each will be asked for."""
        self.base.expect({k: r for k, r in reads.items() if k not in self.renames})
        self.adapter.expect({self.renames[k]: r for k, r in reads.items() if k in self.renames})

    def read_into(self, key: str, requests: Sequence[tuple[Region, np.ndarray]]) -> None:
        """Read regions of tensor `key` (see `Checkpoint.read_into`), from the adapter for a renamed one."""
        if key in self.renames:
            self.adapter.read_into(self.renames[key], requests)
        else:
            self.base.read_into(key, requests)

    def close(self) -> None:
        """Close the adapter and the base."""
        try:
            self.adapter.close()
        finally:
            self.base.close()
