"""Where a failing `verify` goes wrong: the first module of the reference whose result port's model does not reproduce.

Both models run again on verify's inputs, each recording what its modules take and give:

- the reference (PyTorch): a forward pre-hook and a forward hook on every submodule, in
  the order they fire (the first call of each);
- port's model: each Equinox sub-module holding exactly the leaves the mapping fills from
  one reference module's parameters (its *counterpart*: `model.layers.3.self_attn` <->
  `blocks.attn` at layer 3) is swapped, with `eqx.tree_at`, for a `Recorder` that passes
  its first floating input and its first output through a host callback. Inside a layer
  scan the callback fires once per layer, in order: the k-th call is the stack's row k.

Each event of a module with a counterpart is an observation, compared where the shapes
agree (padding left out). Its difference is judged against its own scale: its relative
difference, max |port - reference| over max |reference| there, against verify's relative
tolerance (not against max(1, max |reference|): an attention's output of size 1e-3 that
differs by 4e-5 is 4% off, however small next to the logits, and a post-norm after it
scales that up to size 1). Walking the reference's events in order, the first observation
beyond it is where the difference shows; where it started is found by how it grew: the
observations just before it whose relative difference was already within a factor
`GROWTH` of it carried it (under the tolerance, amplified after), so the first of that
run (D) is where it started, and the observation before it (A), an order of magnitude
smaller, where it had not. Named are the reference's modules with parameters that ran
wholly between A and D (the outermost of them), with where the mapping puts their
parameters; when none did, the module whose input or output D is (its own code). The
logits are the last observation, judged as verify judges them. A counterpart that runs at
another place among the others than its module does in the reference (the mapping pairs
`h.0.ln_1` with port's `ln_2`) is no observation: the module is then named by what runs
after it.

```python
found = first_divergence(model, plan, mapping, reference, call_model, call_reference, logits, factor)
found.modules[0]       # Suspect('model.layers.0.input_layernorm', 'blocks.mlp_norm', 0)
found.max_abs_diff     # 1.88, in the input of model.layers.0.self_attn
found.relative_diff    # 0.48: 1.88 of a max |reference| of 3.89 there
```
"""

from __future__ import annotations

import dataclasses
import math
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import equinox as eqx
import jax
import numpy as np

from .._errors import PortError
from .._mapping import LAYER, Mapping
from .._plan import Plan, layer_groups
from .._targets import path_str
from .._text import size_text

GROWTH = 10.0
"""How much smaller an observation's relative difference is than the first beyond the tolerance's
for the difference to count as not started there: within this factor of it, the observation
already carried it (a difference under the tolerance that what followed amplified)."""

SMALLEST_SCALE = 1e-6
"""The least scale an observation is judged against: values whose max |reference| is smaller
count as that size (below it, a difference is rounding of what is, next to 1, nothing)."""


@dataclass(frozen=True)
class Suspect:
    """A module of the reference, and where the mapping puts its parameters in port's model.

    **Fields:**

    - `module`: its name in the reference (`"model.layers.0.input_layernorm"`; the class's
      name for the whole model).
    - `path`: the port module or leaf its parameters fill (their common path,
      `"blocks.attn_norm"`), or None where none of them is filled (tied, not mapped).
    - `layer`: the checkpoint layer, for a path in a layer stack (else None).

    ```python
    suspect = port.verify("checkpoint", mapping="draft.toml").first_divergence.modules[0]
    str(suspect)   # 'model.layers.0.self_attn -> blocks.attn (layer 0)'
    ```
    """

    module: str
    path: str | None
    layer: int | None

    def __str__(self) -> str:
        port = "" if self.path is None else f" -> {self.path}"
        return f"{self.module}{port}" + ("" if self.layer is None else f" (layer {self.layer})")


