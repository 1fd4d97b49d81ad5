"""Feed-forward layers with torch `Linear` layouts `[out, in]`: a plain MLP and a gated one.

```python
mlp = GatedMLP(embd=512, inner=1408, activation="silu", dtype=jnp.float32, key=key)
y = mlp(x)                                  # down(silu(gate x) * up x); x: [..., 512]
mlp = MLP(embd=768, inner=3072, activation="gelu", dtype=jnp.float32, key=key)
y = mlp(x)                                  # down(gelu(up x + b) ) + b
```

`activation` is a transformers `ACT2FN` name (`port.nn.config.ACTIVATIONS`).
"""

from __future__ import annotations

from typing import Any, final

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, PRNGKeyArray

from port.nn._init import normal, zeros_if
from port.nn.config import ACTIVATIONS


def linear(x: Float[Array, "... in"], weight: Float[Array, "out in"], bias: Float[Array, " out"] | None) -> Array:
    """`x @ weight.T (+ bias)`, weight in torch `Linear`'s `[out, in]` layout.

    **Arguments:**

    - `x`: `[..., in]`.
    - `weight`: `[out, in]`, as torch stores it.
    - `bias`: `[out]`, or None.

    **Returns:** `[..., out]`.

    ```python
    linear(jnp.ones((2, 5, 64)), jnp.ones((128, 64)), None).shape   # (2, 5, 128)
    ```
    """
    y = jnp.einsum("...i,oi->...o", x, weight)
    return y if bias is None else y + bias


def clamped_swiglu(gate: Array, up: Array, *, alpha: float, limit: float) -> Array:
    """gpt-oss's SwiGLU: `(clip(up, -limit, limit) + 1) * g * sigmoid(alpha * g)`, `g = min(gate, limit)`.

    As transformers' `GptOssExperts`: the gate is clamped from above only, the up
    projection on both sides, and 1 is added to it; each step in the inputs' dtype.

    **Arguments:** `gate`, `up` (the two projections, one shape); `alpha` (the sigmoid's
    slope); `limit` (the clamp).

    **Returns:** `up`'s shape and dtype.

    ```python
    clamped_swiglu(jnp.array([9.0]), jnp.array([-9.0]), alpha=1.702, limit=7.0)   # (-7 + 1) * 7 * sigmoid(11.9)
    ```
    """
    gate = jnp.minimum(gate, jnp.asarray(limit, gate.dtype))
    up = jnp.clip(up, jnp.asarray(-limit, up.dtype), jnp.asarray(limit, up.dtype))
    glu = gate * jax.nn.sigmoid(gate * jnp.asarray(alpha, gate.dtype))
    return (up + jnp.asarray(1, up.dtype)) * glu


