"""DINOv2 (`Dinov2Model`, and `Dinov2WithRegistersModel`) in Equinox: a ViT that takes images of any size.

A pre-LayerNorm encoder over image patches, built from `port.nn` (`Attention` without a
mask, `LayerNorm`, `MLP` or SwiGLU's `GatedMLP`) and ViT's strided patch convolution
(`port.models.vit.patch_embeddings`). What is DINOv2's own is here:

- LayerScale: each residual branch is multiplied by a learned per-feature vector
  (`layer_scale1.lambda1`, `layer_scale2.lambda1`) before it is added.
- The feed-forward is GELU's `MLP` (`fc1`, `fc2`) or, with `use_swiglu_ffn` (the giant
  model), a SwiGLU whose hidden size is two thirds of `hidden_size * mlp_ratio`, rounded
  up to a multiple of 8; its fused `weights_in` is split into gate and up by the mapping.
- Position embeddings are learned for config.json's `image_size`, and resized to the
  patch grid of the image given, with torch's bicubic (`port.nn._resize`) in float32:
  without antialiasing for `dinov2`, with it for `dinov2_with_registers`, as
  transformers resizes each. An image of the trained grid uses the table as it is.
- `dinov2_with_registers`: `num_register_tokens` learned tokens go between the class
  token and the patches, after the position embeddings are added (they have none).
- `mask_token` is loaded (so `port export` writes it back) but unused: `__call__` takes
  no `bool_masked_pos` (a pre-training input).

`__call__` returns the last hidden state (final LayerNorm applied), `(batch, 1 +
registers + patches, embd)`; `pooled` is its class token, as transformers' `pooler_output`.
Stochastic depth (`drop_path_rate`) and dropout are training-only and not run.

Example:
    ```python
    import equinox as eqx
    import jax
    import jax.numpy as jnp
    from port.models.dinov2 import DINOv2

    config = {"model_type": "dinov2", "hidden_size": 64, "num_hidden_layers": 2,
              "num_attention_heads": 4, "image_size": 56, "patch_size": 14}
    model = DINOv2.from_config(config, key=jax.random.key(0))
    hidden = eqx.filter_jit(model)(jnp.zeros((2, 3, 56, 56)))   # (2, 17, 64): class token + 4 x 4 patches
    hidden = model(jnp.zeros((2, 3, 70, 42)))                   # (2, 16, 64): 5 x 3 patches, positions resized
    pooled = model.pooled(hidden)                                # (2, 64): the class token
    # Without the batch axis: pixels (3, 56, 56) give hidden (17, 64)
    # bfloat16 compute on float32 parameters, each layer recomputed in the backward pass:
    hidden = model(jnp.zeros((2, 3, 56, 56)), dtype=jnp.bfloat16, remat=True)

    registers = {**config, "model_type": "dinov2_with_registers", "num_register_tokens": 4}
    model = DINOv2.from_config(registers, key=jax.random.key(0))
    model(jnp.zeros((2, 3, 56, 56))).shape                      # (2, 21, 64): class, 4 registers, 16 patches

    # Shapes only, no memory allocated (e.g. before loading a checkpoint):
    abstract = eqx.filter_eval_shape(DINOv2.from_config, config, key=jax.random.key(0))
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
from port.models.vit import patch_embeddings, size_pair
from port.nn import MLP, Attention, GatedMLP, LayerNorm, bicubic_resize, cast, normal, scan, stacked
from port.nn._inputs import batch_first, check_pixels
from port.nn.config import MAX_LAYERS, ConfigFields, activation, check_model_type, get

MODEL_TYPES = ("dinov2", "dinov2_with_registers")


def swiglu_size(hidden_size: int, mlp_ratio: int | float) -> int:
    """The SwiGLU feed-forward's hidden size: two thirds of `hidden_size * mlp_ratio`, rounded up to a multiple of 8.

    ```python
    swiglu_size(1536, 4)    # 4096 (dinov2-giant)
    ```
    """
    return (int(int(hidden_size * mlp_ratio) * 2 / 3) + 7) // 8 * 8


@final
@dataclasses.dataclass(frozen=True)
class DINOv2Config:
    """The hyperparameters of a DINOv2 encoder, as read from a Hugging Face config.json."""

    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    head_dim: int
    mlp_size: int  # the feed-forward's hidden size (SwiGLU's already rounded)
    hidden_act: str
    image_size: tuple[int, int]  # (height, width)
    patch_size: tuple[int, int]
    num_channels: int = 3
    qkv_bias: bool = True
    layer_norm_eps: float = 1e-6
    layerscale_value: float = 1.0
    use_swiglu_ffn: bool = False
    use_mask_token: bool = True
    num_register_tokens: int = 0  # 0: plain DINOv2 (no register tokens)
    antialias: bool = False  # how the position table is resized: transformers' per model type

    @property
    def grid(self) -> tuple[int, int]:
        """The patch grid the position table was learned for (square: transformers resizes it as one)."""
        return self.image_size[0] // self.patch_size[0], self.image_size[1] // self.patch_size[1]

    @property
    def num_positions(self) -> int:
        """The class token and one position per patch of `grid`."""
        return 1 + self.grid[0] * self.grid[1]

    @classmethod
    def from_hf(cls, config: dict) -> DINOv2Config:
        """Build from a Hugging Face `config.json` dict; raises `ConfigError` if unsupported."""
        model_type = check_model_type(config, MODEL_TYPES, "port.models.dinov2", "dinov2")
        DINOv2.FIELDS.check(config)
        hidden = get(config, "hidden_size", int)
        heads = get(config, "num_attention_heads", int)
        head_dim = get(config, "head_dim", int, None)  # transformers: getattr(config, "head_dim", ...)
        if head_dim is None:
            if hidden % heads != 0:
                raise ConfigError(
                    f"config.json: 'hidden_size' ({hidden}) must be divisible by 'num_attention_heads' ({heads})"
                )
            head_dim = hidden // heads
        image, patch = size_pair(config, "image_size", 224), size_pair(config, "patch_size", 14)
        if image[0] < patch[0] or image[1] < patch[1]:
            raise ConfigError(f"config.json: 'image_size' {list(image)} is smaller than 'patch_size' {list(patch)}")
        if image[0] // patch[0] != image[1] // patch[1]:
            raise ConfigError(
                f"config.json: 'image_size' {list(image)} over 'patch_size' {list(patch)} is not a square grid "
                "(transformers resizes the position embeddings as a square)"
            )
        swiglu = get(config, "use_swiglu_ffn", bool, False)
        ratio = get(config, "mlp_ratio", float, 4)
        registers = model_type == "dinov2_with_registers"
        return cls(
            hidden_size=hidden,
            num_hidden_layers=get(config, "num_hidden_layers", int, maximum=MAX_LAYERS),
            num_attention_heads=heads,
            head_dim=head_dim,
            mlp_size=swiglu_size(hidden, ratio) if swiglu else int(hidden * ratio),
            hidden_act=activation(config, "hidden_act", "gelu"),
            image_size=image,
            patch_size=patch,
            num_channels=get(config, "num_channels", int, 3),
            qkv_bias=get(config, "qkv_bias", bool, True),
            layer_norm_eps=get(config, "layer_norm_eps", float, 1e-6),
            layerscale_value=get(config, "layerscale_value", float, 1.0),
            use_swiglu_ffn=swiglu,
            # the registers' config has no use_mask_token: its checkpoints always carry the mask token
            use_mask_token=registers or get(config, "use_mask_token", bool, True),
            num_register_tokens=get(config, "num_register_tokens", int, 4) if registers else 0,
            antialias=registers,
        )


@final
class Layer(eqx.Module):
    """One pre-LayerNorm layer with LayerScale: `x + attn_scale * attn(attn_norm(x))`, then the same with the MLP.

    `mlp` is the GELU feed-forward, `swiglu` SwiGLU's (`use_swiglu_ffn`); the other is None.
    """

    attn_norm: LayerNorm
    attn: Attention
    attn_scale: Float[Array, " embed"]
    mlp_norm: LayerNorm
    mlp: MLP | None
    swiglu: GatedMLP | None
    mlp_scale: Float[Array, " embed"]

    def __init__(self, config: DINOv2Config, dtype: Any, *, key: PRNGKeyArray):
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
        self.attn_scale = jnp.full((e,), c.layerscale_value, dtype)
        self.mlp_norm = LayerNorm(e, eps=c.layer_norm_eps, dtype=dtype)
        if c.use_swiglu_ffn:
            self.mlp = None
            self.swiglu = GatedMLP(embd=e, inner=c.mlp_size, activation="silu", dtype=dtype, key=kmlp, bias=True)
        else:
            self.mlp = MLP(embd=e, inner=c.mlp_size, activation=c.hidden_act, dtype=dtype, key=kmlp)
            self.swiglu = None
        self.mlp_scale = jnp.full((e,), c.layerscale_value, dtype)

    def __call__(
        self, x: Float[Array, "batch seq embed"], mask: Bool[Array, "batch seq keys"]
    ) -> Float[Array, "batch seq embed"]:
        h, _ = self.attn(self.attn_norm(x), mask)
        x = x + self.attn_scale * h
        feed_forward = self.swiglu if self.mlp is None else self.mlp
        assert feed_forward is not None, "one of mlp and swiglu is built"
        return x + self.mlp_scale * feed_forward(self.mlp_norm(x))


@final
class DINOv2(eqx.Module):
    """The DINOv2 encoder; `__call__` returns the last hidden state (final LayerNorm applied).

    `patch_weight` keeps the checkpoint's Conv2d layout (embd, channels, patch height,
    patch width); `layers` is stacked. `register_tokens` is None for `dinov2`,
    `mask_token` None when `use_mask_token` is false.
    """

    input_kind: ClassVar[str] = "pixel_values"  # what `port verify` feeds it
    FIELDS: ClassVar[ConfigFields] = ConfigFields(
        "port.models.dinov2.DINOv2",
        read=(
            "hidden_size", "num_hidden_layers", "num_attention_heads", "head_dim", "mlp_ratio", "hidden_act",
            "layer_norm_eps", "image_size", "patch_size", "num_channels", "qkv_bias", "layerscale_value",
            "use_swiglu_ffn", "use_mask_token", "num_register_tokens",
            # stochastic depth: training only, the identity at inference (as dropout)
            "drop_path_rate",
            # Dinov2Backbone's feature maps: which layers, normed, reshaped; not the last hidden state
            "out_features", "out_indices", "stage_names", "apply_layernorm", "reshape_hidden_states",
        ),
    )  # fmt: skip

    patch_weight: Float[Array, "embed channels patch_height patch_width"]
    patch_bias: Float[Array, " embed"]
    cls_token: Float[Array, " embed"]
    mask_token: Float[Array, " embed"] | None
    register_tokens: Float[Array, "registers embed"] | None
    position_embeddings: Float[Array, "positions embed"]
    layers: Layer
    norm: LayerNorm
    config: DINOv2Config = eqx.field(static=True)

    def __init__(self, config: DINOv2Config, *, key: PRNGKeyArray, dtype: Any = jnp.float32):
        kpatch, kcls, kreg, kpos, klayers = jax.random.split(key, 5)
        e, (ph, pw) = config.hidden_size, config.patch_size
        self.patch_weight = normal(kpatch, (e, config.num_channels, ph, pw), dtype)
        self.patch_bias = jnp.zeros((e,), dtype)
        self.cls_token = normal(kcls, (e,), dtype)
        self.mask_token = jnp.zeros((e,), dtype) if config.use_mask_token else None
        registers = config.num_register_tokens
        self.register_tokens = normal(kreg, (registers, e), dtype) if registers else None
        self.position_embeddings = normal(kpos, (config.num_positions, e), dtype)
        self.layers = stacked(lambda k: Layer(config, dtype, key=k), klayers, config.num_hidden_layers)
        self.norm = LayerNorm(e, eps=config.layer_norm_eps, dtype=dtype)
        self.config = config

    @classmethod
    def from_config(cls, config: dict, *, key: PRNGKeyArray, dtype: Any = jnp.float32) -> DINOv2:
        """Randomly initialise from a Hugging Face `config.json` dict (`dinov2` or `dinov2_with_registers`)."""
        return cls(DINOv2Config.from_hf(config), key=key, dtype=dtype)

    def __call__(
        self,
        pixel_values: ArrayLike,  # floating (batch, channels, height, width) or unbatched; checked here
        *,
        dtype: Any = None,
        remat: Any = None,
    ) -> Float[Array, "*batch seq embed"]:
        """The last hidden state, (batch, 1 + registers + patches, embd), for (batch, channels, height, width) pixels.

        **Arguments:**

        - `pixel_values`: floating `(batch, channels, height, width)`, or unbatched
          `(channels, height, width)` (run as a batch of one, giving `(1 + registers +
          patches, embd)`). Any height and width of at least one patch: the patches are
          `height // patch` by `width // patch` (the rest is cropped, as the strided
          convolution crops it), and the position embeddings are resized to that grid.
          The channels must be config.json's `num_channels`. Pixels are cast to the
          compute dtype, as transformers casts them to the weights' dtype.
        - `dtype`: the compute dtype (bfloat16 compute on float32 parameters; the
          position table is resized in float32 either way).
        - `remat`: rematerialise each layer in the backward pass (`port.nn.scan`).

        `ValueError` for a bad shape, `TypeError` for a non-floating dtype; one line each.
        The checks read static shapes, so they work under `jax.jit`.

        ```python
        hidden = model(jnp.zeros((2, 3, 224, 224)))  # (2, 1 + registers + 256, embd) with 14 x 14 patches
        hidden = model(jnp.zeros((3, 98, 140)))      # (1 + registers + 70, embd): 7 x 10 patches
        ```
        """
        c = self.config
        batched = check_pixels(pixel_values, channels=c.num_channels, size=None, patch=c.patch_size)
        model = cast(self, dtype)
        (pixels,) = batch_first(batched, jnp.asarray(pixel_values).astype(model.patch_weight.dtype))
        (ph, pw), (h, w) = c.patch_size, pixels.shape[-2:]
        grid = (h // ph, w // pw)
        x = patch_embeddings(pixels, model.patch_weight, model.patch_bias)
        batch, e = x.shape[0], c.hidden_size
        x = jnp.concatenate([jnp.broadcast_to(model.cls_token, (batch, 1, e)), x], axis=1)
        x = x + model._positions(grid)
        if model.register_tokens is not None:
            registers = jnp.broadcast_to(model.register_tokens, (batch, *model.register_tokens.shape))
            x = jnp.concatenate([x[:, :1], registers, x[:, 1:]], axis=1)
        seq = x.shape[1]
        mask = jnp.ones((batch, seq, seq), bool)  # every token sees every token
        x, _ = scan(lambda layer, x: (layer(x, mask), None), x, model.layers, remat=remat)
        x = model.norm(x)
        return x if batched else x[0]

    def _positions(self, grid: tuple[int, int]) -> Float[Array, "seq embed"]:
        """The class token's position and the patches' on `grid`: the learned table, resized if the grid is another."""
        table = self.position_embeddings
        if grid == self.config.grid:
            return table
        side = self.config.grid[0]
        patch_table = table[1:].reshape(side, side, -1)
        resized = bicubic_resize(patch_table, grid, antialias=self.config.antialias)
        return jnp.concatenate([table[:1], resized.reshape(grid[0] * grid[1], -1)], axis=0)

    def pooled(self, hidden: Float[Array, "... seq embed"]) -> Float[Array, "... embed"]:
        """transformers' `pooler_output`: the class token of `__call__`'s result (`hidden[..., 0, :]`).

        ```python
        pooled = model.pooled(model(pixels))   # (batch, embd)
        ```
        """
        return hidden[..., 0, :]
