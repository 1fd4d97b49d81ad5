"""CLIP in Equinox: the text tower (`CLIPTextModel`), the vision tower (`CLIPVisionModel`) and
the dual model (`CLIPModel`) with its projections and logit scale.

Both towers are pre-LayerNorm bidirectional encoders built from ViT's `Layer`
(`port.nn`'s `Attention`, `LayerNorm` and `MLP`, biases everywhere, quick-GELU by
default). What is CLIP's own is here. The text tower adds learned position embeddings
(`0, 1, ...` whatever the padding) to its token embeddings, attends causally and never to
padding, ends with `final_layer_norm`, and pools the hidden state at the end-of-text
token. The vision tower cuts the image into patches with a bias-free convolution
(`port.models.vit.patches`), puts a class embedding first, adds position embeddings,
normalises before its layers (`pre_layrnorm`, sic), and pools the class token through
`post_layernorm` (the last hidden state is not normalised). The dual model projects each
pooled output into the shared space (`text_projection`, `visual_projection`) and scores
every image against every text by the normalised embeddings' cosine times
`exp(logit_scale)`.

A tower loads from its own checkpoint (`CLIPTextModel`, `CLIPVisionModel`) or from a dual
model's (`mapping="clip_text"` / `"clip_vision"`: config.json's `text_config` /
`vision_config`, the other tower and the projections ignored; `port export` then writes
the tower's class). `CLIPTextWithProjection` / `CLIPVisionWithProjection` are a tower and
its projection (`CLIPTextModelWithProjection` / `CLIPVisionModelWithProjection`, chosen by
config.json's `architectures`; from a dual model's checkpoint, `mapping="clip_text_projection"`
/ `"clip_vision_projection"`); they return the projected pooled output. The layers are
stored *stacked*, run with `port.nn.scan`.

Example:
    ```python
    import equinox as eqx
    import jax
    import jax.numpy as jnp
    from port.models.clip import CLIP, CLIPText, CLIPVision, contrastive_loss

    text = {"vocab_size": 49408, "hidden_size": 512, "intermediate_size": 2048,
            "num_hidden_layers": 2, "num_attention_heads": 8, "max_position_embeddings": 77}
    vision = {"hidden_size": 768, "intermediate_size": 3072, "num_hidden_layers": 2,
              "num_attention_heads": 12, "image_size": 224, "patch_size": 32}
    ids = jnp.array([[49406, 320, 1125, 49407, 0], [49406, 320, 49407, 0, 0]])
    mask = (jnp.arange(5) < jnp.array([[4], [3]])).astype(jnp.int32)   # right padding
    pixels = jnp.zeros((2, 3, 224, 224))                                  # (images, channels, h, w)

    tower = CLIPText.from_config(text, key=jax.random.key(0))
    hidden = eqx.filter_jit(tower)(ids, attention_mask=mask)   # (2, 5, 512)
    pooled = tower.pooled(hidden, ids)                          # (2, 512): at the end-of-text token

    tower = CLIPVision.from_config(vision, key=jax.random.key(0))
    hidden = tower(pixels)                                      # (2, 50, 768): class token + 7 x 7
    pooled = tower.pooled(hidden)                               # (2, 768): post_layernorm(class)

    config = {"model_type": "clip", "projection_dim": 512, "text_config": text, "vision_config": vision}
    model = CLIP.from_config(config, key=jax.random.key(0))
    logits = model(ids, pixels, attention_mask=mask)            # logits_per_image, (2 images, 2 texts)
    loss = contrastive_loss(logits)                             # transformers' return_loss (image i, text i)
    text_embeds = model.text_features(ids, attention_mask=mask) # (2, 512), not normalised
    image_embeds = model.image_features(pixels)                 # (2, 512), not normalised
    # bfloat16 compute on float32 parameters, each layer recomputed in the backward pass:
    logits = model(ids, pixels, attention_mask=mask, dtype=jnp.bfloat16, remat=True)
    ```
"""

from __future__ import annotations

import abc
import dataclasses
from typing import Any, ClassVar, final

import equinox as eqx
import jax
import jax.numpy as jnp
from jax.typing import ArrayLike
from jaxtyping import Array, Float, PRNGKeyArray

