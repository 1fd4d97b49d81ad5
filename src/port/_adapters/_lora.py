"""`port.lora`: fresh LoRA adapters on a loaded model's projections, named as PEFT names them.

PEFT picks the modules to adapt by name (`target_modules=["q_proj", "v_proj"]`: a module
whose name is one of them or ends with `.` and one of them); port finds the same
modules by the checkpoint keys of its mapping's entries (`model.layers.0.self_attn.q_proj.weight`
is module `model.layers.0.self_attn.q_proj`), and attaches one `port.nn.LoRA` to each
stacked leaf whose every layer (and expert) is such a module, as PEFT initialises one
(`a` uniform, `b` zero: the model is unchanged until trained), sharded as the leaf's
own axes say (`rank` replicated). Only the stacked layers take adapters (the
model's top-level leaves, the embedding and head, are read by its `__call__`).

```python
model = port.load("tiny-llama", mesh="4x2")
model = port.lora(model, "tiny-llama", rank=8, alpha=16, targets=["q_proj", "v_proj"], key=jax.random.key(0))
params, frozen = eqx.partition(model, port.nn.trainable(model))
```
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping as AnyMapping
from collections.abc import Sequence
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding

from .._errors import PlanError, PortError
from .._mapping import Mapping, Param, mapping_for
from .._output import Output
from .._plan import config_names, partition
from .._sources import Checkpoint
from .._text import quoted
from ._kept import RANK, node_at
from ._layout import Layout, layout

_DTYPES = ("float32", "bfloat16", "float16")


def modules(mapping: Mapping, keys: Sequence[str], param: Param) -> dict[tuple[int, ...], str]:
    """The checkpoint module names (`<module>.weight` keys less `.weight`) of a stacked entry, by stack index.

    ```python
    modules(mapping, ckpt.tensors, param)   # {(0,): "model.layers.0.self_attn.q_proj", (1,): ...}
    ```
    """
    pattern, found = param.pattern(), {}
    for key in keys:
        match = pattern.match(mapping.key_name(key))
        if match is not None and key.endswith(".weight"):
            found[param.index(match)] = key.removesuffix(".weight")
    return found


def matches(module: str, targets: Sequence[str]) -> bool:
    """PEFT's rule for a list of `target_modules`: the name is one of them or ends with `.` and one."""
    return any(module == t or module.endswith("." + t) for t in targets)


def lora(
    model: Any,
    source: str | os.PathLike | Checkpoint | Output,
    *,
    rank: int,
    alpha: float,
    targets: Sequence[str],
    key: Any,
    rslora: bool = False,
    dora: bool = False,
    mapping: str | os.PathLike | Mapping | None = None,
    dtype: Any = jnp.float32,
    fan_in_fan_out: bool = False,
) -> Any:
    """`model` with a fresh LoRA adapter on each stacked leaf PEFT's `target_modules` would pick.

    **Arguments:**

    - `model`: a model `port.load` or `port.restore` made (a sharded Equinox module).
    - `source`: where its tensors' names come from, as `port.export` takes it: the checkpoint
      it was converted from (directory, repo id or `Checkpoint`) or a `port convert` output.
    - `rank`, `alpha`: the adapters' rank and `lora_alpha` (scale `alpha / rank`; with
      `rslora`, `alpha / sqrt(rank)`).
    - `targets`: PEFT's `target_modules`, as a list of names (`["q_proj", "v_proj"]`).
    - `key`: a JAX PRNG key for the `a` factors.
    - `dora`: DoRA (a magnitude per output, from the base's norms).
    - `mapping`: the mapping (default: the output's, or the shipped one for the config).
    - `dtype`: the factors' dtype (PEFT's default, float32).
    - `fan_in_fan_out`: the torch weights are `[in, out]` (GPT-2's `Conv1D`), as PEFT's flag.

    **Returns:** the model with `port.nn.LoRA` nodes at the adapted leaves. A one-line
    `PortError` for a target naming no module, a module outside the stacked layers, a
    stack only some of whose modules match, a fused tensor, or a leaf already adapted.

    ```python
    model = port.lora(model, "gpt2", rank=4, alpha=8, targets=["c_fc"], key=key, fan_in_fan_out=True)
    ```
    """
    from .._export._export import read_source
    from ..nn import LoRA
    from ..nn._lora import is_lora

    _check(rank, alpha, targets, dtype)
    found = read_source(source, None)
    kept = found.output if mapping is None else None
    mapping = mapping_for(found.config, mapping if kept is None else kept.mapping, keys=found.headers)
    names = config_names(model, mapping.model_config(found.config))
    rules = {RANK: (), **mapping.rules}
    scale = alpha / math.sqrt(rank) if rslora else alpha / rank
    chosen = _chosen(mapping, found.headers, targets, fan_in_fan_out, names)
    if not chosen:
        raise PortError(f"targets={list(targets)}: no module of {quoted(str(source))} matches them")
    paths = list(chosen)
    nodes = []
    for (path, (param, lay)), k in zip(chosen.items(), jax.random.split(key, len(chosen))):
        leaf = node_at(model, path)
        if is_lora(leaf):
            raise PortError(f"'{path}' already holds an adapter: merge it first (port.nn.merged)")
        node = LoRA.attach(
            leaf, inputs=lay.inputs, rank=rank, scale=scale, key=k, stack=lay.stack,
            transposed=lay.transposed, dora=dora, dtype=dtype,
        )  # fmt: skip
        nodes.append(_sharded(node, param, lay, leaf, rules))
    return eqx.tree_at(lambda m: [node_at(m, path) for path in paths], model, nodes)


