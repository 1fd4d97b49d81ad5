"""`port.export_adapter`: a model's `port.nn.LoRA` adapters written as a PEFT adapter directory.

What `PeftModel.from_pretrained` (and vLLM's adapter loader) reads: `adapter_config.json`
(PEFT's fields, as its `save_pretrained` writes them: indented, keys sorted) and
`adapter_model.safetensors` (metadata `{"format": "pt"}`), each adapted module's
`base_model.model.<module>.lora_A.weight` `[rank, in]`, `lora_B.weight` `[out, rank]` and,
for DoRA, `lora_magnitude_vector` `[out]`, in the factors' dtype. The module names come
from the mapping: the checkpoint key of the leaf's entry, per layer (and expert), less
`.weight`. The factors are the leaf's reshaped back (`_layout`), so an adapter loaded
kept and exported again is the same file, byte for byte (port's safetensors writer lays
a file out as the safetensors library does).

```python
port.export_adapter(model, "my-lora", "tiny-llama")                  # after training
port.export_adapter(model, "again", "tiny-llama", adapter_config=kept.adapter_config)
```

The directory is written under a hidden temporary name and renamed into place when
complete, as `port export`'s is; `force` replaces only such an adapter directory.
"""

from __future__ import annotations

import collections
import contextlib
import json
import math
import os
from collections.abc import Mapping as AnyMapping
from pathlib import Path
from typing import Any

import jax
import numpy as np

from .._destination import check_destination, check_free, make_partial, partial_path, put_in_place, writing
from .._errors import PlanError, PortError
from .._mapping import Mapping, Param, mapping_for
from .._output import Output
from .._sources import Checkpoint, raw_header
from .._targets import path_str
from ._kept import ADAPTER, recorded
from ._lora import modules

CONFIG = "adapter_config.json"
WEIGHTS = "adapter_model.safetensors"
PREFIX = "base_model.model."
_WHAT = "a PEFT adapter directory (adapter_config.json and adapter_model.safetensors only)"
_MAX_CONFIG_BYTES = 16 * 2**20


def is_adapter_export(directory: str | os.PathLike) -> bool:
    """Whether `directory` is what `export_adapter` writes (what `force` may replace): exactly
    `adapter_config.json` (a JSON object) and `adapter_model.safetensors` (a safetensors file),
    both regular files."""
    directory = Path(directory)
    if directory.is_symlink() or not directory.is_dir():
        return False
    try:
        entries = {p.name: p for p in directory.iterdir()}
        if set(entries) != {CONFIG, WEIGHTS} or any(p.is_symlink() or not p.is_file() for p in entries.values()):
            return False
        if entries[CONFIG].stat().st_size > _MAX_CONFIG_BYTES:
            return False
        config = json.loads(entries[CONFIG].read_text("utf-8"))
        raw_header(entries[WEIGHTS])
    except (OSError, ValueError, PortError):
        return False
    return isinstance(config, dict)


