"""Each shipped model module says which `config.json` it can run (issue 35), and says it truly.

Every shipped mapping's model class declares `FIELDS` (a `port.nn.config.ConfigFields`).
For each model type the mapping serves, against the installed transformers' config class
for that type (a multimodal wrapper's `text_config` class, which is what the module
reads):

- every field the config class defines is read, fixed or in `IGNORED`;
- each fixed field transformers defines runs at transformers' default (the first value);
- the config class's own defaults, shrunk to a tiny model, build (abstractly);
- each fixed field set to a value the module does not run is refused by `from_config`
  with one line naming the field and the module.

Parametrised by model type (`-k gemma2` selects one). Needs transformers (no PyTorch).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import equinox as eqx
import jax
import pytest

from port._errors import ConfigError
from port._mapping import load_mapping, shipped_mappings
from port.nn.config import IGNORED, ConfigFields

from helpers import one_line, run_port

transformers = pytest.importorskip("transformers")
ROOT = Path(__file__).resolve().parents[1]

LAYERS = 2
SMALL = {
    # sizes of a tiny model, set where the config class defines them
    "vocab_size": 64, "hidden_size": 32, "num_hidden_layers": LAYERS, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 8, "intermediate_size": 64, "intermediate_size_mlp": 64,
    "n_embd": 32, "n_layer": LAYERS, "n_head": 4, "n_positions": 64, "max_position_embeddings": 64,
    "moe_intermediate_size": 16, "shared_expert_intermediate_size": 16, "num_local_experts": 4,
    "num_experts": 4, "n_routed_experts": 4, "num_experts_per_tok": 2, "n_group": 2, "topk_group": 1,
    "first_k_dense_replace": 1, "kv_lora_rank": 8, "q_lora_rank": 16, "qk_nope_head_dim": 8,
    "qk_rope_head_dim": 4, "qk_head_dim": 12, "v_head_dim": 8, "linear_num_key_heads": 2,
    "linear_num_value_heads": 4, "linear_key_head_dim": 8, "linear_value_head_dim": 8,
    "image_size": 32, "patch_size": 8, "encoder_stride": 8,
}  # fmt: skip


def cases() -> list:
    """(mapping file, model type) for every shipped mapping, with the model type as the id."""
    found = []
    for path in shipped_mappings():
        for model_type in load_mapping(path).model_types:
            found.append(pytest.param(path, model_type, id=model_type))
    return found


CASES = cases()


def model_class(path) -> type:
    return load_mapping(path).model_class()


def fields_of(path) -> ConfigFields:
    """The class's declaration; a class without one fails the test."""
    cls = model_class(path)
    fields = cls.__dict__.get("FIELDS")
    assert isinstance(fields, ConfigFields), f"{cls.__module__}.{cls.__qualname__} declares no FIELDS"
    return fields


def hf_config(model_type: str, path=None) -> tuple[Any, str | None]:
    """The config the module reads for `model_type` (a wrapper's text config, or the sub-config
    the mapping at `path` names with `config`: a dual model's tower), and the wrapper's
    sub-config key for it (None if `model_type` is not a wrapper)."""
    config = transformers.AutoConfig.for_model(model_type)
    key = (load_mapping(path).config if path is not None else "") or "text_config"
    if key in type(config).sub_configs:
        return getattr(config, key), key
    return config, None


def defined_fields(config: Any) -> dict[str, Any]:
    """The fields a config class defines beyond `PretrainedConfig`'s, with their defaults (sub-configs left out)."""
    base = set(transformers.PretrainedConfig().to_dict())
    subs = set(type(config).sub_configs)
    return {k: v for k, v in config.to_dict().items() if k not in base and k not in subs}


def allowed_for(fields: ConfigFields, model_type: str, path=None) -> dict[str, tuple[Any, ...]]:
    """The fixed fields for `model_type` and, for a wrapper, for its text config's type."""
    text, _ = hf_config(model_type, path)
    return {**fields.fixed_for(text.model_type), **fields.fixed_for(model_type)}


def same(a: Any, b: Any) -> bool:
    """Equal as config.json values: a boolean is never a number, a tuple equals a list."""
    if isinstance(a, bool) or isinstance(b, bool):
        return isinstance(a, bool) and isinstance(b, bool) and a == b
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return list(a) == list(b)
    return type(a) is type(b) and a == b or (isinstance(a, (int, float)) and isinstance(b, (int, float)) and a == b)


def shrink(values: dict[str, Any]) -> dict[str, Any]:
    """A config class's defaults as a tiny model: sizes from `SMALL`, per-layer lists cut to `LAYERS`."""
    layers = values.get("num_hidden_layers", values.get("n_layer"))
    tiny = {k: (SMALL[k] if k in SMALL and values[k] is not None else values[k]) for k in values}
    if values.get("num_key_value_heads") == values.get("num_attention_heads"):  # kept one per head
        tiny["num_key_value_heads"] = tiny.get("num_attention_heads")
    for key, value in values.items():
        if isinstance(value, list) and layers and len(value) == layers:
            tiny[key] = value[:LAYERS]
        elif isinstance(value, list) and value and all(isinstance(i, int) and not isinstance(i, bool) for i in value):
            tiny[key] = [i for i in value if i < LAYERS]  # layer indices (moe_layers, mlp_only_layers)
        elif isinstance(value, dict) and value and all(isinstance(k, str) and k.isdigit() for k in value):
            tiny[key] = {k: v for k, v in value.items() if int(k) < LAYERS}  # by layer (Gemma 4's per_layer_config)
    return tiny