def _check(rank: Any, alpha: Any, targets: Any, dtype: Any) -> None:
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise PortError(f"rank={quoted(rank, 40)}: expected a positive integer")
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool) or not alpha > 0 or not math.isfinite(alpha):
        raise PortError(f"alpha={quoted(alpha, 40)}: expected a positive number")
    if isinstance(targets, str) or not targets or not all(isinstance(t, str) and t for t in targets):
        raise PortError(f"targets={quoted(targets, 80)}: expected a list of module names, as ['q_proj', 'v_proj']")
    if jnp.dtype(dtype).name not in _DTYPES:
        raise PortError(f"dtype={quoted(str(dtype), 40)}: expected one of {', '.join(_DTYPES)}")


def _chosen(
    mapping: Mapping,
    headers: AnyMapping[str, tuple[tuple[int, ...], Any]],
    targets: Sequence[str],
    conv1d: bool,
    names: AnyMapping[str, Any],
) -> dict[str, tuple[Param, Layout]]:
    """Each leaf path to adapt (`headers`: each checkpoint key's shape and dtype): its mapping entry and layout."""
    chosen: dict[str, tuple[Param, Layout]] = {}
    keys = list(headers)
    for param in mapping.params:
        found = modules(mapping, keys, param)
        picked = {i: m for i, m in found.items() if matches(m, targets)}
        if not picked:
            continue
        first = next(iter(picked.values()))
        if not param.stacked or param.path_stack or param.axes is None:
            raise PlanError(
                [f"{first}: '{param.path}' is not a stacked layer weight (an embedding or head is the model's own "
                 "leaf), where an adapter cannot sit"]
            )  # fmt: skip
        if len(picked) != len(found):
            other = next(m for i, m in found.items() if i not in picked)
            raise PlanError([f"{first}: the targets pick it but not {quoted(other, 200)}, both in '{param.path}'"])
        shape = tuple(headers[first + ".weight"][0])
        lay = layout(param, names, shape, "conv1d" if conv1d else "linear", first)
        chosen[param.path] = (param, lay)
    return chosen


def _sharded(node: Any, param: Param, lay: Layout, leaf: Any, rules: AnyMapping[str, tuple[str, ...]]) -> Any:
    """`node`'s factors on the leaf's mesh, sharded as its axes say (see `_kept` for the axes)."""
    sharding = getattr(leaf, "sharding", None)
    if not isinstance(sharding, NamedSharding) or param.axes is None:
        return node
    mesh, k = sharding.mesh, lay.stack
    lead, own = list(param.axes[:k]), list(param.axes[k:])
    ins, outs = (own[: lay.inputs], own[lay.inputs :]) if lay.transposed else (own[-lay.inputs :], own[: -lay.inputs])

    def put(x: Any, axes: list[Any]) -> Any:
        spec, _ = partition(tuple(x.shape), tuple(axes), rules, dict(mesh.shape))
        return jax.device_put(x, NamedSharding(mesh, spec))

    a, b = put(node.a, [*lead, RANK, *ins]), put(node.b, [*lead, *outs, RANK])
    node = eqx.tree_at(lambda n: (n.a, n.b), node, (a, b))
    if node.magnitude is not None:
        node = eqx.tree_at(lambda n: n.magnitude, node, put(node.magnitude, [*lead, *outs]))
    return node