@final
class GatedMLP(eqx.Module):
    """`down(act(gate x) * up x)`: SwiGLU (Llama), GeGLU (Gemma); optional biases; gpt-oss's clamped SwiGLU.

    **Arguments:**

    - `embd`: the input and output size.
    - `inner`: the hidden size.
    - `activation`: an `ACT2FN` name ("silu", "gelu_pytorch_tanh", ...).
    - `dtype`, `key`: the parameters' dtype and initialisation key (N(0, 0.02), zero biases).
    - `bias`: biases on all three projections.
    - `limit`, `alpha`: with a `limit`, gpt-oss's clamped SwiGLU (`clamped_swiglu`, the
      sigmoid's gain `alpha`) replaces `act(gate x) * up x`; `activation` is then unused.
      `alpha` None: DeepSeek-V4's, `act(min(gate x, limit)) * clip(up x, -limit, limit)`.

    Called on `x` `[..., embd]`, returns `[..., embd]`. The leaves `gate`, `up`
    `[inner, embd]` and `down` `[embd, inner]` are torch `Linear` weights, biases
    `bgate`, `bup`, `bdown` (None without `bias`).

    ```python
    mlp = GatedMLP(embd=512, inner=1408, activation="silu", dtype=jnp.float32, key=key)
    mlp(jnp.zeros((2, 8, 512))).shape            # (2, 8, 512)
    ```
    """

    gate: Float[Array, "mlp embed"]
    up: Float[Array, "mlp embed"]
    down: Float[Array, "embed mlp"]
    bgate: Float[Array, " mlp"] | None
    bup: Float[Array, " mlp"] | None
    bdown: Float[Array, " embed"] | None
    activation: str = eqx.field(static=True)
    limit: float | None = eqx.field(static=True)
    alpha: float | None = eqx.field(static=True)

    def __init__(
        self,
        *,
        embd: int,
        inner: int,
        activation: str,
        dtype: Any,
        key: PRNGKeyArray,
        bias: bool = False,
        limit: float | None = None,
        alpha: float | None = 1.0,
    ):
        kg, ku, kd = jax.random.split(key, 3)
        self.gate, self.up = normal(kg, (inner, embd), dtype), normal(ku, (inner, embd), dtype)
        self.down = normal(kd, (embd, inner), dtype)
        self.bgate, self.bup = zeros_if(bias, (inner,), dtype), zeros_if(bias, (inner,), dtype)
        self.bdown = zeros_if(bias, (embd,), dtype)
        self.activation = activation
        self.limit, self.alpha = limit, alpha

    def glu(self, gate: Array, up: Array) -> Array:
        """The hidden activations from the gate and up projections: `act(gate) * up`, or clamped.

        ```python
        h = mlp.glu(linear(x, mlp.gate, mlp.bgate), linear(x, mlp.up, mlp.bup))
        ```
        """
        if self.limit is not None and self.alpha is None:
            limit = jnp.asarray(self.limit, gate.dtype)
            return ACTIVATIONS[self.activation](jnp.minimum(gate, limit)) * jnp.clip(up, -limit, limit)
        if self.limit is not None and self.alpha is not None:
            return clamped_swiglu(gate, up, alpha=self.alpha, limit=self.limit)
        return ACTIVATIONS[self.activation](gate) * up

    def __call__(self, x: Float[Array, "... embed"]) -> Float[Array, "... embed"]:
        h = self.glu(linear(x, self.gate, self.bgate), linear(x, self.up, self.bup))
        return linear(h, self.down, self.bdown)


@final
class MLP(eqx.Module):
    """`down(act(up x + bup)) + bdown`: the feed-forward of GPT-NeoX, BERT and ViT.

    **Arguments:**

    - `embd`: the input and output size.
    - `inner`: the hidden size.
    - `activation`: an `ACT2FN` name ("gelu", "gelu_new", ...).
    - `dtype`, `key`: the parameters' dtype and initialisation key (N(0, 0.02), zero biases).

    Called on `x` `[..., embd]`, returns `[..., embd]`. The leaves are `up` `[inner,
    embd]`, `bup`, `down` `[embd, inner]` and `bdown` (torch `Linear` layouts; always
    biased).

    ```python
    mlp = MLP(embd=768, inner=3072, activation="gelu", dtype=jnp.float32, key=key)
    mlp(jnp.zeros((2, 8, 768))).shape            # (2, 8, 768)
    ```
    """

    up: Float[Array, "mlp embed"]
    bup: Float[Array, " mlp"]
    down: Float[Array, "embed mlp"]
    bdown: Float[Array, " embed"]
    activation: str = eqx.field(static=True)

    def __init__(self, *, embd: int, inner: int, activation: str, dtype: Any, key: PRNGKeyArray):
        ku, kd = jax.random.split(key)
        self.up, self.bup = normal(ku, (inner, embd), dtype), jnp.zeros((inner,), dtype)
        self.down, self.bdown = normal(kd, (embd, inner), dtype), jnp.zeros((embd,), dtype)
        self.activation = activation

    def __call__(self, x: Float[Array, "... embed"]) -> Float[Array, "... embed"]:
        return linear(ACTIVATIONS[self.activation](linear(x, self.up, self.bup)), self.down, self.bdown)