def tiny_config(model_type: str, path=None, **text_fields: Any) -> dict[str, Any]:
    """A valid tiny config.json for `model_type` from transformers' defaults; `text_fields` set on
    the config the module reads (a wrapper's `text_config`)."""
    text, sub = hf_config(model_type, path)
    body = {**shrink(text.to_dict()), **text_fields}
    if sub is None:
        return body
    outer = transformers.AutoConfig.for_model(model_type).to_dict()
    return {**{k: v for k, v in outer.items() if k not in type(text).sub_configs and k != "vision_config"}, sub: body}


def build(path, config: dict[str, Any]) -> Any:
    """The mapping's model, abstractly, from the config `port.load` gives it (a tower's own, of a dual model's)."""
    mapping = load_mapping(path)
    return eqx.filter_eval_shape(mapping.model_class().from_config, mapping.model_config(config), key=jax.random.key(0))


def other_value(default: Any, allowed: tuple[Any, ...]) -> Any:
    """A value of the default's kind that none of `allowed` is (None if every candidate is)."""
    if isinstance(default, bool):
        candidates = [not default]
    elif isinstance(default, int):
        candidates = [default + 1, default * 2 + 3]
    elif isinstance(default, float):
        candidates = [default * 2 + 1.0 if math.isfinite(default) else 1.0, 3.25]
    elif isinstance(default, str):
        candidates = ["unsupported"]
    elif isinstance(default, (list, tuple)):
        candidates = [[*default, "unsupported"], []]
    elif isinstance(default, dict):
        candidates = [{**default, "unsupported": 1}]
    else:  # None
        candidates = [{"unsupported": 1}, 3, "unsupported"]
    return next((c for c in candidates if not any(same(c, a) for a in allowed)), None)


# ---------------------------------------------------------------- the declaration against transformers


@pytest.mark.parametrize("path, model_type", CASES)
def test_every_field_is_read_fixed_or_ignored(path, model_type):
    fields = fields_of(path)
    allowed = allowed_for(fields, model_type, path)
    assert not set(fields.read) & set(allowed), "a field is both read and fixed"
    assert not (set(fields.read) | set(allowed)) & IGNORED, "a declared field is also IGNORED"
    text, _ = hf_config(model_type, path)
    undeclared = sorted(set(defined_fields(text)) - set(fields.read) - set(allowed) - IGNORED)
    assert not undeclared, f"{fields.module} declares nothing for {undeclared} ({model_type})"


@pytest.mark.parametrize("path, model_type", CASES)
def test_fixed_fields_run_at_transformers_default(path, model_type):
    fields = fields_of(path)
    text, _ = hf_config(model_type, path)
    defaults = defined_fields(text)
    wrong = {
        k: (defaults[k], v[0])
        for k, v in allowed_for(fields, model_type, path).items()
        if k in defaults and not same(defaults[k], v[0])
    }
    assert not wrong, f"{fields.module}: fixed fields whose first value is not transformers' default: {wrong}"


@pytest.mark.parametrize("path, model_type", CASES)
def test_transformers_defaults_build(path, model_type):
    fields_of(path)
    model = build(path, tiny_config(model_type, path))
    assert jax.tree_util.tree_leaves(model)


@pytest.mark.parametrize("path, model_type", CASES)
def test_each_fixed_field_is_refused_at_another_value(path, model_type):
    fields = fields_of(path)
    refused = []
    for key, allowed in allowed_for(fields, model_type, path).items():
        value = other_value(allowed[0], allowed)
        assert value is not None, f"{fields.module}: fixed {key} allows every value of its kind {allowed}: it is read"
        with pytest.raises(ConfigError) as raised:
            build(path, tiny_config(model_type, path, **{key: value}))
        message = str(raised.value)
        assert "\n" not in message
        assert message.startswith(f"config.json: {key} ") and f"not supported by {fields.module} " in message
        refused.append(key)
    assert len(refused) == len(allowed_for(fields, model_type, path))


# ---------------------------------------------------------------- the command line


@pytest.mark.slow
def test_port_refuses_a_field_the_module_does_not_run(tiny, tmp_path):
    """`port check`, `port plan` and `port convert` of a GPT-2 whose config.json asks for
    cross-attention: one line naming the field and the module, nothing written."""
    directory = tiny(config={"add_cross_attention": True})
    line = "config.json: add_cross_attention true is not supported by port.models.gpt2.GPT2 (supported: false)"
    one_line(run_port("check", ROOT / "mappings" / "gpt2.toml", directory), line)
    one_line(run_port("plan", directory), line)
    out = tmp_path / "out"
    one_line(run_port("convert", directory, "--out", out), line, out=out)
