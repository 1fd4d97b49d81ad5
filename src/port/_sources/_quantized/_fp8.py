"""FP8 with block scales (`quant_method: "fp8"`): DeepSeek-V3 / R1 / V3.2, Kimi K2, Qwen3 `-FP8`,
GLM-4.5+, MiniMax-M2; and DeepSeek-V4's FP4-packed experts (`expert_dtype: "fp4"`).

A weight `W.weight` (float8 e4m3, `[..., M, N]`) has `W.weight_scale_inv` beside it: one
scale per `weight_block_size` block (`[..., ceil(M / bm), ceil(N / bn)]`, float32, or E8M0
powers of two with `scale_fmt: "ue8m0"`; blocks at the edges may be partial), or one for
the whole tensor without `weight_block_size`. The weight is `float32(W) * scale`, each
element by its block's scale, as transformers' `_dequantize_fp8_weight` computes it (the
format's ceil-divided blocks, also where they do not divide the shape). FP4 experts are
int8 with two e2m1 values per byte (low nibble first) and one E8M0 scale per 32 values of
a row. Activation scales (`activation_scale`, `input_scale`) are consumed and unused.

```python
info = ckpt.tensors["model.layers.0.mlp.down_proj.weight"]
info.describe()     # 'fp8 e4m3, 128x128 blocks, scales weight_scale_inv float32'
```
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, final

import ml_dtypes
import numpy as np

from ..._errors import CheckpointError
from ..._text import quoted
from .._checkpoint import Region, TensorInfo
from ._format import Format
from ._source import FLOAT32, Blocks, QuantizedInfo, blocks_of, finite, shape_text, spread

FP8 = (np.dtype(ml_dtypes.float8_e4m3fn), np.dtype(ml_dtypes.float8_e5m2))
E8M0 = np.dtype(ml_dtypes.float8_e8m0fnu)
SCALES = (FLOAT32, np.dtype(ml_dtypes.bfloat16), np.dtype(np.float16), E8M0, np.dtype(np.uint8))
FP4_VALUES = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], np.float32)
"""The 16 values of an e2m1 nibble, by its bits (sign, two exponent bits, one mantissa bit)."""
SCALE_SUFFIX = "_scale_inv"
_VALUES = {d: np.arange(256, dtype=np.uint8).view(d).astype(np.float32) for d in FP8}
"""Each byte's value, per 8-bit float type (NaN where the byte is one)."""
_BITS = {4: np.uint32, 2: np.uint16}
TABLED = 4096
"""The fewest elements a block has for `dequantize_into` to table its 256 values (64x64 blocks and up)."""
"""The unsigned integers a float of each size is looked up as."""
ACTIVATION_SCALES = (".activation_scale", ".input_scale")


def scale_values(block: np.ndarray) -> np.ndarray:
    """Scales as float32: E8M0 (or its bytes, as uint8) as the powers of two they stand for."""
    if block.dtype == np.uint8:
        block = block.view(E8M0)
    return block.astype(np.float32)


def unpack_fp4(packed: np.ndarray) -> np.ndarray:
    """Bytes of two e2m1 values each (low nibble first) as float32, twice as wide on the last axis."""
    u8 = packed.view(np.uint8)
    out = np.empty((*u8.shape[:-1], 2 * u8.shape[-1]), np.float32)
    out[..., 0::2] = FP4_VALUES[u8 & 0xF]
    out[..., 1::2] = FP4_VALUES[u8 >> 4]
    return out


@functools.cache
def _pairs(dtype: np.dtype) -> np.ndarray:
    """Every two bytes of an 8-bit float `dtype`, as the uint16 they read as, to their two
    float32 values (as `astype` gives them), as one uint64: 65,536 entries, 512 KiB."""
    return np.arange(2**16, dtype=np.uint16).view(np.uint8).view(dtype).astype(np.float32).view(np.uint64)


def fp8_values(weight: np.ndarray) -> np.ndarray:
    """`weight` (an 8-bit float) as a new float32 array, equal bit for bit to `weight.astype(np.float32)`:
    looked up two bytes at a time in `_pairs` (ml_dtypes' cast takes 4-8 times longer)."""
    flat = np.ascontiguousarray(weight).reshape(-1)
    table = _pairs(weight.dtype)
    if flat.size % 2 == 0:
        return np.take(table, flat.view(np.uint16)).view(np.float32).reshape(weight.shape)
    out = np.empty(flat.size, np.float32)
    out[:-1] = np.take(table, flat[:-1].view(np.uint16)).view(np.float32)
    out[-1:] = flat[-1:].astype(np.float32)
    return out.reshape(weight.shape)


