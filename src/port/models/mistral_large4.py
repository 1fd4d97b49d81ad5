"""Mistral Large 4 (`model_type` "mistral_large4", its `text_config` "mistral_large4_text"): the language model.

What is new in the family, all else from `port.nn` and DeepSeek-V3's module:

- Latent attention (`port.nn.LatentAttention`) with one query projection (no
  `q_lora_rank`), its rotary pairs interleaved; the queries, after RoPE, scaled per head
  by position: `q * (s[h] * log(position + 1) + b[h])` (transformers'
  `MistralLarge4TextSoftmaxScaling`, the checkpoint's `ssmax_scaling.s` / `.b`).
- LeRoPE: one learned vector `alpha` (`lerope.alpha`) scales YaRN's inverse
  frequencies by `exp(alpha)`, the same for every layer.
- The MoE router: a softmax over the experts in float32 (its logits in the compute dtype,
  where transformers computes them in float32: within bfloat16's noise), group-limited top-k,
  the chosen weights renormalised and times `routed_scaling_factor`; one ungated shared
  expert; the dense layers are those `mlp_layer_types` names "dense" (a stack each kind,
  `layer_groups`, run in order by `port.nn.run_groups`).
- The logits soft-capped: `c * tanh(logits / c)` (`final_logit_softcapping`).
- DeepSeek sparse attention (`port.nn`'s `sparse_attend`): each query attends to the
  `index_topk` keys its layer's indexer scores best (`MistralLarge4Indexer`: GLM-5's,
  with queries from the hidden state, scaled by position as the attention's); every key
  while a call sees at most `index_topk`. The cache keeps the indexer's keys beside the
  rotary key.
- NoPE layers (a 0 in `no_rope_layers`: every 4th by default): no RoPE in the layer's
  attention nor its indexer, each head's key and query all non-rotary
  (`qk_nope_head_dim + qk_rope_head_dim`), its own stacks (`dense_nope`, `moe_nope`).

Refused in one line before any tensor is read: layers sharing another's latent cache
(`kv_source_layers`), indexers shared across layers (`indexer_types` "shared"), and any
other `layer_types` than "indexed_attention".

The checkpoints are Mistral's own layout (what transformers' `save_pretrained` writes and
the Hub holds): `tok_embeddings`, `layers.N.attention.wq`, `wkv_a_with_mqa`, `kv_a_norm`,
`wkv_b`, `wo`, `attention_norm`, `ffn_norm`, `feed_forward.w1/w2/w3`, `experts.E.w1/w2/w3`,
`gate`, `shared_experts.w1/w2/w3`, `norm`, `output`, `lerope.alpha`; the vision encoder
and the projector beside them are ignored.

Example:
    ```python
    import equinox as eqx
    import jax
    from port.models.mistral_large4 import MistralLarge4

    config = {"model_type": "mistral_large4", "text_config": {"model_type": "mistral_large4_text",
              "num_hidden_layers": 8}}
    abstract = eqx.filter_eval_shape(MistralLarge4.from_config, config, key=jax.random.key(0))
    abstract.moe.mlp.experts.gate.shape       # (5, 128, 6144, 6144)
    abstract.layer_groups["moe_nope"]         # (3, 7): every 4th layer is NoPE
    ```
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar, final

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Float, Int, PRNGKeyArray

from port._errors import ConfigError
from port._text import quoted
from port.models.deepseek_v3 import (  # DeepSeek-V3's readers, shared
    check_routing,
    latent_scale,
    non_negative,
)
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
from port.nn._attention import KV, with_cache
from port.nn._init import normal
from port.nn._mla import LatentAttention, rotate
from port.nn._norm import LayerNorm, layer_norm
from port.nn._sparse import sparse_attend
from port.nn.config import MAX_LAYERS, ConfigFields, activation, check, check_model_type, get

MODEL_TYPES = ("mistral_large4_text",)
WRAPPERS = ("mistral_large4",)
ROPE_TYPES = ("default", "linear", "llama3", "yarn")
KINDS = ("dense", "moe", "dense_nope", "moe_nope")
"""The layer stacks: a dense MLP or the experts, with RoPE or without (NoPE)."""

# MistralLarge4TextConfig's defaults (Mistral-Large-4-1T-A52B), used where config.json omits a key.
_DEFAULTS: dict[str, Any] = {
    "vocab_size": 204800,
    "hidden_size": 6144,
    "intermediate_size": 24576,
    "moe_intermediate_size": 6144,
    "num_hidden_layers": 72,
    "num_attention_heads": 64,
    "n_shared_experts": 1,
    "n_routed_experts": 128,
    "routed_scaling_factor": 1.0,
    "kv_lora_rank": 512,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "qk_nope_head_dim": 64,
    "n_group": 1,
    "topk_group": 1,
    "num_experts_per_tok": 4,
    "first_k_dense_replace": 1,
    "hidden_act": "silu",
    "max_position_embeddings": 1048576,
    "rms_norm_eps": 1e-5,
    "index_topk": 2048,
    "index_head_dim": 128,
    "index_n_heads": 32,
    "final_logit_softcapping": 30.0,
    "rope_parameters": {
        "rope_type": "yarn",
        "rope_theta": 10000.0,
        "factor": 2048.0,
        "original_max_position_embeddings": 512,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "attention_factor": 1.0,
    },
}


@final
@dataclasses.dataclass(frozen=True)
class MistralLarge4Config:
    """The hyperparameters of Mistral Large 4's language model, as read from a config.json
    (the wrapper's `text_config`, transformers' names).

    ```python
    c = MistralLarge4Config.from_hf({"model_type": "mistral_large4_text", "num_hidden_layers": 4})
    c.kinds, c.index_topk          # (('dense', 'moe', 'moe', 'moe_nope'), 2048)
    ```
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    moe_intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    qk_head_dim: int  # both: a NoPE layer's non-rotary key and query size (the mapping names it)
    v_head_dim: int
    num_local_experts: int
    num_experts_per_tok: int
    n_shared_experts: int
    n_group: int
    topk_group: int
    routed_scaling_factor: float
    kinds: tuple[str, ...]  # each layer's "dense" or "moe", "_nope" added where it does not rotate
    index_topk: int
    index_n_heads: int
    index_head_dim: int
    rope: Rope
    scale: float  # the attention score scale, YaRN's mscale included
    softcap: float | None
    hidden_act: str = "silu"
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = False

    @classmethod
    def from_hf(cls, config: dict) -> MistralLarge4Config:
        """Build from a Hugging Face `config.json` dict (the wrapper's: its `text_config`);
        raises a one-line `ConfigError` naming the key for anything missing, malformed,
        contradictory or not run by this module."""
        if config.get("model_type") in WRAPPERS:
            config = _language_model(config)
        check_model_type(config, MODEL_TYPES, "port.models.mistral_large4")
        MistralLarge4.FIELDS.check(config)
        c = {**_DEFAULTS, **{k: v for k, v in config.items() if v is not None}}
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
        _check_layers(config, layers)
        rope_dim, nope = get(c, "qk_rope_head_dim", int), get(c, "qk_nope_head_dim", int)
        rope_config = {**config, "rope_parameters": c["rope_parameters"]}
        rope = read_rope(
            rope_config, rope_dim, supported=ROPE_TYPES, max_position_embeddings=get(c, "max_position_embeddings", int)
        )
        softcap = c.get("final_logit_softcapping")
        return cls(
            vocab_size=get(c, "vocab_size", int),
            hidden_size=get(c, "hidden_size", int),
            intermediate_size=get(c, "intermediate_size", int),
            moe_intermediate_size=get(c, "moe_intermediate_size", int),
            num_hidden_layers=layers,
            num_attention_heads=heads,
            kv_lora_rank=get(c, "kv_lora_rank", int),
            qk_nope_head_dim=nope,
            qk_rope_head_dim=rope_dim,
            qk_head_dim=nope + rope_dim,
            v_head_dim=get(c, "v_head_dim", int),
            num_local_experts=experts,
            num_experts_per_tok=top_k,
            n_shared_experts=non_negative(c, "n_shared_experts"),
            n_group=groups,
            topk_group=top_groups,
            routed_scaling_factor=get(c, "routed_scaling_factor", float),
            kinds=tuple(k if r else f"{k}_nope" for k, r in zip(_kinds(c, layers), _rope_layers(config, layers))),
            index_topk=get(c, "index_topk", int),
            index_n_heads=get(c, "index_n_heads", int),
            index_head_dim=get(c, "index_head_dim", int),
            rope=rope,
            scale=latent_scale(rope_config, rope, nope + rope_dim),
            softcap=None if softcap is None else check("final_logit_softcapping", softcap, float),
            hidden_act=activation(c, "hidden_act", "silu"),
            rms_norm_eps=get(c, "rms_norm_eps", float),
            tie_word_embeddings=get({"tie_word_embeddings": False, **config}, "tie_word_embeddings", bool),
        )


