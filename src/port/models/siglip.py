"""SigLIP (`SiglipTextModel`, `SiglipVisionModel` and the dual `SiglipModel`) in Equinox.

Both towers are pre-LayerNorm bidirectional encoders built from ViT's encoder layer
(`port.models.vit.Layer`: `port.nn`'s `Attention`, `LayerNorm` and `MLP`, GELU tanh by
default). What is SigLIP's own is here:

- the text tower (`SiglipText`): token + learned position embeddings, a final LayerNorm,
  and a pooled output that is the *last* token's hidden state through a `head` Linear
  (SigLIP's text is padded to `max_position_embeddings` with no mask, and the last token
  may be padding, as in transformers); an `attention_mask` hides padded keys if given;
- the vision tower (`SiglipVision`): a patch Conv2d with bias, learned position
  embeddings, no class token, `post_layernorm`, and the pooled output of the multihead
  attention pooling head (`AttentionPooling`: a learned probe attending over the patches,
  then LayerNorm + MLP with a residual) when `vision_use_head`;
- the dual model (`Siglip`): both towers, `logit_scale` and `logit_bias`; its
  `logits_per_text` is `normalise(text) @ normalise(image).T * exp(logit_scale) +
  logit_bias`, `__call__` returns `logits_per_image` (its transpose), and
  `sigmoid_loss` is SigLIP's training loss (transformers' `return_loss=True`).

SigLIP 2 (`port.models.siglip2`) uses the same text tower and pooling head.

Example:
    ```python
    import equinox as eqx
    import jax
    import jax.numpy as jnp
    from port.models.siglip import Siglip, SiglipText, SiglipVision, sigmoid_loss

    text_config = {"vocab_size": 1000, "hidden_size": 64, "num_hidden_layers": 2,
                   "num_attention_heads": 4, "intermediate_size": 128, "max_position_embeddings": 16}
    vision_config = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
                     "intermediate_size": 128, "image_size": 32, "patch_size": 8}
    text = SiglipText.from_config(text_config, key=jax.random.key(0))
    ids = jnp.zeros((2, 16), jnp.int32)                 # padded to max_position_embeddings
    hidden = eqx.filter_jit(text)(ids)                  # (2, 16, 64)
    pooled = text.pooled(hidden)                        # (2, 64): head(hidden[:, -1])

    vision = SiglipVision.from_config(vision_config, key=jax.random.key(1))
    pixels = jnp.zeros((3, 3, 32, 32))                  # (batch, channels, height, width)
    hidden = vision(pixels)                             # (3, 16, 64): 4 x 4 patches, no class token
    pooled = vision.pooled(hidden)                      # (3, 64): the attention pooling head

    config = {"model_type": "siglip", "text_config": text_config, "vision_config": vision_config}
    model = Siglip.from_config(config, key=jax.random.key(2))
    logits_per_image = model(ids, pixels)               # (3, 2): images x texts
    loss = sigmoid_loss(logits_per_image.T)             # texts and images paired by index (needs as many)
    # bfloat16 compute on float32 parameters, each layer recomputed in the backward pass:
    logits_per_image = model(ids, pixels, dtype=jnp.bfloat16, remat=True)
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
from port.models.bert import check_heads
from port.models.vit import Layer, patch_embeddings
from port.nn import MLP, Attention, LayerNorm, attend, cast, normal, prepare, scan, stacked
from port.nn._inputs import batch_first, check_pixels
from port.nn._mlp import linear
from port.nn.config import MAX_LAYERS, ConfigFields, activation, check_model_type, get

ENCODER_FIELDS = (
    "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "hidden_act", "layer_norm_eps",
)  # fmt: skip
"""The config.json fields both towers read for their encoder layers."""


@final
@dataclasses.dataclass(frozen=True)
class EncoderConfig:
    """The sizes of a SigLIP tower's encoder layers (what `port.models.vit.Layer` reads).

    Defaults are transformers' (`SiglipTextConfig`, `SiglipVisionConfig`), which Hub
    checkpoints rely on: their config.json often leaves them out.
    """

    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    intermediate_size: int
    hidden_act: str
    layer_norm_eps: float
    qkv_bias: bool = True

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @classmethod
    def read(cls, config: dict) -> EncoderConfig:
        """Read `ENCODER_FIELDS` from a tower's config.json dict; `ConfigError` if bad."""
        hidden = get(config, "hidden_size", int, 768)
        heads = get(config, "num_attention_heads", int, 12)
        check_heads(hidden, heads, ("hidden_size", "num_attention_heads"))
        return cls(
            hidden_size=hidden,
            num_hidden_layers=get(config, "num_hidden_layers", int, 12, maximum=MAX_LAYERS),
            num_attention_heads=heads,
            intermediate_size=get(config, "intermediate_size", int, 3072),
            hidden_act=activation(config, "hidden_act", "gelu_pytorch_tanh"),
            layer_norm_eps=get(config, "layer_norm_eps", float, 1e-6),
        )


