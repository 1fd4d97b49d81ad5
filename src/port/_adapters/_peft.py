"""`open_adapter`: a PEFT LoRA adapter (`adapter_config.json` + `adapter_model.safetensors`), read and checked.

An adapter is untrusted input, like a checkpoint. Opening one reads only its
`adapter_config.json` (bounded, `MAX_CONFIG`) and its safetensors header (bounded,
`MAX_HEADER`), then checks the whole of it against the base checkpoint's headers before
any tensor byte of either is read: the PEFT type (LoRA only), `r`, `lora_alpha`,
`rank_pattern`, `alpha_pattern`, the features port does not merge (`lora_bias`,
`layer_replication`, ...), every key (a tensor PEFT writes for a LoRA, nothing else),
every shape (against the rank and the base weight), and `base_model_name_or_path`
against the base's name. Each failure is one line naming the adapter's file and the
field or key.

The adapter's tensors are a `Checkpoint` (a `LocalCheckpoint` or a `RemoteCheckpoint`,
its config the adapter config), read region by region as any checkpoint.

```python
with port.open_checkpoint("tiny-llama") as base:
    adapter = open_adapter("tiny-llama-lora", base)
    t = adapter.targets["model.layers.0.self_attn.q_proj.weight"]
    t.a, t.rank, t.scale          # 'base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight', 8, 2.0
```
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .._dtypes import floating
from .._errors import CheckpointError, ConfigError
from .._files import read_small
from .._sources import Checkpoint, LocalCheckpoint, TensorInfo, is_url
from .._sources._directory import REPO_ID, read_safetensors, resolve, snapshot
from .._sources._safetensors import MAX_CONFIG, MAX_HEADER, load_json
from .._sources._urls import redact
from .._text import quoted

CONFIG = "adapter_config.json"
"""The adapter's configuration, as PEFT writes it."""
WEIGHTS = "adapter_model.safetensors"
"""The adapter's tensors, as PEFT writes them."""
PREFIX = "base_model.model."
"""What PEFT puts before every module name in the adapter's keys."""
MAX_PATTERNS = 10_000
"""Entries `rank_pattern`, `alpha_pattern` and `modules_to_save` may have, at most (PEFT's hold a few)."""

_UNMERGED = (
    "lora_bias",
    "layer_replication",
    "target_parameters",
    "trainable_token_indices",
    "use_qalora",
    "alora_invocation_tokens",
    "arrow_config",
    "use_bdlora",
    "kasa_config",
    "monteclora_config",
    "velora_config",
)
"""Config fields for features whose weights are not `W + scale * B @ A`: refused when set."""

_SUFFIXES = {
    ".lora_A.weight": "a",
    ".lora_B.weight": "b",
    ".lora_embedding_A": "a",
    ".lora_embedding_B": "b",
    ".lora_magnitude_vector": "magnitude",
    ".base_layer.weight": "base",
}
"""The tensors PEFT writes for one LoRA module, by the suffix of their key."""


@dataclass(frozen=True)
class Target:
    """One adapted module of the base: its weight's key, its factors' keys, rank and scale.

    `kind` is "linear" (the base weight `[out, in]`), "conv1d" (`fan_in_fan_out`: `[in, out]`)
    or "embedding" (`[vocab, dim]`, factors `lora_embedding_A` `[r, vocab]`, `_B` `[dim, r]`).
    """

    module: str
    weight: str
    a: str
    b: str
    magnitude: str | None
    rank: int
    scale: float
    kind: str


@dataclass(frozen=True)
class Adapter:
    """A PEFT LoRA adapter opened against a base: its config, its tensors, what it adapts and replaces."""

    source: str
    config: dict
    checkpoint: Checkpoint
    targets: dict[str, Target]
    saved: dict[str, str]