def export_adapter(
    model: Any,
    out: str | os.PathLike,
    source: str | os.PathLike | Checkpoint | Output,
    *,
    config: AnyMapping[str, Any] | None = None,
    mapping: str | os.PathLike | Mapping | None = None,
    adapter_config: AnyMapping[str, Any] | None = None,
    force: bool = False,
) -> Path:
    """Write the `port.nn.LoRA` adapters of `model` as a PEFT adapter directory at `out`.

    **Arguments:**

    - `model`: a model with adapters (`port.lora`, or loaded with `adapter_mode="keep"`).
    - `out`: the directory to write.
    - `source`: where the base's tensor names come from, as `port.export` takes it: the
      checkpoint (directory, repo id or `Checkpoint`) or a `port convert` output.
    - `config`: the base's config (default: the source's).
    - `mapping`: the mapping (default: the output's, or the shipped one for the config).
    - `adapter_config`: the `adapter_config.json` to write (the one an adapter was loaded
      with: `Kept.adapter_config`); default: one built as PEFT's (`peft_type` LORA, `r`,
      `lora_alpha`, `target_modules`, `rank_pattern`, `alpha_pattern`, `use_rslora` False,
      `use_dora`, `base_model_name_or_path`, `task_type` CAUSAL_LM, ...).
    - `force`: replace an earlier `export_adapter` output at `out`, and nothing else.

    **Returns:** the absolute output path. A one-line `PortError` for a model without
    adapters, an adapter whose leaf the mapping does not fill, or `out`.

    ```python
    port.export_adapter(model, "my-lora", "tiny-llama")
    peft.PeftModel.from_pretrained(base, "my-lora")
    ```
    """
    from .._export._export import read_source
    from .._export._safetensors import SINGLE, OutTensor, Writer
    from ..nn._lora import is_lora

    found = read_source(source, None)
    source = source.directory if isinstance(source, Output) else source
    config = {k: v for k, v in (found.config if config is None else config).items() if k != ADAPTER}
    kept = found.output if mapping is None else None
    mapping = mapping_for(config, mapping if kept is None else kept.mapping, keys=found.headers)
    flat = jax.tree_util.tree_flatten_with_path(model, is_leaf=is_lora)[0]
    nodes = {path_str(keypath): node for keypath, node in flat if is_lora(node)}
    if not nodes:
        raise PortError("`model` holds no adapter (port.nn.LoRA) to export")
    if any(not getattr(x, "is_fully_addressable", True) for n in nodes.values() for x in (n.a, n.b, n.magnitude)):
        raise PortError("export_adapter: the adapters are spread over several processes; export them from one process")
    tensors: dict[str, tuple[Any, tuple[int, ...], str, tuple[int, ...]]] = {}  # key -> node, index, factor, shape
    settings: dict[str, tuple[int, float, bool]] = {}
    conv1d = False  # some weight is `[in, out]` (GPT-2's Conv1D): PEFT's fan_in_fan_out
    for path, node in nodes.items():
        param = _base_entry(mapping, path)
        for index, module in sorted(modules(mapping, list(found.headers), param).items()):
            for name, shape in _factor_shapes(node).items():
                tensors[f"{PREFIX}{module}.{name}"] = (node, index, name, shape)
            settings[module] = (node.rank, node.scale, node.magnitude is not None)
            conv1d |= _conv1d(found.headers.get(f"{module}.weight"), node)
    if adapter_config is None:  # the one a kept adapter was loaded with, as an output (or kept checkpoint) records it
        record = recorded(found.config, str(source))
        adapter_config = None if record is None else record["adapter_config"]
    written = dict(adapter_config) if adapter_config is not None else _peft_config(settings, config, source, conv1d)
    inputs = (source,) if isinstance(source, (str, os.PathLike)) and Path(source).exists() else ()
    out = check_destination(out, force, inputs, ours=is_adapter_export, what=_WHAT)
    layout = [
        OutTensor(key, shape, np.dtype(_FIELDS[name](node).dtype)) for key, (node, _, name, shape) in tensors.items()
    ]
    check_free(out, sum(t.nbytes for t in layout))
    partial = partial_path(out)
    with contextlib.ExitStack() as cleanup, writing(out, partial, "the adapter export"):
        make_partial(partial, cleanup)
        (partial / CONFIG).write_text(json.dumps(written, indent=2, sort_keys=True))
        with Writer(partial, layout, 2**62, metadata={"format": "pt"}) as writer:
            for key, (node, index, name, shape) in tensors.items():  # one tensor on the host at a time
                writer.write(key, _factor(node, index, name, shape))
        os.rename(partial / SINGLE, partial / WEIGHTS)
        put_in_place(partial, out, force, ours=is_adapter_export, what=_WHAT)
    return out


def _base_entry(mapping: Mapping, path: str) -> Param:
    """The entry filling the adapted leaf at `path`: its own (a base mapping) or `path.base`'s (a kept one)."""
    param = mapping.entry(path) or mapping.entry(f"{path}.base")
    if param is None or not param.stacked:
        raise PlanError([f"adapter at '{path}': the mapping {mapping.source} has no stacked entry for its leaf"])
    return param


