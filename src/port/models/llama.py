"""Llama, Mistral, Qwen2, Qwen3 and Phi-3 (decoder-only, RMSNorm, RoPE, SwiGLU, GQA) as one Equinox model.

One class serves the `model_type`s "llama", "mistral", "qwen2", "qwen3" and "phi3"; they
differ in which projections carry biases, in sliding-window attention, in Qwen3's
per-head RMSNorm of queries and keys (`q_norm`, `k_norm`, None elsewhere) and in Phi-3's
RoPE (partial rotary dimensions, "longrope" scaling). Phi-3's fused `qkv_proj` and
`gate_up_proj` are cut into this module's separate leaves by its mapping. The transformer blocks
are stored *stacked*: every array in `Llama.blocks` has a leading axis of size
`num_hidden_layers`, and the forward pass runs them with `jax.lax.scan`.

The dtype of the parameters is the compute dtype (bfloat16 params: bfloat16 compute,
with RMSNorm statistics and the attention softmax in float32, as in transformers).

Example:
    ```python
    import equinox as eqx
    import jax
    import jax.numpy as jnp
    from port.models.llama import Llama

    config = {"model_type": "llama", "vocab_size": 32000, "hidden_size": 2048,
              "intermediate_size": 8192, "num_hidden_layers": 16,
              "num_attention_heads": 32, "num_key_value_heads": 8,
              "rope_parameters": {"rope_type": "default", "rope_theta": 500000.0}}
    model = Llama.from_config(config, key=jax.random.key(0), dtype=jnp.bfloat16)
    logits = eqx.filter_jit(model)(jnp.zeros((1, 8), dtype=jnp.int32))
    # logits.shape == (1, 8, 32000), logits.dtype == bfloat16
    # without the batch axis, (8,) ids give (8, 32000)

    # Shapes only, no memory allocated (e.g. before loading a checkpoint):
    abstract = eqx.filter_eval_shape(Llama.from_config, config, key=jax.random.key(0))
    ```
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Float, Int, PRNGKeyArray

from port._errors import ConfigError
from port._console import quoted
from port.models._config import MAX_LAYERS, activation, check, get
from port.models._inputs import check_ids, per_sequence

MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "phi3")
ROPE_TYPES = ("default", "linear", "llama3")
# Phi-3's config accepts only these (Phi3Config.validate_rope); "su" and "yarn" are old
# names of "longrope" there.
PHI3_ROPE_TYPES = ("default", "longrope")

# Where transformers' config classes disagree on a default (used when the key is absent).
_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": {"max_position_embeddings": 2048, "sliding_window": None},
    "mistral": {"max_position_embeddings": 131072, "sliding_window": 4096,
                "num_key_value_heads": 8},
    "qwen2": {"max_position_embeddings": 32768, "sliding_window": 4096,
              "num_key_value_heads": 32},
    "qwen3": {"max_position_embeddings": 32768, "sliding_window": 4096,
              "num_key_value_heads": 32, "head_dim": 128},
    "phi3": {"max_position_embeddings": 4096, "sliding_window": None, "rms_norm_eps": 1e-5,
             "original_max_position_embeddings": 4096},
}


def _first(*values: Any) -> Any:
    return next((v for v in values if v is not None), None)


def _rope_parameters(config: dict) -> tuple[str, dict]:
    """The config.json key holding the RoPE settings, and the settings standardised as
    transformers 5 does it.

    transformers 5 writes `rope_parameters` (holding `rope_theta` and `rope_type`);
    transformers 4 wrote a top-level `rope_theta` and an optional `rope_scaling`
    (with `rope_type` or the legacy `type`). As in transformers, `rope_scaling` wins.
    """
    key = "rope_scaling" if config.get("rope_scaling") else "rope_parameters"
    rope = config.get(key) or {}
    if not isinstance(rope, dict) or any(isinstance(v, dict) for v in rope.values()):
        raise ConfigError(
            f"config.json: {key!r} must be one flat dict (per-layer-type RoPE "
            f"is not supported), got {rope!r}"
        )
    rope = dict(rope)
    rope["rope_theta"] = _first(rope.get("rope_theta"), config.get("rope_theta"), 10000.0)
    rope["rope_type"] = _first(rope.get("rope_type"), rope.get("type"), "default")
    if "original_max_position_embeddings" in config:  # transformers gives it priority
        rope["original_max_position_embeddings"] = config["original_max_position_embeddings"]
    rope["partial_rotary_factor"] = _first(
        rope.get("partial_rotary_factor"), config.get("partial_rotary_factor"), 1.0
    )
    return key, rope


def _rope_fields(config: dict, model_type: str, head_dim: int) -> dict[str, Any]:
    """The RoPE fields of `LlamaConfig` from a config.json; `ConfigError` if unsupported.

    ```python
    _rope_fields({"rope_theta": 500000.0}, "llama", 64)
    # {"rope_theta": 500000.0, "rope_type": "default", "partial_rotary_factor": 1.0}
    ```
    """
    rope_key, rope = _rope_parameters(config)
    rope_type, supported = rope["rope_type"], ROPE_TYPES
    if model_type == "phi3":
        supported = PHI3_ROPE_TYPES
        rope_type = "longrope" if rope_type in ("su", "yarn") else rope_type
        # Phi3Config always has original_max_position_embeddings (4096 if absent); it wins.
        rope["original_max_position_embeddings"] = config.get(
            "original_max_position_embeddings", _DEFAULTS["phi3"]["original_max_position_embeddings"]
        )
    if rope_type not in supported:
        raise ConfigError(
            f"config.json: {rope_key}: rope type {rope_type!r} is not supported "
            f"(supported: {', '.join(supported)})"
        )

    def ropeget(name: str, kind: type) -> Any:
        if rope.get(name) is None:
            raise ConfigError(f"config.json: required key '{rope_key}.{name}' is missing")
        return check(f"{rope_key}.{name}", rope[name], kind)

    fields: dict[str, Any] = {"rope_theta": ropeget("rope_theta", float), "rope_type": rope_type}
    fields["partial_rotary_factor"] = partial = ropeget("partial_rotary_factor", float)
    rotary = int(head_dim * partial)
    if model_type != "phi3" and partial != 1.0:
        raise ConfigError(
            f"config.json: 'partial_rotary_factor' {partial!r} is not supported for "
            f"{model_type!r} (only 1.0)"
        )
    if partial > 1.0 or rotary < 2 or rotary % 2:
        raise ConfigError(
            f"config.json: 'partial_rotary_factor' {partial!r} of head_dim {head_dim} gives "
            f"{rotary} rotary dimensions (must be even, at least 2, at most head_dim)"
        )
    if rope_type in ("linear", "llama3"):
        fields["rope_factor"] = ropeget("factor", float)
    if rope_type in ("llama3", "longrope"):
        rope.setdefault(
            "original_max_position_embeddings",
            config.get("max_position_embeddings", _DEFAULTS[model_type]["max_position_embeddings"]),
        )
        fields["rope_original_max_position_embeddings"] = ropeget(
            "original_max_position_embeddings", int
        )
    if rope_type == "llama3":
        fields["rope_low_freq_factor"] = ropeget("low_freq_factor", float)
        fields["rope_high_freq_factor"] = ropeget("high_freq_factor", float)
    if rope_type == "longrope":
        fields.update(_longrope_fields(config, model_type, rope, rope_key, rotary))
    return fields


def _longrope_fields(
    config: dict, model_type: str, rope: dict, rope_key: str, rotary: int
) -> dict[str, Any]:
    """"longrope" (Phi-3 128k): short and long per-frequency factors, and the attention factor.

    As transformers' `_compute_longrope_parameters`: `factor` defaults to
    max_position_embeddings / original_max_position_embeddings, and the attention factor
    (which scales cos and sin) to sqrt(1 + ln(factor) / ln(original)), or 1 if factor <= 1.
    """
    original = rope["original_max_position_embeddings"]
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
                f"config.json: '{rope_key}.{name}' must list {rotary // 2} positive numbers "
                f"(one per rotary frequency), got {quoted(value)}"
            )
        factors[name] = tuple(float(v) for v in value)
    factor = rope.get("factor")
    if factor is None:
        maximum = get(config, "max_position_embeddings", int,
                      _DEFAULTS[model_type]["max_position_embeddings"])
        factor = maximum / original
    factor = check(f"{rope_key}.factor", factor, float)
    attention = rope.get("attention_factor")
    if attention is None:
        attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    return {
        "rope_factor": factor,
        "rope_short_factor": factors["short_factor"],
        "rope_long_factor": factors["long_factor"],
        "rope_attention_factor": check(f"{rope_key}.attention_factor", attention, float),
    }


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    """The hyperparameters of a Llama/Mistral/Qwen2/Qwen3/Phi-3 model, as read from a config.json.

    ```python
    c = LlamaConfig.from_hf({"model_type": "qwen3", "vocab_size": 101, "hidden_size": 64,
                             "intermediate_size": 128, "num_hidden_layers": 2,
                             "num_attention_heads": 6, "num_key_value_heads": 2, "head_dim": 12})
    c.qk_norm, c.rotary_dim    # (True, 12)
    ```
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    hidden_act: str = "silu"
    tie_word_embeddings: bool = False
    model_type: str = "llama"
    qkv_bias: bool = False  # q_proj, k_proj, v_proj
    o_bias: bool = False  # o_proj
    mlp_bias: bool = False  # gate_proj, up_proj, down_proj
    qk_norm: bool = False  # Qwen3: RMSNorm over head_dim of each query and key head
    rope_theta: float = 10000.0
    rope_type: str = "default"
    partial_rotary_factor: float = 1.0  # Phi-3: RoPE on the first head_dim * this dims
    rope_factor: float = 1.0  # "linear", "llama3" and "longrope"
    rope_low_freq_factor: float = 1.0  # "llama3"
    rope_high_freq_factor: float = 4.0  # "llama3"
    rope_original_max_position_embeddings: int = 8192  # "llama3" and "longrope"
    rope_short_factor: tuple[float, ...] = ()  # "longrope": up to the original length...
    rope_long_factor: tuple[float, ...] = ()  # ...and beyond it
    rope_attention_factor: float = 1.0  # "longrope": scales cos and sin
    sliding_window: int | None = None  # attend to the last `sliding_window` positions...
    sliding_layers: tuple[bool, ...] = ()  # ...in the layers marked True here

    @classmethod
    def from_hf(cls, config: dict) -> LlamaConfig:
        """Build from a Hugging Face `config.json` dict; raises `ConfigError` if unsupported."""
        model_type = config.get("model_type", "llama")
        if model_type not in MODEL_TYPES:
            raise ConfigError(
                f"config.json: 'model_type' {model_type!r} is not supported by "
                f"port.models.llama (supported: {', '.join(MODEL_TYPES)})"
            )
        defaults = _DEFAULTS[model_type]
        hidden = get(config, "hidden_size", int)
        heads = get(config, "num_attention_heads", int)
        layers = get(config, "num_hidden_layers", int, maximum=MAX_LAYERS)
        # Absent: the config class's default; null: one kv head per query head.
        kv_heads = config.get("num_key_value_heads", defaults.get("num_key_value_heads"))
        kv_heads = heads if kv_heads is None else check("num_key_value_heads", kv_heads, int)
        if heads % kv_heads != 0:
            raise ConfigError(
                f"config.json: 'num_key_value_heads' ({kv_heads}) must divide "
                f"'num_attention_heads' ({heads})"
            )
        head_dim = get(config, "head_dim", int, defaults.get("head_dim", hidden // heads))
        activation(config, "hidden_act", "silu", supported=("silu", "swish"))

        attention_bias = get(config, "attention_bias", bool, False)
        mlp_bias = get(config, "mlp_bias", bool, False)
        # What transformers' modeling code builds, whatever else config.json says:
        qkv_bias, o_bias, mlp_bias = {
            "llama": (attention_bias, attention_bias, mlp_bias),
            "mistral": (False, False, False),
            "qwen2": (True, False, False),
            "qwen3": (attention_bias, attention_bias, False),
            "phi3": (False, False, False),
        }[model_type]
        window, sliding = _sliding(config, model_type, layers)
        return cls(
            vocab_size=get(config, "vocab_size", int),
            hidden_size=hidden,
            intermediate_size=get(config, "intermediate_size", int),
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=head_dim,
            rms_norm_eps=get(config, "rms_norm_eps", float, defaults.get("rms_norm_eps", 1e-6)),
            hidden_act="silu",
            tie_word_embeddings=get(config, "tie_word_embeddings", bool, False),
            model_type=model_type,
            qkv_bias=qkv_bias,
            o_bias=o_bias,
            mlp_bias=mlp_bias,
            qk_norm=model_type == "qwen3",
            sliding_window=window,
            sliding_layers=sliding,
            **_rope_fields(config, model_type, head_dim),
        )

    @property
    def rotary_dim(self) -> int:
        """How many leading dimensions of each head RoPE rotates (head_dim unless partial)."""
        return int(self.head_dim * self.partial_rotary_factor)

    def long_rope(self, seq_len: int) -> bool:
        """Whether "longrope" uses its long factors for a sequence of `seq_len` tokens."""
        return self.rope_type == "longrope" and seq_len > self.rope_original_max_position_embeddings

    def inv_freq(self, seq_len: int = 0) -> np.ndarray:
        """RoPE inverse frequencies [rotary_dim // 2] in float32, computed as transformers does.

        "longrope" depends on the length of the sequence (`seq_len`, static under jit):
        its short factors up to the original context length, its long ones beyond.
        """
        dim = self.rotary_dim
        exponents = np.arange(0, dim, 2).astype(np.float32) / np.float32(dim)
        inv_freq = np.float32(1.0) / np.float32(self.rope_theta) ** exponents
        if self.rope_type == "longrope":
            factors = self.rope_long_factor if self.long_rope(seq_len) else self.rope_short_factor
            base = np.float32(self.rope_theta) ** exponents
            inv_freq = np.float32(1.0) / (np.asarray(factors, np.float32) * base)
        elif self.rope_type == "linear":
            inv_freq = inv_freq / np.float32(self.rope_factor)
        elif self.rope_type == "llama3":
            factor = np.float32(self.rope_factor)
            low, high = self.rope_low_freq_factor, self.rope_high_freq_factor
            old_len = self.rope_original_max_position_embeddings
            low_freq_wavelen, high_freq_wavelen = old_len / low, old_len / high
            wavelen = np.float32(2 * math.pi) / inv_freq
            scaled = np.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
            smooth = (np.float32(old_len) / wavelen - np.float32(low)) / np.float32(high - low)
            smoothed = (1 - smooth) * scaled / factor + smooth * scaled
            medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
            inv_freq = np.where(medium, smoothed, scaled)
        return inv_freq.astype(np.float32)


def _sliding(config: dict, model_type: str, layers: int) -> tuple[int | None, tuple[bool, ...]]:
    """The sliding window (None: none) and which layers use it, as transformers reads them.

    Llama has none; Mistral and Phi-3 slide in every layer when `sliding_window` is set;
    Qwen2 and Qwen3 only with `use_sliding_window`, in the layers `_qwen2_sliding_layers` names.
    """
    window = config.get("sliding_window", _DEFAULTS[model_type]["sliding_window"])
    qwen = model_type in ("qwen2", "qwen3")
    if model_type == "llama" or (qwen and not get(config, "use_sliding_window", bool, False)):
        window = None
    if window is None:
        return None, (False,) * layers
    window = check("sliding_window", window, int)
    return window, _qwen2_sliding_layers(config, layers) if qwen else (True,) * layers


def _qwen2_sliding_layers(config: dict, layers: int) -> tuple[bool, ...]:
    """Qwen2's sliding layers: `layer_types`, else those from `max_window_layers` on."""
    layer_types = config.get("layer_types")
    if layer_types is None:
        first = config.get("max_window_layers", 28)
        if not isinstance(first, int) or isinstance(first, bool) or first < 0:
            raise ConfigError(
                f"config.json: 'max_window_layers' must be a non-negative integer, got {first!r}"
            )
        return tuple(i >= first for i in range(layers))
    kinds = ("full_attention", "sliding_attention")
    if (
        not isinstance(layer_types, list)
        or len(layer_types) != layers
        or any(t not in kinds for t in layer_types)
    ):
        raise ConfigError(
            f"config.json: 'layer_types' must list {layers} of {kinds}, got {quoted(layer_types)}"
        )
    return tuple(t == "sliding_attention" for t in layer_types)


def _normal(key: PRNGKeyArray, shape: tuple[int, ...], dtype: Any) -> Array:
    return 0.02 * jax.random.normal(key, shape, dtype)


def _zeros_if(flag: bool, shape: tuple[int, ...], dtype: Any) -> Array | None:
    return jnp.zeros(shape, dtype) if flag else None


def _rms_norm(x: Float[Array, "seq embd"], weight: Float[Array, " embd"], eps: float) -> Array:
    """transformers' LlamaRMSNorm: normalise in float32, cast back, then scale."""
    h = x.astype(jnp.float32)
    h = h * jax.lax.rsqrt(jnp.mean(h * h, axis=-1, keepdims=True) + eps)
    return weight * h.astype(x.dtype)


def _rotate_half(x: Array) -> Array:
    x1, x2 = jnp.split(x, 2, axis=-1)
    return jnp.concatenate((-x2, x1), axis=-1)


def _apply_rope(x: Float[Array, "seq head dim"], cos: Array, sin: Array) -> Array:
    """Rotate the first `cos.shape[-1]` dims of each head; the rest pass (partial RoPE)."""
    rotary = cos.shape[-1]
    x, rest = x[..., :rotary], x[..., rotary:]
    x = x * cos[:, None, :] + _rotate_half(x) * sin[:, None, :]
    return x if rest.shape[-1] == 0 else jnp.concatenate((x, rest), axis=-1)


class Attention(eqx.Module):
    """Causal grouped-query self-attention with rotary position embeddings."""

    wq: Float[Array, "head head_dim embd"]
    wk: Float[Array, "kv_head head_dim embd"]
    wv: Float[Array, "kv_head head_dim embd"]
    wo: Float[Array, "embd head head_dim"]
    bq: Float[Array, "head head_dim"] | None
    bk: Float[Array, "kv_head head_dim"] | None
    bv: Float[Array, "kv_head head_dim"] | None
    bo: Float[Array, " embd"] | None
    q_norm: Float[Array, " head_dim"] | None  # Qwen3
    k_norm: Float[Array, " head_dim"] | None

    def __init__(self, config: LlamaConfig, dtype: Any, *, key: PRNGKeyArray):
        h, kv, d = config.num_attention_heads, config.num_key_value_heads, config.head_dim
        e = config.hidden_size
        kq, kk, kvv, ko = jax.random.split(key, 4)
        self.wq = _normal(kq, (h, d, e), dtype)
        self.wk = _normal(kk, (kv, d, e), dtype)
        self.wv = _normal(kvv, (kv, d, e), dtype)
        self.wo = _normal(ko, (e, h, d), dtype)
        self.bq = _zeros_if(config.qkv_bias, (h, d), dtype)
        self.bk = _zeros_if(config.qkv_bias, (kv, d), dtype)
        self.bv = _zeros_if(config.qkv_bias, (kv, d), dtype)
        self.bo = _zeros_if(config.o_bias, (e,), dtype)
        self.q_norm = jnp.ones((d,), dtype) if config.qk_norm else None
        self.k_norm = jnp.ones((d,), dtype) if config.qk_norm else None

    def __call__(
        self,
        x: Float[Array, "seq embd"],
        cos: Float[Array, "seq rotary"],
        sin: Float[Array, "seq rotary"],
        mask: Bool[Array, "seq seq"],
        eps: float,
    ) -> Float[Array, "seq embd"]:
        def project(w: Array, b: Array | None, norm: Array | None = None) -> Array:
            y = jnp.einsum("te,hde->thd", x, w)
            y = y if b is None else y + b
            return y if norm is None else _rms_norm(y, norm, eps)  # Qwen3: per head, before RoPE

        q = _apply_rope(project(self.wq, self.bq, self.q_norm), cos, sin)
        k = _apply_rope(project(self.wk, self.bk, self.k_norm), cos, sin)
        v = project(self.wv, self.bv)
        seq, heads, dim = q.shape
        kv_heads = k.shape[1]
        # Query head h uses kv head h // groups (transformers' repeat_kv).
        q = q.reshape(seq, kv_heads, heads // kv_heads, dim)
        scores = jnp.einsum("qkgd,skd->kgqs", q, k) * (dim**-0.5)
        scores = jnp.where(mask, scores.astype(jnp.float32), jnp.finfo(jnp.float32).min)
        weights = jax.nn.softmax(scores, axis=-1).astype(x.dtype)
        out = jnp.einsum("kgqs,skd->qkgd", weights, v).reshape(seq, heads, dim)
        y = jnp.einsum("thd,ehd->te", out, self.wo)
        return y if self.bo is None else y + self.bo


class MLP(eqx.Module):
    """SwiGLU feed-forward: `down(silu(gate x) * up x)`."""

    gate: Float[Array, "inter embd"]
    up: Float[Array, "inter embd"]
    down: Float[Array, "embd inter"]
    bgate: Float[Array, " inter"] | None
    bup: Float[Array, " inter"] | None
    bdown: Float[Array, " embd"] | None

    def __init__(self, config: LlamaConfig, dtype: Any, *, key: PRNGKeyArray):
        e, i = config.hidden_size, config.intermediate_size
        kg, ku, kd = jax.random.split(key, 3)
        self.gate = _normal(kg, (i, e), dtype)
        self.up = _normal(ku, (i, e), dtype)
        self.down = _normal(kd, (e, i), dtype)
        self.bgate = _zeros_if(config.mlp_bias, (i,), dtype)
        self.bup = _zeros_if(config.mlp_bias, (i,), dtype)
        self.bdown = _zeros_if(config.mlp_bias, (e,), dtype)

    def __call__(self, x: Float[Array, "seq embd"]) -> Float[Array, "seq embd"]:
        def linear(x: Array, w: Array, b: Array | None) -> Array:
            y = jnp.einsum("ti,oi->to", x, w)
            return y if b is None else y + b

        h = jax.nn.silu(linear(x, self.gate, self.bgate)) * linear(x, self.up, self.bup)
        return linear(h, self.down, self.bdown)


class Block(eqx.Module):
    """One pre-RMSNorm decoder block."""

    attn_norm: Float[Array, " embd"]
    attn: Attention
    mlp_norm: Float[Array, " embd"]
    mlp: MLP

    def __init__(self, config: LlamaConfig, dtype: Any, *, key: PRNGKeyArray):
        kattn, kmlp = jax.random.split(key)
        self.attn_norm = jnp.ones((config.hidden_size,), dtype)
        self.attn = Attention(config, dtype, key=kattn)
        self.mlp_norm = jnp.ones((config.hidden_size,), dtype)
        self.mlp = MLP(config, dtype, key=kmlp)

    def __call__(
        self,
        x: Float[Array, "seq embd"],
        cos: Array,
        sin: Array,
        mask: Bool[Array, "seq seq"],
        eps: float,
    ) -> Float[Array, "seq embd"]:
        x = x + self.attn(_rms_norm(x, self.attn_norm, eps), cos, sin, mask, eps)
        return x + self.mlp(_rms_norm(x, self.mlp_norm, eps))


class Llama(eqx.Module):
    """Llama / Mistral / Qwen2 / Qwen3 / Phi-3 causal LM. Arrays in `blocks` are stacked over layers."""

    embed: Float[Array, "vocab embd"]
    blocks: Block
    norm: Float[Array, " embd"]
    lm_head: Float[Array, "vocab embd"] | None
    config: LlamaConfig = eqx.field(static=True)

    def __init__(
        self, config: LlamaConfig, *, key: PRNGKeyArray, dtype: Any = jnp.float32
    ):
        kembed, kblocks, khead = jax.random.split(key, 3)
        self.embed = _normal(kembed, (config.vocab_size, config.hidden_size), dtype)
        make_block = lambda k: Block(config, dtype, key=k)
        self.blocks = eqx.filter_vmap(make_block)(
            jax.random.split(kblocks, config.num_hidden_layers)
        )
        self.norm = jnp.ones((config.hidden_size,), dtype)
        self.lm_head = (
            None
            if config.tie_word_embeddings
            else _normal(khead, (config.vocab_size, config.hidden_size), dtype)
        )
        self.config = config

    @classmethod
    def from_config(
        cls, config: dict, *, key: PRNGKeyArray, dtype: Any = jnp.float32
    ) -> Llama:
        """Randomly initialise from a Hugging Face `config.json` dict."""
        return cls(LlamaConfig.from_hf(config), key=key, dtype=dtype)

    def __call__(
        self, input_ids: Int[Array, "*batch seq"]
    ) -> Float[Array, "*batch seq vocab"]:
        """Logits for `input_ids` of shape (batch, seq), or (seq,) without the batch axis.

        Unbatched ids run as a batch of one: `model(ids)` is `model(ids[None])[0]`.
        Raises `ValueError` for another rank and `TypeError` for non-integer ids; the
        checks read static shapes, so they work under `jax.jit`. (RoPE has no length
        limit, so neither does the sequence.)

        ```python
        logits = model(jnp.zeros((2, 8), jnp.int32))  # (2, 8, vocab)
        logits = model(jnp.zeros((8,), jnp.int32))    # (8, vocab)
        ```
        """
        return per_sequence(self._forward, check_ids(input_ids), input_ids)

    def _forward(self, input_ids: Int[Array, " seq"]) -> Float[Array, "seq vocab"]:
        config = self.config
        x = self.embed[input_ids]
        seq = input_ids.shape[0]

        positions = jnp.arange(seq, dtype=jnp.float32)
        freqs = positions[:, None] * jnp.asarray(config.inv_freq(seq))
        angles = jnp.concatenate((freqs, freqs), axis=-1)
        scale = np.float32(config.rope_attention_factor)
        cos, sin = (jnp.cos(angles) * scale).astype(x.dtype), (jnp.sin(angles) * scale).astype(x.dtype)

        q_pos, k_pos = jnp.arange(seq)[:, None], jnp.arange(seq)[None, :]
        causal = k_pos <= q_pos
        windowed = causal
        if config.sliding_window is not None:
            windowed = causal & (k_pos > q_pos - config.sliding_window)

        params, static = eqx.partition(self.blocks, eqx.is_array)

        def step(x: Array, layer: tuple[Block, Array]) -> tuple[Array, None]:
            block_params, sliding = layer
            block = eqx.combine(block_params, static)
            mask = jnp.where(sliding, windowed, causal)
            return block(x, cos, sin, mask, config.rms_norm_eps), None

        layers = config.num_hidden_layers
        if config.sliding_window is None:
            sliding = jnp.zeros((layers,), dtype=bool)
        else:
            sliding = jnp.asarray(config.sliding_layers or (True,) * layers, dtype=bool)
        x, _ = jax.lax.scan(step, x, (params, sliding))
        x = _rms_norm(x, self.norm, config.rms_norm_eps)
        head = self.embed if self.lm_head is None else self.lm_head
        return jnp.einsum("te,ve->tv", x, head)