def scale_blocks(values: np.ndarray, scales: np.ndarray, region: Region, block: tuple[int, ...]) -> np.ndarray:
    """`values` (`region`, float32, owned: changed in place) times each element's block scale:
    `values * spread(scales, region, block)` without a scale per element. The scales are
    repeated along the last axis only (a row of blocks per block row), then each block row of
    `values` is multiplied by its row: the same products, one pass over `values`."""
    if len(block) < 2 or any(n != 1 for n in block[:-2]):
        return values * spread(scales, region, block)
    rows, cols = block[-2:]
    (a, b), (c, d) = region[-2:]
    if cols > 1:
        first = (c // cols) * cols
        scales = np.repeat(scales, cols, axis=-1)[..., c - first : d - first]
    if rows == 1:
        values *= scales
        return values
    first = (a // rows) * rows
    for i in range(scales.shape[-2]):
        top, bottom = max(a, first + i * rows) - a, min(b, first + (i + 1) * rows) - a
        values[..., top:bottom, :] *= scales[..., i : i + 1, :]
    return values


@final
@dataclass(frozen=True)
class Fp8Block(QuantizedInfo):
    """A weight in FP8 (or packed FP4) with one scale per block of `block` (per dimension;
    1 for the leading ones; `()`: one scale for the whole tensor). `fp4`: two values per
    stored byte along the last axis."""

    block: tuple[int, ...] = ()
    fp4: bool = False

    def regions(self, region: Region) -> tuple[tuple[Region, ...], ...]:
        weight = region
        if self.fp4:
            (c, d) = region[-1]
            weight = (*region[:-1], (c // 2, -(-d // 2)))
        if not self.block:  # one scale for the whole tensor
            return (weight,), (tuple((0, n) for n in self.parts[1].shape),)
        return (weight,), (blocks_of(region, self.block),)

    def dequantize(self, region: Region, blocks: Blocks) -> np.ndarray:
        (weight,), (scale,) = blocks
        if self.fp4:
            c = region[-1][0]
            values = unpack_fp4(weight)[..., c % 2 : c % 2 + region[-1][1] - c]
        else:
            values = fp8_values(weight)
        scales = finite(scale_values(scale), self.parts[1])
        if not self.block:
            values *= scales.reshape(())
            return values
        return scale_blocks(values, scales, region, self.block)

    @property
    def band_rows(self) -> int | None:
        return self.block[0] if self.block else 1

    def dequantize_into(self, region: Region, blocks: Blocks, out: np.ndarray) -> None:
        """As `dequantize` then rounded to `out`'s dtype, in one look-up per element: a block's
        256 possible values (each byte's float times the block's scale, rounded to `out`'s
        dtype: the same arithmetic, once per byte value rather than per element) are tabled
        per block, and each element's byte, offset by its block column's table, picks its value
        in a table of its block row (5x faster than float32 then a cast; bit for bit the same)."""
        (weight,), (scale,) = blocks
        small = self.block and math.prod(self.block) < TABLED  # a table per block would cost what its elements do
        if self.fp4 or small or out.dtype.itemsize not in _BITS:
            super().dequantize_into(region, blocks, out)
            return
        bits = _BITS[out.dtype.itemsize]
        values = _VALUES[weight.dtype]
        scales = finite(scale_values(scale), self.parts[1])
        if not self.block:
            table = (values * scales.reshape(())).astype(out.dtype).view(bits)
            np.take(table, weight.view(np.uint8), out=out.view(bits), mode="clip")
            return
        rows, cols = self.block[-2:]
        (a, b), (c, d) = region[-2:]
        tables = (values * scales[..., None]).astype(out.dtype).view(bits)  # [..., block rows, block cols, 256]
        width = tables.shape[-2] * 256
        index = np.uint16 if width <= 2**16 else np.uint32
        columns = ((np.arange(c, d) // cols - c // cols) * 256).astype(index)
        codes, target = weight.view(np.uint8), out.view(bits)
        for lead in np.ndindex(*codes.shape[:-2]):
            for i in range(tables.shape[-3]):
                top, bottom = max(a, (a // rows + i) * rows) - a, min(b, (a // rows + i + 1) * rows) - a
                picks = codes[(*lead, slice(top, bottom))].astype(index)
                picks += columns
                np.take(tables[(*lead, i)].reshape(width), picks, out=target[(*lead, slice(top, bottom))], mode="clip")

    def describe(self) -> str:
        scale = self.parts[1]
        kind = "fp4 e2m1 (2 per byte)" if self.fp4 else f"fp8 {self.packed.dtype.name.removeprefix('float8_')}"
        grid = "x".join(map(str, self.block[-2:])) + " blocks" if self.block else "one scale"
        return f"{kind}, {grid}, scales {scale.key.rsplit('.', 1)[-1]} {scale.dtype.name}"


@final
class Fp8(Format, methods=("fp8",)):
    """`quant_method: "fp8"` (transformers' FineGrainedFP8Config)."""

    @classmethod
    def find(
        cls,
        config: Mapping[str, Any],
        settings: Mapping[str, Any],
        tensors: Mapping[str, TensorInfo],
        out_dtype: np.dtype,
        read: Callable[[str], np.ndarray],
    ) -> tuple[list[QuantizedInfo], set[str]]:
        block = settings.get("weight_block_size", (128, 128))
        if block is not None and (
            not isinstance(block, (list, tuple))
            or len(block) != 2
            or any(not isinstance(n, int) or isinstance(n, bool) or n < 1 for n in block)
        ):
            raise CheckpointError(
                f"config.json: quantization_config.weight_block_size {quoted(block)} must be two positive integers"
            )
        expert_fp4 = settings.get("expert_dtype", "fp8") == "fp4"
        sources: list[QuantizedInfo] = []
        hidden = {key for key in tensors if key.endswith(ACTIVATION_SCALES)}
        scaled = set()
        for key, scale in tensors.items():
            if not key.endswith(SCALE_SUFFIX):
                continue
            name = key.removesuffix(SCALE_SUFFIX)
            weight = tensors.get(name)
            where = f"{scale.file.name}: tensor {quoted(key, 200)}"
            if weight is None:
                raise CheckpointError(f"{where} scales {quoted(name, 200)}, which the checkpoint lacks")
            scaled.add(name)
            sources.append(_source(weight, scale, block, expert_fp4, out_dtype, where))
        for key, info in tensors.items():
            if info.dtype in FP8 and key not in scaled:
                raise CheckpointError(
                    f"{info.file.name}: tensor {quoted(key, 200)} is {info.dtype.name} but has no "
                    f"{quoted(key + SCALE_SUFFIX, 200)} beside it"
                )
        return sources, hidden


def _source(
    weight: TensorInfo,
    scale: TensorInfo,
    block: Any,
    expert_fp4: bool,
    out_dtype: np.dtype,
    where: str,
) -> Fp8Block:
    """The dequantized tensor `weight` and `scale` stand for, checked against each other."""
    fp4 = weight.dtype in (np.dtype(np.int8), np.dtype(np.uint8))
    if fp4 and not expert_fp4:
        raise CheckpointError(
            f"{weight.file.name}: tensor {quoted(weight.key, 200)} is {weight.dtype.name}: FP4-packed weights "
            'need quantization_config.expert_dtype "fp4"'
        )
    if weight.dtype not in FP8 and not fp4:
        raise CheckpointError(
            f"{weight.file.name}: tensor {quoted(weight.key, 200)} is {weight.dtype.name}, not float8 "
            f"(it has scales {quoted(scale.key, 200)})"
        )
    if scale.dtype not in SCALES:
        raise CheckpointError(f"{where} is {scale.dtype.name}: scales are float32, bfloat16, float16 or E8M0")
    if not weight.shape or (fp4 and len(weight.shape) < 2):
        raise CheckpointError(f"{weight.file.name}: tensor {quoted(weight.key, 200)} is a scalar")
    shape = (*weight.shape[:-1], 2 * weight.shape[-1]) if fp4 else weight.shape
    rank = len(shape)
    if fp4:
        grid = (1,) * (rank - 1) + (32,)
    elif block is None or rank < 2:
        grid = None
    else:
        grid = (1,) * (rank - 2) + tuple(block)
    if grid is None:
        if scale.shape not in ((), (1,)):
            raise CheckpointError(
                f"{where} is {shape_text(scale.shape)}, but one scale for the whole of {quoted(weight.key, 200)} "
                "is [] or [1] (no weight_block_size)"
            )
        grid = ()
    else:
        need = tuple(-(-n // b) for n, b in zip(shape, grid))
        if scale.shape != need:
            blocks = "x".join(map(str, grid[-2:])) + " blocks"
            raise CheckpointError(
                f"{where} is {shape_text(scale.shape)}, but {quoted(weight.key, 200)} "
                f"{shape_text(shape)} in {blocks} needs {shape_text(need)}"
            )
    return Fp8Block(
        weight.key,
        weight.file,
        FLOAT32,
        tuple(shape),
        weight.offset,
        weight.file_id,
        parts=(weight, scale),
        out_dtype=out_dtype,
        block=grid,
        fp4=fp4,
    )