def tower_config(config: Any, key: str) -> dict:
    """A dual model's tower config, `config[key]` (absent or null: transformers' defaults, `{}`)."""
    value = config.get(key)
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ConfigError(f"config.json: {key!r} must be a table of the tower's config, got {quoted(value)}")
    return value


def encode(
    layers: Layer, x: Float[Array, "batch seq embed"], mask: Bool[Array, "batch seq keys"], remat: Any
) -> Float[Array, "batch seq embed"]:
    """Run the stacked encoder layers over `x` (`mask`: which keys each position sees)."""
    x, _ = scan(lambda layer, x: (layer(x, mask), None), x, layers, remat=remat)
    return x


@final
@dataclasses.dataclass(frozen=True)
class TextConfig:
    """The hyperparameters of a SigLIP (or SigLIP 2) text tower, as read from its config.json."""

    encoder: EncoderConfig
    vocab_size: int
    max_position_embeddings: int
    projection_size: int

    @classmethod
    def from_hf(cls, config: dict) -> TextConfig:
        """Build from a text tower's config.json dict; raises `ConfigError` if unsupported."""
        check_model_type(config, SiglipText.MODEL_TYPES, SiglipText.FIELDS.module, default="siglip_text_model")
        SiglipText.FIELDS.check(config)
        encoder = EncoderConfig.read(config)
        return cls(
            encoder=encoder,
            vocab_size=get(config, "vocab_size", int, 32000),
            max_position_embeddings=get(config, "max_position_embeddings", int, 64),
            projection_size=get(config, "projection_size", int, encoder.hidden_size),
        )


