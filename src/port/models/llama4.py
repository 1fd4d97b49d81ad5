"""Llama 4's language model (`Llama4ForCausalLM`, and the text half of `Llama4ForConditionalGeneration`).

What is new against port's Llama, and lives here:

- **Two kinds of layer.** Every `interleave_moe_layer_step`-th layer (or the layers
  `moe_layers` lists) has a mixture of experts, the others a dense SwiGLU of
  `intermediate_size_mlp`. Each kind is its own stack (`Llama4.dense`, `Llama4.moe`,
  None for a kind no layer has), the model's `layer_groups` say which checkpoint layers
  each holds, and `port.nn.run_groups` runs them in checkpoint order.
- **Llama 4's MoE**: top-k of the router's logits, each weighted by the sigmoid of its
  logit, the weight multiplying the expert's *input* (not its output), plus a shared
  SwiGLU expert on every token: `port.nn.MoE` with `weight_inputs`. Only the chosen
  experts run.
- **NoPE layers** (`no_rope_layers`: 1 rotates, 0 does not). The rotating layers attend
  in chunks of `attention_chunk_size` (a token sees the keys of its own chunk, causally:
  `chunk_mask`); the others see every earlier key, with queries scaled by the attention
  temperature `log1p(floor((slot + 1) / floor_scale)) * attn_scale + 1`
  (`attn_temperature_tuning`) and without the L2 norm of q and k that the rotating
  layers take (`use_qk_norm`).
- **RoPE on adjacent pairs.** transformers views each head as `head_dim / 2` complex
  numbers `(x[2i], x[2i+1])` and multiplies them by `e^{i p f_i}`: dimension pairs are
  adjacent, not the halves `apply_rope` rotates. port rotates adjacent pairs itself
  (`rotate_pairs`, in float32 as transformers) rather than permuting the checkpoint's
  q/k rows: the parameters and the cache keep the checkpoint's layout, so loading and
  export are plain copies. The frequencies are `Rope`'s (`rope_type` default, linear,
  llama3 or yarn).

Example:
    ```python
    import equinox as eqx
    import jax
    import jax.numpy as jnp
    from port.models.llama4 import Llama4

    config = {"model_type": "llama4_text", "vocab_size": 202048, "hidden_size": 5120,
              "intermediate_size": 8192, "intermediate_size_mlp": 16384, "num_hidden_layers": 48,
              "num_attention_heads": 40, "num_key_value_heads": 8, "head_dim": 128,
              "num_local_experts": 16, "interleave_moe_layer_step": 1}
    # Shapes only, no memory allocated (e.g. before loading a checkpoint):
    abstract = eqx.filter_eval_shape(Llama4.from_config, config, key=jax.random.key(0))
    abstract.moe.mlp.experts.gate.shape      # (48, 16, 8192, 5120)
    abstract.layer_groups                    # {"moe": (0, 1, ..., 47)}
    ```
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar, final

import equinox as eqx
import jax
import jax.numpy as jnp
from jax.typing import ArrayLike
from jaxtyping import Array, Bool, Float, PRNGKeyArray

from port._errors import ConfigError
from port._text import quoted
from port.nn import (
    Attention,
    Cache,
    Decoder,
    GatedMLP,
    MoE,
    Rope,
    Tokens,
    attend,
    embeddings,
    head,
    read_rope,
    rms_norm,
    run_groups,
    stacked,
    with_cache,
)
from port.nn._attention import KV
from port.nn._cache import check_sizes
from port.nn.config import (
    MAX_LAYERS,
    ConfigFields,
    activation,
    check,
    check_model_type,
    get,
    read_kv_heads,
)

MODEL_TYPES = ("llama4_text", "llama4")
ROPE_TYPES = ("default", "linear", "llama3", "yarn")
LAYER_TYPES = ("full_attention", "chunked_attention")

# Llama4TextConfig's defaults (Llama-4-Scout's sizes), used where config.json lacks a key.
_DEFAULTS: dict[str, Any] = {
    "vocab_size": 202048,
    "hidden_size": 5120,
    "intermediate_size": 8192,
    "intermediate_size_mlp": 16384,
    "num_hidden_layers": 48,
    "num_attention_heads": 40,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "max_position_embeddings": 4096 * 32,
    "rms_norm_eps": 1e-5,
    "num_experts_per_tok": 1,
    "num_local_experts": 16,
    "interleave_moe_layer_step": 1,
    "use_qk_norm": True,
    "no_rope_layer_interval": 4,
    "attention_chunk_size": 8192,
    "attn_temperature_tuning": True,
    "floor_scale": 8192,
    "attn_scale": 0.1,
    "attention_bias": False,
    "tie_word_embeddings": False,
}
_THETA = 500000.0  # Llama4TextConfig.default_theta


@final
@dataclasses.dataclass(frozen=True)
class Llama4Config:
    """Llama 4's text hyperparameters, as read from a config.json (`llama4_text`, or `llama4`'s `text_config`).

    Per layer: `moe_layers` (which have experts), `rope_layers` (which rotate; the others
    are NoPE layers) and `chunked_layers` (which attend within `attention_chunk_size`).

    ```python
    c = Llama4Config.from_hf({"model_type": "llama4_text", "num_hidden_layers": 4,
                              "interleave_moe_layer_step": 2, "attention_chunk_size": 3})
    c.moe_layers, c.rope_layers, c.chunked_layers
    # (1, 3), (True, True, True, False), (True, True, True, False)
    ```
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int  # each routed expert's (and the shared expert's) hidden size
    intermediate_size_mlp: int  # the dense layers' hidden size
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    num_local_experts: int
    num_experts_per_tok: int
    moe_layers: tuple[int, ...]
    rope_layers: tuple[bool, ...]
    chunked_layers: tuple[bool, ...]
    attention_chunk_size: int | None
    rope: Rope
    rms_norm_eps: float = 1e-5
    use_qk_norm: bool = True
    attn_temperature_tuning: bool = True
    floor_scale: float = 8192.0
    attn_scale: float = 0.1
    attention_bias: bool = False
    tie_word_embeddings: bool = False

    @classmethod
    def from_hf(cls, config: dict) -> Llama4Config:
        """Build from a config.json dict (`llama4_text`, or `llama4` with a `text_config`); one-line
        `ConfigError` naming the key for anything unsupported or contradictory."""
        if check_model_type(config, MODEL_TYPES, "port.models.llama4", "llama4_text") == "llama4":
            text = config.get("text_config")
            if not isinstance(text, dict):
                raise ConfigError(f"config.json: 'text_config' must be a dict, got {quoted(text)}")
            return cls.from_hf({**text, "model_type": "llama4_text"})
        Llama4.FIELDS.check(config)
        c = {**_DEFAULTS, **{k: v for k, v in config.items() if v is not None}}
        layers = get(c, "num_hidden_layers", int, maximum=MAX_LAYERS)
        heads = get(c, "num_attention_heads", int)
        head_dim = get(c, "head_dim", int, get(c, "hidden_size", int) // heads)
        experts = get(c, "num_local_experts", int)
        top_k = get(c, "num_experts_per_tok", int)
        if top_k > experts:
            raise ConfigError(
                f"config.json: 'num_experts_per_tok' ({top_k}) is more than 'num_local_experts' ({experts})"
            )
        activation(c, "hidden_act", "silu", supported=("silu", "swish"))
        chunk = None if config.get("attention_chunk_size", 0) is None else get(c, "attention_chunk_size", int)
        rope_layers = _rope_layers(c, layers)
        if "rope_parameters" not in config and "rope_theta" not in config and not config.get("rope_scaling"):
            c = {**c, "rope_theta": _THETA}
        return cls(
            vocab_size=get(c, "vocab_size", int),
            hidden_size=get(c, "hidden_size", int),
            intermediate_size=get(c, "intermediate_size", int),
            intermediate_size_mlp=get(c, "intermediate_size_mlp", int),
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=read_kv_heads(c, heads, _DEFAULTS["num_key_value_heads"]),
            head_dim=head_dim,
            num_local_experts=experts,
            num_experts_per_tok=top_k,
            moe_layers=_moe_layers(c, layers),
            rope_layers=rope_layers,
            chunked_layers=_chunked_layers(c, rope_layers, chunk),
            attention_chunk_size=chunk,
            rope=read_rope(
                c, head_dim, supported=ROPE_TYPES, max_position_embeddings=get(c, "max_position_embeddings", int)
            ),
            rms_norm_eps=get(c, "rms_norm_eps", float),
            use_qk_norm=get(c, "use_qk_norm", bool),
            attn_temperature_tuning=get(c, "attn_temperature_tuning", bool),
            floor_scale=float(get(c, "floor_scale", float)),
            attn_scale=float(check("attn_scale", c["attn_scale"], float)),
            attention_bias=get(c, "attention_bias", bool),
            tie_word_embeddings=get(c, "tie_word_embeddings", bool),
        )

    @property
    def kinds(self) -> tuple[str, ...]:
        """Each layer's kind, "dense" or "moe", in checkpoint order."""
        return tuple("moe" if i in self.moe_layers else "dense" for i in range(self.num_hidden_layers))

    @property
    def groups(self) -> dict[str, tuple[int, ...]]:
        """Kind -> the checkpoint layers of that kind, for the kinds some layer has."""
        kinds = self.kinds
        found = {kind: tuple(i for i, k in enumerate(kinds) if k == kind) for kind in ("dense", "moe")}
        return {kind: ids for kind, ids in found.items() if ids}


def _int_list(config: dict, key: str) -> list[int]:
    value = config[key]
    if not isinstance(value, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in value):
        raise ConfigError(f"config.json: {key!r} must be a list of integers, got {quoted(value)}")
    return value


def _moe_layers(config: dict, layers: int) -> tuple[int, ...]:
    """`moe_layers` if given, else every `interleave_moe_layer_step`-th layer (step-1, 2*step-1, ...)."""
    if config.get("moe_layers") is None:
        step = get(config, "interleave_moe_layer_step", int)
        return tuple(range(step - 1, layers, step))
    listed = _int_list(config, "moe_layers")
    if len(set(listed)) != len(listed) or any(not 0 <= i < layers for i in listed):
        raise ConfigError(
            f"config.json: 'moe_layers' must list distinct layers below 'num_hidden_layers' ({layers}), "
            f"got {quoted(listed)}"
        )
    return tuple(sorted(listed))


def _rope_layers(config: dict, layers: int) -> tuple[bool, ...]:
    """Which layers rotate: `no_rope_layers` (1: RoPE, 0: NoPE; absent or empty, every
    `no_rope_layer_interval`-th layer is NoPE), as Llama4TextConfig reads it."""
    if not config.get("no_rope_layers"):
        interval = get(config, "no_rope_layer_interval", int)
        return tuple((i + 1) % interval != 0 for i in range(layers))
    flags = _int_list(config, "no_rope_layers")
    if len(flags) < layers or any(f not in (0, 1) for f in flags):
        raise ConfigError(
            f"config.json: 'no_rope_layers' must give 0 or 1 for each of the {layers} layers, got {quoted(flags)}"
        )
    return tuple(bool(f) for f in flags[:layers])


def _chunked_layers(config: dict, rope_layers: tuple[bool, ...], chunk: int | None) -> tuple[bool, ...]:
    """Which layers attend in chunks: `layer_types`, else the rotating ones when there is a chunk size."""
    types = config.get("layer_types")
    if types is None:
        return tuple(rope and chunk is not None for rope in rope_layers)
    if not isinstance(types, list) or len(types) != len(rope_layers) or any(t not in LAYER_TYPES for t in types):
        raise ConfigError(
            f"config.json: 'layer_types' must list {len(rope_layers)} of {LAYER_TYPES}, got {quoted(types)}"
        )
    if chunk is None and "chunked_attention" in types:
        raise ConfigError("config.json: 'layer_types' has chunked_attention layers but 'attention_chunk_size' is null")
    return tuple(t == "chunked_attention" for t in types)


def rotate_pairs(x: Float[ArrayLike, "batch seq heads head_dim"], cos: ArrayLike, sin: ArrayLike) -> Array:
    """RoPE on adjacent pairs `(x[2i], x[2i+1])` by frequency i, in float32, as Llama 4's complex form.

    `cos`, `sin`: `[batch, seq, head_dim]` from `Rope.angles` (each frequency twice: the
    first half is used).

    ```python
    cos, sin = Rope(theta=500000.0, rotary_dim=64).angles(positions, jnp.float32)
    q = rotate_pairs(q, cos, sin)         # q: [batch, seq, heads, 64]
    ```
    """
    x, cos, sin = jnp.asarray(x), jnp.asarray(cos), jnp.asarray(sin)
    half = x.shape[-1] // 2
    c, s = cos[..., None, :half].astype(jnp.float32), sin[..., None, :half].astype(jnp.float32)
    pairs = x.astype(jnp.float32).reshape(*x.shape[:-1], half, 2)
    real, imag = pairs[..., 0], pairs[..., 1]
    out = jnp.stack((real * c - imag * s, real * s + imag * c), axis=-1)
    return out.reshape(x.shape).astype(x.dtype)


def l2_norm(x: Array, eps: float) -> Array:
    """`x / sqrt(mean(x^2) + eps)` over the last axis in float32, no weight (Llama4TextL2Norm).

    ```python
    l2_norm(jnp.array([3.0, 4.0]), 1e-5)    # ~[0.85, 1.13]
    ```
    """
    x32 = x.astype(jnp.float32)
    return (x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)).astype(x.dtype)


