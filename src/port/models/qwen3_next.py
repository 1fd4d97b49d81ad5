"""Qwen3-Next and the language model of Qwen3.5 / Qwen3.5-MoE: hybrid linear and full attention.

Each layer is a Gated DeltaNet linear-attention layer (`port.nn.GatedDeltaNet`) or a
gated full-attention layer, as config.json's `layer_types` says ("linear_attention" /
"full_attention"; by default three linear to one full). The two kinds are stacked apart
(`Qwen3Next.linear`, `Qwen3Next.full`, the model's `layer_groups`) and run in checkpoint
order by `port.nn.run_groups`. What is new in the family:

- full attention: `q_proj` emits each head's query and an output gate (`Attention(gate=True)`),
  per-head q/k RMSNorm in the `(1 + w)` form, partial rotary (`partial_rotary_factor`,
  0.25 by default);
- every RMSNorm but the DeltaNet's gated one is `(1 + w)`;
- the feed-forward: Qwen3-Next and Qwen3.5-MoE, a routed MoE (softmax, top-k renormalised
  when `norm_topk_prob`, weights in the activations' dtype) with a sigmoid-gated shared
  expert; Qwen3.5, a SwiGLU MLP.

Qwen3.5's released checkpoints are vision-language models: the language model's config is
config.json's `text_config` and its keys are under `model.language_model.` (the
mappings say so); those saved from the text-only classes (`Qwen3_5ForCausalLM`,
`Qwen3_5MoeForCausalLM`: model types `qwen3_5_text`, `qwen3_5_moe_text`) have the same
fields at the top of config.json and their keys under `model.`. The cache holds keys and values of the full layers and, for the
linear ones, `states["linear"]` = (conv inputs, recurrent state) with a leading layer
axis. Packed `segment_ids` are refused (the recurrence would cross segments).

Example:
    ```python
    import jax
    import jax.numpy as jnp
    from port.models.qwen3_next import Qwen3Next

    config = {"model_type": "qwen3_next", "vocab_size": 100, "hidden_size": 64,
              "intermediate_size": 96, "num_hidden_layers": 4, "num_attention_heads": 4,
              "num_key_value_heads": 2, "head_dim": 16, "linear_num_key_heads": 2,
              "linear_num_value_heads": 4, "linear_key_head_dim": 16, "linear_value_head_dim": 16,
              "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
              "shared_expert_intermediate_size": 32}
    model = Qwen3Next.from_config(config, key=jax.random.key(0))
    model.layer_groups                       # {'linear': (0, 1, 2), 'full': (3,)}
    logits = model(jnp.zeros((1, 8), jnp.int32))   # (1, 8, 100)
    ```
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar, final

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, PRNGKeyArray

from port._errors import ConfigError
from port._text import quoted
from port.nn import (
    Attention,
    Block,
    Cache,
    Decoder,
    GatedMLP,
    MoE,
    Rope,
    Tokens,
    embeddings,
    head,
    read_rope,
    rms_norm,
    run_groups,
    stacked,
)
from port.nn._deltanet import GatedDeltaNet, State
from port.nn.config import (
    MAX_LAYERS,
    ConfigFields,
    activation,
    check_model_type,
    get,
    read_kv_heads,
)

MODEL_TYPES = ("qwen3_next", "qwen3_5", "qwen3_5_moe", "qwen3_5_text", "qwen3_5_moe_text")
# The text-only classes' model types, and the model (wrapper) whose language model they are.
TEXT_ONLY = {"qwen3_5_text": "qwen3_5", "qwen3_5_moe_text": "qwen3_5_moe"}
KINDS = {"linear_attention": "linear", "full_attention": "full"}

# transformers' config class defaults (Qwen3NextConfig, Qwen3_5TextConfig, Qwen3_5MoeTextConfig).
_DEFAULTS: dict[str, Any] = {
    "hidden_act": "silu",
    "max_position_embeddings": 32768,
    "rms_norm_eps": 1e-6,
    "head_dim": 256,
    "linear_conv_kernel_dim": 4,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "linear_num_key_heads": 16,
    "linear_num_value_heads": 32,
    "num_key_value_heads": 2,
    "moe_intermediate_size": 512,
    "shared_expert_intermediate_size": 512,
    "attention_bias": False,
    "partial_rotary_factor": 0.25,
    "decoder_sparse_step": 1,
}
_EXPERTS = {"qwen3_next": (512, 10), "qwen3_5_moe": (256, 8)}  # num_experts, num_experts_per_tok


@final
@dataclasses.dataclass(frozen=True)
class Qwen3NextConfig:
    """The hyperparameters of a Qwen3-Next / Qwen3.5 language model, read from config.json.

    `kinds` is each layer's kind ("linear" / "full"). The `linear_*_dim` fields are
    derived sizes the mappings name (`linear_key_dim` = key heads x key head size,
    `linear_group_value_dim` = the value size per key head).

    ```python
    c = Qwen3NextConfig.from_hf(config)      # the config.json dict
    c.kinds                                  # ('linear', 'linear', 'linear', 'full', ...)
    ```
    """

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int | None
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    tie_word_embeddings: bool
    attention_bias: bool
    rope: Rope
    kinds: tuple[str, ...]
    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_conv_kernel_dim: int
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    norm_topk_prob: bool = True
    # Derived sizes, named by the mappings:
    linear_key_dim: int = 0  # linear_num_key_heads * linear_key_head_dim
    linear_value_dim: int = 0  # linear_num_value_heads * linear_value_head_dim
    linear_group_value_dim: int = 0  # the value size per key head (Qwen3-Next's fused in_proj_qkvz)
    linear_group_heads: int = 0  # value heads per key head

    @classmethod
    def from_hf(cls, config: dict) -> Qwen3NextConfig:
        """Build from a Hugging Face `config.json` dict (Qwen3.5's: its `text_config`); `ConfigError` if unsupported."""
        model_type = check_model_type(config, MODEL_TYPES, "port.models.qwen3_next")
        text = config
        if model_type in TEXT_ONLY:
            model_type = TEXT_ONLY[model_type]
        elif model_type != "qwen3_next":
            text = config.get("text_config")
            if not isinstance(text, dict):
                raise ConfigError(f"config.json: 'text_config' must be a dict, got {quoted(text)}")
            text = {"tie_word_embeddings": config.get("tie_word_embeddings", False), **text}
        Qwen3Next.FIELDS.check(text, model_type)
        c = {**_DEFAULTS, **{k: v for k, v in text.items() if v is not None}}
        activation(c, "hidden_act", "silu", supported=("silu", "swish"))
        heads = get(c, "num_attention_heads", int)
        layers = get(c, "num_hidden_layers", int, maximum=MAX_LAYERS)
        head_dim = get(c, "head_dim", int)
        key_heads, value_heads = get(c, "linear_num_key_heads", int), get(c, "linear_num_value_heads", int)
        if value_heads % key_heads:
            raise ConfigError(
                f"config.json: 'linear_num_value_heads' ({value_heads}) must be a multiple of "
                f"'linear_num_key_heads' ({key_heads})"
            )
        moe = {}
        if model_type != "qwen3_5":
            moe = _moe(c, model_type, layers)
        return cls(
            model_type=model_type,
            vocab_size=get(c, "vocab_size", int),
            hidden_size=get(c, "hidden_size", int),
            intermediate_size=get(c, "intermediate_size", int) if model_type == "qwen3_5" else None,
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=read_kv_heads(c, heads, 2),
            head_dim=head_dim,
            rms_norm_eps=get(c, "rms_norm_eps", float),
            tie_word_embeddings=get(c, "tie_word_embeddings", bool, False),
            attention_bias=get(c, "attention_bias", bool),
            rope=read_rope(
                c,
                head_dim,
                supported=("default", "linear", "yarn"),
                max_position_embeddings=get(c, "max_position_embeddings", int),
                allow_partial=True,
            ),
            kinds=_kinds(c, layers),
            linear_num_key_heads=key_heads,
            linear_num_value_heads=value_heads,
            linear_key_head_dim=get(c, "linear_key_head_dim", int),
            linear_value_head_dim=get(c, "linear_value_head_dim", int),
            linear_conv_kernel_dim=get(c, "linear_conv_kernel_dim", int),
            linear_key_dim=key_heads * get(c, "linear_key_head_dim", int),
            linear_value_dim=value_heads * get(c, "linear_value_head_dim", int),
            linear_group_value_dim=value_heads // key_heads * get(c, "linear_value_head_dim", int),
            linear_group_heads=value_heads // key_heads,
            **moe,
        )

    def mlp(self, dtype: Any, key: PRNGKeyArray) -> MoE | GatedMLP:
        """One layer's feed-forward: the routed MoE with its gated shared expert, or (Qwen3.5) SwiGLU."""
        if self.model_type == "qwen3_5":
            assert self.intermediate_size is not None, "from_hf reads intermediate_size for qwen3_5"
            return GatedMLP(
                embd=self.hidden_size, inner=self.intermediate_size, activation="silu", dtype=dtype, key=key
            )
        return MoE(
            embd=self.hidden_size,
            inner=self.moe_intermediate_size,
            experts=self.num_experts,
            top_k=self.num_experts_per_tok,
            activation="silu",
            dtype=dtype,
            key=key,
            scoring="softmax",
            renormalise=self.norm_topk_prob,
            shared_inner=self.shared_expert_intermediate_size,
            shared_gate=True,
            weights_in_input_dtype=True,
        )


def _kinds(config: dict, layers: int) -> tuple[str, ...]:
    """Each layer's kind from `layer_types` (else transformers' default: every 4th layer full)."""
    types = config.get("layer_types")
    if types is None:
        interval = get(config, "full_attention_interval", int, 4)
        return tuple("linear" if (i + 1) % interval else "full" for i in range(layers))
    if not isinstance(types, list) or len(types) != layers or any(t not in KINDS for t in types):
        raise ConfigError(
            f"config.json: 'layer_types' must list {layers} (num_hidden_layers) of {tuple(KINDS)}, got {quoted(types)}"
        )
    return tuple(KINDS[t] for t in types)


def _moe(config: dict, model_type: str, layers: int) -> dict[str, Any]:
    """The routed experts' sizes; refuses dense (`mlp_only_layers`, `decoder_sparse_step`) layers."""
    experts, top_k = _EXPERTS[model_type]
    config = {"num_experts": experts, "num_experts_per_tok": top_k, **config}
    moe = dict(
        num_experts=get(config, "num_experts", int),
        num_experts_per_tok=get(config, "num_experts_per_tok", int),
        moe_intermediate_size=get(config, "moe_intermediate_size", int),
        shared_expert_intermediate_size=get(config, "shared_expert_intermediate_size", int),
        norm_topk_prob=get(config, "norm_topk_prob", bool, True) if model_type == "qwen3_next" else True,
    )
    if moe["num_experts_per_tok"] > moe["num_experts"]:
        raise ConfigError(
            f"config.json: 'num_experts_per_tok' ({moe['num_experts_per_tok']}) is more than "
            f"'num_experts' ({moe['num_experts']})"
        )
    only = config.get("mlp_only_layers") or []
    step = get(config, "decoder_sparse_step", int)
    dense = sorted(
        {i for i in only if isinstance(i, int) and 0 <= i < layers} | {i for i in range(layers) if (i + 1) % step}
    )
    if dense:
        raise ConfigError(
            f"config.json: 'mlp_only_layers' / 'decoder_sparse_step' give layers {dense} a dense MLP: "
            "port.models.qwen3_next needs a sparse MoE MLP in every layer"
        )
    return moe


def _valid(mask: Bool[Array, "batch seq keys"], index: Array | None) -> Bool[Array, "batch seq"]:
    """Whether each query is a real token: it sees its own slot (padding sees no key)."""
    seq = mask.shape[1]
    own = mask if index is None else jax.lax.dynamic_slice_in_dim(mask, index, seq, axis=2)
    return jnp.diagonal(own, axis1=1, axis2=2)


@final
class LinearBlock(eqx.Module):
    """A Gated DeltaNet layer, then the feed-forward; `(1 + w)` RMSNorms before each."""

    attn_norm: Float[Array, " embed"]
    attn: GatedDeltaNet
    mlp_norm: Float[Array, " embed"]
    mlp: MoE | GatedMLP
    eps: float = eqx.field(static=True)

    def __init__(self, c: Qwen3NextConfig, dtype: Any, *, key: PRNGKeyArray):
        kattn, kmlp = jax.random.split(key)
        self.attn_norm = jnp.zeros((c.hidden_size,), dtype)
        self.attn = GatedDeltaNet(
            embd=c.hidden_size,
            key_heads=c.linear_num_key_heads,
            value_heads=c.linear_num_value_heads,
            key_dim=c.linear_key_head_dim,
            value_dim=c.linear_value_head_dim,
            kernel=c.linear_conv_kernel_dim,
            dtype=dtype,
            key=kattn,
            eps=c.rms_norm_eps,
        )
        self.mlp_norm = jnp.zeros((c.hidden_size,), dtype)
        self.mlp = c.mlp(dtype, kmlp)
        self.eps = c.rms_norm_eps

    def __call__(
        self,
        x: Float[Array, "batch seq embed"],
        mask: Bool[Array, "batch seq keys"],
        *,
        cos: Array,
        sin: Array,
        kv: State | None,
        index: Array | None,
        layer: Array,
    ) -> tuple[Float[Array, "batch seq embed"], State | None]:
        h, kv = self.attn(rms_norm(x, self.attn_norm, self.eps, plus_one=True), _valid(mask, index), state=kv)
        x = x + h
        return x + self.mlp(rms_norm(x, self.mlp_norm, self.eps, plus_one=True)), kv


def full_block(c: Qwen3NextConfig, dtype: Any, *, key: PRNGKeyArray) -> Block:
    """Gated full attention (per-head `(1 + w)` q/k norms, partial RoPE), then the feed-forward."""
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
        qk_norm="head",
        plus_one=True,
        norm_eps=c.rms_norm_eps,
        gate=True,
    )
    return Block(attn, c.mlp(dtype, kmlp), embd=c.hidden_size, eps=c.rms_norm_eps, dtype=dtype, plus_one=True)


