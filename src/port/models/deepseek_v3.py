"""DeepSeek-V3 / R1 and Kimi K2 (`model_type` "deepseek_v3"): latent attention, dense then MoE layers.

What is new in the family, all else from `port.nn`:

- Multi-head latent attention (`port.nn.LatentAttention`): queries through a low-rank
  bottleneck (`q_lora_rank`, or one `q_proj` when it is null), keys and values from a
  compressed latent (`kv_lora_rank`) plus one shared rotary key (`qk_rope_head_dim`);
  RoPE on the rotary slice only, its pairs interleaved (`rope_interleave`); the score
  scale `qk_head_dim**-0.5`, times YaRN's `mscale(factor, mscale_all_dim)**2` when the
  RoPE is scaled and `mscale_all_dim` is set (transformers' `yarn_apply_mscale`).
- The first `first_k_dense_replace` layers have a dense SwiGLU MLP, the rest a
  `port.nn.MoE`: sigmoid scores, `e_score_correction_bias` added to choose (not to
  weight), group-limited top-k (`n_group`, `topk_group`), `norm_topk_prob`,
  `routed_scaling_factor`, and `n_shared_experts` ungated shared experts (one SwiGLU of
  `n_shared_experts * moe_intermediate_size`). The two kinds are two stacks, `dense` and
  `moe` (`layer_groups`), run in order by `port.nn.run_groups`.
- The cache holds the latent and the rotated shared key per layer (what transformers
  caches), a dict by layer kind.

The checkpoints' multi-token-prediction layer (`model.layers.{num_hidden_layers}.*`) is
not part of the model; the mapping ignores it.

Example:
    ```python
    import equinox as eqx
    import jax
    import jax.numpy as jnp
    from port.models.deepseek_v3 import DeepseekV3

    config = {"model_type": "deepseek_v3", "vocab_size": 129280, "hidden_size": 7168,
              "intermediate_size": 18432, "moe_intermediate_size": 2048, "num_hidden_layers": 61,
              "num_attention_heads": 128, "num_key_value_heads": 128}
    abstract = eqx.filter_eval_shape(DeepseekV3.from_config, config, key=jax.random.key(0))
    abstract.moe.mlp.experts.gate.shape       # (58, 256, 2048, 7168)
    abstract.layer_groups["dense"]            # (0, 1, 2)

    small = {"model_type": "deepseek_v3", "vocab_size": 100, "hidden_size": 64, "intermediate_size": 96,
             "moe_intermediate_size": 32, "num_hidden_layers": 3, "num_attention_heads": 4,
             "num_key_value_heads": 4, "n_routed_experts": 8, "num_experts_per_tok": 2, "n_group": 2,
             "topk_group": 1, "first_k_dense_replace": 1, "q_lora_rank": 24, "kv_lora_rank": 16,
             "qk_nope_head_dim": 8, "qk_rope_head_dim": 4, "v_head_dim": 12}
    model = DeepseekV3.from_config(small, key=jax.random.key(0))
    logits = eqx.filter_jit(model)(jnp.zeros((1, 8), dtype=jnp.int32))   # (1, 8, 100)
    ```
"""

from __future__ import annotations

import dataclasses
import math
from abc import abstractmethod
from typing import Any, ClassVar, Protocol, final, runtime_checkable

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, PRNGKeyArray

