"""Rotary position embeddings: every scaling transformers' RoPE models ship, read from config.json.

`Rope` holds the settings (`read_rope` reads them from a config.json as transformers 5
standardises them: `rope_parameters`, or transformers 4's `rope_theta` / `rope_scaling`);
`Rope.angles(positions)` gives cos and sin, and `apply_rope` rotates the leading
`rotary_dim` dimensions of each head (partial rotary leaves the rest).

```python
rope = read_rope({"rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                  "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 8192}}, head_dim=64,
                 supported=("default", "llama3"), max_position_embeddings=131072)
cos, sin = rope.angles(jnp.arange(8)[None], jnp.float32)   # (1, 8, 64) each
q = apply_rope(q, cos, sin)                                  # q: (batch, seq, heads, head_dim)
```
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, final

import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from port._errors import ConfigError
from port._text import quoted
from port.nn.config import check

KINDS = ("default", "linear", "llama3", "yarn", "longrope")
"""The `rope_type`s port computes, as transformers' `ROPE_INIT_FUNCTIONS` does."""


@final
@dataclasses.dataclass(frozen=True)
class Rope:
    """RoPE settings; `inv_freq` and `angles` compute what transformers computes from them.

    **Fields:** `theta` (the base), `rotary_dim` (how many leading dimensions of a head
    rotate), `kind` (one of `KINDS`), `factor` (linear, llama3, yarn, longrope),
    `low_freq_factor` / `high_freq_factor` (llama3), `original_max_position_embeddings`
    (llama3, yarn, longrope), `short_factor` / `long_factor` (longrope: per frequency,
    up to the original length and beyond it), `attention_factor` (yarn, longrope: scales
    cos and sin), `beta_fast` / `beta_slow` / `truncate` (yarn's ramp).

    A frozen dataclass, so a family keeps it in its static config; `read_rope` makes one
    from a config.json.

    ```python
    rope = Rope(theta=10000.0, rotary_dim=64)
    rope.inv_freq().shape                                        # (32,)
    cos, sin = rope.angles(jnp.arange(8)[None], jnp.float32)     # (1, 8, 64) each
    ```
    """

    theta: float
    rotary_dim: int
    kind: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    short_factor: tuple[float, ...] = ()
    long_factor: tuple[float, ...] = ()
    attention_factor: float = 1.0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True

    def inv_freq(self, long: bool = False) -> np.ndarray:
        """Inverse frequencies [rotary_dim // 2], float32; `long`: longrope's long factors."""
        dim = self.rotary_dim
        exponents = np.arange(0, dim, 2).astype(np.float32) / np.float32(dim)
        base = np.float32(self.theta) ** exponents
        inv_freq = np.float32(1.0) / base
        if self.kind == "linear":
            inv_freq = inv_freq / np.float32(self.factor)
        elif self.kind == "llama3":
            factor = np.float32(self.factor)
            low, high = self.low_freq_factor, self.high_freq_factor
            old_len = self.original_max_position_embeddings
            low_wavelen, high_wavelen = old_len / low, old_len / high
            wavelen = np.float32(2 * math.pi) / inv_freq
            scaled = np.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
            smooth = (np.float32(old_len) / wavelen - np.float32(low)) / np.float32(high - low)
            smoothed = (1 - smooth) * scaled / factor + smooth * scaled
            medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
            inv_freq = np.where(medium, smoothed, scaled)
        elif self.kind == "yarn":
            inv_freq = self._yarn(base)
        elif self.kind == "longrope":
            factors = self.long_factor if long else self.short_factor
            inv_freq = np.float32(1.0) / (np.asarray(factors, np.float32) * base)
        return inv_freq.astype(np.float32)

    def _yarn(self, base: np.ndarray) -> np.ndarray:
        dim, original = self.rotary_dim, self.original_max_position_embeddings

        def correction(rotations: float) -> float:
            return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(self.theta))

        low, high = correction(self.beta_fast), correction(self.beta_slow)
        if self.truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, dim - 1)
        if low == high:
            high += 0.001
        ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - low) / (high - low), 0, 1)
        extrapolation = 1 - ramp.astype(np.float32)
        interpolation = np.float32(1.0) / (np.float32(self.factor) * base)
        return interpolation * (1 - extrapolation) + (np.float32(1.0) / base) * extrapolation

    def angles(
        self, positions: Int[Array, "*batch seq"], dtype: Any
    ) -> tuple[Float[Array, "*batch seq rotary"], Float[Array, "*batch seq rotary"]]:
        """cos and sin for each position, [..., rotary_dim], scaled by `attention_factor`, in `dtype`.

        longrope picks its long factors when the largest position reaches past the
        original context, as transformers' dynamic update does.
        """
        inv_freq = jnp.asarray(self.inv_freq())
        if self.kind == "longrope":
            longest = jnp.max(positions) + 1
            inv_freq = jnp.where(
                longest > self.original_max_position_embeddings, jnp.asarray(self.inv_freq(long=True)), inv_freq
            )
        freqs = positions.astype(jnp.float32)[..., None] * inv_freq
        angles = jnp.concatenate((freqs, freqs), axis=-1)
        scale = np.float32(self.attention_factor)
        return (jnp.cos(angles) * scale).astype(dtype), (jnp.sin(angles) * scale).astype(dtype)


