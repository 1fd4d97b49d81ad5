"""Formats: which tensors of a checkpoint are quantized sources, by its `quantization_config`.

A format subclasses `Format` with the `quant_method` values it reads (`methods=("fp8",)`),
which registers it in `FORMATS`. `find` reads one checkpoint's tensors (headers only)
and returns its `QuantizedInfo`s, checking every part against the others and against
the config (scale grids that cover the weight, block and group sizes that agree, every
companion present): a `CheckpointError` naming the tensor and what is wrong, before any
tensor byte is read.

```python
@final
class Fp8(Format, methods=("fp8",)):
    @classmethod
    def find(cls, config, settings, tensors, out_dtype):   # -> (sources, hidden)
        ...
```
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Mapping
from typing import Any, ClassVar

import numpy as np

from ..._dtypes import CASTS
from ..._errors import CheckpointError
from ..._text import quoted
from .._checkpoint import TensorInfo
from ._source import BFLOAT16, QuantizedInfo

SMALL = 64 * 2**10
"""The most bytes `Format.find` may read of one tensor (a stored shape, a JSON state)."""

#: The formats by the `quant_method` values they read; filled by subclassing `Format`.
FORMATS: dict[str, type[Format]] = {}


class Format(abc.ABC):
    """One family of quantized layouts, read from `config.json`'s `quantization_config`."""

    methods: ClassVar[tuple[str, ...]]

    def __init_subclass__(cls, *, methods: tuple[str, ...] = (), **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls.methods = methods
        for method in methods:
            if method in FORMATS:
                raise TypeError(f"quant_method '{method}' is registered twice")
            FORMATS[method] = cls

    @classmethod
    @abc.abstractmethod
    def find(
        cls,
        config: Mapping[str, Any],
        settings: Mapping[str, Any],
        tensors: Mapping[str, TensorInfo],
        out_dtype: np.dtype,
        read: Callable[[str], np.ndarray],
    ) -> tuple[list[QuantizedInfo], set[str]]:
        """The quantized sources among `tensors`, and the keys of other tensors the format
        consumes without a source of their own (activation scales); `settings` is
        `quantization_config`. A `CheckpointError` for a tensor that contradicts it.

        `read(key)` reads a whole small tensor (at most `SMALL` bytes, else a
        `CheckpointError`) for a format whose shapes are stored in tensors rather than
        headers (bitsandbytes' `quant_state`); a format that needs none reads nothing."""


def out_dtype(config: Mapping[str, Any]) -> np.dtype:
    """The dtype dequantized parameters take: config.json's `dtype` (transformers 5) or
    `torch_dtype`, where it names one port casts to; bfloat16 otherwise."""
    from ..._dtypes import NAMES

    for name in ("dtype", "torch_dtype"):
        value = config.get(name)
        if isinstance(value, str) and value in CASTS:
            return NAMES[value]
    return BFLOAT16


def settings_of(config: Mapping[str, Any]) -> tuple[type[Format], Mapping[str, Any]] | None:
    """The format `quantization_config` names and its settings; None without one; a
    `CheckpointError` for one port does not read."""
    settings = config.get("quantization_config")
    if settings is None:
        return None
    if not isinstance(settings, dict):
        raise CheckpointError(f"config.json: 'quantization_config' must be an object, got {quoted(settings)}")
    method = settings.get("quant_method")
    if not isinstance(method, str) or method not in FORMATS:
        raise CheckpointError(
            f"config.json: quantization_config.quant_method {quoted(method)} is not supported "
            f"(supported: {', '.join(sorted(FORMATS))})"
        )
    return FORMATS[method], settings