from port._errors import ConfigError
from port._text import quoted
from port.nn import (
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
from port.nn._mla import LatentAttention
from port.nn._rope import rope_parameters
from port.nn.config import MAX_LAYERS, ConfigFields, activation, check, check_model_type, get

MODEL_TYPES = ("deepseek_v3",)
ROPE_TYPES = ("default", "linear", "llama3", "yarn")

# DeepseekV3Config's defaults, used where config.json omits a key.
_DEFAULTS: dict[str, Any] = {
    "vocab_size": 129280,
    "hidden_size": 7168,
    "intermediate_size": 18432,
    "moe_intermediate_size": 2048,
    "num_hidden_layers": 61,
    "num_attention_heads": 128,
    "n_shared_experts": 1,
    "n_routed_experts": 256,
    "routed_scaling_factor": 2.5,
    "kv_lora_rank": 512,
    "q_lora_rank": 1536,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "qk_nope_head_dim": 128,
    "n_group": 8,
    "topk_group": 4,
    "num_experts_per_tok": 8,
    "first_k_dense_replace": 3,
    "norm_topk_prob": True,
    "hidden_act": "silu",
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    "rope_interleave": True,
    "attention_bias": False,
}


@final
@dataclasses.dataclass(frozen=True)
class DeepseekV3Config:
    """The hyperparameters of a DeepSeek-V3 model, as read from a config.json (transformers' names).

    ```python
    c = DeepseekV3Config.from_hf({"model_type": "deepseek_v3", "num_key_value_heads": 128})
    c.qk_head_dim, c.first_k_dense_replace, c.num_local_experts    # (192, 3, 256)
    ```
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    moe_intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    num_local_experts: int
    num_experts_per_tok: int
    n_shared_experts: int
    n_group: int
    topk_group: int
    first_k_dense_replace: int
    norm_topk_prob: bool
    routed_scaling_factor: float
    rope: Rope
    scale: float  # the attention score scale, mscale included
    rope_interleave: bool = True
    attention_bias: bool = False
    hidden_act: str = "silu"
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False

    @property
    def qk_head_dim(self) -> int:
        """Each query/key head's size: its non-rotary and rotary parts."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def kinds(self) -> tuple[str, ...]:
        """Each layer's kind, "dense" or "moe", in order."""
        k = self.first_k_dense_replace
        return ("dense",) * k + ("moe",) * (self.num_hidden_layers - k)

    @classmethod
    def from_hf(cls, config: dict) -> DeepseekV3Config:
        """Build from a Hugging Face `config.json` dict; raises a one-line `ConfigError` naming
        the key for anything missing, malformed or contradictory.

        ```python
        DeepseekV3Config.from_hf({"model_type": "deepseek_v3", "num_hidden_layers": 2})
        # ConfigError: config.json: 'first_k_dense_replace' (3) is beyond the 2 layers ('num_hidden_layers')
        ```
        """
        check_model_type(config, MODEL_TYPES, "port.models.deepseek_v3")
        DeepseekV3.FIELDS.check(config)
        c = {**_DEFAULTS, **{k: v for k, v in config.items() if v is not None or k == "q_lora_rank"}}
        if "n_routed_experts" not in config and config.get("num_local_experts") is not None:
            c["n_routed_experts"] = config["num_local_experts"]
        layers = get(c, "num_hidden_layers", int, maximum=MAX_LAYERS)
        heads = get(c, "num_attention_heads", int)
        kv_heads = config.get("num_key_value_heads")
        if kv_heads is not None and kv_heads != heads:
            raise ConfigError(
                f"config.json: 'num_key_value_heads' ({quoted(kv_heads)}) must equal 'num_attention_heads' "
                f"({heads}): latent attention expands its keys and values to every head"
            )
        experts, top_k = get(c, "n_routed_experts", int), get(c, "num_experts_per_tok", int)
        groups, top_groups = get(c, "n_group", int), get(c, "topk_group", int)
        check_routing(experts, top_k, groups, top_groups)
        dense = non_negative(c, "first_k_dense_replace")
        if dense > layers:
            raise ConfigError(
                f"config.json: 'first_k_dense_replace' ({dense}) is beyond the {layers} layers ('num_hidden_layers')"
            )
        rope_dim = get(c, "qk_rope_head_dim", int)
        maximum = get(c, "max_position_embeddings", int)
        rope = read_rope(config, rope_dim, supported=ROPE_TYPES, max_position_embeddings=maximum)
        nope = get(c, "qk_nope_head_dim", int)
        q_rank = c.get("q_lora_rank")
        return cls(
            vocab_size=get(c, "vocab_size", int),
            hidden_size=get(c, "hidden_size", int),
            intermediate_size=get(c, "intermediate_size", int),
            moe_intermediate_size=get(c, "moe_intermediate_size", int),
            num_hidden_layers=layers,
            num_attention_heads=heads,
            q_lora_rank=None if q_rank is None else check("q_lora_rank", q_rank, int),
            kv_lora_rank=get(c, "kv_lora_rank", int),
            qk_nope_head_dim=nope,
            qk_rope_head_dim=rope_dim,
            v_head_dim=get(c, "v_head_dim", int),
            num_local_experts=experts,
            num_experts_per_tok=top_k,
            n_shared_experts=non_negative(c, "n_shared_experts"),
            n_group=groups,
            topk_group=top_groups,
            first_k_dense_replace=dense,
            norm_topk_prob=get(c, "norm_topk_prob", bool),
            routed_scaling_factor=get(c, "routed_scaling_factor", float),
            rope=rope,
            scale=latent_scale(config, rope, nope + rope_dim),
            rope_interleave=get(c, "rope_interleave", bool),
            attention_bias=get(c, "attention_bias", bool),
            hidden_act=activation(c, "hidden_act", "silu"),
            rms_norm_eps=get(c, "rms_norm_eps", float),
            tie_word_embeddings=get(c, "tie_word_embeddings", bool),
        )

    def attention(self, dtype: Any, key: PRNGKeyArray) -> LatentAttention:
        """One layer's latent attention."""
        return LatentAttention(
            heads=self.num_attention_heads,
            embd=self.hidden_size,
            q_rank=self.q_lora_rank,
            kv_rank=self.kv_lora_rank,
            nope_dim=self.qk_nope_head_dim,
            rope_dim=self.qk_rope_head_dim,
            v_dim=self.v_head_dim,
            dtype=dtype,
            key=key,
            bias=self.attention_bias,
            scale=self.scale,
            interleave=self.rope_interleave,
        )

    def mlp(self, kind: str, dtype: Any, key: PRNGKeyArray) -> GatedMLP | MoE:
        """One layer's feed-forward: a SwiGLU ("dense") or the routed experts ("moe")."""
        return feed_forward(self, kind, dtype, key)


def non_negative(config: dict, key: str) -> int:
    """config.json's `key` as a non-negative integer, or a one-line error naming it."""
    value = config.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ConfigError(f"config.json: {key!r} must be a non-negative integer, got {quoted(value)}")
    return value


def check_routing(experts: int, top_k: int, groups: int, top_groups: int) -> None:
    """Group-limited routing that transformers' router can run."""
    if experts % groups:
        raise ConfigError(f"config.json: 'n_group' ({groups}) must divide 'n_routed_experts' ({experts})")
    if top_groups > groups:
        raise ConfigError(f"config.json: 'topk_group' ({top_groups}) is more than 'n_group' ({groups})")
    if groups > 1 and experts // groups < 2:
        raise ConfigError(
            f"config.json: 'n_group' ({groups}) leaves fewer than 2 of 'n_routed_experts' ({experts}) per group "
            "(a group is scored by its two best experts)"
        )
    if top_k > top_groups * (experts // groups):
        raise ConfigError(
            f"config.json: 'num_experts_per_tok' ({top_k}) is more than the {top_groups * (experts // groups)} "
            f"experts of 'topk_group' ({top_groups}) groups of {experts // groups}"
        )


@runtime_checkable
class RoutedSizes(Protocol):
    """What DeepSeek-V3's feed-forward is built from (a `DeepseekV3Config`, GLM-4.5's `Glm4MoeExperts`): read-only sizes (abstract: any object with these fields answers it)."""

    @property
    @abstractmethod
    def hidden_size(self) -> int: ...
    @property
    @abstractmethod
    def intermediate_size(self) -> int: ...
    @property
    @abstractmethod
    def moe_intermediate_size(self) -> int: ...
    @property
    @abstractmethod
    def num_local_experts(self) -> int: ...
    @property
    @abstractmethod
    def num_experts_per_tok(self) -> int: ...
    @property
    @abstractmethod
    def n_shared_experts(self) -> int: ...
    @property
    @abstractmethod
    def n_group(self) -> int: ...
    @property
    @abstractmethod
    def topk_group(self) -> int: ...
    @property
    @abstractmethod
    def norm_topk_prob(self) -> bool: ...
    @property
    @abstractmethod
    def routed_scaling_factor(self) -> float: ...
    @property
    @abstractmethod
    def hidden_act(self) -> str: ...


def feed_forward(c: RoutedSizes, kind: str, dtype: Any, key: PRNGKeyArray) -> GatedMLP | MoE:
    """One layer's feed-forward as DeepSeek-V3 builds it: a SwiGLU of `intermediate_size`
    ("dense"), or sigmoid group-limited routed experts with `e_score_correction_bias` choosing,
    `routed_scaling_factor` and `n_shared_experts` ungated shared experts ("moe")."""
    if kind == "dense":
        return GatedMLP(embd=c.hidden_size, inner=c.intermediate_size, activation=c.hidden_act, dtype=dtype, key=key)
    shared = c.moe_intermediate_size * c.n_shared_experts
    return MoE(
        embd=c.hidden_size,
        inner=c.moe_intermediate_size,
        experts=c.num_local_experts,
        top_k=c.num_experts_per_tok,
        activation=c.hidden_act,
        dtype=dtype,
        key=key,
        scoring="sigmoid",
        renormalise=c.norm_topk_prob,
        selection_bias=True,
        groups=c.n_group,
        top_groups=c.topk_group,
        scale=c.routed_scaling_factor,
        shared_inner=shared or None,
        shared_gate=False,
    )


def latent_scale(config: dict, rope: Rope, qk_head_dim: int) -> float:
    """transformers' `yarn_apply_mscale`: `qk_head_dim**-0.5`, times `mscale(factor,
    mscale_all_dim)**2` when the RoPE is scaled and `mscale_all_dim` is set."""
    scale = qk_head_dim**-0.5
    _, params = rope_parameters(config)
    all_dim = params.get("mscale_all_dim")
    if params["rope_type"] != "default" and all_dim:
        factor = check("rope_parameters.factor", params.get("factor", rope.factor), float)
        mscale = 1.0 if factor <= 1 else 0.1 * check("mscale_all_dim", all_dim, float) * math.log(factor) + 1.0
        scale = scale * mscale * mscale
    return scale


def block(c: DeepseekV3Config, kind: str, dtype: Any, *, key: PRNGKeyArray) -> Block:
    """One layer: latent attention, then a dense MLP (`kind` "dense") or the experts ("moe")."""
    kattn, kmlp = jax.random.split(key)
    return Block(
        c.attention(dtype, kattn), c.mlp(kind, dtype, kmlp), embd=c.hidden_size, eps=c.rms_norm_eps, dtype=dtype
    )


@final
class DeepseekV3(Decoder):
    """DeepSeek-V3 causal LM: `dense` and `moe` stacks of blocks (None where a kind has no layer).

    Called as every `port.nn.Decoder`: `model(input_ids, *, attention_mask=None, positions=None,
    segment_ids=None, cache=None, dtype=None, remat=None)`.

    ```python
    model = DeepseekV3.from_config(config, key=jax.random.key(0))
    logits = model(ids)                                          # (batch, seq, vocab)
    logits, cache = model(ids, cache=model.init_cache(batch=ids.shape[0], length=64))
    ```
    """

    FIELDS: ClassVar[ConfigFields] = ConfigFields(
        "port.models.deepseek_v3.DeepseekV3",
        read=(
            "vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size", "num_hidden_layers",
            "num_attention_heads", "num_key_value_heads", "n_shared_experts", "n_routed_experts",
            "num_local_experts", "routed_scaling_factor", "kv_lora_rank", "q_lora_rank", "qk_rope_head_dim",
            "v_head_dim", "qk_nope_head_dim", "n_group", "topk_group", "num_experts_per_tok",
            "first_k_dense_replace", "norm_topk_prob", "hidden_act", "max_position_embeddings",
            "rms_norm_eps", "tie_word_embeddings", "rope_parameters", "rope_scaling", "rope_theta",
            "rope_interleave", "attention_bias",
            "head_dim", "qk_head_dim",  # derived: transformers recomputes both from the head sizes above
            "num_nextn_predict_layers", "num_mtp_layers",  # multi-token prediction modules: not built
        ),
        fixed={
            "pretraining_tp": (1,),
            # the released configs' own (DeepSeek's modelling code): transformers runs these values only
            "scoring_func": ("sigmoid",),
            "topk_method": ("noaux_tc",),
            "moe_layer_freq": (1,),
        },
    )  # fmt: skip

    embed: Float[Array, "vocab embed"]
    dense: Block | None
    moe: Block | None
    norm: Float[Array, " embed"]
    lm_head: Float[Array, "vocab embed"] | None
    config: DeepseekV3Config = eqx.field(static=True)

    def __init__(self, config: DeepseekV3Config, *, key: PRNGKeyArray, dtype: Any = jnp.float32):
        kembed, kdense, kmoe = jax.random.split(key, 3)
        self.embed, self.lm_head = embeddings(
            kembed, vocab=config.vocab_size, embd=config.hidden_size, dtype=dtype, tied=config.tie_word_embeddings
        )
        counts = {kind: config.kinds.count(kind) for kind in ("dense", "moe")}

        def make(kind, k):
            return stacked(lambda kk: block(config, kind, dtype, key=kk), k, counts[kind]) if counts[kind] else None

        self.dense, self.moe = make("dense", kdense), make("moe", kmoe)
        self.norm = jnp.ones((config.hidden_size,), dtype)
        self.config = config

    @classmethod
    def from_config(cls, config: dict, *, key: PRNGKeyArray, dtype: Any = jnp.float32) -> DeepseekV3:
        """Randomly initialise from a Hugging Face `config.json` dict (model_type deepseek_v3)."""
        return cls(DeepseekV3Config.from_hf(config), key=key, dtype=dtype)

    @property
    def layer_groups(self) -> dict[str, tuple[int, ...]]:
        """The checkpoint layers each stack holds: `dense` the first `first_k_dense_replace`, `moe` the rest."""
        kinds = self.config.kinds
        return {kind: tuple(i for i, k in enumerate(kinds) if k == kind) for kind in ("dense", "moe")}

    def init_cache(self, batch: int, length: int, dtype: Any = None) -> Cache:
        """An empty cache by layer kind: per layer, the latent (`kv_lora_rank`) as keys and the
        rotated shared key (`qk_rope_head_dim`) as values, `[layers, batch, length, 1, size]`."""
        if dtype is None:
            dtype = self.embed.dtype
        c = self.config
        keys, values = {}, {}
        for kind, ids in self.layer_groups.items():
            if ids:
                keys[kind] = jnp.zeros((len(ids), batch, length, 1, c.kv_lora_rank), dtype)
                values[kind] = jnp.zeros((len(ids), batch, length, 1, c.qk_rope_head_dim), dtype)
        return Cache.of(keys, values, batch=batch, length=length)

    def logits(self, tokens: Tokens, remat: Any) -> tuple[Array, tuple[Any, Any, Any]]:
        """Embed, the dense then the MoE layers, the final norm and the head."""
        c = self.config
        x = self.embed[tokens.ids]
        cos, sin = c.rope.angles(tokens.positions, x.dtype)
        x, cache = run_groups({"dense": self.dense, "moe": self.moe}, c.kinds, x, tokens, cos=cos, sin=sin, remat=remat)
        return head(rms_norm(x, self.norm, c.rms_norm_eps), self.embed, self.lm_head), cache