from port._errors import ConfigError
from port._text import quoted
from port.models.vit import Layer, patches
from port.nn import LayerNorm, cast, normal, prepare, scan, stacked
from port.nn._inputs import batch_first, check_pixels
from port.nn.config import MAX_LAYERS, ConfigFields, activation, check_model_type, get

TEXT, VISION = "text_config", "vision_config"
"""The keys of a dual model's config.json holding its towers' configs."""

LEGACY_EOS = 2
"""transformers' legacy end-of-text id: with it, the pooled token is the one of largest id."""

TOWER_FIELDS = (
    "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "hidden_act", "layer_norm_eps",
    "projection_dim",  # the projection's size, which a tower alone does not hold: any value runs alike
)  # fmt: skip
"""The fields both towers read (their defaults differ)."""


def tower_config(config: dict, key: str, model_type: str) -> dict:
    """A tower's own config: `config[key]` of a dual model's config.json (`{}`, transformers'
    defaults, when absent), else `config` itself, whose `model_type` must be the tower's."""
    if config.get("model_type") == "clip" or key in config:
        own = config.get(key) or {}
        if not isinstance(own, dict):
            raise ConfigError(f"config.json: {key!r} must be a table, got {quoted(own)}")
        return own
    check_model_type(config, (model_type, "clip"), "port.models.clip", model_type)
    return config


@dataclasses.dataclass(frozen=True)
class TowerConfig(abc.ABC):
    """What both towers read: the sizes ViT's `Layer` takes, and the projection's size.

    Abstract: each tower's config (`CLIPTextConfig`, `CLIPVisionConfig`) adds its own fields
    and reads them with `from_hf`.
    """

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    hidden_act: str
    layer_norm_eps: float
    projection_dim: int

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def qkv_bias(self) -> bool:
        return True

    @classmethod
    @abc.abstractmethod
    def from_hf(cls, config: dict) -> TowerConfig:
        """Build from the tower's config.json, or a dual model's."""

    @staticmethod
    def sizes(config: dict, defaults: dict[str, Any]) -> dict[str, Any]:
        """The shared fields of a tower's config, each absent one at transformers' `defaults`."""
        hidden = get(config, "hidden_size", int, defaults["hidden_size"])
        heads = get(config, "num_attention_heads", int, defaults["num_attention_heads"])
        if hidden % heads != 0:
            raise ConfigError(
                f"config.json: 'hidden_size' ({hidden}) must be divisible by 'num_attention_heads' ({heads})"
            )
        return dict(
            hidden_size=hidden,
            intermediate_size=get(config, "intermediate_size", int, defaults["intermediate_size"]),
            num_hidden_layers=get(config, "num_hidden_layers", int, 12, maximum=MAX_LAYERS),
            num_attention_heads=heads,
            hidden_act=activation(config, "hidden_act", "quick_gelu"),
            layer_norm_eps=get(config, "layer_norm_eps", float, 1e-5),
            projection_dim=get(config, "projection_dim", int, 512),
        )


@final
@dataclasses.dataclass(frozen=True)
class CLIPTextConfig(TowerConfig):
    """The text tower's hyperparameters, as read from config.json (or a dual model's `text_config`)."""

    vocab_size: int = 49408
    max_position_embeddings: int = 77
    eos_token_id: int = 49407

    @classmethod
    def from_hf(cls, config: dict) -> CLIPTextConfig:
        """Build from a `CLIPTextModel` config.json, or a `CLIPModel`'s (its `text_config`)."""
        own = tower_config(config, TEXT, "clip_text_model")
        CLIPText.FIELDS.check(own)
        eos = own.get("eos_token_id", 49407)
        if not isinstance(eos, int) or isinstance(eos, bool) or eos < 0:
            raise ConfigError(
                f"config.json: 'eos_token_id' must be one token id (the pooled output is at it), got {quoted(eos)}"
            )
        sizes = cls.sizes(own, {"hidden_size": 512, "intermediate_size": 2048, "num_attention_heads": 8})
        return cls(
            **sizes,
            vocab_size=get(own, "vocab_size", int, 49408),
            max_position_embeddings=get(own, "max_position_embeddings", int, 77),
            eos_token_id=eos,
        )


