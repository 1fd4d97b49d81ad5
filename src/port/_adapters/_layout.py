"""Where a LoRA's factors sit in a leaf: the layout of one mapping entry's weight.

PEFT's `lora_A` is `[rank, in]` and `lora_B` `[out, rank]` for a torch weight `[out, in]`
(`Linear`), or `[in, out]` (GPT-2's `Conv1D`, PEFT's `fan_in_fan_out`). A mapping entry
turns that weight into a leaf by its transforms; when they only reshape, cast, and
transpose without mixing the inputs with the outputs or reordering either, the leaf
is `[*stack, *out_shape, *in_shape]` (or `[*stack, *in_shape, *out_shape]`:
`transposed`), and the factors are PEFT's reshaped: `a = lora_A.reshape(rank,
*in_shape)`, `b = lora_B.reshape(*out_shape, rank)` (`port.nn.LoRA`'s fields). A chain
that splits or strides (a fused tensor cut into several leaves: GPT-2's `c_attn`) has
no such layout: one shared `a` cannot serve its parts.

```python
lay = layout(param, config, (64, 64), "linear", "model.layers.0.self_attn.q_proj")
lay.out_shape, lay.in_shape, lay.transposed      # (4, 16), (64,), False: wq [layers, heads, head_dim, embed]
```
"""

from __future__ import annotations

from collections.abc import Mapping as AnyMapping
from dataclasses import dataclass
from typing import Any

from .._errors import PlanError, PortError
from .._mapping import Param
from .._transforms import Cast, Chain, Reshape, Transpose, reshape_groups

KINDS = ("linear", "conv1d")
"""The torch weights a layout is found for: `Linear` (`[out, in]`) and `Conv1D` (`[in, out]`)."""
_OUT, _IN = "out", "in"


@dataclass(frozen=True)
class Layout:
    """One leaf's LoRA layout (per stacked layer / expert).

    **Fields:** `out_shape`, `in_shape` (the leaf's output and input axes, in order),
    `transposed` (the inputs come first in the leaf), `stack` (how many leading axes the
    leaf is stacked over: the entry's `{layer}` / `{expert}` not in its path).
    """

    out_shape: tuple[int, ...]
    in_shape: tuple[int, ...]
    transposed: bool
    stack: int

    @property
    def inputs(self) -> int:
        """How many of the leaf's own axes are inputs (`LoRA.inputs`)."""
        return len(self.in_shape)

    @property
    def fan_in(self) -> int:
        """The torch weight's input size."""
        n = 1
        for d in self.in_shape:
            n *= d
        return n

    @property
    def fan_out(self) -> int:
        """The torch weight's output size."""
        n = 1
        for d in self.out_shape:
            n *= d
        return n

    def a_shape(self, rank: int) -> tuple[int, ...]:
        """`a`'s shape per stacked layer: `[rank, *in_shape]`."""
        return (rank, *self.in_shape)

    def b_shape(self, rank: int) -> tuple[int, ...]:
        """`b`'s shape per stacked layer: `[*out_shape, rank]`."""
        return (*self.out_shape, rank)


def layout(param: Param, config: AnyMapping[str, Any], source_shape: tuple[int, ...], kind: str, module: str) -> Layout:
    """The LoRA layout of the leaf `param` fills from a torch weight of `source_shape`.

    **Arguments:**

    - `param`: the mapping entry.
    - `config`: the config its transforms' names resolve in.
    - `source_shape`: one stacked key's torch weight shape (`[out, in]`, or `[in, out]`).
    - `kind`: `"linear"` or `"conv1d"` (the weight is `[in, out]`).
    - `module`: the module's name, for messages.

    **Returns:** a `Layout`; a `PlanError` naming `module` where the chain cannot hold
    one adapter (a fused tensor's split or stride, a transform mixing inputs and outputs).

    ```python
    layout(param, config, (128, 64), "linear", "model.layers.0.mlp.up_proj").out_shape   # (128,)
    ```
    """
    if kind not in KINDS or len(source_shape) != 2:
        raise PlanError([f"{module}: a LoRA on a {kind} weight {list(source_shape)} has no layout in a leaf"])
    labels = [_OUT, _IN] if kind == "linear" else [_IN, _OUT]
    try:
        chain = Chain.build(param.build(config), tuple(source_shape))
    except (PortError, ValueError) as e:
        raise PlanError([f"{module}: mapping entry '{param.key}': {e}"]) from None
    for t, shape in zip(chain.transforms, chain.shapes):
        labels = _step(t, shape, labels, module, param.key)
    shape = chain.shape
    first = labels[0] if labels else _OUT
    split = next((i for i, name in enumerate(labels) if name != first), len(labels))
    if any(name == first for name in labels[split:]) or split in (0, len(labels)):
        raise PlanError([_refusal(module, param.key, "mixes its inputs and outputs")])
    lead, rest = tuple(shape[:split]), tuple(shape[split:])
    transposed = first == _IN
    out_shape, in_shape = (rest, lead) if transposed else (lead, rest)
    return Layout(out_shape, in_shape, transposed, len(param.stack) - len(param.path_stack))


def _step(t: Any, shape: tuple[int, ...], labels: list[str], module: str, key: str) -> list[str]:
    """Each output axis of transform `t` (on an input of `shape`) as input or output of the weight."""
    if isinstance(t, Cast):
        return labels
    if isinstance(t, Transpose):
        moved = [labels[p] for p in t.perm]
        for name in (_OUT, _IN):  # each group's axes keep their order: the flattening stays torch's
            order = [p for p in t.perm if labels[p] == name]
            if order != sorted(order):
                raise PlanError([_refusal(module, key, "reorders the axes of its inputs or outputs")])
        return moved
    if isinstance(t, Reshape):
        out: list[str] = []
        for src, dst in reshape_groups(tuple(shape), t.shape(shape)):
            names = {labels[i] for i in src}
            if len(names) > 1:
                raise PlanError([_refusal(module, key, "merges inputs with outputs")])
            name = names.pop() if names else (out[-1] if out else labels[0])  # an added 1: its neighbour's
            out.extend(name for _ in dst)
        return out
    raise PlanError([_refusal(module, key, f"{t.name}s its tensor (a fused weight cut into several leaves)")])


def _refusal(module: str, key: str, why: str) -> str:
    return (
        f"{module}: mapping entry '{key}' {why}, so one adapter cannot be kept on its leaf; "
        "load it merged (adapter_mode='merge', the default)"
    )