def rotate_half(x: Array) -> Array:
    """(x1, x2) -> (-x2, x1) over the last axis, halves as transformers splits them."""
    x1, x2 = jnp.split(x, 2, axis=-1)
    return jnp.concatenate((-x2, x1), axis=-1)


def apply_rope(
    x: Float[Array, "*batch seq heads head_dim"],
    cos: Float[Array, "*batch seq rotary"],
    sin: Float[Array, "*batch seq rotary"],
) -> Float[Array, "*batch seq heads head_dim"]:
    """Rotate the first `cos.shape[-1]` dimensions of every head; the rest pass (partial RoPE).

    **Arguments:**

    - `x`: queries or keys `[..., seq, heads, head_dim]` (heads on the second-to-last axis).
    - `cos`, `sin`: `[..., seq, rotary]` from `Rope.angles` for the same positions,
      `rotary` at most `head_dim`.

    **Returns:** `x` with the first `rotary` dimensions of each head rotated (as
    transformers' `rotate_half` does), same shape and dtype when `cos` and `sin` have
    `x`'s dtype.

    ```python
    cos, sin = Rope(theta=10000.0, rotary_dim=32).angles(jnp.arange(8)[None], jnp.float32)
    apply_rope(jnp.ones((1, 8, 4, 64)), cos, sin).shape   # (1, 8, 4, 64); dims 32.. pass
    ```
    """
    rotary = cos.shape[-1]
    if rotary == 0:
        return x
    x_rot, rest = x[..., :rotary], x[..., rotary:]
    x_rot = x_rot * cos[..., None, :] + rotate_half(x_rot) * sin[..., None, :]
    return x_rot if rest.shape[-1] == 0 else jnp.concatenate((x_rot, rest), axis=-1)


def _first(*values: Any) -> Any:
    return next((v for v in values if v is not None), None)


def rope_parameters(config: dict, *, layer_type: str | None = None, default_theta: float = 10000.0) -> tuple[str, dict]:
    """The config.json key holding the RoPE settings, and the settings as transformers 5 standardises them.

    transformers 5 writes `rope_parameters` (with `rope_theta` and `rope_type`), or, for
    families whose local and global layers rotate differently (Gemma 3, ModernBERT), one
    such dict per layer type (`{"full_attention": {...}, "sliding_attention": {...}}`):
    `layer_type` picks one. transformers 4 wrote a top-level `rope_theta` and an optional
    `rope_scaling` (with `rope_type` or the legacy `type`). As in transformers,
    `rope_scaling` wins, and a top-level `original_max_position_embeddings` takes priority.
    `default_theta` is the config class's base where config.json names none.
    """
    key = "rope_scaling" if config.get("rope_scaling") else "rope_parameters"
    rope = config.get(key) or {}
    nested = isinstance(rope, dict) and any(isinstance(v, dict) for v in rope.values())
    if nested and layer_type is not None and isinstance(rope.get(layer_type), dict):
        key, rope = f"{key}.{layer_type}", rope[layer_type]
        nested = any(isinstance(v, dict) for v in rope.values())
    if not isinstance(rope, dict) or nested:
        wanted = f"a dict for {layer_type!r}" if layer_type else "one flat dict (per-layer-type RoPE is not supported)"
        raise ConfigError(f"config.json: {key!r} must be {wanted}, got {quoted(rope)}")
    rope = dict(rope)
    rope["rope_theta"] = _first(rope.get("rope_theta"), config.get("rope_theta"), default_theta)
    rope["rope_type"] = _first(rope.get("rope_type"), rope.get("type"), "default")
    if "original_max_position_embeddings" in config:
        rope["original_max_position_embeddings"] = config["original_max_position_embeddings"]
    rope["partial_rotary_factor"] = _first(rope.get("partial_rotary_factor"), config.get("partial_rotary_factor"), 1.0)
    return key, rope