@dataclass(frozen=True)
class Divergence:
    """Where port's model and the reference part: the first of the reference's modules, in the
    order they run, whose result port's model does not reproduce, each value judged against its
    own scale (see the module's docstring).

    **Fields:**

    - `modules`: the suspects (`Suspect`), in the order they ran (one, unless several ran
      between the last observation that agreed and the first that does not).
    - `max_abs_diff`: the largest `|port - reference|` where the difference starts
      (`observed`: `"the output of model.layers.0.self_attn"`, `"the logits"`).
    - `max_abs_reference`: the largest `|reference|` there: the scale the difference is judged
      against (`relative_diff`, their ratio).
    - `inputs_max_abs_diff`: at the last observation before it, which agreed (None: the
      model's inputs, the same on both sides).
    - `observed`: the value compared there.
    - `compared`: observations compared up to it.

    ```python
    found = port.verify("checkpoint", mapping="draft.toml").first_divergence
    found.modules        # (Suspect('model.layers.0.self_attn', 'blocks.attn', 0),)
    found.relative_diff  # 0.03: 3.8e-05 in an output of size 1.3e-03
    str(found)           # 'model.layers.0.self_attn -> blocks.attn (layer 0): max abs difference 3.83e-05 ...'
    ```
    """

    modules: tuple[Suspect, ...]
    max_abs_diff: float
    max_abs_reference: float
    inputs_max_abs_diff: float | None
    observed: str
    compared: int

    @property
    def relative_diff(self) -> float:
        """`max_abs_diff` over `max_abs_reference` (as `SMALLEST_SCALE` at least)."""
        return _relative(self.max_abs_diff, self.max_abs_reference)

    def __str__(self) -> str:
        names = ", ".join(map(str, self.modules))
        agree = (
            "from the model's inputs"
            if self.inputs_max_abs_diff is None
            else f"{'its' if len(self.modules) == 1 else 'their'} inputs agree to {self.inputs_max_abs_diff:.2g}"
        )
        return (
            f"{'' if len(self.modules) == 1 else 'one of '}{names}: max abs difference {self.max_abs_diff:.3g} "
            f"in {self.observed}, {self.relative_diff:.2g} of its max |reference| {self.max_abs_reference:.3g} "
            f"({agree})"
        )


class Budget:
    """The bytes the recordings of one search may keep, both models' together (None: any);
    `over` once a value was not kept for want of them."""

    def __init__(self, limit: int | None) -> None:
        self.limit, self.left, self.over = limit, limit, False

    def take(self, nbytes: int) -> bool:
        """Whether a value of `nbytes` may be kept (then counted)."""
        if self.left is not None:
            if nbytes > self.left:
                self.over = True
                return False
            self.left -= nbytes
        return True


class Recording:
    """What the `Recorder`s of one run saw: values by (port path, "in"/"out"), one per call in
    call order, and the order of the calls' inputs, (path, call) pairs; values kept within `budget`."""

    def __init__(self, budget: Budget | None = None) -> None:
        self.values: dict[tuple[str, str], list[np.ndarray]] = {}
        self.order: list[tuple[str, int]] = []
        self.budget = Budget(None) if budget is None else budget
        self._lock = threading.Lock()

    def keep(self, path: str, kind: str, value: Any) -> None:
        with self._lock:
            if not self.budget.take(np.asarray(value).nbytes):
                return
            calls = self.values.setdefault((path, kind), [])
            if kind == "in":
                self.order.append((path, len(calls)))
            calls.append(np.array(value))

    def through(self, path: str, kind: str, x: Any) -> Any:
        """`x`, recorded when the compiled model computes it (one call of a batched `x` under `vmap`)."""

        def keep(value: Any) -> np.ndarray:
            self.keep(path, kind, value)
            return np.asarray(value)

        return jax.pure_callback(keep, jax.ShapeDtypeStruct(x.shape, x.dtype), x, vmap_method="expand_dims")


def _floating(x: Any) -> bool:
    return isinstance(x, jax.Array) and jax.numpy.issubdtype(x.dtype, jax.numpy.floating)


class Recorder(eqx.Module):
    """A module that records its first floating input and first output as it calls `module`;
    any other attribute is `module`'s."""

    module: Any
    path: str = eqx.field(static=True)
    recording: Recording = eqx.field(static=True)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        given, named = list(args), dict(kwargs)
        for holder, at in [*((given, i) for i in range(len(given))), *((named, k) for k in named)]:
            if _floating(holder[at]):
                holder[at] = self.recording.through(self.path, "in", holder[at])
                break
        out = self.module(*given, **named)
        leaves, tree = jax.tree.flatten(out)
        if leaves and _floating(leaves[0]):
            leaves[0] = self.recording.through(self.path, "out", leaves[0])
        return jax.tree.unflatten(tree, leaves)

    def __getattr__(self, name: str) -> Any:
        if name in ("module", "path", "recording") or name.startswith("__"):
            raise AttributeError(name)
        return getattr(self.module, name)


