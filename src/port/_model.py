"""The model protocol: what port asks of a class it builds, fills, restores and verifies.

A model class is any class with a `from_config(config, *, key)` classmethod that builds
the module from a Hugging Face `config.json` dict (port builds it with shapes only,
`eqx.filter_eval_shape`, then fills every leaf). It may say what its call takes first
as `input_kind` (`"input_ids"` when it does not; `port verify` draws inputs by it).
Nothing needs to subclass `Model`: it is a `typing.Protocol`, checked structurally, and
`is_model` is the one check the skeleton, the mapping, restore and the command line make.

```python
class TinyLM(eqx.Module):
    embed: Array

    @classmethod
    def from_config(cls, config, *, key):
        return cls(jax.random.normal(key, (config["vocab_size"], config["hidden_size"])))

is_model(TinyLM)                      # True; isinstance(TinyLM, port.Model) too
input_kind(TinyLM)                    # "input_ids"; a ViT says "pixel_values"
is_model(TinyLM(...)), is_model(len)  # False, False: an instance, a function
```
"""

from __future__ import annotations

import inspect
import sys
from typing import Any, Protocol, runtime_checkable

DEFAULT_INPUT_KIND = "input_ids"
"""What a model's call takes first when its class gives no `input_kind`: token ids."""


@runtime_checkable
class Model(Protocol):
    """A model class: `from_config(config, *, key)` builds it from a `config.json` dict.

    **The protocol:**

    - `from_config(config, *, key, ...)`: a classmethod; `config` is the checkpoint's
      `config.json` as a dict, `key` a JAX PRNG key for the random initialisation (port
      calls it under `eqx.filter_eval_shape`, so no memory is used). Further keyword
      arguments, such as `dtype`, must have defaults. It reads its numerics from the
      config and raises `port.ConfigError` for a config it does not support.
    - `input_kind` (optional class attribute): what the call takes first, a name `port
      verify` knows (`"input_ids"`, the default, or `"pixel_values"`).

    The leaves' module paths (`blocks.attn.wq`) are what a mapping's `path`s name.
    `isinstance(cls, Model)` checks `from_config` only (`input_kind` is optional); use
    `is_model`, which also asks for a class.

    ```python
    class ViTLike(eqx.Module):
        input_kind: ClassVar[str] = "pixel_values"

        @classmethod
        def from_config(cls, config: dict, *, key: PRNGKeyArray) -> ViTLike: ...
    ```
    """

    @classmethod
    def from_config(cls, config: dict[str, Any], *, key: Any) -> Any:
        """The model built from `config` (a `config.json` dict), initialised from `key`."""
        ...


def is_model(obj: Any) -> bool:
    """Whether `obj` is a model class: a class that answers the `Model` protocol.

    ```python
    is_model(port.models.gpt2.GPT2)    # True
    is_model(GPT2.from_config(...))    # False: an instance, not its class
    ```
    """
    return isinstance(obj, type) and isinstance(obj, Model) and callable(getattr(obj, "from_config", None))


def is_nnx_class(obj: Any) -> bool:
    """Whether `obj` is a Flax NNX module class (False, and nothing imported, when Flax is not in use)."""
    nnx = sys.modules.get("flax.nnx")
    return nnx is not None and isinstance(obj, type) and issubclass(obj, nnx.Module)


def is_buildable(obj: Any) -> bool:
    """Whether port can build `obj`, as a mapping's `model` may name it: a model class (`is_model`),
    a Flax NNX module class, or a plain function (a factory taking the config.json dict).

    ```python
    is_buildable(GPT2), is_buildable(build), is_buildable(collections.OrderedDict)   # True, True, False
    ```
    """
    return is_model(obj) or is_nnx_class(obj) or inspect.isfunction(obj)


def input_kind(cls: type) -> str:
    """What a model class's call takes first: its `input_kind`, by default `DEFAULT_INPUT_KIND`.

    ```python
    input_kind(port.models.vit.ViT)    # "pixel_values"
    input_kind(port.models.gpt2.GPT2)  # "input_ids"
    ```
    """
    return getattr(cls, "input_kind", DEFAULT_INPUT_KIND)
