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
