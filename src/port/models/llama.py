"""Llama, Mistral, Qwen2, Qwen3, Phi-3, OLMo 2, OLMo 3, SmolLM3 and Ministral 3 (decoder-only,
RMSNorm, RoPE, SwiGLU, GQA) as one Equinox model.

One class serves the `model_type`s "llama", "mistral", "qwen2", "qwen3", "phi3", "olmo2",
"olmo3", "smollm3", "ministral3" and the language model of "mistral3" (Mistral 3's
vision-language checkpoints: config.json's `text_config`, a Mistral or Ministral 3); they differ in which projections carry biases, in sliding-window
attention, in Qwen3's per-head RMSNorm of queries and keys (`q_norm`, `k_norm`, None
elsewhere), in Phi-3's RoPE (partial rotary dimensions, "longrope" scaling), in OLMo 2's
layout (its norms after the attention and the MLP, `post_attn_norm` and `post_mlp_norm`,
not before them; q/k norms over the whole projection; every RMSNorm applying its weight
in float32), in OLMo 3's (OLMo 2's, with sliding-window layers by `layer_types`, each
layer type with its own RoPE), in SmolLM3's layers without RoPE (`no_rope_layers`) and in
Ministral 3's queries scaled by position after RoPE (`1 + beta * log(1 + floor(position /
original_max_position_embeddings))`, `rope_parameters.llama_4_scaling_beta`). Phi-3's fused `qkv_proj` and
`gate_up_proj` are cut into this module's separate leaves by its mapping. The transformer blocks
are stored *stacked*: every array in `Llama.blocks` has a leading axis of size
`num_hidden_layers`, and `port.nn.run_layers` scans them.

Everything but what is named above comes from `port.nn` (`Attention`, `GatedMLP` or a
`MoE`, `rms_norm`, `Rope`, `Decoder`), so the model takes the call every port decoder
takes: padding masks, positions, packed `segment_ids`, a `Cache` from `init_cache`, a
compute `dtype` (by default the parameters'; RMSNorm statistics and the attention
softmax in float32 either way, as in transformers) and `remat`.

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
from collections.abc import Callable
from typing import Any, ClassVar, final

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, PRNGKeyArray

from port._errors import ConfigError
from port._text import quoted
from port.nn import (
    Attention,
    Block,
    Decoder,
    GatedMLP,
    MoE,
    Rope,
    Tokens,
    embeddings,
    head,
    read_rope,
    rms_norm,
    run_layers,
    stacked,
)
from port.nn._rope import rope_parameters
from port.nn.config import (
    MAX_LAYERS,
    ConfigFields,
    activation,
    check,
    check_model_type,
    get,
    read_kv_heads,
)

MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "phi3", "olmo2", "olmo3", "smollm3", "ministral3", "mistral3")
# A vision-language model whose language model this module runs: its text config's model types.
WRAPPERS = {"mistral3": ("mistral", "ministral3")}
OLMO = ("olmo2", "olmo3")  # post-norm, q/k norm over the projection, float32 norm scale
LAYER_TYPES = ("full_attention", "sliding_attention")
ROPE_TYPES = ("default", "linear", "llama3", "yarn")
# Phi-3's config accepts only these (Phi3Config.validate_rope); "su" and "yarn" are old
# names of "longrope" there.
PHI3_ROPE_TYPES = ("default", "longrope")

# Where transformers' config classes disagree on a default (used when the key is absent).
_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": {"max_position_embeddings": 2048, "sliding_window": None},
    "mistral": {"max_position_embeddings": 131072, "sliding_window": 4096, "num_key_value_heads": 8},
    "qwen2": {"max_position_embeddings": 32768, "sliding_window": 4096, "num_key_value_heads": 32},
    "qwen3": {"max_position_embeddings": 32768, "sliding_window": 4096, "num_key_value_heads": 32, "head_dim": 128},
    "phi3": {
        "max_position_embeddings": 4096,
        "sliding_window": None,
        "rms_norm_eps": 1e-5,
        "original_max_position_embeddings": 4096,
    },
    "olmo2": {"max_position_embeddings": 2048, "sliding_window": None, "rms_norm_eps": 1e-5},
    "olmo3": {"max_position_embeddings": 2048, "sliding_window": 4096, "rms_norm_eps": 1e-5, "rope_theta": 500000.0},
    "smollm3": {"max_position_embeddings": 32768, "sliding_window": None, "rope_theta": 2000000.0},
    "ministral3": {
        "max_position_embeddings": 262144,
        "sliding_window": None,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "rms_norm_eps": 1e-5,
    },
}
# Ministral3Config's RoPE where config.json names none.
_MINISTRAL3_ROPE = {
    "rope_type": "yarn",
    "rope_theta": 1000000.0,
    "factor": 16.0,
    "original_max_position_embeddings": 16384,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "mscale_all_dim": 1.0,
    "mscale": 1.0,
    "llama_4_scaling_beta": 0.1,
}
# The default of tie_word_embeddings where it is not False.
_TIED = {"smollm3": True}


@final
@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    """The hyperparameters of a Llama-family model (every model type of `MODEL_TYPES`), as read from a config.json.

    ```python
    c = LlamaConfig.from_hf({"model_type": "qwen3", "vocab_size": 101, "hidden_size": 64,
                             "intermediate_size": 128, "num_hidden_layers": 2,
                             "num_attention_heads": 6, "num_key_value_heads": 2, "head_dim": 12})
    c.qk_norm, c.rotary_dim    # ('head', 12)
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
    qk_norm: str | None = None  # "head": Qwen3's RMSNorm per query and key head; "projection": OLMo's
    norms: str = "pre"  # "post": OLMo's norms after the attention and the MLP
    float32_scale: bool = False  # OLMo: every RMSNorm applies its weight in float32
    rope: Rope = Rope(theta=10000.0, rotary_dim=128)  # rotary embeddings, as config.json describes them
    sliding_window: int | None = None  # attend to the last `sliding_window` positions...
    sliding_layers: tuple[bool, ...] = ()  # ...in the layers marked True here
    sliding_rope: Rope | None = None  # OLMo 3: the sliding layers' own RoPE (None: `rope`)
    rope_layers: tuple[bool, ...] | None = None  # SmolLM3: the layers that rotate (None: all)
    query_scale: tuple[float, int] | None = None  # Ministral 3: (beta, original length) of its query scale

    @classmethod
    def from_hf(cls, config: dict) -> LlamaConfig:
        """Build from a Hugging Face `config.json` dict (a wrapper's: its `text_config`); raises
        `ConfigError` if unsupported."""
        if config.get("model_type") in WRAPPERS:
            config = _language_model(config)
        Llama.FIELDS.check(config, config.get("model_type", "llama"))
        model_type = check_model_type(config, MODEL_TYPES[:-1], "port.models.llama", "llama")
        if model_type == "ministral3" and not config.get("rope_parameters") and not config.get("rope_scaling"):
            config = {**config, "rope_parameters": _MINISTRAL3_ROPE}
        defaults = _DEFAULTS[model_type]
        hidden = get(config, "hidden_size", int)
        heads = get(config, "num_attention_heads", int)
        layers = get(config, "num_hidden_layers", int, maximum=MAX_LAYERS)
        kv_heads = read_kv_heads(config, heads, defaults.get("num_key_value_heads"))
        # Absent: the config class's default; null: hidden / heads, as the config classes' post-init computes it.
        head_dim = (
            hidden // heads
            if "head_dim" in config and config["head_dim"] is None
            else get(config, "head_dim", int, defaults.get("head_dim", hidden // heads))
        )
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
            "olmo2": (attention_bias, attention_bias, False),
            "olmo3": (attention_bias, attention_bias, False),
            "smollm3": (attention_bias, attention_bias, mlp_bias),
            "ministral3": (False, False, False),
        }[model_type]
        rope_layers = _rope_layers(config, layers) if model_type == "smollm3" else None
        window, sliding = _sliding(config, model_type, layers, rope_layers)
        olmo = model_type in OLMO
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
            tie_word_embeddings=get(config, "tie_word_embeddings", bool, _TIED.get(model_type, False)),
            model_type=model_type,
            qkv_bias=qkv_bias,
            o_bias=o_bias,
            mlp_bias=mlp_bias,
            qk_norm="head" if model_type == "qwen3" else "projection" if olmo else None,
            norms="post" if olmo else "pre",
            float32_scale=olmo,
            sliding_window=window,
            sliding_layers=sliding,
            rope=_rope(config, model_type, head_dim),
            sliding_rope=_sliding_rope(config, head_dim) if model_type == "olmo3" else None,
            rope_layers=rope_layers,
            query_scale=_query_scale(config) if model_type == "ministral3" else None,
        )

    def mlp(self, dtype: Any, key: PRNGKeyArray) -> GatedMLP | MoE:
        """The feed-forward of one block: SwiGLU of `intermediate_size` (a mixture-of-experts
        family's sparse blocks take theirs from `block`'s `mlp`: `port.models.moe`)."""
        return GatedMLP(
            embd=self.hidden_size,
            inner=self.intermediate_size,
            activation="silu",
            dtype=dtype,
            key=key,
            bias=self.mlp_bias,
        )


def _sliding(
    config: dict, model_type: str, layers: int, rope_layers: tuple[bool, ...] | None
) -> tuple[int | None, tuple[bool, ...]]:
    """The sliding window (None: none) and which layers use it, as transformers reads them.

    Llama and OLMo 2 have none; Mistral and Phi-3 slide in every layer when `sliding_window`
    is set; Qwen2 and Qwen3 only with `use_sliding_window`, in the layers `layer_types`
    names (else those from `max_window_layers` on); SmolLM3 likewise (else its layers
    without RoPE); OLMo 3 in the layers `layer_types` names (else three of every four).
    """
    window = config.get("sliding_window", _DEFAULTS[model_type]["sliding_window"])
    typed = model_type in ("qwen2", "qwen3", "smollm3")
    if model_type in ("llama", "olmo2") or (typed and not get(config, "use_sliding_window", bool, False)):
        window = None
    if window is None:
        return None, (False,) * layers
    window = check("sliding_window", window, int)
    if model_type == "olmo3":
        return window, _layer_types(config, layers, tuple((i + 1) % 4 != 0 for i in range(layers)))
    if model_type == "smollm3":
        assert rope_layers is not None, "SmolLM3's layers without RoPE are read first"
        return window, _layer_types(config, layers, tuple(not r for r in rope_layers))
    return window, _qwen2_sliding_layers(config, layers) if typed else (True,) * layers


def _qwen2_sliding_layers(config: dict, layers: int) -> tuple[bool, ...]:
    """Qwen2's sliding layers: `layer_types`, else those from `max_window_layers` on."""
    if config.get("layer_types") is None:
        first = config.get("max_window_layers", 28)
        if not isinstance(first, int) or isinstance(first, bool) or first < 0:
            raise ConfigError(f"config.json: 'max_window_layers' must be a non-negative integer, got {first!r}")
        return tuple(i >= first for i in range(layers))
    return _layer_types(config, layers, ())


def _layer_types(config: dict, layers: int, default: tuple[bool, ...]) -> tuple[bool, ...]:
    """The layers `layer_types` marks "sliding_attention" (absent or null: `default`).

    ```python
    _layer_types({"layer_types": ["sliding_attention", "full_attention"]}, 2, ())   # (True, False)
    ```
    """
    layer_types = config.get("layer_types")
    if layer_types is None:
        return default
    if (
        not isinstance(layer_types, list)
        or len(layer_types) != layers
        or any(t not in LAYER_TYPES for t in layer_types)
    ):
        raise ConfigError(f"config.json: 'layer_types' must list {layers} of {LAYER_TYPES}, got {quoted(layer_types)}")
    return tuple(t == "sliding_attention" for t in layer_types)


def _rope_layers(config: dict, layers: int) -> tuple[bool, ...]:
    """SmolLM3's layers that rotate: `no_rope_layers` (1: RoPE, 0: none), else all but every
    `no_rope_layer_interval`-th (SmolLM3Config's default: 4).

    ```python
    _rope_layers({}, 8)                                # (True, True, True, False) * 2
    _rope_layers({"no_rope_layers": [1, 0]}, 2)        # (True, False)
    ```
    """
    flags = config.get("no_rope_layers")
    if flags is None:
        interval = get(config, "no_rope_layer_interval", int, 4)
        return tuple((i + 1) % interval != 0 for i in range(layers))
    if (
        not isinstance(flags, list)
        or len(flags) != layers
        or any(f not in (0, 1) or isinstance(f, bool) for f in flags)
    ):
        raise ConfigError(f"config.json: 'no_rope_layers' must list {layers} of 0 or 1, got {quoted(flags)}")
    return tuple(f == 1 for f in flags)


def _rope(config: dict, model_type: str, head_dim: int) -> Rope:
    """The RoPE of a Llama-family config.json: Phi-3 rotates part of each head and knows
    "longrope" (its old names "su" and "yarn" included); the rest take llama3, linear and yarn."""
    if model_type != "phi3":
        defaults = _DEFAULTS[model_type]
        maximum = get(config, "max_position_embeddings", int, defaults["max_position_embeddings"])
        return read_rope(
            config,
            head_dim,
            supported=ROPE_TYPES,
            max_position_embeddings=maximum,
            layer_type="full_attention" if model_type == "olmo3" else None,
            default_theta=defaults.get("rope_theta", 10000.0),
        )
    # Phi3Config always has original_max_position_embeddings (4096 if absent); it wins.
    config = {
        **config,
        "original_max_position_embeddings": config.get(
            "original_max_position_embeddings", _DEFAULTS["phi3"]["original_max_position_embeddings"]
        ),
    }
    maximum = get(config, "max_position_embeddings", int, _DEFAULTS["phi3"]["max_position_embeddings"])
    return read_rope(
        config,
        head_dim,
        supported=PHI3_ROPE_TYPES,
        max_position_embeddings=maximum,
        aliases={"su": "longrope", "yarn": "longrope"},
        allow_partial=True,
    )


def _language_model(config: dict) -> dict:
    """A vision-language config.json's `text_config` (its model type one this module runs), with
    the wrapper's `tie_word_embeddings` (Mistral3Config's default: true), which is what
    transformers ties by, whatever the text config says."""
    wrapper = config["model_type"]
    text = config.get("text_config")
    if not isinstance(text, dict):
        raise ConfigError(f"config.json: 'text_config' must be a dict, got {quoted(text)}")
    kinds = WRAPPERS[wrapper]
    text = {"model_type": kinds[0], **text, "tie_word_embeddings": config.get("tie_word_embeddings", True)}
    if text["model_type"] not in kinds:
        raise ConfigError(
            f"config.json: text_config's 'model_type' {quoted(text['model_type'])} is not supported by "
            f"port.models.llama in a {wrapper} checkpoint (supported: {', '.join(kinds)})"
        )
    return text


def _query_scale(config: dict) -> tuple[float, int]:
    """Ministral 3's query scale: `rope_parameters`' `llama_4_scaling_beta` and
    `original_max_position_embeddings` (both required, as transformers reads them)."""
    key, rope = rope_parameters(config)
    for name in ("llama_4_scaling_beta", "original_max_position_embeddings"):
        if rope.get(name) is None:
            raise ConfigError(f"config.json: required key '{key}.{name}' is missing")
    beta = rope["llama_4_scaling_beta"]
    if not isinstance(beta, (int, float)) or isinstance(beta, bool) or not beta >= 0:
        raise ConfigError(f"config.json: '{key}.llama_4_scaling_beta' must be a number >= 0, got {quoted(beta)}")
    return float(beta), check(f"{key}.original_max_position_embeddings", rope["original_max_position_embeddings"], int)


def _sliding_rope(config: dict, head_dim: int) -> Rope | None:
    """OLMo 3's sliding layers' RoPE where it is not the full layers' (None where it is)."""
    defaults = _DEFAULTS["olmo3"]
    maximum = get(config, "max_position_embeddings", int, defaults["max_position_embeddings"])
    read = {
        layer_type: read_rope(
            config,
            head_dim,
            supported=ROPE_TYPES,
            max_position_embeddings=maximum,
            layer_type=layer_type,
            default_theta=defaults["rope_theta"],
        )
        for layer_type in LAYER_TYPES
    }
    return None if read["sliding_attention"] == read["full_attention"] else read["sliding_attention"]


def block(
    c: LlamaConfig,
    dtype: Any,
    *,
    key: PRNGKeyArray,
    mlp: Callable[[Any, PRNGKeyArray], GatedMLP | MoE] | None = None,
) -> Block:
    """One decoder layer: `c`'s attention and `c.mlp` (or `mlp(dtype, key)`: another feed-forward,
    such as a mixture of experts)."""
    kattn, kmlp = jax.random.split(key)
    attn = Attention(
        heads=c.num_attention_heads,
        kv_heads=c.num_key_value_heads,
        head_dim=c.head_dim,
        embd=c.hidden_size,
        dtype=dtype,
        key=kattn,
        qkv_bias=c.qkv_bias,
        o_bias=c.o_bias,
        qk_norm=c.qk_norm,  # pyright: ignore[reportArgumentType]
        float32_scale=c.float32_scale,
        norm_eps=c.rms_norm_eps,
    )
    return Block(
        attn,
        (c.mlp if mlp is None else mlp)(dtype, kmlp),
        embd=c.hidden_size,
        eps=c.rms_norm_eps,
        dtype=dtype,
        norms=c.norms,  # pyright: ignore[reportArgumentType]
        float32_scale=c.float32_scale,
    )


@final
class Llama(Decoder):
    """Llama / Mistral / Qwen2 / Qwen3 / Phi-3 / OLMo 2 / OLMo 3 / SmolLM3 causal LM. Arrays in
    `blocks` are stacked over layers.

    Called as every `port.nn.Decoder`: `model(input_ids, *, attention_mask=None, positions=None,
    segment_ids=None, cache=None, dtype=None, remat=None)`. `FIELDS` is the config.json it
    runs: Llama's tensor-parallel split of its projections (`pretraining_tp`) only at 1.
    """

    FIELDS: ClassVar[ConfigFields] = ConfigFields(
        "port.models.llama.Llama",
        read=(
            "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads", "head_dim", "hidden_act", "max_position_embeddings", "rms_norm_eps",
            "tie_word_embeddings", "rope_parameters", "rope_scaling", "rope_theta", "partial_rotary_factor",
            "original_max_position_embeddings", "attention_bias", "mlp_bias", "sliding_window",
            "use_sliding_window", "max_window_layers", "layer_types", "no_rope_layers", "no_rope_layer_interval",
        ),
        types={"llama": {"pretraining_tp": (1,)}},
    )  # fmt: skip

    embed: Float[Array, "vocab embed"]
    blocks: Block
    norm: Float[Array, " embed"]
    lm_head: Float[Array, "vocab embed"] | None
    config: LlamaConfig = eqx.field(static=True)

    def __init__(self, config: LlamaConfig, *, key: PRNGKeyArray, dtype: Any = jnp.float32):
        kembed, kblocks = jax.random.split(key)
        self.embed, self.lm_head = embeddings(
            kembed, vocab=config.vocab_size, embd=config.hidden_size, dtype=dtype, tied=config.tie_word_embeddings
        )
        self.blocks = stacked(lambda k: block(config, dtype, key=k), kblocks, config.num_hidden_layers)
        self.norm = jnp.ones((config.hidden_size,), dtype)
        self.config = config

    @classmethod
    def from_config(cls, config: dict, *, key: PRNGKeyArray, dtype: Any = jnp.float32) -> Llama:
        """Randomly initialise from a Hugging Face `config.json` dict."""
        return cls(LlamaConfig.from_hf(config), key=key, dtype=dtype)

    def logits(self, tokens: Tokens, remat: Any) -> tuple[Array, tuple[Array | None, Array | None]]:
        """Embed, the stacked blocks (each layer's own window), the final norm and the head."""
        c = self.config
        x = self.embed[tokens.ids]
        cos, sin = c.rope.angles(tokens.positions, x.dtype)
        local = None if c.sliding_rope is None else c.sliding_rope.angles(tokens.positions, x.dtype)
        q_scale = None
        if c.query_scale is not None:  # in float32, cast to the queries' dtype by the attention
            beta, original = c.query_scale
            q_scale = 1.0 + beta * jnp.log1p(jnp.floor(tokens.positions.astype(jnp.float32) / original))
        x, kv = run_layers(
            self.blocks,
            x,
            tokens,
            cos=cos,
            sin=sin,
            sliding=c.sliding_layers,
            sliding_rope=local,
            rope_layers=c.rope_layers,
            q_scale=q_scale,
            remat=remat,
        )
        x = rms_norm(x, self.norm, c.rms_norm_eps, float32_scale=c.float32_scale)
        return head(x, self.embed, self.lm_head), kv
