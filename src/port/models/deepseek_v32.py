"""DeepSeek-V3.2 (`model_type` "deepseek_v32") and GLM-5 (`model_type` "glm_moe_dsa"): DeepSeek-V3 with
DeepSeek sparse attention.

What is new in the family, all else from `port.models.deepseek_v3` (its config reader,
latent attention, router and experts) and `port.nn`:

- Every layer's latent attention attends only to the `index_topk` keys its lightning
  indexer picks per query (`port.nn.SparseLatentAttention`, `port.nn.Indexer`:
  `index_n_heads` heads of `index_head_dim`, RoPE on the first `qk_rope_head_dim`
  dimensions, half-split in DeepSeek-V3.2 and interleaved in GLM-5); the cache keeps the
  indexer's keys beside the latent's rotary key.
- The main attention's RoPE is always interleaved (transformers defines no
  `rope_interleave` for these types), and the queries always go through `q_lora_rank`.
- `mlp_layer_types` ("dense" or "sparse" per layer; default: the first
  `first_k_dense_replace` dense) picks each layer's feed-forward; the two kinds are the
  `dense` and `moe` stacks, in any order (`port.nn.run_groups`).
- GLM-5's `indexer_types` may mark layers "shared" (reusing the previous layer's
  selection): port refuses those in one line; every layer runs its own indexer
  (transformers' default).

The checkpoints' multi-token-prediction layer (`model.layers.{num_hidden_layers}.*`) is
ignored by the mapping, as DeepSeek-V3's is.

Example:
    ```python
    import equinox as eqx
    import jax
    from port.models.deepseek_v32 import DeepseekV32

    config = {"model_type": "deepseek_v32", "num_hidden_layers": 61}
    abstract = eqx.filter_eval_shape(DeepseekV32.from_config, config, key=jax.random.key(0))
    abstract.moe.attn.indexer.wq.shape         # (58, 64, 128, 1536)
    abstract.layer_groups["dense"]             # (0, 1, 2)
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
from port.models.deepseek_v3 import DeepseekV3, DeepseekV3Config
from port.nn import (
    Block,
    Cache,
    Decoder,
    Indexer,
    SparseLatentAttention,
    Tokens,
    embeddings,
    head,
    rms_norm,
    run_groups,
    stacked,
)
from port.nn.config import MAX_LAYERS, ConfigFields, check_model_type, get

MODEL_TYPES = ("deepseek_v32", "glm_moe_dsa")

# Where the config classes' defaults differ from DeepseekV3Config's (used where config.json omits a key).
_DEFAULTS: dict[str, dict[str, Any]] = {
    "deepseek_v32": {"max_position_embeddings": 163840, "index_topk": 2048, "index_head_dim": 128, "index_n_heads": 64},
    "glm_moe_dsa": {
        "vocab_size": 154880, "hidden_size": 6144, "intermediate_size": 12288, "num_hidden_layers": 78,
        "num_attention_heads": 64, "q_lora_rank": 2048, "v_head_dim": 256, "qk_nope_head_dim": 192,
        "n_group": 1, "topk_group": 1, "max_position_embeddings": 202752, "rms_norm_eps": 1e-5,
        "index_topk": 2048, "index_head_dim": 128, "index_n_heads": 32,
    },
}  # fmt: skip
_OWN = ("mlp_layer_types", "layer_types", "index_topk", "index_head_dim", "index_n_heads", "indexer_types")


@final
@dataclasses.dataclass(frozen=True)
class DeepseekV32Config:
    """A DeepSeek-V3.2 / GLM-5 model's hyperparameters: DeepSeek-V3's (`base`), each layer's
    feed-forward kind and the indexer's sizes.

    ```python
    c = DeepseekV32Config.from_hf({"model_type": "glm_moe_dsa", "num_hidden_layers": 4})
    c.kinds, c.index_n_heads, c.interleave_index    # (('dense',) * 3 + ('moe',), 32, True)
    ```
    """

    base: DeepseekV3Config
    kinds: tuple[str, ...]
    index_topk: int
    index_head_dim: int
    index_n_heads: int
    interleave_index: bool

    @classmethod
    def from_hf(cls, config: dict) -> DeepseekV32Config:
        """Build from a Hugging Face `config.json` dict; one-line `ConfigError` naming the key
        for anything missing, malformed, contradictory or not run."""
        model_type = check_model_type(config, MODEL_TYPES, "port.models.deepseek_v32")
        DeepseekV32.FIELDS.check(config)
        c = {**_DEFAULTS[model_type], **{k: v for k, v in config.items() if v is not None}}
        layers = get(c, "num_hidden_layers", int, 61, maximum=MAX_LAYERS)
        kinds = _mlp_kinds(c, layers)
        _check_layer_types(c, layers)
        if model_type == "glm_moe_dsa":
            _check_indexer_types(config, layers)
        get(c, "q_lora_rank", int)  # the indexer reads the query latent: never null here
        base = {k: v for k, v in c.items() if k not in _OWN}
        base.update(model_type="deepseek_v3", first_k_dense_replace=kinds.count("dense"), rope_interleave=True)
        rope_dim = get(c, "qk_rope_head_dim", int)
        dim = get(c, "index_head_dim", int)
        if rope_dim > dim:
            raise ConfigError(
                f"config.json: 'qk_rope_head_dim' ({rope_dim}) is more than 'index_head_dim' ({dim}): "
                "the indexer rotates that many of its dimensions"
            )
        return cls(
            base=DeepseekV3Config.from_hf(base),
            kinds=kinds,
            index_topk=get(c, "index_topk", int),
            index_head_dim=dim,
            index_n_heads=get(c, "index_n_heads", int),
            interleave_index=model_type == "glm_moe_dsa",
        )

    @property
    def num_hidden_layers(self) -> int:
        """The number of layers."""
        return len(self.kinds)

    def attention(self, dtype: Any, key: PRNGKeyArray) -> SparseLatentAttention:
        """One layer's sparse latent attention: DeepSeek-V3's latent attention and an indexer."""
        kmla, kindex = jax.random.split(key)
        b = self.base
        assert b.q_lora_rank is not None, "from_hf requires q_lora_rank"
        indexer = Indexer(
            heads=self.index_n_heads,
            dim=self.index_head_dim,
            q_rank=b.q_lora_rank,
            embd=b.hidden_size,
            rope_dim=b.qk_rope_head_dim,
            top_k=self.index_topk,
            dtype=dtype,
            key=kindex,
            interleave=self.interleave_index,
        )
        return SparseLatentAttention(b.attention(dtype, kmla), indexer)


def _mlp_kinds(c: dict, layers: int) -> tuple[str, ...]:
    """Each layer's feed-forward, "dense" or "moe", from `mlp_layer_types` (default: the first
    `first_k_dense_replace` layers dense, as transformers fills it)."""
    types = c.get("mlp_layer_types")
    if types is None:
        dense = c.get("first_k_dense_replace", 3)
        if not isinstance(dense, int) or isinstance(dense, bool) or dense < 0:
            raise ConfigError(
                f"config.json: 'first_k_dense_replace' must be a non-negative integer, got {quoted(dense)}"
            )
        return ("dense",) * min(dense, layers) + ("moe",) * (layers - min(dense, layers))
    if not isinstance(types, list) or len(types) != layers or any(t not in ("dense", "sparse") for t in types):
        raise ConfigError(
            f'config.json: \'mlp_layer_types\' must list "dense" or "sparse" for each of the {layers} layers '
            f"('num_hidden_layers'), got {quoted(types)}"
        )
    return tuple("dense" if t == "dense" else "moe" for t in types)


def _check_layer_types(c: dict, layers: int) -> None:
    """`layer_types`: every layer "indexed_attention" (the only kind these types define)."""
    types = c.get("layer_types")
    if types is not None and (not isinstance(types, list) or types != ["indexed_attention"] * layers):
        raise ConfigError(
            f"config.json: 'layer_types' {quoted(types)} is not supported by port.models.deepseek_v32 "
            f'(every one of the {layers} layers "indexed_attention")'
        )


def _check_indexer_types(config: dict, layers: int) -> None:
    """GLM-5's `indexer_types` (or the `index_topk_pattern` / `index_topk_freq` /
    `index_skip_topk_offset` it is derived from, as transformers derives it): every layer "full"."""
    types = config.get("indexer_types")
    if types is None:
        pattern = config.get("index_topk_pattern")
        if isinstance(pattern, str):
            types = [{"F": "full", "S": "shared"}.get(ch, ch) for ch in pattern]
        elif pattern is not None:
            types = pattern
        else:
            freq = config.get("index_topk_freq", 1)
            offset = config.get("index_skip_topk_offset", 2)
            for key, value in (("index_topk_freq", freq), ("index_skip_topk_offset", offset)):
                if not isinstance(value, int) or isinstance(value, bool):
                    raise ConfigError(f"config.json: {key!r} must be an integer, got {quoted(value)}")
            freq = max(freq, 1)
            types = ["full" if max(i - offset + 1, 0) % freq == 0 else "shared" for i in range(layers)]
    if not isinstance(types, list) or len(types) != layers or any(t not in ("full", "shared") for t in types):
        raise ConfigError(
            f'config.json: \'indexer_types\' must list "full" or "shared" for each of the {layers} layers, '
            f"got {quoted(types)}"
        )
    if "shared" in types:
        raise ConfigError(
            f"config.json: 'indexer_types' layer {types.index('shared')} \"shared\" (reusing an earlier layer's "
            'top-k) is not supported by port.models.deepseek_v32 (supported: every layer "full")'
        )


def block(c: DeepseekV32Config, kind: str, dtype: Any, *, key: PRNGKeyArray) -> Block:
    """One layer: sparse latent attention, then a dense MLP (`kind` "dense") or the experts ("moe")."""
    kattn, kmlp = jax.random.split(key)
    b = c.base
    return Block(
        c.attention(dtype, kattn), b.mlp(kind, dtype, kmlp), embd=b.hidden_size, eps=b.rms_norm_eps, dtype=dtype
    )


@final
class DeepseekV32(Decoder):
    """DeepSeek-V3.2 / GLM-5 causal LM: `dense` and `moe` stacks of blocks (None where a kind has no layer).

    Called as every `port.nn.Decoder`.

    ```python
    model = DeepseekV32.from_config(config, key=jax.random.key(0))
    logits = model(ids)                                          # (batch, seq, vocab)
    logits, cache = model(ids, cache=model.init_cache(batch=ids.shape[0], length=64))
    ```
    """

    FIELDS: ClassVar[ConfigFields] = ConfigFields(
        "port.models.deepseek_v32.DeepseekV32",
        read=(
            *DeepseekV3.FIELDS.read,
            "mlp_layer_types", "layer_types", "index_topk", "index_head_dim", "index_n_heads",
            "indexer_types", "index_topk_pattern", "index_topk_freq", "index_skip_topk_offset",  # GLM-5's
            "mlp_bias",  # transformers' MLPs of these types have no bias, whatever it says
        ),
        fixed=DeepseekV3.FIELDS.fixed,
    )  # fmt: skip

    embed: Float[Array, "vocab embed"]
    dense: Block | None
    moe: Block | None
    norm: Float[Array, " embed"]
    lm_head: Float[Array, "vocab embed"] | None
    config: DeepseekV32Config = eqx.field(static=True)

    def __init__(self, config: DeepseekV32Config, *, key: PRNGKeyArray, dtype: Any = jnp.float32):
        kembed, kdense, kmoe = jax.random.split(key, 3)
        b = config.base
        self.embed, self.lm_head = embeddings(
            kembed, vocab=b.vocab_size, embd=b.hidden_size, dtype=dtype, tied=b.tie_word_embeddings
        )
        counts = {kind: config.kinds.count(kind) for kind in ("dense", "moe")}

        def make(kind, k):
            return stacked(lambda kk: block(config, kind, dtype, key=kk), k, counts[kind]) if counts[kind] else None

        self.dense, self.moe = make("dense", kdense), make("moe", kmoe)
        self.norm = jnp.ones((b.hidden_size,), dtype)
        self.config = config

    @classmethod
    def from_config(cls, config: dict, *, key: PRNGKeyArray, dtype: Any = jnp.float32) -> DeepseekV32:
        """Randomly initialise from a Hugging Face `config.json` dict (model_type deepseek_v32 or glm_moe_dsa)."""
        return cls(DeepseekV32Config.from_hf(config), key=key, dtype=dtype)

    @property
    def layer_groups(self) -> dict[str, tuple[int, ...]]:
        """The checkpoint layers each stack holds, by `mlp_layer_types`."""
        kinds = self.config.kinds
        return {kind: tuple(i for i, k in enumerate(kinds) if k == kind) for kind in ("dense", "moe")}

    @property
    def cache_sizes(self) -> tuple[int, int, int]:
        """`(layers, 1, kv_lora_rank)`: the latent is one "head" per layer (the values hold the
        rotary and indexer keys, `qk_rope_head_dim + index_head_dim`)."""
        return self.config.num_hidden_layers, 1, self.config.base.kv_lora_rank

    def init_cache(self, batch: int, length: int, dtype: Any = None) -> Cache:
        """An empty cache by layer kind: per layer, the latent (`kv_lora_rank`) as keys and the
        rotated shared key and the indexer's key (`qk_rope_head_dim + index_head_dim`) as
        values, `[layers, batch, length, 1, size]`."""
        if dtype is None:
            dtype = self.embed.dtype
        c = self.config
        keys, values = {}, {}
        for kind, ids in self.layer_groups.items():
            if ids:
                keys[kind] = jnp.zeros((len(ids), batch, length, 1, c.base.kv_lora_rank), dtype)
                values[kind] = jnp.zeros(
                    (len(ids), batch, length, 1, c.base.qk_rope_head_dim + c.index_head_dim), dtype
                )
        return Cache.of(keys, values, batch=batch, length=length)

    def logits(self, tokens: Tokens, remat: Any) -> tuple[Array, tuple[Any, Any, Any]]:
        """Embed, the layers in checkpoint order, the final norm and the head."""
        b = self.config.base
        x = self.embed[tokens.ids]
        cos, sin = b.rope.angles(tokens.positions, x.dtype)
        groups = {"dense": self.dense, "moe": self.moe}
        x, cache = run_groups(groups, self.config.kinds, x, tokens, cos=cos, sin=sin, remat=remat)
        return head(rms_norm(x, self.norm, b.rms_norm_eps), self.embed, self.lm_head), cache