def _language_model(config: dict) -> dict:
    """The wrapper's `text_config`, with the wrapper's `tie_word_embeddings` (what
    transformers ties the head by; MistralLarge4Config's default false)."""
    text = config.get("text_config")
    if not isinstance(text, dict):
        raise ConfigError(f"config.json: 'text_config' must be a dict, got {quoted(text)}")
    return {
        "model_type": MODEL_TYPES[0],
        **text,
        "tie_word_embeddings": config.get("tie_word_embeddings", False),
    }


def _check_layers(config: dict, layers: int) -> None:
    """Refuse the per-layer options this module does not run: shared latent caches, shared
    indexers, other attention kinds."""
    runs = {
        "kv_source_layers": (None, "a layer sharing another layer's latent cache is not supported"),
        "indexer_types": ("full", "an indexer shared across layers ('shared') is not supported"),
        "layer_types": ("indexed_attention", "only 'indexed_attention' layers are supported"),
    }
    for key, (value, why) in runs.items():
        given = config.get(key)
        if given is None:
            continue
        if not isinstance(given, list) or len(given) != layers:
            raise ConfigError(f"config.json: {key!r} must be a list of {layers} entries ('num_hidden_layers')")
        wanted = list(range(layers)) if value is None else [value] * layers
        if given != wanted:
            raise ConfigError(
                f"config.json: {key!r} {quoted(given)} is not supported by port.models.mistral_large4: {why}"
            )


