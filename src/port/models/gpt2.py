"""GPT-2 as an Equinox model.

What is new in this family, on top of `port.nn`: learned position embeddings (`wpe`,
`n_positions` of them), and projections in GPT-2's `Conv1D` orientation, `(in, out)`,
split per head (loading is a copy, never a transpose), with attention scaled by
`1 / (layer + 1)` when `scale_attn_by_inverse_layer_idx`. LayerNorm, attention scores,
masks, the cache and the layer scan are `port.nn`'s; the blocks are stored *stacked*
(every array in `GPT2.blocks` has a leading axis of size `n_layer`) and run by
`port.nn.run_layers`, so compile time does not grow with depth. The LM head is `wte`.

Example:
    ```python
    import equinox as eqx
    import jax
    import jax.numpy as jnp
    import port
    from port.models.gpt2 import GPT2

    config = {"vocab_size": 50257, "n_positions": 1024, "n_embd": 768,
              "n_layer": 12, "n_head": 12}
    model = GPT2.from_config(config, key=jax.random.key(0))
    logits = eqx.filter_jit(model)(jnp.zeros((1, 8), dtype=jnp.int32))
    # logits.shape == (1, 8, 50257); without the batch axis, (8,) ids give (8, 50257)
    out = port.generate(model, prompt_ids, max_new_tokens=16, attention_mask=prompt_mask)

    # Shapes only, no memory allocated (e.g. before loading a checkpoint):
    abstract = eqx.filter_eval_shape(GPT2.from_config, config, key=jax.random.key(0))
    ```
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar, final

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int, PRNGKeyArray

from port._errors import ConfigError
from port.nn import (
    Decoder,
    LayerNorm,
    Tokens,
    attend,
    normal,
    run_layers,
    stacked,
    with_cache,
)
from port.nn._attention import KV
from port.nn.config import ACTIVATIONS, MAX_LAYERS, ConfigFields, activation, get


@final
@dataclasses.dataclass(frozen=True)
class GPT2Config:
    """The hyperparameters of a GPT-2 model, as read from a Hugging Face config.json.

    ```python
    c = GPT2Config.from_hf({"vocab_size": 101, "n_positions": 32, "n_embd": 64, "n_layer": 2, "n_head": 4})
    c.head_dim, c.n_inner    # 16, 256
    ```
    """

    vocab_size: int
    n_positions: int
    n_embd: int
    n_layer: int
    n_head: int
    n_inner: int
    layer_norm_epsilon: float
    activation_function: str
    scale_attn_weights: bool = True
    scale_attn_by_inverse_layer_idx: bool = False

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    @classmethod
    def from_hf(cls, config: dict) -> GPT2Config:
        """Build from a Hugging Face `config.json` dict; raises `ConfigError` if unsupported."""
        GPT2.FIELDS.check(config)
        n_embd = get(config, "n_embd", int)
        n_head = get(config, "n_head", int)
        if n_embd % n_head != 0:
            raise ConfigError(f"config.json: 'n_embd' ({n_embd}) must be divisible by 'n_head' ({n_head})")
        n_inner = get(config, "n_inner", int, 4 * n_embd)
        act = activation(config, "activation_function", "gelu_new")
        # `reorder_and_upcast_attn` only changes where the softmax is upcast; we
        # always compute the softmax in float32, so it needs no handling.
        get(config, "reorder_and_upcast_attn", bool, False)
        return cls(
            vocab_size=get(config, "vocab_size", int),
            n_positions=get(config, "n_positions", int),
            n_embd=n_embd,
            n_layer=get(config, "n_layer", int, maximum=MAX_LAYERS),
            n_head=n_head,
            n_inner=n_inner,
            layer_norm_epsilon=get(config, "layer_norm_epsilon", float, 1e-5),
            activation_function=act,
            scale_attn_weights=get(config, "scale_attn_weights", bool, True),
            scale_attn_by_inverse_layer_idx=get(config, "scale_attn_by_inverse_layer_idx", bool, False),
        )


@final
class Attention(eqx.Module):
    """Causal multi-head self-attention, projections in `Conv1D` orientation split per head.

    **Arguments:** `config` (sizes and the two scaling flags), `dtype`, `key`.

    Called as `attn(x, mask, kv=, index=, layer=)` -> `(y, kv)`: `x` `[batch, seq, embd]`,
    `mask` from `port.nn.prepare`, `kv`/`index` this layer's cache (None: none), `layer`
    the layer's index (traced; the scores are divided by `layer + 1` when
    `scale_attn_by_inverse_layer_idx`).

    ```python
    attn = Attention(config, jnp.float32, key=key)
    y, _ = attn(x, tokens.mask, layer=jnp.asarray(0))
    ```
    """

    wq: Float[Array, "embed heads head_dim"]
    wk: Float[Array, "embed heads head_dim"]
    wv: Float[Array, "embed heads head_dim"]
    bq: Float[Array, "heads head_dim"]
    bk: Float[Array, "heads head_dim"]
    bv: Float[Array, "heads head_dim"]
    wo: Float[Array, "heads head_dim embed"]
    bo: Float[Array, " embed"]
    scale_attn_weights: bool = eqx.field(static=True)
    scale_attn_by_inverse_layer_idx: bool = eqx.field(static=True)

    def __init__(self, config: GPT2Config, dtype: Any, *, key: PRNGKeyArray):
        h, d, e = config.n_head, config.head_dim, config.n_embd
        kq, kk, kv, ko = jax.random.split(key, 4)
        self.wq, self.wk = normal(kq, (e, h, d), dtype), normal(kk, (e, h, d), dtype)
        self.wv = normal(kv, (e, h, d), dtype)
        self.bq, self.bk, self.bv = jnp.zeros((h, d), dtype), jnp.zeros((h, d), dtype), jnp.zeros((h, d), dtype)
        self.wo = normal(ko, (h, d, e), dtype)
        self.bo = jnp.zeros((e,), dtype)
        self.scale_attn_weights = config.scale_attn_weights
        self.scale_attn_by_inverse_layer_idx = config.scale_attn_by_inverse_layer_idx

    def __call__(
        self,
        x: Float[Array, "batch seq embed"],
        mask: Bool[Array, "batch seq keys"],
        *,
        kv: KV | None = None,
        index: Array | None = None,
        layer: Int[Array, ""] | int = 0,
    ) -> tuple[Float[Array, "batch seq embed"], KV | None]:
        q = jnp.einsum("bte,ehd->bthd", x, self.wq) + self.bq
        k = jnp.einsum("bte,ehd->bthd", x, self.wk) + self.bk
        v = jnp.einsum("bte,ehd->bthd", x, self.wv) + self.bv
        if self.scale_attn_by_inverse_layer_idx:  # scores / (layer + 1): attend's scale is a Python float
            q = q / (jnp.asarray(layer) + 1).astype(q.dtype)
        k, v, kv = with_cache(k, v, kv, index)
        out = attend(q, k, v, mask, scale=q.shape[-1] ** -0.5 if self.scale_attn_weights else 1.0)
        return jnp.einsum("bthd,hde->bte", out, self.wo) + self.bo, kv


@final
class MLP(eqx.Module):
    """The position-wise feed-forward network, weights in `Conv1D` orientation (in, out).

    **Arguments:** `config` (`n_embd`, `n_inner`, `activation_function`), `dtype`, `key`.

    ```python
    mlp = MLP(config, jnp.float32, key=key)
    y = mlp(x)    # act(x @ w_fc + b_fc) @ w_proj + b_proj; x: [..., n_embd]
    ```
    """

    w_fc: Float[Array, "embed mlp"]
    b_fc: Float[Array, " mlp"]
    w_proj: Float[Array, "mlp embed"]
    b_proj: Float[Array, " embed"]
    activation: str = eqx.field(static=True)

    def __init__(self, config: GPT2Config, dtype: Any, *, key: PRNGKeyArray):
        kfc, kproj = jax.random.split(key)
        self.w_fc = normal(kfc, (config.n_embd, config.n_inner), dtype)
        self.b_fc = jnp.zeros((config.n_inner,), dtype)
        self.w_proj = normal(kproj, (config.n_inner, config.n_embd), dtype)
        self.b_proj = jnp.zeros((config.n_embd,), dtype)
        self.activation = config.activation_function

    def __call__(self, x: Float[Array, "... embed"]) -> Float[Array, "... embed"]:
        x = ACTIVATIONS[self.activation](x @ self.w_fc + self.b_fc)
        return x @ self.w_proj + self.b_proj


@final
class Block(eqx.Module):
    """One pre-LayerNorm transformer block. **Arguments:** `config`, `dtype`, `key`.

    Called as `port.nn.run_layers` calls blocks (no RoPE: `cos` and `sin` are None).
    """

    ln_1: LayerNorm
    attn: Attention
    ln_2: LayerNorm
    mlp: MLP

    def __init__(self, config: GPT2Config, dtype: Any, *, key: PRNGKeyArray):
        kattn, kmlp = jax.random.split(key)
        eps = config.layer_norm_epsilon
        self.ln_1 = LayerNorm(config.n_embd, eps=eps, dtype=dtype)
        self.attn = Attention(config, dtype, key=kattn)
        self.ln_2 = LayerNorm(config.n_embd, eps=eps, dtype=dtype)
        self.mlp = MLP(config, dtype, key=kmlp)

    def __call__(
        self,
        x: Float[Array, "batch seq embed"],
        mask: Bool[Array, "batch seq keys"],
        *,
        cos: None = None,
        sin: None = None,
        kv: KV | None = None,
        index: Array | None = None,
        layer: Int[Array, ""] | int = 0,
    ) -> tuple[Float[Array, "batch seq embed"], KV | None]:
        h, kv = self.attn(self.ln_1(x), mask, kv=kv, index=index, layer=layer)
        x = x + h
        return x + self.mlp(self.ln_2(x)), kv


@final
class GPT2(Decoder):
    """GPT-2 language model with a tied LM head. Arrays in `blocks` are stacked over layers.

    Called as every `port.nn.Decoder`: `model(input_ids, *, attention_mask=None, positions=None,
    segment_ids=None, cache=None, dtype=None, remat=None)`; positions stop at `n_positions`
    (its learned table), and so does `init_cache`'s length.

    **Arguments:** `config` (a `GPT2Config`; `from_config` reads a config.json dict),
    `key`, `dtype` (the parameters').
    """

    FIELDS: ClassVar[ConfigFields] = ConfigFields(
        "port.models.gpt2.GPT2",
        read=(
            "vocab_size", "n_positions", "n_embd", "n_layer", "n_head", "n_inner", "activation_function",
            "layer_norm_epsilon", "scale_attn_weights", "scale_attn_by_inverse_layer_idx",
            "reorder_and_upcast_attn",  # where the softmax is upcast: port's is always float32
        ),
        fixed={"add_cross_attention": (False,), "tie_word_embeddings": (True,)},
    )  # fmt: skip

    wte: Float[Array, "vocab embed"]
    wpe: Float[Array, "positions embed"]
    blocks: Block
    ln_f: LayerNorm
    config: GPT2Config = eqx.field(static=True)

    def __init__(self, config: GPT2Config, *, key: PRNGKeyArray, dtype: Any = jnp.float32):
        kwte, kwpe, kblocks = jax.random.split(key, 3)
        self.wte = normal(kwte, (config.vocab_size, config.n_embd), dtype)
        self.wpe = normal(kwpe, (config.n_positions, config.n_embd), dtype)
        self.blocks = stacked(lambda k: Block(config, dtype, key=k), kblocks, config.n_layer)
        self.ln_f = LayerNorm(config.n_embd, eps=config.layer_norm_epsilon, dtype=dtype)
        self.config = config

    @classmethod
    def from_config(cls, config: dict, *, key: PRNGKeyArray, dtype: Any = jnp.float32) -> GPT2:
        """Randomly initialise from a Hugging Face `config.json` dict."""
        return cls(GPT2Config.from_hf(config), key=key, dtype=dtype)

    @property
    def cache_sizes(self) -> tuple[int, int, int]:
        return self.config.n_layer, self.config.n_head, self.config.head_dim

    @property
    def position_limit(self) -> tuple[str, int]:
        return "n_positions", self.config.n_positions

    def logits(self, tokens: Tokens, remat: Any) -> tuple[Array, tuple[Array | None, Array | None]]:
        """Token plus learned position embeddings, the stacked blocks, `ln_f`, the tied head."""
        x = self.wte[tokens.ids] + self.wpe[tokens.positions]
        x, kv = run_layers(self.blocks, x, tokens, remat=remat)
        return jnp.einsum("bte,ve->btv", self.ln_f(x), self.wte), kv
