"""Gemma, Gemma 2 and Gemma 3 (decoder-only, (1 + w) RMSNorm, RoPE, GeLU-gated MLP, GQA) as one Equinox model.

One class serves the `model_type`s "gemma", "gemma2", "gemma3_text" and "gemma3" (the
language model of a `Gemma3ForConditionalGeneration` checkpoint: its `text_config`). What
all do, unlike Llama:
RMSNorm scales by `1 + weight` (computed in float32, cast back after scaling), the token
embeddings are multiplied by `sqrt(hidden_size)` (that constant rounded to the
parameters' dtype first, as transformers does), the MLP is `down(gelu_tanh(gate x) * up x)`,
`head_dim` is its own config value (not hidden / heads), and the head is tied to the
embeddings unless `tie_word_embeddings` is false. Gemma 2 adds tanh soft-capping of the
attention scores and of the final logits, the attention scale `query_pre_attn_scalar**-0.5`,
a sliding window in the layers `layer_types` marks (by default every other layer, from
the first), and two more norms per block: one on the attention output
(`post_attn_norm`) and one on the MLP output (`post_mlp_norm`); both are None for Gemma.
Gemma 3 has Gemma 2's block and adds a per-head (1 + w) RMSNorm of queries and keys
before RoPE (`attn.q_norm`, `attn.k_norm`), and its local (sliding) and global layers
rotate with their own RoPE (`local_rope`: `rope_parameters["sliding_attention"]`, base
10000; `rope`: `["full_attention"]`, base 1e6, which may be scaled, linearly in the
released 4B and larger); its sliding layers are `layer_types`, else five in six
(`sliding_window_pattern`); its final soft-cap is off unless the config sets one, and its
attention applies no soft-cap whatever `attn_logit_softcapping` says (transformers'
`Gemma3Attention` keeps the value but does not pass it to the attention function). The
language model of a `gemma3` checkpoint applies no final soft-cap (transformers'
`Gemma3ForConditionalGeneration` does not), so such a config must not set one.
The mappings (`mappings/gemma.toml`, `mappings/gemma2.toml`, `mappings/gemma3.toml`)
differ in which checkpoint norm fills which leaf, and Gemma 3's in its q/k norms and
the wrapper's key prefixes.

Everything else comes from `port.nn`: the (1 + w) norm is `rms_norm(..., plus_one=True)`,
attention is `Attention` (with `scale`, `softcap` and Gemma 3's `qk_norm="head"`), the MLP
is `GatedMLP` with the config's activation, the layer is `Block` (norms `"pre"` for Gemma,
`"sandwich"` for Gemma 2 and 3), and the layers run in `run_layers`, the sliding ones on
`prepare`'s windowed mask and, for Gemma 3, with their own RoPE (`sliding_rope`). The model takes the arguments every port decoder takes (padding masks,
positions, packed `segment_ids`, a `Cache` from `init_cache`, a compute `dtype`, `remat`).

The transformer blocks are stored *stacked*: every array in `Gemma.blocks` has a leading
axis of size `num_hidden_layers`, scanned by `run_layers`. Which layers slide is static
(`GemmaConfig.sliding_layers`). The compute dtype is the parameters' unless the call's
`dtype` says otherwise; RMSNorm and the attention softmax are in float32 either way, as in
transformers.

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
    # without the batch axis, (8,) ids give (8, 256000)

    # Shapes only, no memory allocated (e.g. before loading a checkpoint):
    abstract = eqx.filter_eval_shape(Gemma.from_config, config, key=jax.random.key(0))
    ```
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar, final

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, PRNGKeyArray

from port._errors import ConfigError
from port._text import quoted
from port.nn import (
    Attention,
    Block,
    Decoder,
    GatedMLP,
    Rope,
    Tokens,
    embeddings,
    head,
    read_rope,
    rms_norm,
    run_layers,
    stacked,
)
from port.nn._rope import KINDS
from port.nn.config import (
    MAX_LAYERS,
    MISSING,
    ConfigFields,
    activation,
    check,
    check_model_type,
    get,
    read_kv_heads,
)

MODEL_TYPES = ("gemma", "gemma2", "gemma3_text", "gemma3")
LAYER_TYPES = ("full_attention", "sliding_attention")
SANDWICH = ("gemma2", "gemma3_text")
"""The model types whose blocks norm the attention and MLP outputs too (Gemma 2's block)."""

# transformers' GemmaConfig / Gemma2Config defaults, used where config.json lacks the key.
_DEFAULTS: dict[str, dict[str, Any]] = {
    "gemma": {"num_key_value_heads": 16},
    "gemma2": {
        "num_key_value_heads": 4,
        "query_pre_attn_scalar": 256.0,
        "attn_logit_softcapping": 50.0,
        "final_logit_softcapping": 30.0,
        "sliding_window": 4096,
        "sliding_window_pattern": 2,  # every other layer slides, from the first
    },
    "gemma3_text": {
        # the released configs leave out what the class defaults (gemma-3-27b-it: vocab_size)
        "vocab_size": 262_208,
        "hidden_size": 2304,
        "intermediate_size": 9216,
        "num_hidden_layers": 26,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "query_pre_attn_scalar": 256.0,
        "attn_logit_softcapping": None,
        "final_logit_softcapping": None,
        "sliding_window": 4096,
        "sliding_window_pattern": 6,  # five local layers, then a global one
        "rope_theta": 1_000_000.0,  # the global layers' base (Gemma3TextConfig.default_theta)
        "rope_local_base_freq": 10_000.0,  # the local layers'
    },
}

FIELDS = ConfigFields(
    "port.models.gemma.Gemma",
    read=(
        "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
        "num_key_value_heads", "head_dim", "hidden_act", "hidden_activation", "max_position_embeddings",
        "rms_norm_eps", "tie_word_embeddings", "attention_bias", "rope_parameters", "rope_scaling", "rope_theta",
        "rope_local_base_freq", "query_pre_attn_scalar", "attn_logit_softcapping", "final_logit_softcapping",
        "sliding_window", "layer_types", "sliding_window_pattern",
        "_sliding_window_pattern",  # what transformers derives and writes; it reads `sliding_window_pattern`
        "text_config",  # a gemma3 checkpoint's: the language model's config
    ),
    fixed={"use_bidirectional_attention": (None, False)},  # causal only
    types={
        "gemma3_text": {"use_bidirectional_attention": (False, None)},
        "gemma3": {"use_bidirectional_attention": (False, None)},
    },
)  # fmt: skip
"""The config.json fields `Gemma` reads, and the values it runs of those it does not (for
"gemma3", of its `text_config`)."""


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


def _rope(config: dict, head_dim: int) -> Rope:
    """Gemma's RoPE: plain (`rope_type` "default" only; anything else is a `ConfigError`),
    rotating the whole head.

    transformers' Gemma rotary embedding computes its own default frequencies, which
    ignore `partial_rotary_factor`, so it is dropped here before `read_rope` reads the rest.

    ```python
    _rope({"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}}, 256).theta  # 10000.0
    _rope({"rope_theta": 500.0}, 256).theta                                                 # 500.0
    ```
    """
    config = {k: v for k, v in config.items() if k != "partial_rotary_factor"}
    for key in ("rope_scaling", "rope_parameters"):
        if isinstance(config.get(key), dict):
            config[key] = {k: v for k, v in config[key].items() if k != "partial_rotary_factor"}
    # max_position_embeddings only matters to scaled types, which Gemma has none of.
    return read_rope(config, head_dim, supported=("default",), max_position_embeddings=8192)


def _gemma3_ropes(config: dict, head_dim: int) -> tuple[Rope, Rope]:
    """Gemma 3's global and local RoPE, as Gemma3TextConfig standardises them.

    transformers 5 writes one dict per layer type in `rope_parameters`; transformers 4
    wrote `rope_theta` (global), `rope_local_base_freq` (local) and `rope_scaling`, which
    scales the global layers only. Either way a missing base is the config class's.

    ```python
    glob, local = _gemma3_ropes({"rope_scaling": {"rope_type": "linear", "factor": 8.0}}, 256)
    glob.kind, glob.theta, local.kind, local.theta    # ('linear', 1000000.0, 'default', 10000.0)
    ```
    """
    defaults = _DEFAULTS["gemma3_text"]
    given = config.get("rope_parameters")
    given = given if isinstance(given, dict) else {}
    per_type = {t: dict(given[t]) if isinstance(given.get(t), dict) else {"rope_type": "default"} for t in LAYER_TYPES}
    if isinstance(config.get("rope_scaling"), dict):
        per_type["full_attention"].update(config["rope_scaling"])
    per_type["full_attention"].setdefault("rope_theta", config.get("rope_theta") or defaults["rope_theta"])
    local_theta = config.get("rope_local_base_freq") or defaults["rope_local_base_freq"]
    per_type["sliding_attention"].setdefault("rope_theta", local_theta)
    for settings in per_type.values():
        settings.pop("partial_rotary_factor", None)  # Gemma's rotary embedding rotates the whole head
    length = get(config, "max_position_embeddings", int, 131_072)
    ropes = (
        read_rope(
            {"rope_parameters": per_type}, head_dim, supported=KINDS, max_position_embeddings=length, layer_type=kind
        )
        for kind in ("full_attention", "sliding_attention")
    )
    return next(ropes), next(ropes)


def _sliding_layers(config: dict, layers: int, pattern: int) -> tuple[bool, ...]:
    """Gemma 2 and 3's sliding layers: `layer_types`, else all but every `pattern`-th (as
    Gemma2Config, `pattern` 2, and Gemma3TextConfig, `sliding_window_pattern` or 6).

    ```python
    _sliding_layers({}, 3, 2)                                               # (True, False, True)
    _sliding_layers({"layer_types": ["full_attention"] * 2}, 2, 2)          # (False, False)
    ```
    """
    layer_types = config.get("layer_types")
    if layer_types is None:
        return tuple(bool((i + 1) % pattern) for i in range(layers))
    if (
        not isinstance(layer_types, list)
        or len(layer_types) != layers
        or any(t not in LAYER_TYPES for t in layer_types)
    ):
        raise ConfigError(f"config.json: 'layer_types' must list {layers} of {LAYER_TYPES}, got {quoted(layer_types)}")
    return tuple(t == "sliding_attention" for t in layer_types)


def _hidden_act(config: dict, model_type: str) -> str:
    """The MLP activation as transformers 5 picks it.

    Gemma reads `hidden_act` ("gelu", the legacy value of the released configs, means the
    tanh approximation there); Gemma 2 and 3 read `hidden_activation` and ignore `hidden_act`.
    """
    if model_type in SANDWICH:
        return activation(config, "hidden_activation", "gelu_pytorch_tanh")
    name = activation(config, "hidden_act", "gelu_pytorch_tanh")
    return "gelu_pytorch_tanh" if name == "gelu" else name


@final
@dataclasses.dataclass(frozen=True)
class GemmaConfig:
    """The hyperparameters of a Gemma, Gemma 2 or Gemma 3 model, as read from a config.json.

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
    rope: Rope = Rope(theta=10000.0, rotary_dim=256)  # plain RoPE over the whole head
    model_type: str = "gemma"
    query_pre_attn_scalar: float | None = None  # Gemma 2: scores * this**-0.5 (None: head_dim)
    attn_logit_softcapping: float | None = None  # Gemma 2: cap * tanh(scores / cap)
    final_logit_softcapping: float | None = None  # Gemma 2: cap * tanh(logits / cap)
    sliding_window: int | None = None  # attend to the last `sliding_window` positions...
    sliding_layers: tuple[bool, ...] = ()  # ...in the layers marked True here
    local_rope: Rope | None = None  # Gemma 3: the sliding layers' own RoPE (None: they rotate as the others)

    @classmethod
    def from_hf(cls, config: dict) -> GemmaConfig:
        """Build from a Hugging Face `config.json` dict (a "gemma3" one: its `text_config`);
        raises `ConfigError` if unsupported."""
        model_type = check_model_type(config, MODEL_TYPES, "port.models.gemma", "gemma")
        if model_type == "gemma3":
            text = config.get("text_config")
            if not isinstance(text, dict):
                raise ConfigError(f"config.json: 'text_config' must be a dict, got {quoted(text)}")
            FIELDS.check(text, model_type)
            if text.get("final_logit_softcapping") is not None:
                # Gemma3ForConditionalGeneration's head applies none, Gemma3ForCausalLM's does: a text-only
                # export of this model would compute other logits
                raise ConfigError(
                    f"config.json: text_config.final_logit_softcapping {quoted(text['final_logit_softcapping'])} "
                    "is not supported by port.models.gemma.Gemma for model_type 'gemma3' (its head applies none)"
                )
            return cls.from_hf({**text, "model_type": "gemma3_text"})
        FIELDS.check(config)
        defaults = _DEFAULTS[model_type]
        heads = get(config, "num_attention_heads", int, defaults.get("num_attention_heads", MISSING))
        layers = get(config, "num_hidden_layers", int, defaults.get("num_hidden_layers", MISSING), maximum=MAX_LAYERS)
        kv_heads = read_kv_heads(config, heads, defaults.get("num_key_value_heads"))
        head_dim = get(config, "head_dim", int, 256)  # every config class: 256
        fields = _sandwich_fields(config, model_type, layers) if model_type in SANDWICH else {}
        if model_type == "gemma3_text":
            fields["rope"], fields["local_rope"] = _gemma3_ropes(config, head_dim)
        else:
            fields["rope"] = _rope(config, head_dim)
        return cls(
            vocab_size=get(config, "vocab_size", int, defaults.get("vocab_size", MISSING)),
            hidden_size=get(config, "hidden_size", int, defaults.get("hidden_size", MISSING)),
            intermediate_size=get(config, "intermediate_size", int, defaults.get("intermediate_size", MISSING)),
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=head_dim,
            rms_norm_eps=get(config, "rms_norm_eps", float, 1e-6),
            hidden_act=_hidden_act(config, model_type),
            tie_word_embeddings=get(config, "tie_word_embeddings", bool, True),
            attention_bias=get(config, "attention_bias", bool, False),
            model_type=model_type,
            **fields,
        )

    @property
    def sandwich(self) -> bool:
        """Whether the blocks norm the attention and MLP outputs too (Gemma 2 and 3)."""
        return self.model_type in SANDWICH

    @property
    def qk_norm(self) -> bool:
        """Whether queries and keys are normed per head before RoPE (Gemma 3)."""
        return self.model_type == "gemma3_text"

    @property
    def scaling(self) -> float:
        """What the attention scores are multiplied by: `query_pre_attn_scalar**-0.5` (Gemma 2) or `head_dim**-0.5`."""
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    def block(self, dtype: Any, key: PRNGKeyArray) -> Block:
        """One decoder layer: `(1 + w)` norms before each branch (Gemma), also after it (Gemma 2 and 3)."""
        kattn, kmlp = jax.random.split(key)
        mlp = GatedMLP(
            embd=self.hidden_size, inner=self.intermediate_size, activation=self.hidden_act, dtype=dtype, key=kmlp
        )
        return Block(
            self.attention(dtype, kattn),
            mlp,
            embd=self.hidden_size,
            eps=self.rms_norm_eps,
            dtype=dtype,
            norms="sandwich" if self.sandwich else "pre",
            plus_one=True,
        )

    def attention(self, dtype: Any, key: PRNGKeyArray) -> Attention:
        """One block's attention: GQA with its own `head_dim`, Gemma 2's scale and score soft-cap."""
        return Attention(
            heads=self.num_attention_heads,
            kv_heads=self.num_key_value_heads,
            head_dim=self.head_dim,
            embd=self.hidden_size,
            dtype=dtype,
            key=key,
            qkv_bias=self.attention_bias,
            o_bias=self.attention_bias,
            scale=self.scaling,
            softcap=self.attn_logit_softcapping,
            qk_norm="head" if self.qk_norm else None,
            plus_one=True,
            norm_eps=self.rms_norm_eps,
        )


def _sandwich_fields(config: dict, model_type: str, layers: int) -> dict[str, Any]:
    """Gemma 2 and 3's config values beyond Gemma's: the attention scale, the soft-caps and the window."""
    defaults = _DEFAULTS[model_type]
    window = _optional(config, "sliding_window", int, defaults["sliding_window"])
    pattern = defaults["sliding_window_pattern"]
    if model_type == "gemma3_text":
        pattern = get(config, "sliding_window_pattern", int, pattern)
    return dict(
        query_pre_attn_scalar=get(config, "query_pre_attn_scalar", float, defaults["query_pre_attn_scalar"]),
        # Gemma 3's attention does not pass its `attn_logit_softcapping` on (transformers 5.24): no cap
        attn_logit_softcapping=None
        if model_type == "gemma3_text"
        else _optional(config, "attn_logit_softcapping", float, defaults["attn_logit_softcapping"]),
        final_logit_softcapping=_optional(
            config, "final_logit_softcapping", float, defaults["final_logit_softcapping"]
        ),
        sliding_window=window,
        sliding_layers=_sliding_layers(config, layers, pattern) if window else (False,) * layers,
    )


@final
class Gemma(Decoder):
    """Gemma / Gemma 2 / Gemma 3 causal LM. Arrays in `blocks` are stacked over layers.

    Called as every `port.nn.Decoder`: `model(input_ids, *, attention_mask=None, positions=None,
    segment_ids=None, cache=None, dtype=None, remat=None)`.
    """

    embed: Float[Array, "vocab embed"]
    blocks: Block
    norm: Float[Array, " embed"]
    lm_head: Float[Array, "vocab embed"] | None  # None: tied to `embed` (the default)
    config: GemmaConfig = eqx.field(static=True)
    FIELDS: ClassVar[ConfigFields] = FIELDS

    def __init__(self, config: GemmaConfig, *, key: PRNGKeyArray, dtype: Any = jnp.float32):
        kembed, kblocks = jax.random.split(key)
        self.embed, self.lm_head = embeddings(
            kembed, vocab=config.vocab_size, embd=config.hidden_size, dtype=dtype, tied=config.tie_word_embeddings
        )
        self.blocks = stacked(lambda k: config.block(dtype, k), kblocks, config.num_hidden_layers)
        self.norm = jnp.zeros((config.hidden_size,), dtype)  # (1 + 0): the identity scale
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

    def logits(self, tokens: Tokens, remat: Any) -> tuple[Array, tuple[Array | None, Array | None]]:
        """Scaled embeddings, the stacked blocks, the (1 + w) final norm, the head and its soft-cap."""
        c = self.config
        x = self.embed[tokens.ids]
        # transformers holds sqrt(hidden_size) in float32 and rounds it to the weights' dtype.
        x = x * jnp.asarray(np.float32(c.hidden_size**0.5), dtype=x.dtype)
        cos, sin = c.rope.angles(tokens.positions, x.dtype)
        local = None if c.local_rope is None else c.local_rope.angles(tokens.positions, x.dtype)
        x, kv = run_layers(
            self.blocks, x, tokens, cos=cos, sin=sin, sliding=c.sliding_layers, sliding_rope=local, remat=remat
        )
        logits = head(rms_norm(x, self.norm, c.rms_norm_eps, plus_one=True), self.embed, self.lm_head)
        cap = c.final_logit_softcapping
        if cap is not None:  # cap * tanh(logits / cap), in the logits' dtype, as transformers
            logits = jnp.tanh(logits / cap) * cap
        return logits, kv
