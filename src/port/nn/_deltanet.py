"""Gated DeltaNet linear attention (Qwen3-Next, Qwen3.5): a chunked form for prefill and
training, a recurrent form for decoding, and the layer around them.

The gated delta rule keeps one state `S` `[heads, key_dim, value_dim]` per sequence:
at each token `S <- exp(g) S`, then `S <- S + beta k (v - S^T k)^T`, and the output is
`S^T q` (queries and keys L2-normalised, queries scaled by `key_dim**-0.5`).
`chunk_gated_delta_rule` computes the same thing a chunk of tokens at a time (the UT
transform of the DeltaNet paper, as transformers' `torch_chunk_gated_delta_rule`);
`recurrent_gated_delta_rule` one token at a time. Both run in float32.

`GatedDeltaNet` is the layer: q/k/v/z/b/a projections (torch `Linear` layouts split per
head), a causal depthwise conv1d with SiLU over q, k and v, the rule, a gated RMSNorm of
the output and the output projection. Its cache entry is `(conv, recurrent)`: the last
`kernel - 1` conv inputs of q, k and v, and the recurrent state.

```python
net = GatedDeltaNet(embd=64, key_heads=2, value_heads=4, key_dim=16, value_dim=16, kernel=4,
                    dtype=jnp.float32, key=jax.random.key(0))
y, _ = net(x)                                     # x: [batch, seq, 64] -> y: same
y, state = net(x, state=net.empty_state(batch))   # prefill, then one token at a time
```
"""

from __future__ import annotations

from typing import Any, final

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, PRNGKeyArray

from port.nn._init import normal

State = tuple[tuple[Array, Array, Array], Array]
"""One layer's cache entry: `((conv_q, conv_k, conv_v), recurrent)`."""


def l2norm(x: Float[Array, "*rest dim"], eps: float = 1e-6) -> Float[Array, "*rest dim"]:
    """`x / sqrt(sum(x^2) + eps)` over the last axis (transformers' / FLA's `l2norm`).

    **Arguments:** `x`, any shape; `eps` inside the square root.

    **Returns:** `x`'s shape and dtype, each vector along the last axis of unit length.

    ```python
    l2norm(jnp.array([3.0, 4.0]))   # ~[0.6, 0.8]
    ```
    """
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + eps)


def _prepare(q: Array, k: Array, v: Array, g: Array, beta: Array, normalize: bool) -> tuple[Array, ...]:
    """Float32; q/k heads repeated to v's (each q/k head serves consecutive v heads); normed, q scaled."""
    repeat = v.shape[2] // k.shape[2]
    q, k = jnp.repeat(q, repeat, axis=2), jnp.repeat(k, repeat, axis=2)
    q, k, v, g, beta = (a.astype(jnp.float32) for a in (q, k, v, g, beta))
    if normalize:
        q, k = l2norm(q), l2norm(k)
    return q * q.shape[-1] ** -0.5, k, v, g, beta


def recurrent_gated_delta_rule(
    q: Float[Array, "batch seq linear_heads key_dim"],
    k: Float[Array, "batch seq linear_heads key_dim"],
    v: Float[Array, "batch seq linear_v_heads value_dim"],
    g: Float[Array, "batch seq linear_v_heads"],
    beta: Float[Array, "batch seq linear_v_heads"],
    *,
    initial_state: Float[Array, "batch linear_v_heads key_dim value_dim"] | None = None,
    normalize: bool = True,
) -> tuple[Float[Array, "batch seq linear_v_heads value_dim"], Float[Array, "batch linear_v_heads key_dim value_dim"]]:
    """The gated delta rule one token at a time (decoding; any length).

    **Arguments:**

    - `q`, `k`: queries and keys `[batch, seq, key_heads, key_dim]` (`heads` a multiple of
      `key_heads`: v head h reads q/k head `h // (heads / key_heads)`).
    - `v`: values `[batch, seq, heads, value_dim]`.
    - `g`: the log decay `[batch, seq, heads]` (<= 0); `beta`: the write strength, same shape.
    - `initial_state`: the state to start from (None: zeros).
    - `normalize`: L2-normalise q and k first (Qwen3-Next does).

    **Returns:** `(out, state)`: the output in `v`'s dtype and the final state (float32).

    ```python
    out, state = recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=state)
    ```
    """
    dtype = v.dtype
    q, k, v, g, beta = _prepare(q, k, v, g, beta, normalize)
    batch, _, heads, key_dim = q.shape
    state = (
        jnp.zeros((batch, heads, key_dim, v.shape[-1]), jnp.float32)
        if initial_state is None
        else initial_state.astype(jnp.float32)
    )

    def step(s: Array, xs: tuple[Array, ...]) -> tuple[Array, Array]:
        qt, kt, vt, gt, bt = xs
        s = s * jnp.exp(gt)[..., None, None]
        delta = (vt - jnp.einsum("bhkv,bhk->bhv", s, kt)) * bt[..., None]
        s = s + kt[..., None] * delta[..., None, :]
        return s, jnp.einsum("bhkv,bhk->bhv", s, qt)

    state, out = jax.lax.scan(step, state, tuple(jnp.moveaxis(a, 1, 0) for a in (q, k, v, g, beta)))
    return jnp.moveaxis(out, 0, 1).astype(dtype), state


