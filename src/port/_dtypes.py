"""Dtypes: the one table of the dtypes port knows, by each name they go by.

A safetensors header says `BF16`; a mapping's `cast`, an output's metadata and `dtype=` say
`bfloat16`; NumPy needs `ml_dtypes` for it. Every module asks here, and "floating"
means one thing everywhere: `jnp.issubdtype(d, jnp.floating)`, which covers bfloat16
and the float8 types.

```python
SAFETENSORS["BF16"]          # dtype(bfloat16)
dtype("bfloat16")            # dtype(bfloat16)
floating(dtype("int8"))      # False
```
"""

from __future__ import annotations

import functools
from typing import Any

import ml_dtypes
import numpy as np

from ._errors import PortError

SAFETENSORS: dict[str, np.dtype] = {
    "F64": np.dtype(np.float64),
    "F32": np.dtype(np.float32),
    "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
    "F8_E8M0": np.dtype(ml_dtypes.float8_e8m0fnu),  # block scales (MXFP4, ue8m0 FP8): powers of two
    "I64": np.dtype(np.int64),
    "I32": np.dtype(np.int32),
    "I16": np.dtype(np.int16),
    "I8": np.dtype(np.int8),
    "U8": np.dtype(np.uint8),
    "BOOL": np.dtype(np.bool_),
}
"""The dtypes a safetensors checkpoint may hold that port reads, by their header names."""

NAMES: dict[str, np.dtype] = {d.name: d for d in SAFETENSORS.values()}
"""The same dtypes by their NumPy names (`bfloat16`, `float8_e4m3fn`, `int8`, ...)."""

CASTS = ("float32", "bfloat16", "float16")
"""What parameters may be cast to (`dtype=`, `--dtype`): the floating dtypes JAX holds without x64."""


def dtype(name: str | Any) -> np.dtype:
    """The dtype named `name` (`"bfloat16"`, `"float32"`, ...), or a one-line `PortError`; a dtype as it is."""
    if not isinstance(name, str):
        return np.dtype(name)
    if name not in NAMES:
        raise PortError(f"unknown dtype '{name}' (expected one of {', '.join(sorted(NAMES))})")
    return NAMES[name]


def floating(d: Any) -> bool:
    """Whether `d` is a floating dtype: float16/32/64, bfloat16 and the float8 types."""
    return _floating(np.dtype(d))


@functools.cache  # asked for every key and leaf by scaffold: a dict lookup after the first
def _floating(d: np.dtype) -> bool:
    import jax.numpy as jnp  # here, not above: the command line's supervisor reads this table without JAX

    return bool(jnp.issubdtype(d, jnp.floating))
