"""SigLIP 2 (`Siglip2VisionModel` with NaFlex inputs, and the dual `Siglip2Model`) in Equinox.

The text tower is SigLIP's (`port.models.siglip.SiglipText`, model_type
`siglip2_text_model`), and so are the encoder layers and the attention pooling head. What
is SigLIP 2's own is the NaFlex vision input: each image comes as its patches,

- `pixel_values` `(batch, max_patches, patch * patch * channels)`: the patches of each
  image row by row, each flattened (patch row, patch column, channel) as the processor
  writes them, padded to `max_patches`;
- `pixel_attention_mask` `(batch, max_patches)`: 1 for an image's patches, 0 for padding;
- `spatial_shapes` `(batch, 2)`: each image's (rows, columns) of patches;

the patch embedding is a Linear, and the square table of learned position embeddings is
resized to each image's (rows, columns) as transformers does (`resize_positions`: an
antialiased bilinear resize, computed in float32; padding takes the first position's).
The encoder's attention and the pooling head never attend to padding.

Example:
    ```python
    import equinox as eqx
    import jax
    import jax.numpy as jnp
    from port.models.siglip2 import Siglip2, Siglip2Vision

    vision_config = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
                     "intermediate_size": 128, "patch_size": 4, "num_patches": 16}
    vision = Siglip2Vision.from_config(vision_config, key=jax.random.key(0))
    pixels = jnp.zeros((2, 16, 4 * 4 * 3))                       # at most 16 patches each
    spatial_shapes = jnp.array([[4, 4], [2, 5]])                  # 4 x 4 patches; 2 x 5 (+ 6 padding)
    mask = jnp.arange(16)[None] < (spatial_shapes[:, 0] * spatial_shapes[:, 1])[:, None]
    hidden = eqx.filter_jit(vision)(pixels, mask, spatial_shapes)  # (2, 16, 64)
    pooled = vision.pooled(hidden, mask)                          # (2, 64)

    text_config = {"vocab_size": 1000, "hidden_size": 64, "num_hidden_layers": 2,
                   "num_attention_heads": 4, "intermediate_size": 128, "max_position_embeddings": 16}
    config = {"model_type": "siglip2", "text_config": text_config, "vision_config": vision_config}
    model = Siglip2.from_config(config, key=jax.random.key(1))
    logits_per_image = model(jnp.zeros((3, 16), jnp.int32), pixels, mask, spatial_shapes)   # (2, 3)
    ```
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, ClassVar, final

import equinox as eqx
import jax
import jax.numpy as jnp
from jax.typing import ArrayLike
from jaxtyping import Array, Float, Int, PRNGKeyArray

from port._errors import ConfigError
from port.models.siglip import (
    ENCODER_FIELDS,
    AttentionPooling,
    EncoderConfig,
    SiglipText,
    encode,
    logit_params,
    logits_per_text,
    no_head,
    tower_config,
)
from port.models.vit import Layer
from port.nn import LayerNorm, cast, normal, stacked
from port.nn._inputs import batch_first
from port.nn._mlp import linear
from port.nn.config import ConfigFields, check_model_type, get


@final
@dataclasses.dataclass(frozen=True)
class VisionConfig:
    """The hyperparameters of a SigLIP 2 (NaFlex) vision tower, as read from its config.json."""

    encoder: EncoderConfig
    num_channels: int
    patch_size: int
    num_patches: int
    use_head: bool

    @property
    def grid(self) -> int:
        """The rows (and columns) of the square position table: sqrt(num_patches)."""
        return math.isqrt(self.num_patches)

    @property
    def patch_pixels(self) -> int:
        """What one flattened patch holds: patch * patch * channels."""
        return self.patch_size * self.patch_size * self.num_channels

    @classmethod
    def from_hf(cls, config: dict) -> VisionConfig:
        """Build from a vision tower's config.json dict; raises `ConfigError` if unsupported."""
        check_model_type(config, ("siglip2_vision_model",), Siglip2Vision.FIELDS.module, "siglip2_vision_model")
        Siglip2Vision.FIELDS.check(config)
        patches = get(config, "num_patches", int, 256)
        if math.isqrt(patches) ** 2 != patches:
            raise ConfigError(f"config.json: 'num_patches' ({patches}) must be a square (the position table's grid)")
        return cls(
            encoder=EncoderConfig.read(config),
            num_channels=get(config, "num_channels", int, 3),
            patch_size=get(config, "patch_size", int, 16),
            num_patches=patches,
            use_head=get(config, "vision_use_head", bool, True),
        )


