"""Reading a Hugging Face `config.json`: typed values and activation functions.

Shared by the model modules, so every model reports a bad config the same way: one
line naming `config.json`, the key and what is wrong.

```python
n_embd = get(config, "n_embd", int)                      # required, a positive integer
eps = get(config, "layer_norm_epsilon", float, 1e-5)      # absent or null: the default
act = activation(config, "activation_function", "gelu_new")
```
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

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