def chunk_mask(tokens: Tokens, chunk: int) -> Bool[Array, "batch seq keys"]:
    """`tokens.mask` where the key's position is in the query's chunk of `chunk` positions.

    Positions, as transformers counts chunks from each sequence's first real token: the
    call's keys are its tokens (`tokens.positions`: packed segments restart); a cache's
    slots take the positions they were filled with (count of real slots before them).

    ```python
    tokens = prepare(jnp.zeros((1, 5), jnp.int32))
    chunk_mask(tokens, 2)[0].astype(int)   # [[1,0,0,0,0],[1,1,0,0,0],[0,0,1,0,0],[0,0,1,1,0],[0,0,0,0,1]]
    ```
    """
    if tokens.cache is None:
        keys = tokens.positions
    else:
        keys = jnp.cumsum(tokens.cache.mask, axis=-1) - 1
    same = (tokens.positions[:, :, None] // chunk) == (keys[:, None, :] // chunk)
    return tokens.mask & same


def temperature(seq: int, index: Array | None, floor_scale: float, attn_scale: float) -> Float[Array, " seq"]:
    """The query scale of a NoPE layer for `seq` tokens from slot `index` (None: 0):
    `log1p(floor((slot + 1) / floor_scale)) * attn_scale + 1`, by slot as transformers counts.

    ```python
    temperature(4, None, 2.0, 0.1)    # [1.0, 1.069, 1.069, 1.110]
    ```
    """
    slots = jnp.arange(seq) + (0 if index is None else index)
    return jnp.log1p(jnp.floor((slots.astype(jnp.float32) + 1.0) / floor_scale)) * attn_scale + 1.0


@final
class Block(eqx.Module):
    """One Llama 4 layer: attention (RoPE or NoPE, by the layer), then a dense MLP or the MoE."""

    attn_norm: Float[Array, " embed"]
    attn: Attention
    mlp_norm: Float[Array, " embed"]
    mlp: GatedMLP | MoE
    config: Llama4Config = eqx.field(static=True)

    def __init__(self, config: Llama4Config, kind: str, dtype: Any, *, key: PRNGKeyArray):
        kattn, kmlp = jax.random.split(key)
        c = config
        self.attn_norm = jnp.ones((c.hidden_size,), dtype)
        self.attn = Attention(
            heads=c.num_attention_heads,
            kv_heads=c.num_key_value_heads,
            head_dim=c.head_dim,
            embd=c.hidden_size,
            dtype=dtype,
            key=kattn,
            qkv_bias=c.attention_bias,
            o_bias=c.attention_bias,
        )
        self.mlp_norm = jnp.ones((c.hidden_size,), dtype)
        if kind == "moe":
            # Llama 4's MoE: top-k by sigmoid scores, each weighting its expert's input; a shared expert.
            self.mlp = MoE(
                embd=c.hidden_size,
                inner=c.intermediate_size,
                experts=c.num_local_experts,
                top_k=c.num_experts_per_tok,
                activation="silu",
                dtype=dtype,
                key=kmlp,
                scoring="sigmoid",
                renormalise=False,
                weights_in_input_dtype=True,
                weight_inputs=True,
                shared_inner=c.intermediate_size,
            )
        else:
            self.mlp = GatedMLP(
                embd=c.hidden_size, inner=c.intermediate_size_mlp, activation="silu", dtype=dtype, key=kmlp
            )
        self.config = config

    def __call__(
        self,
        x: Float[Array, "batch seq embed"],
        mask: Bool[Array, "batch seq keys"],
        *,
        cos: Array,
        sin: Array,
        kv: KV | None,
        index: Array | None,
        layer: Array,
    ) -> tuple[Float[Array, "batch seq embed"], KV | None]:
        h, kv = self._attend(rms_norm(x, self.attn_norm, self.config.rms_norm_eps), mask, cos, sin, kv, index, layer)
        x = x + h
        return x + self.mlp(rms_norm(x, self.mlp_norm, self.config.rms_norm_eps)), kv

    def _attend(
        self, x: Array, mask: Array, cos: Array, sin: Array, kv: KV | None, index: Array | None, layer: Array
    ) -> tuple[Array, KV | None]:
        c, attn = self.config, self.attn
        rotates = jnp.asarray(c.rope_layers)[layer]
        q, k, v = attn.project(x, None, None)
        q = jnp.where(rotates, rotate_pairs(q, cos, sin), q)
        k = jnp.where(rotates, rotate_pairs(k, cos, sin), k)
        if c.use_qk_norm:
            q = jnp.where(rotates, l2_norm(q, c.rms_norm_eps), q)
            k = jnp.where(rotates, l2_norm(k, c.rms_norm_eps), k)
        if c.attn_temperature_tuning:
            scale = temperature(q.shape[1], index, c.floor_scale, c.attn_scale)
            tuned = (q.astype(jnp.float32) * scale[None, :, None, None]).astype(q.dtype)
            q = jnp.where(rotates, q, tuned)
        k, v, kv = with_cache(k, v, kv, index)
        out = attend(q, k, v, mask, scale=c.head_dim**-0.5)
        y = jnp.einsum("bthd,ehd->bte", out, attn.wo)
        return (y if attn.bo is None else y + attn.bo), kv


@final
class Llama4(Decoder):
    """Llama 4 text causal LM: dense and MoE layers in two stacks (`dense`, `moe`; None where no
    layer has that kind), run in checkpoint order.

    Called as every `port.nn.Decoder`: `model(input_ids, *, attention_mask=None, positions=None,
    segment_ids=None, cache=None, dtype=None, remat=None)`; `init_cache` gives a cache per kind.

    ```python
    model = Llama4.from_config(config, key=jax.random.key(0))
    logits = model(ids)                                   # (batch, seq, vocab)
    tokens = port.generate(model, ids, max_new_tokens=16)
    ```
    """

    FIELDS: ClassVar[ConfigFields] = ConfigFields(
        "port.models.llama4.Llama4",
        read=(
            "vocab_size", "hidden_size", "intermediate_size", "intermediate_size_mlp", "num_hidden_layers",
            "num_attention_heads", "num_key_value_heads", "head_dim", "hidden_act", "max_position_embeddings",
            "rms_norm_eps", "num_experts_per_tok", "num_local_experts", "moe_layers",
            "interleave_moe_layer_step", "use_qk_norm", "no_rope_layers", "no_rope_layer_interval",
            "attention_chunk_size", "layer_types", "attn_temperature_tuning", "floor_scale", "attn_scale",
            "attention_bias", "tie_word_embeddings", "rope_parameters", "rope_scaling", "rope_theta",
        ),
    )  # fmt: skip

    embed: Float[Array, "vocab embed"]
    dense: Block | None
    moe: Block | None
    norm: Float[Array, " embed"]
    lm_head: Float[Array, "vocab embed"] | None
    config: Llama4Config = eqx.field(static=True)

    def __init__(self, config: Llama4Config, *, key: PRNGKeyArray, dtype: Any = jnp.float32):
        kembed, kdense, kmoe = jax.random.split(key, 3)
        self.embed, self.lm_head = embeddings(
            kembed, vocab=config.vocab_size, embd=config.hidden_size, dtype=dtype, tied=config.tie_word_embeddings
        )
        groups = config.groups

        def make(kind, k):
            return (
                None
                if kind not in groups
                else stacked(lambda key: Block(config, kind, dtype, key=key), k, len(groups[kind]))
            )

        self.dense, self.moe = make("dense", kdense), make("moe", kmoe)
        self.norm = jnp.ones((config.hidden_size,), dtype)
        self.config = config

    @classmethod
    def from_config(cls, config: dict, *, key: PRNGKeyArray, dtype: Any = jnp.float32) -> Llama4:
        """Randomly initialise from a config.json dict (`llama4_text`, or `llama4` with a `text_config`)."""
        return cls(Llama4Config.from_hf(config), key=key, dtype=dtype)

    @property
    def layer_groups(self) -> dict[str, tuple[int, ...]]:
        """`{"dense": ids, "moe": ids}`: the checkpoint layers each stack holds (kinds with layers only)."""
        return self.config.groups

    def init_cache(self, batch: int, length: int, dtype: Any = None) -> Cache:
        """An empty cache, keys and values per kind: `{"dense": [dense layers, batch, length, kv_heads,
        head_dim], "moe": ...}`, in `dtype` (default: the parameters')."""
        check_sizes(batch, length)
        dtype = self.embed.dtype if dtype is None else dtype
        c = self.config
        zeros = {
            kind: jnp.zeros((len(ids), batch, length, c.num_key_value_heads, c.head_dim), dtype)
            for kind, ids in c.groups.items()
        }
        return Cache.of(zeros, dict(zeros), batch=batch, length=length)

    def logits(self, tokens: Tokens, remat: Any) -> tuple[Array, tuple[Any, Any, Any]]:
        """Embed, the layers (chunked ones on `chunk_mask`), the final norm and the head."""
        c = self.config
        x = self.embed[tokens.ids]
        cos, sin = c.rope.angles(tokens.positions, jnp.float32)
        if c.attention_chunk_size is not None:
            tokens = dataclasses.replace(tokens, sliding=chunk_mask(tokens, c.attention_chunk_size))
        blocks = {"dense": self.dense, "moe": self.moe}
        groups = {kind: blocks[kind] for kind in c.groups}
        x, cache = run_groups(groups, c.kinds, x, tokens, cos=cos, sin=sin, sliding=c.chunked_layers, remat=remat)
        return head(rms_norm(x, self.norm, c.rms_norm_eps), self.embed, self.lm_head), cache