@final
@dataclasses.dataclass(frozen=True)
class CLIPVisionConfig(TowerConfig):
    """The vision tower's hyperparameters, as read from config.json (or a dual model's `vision_config`)."""

    image_size: int = 224
    patch_size: int = 32
    num_channels: int = 3

    @property
    def grid(self) -> tuple[int, int]:
        """Patches per column and per row: the strided convolution drops a partial patch."""
        side = self.image_size // self.patch_size
        return side, side

    @property
    def num_positions(self) -> int:
        """The class token and one position per patch."""
        return 1 + (self.image_size // self.patch_size) ** 2

    @classmethod
    def from_hf(cls, config: dict) -> CLIPVisionConfig:
        """Build from a `CLIPVisionModel` config.json, or a `CLIPModel`'s (its `vision_config`)."""
        own = tower_config(config, VISION, "clip_vision_model")
        CLIPVision.FIELDS.check(own)
        sizes = cls.sizes(own, {"hidden_size": 768, "intermediate_size": 3072, "num_attention_heads": 12})
        image, patch = get(own, "image_size", int, 224), get(own, "patch_size", int, 32)
        if image < patch:
            raise ConfigError(f"config.json: 'image_size' ({image}) is smaller than 'patch_size' ({patch})")
        return cls(**sizes, image_size=image, patch_size=patch, num_channels=get(own, "num_channels", int, 3))


def _layers(config: TowerConfig, dtype: Any, key: PRNGKeyArray) -> Layer:
    """The tower's pre-LayerNorm layers, stacked."""
    return stacked(lambda k: Layer(config, dtype, key=k), key, config.num_hidden_layers)


@final
class CLIPText(eqx.Module):
    """CLIP's text tower; `__call__` returns the last hidden state (`final_layer_norm` applied),
    `pooled` the hidden state at each sequence's end-of-text token. `layers` is stacked."""

    FIELDS: ClassVar[ConfigFields] = ConfigFields(
        "port.models.clip.CLIPText", read=(*TOWER_FIELDS, "vocab_size", "max_position_embeddings")
    )

    token_embeddings: Float[Array, "vocab embed"]
    position_embeddings: Float[Array, "positions embed"]
    layers: Layer
    norm: LayerNorm
    config: CLIPTextConfig = eqx.field(static=True)

    def __init__(self, config: CLIPTextConfig, *, key: PRNGKeyArray, dtype: Any = jnp.float32):
        ktok, kpos, klayers = jax.random.split(key, 3)
        e = config.hidden_size
        self.token_embeddings = normal(ktok, (config.vocab_size, e), dtype)
        self.position_embeddings = normal(kpos, (config.max_position_embeddings, e), dtype)
        self.layers = _layers(config, dtype, klayers)
        self.norm = LayerNorm(e, eps=config.layer_norm_eps, dtype=dtype)
        self.config = config

    @classmethod
    def from_config(cls, config: dict, *, key: PRNGKeyArray, dtype: Any = jnp.float32) -> CLIPText:
        """Randomly initialise from a `CLIPTextModel` config.json, or a `CLIPModel`'s."""
        return cls(CLIPTextConfig.from_hf(config), key=key, dtype=dtype)

    def __call__(
        self,
        input_ids: ArrayLike,  # integer (batch, seq) or (seq,); checked here, one line naming it
        attention_mask: Any = None,
        *,
        position_ids: ArrayLike | None = None,
        dtype: Any = None,
        remat: Any = None,
    ) -> Float[Array, "*batch seq embed"]:
        """The last hidden state, `(batch, seq, embd)`, for `input_ids` `(batch, seq)` or `(seq,)`.

        **Arguments:**

        - `input_ids`: integer `(batch, seq)`, or `(seq,)` (run as a batch of one), at most
          `max_position_embeddings` long.
        - `attention_mask`: `input_ids`' shape; nonzero/True to attend, 0 for padding
          (default all attended). Attention is causal and never reaches a padded key.
        - `position_ids`: `input_ids`' shape, integer (default `0, 1, ...` whatever the mask).
        - `dtype`: the compute dtype (bfloat16 compute on float32 parameters).
        - `remat`: rematerialise each layer in the backward pass (`port.nn.scan`).

        `ValueError` for a bad shape or too long a sequence, `TypeError` for non-integer
        ids; one line each, under `jax.jit` too.

        ```python
        hidden = tower(jnp.zeros((2, 7), jnp.int32), jnp.ones((2, 7), jnp.int32))  # (2, 7, embd)
        ```
        """
        c = self.config
        limit = None if position_ids is not None else ("max_position_embeddings", c.max_position_embeddings)
        tokens = prepare(input_ids, attention_mask=attention_mask, positions=position_ids, causal=True, limit=limit)
        model = cast(self, dtype)
        positions = jnp.arange(tokens.ids.shape[1]) if position_ids is None else tokens.positions
        x = model.token_embeddings[tokens.ids] + model.position_embeddings[positions]
        x, _ = scan(lambda layer, x: (layer(x, tokens.mask), None), x, model.layers, remat=remat)
        return tokens.output(model.norm(x))

    def pooled(self, hidden: Float[Array, "*batch seq embed"], input_ids: ArrayLike) -> Float[Array, "*batch embed"]:
        """`CLIPTextModel`'s pooler output: each sequence's hidden state at its end-of-text token.

        The token is the first equal to config.json's `eos_token_id`, or with the legacy
        `eos_token_id` 2, the one of largest id (transformers' rule; a sequence without
        one pools its first token). `hidden` is `__call__`'s result for `input_ids`:
        `(batch, seq, embd)` gives `(batch, embd)`, unbatched `(seq, embd)` gives `(embd,)`.

        ```python
        pooled = tower.pooled(tower(ids, attention_mask=mask), ids)   # (batch, embd)
        ```
        """
        ids = jnp.asarray(input_ids)
        if ids.shape != jnp.shape(hidden)[:-1]:
            raise ValueError(
                f"`input_ids` {tuple(ids.shape)} must be the ids `hidden` {tuple(jnp.shape(hidden))} was computed from"
            )
        eos = self.config.eos_token_id
        index = jnp.argmax(ids if eos == LEGACY_EOS else ids == eos, axis=-1)
        return jnp.take_along_axis(hidden, index[..., None, None], axis=-2)[..., 0, :]


@final
class CLIPVision(eqx.Module):
    """CLIP's vision tower; `__call__` returns the last hidden state (no final norm), `pooled`
    `post_layernorm` of the class token. `patch_weight` keeps the Conv2d layout (embd,
    channels, patch height, patch width); `layers` is stacked."""

    input_kind: ClassVar[str] = "pixel_values"  # what `port verify` feeds it
    FIELDS: ClassVar[ConfigFields] = ConfigFields(
        "port.models.clip.CLIPVision", read=(*TOWER_FIELDS, "image_size", "patch_size", "num_channels")
    )

    patch_weight: Float[Array, "embed channels patch_height patch_width"]
    class_embedding: Float[Array, " embed"]
    position_embeddings: Float[Array, "positions embed"]
    pre_norm: LayerNorm
    layers: Layer
    post_norm: LayerNorm
    config: CLIPVisionConfig = eqx.field(static=True)

    def __init__(self, config: CLIPVisionConfig, *, key: PRNGKeyArray, dtype: Any = jnp.float32):
        kpatch, kcls, kpos, klayers = jax.random.split(key, 4)
        e, p = config.hidden_size, config.patch_size
        self.patch_weight = normal(kpatch, (e, config.num_channels, p, p), dtype)
        self.class_embedding = normal(kcls, (e,), dtype)
        self.position_embeddings = normal(kpos, (config.num_positions, e), dtype)
        self.pre_norm = LayerNorm(e, eps=config.layer_norm_eps, dtype=dtype)
        self.layers = _layers(config, dtype, klayers)
        self.post_norm = LayerNorm(e, eps=config.layer_norm_eps, dtype=dtype)
        self.config = config

    @classmethod
    def from_config(cls, config: dict, *, key: PRNGKeyArray, dtype: Any = jnp.float32) -> CLIPVision:
        """Randomly initialise from a `CLIPVisionModel` config.json, or a `CLIPModel`'s."""
        return cls(CLIPVisionConfig.from_hf(config), key=key, dtype=dtype)

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
          `(channels, height, width)`; config.json's `image_size` square (position
          embeddings are not interpolated) and `num_channels`.
        - `dtype`: the compute dtype (bfloat16 compute on float32 parameters).
        - `remat`: rematerialise each layer in the backward pass (`port.nn.scan`).

        `ValueError` for a bad shape, `TypeError` for a non-floating dtype; one line each,
        under `jax.jit` too.

        ```python
        hidden = tower(jnp.zeros((2, 3, 224, 224)))   # (2, 50, embd) for 32 x 32 patches
        ```
        """
        c = self.config
        batched = check_pixels(pixel_values, channels=c.num_channels, size=(c.image_size, c.image_size))
        model = cast(self, dtype)
        (pixels,) = batch_first(batched, jnp.asarray(pixel_values).astype(model.patch_weight.dtype))
        cells = patches(pixels, model.patch_weight, c.grid)
        batch, e = cells.shape[0], c.hidden_size
        x = jnp.concatenate([jnp.broadcast_to(model.class_embedding, (batch, 1, e)), cells], axis=1)
        x = model.pre_norm(x + model.position_embeddings)
        mask = jnp.ones((batch, x.shape[1], x.shape[1]), bool)  # every patch sees every patch
        x, _ = scan(lambda layer, x: (layer(x, mask), None), x, model.layers, remat=remat)
        return x if batched else x[0]

    def pooled(self, hidden: Float[Array, "*batch seq embed"]) -> Float[Array, "*batch embed"]:
        """`CLIPVisionModel`'s pooler output, `post_layernorm(hidden[..., 0, :])`, in `hidden`'s dtype.

        ```python
        pooled = tower.pooled(tower(pixels))   # (batch, embd)
        ```
        """
        if jnp.ndim(hidden) not in (2, 3):
            raise ValueError(
                f"`hidden` must have shape (batch, seq, embd) or (seq, embd), got {tuple(jnp.shape(hidden))}"
            )
        return cast(self.post_norm, jnp.result_type(hidden))(hidden[..., 0, :])


@final
class CLIPTextWithProjection(eqx.Module):
    """`CLIPTextModelWithProjection`: the text tower and its `text_projection`; `__call__` returns
    `text_embeds`, the projected pooled output (`tower` gives the hidden states).

    Loaded from a `CLIPTextModelWithProjection` checkpoint (chosen by its `architectures`), or
    from a dual model's with `mapping="clip_text_projection"`; exported as that class.
    """

    FIELDS: ClassVar[ConfigFields] = dataclasses.replace(
        CLIPText.FIELDS, module="port.models.clip.CLIPTextWithProjection"
    )

    tower: CLIPText
    projection: Float[Array, "projection embed"]
    config: CLIPTextConfig = eqx.field(static=True)  # the tower's: what the mapping's reshapes name

    def __init__(self, config: CLIPTextConfig, *, key: PRNGKeyArray, dtype: Any = jnp.float32):
        ktower, kproj = jax.random.split(key)
        self.tower = CLIPText(config, key=ktower, dtype=dtype)
        self.projection = normal(kproj, (config.projection_dim, config.hidden_size), dtype)
        self.config = config

    @classmethod
    def from_config(cls, config: dict, *, key: PRNGKeyArray, dtype: Any = jnp.float32) -> CLIPTextWithProjection:
        """Randomly initialise from a `CLIPTextModelWithProjection` config.json, or a `CLIPModel`'s."""
        return cls(CLIPTextConfig.from_hf(config), key=key, dtype=dtype)

    def __call__(
        self,
        input_ids: ArrayLike,  # integer (batch, seq) or (seq,); checked by the tower
        attention_mask: Any = None,
        *,
        position_ids: ArrayLike | None = None,
        dtype: Any = None,
        remat: Any = None,
    ) -> Float[Array, "*batch projection"]:
        """`text_embeds`, `(batch, projection_dim)`: the tower's pooled output projected (not normalised).

        The arguments are the tower's (`CLIPText.__call__`).

        ```python
        embeds = model(ids, attention_mask=mask)   # (batch, projection_dim)
        ```
        """
        hidden = self.tower(input_ids, attention_mask, position_ids=position_ids, dtype=dtype, remat=remat)
        return self.tower.pooled(hidden, input_ids) @ cast(self.projection, dtype).T


