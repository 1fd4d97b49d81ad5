"""ModernBERT (the `ModernBertModel` encoder, also inside `ModernBertForMaskedLM` checkpoints) in Equinox.

A pre-LayerNorm bidirectional encoder that returns the last hidden state (after its final
norm), built from `port.nn`: `Attention` (no mask but padding, RoPE), `GatedMLP` (GeGLU),
`LayerNorm`, `run_layers`. What is ModernBERT's own is here:

- global and local layers: `layer_types` (older configs: every `global_attn_every_n_layers`-th
  layer global, from the first); a local layer sees the keys within `local_attention // 2`
  slots of the query on either side (`port.nn.local_window`);
- rotary embeddings with a base per layer type (`rope_parameters` per layer type, or the older
  `global_rope_theta` / `local_rope_theta`; transformers' defaults 160000 and 10000), at
  positions `0, 1, ...` whatever the padding;
- the embedding norm after the token embeddings (no position table), and the final norm;
- the first layer has no attention norm (transformers' `nn.Identity`): the other layers'
  attention norms are their own stack, `attn_norms` (layer group `attn_norms`: checkpoint
  layers 1, 2, ...), beside `layers`, which holds every layer's attention, MLP norm and MLP;
- biases only where `attention_bias`, `mlp_bias`, `norm_bias` say (all False by default).

The checkpoint's fused `Wqkv` and `Wi` (`input | gate`, the first half activated) are split
by the mapping (`mappings/modernbert.toml`), so loading stays a copy. Heads
(`ModernBertForMaskedLM`'s `head` and `decoder`, classifiers) are not built: their tensors
are ignored and their config fields change nothing here.

Example:
    ```python
    import equinox as eqx
    import jax
    import jax.numpy as jnp
    from port.models.modernbert import ModernBert

    config = {"model_type": "modernbert", "vocab_size": 50368, "hidden_size": 768,
              "intermediate_size": 1152, "num_hidden_layers": 22, "num_attention_heads": 12}
    abstract = eqx.filter_eval_shape(ModernBert.from_config, config, key=jax.random.key(0))
    abstract.config.sliding_layers[:4]           # (False, True, True, False)
    abstract.layer_groups["attn_norms"][:3]      # (1, 2, 3)

    small = {**config, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 3,
             "num_attention_heads": 4, "vocab_size": 100, "local_attention": 8}
    model = ModernBert.from_config(small, key=jax.random.key(0))
    ids = jnp.zeros((2, 12), dtype=jnp.int32)
    mask = jnp.ones((2, 12), dtype=jnp.int32)    # 1 = attend, 0 = padding
    hidden = eqx.filter_jit(model)(ids, attention_mask=mask)   # (2, 12, 64)
    # bfloat16 compute on float32 parameters, each layer recomputed in the backward pass:
    hidden = model(ids, attention_mask=mask, dtype=jnp.bfloat16, remat=True)
    ```
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar, final

import equinox as eqx
import jax
import jax.numpy as jnp
from jax.typing import ArrayLike
from jaxtyping import Array, Bool, Float, Int, PRNGKeyArray

from port._errors import ConfigError
from port._text import quoted
from port.nn import (
    Attention,
    GatedMLP,
    LayerNorm,
    Rope,
    cast,
    local_window,
    normal,
    prepare,
    read_rope,
    run_layers,
    stacked,
)
from port.nn._rope import KINDS
from port.nn.config import MAX_LAYERS, ConfigFields, activation, check_model_type, get

MODULE = "port.models.modernbert.ModernBert"
LAYER_TYPES = ("full_attention", "sliding_attention")
DEFAULT_THETA = {"full_attention": 160_000.0, "sliding_attention": 10_000.0}  # ModernBertConfig.default_theta
OLD_THETA_KEYS = {"full_attention": "global_rope_theta", "sliding_attention": "local_rope_theta"}
OLD_KEYS = (*OLD_THETA_KEYS.values(), "global_attn_every_n_layers", "rope_scaling")  # transformers 4's configs


def _sliding_layers(config: dict, layers: int) -> tuple[bool, ...]:
    """Which layers are local: `layer_types`, else all but every `global_attn_every_n_layers`-th
    from the first (ModernBertConfig's default, 3).

    ```python
    _sliding_layers({}, 4)                                         # (False, True, True, False)
    _sliding_layers({"global_attn_every_n_layers": 2}, 3)          # (False, True, False)
    ```
    """
    layer_types = config.get("layer_types")
    if layer_types is None:
        every = get(config, "global_attn_every_n_layers", int, 3)
        return tuple(i % every != 0 for i in range(layers))
    if (
        not isinstance(layer_types, list)
        or len(layer_types) != layers
        or any(t not in LAYER_TYPES for t in layer_types)
    ):
        raise ConfigError(f"config.json: 'layer_types' must list {layers} of {LAYER_TYPES}, got {quoted(layer_types)}")
    return tuple(t == "sliding_attention" for t in layer_types)


def _rope(config: dict, head_dim: int, layer_type: str, max_positions: int) -> Rope:
    """The rotary settings of one layer type; the older per-type theta keys are the default base."""
    theta = get(config, OLD_THETA_KEYS[layer_type], float, DEFAULT_THETA[layer_type])
    return read_rope(
        config,
        head_dim,
        supported=KINDS,
        max_position_embeddings=max_positions,
        layer_type=layer_type,
        default_theta=theta,
    )


@final
@dataclasses.dataclass(frozen=True)
class ModernBertConfig:
    """The hyperparameters of a ModernBERT encoder, as read from a Hugging Face config.json."""

    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    intermediate_size: int
    hidden_activation: str
    global_rope: Rope
    local_rope: Rope
    sliding_layers: tuple[bool, ...]
    local_attention: int = 128
    norm_eps: float = 1e-5
    norm_bias: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def radius(self) -> int:
        """How far a local layer's query sees on either side: `local_attention // 2` slots."""
        return self.local_attention // 2

    @classmethod
    def from_hf(cls, config: dict) -> ModernBertConfig:
        """Build from a Hugging Face `config.json` dict; raises `ConfigError` if unsupported."""
        ModernBert.FIELDS.check(config)
        check_model_type(config, ("modernbert",), MODULE)
        hidden = get(config, "hidden_size", int)
        heads = get(config, "num_attention_heads", int)
        if hidden % heads != 0:
            raise ConfigError(
                f"config.json: 'hidden_size' ({hidden}) must be divisible by 'num_attention_heads' ({heads})"
            )
        layers = get(config, "num_hidden_layers", int, maximum=MAX_LAYERS)
        positions = get(config, "max_position_embeddings", int, 8192)
        return cls(
            vocab_size=get(config, "vocab_size", int),
            hidden_size=hidden,
            num_hidden_layers=layers,
            num_attention_heads=heads,
            intermediate_size=get(config, "intermediate_size", int),
            hidden_activation=activation(config, "hidden_activation", "gelu"),
            global_rope=_rope(config, hidden // heads, "full_attention", positions),
            local_rope=_rope(config, hidden // heads, "sliding_attention", positions),
            sliding_layers=_sliding_layers(config, layers),
            local_attention=get(config, "local_attention", int, 128),
            norm_eps=get(config, "norm_eps", float, 1e-5),
            norm_bias=get(config, "norm_bias", bool, False),
            attention_bias=get(config, "attention_bias", bool, False),
            mlp_bias=get(config, "mlp_bias", bool, False),
        )


@final
class Layer(eqx.Module):
    """One pre-LayerNorm layer but its attention norm (`ModernBert.attn_norms`):
    `x + attn(attn_norm(x))`, then `x + mlp(mlp_norm(x))`."""

    attn: Attention
    mlp_norm: LayerNorm
    mlp: GatedMLP

    def __init__(self, config: ModernBertConfig, dtype: Any, *, key: PRNGKeyArray):
        kattn, kmlp = jax.random.split(key)
        c, e = config, config.hidden_size
        heads = c.num_attention_heads
        self.attn = Attention(
            heads=heads,
            kv_heads=heads,
            head_dim=c.head_dim,
            embd=e,
            dtype=dtype,
            key=kattn,
            qkv_bias=c.attention_bias,
            o_bias=c.attention_bias,
        )
        self.mlp_norm = LayerNorm(e, eps=c.norm_eps, dtype=dtype, bias=c.norm_bias)
        self.mlp = GatedMLP(
            embd=e, inner=c.intermediate_size, activation=c.hidden_activation, dtype=dtype, key=kmlp, bias=c.mlp_bias
        )


@final
class Block(eqx.Module):
    """A layer with its attention norm, as `run_layers` calls it; layer 0's norm is not applied."""

    layer: Layer
    attn_norm: LayerNorm

    def __call__(
        self,
        x: Float[Array, "batch seq embed"],
        mask: Bool[Array, "batch seq keys"],
        *,
        cos: Array | None,
        sin: Array | None,
        kv: Any,
        index: Any,
        layer: Int[Array, ""],
    ) -> tuple[Float[Array, "batch seq embed"], None]:
        normed = jnp.where(layer == 0, x, self.attn_norm(x))  # the first layer's norm is the identity
        h, _ = self.layer.attn(normed, mask, cos=cos, sin=sin)
        x = x + h
        return x + self.layer.mlp(self.layer.mlp_norm(x)), None


@final
class ModernBert(eqx.Module):
    """The ModernBERT encoder; `__call__` returns the last hidden state. `layers` and `attn_norms` are stacked."""

    FIELDS: ClassVar[ConfigFields] = ConfigFields(
        MODULE,
        read=(
            "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size",
            "hidden_activation", "max_position_embeddings", "norm_eps", "norm_bias", "attention_bias", "mlp_bias",
            "layer_types", "rope_parameters", "local_attention", *OLD_KEYS, "tie_word_embeddings",
        ),
    )  # fmt: skip

    embeddings: Float[Array, "vocab embed"]
    embed_norm: LayerNorm
    layers: Layer
    attn_norms: LayerNorm | None  # layers 1, 2, ...; None for a one-layer model
    final_norm: LayerNorm
    config: ModernBertConfig = eqx.field(static=True)

    def __init__(self, config: ModernBertConfig, *, key: PRNGKeyArray, dtype: Any = jnp.float32):
        kembed, klayers = jax.random.split(key)
        c, e = config, config.hidden_size

        def norm(_: Any = None) -> LayerNorm:
            return LayerNorm(e, eps=c.norm_eps, dtype=dtype, bias=c.norm_bias)

        self.embeddings = normal(kembed, (c.vocab_size, e), dtype)
        self.embed_norm = norm()
        self.layers = stacked(lambda k: Layer(c, dtype, key=k), klayers, c.num_hidden_layers)
        rest = c.num_hidden_layers - 1
        self.attn_norms = stacked(norm, klayers, rest) if rest else None
        self.final_norm = norm()
        self.config = config

    @classmethod
    def from_config(cls, config: dict, *, key: PRNGKeyArray, dtype: Any = jnp.float32) -> ModernBert:
        """Randomly initialise from a Hugging Face `config.json` dict (model_type modernbert)."""
        return cls(ModernBertConfig.from_hf(config), key=key, dtype=dtype)

    @property
    def layer_groups(self) -> dict[str, tuple[int, ...]]:
        """The checkpoint layers each stack holds: `layers` every one, `attn_norms` all but the first."""
        layers = tuple(range(self.config.num_hidden_layers))
        return {"layers": layers, "attn_norms": layers[1:]}

    def blocks(self) -> Block:
        """Every layer with its attention norm, stacked as `run_layers` runs them; layer 0's
        (a stand-in: its MLP norm) is never applied."""
        stand_in = jax.tree.map(lambda a: a[:1], self.layers.mlp_norm)
        if self.attn_norms is None:
            return Block(self.layers, stand_in)
        return Block(self.layers, jax.tree.map(lambda a, b: jnp.concatenate([a, b]), stand_in, self.attn_norms))

    def __call__(
        self,
        input_ids: ArrayLike,  # integer (batch, seq) or (seq,); checked here, one line naming it
        attention_mask: Any = None,
        *,
        dtype: Any = None,
        remat: Any = None,
    ) -> Float[Array, "*batch seq embed"]:
        """The last hidden state (after the final norm), for `input_ids` of shape (batch, seq) or (seq,).

        **Arguments:**

        - `input_ids`: integer `(batch, seq)`, or `(seq,)` (run as a batch of one).
        - `attention_mask`: `input_ids`' shape; nonzero/True to attend, 0 for padding
          (default all attended). Padded keys are never attended; padded queries still
          get an output. Positions are `0, 1, ...` whatever the mask, as in transformers.
        - `dtype`: the compute dtype (bfloat16 compute on float32 parameters).
        - `remat`: rematerialise each layer in the backward pass (`port.nn.scan`).

        Raises `ValueError` for another rank or mismatched shapes, `TypeError` for
        non-integer ids; the checks read static shapes, so they work under `jax.jit`.

        ```python
        hidden = model(jnp.zeros((2, 8), jnp.int32), jnp.ones((2, 8), jnp.int32))  # (2, 8, embd)
        ```
        """
        c = self.config
        tokens = local_window(prepare(input_ids, attention_mask=attention_mask, causal=False), c.radius)
        model = cast(self, dtype)
        x = model.embed_norm(model.embeddings[tokens.ids])
        positions = jnp.broadcast_to(jnp.arange(tokens.ids.shape[1]), tokens.ids.shape)
        cos, sin = c.global_rope.angles(positions, x.dtype)
        local = c.local_rope.angles(positions, x.dtype)
        x, _ = run_layers(
            model.blocks(), x, tokens, cos=cos, sin=sin, sliding=c.sliding_layers, sliding_rope=local, remat=remat
        )
        return tokens.output(model.final_norm(x))