def _unit_lower_inverse(lower: Float[Array, "... n n"]) -> Float[Array, "... n n"]:
    """`(I + lower)^-1` for a strictly lower triangular `lower`, by matmuls only.

    `lower` is nilpotent (`lower^n = 0`), so `(I + L)(I - L)(I + L^2)(I + L^4)...` telescopes
    to `I - L^(2^m) = I` once `2^m >= n`: log2(n) squarings and products. Not
    `jax.lax.linalg.triangular_solve`: inside a scan over layers whose inputs are sharded,
    XLA's CPU runtime deadlocks on it (jax 0.10.2, 8 simulated devices); matmuls also suit
    accelerators better than a substitution.
    """
    n = lower.shape[-1]
    eye = jnp.eye(n, dtype=lower.dtype)
    inverse, power, reach = eye - lower, lower, 2
    while reach < n:
        power = power @ power
        inverse = inverse @ (eye + power)
        reach *= 2
    return inverse


def chunk_gated_delta_rule(
    q: Float[Array, "batch seq linear_heads key_dim"],
    k: Float[Array, "batch seq linear_heads key_dim"],
    v: Float[Array, "batch seq linear_v_heads value_dim"],
    g: Float[Array, "batch seq linear_v_heads"],
    beta: Float[Array, "batch seq linear_v_heads"],
    *,
    chunk_size: int = 64,
    initial_state: Float[Array, "batch linear_v_heads key_dim value_dim"] | None = None,
    normalize: bool = True,
) -> tuple[Float[Array, "batch seq linear_v_heads value_dim"], Float[Array, "batch linear_v_heads key_dim value_dim"]]:
    """The gated delta rule `chunk_size` tokens at a time: matmuls within a chunk (the UT
    transform: a unit lower-triangular system, inverted by matmuls), a scan over chunks. Equal to
    `recurrent_gated_delta_rule`, differentiable, and what prefill and training use.

    **Arguments:** `q`, `k`, `v`, `g`, `beta`, `initial_state`, `normalize` as in
    `recurrent_gated_delta_rule`; `chunk_size`, the tokens per chunk (the sequence is
    padded to a multiple of it).

    **Returns:** `(out, state)`: the output in `v`'s dtype and the final state (float32).

    ```python
    out, state = chunk_gated_delta_rule(q, k, v, g, beta)          # out: v's shape
    ```
    """
    dtype = v.dtype
    q, k, v, g, beta = _prepare(q, k, v, g, beta, normalize)
    batch, seq, heads, key_dim = q.shape
    value_dim = v.shape[-1]
    size = chunk_size
    pad = (-seq) % size

    # [batch, heads, chunks, size, ...]
    def chunked(a):
        return jnp.pad(jnp.moveaxis(a, 1, 2), [(0, 0), (0, 0), (0, pad)] + [(0, 0)] * (a.ndim - 3)).reshape(
            batch, heads, -1, size, *a.shape[3:]
        )

    q, k, v, g, beta = (chunked(a) for a in (q, k, v, g, beta))
    v_beta, k_beta = v * beta[..., None], k * beta[..., None]
    cum = jnp.cumsum(g, axis=-1)
    upper = jnp.triu(jnp.ones((size, size), bool), 1)
    pairwise = jnp.exp(jnp.where(upper, -jnp.inf, cum[..., :, None] - cum[..., None, :]))
    system = jnp.einsum("...ik,...jk->...ij", k_beta, k) * pairwise
    intra = jnp.einsum("...ik,...jk->...ij", q, k) * pairwise
    inverse = _unit_lower_inverse(system * jnp.tril(jnp.ones((size, size), system.dtype), -1))
    solve = lambda b: inverse @ b  # noqa: E731
    new_values, k_cumdecay = solve(v_beta), solve(k_beta * jnp.exp(cum)[..., None])
    q = q * jnp.exp(cum)[..., None]
    k = k * jnp.exp(cum[..., -1:] - cum)[..., None]
    chunk_decay = jnp.exp(cum[..., -1])[..., None, None]
    state = (
        jnp.zeros((batch, heads, key_dim, value_dim), jnp.float32)
        if initial_state is None
        else initial_state.astype(jnp.float32)
    )

    def step(s: Array, xs: tuple[Array, ...]) -> tuple[Array, Array]:
        values, cumdecay, qc, kc, attn, decay = xs
        fresh = values - cumdecay @ s
        out = qc @ s + attn @ fresh
        return s * decay + jnp.swapaxes(kc, -1, -2) @ fresh, out

    xs = tuple(jnp.moveaxis(a, 2, 0) for a in (new_values, k_cumdecay, q, k, intra, chunk_decay))
    state, out = jax.lax.scan(step, state, xs)
    out = jnp.moveaxis(out, 0, 2).reshape(batch, heads, -1, value_dim)[:, :, :seq]
    return jnp.moveaxis(out, 1, 2).astype(dtype), state


