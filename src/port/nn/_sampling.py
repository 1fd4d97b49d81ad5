"""Logits processors for sampling: transformers' repetition penalty, temperature, top-k, top-p and min-p.

Each is a small pure function on float logits `[batch, vocab]`, equal to transformers'
logits processor of the same name on the same logits (`RepetitionPenaltyLogitsProcessor`,
`TemperatureLogitsWarper`, `TopKLogitsWarper`, `TopPLogitsWarper`, `MinPLogitsWarper`):
a filtered token's logit becomes `-inf`. `process_logits` runs them in transformers'
order (`GenerationMixin._get_logits_processor`: the repetition penalty, then temperature,
top-k, top-p, min-p), each only where transformers applies it; `port.generate` draws the
next token from the result with `jax.random.categorical`. The values may be traced
(arrays), so a jitted step does not recompile for another temperature; `top_k` is a
Python integer (`jax.lax.top_k` takes a static k: far cheaper than sorting the
vocabulary), and top-p after top-k sorts only the k kept. "Equal" up to two things
transformers leaves open: which of several logits tied at a cut is kept (PyTorch's sort
is not stable), and 1 ulp where XLA's float32 division on CPU is not correctly rounded
(temperature, the penalty).

```python
logits = process_logits(logits, tokens, counted=mask, repetition_penalty=1.2,
                        temperature=0.7, top_k=50, top_p=0.9)
token = jax.random.categorical(key, logits, axis=-1)          # [batch]
```
"""

from __future__ import annotations

import math
from typing import Any, final

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import ArrayLike
from jaxtyping import Array, Bool, Float, Int

Number = Any  # a Python number, or a scalar array (traced under jit)


def penalize_repetition(
    logits: Float[ArrayLike, "batch vocab"],
    tokens: Int[ArrayLike, "batch seq"],
    penalty: Number,
    *,
    counted: Bool[ArrayLike, "batch seq"] | None = None,
) -> Float[Array, "batch vocab"]:
    """transformers' `RepetitionPenaltyLogitsProcessor`: each token seen so far has its logit
    divided by `penalty` when positive, multiplied by it when negative (once, however often seen).

    **Arguments:**

    - `logits`: `[batch, vocab]`.
    - `tokens`: `[batch, seq]`, the tokens so far (the prompt included, as transformers
      counts it); ids at or above `vocab` are skipped.
    - `penalty`: above 1 discourages repeats, below 1 encourages them (positive).
    - `counted`: `tokens`' shape, False where a token does not count (the prompt's left
      padding, the free slots of a fixed buffer); None: every token counts.

    **Returns:** the penalized logits, `logits`' shape.

    ```python
    logits = penalize_repetition(logits, tokens, 1.3, counted=tokens != 0)
    ```
    """
    logits, tokens = jnp.asarray(logits), jnp.asarray(tokens)
    batch, vocab = logits.shape
    ids = jnp.clip(tokens, 0, vocab)  # vocab: one extra column, dropped below
    if counted is not None:
        ids = jnp.where(counted, ids, vocab)
    seen = jnp.zeros((batch, vocab + 1), bool).at[jnp.arange(batch)[:, None], ids].set(True)[:, :vocab]
    penalized = jnp.where(logits < 0, logits * penalty, logits / penalty)
    return jnp.where(seen, penalized, logits)


def apply_temperature(logits: Float[ArrayLike, "batch vocab"], temperature: Number) -> Float[Array, "batch vocab"]:
    """transformers' `TemperatureLogitsWarper`: `logits / temperature`.

    **Arguments:**

    - `logits`: `[batch, vocab]`.
    - `temperature`: positive; below 1 sharpens the distribution, above 1 flattens it.

    **Returns:** the scaled logits.

    ```python
    logits = apply_temperature(logits, 0.7)
    ```
    """
    return jnp.asarray(logits) / temperature


