"""Derive: a model's source tensors (name, shape, dtype) from its mapping, its config and its leaves.

A model trained from scratch has no checkpoint to take the tensors' names, shapes and
dtypes from; `derive` finds them from the mapping walked backwards. Pure: no I/O.

- The keys: every entry whose leaf the model has (an optional entry whose leaf is None,
  a tied head, is skipped: `save_pretrained` leaves a tied key out too), `{layer}` and
  `{expert}` put in over the leaf's stack dimensions (a layer group's rows: its layers),
  under the mapping's base-model prefix (its last `prefixes`: `model.`, `transformer.`)
  where the mapping has a head (`tied` keys: `lm_head.weight`, which are the head class's
  own, are not prefixed); a mapping without one is of a base model (BERT), written bare.
- The shape: the leaf's, through the entry's transforms backwards. `transpose` permutes
  back; `split` and `stride` make the fused tensor (every part's size along the axis,
  as the entries sharing the key keep them); `cast` keeps the shape. `reshape` is
  ambiguous in general; the rule: the source stores a head count and the head size
  fused (`[heads * head_dim, hidden]` for a leaf `[heads, head_dim, hidden]`), so the
  dimensions whose logical axes run from a head count (`heads`, `kv_heads`, ...) to
  `head_dim` are merged back into one. A reshape with no such run (DINOv2's
  `cls_token`, `[1, 1, hidden]` -> `[hidden]`: which 1s?), an entry with two reshapes,
  or axes the module annotates (`axes = "module"`) is refused in one line naming the
  mapping, the key and the transform.
- The dtype: the leaf's (a bfloat16-trained model writes bfloat16); before a `cast`, the
  config's `torch_dtype` (or `dtype`) where it gives one, else the leaf's.

```python
headers = derive(model, port.mapping_for(config), config)
headers["model.layers.0.self_attn.q_proj.weight"]    # ((64, 64), dtype('float32'))
```
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping as AnyMapping
from typing import Any

import numpy as np

from .._dtypes import NAMES
from .._errors import PlanError
from .._mapping import LAYER, Mapping, Param
from .._plan import config_names, is_none, layer_groups
from .._targets import target_of
from .._transforms import Cast, Reshape, Split, Stride, Transform, Transpose

Header = tuple[tuple[int, ...], np.dtype]
HEAD_DIM = "head_dim"
"""The logical axis of a head's size; a head count is an axis named `heads` or ending in `_heads`."""


def derive(model: Any, mapping: Mapping, config: AnyMapping[str, Any]) -> dict[str, Header]:
    """Each source tensor of `model` by `mapping` and `config`: its key's shape and dtype, in the
    mapping's order; a one-line `PlanError` naming the entry where a transform cannot be undone.

    **Arguments:**

    - `model`: the module (its leaves give the shapes and dtypes).
    - `mapping`: the `Mapping` that relates its leaves to the checkpoint's keys.
    - `config`: the Hugging Face config the model was built from.

    ```python
    derive(model, port.mapping_for(config), config)["lm_head.weight"]    # ((vocab, hidden), float32)
    ```
    """
    names = config_names(model, mapping.model_config(config))
    every = {p: leaf for p, leaf in target_of(model).leaves(model).items() if hasattr(leaf, "shape")}
    before_cast = _config_dtype(config)
    prefix = mapping.prefixes[-1] if mapping.prefixes and mapping.tied else ""  # a base model under a head
    headers: dict[str, Header] = {}
    by_entry: dict[str, str] = {}  # key -> the first entry that derived it (a fused key has several)
    for param, leaf, layers in _concrete(mapping, model, every):
        shape = tuple(int(n) for n in leaf.shape)
        k = len(param.stack)
        if len(shape) < k:
            raise PlanError([f"{mapping.source}: entry '{param.key}': '{param.path}' has fewer dimensions than {k}"])
        transforms = param.build(names)
        axes = None if param.axes is None else tuple(param.axes[k:])
        source = _undo(param, transforms, shape[k:], axes, f"{mapping.source}: entry '{param.key}'")
        dtype = np.dtype(leaf.dtype)
        if any(isinstance(t, Cast) for t in transforms):
            dtype = before_cast or dtype
        for index in itertools.product(*(range(n) for n in shape[:k])):
            layer_index = index if layers is None else (layers[index[0]], *index[1:])
            name = param.key_at(layer_index)
            key = name if name in mapping.tied else prefix + name
            if key in headers and headers[key] != (source, dtype):
                raise PlanError(
                    [
                        f"{mapping.source}: entries '{by_entry[key]}' and '{param.key}' derive tensor '{key}' "
                        f"as {list(headers[key][0])} and {list(source)}"
                    ]
                )
            headers[key] = (source, dtype)
            by_entry.setdefault(key, param.key)
    return headers


