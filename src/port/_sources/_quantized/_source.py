"""A quantized source: the one tensor a packed weight and its companions stand for.

`QuantizedInfo` is a `TensorInfo` of the dequantized tensor (its logical shape, float32)
that knows its `parts` (the packed weight, its scales, zero points, group indices) and
answers the region question one step further: `regions(region)` is what each part must
read for that region of the dequantized tensor, and `dequantize(region, blocks)` turns
those reads into the region. Each format subclasses it once (`_fp8`, `_mxfp4`, ...).

```python
info = ckpt.tensors["model.layers.0.mlp.down_proj.weight"]   # an Fp8Block, shape (48, 72)
info.regions(((16, 32), (0, 72)))    # (((16, 32), (0, 72)),), (((1, 2), (0, 5)),)
info.region_nbytes(((16, 32), (0, 72)))   # 16 * 72 + 5 * 4
```
"""

from __future__ import annotations

import abc
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import ml_dtypes
import numpy as np

from ..._errors import CheckpointError
from ..._text import quoted
from .._checkpoint import Region, TensorInfo

FLOAT32 = np.dtype(np.float32)
BFLOAT16 = np.dtype(ml_dtypes.bfloat16)
READ_AS = (FLOAT32, BFLOAT16, np.dtype(np.float16))
"""The dtypes a quantized tensor's region may be read into (`dequantize_into`)."""

Blocks = tuple[tuple[np.ndarray, ...], ...]
"""What was read for one region: per part (in `parts` order), one array per region it asked for."""


@dataclass(frozen=True)
class QuantizedInfo(TensorInfo, abc.ABC):
    """The dequantized tensor a quantized weight and its companions stand for.

    `key` is the tensor's name as an unquantized checkpoint would have it; `dtype` is
    float32 (dequantization's arithmetic; the plan casts to `out_dtype`, the checkpoint's
    `torch_dtype`, unless `dtype=` says otherwise); `file` and `offset` are the packed
    part's. A subclass per format answers `regions`, `dequantize` and `describe`.
    """

    parts: tuple[TensorInfo, ...] = ()
    out_dtype: np.dtype = field(default=BFLOAT16)

    @property
    def load_dtype(self) -> np.dtype:
        return self.out_dtype

    @property
    def band_rows(self) -> int | None:
        return None  # a format that knows which rows keep its companions unshared says so

    @property
    def packed(self) -> TensorInfo:
        """The part that holds the quantized values."""
        return self.parts[0]

    @abc.abstractmethod
    def regions(self, region: Region) -> tuple[tuple[Region, ...], ...]:
        """Per part, the regions of it that `region` of the dequantized tensor needs."""

    @abc.abstractmethod
    def dequantize(self, region: Region, blocks: Blocks) -> np.ndarray:
        """`region` of the dequantized tensor (float32) from the parts' `blocks` read for it."""

    def dequantize_into(self, region: Region, blocks: Blocks, out: np.ndarray) -> None:
        """`region` of the dequantized tensor into `out`, rounded once to its dtype (float32,
        bfloat16 or float16): `out[...] = dequantize(region, blocks)`, unless a format has a
        faster way to the same values."""
        out[...] = self.dequantize(region, blocks)

    @abc.abstractmethod
    def describe(self) -> str:
        """The format and its companions in a few words, as `port plan` and `port info` show them."""

    def region_nbytes(self, region: Region) -> int:
        return sum(
            math.prod(b - a for a, b in r) * part.dtype.itemsize
            for part, rs in zip(self.parts, self.regions(region))
            for r in rs
        )


def blocks_of(region: Region, block: Sequence[int]) -> Region:
    """The blocks of size `block` (per dimension) that cover `region`: `((16, 40),)` by 16 -> `((1, 3),)`."""
    return tuple((a // n, -(-b // n)) for (a, b), n in zip(region, block))


def spread(scales: np.ndarray, region: Region, block: Sequence[int]) -> np.ndarray:
    """Scales of the blocks covering `region` (as `blocks_of` gives them) repeated over
    each block's elements and cut to `region`: one value per element of the region."""
    out = scales
    for axis, ((a, b), n) in enumerate(zip(region, block)):
        if n == 1:
            continue
        first = (a // n) * n
        out = np.repeat(out, n, axis=axis)[(slice(None),) * axis + (slice(a - first, b - first),)]
    return out


def finite(values: np.ndarray, part: TensorInfo) -> np.ndarray:
    """`values` (scales just read) as they are, or a `CheckpointError` naming `part` where one is NaN or infinite."""
    if not np.isfinite(values).all():
        raise CheckpointError(f"{part.file.name}: tensor {quoted(part.key, 200)} holds a NaN or infinite scale")
    return values


def shape_text(shape: Sequence[int]) -> str:
    return "[" + ", ".join(map(str, shape)) + "]"
