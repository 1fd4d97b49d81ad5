"""Gemma 4's language model (`gemma4_text`, and the text half of `gemma4`), dense or with experts.

What is new in the family, as transformers' `Gemma4Text*` classes compute it:

- Two kinds of layer, each its own stack (`Gemma4.sliding`, `Gemma4.full`; the model's
  `layer_groups`), run in checkpoint order by `port.nn.run_groups`: local layers
  attend within `sliding_window` with `head_dim`-sized heads and a plain RoPE (base
  10000 by default); global layers see every position with heads of their own size
  and count (`per_layer_config`, or `global_head_dim` / `num_global_key_value_heads`),
  and a "proportional" RoPE (base 1e6) that turns only `partial_rotary_factor` of each
  head's frequencies (the rest are zero: those features pass unrotated).
- Attention scaled by 1, after RMSNorm of each query and key head (`weight * x_hat`,
  in float32) and a scale-free RMSNorm of each value head; with `attention_k_eq_v` the
  global layers have no value projection: values are the keys' projection.
- Four norms a layer (before and after the attention and the MLP); with
  `enable_moe_block` a routed mixture of experts beside the MLP, its router on the
  scale-free normed input times a learned `router_scale` and `hidden_size**-0.5`, its
  chosen weights renormalised and multiplied by a learned `expert_scale` per expert, the
  two branches normed apart and summed.
- Per-layer embeddings (`hidden_size_per_layer_input`): a second token table and a
  projection of the embeddings give every layer a small input, gated into its output
  after the MLP. They ride along the hidden state in the layer scan (the last
  `num_hidden_layers * hidden_size_per_layer_input` features of the carry), each layer
  reading its own slice.
- Each layer's output is multiplied by its `layer_scalar` (a checkpoint buffer); the
  embeddings by `sqrt(hidden_size)` in the parameters' dtype; the logits soft-capped by
  `final_logit_softcapping`.
- The last `num_kv_shared_layers` layers (Gemma 4 E2B / E4B) have no key or value
  projection: each reuses the keys and values of the last earlier layer of its type
  (stacks `shared_sliding`, `shared_full`), which ride along the hidden state in the scan;
  with `use_double_wide_mlp` their MLPs are twice as wide. Each writes those keys and
  values to its own rows of the cache, so its rows hold what transformers reads from
  the earlier layer's (the cache is as large as without sharing).

Bidirectional attention (`use_bidirectional_attention` "all") is refused, one line naming
the field (`Gemma4.FIELDS`).

Example:
    ```python
    import jax
    from port.models.gemma4 import Gemma4

    config = {"model_type": "gemma4_text", "vocab_size": 97, "hidden_size": 48,
              "intermediate_size": 80, "num_hidden_layers": 3, "num_attention_heads": 4,
              "num_key_value_heads": 2, "head_dim": 12, "global_head_dim": 16,
              "hidden_size_per_layer_input": 0, "sliding_window": 4,
              "layer_types": ["sliding_attention", "sliding_attention", "full_attention"]}
    model = Gemma4.from_config(config, key=jax.random.key(0))
    model.layer_groups                        # {'sliding': (0, 1), 'full': (2,)}
    logits = model(jax.numpy.zeros((1, 8), jax.numpy.int32))   # (1, 8, 97)
    ```
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, ClassVar, final

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Float, Int, PRNGKeyArray

from port._errors import ConfigError
from port._text import quoted
from port.nn import (
    Cache,
    Decoder,
    GatedMLP,
    MoE,
    Rope,
    Tokens,
    apply_rope,
    attend,
    embeddings,
    head,
    rms_norm,
    route,
    run_groups,
    stacked,
    with_cache,
)
from port.nn._attention import KV
from port.nn._cache import check_sizes
from port.nn._init import normal, zeros_if
from port.nn._mlp import linear
from port.nn._rope import rope_parameters
from port.nn.config import (
    ACTIVATIONS,
    MAX_LAYERS,
    ConfigFields,
    activation,
    check,
    check_model_type,
    get,
    read_kv_heads,
)

MODEL_TYPES = ("gemma4_text", "gemma4")
LAYER_TYPES = {"sliding_attention": "sliding", "full_attention": "full"}
KINDS = ("sliding", "full", "shared_sliding", "shared_full")
"""The layer stacks: local and global layers, and those reusing an earlier layer's keys and values."""
ROPE_TYPES = ("default", "proportional")