def _config_dtype(config: AnyMapping[str, Any]) -> np.dtype | None:
    """The dtype config.json says the checkpoint holds (`torch_dtype` or `dtype`), if it names one."""
    for name in ("torch_dtype", "dtype"):
        value = config.get(name)
        if isinstance(value, str) and value in NAMES:
            return NAMES[value]
    return None


def _concrete(
    mapping: Mapping, model: Any, every: AnyMapping[str, Any]
) -> list[tuple[Param, Any, tuple[int, ...] | None]]:
    """Each entry with the leaf it fills (one per leaf for a path with placeholders) and the
    checkpoint layers of its stack's rows (a layer group's; None: row i is layer i)."""
    groups = layer_groups(model)
    found = []
    for param in mapping.params:
        if not param.path_stack:
            if param.path not in every:
                if is_none(model, param.path) and (param.leaf_optional or param.key_optional):
                    continue  # a tied head, an absent pooler: no tensor
                raise PlanError([f"{mapping.source}: entry '{param.key}': the model has no leaf '{param.path}'"])
            layers = _group(groups, param.path) if param.stack[:1] == (LAYER,) else None
            found.append((param, every[param.path], layers))
            continue
        pattern = param.path_pattern()
        rows = sorted(tuple(int(m.group(n[1:-1])) for n in param.path_stack) for p in every if (m := pattern.match(p)))
        layered = param.path_stack[0] == LAYER
        layers = _group(groups, param.path.split(LAYER, 1)[0].rstrip("._")) if layered else None
        for row in rows:
            index = row if layers is None else (layers[row[0]], *row[1:])
            concrete = param.at(index, row)
            found.append((concrete, every[concrete.path], None))
    return found


def _group(groups: AnyMapping[str, tuple[int, ...]], path: str) -> tuple[int, ...] | None:
    """The checkpoint layers of the layer group `path` lies in (see `port._plan.layer_groups`); None outside one."""
    for prefix, ids in groups.items():
        if path == prefix or path.startswith(prefix + "."):
            return tuple(ids)
    return None


def _undo(
    param: Param, transforms: list[Transform], shape: tuple[int, ...], axes: tuple[str | None, ...] | None, where: str
) -> tuple[int, ...]:
    """The source shape whose `transforms` (`param`'s, resolved) give `shape` (the leaf's, stack
    dimensions dropped), walked backwards; messages show each transform as the mapping writes it."""
    reshapes = [i for i, t in enumerate(transforms) if isinstance(t, Reshape)]
    if len(reshapes) > 1:
        raise _refused(where, param.transforms[reshapes[0]], "two reshapes: the shape between them is not known")
    current = list(shape)
    names = None if axes is None or len(axes) != len(shape) else list(axes)
    for t, written in reversed(list(zip(transforms, param.transforms))):
        if isinstance(t, Transpose):
            current = [current[t.perm.index(i)] for i in range(len(current))]
            names = None if names is None else [names[t.perm.index(i)] for i in range(len(names))]
        elif isinstance(t, (Split, Stride)):
            axis = t.axis % len(current)
            current[axis] = _fused_size(t, current[axis])
        elif isinstance(t, Reshape):
            current, names = _unreshape(written, current, names, where)
        elif not isinstance(t, Cast):
            raise _refused(where, written, "port does not know its inverse's shape")
    return tuple(current)


def _fused_size(t: Split | Stride, part: int) -> int:
    """The size along the axis of the tensor that `t` keeps a part of size `part` of."""
    if isinstance(t, Stride):
        return part * t.step
    if t.sizes is not None:
        return sum(int(s) for s in t.sizes)  # resolved by `Param.build`
    return part * int(t.parts or 1)


def _unreshape(
    t: Transform, shape: list[int], names: list[str | None] | None, where: str
) -> tuple[list[int], list[str | None] | None]:
    """The shape before `t`: the run of axes from a head count to `head_dim` merged into one."""
    if names is None:
        raise _refused(where, t, "the entry names no logical axes to tell which dimensions were one")
    start = next((i for i, n in enumerate(names) if _is_heads(n)), None)
    stop = None if start is None else next((i for i in range(start, len(names)) if names[i] == HEAD_DIM), None)
    if start is None or stop is None or any(_is_heads(n) for n in names[start + 1 : stop + 1]):
        raise _refused(where, t, "no head count and head_dim to merge, so the dimensions it came from are ambiguous")
    merged = [*shape[:start], math.prod(shape[start : stop + 1]), *shape[stop + 1 :]]
    return merged, [*names[:start], None, *names[stop + 1 :]]


def _is_heads(name: str | None) -> bool:
    return name is not None and (name == "heads" or name.endswith("_heads"))


def _refused(where: str, t: Transform, why: str) -> PlanError:
    return PlanError(
        [
            f"{where}: cannot derive the source tensor's shape through {t.render()} ({why}); export it with "
            "the checkpoint it came from as the source"
        ]
    )
