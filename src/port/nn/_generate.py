"""Greedy decoding with a key/value cache: one prefill, then one compiled step per token.

```python
out = generate(model, prompt_ids, max_new_tokens=32, attention_mask=prompt_mask)
# out: [batch, prompt + 32], the prompt (left padding kept) followed by the new tokens,
# token for token what transformers' generate(do_sample=False) gives

cache = model.init_cache(batch, length)                   # the pieces underneath
logits, cache = prefill(model, prompt_ids, cache, attention_mask=prompt_mask)
logits, cache = decode_step(model, logits.argmax(-1), cache)   # compiled once

out = generate(t5, input_ids, max_new_tokens=32, attention_mask=mask)   # an encoder-decoder:
# [batch, 1 + 32], the decoder start token then the new tokens (transformers' sequences)
```

An encoder-decoder (a module with `encode`: T5, Whisper) is run as transformers runs it:
the encoder once, then the decoder from its start tokens, one compiled step per token,
with a cache of its self-attention keys and values and of the cross-attention keys and
values computed once from the encoder's output. Such a module provides
`encode(inputs, *, attention_mask=None)`, `init_cache(batch, length, encoded, *,
attention_mask=None)`, `decode(decoder_input_ids, *, cache)` -> `(logits, cache)` and
`decoder_start_token_id`.
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
    decoder_input_ids: Any = None,
) -> Int[Array, "batch total"]:
    """Greedy decoding: the prompt followed by `max_new_tokens` tokens, each the argmax.

    **Arguments:**

    - `model`: a port decoder (it has `init_cache`), or an encoder-decoder (it has
      `encode` too: T5, Whisper).
    - `input_ids`: `(batch, seq)` or `(seq,)` prompts, left-padded to one length; for an
      encoder-decoder, the encoder's inputs (token ids, Whisper's `input_features`),
      padded on either side.
    - `max_new_tokens`: how many tokens to add (at least 1).
    - `attention_mask`: `input_ids`' shape, 0 on padding; positions follow it. For an
      encoder-decoder, the encoder's mask (the cross-attention's too).
    - `eos_token_id`: a sequence that produced it is finished: its later tokens are
      `pad_token_id` (as transformers pads them).
    - `decoder_input_ids`: an encoder-decoder's decoder prompt, `(batch, start)` or
      `(start,)` (Whisper's start-of-transcript, language, task and no-timestamps tokens);
      None: the model's `decoder_start_token_id`. A decoder takes none.

    **Returns:** `[batch, seq + max_new_tokens]` (or `[seq + max_new_tokens]`); for an
    encoder-decoder `[batch, start + max_new_tokens]`, the decoder's prompt then the new
    tokens, as transformers' `generate` returns them.
    Raises `ValueError` / `TypeError` naming the argument before anything is compiled.

    ```python
    prompts = np.array([[15, 42, 7, 300], [0, 0, 8, 1]])     # the second left-padded
    out = port.generate(model, prompts, max_new_tokens=32, attention_mask=prompts != 0)
    out[:, 4:]                                                # the 32 new tokens of each
    ```
    """
    if not isinstance(max_new_tokens, (int, np.integer)) or isinstance(max_new_tokens, bool) or max_new_tokens < 1:
        raise ValueError(f"`max_new_tokens` must be a positive integer, got {max_new_tokens!r}")
    if hasattr(model, "encode") and hasattr(model, "decode"):
        return _generate_seq2seq(
            model, input_ids, int(max_new_tokens), attention_mask, decoder_input_ids, eos_token_id, pad_token_id
        )
    if decoder_input_ids is not None:
        raise TypeError(f"`decoder_input_ids` is for an encoder-decoder; {type(model).__name__} is a decoder")
    if not hasattr(model, "init_cache"):
        raise TypeError(f"`model` must be a port decoder with init_cache, got {type(model).__name__}")
    batched = check_ids(input_ids)
    check_like("attention_mask", attention_mask, input_ids)
    ids, mask = batch_first(batched, input_ids, attention_mask)
    ids = jnp.asarray(ids)
    batch, seq = ids.shape
    cache = model.init_cache(batch, seq + int(max_new_tokens))
    logits, cache = prefill(model, ids, cache, attention_mask=mask)
    step = lambda token, cache: decode_step(model, token, cache)  # noqa: E731
    out = _greedy(step, logits, cache, ids, int(max_new_tokens), eos_token_id, pad_token_id)
    return out if batched else out[0]


def _greedy(step: Any, logits: Array, cache: Any, start: Array, new: int, eos: int | None, pad: int) -> Array:
    """`start` followed by `new` argmax tokens: the first from `logits`, each next from
    `step(token, cache) -> (logits, cache)`; after `eos`, a sequence's tokens are `pad`."""
    finished = jnp.zeros((start.shape[0],), bool)
    tokens: list[Array] = []
    for _ in range(int(new)):
        if tokens:
            logits, cache = step(tokens[-1], cache)
        token = jnp.argmax(logits, axis=-1).astype(start.dtype)
        if eos is not None:
            token = jnp.where(finished, jnp.asarray(pad, start.dtype), token)
            finished = finished | (token == eos)
        tokens.append(token)
    return jnp.concatenate([start, jnp.stack(tokens, axis=1)], axis=1)


@eqx.filter_jit
def _encode(model: Any, inputs: Array, mask: Array | None) -> Array:
    return model.encode(inputs, attention_mask=mask)


@eqx.filter_jit
def _begin(model: Any, encoded: Array, mask: Array | None, start: Array, length: int) -> tuple[Array, Any]:
    """The cache for `length` decoder slots over `encoded`, filled with the decoder's `start`
    tokens; the logits of the last."""
    cache = model.init_cache(start.shape[0], length, encoded, attention_mask=mask)
    logits, cache = model.decode(start, cache=cache)
    return logits[:, -1], cache


@eqx.filter_jit
def _decode_step(model: Any, token: Array, cache: Any) -> tuple[Array, Any]:
    logits, cache = model.decode(token[:, None], cache=cache)
    return logits[:, -1], cache


def _generate_seq2seq(
    model: Any, inputs: Any, new: int, mask: Any, start: Any, eos: int | None, pad: int
) -> Int[Array, "batch total"]:
    """`generate` for an encoder-decoder: the encoder once, then the decoder from `start`."""
    encoded = _encode(model, jnp.asarray(inputs), None if mask is None else jnp.asarray(mask))  # checks the inputs
    batched = encoded.ndim == 3
    if not batched:
        encoded = encoded[None]
        mask = None if mask is None else jnp.asarray(mask)[None]
    batch = encoded.shape[0]
    if start is None:
        start = np.full((batch, 1), model.decoder_start_token_id, np.int32)
    else:
        check_ids(start, name="decoder_input_ids")
        start = np.asarray(start)
        start = start if start.ndim == 2 else start[None]
        if start.shape[0] != batch:
            raise ValueError(f"`decoder_input_ids` has {start.shape[0]} sequences for a batch of {batch}")
    start = jnp.asarray(start)
    logits, cache = _begin(model, encoded, None if mask is None else jnp.asarray(mask), start, start.shape[1] + new)
    out = _greedy(lambda token, cache: _decode_step(model, token, cache), logits, cache, start, new, eos, pad)
    return out if batched else out[0]