def causal_conv(
    x: Float[Array, "batch seq groups dim"], weight: Float[Array, "groups dim kernel"], state: Array | None
) -> tuple[Float[Array, "batch seq groups dim"], Array]:
    """Depthwise causal conv1d then SiLU, after the `kernel - 1` inputs of `state` (None: zeros).

    **Arguments:** `x` `[batch, seq, heads, dim]`; `weight` `[heads, dim, kernel]` (the
    channels of torch's `conv1d.weight`); `state`, the inputs before `x` (None: zeros).

    **Returns:** `(out, state)`: `x`'s shape and dtype, and the last `kernel - 1` inputs
    (`[batch, kernel - 1, heads, dim]`, in `state`'s dtype, else `x`'s).

    ```python
    y, state = causal_conv(x, weight, None)   # weight: torch conv1d.weight [C, 1, K] as [heads, dim, K]
    ```
    """
    size = weight.shape[-1]
    past = jnp.zeros((x.shape[0], size - 1, *x.shape[2:]), x.dtype) if state is None else state
    full = jnp.concatenate([past.astype(x.dtype), x], axis=1)
    seq = x.shape[1]
    w = weight.astype(jnp.float32)
    out = jnp.asarray(sum(full[:, j : j + seq].astype(jnp.float32) * w[..., j] for j in range(size)))
    return jax.nn.silu(out.astype(x.dtype)), full[:, full.shape[1] - (size - 1) :].astype(past.dtype)


def gated_rms_norm(
    x: Float[Array, "*rest dim"], gate: Float[Array, "*rest dim"], weight: Float[Array, " dim"], eps: float
) -> Float[Array, "*rest dim"]:
    """RMSNorm of `x` (Llama's form, `weight * x_hat`), times `silu(gate)` in float32; `x`'s dtype
    (transformers' `Qwen3NextRMSNormGated`).

    **Arguments:** `x` and `gate` of one shape; `weight` `[dim]`; `eps` of the norm.

    **Returns:** `x`'s shape and dtype.

    ```python
    gated_rms_norm(jnp.ones((2, 4)), jnp.zeros((2, 4)), jnp.ones(4), 1e-6)   # zeros: silu(0) = 0
    ```
    """
    h = x.astype(jnp.float32)
    h = h * jax.lax.rsqrt(jnp.mean(h * h, axis=-1, keepdims=True) + eps)
    h = weight * h.astype(x.dtype)
    return (h.astype(jnp.float32) * jax.nn.silu(gate.astype(jnp.float32))).astype(x.dtype)


