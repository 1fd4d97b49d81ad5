"""Low-rank adapters (LoRA, DoRA): a weight that is its frozen base plus a trainable `scale * b @ a`.

A `LoRA` takes the place of one weight leaf of a model (stacked over layers, and over
experts, as the leaf is). It holds the leaf itself (`base`), the two factors in the
leaf's own layout and, for DoRA, a magnitude per output. The layers never see it: the
layer loop (`scan`, `run_layers`, `run_groups`) merges each layer's adapters into plain
weights (`merged`) before running the layer, one layer at a time, so a model with
adapters attached runs, differentiates, rematerialises and decodes as the plain model
does, with one layer's merged weights alive at a time.

The factors follow the leaf. A leaf `[*stack, *out, *in]` (torch `Linear`'s layout,
reshaped: `wq` `[heads, head_dim, embed]` has outputs `heads head_dim` and inputs
`embed`) gets `a` `[*stack, rank, *in]` and `b` `[*stack, *out, rank]`; a leaf whose
inputs come first (`transposed`, `[*stack, *in, *out]`) gets the same factors. The
product is summed in float32 and the merged weight cast back to the base's dtype.

```python
w = LoRA.attach(wq, inputs=1, rank=8, scale=2.0, key=key)   # a = uniform, b = 0: w.merged() == wq
model = eqx.tree_at(lambda m: m.blocks.attn.wq, model, w)
spec = trainable(model)                                      # True at every a, b (and magnitude)
params, frozen = eqx.partition(model, spec)
plain = merged(model)                                        # every LoRA replaced by its merged weight
```
"""

from __future__ import annotations

import math
from typing import Any, final

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, PRNGKeyArray