def open_adapter(source: str | os.PathLike, base: Checkpoint, *, base_name: str | None = None) -> Adapter:
    """Open the PEFT LoRA adapter `source` for `base`, reading only its config and header.

    **Arguments:**

    - `source`: a directory with `adapter_config.json` and `adapter_model.safetensors`, a
      Hugging Face repo id, or a URL of such a directory (`hf://`, `https://`, `s3://`, ...).
    - `base`: the opened base checkpoint the adapter applies to.
    - `base_name`: what the base was named (a Hub id or a directory), to compare with the
      adapter's `base_model_name_or_path`; None skips that check.

    Returns an `Adapter`; a `CheckpointError` or `ConfigError` naming the adapter's file and
    the key or field when it is not a LoRA adapter port can apply to `base`.

    ```python
    adapter = open_adapter("tiny-llama-lora", base, base_name="tiny-llama")
    ```
    """
    shown = redact(str(source)) if is_url(source) else str(source)
    config, checkpoint = _open_files(source)
    try:
        where = f"{shown}/{CONFIG}"
        _check_config(config, where)
        if base_name is not None:
            _check_base_name(config, base_name, where)
        targets, saved = _targets(config, checkpoint.tensors, base.tensors, shown, where)
        return Adapter(shown, config, checkpoint, targets, saved)
    except BaseException:
        checkpoint.close()
        raise


def _open_files(source: str | os.PathLike) -> tuple[dict, Checkpoint]:
    """The adapter config and the adapter's tensors (headers only), from a directory, repo id or URL."""
    if is_url(source) and not str(source).lower().startswith("file://"):
        return _open_remote(str(source))
    directory = _directory(source)
    config_path, weights = directory / CONFIG, directory / WEIGHTS
    for path in (config_path, weights):
        if not os.path.lexists(path):
            raise CheckpointError(f"{source}: no {path.name} (not a PEFT adapter directory)")
    config = load_json(read_small(config_path, MAX_CONFIG, "an adapter_config.json"), str(config_path))
    if not isinstance(config, dict):
        raise CheckpointError(f"{config_path}: expected a JSON object")
    tensors, _ = read_safetensors(weights, MAX_HEADER)
    return config, LocalCheckpoint(directory, config, tensors)


def _open_remote(url: str) -> tuple[dict, Checkpoint]:
    """The adapter config and tensors (headers only) of the adapter directory at `url`, read by byte range."""
    from .._sources._remote import RemoteCheckpoint, remote_headers, small_file, transport_for

    transport = transport_for(url)
    checkpoint = RemoteCheckpoint(transport.display, {}, {}, transport=transport)
    try:
        raw = small_file(transport, CONFIG, MAX_CONFIG, CONFIG)
        if raw is None:
            raise CheckpointError(f"{transport.display}: no {CONFIG} (not a PEFT adapter directory)")
        config = load_json(raw, transport.url(CONFIG))
        if not isinstance(config, dict):
            raise CheckpointError(f"{transport.url(CONFIG)}: expected a JSON object")
        checkpoint.config, checkpoint.tensors = config, remote_headers(checkpoint, [WEIGHTS], {})
        transport.setup(max((info.nbytes for info in checkpoint.tensors.values()), default=0))
        return config, checkpoint
    except BaseException:
        checkpoint.close()
        raise


def _directory(source: str | os.PathLike) -> Path:
    """A local adapter directory (or a `file://` URL), or a Hub repo id's snapshot of its two files."""
    if is_url(source) or Path(str(source)).exists() or not REPO_ID.match(str(source)):
        return resolve(source)
    return snapshot(str(source), [CONFIG, WEIGHTS])


def _positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 < value <= 2**31


def _positive_number(value: Any) -> bool:
    return (
        isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and 0 < value <= 1e12
    )


def _check_config(config: Mapping[str, Any], where: str) -> None:
    """The adapter config describes a LoRA port can merge: type, rank, alpha, patterns, no other features."""
    kind = config.get("peft_type")
    if kind != "LORA":
        raise ConfigError(f"{where}: peft_type is {quoted(kind)}; port reads LoRA adapters (peft_type 'LORA') only")
    if not _positive_int(config.get("r")):
        raise ConfigError(f"{where}: field 'r' is {quoted(config.get('r'))}, expected a positive integer")
    if not _positive_number(config.get("lora_alpha")):
        raise ConfigError(
            f"{where}: field 'lora_alpha' is {quoted(config.get('lora_alpha'))}, expected a positive number"
        )
    for name in ("use_rslora", "use_dora", "fan_in_fan_out"):
        if not isinstance(config.get(name, False), bool):
            raise ConfigError(f"{where}: field {quoted(name)} is {quoted(config.get(name))}, expected true or false")
    for name, valid, expected in (
        ("rank_pattern", _positive_int, "a positive integer"),
        ("alpha_pattern", _positive_number, "a positive number"),
    ):
        pattern = config.get(name) or {}
        if not isinstance(pattern, dict) or len(pattern) > MAX_PATTERNS:
            raise ConfigError(f"{where}: field {quoted(name)} must be an object of at most {MAX_PATTERNS} entries")
        for key, value in pattern.items():
            if not valid(value):
                raise ConfigError(f"{where}: {name}[{quoted(key, 200)}] is {quoted(value)}, expected {expected}")
            try:
                re.compile(rf"(.*\.)?({key})$")
            except re.error:
                raise ConfigError(f"{where}: {name} key {quoted(key, 200)} is not a valid pattern") from None
    if config.get("bias", "none") != "none":
        raise ConfigError(f"{where}: field 'bias' is {quoted(config.get('bias'))}; port merges only bias 'none'")
    for name in _UNMERGED:
        if config.get(name):
            raise ConfigError(f"{where}: field {quoted(name)} is set; port does not merge that LoRA variant")
    saved = config.get("modules_to_save") or []
    if not isinstance(saved, list) or len(saved) > MAX_PATTERNS or not all(isinstance(m, str) for m in saved):
        raise ConfigError(f"{where}: field 'modules_to_save' must be a list of at most {MAX_PATTERNS} module names")


