"""GLM-4.5, GLM-4.6 and GLM-4.7 (`model_type` "glm4_moe"): Llama's attention, DeepSeek-V3's experts.

A composition, no new layer: what is new in the family is which pieces it takes.

- The attention is `port.models.llama.block`'s (GQA, `port.nn.Attention`) with q/k/v
  biases (`attention_bias`; never on `o_proj`), an optional per-head RMSNorm of queries and
  keys before RoPE (`use_qk_norm`: Cohere's, as Qwen3's `qk_norm="head"`), and partial
  rotary: the first `int(head_dim * partial_rotary_factor)` dimensions of each head rotate,
  their pairs the two halves (GLM's rotary, gpt-neox's `apply_rotary_pos_emb`); the
  factor defaults to 0.5 where config.json names none, as `Glm4MoeConfig` sets it.
- The first `first_k_dense_replace` layers have a dense SwiGLU MLP, the rest
  DeepSeek-V3's `port.nn.MoE` (sigmoid scores, `e_score_correction_bias` to choose,
  group-limited top-k, `norm_topk_prob`, `routed_scaling_factor`, ungated shared experts
  of `n_shared_experts * moe_intermediate_size`): the two kinds are two stacks, `dense`
  and `moe` (`layer_groups`), run in order by `port.nn.run_groups`. The cache is every
  port decoder's (keys and values per layer).

The checkpoints' multi-token-prediction layer (`model.layers.{num_hidden_layers}.*`) is not
part of the model; the mapping ignores it.

Example:
    ```python
    import equinox as eqx
    import jax
    import jax.numpy as jnp
    from port.models.glm4_moe import Glm4Moe

    config = {"model_type": "glm4_moe", "vocab_size": 151552, "hidden_size": 5120, "head_dim": 128,
              "intermediate_size": 12288, "moe_intermediate_size": 1536, "num_hidden_layers": 92,
              "num_attention_heads": 96, "num_key_value_heads": 8, "n_routed_experts": 160,
              "first_k_dense_replace": 3, "use_qk_norm": True, "attention_bias": True}
    abstract = eqx.filter_eval_shape(Glm4Moe.from_config, config, key=jax.random.key(0))
    abstract.moe.mlp.experts.gate.shape       # (89, 160, 1536, 5120)
    abstract.layer_groups["dense"]            # (0, 1, 2)

    small = {"model_type": "glm4_moe", "vocab_size": 100, "hidden_size": 64, "intermediate_size": 96,
             "moe_intermediate_size": 32, "num_hidden_layers": 3, "num_attention_heads": 4,
             "num_key_value_heads": 2, "n_routed_experts": 8, "num_experts_per_tok": 2,
             "first_k_dense_replace": 1, "use_qk_norm": True}
    model = Glm4Moe.from_config(small, key=jax.random.key(0))
    logits = eqx.filter_jit(model)(jnp.zeros((1, 8), dtype=jnp.int32))   # (1, 8, 100)
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
from port.models.deepseek_v3 import check_routing, feed_forward, non_negative
from port.models.llama import LlamaConfig, block
from port.nn import Block, Decoder, GatedMLP, MoE, Tokens, embeddings, head, read_rope, rms_norm, run_groups, stacked
from port.nn.config import MAX_LAYERS, ConfigFields, activation, check_model_type, get, read_kv_heads

MODEL_TYPES = ("glm4_moe",)
ROPE_TYPES = ("default", "linear", "llama3", "yarn")

# Glm4MoeConfig's defaults, used where config.json omits a key.
_DEFAULTS: dict[str, Any] = {
    "vocab_size": 151552,
    "hidden_size": 4096,
    "intermediate_size": 10944,
    "num_hidden_layers": 46,
    "num_attention_heads": 96,
    "hidden_act": "silu",
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False,
    "attention_bias": False,
    "moe_intermediate_size": 1408,
    "num_experts_per_tok": 8,
    "n_shared_experts": 1,
    "n_routed_experts": 128,
    "routed_scaling_factor": 1.0,
    "n_group": 1,
    "topk_group": 1,
    "first_k_dense_replace": 1,
    "norm_topk_prob": True,
    "use_qk_norm": False,
}
_KV_HEADS = 8  # Glm4MoeConfig's num_key_value_heads
_PARTIAL_ROTARY_FACTOR = 0.5  # Glm4MoeConfig's, where config.json names none


@final
@dataclasses.dataclass(frozen=True)
class Glm4MoeExperts:
    """The feed-forward side of a GLM-4.5 model: what its `LlamaConfig` (attention, norms,
    RoPE) does not hold. `mlp(kind, ...)` builds one layer's: the dense SwiGLU of
    `intermediate_size` or DeepSeek-V3's routed experts.

    ```python
    llama, experts = read_config({"model_type": "glm4_moe", "num_hidden_layers": 4, "head_dim": 128})
    experts.kinds, experts.num_local_experts     # (("dense", "moe", "moe", "moe"), 128)
    ```
    """

    hidden_size: int
    intermediate_size: int
    moe_intermediate_size: int
    num_hidden_layers: int
    num_local_experts: int
    num_experts_per_tok: int
    n_shared_experts: int
    n_group: int
    topk_group: int
    first_k_dense_replace: int
    norm_topk_prob: bool
    routed_scaling_factor: float
    hidden_act: str = "silu"

    @property
    def kinds(self) -> tuple[str, ...]:
        """Each layer's kind, "dense" or "moe", in order."""
        k = self.first_k_dense_replace
        return ("dense",) * k + ("moe",) * (self.num_hidden_layers - k)

    def mlp(self, kind: str, dtype: Any, key: PRNGKeyArray) -> GatedMLP | MoE:
        """One layer's feed-forward: a SwiGLU ("dense") or DeepSeek-V3's routed experts ("moe")."""
        return feed_forward(self, kind, dtype, key)


