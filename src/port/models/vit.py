"""ViT (the `ViTModel` image encoder) in Equinox.

A pre-LayerNorm bidirectional encoder over image patches: a strided convolution cuts
the image into patches and embeds each, a class token goes first, learned position
embeddings are added, and the final LayerNorm gives the last hidden state. The layers
are stored *stacked*: every array in `ViT.layers` has a leading axis of size
`num_hidden_layers`, and the forward pass runs them with `jax.lax.scan`.

Example:
    ```python
    import equinox as eqx
    import jax
    import jax.numpy as jnp
    from port.models.vit import ViT

    config = {"hidden_size": 768, "num_hidden_layers": 12, "num_attention_heads": 12,
              "intermediate_size": 3072, "image_size": 224, "patch_size": 16}
    model = ViT.from_config(config, key=jax.random.key(0))
    pixels = jnp.zeros((2, 3, 224, 224))       # (batch, channels, height, width)
    hidden = eqx.filter_jit(model)(pixels)     # (2, 197, 768): class token + 14 x 14 patches
    pooled = model.pooled(hidden)              # (2, 768): tanh(dense(hidden[:, 0]))
    # Without the batch axis: pixels (3, 224, 224) give hidden (197, 768)

    # Shapes only, no memory allocated (e.g. before loading a checkpoint):
    abstract = eqx.filter_eval_shape(ViT.from_config, config, key=jax.random.key(0))
    ```
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any, ClassVar

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, PRNGKeyArray

from port._console import quoted
from port._errors import ConfigError
from port.models._config import ACTIVATIONS, MAX_LAYERS, activation, check, get
from port.models._inputs import check_pixels, per_sequence

POOLER_ACTIVATIONS: dict[str, Callable[[Array], Array]] = {"tanh": jnp.tanh, **ACTIVATIONS}
"""The pooler's activations (`pooler_act`): transformers' default `tanh`, or any of `ACTIVATIONS`."""


def _pair(config: dict, key: str, default: int) -> tuple[int, int]:
    """`config[key]` as (height, width): one positive integer for both, or a list of two."""
    value = config.get(key)
    if value is None:
        return default, default
    if isinstance(value, (list, tuple)):
        if len(value) != 2:
            raise ConfigError(
                f"config.json: {key!r} must be a positive integer or a list of two, got {quoted(value)}"
            )
        return check(key, value[0], int), check(key, value[1], int)
    size = check(key, value, int)
    return size, size


@dataclasses.dataclass(frozen=True)
class ViTConfig:
    """The hyperparameters of a ViT encoder, as read from a Hugging Face config.json."""

    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    head_dim: int
    intermediate_size: int
    hidden_act: str
    image_size: tuple[int, int]  # (height, width)
    patch_size: tuple[int, int]
    num_channels: int = 3
    qkv_bias: bool = True
    layer_norm_eps: float = 1e-12
    pooler_output_size: int | None = None  # None: hidden_size
    pooler_act: str = "tanh"

    @property
    def grid(self) -> tuple[int, int]:
        """Patches per column and per row: the strided convolution drops a partial patch."""
        return self.image_size[0] // self.patch_size[0], self.image_size[1] // self.patch_size[1]

    @property
    def num_positions(self) -> int:
        """The class token and one position per patch."""
        return 1 + self.grid[0] * self.grid[1]

    @classmethod
    def from_hf(cls, config: dict) -> ViTConfig:
        """Build from a Hugging Face `config.json` dict; raises `ConfigError` if unsupported."""
        hidden = get(config, "hidden_size", int)
        heads = get(config, "num_attention_heads", int)
        head_dim = get(config, "head_dim", int, None)  # transformers: getattr(config, "head_dim", ...)
        if head_dim is None:
            if hidden % heads != 0:
                raise ConfigError(
                    f"config.json: 'hidden_size' ({hidden}) must be divisible by "
                    f"'num_attention_heads' ({heads})"
                )
            head_dim = hidden // heads
        image, patch = _pair(config, "image_size", 224), _pair(config, "patch_size", 16)
        if image[0] < patch[0] or image[1] < patch[1]:
            raise ConfigError(
                f"config.json: 'image_size' {list(image)} is smaller than 'patch_size' {list(patch)}"
            )
        pooled = get(config, "pooler_output_size", int, hidden)
        return cls(
            hidden_size=hidden,
            num_hidden_layers=get(config, "num_hidden_layers", int, maximum=MAX_LAYERS),
            num_attention_heads=heads,
            head_dim=head_dim,
            intermediate_size=get(config, "intermediate_size", int),
            hidden_act=activation(config, "hidden_act", "gelu"),
            image_size=image,
            patch_size=patch,
            num_channels=get(config, "num_channels", int, 3),
            qkv_bias=get(config, "qkv_bias", bool, True),
            layer_norm_eps=get(config, "layer_norm_eps", float, 1e-12),
            pooler_output_size=pooled,
            pooler_act=activation(config, "pooler_act", "tanh", tuple(POOLER_ACTIVATIONS)),
        )


def _normal(key: PRNGKeyArray, shape: tuple[int, ...], dtype: Any) -> Array:
    return 0.02 * jax.random.normal(key, shape, dtype)


def _linear(
    in_features: int, out_features: int, dtype: Any, *, key: PRNGKeyArray
) -> eqx.nn.Linear:
    """An `eqx.nn.Linear` with ViT's init: weights N(0, 0.02), zero bias."""
    linear = eqx.nn.Linear(in_features, out_features, dtype=dtype, key=key)
    weight = _normal(jax.random.fold_in(key, 1), (out_features, in_features), dtype)
    bias = jnp.zeros((out_features,), dtype)
    return eqx.tree_at(lambda l: (l.weight, l.bias), linear, (weight, bias))