def _rope_layers(config: dict, layers: int) -> tuple[bool, ...]:
    """Whether each layer rotates: `no_rope_layers` (1: RoPE, 0: NoPE), by default every
    layer but every 4th (transformers' `no_rope_layer_interval`)."""
    given = config.get("no_rope_layers")
    if given is None:
        return tuple((i + 1) % 4 != 0 for i in range(layers))
    if not isinstance(given, list) or len(given) < layers or any(isinstance(v, bool) or v not in (0, 1) for v in given):
        raise ConfigError(
            f"config.json: 'no_rope_layers' must be a list of at least {layers} 0 or 1 ('num_hidden_layers'), "
            f"got {quoted(given)}"
        )
    return tuple(v == 1 for v in given[:layers])


def _kinds(config: dict, layers: int) -> tuple[str, ...]:
    """Each layer's MLP, "dense" or "moe": `mlp_layer_types` ("dense" / "sparse"), or the
    first `first_k_dense_replace` dense and the rest MoE."""
    types = config.get("mlp_layer_types")
    if types is None:
        dense = min(non_negative(config, "first_k_dense_replace"), layers)
        return ("dense",) * dense + ("moe",) * (layers - dense)
    if not isinstance(types, list) or len(types) != layers or any(t not in ("dense", "sparse") for t in types):
        raise ConfigError(
            f"config.json: 'mlp_layer_types' must be a list of {layers} 'dense' or 'sparse', got {quoted(types)}"
        )
    return tuple("dense" if t == "dense" else "moe" for t in types)


