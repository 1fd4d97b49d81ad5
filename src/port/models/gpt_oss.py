"""gpt-oss (OpenAI's open-weight MoE, `GptOssForCausalLM`) as an Equinox model.

Only what is new in the family lives here, the layers are `port.nn`'s:

- attention with q/k/v/o biases (`attention_bias`) and a learned *sink* per head: a
  logit that joins every softmax and is then dropped (`Attention(sinks=True)`);
- layers alternating sliding-window and full attention (`layer_types`; by default
  even layers slide, with a window of `sliding_window` positions);
- YaRN rotary embeddings (`rope_parameters`, `truncate` false in gpt-oss), the base
  150000 where config.json gives none;
- a `port.nn.MoE` in every block: a router with a bias, top `num_experts_per_tok` of its
  logits and a softmax over those (as a softmax over all experts renormalised on the
  top k: the same weights), the weights in the activations' dtype; experts with biases
  and a clamped SwiGLU (`swiglu_limit`, `swiglu_alpha`: `(clip(up) + 1) * g * sigmoid(alpha g)`).

The checkpoint fuses each layer's experts into 3-D tensors (`experts.gate_up_proj`
`[experts, hidden, 2 * inter]`, gate and up interleaved column by column), which
mappings/gpt_oss.toml cuts into this module's `GatedMLP` leaves. The Hub's openai/gpt-oss-*
store them in MXFP4 (`*_blocks`, `*_scales`), which port reads as these same tensors
(`port._sources._quantized._mxfp4`).

Example:
    ```python
    import equinox as eqx
    import jax
    import jax.numpy as jnp
    from port.models.gpt_oss import GptOss

    config = {"model_type": "gpt_oss", "vocab_size": 201088, "hidden_size": 2880,
              "intermediate_size": 2880, "num_hidden_layers": 24, "num_attention_heads": 64,
              "num_key_value_heads": 8, "head_dim": 64, "num_local_experts": 32,
              "num_experts_per_tok": 4, "sliding_window": 128}
    abstract = eqx.filter_eval_shape(GptOss.from_config, config, key=jax.random.key(0))
    # abstract.blocks.mlp.experts.gate.shape == (24, 32, 2880, 2880)

    small = {**config, "vocab_size": 100, "hidden_size": 64, "intermediate_size": 32,
             "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
             "head_dim": 16, "num_local_experts": 4, "num_experts_per_tok": 2}
    model = GptOss.from_config(small, key=jax.random.key(0))
    logits = eqx.filter_jit(model)(jnp.zeros((1, 8), dtype=jnp.int32))  # (1, 8, 100)
    ```
"""

from __future__ import annotations

import dataclasses
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
from port.nn.config import MAX_LAYERS, ConfigFields, check, check_model_type, get, read_kv_heads

MODEL_TYPES = ("gpt_oss",)
ROPE_TYPES = ("default", "yarn")
LAYER_TYPES = ("sliding_attention", "full_attention")

# transformers' GptOssConfig defaults, used where config.json omits a key.
_DEFAULTS: dict[str, Any] = {
    "num_local_experts": 128,
    "num_experts_per_tok": 4,
    "num_key_value_heads": 8,
    "head_dim": 64,
    "sliding_window": 128,
    "rms_norm_eps": 1e-5,
    "max_position_embeddings": 131072,
    "swiglu_alpha": 1.702,
    "swiglu_limit": 7.0,
    "attention_bias": True,
    "tie_word_embeddings": False,
}
_ROPE_THETA = 150000.0  # GptOssConfig.default_theta
_ROPE = {
    "rope_type": "yarn",
    "factor": 32.0,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "truncate": False,
    "original_max_position_embeddings": 4096,
}  # GptOssConfig's rope_parameters when none are given


