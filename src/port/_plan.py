"""Plan: one recipe per target leaf, validated before any tensor byte is read.

`plan` is a pure function of the skeleton, the mapping, the checkpoint headers and
the mesh's axis sizes. It checks that every leaf is filled exactly once, every
source key is used, ignored or tied, shapes and dtypes agree, and every logical
axis has a rule naming mesh axes that exist. A dimension a mesh axis does not
divide is replicated on that axis, and the leaf's `notes` say so.

```python
p = plan(skel, mapping, ckpt.tensors, ckpt.config, {"data": 4, "model": 2})
p.leaves[0].spec       # PartitionSpec(None, 'data'): vocab 50257 not divisible by model=2
print(p.table())
```
"""

from __future__ import annotations

import dataclasses
import fnmatch
import itertools
import math
import re
from collections.abc import Iterable, Sequence
from collections.abc import Mapping as AnyMapping
from dataclasses import dataclass
from typing import Any

import numpy as np
from jax.sharding import PartitionSpec

from ._dtypes import dtype as dtype_named
from ._dtypes import floating
from ._errors import PlanError, PortError
from ._mapping import LAYER, Mapping, Param, language_model
from ._sources import Region, TensorInfo
from ._sources._quantized import QuantizedInfo, describe
from ._targets import target_of
from ._text import quoted
from ._transforms import Cast, Chain