def read_config(config: dict) -> tuple[LlamaConfig, Glm4MoeExperts]:
    """A Hugging Face `config.json` dict (model_type glm4_moe) read into its attention side and
    its feed-forward side; raises a one-line `ConfigError` naming the key for anything
    missing, malformed, contradictory or not run by this module.

    ```python
    read_config({"model_type": "glm4_moe", "head_dim": 128, "use_qk_norm": True})[0].qk_norm     # 'head'
    read_config({"model_type": "glm4_moe", "head_dim": 128, "num_hidden_layers": 2, "first_k_dense_replace": 3})
    # ConfigError: config.json: 'first_k_dense_replace' (3) is beyond the 2 layers ('num_hidden_layers')
    ```
    """
    check_model_type(config, MODEL_TYPES, "port.models.glm4_moe")
    Glm4Moe.FIELDS.check(config)
    c = {**_DEFAULTS, **{k: v for k, v in config.items() if v is not None}}
    if "n_routed_experts" not in config and config.get("num_local_experts") is not None:
        c["n_routed_experts"] = config["num_local_experts"]
    layers = get(c, "num_hidden_layers", int, maximum=MAX_LAYERS)
    hidden, heads = get(c, "hidden_size", int), get(c, "num_attention_heads", int)
    head_dim = get(c, "head_dim", int, hidden // heads)  # transformers: `getattr(config, "head_dim", ...)`
    if config.get("partial_rotary_factor") is None:
        c["partial_rotary_factor"] = _PARTIAL_ROTARY_FACTOR  # a rope_parameters' own one wins
    rope = read_rope(
        c, head_dim, supported=ROPE_TYPES, max_position_embeddings=get(c, "max_position_embeddings", int),
        allow_partial=True,
    )  # fmt: skip
    experts, top_k = get(c, "n_routed_experts", int), get(c, "num_experts_per_tok", int)
    groups, top_groups = get(c, "n_group", int), get(c, "topk_group", int)
    check_routing(experts, top_k, groups, top_groups)
    dense = non_negative(c, "first_k_dense_replace")
    if dense > layers:
        raise ConfigError(
            f"config.json: 'first_k_dense_replace' ({dense}) is beyond the {layers} layers ('num_hidden_layers')"
        )
    eps = get(c, "rms_norm_eps", float)
    attention = LlamaConfig(
        vocab_size=get(c, "vocab_size", int),
        hidden_size=hidden,
        intermediate_size=get(c, "intermediate_size", int),
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=read_kv_heads(config, heads, _KV_HEADS),
        head_dim=head_dim,
        rms_norm_eps=eps,
        tie_word_embeddings=get(c, "tie_word_embeddings", bool),
        model_type="glm4_moe",
        qkv_bias=get(c, "attention_bias", bool),
        qk_norm="head" if get(c, "use_qk_norm", bool) else None,
        rope=rope,
        sliding_layers=(False,) * layers,
    )
    return attention, Glm4MoeExperts(
        hidden_size=hidden,
        intermediate_size=attention.intermediate_size,
        moe_intermediate_size=get(c, "moe_intermediate_size", int),
        num_hidden_layers=layers,
        num_local_experts=experts,
        num_experts_per_tok=top_k,
        n_shared_experts=non_negative(c, "n_shared_experts"),
        n_group=groups,
        topk_group=top_groups,
        first_k_dense_replace=dense,
        norm_topk_prob=get(c, "norm_topk_prob", bool),
        routed_scaling_factor=get(c, "routed_scaling_factor", float),
        hidden_act=activation(c, "hidden_act", "silu"),
    )


@final
class Glm4Moe(Decoder):
    """GLM-4.5 / 4.6 / 4.7 causal LM: `dense` and `moe` stacks of Llama blocks (None where a
    kind has no layer). `config` is the attention's `LlamaConfig` (what every decoder reads:
    layers, heads, head size), `experts` the `Glm4MoeExperts` beside it.

    Called as every `port.nn.Decoder`: `model(input_ids, *, attention_mask=None, positions=None,
    segment_ids=None, cache=None, dtype=None, remat=None)`.

    ```python
    model = Glm4Moe.from_config(config, key=jax.random.key(0))
    logits = model(ids)                                          # (batch, seq, vocab)
    model.layer_groups                                           # {"dense": (0,), "moe": (1, 2)}
    ```
    """

    FIELDS: ClassVar[ConfigFields] = ConfigFields(
        "port.models.glm4_moe.Glm4Moe",
        read=(
            "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads", "head_dim", "hidden_act", "max_position_embeddings", "rms_norm_eps",
            "tie_word_embeddings", "rope_parameters", "rope_scaling", "rope_theta", "partial_rotary_factor",
            "attention_bias", "moe_intermediate_size", "num_experts_per_tok", "n_shared_experts",
            "n_routed_experts", "num_local_experts", "routed_scaling_factor", "n_group", "topk_group",
            "first_k_dense_replace", "norm_topk_prob", "use_qk_norm",
            "num_nextn_predict_layers", "num_mtp_layers",  # multi-token prediction modules: not built
        ),
    )  # fmt: skip

    embed: Float[Array, "vocab embed"]
    dense: Block | None
    moe: Block | None
    norm: Float[Array, " embed"]
    lm_head: Float[Array, "vocab embed"] | None
    config: LlamaConfig = eqx.field(static=True)
    experts: Glm4MoeExperts = eqx.field(static=True)

    def __init__(self, config: LlamaConfig, experts: Glm4MoeExperts, *, key: PRNGKeyArray, dtype: Any = jnp.float32):
        kembed, kdense, kmoe = jax.random.split(key, 3)
        self.embed, self.lm_head = embeddings(
            kembed, vocab=config.vocab_size, embd=config.hidden_size, dtype=dtype, tied=config.tie_word_embeddings
        )

        def make(kind: str, k: PRNGKeyArray) -> Block | None:
            count = experts.kinds.count(kind)
            if not count:
                return None
            mlp = lambda d, kk: experts.mlp(kind, d, kk)  # noqa: E731
            return stacked(lambda kk: block(config, dtype, key=kk, mlp=mlp), k, count)

        self.dense, self.moe = make("dense", kdense), make("moe", kmoe)
        self.norm = jnp.ones((config.hidden_size,), dtype)
        self.config, self.experts = config, experts

    @classmethod
    def from_config(cls, config: dict, *, key: PRNGKeyArray, dtype: Any = jnp.float32) -> Glm4Moe:
        """Randomly initialise from a Hugging Face `config.json` dict (model_type glm4_moe)."""
        return cls(*read_config(config), key=key, dtype=dtype)

    @property
    def layer_groups(self) -> dict[str, tuple[int, ...]]:
        """The checkpoint layers each stack holds: `dense` the first `first_k_dense_replace`, `moe` the rest."""
        kinds = self.experts.kinds
        return {kind: tuple(i for i, k in enumerate(kinds) if k == kind) for kind in ("dense", "moe")}

    def logits(self, tokens: Tokens, remat: Any) -> tuple[Array, Any]:
        """Embed, the dense then the MoE layers, the final norm and the head."""
        c = self.config
        x = self.embed[tokens.ids]
        cos, sin = c.rope.angles(tokens.positions, x.dtype)
        groups = {"dense": self.dense, "moe": self.moe}
        x, cache = run_groups(groups, self.experts.kinds, x, tokens, cos=cos, sin=sin, remat=remat)
        return head(rms_norm(x, self.norm, c.rms_norm_eps), self.embed, self.lm_head), cache
