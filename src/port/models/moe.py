"""Mixtral, Qwen2-MoE, Qwen3-MoE and MiniMax-M2: port's Llama blocks with a routed mixture of experts.

Only what is new in these families lives here: reading their config.json (`read_config`)
into a `LlamaConfig` (attention, norms, RoPE and the dense layers' MLP, as Llama's) and a
`MoeConfig` (the experts) beside it, composed, not subclassed; `MoeConfig.mlp` builds each
sparse block's feed-forward as a `port.nn.MoE`, and `port.models.llama.block` the block
around it. Its router picks the top `num_experts_per_tok` experts of each token and only
those run, as grouped matmuls over the (token, expert) pairs sorted by expert: the cost
follows top-k, not the expert count. The experts are stacked on an axis after the layers' (`blocks.mlp.experts.gate`
is [layers, experts, intermediate, embed]). Layers with a dense MLP among the sparse
ones (`mlp_only_layers`, `decoder_sparse_step` > 1) are stacked apart, in `dense`, and
the model's `layer_groups` says which checkpoint layers each stack holds. Four
`model_type`s:

- "mixtral": softmax routing, the top-k weights renormalised to sum to 1 and kept
  float32 when weighting the experts' outputs (as transformers); no attention biases; an
  optional sliding window on every layer.
- "qwen2_moe": renormalised only when `norm_topk_prob`, the weights cast to the
  activations' dtype; q/k/v biases (`qkv_bias`); a shared expert (a SwiGLU MLP of
  `shared_expert_intermediate_size`) added to every token, scaled by
  `sigmoid(shared_expert_gate . x)`.
- "qwen3_moe": Qwen3's attention (per-head q/k RMSNorm, `attention_bias`), the sliding
  window on every layer when `use_sliding_window`; Qwen2-MoE's routing without a shared
  expert.
- "minimax_m2" (MiniMax-M2, M2.1): Mixtral's experts and keys with a sigmoid router whose
  `e_score_correction_bias` (the MoE's `selection_bias`) is added to choose the top k, not
  to weight them, the chosen scores renormalised; q/k RMSNorm over the whole projection
  (OLMo 2's, before RoPE, without its float32 scale); RoPE on the first `rotary_dim`
  dimensions of each head (`partial_rotary_factor`, which wins, else the legacy
  `rotary_dim` / `head_dim`, as transformers reads them). The Hub's config.json fields that
  transformers does not read (`use_qk_norm`, `qk_norm_type`, `scoring_func`,
  `use_routing_bias`, `shared_intermediate_size`, `attn_type_list`) are held to what it runs.

Example:
    ```python
    import equinox as eqx
    import jax
    import jax.numpy as jnp
    from port.models.moe import Moe

    config = {"model_type": "mixtral", "vocab_size": 32000, "hidden_size": 4096,
              "intermediate_size": 14336, "num_hidden_layers": 32,
              "num_attention_heads": 32, "num_key_value_heads": 8,
              "num_local_experts": 8, "num_experts_per_tok": 2}
    # Shapes only, no memory allocated (e.g. before loading a checkpoint):
    abstract = eqx.filter_eval_shape(Moe.from_config, config, key=jax.random.key(0))
    # abstract.blocks.mlp.experts.gate.shape == (32, 8, 14336, 4096)
    llama, moe = read_config(config)   # LlamaConfig (attention, norms, RoPE) and MoeConfig (experts)

    small = {**config, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
             "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 100}
    model = Moe.from_config(small, key=jax.random.key(0))
    logits = eqx.filter_jit(model)(jnp.zeros((1, 8), dtype=jnp.int32))  # (1, 8, 100)
    ```
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, ClassVar, final

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, PRNGKeyArray

from port._errors import ConfigError
from port._text import quoted
from port.models.llama import ROPE_TYPES, LlamaConfig, block
from port.nn import Block, Decoder, MoE, Tokens, embeddings, head, read_rope, rms_norm, run_groups, stacked
from port.nn._rope import rope_parameters
from port.nn.config import MAX_LAYERS, ConfigFields, check, check_model_type, get

MODEL_TYPES = ("mixtral", "qwen2_moe", "qwen3_moe", "minimax_m2")

# transformers' config class defaults, used where config.json omits a key (as port's Llama,
# a null num_key_value_heads means one kv head per query head).
_MIXTRAL_DEFAULTS: dict[str, Any] = {
    "num_local_experts": 8,
    "num_experts_per_tok": 2,
    "rms_norm_eps": 1e-5,
    "rope_theta": 1e6,
    "sliding_window": None,
}
_QWEN3_MOE_DEFAULTS: dict[str, Any] = {
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "moe_intermediate_size": 768,
    "norm_topk_prob": False,
    "decoder_sparse_step": 1,
    "num_key_value_heads": 4,
    "use_sliding_window": False,
    "sliding_window": 4096,
    "attention_bias": False,
}
_QWEN2_MOE_DEFAULTS: dict[str, Any] = {
    "num_experts": 60,
    "num_experts_per_tok": 4,
    "moe_intermediate_size": 1408,
    "shared_expert_intermediate_size": 5632,
    "norm_topk_prob": False,
    "qkv_bias": True,
    "decoder_sparse_step": 1,
    "num_key_value_heads": 16,
    "max_window_layers": 28,
}
_MINIMAX_M2_DEFAULTS: dict[str, Any] = {
    "num_local_experts": 256,
    "num_experts_per_tok": 8,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "max_position_embeddings": 196608,
    "rms_norm_eps": 1e-6,
    "rope_theta": 5000000.0,
}


@final
@dataclasses.dataclass(frozen=True)
class MoeConfig:
    """The mixture of experts of a Mixtral / Qwen2-MoE / Qwen3-MoE model: what its
    `LlamaConfig` (attention, norms, RoPE, the dense layers' MLP) does not hold.

    `moe_intermediate_size` is each routed expert's hidden size; `shared_intermediate_size`
    the shared expert's, or None without one. `scoring`: the router's "softmax" or
    "sigmoid" (MiniMax-M2); `selection_bias`: whether a learned bias is added to the scores
    to choose the experts (MiniMax-M2's `e_score_correction_bias`). `weights_in_input_dtype`: the top-k weights
    are cast to the activations' dtype before weighting (Qwen2-MoE) rather than kept
    float32 (Mixtral); the same in float32. `sparse_layers`: per layer, whether its MLP
    is the mixture of experts (True) or the `LlamaConfig`'s dense SwiGLU.

    ```python
    llama, moe = read_config({"model_type": "qwen2_moe", "vocab_size": 101, "hidden_size": 48,
                              "intermediate_size": 56, "num_hidden_layers": 2,
                              "num_attention_heads": 6, "num_key_value_heads": 2, "num_experts": 6})
    moe.num_experts, moe.num_experts_per_tok, moe.shared_intermediate_size   # (6, 4, 5632)
    moe.kinds                                                                 # ("blocks", "blocks")
    ```
    """

    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    norm_topk_prob: bool
    shared_intermediate_size: int | None
    weights_in_input_dtype: bool
    sparse_layers: tuple[bool, ...]
    scoring: str = "softmax"
    selection_bias: bool = False

    @property
    def kinds(self) -> tuple[str, ...]:
        """Each layer's stack in `Moe`: "blocks" (mixture of experts) or "dense"."""
        return tuple("blocks" if s else "dense" for s in self.sparse_layers)

    def mlp(self, llama: LlamaConfig, dtype: Any, key: PRNGKeyArray) -> MoE:
        """The feed-forward of one sparse block: a `port.nn.MoE` routed as transformers routes it.

        **Arguments:** `llama` (the model's `LlamaConfig`: the hidden size and activation),
        `dtype` (of the parameters), `key` (their initialisation).

        ```python
        llama, moe = read_config(config)
        y = moe.mlp(llama, jnp.float32, jax.random.key(0))(x)   # x: [..., hidden_size]
        ```
        """
        return MoE(
            embd=llama.hidden_size,
            inner=self.moe_intermediate_size,
            experts=self.num_experts,
            top_k=self.num_experts_per_tok,
            activation=llama.hidden_act,
            dtype=dtype,
            key=key,
            scoring=self.scoring,
            selection_bias=self.selection_bias,
            renormalise=self.norm_topk_prob,
            shared_inner=self.shared_intermediate_size,
            shared_gate=self.shared_intermediate_size is not None,
            weights_in_input_dtype=self.weights_in_input_dtype,
        )


def read_config(config: dict) -> tuple[LlamaConfig, MoeConfig]:
    """A Hugging Face `config.json` dict (model_type mixtral, qwen2_moe, qwen3_moe or minimax_m2) read into
    its attention side and its experts; raises `ConfigError` if unsupported.

    **Arguments:** `config`, the config.json dict.

    **Returns:** `(llama, moe)`: the `LlamaConfig` of the attention, norms, RoPE and dense
    MLPs (transformers' defaults of the MoE family's config class where keys are absent),
    and the `MoeConfig`.

    ```python
    llama, moe = read_config({**mixtral_config, "num_local_experts": 8})
    llama.rms_norm_eps, moe.num_experts      # (1e-05, 8)
    ```
    """
    model_type = check_model_type(config, MODEL_TYPES, "port.models.moe")
    Moe.FIELDS.check(config)
    read = {"mixtral": _mixtral, "qwen2_moe": _qwen2_moe, "qwen3_moe": _qwen3_moe, "minimax_m2": _minimax_m2}
    llama, moe = read[model_type](config)
    if moe.num_experts_per_tok > moe.num_experts:
        key = "num_local_experts" if model_type in ("mixtral", "minimax_m2") else "num_experts"
        raise ConfigError(
            f"config.json: 'num_experts_per_tok' ({moe.num_experts_per_tok}) is more than {key!r} ({moe.num_experts})"
        )
    return dataclasses.replace(llama, model_type=model_type), moe


def _with_defaults(config: dict, defaults: dict[str, Any]) -> dict:
    """`config` with `defaults` for the keys it lacks."""
    return {**defaults, **config}


def _mixtral(config: dict) -> tuple[LlamaConfig, MoeConfig]:
    """Mixtral's attention is Mistral's (no biases, an optional sliding window on every layer)."""
    filled = _with_defaults(config, _MIXTRAL_DEFAULTS)  # no window unless given (Mistral: 4096)
    attention = LlamaConfig.from_hf({**filled, "model_type": "mistral"})
    moe = MoeConfig(
        num_experts=get(filled, "num_local_experts", int),
        num_experts_per_tok=get(filled, "num_experts_per_tok", int),
        moe_intermediate_size=attention.intermediate_size,
        norm_topk_prob=True,
        shared_intermediate_size=None,
        weights_in_input_dtype=False,
        sparse_layers=(True,) * attention.num_hidden_layers,
    )
    return attention, moe


def _minimax_m2(config: dict) -> tuple[LlamaConfig, MoeConfig]:
    """MiniMax-M2: Mixtral's attention and experts, q/k norms over the projection, partial RoPE,
    a sigmoid router with a selection bias."""
    filled = _with_defaults(config, _MINIMAX_M2_DEFAULTS)
    if filled.get("sliding_window") is not None:  # transformers' MiniMaxM2 attends to every position
        raise ConfigError(
            f"config.json: sliding_window {quoted(filled['sliding_window'])} is not supported by "
            "port.models.moe.Moe for minimax_m2 (supported: null)"
        )
    kinds = filled.get("attn_type_list")
    if kinds is not None and (not isinstance(kinds, list) or any(k != 1 or isinstance(k, bool) for k in kinds)):
        raise ConfigError(
            f"config.json: 'attn_type_list' must list only 1 (softmax attention: port.models.moe.Moe runs no "
            f"linear attention), got {quoted(kinds)}"
        )
    key, rope = rope_parameters(filled, default_theta=_MINIMAX_M2_DEFAULTS["rope_theta"])
    full = LlamaConfig.from_hf(
        {**filled, "model_type": "mistral", "sliding_window": None, key: {**rope, "partial_rotary_factor": 1.0}}
    )
    if filled.get("partial_rotary_factor") is None and filled.get("rotary_dim") is not None:
        # transformers' MiniMaxM2Config: the legacy `rotary_dim` below both partial_rotary_factors
        filled["partial_rotary_factor"] = check("rotary_dim", filled["rotary_dim"], int) / full.head_dim
    partial = read_rope(
        filled,
        full.head_dim,
        supported=ROPE_TYPES,
        max_position_embeddings=get(filled, "max_position_embeddings", int),
        allow_partial=True,
        default_theta=_MINIMAX_M2_DEFAULTS["rope_theta"],
    )
    attention = dataclasses.replace(full, qk_norm="projection", rope=partial)
    moe = MoeConfig(
        num_experts=get(filled, "num_local_experts", int),
        num_experts_per_tok=get(filled, "num_experts_per_tok", int),
        moe_intermediate_size=attention.intermediate_size,
        norm_topk_prob=True,
        shared_intermediate_size=None,
        weights_in_input_dtype=False,
        sparse_layers=(True,) * attention.num_hidden_layers,
        scoring="sigmoid",
        selection_bias=True,
    )
    return attention, moe


def _qwen2_moe(config: dict) -> tuple[LlamaConfig, MoeConfig]:
    """Qwen2-MoE's attention is Qwen2's, with q/k/v biases as `qkv_bias` says."""
    filled = _with_defaults(config, _QWEN2_MOE_DEFAULTS)
    layers = get(filled, "num_hidden_layers", int, maximum=MAX_LAYERS)
    if get(filled, "use_sliding_window", bool, False) and filled.get("layer_types") is None:
        # Qwen2MoeConfig: every other layer (0, 2, ...) below max_window_layers slides.
        first = filled["max_window_layers"]
        if not isinstance(first, int) or isinstance(first, bool) or first < 0:
            raise ConfigError(f"config.json: 'max_window_layers' must be a non-negative integer, got {quoted(first)}")
        filled["layer_types"] = [
            "sliding_attention" if i % 2 == 0 and i < first else "full_attention" for i in range(layers)
        ]
    attention = LlamaConfig.from_hf({**filled, "model_type": "qwen2"})
    attention = dataclasses.replace(attention, qkv_bias=get(filled, "qkv_bias", bool))
    moe = MoeConfig(
        sparse_layers=_sparse_layers(filled, layers),
        num_experts=get(filled, "num_experts", int),
        num_experts_per_tok=get(filled, "num_experts_per_tok", int),
        moe_intermediate_size=get(filled, "moe_intermediate_size", int),
        norm_topk_prob=get(filled, "norm_topk_prob", bool),
        shared_intermediate_size=get(filled, "shared_expert_intermediate_size", int),
        weights_in_input_dtype=True,
    )
    return attention, moe


def _qwen3_moe(config: dict) -> tuple[LlamaConfig, MoeConfig]:
    """Qwen3-MoE's attention is Qwen3's; its window, when `use_sliding_window`, covers every layer."""
    filled = _with_defaults(config, _QWEN3_MOE_DEFAULTS)
    if "num_local_experts" in config:  # transformers 5 saves `num_experts` under this name
        filled["num_experts"] = config["num_local_experts"]
    layers = get(filled, "num_hidden_layers", int, maximum=MAX_LAYERS)
    hidden, heads = get(filled, "hidden_size", int), get(filled, "num_attention_heads", int)
    head_dim = filled.get("head_dim") or hidden // max(heads, 1)
    attention = LlamaConfig.from_hf(
        {**filled, "model_type": "qwen3", "use_sliding_window": False, "head_dim": head_dim}
    )
    if get(filled, "use_sliding_window", bool) and filled.get("sliding_window") is not None:
        window = get(filled, "sliding_window", int)
        attention = dataclasses.replace(attention, sliding_window=window, sliding_layers=(True,) * layers)
    moe = MoeConfig(
        sparse_layers=_sparse_layers(filled, layers),
        num_experts=get(filled, "num_experts", int),
        num_experts_per_tok=get(filled, "num_experts_per_tok", int),
        moe_intermediate_size=get(filled, "moe_intermediate_size", int),
        norm_topk_prob=get(filled, "norm_topk_prob", bool),
        shared_intermediate_size=None,
        weights_in_input_dtype=True,
    )
    return attention, moe


def _sparse_layers(config: dict, layers: int) -> tuple[bool, ...]:
    """Which layers have the mixture of experts, as transformers decides: layer i is sparse
    unless it is in `mlp_only_layers` or `(i + 1) % decoder_sparse_step` is not 0."""
    step = get(config, "decoder_sparse_step", int)
    only = config.get("mlp_only_layers") or []
    if not isinstance(only, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in only):
        raise ConfigError(f"config.json: 'mlp_only_layers' must be a list of layer indices, got {quoted(only)}")
    return tuple(i not in only and (i + 1) % step == 0 for i in range(layers))


@final
class Moe(Decoder):
    """Mixtral / Qwen2-MoE / Qwen3-MoE / MiniMax-M2 causal LM: Llama blocks whose `mlp` is a `port.nn.MoE`.

    Called as every `port.nn.Decoder` (masks, positions, segments, the cache, `dtype`,
    `remat`). `blocks` holds the sparse layers, stacked; `dense` the layers with a dense
    MLP (None when every layer is sparse, as in Mixtral); `layer_groups` says which
    checkpoint layers each holds. `config` is the `LlamaConfig` (what every decoder
    reads: layers, heads, the window), `moe` the `MoeConfig` beside it.

    ```python
    model = Moe.from_config(config, key=jax.random.key(0))
    logits = model(ids)                      # (batch, seq, vocab)
    model.layer_groups                       # {} when every layer is sparse, else
                                             # {"blocks": (1, 3), "dense": (0, 2)}
    ```
    """

    FIELDS: ClassVar[ConfigFields] = ConfigFields(
        "port.models.moe.Moe",
        read=(
            "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads", "head_dim", "hidden_act", "max_position_embeddings", "rms_norm_eps",
            "tie_word_embeddings", "rope_parameters", "rope_scaling", "rope_theta", "sliding_window",
            "use_sliding_window", "max_window_layers", "layer_types", "attention_bias", "qkv_bias",
            "num_local_experts", "num_experts", "num_experts_per_tok", "moe_intermediate_size",
            "shared_expert_intermediate_size", "norm_topk_prob", "decoder_sparse_step", "mlp_only_layers",
            "partial_rotary_factor", "rotary_dim", "attn_type_list",
        ),
        # MiniMax-M2's Hub config.json describes what transformers' MiniMaxM2 always runs
        types={
            "minimax_m2": {
                "use_qk_norm": (True,), "qk_norm_type": ("per_layer",), "scoring_func": ("sigmoid",),
                "use_routing_bias": (True,), "shared_intermediate_size": (0,),
            },
        },
    )  # fmt: skip

    embed: Float[Array, "vocab embed"]
    blocks: Block | None
    dense: Block | None
    norm: Float[Array, " embed"]
    lm_head: Float[Array, "vocab embed"] | None
    config: LlamaConfig = eqx.field(static=True)
    moe: MoeConfig = eqx.field(static=True)

    def __init__(self, config: LlamaConfig, moe: MoeConfig, *, key: PRNGKeyArray, dtype: Any = jnp.float32):
        kembed, kblocks, kdense = jax.random.split(key, 3)
        self.embed, self.lm_head = embeddings(
            kembed, vocab=config.vocab_size, embd=config.hidden_size, dtype=dtype, tied=config.tie_word_embeddings
        )
        sparse, dense = moe.kinds.count("blocks"), moe.kinds.count("dense")
        routed = functools.partial(moe.mlp, config)
        self.blocks = stacked(lambda k: block(config, dtype, key=k, mlp=routed), kblocks, sparse) if sparse else None
        self.dense = stacked(lambda k: block(config, dtype, key=k), kdense, dense) if dense else None
        self.norm = jnp.ones((config.hidden_size,), dtype)
        self.config, self.moe = config, moe

    @classmethod
    def from_config(cls, config: dict, *, key: PRNGKeyArray, dtype: Any = jnp.float32) -> Moe:
        """Randomly initialise from a Hugging Face `config.json` dict (model_type mixtral, qwen2_moe,
        qwen3_moe or minimax_m2).

        **Arguments:** `config` (the config.json dict), `key`, `dtype` (of the parameters).
        """
        return cls(*read_config(config), key=key, dtype=dtype)

    @property
    def layer_groups(self) -> dict[str, tuple[int, ...]]:
        """The checkpoint layers `blocks` and `dense` hold; {} when every layer is sparse."""
        kinds = self.moe.kinds
        if "dense" not in kinds:
            return {}
        return {kind: tuple(i for i, k in enumerate(kinds) if k == kind) for kind in ("blocks", "dense")}

    def logits(self, tokens: Tokens, remat: Any) -> tuple[Array, Any]:
        """Embed, the layers in checkpoint order (each its window), the final norm and the head."""
        c = self.config
        x = self.embed[tokens.ids]
        cos, sin = c.rope.angles(tokens.positions, x.dtype)
        groups = {"blocks": self.blocks, "dense": self.dense}
        x, cache = run_groups(
            groups, self.moe.kinds, x, tokens, cos=cos, sin=sin, sliding=c.sliding_layers, remat=remat
        )
        return head(rms_norm(x, self.norm, c.rms_norm_eps), self.embed, self.lm_head), cache
