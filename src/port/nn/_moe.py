"""A routed mixture of experts whose cost follows top-k.

Each token's router picks `top_k` experts; the (token, expert) pairs are sorted by
expert and each expert's gated MLP runs on its own tokens only, as grouped matmuls
(`jax.lax.ragged_dot`, which GPUs and TPUs run as grouped GEMMs); the outputs are
weighted and added back to their tokens. No token is dropped, so the result is
transformers' exactly (no capacity factor). Scoring is a softmax (Mixtral, Qwen-MoE,
gpt-oss) or a sigmoid with a selection bias and group-limited choice (DeepSeek-V3);
a shared expert, gated or not, may be added to every token. The router may have a
bias and the experts biases and gpt-oss's clamped SwiGLU (`limit`, `alpha`).

```python
moe = MoE(embd=512, inner=256, experts=8, top_k=2, activation="silu", dtype=jnp.float32, key=key)
y = moe(x)                       # x: [..., 512]
```
"""

from __future__ import annotations

from typing import Any, final

import equinox as eqx
import jax
import jax.numpy as jnp
from jax.typing import ArrayLike
from jaxtyping import Array, Float, Int, PRNGKeyArray

from port.nn._init import normal, stacked, zeros_if
from port.nn._mlp import GatedMLP, linear

_GROUPED = jax.lax.RaggedDotDimensionNumbers(
    dot_dimension_numbers=(((1,), (2,)), ((), ())), lhs_ragged_dimensions=[0], rhs_group_dimensions=[0]
)
"""ragged_dot of tokens `[rows, in]` with expert weights in torch layout `[experts, out, in]`."""


def grouped(
    x: Float[Array, "rows in"], weights: Float[Array, "experts out in"], sizes: Int[Array, " experts"]
) -> Array:
    """Rows of `x` sorted by expert, each times its expert's weight: `[rows, out]`."""
    return jax.lax.ragged_dot_general(x, weights, sizes, _GROUPED)


SCORES = {
    "softmax": lambda logits: jax.nn.softmax(logits, axis=-1),
    "sigmoid": jax.nn.sigmoid,
    "sqrtsoftplus": lambda logits: jnp.sqrt(jax.nn.softplus(logits)),
}
"""The routers' scoring functions, by transformers' `scoring_func` name."""