@final
class LoRA(eqx.Module):
    """One weight with a low-rank adapter: `base + scale * b @ a` (DoRA: rescaled per output).

    **Fields:**

    - `base`: the frozen weight, `[*stack, *out, *in]` (`[*stack, *in, *out]` when
      `transposed`).
    - `a`: `[*stack, rank, *in]`, PEFT's `lora_A` in the leaf's layout.
    - `b`: `[*stack, *out, rank]`, PEFT's `lora_B` in the leaf's layout.
    - `magnitude`: DoRA's `[*stack, *out]`, or None (LoRA).
    - `scale`: `lora_alpha / rank` (`lora_alpha / sqrt(rank)` with rsLoRA).
    - `inputs`: how many of the leaf's own axes (after `stack`) are inputs.
    - `transposed`: the inputs come before the outputs in `base`.

    ```python
    w = LoRA(base=wq, a=jnp.zeros((8, 512)), b=jnp.zeros((8, 64, 8)), magnitude=None,
             scale=2.0, inputs=1, transposed=False)
    w.merged().shape                              # wq's: (8, 64, 512)
    ```
    """

    base: Array
    a: Array
    b: Array
    magnitude: Array | None
    scale: float = eqx.field(static=True)
    inputs: int = eqx.field(static=True)
    transposed: bool = eqx.field(static=True)

    @staticmethod
    def attach(
        base: Array,
        *,
        inputs: int,
        rank: int,
        scale: float,
        key: PRNGKeyArray,
        stack: int = 0,
        transposed: bool = False,
        dora: bool = False,
        dtype: Any = jnp.float32,
    ) -> LoRA:
        """A new adapter on `base` as PEFT initialises one: `a` uniform in `+-1/sqrt(fan_in)`
        (`kaiming_uniform_(a=sqrt(5))`), `b` zero, so the merged weight is `base` itself;
        DoRA's magnitude is the base's norm per output.

        **Arguments:**

        - `base`: the weight (`[*stack, *out, *in]`, or inputs first when `transposed`).
        - `inputs`: how many of its axes after the `stack` axes are inputs.
        - `rank`, `scale`: the adapter's rank and its product's scale.
        - `key`: for `a`.
        - `stack`: the leading axes the leaf is stacked over (layers, experts).
        - `transposed`: inputs before outputs in `base`.
        - `dora`: add a DoRA magnitude.
        - `dtype`: the factors' dtype (PEFT's default: float32).

        **Returns:** the `LoRA`.

        ```python
        LoRA.attach(wq, inputs=1, rank=8, scale=2.0, key=key, stack=1).a.shape   # (layers, 8, embed)
        ```
        """
        lead, own = base.shape[:stack], base.shape[stack:]
        if not 0 < inputs < len(own):
            raise ValueError(f"a LoRA needs inputs and outputs: {inputs} input axes of a leaf {list(own)}")
        ins, outs = (own[:inputs], own[inputs:]) if transposed else (own[len(own) - inputs :], own[: len(own) - inputs])
        bound = 1.0 / math.sqrt(math.prod(ins))
        a = jax.random.uniform(key, (*lead, rank, *ins), dtype, -bound, bound)
        b = jnp.zeros((*lead, *outs, rank), dtype)
        node = LoRA(base, a, b, None, scale, inputs, transposed)
        if dora:
            node = LoRA(base, a, b, node.norm(base).astype(dtype), scale, inputs, transposed)
        return node

    @property
    def shape(self) -> tuple[int, ...]:
        """The weight's shape, `base`'s: a layer that sizes something by a weight outside the
        layer loop (DeepSeek-V4's `init_cache` reads a compressor's `wkv.shape`) reads it
        through an adapter as through the plain weight."""
        return self.base.shape

    @property
    def dtype(self) -> Any:
        """The weight's dtype, `base`'s (that of the merged weight)."""
        return self.base.dtype

    @property
    def ndim(self) -> int:
        """The weight's number of axes, `base`'s."""
        return self.base.ndim

    @property
    def stack(self) -> int:
        """How many leading axes the factors are stacked over (layers, experts)."""
        return self.a.ndim - 1 - self.inputs

    @property
    def rank(self) -> int:
        """The adapter's rank."""
        return self.a.shape[self.stack]

    def _in_axes(self, weight: Array) -> tuple[int, ...]:
        """The axes of a weight in `base`'s layout that are inputs."""
        stack, own = self.stack, weight.ndim - self.stack
        first = stack if self.transposed else stack + own - self.inputs
        return tuple(range(first, first + self.inputs))

    def delta(self) -> Array:
        """`scale * b @ a` in `base`'s layout, in float32.

        ```python
        w.delta().shape == w.base.shape
        ```
        """
        s, r = self.stack, self.rank
        a = self.a.reshape(*self.a.shape[: s + 1], -1)  # [*stack, r, in]
        b = self.b.reshape(*self.b.shape[:s], -1, r)  # [*stack, out, r]
        d = jnp.einsum("...or,...ri->...oi", b, a, preferred_element_type=jnp.float32)
        d = d.reshape(*self.b.shape[:-1], *self.a.shape[s + 1 :]) * jnp.float32(self.scale)
        if self.transposed:
            outs = d.ndim - s - self.inputs
            d = jnp.moveaxis(d, tuple(range(s, s + outs)), tuple(range(d.ndim - outs, d.ndim)))
        return d

    def norm(self, weight: Array) -> Array:
        """The norm of `weight` (in `base`'s layout) per output, over its inputs: DoRA's `||W||_c`."""
        w = weight.astype(jnp.float32)
        return jnp.sqrt(jnp.sum(w * w, axis=self._in_axes(weight)))

    def merged(self) -> Array:
        """The weight the layer uses, `base`'s shape and dtype: `base + delta` (summed in
        float32); with DoRA, that times `magnitude / norm` per output, the norm taken as a
        constant in the backward pass as PEFT does.

        ```python
        layer_weight = w.merged()
        ```
        """
        w = self.base.astype(jnp.float32) + self.delta()
        if self.magnitude is not None:
            factor = self.magnitude.astype(jnp.float32) / jax.lax.stop_gradient(self.norm(w))
            w = w * jnp.expand_dims(factor, self._in_axes(w))
        return w.astype(self.base.dtype)


def is_lora(x: Any) -> bool:
    """Whether `x` is a `LoRA` (an `is_leaf` for tree maps that stop at adapters)."""
    return isinstance(x, LoRA)


def merged(tree: Any) -> Any:
    """`tree` with every `LoRA` replaced by its merged weight (`LoRA.merged`).

    **Arguments:** `tree`: a model or any pytree.

    **Returns:** the same tree, plain arrays where the adapters were; a tree without
    adapters comes back as it is.

    ```python
    plain = merged(model)          # export it, or generate with it, as any model
    ```
    """
    return jax.tree.map(lambda x: x.merged() if isinstance(x, LoRA) else x, tree, is_leaf=is_lora)


def trainable(tree: Any) -> Any:
    """A filter for `eqx.partition`: True at each adapter's `a`, `b` and `magnitude`, False elsewhere.

    **Arguments:** `tree`: a model with `LoRA`s attached.

    **Returns:** a tree of bools of `tree`'s structure.

    ```python
    params, frozen = eqx.partition(model, trainable(model))
    grads = eqx.filter_grad(lambda p: loss(eqx.combine(p, frozen), batch))(params)
    ```
    """

    def mark(x: Any) -> Any:
        if isinstance(x, LoRA):
            return eqx.tree_at(lambda n: n.base, jax.tree.map(lambda _: True, x), False)
        return False

    return jax.tree.map(mark, tree, is_leaf=is_lora)
