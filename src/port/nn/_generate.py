"""Greedy or sampled decoding with a key/value cache: one prefill, then one compiled step per token.

```python
out = generate(model, prompt_ids, max_new_tokens=32, attention_mask=prompt_mask)
# out: [batch, prompt + 32], the prompt (left padding kept) followed by the new tokens,
# token for token what transformers' generate(do_sample=False) gives
out = generate(model, prompt_ids, max_new_tokens=32, attention_mask=prompt_mask,
               key=jax.random.key(0), temperature=0.7, top_p=0.9, eos_token_id=[2, 7])
# sampled: transformers' processors (port/nn/_sampling.py), a draw per token; the same key,
# the same tokens

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

from typing import Any, final

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Float, Int

from port.nn._cache import Cache
from port.nn._inputs import batch_first, check_ids, check_like
from port.nn._sampling import Sampling, sampling


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
    key: Any = None,  # the sampling arguments are checked here, one line naming each
    temperature: Any = None,
    top_k: Any = None,
    top_p: Any = None,
    min_p: Any = None,
    repetition_penalty: Any = None,
    eos_token_id: Any = None,  # an id or a list of ids
    pad_token_id: Any = 0,
    attention_mask: Any = None,
    decoder_input_ids: Any = None,
) -> Int[Array, "batch total"]:
    """The prompt followed by `max_new_tokens` tokens: greedy, or sampled with `key`.

    Without `key`, each token is the argmax (transformers' `do_sample=False`); with one,
    it is drawn (`jax.random.categorical`) from the logits after transformers' processors,
    in its order: `repetition_penalty`, `temperature`, `top_k`, `top_p`, `min_p`
    (`port.nn.process_logits`). As in transformers, the repetition penalty applies to
    greedy decoding too, and the other four are for sampling only (given without `key`:
    a `ValueError`). Unlike transformers' `GenerationConfig` (`top_k=50`), nothing is
    filtered by default: pass `top_k=50` to sample as its defaults do.

    Each decode step (model, processors, draw and key split) is one jitted function whose
    shapes do not change, so it compiles once; the settings are traced, so another
    temperature or key does not recompile (another `top_k` does: `jax.lax.top_k` takes a
    static k).

    **Arguments:**

    - `model`: a port decoder (it has `init_cache`), or an encoder-decoder (it has
      `encode` too: T5, Whisper).
    - `input_ids`: `(batch, seq)` or `(seq,)` prompts, left-padded to one length; for an
      encoder-decoder, the encoder's inputs (token ids, Whisper's `input_features`),
      padded on either side.
    - `max_new_tokens`: how many tokens to add (at least 1).
    - `key`: a `jax.random.key`: sample; None: greedy. The same key gives the same tokens.
    - `temperature`: positive; the logits are divided by it (1: off).
    - `top_k`: keep the `top_k` most likely tokens (0 or None: off).
    - `top_p`: in [0, 1]: keep the most likely tokens whose probabilities add up to it
      (1 or None: off).
    - `min_p`: in [0, 1]: drop the tokens less likely than `min_p` times the likeliest.
    - `repetition_penalty`: positive; each token already in the sequence (the prompt
      included, its left padding not) has its logit divided by it when positive,
      multiplied when negative (1 or None: off). For an encoder-decoder, the decoder's
      tokens count, its start tokens included (transformers' choice).
    - `eos_token_id`: an id or a list of ids; a sequence that produced any of them is
      finished: its later tokens are `pad_token_id`, whatever the other rows do (as
      transformers pads them). Once every row has finished, no more steps run; the output
      keeps its length (transformers' is then shorter: port's, cut at its length).
    - `pad_token_id`: what a finished sequence continues with.
    - `attention_mask`: `input_ids`' shape, 0 on padding; positions follow it. For an
      encoder-decoder, the encoder's mask (the cross-attention's too).
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
    sampled = port.generate(model, prompts, max_new_tokens=32, attention_mask=prompts != 0,
                            key=jax.random.key(0), temperature=0.7, top_p=0.9, eos_token_id=[2, 7])
    ```
    """
    if not isinstance(max_new_tokens, (int, np.integer)) or isinstance(max_new_tokens, bool) or max_new_tokens < 1:
        raise ValueError(f"`max_new_tokens` must be a positive integer, got {max_new_tokens!r}")
    rule = sampling(
        key,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        min_p=min_p,
        repetition_penalty=repetition_penalty,
        eos_token_id=eos_token_id,
        pad_token_id=pad_token_id,
    )
    if hasattr(model, "encode") and hasattr(model, "decode"):
        return _generate_seq2seq(model, input_ids, int(max_new_tokens), attention_mask, decoder_input_ids, rule)
    if decoder_input_ids is not None:
        raise TypeError(f"`decoder_input_ids` is for an encoder-decoder; {type(model).__name__} is a decoder")
    if not hasattr(model, "init_cache"):
        raise TypeError(f"`model` must be a port decoder with init_cache, got {type(model).__name__}")
    batched = check_ids(input_ids)
    check_like("attention_mask", attention_mask, input_ids)
    ids, mask = batch_first(batched, input_ids, attention_mask)
    ids = jnp.asarray(ids)
    mask = None if mask is None else jnp.asarray(mask)
    batch, seq = ids.shape
    cache = model.init_cache(batch, seq + int(max_new_tokens))
    logits, cache = prefill(model, ids, cache, attention_mask=mask)
    out = _decode(model, False, logits, cache, _start(ids, mask, int(max_new_tokens), rule))
    return out if batched else out[0]


@final
class _State(eqx.Module):
    """Where a generation stands: the tokens so far, in a buffer of the final length."""

    tokens: Int[Array, "batch total"]  # the prompt, the tokens chosen so far, then padding
    length: Int[Array, ""]  # how many of `tokens` are filled
    first: Int[Array, " batch"]  # the first slot the repetition penalty counts (after left padding)
    finished: Bool[Array, " batch"]  # produced one of the eos ids
    rule: Sampling  # the settings, and the key still to split


@eqx.filter_jit
def _start(prompt: Array, mask: Array | None, new: int, rule: Sampling) -> _State:
    """The state before the first new token: `prompt` then `new` free slots. The penalty's
    first counted slot is each row's first unmasked one, as transformers' `padding_lengths`."""
    batch, seq = prompt.shape
    tokens = jnp.concatenate([prompt, jnp.full((batch, new), rule.pad, prompt.dtype)], axis=1)
    first = jnp.zeros((batch,), jnp.int32) if mask is None else jnp.argmax(mask != 0, axis=1).astype(jnp.int32)
    return _State(tokens, jnp.asarray(seq, jnp.int32), first, jnp.zeros((batch,), bool), rule)


def _pick(logits: Float[Array, "batch vocab"], state: _State) -> _State:
    """`state` with the next token written: processed and drawn (or the argmax), `pad` after eos."""
    rule = state.rule
    slots = jnp.arange(state.tokens.shape[1])
    counted = (slots >= state.first[:, None]) & (slots < state.length)
    logits = rule.warp(logits, state.tokens, counted)
    if rule.key is None:
        token = jnp.argmax(logits, axis=-1)
    else:
        key, draw = jax.random.split(rule.key)
        token = jax.random.categorical(draw, logits, axis=-1)
        rule = eqx.tree_at(lambda r: r.key, rule, key)
    token = token.astype(state.tokens.dtype)
    finished = state.finished
    if rule.eos:
        token = jnp.where(finished, jnp.asarray(rule.pad, token.dtype), token)
        finished = finished | jnp.isin(token, jnp.asarray(rule.eos, token.dtype))
    tokens = jax.lax.dynamic_update_slice_in_dim(state.tokens, token[:, None], state.length, axis=1)
    return _State(tokens, state.length + 1, state.first, finished, rule)


_pick_first = eqx.filter_jit(_pick)


@eqx.filter_jit
def _advance(model: Any, seq2seq: bool, cache: Any, state: _State) -> tuple[_State, Any]:
    """One decode step: the last token through `model` (its decoder when `seq2seq`), then the next picked."""
    token = jax.lax.dynamic_index_in_dim(state.tokens, state.length - 1, axis=1, keepdims=False)
    logits, cache = (model.decode if seq2seq else model)(token[:, None], cache=cache)
    return _pick(logits[:, -1], state), cache


def _decode(model: Any, seq2seq: bool, logits: Array, cache: Any, state: _State) -> Array:
    """The tokens after `state`'s: the first from `logits`, each next from a decode step, until
    the buffer is full or (with eos ids) every row has finished."""
    state = _pick_first(logits, state)
    for _ in range(state.tokens.shape[1] - int(state.length)):
        if state.rule.eos and bool(state.finished.all()):
            break
        state, cache = _advance(model, seq2seq, cache, state)
    return state.tokens


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


def _generate_seq2seq(
    model: Any, inputs: Any, new: int, mask: Any, start: Any, rule: Sampling
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
    out = _decode(model, True, logits, cache, _start(start, None, new, rule))
    return out if batched else out[0]