_FIELDS = {
    "lora_A.weight": lambda n: n.a,
    "lora_B.weight": lambda n: n.b,
    "lora_magnitude_vector": lambda n: n.magnitude,
}
"""PEFT's name of each factor (after the module's), and the `LoRA` field holding it."""


def _factor_shapes(node: Any) -> dict[str, tuple[int, ...]]:
    """Each factor of one layer (and expert) of `node` by PEFT's name, in PEFT's layout: `lora_A`
    `[rank, in]`, `lora_B` `[out, rank]`, DoRA's `lora_magnitude_vector` `[out]`."""
    s, rank = node.stack, node.rank
    fan_in, fan_out = math.prod(node.a.shape[s + 1 :]), math.prod(node.b.shape[s:-1])
    shapes = {"lora_A.weight": (rank, fan_in), "lora_B.weight": (fan_out, rank)}
    return shapes | ({"lora_magnitude_vector": (fan_out,)} if node.magnitude is not None else {})


def _factor(node: Any, index: tuple[int, ...], name: str, shape: tuple[int, ...]) -> np.ndarray:
    """Factor `name` of `node` at stack `index`, gathered to the host in PEFT's layout."""
    array = _FIELDS[name](node)
    at = tuple(index[: node.stack])
    return np.ascontiguousarray(np.asarray(array[at] if at else array).reshape(shape))


def _conv1d(header: tuple[tuple[int, ...], Any] | None, node: Any) -> bool:
    """Whether the base weight `header` describes is `[in, out]` (GPT-2's Conv1D), not torch
    `Linear`'s `[out, in]`, by the factors' sizes (a square weight says neither)."""
    shapes = _factor_shapes(node)
    (_, fan_in), (fan_out, _) = shapes["lora_A.weight"], shapes["lora_B.weight"]
    return header is not None and fan_in != fan_out and tuple(header[0]) == (fan_in, fan_out)


def _peft_config(
    settings: AnyMapping[str, tuple[int, float, bool]], config: AnyMapping[str, Any], source: Any, conv1d: bool
) -> dict:
    """An `adapter_config.json` as PEFT writes one for these modules (module -> rank, scale, DoRA;
    `conv1d`: some weight is `[in, out]`, PEFT's `fan_in_fan_out`):
    the commonest rank and alpha as `r` and `lora_alpha`, the others per module by pattern."""
    ranks = collections.Counter(rank for rank, _, _ in settings.values())
    r = ranks.most_common(1)[0][0]
    alphas = collections.Counter(scale * rank for rank, scale, _ in settings.values())
    alpha = _number(alphas.most_common(1)[0][0])
    rank_pattern, alpha_pattern = {}, {}
    for module, (rank, scale, _) in settings.items():
        pattern = ".".join(module.split(".")[-2:]).replace(".", r"\.")  # "self_attn.q_proj": every layer's
        if rank != r:
            rank_pattern[pattern] = rank
        if not math.isclose(scale * rank, alpha):
            alpha_pattern[pattern] = _number(scale * rank)
    return {
        "alpha_pattern": alpha_pattern,
        "base_model_name_or_path": str(config.get("_name_or_path") or source),
        "bias": "none",
        "fan_in_fan_out": conv1d,
        "inference_mode": True,
        "init_lora_weights": True,
        "layers_to_transform": None,
        "lora_alpha": alpha,
        "lora_dropout": 0.0,
        "modules_to_save": None,
        "peft_type": "LORA",
        "r": r,
        "rank_pattern": rank_pattern,
        "target_modules": sorted({module.rsplit(".", 1)[-1] for module in settings}),
        "task_type": "CAUSAL_LM",
        "use_dora": any(dora for _, _, dora in settings.values()),
        "use_rslora": False,
    }


def _number(x: float) -> int | float:
    """`x` as an int where it is one (PEFT's configs write `lora_alpha` 16, not 16.0)."""
    return int(round(x)) if math.isclose(x, round(x)) else x