@final
class MistralLarge4Indexer(eqx.Module):
    """Mistral Large 4's sparse-attention indexer (transformers' `MistralLarge4TextIndexer`):
    `port.nn`'s DeepSeek `Indexer` but for its queries, which come from the hidden state
    (a LayerNorm, then `wq_b`) and are scaled per head by position as the attention's are
    (before RoPE and the ReLU of the scores).

    Leaves (torch layouts): `wq` `[heads, dim, embd]` (`wq_b`), `q_norm` (a `LayerNorm`
    `[embd]`, `q_input_norm`), `wk` `[dim, embd]`, `k_norm`, `k_norm_bias` `[dim]` (a
    LayerNorm's `weight` and `bias`, eps 1e-6), `weights` `[heads, embd]` (`weights_proj`),
    `q_scale_slope` / `q_scale_bias` `[heads]` (`ssmax_scaling.s` / `.b`). RoPE on the
    first `rope_dim` dimensions, interleaved pairs."""

    wq: Float[Array, "index_heads index_dim embed"]
    q_norm: LayerNorm
    wk: Float[Array, "index_dim embed"]
    k_norm: Float[Array, " index_dim"]
    k_norm_bias: Float[Array, " index_dim"]
    weights: Float[Array, "index_heads embed"]
    q_scale_slope: Float[Array, " index_heads"]
    q_scale_bias: Float[Array, " index_heads"]
    top_k: int = eqx.field(static=True)

    def __init__(self, *, heads: int, dim: int, embd: int, top_k: int, dtype: Any, key: PRNGKeyArray):
        kq, kk, kw = jax.random.split(key, 3)
        self.wq = normal(kq, (heads, dim, embd), dtype)
        self.q_norm = LayerNorm(embd, eps=1e-6, dtype=dtype)
        self.wk = normal(kk, (dim, embd), dtype)
        self.k_norm, self.k_norm_bias = jnp.ones((dim,), dtype), jnp.zeros((dim,), dtype)
        self.weights = normal(kw, (heads, embd), dtype)
        self.q_scale_slope, self.q_scale_bias = jnp.zeros((heads,), dtype), jnp.ones((heads,), dtype)
        self.top_k = top_k

    @property
    def dim(self) -> int:
        """Each indexer head's size (`index_head_dim`): one cached key's."""
        return self.wk.shape[0]

    def keys(self, x: Float[Array, "batch seq embed"], cos: Array | None, sin: Array | None) -> Array:
        """The indexer's key of each token, `[batch, seq, dim]`: normed, then rotated."""
        k = layer_norm(jnp.einsum("bte,de->btd", x, self.wk), self.k_norm, self.k_norm_bias, 1e-6)
        return rotate(k[:, :, None], cos, sin, interleave=True)[:, :, 0]

    def select(
        self,
        x: Float[Array, "batch seq embed"],
        keys: Float[Array, "batch keys index_dim"],
        mask: Bool[Array, "batch seq keys"],
        cos: Array | None,
        sin: Array | None,
        log_positions: Float[Array, "batch seq"],
    ) -> Int[Array, "batch seq top"]:
        """The `min(top_k, keys)` keys each query attends to, best first (int32 indices), as
        `port.nn`'s `Indexer.select` scores them; no gradient flows through."""
        x, keys = jax.lax.stop_gradient(x), jax.lax.stop_gradient(keys)
        q = jnp.einsum("bte,hde->bthd", self.q_norm(x), self.wq)
        q = rotate(scaled(q, self.q_scale_slope, self.q_scale_bias, log_positions), cos, sin, interleave=True)
        f32 = jnp.float32
        scores = jax.nn.relu(jnp.einsum("bthd,bsd->bths", q.astype(f32), keys.astype(f32)) * self.dim**-0.5)
        weights = jnp.einsum("bte,he->bth", x.astype(f32), self.weights.astype(f32)) * self.wq.shape[0] ** -0.5
        index = jnp.where(mask, jnp.einsum("bth,bths->bts", weights, scores), -jnp.inf)
        return jax.lax.top_k(index, min(self.top_k, index.shape[-1]))[1].astype(jnp.int32)