def keep_top_k(
    logits: Float[ArrayLike, "batch vocab"], top_k: int, *, min_tokens_to_keep: int = 1
) -> Float[Array, "batch vocab"]:
    """transformers' `TopKLogitsWarper`: `-inf` for every logit below the `top_k`-th largest
    (ties with it are kept).

    **Arguments:**

    - `logits`: `[batch, vocab]`.
    - `top_k`: how many to keep, a Python integer (static under jit: `jax.lax.top_k`, not a
      sort of the vocabulary), at least 1; more than `vocab` keeps all.
    - `min_tokens_to_keep`: `top_k` is raised to it (transformers' default 1).

    **Returns:** the filtered logits.

    ```python
    logits = keep_top_k(logits, 50)
    ```
    """
    logits = jnp.asarray(logits)
    kth = _top_k(logits, min(max(int(top_k), min_tokens_to_keep), logits.shape[-1]))[0][..., -1:]
    return jnp.where(logits < kth, -jnp.inf, logits)


def keep_top_p(
    logits: Float[ArrayLike, "batch vocab"], top_p: Number, *, min_tokens_to_keep: int = 1
) -> Float[Array, "batch vocab"]:
    """transformers' `TopPLogitsWarper` (nucleus): keep the most probable tokens whose
    probabilities add up to `top_p`, `-inf` for the rest.

    As transformers computes it: sorted ascending, a token is dropped when the cumulative
    probability up to it is at most `1 - top_p`; the `min_tokens_to_keep` most probable stay.

    **Arguments:**

    - `logits`: `[batch, vocab]`.
    - `top_p`: in [0, 1].
    - `min_tokens_to_keep`: at least this many are kept (transformers' default 1).

    **Returns:** the filtered logits.

    ```python
    logits = keep_top_p(logits, 0.9)
    ```
    """
    logits = jnp.asarray(logits)
    batch, vocab = logits.shape
    order = jnp.argsort(logits, axis=-1)  # ascending, stable
    ascending = jnp.take_along_axis(logits, order, axis=-1)
    cumulative = jnp.cumsum(jax.nn.softmax(ascending, axis=-1), axis=-1)
    drop = (cumulative <= 1 - top_p) & (jnp.arange(vocab) < vocab - min_tokens_to_keep)
    drop = jnp.zeros_like(drop).at[jnp.arange(batch)[:, None], order].set(drop)
    return jnp.where(drop, -jnp.inf, logits)


def keep_min_p(
    logits: Float[ArrayLike, "batch vocab"], min_p: Number, *, min_tokens_to_keep: int = 1
) -> Float[Array, "batch vocab"]:
    """transformers' `MinPLogitsWarper`: `-inf` for every token whose probability is below
    `min_p` times the most probable token's.

    **Arguments:**

    - `logits`: `[batch, vocab]`.
    - `min_p`: in [0, 1].
    - `min_tokens_to_keep`: the this-many most probable are kept (transformers' default 1).

    **Returns:** the filtered logits.

    ```python
    logits = keep_min_p(logits, 0.05)
    ```
    """
    logits = jnp.asarray(logits)
    probs = jax.nn.softmax(logits, axis=-1)
    drop = probs < min_p * probs.max(axis=-1, keepdims=True)
    kept = jax.lax.top_k(probs, min(min_tokens_to_keep, logits.shape[-1]))[1]
    drop = drop.at[jnp.arange(logits.shape[0])[:, None], kept].set(False)
    return jnp.where(drop, -jnp.inf, logits)