@final
class SiglipText(eqx.Module):
    """SigLIP's text tower; `__call__` returns the last hidden state (final LayerNorm applied).

    `layers` is stacked; `head_weight` / `head_bias` are the `head` Linear that `pooled`
    applies to the last token.
    """

    MODEL_TYPES: ClassVar[tuple[str, ...]] = ("siglip_text_model", "siglip2_text_model")
    FIELDS: ClassVar[ConfigFields] = ConfigFields(
        "port.models.siglip.SiglipText",
        read=(*ENCODER_FIELDS, "vocab_size", "max_position_embeddings", "projection_size"),
    )

    token_embeddings: Float[Array, "vocab embed"]
    position_embeddings: Float[Array, "positions embed"]
    layers: Layer
    norm: LayerNorm
    head_weight: Float[Array, "embed_out embed"]
    head_bias: Float[Array, " embed_out"]
    config: TextConfig = eqx.field(static=True)

    def __init__(self, config: TextConfig, *, key: PRNGKeyArray, dtype: Any = jnp.float32):
        ktok, kpos, klayers, khead = jax.random.split(key, 4)
        c, e = config, config.encoder.hidden_size
        self.token_embeddings = normal(ktok, (c.vocab_size, e), dtype)
        self.position_embeddings = normal(kpos, (c.max_position_embeddings, e), dtype)
        self.layers = stacked(lambda k: Layer(c.encoder, dtype, key=k), klayers, c.encoder.num_hidden_layers)
        self.norm = LayerNorm(e, eps=c.encoder.layer_norm_eps, dtype=dtype)
        self.head_weight = normal(khead, (c.projection_size, e), dtype)
        self.head_bias = jnp.zeros((c.projection_size,), dtype)
        self.config = config

    @classmethod
    def from_config(cls, config: dict, *, key: PRNGKeyArray, dtype: Any = jnp.float32) -> SiglipText:
        """Randomly initialise from a text tower's Hugging Face `config.json` dict."""
        return cls(TextConfig.from_hf(config), key=key, dtype=dtype)

    def __call__(
        self,
        input_ids: ArrayLike,  # integer (batch, seq) or (seq,); checked here, one line naming it
        attention_mask: Any = None,
        *,
        dtype: Any = None,
        remat: Any = None,
    ) -> Float[Array, "*batch seq embed"]:
        """The last hidden state, (batch, seq, embd), for `input_ids` (batch, seq) or (seq,).

        **Arguments:**

        - `input_ids`: integer `(batch, seq)`, or `(seq,)` (run as a batch of one); at most
          `max_position_embeddings` tokens. SigLIP was trained on text padded to
          `max_position_embeddings` without a mask.
        - `attention_mask`: `input_ids`' shape; nonzero/True to attend, 0 for padding
          (default: every token attended). Positions are `0, 1, ...` whatever the mask.
        - `dtype`: the compute dtype (bfloat16 compute on float32 parameters).
        - `remat`: rematerialise each layer in the backward pass (`port.nn.scan`).

        `ValueError` / `TypeError` (one line naming the argument) for a bad shape or dtype
        or too many tokens; the checks read static shapes, so they work under `jax.jit`.

        ```python
        hidden = text(jnp.zeros((2, 16), jnp.int32))   # (2, 16, embd)
        ```
        """
        c = self.config
        limit = ("max_position_embeddings", c.max_position_embeddings)
        tokens = prepare(input_ids, attention_mask=attention_mask, causal=False, limit=limit)
        model = cast(self, dtype)
        x = model.token_embeddings[tokens.ids] + model.position_embeddings[jnp.arange(tokens.ids.shape[1])]
        x = encode(model.layers, x, tokens.mask, remat)
        return tokens.output(model.norm(x))

    def pooled(self, hidden: Float[Array, "... embed"]) -> Float[Array, "... embed_out"]:
        """SigLIP's text pooled output, `head(hidden[..., -1, :])` (the last token, padding or not).

        `hidden` is `__call__`'s result: (batch, seq, embd) gives (batch, projection_size),
        (seq, embd) gives (projection_size,). This is `get_text_features`' embedding.

        ```python
        pooled = text.pooled(text(ids))    # (batch, projection_size)
        ```
        """
        if jnp.ndim(hidden) not in (2, 3):
            raise ValueError(f"`hidden` must have shape (batch, seq, embd) or (seq, embd), got {jnp.shape(hidden)}")
        return linear(hidden[..., -1, :], self.head_weight, self.head_bias)


@final
class AttentionPooling(eqx.Module):
    """SigLIP's multihead attention pooling head: a learned `probe` attends over the hidden
    states (torch `nn.MultiheadAttention`, its fused `in_proj` split per head into `attn`),
    then `y + mlp(norm(y))`; the probe's row is the pooled output.

    Called as `head(hidden, valid)`: `hidden` `[batch, seq, embd]`, `valid` `[batch, seq]`
    (True for a real patch; None: all), giving `[batch, embd]`.
    """

    probe: Float[Array, " embed"]
    attn: Attention
    norm: LayerNorm
    mlp: MLP

    def __init__(self, config: EncoderConfig, dtype: Any, *, key: PRNGKeyArray):
        kprobe, kattn, kmlp = jax.random.split(key, 3)
        e = config.hidden_size
        self.probe = normal(kprobe, (e,), dtype)
        self.attn = Attention(
            heads=config.num_attention_heads,
            kv_heads=config.num_attention_heads,
            head_dim=config.head_dim,
            embd=e,
            dtype=dtype,
            key=kattn,
            qkv_bias=True,
            o_bias=True,
        )
        self.norm = LayerNorm(e, eps=config.layer_norm_eps, dtype=dtype)
        self.mlp = MLP(embd=e, inner=config.intermediate_size, activation=config.hidden_act, dtype=dtype, key=kmlp)

    def __call__(
        self, hidden: Float[Array, "batch seq embed"], valid: Bool[Array, "batch seq"] | None
    ) -> Float[Array, "batch embed"]:
        batch, seq, e = hidden.shape
        probe = jnp.broadcast_to(self.probe.astype(hidden.dtype), (batch, 1, e))
        q, _, _ = self.attn.project(probe, None, None)  # the unused projections are not computed under jit
        _, k, v = self.attn.project(hidden, None, None)
        mask = jnp.ones((batch, 1, seq), bool) if valid is None else valid[:, None, :]
        out = attend(q, k, v, mask, scale=self.attn.scale)
        y = jnp.einsum("bthd,ehd->bte", out, self.attn.wo)
        y = y if self.attn.bo is None else y + self.attn.bo
        y = y + self.mlp(self.norm(y))
        return y[:, 0]


