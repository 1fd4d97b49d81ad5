"""Gemma and Gemma 2 (decoder-only, (1 + w) RMSNorm, RoPE, GeLU-gated MLP, GQA) as one Equinox model.

One class serves the `model_type`s "gemma" and "gemma2". What both do, unlike Llama:
RMSNorm scales by `1 + weight` (computed in float32, cast back after scaling), the token
embeddings are multiplied by `sqrt(hidden_size)` (that constant rounded to the
parameters' dtype first, as transformers does), the MLP is `down(gelu_tanh(gate x) * up x)`,
`head_dim` is its own config value (not hidden / heads), and the head is tied to the
embeddings unless `tie_word_embeddings` is false. Gemma 2 adds tanh soft-capping of the
attention scores and of the final logits, the attention scale `query_pre_attn_scalar**-0.5`,
a sliding window in the layers `layer_types` marks (by default every other layer, from
the first), and two more norms per block: one on the attention output
(`post_attn_norm`) and one on the MLP output (`post_mlp_norm`); both are None for Gemma.
The two mappings (`mappings/gemma.toml`, `mappings/gemma2.toml`) differ only in which
checkpoint norm fills which leaf.

The transformer blocks are stored *stacked*: every array in `Gemma.blocks` has a leading
axis of size `num_hidden_layers`, and the forward pass runs them with `jax.lax.scan`.
Which layers slide is static (`GemmaConfig.sliding_layers`), scanned as a boolean array.
The dtype of the parameters is the compute dtype (bfloat16 params: bfloat16 compute,
with RMSNorm and the attention softmax in float32, as in transformers).

Example:
    ```python
    import equinox as eqx
    import jax
    import jax.numpy as jnp
    from port.models.gemma import Gemma

    config = {"model_type": "gemma2", "vocab_size": 256000, "hidden_size": 2304,
              "intermediate_size": 9216, "num_hidden_layers": 26,
              "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256}
    model = Gemma.from_config(config, key=jax.random.key(0), dtype=jnp.bfloat16)
    logits = eqx.filter_jit(model)(jnp.zeros((1, 8), dtype=jnp.int32))
    # logits.shape == (1, 8, 256000), every |logit| <= 30 (final_logit_softcapping)

    # Shapes only, no memory allocated (e.g. before loading a checkpoint):
    abstract = eqx.filter_eval_shape(Gemma.from_config, config, key=jax.random.key(0))
    ```
"""

from __future__ import annotations

import dataclasses
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Float, Int, PRNGKeyArray

from port._console import quoted
from port._errors import ConfigError
from port.models._config import ACTIVATIONS, MAX_LAYERS, activation, check, get
from port.models._inputs import check_ids, per_sequence

MODEL_TYPES = ("gemma", "gemma2")
LAYER_TYPES = ("full_attention", "sliding_attention")

# transformers' GemmaConfig / Gemma2Config defaults, used where config.json lacks the key.
_DEFAULTS: dict[str, dict[str, Any]] = {
    "gemma": {"num_key_value_heads": 16},
    "gemma2": {"num_key_value_heads": 4, "query_pre_attn_scalar": 256,
               "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0,
               "sliding_window": 4096},
}


def _optional(config: dict, key: str, kind: type, default: Any) -> Any:
    """`config[key]` checked as `kind`; absent: `default`; null: None (the feature is off).

    ```python
    _optional({"final_logit_softcapping": None}, "final_logit_softcapping", float, 30.0)  # None
    _optional({}, "final_logit_softcapping", float, 30.0)                                # 30.0
    ```
    """
    if key not in config:
        return default
    value = config[key]
    return None if value is None else check(key, value, kind)


def _rope_theta(config: dict) -> float:
    """The RoPE base from `rope_parameters` (transformers 5) or `rope_theta` (transformers 4).

    Gemma and Gemma 2 use plain RoPE; any other `rope_type` is a `ConfigError`.

    ```python
    _rope_theta({"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}})  # 10000.0
    _rope_theta({"rope_theta": 500.0})                                                  # 500.0
    ```
    """
    key = "rope_scaling" if config.get("rope_scaling") else "rope_parameters"
    rope = config.get(key) or {}
    if not isinstance(rope, dict) or any(isinstance(v, dict) for v in rope.values()):
        raise ConfigError(f"config.json: {key!r} must be one flat dict, got {quoted(rope)}")
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type != "default":
        raise ConfigError(
            f"config.json: {key}: rope type {quoted(rope_type)} is not supported for Gemma (supported: default)"
        )
    theta = rope.get("rope_theta", config.get("rope_theta"))
    return 10000.0 if theta is None else check(f"{key}.rope_theta", theta, float)


