"""From a decoder's call arguments to what its layers need: positions and attention masks.

`prepare` checks the arguments (static shapes, so it works under `jax.jit` and raises
before anything compiles), adds the batch axis when the ids have none, and builds:

- `positions` `[batch, seq]`: given, or following the padding mask as transformers'
  `generate` computes them (`cumsum(mask) - 1`, 0 on padding), or restarting at 0 in
  each packed segment, or `0, 1, ...` (after the cache's tokens, with a cache);
- `mask` `[batch, seq, keys]`: which keys each query sees: causal (decoders), never a
  padding key, never another segment, and with a cache the filled slots only;
  `sliding` the same within a window of the query's slot (slots, as transformers
  counts them), for layers with sliding-window attention.

```python
tokens = prepare(input_ids, attention_mask=mask, window=4096)
x = embed[tokens.ids]                          # [batch, seq, embd]
cos, sin = rope.angles(tokens.positions, x.dtype)
...                                            # layers use tokens.mask / tokens.sliding
return tokens.output(logits)                   # the batch axis dropped if the ids had none
```
"""

from __future__ import annotations

import dataclasses
from typing import Any, final

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Int

from port.nn._cache import Cache
from port.nn._inputs import batch_first, check_ids, check_like


@final
class Tokens(eqx.Module):
    """A decoder call's tokens, batch-first, with their positions and masks (see `prepare`).

    **Fields:**

    - `ids`: `[batch, seq]`, the ids with a batch axis.
    - `positions`: `[batch, seq]`, int32.
    - `mask`: `[batch, seq, keys]`, True where a query may see a key; `keys` is `seq`, or
      the cache's slots with a cache.
    - `sliding`: the same, within the sliding window (None without a `window`, or when
      not causal).
    - `cache`: the cache with this call's slots marked (its `mask`, `next_position` and
      `length`), its keys and values not yet written (`output` writes them); None
      without one.
    - `batched`: whether `input_ids` had a batch axis.

    `index` is the first slot this call's tokens take in the cache; `output(out, keys,
    values)` gives the call's result.

    ```python
    tokens = prepare(jnp.array([[0, 0, 5, 6]]), attention_mask=jnp.array([[0, 0, 1, 1]]))
    tokens.positions             # [[0, 0, 0, 1]]: they follow the mask
    tokens.mask.shape            # (1, 4, 4): causal, never a padding key
    tokens.output(logits)        # logits as they are: the ids had a batch axis
    ```
    """

    ids: Int[Array, "batch seq"]
    positions: Int[Array, "batch seq"]
    mask: Bool[Array, "batch seq keys"]
    sliding: Bool[Array, "batch seq keys"] | None
    cache: Cache | None  # the cache with this call's slots marked, its keys not yet written
    batched: bool = eqx.field(static=True)

    @property
    def index(self) -> Int[Array, ""] | None:
        """The first slot this call's tokens take in the cache (None without one)."""
        return None if self.cache is None else self.cache.length - self.ids.shape[1]

    def output(self, out: Array, keys: Any = None, values: Any = None, states: Any = None) -> Any:
        """`out` without the batch axis if the ids had none; with a cache, `(out, cache)`,
        the cache holding the layers' new `keys` and `values` (and recurrent `states`,
        for a model that has them)."""
        out = out if self.batched else out[0]
        if self.cache is None:
            return out
        return out, dataclasses.replace(self.cache, keys=keys, values=values, states=states)