@final
@dataclasses.dataclass(frozen=True)
class VisionConfig:
    """The hyperparameters of a SigLIP vision tower, as read from its config.json."""

    encoder: EncoderConfig
    num_channels: int
    image_size: int
    patch_size: int
    use_head: bool

    @property
    def num_positions(self) -> int:
        """One position per patch (the strided convolution drops a partial patch), no class token."""
        return (self.image_size // self.patch_size) ** 2

    @classmethod
    def from_hf(cls, config: dict) -> VisionConfig:
        """Build from a vision tower's config.json dict; raises `ConfigError` if unsupported."""
        check_model_type(config, ("siglip_vision_model",), SiglipVision.FIELDS.module, default="siglip_vision_model")
        SiglipVision.FIELDS.check(config)
        image, patch = get(config, "image_size", int, 224), get(config, "patch_size", int, 16)
        if image < patch:
            raise ConfigError(f"config.json: 'image_size' ({image}) is smaller than 'patch_size' ({patch})")
        return cls(
            encoder=EncoderConfig.read(config),
            num_channels=get(config, "num_channels", int, 3),
            image_size=image,
            patch_size=patch,
            use_head=get(config, "vision_use_head", bool, True),
        )


def no_head(family: str) -> ValueError:
    """The error of `pooled` on a vision tower built without its pooling head."""
    return ValueError(
        f"this {family} vision model has no pooling head (config.json's vision_use_head is false); "
        "use the hidden state instead of the pooled output"
    )


@final
class SiglipVision(eqx.Module):
    """SigLIP's vision tower; `__call__` returns the last hidden state (`post_layernorm` applied).

    `patch_weight` keeps the checkpoint's Conv2d layout (embd, channels, patch height,
    patch width); `layers` is stacked; `head` is the attention pooling head (None when
    config.json's `vision_use_head` is false).
    """

    input_kind: ClassVar[str] = "pixel_values"  # what `port verify` feeds it
    FIELDS: ClassVar[ConfigFields] = ConfigFields(
        "port.models.siglip.SiglipVision",
        read=(*ENCODER_FIELDS, "num_channels", "image_size", "patch_size", "vision_use_head"),
    )

    patch_weight: Float[Array, "embed channels patch_height patch_width"]
    patch_bias: Float[Array, " embed"]
    position_embeddings: Float[Array, "positions embed"]
    layers: Layer
    norm: LayerNorm
    head: AttentionPooling | None
    config: VisionConfig = eqx.field(static=True)

    def __init__(self, config: VisionConfig, *, key: PRNGKeyArray, dtype: Any = jnp.float32):
        kpatch, kpos, klayers, khead = jax.random.split(key, 4)
        c, e, p = config, config.encoder.hidden_size, config.patch_size
        self.patch_weight = normal(kpatch, (e, c.num_channels, p, p), dtype)
        self.patch_bias = jnp.zeros((e,), dtype)
        self.position_embeddings = normal(kpos, (c.num_positions, e), dtype)
        self.layers = stacked(lambda k: Layer(c.encoder, dtype, key=k), klayers, c.encoder.num_hidden_layers)
        self.norm = LayerNorm(e, eps=c.encoder.layer_norm_eps, dtype=dtype)
        self.head = AttentionPooling(c.encoder, dtype, key=khead) if c.use_head else None
        self.config = config

    @classmethod
    def from_config(cls, config: dict, *, key: PRNGKeyArray, dtype: Any = jnp.float32) -> SiglipVision:
        """Randomly initialise from a vision tower's Hugging Face `config.json` dict."""
        return cls(VisionConfig.from_hf(config), key=key, dtype=dtype)

    def __call__(
        self,
        pixel_values: ArrayLike,  # floating (batch, channels, height, width) or unbatched; checked here
        *,
        dtype: Any = None,
        remat: Any = None,
    ) -> Float[Array, "*batch patches embed"]:
        """The last hidden state, (batch, patches, embd), for (batch, channels, height, width) pixels.

        **Arguments:**

        - `pixel_values`: floating `(batch, channels, height, width)`, or unbatched
          `(channels, height, width)` (giving `(patches, embd)`). Height and width are
          config.json's `image_size` (position embeddings are not interpolated: transformers'
          `interpolate_pos_encoding` is not offered), channels `num_channels`.
        - `dtype`: the compute dtype (bfloat16 compute on float32 parameters).
        - `remat`: rematerialise each layer in the backward pass (`port.nn.scan`).

        `ValueError` for a bad shape, `TypeError` for a non-floating dtype; one line each.

        ```python
        hidden = vision(jnp.zeros((2, 3, 224, 224)))   # (2, 196, embd) for 16 x 16 patches
        ```
        """
        c = self.config
        batched = check_pixels(pixel_values, channels=c.num_channels, size=(c.image_size, c.image_size))
        model = cast(self, dtype)
        (pixels,) = batch_first(batched, jnp.asarray(pixel_values).astype(model.patch_weight.dtype))
        x = patch_embeddings(pixels, model.patch_weight, model.patch_bias) + model.position_embeddings
        batch, seq = x.shape[:2]
        x = encode(model.layers, x, jnp.ones((batch, seq, seq), bool), remat)
        x = model.norm(x)
        return x if batched else x[0]

    def pooled(self, hidden: Float[Array, "... embed"]) -> Float[Array, "... embed"]:
        """The attention pooling head's output from `__call__`'s result: (batch, patches, embd)
        gives (batch, embd), (patches, embd) gives (embd,). This is `get_image_features`' embedding.

        `ValueError` if the model has no head (`vision_use_head` false).

        ```python
        pooled = vision.pooled(vision(pixels))    # (batch, embd)
        ```
        """
        if self.head is None:
            raise no_head("SigLIP")
        if jnp.ndim(hidden) not in (2, 3):
            raise ValueError(
                f"`hidden` must have shape (batch, patches, embd) or (patches, embd), got {jnp.shape(hidden)}"
            )
        batched = jnp.ndim(hidden) == 3
        (hidden,) = batch_first(batched, hidden)
        pooled = self.head(hidden, None)
        return pooled if batched else pooled[0]


def logits_per_text(
    text_embeds: Float[Array, "texts embed"],
    image_embeds: Float[Array, "images embed"],
    logit_scale: Float[Array, " scalar"],
    logit_bias: Float[Array, " scalar"],
) -> Float[Array, "texts images"]:
    """SigLIP's similarity logits: `normalise(text) @ normalise(image).T * exp(logit_scale) + logit_bias`.

    ```python
    logits = logits_per_text(text_embeds, image_embeds, model.logit_scale, model.logit_bias)
    ```
    """
    text = text_embeds / jnp.linalg.norm(text_embeds, axis=-1, keepdims=True)
    image = image_embeds / jnp.linalg.norm(image_embeds, axis=-1, keepdims=True)
    return (text @ image.T) * jnp.exp(logit_scale) + logit_bias


def sigmoid_loss(logits: Float[Array, "texts images"]) -> Float[Array, ""]:
    """SigLIP's pairwise sigmoid loss (transformers' `return_loss=True`): text i matches image i.

    `-mean_i sum_j log sigmoid(s_ij * logits[i, j])`, `s_ij` 1 on the diagonal and -1 off it,
    in float32. `logits` is `logits_per_text` (`model(ids, pixels).T`), square.

    ```python
    loss = sigmoid_loss(model(ids, pixels).T)
    ```
    """
    n = logits.shape[0]
    signs = 2 * jnp.eye(n, logits.shape[1], dtype=jnp.float32) - 1
    return -jnp.mean(jnp.sum(jax.nn.log_sigmoid(signs * logits.astype(jnp.float32)), axis=-1))


def logit_params(dtype: Any) -> tuple[Array, Array]:
    """`logit_scale` and `logit_bias` as a fresh dual model holds them (transformers initialises both to 0)."""
    return jnp.zeros((1,), dtype), jnp.zeros((1,), dtype)


@final
class Siglip(eqx.Module):
    """The dual SigLIP model (`SiglipModel`); `__call__` returns `logits_per_image` (images, texts).

    `text_features` / `image_features` are transformers' `get_text_features` /
    `get_image_features` (the towers' pooled outputs, not normalised).
    """

    FIELDS: ClassVar[ConfigFields] = ConfigFields(
        # its towers' fields, read from text_config (checked against these) and vision_config
        "port.models.siglip.Siglip",
        read=SiglipText.FIELDS.read,
    )

    text: SiglipText
    vision: SiglipVision
    logit_scale: Float[Array, " scalar"]
    logit_bias: Float[Array, " scalar"]

    def __init__(self, text: SiglipText, vision: SiglipVision, dtype: Any = jnp.float32):
        self.text, self.vision = text, vision
        self.logit_scale, self.logit_bias = logit_params(dtype)

    @classmethod
    def from_config(cls, config: dict, *, key: PRNGKeyArray, dtype: Any = jnp.float32) -> Siglip:
        """Randomly initialise from a `SiglipModel` config.json dict (`text_config`, `vision_config`)."""
        check_model_type(config, ("siglip",), cls.FIELDS.module, default="siglip")
        ktext, kvision = jax.random.split(key)
        text = SiglipText.from_config(tower_config(config, "text_config"), key=ktext, dtype=dtype)
        vision = SiglipVision.from_config(tower_config(config, "vision_config"), key=kvision, dtype=dtype)
        if vision.head is None:
            raise ConfigError("config.json: vision_config's vision_use_head false: SiglipModel pools by the head")
        return cls(text, vision, dtype)

    def text_features(
        self, input_ids: ArrayLike, attention_mask: Any = None, *, dtype: Any = None, remat: Any = None
    ) -> Float[Array, "*batch embed_out"]:
        """The text tower's pooled output (`get_text_features`) for `input_ids` (batch, seq) or (seq,)."""
        text = cast(self.text, dtype)
        return text.pooled(text(input_ids, attention_mask, remat=remat))

    def image_features(
        self, pixel_values: ArrayLike, *, dtype: Any = None, remat: Any = None
    ) -> Float[Array, "*batch embed"]:
        """The vision tower's pooled output (`get_image_features`) for (batch, channels, height, width) pixels."""
        vision = cast(self.vision, dtype)
        return vision.pooled(vision(pixel_values, remat=remat))

    def __call__(
        self,
        input_ids: ArrayLike,
        pixel_values: ArrayLike,
        *,
        attention_mask: Any = None,
        dtype: Any = None,
        remat: Any = None,
    ) -> Float[Array, "images texts"]:
        """`logits_per_image` (images, texts) of the texts `input_ids` and the images `pixel_values`.

        Arguments as the towers' (`SiglipText.__call__`, `SiglipVision.__call__`); an
        unbatched text or image counts as one. `sigmoid(logits)` are the match
        probabilities; `sigmoid_loss(logits.T)` the training loss.

        ```python
        logits_per_image = model(ids, pixels)    # (images, texts)
        ```
        """
        model = cast(self, dtype)
        text = jnp.atleast_2d(model.text_features(input_ids, attention_mask, remat=remat))
        image = jnp.atleast_2d(model.image_features(pixel_values, remat=remat))
        return logits_per_text(text, image, model.logit_scale, model.logit_bias).T