@dataclass(frozen=True)
class LeafPlan:
    """How one target leaf is made: source keys (one per layer, or per layer and expert, when stacked), chain, sharding.

    A stacked leaf's leading dimensions are `stack` (layers, experts or both), and
    `keys` lists its source tensors in row-major order over them.
    """

    path: str
    pattern: str
    keys: tuple[str, ...]
    stack: tuple[int, ...]
    chain: Chain
    shape: tuple[int, ...]
    dtype: np.dtype
    source_dtype: np.dtype  # what a source region is read as (a quantized source: dequantized to the leaf's dtype)
    axes: tuple[str | None, ...]
    spec: PartitionSpec
    notes: tuple[str, ...]
    device_bytes: int
    read_bytes: int
    source: TensorInfo | None = None  # the first source tensor's header (all alike): what a region of it reads

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def stacked(self) -> bool:
        return bool(self.stack)

    def key_index(self, index: tuple[int, ...]) -> int:
        """Where the source tensor of stack index `index` (layer, expert) is in `keys`."""
        at = 0
        for i, n in zip(index, self.stack):
            at = at * n + i
        return at

    def region_nbytes(self, region: Region) -> int:
        """The bytes reading `region` of one source tensor reads (packed bytes and scales, when quantized)."""
        if self.source is None:
            return math.prod(b - a for a, b in region) * self.source_dtype.itemsize
        return self.source.region_nbytes(region)

    def split_box(self, box: Region) -> tuple[Region, Region]:
        """A box of the leaf as (its stack dimensions, the rest: a box of each source tensor's result)."""
        k = len(self.stack)
        return box[:k], box[k:]

    def box_keys(self, box: Region) -> tuple[str, ...]:
        """The source keys a box of the leaf spans, in row-major order over its stack dimensions."""
        outer, _ = self.split_box(box)
        return tuple(self.keys[self.key_index(i)] for i in itertools.product(*(range(a, b) for a, b in outer)))

    def shards(self, mesh_shape: AnyMapping[str, int]) -> list[Region]:
        """Every distinct shard box of this leaf under its spec."""
        per_dim = []
        for dim, entry in zip(self.shape, tuple(self.spec) + (None,) * len(self.shape)):
            n = _count(entry, mesh_shape)
            per_dim.append([(i * dim // n, (i + 1) * dim // n) for i in range(n)])
        return list(itertools.product(*per_dim))

    def source_region(self, box: Region) -> tuple[Region, tuple[str, ...]]:
        """The source region and keys a target box needs."""
        _, inner = self.split_box(box)
        return self.chain.regions(inner)[0], self.box_keys(box)


@dataclass(frozen=True)
class Plan:
    """The validated plan: leaves in a fixed order, and what the checkpoint holds besides."""

    leaves: tuple[LeafPlan, ...]
    mesh_shape: dict[str, int]
    ignored: tuple[str, ...]
    tied: tuple[tuple[str, str], ...]
    empty: tuple[str, ...] = ()  # optional leaves the checkpoint lacks: set to None
    excluded: tuple[str, ...] = ()  # leaves `include` leaves out: set to None
    kept: tuple[str, ...] = ()  # leaves a non-strict plan does not fill: they keep the model's values
    own: tuple[str, ...] = ()  # the module's own state the mapping does not fill (an NNX Rngs' key): not read
    unused: tuple[str, ...] = ()  # checkpoint keys a non-strict plan leaves unread
    # The keys ignored by each mapping ignore pattern that names config values, as
    # (pattern, with the values put in, keys): `layers.{num_hidden_layers}.*` ->
    # `layers.61.*` (DeepSeek-V3's multi-token-prediction layer), for `port plan` to show.
    ignored_by_rule: tuple[tuple[str, str, tuple[str, ...]], ...] = ()

    @property
    def params(self) -> int:
        return sum(leaf.size for leaf in self.leaves)

    @property
    def device_bytes(self) -> int:
        """Bytes each device holds (shards of a NamedSharding are equal in size)."""
        return sum(leaf.device_bytes for leaf in self.leaves)

    @property
    def nbytes(self) -> int:
        """Bytes of every leaf in its target dtype: what a saved output holds."""
        return sum(leaf.size * leaf.dtype.itemsize for leaf in self.leaves)

    @property
    def read_bytes(self) -> int:
        """Bytes read from the checkpoint when every distinct shard is read once, and a region
        several leaves' blocks need (the parts of an interleaved tensor) once for all."""
        sharing = [leaf for leaf in self.leaves if any(t.shares_regions for t in leaf.chain.transforms)]
        regions: dict[tuple[str, Region], int] = {}
        for leaf in sharing:
            for box in leaf.shards(self.mesh_shape):
                region, keys = leaf.source_region(box)
                size = leaf.region_nbytes(region)
                regions.update(((key, region), size) for key in keys)
        shared = {id(leaf) for leaf in sharing}
        return sum(regions.values()) + sum(leaf.read_bytes for leaf in self.leaves if id(leaf) not in shared)

    def table(self) -> list[dict[str, str]]:
        """One row per leaf, as `port plan` prints it."""
        return [
            {
                "source": leaf.pattern + "".join(f" x{n}" for n in leaf.stack),
                "target": leaf.path,
                "transforms": str(leaf.chain),
                "shape": "[" + ", ".join(map(str, leaf.shape)) + "]",
                "dtype": leaf.dtype.name,
                "spec": spec_text(leaf.spec),
                "bytes/device": str(leaf.device_bytes),
                "notes": "; ".join(leaf.notes),
            }
            for leaf in self.leaves
        ]


def _count(entry: Any, mesh_shape: AnyMapping[str, int]) -> int:
    if entry is None:
        return 1
    names = entry if isinstance(entry, tuple) else (entry,)
    return math.prod(mesh_shape[n] for n in names)


def spec_text(spec: PartitionSpec) -> str:
    """A `PartitionSpec` as `port plan` shows it: `(-, data)`, `((data,model), -)`."""

    def one(e: Any) -> str:
        if e is None:
            return "-"
        return "(" + ",".join(e) + ")" if isinstance(e, tuple) else e

    return "(" + ", ".join(one(e) for e in spec) + ")"


def partition(
    shape: tuple[int, ...],
    axes: tuple[str | None, ...],
    rules: AnyMapping[str, tuple[str, ...]],
    mesh_shape: AnyMapping[str, int],
) -> tuple[PartitionSpec, tuple[str, ...]]:
    """The PartitionSpec for logical `axes`, replicating what a mesh axis does not divide.

    A logical axis with no rule that is the name of a mesh axis (an NNX module annotated
    with mesh axes, `(None, "model")`) is placed on that mesh axis. A leaf without elements
    (a NoPE layer's empty rotary key) has nothing to divide: it is replicated."""
    if 0 in shape:
        return PartitionSpec(*(None,) * len(shape)), ("no elements: replicated",)
    used: set[str] = set()
    spec, notes = [], []
    for dim, axis in zip(shape, axes):
        chosen: list[str] = []
        for name in rules.get(axis, (axis,) if axis in mesh_shape else ()) if axis else ():
            size = mesh_shape.get(name)
            if size is None:  # reported by plan
                continue
            if name in used:
                notes.append(f"{axis}: mesh axis {name} already used, replicated on it")
            elif dim % (math.prod(mesh_shape[c] for c in chosen) * size):
                notes.append(f"{axis} {dim} not divisible by {name}={size}: replicated on {name}")
            else:
                chosen.append(name)
                used.add(name)
        spec.append(None if not chosen else chosen[0] if len(chosen) == 1 else tuple(chosen))
    return PartitionSpec(*spec), tuple(notes)


def selects(path: str, patterns: Sequence[str] | None) -> bool:
    """Whether a module path is selected by `patterns` (None: all): a pattern equal to the path,
    a dotted prefix of it (`blocks` selects `blocks.attn.wq`), or an fnmatch glob (`blocks.attn.*`).

    ```python
    selects("blocks.attn.wq", ["embed", "blocks"])   # True
    ```
    """
    if patterns is None:
        return True
    return any(path == p or path.startswith(p + ".") or fnmatch.fnmatchcase(path, p) for p in patterns)


def check_include(paths: Iterable[str], patterns: Sequence[str] | None, model: str) -> None:
    """Refuse a pattern of `include` that selects none of `paths`, in one line naming it."""
    paths = list(paths)
    for pattern in patterns or ():
        if not any(selects(path, [pattern]) for path in paths):
            raise PortError(f"include {quoted(pattern, 200)}: matches no leaf of {model} (leaves: {_few(paths)})")


def _few(paths: list[str], n: int = 6) -> str:
    return ", ".join(paths[:n]) + (f", ... ({len(paths)} in all)" if len(paths) > n else "")


def plan(
    skeleton: Any,
    mapping: Mapping,
    tensors: AnyMapping[str, TensorInfo],
    config: AnyMapping[str, Any],
    mesh_shape: AnyMapping[str, int],
    dtype: str | np.dtype | None = None,
    *,
    include: Sequence[str] | None = None,
    layers: range | None = None,
    strict: bool = True,
) -> Plan:
    """Validate everything and make one recipe per leaf; reads no tensor data.

    Checks every mapping entry against the checkpoint's headers, the module's leaves
    and the mesh: keys, shapes after the transforms, dtypes, axes that divide evenly.

    **Arguments:**

    - `skeleton`: the module to fill (`port.skeleton(...)`).
    - `mapping`: the `Mapping` relating checkpoint keys to module paths.
    - `tensors`: the checkpoint's headers (`Checkpoint.tensors`).
    - `config`: the checkpoint's `config.json`, for names the mapping uses.
    - `mesh_shape`: axis sizes (`mesh.shape` or `port.mesh_shape("4x2")`).
    - `dtype`: cast floating parameters to it; default: keep the checkpoint's.
    - `include`: plan only the leaves these patterns select (see `selects`); the others
      are listed in `Plan.excluded`, and their keys are not read.
    - `layers`: plan only these checkpoint layers (a contiguous range) of each
      `{layer}`-stacked entry, as layers 0, 1, ... of the (smaller) skeleton.
    - `strict`: False allows leaves the mapping does not fill or whose keys the
      checkpoint lacks (`Plan.kept`: they keep the model's values) and checkpoint keys
      the mapping does not use (`Plan.unused`).

    Raises `PlanError`: `.problems` lists them all; its message names the first and counts the rest.

    ```python
    recipe = port.plan(skel, mapping, ckpt.tensors, ckpt.config, {"data": 4, "model": 2})
    recipe.read_bytes, len(recipe.leaves)
    ```
    """
    problems = plan_problems(
        skeleton, mapping, tensors, config, mesh_shape, dtype, include=include, layers=layers, strict=strict
    )
    if isinstance(problems, Plan):
        return problems
    raise PlanError(problems)


def plan_problems(
    skeleton: Any,
    mapping: Mapping,
    tensors: AnyMapping[str, TensorInfo],
    config: AnyMapping[str, Any],
    mesh_shape: AnyMapping[str, int],
    dtype: str | np.dtype | None = None,
    *,
    include: Sequence[str] | None = None,
    layers: range | None = None,
    strict: bool = True,
) -> Plan | list[str]:
    """The plan, or every problem found, each naming the mapping entry or key it comes from.

    A pattern of `include` that selects no leaf raises `PortError` (one line), as `plan` does.
    """
    problems: list[str] = []
    mapping = language_model(mapping, config, tensors)  # a wrapper's: its prefixes and towers, from the keys
    config = mapping.model_config(config)  # a wrapper's language model: names are its text_config's
    mesh_shape = dict(mesh_shape)
    target_dtype = None if dtype is None else dtype_named(dtype)
    if target_dtype is not None:
        check_target_dtype(target_dtype)
    for axis, mesh_axes in mapping.rules.items():
        for name in mesh_axes:
            if name not in mesh_shape:
                problems.append(
                    f"{mapping.source}: rules.{axis} names mesh axis '{name}', which the mesh "
                    f"({', '.join(mesh_shape)}) does not have"
                )
    stripped = _strip(mapping, tensors, problems)
    name_of = {key: name for name, key in stripped.items()}
    names = config_names(skeleton, config)
    ignore = ignore_patterns(mapping, names, problems)
    target = target_of(skeleton)
    every = {p: leaf for p, leaf in target.leaves(skeleton).items() if hasattr(leaf, "shape")}
    own = target.own(skeleton)
    annotated = target.axes(skeleton)
    check_include(every, include, mapping.model)
    targets = {p: leaf for p, leaf in every.items() if selects(p, include)}
    claimed: set[str] = set()  # keys of every entry whose leaf exists, planned or not
    groups_union = {i for ids in layer_groups(skeleton).values() for i in ids}
    beyond: dict[str, int] = {}  # keys of layers no group holds -> their layer
    leaf_plans, empty, kept = [], [], []
    params: list[Param] = []
    for param in mapping.params:
        if param.path_stack:  # one leaf per layer (expert): an entry for each
            params.extend(
                _per_leaf(param, every, stripped, skeleton, names, layers, mapping, claimed, beyond, problems)
            )
        else:
            params.append(param)
    for param in params:
        where = f"{mapping.source}: entry '{param.key}'"
        if param.path in every and param.path not in targets:  # left out by `include`: its keys are not read
            pattern = param.pattern()
            claimed.update(key for name, key in stripped.items() if pattern.match(name))
            continue
        if param.path not in targets:
            if not is_none(skeleton, param.path):
                problems.append(f"{where}: path '{param.path}' is not a leaf of {mapping.model}")
            elif param.key_optional and not any(param.pattern().match(name) for name in stripped):
                pass  # a model restored from a checkpoint that lacked the key (a BERT without pooler)
            elif not param.leaf_optional:
                at = _none_at(skeleton, param.path)
                what = (
                    f"'{param.path}' is None"
                    if at == param.path
                    else f"'{param.path}' lies under '{at}', which is None"
                )
                problems.append(
                    f"{where}: {what} in {mapping.model} built from this config.json "
                    '(mark the entry optional = "model" if the model may lack it)'
                )
            continue  # an optional leaf the model lacks: its keys must be tied or ignored
        matches = {}
        pattern = param.pattern()
        group = layer_group(skeleton, param)
        rows = None if group is None else {layer: row for row, layer in enumerate(group)}
        for name, key in stripped.items():
            if m := pattern.match(name):
                claimed.add(key)
                index = _in_layers(param, param.index(m), layers)
                if index is not None and rows is not None:  # rows: the layer group's, when the leaf has one
                    if index[0] not in groups_union:
                        beyond[key] = index[0]
                    index = (rows[index[0]], *index[1:]) if index[0] in rows else None
                if index is not None:
                    matches[index] = key
        if not matches and param.key_optional:
            empty.append(param.path)
            continue
        if not matches and not strict:  # the checkpoint lacks it: the model's own value stays
            kept.append(param.path)
            continue
        if param.axes is None:
            if param.path not in annotated:
                problems.append(
                    f'{where}: axes = "module", but {mapping.model} annotates no sharding names for '
                    f"'{param.path}' (name its logical axes, one per dimension)"
                )
                continue
            param = dataclasses.replace(param, axes=annotated[param.path])
        leaf = _leaf(
            param,
            where,
            matches,
            tensors,
            targets[param.path],
            names,
            mapping.rules,
            mesh_shape,
            target_dtype,
            problems,
            group,
        )
        if leaf is not None:
            leaf_plans.append(leaf)
    beyond_ignored = [k for k in beyond if any(fnmatch.fnmatchcase(name_of[k], p) for p in ignore.values())]
    layer_count = len(groups_union) or _layer_count(names) or 0
    for layer, key in sorted((layer, key) for key, layer in beyond.items() if key not in set(beyond_ignored))[:1]:
        problems.append(
            f"{tensors[key].file.name}: tensor {quoted(key, 200)} is of layer {layer}, beyond the model's "
            f"{layer_count} layers"
        )
    filled = {p.path for p in params}
    own_state = tuple(p for p in own if p not in filled)
    excluded = tuple(p for p in every if p not in targets and p not in own_state)
    for path in targets:
        if path not in filled and path not in own_state:  # own state (an NNX Rngs' key) keeps its own value
            if strict:
                problems.append(f"{mapping.source}: leaf '{path}' of {mapping.model} has no mapping entry")
            else:
                kept.append(path)
    ignored, tied, unused = list(beyond_ignored), [], []
    for name, key in stripped.items():
        if key in claimed:
            continue
        if any(fnmatch.fnmatchcase(name, pattern) for pattern in ignore.values()):
            ignored.append(key)
        elif name in mapping.tied:
            tied.append((key, mapping.tied[name]))
        elif not strict:
            unused.append(key)
        else:
            problems.append(
                f"{tensors[key].file.name}: tensor {quoted(key, 200)} is not used by the mapping "
                f"{mapping.source} (map it, or add it to ignore)"
            )
    if problems:
        return problems
    return Plan(
        tuple(leaf_plans),
        mesh_shape,
        tuple(ignored),
        tuple(tied),
        tuple(empty),
        excluded,
        tuple(kept),
        own_state,
        tuple(unused),
        tuple(
            (p, r, tuple(k for k in ignored if fnmatch.fnmatchcase(name_of[k], r))) for p, r in ignore.items() if p != r
        ),
    )


LAYER_COUNTS = ("num_hidden_layers", "n_layer", "num_layers", "n_layers")
"""The config.json keys Hugging Face configs keep their layer count in."""


def layer_count_key(config: AnyMapping[str, Any]) -> str | None:
    """The key of `LAYER_COUNTS` the config gives its layer count under (an integer), if any."""
    return next((k for k in LAYER_COUNTS if type(config.get(k)) is int), None)


def _layer_count(names: AnyMapping[str, Any]) -> int | None:
    """The config's layer count, if it gives one."""
    key = layer_count_key(names)
    return None if key is None else names[key]


def _per_leaf(
    param: Param,
    every: AnyMapping[str, Any],
    stripped: AnyMapping[str, str],
    skeleton: Any,
    names: AnyMapping[str, Any],
    layers: range | None,
    mapping: Mapping,
    claimed: set[str],
    beyond: dict[str, int],
    problems: list[str],
) -> list[Param]:
    """The entries of a path with placeholders (`layers.{layer}.attn.wq`), one per leaf the module
    has there: its list index is the layer's position in the module (in its layer group, or in
    `layers`), the key names that checkpoint layer. A list whose length is not the config's layer
    count (its group's), or that skips an index, is a problem; so is a checkpoint layer it lacks.

    ```python
    _per_leaf(param, ...)    # [Param("h.0.attn.w", "layers.0.attn.w", ...), Param("h.1.attn.w", ...), ...]
    ```
    """
    where = f"{mapping.source}: entry '{param.key}'"
    pattern = param.path_pattern()
    rows = sorted(
        tuple(int(m.group(name[1:-1])) for name in param.path_stack) for path in every if (m := pattern.match(path))
    )
    if not rows:
        if not param.leaf_optional:
            problems.append(f"{where}: path '{param.path}' matches no leaf of {mapping.model}")
        return []
    layered = param.path_stack[0] == LAYER
    group = _group_at(skeleton, param.path.split(LAYER, 1)[0].rstrip("._")) if layered else None
    for i, name in enumerate(param.path_stack):
        seen = sorted({r[i] for r in rows})
        if seen != list(range(len(seen))):
            missing = next(j for j in range(len(seen) + 1) if j not in seen)
            problems.append(f"{where}: path '{param.path}' has no leaf at {name[1:-1]} {missing} in {mapping.model}")
            return []
    count = len({r[0] for r in rows})
    if layered:
        expected = len(group) if group is not None else len(layers) if layers is not None else _layer_count(names)
        if expected is not None and count != expected:
            said = "its layer group holds" if group is not None else "config.json gives"
            problems.append(
                f"{where}: path '{param.path}' has {count} layers in {mapping.model}, but {said} {expected}"
            )
            return []

    def checkpoint_index(row: tuple[int, ...]) -> tuple[int, ...]:
        if not layered:
            return row
        layer = group[row[0]] if group is not None else row[0] + (layers.start if layers is not None else 0)
        return (layer, *row[1:])

    used = {checkpoint_index(r) for r in rows}
    key_pattern = param.pattern()
    for name, key in stripped.items():
        if m := key_pattern.match(name):
            index = param.index(m)[: len(param.path_stack)]
            if index not in used and layered:
                claimed.add(key)
                if (layers is None or index[0] in layers) and group is None:
                    beyond[key] = index[0]
    return [param.at(checkpoint_index(r), r) for r in rows]


def ignore_patterns(mapping: Mapping, names: AnyMapping[str, Any], problems: list[str]) -> dict[str, str]:
    """The mapping's `ignore` patterns, each with config values put in for `{name}`.

    `layers.{num_hidden_layers}.*` is the layer stored after the model's last one
    (DeepSeek-V3's multi-token-prediction layer): `layers.61.*` for a 61-layer config.
    A name config.json lacks, or whose value is not an integer, is a problem.
    """
    patterns = {}
    for pattern in mapping.ignore:
        resolved = pattern
        for name in re.findall(r"\{([A-Za-z_][A-Za-z0-9_]*)\}", pattern):
            value = names.get(name)
            if not isinstance(value, int) or isinstance(value, bool):
                problems.append(
                    f"{mapping.source}: ignore pattern '{pattern}' names '{name}', which config.json "
                    f"does not give as an integer"
                )
                break
            resolved = resolved.replace("{" + name + "}", str(value))
        patterns[pattern] = resolved
    return patterns


def layer_groups(skeleton: Any) -> dict[str, tuple[int, ...]]:
    """The model's layer groups: path prefix -> the checkpoint layers its stacked rows hold.

    A model whose layers differ (dense MLP layers among mixture-of-experts ones, linear
    and full attention) keeps each kind in its own stack and says which checkpoint
    layers each holds, as a `layer_groups` attribute: `{"dense": (0, 1, 2), "moe": (3,
    ..., 60)}`. A `{layer}` entry whose path is under a group's prefix fills that
    group's rows from those layers only (row i from layer `ids[i]`); {} for a model
    without groups (every `{layer}` stack holds every layer, in order).
    """
    groups = getattr(skeleton, "layer_groups", None)
    return dict(groups) if isinstance(groups, AnyMapping) else {}


def layer_group(skeleton: Any, param: Param) -> tuple[int, ...] | None:
    """The checkpoint layers the stack at `param.path` holds, when it is in a layer group."""
    if not param.stack or param.stack[0] != LAYER:
        return None
    return _group_at(skeleton, param.path)


def _group_at(skeleton: Any, path: str) -> tuple[int, ...] | None:
    """The checkpoint layers of the layer group whose prefix `path` is, or lies under; None outside one."""
    for prefix, ids in layer_groups(skeleton).items():
        if path == prefix or path.startswith(prefix + "."):
            return tuple(ids)
    return None


def _in_layers(param: Param, index: tuple[int, ...], layers: range | None) -> tuple[int, ...] | None:
    """A match's stack index counted from `layers.start`, or None for a layer outside `layers`."""
    if layers is None or not param.stack or param.stack[0] != LAYER:
        return index
    if index[0] not in layers:
        return None
    return (index[0] - layers.start, *index[1:])


def config_names(skeleton: Any, config: AnyMapping[str, Any]) -> dict[str, Any]:
    """Values a mapping may name: config.json, completed by the model's own config dataclass.

    A model normalises its config (`num_key_value_heads` defaults to the head count,
    `head_dim` to embed / heads); where config.json omits a value or leaves it null,
    the model's value is used.
    """
    names = dict(config)
    model_config = getattr(skeleton, "config", None)
    if dataclasses.is_dataclass(model_config):
        for field in dataclasses.fields(model_config):
            if names.get(field.name) is None:
                names[field.name] = getattr(model_config, field.name)
    return names


def is_none(module: Any, path: str) -> bool:
    """Whether `path` names an attribute of `module` that is None, or lies under one that is
    (an absent optional leaf, or a leaf of an absent submodule)."""
    return _none_at(module, path) is not None


def _none_at(module: Any, path: str) -> str | None:
    """The prefix of `path` (`path` itself, or a submodule's path) that is None in `module`; None
    where none is (the path exists, or names no attribute)."""
    node, parts = module, path.split(".")
    for i, part in enumerate(parts):
        if node is None:
            return ".".join(parts[:i])
        if part.isdigit() and isinstance(node, (list, tuple)):
            if int(part) >= len(node):
                return None
            node = node[int(part)]
        elif hasattr(node, part):
            node = getattr(node, part)
        else:
            return None
    return path if node is None else None


def _strip(mapping: Mapping, tensors: AnyMapping[str, TensorInfo], problems: list[str]) -> dict[str, str]:
    """Source keys without their optional prefix: stripped name -> key in the checkpoint."""
    stripped: dict[str, str] = {}
    for key in tensors:
        name = mapping.key_name(key)
        if name in stripped:
            problems.append(
                f"{tensors[key].file.name}: both {quoted(stripped[name], 200)} and {quoted(key, 200)} are present"
            )
        stripped[name] = key
    return stripped


def _leaf(
    param: Param,
    where: str,
    matches: dict[tuple[int, ...], str],
    tensors: AnyMapping[str, TensorInfo],
    target: Any,
    names: AnyMapping[str, Any],
    rules: AnyMapping[str, tuple[str, ...]],
    mesh_shape: dict[str, int],
    target_dtype: np.dtype | None,
    problems: list[str],
    group: tuple[int, ...] | None = None,
) -> LeafPlan | None:
    if not matches:
        problems.append(f"{where}: missing tensor: no key in the checkpoint matches")
        return None
    k = len(param.stack)
    stack = tuple(target.shape[:k])
    if len(stack) < k:
        problems.append(f"{where}: '{param.path}' has {len(target.shape)} dimensions, fewer than the key stacks ({k})")
        return None
    grid = list(itertools.product(*(range(n) for n in stack)))
    counts = " x ".join(f"{n} {name[1:-1]}s" for n, name in zip(stack, param.stack))
    missing = [i for i in grid if i not in matches]
    extra = sorted(i for i in matches if any(a >= n for a, n in zip(i, stack)))
    if missing:
        first_missing = missing[0] if group is None else (group[missing[0][0]], *missing[0][1:])
        problems.append(f"{where}: missing tensor '{param.key_at(first_missing)}' ({counts} expected)")
        return None
    if extra:
        problems.append(f"{where}: tensor {quoted(matches[extra[0]], 200)} is beyond the model's {counts}")
        return None
    keys = tuple(matches[i] for i in grid)
    infos = [tensors[k] for k in keys]
    first = infos[0]
    for info in infos[1:]:
        if info.shape != first.shape or info.dtype != first.dtype:
            problems.append(
                f"{where}: '{info.key}' is {info.dtype.name}{list(info.shape)} but "
                f"'{first.key}' is {first.dtype.name}{list(first.shape)}"
            )
            return None
    try:
        transforms = param.build(names)
        chain = Chain.build(transforms, first.shape)
    except PortError as e:
        problems.append(str(e))
        return None
    except ValueError as e:
        problems.append(f"{where}: {e} (source '{first.key}' is {list(first.shape)})")
        return None
    shape = stack + chain.shape
    if shape != tuple(target.shape):
        source = f"'{first.key}' is {list(first.shape)}"
        if param.stacked:
            source = f"{counts} of {source}"
        if transforms:
            source += f", through {chain} gives {list(shape)},"
        problems.append(f"{where}: shape mismatch: {source} but '{param.path}' is {list(target.shape)}")
        return None
    axes = param.axes if param.axes is not None else ()  # resolved from the module's annotations by now
    if len(axes) != len(shape):
        problems.append(f"{where}: {len(axes)} axes for a {len(shape)}-d leaf '{param.path}'")
        return None
    for axis in axes:
        if axis is not None and axis not in rules and axis not in mesh_shape:
            problems.append(f"{where}: logical axis '{axis}' has no rule in [rules]")
            return None
    current = first.dtype
    for t in transforms:
        if isinstance(t, Cast):
            current = np.dtype(t.dtype)
    leaf_kind = np.dtype(target.dtype).kind
    if (current.kind in "fV") != (leaf_kind in "fV"):
        problems.append(
            f"{where}: dtype mismatch: '{first.key}' is {current.name} but '{param.path}' is "
            f"{np.dtype(target.dtype).name}"
        )
        return None
    explicit_cast = any(isinstance(t, Cast) for t in transforms)
    out_dtype = current if explicit_cast else first.load_dtype  # a quantized source: the checkpoint's dtype
    if target_dtype is not None and not explicit_cast and floating(current):
        out_dtype = np.dtype(target_dtype)
    read_dtype = first.dtype
    if isinstance(first, QuantizedInfo) and not explicit_cast:
        read_dtype = current = out_dtype  # dequantized straight to it, rounded once (not through a cast)
    if out_dtype != current:
        chain = Chain.build([*transforms, Cast(out_dtype)], first.shape)
    spec, notes = partition(shape, axes, rules, mesh_shape)
    stored = describe(first)
    if stored is not None:
        notes = (f"quantized: {stored}", *notes)
    leaf = LeafPlan(
        param.path,
        param.key,
        keys,
        stack,
        chain,
        shape,
        out_dtype,
        read_dtype,
        axes,
        spec,
        notes,
        0,
        0,
        first,
    )
    shards = leaf.shards(mesh_shape)
    read_bytes = 0
    for box in shards:
        region, box_keys = leaf.source_region(box)
        read_bytes += leaf.region_nbytes(region) * len(box_keys)
    device_bytes = math.prod(b - a for a, b in shards[0]) * out_dtype.itemsize
    return dataclasses.replace(leaf, device_bytes=device_bytes, read_bytes=read_bytes)


def check_target_dtype(dtype: np.dtype) -> None:
    """Refuse a `dtype` to cast parameters to that is not floating, or that JAX would silently narrow."""
    import jax

    if not floating(dtype):
        raise PortError(
            f"dtype {dtype.name}: parameters are cast only to a floating dtype (float32, bfloat16, float16)"
        )
    if dtype.itemsize > 4 and not jax.config.jax_enable_x64:  # pyright: ignore[reportAttributeAccessIssue]  # jax's Config stub lacks its options
        raise PortError(f"dtype {dtype.name}: JAX stores it as float32 unless jax_enable_x64 is set")