def resize_positions(
    table: Float[Array, "height width embed"], spatial_shapes: Int[Array, "batch 2"], length: int
) -> Float[Array, "batch patches embed"]:
    """The position table resized to each image's (rows, columns) and padded to `length` positions.

    transformers' `Siglip2VisionEmbeddings.resize_positional_embeddings`: the weights of
    `F.interpolate(mode="bilinear", align_corners=False, antialias=True)` along each axis
    (a triangle filter widened by the downscale factor, normalised), in float32; output
    position `i` is row `i // columns`, column `i % columns` of its image, and positions
    past `rows * columns` take position 0's value. The result has `table`'s dtype.

    ```python
    resize_positions(jnp.zeros((4, 4, 8)), jnp.array([[2, 3]]), 16).shape   # (1, 16, 8)
    ```
    """
    grid, embed = table.shape[0], table.shape[-1]
    sizes = spatial_shapes.astype(jnp.float32)[:, None]  # (batch, 1, 2)
    positions = jnp.arange(length, dtype=jnp.float32)[None, :, None]  # (1, length, 1)
    rows = jnp.floor(positions / sizes[..., 1:])
    index = jnp.concatenate([rows, positions - rows * sizes[..., 1:]], axis=-1)
    index = index * (positions < jnp.prod(sizes, axis=-1, keepdims=True))
    scale = grid / sizes
    support = jnp.maximum(scale, 1.0)
    center = (index + 0.5) * scale - 0.5  # (batch, length, 2)
    source = jnp.arange(grid, dtype=jnp.float32)
    weights = jnp.maximum(1 - jnp.abs(source - center[..., None]) / support[..., None], 0.0)
    weights = weights / jnp.sum(weights, axis=-1, keepdims=True)  # (batch, length, 2, grid)
    both = (weights[..., 0, :, None] * weights[..., 1, None, :]).reshape(*weights.shape[:2], grid * grid)
    flat = table.reshape(grid * grid, embed).astype(jnp.float32)
    return jnp.einsum("blg,ge->ble", both, flat, precision=jax.lax.Precision.HIGHEST).astype(table.dtype)


def check_patches(pixel_values: Any, pixel_attention_mask: Any, spatial_shapes: Any, *, patch_pixels: int) -> bool:
    """Check NaFlex inputs (static shapes and dtypes); return whether they are batched.

    `pixel_values` floating `(batch, patches, patch_pixels)` (or `(patches, patch_pixels)`),
    `pixel_attention_mask` `(batch, patches)` (or `(patches,)`), `spatial_shapes` integer
    `(batch, 2)` (or `(2,)`). `ValueError` / `TypeError`, one line naming the argument.
    """
    shape = tuple(jnp.shape(pixel_values))
    if len(shape) not in (2, 3) or shape[-1] != patch_pixels:
        raise ValueError(
            f"`pixel_values` must have shape (batch, patches, {patch_pixels}) or (patches, {patch_pixels}) "
            f"(patch_size**2 * num_channels of config.json), got {shape}"
        )
    if not jnp.issubdtype(jnp.result_type(pixel_values), jnp.floating):
        raise TypeError(f"`pixel_values` must have a floating dtype, got {jnp.result_type(pixel_values)}")
    mask = tuple(jnp.shape(pixel_attention_mask))
    if mask != shape[:-1]:
        raise ValueError(
            f"`pixel_attention_mask` must have shape {shape[:-1]} like `pixel_values`' patches, got {mask}"
        )
    spatial = tuple(jnp.shape(spatial_shapes))
    if spatial != (*shape[:-2], 2):
        raise ValueError(
            f"`spatial_shapes` must have shape {(*shape[:-2], 2)}: (rows, columns) per image, got {spatial}"
        )
    if not jnp.issubdtype(jnp.result_type(spatial_shapes), jnp.integer):
        raise TypeError(f"`spatial_shapes` must have an integer dtype, got {jnp.result_type(spatial_shapes)}")
    return len(shape) == 3