def prepare(
    input_ids: Any,
    *,
    attention_mask: Any = None,
    positions: Any = None,
    segment_ids: Any = None,
    cache: Cache | None = None,
    causal: bool = True,
    window: int | None = None,
    limit: tuple[str, int] | None = None,
) -> Tokens:
    """Check a call's arguments and build its `Tokens`.

    **Arguments:**

    - `input_ids`: integer `(batch, seq)` or `(seq,)`.
    - `attention_mask`: `input_ids`' shape; nonzero/True for real tokens, 0 for padding
      (left or right).
    - `positions`: `input_ids`' shape, integer; overrides the default positions.
    - `segment_ids`: `input_ids`' shape, integer; packed sequences: a token attends only
      to tokens with the same id, and default positions restart in each segment.
    - `cache`: a `Cache`; this call's tokens take its next slots.
    - `causal`: False for an encoder (every token sees every unmasked token).
    - `window`: the sliding window, in slots, of the layers that slide (None: none).
    - `limit`: a config key and value bounding the sequence length (learned position
      tables), e.g. `("n_positions", 1024)`; not checked with a `cache` (`init_cache`
      bounds its length).

    **Returns:** `Tokens`. Raises `ValueError` / `TypeError` naming the argument for a
    bad shape or dtype, a cache of another batch size or too short for the tokens.

    ```python
    tokens = prepare(jnp.array([5, 6, 7]))         # (seq,): run as a batch of one
    tokens.ids.shape, tokens.batched               # (1, 3), False
    tokens.positions                               # [[0, 1, 2]]
    tokens = prepare(input_ids, attention_mask=mask, cache=cache, window=4096)
    x, kv = run_layers(blocks, embed[tokens.ids], tokens, sliding=sliding_layers)
    ```
    """
    batched = check_ids(input_ids, limit=None if cache is not None else limit)
    check_like("attention_mask", attention_mask, input_ids)
    check_like("positions", positions, input_ids, integer=True)
    check_like("segment_ids", segment_ids, input_ids, integer=True)
    ids, attention_mask, positions, segment_ids = batch_first(
        batched, input_ids, attention_mask, positions, segment_ids
    )
    ids = jnp.asarray(ids)
    batch, seq = ids.shape
    valid = jnp.ones((batch, seq), bool) if attention_mask is None else jnp.asarray(attention_mask) != 0

    if cache is not None:
        if not isinstance(cache, Cache):
            raise TypeError(f"`cache` must be a port.nn.Cache (from model.init_cache), got {type(cache).__name__}")
        if segment_ids is not None:
            raise ValueError("`segment_ids` cannot be used with `cache` (packed sequences are for training)")
        if cache.mask.shape[0] != batch:
            raise ValueError(f"`cache` holds a batch of {cache.mask.shape[0]}, but `input_ids` has {batch}")
        if seq > cache.size:
            raise ValueError(f"`cache` has {cache.size} slots, too few for {seq} tokens")
        start = cache.length
        start = eqx.error_if(start, start + seq > cache.size, "`cache` is full: too few slots for these tokens")
        offset = cache.next_position[:, None]
        key_valid = jax.lax.dynamic_update_slice_in_dim(cache.mask, valid, start, axis=1)
        q_slot = start + jnp.arange(seq)
        k_slot = jnp.arange(cache.size)
        cache = eqx.tree_at(
            lambda c: (c.mask, c.next_position, c.length),
            cache,
            (key_valid, cache.next_position + valid.sum(axis=-1).astype(jnp.int32), start + seq),
        )
    else:
        offset = jnp.zeros((batch, 1), jnp.int32)
        key_valid = valid
        q_slot = k_slot = jnp.arange(seq)

    if positions is None:
        if segment_ids is not None:
            positions = _segment_positions(jnp.asarray(segment_ids))
        elif attention_mask is not None:
            positions = jnp.where(valid, offset + jnp.cumsum(valid, axis=-1) - 1, 0)
        else:
            positions = offset + jnp.arange(seq)
    positions = jnp.asarray(positions).astype(jnp.int32)

    mask = jnp.broadcast_to(key_valid[:, None, :], (batch, seq, k_slot.shape[0]))
    if segment_ids is not None:
        segments = jnp.asarray(segment_ids)
        mask = mask & (segments[:, :, None] == segments[:, None, :])
    sliding = None
    if causal:
        mask = mask & (k_slot[None, :] <= q_slot[:, None])
        if window is not None:
            sliding = mask & (k_slot[None, :] > q_slot[:, None] - window)
    return Tokens(ids=ids, positions=positions, mask=mask, sliding=sliding, cache=cache, batched=batched)


def _segment_positions(segments: Int[Array, "batch seq"]) -> Int[Array, "batch seq"]:
    """Each token's index within its run of equal segment ids."""
    seq = segments.shape[-1]
    index = jnp.arange(seq)
    change = jnp.concatenate([jnp.ones_like(segments[:, :1], bool), segments[:, 1:] != segments[:, :-1]], axis=-1)
    start = jax.lax.cummax(jnp.where(change, index, 0), axis=1)
    return index - start
