"""ViT (the `ViTModel` image encoder) in Equinox.

A pre-LayerNorm bidirectional encoder over image patches, built from `port.nn`: its
`Attention` (no mask; q/k/v biases per `qkv_bias`), `LayerNorm` and `MLP`, and BERT's
`port.nn.Pooler`. What is ViT's own is here: a strided convolution cuts the image into patches
and embeds each, a class token goes first, learned position embeddings are added, and
the final LayerNorm gives the last hidden state. The layers are stored *stacked*: every
array in `ViT.layers` has a leading axis of size `num_hidden_layers`, and the forward
pass runs them batch-first with `port.nn.scan`.

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
    # bfloat16 compute on float32 parameters, each layer recomputed in the backward pass:
    hidden = model(pixels, dtype=jnp.bfloat16, remat=True)

    # Shapes only, no memory allocated (e.g. before loading a checkpoint):
    abstract = eqx.filter_eval_shape(ViT.from_config, config, key=jax.random.key(0))
    ```
"""

from __future__ import annotations

import dataclasses
from abc import abstractmethod
from collections.abc import Callable
from typing import Any, ClassVar, Protocol, final, runtime_checkable

import equinox as eqx
import jax
import jax.numpy as jnp
from jax.typing import ArrayLike
from jaxtyping import Array, Bool, Float, PRNGKeyArray

from port._errors import ConfigError
from port._text import quoted
from port.nn import MLP, Attention, LayerNorm, Pooler, cast, normal, scan, stacked
from port.nn._inputs import batch_first, check_pixels
from port.nn.config import ACTIVATIONS, MAX_LAYERS, ConfigFields, activation, check, check_model_type, get

POOLER_ACTIVATIONS: dict[str, Callable[[Array], Array]] = {"tanh": jnp.tanh, **ACTIVATIONS}
"""The pooler's activations (`pooler_act`): transformers' default `tanh`, or any of `ACTIVATIONS`."""


def size_pair(config: dict, key: str, default: int) -> tuple[int, int]:
    """`config[key]` as (height, width): one positive integer for both, or a list of two.

    ```python
    size_pair({"image_size": 224}, "image_size", 224)          # (224, 224)
    size_pair({"patch_size": [14, 16]}, "patch_size", 16)      # (14, 16)
    ```
    """
    value = config.get(key)
    if value is None:
        return default, default
    if isinstance(value, (list, tuple)):
        if len(value) != 2:
            raise ConfigError(f"config.json: {key!r} must be a positive integer or a list of two, got {quoted(value)}")
        return check(key, value[0], int), check(key, value[1], int)
    size = check(key, value, int)
    return size, size


def patches(
    pixels: Float[Array, "batch channels height width"],
    weight: Float[Array, "embed channels patch_height patch_width"],
    grid: tuple[int, int],
) -> Float[Array, "batch patches embed"]:
    """A Conv2d of kernel = stride = patch size, without bias, as patches times the flattened kernel.

    `grid` is the patches per column and per row; pixels a partial patch would need are
    dropped, as the strided convolution drops them. Patches go row by row (torch's
    `flatten(2)` of the (embd, rows, columns) output).
    """
    (gh, gw), (ph, pw) = grid, weight.shape[2:]
    b, ch = pixels.shape[:2]
    cells = pixels[:, :, : gh * ph, : gw * pw].reshape(b, ch, gh, ph, gw, pw)
    out = jnp.einsum("bcipjq,ecpq->bije", cells, weight)
    return out.reshape(b, gh * gw, -1)