@final
class Siglip2Vision(eqx.Module):
    """SigLIP 2's NaFlex vision tower; `__call__` returns the last hidden state (`post_layernorm` applied).

    `patch_weight` is the patch Linear `[embd, patch * patch * channels]`; `layers` is
    stacked; `head` is the attention pooling head (None when `vision_use_head` is false).
    `port verify` cannot draw its three inputs: it takes images of one size only.
    """

    input_kind: ClassVar[str] = "pixel_values"
    FIELDS: ClassVar[ConfigFields] = ConfigFields(
        "port.models.siglip2.Siglip2Vision",
        read=(*ENCODER_FIELDS, "num_channels", "patch_size", "num_patches", "vision_use_head"),
    )

    patch_weight: Float[Array, "embed patch_pixels"]
    patch_bias: Float[Array, " embed"]
    position_embeddings: Float[Array, "positions embed"]
    layers: Layer
    norm: LayerNorm
    head: AttentionPooling | None
    config: VisionConfig = eqx.field(static=True)

    def __init__(self, config: VisionConfig, *, key: PRNGKeyArray, dtype: Any = jnp.float32):
        kpatch, kpos, klayers, khead = jax.random.split(key, 4)
        c, e = config, config.encoder.hidden_size
        self.patch_weight = normal(kpatch, (e, c.patch_pixels), dtype)
        self.patch_bias = jnp.zeros((e,), dtype)
        self.position_embeddings = normal(kpos, (c.num_patches, e), dtype)
        self.layers = stacked(lambda k: Layer(c.encoder, dtype, key=k), klayers, c.encoder.num_hidden_layers)
        self.norm = LayerNorm(e, eps=c.encoder.layer_norm_eps, dtype=dtype)
        self.head = AttentionPooling(c.encoder, dtype, key=khead) if c.use_head else None
        self.config = config

    @classmethod
    def from_config(cls, config: dict, *, key: PRNGKeyArray, dtype: Any = jnp.float32) -> Siglip2Vision:
        """Randomly initialise from a vision tower's Hugging Face `config.json` dict."""
        return cls(VisionConfig.from_hf(config), key=key, dtype=dtype)

    def __call__(
        self,
        pixel_values: ArrayLike,  # floating (batch, patches, patch_pixels) or unbatched; checked here
        pixel_attention_mask: ArrayLike,
        spatial_shapes: ArrayLike,
        *,
        dtype: Any = None,
        remat: Any = None,
    ) -> Float[Array, "*batch patches embed"]:
        """The last hidden state, (batch, patches, embd), of NaFlex patches.

        **Arguments:**

        - `pixel_values`: floating `(batch, patches, patch * patch * channels)`, or one
          image's `(patches, patch * patch * channels)`.
        - `pixel_attention_mask`: `(batch, patches)`, nonzero/True for an image's patches.
        - `spatial_shapes`: integer `(batch, 2)`, each image's (rows, columns) of patches;
          `rows * columns` must not exceed `patches` (not checked: values are traced).
        - `dtype`: the compute dtype (bfloat16 compute on float32 parameters).
        - `remat`: rematerialise each layer in the backward pass (`port.nn.scan`).

        Padding positions get an output too (they see the image's patches), as in
        transformers. `ValueError` / `TypeError`, one line, for a bad shape or dtype.

        ```python
        hidden = vision(pixels, mask, spatial_shapes)   # (batch, patches, embd)
        ```
        """
        c = self.config
        batched = check_patches(pixel_values, pixel_attention_mask, spatial_shapes, patch_pixels=c.patch_pixels)
        model = cast(self, dtype)
        pixels, valid, spatial = batch_first(batched, pixel_values, pixel_attention_mask, spatial_shapes)
        pixels = jnp.asarray(pixels).astype(model.patch_weight.dtype)
        valid = jnp.asarray(valid) != 0
        table = model.position_embeddings.reshape(c.grid, c.grid, -1)
        x = linear(pixels, model.patch_weight, model.patch_bias)
        x = x + resize_positions(table, jnp.asarray(spatial), pixels.shape[1])
        seq = x.shape[1]
        x = encode(model.layers, x, jnp.broadcast_to(valid[:, None, :], (x.shape[0], seq, seq)), remat)
        x = model.norm(x)
        return x if batched else x[0]

    def pooled(self, hidden: Float[Array, "... embed"], pixel_attention_mask: ArrayLike) -> Float[Array, "... embed"]:
        """The attention pooling head's output over an image's patches (padding never attended):
        (batch, patches, embd) gives (batch, embd). This is `get_image_features`' embedding.

        `ValueError` if the model has no head (`vision_use_head` false) or the mask's shape
        is not the hidden state's patches'.

        ```python
        pooled = vision.pooled(vision(pixels, mask, spatial_shapes), mask)   # (batch, embd)
        ```
        """
        if self.head is None:
            raise no_head("SigLIP 2")
        if jnp.ndim(hidden) not in (2, 3) or jnp.shape(pixel_attention_mask) != jnp.shape(hidden)[:-1]:
            raise ValueError(
                f"`hidden` (batch, patches, embd) {jnp.shape(hidden)} and `pixel_attention_mask` (batch, patches) "
                f"{jnp.shape(pixel_attention_mask)} do not match"
            )
        batched = jnp.ndim(hidden) == 3
        hidden, valid = batch_first(batched, hidden, pixel_attention_mask)
        pooled = self.head(jnp.asarray(hidden), jnp.asarray(valid) != 0)
        return pooled if batched else pooled[0]