FIELDS = ConfigFields(
    "port.models.gemma4.Gemma4",
    read=(
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "global_head_dim",
        "num_global_key_value_heads",
        "per_layer_config",
        "hidden_activation",
        "max_position_embeddings",
        "rms_norm_eps",
        "tie_word_embeddings",
        "rope_parameters",
        "attention_bias",
        "sliding_window",
        "layer_types",
        "final_logit_softcapping",
        "vocab_size_per_layer_input",
        "hidden_size_per_layer_input",
        "attention_k_eq_v",
        "enable_moe_block",
        "num_experts",
        "top_k_experts",
        "moe_intermediate_size",
        "use_double_wide_mlp",
        "num_kv_shared_layers",
    ),
    fixed={
        # "vision": image tokens attend both ways, text causally: text alone runs causally.
        "use_bidirectional_attention": (None, "vision"),
        "is_encoder_decoder": (False,),
    },
)


@final
@dataclasses.dataclass(frozen=True)
class LayerRope:
    """One layer type's RoPE: `rotated` of a head's `head_dim // 2` frequencies turn, the rest are 0.

    transformers' "proportional" RoPE (Gemma 4's global layers): the turning frequencies
    are `theta ** (-2i / head_dim)` for `i < rotated`, all divided by `factor`; a zero
    frequency leaves its pair of features as they are. "default" is `rotated = head_dim // 2`.

    ```python
    rope = LayerRope(theta=1e6, head_dim=16, rotated=2)
    cos, sin = rope.angles(jnp.arange(4)[None], jnp.float32)   # (1, 4, 16) each; cos[..., 2:8] == 1
    ```
    """

    theta: float
    head_dim: int
    rotated: int
    factor: float = 1.0

    def angles(self, positions: Int[Array, "*batch seq"], dtype: Any) -> tuple[Array, Array]:
        """cos and sin `[..., seq, head_dim]` in `dtype`, for `apply_rope` over the whole head."""
        turning = Rope(theta=self.theta, rotary_dim=self.head_dim).inv_freq()[: self.rotated]
        inv_freq = np.concatenate([turning, np.zeros(self.head_dim // 2 - self.rotated, np.float32)])
        inv_freq = inv_freq / np.float32(self.factor)
        freqs = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)
        angles = jnp.concatenate((freqs, freqs), axis=-1)
        return jnp.cos(angles).astype(dtype), jnp.sin(angles).astype(dtype)


def _rope(config: dict, layer_type: str, head_dim: int, default_theta: float) -> LayerRope:
    """The RoPE of one layer type, from `rope_parameters[layer_type]` (absent: transformers' default)."""
    if config.get("rope_parameters") is None:
        config = {
            **config,
            "rope_parameters": {
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1e6},
            },
        }
    key, rope = rope_parameters(config, layer_type=layer_type, default_theta=default_theta)
    kind = rope["rope_type"]
    if kind not in ROPE_TYPES:
        raise ConfigError(
            f"config.json: {key}: rope type {quoted(kind)} is not supported (supported: {', '.join(ROPE_TYPES)})"
        )
    theta = check(f"{key}.rope_theta", rope["rope_theta"], float)
    if kind == "default":  # transformers' default frequencies ignore partial_rotary_factor
        return LayerRope(theta=theta, head_dim=head_dim, rotated=head_dim // 2)
    partial = rope["partial_rotary_factor"]
    if not isinstance(partial, (int, float)) or isinstance(partial, bool) or not 0 <= partial <= 1:
        raise ConfigError(f"config.json: '{key}.partial_rotary_factor' must be in [0, 1], got {quoted(partial)}")
    factor = check(f"{key}.factor", rope.get("factor", 1.0), float)
    return LayerRope(theta=theta, head_dim=head_dim, rotated=int(partial * head_dim // 2), factor=factor)


def _layer_types(config: dict, layers: int) -> tuple[str, ...]:
    """Each layer's kind ("sliding" or "full"): `layer_types`, else five local layers to one global;
    the last layer is global whatever config.json says, as Gemma4TextConfig forces it."""
    layer_types = config.get("layer_types")
    if layer_types is None:
        layer_types = ["sliding_attention" if (i + 1) % 6 else "full_attention" for i in range(layers)]
    if (
        not isinstance(layer_types, list)
        or len(layer_types) != layers
        or any(t not in LAYER_TYPES for t in layer_types)
    ):
        raise ConfigError(
            f"config.json: 'layer_types' must list {layers} of {tuple(LAYER_TYPES)}, got {quoted(layer_types)}"
        )
    return (*(LAYER_TYPES[t] for t in layer_types[:-1]), "full")


def _global_sizes(config: dict, kinds: tuple[str, ...], head_dim: int, kv_heads: int) -> tuple[int, int]:
    """The global layers' `(head_dim, num_key_value_heads)`, as Gemma4TextConfig resolves them.

    `per_layer_config` (what transformers writes: layer index -> `head_dim` and
    `num_key_value_heads` overrides) wins; without it, `global_head_dim` (default 512) and,
    with `attention_k_eq_v`, `num_global_key_value_heads`. Overrides must be alike for
    every global layer and absent for local ones: one line otherwise.
    """
    per_layer = config.get("per_layer_config")
    if per_layer is None:
        dim = get(config, "global_head_dim", int, 512)
        heads = config.get("num_global_key_value_heads")
        if heads is None or not get(config, "attention_k_eq_v", bool, False):
            return dim, kv_heads
        return dim, check("num_global_key_value_heads", heads, int)
    if not isinstance(per_layer, dict):
        raise ConfigError(f"config.json: 'per_layer_config' must be a dict by layer, got {quoted(per_layer)}")
    entries = {}
    for key, entry in per_layer.items():  # transformers zero-pads the indices ("05")
        if not (isinstance(key, str) and key.isdigit() and int(key) < len(kinds)):
            raise ConfigError(f"config.json: 'per_layer_config' names no layer: {key!r} (not supported)")
        entries[int(key)] = entry
    sizes = set()
    for i, kind in enumerate(kinds):
        entry = entries.get(i, {})
        if not isinstance(entry, dict) or set(entry) - {"head_dim", "num_key_value_heads"}:
            raise ConfigError(
                f"config.json: 'per_layer_config.{i}' may set only head_dim and num_key_value_heads, got {quoted(entry)}"
            )
        size = (
            check(f"per_layer_config.{i}.head_dim", entry.get("head_dim", head_dim), int),
            check(f"per_layer_config.{i}.num_key_value_heads", entry.get("num_key_value_heads", kv_heads), int),
        )
        if kind == "sliding" and size != (head_dim, kv_heads):
            raise ConfigError(f"config.json: 'per_layer_config.{i}' changes a sliding layer (not supported)")
        if kind == "full":
            sizes.add(size)
    if len(sizes) > 1:
        raise ConfigError("config.json: 'per_layer_config' gives global layers different sizes (not supported)")
    return sizes.pop()


def _shared(config: dict, kinds: tuple[str, ...]) -> tuple[str, ...]:
    """`kinds` with the last `num_kv_shared_layers` marked "shared_sliding" / "shared_full": layers
    that reuse the keys and values of the last earlier layer of their type (Gemma4TextConfig's
    `kv_sharing_modes`, which requires one for every type)."""
    count = config.get("num_kv_shared_layers") or 0
    if count == 0:
        return kinds
    count = check("num_kv_shared_layers", count, int)
    first = len(kinds) - count
    if first <= 0 or set(kinds[:first]) != set(kinds):
        raise ConfigError(
            f"config.json: 'num_kv_shared_layers' ({count}) must leave a layer of every type before the "
            f"shared ones (layers 0-{max(first, 0) - 1} hold {sorted(set(kinds[:first]))})"
        )
    return (*kinds[:first], *(f"shared_{kind}" for kind in kinds[first:]))


def _text_config(config: dict) -> dict:
    """config.json's language model: itself (`gemma4_text`), or `gemma4`'s `text_config` with the
    top level's `tie_word_embeddings` (which ties the wrapper's head)."""
    if check_model_type(config, MODEL_TYPES, "port.models.gemma4", "gemma4_text") == "gemma4_text":
        return config
    text = config.get("text_config")
    if not isinstance(text, dict):
        raise ConfigError(f"config.json: 'text_config' must be a dict, got {quoted(text)}")
    tied = config.get("tie_word_embeddings", True)
    return {**text, "model_type": "gemma4_text", "tie_word_embeddings": tied}


@final
@dataclasses.dataclass(frozen=True)
class Gemma4Config:
    """Gemma 4's text hyperparameters, as read from a config.json (`gemma4_text`, or `gemma4`'s `text_config`).

    Field names are config.json's where they mean what config.json's mean, so a mapping may
    name them in a reshape; the global layers' sizes are `full_head_dim` and `full_kv_heads`
    (resolved from `per_layer_config` or `global_head_dim`).

    ```python
    c = Gemma4Config.from_hf({"model_type": "gemma4_text", "num_hidden_layers": 3, "hidden_size": 48,
                              "vocab_size": 97, "intermediate_size": 80, "num_attention_heads": 4,
                              "head_dim": 12, "global_head_dim": 16})
    c.kinds, c.full_head_dim, c.full_rope.rotated      # ('sliding', 'sliding', 'full'), 16, 2
    ```
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    full_head_dim: int
    full_kv_heads: int
    kinds: tuple[str, ...]
    sliding_window: int
    local_rope: LayerRope
    full_rope: LayerRope
    rms_norm_eps: float = 1e-6
    hidden_activation: str = "gelu_pytorch_tanh"
    tie_word_embeddings: bool = True
    attention_bias: bool = False
    attention_k_eq_v: bool = False
    final_logit_softcapping: float | None = None
    num_experts: int | None = None  # None: no mixture of experts
    top_k_experts: int = 1
    moe_intermediate_size: int = 1
    hidden_size_per_layer_input: int = 0  # 0: no per-layer embeddings
    vocab_size_per_layer_input: int = 0
    use_double_wide_mlp: bool = False  # shared layers' MLPs twice as wide

    @classmethod
    def from_hf(cls, config: dict) -> Gemma4Config:
        """Build from a config.json dict; one-line `ConfigError` naming the key for anything unsupported."""
        c = _text_config(config)
        FIELDS.check(c)
        layers = get(c, "num_hidden_layers", int, 30, maximum=MAX_LAYERS)
        heads = get(c, "num_attention_heads", int, 8)
        kv_heads = read_kv_heads(c, heads, 4)
        head_dim = get(c, "head_dim", int, 256)
        kinds = _layer_types(c, layers)
        full_head_dim, full_kv_heads = _global_sizes(c, kinds, head_dim, kv_heads)
        kinds = _shared(c, kinds)
        if heads % full_kv_heads:
            raise ConfigError(
                f"config.json: the global layers' {full_kv_heads} key/value heads must divide "
                f"'num_attention_heads' ({heads})"
            )
        experts = cls._experts(c)
        per_layer = c.get("hidden_size_per_layer_input", 256)
        per_layer = 0 if per_layer in (None, 0) else check("hidden_size_per_layer_input", per_layer, int)
        cap = c.get("final_logit_softcapping")
        return cls(
            vocab_size=get(c, "vocab_size", int, 262144),
            hidden_size=get(c, "hidden_size", int, 2304),
            intermediate_size=get(c, "intermediate_size", int, 9216),
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=head_dim,
            full_head_dim=full_head_dim,
            full_kv_heads=full_kv_heads,
            kinds=kinds,
            sliding_window=get(c, "sliding_window", int, 512),
            local_rope=_rope(c, "sliding_attention", head_dim, 10000.0),
            full_rope=_rope(c, "full_attention", full_head_dim, 1e6),
            rms_norm_eps=get(c, "rms_norm_eps", float, 1e-6),
            hidden_activation=activation(c, "hidden_activation", "gelu_pytorch_tanh"),
            tie_word_embeddings=get(c, "tie_word_embeddings", bool, True),
            attention_bias=get(c, "attention_bias", bool, False),
            attention_k_eq_v=get(c, "attention_k_eq_v", bool, False),
            final_logit_softcapping=None if cap is None else check("final_logit_softcapping", cap, float),
            hidden_size_per_layer_input=per_layer,
            use_double_wide_mlp=get(c, "use_double_wide_mlp", bool, False),
            vocab_size_per_layer_input=get(c, "vocab_size_per_layer_input", int, 262144) if per_layer else 0,
            **experts,
        )

    @staticmethod
    def _experts(c: dict) -> dict[str, Any]:
        """`num_experts`, `top_k_experts`, `moe_intermediate_size` with `enable_moe_block`, else none."""
        if not get(c, "enable_moe_block", bool, False):
            return {}
        experts = get(c, "num_experts", int)
        top_k = get(c, "top_k_experts", int)
        if top_k > experts:
            raise ConfigError(f"config.json: 'top_k_experts' ({top_k}) is more than 'num_experts' ({experts})")
        return {
            "num_experts": experts,
            "top_k_experts": top_k,
            "moe_intermediate_size": get(c, "moe_intermediate_size", int),
        }

    @property
    def groups(self) -> dict[str, tuple[int, ...]]:
        """`{"sliding": ids, "full": ids, "shared_sliding": ids, "shared_full": ids}`: the checkpoint
        layers of each kind (kinds with layers only)."""
        ids = {kind: tuple(i for i, k in enumerate(self.kinds) if k == kind) for kind in KINDS}
        return {kind: layers for kind, layers in ids.items() if layers}

    @property
    def sliding_layers(self) -> tuple[bool, ...]:
        """Per layer, whether it attends within `sliding_window`."""
        return tuple(kind.endswith("sliding") for kind in self.kinds)

    def sizes(self, kind: str) -> tuple[int, int]:
        """`(kv_heads, head_dim)` of a layer of `kind`."""
        full = kind.endswith("full")
        return (self.full_kv_heads, self.full_head_dim) if full else (self.num_key_value_heads, self.head_dim)

    @property
    def shared_slots(self) -> dict[str, int]:
        """Where a type's keys (then its values, as many features) ride in the carry, for the
        shared layers of that type: `{"sliding": offset, ...}`; empty without shared layers."""
        offset, slots = self.hidden_size + self.num_hidden_layers * self.hidden_size_per_layer_input, {}
        for kind in ("sliding", "full"):
            if f"shared_{kind}" in self.kinds:
                slots[kind] = offset
                offset += 2 * math.prod(self.sizes(kind))
        return slots


def _norm(x: Array, weight: Array | None, eps: float) -> Array:
    """Gemma4RMSNorm: `weight * x_hat` in float32, cast back; no weight: `x_hat` alone."""
    if weight is None:
        weight = jnp.ones(x.shape[-1:], jnp.float32)
    return rms_norm(x, weight, eps, float32_scale=True)


@final
class Gemma4Attention(eqx.Module):
    """Self-attention scaled by 1: per-head normed queries and keys, scale-free normed values.

    `wv` is None in a global layer with `attention_k_eq_v` (values are the keys' projection,
    before the key norm). Leaves as `port.nn.Attention`'s (`wq` `[heads, head_dim, embd]`,
    `wo` `[embd, heads, head_dim]`, biases with `attention_bias`).
    """

    wq: Float[Array, "heads head_dim embed"]
    wk: Float[Array, "kv_heads head_dim embed"] | None
    wv: Float[Array, "kv_heads head_dim embed"] | None
    wo: Float[Array, "embed heads head_dim"]
    bq: Float[Array, "heads head_dim"] | None
    bk: Float[Array, "kv_heads head_dim"] | None
    bv: Float[Array, "kv_heads head_dim"] | None
    bo: Float[Array, " embed"] | None
    q_norm: Float[Array, " head_dim"]
    k_norm: Float[Array, " head_dim"] | None
    eps: float = eqx.field(static=True)

    def __init__(self, c: Gemma4Config, kind: str, dtype: Any, *, key: PRNGKeyArray):
        kq, kk, kv, ko = jax.random.split(key, 4)
        g, d = c.sizes(kind)
        h, e, bias = c.num_attention_heads, c.hidden_size, c.attention_bias
        keys = not kind.startswith("shared")  # a shared layer reuses an earlier layer's keys and values
        values = keys and not (c.attention_k_eq_v and kind == "full")
        self.wq, self.wk = normal(kq, (h, d, e), dtype), normal(kk, (g, d, e), dtype) if keys else None
        self.wv = normal(kv, (g, d, e), dtype) if values else None
        self.wo = normal(ko, (e, h, d), dtype)
        self.bq, self.bk = zeros_if(bias, (h, d), dtype), zeros_if(bias and keys, (g, d), dtype)
        self.bv, self.bo = zeros_if(bias and values, (g, d), dtype), zeros_if(bias, (e,), dtype)
        self.q_norm, self.k_norm = jnp.ones((d,), dtype), jnp.ones((d,), dtype) if keys else None
        self.eps = c.rms_norm_eps

    def __call__(
        self,
        x: Float[Array, "batch seq embed"],
        mask: Bool[Array, "batch seq keys"],
        *,
        cos: Array,
        sin: Array,
        kv: KV | None,
        index: Array | None,
        shared: KV | None = None,
    ) -> tuple[Float[Array, "batch seq embed"], KV | None, KV]:
        """`(y, kv, (k, v))`: the output, the updated cache and this call's keys and values (normed
        and rotated: `shared`, the earlier layer's, in a layer without key projection)."""

        def project(w: Array, b: Array | None) -> Array:
            y = jnp.einsum("bte,hde->bthd", x, w)
            return y if b is None else y + b

        q = apply_rope(_norm(project(self.wq, self.bq), self.q_norm, self.eps), cos, sin)
        if self.wk is None:
            assert shared is not None, "a layer without key projection takes an earlier layer's keys and values"
            k, v = shared
        else:
            k = project(self.wk, self.bk)
            v = k if self.wv is None else project(self.wv, self.bv)
            k = apply_rope(_norm(k, self.k_norm, self.eps), cos, sin)
            v = _norm(v, None, self.eps)
        own = (k, v)
        # A shared layer writes the same keys and values to its cache rows as the layer it shares
        # with, so its rows hold that layer's: transformers reads them from that layer instead.
        k, v, kv = with_cache(k, v, kv, index)
        y = jnp.einsum("bthd,ehd->bte", attend(q, k, v, mask, scale=1.0), self.wo)
        return (y if self.bo is None else y + self.bo), kv, own


@final
class Block(eqx.Module):
    """One Gemma 4 decoder layer of one kind (`KINDS`); see the module's docstring.

    The carry `x` is `[batch, seq, ...]`: the hidden state (`hidden_size`), then (with
    per-layer embeddings) every layer's input, this layer reading its own slice, then (with
    shared layers) each shared type's keys and values, flattened: every earlier layer of the
    type writes its own there, a shared layer reads those of the last (`shared_slot`).
    """

    attn_norm: Float[Array, " embed"]
    attn: Gemma4Attention
    post_attn_norm: Float[Array, " embed"]
    mlp_norm: Float[Array, " embed"]
    mlp: GatedMLP
    post_mlp_norm: Float[Array, " embed"]
    moe: MoE | None  # the experts and their router's projection (`moe.router`)
    router_scale: Float[Array, " embed"] | None
    expert_scale: Float[Array, " experts"] | None
    post_dense_norm: Float[Array, " embed"] | None  # the MLP branch's norm beside the experts
    moe_norm: Float[Array, " embed"] | None  # before the experts
    post_moe_norm: Float[Array, " embed"] | None  # after the experts
    per_layer_gate: Float[Array, "per_layer embed"] | None
    per_layer_projection: Float[Array, "embed per_layer"] | None
    post_per_layer_norm: Float[Array, " embed"] | None
    layer_scalar: Float[Array, " scalar"]
    kind: str = eqx.field(static=True)
    rotary: tuple[int, int] = eqx.field(static=True)  # this kind's columns of the cos and sin given
    shared_slot: int | None = eqx.field(static=True)  # where its type's keys ride in the carry (None: nowhere)
    kv_shape: tuple[int, int] = eqx.field(static=True)  # (kv_heads, head_dim)
    embd: int = eqx.field(static=True)
    per_layer: int = eqx.field(static=True)
    activation: str = eqx.field(static=True)
    eps: float = eqx.field(static=True)

    def __init__(self, c: Gemma4Config, kind: str, dtype: Any, *, key: PRNGKeyArray):
        kattn, kmlp, kmoe, kgate, kproj = jax.random.split(key, 5)
        e, moe, p = c.hidden_size, c.num_experts is not None, c.hidden_size_per_layer_input

        def norm() -> Array:
            return jnp.ones((e,), dtype)

        def norm_if(present: bool) -> Array | None:
            return norm() if present else None

        self.attn_norm, self.post_attn_norm = norm(), norm()
        self.attn = Gemma4Attention(c, kind, dtype, key=kattn)
        self.mlp_norm, self.post_mlp_norm = norm(), norm()
        wide = 2 if c.use_double_wide_mlp and kind.startswith("shared") else 1
        self.mlp = GatedMLP(
            embd=e, inner=wide * c.intermediate_size, activation=c.hidden_activation, dtype=dtype, key=kmlp
        )
        self.moe = (
            MoE(
                embd=e,
                inner=c.moe_intermediate_size,
                experts=c.num_experts,
                top_k=c.top_k_experts,
                activation=c.hidden_activation,
                dtype=dtype,
                key=kmoe,
            )
            if c.num_experts is not None
            else None
        )
        self.router_scale = norm_if(moe)
        self.expert_scale = jnp.ones((c.num_experts,), dtype) if c.num_experts is not None else None
        self.post_dense_norm, self.moe_norm, self.post_moe_norm = norm_if(moe), norm_if(moe), norm_if(moe)
        self.per_layer_gate = normal(kgate, (p, e), dtype) if p else None
        self.per_layer_projection = normal(kproj, (e, p), dtype) if p else None
        self.post_per_layer_norm = norm_if(bool(p))
        self.layer_scalar = jnp.ones((1,), dtype)
        self.kind = kind
        sliding = kind.endswith("sliding")
        self.rotary = (0, c.head_dim) if sliding else (c.head_dim, c.head_dim + c.full_head_dim)
        self.shared_slot = c.shared_slots.get("sliding" if sliding else "full")
        self.kv_shape = c.sizes(kind)
        self.embd, self.per_layer, self.activation, self.eps = e, p, c.hidden_activation, c.rms_norm_eps

    def _experts(self, x: Array) -> Array:
        """The mixture-of-experts branch on the layer's input (its residual stream)."""
        assert self.moe is not None and self.router_scale is not None and self.expert_scale is not None
        flat = x.reshape(-1, x.shape[-1])
        scaled = _norm(flat, None, self.eps) * self.router_scale * (self.embd**-0.5)
        weights, index = route(linear(scaled, self.moe.router, None), self.moe.top_k)
        weights = weights * self.expert_scale[index]
        out = self.moe._dispatch(_norm(flat, self.moe_norm, self.eps), weights, index)
        return _norm(out, self.post_moe_norm, self.eps).reshape(x.shape)

    def _per_layer_input(self, x: Array, inputs: Array, layer: Array) -> Array:
        """The per-layer embedding's gated residual: `norm(proj(act(gate x) * input))`."""
        assert self.per_layer_gate is not None and self.per_layer_projection is not None
        own = jax.lax.dynamic_slice_in_dim(inputs, layer * self.per_layer, self.per_layer, axis=-1)
        h = ACTIVATIONS[self.activation](linear(x, self.per_layer_gate, None)) * own
        return _norm(linear(h, self.per_layer_projection, None), self.post_per_layer_norm, self.eps)

    def __call__(
        self,
        x: Float[Array, "batch seq carry"],
        mask: Bool[Array, "batch seq keys"],
        *,
        cos: Array,
        sin: Array,
        kv: KV | None,
        index: Array | None,
        layer: Array,
    ) -> tuple[Float[Array, "batch seq carry"], KV | None]:
        x, inputs = x[..., : self.embd], x[..., self.embd :]
        start, stop = self.rotary
        h, kv, own = self.attn(
            _norm(x, self.attn_norm, self.eps),
            mask,
            cos=cos[..., start:stop],
            sin=sin[..., start:stop],
            kv=kv,
            index=index,
            shared=self._carried(inputs) if self.attn.wk is None else None,
        )
        if self.shared_slot is not None and self.attn.wk is not None:
            inputs = self._carry(inputs, own)
        x = x + _norm(h, self.post_attn_norm, self.eps)
        h = self.mlp(_norm(x, self.mlp_norm, self.eps))
        if self.moe is not None:
            h = _norm(h, self.post_dense_norm, self.eps) + self._experts(x)
        x = x + _norm(h, self.post_mlp_norm, self.eps)
        if self.per_layer:
            x = x + self._per_layer_input(x, inputs, layer)
        x = x * self.layer_scalar
        return jnp.concatenate([x, inputs], axis=-1) if inputs.shape[-1] else x, kv

    def _slot(self) -> tuple[int, int]:
        """The start (past the hidden state) and size of this type's keys in the carry."""
        assert self.shared_slot is not None
        return self.shared_slot - self.embd, math.prod(self.kv_shape)

    def _carry(self, inputs: Array, kv: KV) -> Array:
        """`inputs` with this layer's keys and values written in its type's slot."""
        start, size = self._slot()
        flat = [a.reshape(*a.shape[:-2], size).astype(inputs.dtype) for a in kv]
        return jnp.concatenate([inputs[..., :start], *flat, inputs[..., start + 2 * size :]], axis=-1)

    def _carried(self, inputs: Array) -> KV:
        """The keys and values of the last earlier layer of this type, from the carry."""
        start, size = self._slot()
        k, v = inputs[..., start : start + size], inputs[..., start + size : start + 2 * size]
        return k.reshape(*k.shape[:-1], *self.kv_shape), v.reshape(*v.shape[:-1], *self.kv_shape)


@final
class Gemma4(Decoder):
    """Gemma 4's causal LM: local and global layers in stacks of their own (`sliding`, `full`, and
    `shared_sliding`, `shared_full` for the layers reusing earlier keys and values; None where no
    layer has that kind), run in checkpoint order; optional per-layer embeddings (`per_layer_embed`,
    `per_layer_model_projection`, `per_layer_norm`; None without).

    Called as every `port.nn.Decoder`: `model(input_ids, *, attention_mask=None, positions=None,
    segment_ids=None, cache=None, dtype=None, remat=None)`; `init_cache` gives a cache per kind.
    """

    FIELDS: ClassVar[ConfigFields] = FIELDS

    embed: Float[Array, "vocab embed"]
    per_layer_embed: Float[Array, "per_layer_vocab per_layer_all"] | None
    per_layer_model_projection: Float[Array, "per_layer_all embed"] | None
    per_layer_norm: Float[Array, " per_layer"] | None
    sliding: Block | None
    full: Block | None
    shared_sliding: Block | None
    shared_full: Block | None
    norm: Float[Array, " embed"]
    lm_head: Float[Array, "vocab embed"] | None
    config: Gemma4Config = eqx.field(static=True)

    def __init__(self, config: Gemma4Config, *, key: PRNGKeyArray, dtype: Any = jnp.float32):
        kembed, kple, kproj, kblocks = jax.random.split(key, 4)
        c = config
        self.embed, self.lm_head = embeddings(
            kembed, vocab=c.vocab_size, embd=c.hidden_size, dtype=dtype, tied=c.tie_word_embeddings
        )
        p, every = c.hidden_size_per_layer_input, c.num_hidden_layers * c.hidden_size_per_layer_input
        self.per_layer_embed = normal(kple, (c.vocab_size_per_layer_input, every), dtype) if p else None
        self.per_layer_model_projection = normal(kproj, (every, c.hidden_size), dtype) if p else None
        self.per_layer_norm = jnp.ones((p,), dtype) if p else None
        groups = c.groups

        def make(kind: str, k: PRNGKeyArray) -> Block | None:
            if kind not in groups:
                return None
            return stacked(lambda key: Block(c, kind, dtype, key=key), k, len(groups[kind]))

        ksliding, kfull, kshared_sliding, kshared_full = jax.random.split(kblocks, 4)
        self.sliding, self.full = make("sliding", ksliding), make("full", kfull)
        self.shared_sliding, self.shared_full = (
            make("shared_sliding", kshared_sliding),
            make("shared_full", kshared_full),
        )
        self.norm = jnp.ones((c.hidden_size,), dtype)
        self.config = config

    @classmethod
    def from_config(cls, config: dict, *, key: PRNGKeyArray, dtype: Any = jnp.float32) -> Gemma4:
        """Randomly initialise from a config.json dict (`gemma4_text`, or `gemma4` with a `text_config`)."""
        return cls(Gemma4Config.from_hf(config), key=key, dtype=dtype)

    @property
    def layer_groups(self) -> dict[str, tuple[int, ...]]:
        """`{"sliding": ids, "full": ids, ...}`: the checkpoint layers each stack holds (kinds with layers only)."""
        return self.config.groups

    def init_cache(self, batch: int, length: int, dtype: Any = None) -> Cache:
        """An empty cache, keys and values per kind (`[layers of the kind, batch, length, kv_heads,
        head_dim]`, each kind its own sizes), in `dtype` (default: the parameters')."""
        check_sizes(batch, length)
        dtype = self.embed.dtype if dtype is None else dtype
        c = self.config
        zeros = {kind: jnp.zeros((len(ids), batch, length, *c.sizes(kind)), dtype) for kind, ids in c.groups.items()}
        return Cache.of(zeros, dict(zeros), batch=batch, length=length)

    def _per_layer_inputs(self, ids: Array, x: Array) -> Array:
        """Every layer's input `[batch, seq, layers * per_layer]`: the projected embeddings, normed per
        layer, plus the per-layer table's rows (times `sqrt(per_layer)`), over `sqrt(2)`."""
        assert self.per_layer_embed is not None and self.per_layer_model_projection is not None
        c = self.config
        p = c.hidden_size_per_layer_input
        table = self.per_layer_embed[ids] * jnp.asarray(np.float32(p**0.5), x.dtype)
        projected = linear(x, self.per_layer_model_projection, None) * (c.hidden_size**-0.5)
        projected = _norm(projected.reshape(*x.shape[:-1], c.num_hidden_layers, p), self.per_layer_norm, c.rms_norm_eps)
        combined = (projected + table.reshape(projected.shape)) * (2.0**-0.5)
        return combined.reshape(*x.shape[:-1], -1)

    def logits(self, tokens: Tokens, remat: Any) -> tuple[Array, tuple[Any, Any, Any]]:
        """Scaled embeddings (and per-layer inputs), the layers, the final norm, the head and its soft-cap."""
        c = self.config
        x = self.embed[tokens.ids]
        x = x * jnp.asarray(np.float32(c.hidden_size**0.5), x.dtype)
        if self.per_layer_embed is not None:
            x = jnp.concatenate([x, self._per_layer_inputs(tokens.ids, x)], axis=-1)
        slots = 2 * sum(math.prod(c.sizes(kind)) for kind in c.shared_slots)
        if slots:  # room for the keys and values the shared layers reuse
            x = jnp.concatenate([x, jnp.zeros((*x.shape[:-1], slots), x.dtype)], axis=-1)
        local = c.local_rope.angles(tokens.positions, x.dtype)
        full = c.full_rope.angles(tokens.positions, x.dtype)
        cos, sin = (jnp.concatenate(pair, axis=-1) for pair in zip(local, full))
        blocks = {
            "sliding": self.sliding,
            "full": self.full,
            "shared_sliding": self.shared_sliding,
            "shared_full": self.shared_full,
        }
        groups = {kind: blocks[kind] for kind in c.groups}
        x, cache = run_groups(groups, c.kinds, x, tokens, cos=cos, sin=sin, sliding=c.sliding_layers, remat=remat)
        x = _norm(x[..., : c.hidden_size], self.norm, c.rms_norm_eps)
        logits = head(x, self.embed, self.lm_head)
        cap = c.final_logit_softcapping
        if cap is not None:  # cap * tanh(logits / cap), in the logits' dtype, as transformers
            logits = jnp.tanh(logits / cap) * cap
        return logits, cache