@final
class Qwen3Next(Decoder):
    """Qwen3-Next / Qwen3.5 causal LM: linear and full attention layers stacked apart.

    Called as every `port.nn.Decoder` (`segment_ids` excepted: a `ValueError`).
    `linear` / `full` hold the layers of each kind (None when there are none), in the
    order `layer_groups` gives; `init_cache` makes the hybrid cache.

    ```python
    model = Qwen3Next.from_config(config, key=jax.random.key(0))
    logits, cache = model(ids, cache=model.init_cache(batch=1, length=32))
    ```
    """

    FIELDS: ClassVar[ConfigFields] = ConfigFields(
        "port.models.qwen3_next.Qwen3Next",
        read=(
            "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads", "head_dim", "hidden_act", "max_position_embeddings", "rms_norm_eps",
            "tie_word_embeddings", "rope_parameters", "rope_scaling", "rope_theta", "partial_rotary_factor",
            "attention_bias", "layer_types", "full_attention_interval", "linear_conv_kernel_dim",
            "linear_key_head_dim", "linear_value_head_dim", "linear_num_key_heads", "linear_num_value_heads",
            "num_experts", "num_experts_per_tok", "moe_intermediate_size", "shared_expert_intermediate_size",
            "norm_topk_prob", "decoder_sparse_step", "mlp_only_layers",
        ),
    )  # fmt: skip

    embed: Float[Array, "vocab embed"]
    linear: LinearBlock | None
    full: Block | None
    norm: Float[Array, " embed"]
    lm_head: Float[Array, "vocab embed"] | None
    config: Qwen3NextConfig = eqx.field(static=True)

    def __init__(self, config: Qwen3NextConfig, *, key: PRNGKeyArray, dtype: Any = jnp.float32):
        kembed, klinear, kfull = jax.random.split(key, 3)
        self.embed, self.lm_head = embeddings(
            kembed, vocab=config.vocab_size, embd=config.hidden_size, dtype=dtype, tied=config.tie_word_embeddings
        )
        groups = _groups(config.kinds)
        self.linear = (
            stacked(lambda k: LinearBlock(config, dtype, key=k), klinear, len(groups["linear"]))
            if groups["linear"]
            else None
        )
        self.full = (
            stacked(lambda k: full_block(config, dtype, key=k), kfull, len(groups["full"])) if groups["full"] else None
        )
        self.norm = jnp.zeros((config.hidden_size,), dtype)
        self.config = config

    @classmethod
    def from_config(cls, config: dict, *, key: PRNGKeyArray, dtype: Any = jnp.float32) -> Qwen3Next:
        """Randomly initialise from a Hugging Face `config.json` dict (qwen3_next, qwen3_5, qwen3_5_moe)."""
        return cls(Qwen3NextConfig.from_hf(config), key=key, dtype=dtype)

    @property
    def layer_groups(self) -> dict[str, tuple[int, ...]]:
        """`{"linear": checkpoint layers, "full": checkpoint layers}`, as `port.plan` reads them."""
        return _groups(self.config.kinds)

    def init_cache(self, batch: int, length: int, dtype: Any = None) -> Cache:
        """An empty hybrid cache: keys/values `{"full": [layers, batch, length, kv_heads, head_dim]}`,
        states `{"linear": (conv inputs, recurrent state)}` with a leading layer axis."""
        c = self.config
        if dtype is None:
            dtype = self.embed.dtype
        groups = _groups(c.kinds)
        kv = jnp.zeros((len(groups["full"]), batch, length, c.num_key_value_heads, c.head_dim), dtype)
        keys, values, states = {}, {}, {}
        if groups["full"]:
            keys["full"], values["full"] = kv, kv
        if groups["linear"]:
            one = eqx.combine(
                jax.tree.map(lambda a: a[0], eqx.filter(self.linear, eqx.is_array)),
                eqx.partition(self.linear, eqx.is_array)[1],
            )
            states["linear"] = jax.tree.map(
                lambda a: jnp.zeros((len(groups["linear"]), *a.shape), a.dtype), one.attn.empty_state(batch, dtype)
            )
        return Cache.of(keys, values, states, batch=batch, length=length)

    def __call__(self, input_ids: Any, *, segment_ids: Any = None, **kwargs: Any) -> Any:
        if segment_ids is not None and "linear" in self.config.kinds:
            raise ValueError(
                "`segment_ids` is not supported by Qwen3-Next / Qwen3.5: the linear-attention "
                "recurrence would carry state across packed segments"
            )
        return super().__call__(input_ids, segment_ids=segment_ids, **kwargs)

    def logits(self, tokens: Tokens, remat: Any) -> tuple[Array, tuple[Any, Any, Any]]:
        """Embed, the layers in checkpoint order (`run_groups`), the final `(1 + w)` norm and the head."""
        c = self.config
        x = self.embed[tokens.ids]
        cos, sin = c.rope.angles(tokens.positions, x.dtype)
        x, cache = run_groups(
            {"linear": self.linear, "full": self.full}, c.kinds, x, tokens, cos=cos, sin=sin, remat=remat
        )
        return head(rms_norm(x, self.norm, c.rms_norm_eps, plus_one=True), self.embed, self.lm_head), cache


def _groups(kinds: tuple[str, ...]) -> dict[str, tuple[int, ...]]:
    return {kind: tuple(i for i, k in enumerate(kinds) if k == kind) for kind in ("linear", "full")}
