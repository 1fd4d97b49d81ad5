"""The inputs of a model's `__call__`: shapes, dtypes and the optional batch axis.

Shared by the model modules, so every model accepts the same shapes and reports a bad
input the same way: one line naming the argument, the shape it must have and what it
got. `input_ids` is `(batch, seq)` or, without the batch axis, `(seq,)`; per-token
arguments (an attention mask, token type ids) have exactly its shape. `pixel_values`
(image models) is `(batch, channels, height, width)` or `(channels, height, width)`.
The checks read static shapes and dtypes only, so they run under `jax.jit` /
`eqx.filter_jit` too.

```python
batched = check_ids(input_ids, limit=("n_positions", 1024))  # True: (batch, seq)
check_like("attention_mask", attention_mask, input_ids)        # None passes
batched = check_pixels(pixel_values, channels=3, size=(224, 224))
```
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp

SHAPES = {2: "(batch, seq)", 1: "(seq,)"}
"""The accepted ranks of `input_ids` and how messages name them."""


def _shape(value: Any) -> tuple[int, ...]:
    return tuple(jnp.shape(value))


def check_ids(input_ids: Any, *, limit: tuple[str, int] | None = None, name: str = "input_ids") -> bool:
    """Check `input_ids` is integer `(batch, seq)` or `(seq,)`; return whether it is batched.

    `limit` is a config key and its value bounding the sequence length, e.g.
    `("max_position_embeddings", 512)`. Raises `ValueError` for a bad shape or a
    sequence over the limit, `TypeError` for a non-integer dtype; messages call the
    argument `name` (`decoder_input_ids`).

    ```python
    check_ids(jnp.zeros((2, 8), jnp.int32))  # True
    check_ids(jnp.zeros((8,), jnp.int32))    # False
    check_ids(jnp.zeros((2, 3, 4), jnp.int32))
    # ValueError: `input_ids` must have shape (batch, seq) or (seq,), got (2, 3, 4)
    ```
    """
    shape = _shape(input_ids)
    if len(shape) not in SHAPES:
        raise ValueError(f"`{name}` must have shape {SHAPES[2]} or {SHAPES[1]}, got {shape}")
    dtype = jnp.result_type(input_ids)
    if not jnp.issubdtype(dtype, jnp.integer):
        raise TypeError(f"`{name}` must have an integer dtype, got {dtype}")
    if limit is not None and shape[-1] > limit[1]:
        raise ValueError(f"`{name}`: sequence length {shape[-1]} exceeds {limit[0]} ({limit[1]})")
    return len(shape) == 2


def check_like(name: str, value: Any | None, input_ids: Any, *, integer: bool = False) -> None:
    """Check the per-token argument `name` has exactly `input_ids`' shape (None passes).

    With `integer`, its dtype must be an integer type (`TypeError` otherwise); without,
    any boolean, integer or floating dtype will do.

    ```python
    ids = jnp.zeros((2, 8), jnp.int32)
    check_like("attention_mask", jnp.ones((8,), jnp.int32), ids)
    # ValueError: `attention_mask` must have shape (batch, seq) = (2, 8) like `input_ids`, got (8,)
    ```
    """
    if value is None:
        return
    expected, shape = _shape(input_ids), _shape(value)
    if shape != expected:
        raise ValueError(f"`{name}` must have shape {SHAPES[len(expected)]} = {expected} like `input_ids`, got {shape}")
    dtype = jnp.result_type(value)
    kinds = (jnp.integer,) if integer else (jnp.bool_, jnp.integer, jnp.floating)
    if not any(jnp.issubdtype(dtype, kind) for kind in kinds):
        expected_dtype = "an integer" if integer else "a boolean, integer or floating"
        raise TypeError(f"`{name}` must have {expected_dtype} dtype, got {dtype}")


PIXEL_SHAPES = {4: "(batch, channels, height, width)", 3: "(channels, height, width)"}
"""The accepted ranks of `pixel_values` and how messages name them."""


def check_pixels(
    pixel_values: Any, *, channels: int, size: tuple[int, int] | None, patch: tuple[int, int] = (1, 1)
) -> bool:
    """Check floating `pixel_values` of `channels` x `size` (height, width); return whether batched.

    `(batch, channels, height, width)` is batched, `(channels, height, width)` not.
    `size` None takes any image of at least one `patch` (a model that interpolates its
    position embeddings). Raises `ValueError` for another rank, channel count or image
    size (one line naming config.json's `num_channels`, `image_size` or `patch_size`),
    `TypeError` for a non-floating dtype.

    ```python
    check_pixels(jnp.zeros((2, 3, 224, 224)), channels=3, size=(224, 224))  # True
    check_pixels(jnp.zeros((3, 224, 224)), channels=3, size=(224, 224))     # False
    check_pixels(jnp.zeros((2, 3, 256, 256)), channels=3, size=(224, 224))
    # ValueError: `pixel_values`: image of 256x256 pixels, but config.json's image_size is 224x224
    check_pixels(jnp.zeros((3, 10, 20)), channels=3, size=None, patch=(14, 14))
    # ValueError: `pixel_values`: image of 10x20 pixels, smaller than config.json's patch_size 14x14
    ```
    """
    shape = _shape(pixel_values)
    if len(shape) not in PIXEL_SHAPES:
        raise ValueError(f"`pixel_values` must have shape {PIXEL_SHAPES[4]} or {PIXEL_SHAPES[3]}, got {shape}")
    dtype = jnp.result_type(pixel_values)
    if not jnp.issubdtype(dtype, jnp.floating):
        raise TypeError(f"`pixel_values` must have a floating dtype, got {dtype}")
    c, h, w = shape[-3:]
    if c != channels:
        raise ValueError(
            f"`pixel_values` has {c} channels (axis {len(shape) - 3} of {shape}), "
            f"but config.json's num_channels is {channels}"
        )
    if size is None and (h < patch[0] or w < patch[1]):
        raise ValueError(
            f"`pixel_values`: image of {h}x{w} pixels, smaller than config.json's patch_size {patch[0]}x{patch[1]}"
        )
    if size is not None and (h, w) != tuple(size):
        raise ValueError(
            f"`pixel_values`: image of {h}x{w} pixels, but config.json's image_size is "
            f"{size[0]}x{size[1]} (position embeddings are not interpolated)"
        )
    return len(shape) == 4


def batch_first(batched: bool, *args: Any) -> tuple[Any, ...]:
    """`args` with a batch axis: unchanged when `batched`, else each given a batch of one (None passes)."""
    if batched:
        return args
    return tuple(None if a is None else jnp.asarray(a)[None] for a in args)