def patch_embeddings(
    pixels: Float[Array, "batch channels height width"],
    weight: Float[Array, "embed channels patch_height patch_width"],
    bias: Float[Array, " embed"],
) -> Float[Array, "batch patches embed"]:
    """`patches` on the grid the pixels' own size gives (`height // patch`, `width // patch`), plus the bias:
    the patch embeddings of a model that takes images of any size (DINOv2) or checks the size first (SigLIP).

    ```python
    patch_embeddings(jnp.zeros((2, 3, 18, 16)), jnp.zeros((8, 3, 4, 4)), jnp.zeros(8)).shape  # (2, 16, 8)
    ```
    """
    (ph, pw), (h, w) = weight.shape[2:], pixels.shape[2:]
    return patches(pixels, weight, (h // ph, w // pw)) + bias


@final
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
        check_model_type(config, ("vit",), "port.models.vit", "vit")
        ViT.FIELDS.check(config)
        hidden = get(config, "hidden_size", int)
        heads = get(config, "num_attention_heads", int)
        head_dim = get(config, "head_dim", int, None)  # transformers: getattr(config, "head_dim", ...)
        if head_dim is None:
            if hidden % heads != 0:
                raise ConfigError(
                    f"config.json: 'hidden_size' ({hidden}) must be divisible by 'num_attention_heads' ({heads})"
                )
            head_dim = hidden // heads
        image, patch = size_pair(config, "image_size", 224), size_pair(config, "patch_size", 16)
        if image[0] < patch[0] or image[1] < patch[1]:
            raise ConfigError(f"config.json: 'image_size' {list(image)} is smaller than 'patch_size' {list(patch)}")
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


@runtime_checkable
class LayerSizes(Protocol):
    """What `Layer` reads of a config: `ViTConfig`, and the configs of other pre-LayerNorm encoders
    (CLIP's towers, `port.models.clip`): read-only sizes (abstract: any object with these fields answers it)."""

    @property
    @abstractmethod
    def hidden_size(self) -> int: ...
    @property
    @abstractmethod
    def num_attention_heads(self) -> int: ...
    @property
    @abstractmethod
    def head_dim(self) -> int: ...
    @property
    @abstractmethod
    def intermediate_size(self) -> int: ...
    @property
    @abstractmethod
    def hidden_act(self) -> str: ...
    @property
    @abstractmethod
    def qkv_bias(self) -> bool: ...
    @property
    @abstractmethod
    def layer_norm_eps(self) -> float: ...


@final
class Layer(eqx.Module):
    """One pre-LayerNorm encoder layer: `x + attn(layernorm_before(x))`, then `x + mlp(layernorm_after(x))`."""

    attn_norm: LayerNorm
    attn: Attention
    mlp_norm: LayerNorm
    mlp: MLP

    def __init__(self, config: LayerSizes, dtype: Any, *, key: PRNGKeyArray):
        kattn, kmlp = jax.random.split(key)
        c, e = config, config.hidden_size
        self.attn_norm = LayerNorm(e, eps=c.layer_norm_eps, dtype=dtype)
        self.attn = Attention(
            heads=c.num_attention_heads,
            kv_heads=c.num_attention_heads,
            head_dim=c.head_dim,
            embd=e,
            dtype=dtype,
            key=kattn,
            qkv_bias=c.qkv_bias,
            o_bias=True,
        )
        self.mlp_norm = LayerNorm(e, eps=c.layer_norm_eps, dtype=dtype)
        self.mlp = MLP(embd=e, inner=c.intermediate_size, activation=c.hidden_act, dtype=dtype, key=kmlp)

    def __call__(
        self, x: Float[Array, "batch seq embed"], mask: Bool[Array, "batch seq keys"]
    ) -> Float[Array, "batch seq embed"]:
        h, _ = self.attn(self.attn_norm(x), mask)
        x = x + h
        return x + self.mlp(self.mlp_norm(x))


@final
class ViT(eqx.Module):
    """The ViT encoder; `__call__` returns the last hidden state (final LayerNorm applied).

    `patch_weight` keeps the checkpoint's Conv2d layout (embd, channels, patch height,
    patch width); `layers` is stacked.
    """

    input_kind: ClassVar[str] = "pixel_values"  # what `port verify` feeds it
    FIELDS: ClassVar[ConfigFields] = ConfigFields(
        "port.models.vit.ViT",
        read=(
            "hidden_size", "num_hidden_layers", "num_attention_heads", "head_dim", "intermediate_size",
            "hidden_act", "layer_norm_eps", "image_size", "patch_size", "num_channels", "qkv_bias",
            "pooler_output_size", "pooler_act",
        ),
    )  # fmt: skip

    patch_weight: Float[Array, "embed channels patch_height patch_width"]
    patch_bias: Float[Array, " embed"]
    cls_token: Float[Array, " embed"]
    position_embeddings: Float[Array, "positions embed"]
    layers: Layer
    norm: LayerNorm
    pooler: Pooler
    config: ViTConfig = eqx.field(static=True)

    def __init__(self, config: ViTConfig, *, key: PRNGKeyArray, dtype: Any = jnp.float32):
        kpatch, kcls, kpos, klayers, kpool = jax.random.split(key, 5)
        e, (ph, pw) = config.hidden_size, config.patch_size
        self.patch_weight = normal(kpatch, (e, config.num_channels, ph, pw), dtype)
        self.patch_bias = jnp.zeros((e,), dtype)
        self.cls_token = normal(kcls, (e,), dtype)
        self.position_embeddings = normal(kpos, (config.num_positions, e), dtype)
        self.layers = stacked(lambda k: Layer(config, dtype, key=k), klayers, config.num_hidden_layers)
        self.norm = LayerNorm(e, eps=config.layer_norm_eps, dtype=dtype)
        self.pooler = Pooler(e, config.pooler_output_size or e, dtype, key=kpool)
        self.config = config

    @classmethod
    def from_config(cls, config: dict, *, key: PRNGKeyArray, dtype: Any = jnp.float32) -> ViT:
        """Randomly initialise from a Hugging Face `config.json` dict (pooler included)."""
        return cls(ViTConfig.from_hf(config), key=key, dtype=dtype)

    def __call__(
        self,
        pixel_values: ArrayLike,  # floating (batch, channels, height, width) or unbatched; checked here
        *,
        dtype: Any = None,
        remat: Any = None,
    ) -> Float[Array, "*batch seq embed"]:
        """The last hidden state, (batch, 1 + patches, embd), for (batch, channels, height, width) pixels.

        **Arguments:**

        - `pixel_values`: floating `(batch, channels, height, width)`, or unbatched
          `(channels, height, width)` (run as a batch of one, giving `(1 + patches, embd)`).
          The height and width must be config.json's `image_size` (position embeddings
          are not interpolated) and the channels `num_channels`. Pixels are cast to the
          compute dtype, as transformers casts them to the weights' dtype.
        - `dtype`: the compute dtype (bfloat16 compute on float32 parameters).
        - `remat`: rematerialise each layer in the backward pass (`port.nn.scan`).

        `ValueError` for a bad shape, `TypeError` for a non-floating dtype; one line each.
        The checks read static shapes, so they work under `jax.jit`.

        ```python
        hidden = model(jnp.zeros((2, 3, 224, 224)))  # (2, 197, embd)
        hidden = model(jnp.zeros((3, 224, 224)))     # (197, embd)
        ```
        """
        c = self.config
        batched = check_pixels(pixel_values, channels=c.num_channels, size=c.image_size)
        model = cast(self, dtype)
        (pixels,) = batch_first(batched, jnp.asarray(pixel_values).astype(model.patch_weight.dtype))
        patches = model._patches(pixels)
        batch, e = patches.shape[0], c.hidden_size
        x = jnp.concatenate([jnp.broadcast_to(model.cls_token, (batch, 1, e)), patches], axis=1)
        x = x + model.position_embeddings
        seq = x.shape[1]
        mask = jnp.ones((batch, seq, seq), bool)  # every patch sees every patch
        x, _ = scan(lambda layer, x: (layer(x, mask), None), x, model.layers, remat=remat)
        x = model.norm(x)
        return x if batched else x[0]

    def _patches(self, pixels: Float[Array, "batch channels height width"]) -> Float[Array, "batch patches embed"]:
        """The Conv2d of kernel = stride = patch size, as patches times the flattened kernel.

        Patches go row by row (torch's `flatten(2)` of the (embd, rows, columns) output).
        """
        (gh, gw), (ph, pw) = self.config.grid, self.config.patch_size
        b, ch = pixels.shape[:2]
        grid = pixels[:, :, : gh * ph, : gw * pw].reshape(b, ch, gh, ph, gw, pw)
        out = jnp.einsum("bcipjq,ecpq->bije", grid, self.patch_weight)
        return out.reshape(b, gh * gw, -1) + self.patch_bias

    def pooled(self, hidden: Float[Array, "... embed"]) -> Float[Array, "... embed_out"]:
        """ViT's pooler output, `pooler_act(dense(hidden[..., 0, :]))`, from `__call__`'s result.

        `hidden` is (batch, seq, embd), giving (batch, pooled), or unbatched (seq, embd),
        giving (pooled,). `ValueError` if the checkpoint has no pooler (e.g. one saved by
        `ViTForImageClassification`).

        ```python
        pooled = model.pooled(model(pixels))   # (batch, pooler_output_size)
        ```
        """
        return self.pooler(hidden, POOLER_ACTIVATIONS[self.config.pooler_act], "ViT")
