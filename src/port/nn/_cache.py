"""The key/value cache of a decoder: prefill once, then one token per step.

A `Cache` holds every layer's keys and values in one buffer of a fixed length, so a
jitted decode step has the same shapes at every step and compiles once. Slots fill
from the left: a batch of prompts is padded to one length (left padding keeps each
prompt's last token in the same slot), `mask` says which slots hold real tokens and
`next_position` each sequence's next position (positions follow the mask, as
transformers' `generate` computes them).

```python
cache = model.init_cache(batch=2, length=64)           # every decoder family has it
logits, cache = model(prompt_ids, attention_mask=prompt_mask, cache=cache)   # prefill
logits, cache = model(next_ids[:, None], cache=cache)                         # one step
```
"""

from __future__ import annotations

from typing import Any, final

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int


@final
class Cache(eqx.Module):
    """Keys and values of every layer, `[layers, batch, length, kv_heads, head_dim]`.

    **Fields:**

    - `keys`, `values`: `[layers, batch, length, kv_heads, head_dim]` each.
    - `mask`: `[batch, length]`, the slots holding real tokens.
    - `next_position`: `[batch]`, the position the next token of each sequence takes.
    - `length`: a scalar, how many slots are filled (the same for the whole batch).

    Made empty by `Cache.empty` (or a decoder's `init_cache`); `prepare` and the layers
    fill it, and a decoder called with `cache=` returns the filled one.

    ```python
    cache = Cache.empty(layers=2, batch=3, length=64, kv_heads=2, head_dim=16, dtype=jnp.float32)
    cache.keys.shape                     # (2, 3, 64, 2, 16)
    cache.size                           # 64 slots; cache.length is 0 until a call fills some
    logits, cache = model(ids, attention_mask=mask, cache=cache)   # ids: [3, seq]
    ```
    """

    keys: Any  # [layers, batch, length, kv_heads, head_dim], or a dict of them by layer group
    values: Any
    mask: Bool[Array, "batch length"]
    next_position: Int[Array, " batch"]
    length: Int[Array, ""]
    states: Any = None  # recurrent layers' states by layer group (None: none)

    @classmethod
    def empty(
        cls,
        *,
        layers: int,
        batch: int,
        length: int,
        kv_heads: int,
        head_dim: int,
        dtype: Any,
        value_dim: int | None = None,
    ) -> Cache:
        """An empty cache of `length` slots per sequence.

        **Arguments:** the model's `layers`, `kv_heads`, `head_dim` and activation
        `dtype`; the `batch` size and the `length` (prompt plus every new token);
        `value_dim`, the values' head size where it is not the keys' (multi-head latent
        attention).

        **Returns:** a `Cache` of zeros, no slot filled. Raises `ValueError` when `batch`
        or `length` is not a positive integer.
        """
        check_sizes(batch, length)
        shape = (layers, batch, length, kv_heads, head_dim)
        value_shape = shape if value_dim is None else (*shape[:-1], value_dim)
        return cls.of(jnp.zeros(shape, dtype), jnp.zeros(value_shape, dtype), batch=batch, length=length)

    @classmethod
    def of(cls, keys: Any, values: Any, states: Any = None, *, batch: int, length: int) -> Cache:
        """An empty cache over buffers a model made itself: per layer group, or with
        recurrent states (a hybrid model's `init_cache`).

        **Arguments:** `keys`, `values` (zeros, `[layers, batch, length, ...]` each, or
        dicts of them by layer group), `states` (zeros, by layer group; None: none), and
        the `batch` and `length` they were made for.

        ```python
        kv = lambda n: jnp.zeros((n, batch, length, kv_heads, head_dim))
        cache = Cache.of({"full": kv(12)}, {"full": kv(12)}, {"linear": (conv, recurrent)},
                         batch=batch, length=length)
        ```
        """
        check_sizes(batch, length)
        return cls(
            keys=keys,
            values=values,
            mask=jnp.zeros((batch, length), bool),
            next_position=jnp.zeros((batch,), jnp.int32),
            length=jnp.zeros((), jnp.int32),
            states=states,
        )

    @property
    def size(self) -> int:
        """The number of slots per sequence."""
        return self.mask.shape[1]


def check_sizes(batch: Any, length: Any) -> None:
    """Raise `ValueError` unless `batch` and `length` are positive integers."""
    for name, value in (("batch", batch), ("length", length)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"`{name}` must be a positive integer, got {value!r}")


def write(
    buffer: Float[Array, "batch length kv_heads head_dim"],
    new: Float[Array, "batch seq kv_heads head_dim"],
    index: Int[Array, ""],
) -> Float[Array, "batch length kv_heads head_dim"]:
    """`buffer` with `new` written at slots `index, index + 1, ...` (one layer's keys or values)."""
    return jax.lax.dynamic_update_slice_in_dim(buffer, new.astype(buffer.dtype), index, axis=1)
