"""Running a family's stacked blocks over prepared tokens: masks per layer, the cache, remat.

Every decoder family calls `run_layers` between its embedding and its head; each block
takes `block(x, mask, cos=, sin=, kv=, index=, layer=)` and returns `(x, kv)`.

```python
tokens = prepare(input_ids, attention_mask=mask, cache=cache, window=config.sliding_window)
x = embed[tokens.ids]
cos, sin = config.rope.angles(tokens.positions, x.dtype)
x, kv = run_layers(blocks, x, tokens, cos=cos, sin=sin, sliding=config.sliding_layers, remat=remat)
return tokens.output(head(x), *kv)
```
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float

from port.nn._lora import merged
from port.nn._scan import checkpointed, scan
from port.nn._tokens import Tokens


def run_layers(
    blocks: Any,
    x: Float[Array, "batch seq embed"],
    tokens: Tokens,
    *,
    cos: Array | None = None,
    sin: Array | None = None,
    sliding: Sequence[bool] | None = None,
    sliding_rope: tuple[Array, Array] | None = None,
    rope_layers: Sequence[bool] | None = None,
    q_scale: Float[Array, "batch seq"] | None = None,
    remat: bool | str | Callable[..., bool] | None = None,
) -> tuple[Float[Array, "batch seq embed"], tuple[Array | None, Array | None]]:
    """Run stacked `blocks` over `x`.

    **Arguments:**

    - `blocks`: the stacked blocks (from `stacked`), arrays `[layers, ...]`; each is
      called `block(x, mask, cos=, sin=, kv=, index=, layer=)` and returns `(x, kv)`.
    - `x`: the embedded tokens, `[batch, seq, embd]`.
    - `tokens`: from `prepare` (its masks and cache).
    - `cos`, `sin`: the rotary angles (None: no RoPE).
    - `sliding`: per layer, whether it is a local layer: it uses `tokens.sliding` (the
      window, when `prepare` was given one) rather than `tokens.mask`...
    - `sliding_rope`: ...and these `(cos, sin)` rather than `cos`, `sin` (a per-layer RoPE
      base, as Gemma 3's local layers have); None: every layer rotates alike.
    - `rope_layers`: per layer, whether it rotates its queries and keys at all; a layer
      marked False (a NoPE layer: SmolLM3's `no_rope_layers`) gets the identity rotation
      (cos 1, sin 0), which leaves them exactly as they are. None: every layer rotates.
    - `q_scale`: `[batch, seq]`, a factor on every layer's queries after RoPE, handed to
      each block as `q_scale=` (Ministral 3's scale by position); None: none (and the
      blocks are called without it).
    - `remat`: as in `scan`.

    **Returns:** `(x, (keys, values))`: the last block's output `[batch, seq, embd]` and,
    with a cache, every layer's updated keys and values, `[layers, batch, length,
    kv_heads, head_dim]` each (else `(None, None)`), for `tokens.output`.

    ```python
    tokens = prepare(input_ids, attention_mask=mask, window=config.sliding_window)
    cos, sin = config.rope.angles(tokens.positions, jnp.float32)
    x, kv = run_layers(blocks, embed[tokens.ids], tokens, cos=cos, sin=sin,
                       sliding=config.sliding_layers, remat="full")
    ```
    """
    layers = jnp.arange(jnp.shape(_first_leaf(blocks))[0])
    flags = jnp.asarray(sliding, bool) if sliding else jnp.zeros(layers.shape, bool)
    rotates = None if rope_layers is None else jnp.asarray(rope_layers, bool)
    kv = None if tokens.cache is None else (tokens.cache.keys, tokens.cache.values)
    index = tokens.index

    def layer(block: Any, x: Array, i: Array, slides: Array, rotate: Array | None, kv: Any) -> tuple[Array, Any]:
        mask = tokens.mask if tokens.sliding is None else jnp.where(slides, tokens.sliding, tokens.mask)
        c, s = cos, sin
        if sliding_rope is not None:
            assert cos is not None and sin is not None, "sliding_rope replaces cos and sin on the local layers"
            c, s = (jnp.where(slides, local, default) for local, default in zip(sliding_rope, (cos, sin)))
        if rotate is not None:
            assert c is not None and s is not None, "rope_layers picks the layers that use cos and sin"
            c, s = jnp.where(rotate, c, jnp.ones_like(c)), jnp.where(rotate, s, jnp.zeros_like(s))
        scaled = {} if q_scale is None else {"q_scale": q_scale}
        return block(x, mask, cos=c, sin=s, kv=kv, index=index, layer=i, **scaled)

    x, kv = scan(layer, x, blocks, layers, flags, rotates, kv, remat=remat)
    return x, (None, None) if kv is None else kv


def _first_leaf(tree: Any) -> Array:
    return jax.tree.leaves(eqx.filter(tree, eqx.is_array))[0]


def run_groups(
    groups: Mapping[str, Any],
    kinds: Sequence[str],
    x: Float[Array, "batch seq embed"],
    tokens: Tokens,
    *,
    cos: Array | None = None,
    sin: Array | None = None,
    sliding: Sequence[bool] | None = None,
    q_scale: Float[Array, "batch seq"] | None = None,
    remat: bool | str | Callable[..., bool] | None = None,
) -> tuple[Float[Array, "batch seq embed"], tuple[Any, Any, Any]]:
    """Run layers of several kinds, each kind's blocks stacked apart, in the checkpoint's order.

    A model whose layers differ (dense MLPs among mixture-of-experts layers, linear and
    full attention) keeps one stack per kind, the model's `layer_groups`. A pattern that
    repeats (Llama 4's every-other MoE layer, Qwen3-Next's three linear layers to one
    full) runs as one scan over its repeats, the pattern written out inside; any other
    order (DeepSeek-V3's dense layers first) as one scan per run of equal kinds.

    **Arguments:**

    - `groups`: kind -> its stacked blocks (arrays `[its layers, ...]`, in layer order),
      or None for a kind no layer has. Each block is called as in `run_layers`.
    - `kinds`: each layer's kind, in order (`len(kinds)` layers).
    - `x`, `tokens`, `cos`, `sin`, `q_scale`, `remat`: as in `run_layers`; `sliding` per
      layer, in the order of `kinds`.

    With a cache, a block of kind `g` gets its layers' rows of the cache's `keys` and
    `values` (arrays over every layer, when every layer caches alike), or `(keys[g],
    values[g])` of the cache's dicts by kind, or `states[g]` (a recurrent layer's state,
    whatever pytree it is), and returns it updated.

    **Returns:** `(x, (keys, values, states))`: the output and the cache's new dicts
    (each None without a cache), for `tokens.output`.

    ```python
    kinds = ("dense",) * 3 + ("moe",) * 58
    x, cache = run_groups({"dense": self.dense, "moe": self.moe}, kinds, x, tokens, cos=cos, sin=sin)
    return tokens.output(head(x), *cache)
    ```
    """
    kinds = tuple(kinds)
    n = len(kinds)
    if len(set(kinds)) == 1 and (tokens.cache is None or not isinstance(tokens.cache.keys, Mapping)):
        x, (keys, values) = run_layers(
            groups[kinds[0]], x, tokens, cos=cos, sin=sin, sliding=sliding, q_scale=q_scale, remat=remat
        )
        return x, (keys, values, None if tokens.cache is None else tokens.cache.states)
    flags = jnp.asarray(sliding if sliding else (False,) * n, bool)
    cache = tokens.cache
    rows = {kind: [i for i, k in enumerate(kinds) if k == kind] for kind in dict.fromkeys(kinds)}
    entries: dict[str, Any] = {}
    for kind in rows:
        if groups.get(kind) is None:
            raise ValueError(f"layer kind {kind!r} has layers but no blocks")
        if cache is None:
            entries[kind] = None
        elif not isinstance(cache.keys, Mapping):  # one buffer over every layer: this kind's rows
            entries[kind] = (cache.keys[jnp.asarray(rows[kind])], cache.values[jnp.asarray(rows[kind])])
        elif kind in cache.keys:
            entries[kind] = (cache.keys[kind], cache.values[kind])
        elif isinstance(cache.states, Mapping) and kind in cache.states:
            entries[kind] = cache.states[kind]
        else:
            raise ValueError(f"the cache holds nothing for layer kind {kind!r}")
    index = tokens.index

    def layer(block: Any, x: Array, i: Array, slides: Array, entry: Any) -> tuple[Array, Any]:
        mask = tokens.mask if tokens.sliding is None else jnp.where(slides, tokens.sliding, tokens.mask)
        scaled = {} if q_scale is None else {"q_scale": q_scale}
        return block(x, mask, cos=cos, sin=sin, kv=entry, index=index, layer=i, **scaled)

    period = _period(kinds)
    out: dict[str, Any] = {}
    if period < n:
        # One scan over the repeats of the pattern kinds[:period]; inside it, the pattern's
        # layers in order, each kind's j-th block of the repeat.
        repeats = n // period
        pattern = kinds[:period]

        def split(tree, kind):
            return jax.tree.map(  # [layers, ...] -> [repeats, per repeat, ...]
                lambda a: a.reshape(repeats, -1, *a.shape[1:]), tree
            )

        stacks = {kind: split(eqx.filter(groups[kind], eqx.is_array), kind) for kind in entries}
        static = {kind: eqx.partition(groups[kind], eqx.is_array)[1] for kind in entries}
        per_repeat = {kind: split(entries[kind], kind) for kind in entries}
        ids = jnp.arange(n).reshape(repeats, period)
        fl = flags.reshape(repeats, period)

        def repeat(x: Array, xs: Any) -> tuple[Array, Any]:
            params, caches, i, slides = xs
            seen = dict.fromkeys(entries, 0)
            new = {kind: [] for kind in entries}
            for j, kind in enumerate(pattern):
                block = merged(eqx.combine(jax.tree.map(lambda a, s=seen[kind]: a[s], params[kind]), static[kind]))
                entry = None if caches[kind] is None else jax.tree.map(lambda a, s=seen[kind]: a[s], caches[kind])
                x, entry = layer(block, x, i[j], slides[j], entry)
                new[kind].append(entry)
                seen[kind] += 1
            stacked_new = {
                kind: None if caches[kind] is None else jax.tree.map(lambda *a: jnp.stack(a), *new[kind])
                for kind in entries
            }
            return x, stacked_new

        step = checkpointed(repeat, remat)
        x, new = jax.lax.scan(step, x, (stacks, per_repeat, ids, fl))
        for kind in entries:
            out[kind] = None if new[kind] is None else jax.tree.map(lambda a: a.reshape(-1, *a.shape[2:]), new[kind])
    else:
        parts: dict[str, list[Any]] = {kind: [] for kind in entries}
        start = 0
        for kind, run in itertools.groupby(kinds):
            length = len(list(run))
            first = rows[kind].index(start)
            take = lambda tree, a=first, b=first + length: jax.tree.map(lambda t: t[a:b], tree)  # noqa: E731
            blocks = take(eqx.filter(groups[kind], eqx.is_array))
            blocks = eqx.combine(blocks, eqx.partition(groups[kind], eqx.is_array)[1])
            entry = None if entries[kind] is None else take(entries[kind])
            x, new = scan(
                layer, x, blocks, jnp.arange(start, start + length), flags[start : start + length], entry, remat=remat
            )
            parts[kind].append(new)
            start += length
        for kind in entries:
            out[kind] = None if entries[kind] is None else jax.tree.map(lambda *a: jnp.concatenate(a), *parts[kind])
    if cache is None:
        return x, (None, None, None)
    states = dict(cache.states) if isinstance(cache.states, Mapping) else cache.states
    if not isinstance(cache.keys, Mapping):  # one buffer over every layer: each kind's rows
        keys, values = cache.keys, cache.values
        for kind, entry in out.items():
            at = jnp.asarray(rows[kind])
            keys, values = keys.at[at].set(entry[0]), values.at[at].set(entry[1])
        return x, (keys, values, states)
    keys = dict(cache.keys)
    values = dict(cache.values) if isinstance(cache.values, Mapping) else cache.values
    for kind, entry in out.items():
        if kind in cache.keys:
            keys[kind], values[kind] = entry
        else:
            states[kind] = entry
    return x, (keys, values, states)


def _period(kinds: tuple[str, ...]) -> int:
    """The shortest p dividing len(kinds) with kinds[i] == kinds[i % p] (len(kinds) if none)."""
    n = len(kinds)
    for p in range(1, n):
        if n % p == 0 and all(kinds[i] == kinds[i % p] for i in range(n)):
            return p
    return n