def _check_base_name(config: Mapping[str, Any], base_name: str, where: str) -> None:
    """`base_model_name_or_path` names the base loaded (compared by their last path part), when both are known."""
    named = config.get("base_model_name_or_path")
    if not isinstance(named, str) or not named.strip() or not base_name.strip():
        return
    if _last_part(named).lower() != _last_part(base_name).lower():
        raise ConfigError(
            f"{where}: base_model_name_or_path is {quoted(named, 200)}, but the base loaded is {quoted(base_name, 200)} "
            "(if they are the same model, name it so in the adapter's config)"
        )


def _last_part(name: str) -> str:
    """The last part of a Hub id, a URL or a path: `meta-llama/Llama-3-8B` and `/models/Llama-3-8B/` give `Llama-3-8B`."""
    return name.rstrip("/").rsplit("/", 1)[-1].split("@", 1)[0]


Patterns = list[tuple[re.Pattern[str], Any]]
"""A `rank_pattern` or `alpha_pattern`, compiled: each key as PEFT matches it, and its value."""


def _compiled(config: Mapping[str, Any], name: str) -> Patterns:
    """The config's `name` pattern (checked by `_check_config`), each key compiled once."""
    return [(re.compile(rf"(.*\.)?({key})$"), value) for key, value in (config.get(name) or {}).items()]


def _pattern_value(patterns: Patterns, module: str, default: Any) -> Any:
    """PEFT's `get_pattern_key`: the value of the first key matching the end of `module` on a dot, else `default`."""
    for pattern, value in patterns:
        if pattern.match(module):
            return value
    return default


def _targets(
    config: Mapping[str, Any],
    tensors: Mapping[str, TensorInfo],
    base: Mapping[str, TensorInfo],
    shown: str,
    where: str,
) -> tuple[dict[str, Target], dict[str, str]]:
    """Every adapted module and every replaced module, checked against the adapter's and the base's headers."""
    file = f"{shown}/{WEIGHTS}"
    modules: dict[str, dict[str, str]] = {}
    saved: dict[str, str] = {}
    saved_modules = frozenset(config.get("modules_to_save") or ())
    for key in tensors:
        if not key.startswith(PREFIX):
            raise CheckpointError(f"{file}: tensor {quoted(key, 200)} does not start with {PREFIX!r} as PEFT's keys do")
        name = key[len(PREFIX) :]
        suffix = next((s for s in _SUFFIXES if name.endswith(s)), None)
        if suffix is not None:
            part = _SUFFIXES[suffix]
            module = name[: -len(suffix)]
            if suffix.startswith(".lora_embedding"):
                part = "embedding_" + part
            modules.setdefault(module, {})[part] = key
        elif name.endswith(".weight") and _saved_module(name, saved_modules):
            saved[_base_key(name[: -len(".weight")], base, file, key)] = key
        else:
            raise CheckpointError(f"{file}: tensor {quoted(key, 200)} is not a LoRA tensor PEFT writes")
    targets = {}
    patterns = _compiled(config, "rank_pattern"), _compiled(config, "alpha_pattern")
    for module, parts in modules.items():
        target = _target(module, parts, config, patterns, tensors, base, file)
        targets[target.weight] = target
    for weight, key in saved.items():
        if tensors[key].shape != base[weight].shape:
            raise CheckpointError(
                f"{file}: tensor {quoted(key, 200)} has shape {list(tensors[key].shape)}, but the base's "
                f"{quoted(weight, 200)} is {list(base[weight].shape)}"
            )
        if weight in targets:
            raise CheckpointError(f"{file}: module of {quoted(key, 200)} is both adapted and replaced")
    return targets, saved