@final
class CLIPVisionWithProjection(eqx.Module):
    """`CLIPVisionModelWithProjection`: the vision tower and its `visual_projection`; `__call__`
    returns `image_embeds`, the projected pooled output (`tower` gives the hidden states).

    Loaded from a `CLIPVisionModelWithProjection` checkpoint (chosen by its `architectures`),
    or from a dual model's with `mapping="clip_vision_projection"`; exported as that class.
    """

    input_kind: ClassVar[str] = "pixel_values"  # what `port verify` feeds it
    FIELDS: ClassVar[ConfigFields] = dataclasses.replace(
        CLIPVision.FIELDS, module="port.models.clip.CLIPVisionWithProjection"
    )

    tower: CLIPVision
    projection: Float[Array, "projection embed"]
    config: CLIPVisionConfig = eqx.field(static=True)  # the tower's: what the mapping's reshapes name

    def __init__(self, config: CLIPVisionConfig, *, key: PRNGKeyArray, dtype: Any = jnp.float32):
        ktower, kproj = jax.random.split(key)
        self.tower = CLIPVision(config, key=ktower, dtype=dtype)
        self.projection = normal(kproj, (config.projection_dim, config.hidden_size), dtype)
        self.config = config

    @classmethod
    def from_config(cls, config: dict, *, key: PRNGKeyArray, dtype: Any = jnp.float32) -> CLIPVisionWithProjection:
        """Randomly initialise from a `CLIPVisionModelWithProjection` config.json, or a `CLIPModel`'s."""
        return cls(CLIPVisionConfig.from_hf(config), key=key, dtype=dtype)

    def __call__(
        self, pixel_values: ArrayLike, *, dtype: Any = None, remat: Any = None
    ) -> Float[Array, "*batch projection"]:
        """`image_embeds`, `(batch, projection_dim)`: the tower's pooled output projected (not normalised).

        The arguments are the tower's (`CLIPVision.__call__`).

        ```python
        embeds = model(pixels)   # (batch, projection_dim)
        ```
        """
        pooled = self.tower.pooled(self.tower(pixel_values, dtype=dtype, remat=remat))
        return pooled @ cast(self.projection, dtype).T