def scaled(q: Array, slope: Array, bias: Array, log_positions: Array) -> Array:
    """Queries `[batch, seq, heads, dim]` times `slope[h] * log_positions + bias[h]`, in
    float32 and cast back (transformers computes it in the queries' dtype: in bfloat16 the
    float32 product is nearer float32's logits)."""
    f32 = jnp.float32
    factor = slope.astype(f32) * log_positions.astype(f32)[..., None] + bias.astype(f32)
    return (q.astype(f32) * factor[..., None]).astype(q.dtype)


@final
class ScaledLatentAttention(eqx.Module):
    """DeepSeek sparse latent attention (`port.nn`'s `LatentAttention` and `sparse_attend`)
    whose queries, after RoPE, are scaled per head by position, `q * (q_scale_slope[h] *
    log(position + 1) + q_scale_bias[h])` (see `scaled`), over the keys its
    `MistralLarge4Indexer` picks (every key while they are at most `index_topk`).
    `rotates` False: a NoPE layer, every query and key dimension non-rotary, nothing rotated
    (the latent attention's `rope_dim` 0).

    Called as a `port.nn.Block`'s attention, with `q_scale` `[batch, seq]` the log of each
    query's position plus one (from `port.nn.run_groups`). The cache holds the latent
    (keys) and the rotary key beside the indexer's key (values), as `SparseLatentAttention`'s."""

    mla: LatentAttention
    q_scale_slope: Float[Array, " heads"]
    q_scale_bias: Float[Array, " heads"]
    indexer: MistralLarge4Indexer
    rotates: bool = eqx.field(static=True)

    def __init__(self, c: MistralLarge4Config, dtype: Any, key: PRNGKeyArray, *, rotates: bool = True):
        kattn, kindex = jax.random.split(key)
        rope = c.qk_rope_head_dim if rotates else 0
        self.mla = LatentAttention(
            heads=c.num_attention_heads,
            embd=c.hidden_size,
            q_rank=None,
            kv_rank=c.kv_lora_rank,
            nope_dim=c.qk_nope_head_dim + c.qk_rope_head_dim - rope,
            rope_dim=rope,
            v_dim=c.v_head_dim,
            dtype=dtype,
            key=kattn,
            scale=c.scale,
            interleave=True,
            norm_eps=c.rms_norm_eps,
        )
        self.q_scale_slope = jnp.zeros((c.num_attention_heads,), dtype)
        self.q_scale_bias = jnp.ones((c.num_attention_heads,), dtype)
        self.indexer = MistralLarge4Indexer(
            heads=c.index_n_heads, dim=c.index_head_dim, embd=c.hidden_size, top_k=c.index_topk, dtype=dtype, key=kindex
        )
        self.rotates = rotates

    @property
    def cache_sizes(self) -> tuple[int, int, int]:
        """`(kv_heads, key size, value size)`: the latent, and the rotary and indexer keys."""
        heads, latent, rope = self.mla.cache_sizes
        return heads, latent, rope + self.indexer.dim

    def __call__(
        self,
        x: Float[Array, "batch seq embed"],
        mask: Bool[Array, "batch seq keys"],
        *,
        cos: Array | None = None,
        sin: Array | None = None,
        kv: KV | None = None,
        index: Array | None = None,
        q_scale: Float[Array, "batch seq"] | None = None,
    ) -> tuple[Float[Array, "batch seq embed"], KV | None]:
        assert q_scale is not None, "the queries' scale needs each position's log (q_scale)"
        if not self.rotates:  # a NoPE layer: neither the attention nor the indexer rotates
            cos = sin = None
        mla = self.mla
        q = scaled(mla.queries(x, cos, sin), self.q_scale_slope, self.q_scale_bias, q_scale)
        latent, rope = mla.latents(x, cos, sin)
        side = jnp.concatenate((rope, self.indexer.keys(x, cos, sin)[:, :, None].astype(rope.dtype)), axis=-1)
        latent, side, kv = with_cache(latent, side, kv, index)
        rope, keys = side[..., : mla.rope_dim], side[:, :, 0, mla.rope_dim :]
        if self.indexer.top_k >= latent.shape[1]:  # every key is chosen: latent attention itself
            return mla.attend(q, latent, rope, mask), kv
        chosen = self.indexer.select(x, keys, mask, cos, sin, q_scale)
        return sparse_attend(mla, q, latent, rope, mask, chosen), kv