def read_rope(
    config: dict,
    head_dim: int,
    *,
    supported: tuple[str, ...],
    max_position_embeddings: int,
    aliases: dict[str, str] | None = None,
    allow_partial: bool = False,
    layer_type: str | None = None,
    default_theta: float = 10000.0,
) -> Rope:
    """The `Rope` a config.json describes; `ConfigError` naming the key for anything unsupported.

    **Arguments:**

    - `config`: the config.json dict.
    - `head_dim`: the attention head size.
    - `supported`: the `rope_type`s this family's transformers class accepts.
    - `max_position_embeddings`: the model's context (the default for the original
      length, and for longrope / yarn factors that config.json leaves out).
    - `aliases`: old names of a type (Phi-3: `{"su": "longrope"}`).
    - `allow_partial`: whether `partial_rotary_factor` may be below 1.
    - `layer_type`: which of per-layer-type settings to read (`"sliding_attention"`,
      `"full_attention"`), where config.json gives one dict per layer type.
    - `default_theta`: the base where config.json names none: the family's config class
      default (SmolLM3: 2e6), never silently 10000 for a family whose default differs.

    **Returns:** a `Rope`, its `rotary_dim` `int(head_dim * partial_rotary_factor)`.

    ```python
    rope = read_rope({"rope_theta": 1000000.0}, 128, supported=("default", "yarn"),
                     max_position_embeddings=32768)
    rope.kind, rope.theta, rope.rotary_dim          # ('default', 1000000.0, 128)
    read_rope({"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, 128,
              supported=("default",), max_position_embeddings=4096)
    # ConfigError: config.json: rope_scaling: rope type 'dynamic' is not supported (supported: default)
    ```
    """
    key, rope = rope_parameters(config, layer_type=layer_type, default_theta=default_theta)
    kind = (aliases or {}).get(rope["rope_type"], rope["rope_type"])
    if kind not in supported:
        raise ConfigError(
            f"config.json: {key}: rope type {quoted(kind)} is not supported (supported: {', '.join(supported)})"
        )

    def value(name: str, kind_: type) -> Any:
        if rope.get(name) is None:
            raise ConfigError(f"config.json: required key '{key}.{name}' is missing")
        return check(f"{key}.{name}", rope[name], kind_)

    partial = value("partial_rotary_factor", float)
    rotary = int(head_dim * partial)
    if partial != 1.0 and not allow_partial:
        raise ConfigError(f"config.json: 'partial_rotary_factor' {partial!r} is not supported here (only 1.0)")
    if partial > 1.0 or rotary < 2 or rotary % 2:
        raise ConfigError(
            f"config.json: 'partial_rotary_factor' {partial!r} of head_dim {head_dim} gives "
            f"{rotary} rotary dimensions (must be even, at least 2, at most head_dim)"
        )
    fields: dict[str, Any] = {"theta": value("rope_theta", float), "rotary_dim": rotary, "kind": kind}
    if kind in ("llama3", "yarn", "longrope"):
        rope.setdefault("original_max_position_embeddings", max_position_embeddings)
        fields["original_max_position_embeddings"] = original = value("original_max_position_embeddings", int)
        if kind in ("yarn", "longrope"):
            factor = rope.get("factor")
            factor = check(f"{key}.factor", max_position_embeddings / original if factor is None else factor, float)
            fields["factor"] = factor
            if kind == "yarn":
                fields.update(_yarn(rope, key, factor))
            else:
                fields.update(_longrope(rope, key, rotary, factor, original))
    if kind in ("linear", "llama3"):
        fields["factor"] = value("factor", float)
    if kind == "llama3":
        fields["low_freq_factor"] = value("low_freq_factor", float)
        fields["high_freq_factor"] = value("high_freq_factor", float)
    return Rope(**fields)


def _yarn(rope: dict, key: str, factor: float) -> dict[str, Any]:
    """yarn's attention factor (from `mscale` / `mscale_all_dim` when both are set) and ramp."""

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention = rope.get("attention_factor")
    if attention is None:
        m, m_all = rope.get("mscale"), rope.get("mscale_all_dim")
        attention = mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)
    return {
        "attention_factor": check(f"{key}.attention_factor", attention, float),
        "beta_fast": check(f"{key}.beta_fast", rope.get("beta_fast") or 32, float),
        "beta_slow": check(f"{key}.beta_slow", rope.get("beta_slow") or 1, float),
        "truncate": bool(rope.get("truncate", True)),
    }


def _longrope(rope: dict, key: str, rotary: int, factor: float, original: int) -> dict[str, Any]:
    """longrope (Phi-3 128k): short and long per-frequency factors, and the attention factor."""
    factors = {}
    for name in ("short_factor", "long_factor"):
        value = rope.get(name)
        if (
            not isinstance(value, list)
            or len(value) != rotary // 2
            or not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in value)
            or not all(math.isfinite(v) and v > 0 for v in value)
        ):
            raise ConfigError(
                f"config.json: '{key}.{name}' must list {rotary // 2} positive numbers "
                f"(one per rotary frequency), got {quoted(value)}"
            )
        factors[name] = tuple(float(v) for v in value)
    attention = rope.get("attention_factor")
    if attention is None:
        attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    return {
        "short_factor": factors["short_factor"],
        "long_factor": factors["long_factor"],
        "attention_factor": check(f"{key}.attention_factor", attention, float),
    }