class Attention(eqx.Module):
    """Bidirectional multi-head self-attention with per-head weights; q/k/v biases per `qkv_bias`."""

    wq: Float[Array, "head head_dim embd"]
    wk: Float[Array, "head head_dim embd"]
    wv: Float[Array, "head head_dim embd"]
    bq: Float[Array, "head head_dim"] | None
    bk: Float[Array, "head head_dim"] | None
    bv: Float[Array, "head head_dim"] | None
    wo: Float[Array, "embd head head_dim"]
    bo: Float[Array, " embd"]

    def __init__(self, config: ViTConfig, dtype: Any, *, key: PRNGKeyArray):
        n, d, e = config.num_attention_heads, config.head_dim, config.hidden_size
        kq, kk, kv, ko = jax.random.split(key, 4)
        self.wq = _normal(kq, (n, d, e), dtype)
        self.wk = _normal(kk, (n, d, e), dtype)
        self.wv = _normal(kv, (n, d, e), dtype)
        bias = (lambda: jnp.zeros((n, d), dtype)) if config.qkv_bias else (lambda: None)
        self.bq, self.bk, self.bv = bias(), bias(), bias()
        self.wo = _normal(ko, (e, n, d), dtype)
        self.bo = jnp.zeros((e,), dtype)

    def __call__(self, x: Float[Array, "seq embd"]) -> Float[Array, "seq embd"]:
        def project(w: Array, b: Array | None) -> Array:
            y = jnp.einsum("te,hde->thd", x, w)
            return y if b is None else y + b

        q, k, v = project(self.wq, self.bq), project(self.wk, self.bk), project(self.wv, self.bv)
        scores = jnp.einsum("qhd,khd->hqk", q, k).astype(jnp.float32) / math.sqrt(q.shape[-1])
        weights = jax.nn.softmax(scores, axis=-1).astype(x.dtype)
        attn = jnp.einsum("hqk,khd->qhd", weights, v)
        return jnp.einsum("thd,ehd->te", attn, self.wo) + self.bo


class MLP(eqx.Module):
    """The position-wise feed-forward network (ViT's intermediate + output dense)."""

    fc: eqx.nn.Linear
    proj: eqx.nn.Linear
    activation: str = eqx.field(static=True)

    def __init__(self, config: ViTConfig, dtype: Any, *, key: PRNGKeyArray):
        kfc, kproj = jax.random.split(key)
        e, i = config.hidden_size, config.intermediate_size
        self.fc = _linear(e, i, dtype, key=kfc)
        self.proj = _linear(i, e, dtype, key=kproj)
        self.activation = config.hidden_act

    def __call__(self, x: Float[Array, "seq embd"]) -> Float[Array, "seq embd"]:
        x = jax.vmap(self.fc)(x)
        x = ACTIVATIONS[self.activation](x)
        return jax.vmap(self.proj)(x)


class Layer(eqx.Module):
    """One pre-LayerNorm encoder layer: `layernorm_before` -> attention, `layernorm_after` -> MLP."""

    attn_norm: eqx.nn.LayerNorm
    attn: Attention
    mlp_norm: eqx.nn.LayerNorm
    mlp: MLP

    def __init__(self, config: ViTConfig, dtype: Any, *, key: PRNGKeyArray):
        kattn, kmlp = jax.random.split(key)
        e, eps = config.hidden_size, config.layer_norm_eps
        self.attn_norm = eqx.nn.LayerNorm(e, eps=eps, dtype=dtype)
        self.attn = Attention(config, dtype, key=kattn)
        self.mlp_norm = eqx.nn.LayerNorm(e, eps=eps, dtype=dtype)
        self.mlp = MLP(config, dtype, key=kmlp)

    def __call__(self, x: Float[Array, "seq embd"]) -> Float[Array, "seq embd"]:
        x = x + self.attn(jax.vmap(self.attn_norm)(x))
        return x + self.mlp(jax.vmap(self.mlp_norm)(x))