@final
class Siglip2(eqx.Module):
    """The dual SigLIP 2 model (`Siglip2Model`); `__call__` returns `logits_per_image` (images, texts).

    As `port.models.siglip.Siglip`, with NaFlex images (`Siglip2Vision`); the loss is
    `port.models.siglip.sigmoid_loss`.
    """

    FIELDS: ClassVar[ConfigFields] = ConfigFields(
        # its towers' fields, read from text_config (checked against these) and vision_config
        "port.models.siglip2.Siglip2",
        read=SiglipText.FIELDS.read,
    )

    text: SiglipText
    vision: Siglip2Vision
    logit_scale: Float[Array, " scalar"]
    logit_bias: Float[Array, " scalar"]

    def __init__(self, text: SiglipText, vision: Siglip2Vision, dtype: Any = jnp.float32):
        self.text, self.vision = text, vision
        self.logit_scale, self.logit_bias = logit_params(dtype)

    @classmethod
    def from_config(cls, config: dict, *, key: PRNGKeyArray, dtype: Any = jnp.float32) -> Siglip2:
        """Randomly initialise from a `Siglip2Model` config.json dict (`text_config`, `vision_config`)."""
        check_model_type(config, ("siglip2",), cls.FIELDS.module, default="siglip2")
        ktext, kvision = jax.random.split(key)
        text_config = {"model_type": "siglip2_text_model", **tower_config(config, "text_config")}
        text = SiglipText.from_config(text_config, key=ktext, dtype=dtype)
        vision = Siglip2Vision.from_config(tower_config(config, "vision_config"), key=kvision, dtype=dtype)
        if vision.head is None:
            raise ConfigError("config.json: vision_config's vision_use_head false: Siglip2Model pools by the head")
        return cls(text, vision, dtype)

    def text_features(
        self, input_ids: ArrayLike, attention_mask: Any = None, *, dtype: Any = None, remat: Any = None
    ) -> Float[Array, "*batch embed_out"]:
        """The text tower's pooled output (`get_text_features`)."""
        text = cast(self.text, dtype)
        return text.pooled(text(input_ids, attention_mask, remat=remat))

    def image_features(
        self,
        pixel_values: ArrayLike,
        pixel_attention_mask: ArrayLike,
        spatial_shapes: ArrayLike,
        *,
        dtype: Any = None,
        remat: Any = None,
    ) -> Float[Array, "*batch embed"]:
        """The vision tower's pooled output (`get_image_features`) of NaFlex patches."""
        vision = cast(self.vision, dtype)
        hidden = vision(pixel_values, pixel_attention_mask, spatial_shapes, remat=remat)
        return vision.pooled(hidden, pixel_attention_mask)

    def __call__(
        self,
        input_ids: ArrayLike,
        pixel_values: ArrayLike,
        pixel_attention_mask: ArrayLike,
        spatial_shapes: ArrayLike,
        *,
        attention_mask: Any = None,
        dtype: Any = None,
        remat: Any = None,
    ) -> Float[Array, "images texts"]:
        """`logits_per_image` (images, texts); arguments as `SiglipText` and `Siglip2Vision` take them.

        ```python
        logits_per_image = model(ids, pixels, mask, spatial_shapes)   # (images, texts)
        ```
        """
        model = cast(self, dtype)
        text = jnp.atleast_2d(model.text_features(input_ids, attention_mask, remat=remat))
        image = jnp.atleast_2d(model.image_features(pixel_values, pixel_attention_mask, spatial_shapes, remat=remat))
        return logits_per_text(text, image, model.logit_scale, model.logit_bias).T
