"""What every decoder-only language model shares: its call, its inputs and its cache.

`Decoder` is an abstract Equinox module (Equinox's abstract/final pattern): a family
defines its fields and `logits(tokens, remat)`, and names its sizes; the call
signature, the input checks, the compute dtype, the masks and positions and the cache
come from here, so every family takes exactly the same arguments.

```python
class MyLM(Decoder):
    embed: Array
    blocks: Block
    config: MyConfig = eqx.field(static=True)   # num_hidden_layers, num_key_value_heads, head_dim

    def logits(self, tokens, remat):
        x = self.embed[tokens.ids]
        x, kv = run_layers(self.blocks, x, tokens, remat=remat)
        return x @ self.embed.T, kv

logits = MyLM(...)(input_ids, attention_mask=mask)     # the call every decoder takes
```
"""

from __future__ import annotations

import abc
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
from jax.typing import ArrayLike
from jaxtyping import Array, Float

from port.nn._cache import Cache
from port.nn._precision import cast
from port.nn._tokens import Tokens, prepare


class Decoder(eqx.Module):
    """A decoder-only language model: `model(input_ids, *, attention_mask=None, positions=None,
    segment_ids=None, cache=None, dtype=None, remat=None)`.

    Abstract: a family subclasses it, and its own constructor makes the fields.

    **Fields:**

    - `config`: the family's config (an `eqx.AbstractVar`; families declare it as a
      static field), read by `cache_sizes` and `window`.

    **Arguments of the call:** (all but `input_ids` keyword-only and optional)

    - `input_ids`: `(batch, seq)`, or `(seq,)` for one sequence (run as a batch of one).
    - `attention_mask`: 0 on padding (left or right); positions then follow the mask as
      transformers' `generate` computes them.
    - `positions`: explicit positions, `input_ids`' shape.
    - `segment_ids`: packed sequences; attention never crosses a segment and positions
      restart in each.
    - `cache`: a `Cache` from `init_cache`; the call then returns `(logits, cache)`.
    - `dtype`: the compute dtype (bfloat16 compute on float32 parameters).
    - `remat`: recompute each layer in the backward pass, as `port.nn.scan`'s `remat`.

    **Returns:** logits `[batch, seq, vocab]` (`[seq, vocab]` for `(seq,)` ids); with a
    `cache`, `(logits, cache)`. Raises `ValueError` / `TypeError` naming the argument for
    a bad shape or dtype; the checks read static shapes, so they run while tracing,
    before anything compiles.

    A family has a `config` field and defines `logits(tokens, remat)`; where its config
    does not use transformers' names, it overrides `cache_sizes` (and `window`); a learned
    position table sets `position_limit`.

    ```python
    class MyLM(Decoder):
        embed: Array
        blocks: Block                               # stacked, run by run_layers
        config: MyConfig = eqx.field(static=True)   # num_hidden_layers, num_key_value_heads, head_dim

        def logits(self, tokens, remat):
            x, kv = run_layers(self.blocks, self.embed[tokens.ids], tokens, remat=remat)
            return x @ self.embed.T, kv

    model = MyLM(...)
    logits = model(input_ids, attention_mask=mask)            # input_ids: [2, seq] -> [2, seq, vocab]
    logits, cache = model(input_ids, attention_mask=mask, cache=model.init_cache(batch=2, length=64))
    ```
    """

    config: eqx.AbstractVar[Any]

    @property
    def cache_sizes(self) -> tuple[int, int, int]:
        """`(layers, kv_heads, head_dim)` of the key/value cache. By default the config's
        `num_hidden_layers`, `num_key_value_heads` (else `num_attention_heads`) and `head_dim`:
        transformers' names; a family that names them otherwise overrides this."""
        c = self.config
        return c.num_hidden_layers, getattr(c, "num_key_value_heads", None) or c.num_attention_heads, c.head_dim

    @property
    def window(self) -> int | None:
        """The sliding window of the layers that slide, in slots (None: no layer slides); by
        default the config's `sliding_window`, if it has one."""
        return getattr(self.config, "sliding_window", None)

    @property
    def position_limit(self) -> tuple[str, int] | None:
        """A learned position table's config key and size, bounding the positions (None: none)."""
        return None

    @abc.abstractmethod
    def logits(self, tokens: Tokens, remat: Any) -> tuple[Array, tuple[Any, ...]]:
        """The logits for prepared `tokens`, and what `tokens.output` takes after them: every
        layer's keys and values (from `run_layers`), or keys, values and recurrent states
        (from `run_groups`)."""

    def init_cache(self, batch: int, length: int, dtype: Any = None) -> Cache:
        """An empty key/value cache for `batch` sequences of up to `length` tokens, in `dtype`
        (default: the parameters' floating dtype)."""
        if self.position_limit is not None and isinstance(length, int) and length > self.position_limit[1]:
            name, size = self.position_limit
            raise ValueError(f"`length` {length} exceeds {name} ({size}): the model has no positions past it")
        if dtype is None:
            floating = [leaf for leaf in jax.tree.leaves(self) if eqx.is_inexact_array(leaf)]
            dtype = floating[0].dtype if floating else jnp.float32
        layers, kv_heads, head_dim = self.cache_sizes
        return Cache.empty(layers=layers, batch=batch, length=length, kv_heads=kv_heads, head_dim=head_dim, dtype=dtype)

    def __call__(
        self,
        input_ids: ArrayLike,  # integer (batch, seq) or (seq,): checked by `prepare`, which names it
        *,
        attention_mask: Any = None,
        positions: Any = None,
        segment_ids: Any = None,
        cache: Cache | None = None,
        dtype: Any = None,
        remat: Any = None,
    ) -> Float[Array, "*batch seq vocab"] | tuple[Float[Array, "*batch seq vocab"], Cache]:
        tokens = prepare(
            input_ids,
            attention_mask=attention_mask,
            positions=positions,
            segment_ids=segment_ids,
            cache=cache,
            window=self.window,
            limit=self.position_limit,
        )
        logits, kv = cast(self, dtype).logits(tokens, remat)
        return tokens.output(logits, *kv)
