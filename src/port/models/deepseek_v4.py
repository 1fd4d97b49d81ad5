"""DeepSeek-V4 (`model_type` "deepseek_v4"): compressed attention, hyper-connections, hash-routed MoE.

What is new in the family, all else from `port.nn`:

- Attention by `layer_types` (`port.nn.CompressedAttention`): every layer a sliding
  window over one shared key/value head with a learned sink per head and a grouped
  low-rank output projection; `compressed_sparse_attention` layers add entries pooled
  from every `compress_rates[...]` tokens, of which a lightning indexer keeps the
  `index_topk` best per query; `heavily_compressed_attention` layers add every entry
  (of a much larger rate). Sliding layers rotate with `rope_theta`, the others with the
  `compress` RoPE (`compress_rope_theta`, YaRN where `rope_parameters` says so).
- Manifold-constrained hyper-connections (`port.nn.HyperConnection`, `HyperHead`): a
  residual of `hc_mult` streams, collapsed before each branch and mixed after it.
- Every layer a `port.nn.MoE` with `sqrtsoftplus` scores, a selection bias,
  renormalised weights times `routed_scaling_factor`, one shared expert and the clamped
  SwiGLU (`swiglu_limit`) in every expert; `hash_moe` layers (`mlp_layer_types`) take
  their experts from a table by token id (`tid2eid`) instead of the router's top k.
- Layers are stacked by kind: attention type x MLP type (`sliding_hash`, `csa_moe`, ...).

The cache (`init_cache`) keeps what transformers' `DeepseekV4HCACache` / `DeepseekV4CSACache`
keep, in fixed-size buffers: every layer's sliding keys, and each compressor's (and
indexer's) slots of its last whole window and unfinished one, and the entries made so far.
Packed `segment_ids` are refused in one line (windows are counted in slots from the row's
start, as transformers counts them).

Example:
    ```python
    import jax
    import jax.numpy as jnp
    from port.models.deepseek_v4 import DeepseekV4

    small = {"model_type": "deepseek_v4", "vocab_size": 100, "hidden_size": 48, "moe_intermediate_size": 32,
             "num_hidden_layers": 4, "num_attention_heads": 4, "head_dim": 16, "q_lora_rank": 24,
             "partial_rotary_factor": 0.5, "n_routed_experts": 4, "num_experts_per_tok": 2, "hc_mult": 2,
             "o_groups": 2, "o_lora_rank": 12, "index_n_heads": 2, "index_head_dim": 8, "index_topk": 2,
             "sliding_window": 4, "compress_rates": {"compressed_sparse_attention": 2,
                                                     "heavily_compressed_attention": 4}}
    model = DeepseekV4.from_config(small, key=jax.random.key(0))
    model(jnp.zeros((1, 8), dtype=jnp.int32)).shape          # (1, 8, 100)
    model.layer_groups                                        # {'hca_hash': (0, 1, 2), 'csa_moe': (3,)}
    ```
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Any, ClassVar, final

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int, PRNGKeyArray

from port._errors import ConfigError
from port._text import quoted
from port.nn import Cache, Decoder, MoE, Rope, Tokens, embeddings, head, read_rope, rms_norm, scan, stacked
from port.nn._cache import check_sizes
from port.nn._compressed import CompressedAttention
from port.nn._hyper import HyperConnection, HyperHead
from port.nn.config import MAX_LAYERS, ConfigFields, activation, check, check_model_type, get

MODEL_TYPES = ("deepseek_v4",)
ATTENTIONS = {
    "sliding_attention": "sliding",
    "compressed_sparse_attention": "csa",
    "heavily_compressed_attention": "hca",
}
"""`layer_types` values -> port's short names (the stacks' prefixes)."""
MLPS = {"hash_moe": "hash", "moe": "moe"}
"""`mlp_layer_types` values -> port's short names (the stacks' suffixes)."""
KINDS = tuple(f"{a}_{m}" for a in ATTENTIONS.values() for m in MLPS.values())
"""Every layer kind: attention type x MLP type, one stack each."""
SCORINGS = ("sqrtsoftplus", "sigmoid")

# DeepseekV4Config's defaults, used where config.json omits a key.
_DEFAULTS: dict[str, Any] = {
    "vocab_size": 129280,
    "hidden_size": 4096,
    "moe_intermediate_size": 2048,
    "num_hidden_layers": 43,
    "num_attention_heads": 64,
    "head_dim": 512,
    "q_lora_rank": 1024,
    "num_experts_per_tok": 6,
    "n_routed_experts": 256,
    "scoring_func": "sqrtsoftplus",
    "routed_scaling_factor": 1.5,
    "max_position_embeddings": 1048576,
    "rope_theta": 10000.0,
    "compress_rope_theta": 160000.0,
    "hc_mult": 4,
    "hc_sinkhorn_iters": 20,
    "hc_eps": 1.0e-6,
    "swiglu_limit": 10.0,
    "sliding_window": 128,
    "o_groups": 8,
    "o_lora_rank": 1024,
    "index_n_heads": 64,
    "index_head_dim": 128,
    "index_topk": 512,
    "hidden_act": "silu",
    "rms_norm_eps": 1.0e-6,
    "tie_word_embeddings": False,
}
_COMPRESS_RATES = {"compressed_sparse_attention": 4, "heavily_compressed_attention": 128}
_HASH_LAYERS = 3


@final
@dataclasses.dataclass(frozen=True)
class DeepseekV4Config:
    """The hyperparameters of a DeepSeek-V4 model, as read from a config.json (transformers' names).

    ```python
    c = DeepseekV4Config.from_hf({"model_type": "deepseek_v4", "num_hidden_layers": 4})
    c.kinds                  # ('hca_hash', 'hca_hash', 'hca_hash', 'csa_moe')
    ```
    """

    vocab_size: int
    hidden_size: int
    moe_intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    head_dim: int
    q_lora_rank: int
    num_experts_per_tok: int
    n_routed_experts: int
    scoring_func: str
    routed_scaling_factor: float
    layer_types: tuple[str, ...]
    mlp_layer_types: tuple[str, ...]
    compress_rates: tuple[tuple[str, int], ...]
    hc_mult: int
    hc_sinkhorn_iters: int
    hc_eps: float
    swiglu_limit: float
    sliding_window: int
    o_groups: int
    o_lora_rank: int
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    rope: Rope  # sliding layers'
    compress_rope: Rope  # compressed layers', their entries' and the indexer's
    hidden_act: str = "silu"
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False

    @property
    def num_key_value_heads(self) -> int:
        """One shared key/value head."""
        return 1

    @property
    def kinds(self) -> tuple[str, ...]:
        """Each layer's kind, `<attention>_<mlp>` (`KINDS`), in order."""
        return tuple(f"{ATTENTIONS[a]}_{MLPS[m]}" for a, m in zip(self.layer_types, self.mlp_layer_types))

    @classmethod
    def from_hf(cls, config: dict) -> DeepseekV4Config:
        """Build from a Hugging Face `config.json` dict; raises a one-line `ConfigError` naming
        the key for anything missing, malformed or contradictory."""
        check_model_type(config, MODEL_TYPES, "port.models.deepseek_v4")
        DeepseekV4.FIELDS.check(config)
        c = {**_DEFAULTS, **{k: v for k, v in config.items() if v is not None}}
        if "n_routed_experts" not in config and config.get("num_local_experts") is not None:
            c["n_routed_experts"] = config["num_local_experts"]
        layers = get(c, "num_hidden_layers", int, maximum=MAX_LAYERS)
        heads, head_dim = get(c, "num_attention_heads", int), get(c, "head_dim", int)
        c = _legacy(c, head_dim)
        groups = get(c, "o_groups", int)
        if (heads * head_dim) % groups:
            raise ConfigError(
                f"config.json: 'o_groups' ({groups}) must divide the {heads * head_dim} features of all heads "
                "('num_attention_heads' x 'head_dim')"
            )
        experts, top_k = get(c, "n_routed_experts", int), get(c, "num_experts_per_tok", int)
        if top_k > experts:
            raise ConfigError(
                f"config.json: 'num_experts_per_tok' ({top_k}) is more than 'n_routed_experts' ({experts})"
            )
        scoring = c["scoring_func"]
        if scoring not in SCORINGS:
            raise ConfigError(
                f"config.json: 'scoring_func' {quoted(scoring)} is not supported by port.models.deepseek_v4 "
                f"(supported: {', '.join(SCORINGS)})"
            )
        rope, compress_rope = _ropes(config, c, head_dim)
        index_dim = get(c, "index_head_dim", int)
        if index_dim < compress_rope.rotary_dim:
            raise ConfigError(
                f"config.json: 'index_head_dim' ({index_dim}) is smaller than the rotary part of a head "
                f"({compress_rope.rotary_dim})"
            )
        return cls(
            vocab_size=get(c, "vocab_size", int),
            hidden_size=get(c, "hidden_size", int),
            moe_intermediate_size=get(c, "moe_intermediate_size", int),
            num_hidden_layers=layers,
            num_attention_heads=heads,
            head_dim=head_dim,
            q_lora_rank=get(c, "q_lora_rank", int),
            num_experts_per_tok=top_k,
            n_routed_experts=experts,
            scoring_func=scoring,
            routed_scaling_factor=get(c, "routed_scaling_factor", float),
            layer_types=_schedule(c, "layer_types", ATTENTIONS, _default_layer_types(layers), layers),
            mlp_layer_types=_schedule(c, "mlp_layer_types", MLPS, _default_mlp_types(layers), layers),
            compress_rates=_compress_rates(c),
            hc_mult=get(c, "hc_mult", int),
            hc_sinkhorn_iters=get(c, "hc_sinkhorn_iters", int),
            hc_eps=get(c, "hc_eps", float),
            swiglu_limit=get(c, "swiglu_limit", float),
            sliding_window=get(c, "sliding_window", int),
            o_groups=groups,
            o_lora_rank=get(c, "o_lora_rank", int),
            index_n_heads=get(c, "index_n_heads", int),
            index_head_dim=index_dim,
            index_topk=get(c, "index_topk", int),
            rope=rope,
            compress_rope=compress_rope,
            hidden_act=activation(c, "hidden_act", "silu"),
            rms_norm_eps=get(c, "rms_norm_eps", float),
            tie_word_embeddings=get(c, "tie_word_embeddings", bool),
        )

    def rate(self, layer_type: str) -> int | None:
        """The compression rate of a `layer_types` value (None: a sliding layer)."""
        return dict(self.compress_rates).get(layer_type)


_RATIO_TYPES = {0: "sliding_attention", 4: "compressed_sparse_attention", 128: "heavily_compressed_attention"}
"""An older config's `compress_ratios` entry -> its `layer_types` value (transformers' table)."""


def _legacy(c: dict, head_dim: int) -> dict:
    """Older DeepSeek-V4 configs' fields folded in as transformers' `DeepseekV4Config` folds them:
    `compress_rate_csa` / `compress_rate_hca` into `compress_rates`, `compress_ratios` (0, 4 or
    128 per layer) into `layer_types`, `num_hash_layers` into `mlp_layer_types`,
    `qk_rope_head_dim` into `partial_rotary_factor`; a field of the new name wins."""
    c = dict(c)
    rates = c.get("compress_rates")
    for key, layer_type in (("compress_rate_csa", "compressed_sparse_attention"),
                            ("compress_rate_hca", "heavily_compressed_attention")):  # fmt: skip
        if key in c:
            rates = {**(rates if isinstance(rates, dict) else {}), layer_type: c[key]}
    if rates is not None:
        c["compress_rates"] = rates
    ratios = c.get("compress_ratios")
    if "layer_types" not in c and ratios is not None:
        if not isinstance(ratios, list) or any(type(r) is not int or r not in _RATIO_TYPES for r in ratios):
            raise ConfigError(
                f"config.json: 'compress_ratios' must list 0, 4 or 128 for each layer, got {quoted(ratios)}"
            )
        c["layer_types"] = [_RATIO_TYPES[r] for r in ratios]
    if "mlp_layer_types" not in c and "num_hash_layers" in c:
        layers, hashed = c["num_hidden_layers"], get(c, "num_hash_layers", int)
        c["mlp_layer_types"] = ["hash_moe"] * min(layers, hashed) + ["moe"] * max(0, layers - hashed)
    if "partial_rotary_factor" not in c and "qk_rope_head_dim" in c:
        c["partial_rotary_factor"] = get(c, "qk_rope_head_dim", int) / head_dim
    return c


def _default_layer_types(layers: int) -> list[str]:
    """transformers' default: two HCA layers, then HCA and CSA in turn."""
    rest = [
        "compressed_sparse_attention" if i % 2 else "heavily_compressed_attention" for i in range(max(layers - 2, 0))
    ]
    return ["heavily_compressed_attention"] * min(layers, 2) + rest


def _default_mlp_types(layers: int) -> list[str]:
    """transformers' default: three hash-routed layers, then routed ones."""
    return ["hash_moe"] * min(layers, _HASH_LAYERS) + ["moe"] * max(0, layers - _HASH_LAYERS)


def _schedule(c: dict, key: str, allowed: dict[str, str], default: list[str], layers: int) -> tuple[str, ...]:
    """A per-layer list of `allowed` values, `layers` long."""
    value = c.get(key, default)
    if isinstance(value, list):
        value = value[:layers]  # transformers cuts a longer list (one naming the MTP layer too)
    if not isinstance(value, list) or len(value) != layers or any(v not in allowed for v in value):
        raise ConfigError(
            f"config.json: {key!r} must list one of {', '.join(allowed)} for each of the {layers} layers, "
            f"got {quoted(value)}"
        )
    return tuple(value)


def _compress_rates(c: dict) -> tuple[tuple[str, int], ...]:
    """`compress_rates` by compressed layer type (transformers' defaults for the ones it omits)."""
    rates = c.get("compress_rates") or {}
    if not isinstance(rates, dict) or set(rates) - set(_COMPRESS_RATES):
        raise ConfigError(
            f"config.json: 'compress_rates' must map {' and '.join(_COMPRESS_RATES)} to rates, got {quoted(rates)}"
        )
    merged = {**_COMPRESS_RATES, **rates}
    return tuple((k, check(f"compress_rates.{k}", v, int)) for k, v in merged.items())


def _ropes(config: dict, c: dict, head_dim: int) -> tuple[Rope, Rope]:
    """The sliding layers' RoPE (`main`) and the compressed ones' (`compress`), as transformers nests them."""
    nested = config.get("rope_parameters")
    factor = c.get("partial_rotary_factor", 64 / 512)
    maximum = get(c, "max_position_embeddings", int)
    if isinstance(nested, dict) and isinstance(nested.get("main"), dict) and isinstance(nested.get("compress"), dict):
        main, compress = nested["main"], nested["compress"]
    else:
        flat = {k: v for k, v in (nested or {}).items() if k not in ("main", "compress")}
        main = {"rope_type": "default", "rope_theta": c["rope_theta"], "partial_rotary_factor": factor}
        compress = {
            "rope_type": "default",
            **flat,
            "rope_theta": c["compress_rope_theta"],
            "partial_rotary_factor": factor,
        }
        if compress["rope_type"] == "yarn":
            compress.setdefault("attention_factor", 1.0)
    rope = _read_rope(main, head_dim, ("default",), maximum)
    compress_rope = _read_rope(compress, head_dim, ("default", "yarn"), maximum)
    return rope, compress_rope


def _read_rope(params: dict, head_dim: int, supported: tuple[str, ...], maximum: int) -> Rope:
    """One of the two RoPEs. A plain one is built as transformers builds it, whatever its size:
    `int(head_dim * partial_rotary_factor)` features, rounded up to whole pairs (`_half`)."""
    if params.get("rope_type", "default") == "default":
        factor = check("rope_parameters.partial_rotary_factor", params.get("partial_rotary_factor", 1.0), float)
        theta = check("rope_parameters.rope_theta", params.get("rope_theta", 10000.0), float)
        return Rope(theta=theta, rotary_dim=max(1, min(head_dim, int(head_dim * factor))))
    return read_rope(
        {"rope_parameters": params}, head_dim, supported=supported, max_position_embeddings=maximum, allow_partial=True
    )


@final
class DeepseekV4Block(eqx.Module):
    """One layer: hyper-connections around the compressed attention and around the MoE.

    Called on the streams, the sliding window's mask and the layer's `Context`.
    """

    attn_hc: HyperConnection
    attn_norm: Float[Array, " embed"]
    attn: CompressedAttention
    ffn_hc: HyperConnection
    ffn_norm: Float[Array, " embed"]
    mlp: MoE
    tid2eid: Int[Array, "vocab hash_experts"] | None
    kind: str = eqx.field(static=True)
    eps: float = eqx.field(static=True)

    def __init__(self, c: DeepseekV4Config, kind: str, dtype: Any, *, key: PRNGKeyArray):
        attention, mlp = kind.split("_")
        layer_type = {v: k for k, v in ATTENTIONS.items()}[attention]
        ka, km, kh1, kh2 = jax.random.split(key, 4)
        index = None
        if attention == "csa":
            index = {"heads": c.index_n_heads, "dim": c.index_head_dim, "topk": c.index_topk}
        self.attn = CompressedAttention(
            heads=c.num_attention_heads,
            head_dim=c.head_dim,
            embd=c.hidden_size,
            q_rank=c.q_lora_rank,
            groups=c.o_groups,
            group_rank=c.o_lora_rank,
            rate=c.rate(layer_type),
            overlap=attention == "csa",
            index=index,
            eps=c.rms_norm_eps,
            dtype=dtype,
            key=ka,
        )
        self.mlp = MoE(
            embd=c.hidden_size,
            inner=c.moe_intermediate_size,
            experts=c.n_routed_experts,
            top_k=c.num_experts_per_tok,
            activation=c.hidden_act,
            dtype=dtype,
            key=km,
            scoring=c.scoring_func,
            selection_bias=mlp == "moe",
            scale=c.routed_scaling_factor,
            shared_inner=c.moe_intermediate_size,
            limit=c.swiglu_limit,
            alpha=None,
        )
        self.tid2eid = jnp.zeros((c.vocab_size, c.num_experts_per_tok), jnp.int32) if mlp == "hash" else None
        hc = {"streams": c.hc_mult, "embd": c.hidden_size, "iterations": c.hc_sinkhorn_iters, "eps": c.hc_eps}
        self.attn_hc = HyperConnection(**hc, norm_eps=c.rms_norm_eps, key=kh1)
        self.ffn_hc = HyperConnection(**hc, norm_eps=c.rms_norm_eps, key=kh2)
        self.attn_norm, self.ffn_norm = jnp.ones((c.hidden_size,), jnp.float32), jnp.ones((c.hidden_size,), jnp.float32)
        self.kind, self.eps = kind, c.rms_norm_eps

    def __call__(
        self, x: Float[Array, "batch seq hc embed"], mask: Bool[Array, "batch seq keys"], ctx: Context, kv: Any = None
    ) -> tuple[Float[Array, "batch seq hc embed"], Any]:
        """The streams after this layer, and this layer's cache after them (`kv`: its sliding
        keys and compressors' state, from `init_cache`; None: no cache, None back); `mask`
        the sliding window's."""
        rope = ctx.sliding if self.kind.startswith("sliding") else ctx.compressed
        post, comb, h = self.attn_hc(x)
        h = rms_norm(h, self.attn_norm, self.eps, float32_scale=True)
        if kv is None or ctx.start is None:
            out = self.attn(h, mask, ctx.positions, rope, ctx.angles)
        else:
            keys, state = kv
            out, keys, state = self.attn.cached(h, mask, ctx.positions, rope, ctx.angles, keys, state, ctx.start)
            kv = (keys, state)
        x = HyperConnection.mix(x, out, post, comb)
        return self.mlp_part(x, ctx), kv

    def mlp_part(self, x: Float[Array, "batch seq hc embed"], ctx: Context) -> Float[Array, "batch seq hc embed"]:
        """The hyper-connected MoE (hash-routed by the token ids where the layer is)."""
        post, comb, h = self.ffn_hc(x)
        h = rms_norm(h, self.ffn_norm, self.eps, float32_scale=True)
        chosen = None if self.tid2eid is None else self.tid2eid[ctx.ids]
        return HyperConnection.mix(x, self.mlp(h, chosen), post, comb)


@final
class Context(eqx.Module):
    """What every layer reads besides its input: positions, ids (hash routing), both RoPEs."""

    positions: Int[Array, "batch seq"]
    ids: Int[Array, "batch seq"]
    sliding: tuple[Array, Array]
    compressed: tuple[Array, Array]
    compress_rope: Rope = eqx.field(static=True)
    dtype: Any = eqx.field(static=True)
    start: Int[Array, ""] | None = None  # with a cache: the first slot of the call's tokens

    def angles(self, positions: Int[Array, "batch n"]) -> tuple[Array, Array]:
        """The compressed RoPE's half-size `(cos, sin)` at `positions`."""
        return _half(self.compress_rope, positions, self.dtype)


def _half(rope: Rope, positions: Array, dtype: Any) -> tuple[Array, Array]:
    """`rope`'s cos and sin, one per interleaved pair (`rotary_dim // 2`)."""
    cos, sin = rope.angles(positions, dtype)
    half = (rope.rotary_dim + 1) // 2  # transformers' `arange(0, dim, 2)`
    return cos[..., :half], sin[..., :half]


def run_kinds(
    groups: dict[str, DeepseekV4Block | None],
    kinds: tuple[str, ...],
    x: Array,
    mask: Bool[Array, "batch seq keys"] | None,
    ctx: Context,
    remat: Any,
    cache: tuple[dict[str, Array], dict[str, Any]] | None = None,
) -> tuple[Array, tuple[dict[str, Array], dict[str, Any]] | None]:
    """The layers in order: each run of one kind a scan over its stack's layers; with a
    `cache` (keys and states by kind, as `DeepseekV4.init_cache` makes them), each layer's
    entries read and written back."""
    taken = dict.fromkeys(groups, 0)
    keys, states = (None, None) if cache is None else (dict(cache[0]), dict(cache[1]))
    for kind, run in itertools.groupby(kinds):
        length, first = len(list(run)), taken[kind]
        params, static = eqx.partition(groups[kind], eqx.is_array)
        rows = lambda tree, i=first, n=length: jax.tree.map(lambda a: a[i : i + n], tree)  # noqa: E731
        blocks = eqx.combine(rows(params), static)
        if keys is None or states is None:
            x, _ = scan(lambda block, h: (block(h, mask, ctx)[0], None), x, blocks, remat=remat)
        else:
            x, (k, s) = scan(
                lambda block, h, kv: block(h, mask, ctx, kv),
                x,
                blocks,
                (rows(keys[kind]), rows(states[kind])),
                remat=remat,
            )
            put = lambda whole, part, i=first: whole.at[i : i + part.shape[0]].set(part)  # noqa: E731
            keys[kind], states[kind] = put(keys[kind], k), jax.tree.map(put, states[kind], s)
        taken[kind] += length
    return x, None if keys is None or states is None else (keys, states)


@final
class DeepseekV4(Decoder):
    """DeepSeek-V4 causal LM: one stack of blocks per layer kind (`KINDS`; None where no layer has it).

    Called as every `port.nn.Decoder`, without packed `segment_ids` (a one-line refusal).
    """

    FIELDS: ClassVar[ConfigFields] = ConfigFields(
        "port.models.deepseek_v4.DeepseekV4",
        read=(
            "vocab_size", "hidden_size", "moe_intermediate_size", "intermediate_size", "num_hidden_layers",
            "num_attention_heads", "head_dim", "q_lora_rank", "num_experts_per_tok", "n_routed_experts",
            "num_local_experts", "scoring_func", "routed_scaling_factor", "max_position_embeddings",
            "rope_theta", "layer_types", "compress_rates", "compress_rope_theta", "hc_mult",
            "hc_sinkhorn_iters", "hc_eps", "mlp_layer_types", "swiglu_limit", "sliding_window", "o_groups",
            "o_lora_rank", "index_n_heads", "index_head_dim", "index_topk", "hidden_act", "rms_norm_eps",
            "tie_word_embeddings", "rope_parameters", "partial_rotary_factor",
            # older configs' names, folded in as transformers folds them (_legacy)
            "qk_rope_head_dim", "compress_ratios", "compress_rate_csa", "compress_rate_hca", "num_hash_layers",
            "norm_topk_prob",  # transformers' V4 router renormalises whatever it says
            "num_nextn_predict_layers",  # multi-token prediction modules: not built
            # transformers' V4 runs one shared key/value head, one shared expert and unbiased
            # attention projections whatever these say
            "num_key_value_heads", "n_shared_experts", "attention_bias",
        ),
        fixed={"mlp_bias": (False,)},
    )  # fmt: skip

    embed: Float[Array, "vocab embed"]
    sliding_hash: DeepseekV4Block | None
    sliding_moe: DeepseekV4Block | None
    csa_hash: DeepseekV4Block | None
    csa_moe: DeepseekV4Block | None
    hca_hash: DeepseekV4Block | None
    hca_moe: DeepseekV4Block | None
    hc_head: HyperHead
    norm: Float[Array, " embed"]
    lm_head: Float[Array, "vocab embed"] | None
    config: DeepseekV4Config = eqx.field(static=True)

    def __init__(self, config: DeepseekV4Config, *, key: PRNGKeyArray, dtype: Any = jnp.float32):
        kembed, khead, *kinds = jax.random.split(key, 2 + len(KINDS))
        self.embed, self.lm_head = embeddings(
            kembed, vocab=config.vocab_size, embd=config.hidden_size, dtype=dtype, tied=config.tie_word_embeddings
        )
        for kind, k in zip(KINDS, kinds):
            count = config.kinds.count(kind)
            blocks = (
                stacked(lambda kk, kind=kind: DeepseekV4Block(config, kind, dtype, key=kk), k, count) if count else None
            )
            setattr(self, kind, blocks)
        self.hc_head = HyperHead(
            streams=config.hc_mult, embd=config.hidden_size, eps=config.hc_eps, norm_eps=config.rms_norm_eps, key=khead
        )
        self.norm = jnp.ones((config.hidden_size,), jnp.float32)
        self.config = config

    @classmethod
    def from_config(cls, config: dict, *, key: PRNGKeyArray, dtype: Any = jnp.float32) -> DeepseekV4:
        """Randomly initialise from a Hugging Face `config.json` dict (model_type deepseek_v4)."""
        return cls(DeepseekV4Config.from_hf(config), key=key, dtype=dtype)

    @property
    def layer_groups(self) -> dict[str, tuple[int, ...]]:
        """The checkpoint layers each stack holds, by kind (only the kinds some layer has)."""
        kinds = self.config.kinds
        return {kind: tuple(i for i, k in enumerate(kinds) if k == kind) for kind in KINDS if kind in kinds}

    @property
    def cache_sizes(self) -> tuple[int, int, int]:
        c = self.config
        return c.num_hidden_layers, 1, c.head_dim

    def init_cache(self, batch: int, length: int, dtype: Any = None) -> Cache:
        """An empty cache by layer kind: every layer's sliding keys (which are its values;
        every slot kept, `[layers, batch, length, head_dim]`) as `keys`, and as `states` its
        compressors' (the slots of their last whole window and unfinished one, and room for
        every entry: `CompressedAttention.empty_state`); fixed sizes, so a decode step
        compiles once."""
        check_sizes(batch, length)
        if dtype is None:
            dtype = self.embed.dtype
        keys, states = {}, {}
        for kind in self.layer_groups:
            block = getattr(self, kind)
            count = len(self.layer_groups[kind])
            keys[kind] = jnp.zeros((count, batch, length, self.config.head_dim), dtype)
            one = block.attn.empty_state(batch, length, dtype)  # a stack's statics are one layer's
            states[kind] = jax.tree.map(lambda a, n=count: jnp.broadcast_to(a, (n, *a.shape)), one)
        return Cache.of(keys, None, states, batch=batch, length=length)

    def __call__(self, input_ids: Any, *, segment_ids: Any = None, **kwargs: Any) -> Any:
        if segment_ids is not None:
            raise ValueError(
                "`segment_ids` is not supported by port.models.deepseek_v4: its compressed attention pools "
                "windows of slots across segments"
            )
        return super().__call__(input_ids, **kwargs)

    def logits(self, tokens: Tokens, remat: Any) -> tuple[Array, tuple[Any, ...]]:
        """Embed into `hc_mult` streams, the layers in order, the last collapse, the norm and the head."""
        c = self.config
        x = self.embed[tokens.ids]
        ctx = Context(
            positions=tokens.positions,
            ids=tokens.ids,
            sliding=_half(c.rope, tokens.positions, x.dtype),
            compressed=_half(c.compress_rope, tokens.positions, x.dtype),
            compress_rope=c.compress_rope,
            dtype=x.dtype,
            start=tokens.index,
        )
        streams = jnp.broadcast_to(x[:, :, None, :], (*x.shape[:2], c.hc_mult, x.shape[-1]))
        cache = None if tokens.cache is None else (tokens.cache.keys, tokens.cache.states)
        groups = {kind: getattr(self, kind) for kind in KINDS}
        streams, cache = run_kinds(groups, c.kinds, streams, tokens.sliding, ctx, remat, cache)
        x = rms_norm(self.hc_head(streams), self.norm, c.rms_norm_eps, float32_scale=True)
        keys, states = (None, None) if cache is None else cache
        return head(x, self.embed, self.lm_head), (keys, None, states)
