"""Normalisation layers: RMSNorm (Llama's, OLMo 2's float32 scale, Gemma's `1 + weight`) and LayerNorm
(as a function over given leaves, `layer_norm`, and as a module, `LayerNorm`).

Statistics are always taken in float32 and the result cast back to the input's dtype,
as transformers does, so bfloat16 activations normalise exactly as in PyTorch.

```python
y = rms_norm(x, weight, 1e-6)                  # Llama: weight * normalised.astype(x.dtype)
y = rms_norm(x, weight, 1e-6, float32_scale=True)  # OLMo 2: (weight * normalised), in float32, then cast
y = rms_norm(x, weight, 1e-6, plus_one=True)    # Gemma: (1 + weight) * normalised, in float32
y = layer_norm(x, weight, bias, 1e-6)           # LayerNorm over leaves a module keeps (bias may be None)
norm = LayerNorm(768, eps=1e-5, dtype=jnp.float32)
y = norm(x)                                     # any leading axes; normalises the last
```
"""

from __future__ import annotations

from typing import Any, final

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float


def rms_norm(
    x: Float[Array, "*rest embed"],
    weight: Float[Array, " embed"],
    eps: float,
    *,
    plus_one: bool = False,
    float32_scale: bool = False,
) -> Float[Array, "*rest embed"]:
    """Root-mean-square normalisation over the last axis, scaled by `weight`.

    **Arguments:**

    - `x`: the activations; the last axis is normalised.
    - `weight`: the learned scale.
    - `eps`: added to the mean square (config.json's `rms_norm_eps`).
    - `plus_one`: Gemma's form, `(1 + weight) * x_hat` computed in float32 and then cast;
      without it Llama's, `weight * x_hat.astype(x.dtype)`.
    - `float32_scale`: OLMo 2's form, `weight * x_hat` computed in float32 and then cast
      (`(self.weight * hidden_states).to(input_dtype)`); `plus_one` always scales so.

    **Returns:** an array of `x`'s shape and dtype.

    ```python
    rms_norm(jnp.ones((2, 4)), jnp.ones(4), 1e-6)   # ~ones
    ```
    """
    h = x.astype(jnp.float32)
    h = h * jax.lax.rsqrt(jnp.mean(h * h, axis=-1, keepdims=True) + eps)
    if plus_one:
        return (h * (1.0 + weight.astype(jnp.float32))).astype(x.dtype)
    if float32_scale:
        return (h * weight.astype(jnp.float32)).astype(x.dtype)
    return weight * h.astype(x.dtype)


def layer_norm(
    x: Float[Array, "*rest dim"],
    weight: Float[Array, " dim"],
    bias: Float[Array, " dim"] | None,
    eps: float,
) -> Float[Array, "*rest dim"]:
    """Layer normalisation over the last axis, scaled by `weight` and shifted by `bias`.

    Statistics, scale and shift in float32, the result in `x`'s dtype (transformers'
    `nn.LayerNorm`). For norms whose size is not the hidden size, kept as plain leaves
    annotated with their own axis (the sparse-attention indexers' `k_norm`).

    **Arguments:**

    - `x`: the activations; the last axis is normalised.
    - `weight`, `bias`: the learned scale and shift (`bias` None: no shift).
    - `eps`: added to the variance.

    **Returns:** an array of `x`'s shape and dtype.

    ```python
    layer_norm(jnp.arange(8.0), jnp.ones(8), jnp.zeros(8), 1e-6)   # mean 0, variance ~1
    ```
    """
    h = x.astype(jnp.float32)
    mean = jnp.mean(h, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(h - mean), axis=-1, keepdims=True)
    h = (h - mean) * jax.lax.rsqrt(var + eps) * weight.astype(jnp.float32)
    if bias is not None:
        h = h + bias.astype(jnp.float32)
    return h.astype(x.dtype)


@final
class LayerNorm(eqx.Module):
    """Layer normalisation over the last axis, with an optional bias.

    Statistics in float32, scale and shift in float32, the result in the input's dtype
    (transformers' `nn.LayerNorm`). The leaves are `weight` and `bias`, as in
    `eqx.nn.LayerNorm` and PyTorch, so mappings name them `ln_1.weight` / `ln_1.bias`.

    **Arguments:**

    - `size`: the normalised axis' length.
    - `eps`: config.json's `layer_norm_eps` (or `layer_norm_epsilon`).
    - `dtype`: the parameters' dtype.
    - `bias`: whether there is a bias.

    ```python
    norm = LayerNorm(8, eps=1e-5, dtype=jnp.float32)
    norm(jnp.arange(16.0).reshape(2, 8)).shape   # (2, 8)
    ```
    """

    weight: Float[Array, " embed"]
    bias: Float[Array, " embed"] | None
    eps: float = eqx.field(static=True)

    def __init__(self, size: int, *, eps: float, dtype: Any, bias: bool = True):
        self.weight = jnp.ones((size,), dtype)
        self.bias = jnp.zeros((size,), dtype) if bias else None
        self.eps = eps

    def __call__(self, x: Float[Array, "*rest embed"]) -> Float[Array, "*rest embed"]:
        return layer_norm(x, self.weight, self.bias, self.eps)