def block(c: MistralLarge4Config, kind: str, dtype: Any, *, key: PRNGKeyArray) -> Block:
    """One layer: the scaled latent attention (without RoPE for a `kind` ending "_nope"), then a
    dense MLP (`kind` "dense...") or the experts ("moe...")."""
    kattn, kmlp = jax.random.split(key)
    if kind.startswith("dense"):
        mlp: GatedMLP | MoE = GatedMLP(
            embd=c.hidden_size, inner=c.intermediate_size, activation=c.hidden_act, dtype=dtype, key=kmlp
        )
    else:
        mlp = MoE(
            embd=c.hidden_size,
            inner=c.moe_intermediate_size,
            experts=c.num_local_experts,
            top_k=c.num_experts_per_tok,
            activation=c.hidden_act,
            dtype=dtype,
            key=kmlp,
            scoring="softmax",
            renormalise=True,
            groups=c.n_group,
            top_groups=c.topk_group,
            scale=c.routed_scaling_factor,
            shared_inner=c.moe_intermediate_size * c.n_shared_experts or None,
        )
    attn = ScaledLatentAttention(c, dtype, kattn, rotates=not kind.endswith("_nope"))
    return Block(attn, mlp, embd=c.hidden_size, eps=c.rms_norm_eps, dtype=dtype)