class ViT(eqx.Module):
    """The ViT encoder; `__call__` returns the last hidden state (final LayerNorm applied).

    `patch_weight` keeps the checkpoint's Conv2d layout (embd, channels, patch height,
    patch width); `layers` is stacked.
    """

    input_kind: ClassVar[str] = "pixel_values"  # what `port verify` feeds it

    patch_weight: Float[Array, "embd channels patch_h patch_w"]
    patch_bias: Float[Array, " embd"]
    cls_token: Float[Array, " embd"]
    position_embeddings: Float[Array, "positions embd"]
    layers: Layer
    norm: eqx.nn.LayerNorm
    pooler: eqx.nn.Linear | None
    config: ViTConfig = eqx.field(static=True)

    def __init__(self, config: ViTConfig, *, key: PRNGKeyArray, dtype: Any = jnp.float32):
        kpatch, kcls, kpos, klayers, kpool = jax.random.split(key, 5)
        e, (ph, pw) = config.hidden_size, config.patch_size
        self.patch_weight = _normal(kpatch, (e, config.num_channels, ph, pw), dtype)
        self.patch_bias = jnp.zeros((e,), dtype)
        self.cls_token = _normal(kcls, (e,), dtype)
        self.position_embeddings = _normal(kpos, (config.num_positions, e), dtype)
        make_layer = lambda k: Layer(config, dtype, key=k)
        self.layers = eqx.filter_vmap(make_layer)(
            jax.random.split(klayers, config.num_hidden_layers)
        )
        self.norm = eqx.nn.LayerNorm(e, eps=config.layer_norm_eps, dtype=dtype)
        self.pooler = _linear(e, config.pooler_output_size or e, dtype, key=kpool)
        self.config = config

    @classmethod
    def from_config(cls, config: dict, *, key: PRNGKeyArray, dtype: Any = jnp.float32) -> ViT:
        """Randomly initialise from a Hugging Face `config.json` dict (pooler included)."""
        return cls(ViTConfig.from_hf(config), key=key, dtype=dtype)

    def __call__(
        self, pixel_values: Float[Array, "*batch channels height width"]
    ) -> Float[Array, "*batch seq embd"]:
        """The last hidden state, (batch, 1 + patches, embd), for (batch, channels, height, width) pixels.

        Unbatched pixels (channels, height, width) run as a batch of one and give
        (1 + patches, embd). The height and width must be config.json's `image_size`
        (position embeddings are not interpolated) and the channels `num_channels`:
        `ValueError` otherwise, `TypeError` for a non-floating dtype. Pixels are cast
        to the weights' dtype, as transformers does. The checks read static shapes, so
        they work under `jax.jit`.

        ```python
        hidden = model(jnp.zeros((2, 3, 224, 224)))  # (2, 197, embd)
        hidden = model(jnp.zeros((3, 224, 224)))     # (197, embd)
        ```
        """
        batched = check_pixels(
            pixel_values, channels=self.config.num_channels, size=self.config.image_size
        )
        pixels = jnp.asarray(pixel_values).astype(self.patch_weight.dtype)
        return per_sequence(self._forward, batched, pixels)

    def _patches(self, pixels: Float[Array, "channels height width"]) -> Float[Array, "patches embd"]:
        """The Conv2d of kernel = stride = patch size, as patches times the flattened kernel.

        Patches go row by row (torch's `flatten(2)` of the (embd, rows, columns) output).
        """
        (gh, gw), (ph, pw) = self.config.grid, self.config.patch_size
        c = pixels.shape[0]
        grid = pixels[:, : gh * ph, : gw * pw].reshape(c, gh, ph, gw, pw)
        out = jnp.einsum("cipjq,ecpq->ije", grid, self.patch_weight)
        return out.reshape(gh * gw, -1) + self.patch_bias

    def _forward(self, pixels: Float[Array, "channels height width"]) -> Float[Array, "seq embd"]:
        x = jnp.concatenate([self.cls_token[None], self._patches(pixels)])
        x = x + self.position_embeddings
        params, static = eqx.partition(self.layers, eqx.is_array)

        def step(x, layer_params):
            return eqx.combine(layer_params, static)(x), None

        x, _ = jax.lax.scan(step, x, params)
        return jax.vmap(self.norm)(x)

    def pooled(self, hidden: Float[Array, "*batch seq embd"]) -> Float[Array, "*batch pooled"]:
        """ViT's pooler output, `pooler_act(dense(hidden[..., 0, :]))`, from `__call__`'s result.

        `hidden` is (batch, seq, embd), giving (batch, pooled), or unbatched (seq, embd),
        giving (pooled,). `ValueError` if the checkpoint has no pooler (e.g. one saved by
        `ViTForImageClassification`).

        ```python
        pooled = model.pooled(model(pixels))   # (batch, pooler_output_size)
        ```
        """
        if self.pooler is None or self.pooler.weight is None:  # port leaves absent leaves None
            raise ValueError(
                "this ViT checkpoint has no pooler weights ('pooler.dense.weight'); "
                "use the hidden state instead of the pooled output"
            )
        batched = jnp.ndim(hidden) == 3
        if not batched and jnp.ndim(hidden) != 2:
            raise ValueError(
                "`hidden` must have shape (batch, seq, embd) or (seq, embd), "
                f"got {tuple(jnp.shape(hidden))}"
            )
        first = hidden[:, 0] if batched else hidden[None, 0]  # unbatched: a batch of one
        pooled = POOLER_ACTIVATIONS[self.config.pooler_act](jax.vmap(self.pooler)(first))
        return pooled if batched else pooled[0]
