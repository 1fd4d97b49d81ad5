"""Reading a Hugging Face `config.json`: typed values, activation functions, and which fields a module runs.

Public (`port.nn.config`) and shared by every model module, so every model reports a bad
config the same way: one line naming `config.json`, the key and what is wrong.

```python
from port.nn.config import ConfigFields, get, read_kv_heads

n_embd = get(config, "n_embd", int)                      # required, a positive integer
eps = get(config, "layer_norm_epsilon", float, 1e-5)      # absent or null: the default
act = activation(config, "activation_function", "gelu_new")

FIELDS = ConfigFields(
    "port.models.bert.Bert",
    read=("vocab_size", "hidden_size", "num_hidden_layers"),
    fixed={"position_embedding_type": ("absolute",), "is_decoder": (False,)},
)
FIELDS.check(config)   # before anything else is read: one line for a field it cannot run
```
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Callable, Mapping
from typing import Any, final

import jax
from jaxtyping import Array

from port._errors import ConfigError
from port._text import quoted

ACTIVATIONS: dict[str, Callable[[Array], Array]] = {
    "gelu": lambda x: jax.nn.gelu(x, approximate=False),  # exact (erf)
    "gelu_new": lambda x: jax.nn.gelu(x, approximate=True),  # tanh approximation
    "gelu_fast": lambda x: jax.nn.gelu(x, approximate=True),
    "gelu_pytorch_tanh": lambda x: jax.nn.gelu(x, approximate=True),
    "quick_gelu": lambda x: x * jax.nn.sigmoid(1.702 * x),
    "relu": jax.nn.relu,
    "silu": jax.nn.silu,
    "swish": jax.nn.silu,
}
"""transformers' activation names (`ACT2FN`) and their JAX functions."""

MISSING = object()


MAX_INT = 2**31 - 1  # a size JAX can index
MAX_LAYERS = 10_000  # far past any real model; a model builds per-layer tables of this length


def check(key: str, value: Any, kind: type, maximum: int = MAX_INT) -> Any:
    """Check a config value; `kind` is `int` (positive, at most `maximum`) or `float` (positive) or `bool`."""
    if kind is bool:
        ok = isinstance(value, bool)
    else:
        ok = (
            isinstance(value, int if kind is int else (int, float))
            and not isinstance(value, bool)
            and value > 0
            and (kind is not int or value <= maximum)
            and (kind is int or math.isfinite(value))
        )
    if not ok:
        expected = {bool: "a boolean", int: f"a positive integer up to {maximum}"}.get(kind, "a positive number")
        raise ConfigError(f"config.json: {key!r} must be {expected}, got {quoted(value)}")
    return kind(value)


def get(config: dict, key: str, kind: type, default: Any = MISSING, maximum: int = MAX_INT) -> Any:
    """Read and check `config[key]`; an absent or null key yields `default` if given."""
    value = config.get(key)
    if value is None and default is not MISSING:
        return default
    if key not in config:
        raise ConfigError(f"config.json: required key {key!r} is missing")
    return check(key, value, kind, maximum)


def activation(config: dict, key: str, default: str, supported: tuple[str, ...] | None = None) -> str:
    """The activation named by `config[key]`, one port implements (or one of `supported`)."""
    name = config.get(key, default)
    allowed = supported or tuple(ACTIVATIONS)
    if not isinstance(name, str) or name not in allowed:
        raise ConfigError(
            f"config.json: {key!r} {quoted(name)} is not supported (supported: {', '.join(sorted(allowed))})"
        )
    return name


def check_model_type(config: dict, supported: tuple[str, ...], module: str, default: str | None = None) -> str:
    """config.json's `model_type` (absent: `default`), one of the `supported` ones of `module`.

    ```python
    check_model_type({"model_type": "gemma2"}, ("gemma", "gemma2"), "port.models.gemma")   # "gemma2"
    ```
    """
    value = config.get("model_type", default)
    if value not in supported:
        raise ConfigError(
            f"config.json: 'model_type' {quoted(value)} is not supported by {module} "
            f"(supported: {', '.join(supported)})"
        )
    return value


def read_kv_heads(config: dict, heads: int, default: int | None) -> int:
    """`num_key_value_heads`: absent, the config class's `default`; null (or no default), one
    per query head; it must divide `heads`.

    ```python
    read_kv_heads({"num_key_value_heads": 2}, 8, None)   # 2
    read_kv_heads({}, 8, None)                            # 8
    ```
    """
    value = config.get("num_key_value_heads", default)
    value = heads if value is None else check("num_key_value_heads", value, int)
    if heads % value != 0:
        raise ConfigError(f"config.json: 'num_key_value_heads' ({value}) must divide 'num_attention_heads' ({heads})")
    return value