def process_logits(
    logits: Float[ArrayLike, "batch vocab"],
    tokens: Int[ArrayLike, "batch seq"] | None = None,
    *,
    counted: Bool[ArrayLike, "batch seq"] | None = None,
    repetition_penalty: Number | None = None,
    temperature: Number | None = None,
    top_k: int | None = None,
    top_p: Number | None = None,
    min_p: Number | None = None,
) -> Float[Array, "batch vocab"]:
    """The processors in transformers' order, each where transformers applies it: the
    repetition penalty (unless 1), temperature (unless 1), top-k (unless 0), top-p (unless
    1), min-p; a None is off. Computed in float32, as transformers' `generate` does.

    **Arguments:**

    - `logits`: `[batch, vocab]`, the last slot's logits.
    - `tokens`: `[batch, seq]`, the tokens so far (for `repetition_penalty` only).
    - `counted`: `tokens`' shape, False where a token does not count (`penalize_repetition`).
    - `repetition_penalty`: `penalize_repetition`'s `penalty`.
    - `temperature`: `apply_temperature`'s.
    - `top_k`: `keep_top_k`'s (a Python integer); 0 is off, as in transformers' `generate`.
    - `top_p`: `keep_top_p`'s.
    - `min_p`: `keep_min_p`'s.

    **Returns:** the processed float32 logits, `-inf` where filtered: draw from them with
    `jax.random.categorical`.

    ```python
    logits, cache = port.nn.decode_step(model, token, cache)
    token = jax.random.categorical(key, process_logits(logits, temperature=0.7, top_p=0.9))
    ```
    """
    logits = jnp.asarray(logits, jnp.float32)
    if _applies(repetition_penalty, off=1.0):
        if tokens is None:
            raise ValueError("`repetition_penalty` needs `tokens`, the tokens so far")
        logits = penalize_repetition(logits, tokens, repetition_penalty, counted=counted)
    if _applies(temperature, off=1.0):
        logits = apply_temperature(logits, temperature)
    if top_k:  # None or 0: off
        logits = keep_top_k(logits, top_k)
    if _applies(top_p, off=1.0, above=True):
        logits = _keep_top_p_after_top_k(logits, top_p, top_k) if top_k else keep_top_p(logits, top_p)
    if min_p is not None:
        logits = keep_min_p(logits, min_p)
    return logits


def _top_k(logits: Array, k: int) -> tuple[Array, Array]:
    """`jax.lax.top_k`, kept one: without the barrier XLA (CPU) rewrites a top-k whose values
    are sliced into a sort of the whole vocabulary, 60x slower at 8 x 32000."""
    values, indices = jax.lax.optimization_barrier(jax.lax.top_k(logits, k))
    return values, indices


def _keep_top_p_after_top_k(logits: Array, top_p: Number, top_k: int) -> Array:
    """`keep_top_p` of logits `keep_top_k` has cut: on the `top_k` kept alone (a sort of k
    logits, not of the vocabulary: the rest have probability 0 and are dropped either way),
    unless a tie with the k-th kept more than k in some row; then on all of them."""
    values, indices = _top_k(logits, min(top_k, logits.shape[-1]))

    def within(_: None) -> Array:
        kept = keep_top_p(values, top_p)
        return jnp.full_like(logits, -jnp.inf).at[jnp.arange(logits.shape[0])[:, None], indices].set(kept)

    exact = (logits > -jnp.inf).sum(axis=-1).max() <= values.shape[-1]
    return jax.lax.cond(exact, within, lambda _: keep_top_p(logits, top_p), None)


def _applies(value: Number | None, *, off: float, above: bool = False) -> bool:
    """Whether transformers applies a processor set to `value` (its `off` value, or beyond
    it when `above`, does nothing); an array (traced) always applies."""
    if value is None:
        return False
    if isinstance(value, (int, float, np.number)):
        return bool(value < off if above else value != off)
    return True


@final
class Sampling(eqx.Module):
    """How `generate` picks each token: its settings, checked, as arrays (so another value
    does not recompile; `top_k` static), None where off; the stop tokens and the padding
    after them."""

    key: Array | None
    repetition_penalty: Array | None
    temperature: Array | None
    top_k: int | None = eqx.field(static=True)
    top_p: Array | None
    min_p: Array | None
    eos: tuple[int, ...] = eqx.field(static=True)
    pad: int = eqx.field(static=True)

    def warp(self, logits: Array, tokens: Array, counted: Array) -> Array:
        """`process_logits` with these settings."""
        return process_logits(
            logits,
            tokens,
            counted=counted,
            repetition_penalty=self.repetition_penalty,
            temperature=self.temperature,
            top_k=self.top_k,
            top_p=self.top_p,
            min_p=self.min_p,
        )