def _sliding_layers(config: dict, layers: int) -> tuple[bool, ...]:
    """Gemma 2's sliding layers: `layer_types`, else every other layer from the first (as Gemma2Config).

    ```python
    _sliding_layers({}, 3)                                                  # (True, False, True)
    _sliding_layers({"layer_types": ["full_attention"] * 2}, 2)             # (False, False)
    ```
    """
    layer_types = config.get("layer_types")
    if layer_types is None:
        return tuple(i % 2 == 0 for i in range(layers))
    if (
        not isinstance(layer_types, list)
        or len(layer_types) != layers
        or any(t not in LAYER_TYPES for t in layer_types)
    ):
        raise ConfigError(
            f"config.json: 'layer_types' must list {layers} of {LAYER_TYPES}, got {quoted(layer_types)}"
        )
    return tuple(t == "sliding_attention" for t in layer_types)


def _hidden_act(config: dict, model_type: str) -> str:
    """The MLP activation as transformers 5 picks it.

    Gemma reads `hidden_act` ("gelu", the legacy value of the released configs, means the
    tanh approximation there); Gemma 2 reads `hidden_activation` and ignores `hidden_act`.
    """
    if model_type == "gemma2":
        return activation(config, "hidden_activation", "gelu_pytorch_tanh")
    name = activation(config, "hidden_act", "gelu_pytorch_tanh")
    return "gelu_pytorch_tanh" if name == "gelu" else name


