"""Greedy decoding with a key/value cache: one prefill, then one compiled step per token.

```python
out = generate(model, prompt_ids, max_new_tokens=32, attention_mask=prompt_mask)
# out: [batch, prompt + 32], the prompt (left padding kept) followed by the new tokens,
# token for token what transformers' generate(do_sample=False) gives

cache = model.init_cache(batch, length)                   # the pieces underneath
logits, cache = prefill(model, prompt_ids, cache, attention_mask=prompt_mask)
logits, cache = decode_step(model, logits.argmax(-1), cache)   # compiled once
```
"""

from __future__ import annotations

from typing import Any

import equinox as eqx
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from port.nn._cache import Cache
from port.nn._inputs import batch_first, check_ids, check_like


@eqx.filter_jit
def prefill(
    model: Any, input_ids: Int[Array, "batch seq"], cache: Cache, *, attention_mask: Array | None = None
) -> tuple[Float[Array, "batch vocab"], Cache]:
    """Run the prompt through `model`, filling `cache`; the logits of each prompt's last slot.

    Jitted (`eqx.filter_jit`): it compiles once per prompt and cache shape.

    **Arguments:**

    - `model`: a port decoder (a `Decoder`).
    - `input_ids`: `[batch, seq]` (left-padded when the prompts differ in length, so that
      the last slot is each prompt's last token).
    - `cache`: from `model.init_cache(batch, length)`, `length` at least `seq` plus the
      tokens still to come.
    - `attention_mask`: `input_ids`' shape, 0 on padding; None: no padding.

    **Returns:** `(logits, cache)`: the logits `[batch, vocab]` of the last slot, and the
    cache holding the prompt.

    ```python
    cache = model.init_cache(batch=2, length=36)
    logits, cache = prefill(model, prompt_ids, cache, attention_mask=prompt_mask)  # prompt_ids: [2, 4]
    next_ids = logits.argmax(-1)                                # [2]
    ```
    """
    logits, cache = model(input_ids, attention_mask=attention_mask, cache=cache)
    return logits[:, -1], cache


@eqx.filter_jit
def decode_step(model: Any, token: Int[Array, " batch"], cache: Cache) -> tuple[Float[Array, "batch vocab"], Cache]:
    """One token per sequence through `model`, at the cache's next slot; its logits and the cache.

    Jitted (`eqx.filter_jit`), and the shapes do not change from step to step, so it
    compiles once.

    **Arguments:**

    - `model`: a port decoder (a `Decoder`).
    - `token`: `[batch]`, each sequence's next token.
    - `cache`: the cache from `prefill` or the previous step, with a free slot left.

    **Returns:** `(logits, cache)`: the logits `[batch, vocab]` for the token after
    `token`, and the cache holding `token` too.

    ```python
    logits, cache = prefill(model, prompt_ids, cache, attention_mask=prompt_mask)
    for _ in range(32):
        logits, cache = decode_step(model, logits.argmax(-1), cache)   # logits: [batch, vocab]
    ```
    """
    logits, cache = model(token[:, None], cache=cache)
    return logits[:, -1], cache


def generate(
    model: Any,
    input_ids: Any,
    *,
    max_new_tokens: Any,  # a positive integer: checked here, one line naming it
    attention_mask: Any = None,
    eos_token_id: int | None = None,
    pad_token_id: int = 0,
) -> Int[Array, "batch total"]:
    """Greedy decoding: the prompt followed by `max_new_tokens` tokens, each the argmax.

    **Arguments:**

    - `model`: a port decoder (it has `init_cache`).
    - `input_ids`: `(batch, seq)` or `(seq,)` prompts, left-padded to one length.
    - `max_new_tokens`: how many tokens to add (at least 1).
    - `attention_mask`: `input_ids`' shape, 0 on padding; positions follow it.
    - `eos_token_id`: a sequence that produced it is finished: its later tokens are
      `pad_token_id` (as transformers pads them).

    **Returns:** `[batch, seq + max_new_tokens]` (or `[seq + max_new_tokens]`).
    Raises `ValueError` / `TypeError` naming the argument before anything is compiled.

    ```python
    prompts = np.array([[15, 42, 7, 300], [0, 0, 8, 1]])     # the second left-padded
    out = port.generate(model, prompts, max_new_tokens=32, attention_mask=prompts != 0)
    out[:, 4:]                                                # the 32 new tokens of each
    ```
    """
    if not isinstance(max_new_tokens, (int, np.integer)) or isinstance(max_new_tokens, bool) or max_new_tokens < 1:
        raise ValueError(f"`max_new_tokens` must be a positive integer, got {max_new_tokens!r}")
    if not hasattr(model, "init_cache"):
        raise TypeError(f"`model` must be a port decoder with init_cache, got {type(model).__name__}")
    batched = check_ids(input_ids)
    check_like("attention_mask", attention_mask, input_ids)
    ids, mask = batch_first(batched, input_ids, attention_mask)
    ids = jnp.asarray(ids)
    batch, seq = ids.shape
    cache = model.init_cache(batch, seq + int(max_new_tokens))
    logits, cache = prefill(model, ids, cache, attention_mask=mask)
    finished = jnp.zeros((batch,), bool)
    tokens: list[Array] = []
    for _ in range(int(max_new_tokens)):
        if tokens:
            logits, cache = decode_step(model, tokens[-1], cache)
        token = jnp.argmax(logits, axis=-1).astype(ids.dtype)
        if eos_token_id is not None:
            token = jnp.where(finished, jnp.asarray(pad_token_id, ids.dtype), token)
            finished = finished | (token == eos_token_id)
        tokens.append(token)
    out = jnp.concatenate([ids, jnp.stack(tokens, axis=1)], axis=1)
    return out if batched else out[0]