@final
@dataclasses.dataclass(frozen=True)
class CLIPConfig:
    """The dual model's hyperparameters: its towers', and the sizes its mapping names
    (`text_heads`, `vision_hidden_size`, ...: a tower's own are under its key)."""

    text: CLIPTextConfig
    vision: CLIPVisionConfig
    projection_dim: int
    text_heads: int
    text_hidden_size: int
    vision_heads: int
    vision_hidden_size: int

    @classmethod
    def from_hf(cls, config: dict) -> CLIPConfig:
        """Build from a `CLIPModel` config.json (`model_type` `clip`)."""
        check_model_type(config, ("clip",), CLIP.FIELDS.module, "clip")
        CLIP.FIELDS.check(config)
        text, vision = CLIPTextConfig.from_hf(config), CLIPVisionConfig.from_hf(config)
        return cls(
            text=text,
            vision=vision,
            projection_dim=get(config, "projection_dim", int, 512),
            text_heads=text.num_attention_heads,
            text_hidden_size=text.hidden_size,
            vision_heads=vision.num_attention_heads,
            vision_hidden_size=vision.hidden_size,
        )


@final
class CLIP(eqx.Module):
    """CLIP's dual model (`CLIPModel`): both towers, their projections and the logit scale.

    `__call__` returns `logits_per_image`, `(images, texts)`; `text_features` and
    `image_features` are transformers' `get_text_features` / `get_image_features` (the
    projected pooled outputs, not normalised).
    """

    FIELDS: ClassVar[ConfigFields] = ConfigFields(
        # the dual model's own fields; its towers' are read from text_config and vision_config
        # (`logit_scale_init_value` is only the parameter's initial value)
        "port.models.clip.CLIP",
        read=("projection_dim", "logit_scale_init_value", *CLIPText.FIELDS.read),
    )

    text: CLIPText
    vision: CLIPVision
    text_projection: Float[Array, "projection embed"]
    visual_projection: Float[Array, "projection embed"]
    logit_scale: Float[Array, ""]
    config: CLIPConfig = eqx.field(static=True)

    def __init__(self, config: CLIPConfig, *, key: PRNGKeyArray, dtype: Any = jnp.float32):
        ktext, kvision, ktp, kvp = jax.random.split(key, 4)
        self.text = CLIPText(config.text, key=ktext, dtype=dtype)
        self.vision = CLIPVision(config.vision, key=kvision, dtype=dtype)
        self.text_projection = normal(ktp, (config.projection_dim, config.text_hidden_size), dtype)
        self.visual_projection = normal(kvp, (config.projection_dim, config.vision_hidden_size), dtype)
        self.logit_scale = jnp.asarray(2.6592, dtype)  # transformers' logit_scale_init_value
        self.config = config

    @classmethod
    def from_config(cls, config: dict, *, key: PRNGKeyArray, dtype: Any = jnp.float32) -> CLIP:
        """Randomly initialise from a `CLIPModel` config.json."""
        return cls(CLIPConfig.from_hf(config), key=key, dtype=dtype)

    def text_features(
        self, input_ids: ArrayLike, attention_mask: Any = None, *, dtype: Any = None, remat: Any = None
    ) -> Float[Array, "*batch projection"]:
        """`get_text_features`: `text_projection` of the text tower's pooled output, `(batch, projection_dim)`.

        The arguments are the text tower's (`CLIPText.__call__`).
        """
        hidden = self.text(input_ids, attention_mask, dtype=dtype, remat=remat)
        return self.text.pooled(hidden, input_ids) @ cast(self.text_projection, dtype).T

    def image_features(
        self, pixel_values: ArrayLike, *, dtype: Any = None, remat: Any = None
    ) -> Float[Array, "*batch projection"]:
        """`get_image_features`: `visual_projection` of the vision tower's pooled output, `(batch, projection_dim)`.

        The arguments are the vision tower's (`CLIPVision.__call__`).
        """
        pooled = self.vision.pooled(self.vision(pixel_values, dtype=dtype, remat=remat))
        return pooled @ cast(self.visual_projection, dtype).T

    def __call__(
        self,
        input_ids: ArrayLike,  # integer (texts, seq)
        pixel_values: ArrayLike,  # floating (images, channels, height, width)
        *,
        attention_mask: Any = None,
        dtype: Any = None,
        remat: Any = None,
    ) -> Float[Array, "images texts"]:
        """`logits_per_image`: `exp(logit_scale)` times the cosine of every image's and every text's embeddings.

        **Arguments:**

        - `input_ids`: integer `(texts, seq)`; `attention_mask` its padding, as the text
          tower takes them.
        - `pixel_values`: floating `(images, channels, height, width)`.
        - `dtype`, `remat`: as the towers take them.

        **Returns:** `(images, texts)`; its transpose is transformers' `logits_per_text`.
        `ValueError` (one line) for unbatched inputs.

        ```python
        logits = model(ids, pixels, attention_mask=mask)   # (images, texts)
        probs = jax.nn.softmax(logits, axis=-1)            # each image over the texts
        ```
        """
        for name, value, rank in (("input_ids", input_ids, 2), ("pixel_values", pixel_values, 4)):
            if jnp.ndim(value) != rank:
                raise ValueError(f"`{name}` must have a batch axis ({rank} dimensions), got {tuple(jnp.shape(value))}")
        texts = _normalised(self.text_features(input_ids, attention_mask, dtype=dtype, remat=remat))
        images = _normalised(self.image_features(pixel_values, dtype=dtype, remat=remat))
        return images @ texts.T * jnp.exp(cast(self.logit_scale, dtype))


def _normalised(x: Float[Array, "batch projection"]) -> Float[Array, "batch projection"]:
    """Each row over its L2 norm, as transformers computes it."""
    return x / jnp.sqrt(jnp.sum(jnp.square(x), axis=-1, keepdims=True))


def contrastive_loss(logits_per_image: Float[ArrayLike, "images texts"]) -> Float[Array, ""]:
    """CLIP's loss (`CLIPModel(..., return_loss=True)`): the mean of the image-to-text and
    text-to-image cross entropies, image i's text being text i, in float32.

    ```python
    loss = contrastive_loss(model(ids, pixels, attention_mask=mask))   # images == texts
    ```
    """
    logits = jnp.asarray(logits_per_image, jnp.float32)
    if logits.ndim != 2 or logits.shape[0] != logits.shape[1]:
        raise ValueError(f"`logits_per_image` must be square (one text per image), got {tuple(logits.shape)}")
    diagonal = jnp.diagonal(logits)
    per_text = jax.nn.logsumexp(logits, axis=0) - diagonal
    per_image = jax.nn.logsumexp(logits, axis=1) - diagonal
    return (per_text.mean() + per_image.mean()) / 2