def route(
    logits: Float[ArrayLike, "tokens experts"],
    top_k: int,
    *,
    scoring: str = "softmax",
    renormalise: bool = True,
    selection_bias: Float[ArrayLike, " experts"] | None = None,
    groups: int = 1,
    top_groups: int = 1,
    scale: float = 1.0,
    chosen: Int[ArrayLike, "tokens top_k"] | None = None,
) -> tuple[Float[Array, "tokens top_k"], Int[Array, "tokens top_k"]]:
    """Each token's `top_k` experts and their weights (float32), as transformers' routers choose them.

    **Arguments:**

    - `logits`: the router's output.
    - `top_k`: experts per token.
    - `scoring`: "softmax" (probabilities over all experts), "sigmoid" (each expert's
      own score, DeepSeek-V3) or "sqrtsoftplus" (`sqrt(softplus(logit))`, DeepSeek-V4).
    - `renormalise`: divide the chosen weights by their sum.
    - `selection_bias`: added to the scores to choose experts, not to weight them
      (DeepSeek-V3's `e_score_correction_bias`).
    - `groups`, `top_groups`: group-limited routing: experts are split into `groups`,
      each group scored by the sum of its two best experts, and only the `top_groups`
      best groups may be chosen from.
    - `scale`: multiplies the weights (`routed_scaling_factor`).
    - `chosen`: the experts, given (DeepSeek-V4's hash routing: a table by token id);
      only their weights are computed.

    **Returns:** `(weights, experts)`, `[tokens, top_k]` each.

    ```python
    route(jnp.array([[0.0, 1.0, 2.0]]), 2)   # ([[0.731, 0.269]], [[2, 1]])
    ```
    """
    logits = jnp.asarray(logits).astype(jnp.float32)
    scores = SCORES[scoring](logits)
    choice = scores if selection_bias is None else scores + jnp.asarray(selection_bias).astype(jnp.float32)
    if groups > 1:
        tokens, experts = choice.shape
        grouped_scores = choice.reshape(tokens, groups, experts // groups)
        group_score = jax.lax.top_k(grouped_scores, 2)[0].sum(axis=-1)
        _, best = jax.lax.top_k(group_score, top_groups)
        allowed = jnp.zeros((tokens, groups), bool).at[jnp.arange(tokens)[:, None], best].set(True)
        allowed = jnp.repeat(allowed, experts // groups, axis=-1)
        choice = jnp.where(allowed, choice, -jnp.inf)  # a closed group's experts are never chosen
    _, index = jax.lax.top_k(choice, top_k) if chosen is None else (None, jnp.asarray(chosen))
    weights = jnp.take_along_axis(scores, index, axis=-1)
    if renormalise:
        denominator = weights.sum(axis=-1, keepdims=True)
        weights = weights / (denominator if scoring == "softmax" else denominator + 1e-20)
    return weights * scale, index


@final
class MoE(eqx.Module):
    """Routed gated-MLP experts (`experts`, arrays `[experts, ...]`), an optional shared expert.

    **Arguments:**

    - `embd`, `inner` (each expert's hidden size), `experts` (how many), `top_k`
      (experts per token), `activation` (an `ACT2FN` name), `dtype`, `key`.
    - `scoring`, `renormalise`, `groups`, `top_groups`, `scale`: as in `route`;
      `selection_bias`: whether there is a learned `selection_bias` leaf.
    - `shared_inner`: the shared expert's hidden size (None: none); `shared_gate`:
      whether the shared expert's output is scaled by `sigmoid(shared_gate . x)`, a
      learned `shared_gate` leaf `[embd]` (Qwen2-MoE).
    - `weights_in_input_dtype`: cast the routing weights to the activations' dtype
      before weighting (Qwen-MoE) rather than weighting in float32 (Mixtral).
    - `router_bias`: whether the router has a learned bias, a `router_bias` leaf
      `[experts]` added to its logits (gpt-oss). gpt-oss's router takes the top k of the
      logits and a softmax over those k: that is `scoring="softmax"` with `renormalise`
      (the softmax is monotonic, and renormalising its top k is the softmax of their logits).
    - `weight_inputs`: multiply each chosen expert's *input* by its weight, not its
      output (Llama 4: `sigmoid` scoring, top 1, no renormalising).
    - `bias`: biases on the experts' projections (`experts.bgate`, `bup`, `bdown`,
      `[experts, ...]`); `limit`, `alpha`: the experts' (and the shared expert's) clamped SwiGLU, as `GatedMLP`'s.

    Called on `x` `[..., embd]`, returns the same shape. The leaves are
    `router` `[experts, embd]`, the optional `router_bias`, `experts` (a `GatedMLP` stacked by `stacked`, arrays
    `[experts, ...]`), `shared` (a `GatedMLP`, or None) and the optional
    `selection_bias` / `shared_gate`.

    ```python
    moe = MoE(embd=512, inner=256, experts=8, top_k=2, activation="silu", dtype=jnp.float32, key=key)
    moe(jnp.zeros((2, 8, 512))).shape          # (2, 8, 512)
    moe.experts.gate.shape                     # (8, 256, 512)
    ```
    """

    router: Float[Array, "experts embed"]
    router_bias: Float[Array, " experts"] | None
    selection_bias: Float[Array, " experts"] | None
    experts: GatedMLP
    shared: GatedMLP | None
    shared_gate: Float[Array, " embed"] | None
    top_k: int = eqx.field(static=True)
    scoring: str = eqx.field(static=True)
    renormalise: bool = eqx.field(static=True)
    groups: int = eqx.field(static=True)
    top_groups: int = eqx.field(static=True)
    scale: float = eqx.field(static=True)
    weights_in_input_dtype: bool = eqx.field(static=True)
    weight_inputs: bool = eqx.field(static=True)

    def __init__(
        self,
        *,
        embd: int,
        inner: int,
        experts: int,
        top_k: int,
        activation: str,
        dtype: Any,
        key: PRNGKeyArray,
        scoring: str = "softmax",
        renormalise: bool = True,
        selection_bias: bool = False,
        groups: int = 1,
        top_groups: int = 1,
        scale: float = 1.0,
        shared_inner: int | None = None,
        shared_gate: bool = False,
        weights_in_input_dtype: bool = False,
        router_bias: bool = False,
        weight_inputs: bool = False,
        bias: bool = False,
        limit: float | None = None,
        alpha: float | None = 1.0,
    ):
        krouter, kexperts, kshared, kgate = jax.random.split(key, 4)
        self.router = normal(krouter, (experts, embd), dtype)
        self.router_bias = zeros_if(router_bias, (experts,), dtype)
        self.selection_bias = jnp.zeros((experts,), dtype) if selection_bias else None

        def make(k):
            return GatedMLP(
                embd=embd, inner=inner, activation=activation, dtype=dtype, key=k, bias=bias, limit=limit, alpha=alpha
            )

        self.experts = stacked(make, kexperts, experts)
        self.shared = (
            None
            if shared_inner is None
            else GatedMLP(
                embd=embd, inner=shared_inner, activation=activation, dtype=dtype, key=kshared, limit=limit, alpha=alpha
            )
        )
        self.shared_gate = normal(kgate, (embd,), dtype) if shared_inner is not None and shared_gate else None
        self.top_k, self.scoring, self.renormalise = top_k, scoring, renormalise
        self.groups, self.top_groups, self.scale = groups, top_groups, scale
        self.weights_in_input_dtype = weights_in_input_dtype
        self.weight_inputs = weight_inputs

    def __call__(
        self, x: Float[Array, "... embed"], chosen: Int[Array, "... top_k"] | None = None
    ) -> Float[Array, "... embed"]:
        """`chosen`: each token's experts, given (hash routing); None: the router chooses."""
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        weights, index = route(
            linear(x, self.router, self.router_bias),
            self.top_k,
            scoring=self.scoring,
            renormalise=self.renormalise,
            selection_bias=self.selection_bias,
            groups=self.groups,
            top_groups=self.top_groups,
            scale=self.scale,
            chosen=None if chosen is None else chosen.reshape(-1, self.top_k),
        )
        if self.weights_in_input_dtype:
            weights = weights.astype(x.dtype)
        y = self._dispatch(x, weights, index)
        if self.shared is not None:
            shared = self.shared(x)
            if self.shared_gate is not None:
                shared = jax.nn.sigmoid(jnp.einsum("te,e->t", x, self.shared_gate))[:, None] * shared
            y = y + shared
        return y.reshape(shape)

    def _dispatch(self, x: Array, weights: Array, index: Array) -> Array:
        """Every (token, chosen expert) pair through its expert, grouped by expert."""
        experts = self.router.shape[0]
        flat = index.reshape(-1)
        order = jnp.argsort(flat, stable=True)
        token = order // self.top_k
        sizes = jnp.bincount(flat, length=experts).astype(jnp.int32)
        weight = weights.reshape(-1)[order][:, None]
        rows = (x[token] * weight).astype(x.dtype) if self.weight_inputs else x[token]
        mlp, chosen = self.experts, flat[order]

        def project(w: Array, b: Array | None, h: Array) -> Array:
            out = grouped(h, w, sizes)
            return out if b is None else out + b[chosen]

        h = mlp.glu(project(mlp.gate, mlp.bgate, rows), project(mlp.up, mlp.bup, rows))
        out = project(mlp.down, mlp.bdown, h)
        # Weighted in the weights' dtype, then cast, as transformers does per expert.
        out = (out if self.weight_inputs else out * weight).astype(x.dtype)
        return jnp.zeros_like(x).at[token].add(out)