@final
class GatedDeltaNet(eqx.Module):
    """Gated DeltaNet linear attention (see the module's docstring).

    **Arguments:** `embd`; `key_heads`, `value_heads` (a multiple of `key_heads`), their
    sizes `key_dim`, `value_dim`; the conv `kernel`; `dtype`, `key`; `eps` of the gated
    norm; `chunk_size` of the chunked rule.

    Leaves (torch layouts split per head): `wq`, `wk` `[key_heads, key_dim, embd]`; `wv`,
    `wz` `[value_heads, value_dim, embd]`; `wb`, `wa` `[value_heads, embd]`; `conv_q`,
    `conv_k` `[key_heads, key_dim, kernel]`, `conv_v` `[value_heads, value_dim, kernel]`;
    `dt_bias`, `a_log` `[value_heads]`; `norm` `[value_dim]`; `wo` `[embd, value_heads, value_dim]`.

    Called as `net(x, valid=None, *, state=None)` -> `(y, state)`: `valid` `[batch, seq]`
    zeroes padding tokens' inputs (as transformers does); with a `state` (from
    `empty_state` or a previous call) it continues from it and returns the new one; one
    token with a state runs the recurrent form, anything else the chunked one.

    ```python
    y, state = net(x, tokens_valid, state=net.empty_state(batch=2))
    ```
    """

    wq: Float[Array, "linear_heads key_dim embed"]
    wk: Float[Array, "linear_heads key_dim embed"]
    wv: Float[Array, "linear_v_heads value_dim embed"]
    wz: Float[Array, "linear_v_heads value_dim embed"]
    wb: Float[Array, "linear_v_heads embed"]
    wa: Float[Array, "linear_v_heads embed"]
    conv_q: Float[Array, "linear_heads key_dim kernel"]
    conv_k: Float[Array, "linear_heads key_dim kernel"]
    conv_v: Float[Array, "linear_v_heads value_dim kernel"]
    dt_bias: Float[Array, " linear_v_heads"]
    a_log: Float[Array, " linear_v_heads"]
    norm: Float[Array, " value_dim"]
    wo: Float[Array, "embed linear_v_heads value_dim"]
    eps: float = eqx.field(static=True)
    chunk_size: int = eqx.field(static=True)

    def __init__(
        self,
        *,
        embd: int,
        key_heads: int,
        value_heads: int,
        key_dim: int,
        value_dim: int,
        kernel: int,
        dtype: Any,
        key: PRNGKeyArray,
        eps: float = 1e-6,
        chunk_size: int = 64,
    ):
        if value_heads % key_heads:
            raise ValueError(f"value_heads ({value_heads}) must be a multiple of key_heads ({key_heads})")
        ks = jax.random.split(key, 10)
        self.wq, self.wk = (
            normal(ks[0], (key_heads, key_dim, embd), dtype),
            normal(ks[1], (key_heads, key_dim, embd), dtype),
        )
        self.wv, self.wz = (
            normal(ks[2], (value_heads, value_dim, embd), dtype),
            normal(ks[3], (value_heads, value_dim, embd), dtype),
        )
        self.wb, self.wa = normal(ks[4], (value_heads, embd), dtype), normal(ks[5], (value_heads, embd), dtype)
        self.conv_q = normal(ks[6], (key_heads, key_dim, kernel), dtype)
        self.conv_k = normal(ks[7], (key_heads, key_dim, kernel), dtype)
        self.conv_v = normal(ks[8], (value_heads, value_dim, kernel), dtype)
        self.dt_bias = jnp.ones((value_heads,), dtype)
        self.a_log = jnp.zeros((value_heads,), dtype)
        self.norm = jnp.ones((value_dim,), dtype)
        self.wo = normal(ks[9], (embd, value_heads, value_dim), dtype)
        self.eps, self.chunk_size = eps, chunk_size

    def empty_state(self, batch: int, dtype: Any = None) -> State:
        """A zero cache entry for `batch` sequences (conv inputs in `dtype`, default the parameters')."""
        dtype = self.wq.dtype if dtype is None else dtype
        past = self.conv_q.shape[-1] - 1
        q, k, v = (jnp.zeros((batch, past, *w.shape[:2]), dtype) for w in (self.conv_q, self.conv_k, self.conv_v))
        heads, value_dim = self.wv.shape[:2]
        return (q, k, v), jnp.zeros((batch, heads, self.wq.shape[1], value_dim), jnp.float32)

    def __call__(
        self,
        x: Float[Array, "batch seq embed"],
        valid: Bool[Array, "batch seq"] | None = None,
        *,
        state: State | None = None,
    ) -> tuple[Float[Array, "batch seq embed"], State | None]:
        if valid is not None:
            x = x * valid[..., None].astype(x.dtype)

        def proj(w):
            return jnp.einsum("bte,hde->bthd", x, w)

        conv = (None, None, None) if state is None else state[0]
        (q, cq), (k, ck), (v, cv) = (
            causal_conv(proj(w), c, s)
            for w, c, s in zip((self.wq, self.wk, self.wv), (self.conv_q, self.conv_k, self.conv_v), conv)
        )
        beta = jax.nn.sigmoid(jnp.einsum("bte,he->bth", x, self.wb))
        a = jnp.einsum("bte,he->bth", x, self.wa).astype(jnp.float32)
        g = -jnp.exp(self.a_log.astype(jnp.float32)) * jax.nn.softplus(a + self.dt_bias.astype(jnp.float32))
        recurrent = None if state is None else state[1]
        if recurrent is not None and x.shape[1] == 1:
            out, recurrent = recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=recurrent)
        else:
            out, recurrent = chunk_gated_delta_rule(
                q, k, v, g, beta, chunk_size=self.chunk_size, initial_state=recurrent
            )
        out = gated_rms_norm(out, proj(self.wz), self.norm, self.eps)
        y = jnp.einsum("bthd,ehd->bte", out, self.wo)
        return y, None if state is None else ((cq, ck, cv), recurrent)
