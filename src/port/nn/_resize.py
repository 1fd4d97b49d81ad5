"""Bicubic resizing as PyTorch's `torch.nn.functional.interpolate` does it, to the last bit of its weights.

Vision encoders that take images of another size than they were trained on resize their
learned position table (DINOv2's `interpolate_pos_encoding`) with torch's bicubic
`interpolate(..., size=..., mode="bicubic", align_corners=False)`. `jax.image.resize`'s
"cubic" is Keys' kernel with a = -0.5 and does not match it. Here each axis gets the
weights matrix torch's kernel uses, and the resize is two matrix products:

- `antialias=False`: torch's `upsample_bicubic2d`: the cubic convolution with a = -0.75,
  source coordinate `(i + 0.5) * in / out - 0.5`, four taps, indices past the edge
  clamped to it (the edge pixel repeated).
- `antialias=True`: torch's `_upsample_bicubic2d_aa` (PIL's): the cubic with a = -0.5,
  its support stretched by `in / out` when shrinking, taps past the edge dropped and the
  rest normalised to sum to one.

The weights are computed in float64 with NumPy from the static sizes (no tracing) and
applied in float32 at the highest matmul precision.

```python
import jax.numpy as jnp
from port.nn._resize import bicubic_resize, bicubic_weights

table = jnp.zeros((16, 16, 64))                         # (rows, columns, features)
bicubic_resize(table, (24, 20)).shape                   # (24, 20, 64)
bicubic_resize(table, (8, 8), antialias=True).shape     # (8, 8, 64)
bicubic_weights(16, 24).shape                           # (24, 16): output by input
```
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float

TORCH_A = -0.75
"""The cubic convolution's `a` in torch's bicubic without antialiasing (OpenCV's)."""
ANTIALIAS_A = -0.5
"""The cubic convolution's `a` in torch's antialiased bicubic (PIL's)."""


def _cubic(x: np.ndarray, a: float) -> np.ndarray:
    """Keys' cubic convolution kernel with parameter `a`, at distances `x`."""
    x = np.abs(x)
    near = ((a + 2) * x - (a + 3)) * x * x + 1
    far = ((a * x - 5 * a) * x + 8 * a) * x - 4 * a
    return np.where(x < 1, near, np.where(x < 2, far, 0.0))


def _plain(size_in: int, size_out: int) -> np.ndarray:
    """torch's `upsample_bicubic2d` (align_corners=False) as a [size_out, size_in] matrix."""
    source = (np.arange(size_out) + 0.5) * (size_in / size_out) - 0.5
    start = np.floor(source)
    t = source - start
    taps = np.stack([_cubic(t + 1, TORCH_A), _cubic(t, TORCH_A), _cubic(1 - t, TORCH_A), _cubic(2 - t, TORCH_A)], 1)
    weights = np.zeros((size_out, size_in))
    rows = np.arange(size_out)
    for k in range(4):  # the edge pixel takes the weight of every tap past it
        np.add.at(weights, (rows, np.clip(start.astype(np.int64) - 1 + k, 0, size_in - 1)), taps[:, k])
    return weights


def _antialiased(size_in: int, size_out: int) -> np.ndarray:
    """torch's `_upsample_bicubic2d_aa` (align_corners=False) as a [size_out, size_in] matrix."""
    scale = size_in / size_out
    support = 2.0 * scale if scale >= 1.0 else 2.0
    stretch = 1.0 / scale if scale >= 1.0 else 1.0
    weights = np.zeros((size_out, size_in))
    for i in range(size_out):
        center = scale * (i + 0.5)
        first = max(math.trunc(center - support + 0.5), 0)
        last = min(math.trunc(center + support + 0.5), size_in)
        taps = _cubic((np.arange(first, last) - center + 0.5) * stretch, ANTIALIAS_A)
        total = taps.sum()
        weights[i, first:last] = taps / total if total != 0 else taps
    return weights


def bicubic_weights(size_in: int, size_out: int, *, antialias: bool = False) -> np.ndarray:
    """The [size_out, size_in] float64 matrix of torch's bicubic resize of one axis.

    **Arguments:**

    - `size_in`, `size_out`: the axis' length before and after (positive).
    - `antialias`: torch's `antialias=True` (see the module's docstring).

    **Returns:** the matrix `W` such that `W @ x` resizes `x`'s first axis.

    ```python
    bicubic_weights(4, 4)           # the identity: same size, nothing moves
    bicubic_weights(4, 8).sum(1)    # ones: each output is a weighted mean
    ```
    """
    return _antialiased(size_in, size_out) if antialias else _plain(size_in, size_out)


def bicubic_resize(
    table: Float[Array, "height width dim"], size: tuple[int, int], *, antialias: bool = False
) -> Float[Array, "_height _width dim"]:
    """`table` resized to `size` (rows, columns) as torch's bicubic `interpolate` resizes (channels, rows, columns).

    **Arguments:**

    - `table`: `[rows, columns, features]`, channels last.
    - `size`: the new (rows, columns).
    - `antialias`: torch's `antialias=True`.

    **Returns:** `[size[0], size[1], features]`, computed in float32 and returned in `table`'s
    dtype, as DINOv2 interpolates in float32.

    ```python
    bicubic_resize(jnp.zeros((4, 4, 8)), (6, 5)).shape   # (6, 5, 8)
    ```
    """
    rows = jnp.asarray(bicubic_weights(table.shape[0], size[0], antialias=antialias), jnp.float32)
    columns = jnp.asarray(bicubic_weights(table.shape[1], size[1], antialias=antialias), jnp.float32)
    out = jnp.einsum("ia,jb,abf->ijf", rows, columns, table.astype(jnp.float32), precision=jax.lax.Precision.HIGHEST)
    return out.astype(table.dtype)
