"""Llama, Mistral, Qwen2, Qwen3 and Phi-3 (decoder-only, RMSNorm, RoPE, SwiGLU, GQA) as one Equinox model.

One class serves the `model_type`s "llama", "mistral", "qwen2", "qwen3" and "phi3"; they
differ in which projections carry biases, in sliding-window attention, in Qwen3's
per-head RMSNorm of queries and keys (`q_norm`, `k_norm`, None elsewhere) and in Phi-3's
RoPE (partial rotary dimensions, "longrope" scaling). Phi-3's fused `qkv_proj` and
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
from typing import Any, final

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
from port.nn.config import (
    MAX_LAYERS,
    activation,
    check,
    check_model_type,
    get,
    read_kv_heads,
)

MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "phi3")
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
}


@final
@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    """The hyperparameters of a Llama/Mistral/Qwen2/Qwen3/Phi-3 model, as read from a config.json.

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
    qk_norm: str | None = None  # "head": Qwen3's RMSNorm over head_dim of each query and key head
    rope: Rope = Rope(theta=10000.0, rotary_dim=128)  # rotary embeddings, as config.json describes them
    sliding_window: int | None = None  # attend to the last `sliding_window` positions...
    sliding_layers: tuple[bool, ...] = ()  # ...in the layers marked True here

    @classmethod
    def from_hf(cls, config: dict) -> LlamaConfig:
        """Build from a Hugging Face `config.json` dict; raises `ConfigError` if unsupported."""
        model_type = check_model_type(config, MODEL_TYPES, "port.models.llama", "llama")
        defaults = _DEFAULTS[model_type]
        hidden = get(config, "hidden_size", int)
        heads = get(config, "num_attention_heads", int)
        layers = get(config, "num_hidden_layers", int, maximum=MAX_LAYERS)
        kv_heads = read_kv_heads(config, heads, defaults.get("num_key_value_heads"))
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
            qk_norm="head" if model_type == "qwen3" else None,
            sliding_window=window,
            sliding_layers=sliding,
            rope=_rope(config, model_type, head_dim),
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
            raise ConfigError(f"config.json: 'max_window_layers' must be a non-negative integer, got {first!r}")
        return tuple(i >= first for i in range(layers))
    kinds = ("full_attention", "sliding_attention")
    if not isinstance(layer_types, list) or len(layer_types) != layers or any(t not in kinds for t in layer_types):
        raise ConfigError(f"config.json: 'layer_types' must list {layers} of {kinds}, got {quoted(layer_types)}")
    return tuple(t == "sliding_attention" for t in layer_types)


def _rope(config: dict, model_type: str, head_dim: int) -> Rope:
    """The RoPE of a Llama-family config.json: Phi-3 rotates part of each head and knows
    "longrope" (its old names "su" and "yarn" included); the rest take llama3, linear and yarn."""
    if model_type != "phi3":
        maximum = get(config, "max_position_embeddings", int, _DEFAULTS[model_type]["max_position_embeddings"])
        return read_rope(config, head_dim, supported=ROPE_TYPES, max_position_embeddings=maximum)
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
        qk_norm=c.qk_norm,
        norm_eps=c.rms_norm_eps,
    )
    return Block(
        attn, (c.mlp if mlp is None else mlp)(dtype, kmlp), embd=c.hidden_size, eps=c.rms_norm_eps, dtype=dtype
    )


@final
class Llama(Decoder):
    """Llama / Mistral / Qwen2 / Qwen3 / Phi-3 causal LM. Arrays in `blocks` are stacked over layers.

    Called as every `port.nn.Decoder`: `model(input_ids, *, attention_mask=None, positions=None,
    segment_ids=None, cache=None, dtype=None, remat=None)`.
    """

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
        x, kv = run_layers(self.blocks, x, tokens, cos=cos, sin=sin, sliding=c.sliding_layers, remat=remat)
        return head(rms_norm(x, self.norm, c.rms_norm_eps), self.embed, self.lm_head), kv