@final
class MistralLarge4(Decoder):
    """Mistral Large 4's language model: `dense` and `moe` stacks of blocks, and their NoPE
    layers' `dense_nope` and `moe_nope` (None where a kind has no layer), LeRoPE's
    `rope_alpha`, soft-capped logits.

    Called as every `port.nn.Decoder`: `model(input_ids, *, attention_mask=None, positions=None,
    segment_ids=None, cache=None, dtype=None, remat=None)`.
    """

    FIELDS: ClassVar[ConfigFields] = ConfigFields(
        "port.models.mistral_large4.MistralLarge4",
        read=(
            "vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size", "num_hidden_layers",
            "num_attention_heads", "num_key_value_heads", "n_shared_experts", "n_routed_experts",
            "num_local_experts", "routed_scaling_factor", "kv_lora_rank", "qk_rope_head_dim", "v_head_dim",
            "qk_nope_head_dim", "n_group", "topk_group", "num_experts_per_tok", "first_k_dense_replace",
            "mlp_layer_types", "hidden_act", "max_position_embeddings", "rms_norm_eps", "tie_word_embeddings",
            "rope_parameters", "rope_scaling", "rope_theta", "index_topk", "index_head_dim", "index_n_heads",
            "no_rope_layers", "kv_source_layers", "indexer_types", "layer_types", "final_logit_softcapping",
            "head_dim", "qk_head_dim",  # derived: transformers recomputes both from the head sizes above
        ),
        fixed={"attention_bias": (False,)},
    )  # fmt: skip

    embed: Float[Array, "vocab embed"]
    rope_alpha: Float[Array, " half_rotary"]
    dense: Block | None
    moe: Block | None
    dense_nope: Block | None
    moe_nope: Block | None
    norm: Float[Array, " embed"]
    lm_head: Float[Array, "vocab embed"] | None
    config: MistralLarge4Config = eqx.field(static=True)

    def __init__(self, config: MistralLarge4Config, *, key: PRNGKeyArray, dtype: Any = jnp.float32):
        kembed, kdense, kmoe, kdense_nope, kmoe_nope = jax.random.split(key, 5)
        self.embed, self.lm_head = embeddings(
            kembed, vocab=config.vocab_size, embd=config.hidden_size, dtype=dtype, tied=config.tie_word_embeddings
        )
        self.rope_alpha = jnp.zeros((config.qk_rope_head_dim // 2,), jnp.float32)
        counts = {kind: config.kinds.count(kind) for kind in KINDS}

        def make(kind, k):
            return stacked(lambda kk: block(config, kind, dtype, key=kk), k, counts[kind]) if counts[kind] else None

        self.dense, self.moe = make("dense", kdense), make("moe", kmoe)
        self.dense_nope, self.moe_nope = make("dense_nope", kdense_nope), make("moe_nope", kmoe_nope)
        self.norm = jnp.ones((config.hidden_size,), dtype)
        self.config = config

    @classmethod
    def from_config(cls, config: dict, *, key: PRNGKeyArray, dtype: Any = jnp.float32) -> MistralLarge4:
        """Randomly initialise from a Hugging Face `config.json` dict (model_type mistral_large4,
        or its text config's mistral_large4_text)."""
        return cls(MistralLarge4Config.from_hf(config), key=key, dtype=dtype)

    @property
    def layer_groups(self) -> dict[str, tuple[int, ...]]:
        """The checkpoint layers each stack holds, by `mlp_layer_types` and `no_rope_layers`."""
        kinds = self.config.kinds
        return {kind: tuple(i for i, k in enumerate(kinds) if k == kind) for kind in KINDS}

    def init_cache(self, batch: int, length: int, dtype: Any = None) -> Cache:
        """An empty cache by layer kind: per layer, the latent (`kv_lora_rank`) as keys, the
        rotated shared key and the indexer's key (`qk_rope_head_dim + index_head_dim`) as
        values, `[layers, batch, length, 1, size]`."""
        if dtype is None:
            dtype = self.embed.dtype
        c = self.config
        keys, values = {}, {}
        for kind, ids in self.layer_groups.items():
            if ids:
                rope = 0 if kind.endswith("_nope") else c.qk_rope_head_dim
                keys[kind] = jnp.zeros((len(ids), batch, length, 1, c.kv_lora_rank), dtype)
                values[kind] = jnp.zeros((len(ids), batch, length, 1, rope + c.index_head_dim), dtype)
        return Cache.of(keys, values, batch=batch, length=length)

    def angles(self, positions: Array, dtype: Any) -> tuple[Array, Array]:
        """cos and sin of LeRoPE: the RoPE's inverse frequencies times `exp(rope_alpha)`, in
        float32 as transformers computes them, then cast to `dtype`."""
        rope = self.config.rope
        inv_freq = jnp.asarray(rope.inv_freq()) * jnp.exp(self.rope_alpha.astype(jnp.float32))
        freqs = positions.astype(jnp.float32)[..., None] * inv_freq
        angles = jnp.concatenate((freqs, freqs), axis=-1)
        scale = np.float32(rope.attention_factor)
        return (jnp.cos(angles) * scale).astype(dtype), (jnp.sin(angles) * scale).astype(dtype)

    def logits(self, tokens: Tokens, remat: Any) -> tuple[Array, tuple[Any, Any, Any]]:
        """Embed, the layers in order, the final norm, the head and its soft cap."""
        c = self.config
        x = self.embed[tokens.ids]
        cos, sin = self.angles(tokens.positions, x.dtype)
        log_positions = jnp.log(tokens.positions.astype(jnp.float32) + 1)
        groups = {"dense": self.dense, "moe": self.moe, "dense_nope": self.dense_nope, "moe_nope": self.moe_nope}
        x, cache = run_groups(groups, c.kinds, x, tokens, cos=cos, sin=sin, q_scale=log_positions, remat=remat)
        logits = head(rms_norm(x, self.norm, c.rms_norm_eps), self.embed, self.lm_head)
        if c.softcap is not None:
            logits = jnp.tanh(logits / c.softcap) * c.softcap
        return logits, cache