@final
@dataclasses.dataclass(frozen=True)
class GptOssConfig:
    """The hyperparameters of a gpt-oss model, as read from a config.json.

    ```python
    c = GptOssConfig.from_hf({"model_type": "gpt_oss", "vocab_size": 101, "hidden_size": 48,
                              "intermediate_size": 40, "num_hidden_layers": 2,
                              "num_attention_heads": 6, "num_key_value_heads": 2, "head_dim": 8,
                              "num_local_experts": 4})
    c.sliding_layers, c.sliding_window, c.rope.kind   # ((True, False), 128, 'yarn')
    ```
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int  # each expert's hidden size
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    num_experts: int = 128
    num_experts_per_tok: int = 4
    rms_norm_eps: float = 1e-5
    attention_bias: bool = True  # q, k, v and o projections
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    tie_word_embeddings: bool = False
    rope: Rope = Rope(theta=_ROPE_THETA, rotary_dim=64)
    sliding_window: int | None = 128  # attend to the last `sliding_window` positions...
    sliding_layers: tuple[bool, ...] = ()  # ...in the layers marked True here

    @classmethod
    def from_hf(cls, config: dict) -> GptOssConfig:
        """Build from a Hugging Face `config.json` dict; raises a one-line `ConfigError` if unsupported."""
        check_model_type(config, MODEL_TYPES, "port.models.gpt_oss")
        GptOss.FIELDS.check(config)
        if config.get("num_local_experts") is None and config.get("num_experts") is not None:
            config = {**config, "num_local_experts": config["num_experts"]}  # GptOssConfig.attribute_map
        filled = {**_DEFAULTS, **{k: v for k, v in config.items() if v is not None or k == "sliding_window"}}
        hidden = get(filled, "hidden_size", int)
        heads = get(filled, "num_attention_heads", int)
        layers = get(filled, "num_hidden_layers", int, maximum=MAX_LAYERS)
        head_dim = get(filled, "head_dim", int, hidden // heads)
        experts = get(filled, "num_local_experts", int)
        top_k = get(filled, "num_experts_per_tok", int)
        if top_k > experts:
            raise ConfigError(
                f"config.json: 'num_experts_per_tok' ({top_k}) is more than 'num_local_experts' ({experts})"
            )
        window = filled["sliding_window"]
        return cls(
            vocab_size=get(filled, "vocab_size", int),
            hidden_size=hidden,
            intermediate_size=get(filled, "intermediate_size", int),
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=read_kv_heads(config, heads, _DEFAULTS["num_key_value_heads"]),
            head_dim=head_dim,
            num_experts=experts,
            num_experts_per_tok=top_k,
            rms_norm_eps=get(filled, "rms_norm_eps", float),
            attention_bias=get(filled, "attention_bias", bool),
            swiglu_alpha=get(filled, "swiglu_alpha", float),
            swiglu_limit=get(filled, "swiglu_limit", float),
            tie_word_embeddings=get(filled, "tie_word_embeddings", bool),
            rope=_rope(filled, head_dim),
            sliding_window=None if window is None else check("sliding_window", window, int),
            sliding_layers=_sliding_layers(filled, layers, window),
        )

    def mlp(self, dtype: Any, key: PRNGKeyArray) -> MoE:
        """One block's feed-forward: a `port.nn.MoE` routed and activated as gpt-oss's.

        ```python
        moe = GptOssConfig.from_hf(config).mlp(jnp.float32, jax.random.key(0))
        y = moe(x)   # x: [..., hidden_size]
        ```
        """
        return MoE(
            embd=self.hidden_size,
            inner=self.intermediate_size,
            experts=self.num_experts,
            top_k=self.num_experts_per_tok,
            activation="silu",
            dtype=dtype,
            key=key,
            scoring="softmax",
            renormalise=True,
            weights_in_input_dtype=True,
            router_bias=True,
            bias=True,
            limit=self.swiglu_limit,
            alpha=self.swiglu_alpha,
        )


def _sliding_layers(config: dict, layers: int, window: Any) -> tuple[bool, ...]:
    """Which layers slide: `layer_types`, else even layers (GptOssConfig's default); none without a window."""
    layer_types = config.get("layer_types")
    if layer_types is None:
        layer_types = [LAYER_TYPES[i % 2] for i in range(layers)]
    if (
        not isinstance(layer_types, list)
        or len(layer_types) != layers
        or any(t not in LAYER_TYPES for t in layer_types)
    ):
        raise ConfigError(f"config.json: 'layer_types' must list {layers} of {LAYER_TYPES}, got {quoted(layer_types)}")
    return tuple(window is not None and t == "sliding_attention" for t in layer_types)


def _rope(config: dict, head_dim: int) -> Rope:
    """YaRN as GptOssConfig fills it: its own parameters when config.json has none, base 150000."""
    if not config.get("rope_scaling") and not config.get("rope_parameters"):
        config = {**config, "rope_parameters": _ROPE}
    key = "rope_scaling" if config.get("rope_scaling") else "rope_parameters"
    if isinstance(config[key], dict) and config[key].get("rope_theta") is None and config.get("rope_theta") is None:
        config = {**config, "rope_theta": _ROPE_THETA}
    maximum = get(config, "max_position_embeddings", int)
    return read_rope(config, head_dim, supported=ROPE_TYPES, max_position_embeddings=maximum)


def block(c: GptOssConfig, dtype: Any, *, key: PRNGKeyArray) -> Block:
    """One gpt-oss layer: attention with sinks and biases, then the mixture of experts."""
    kattn, kmlp = jax.random.split(key)
    attn = Attention(
        heads=c.num_attention_heads,
        kv_heads=c.num_key_value_heads,
        head_dim=c.head_dim,
        embd=c.hidden_size,
        dtype=dtype,
        key=kattn,
        qkv_bias=c.attention_bias,
        o_bias=c.attention_bias,
        sinks=True,
    )
    return Block(attn, c.mlp(dtype, kmlp), embd=c.hidden_size, eps=c.rms_norm_eps, dtype=dtype)


@final
class GptOss(Decoder):
    """gpt-oss causal LM. Arrays in `blocks` are stacked over layers.

    Called as every `port.nn.Decoder`: `model(input_ids, *, attention_mask=None, positions=None,
    segment_ids=None, cache=None, dtype=None, remat=None)`.

    ```python
    model = GptOss.from_config(config, key=jax.random.key(0))
    logits = model(ids)                      # (batch, seq, vocab)
    ```
    """

    FIELDS: ClassVar[ConfigFields] = ConfigFields(
        "port.models.gpt_oss.GptOss",
        read=(
            "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads", "head_dim", "num_local_experts", "num_experts", "num_experts_per_tok",
            "rms_norm_eps", "attention_bias", "swiglu_alpha", "swiglu_limit", "tie_word_embeddings",
            "rope_parameters", "rope_scaling", "rope_theta", "max_position_embeddings", "sliding_window",
            "layer_types",
            "hidden_act",  # unused by gpt-oss (its experts' clamped SwiGLU is its own), as in transformers
        ),
    )  # fmt: skip

    embed: Float[Array, "vocab embed"]
    blocks: Block
    norm: Float[Array, " embed"]
    lm_head: Float[Array, "vocab embed"] | None
    config: GptOssConfig = eqx.field(static=True)

    def __init__(self, config: GptOssConfig, *, key: PRNGKeyArray, dtype: Any = jnp.float32):
        kembed, kblocks = jax.random.split(key)
        self.embed, self.lm_head = embeddings(
            kembed, vocab=config.vocab_size, embd=config.hidden_size, dtype=dtype, tied=config.tie_word_embeddings
        )
        self.blocks = stacked(lambda k: block(config, dtype, key=k), kblocks, config.num_hidden_layers)
        self.norm = jnp.ones((config.hidden_size,), dtype)
        self.config = config

    @classmethod
    def from_config(cls, config: dict, *, key: PRNGKeyArray, dtype: Any = jnp.float32) -> GptOss:
        """Randomly initialise from a Hugging Face `config.json` dict (model_type gpt_oss).

        **Arguments:** `config` (the config.json dict), `key`, `dtype` (of the parameters).
        """
        return cls(GptOssConfig.from_hf(config), key=key, dtype=dtype)

    def logits(self, tokens: Tokens, remat: Any) -> tuple[Array, tuple[Array | None, Array | None]]:
        """Embed, the stacked blocks (sliding or full, per layer), the final norm and the head."""
        c = self.config
        x = self.embed[tokens.ids]
        cos, sin = c.rope.angles(tokens.positions, x.dtype)
        x, kv = run_layers(self.blocks, x, tokens, cos=cos, sin=sin, sliding=c.sliding_layers, remat=remat)
        return head(rms_norm(x, self.norm, c.rms_norm_eps), self.embed, self.lm_head), kv
