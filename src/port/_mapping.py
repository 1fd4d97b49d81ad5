"""Mapping: a TOML file relating state-dict keys to Equinox module paths.

```toml
model = "port.models.gpt2:GPT2"          # module:Class with from_config(config, *, key)
model_types = ["gpt2"]                    # config.json model_type values it serves
prefixes = ["transformer."]               # optional key prefixes, stripped when present
ignore = ["h.*.attn.bias"]                # buffers, never read
tied = { "lm_head.weight" = "wte.weight" }  # may be present; a copy, never read
aliases = { "LayerNorm.gamma" = "LayerNorm.weight" }  # legacy key endings
reference = { class = "transformers:GPT2LMHeadModel", output = "logits" }  # for port verify
config = "vision_config"                  # a tower of a dual model: its own config is this key's
architectures = { clip = ["CLIPVisionModel"] }  # by the source's model_type: the class the model is
                                          # (chosen by config.json's architectures among the shipped
                                          # mappings of one model_type; what `port export` writes)

[export.gemma3]                           # a multimodal model type whose language model the mapping
config = "text_config"                    # loads: `port export` writes it as a text-only checkpoint,
model_type = "gemma3_text"                # config.json the text config with this model_type and
architectures = ["Gemma3ForCausalLM"]     # architectures, each key's first matching prefix replaced
prefixes = { "language_model.model." = "model.", "language_model." = "", "model.language_model." = "model." }

[rules]                                   # logical axis -> mesh axis (or list of them)
embed = "data"
heads = "model"

[[params]]
key = "h.{layer}.attn.c_attn.weight"      # {layer} stacks every layer on a leading axis
                                          # ({expert} every expert, after the layers' axis)
path = "blocks.attn.wq"
transforms = [{ split = { axis = 1, parts = 3, index = 0 } },
              { transpose = [1, 0] },
              { reshape = ["n_head", -1, "n_embd"] }]   # names are config.json values
axes = ["layers", "heads", "head_dim", "embed"]

[[params]]
key = "h.{layer}.ln_1.weight"             # {layer} in the path too: one leaf per layer, for a module
path = "layers.{layer}.norm.scale"        # that keeps its layers in a list (nnx.List, a tuple)
                                          # ("/" separates names as "." does: "blocks_{layer}/ln/scale")
axes = "module"                           # the sharding names the module annotates the leaf with
                                          # (an NNX variable's nnx.with_partitioning names)

[[params]]
key = "lm_head.weight"
path = "lm_head"
optional = "model"   # the module built from config.json may have None there (a tied head);
                     # "checkpoint": the checkpoint may lack the key (the leaf is then None);
                     # true: either
axes = ["vocab", "embed"]
```

```python
mapping = load_mapping("mappings/gpt2.toml")
mapping = mapping_for({"model_type": "gpt2"})   # the shipped one
mapping = load_mapping("t5_encoder")            # a shipped mapping by name (mappings/t5_encoder.toml)
```
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import importlib.resources
import os
import re
import stat
import tomllib
from collections.abc import Iterable
from collections.abc import Mapping as AnyMapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ._errors import CheckpointError, ConfigError, MappingError, PortError
from ._files import file_kind
from ._model import is_buildable, is_model
from ._text import one_line, quoted
from ._transforms import Transform, parse_transform

LAYER = "{layer}"
EXPERT = "{expert}"
STACKS = (LAYER, EXPERT)
"""The placeholders that stack keys on leading axes of a leaf, outermost first: `layers.{layer}.experts.{expert}.w1`
fills a leaf [layers, experts, ...]."""
_DIGITS = re.compile(r"[0-9]+")
TEXT_CONFIG = "text_config"
"""The key of a multimodal wrapper's config.json that holds its language model's config."""
MODULE_AXES = "module"
"""An entry's `axes` when they are the module's own annotations (an NNX variable's sharding names)."""
_INDEX = r"(0|[1-9][0-9]{0,8})"
_TOP = {
    "model", "model_types", "prefixes", "ignore", "tied", "aliases", "reference", "rules", "params", "export",
    "config", "architectures",
}  # fmt: skip
CARRIED = ("dtype", "torch_dtype", "transformers_version")
"""What a config.json written for part of a model (a language model, a tower) takes from the whole
model's where its own lacks it."""
_SHIPPED_NAME = re.compile(r"[a-z0-9_]{1,64}")
"""A shipped mapping's name (its file's stem): what `mapping=` may give instead of a file."""
_EXPORT = {"config", "model_type", "architectures", "prefixes"}
_PARAM = {"key", "path", "axes", "transforms", "optional"}
MAX_MAPPING_BYTES = 16 * 2**20
"""Bytes a mapping file may have (the shipped ones take a few KB)."""
MAX_NESTING = 32
"""How deep a mapping's tables and arrays may nest (the shipped ones nest 5 deep)."""


@dataclass(frozen=True)
class Param:
    """One mapping entry: a source key pattern, a module path, transforms and logical axes.

    `transforms` are as the file wrote them (config names unresolved); `build` resolves them.
    """

    key: str
    path: str
    axes: tuple[str | None, ...] | None  # None: the module's own annotations (an NNX variable's sharding names)
    transforms: tuple[Transform, ...]
    optional: str = ""  # "", "model", "checkpoint" or "either": who may lack it

    @property
    def leaf_optional(self) -> bool:
        """Whether the module built from the config may have None at `path` (the entry is then skipped)."""
        return self.optional in ("model", "either")

    @property
    def key_optional(self) -> bool:
        """Whether the checkpoint may lack the key (the leaf is then None)."""
        return self.optional in ("checkpoint", "either")

    @property
    def stack(self) -> tuple[str, ...]:
        """The placeholders in the key, outermost first: `("{layer}",)`, `("{layer}", "{expert}")`, or `()`."""
        return tuple(name for name in STACKS if name in self.key)

    @property
    def stacked(self) -> bool:
        return bool(self.stack)

    @property
    def path_stack(self) -> tuple[str, ...]:
        """The placeholders in the path, outermost first: the leaves are one per layer (and expert)
        of them, and stack only the key's others (`()` for a path that names one leaf)."""
        return tuple(name for name in STACKS if name in self.path)

    def path_pattern(self) -> re.Pattern:
        """Matches the concrete paths of a path with placeholders (`layers.{layer}.wq` -> `layers.3.wq`);
        its groups are the list indices of `path_stack`, in order."""
        text = re.escape(self.path)
        for name in self.path_stack:
            text = text.replace(re.escape(name), f"(?P<{name[1:-1]}>{_INDEX})")
        return re.compile(text + r"\Z")

    def at(self, index: tuple[int, ...], rows: tuple[int, ...]) -> Param:
        """The entry for one leaf of a path with placeholders: the path's placeholders set to the
        list indices `rows`, the key's to the checkpoint indices `index` (a layer group's rows hold
        other layers than their position says); the key's other placeholders stay, stacked.

        ```python
        param.at((5,), (2,))    # key "h.5.attn.w", path "blocks.2.attn.w", for a group of layers 3..
        ```
        """
        key, path = self.key, self.path
        for name, i, row in zip(self.path_stack, index, rows):
            key, path = key.replace(name, str(i)), path.replace(name, str(row))
        return dataclasses.replace(self, key=key, path=path)

    def pattern(self) -> re.Pattern:
        """Matches the stripped source keys of this entry; its groups are the indices of `stack`, in order.

        An index is ASCII digits with no leading zero, at most 9 of them: `h.01.`, or
        `h.1.` written with an Arabic-Indic digit, would name the same layer as `h.1.`,
        so such a key matches no entry and the plan refuses it as unused.
        """
        return re.compile(self.regex() + r"\Z")

    def regex(self, *, named: bool = True) -> str:
        """`pattern`'s text; `named=False` leaves its stack groups unnamed, so that several entries'
        texts join into one alternation (`"|".join(p.regex(named=False) for p in params)`)."""
        text = re.escape(self.key)
        for name in self.stack:
            text = text.replace(re.escape(name), f"(?P<{name[1:-1]}>{_INDEX})" if named else _INDEX)
        return text

    def index(self, match: re.Match) -> tuple[int, ...]:
        """The stack index a `pattern` match names: (layer,), (layer, expert), (expert,) or ()."""
        return tuple(int(match.group(name[1:-1])) for name in self.stack)

    def key_at(self, index: tuple[int, ...]) -> str:
        """The key this entry's pattern names at a stack index (`h.{layer}.x` at (3,) -> `h.3.x`)."""
        key = self.key
        for name, i in zip(self.stack, index):
            key = key.replace(name, str(i))
        return key

    def build(self, config: AnyMapping[str, Any]) -> list[Transform]:
        """The transforms, with config names (reshape, split sizes) replaced by their values."""
        try:
            return [t.resolve(config) for t in self.transforms]
        except PortError as e:
            kind = ConfigError if isinstance(e, ConfigError) else MappingError
            raise kind(f"mapping entry '{self.key}': {e}") from None


@dataclass(frozen=True)
class TextExport:
    """How `port export` writes the language model of a multimodal model type (a mapping's
    `[export.<model_type>]`): as a checkpoint of the text-only class, which transformers
    loads without a vision tower to initialise at random.

    **Fields:** `config` (the key of the wrapper's config.json holding the language
    model's), `model_type` and `architectures` (what the written config.json says;
    `architectures` may instead be a table by the text config's own `model_type`, for a
    wrapper that holds several kinds of language model, as Mistral 3 holds a Mistral or a
    Ministral 3; `model_type` is then omitted: the text config's own), `prefixes` (pairs:
    a key starting with the first is written with the second instead; the first that
    matches, in order; a key none matches is written as it is).

    ```python
    entry = mapping.export["gemma3"]
    entry.key("language_model.model.norm.weight")    # "model.norm.weight"
    ```
    """

    config: str
    model_type: str | None
    architectures: tuple[str, ...] | dict[str, tuple[str, ...]]
    prefixes: tuple[tuple[str, str], ...]

    def written(self, text: AnyMapping[str, Any]) -> tuple[str, list[str]]:
        """The `model_type` and `architectures` the text-only config.json says, for the wrapper's
        text config `text`; `ConfigError` for a text model type the mapping does not name.

        ```python
        mapping.export["mistral3"].written({"model_type": "ministral3"})   # ("ministral3", ["Ministral3ForCausalLM"])
        ```
        """
        if isinstance(self.architectures, tuple):
            assert self.model_type is not None, "a fixed architecture comes with its model_type"
            return self.model_type, list(self.architectures)
        kind = text.get("model_type")
        if not isinstance(kind, str) or kind not in self.architectures:
            raise ConfigError(
                f"config.json: {self.config}'s 'model_type' {quoted(kind)} has no text-only class to export as "
                f"(the mapping names: {', '.join(self.architectures)})"
            )
        return kind, list(self.architectures[kind])

    def key(self, key: str) -> str:
        """The text-only class's name of the wrapper's checkpoint key `key`."""
        return next((new + key[len(old) :] for old, new in self.prefixes if key.startswith(old)), key)


@dataclass(frozen=True)
class Mapping:
    """A parsed mapping file."""

    source: str
    text: str
    model: str
    model_types: tuple[str, ...]
    prefixes: tuple[str, ...]
    ignore: tuple[str, ...]
    tied: dict[str, str]
    rules: dict[str, tuple[str, ...]]
    params: tuple[Param, ...]
    aliases: dict[str, str]
    reference: dict[str, str]
    export: dict[str, TextExport] = dataclasses.field(default_factory=dict)  # by the wrapper's model_type
    fitted: str = ""  # the wrapper's model_type `language_model` fitted it to the keys of, if any
    config: str = ""  # the key of a dual model's config.json holding this model's own config ("": none)
    architectures: dict[str, tuple[str, ...]] = dataclasses.field(default_factory=dict)  # by the source model_type

    def serves(self, config: AnyMapping[str, Any]) -> bool:
        """Whether this mapping's model is the class `config.json` names: its `architectures`
        for the config's model_type holds config.json's first `architectures`.

        ```python
        port.load_mapping("t5_encoder").serves({"model_type": "t5", "architectures": ["T5EncoderModel"]})  # True
        ```
        """
        named = config.get("architectures")
        first = named[0] if isinstance(named, list) and named else None
        return isinstance(first, str) and first in self.architectures.get(str(config.get("model_type")), ())

    def written_config(self, config: AnyMapping[str, Any]) -> dict[str, Any] | None:
        """The config.json `port export` writes for this mapping's model, converted from a checkpoint
        whose config.json is `config`: `model_config(config)` (a tower's own, from a dual model's),
        with the `model_type` it has and the mapping's `architectures` for the source's model_type;
        None where the mapping declares neither `config` nor `architectures` (`config` is
        written as it is).

        ```python
        port.load_mapping("clip_vision").written_config(clip_config)
        # clip_config["vision_config"] | {"model_type": "clip_vision_model", "architectures": ["CLIPVisionModel"]}
        ```
        """
        if not self.config and not self.architectures:
            return None
        own = dict(self.model_config(config))
        if own is not config:
            own = {k: config[k] for k in CARRIED if k in config} | own
        classes = self.architectures.get(str(config.get("model_type")))
        return own | ({"architectures": list(classes)} if classes else {})

    def key_name(self, key: str) -> str:
        """A checkpoint key as the entries name it: an optional prefix stripped, a legacy ending
        (`aliases`) made modern.

        ```python
        mapping.key_name("transformer.h.0.ln_1.weight")   # "h.0.ln_1.weight" (prefixes = ["transformer."])
        ```
        """
        name = next((key[len(p) :] for p in self.prefixes if key.startswith(p)), key)
        for legacy, modern in self.aliases.items():
            if name.endswith(legacy):
                return name[: -len(legacy)] + modern
        return name

    def model_config(self, config: AnyMapping[str, Any]) -> AnyMapping[str, Any]:
        """The config the model is built from: a dual model's config.json's key the mapping's
        `config` names (a tower's own config, where present), `config` itself, or, for a multimodal wrapper whose
        own `model_type` this mapping does not serve but whose `text_config`'s it does (Kimi
        K2.5's `kimi_k25` around a `deepseek_v3`), that `text_config`.

        ```python
        mapping.model_config({"model_type": "kimi_k25", "text_config": {"model_type": "deepseek_v3"}})
        # {"model_type": "deepseek_v3"}   (mappings/deepseek_v3.toml)
        ```
        """
        own = config.get(self.config) if self.config else None
        if isinstance(own, dict):
            return own  # a tower of a dual model (`config = "vision_config"`)
        text = config.get(TEXT_CONFIG)
        if config.get("model_type") in self.model_types or not isinstance(text, dict):
            return config
        return text if text.get("model_type") in self.model_types else config

    def entry(self, path: str) -> Param | None:
        """The entry that fills the leaf at `path`: the one naming it, or the one whose path with
        placeholders matches it (`layers.{layer}.wq` fills `layers.3.wq`); None if none does.

        A lookup in an index (a path with its numbers blanked), not a scan: an output's
        metadata may list a million leaves."""
        exact, templated = self._entries
        if path in exact:
            return exact[path]
        for param in templated.get(_DIGITS.sub("#", path), ()):
            if param.path_pattern().match(path):
                return param
        return None

    @functools.cached_property
    def _entries(self) -> tuple[dict[str, Param], dict[str, list[Param]]]:
        exact = {p.path: p for p in self.params if not p.path_stack}
        templated: dict[str, list[Param]] = {}
        for p in self.params:
            if p.path_stack:
                blank = _DIGITS.sub("#", p.path.replace(LAYER, "0").replace(EXPERT, "0"))
                templated.setdefault(blank, []).append(p)
        return exact, templated

    def model_object(self) -> Any:
        """Import what `model` names: a model class (`from_config(config, *, key)`), a Flax NNX module
        class, or a factory (a function taking the config.json dict and returning the module);
        a `MappingError` naming the file for anything else (as `model_class` words it).

        ```python
        mapping.model_object()     # <class 'port.models.gpt2.GPT2'>, or the function mypkg.llama:build
        ```
        """
        found = import_object(self.model, f"{self.source}: model", MappingError)
        return found if is_buildable(found) else self.model_class()

    def model_class(self) -> type:
        """Import the `module:Class` named by `model`: a class, or a `MappingError` naming the file."""
        found = import_object(self.model, f"{self.source}: model", MappingError)
        if not isinstance(found, type):
            raise MappingError(
                f"{self.source}: model {quoted(self.model, 200)} is a {type(found).__name__}, not a class "
                "(expected module:Class, such as port.models.gpt2:GPT2)"
            )
        if not is_model(found):
            raise MappingError(
                f"{self.source}: model {quoted(self.model, 200)} is not a model class: it has no "
                "from_config(config, *, key)"
            )
        return found


_NAME = r"[^\W\d]\w*"
MODEL_SPEC = re.compile(rf"{_NAME}(?:\.{_NAME})*:{_NAME}(?:\.{_NAME})*")  # module:Class, both dotted identifiers


def import_object(spec: str, what: str, error: type[PortError] = PortError) -> Any:
    """Import `package.module:Name`; `what` starts the error message, an `error`.

    The module must be importable as it is (installed, or on `sys.path`): port adds
    no directory to the path. The command line lets one module come from the working
    directory, the one its `--module` flag names; a module found there but not named
    gets a hint saying so.
    Both parts must be dotted identifiers: a relative module (`.gpt2:GPT2`) is refused,
    not imported.
    """
    if not MODEL_SPEC.fullmatch(spec):
        raise error(f"{what} {quoted(spec, 200)}: expected module:Class, such as port.models.gpt2:GPT2")
    module, _, name = spec.partition(":")
    try:
        found: Any = importlib.import_module(module)
        for part in name.split("."):
            found = getattr(found, part)
    except (ImportError, AttributeError) as e:
        top = module.split(".")[0]
        beside = next((f"{top}{s}" for s in (".py", "/") if (Path.cwd() / f"{top}{s}").exists()), None)
        missing = (getattr(e, "name", None) or top).split(".")[0]  # the module not found: this one, or one it imports
        hint = (
            ""
            if beside is None or not isinstance(e, ModuleNotFoundError) or missing != top
            else (
                f"; {beside} in the working directory is imported only when named: "
                f"`--module {spec}` on the command line, or its directory on sys.path in Python"
            )
        )
        if isinstance(e, ModuleNotFoundError) and missing == "flax":
            hint = "; it needs Flax: install port's flax extra (pip install 'port[flax]')"
        raise error(f"{what} {quoted(spec, 200)} cannot be imported ({one_line(str(e), 300)}){hint}") from None
    return found


def parse_mapping(text: str, source: str = "<mapping>") -> Mapping:
    """Parse and check the structure of a mapping; checks that need a config or checkpoint wait for `plan`.

    **Arguments:**

    - `text`: the mapping's TOML text.
    - `source`: how messages name it (a file name).

    Returns a `Mapping`; a `MappingError` names `source` and what is wrong.

    ```python
    mapping = port.parse_mapping(Path("my_model.toml").read_text(), "my_model.toml")
    ```
    """
    deep = MappingError(f"{source}: invalid TOML: tables and arrays nested more than {MAX_NESTING} deep")
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise MappingError(f"{source}: invalid TOML: {one_line(str(e), 300)}") from None
    except RecursionError:  # tomllib recurses once per level (about 300 of them)
        raise deep from None
    if _nesting(data) > MAX_NESTING:
        raise deep

    def fail(msg: str) -> MappingError:
        return MappingError(f"{source}: {msg}")

    unknown = set(data) - _TOP
    if unknown:
        raise fail(f"unknown key '{sorted(unknown)[0]}' (expected {', '.join(sorted(_TOP))})")
    model = data.get("model")
    if not isinstance(model, str) or ":" not in model:
        raise fail("'model' must be a string 'package.module:Class'")

    def strings(name: str) -> tuple[str, ...]:
        value = data.get(name, [])
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise fail(f"'{name}' must be a list of strings")
        return tuple(value)

    def table(name: str, shape: str) -> dict[str, str]:
        value = data.get(name, {})
        if not isinstance(value, dict) or not all(isinstance(v, str) for v in value.values()):
            raise fail(f"'{name}' must be a table of {shape}")
        return dict(value)

    tied = table("tied", 'key = "key it copies"')
    aliases = table("aliases", '"legacy ending" = "ending"')
    reference = table("reference", '{ class = "module:Class", output = "attribute" }')
    if reference and set(reference) != {"class", "output"}:
        raise fail("'reference' needs exactly 'class' (module:Class) and 'output' (an attribute)")
    if reference and (not reference["output"].isidentifier() or reference["output"].startswith("_")):
        raise fail(f"'reference.output' {quoted(reference['output'])}: expected a public attribute, such as 'logits'")
    rules = {}
    rule_table = data.get("rules", {})
    if not isinstance(rule_table, dict):
        raise fail("[rules] must be a table of logical axis = mesh axis (or a list of them)")
    for axis, mesh_axes in rule_table.items():
        if isinstance(mesh_axes, str):
            mesh_axes = [mesh_axes]
        if not isinstance(mesh_axes, list) or not all(isinstance(m, str) for m in mesh_axes):
            raise fail(f"rules.{axis} must be a mesh axis name or a list of them")
        rules[axis] = tuple(mesh_axes)
    params = data.get("params")
    if not isinstance(params, list) or not params:
        raise fail("no [[params]] entries")
    parsed = tuple(_param(entry, i, fail) for i, entry in enumerate(params))
    model_types = strings("model_types")
    exports = data.get("export", {})
    if not isinstance(exports, dict):
        raise fail("[export] must be a table of model_type = { config, model_type, architectures, prefixes }")
    export = {name: _text_export(name, entry, model_types, fail) for name, entry in exports.items()}
    own_config = data.get("config", "")
    if not isinstance(own_config, str) or (own_config and not own_config.isidentifier()):
        raise fail(f"'config' must be the config.json key holding the model's own config, got {quoted(own_config)}")
    architectures = _architectures(data.get("architectures", {}), model_types, fail)
    seen: dict[str, str] = {}
    for p in parsed:
        if p.path in seen:
            raise fail(f"path '{p.path}' is filled by both '{seen[p.path]}' and '{p.key}'")
        seen[p.path] = p.key
    return Mapping(
        source,
        text,
        model,
        model_types,
        strings("prefixes"),
        strings("ignore"),
        tied,
        rules,
        parsed,
        aliases,
        reference,
        export,
        config=own_config,
        architectures=architectures,
    )


def _architectures(value: Any, model_types: tuple[str, ...], fail) -> dict[str, tuple[str, ...]]:
    """The `architectures` table: each of the mapping's model_types -> a list of class names."""
    shape = 'a table of model_type = ["Class", ...]'
    if not isinstance(value, dict):
        raise fail(f"'architectures' must be {shape}")
    found = {}
    for kind, classes in value.items():
        if kind not in model_types:
            raise fail(f"architectures.{kind}: {quoted(kind)} is not one of the mapping's model_types")
        if (
            not isinstance(classes, list)
            or not classes
            or not all(isinstance(c, str) and c.isidentifier() for c in classes)
        ):
            raise fail(f"architectures.{kind} must be a non-empty list of class names ({shape})")
        found[kind] = tuple(classes)
    return found


def _text_export(name: str, entry: Any, model_types: tuple[str, ...], fail) -> TextExport:
    """The `TextExport` of `[export.<name>]`; `fail(message)` makes the `MappingError` for anything wrong."""
    where = f"export.{name}"
    if name not in model_types:
        raise fail(f"{where}: {quoted(name)} is not one of the mapping's model_types")
    by_type = isinstance(entry, dict) and isinstance(entry.get("architectures"), dict)
    wanted = _EXPORT - {"model_type"} if by_type else _EXPORT
    if not isinstance(entry, dict) or not wanted - {"prefixes"} <= set(entry) <= wanted:
        raise fail(
            f"{where} must be a table of exactly {', '.join(sorted(_EXPORT))} "
            "(without model_type when architectures is a table by the text config's model_type; "
            "prefixes may be left to port, which derives them from the checkpoint's keys)"
        )
    for field in sorted(wanted & {"config", "model_type"}):
        if not isinstance(entry[field], str) or not entry[field]:
            raise fail(f"{where}.{field} must be a non-empty string")
    prefixes = entry.get("prefixes", {})

    def classes(value: Any, at: str) -> tuple[str, ...]:
        if not isinstance(value, list) or not value or not all(isinstance(a, str) and a for a in value):
            raise fail(f"{at} must be a non-empty list of class names")
        return tuple(value)

    architectures: tuple[str, ...] | dict[str, tuple[str, ...]] = (
        {kind: classes(v, f"{where}.architectures.{kind}") for kind, v in entry["architectures"].items()}
        if by_type
        else classes(entry["architectures"], f"{where}.architectures")
    )
    if by_type and not architectures:
        raise fail(f"{where}.architectures must name at least one text model_type")
    if not isinstance(prefixes, dict) or not all(isinstance(v, str) for v in prefixes.values()):
        raise fail(f'{where}.prefixes must be a table of "wrapper prefix" = "text-only prefix"')
    return TextExport(entry["config"], entry.get("model_type"), architectures, tuple(prefixes.items()))


def _nesting(data: Any) -> int:
    """How deep the tables and arrays of parsed TOML nest (a table of scalars: 1)."""
    deepest, todo = 0, [(data, 1)]
    while todo:
        value, depth = todo.pop()
        children = value.values() if isinstance(value, dict) else value if isinstance(value, list) else None
        if children is not None:
            deepest = max(deepest, depth)
            todo.extend((child, depth + 1) for child in children)
    return deepest


def _param(entry: Any, i: int, fail) -> Param:
    if not isinstance(entry, dict):
        raise fail(f"params[{i}] must be a table")
    where = f"params[{i}] ({entry.get('key', '?')})"
    unknown = set(entry) - _PARAM
    if unknown:
        raise fail(f"{where}: unknown field '{sorted(unknown)[0]}'")
    for name in ("key", "path"):
        if not isinstance(entry.get(name), str) or not entry[name]:
            raise fail(f"{where}: '{name}' must be a non-empty string")
    for name in STACKS:
        if entry["key"].count(name) > 1:
            raise fail(f"{where}: '{name}' appears more than once in the key")
    axes = entry.get("axes")
    if axes != MODULE_AXES and (not isinstance(axes, list) or not all(isinstance(a, str) for a in axes)):
        raise fail(
            f"{where}: 'axes' must be a list of logical axis names, one per target dimension "
            f'(or "{MODULE_AXES}": the sharding names the module annotates the leaf with)'
        )
    path = entry["path"].replace("/", ".")
    for name in STACKS:
        if path.count(name) > 1:
            raise fail(f"{where}: '{name}' appears more than once in the path")
        if name in path and name not in entry["key"]:
            raise fail(f"{where}: the path has '{name}' but the key does not")
    in_path = [name for name in STACKS if name in path]
    in_key = [name for name in STACKS if name in entry["key"]]
    if in_path != in_key[: len(in_path)]:
        raise fail(
            f"{where}: the path's placeholders must be the key's outermost ones ({', '.join(in_key)}): "
            "a leaf per layer may stack experts, not the other way round"
        )
    optional = entry.get("optional", False)
    if optional not in (True, False, "model", "checkpoint"):
        raise fail(f'{where}: \'optional\' must be "model", "checkpoint", true (either) or false')
    if optional in (True, False):
        optional = "either" if optional else ""
    transforms = []
    steps = entry.get("transforms", [])
    if not isinstance(steps, list):
        raise fail(f"{where}: 'transforms' must be a list of one-key tables such as {{ transpose = [1, 0] }}")
    for t in steps:
        try:
            transforms.append(parse_transform(t))
        except ValueError as e:
            raise fail(f"{where}: {e}") from None
    return Param(
        entry["key"],
        path,
        None if axes == MODULE_AXES else tuple(a or None for a in axes),
        tuple(transforms),
        optional,
    )


def load_mapping(path: str | os.PathLike) -> Mapping:
    """Read and parse a mapping file.

    **Arguments:**

    - `path`: the mapping's TOML file, or the name of a shipped one (`"t5_encoder"`:
      `mappings/t5_encoder.toml`) where no file of that name exists.

    Returns a `Mapping`; a `MappingError` names the file and what is wrong with it.

    ```python
    mapping = port.load_mapping("mappings/gpt2.toml")
    ```
    """
    return parse_mapping(_read(_named(path)), str(_named(path)))


def _named(path: str | os.PathLike) -> Path:
    """`path`, or, where no such file exists and it is a plain name (`t5_encoder`), the shipped
    mapping of that name; a `MappingError` for a name that is neither."""
    given = Path(path)
    if given.exists() or not _SHIPPED_NAME.fullmatch(str(path)):
        return given
    shipped = {p.stem: p for p in shipped_mappings()}
    if str(path) in shipped:
        return shipped[str(path)]
    raise MappingError(
        f"{path}: no such mapping file, nor a shipped mapping of that name (shipped: {', '.join(sorted(shipped))})"
    )


def _read(path: Path) -> str:
    """The text of the mapping file `path`, or a `MappingError` naming it.

    Only a regular file is read: checked before opening (`stat`, so a FIFO or device is
    never opened) and again on a descriptor opened with `O_NONBLOCK` (`fstat`: the same
    file, still regular), so nothing can block. At most `MAX_MAPPING_BYTES`, UTF-8.
    """
    flags = os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOCTTY", 0) | getattr(os, "O_CLOEXEC", 0)
    try:
        before = os.stat(path)
        if not stat.S_ISREG(before.st_mode):
            raise MappingError(f"{path}: not a regular file ({file_kind(before.st_mode)}); a mapping is a TOML file")
        fd = os.open(path, flags)
        try:
            after = os.fstat(fd)
            if not stat.S_ISREG(after.st_mode) or (after.st_dev, after.st_ino) != (before.st_dev, before.st_ino):
                raise MappingError(f"{path}: replaced while being opened")
            if after.st_size > MAX_MAPPING_BYTES:
                raise MappingError(
                    f"{path}: a mapping file of {after.st_size} bytes, more than port reads ({MAX_MAPPING_BYTES})"
                )
            with open(fd, "rb", closefd=False) as f:
                data = f.read(MAX_MAPPING_BYTES + 1)
        finally:
            os.close(fd)
    except OSError as e:
        raise MappingError(f"{path}: cannot read mapping file ({e.strerror or e})") from None
    if len(data) > MAX_MAPPING_BYTES:
        raise MappingError(f"{path}: a mapping file of more than {MAX_MAPPING_BYTES} bytes (it grew while read)")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise MappingError(
            f"{path}: not UTF-8 text (byte {e.start} is {data[e.start]:#04x}); a mapping is a TOML file"
        ) from None


def shipped_mappings() -> list[Path]:
    """The mapping files that ship with port (in the wheel, or `mappings/` of a checkout)."""
    packaged = Path(str(importlib.resources.files("port"))) / "mappings"
    checkout = Path(__file__).resolve().parents[2] / "mappings"
    for directory in (packaged, checkout):
        if directory.is_dir():
            return sorted(directory.glob("*.toml"))
    return []


def mapping_for(
    config: AnyMapping[str, Any],
    mapping: str | os.PathLike | Mapping | None = None,
    *,
    keys: Iterable[str] | None = None,
    built: type | None = None,
) -> Mapping:
    """The mapping to use for a checkpoint: `mapping` if given, else the shipped one for its `model_type`.

    **Arguments:**

    - `config`: the checkpoint's `config.json` as a dict.
    - `mapping`: a `Mapping`, a mapping file (or a shipped mapping's name), or None for
      the shipped mapping that lists `config["model_type"]` (a `MappingError` if none
      does; of several, the one whose `architectures` name config.json's class, else the
      first by file name), or, for a multimodal wrapper none lists, the one that lists its
      `text_config`'s `model_type`.
    - `built`: the class of a model at hand (`port export`'s): of the shipped mappings
      listing the model_type, the one whose `model` it is goes first (a `T5Encoder`
      loaded from a full T5 checkpoint exports by `t5_encoder.toml`).
    - `keys`: the checkpoint's tensor names. Given them, the mapping of a wrapper's language
      model (its `text_config`'s model type, not the wrapper's) is fitted to the wrapper's
      layout (`language_model`): the prefixes of its keys and the towers to ignore are
      derived from them.

    ```python
    mapping = port.mapping_for({"model_type": "gpt2"})   # mappings/gpt2.toml
    port.mapping_for(kimi_config, keys=ckpt.tensors).prefixes   # ("language_model.model.", "language_model.")
    ```
    """
    if isinstance(mapping, Mapping):
        found = mapping
    elif mapping is not None:
        found = load_mapping(mapping)
    else:
        found = _shipped_for(config, built)
    return found if keys is None else language_model(found, config, keys)


def _shipped_for(config: AnyMapping[str, Any], built: type | None = None) -> Mapping:
    """The shipped mapping that lists `config`'s model_type (of several, the one whose model is
    `built`, else the one that `serves` it, else the first), else its `text_config`'s; a
    `MappingError` otherwise."""
    model_type = config.get("model_type")
    if not isinstance(model_type, str):
        raise MappingError("config.json: no 'model_type'; give a mapping with mapping=")
    text = config.get(TEXT_CONFIG)
    text_type = text.get("model_type") if isinstance(text, dict) else None
    by_text = None
    listing: list[Mapping] = []
    for path in shipped_mappings():
        source = _read(path)
        if not _may_list(source, (model_type, text_type)):
            continue
        mapping = parse_mapping(source, str(path))
        if model_type in mapping.model_types:
            listing.append(mapping)
        if by_text is None and text_type in mapping.model_types:
            by_text = mapping
    if listing:  # several (a full model, its encoder, its towers): the one config.json's class is, else the first
        named = None if built is None else f"{built.__module__}:{built.__qualname__}"
        return next((m for m in listing if m.model == named), None) or next(
            (m for m in listing if m.serves(config)), listing[0]
        )
    if by_text is not None:
        return by_text
    known = [t for path in shipped_mappings() for t in load_mapping(path).model_types]
    nor = "" if text is None else f", nor has its {TEXT_CONFIG}'s model_type {quoted(text_type)}"
    raise MappingError(
        f"config.json: model_type {quoted(model_type)} has no mapping{nor} "
        f"(known: {', '.join(sorted(known)) or 'none'}); give one with mapping="
    )


def _may_list(text: str, model_types: tuple[str | None, ...]) -> bool:
    """Whether a mapping file's text may list one of `model_types` (it names one as a TOML string):
    the shipped mappings are parsed only where it does, not all of them for every load."""
    return any(t is not None and (f'"{t}"' in text or f"'{t}'" in text) for t in model_types)


def language_model(mapping: Mapping, config: AnyMapping[str, Any], keys: Iterable[str]) -> Mapping:
    """`mapping` fitted to a multimodal wrapper holding its model as the language model, where
    `config` is such a wrapper's: one whose `text_config`'s model type the mapping serves, or
    whose own it exports (`[export.<model_type>]`); else `mapping`. Idempotent.

    Derived from the checkpoint's `keys`, nothing written per family: `prefixes` are the
    key prefixes under which the mapping's entries are found (the one holding most of them,
    `language_model.model.` or `model.language_model.`, and any holding entries that one
    lacks, such as the head's `language_model.` or none); every other group of keys (a
    vision tower, a projector) is ignored, by the shortest leading names no prefix shares
    (`vision_tower.*`, `model.visual.*`); and `export[<wrapper's model_type>]` writes the
    language model as a text-only checkpoint of the text config's model type, its keys
    under the mapping's own first prefix (`model.`) and the others' at the top
    (`lm_head.weight`); a mapping's `[export.<model_type>]` gives the class to write (and may
    give the prefixes). A `CheckpointError` when the language model's keys are found under
    two prefixes.
    """
    text = config.get(TEXT_CONFIG)
    wrapper = config.get("model_type")
    if not isinstance(text, dict) or not isinstance(wrapper, str) or text.get("model_type") == wrapper:
        return mapping
    if mapping.config:  # a dual model's tower: its keys named by the mapping itself
        return mapping
    if text.get("model_type") not in mapping.model_types and wrapper not in mapping.export or mapping.fitted:
        return mapping
    keys = list(keys)
    found, main, others = _text_prefixes(mapping, keys, wrapper)
    prefixes = [main, *others]
    top = found.get("", set())
    towers = sorted({_group(key, prefixes) for key in keys if not _under(key, prefixes, top)})
    renames = ((main, mapping.prefixes[-1] if mapping.prefixes else ""), *((p, "") for p in others if p))
    declared = mapping.export.get(wrapper)  # its model_type and architectures; prefixes derived unless it gives them
    if declared is not None:
        export = declared if declared.prefixes else dataclasses.replace(declared, prefixes=renames)
    else:
        named = text.get("architectures")  # the text config's own, where it keeps them; else none is written
        architectures = tuple(named) if isinstance(named, list) and all(isinstance(a, str) for a in named) else ()
        export = TextExport(TEXT_CONFIG, str(text.get("model_type")), architectures, renames)
    return dataclasses.replace(
        mapping,
        prefixes=tuple(sorted((p for p in prefixes if p), key=lambda p: (-len(p), p))),
        ignore=tuple(dict.fromkeys((*mapping.ignore, *(f"{group}.*" for group in towers)))),
        export={**mapping.export, wrapper: export},
        fitted=wrapper,
    )


def _text_prefixes(mapping: Mapping, keys: list[str], wrapper: str) -> tuple[dict[str, set[str]], str, list[str]]:
    """Each prefix under which `mapping`'s entries are found among `keys` -> the names found under
    it (numbers blanked); the one holding most, and those holding only names it lacks (the
    head's); `CheckpointError` for the same entries under two prefixes.

    The keys are matched by their shapes (`layers.#.mlp.experts.#.up_proj.weight`): a few
    hundred, however many layers and experts a checkpoint has."""
    names = re.compile("|".join([*(p.regex(named=False) for p in mapping.params), *map(re.escape, mapping.tied)]))
    by_shape: dict[str, list[str]] = {}
    for key in keys:
        by_shape.setdefault(_DIGITS.sub("#", key), []).append(key)
    found: dict[str, set[str]] = {}
    for shape, same in by_shape.items():
        probe = shape.replace("#", "0")
        for depth, at in enumerate([0, *(i + 1 for i, c in enumerate(probe) if c == ".")]):
            if names.fullmatch(probe, at):
                head = shape[:at]  # the prefix, unless it holds numbers: then each key's own
                keyed = {".".join(key.split(".")[:depth]) + "." for key in same} if "#" in head else {head}
                for prefix in keyed:
                    found.setdefault(prefix, set()).add(shape[at:])
    if not found:
        raise CheckpointError(
            f"config.json: model_type {quoted(wrapper)} wraps a {mapping.model_types[0]} language model, "
            f"but no key of the checkpoint is one {mapping.source} names, under any prefix"
        )
    ranked = sorted(found, key=lambda p: (-len(found[p]), p))
    main = ranked[0]
    twin = next((p for p in ranked[1:] if found[p] == found[main]), None)
    if twin is not None:
        raise CheckpointError(
            f"checkpoint: the {mapping.model_types[0]} language model of {quoted(wrapper)} is found under two "
            f"prefixes, {quoted(main)} and {quoted(twin)}: one model, one prefix"
        )
    others: dict[str, str] = {}
    for prefix in ranked[1:]:
        if found[prefix] & found[main]:
            continue  # another tower with some of the same names (a vision model's layers)
        for name in found[prefix]:
            if name in others:
                raise CheckpointError(
                    f"checkpoint: {quoted(name)} of the {mapping.model_types[0]} language model of {quoted(wrapper)} "
                    f"is found under two prefixes, {quoted(others[name])} and {quoted(prefix)}"
                )
            others[name] = prefix
    return found, main, sorted(set(others.values()), key=lambda p: (-len(p), p))


def _under(key: str, prefixes: list[str], top: set[str]) -> bool:
    """Whether `key` is the language model's: under one of its non-empty `prefixes`, or, where one
    is empty (a head at the top), one of the names found there (`top`, numbers blanked)."""
    return any(p and key.startswith(p) for p in prefixes) or ("" in prefixes and _DIGITS.sub("#", key) in top)


def _group(key: str, prefixes: list[str]) -> str:
    """The shortest leading names of `key` that begin no prefix of the language model's:
    `vision_tower` of `vision_tower.blocks.0.w`, `model.visual` of `model.visual.w` beside
    `model.language_model.`."""
    parts = key.split(".")
    for n in range(1, len(parts)):
        head = ".".join(parts[:n]) + "."
        if not any(p.startswith(head) for p in prefixes):
            return head[:-1]
    return key
