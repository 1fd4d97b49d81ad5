"""GPT-NeoX and Pythia (decoder-only, LayerNorm, partial RoPE, parallel residual) as an Equinox model.

What is new in this family, on top of `port.nn`: the fused `query_key_value` projection,
which interleaves its rows per head (for each head: its query rows, then its key rows,
then its value rows). port keeps it fused, one leaf `[heads, 3, head_dim, embed]`: a
device holding some heads reads exactly those heads' rows, q, k and v together. The
blocks add attention and MLP in parallel (`use_parallel_residual`, the default) or in
sequence. Norms, RoPE, the MLP, attention scores, masks, the cache and the layer scan
are `port.nn`'s; the blocks are stored *stacked* (a leading `num_hidden_layers` axis on
every array of `GPTNeoX.blocks`) and run by `port.nn.run_layers`.

Only the first `2 * ceil(rotary_ndims / 2)` dimensions of each head rotate
(`rotary_ndims = int(head_dim * partial_rotary_factor)`, as transformers computes it),
from `rotary_pct` / `rotary_emb_base` (transformers 4) or
`rope_parameters.partial_rotary_factor` / `rope_theta` (transformers 5). LayerNorm
statistics and the attention softmax are in float32, as in transformers; `dtype=` on the
call computes in another dtype than the parameters'.

Example:
    ```python
    import equinox as eqx
    import jax
    import jax.numpy as jnp
    import port
    from port.models.gpt_neox import GPTNeoX

    config = {"model_type": "gpt_neox", "vocab_size": 50304, "hidden_size": 2048,
              "intermediate_size": 8192, "num_hidden_layers": 24,
              "num_attention_heads": 16, "rotary_pct": 0.25, "rotary_emb_base": 10000}
    model = GPTNeoX.from_config(config, key=jax.random.key(0), dtype=jnp.bfloat16)
    logits = eqx.filter_jit(model)(jnp.zeros((1, 8), dtype=jnp.int32))
    # logits.shape == (1, 8, 50304); without the batch axis, (8,) ids give (8, 50304)
    out = port.generate(model, prompt_ids, max_new_tokens=16, attention_mask=prompt_mask)

    # Shapes only, no memory allocated (e.g. before loading a checkpoint):
    abstract = eqx.filter_eval_shape(GPTNeoX.from_config, config, key=jax.random.key(0))
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
    MLP,
    Decoder,
    LayerNorm,
    Rope,
    Tokens,
    apply_rope,
    attend,
    embeddings,
    head,
    normal,
    run_layers,
    stacked,
    with_cache,
    zeros_if,
)
from port.nn._attention import KV
from port.nn.config import MAX_LAYERS, ConfigFields, activation, check, check_model_type, get

MODEL_TYPES = ("gpt_neox",)


def _rope(config: dict) -> tuple[str, float, float]:
    """(the key holding the RoPE settings, rope_theta, partial_rotary_factor), as transformers 5.23 reads them.

    `rope_scaling`, else `rope_parameters` (transformers 5); the theta and factor they
    lack come from `rotary_emb_base` and `rotary_pct` (transformers 4), else 10000 and
    0.25. Top-level `rope_theta` / `partial_rotary_factor` are not read (nor are they
    by transformers' GPTNeoXConfig).
    """
    key = "rope_scaling" if config.get("rope_scaling") else "rope_parameters"
    rope = config.get(key) or {}
    if not isinstance(rope, dict) or any(isinstance(v, dict) for v in rope.values()):
        raise ConfigError(
            f"config.json: {key!r} must be one flat dict (per-layer-type RoPE is not supported), got {quoted(rope)}"
        )
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type != "default":
        raise ConfigError(f"config.json: {key}: rope type {quoted(rope_type)} is not supported (supported: default)")
    theta = rope.get("rope_theta")
    if theta is None:
        theta = get(config, "rotary_emb_base", float, 10000.0)
    else:
        theta = check(f"{key}.rope_theta", theta, float)
    factor = rope.get("partial_rotary_factor")
    name = f"{key}.partial_rotary_factor"
    if factor is None:
        factor, name = config.get("rotary_pct", 0.25), "rotary_pct"
    if not isinstance(factor, (int, float)) or isinstance(factor, bool) or not 0 <= factor <= 1:
        raise ConfigError(f"config.json: {name!r} must be a number from 0 to 1, got {quoted(factor)}")
    return key, theta, float(factor)


@final
@dataclasses.dataclass(frozen=True)
class GPTNeoXConfig:
    """The hyperparameters of a GPT-NeoX model, as read from a Hugging Face config.json.

    `rope` holds the base and `rotary_dim`, transformers' `int(head_dim *
    partial_rotary_factor)`; `rope.inv_freq()` is transformers' `inv_freq`, and the
    rotated dimensions of each head are the first `2 * len(inv_freq)` (odd counts round
    up to even, as in transformers; 0: no rotation).

    ```python
    c = GPTNeoXConfig.from_hf({"vocab_size": 8, "hidden_size": 48, "intermediate_size": 8,
                               "num_hidden_layers": 1, "num_attention_heads": 4, "rotary_pct": 0.25})
    c.head_dim, c.rope    # 12, Rope(theta=10000.0, rotary_dim=3, ...): 4 dims rotate
    ```
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    rope: Rope  # theta and rotary_dim (int(head_dim * partial_rotary_factor))
    layer_norm_eps: float = 1e-5
    hidden_act: str = "gelu"
    use_parallel_residual: bool = True
    attention_bias: bool = True  # query_key_value and dense
    tie_word_embeddings: bool = False

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @classmethod
    def from_hf(cls, config: dict) -> GPTNeoXConfig:
        """Build from a Hugging Face `config.json` dict; raises `ConfigError` if unsupported."""
        check_model_type(config, MODEL_TYPES, "port.models.gpt_neox", "gpt_neox")
        GPTNeoX.FIELDS.check(config)
        get(config, "is_decoder", bool, False)
        hidden = get(config, "hidden_size", int)
        heads = get(config, "num_attention_heads", int)
        if hidden % heads != 0:
            raise ConfigError(
                f"config.json: 'hidden_size' ({hidden}) must be divisible by 'num_attention_heads' ({heads})"
            )
        head_dim = config.get("head_dim")
        if head_dim is not None and head_dim != hidden // heads:
            raise ConfigError(
                f"config.json: 'head_dim' {quoted(head_dim)} is not supported: GPT-NeoX heads are "
                f"hidden_size // num_attention_heads ({hidden // heads})"
            )
        _, theta, factor = _rope(config)
        return cls(
            vocab_size=get(config, "vocab_size", int),
            hidden_size=hidden,
            intermediate_size=get(config, "intermediate_size", int),
            num_hidden_layers=get(config, "num_hidden_layers", int, maximum=MAX_LAYERS),
            num_attention_heads=heads,
            rope=Rope(theta=theta, rotary_dim=int(hidden // heads * factor)),
            layer_norm_eps=get(config, "layer_norm_eps", float, 1e-5),
            hidden_act=activation(config, "hidden_act", "gelu"),
            use_parallel_residual=get(config, "use_parallel_residual", bool, True),
            attention_bias=get(config, "attention_bias", bool, True),
            tie_word_embeddings=get(config, "tie_word_embeddings", bool, False),
        )


@final
class Attention(eqx.Module):
    """Causal multi-head self-attention, q, k and v fused per head as in the checkpoint.

    **Arguments:** `config` (its sizes and `attention_bias`), `dtype`, `key`.

    Called as `attn(x, mask, cos=, sin=, kv=, index=)` -> `(y, kv)`, like
    `port.nn.Attention`: `x` `[batch, seq, embd]`, `mask` from `port.nn.prepare`,
    `cos`/`sin` from `Rope.angles`, `kv`/`index` this layer's cache (None: none).

    ```python
    attn = Attention(config, jnp.float32, key=key)
    y, _ = attn(x, tokens.mask, cos=cos, sin=sin)
    ```
    """

    wqkv: Float[Array, "heads qkv head_dim embed"]
    bqkv: Float[Array, "heads qkv head_dim"] | None
    wo: Float[Array, "embed heads head_dim"]
    bo: Float[Array, " embed"] | None

    def __init__(self, config: GPTNeoXConfig, dtype: Any, *, key: PRNGKeyArray):
        h, d, e = config.num_attention_heads, config.head_dim, config.hidden_size
        kqkv, ko = jax.random.split(key)
        self.wqkv = normal(kqkv, (h, 3, d, e), dtype)
        self.bqkv = zeros_if(config.attention_bias, (h, 3, d), dtype)
        self.wo = normal(ko, (e, h, d), dtype)
        self.bo = zeros_if(config.attention_bias, (e,), dtype)

    def __call__(
        self,
        x: Float[Array, "batch seq embed"],
        mask: Bool[Array, "batch seq keys"],
        *,
        cos: Array,
        sin: Array,
        kv: KV | None = None,
        index: Array | None = None,
    ) -> tuple[Float[Array, "batch seq embed"], KV | None]:
        qkv = jnp.einsum("bte,hcde->bthcd", x, self.wqkv)
        if self.bqkv is not None:
            qkv = qkv + self.bqkv
        q, k, v = qkv[..., 0, :], qkv[..., 1, :], qkv[..., 2, :]
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        k, v, kv = with_cache(k, v, kv, index)
        out = attend(q, k, v, mask, scale=q.shape[-1] ** -0.5)
        y = jnp.einsum("bthd,ehd->bte", out, self.wo)
        return (y if self.bo is None else y + self.bo), kv


@final
class Block(eqx.Module):
    """One GPT-NeoX layer: pre-LayerNorm attention and MLP, in parallel or in sequence.

    **Arguments:** `config`, `dtype`, `key`. Called as `port.nn.run_layers` calls blocks.
    """

    attn_norm: LayerNorm
    attn: Attention
    mlp_norm: LayerNorm
    mlp: MLP
    parallel: bool = eqx.field(static=True)

    def __init__(self, config: GPTNeoXConfig, dtype: Any, *, key: PRNGKeyArray):
        kattn, kmlp = jax.random.split(key)
        e, eps = config.hidden_size, config.layer_norm_eps
        self.attn_norm = LayerNorm(e, eps=eps, dtype=dtype)
        self.attn = Attention(config, dtype, key=kattn)
        self.mlp_norm = LayerNorm(e, eps=eps, dtype=dtype)
        self.mlp = MLP(embd=e, inner=config.intermediate_size, activation=config.hidden_act, dtype=dtype, key=kmlp)
        self.parallel = config.use_parallel_residual

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
        attn, kv = self.attn(self.attn_norm(x), mask, cos=cos, sin=sin, kv=kv, index=index)
        if self.parallel:  # x + attn(ln1(x)) + mlp(ln2(x)), summed in transformers' order
            return self.mlp(self.mlp_norm(x)) + attn + x, kv
        h = attn + x
        return self.mlp(self.mlp_norm(h)) + h, kv


@final
class GPTNeoX(Decoder):
    """GPT-NeoX / Pythia causal LM. Arrays in `blocks` are stacked over layers.

    Called as every `port.nn.Decoder`: `model(input_ids, *, attention_mask=None, positions=None,
    segment_ids=None, cache=None, dtype=None, remat=None)`.

    **Arguments:** `config` (a `GPTNeoXConfig`; `from_config` reads a config.json dict),
    `key`, `dtype` (the parameters').
    """

    FIELDS: ClassVar[ConfigFields] = ConfigFields(
        "port.models.gpt_neox.GPTNeoX",
        read=(
            "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
            "head_dim", "hidden_act", "layer_norm_eps", "use_parallel_residual", "attention_bias",
            "tie_word_embeddings", "rope_parameters", "rope_scaling", "rotary_emb_base", "rotary_pct",
            "max_position_embeddings",  # no learned table and default RoPE: positions are not bounded
            "is_decoder",  # GPT-NeoX is causal either way
        ),
    )  # fmt: skip

    embed: Float[Array, "vocab embed"]
    blocks: Block
    norm: LayerNorm
    lm_head: Float[Array, "vocab embed"] | None
    config: GPTNeoXConfig = eqx.field(static=True)

    def __init__(self, config: GPTNeoXConfig, *, key: PRNGKeyArray, dtype: Any = jnp.float32):
        kembed, kblocks = jax.random.split(key)
        self.embed, self.lm_head = embeddings(
            kembed, vocab=config.vocab_size, embd=config.hidden_size, dtype=dtype, tied=config.tie_word_embeddings
        )
        self.blocks = stacked(lambda k: Block(config, dtype, key=k), kblocks, config.num_hidden_layers)
        self.norm = LayerNorm(config.hidden_size, eps=config.layer_norm_eps, dtype=dtype)
        self.config = config

    @classmethod
    def from_config(cls, config: dict, *, key: PRNGKeyArray, dtype: Any = jnp.float32) -> GPTNeoX:
        """Randomly initialise from a Hugging Face `config.json` dict."""
        return cls(GPTNeoXConfig.from_hf(config), key=key, dtype=dtype)

    def logits(self, tokens: Tokens, remat: Any) -> tuple[Array, tuple[Array | None, Array | None]]:
        """Embed, the stacked blocks (partial RoPE), the final LayerNorm, the head."""
        x = self.embed[tokens.ids]
        cos, sin = self.config.rope.angles(tokens.positions, x.dtype)
        x, kv = run_layers(self.blocks, x, tokens, cos=cos, sin=sin, remat=remat)
        return head(self.norm(x), self.embed, self.lm_head), kv