@dataclasses.dataclass(frozen=True)
class GemmaConfig:
    """The hyperparameters of a Gemma or Gemma 2 model, as read from a config.json.

    Field names are config.json's, so a mapping may name them in a reshape.

    ```python
    c = GemmaConfig.from_hf({"model_type": "gemma2", "vocab_size": 100, "hidden_size": 48,
                             "intermediate_size": 96, "num_hidden_layers": 3,
                             "num_attention_heads": 6, "num_key_value_heads": 2, "head_dim": 16})
    c.sliding_layers, c.scaling    # ((True, False, True), 0.0625): query_pre_attn_scalar 256
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
    hidden_act: str = "gelu_pytorch_tanh"
    tie_word_embeddings: bool = True
    attention_bias: bool = False  # q_proj, k_proj, v_proj and o_proj
    rope_theta: float = 10000.0
    model_type: str = "gemma"
    query_pre_attn_scalar: float | None = None  # Gemma 2: scores * this**-0.5 (None: head_dim)
    attn_logit_softcapping: float | None = None  # Gemma 2: cap * tanh(scores / cap)
    final_logit_softcapping: float | None = None  # Gemma 2: cap * tanh(logits / cap)
    sliding_window: int | None = None  # attend to the last `sliding_window` positions...
    sliding_layers: tuple[bool, ...] = ()  # ...in the layers marked True here

    @classmethod
    def from_hf(cls, config: dict) -> GemmaConfig:
        """Build from a Hugging Face `config.json` dict; raises `ConfigError` if unsupported."""
        model_type = config.get("model_type", "gemma")
        if model_type not in MODEL_TYPES:
            raise ConfigError(
                f"config.json: 'model_type' {quoted(model_type)} is not supported by "
                f"port.models.gemma (supported: {', '.join(MODEL_TYPES)})"
            )
        defaults = _DEFAULTS[model_type]
        heads = get(config, "num_attention_heads", int)
        layers = get(config, "num_hidden_layers", int, maximum=MAX_LAYERS)
        # Absent: the config class's default; null: one kv head per query head.
        kv_heads = config.get("num_key_value_heads", defaults["num_key_value_heads"])
        kv_heads = heads if kv_heads is None else check("num_key_value_heads", kv_heads, int)
        if heads % kv_heads != 0:
            raise ConfigError(
                f"config.json: 'num_key_value_heads' ({kv_heads}) must divide "
                f"'num_attention_heads' ({heads})"
            )
        if get(config, "use_bidirectional_attention", bool, False):
            raise ConfigError("config.json: 'use_bidirectional_attention' true is not supported (causal only)")
        fields: dict[str, Any] = {}
        if model_type == "gemma2":
            window = _optional(config, "sliding_window", int, defaults["sliding_window"])
            fields = dict(
                query_pre_attn_scalar=get(config, "query_pre_attn_scalar", float,
                                          defaults["query_pre_attn_scalar"]),
                attn_logit_softcapping=_optional(config, "attn_logit_softcapping", float,
                                                 defaults["attn_logit_softcapping"]),
                final_logit_softcapping=_optional(config, "final_logit_softcapping", float,
                                                  defaults["final_logit_softcapping"]),
                sliding_window=window,
                sliding_layers=_sliding_layers(config, layers) if window else (False,) * layers,
            )
        return cls(
            vocab_size=get(config, "vocab_size", int),
            hidden_size=get(config, "hidden_size", int),
            intermediate_size=get(config, "intermediate_size", int),
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=get(config, "head_dim", int, 256),  # both config classes: 256
            rms_norm_eps=get(config, "rms_norm_eps", float, 1e-6),
            hidden_act=_hidden_act(config, model_type),
            tie_word_embeddings=get(config, "tie_word_embeddings", bool, True),
            attention_bias=get(config, "attention_bias", bool, False),
            rope_theta=_rope_theta(config),
            model_type=model_type,
            **fields,
        )

    @property
    def gemma2(self) -> bool:
        """Whether this is Gemma 2 (its blocks have the two extra norms)."""
        return self.model_type == "gemma2"

    @property
    def scaling(self) -> float:
        """What the attention scores are multiplied by: `query_pre_attn_scalar**-0.5` (Gemma 2) or `head_dim**-0.5`."""
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    def inv_freq(self) -> np.ndarray:
        """RoPE inverse frequencies [head_dim // 2] in float32, computed as transformers does."""
        exponents = np.arange(0, self.head_dim, 2).astype(np.float32) / np.float32(self.head_dim)
        return (np.float32(1.0) / np.float32(self.rope_theta) ** exponents).astype(np.float32)


def _normal(key: PRNGKeyArray, shape: tuple[int, ...], dtype: Any) -> Array:
    return 0.02 * jax.random.normal(key, shape, dtype)


def _zeros_if(flag: bool, shape: tuple[int, ...], dtype: Any) -> Array | None:
    return jnp.zeros(shape, dtype) if flag else None


def _rms_norm(x: Float[Array, "... embd"], weight: Float[Array, " embd"], eps: float) -> Array:
    """transformers' GemmaRMSNorm: normalise and scale by `1 + weight` in float32, then cast back.

    ```python
    _rms_norm(jnp.ones((2, 4)), jnp.zeros(4), 1e-6)   # ~ones: a zero weight is the identity scale
    ```
    """
    h = x.astype(jnp.float32)
    h = h * jax.lax.rsqrt(jnp.mean(h * h, axis=-1, keepdims=True) + eps)
    return (h * (1.0 + weight.astype(jnp.float32))).astype(x.dtype)


def _softcap(x: Array, cap: float | None) -> Array:
    """`cap * tanh(x / cap)` in `x`'s dtype (None: `x` unchanged), as transformers computes it."""
    return x if cap is None else jnp.tanh(x / cap) * cap


def _rotate_half(x: Array) -> Array:
    x1, x2 = jnp.split(x, 2, axis=-1)
    return jnp.concatenate((-x2, x1), axis=-1)


def _apply_rope(x: Float[Array, "seq head dim"], cos: Array, sin: Array) -> Array:
    return x * cos[:, None, :] + _rotate_half(x) * sin[:, None, :]


class Attention(eqx.Module):
    """Causal grouped-query self-attention with RoPE; Gemma 2's scale and score soft-capping."""

    wq: Float[Array, "head head_dim embd"]
    wk: Float[Array, "kv_head head_dim embd"]
    wv: Float[Array, "kv_head head_dim embd"]
    wo: Float[Array, "embd head head_dim"]
    bq: Float[Array, "head head_dim"] | None  # attention_bias
    bk: Float[Array, "kv_head head_dim"] | None
    bv: Float[Array, "kv_head head_dim"] | None
    bo: Float[Array, " embd"] | None

    def __init__(self, config: GemmaConfig, dtype: Any, *, key: PRNGKeyArray):
        h, kv, d = config.num_attention_heads, config.num_key_value_heads, config.head_dim
        e, bias = config.hidden_size, config.attention_bias
        kq, kk, kvv, ko = jax.random.split(key, 4)
        self.wq = _normal(kq, (h, d, e), dtype)
        self.wk = _normal(kk, (kv, d, e), dtype)
        self.wv = _normal(kvv, (kv, d, e), dtype)
        self.wo = _normal(ko, (e, h, d), dtype)
        self.bq = _zeros_if(bias, (h, d), dtype)
        self.bk = _zeros_if(bias, (kv, d), dtype)
        self.bv = _zeros_if(bias, (kv, d), dtype)
        self.bo = _zeros_if(bias, (e,), dtype)

    def __call__(
        self,
        x: Float[Array, "seq embd"],
        cos: Float[Array, "seq head_dim"],
        sin: Float[Array, "seq head_dim"],
        mask: Bool[Array, "seq seq"],
        config: GemmaConfig,
    ) -> Float[Array, "seq embd"]:
        def project(w: Array, b: Array | None) -> Array:
            y = jnp.einsum("te,hde->thd", x, w)
            return y if b is None else y + b

        q = _apply_rope(project(self.wq, self.bq), cos, sin)
        k = _apply_rope(project(self.wk, self.bk), cos, sin)
        v = project(self.wv, self.bv)
        seq, heads, dim = q.shape
        kv_heads = k.shape[1]
        # Query head h uses kv head h // groups (transformers' repeat_kv).
        q = q.reshape(seq, kv_heads, heads // kv_heads, dim)
        scores = jnp.einsum("qkgd,skd->kgqs", q, k) * config.scaling
        scores = _softcap(scores, config.attn_logit_softcapping)  # in x's dtype, before the mask
        scores = jnp.where(mask, scores.astype(jnp.float32), jnp.finfo(jnp.float32).min)
        weights = jax.nn.softmax(scores, axis=-1).astype(x.dtype)
        out = jnp.einsum("kgqs,skd->qkgd", weights, v).reshape(seq, heads, dim)
        y = jnp.einsum("thd,ehd->te", out, self.wo)
        return y if self.bo is None else y + self.bo


class MLP(eqx.Module):
    """Gated feed-forward: `down(act(gate x) * up x)`, act GeLU-tanh unless config.json says otherwise."""

    gate: Float[Array, "inter embd"]
    up: Float[Array, "inter embd"]
    down: Float[Array, "embd inter"]

    def __init__(self, config: GemmaConfig, dtype: Any, *, key: PRNGKeyArray):
        e, i = config.hidden_size, config.intermediate_size
        kg, ku, kd = jax.random.split(key, 3)
        self.gate = _normal(kg, (i, e), dtype)
        self.up = _normal(ku, (i, e), dtype)
        self.down = _normal(kd, (e, i), dtype)

    def __call__(self, x: Float[Array, "seq embd"], act: str) -> Float[Array, "seq embd"]:
        h = ACTIVATIONS[act](jnp.einsum("te,ie->ti", x, self.gate)) * jnp.einsum("te,ie->ti", x, self.up)
        return jnp.einsum("ti,ei->te", h, self.down)


class Block(eqx.Module):
    """One pre-RMSNorm decoder block; Gemma 2 also norms the attention and MLP outputs."""

    attn_norm: Float[Array, " embd"]
    attn: Attention
    post_attn_norm: Float[Array, " embd"] | None  # Gemma 2
    mlp_norm: Float[Array, " embd"]
    mlp: MLP
    post_mlp_norm: Float[Array, " embd"] | None  # Gemma 2

    def __init__(self, config: GemmaConfig, dtype: Any, *, key: PRNGKeyArray):
        kattn, kmlp = jax.random.split(key)
        norm = lambda: jnp.zeros((config.hidden_size,), dtype)  # (1 + 0): the identity scale
        self.attn_norm = norm()
        self.attn = Attention(config, dtype, key=kattn)
        self.post_attn_norm = norm() if config.gemma2 else None
        self.mlp_norm = norm()
        self.mlp = MLP(config, dtype, key=kmlp)
        self.post_mlp_norm = norm() if config.gemma2 else None

    def __call__(
        self,
        x: Float[Array, "seq embd"],
        cos: Array,
        sin: Array,
        mask: Bool[Array, "seq seq"],
        config: GemmaConfig,
    ) -> Float[Array, "seq embd"]:
        eps = config.rms_norm_eps

        def post(h: Array, weight: Array | None) -> Array:
            return h if weight is None else _rms_norm(h, weight, eps)

        h = self.attn(_rms_norm(x, self.attn_norm, eps), cos, sin, mask, config)
        x = x + post(h, self.post_attn_norm)
        h = self.mlp(_rms_norm(x, self.mlp_norm, eps), config.hidden_act)
        return x + post(h, self.post_mlp_norm)


class Gemma(eqx.Module):
    """Gemma / Gemma 2 causal LM. Arrays in `blocks` are stacked over layers."""

    embed: Float[Array, "vocab embd"]
    blocks: Block
    norm: Float[Array, " embd"]
    lm_head: Float[Array, "vocab embd"] | None  # None: tied to `embed` (the default)
    config: GemmaConfig = eqx.field(static=True)

    def __init__(self, config: GemmaConfig, *, key: PRNGKeyArray, dtype: Any = jnp.float32):
        kembed, kblocks, khead = jax.random.split(key, 3)
        self.embed = _normal(kembed, (config.vocab_size, config.hidden_size), dtype)
        make_block = lambda k: Block(config, dtype, key=k)
        self.blocks = eqx.filter_vmap(make_block)(jax.random.split(kblocks, config.num_hidden_layers))
        self.norm = jnp.zeros((config.hidden_size,), dtype)
        self.lm_head = (
            None
            if config.tie_word_embeddings
            else _normal(khead, (config.vocab_size, config.hidden_size), dtype)
        )
        self.config = config

    @classmethod
    def from_config(cls, config: dict, *, key: PRNGKeyArray, dtype: Any = jnp.float32) -> Gemma:
        """Randomly initialise from a Hugging Face `config.json` dict.

        ```python
        model = Gemma.from_config({"model_type": "gemma", "vocab_size": 100, "hidden_size": 48,
                                   "intermediate_size": 96, "num_hidden_layers": 2,
                                   "num_attention_heads": 3, "num_key_value_heads": 1,
                                   "head_dim": 32}, key=jax.random.key(0))
        model.blocks.attn.wq.shape   # (2, 3, 32, 48)
        ```
        """
        return cls(GemmaConfig.from_hf(config), key=key, dtype=dtype)

    def __call__(self, input_ids: Int[Array, "*batch seq"]) -> Float[Array, "*batch seq vocab"]:
        """Logits for `input_ids` of shape (batch, seq), or (seq,) without the batch axis.

        Unbatched ids run as a batch of one: `model(ids)` is `model(ids[None])[0]`.
        Raises `ValueError` for another rank and `TypeError` for non-integer ids; the
        checks read static shapes, so they work under `jax.jit`.

        ```python
        logits = model(jnp.zeros((2, 8), jnp.int32))  # (2, 8, vocab)
        logits = model(jnp.zeros((8,), jnp.int32))    # (8, vocab)
        ```
        """
        return per_sequence(self._forward, check_ids(input_ids), input_ids)

    def _forward(self, input_ids: Int[Array, " seq"]) -> Float[Array, "seq vocab"]:
        config = self.config
        x = self.embed[input_ids]
        # transformers holds sqrt(hidden_size) in float32 and rounds it to the weights' dtype.
        x = x * jnp.asarray(np.float32(config.hidden_size**0.5), dtype=x.dtype)
        seq = input_ids.shape[0]

        positions = jnp.arange(seq, dtype=jnp.float32)
        freqs = positions[:, None] * jnp.asarray(config.inv_freq())
        angles = jnp.concatenate((freqs, freqs), axis=-1)
        cos, sin = jnp.cos(angles).astype(x.dtype), jnp.sin(angles).astype(x.dtype)

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
            return block(x, cos, sin, mask, config), None

        sliding = jnp.asarray(config.sliding_layers or (False,) * config.num_hidden_layers, dtype=bool)
        x, _ = jax.lax.scan(step, x, (params, sliding))
        x = _rms_norm(x, self.norm, config.rms_norm_eps)
        head = self.embed if self.lm_head is None else self.lm_head
        return _softcap(jnp.einsum("te,ve->tv", x, head), config.final_logit_softcapping)