IGNORED: frozenset[str] = frozenset(
    {
        # what the checkpoint is and who wrote it
        "_name_or_path", "architectures", "model_type", "transformers_version", "dtype", "torch_dtype",
        "_commit_hash", "auto_map", "name_or_path", "tokenizer_class", "prefix",
        # ids of special tokens: the caller's to use (a loaded model's numbers do not depend on them)
        "bos_token_id", "eos_token_id", "pad_token_id", "sep_token_id", "cls_token_id", "mask_token_id",
        "unk_token_id", "decoder_start_token_id", "forced_bos_token_id", "forced_eos_token_id",
        "image_token_id", "image_token_index", "video_token_id", "audio_token_id", "boi_token_id",
        "eoi_token_id", "boa_token_id", "eoa_token_id",
        # generation settings and what transformers' forward returns
        "use_cache", "output_attentions", "output_hidden_states", "return_dict", "max_length", "min_length",
        "do_sample", "temperature", "top_k", "top_p", "num_beams", "repetition_penalty", "length_penalty",
        "no_repeat_ngram_size", "early_stopping", "bad_words_ids", "num_return_sequences",
        "task_specific_params", "chunk_size_feed_forward",
        # training only: port's modules run without dropout and are initialised from the checkpoint
        "attention_dropout", "attention_probs_dropout_prob", "hidden_dropout_prob", "hidden_dropout",
        "dropout", "embd_pdrop", "resid_pdrop", "attn_pdrop", "summary_first_dropout", "classifier_dropout",
        "embedding_dropout", "mlp_dropout", "initializer_range", "initializer_factor", "router_aux_loss_coef",
        "output_router_logits", "router_jitter_noise", "z_loss_coef", "gradient_checkpointing",
        "qa_dropout", "seq_classif_dropout", "initializer_cutoff_factor", "deterministic_flash_attn",
        # heads port does not build (classification labels, GPT-2's multiple-choice summary, ViT's
        # masked-image decoder)
        "id2label", "label2id", "num_labels", "problem_type", "finetuning_task",
        "summary_type", "summary_use_proj", "summary_activation", "summary_proj_to_labels", "encoder_stride",
        # ModernBERT's masked-LM head and classifiers
        "decoder_bias", "classifier_pooling", "classifier_bias", "classifier_activation", "sparse_prediction",
        "sparse_pred_ignore_index",
    }
)  # fmt: skip
"""config.json fields that change nothing numerically in a loaded model (special token ids,
`architectures`, `dtype`, generation settings, dropout and initialisation): no module
declares them, and `ConfigFields.check` never looks at them."""


def _shown(value: Any) -> str:
    """A config value as config.json writes it (`true`, `null`, `[1, 2]`), a string quoted as Python does."""
    if isinstance(value, str):
        return quoted(value)
    try:
        return quoted(json.dumps(value))[1:-1] if len(json.dumps(value)) <= 80 else quoted(value)
    except (TypeError, ValueError):
        return quoted(value)


@final
@dataclasses.dataclass(frozen=True)
class ConfigFields:
    """Which `config.json` fields a model module runs, and the values it supports.

    **Fields:**

    - `module`: the module's dotted name, for messages (`"port.models.bert.Bert"`).
    - `read`: the fields the module reads (and checks itself, with `get`, `read_rope`, ...).
    - `fixed`: fields the family's transformers config defines that the module does not
      implement, each with the values it runs exactly like (the first: transformers'
      default); absent or null means the default.
    - `types`: per `model_type`, more `fixed` fields (or other values for one), where the
      model types a module serves define different fields or defaults.

    Every other field is one `IGNORED` names, or one transformers does not define for the
    family (which, as in transformers, changes nothing). `tests/test_config_fields.py`
    holds each shipped module's declaration to the installed transformers' config classes:
    every field they define is read, fixed (at its default) or ignored.

    ```python
    FIELDS = ConfigFields("port.models.bert.Bert", read=("hidden_size",),
                          fixed={"position_embedding_type": ("absolute",)})
    FIELDS.check({"hidden_size": 8, "position_embedding_type": "relative_key"})
    # ConfigError: config.json: position_embedding_type 'relative_key' is not supported by
    # port.models.bert.Bert (supported: 'absolute')
    ```
    """

    module: str
    read: tuple[str, ...] = ()
    fixed: Mapping[str, tuple[Any, ...]] = dataclasses.field(default_factory=dict)
    types: Mapping[str, Mapping[str, tuple[Any, ...]]] = dataclasses.field(default_factory=dict)

    def fixed_for(self, model_type: Any) -> dict[str, tuple[Any, ...]]:
        """The fixed fields and their supported values for one `model_type`."""
        return {**self.fixed, **self.types.get(model_type, {})} if isinstance(model_type, str) else dict(self.fixed)

    def check(self, config: dict, model_type: Any = None) -> None:
        """Raise `ConfigError` (one line: the field, its value, the module, what it supports) for
        the first fixed field `config` sets to a value the module does not run; `model_type`
        (default: config's own) picks `types`' entries."""
        kind = config.get("model_type") if model_type is None else model_type
        for key, allowed in self.fixed_for(kind).items():
            value = config.get(key)
            if value is None or any(_same(value, a) for a in allowed):
                continue
            supported = ", ".join(_shown(a) for a in allowed)
            raise ConfigError(
                f"config.json: {key} {_shown(value)} is not supported by {self.module} (supported: {supported})"
            )


def _same(value: Any, allowed: Any) -> bool:
    """`value == allowed`, but a boolean is never a number (True is not 1) and lists equal tuples."""
    if isinstance(value, bool) or isinstance(allowed, bool):
        return isinstance(value, bool) and isinstance(allowed, bool) and value == allowed
    if isinstance(allowed, (list, tuple)):
        return isinstance(value, (list, tuple)) and list(value) == list(allowed)
    return type(value) in (int, float, str, dict) and value == allowed