def _saved_module(name: str, saved: Collection[str]) -> bool:
    """Whether `name` (a key less PEFT's prefix) is the weight of a module `saved` names (its name, or
    the end of it on a dot): `modules_to_save`'s replacement."""
    parts = name[: -len(".weight")].split(".")
    return any(".".join(parts[i:]) in saved for i in range(len(parts)))


def _base_key(module: str, base: Mapping[str, TensorInfo], file: str, key: str) -> str:
    """The base checkpoint's key of `module`'s weight: `<module>.weight`, or without the model
    class's first part (`transformer.h.0.attn.c_attn` in GPT2LMHeadModel, `h.0.attn.c_attn.weight` on disk)."""
    for candidate in (f"{module}.weight", f"{module.partition('.')[2]}.weight"):
        if candidate in base:
            return candidate
    raise CheckpointError(
        f"{file}: tensor {quoted(key, 200)} adapts module {quoted(module, 200)}, but the base checkpoint has no "
        f"{quoted(module + '.weight', 200)}"
    )


def _target(
    module: str,
    parts: Mapping[str, str],
    config: Mapping[str, Any],
    patterns: tuple[Patterns, Patterns],
    tensors: Mapping[str, TensorInfo],
    base: Mapping[str, TensorInfo],
    file: str,
) -> Target:
    """One adapted module, its tensors' shapes checked against its rank and its base weight (an
    embedding's `base_layer.weight`, which PEFT saves beside its factors, against the base's)."""
    embedding = "embedding_a" in parts or "embedding_b" in parts
    a, b = (parts.get("embedding_a"), parts.get("embedding_b")) if embedding else (parts.get("a"), parts.get("b"))
    extra = [
        p for p in parts if p not in ({"embedding_a", "embedding_b", "base"} if embedding else {"a", "b", "magnitude"})
    ]
    if a is None or b is None:
        have = next(iter(parts.values()))
        raise CheckpointError(
            f"{file}: tensor {quoted(have, 200)} has no {'lora_A' if a is None else 'lora_B'} beside it"
        )
    if extra:
        raise CheckpointError(
            f"{file}: tensor {quoted(parts[extra[0]], 200)} does not go with module {quoted(module, 200)}'s other tensors"
        )
    weight = _base_key(module, base, file, a)
    rank = _pattern_value(patterns[0], module, config["r"])
    alpha = _pattern_value(patterns[1], module, config["lora_alpha"])
    scale = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    shape = base[weight].shape
    kind = "embedding" if embedding else "conv1d" if config.get("fan_in_fan_out") else "linear"
    if len(shape) != 2:
        raise CheckpointError(
            f"{file}: module {quoted(module, 200)}'s base weight has shape {list(shape)}, not a matrix"
        )
    out, inputs = (shape[1], shape[0]) if kind in ("conv1d", "embedding") else shape
    expected = {a: (rank, inputs), b: (out, rank)}
    magnitude = parts.get("magnitude")
    if config.get("use_dora"):
        if embedding:
            raise ConfigError(f"{file}: module {quoted(module, 200)}: port does not merge DoRA on an embedding")
        if magnitude is None:
            raise CheckpointError(
                f"{file}: module {quoted(module, 200)} has no lora_magnitude_vector (use_dora is true)"
            )
        expected[magnitude] = (out,)
    elif magnitude is not None:
        raise CheckpointError(f"{file}: tensor {quoted(magnitude, 200)} is a DoRA magnitude, but use_dora is false")
    if "base" in parts:
        expected[parts["base"]] = shape
    for key, want in expected.items():
        info = tensors[key]
        if info.shape != want or not floating(info.dtype):
            raise CheckpointError(
                f"{file}: tensor {quoted(key, 200)} has shape {list(info.shape)} ({info.dtype.name}), expected "
                f"{list(want)} (rank {rank}, base weight {quoted(weight, 200)} {list(shape)})"
            )
    return Target(module, weight, a, b, magnitude, rank, float(scale), kind)
