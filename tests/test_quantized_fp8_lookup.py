"""`_fp8`'s fast dequantization pieces equal the plain NumPy they replace, bit for bit.

`fp8_values` (two bytes a look-up) against ml_dtypes' `astype(np.float32)` on every byte of
both float8 dtypes (NaN included), odd lengths and strided views; `scale_blocks` (scales
multiplied in place a block row at a time) against `values * spread(...)` on random regions,
aligned to the blocks or not, of 2-D and stacked weights, FP8's and FP4's block shapes, with
float32, E8M0, subnormal and overflowing scales. tests/test_quantized_fp8.py compares whole
loads with transformers; this reaches the corners a model's weights do not.
"""

import ml_dtypes
import numpy as np
import pytest

from port._sources._quantized._fp8 import fp8_values, scale_blocks, scale_values
from port._sources._quantized._source import blocks_of, spread

FLOAT8 = [ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e5m2]


def same_bits(a: np.ndarray, b: np.ndarray) -> None:
    assert a.dtype == b.dtype == np.float32 and a.shape == b.shape
    np.testing.assert_array_equal(a.view(np.uint32), b.view(np.uint32))


@pytest.mark.parametrize("dtype", FLOAT8)
def test_fp8_values_are_astype_for_every_byte(dtype):
    every = np.arange(256, dtype=np.uint8).view(dtype)
    pairs = np.arange(2**16, dtype=np.uint16).view(np.uint8).view(dtype).reshape(512, 256)
    for weight in (every, every[:-1], every.reshape(16, 16), pairs, pairs[3:200:3, 1:-2], np.empty((0, 4), dtype)):
        same_bits(fp8_values(weight), weight.astype(np.float32))


@pytest.mark.parametrize("block", [(128, 128), (16, 16), (1, 16, 16), (1, 1, 8, 24), (1, 32), (1, 1, 32), (2, 4, 4)])
def test_scale_blocks_is_values_times_spread(block):
    rng = np.random.default_rng(len(block) * 1000 + block[-1])
    for _ in range(60):
        shape = [int(rng.integers(1, 4)) for _ in block[:-2]] + [int(rng.integers(1, 300)) for _ in block[-2:]]
        region = []
        for n in shape:
            a = int(rng.integers(0, n))
            region.append((a, int(rng.integers(a + 1, n + 1))))
        region = tuple(region)
        grid = tuple(b - a for a, b in blocks_of(region, block))
        scales = [
            (rng.standard_normal(grid) * 10.0 ** rng.integers(-40, 38)).astype(np.float32),
            scale_values(rng.integers(0, 255, grid, dtype=np.uint8)),  # E8M0, 2**-127 .. 2**127
            np.where(rng.random(grid) < 0.5, np.float32(2.0**-149), np.float32(3e38)).astype(np.float32),
        ]
        weight = rng.integers(0, 256, tuple(b - a for a, b in region), dtype=np.uint8).view(FLOAT8[0])
        for scale in scales:
            values = weight.astype(np.float32)
            with np.errstate(over="ignore", invalid="ignore"):
                expected = values * spread(scale, region, block)
                same_bits(scale_blocks(values.copy(), scale, region, block), expected)


@pytest.mark.parametrize("dtype", FLOAT8)
@pytest.mark.parametrize("block", [(128, 128), (64, 64), (1, 64, 128)])
def test_dequantize_into_rounds_once_to_the_buffer_as_a_cast_of_dequantize(dtype, block):
    """`Fp8Block.dequantize_into` (a table of each block's 256 values) equals `dequantize` (float32)
    cast to the buffer's dtype, every byte included (NaN too), on regions aligned to the blocks
    or not (tests/test_quantized_fp8.py compares `dequantize` with transformers')."""
    from pathlib import Path

    from port._sources._checkpoint import TensorInfo
    from port._sources._quantized._fp8 import _source

    rng = np.random.default_rng(block[-1])
    shape = (*([3] if len(block) == 3 else []), 200, 300)
    weight = rng.integers(0, 256, shape, dtype=np.uint8).view(dtype)
    grid = tuple(-(-n // b) for n, b in zip(shape[-2:], block[-2:]))
    scales = np.exp(rng.normal(-6, 2, (*shape[:-2], *grid))).astype(np.float32)
    info = _source(
        TensorInfo("w.weight", Path("m.safetensors"), weight.dtype, shape, 0),
        TensorInfo("w.weight_scale_inv", Path("m.safetensors"), scales.dtype, scales.shape, 0),
        block[-2:],
        False,
        np.dtype(ml_dtypes.bfloat16),
        "m.safetensors",
    )
    lead = tuple((0, n) for n in shape[:-2])
    for rows, cols in [((0, 200), (0, 300)), ((64, 128), (128, 256)), ((5, 199), (3, 297)), ((70, 71), (250, 251))]:
        region = (*lead, rows, cols)
        codes = weight[tuple(slice(a, b) for a, b in region)]
        covering = scales[tuple(slice(a, b) for a, b in info.regions(region)[1][0])]
        expected = info.dequantize(region, ((codes,), (covering,)))
        for out_dtype, bits in ((np.float32, np.uint32), (ml_dtypes.bfloat16, np.uint16), (np.float16, np.uint16)):
            out = np.empty(codes.shape, out_dtype)
            info.dequantize_into(region, ((codes,), (covering,)), out)
            np.testing.assert_array_equal(out.view(bits), expected.astype(out_dtype).view(bits))