def leaf_rows(plan: Plan, mapping: Mapping) -> dict[str, set[tuple[str, int | None]]]:
    """Each checkpoint key (as `Mapping.key_name` names it) -> the leaves it fills, with the layer stack's row."""
    found: dict[str, set[tuple[str, int | None]]] = {}
    for leaf in plan.leaves:
        layered = LAYER in leaf.pattern
        inner = math.prod(leaf.stack[1:]) if leaf.stack else 1
        for j, key in enumerate(leaf.keys):
            found.setdefault(mapping.key_name(key), set()).add((leaf.path, j // inner if layered else None))
    return found


def _submodules(model: Any) -> dict[str, tuple]:
    """Every Equinox module inside `model` (not itself): dotted path -> its key path."""
    found: dict[str, tuple] = {}

    def walk(node: Any, at: tuple) -> None:
        flat, _ = jax.tree_util.tree_flatten_with_path(
            node, is_leaf=lambda x: x is not node and isinstance(x, eqx.Module)
        )
        for keypath, child in flat:
            if isinstance(child, eqx.Module):
                found[path_str(at + keypath)] = at + keypath
                walk(child, at + keypath)

    walk(model, ())
    return found


def _at(tree: Any, keypath: tuple) -> Any:
    for k in keypath:
        if hasattr(k, "name"):
            tree = getattr(tree, k.name)
        elif hasattr(k, "idx"):
            tree = tree[k.idx]
        else:
            tree = tree[k.key]
    return tree


def _common(paths: set[str]) -> str:
    parts = [p.split(".") for p in sorted(paths)]
    common = []
    for column in zip(*parts):
        if len(set(column)) > 1:
            break
        common.append(column[0])
    return ".".join(common)


@dataclass(frozen=True)
class _Module:
    """A module of the reference: its parameters' leaves and rows in port's model, if every one is filled."""

    name: str
    params: int
    targets: frozenset[tuple[str, int | None]] | None


def _reference_modules(reference: Any, rows: dict[str, set[tuple[str, int | None]]], mapping: Mapping) -> dict:
    found = {}
    for name, module in reference.named_modules():
        params = [f"{name}.{p}" if name else p for p, _ in module.named_parameters(remove_duplicate=False)]
        targets: set[tuple[str, int | None]] | None = set()
        for param in params:
            normal = mapping.key_name(param)
            filled = rows.get(normal) or rows.get(mapping.key_name(mapping.tied.get(normal, "")))
            if not filled:
                targets = None
                break
            targets |= filled
        found[name] = _Module(name, len(params), None if targets is None else frozenset(targets))
    return found


def counterparts(
    model: Any, plan: Plan, mapping: Mapping, reference: Any
) -> tuple[dict[str, tuple[str, int | None]], dict[str, tuple]]:
    """Each reference module with a counterpart in `model` -> (its port path, the layer stack's row
    or None); and the key path of each port module named. A counterpart holds exactly the leaves
    the mapping fills from the module's parameters (one row of them, for a layer stack); tied
    parameters count as not filled."""
    modules = _reference_modules(reference, leaf_rows(plan, mapping), dataclasses.replace(mapping, tied={}))
    planned = {leaf.path for leaf in plan.leaves}
    submodules = _submodules(model)
    by_leaves: dict[frozenset[str], str] = {}
    for path in sorted(submodules, key=lambda p: (p.count("."), p)):
        held = frozenset(p for p in planned if p.startswith(path + "."))
        if held and held not in by_leaves and callable(_at(model, submodules[path])):
            by_leaves[held] = path
    found = {}
    for name, module in modules.items():
        if not name or not module.targets:
            continue
        stack_rows = {row for _, row in module.targets}
        path = by_leaves.get(frozenset(leaf for leaf, _ in module.targets))
        if path is not None and len(stack_rows) == 1:
            found[name] = (path, stack_rows.pop())
    return found, {path: submodules[path] for path, _ in found.values()}


def _first_tensor(value: Any, torch: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value if value.is_floating_point() else None
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, (list, tuple)):
        for item in value:
            found = _first_tensor(item, torch)
            if found is not None:
                return found
    return None


def _difference(ours: np.ndarray, theirs: np.ndarray, mask: np.ndarray | None) -> tuple[float, float] | None:
    """(max |ours - theirs|, max |theirs|) where the shapes agree (size-1 axes aside), padding left out; else None."""
    ours, theirs = np.squeeze(ours).astype(np.float32), np.squeeze(theirs).astype(np.float32)
    if ours.shape != theirs.shape or ours.size == 0:
        return None
    if mask is not None:
        if ours.shape[: mask.ndim] != mask.shape:
            return None
        kept = mask.astype(bool)
        ours, theirs = ours[kept], theirs[kept]
    return float(np.abs(ours - theirs).max()), float(np.abs(theirs).max())


def _relative(diff: float, scale: float) -> float:
    """A difference judged against the value's own scale (at least `SMALLEST_SCALE`)."""
    return diff / max(scale, SMALLEST_SCALE)


@dataclass(frozen=True)
class _Observation:
    """One value compared: its event's index in the reference's order, which event it is (the
    logits: `name` empty), and (max |port - reference|, max |reference|) there."""

    at: int
    kind: str
    name: str
    diff: float
    scale: float

    @property
    def observed(self) -> str:
        """The value, as messages name it: `"the input of model.layers.0.self_attn"`, `"the logits"`."""
        return f"the {'input' if self.kind == 'in' else 'output'} of {self.name}" if self.name else "the logits"

    @property
    def relative(self) -> float:
        return _relative(self.diff, self.scale)


def _started(seen: list[_Observation]) -> int:
    """Where the difference the last of `seen` shows started: the first of the run of observations
    before it whose relative differences are each within `GROWTH` of the last's (its index)."""
    start, shown = len(seen) - 1, seen[-1].relative
    while start and seen[start - 1].relative * GROWTH > shown:
        start -= 1
    return start


def first_divergence(
    model: Any,
    plan: Plan,
    mapping: Mapping,
    reference: Any,
    call_model: Callable[[Any], Any],
    call_reference: Callable[[], Any],
    logits: tuple[float, float],
    factor: float,
    mask: np.ndarray | None = None,
    budget: tuple[int | None, str] = (None, ""),
) -> Divergence | None:
    """Run both models again, recording their modules, and find where they first part.

    **Arguments:**

    - `model`: port's converted model; `plan`: the plan that filled it; `mapping`: its mapping.
    - `reference`: the PyTorch model (a `torch.nn.Module`).
    - `call_model(m)`: runs port's model `m` (with the `Recorder`s in) on verify's inputs.
    - `call_reference()`: runs `reference` on the same inputs.
    - `logits`: (max |difference|, max |reference|) of the outputs compared: the last observation.
    - `factor`: the tolerance relative to each observation's own max |reference| (the logits':
      to max(1, theirs), as verify's).
    - `mask`: the attention mask (`[batch, seq]`): padding positions are not compared.
    - `budget`: the bytes the recorded values of both models may take (None: any), and what a
      refusal names first (`batch=2 and length=16`): a `PortError` once they would take more.

    Returns a `Divergence`, or None when every observation, the logits too, agrees.
    """
    pairs, keypaths = counterparts(model, plan, mapping, reference)
    limit = Budget(budget[0])
    recording = Recording(limit)
    # On one device: a callback in a program partitioned over a mesh gathers its value to one
    # device anyway, and XLA warns, for each, that it has to.
    model = jax.device_put(model, jax.devices()[0])
    for path in sorted(keypaths, key=lambda p: -len(keypaths[p])):  # the innermost first: outer paths stay valid
        where = keypaths[path]
        model = eqx.tree_at(lambda m, w=where: _at(m, w), model, Recorder(_at(model, where), path, recording))
    call_model(model)
    events, values = ([], {}) if limit.over else _run_reference(reference, set(pairs), call_reference, limit)
    if limit.over:
        raise PortError(
            f"{budget[1]}: finding the first divergence would keep each module's input and output, of both "
            f"models, in more than the {size_text(limit.limit or 0)} available"
        )

    stack = {leaf.path: leaf.stack[0] if LAYER in leaf.pattern else 1 for leaf in plan.leaves}

    def calls(path: str) -> int:
        return next(n for leaf, n in stack.items() if leaf.startswith(path + "."))

    usable = {
        name
        for name, (path, _) in pairs.items()
        if all(len(recording.values.get((path, kind), [])) == calls(path) for kind in ("in", "out"))
    }
    usable -= _misplaced(pairs, usable, events, recording)
    seen: list[_Observation] = []
    for i, (kind, name) in enumerate(events):
        if name not in usable or (name, kind) not in values:
            continue
        path, row = pairs[name]
        difference = _difference(recording.values[(path, kind)][row or 0], values[(name, kind)], mask)
        if difference is not None:
            seen.append(_Observation(i, kind, name, *difference))
            if seen[-1].relative > factor:
                break
    if not seen or seen[-1].relative <= factor:  # every observation agrees: the logits differ, or nothing does
        if logits[0] <= factor * max(1.0, logits[1]):
            return None
        seen.append(_Observation(len(events), "out", "", *logits))
    start = _started(seen)
    agreed_at, agreed = (seen[start - 1].at, seen[start - 1].diff) if start else (-1, None)
    modules = _reference_modules(reference, leaf_rows(plan, mapping), mapping)
    suspects = _suspects(modules, events, agreed_at, seen[start])
    named = tuple(_suspect(modules[m], layer_groups(model), reference) for m in suspects)
    compared = sum(1 for o in seen[: start + 1] if o.name)  # the logits aside
    return Divergence(named, seen[start].diff, seen[start].scale, agreed, seen[start].observed, compared)


def _suspects(modules: dict, events: list[tuple[str, str]], agreed_at: int, found: _Observation) -> list[str]:
    """The reference's modules with parameters that ran wholly between the event `agreed_at` and
    `found`'s (the outermost of them); when none did, the module whose input or output `found` is."""
    order = {event: i for i, event in enumerate(events)}
    kind, name, at = found.kind, found.name, found.at
    ran = [m for m in modules if m and modules[m].params and agreed_at < order.get(("in", m), -1)]
    ran = [m for m in ran if order.get(("out", m), len(events)) < at]
    suspects = [m for m in ran if not any(m.startswith(o + ".") for o in ran)]
    if kind == "out" and name and all(m.startswith(name + ".") for m in suspects):
        suspects = [name]  # what ran since the last agreement is inside the module whose output differs
    if not suspects:
        if kind == "out":
            suspects = [name]
        else:  # nothing ran since the last agreement: the code of the module around it
            around = [m for m in modules if order.get(("in", m), -1) < at < order.get(("out", m), -1)]
            suspects = [max(around, key=len) if around else ""]
    return suspects


def _run_reference(
    reference: Any, kept: set[str], call_reference: Callable[[], Any], budget: Budget
) -> tuple[list[tuple[str, str]], dict[tuple[str, str], np.ndarray]]:
    """Run the reference with hooks on every submodule: its events, ("in" or "out", module name) of
    each module's first call in the order they fire, and the values of those of `kept`'s modules,
    by (name, "in" or "out"): the first floating tensor given (`hidden_states` when given by name)
    and returned, in float32, those `budget` allows."""
    import torch

    events: list[tuple[str, str]] = []
    fired: set[tuple[str, str]] = set()
    values: dict[tuple[str, str], np.ndarray] = {}

    def seen(kind: str, name: str, given: Any) -> None:
        if (kind, name) in fired:
            return
        fired.add((kind, name))
        events.append((kind, name))
        tensor = _first_tensor(given, torch)
        if name in kept and tensor is not None and budget.take(4 * tensor.numel()):
            values[(name, kind)] = tensor.detach().float().cpu().numpy().copy()

    handles = []
    try:
        for name, module in reference.named_modules():
            if name:
                handles.append(
                    module.register_forward_pre_hook(
                        lambda _, args, kwargs, n=name: seen(
                            "in", n, [*args, kwargs.get("hidden_states"), *kwargs.values()]
                        ),
                        with_kwargs=True,
                    )
                )
                handles.append(module.register_forward_hook(lambda _, args, out, n=name: seen("out", n, out)))
        call_reference()
    finally:
        for handle in handles:
            handle.remove()
    return events, values


def _suspect(module: _Module, groups: dict[str, tuple[int, ...]], reference: Any) -> Suspect:
    if module.targets is None:
        return Suspect(module.name or type(reference).__name__, None, None)
    path = _common({leaf for leaf, _ in module.targets})
    rows = {row for _, row in module.targets}
    row = rows.pop() if len(rows) == 1 else None
    if row is not None:
        group = next((ids for prefix, ids in groups.items() if path == prefix or path.startswith(prefix + ".")), None)
        row = group[row] if group is not None and row < len(group) else row
    return Suspect(module.name or type(reference).__name__, path or None, row)


def _misplaced(
    pairs: dict[str, tuple[str, int | None]], usable: set[str], events: list[tuple[str, str]], recording: Recording
) -> set[str]:
    """The reference modules whose counterparts port's model runs at another place among the
    others (by their inputs' order) than the reference runs them: the mapping pairs them wrongly."""
    ours = [(name, (pairs[name][0], pairs[name][1] or 0)) for kind, name in events if kind == "in" and name in usable]
    position = {call: i for i, call in enumerate(recording.order)}
    ours = [(name, position[call]) for name, call in ours if call in position]
    ranked = sorted(ours, key=lambda item: item[1])
    return {name for (name, _), (other, _) in zip(ours, ranked) if name != other}