def sampling(
    key: Any,
    *,
    temperature: Any,
    top_k: Any,
    top_p: Any,
    min_p: Any,
    repetition_penalty: Any,
    eos_token_id: Any,
    pad_token_id: Any,
) -> Sampling:
    """`generate`'s sampling arguments checked (a one-line `ValueError` / `TypeError` naming
    the argument), as a `Sampling`; the processors transformers would skip are None."""
    if key is not None:
        _check_key(key)
    else:
        for name, value in (("temperature", temperature), ("top_k", top_k), ("top_p", top_p), ("min_p", min_p)):
            if value is not None:
                raise ValueError(
                    f"`{name}` is for sampling: pass `key` (a jax.random key); without one, decoding is greedy"
                )
    _check_number("temperature", temperature, low=0.0, low_open=True)
    _check_number("repetition_penalty", repetition_penalty, low=0.0, low_open=True)
    _check_number("top_p", top_p, low=0.0, high=1.0)
    _check_number("min_p", min_p, low=0.0, high=1.0)
    if top_k is not None and (not _is_int(top_k) or top_k < 0):
        raise ValueError(f"`top_k` must be a non-negative integer (0: off), got {top_k!r}")
    return Sampling(
        key=key,
        repetition_penalty=_on(repetition_penalty, _applies(repetition_penalty, off=1.0)),
        temperature=_on(temperature, _applies(temperature, off=1.0)),
        top_k=int(top_k) if top_k else None,  # checked: None or an integer, 0 off
        top_p=_on(top_p, _applies(top_p, off=1.0, above=True)),
        min_p=_on(min_p, min_p is not None),
        eos=_eos_ids(eos_token_id),
        pad=_token_id("pad_token_id", pad_token_id),
    )


def _on(value: Any, applies: bool) -> Array | None:
    return jnp.asarray(value, jnp.float32) if applies else None


def _is_int(value: Any) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def _check_number(name: str, value: Any, *, low: float, high: float = math.inf, low_open: bool = False) -> None:
    """A real `value` in [low, high] ((low, high] when `low_open`), or None."""
    if value is None:
        return
    real = isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, bool)
    inside = real and math.isfinite(value) and (value > low if low_open else value >= low) and value <= high
    if not inside:
        bounds = f"{'(' if low_open else '['}{low:g}, {high:g}{']' if math.isfinite(high) else ')'}"
        raise ValueError(f"`{name}` must be a number in {bounds}, got {value!r}")


def _check_key(key: Any) -> None:
    typed = isinstance(key, jax.Array) and jnp.issubdtype(key.dtype, jax.dtypes.prng_key) and key.shape == ()
    raw = isinstance(key, jax.Array) and key.dtype == jnp.uint32 and key.shape == (2,)
    if not (typed or raw):
        shown = f"{type(key).__name__} {getattr(key, 'dtype', '')}{getattr(key, 'shape', '')}"
        raise TypeError(f"`key` must be one jax.random key (jax.random.key(0)), got {shown}")


def _token_id(name: str, value: Any) -> int:
    if not _is_int(value) or value < 0:
        raise ValueError(f"`{name}` must be a token id (a non-negative integer), got {value!r}")
    return int(value)


def _eos_ids(value: Any) -> tuple[int, ...]:
    """`eos_token_id` (None, an id, or a list of ids) as a tuple."""
    if value is None:
        return ()
    if isinstance(value, (list, tuple)) and value:
        return tuple(_token_id("eos_token_id", v) for v in value)
    if _is_int(value):
        return (_token_id("eos_token_id", value),)
    raise ValueError(f"`eos_token_id` must be a token id or a non-empty list of them, got {value!r}")
