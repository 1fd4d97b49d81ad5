"""Whisper (`WhisperForConditionalGeneration`, the speech-to-text encoder-decoder) in Equinox.

Built from `port.nn`: its `Attention` (q/v/output biases, none on the keys), `LayerNorm`
(epsilon 1e-5, as transformers' `nn.LayerNorm`), `MLP` (`fc1`/`fc2`, config.json's
`activation_function`), `attend`, the `Cache` and the layer `scan`. What is Whisper's own is
here: the encoder's front, two Conv1d layers over the log-mel `input_features` (kernel 3,
padding 1, the second of stride 2, each followed by exact GELU) and sinusoidal positions
loaded from the checkpoint (a frozen table: no gradient reaches it, as in transformers);
pre-LayerNorm encoder layers and a final LayerNorm; the decoder's token embeddings and
learned positions, pre-LayerNorm layers with causal self-attention, cross-attention over
the encoder's output and an MLP, a final LayerNorm and the head tied to the token
embeddings (`proj_out`; untied where config.json's `tie_word_embeddings` is false). The
layers are stored *stacked* (a leading axis of `encoder_layers` / `decoder_layers`).

`input_features` must be `(batch, num_mel_bins, 2 * max_source_positions)`, as transformers
requires (3000 frames for the released models: 30 s of audio). Whisper's encoder takes no
attention mask; the decoder takes `decoder_attention_mask` (keys at 0 are not attended to),
and decoder positions count from the first token, as transformers' forward counts them.

Generation: `encode` runs the encoder once, `init_cache` makes the decoder's self-attention
buffers and computes every layer's cross-attention keys and values once (kept in
`Cache.states["cross"]`), and `decode` runs decoder steps on the cache: the protocol
`port.nn.generate` follows for an encoder-decoder.

Example:
    ```python
    import equinox as eqx
    import jax
    import jax.numpy as jnp
    import port
    from port.models.whisper import Whisper

    config = {"vocab_size": 100, "num_mel_bins": 8, "d_model": 32, "encoder_layers": 2,
              "encoder_attention_heads": 4, "encoder_ffn_dim": 64, "decoder_layers": 2,
              "decoder_attention_heads": 4, "decoder_ffn_dim": 64, "max_source_positions": 16,
              "max_target_positions": 48, "decoder_start_token_id": 98}
    model = Whisper.from_config(config, key=jax.random.key(0))
    features = jnp.zeros((2, 8, 32))                   # (batch, num_mel_bins, 2 * max_source_positions)
    prompt = jnp.full((2, 1), model.decoder_start_token_id)
    logits = eqx.filter_jit(model)(features, prompt)   # (2, 1, 100)
    # bfloat16 compute on float32 parameters, each layer recomputed in the backward pass:
    logits = model(features, prompt, dtype=jnp.bfloat16, remat=True)

    # Greedy decoding from Whisper's forced prompt (start of transcript, language, task, no timestamps):
    out = port.generate(model, features, max_new_tokens=4, decoder_input_ids=jnp.array([[98, 90, 91, 92]] * 2))
    # out: (2, 8), the prompt then 4 new tokens. By hand, as port.generate runs it:
    encoded = model.encode(features)                   # (2, 16, 32)
    cache = model.init_cache(2, 8, encoded)
    logits, cache = model.decode(prompt, cache=cache)
    logits, cache = model.decode(jnp.argmax(logits[:, -1], -1)[:, None], cache=cache)

    # Shapes only, no memory allocated (e.g. before loading a checkpoint):
    abstract = eqx.filter_eval_shape(Whisper.from_config, config, key=jax.random.key(0))
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
from port.nn import MLP, Attention, Cache, LayerNorm, attend, cast, embeddings, head, normal, prepare, scan, stacked
from port.nn._attention import KV
from port.nn._inputs import batch_first
from port.nn.config import MAX_LAYERS, ConfigFields, activation, check_model_type, get

LAYER_NORM_EPS = 1e-5
"""transformers' `nn.LayerNorm` default, which every Whisper norm uses (config.json has no field for it)."""
CONV_STRIDES = (1, 2)
"""The strides of the encoder's two Conv1d layers: the features are twice as long as the positions."""
FEATURE_SHAPES = {3: "(batch, num_mel_bins, frames)", 2: "(num_mel_bins, frames)"}
"""The accepted ranks of `input_features` and how messages name them."""


def exact_gelu(x: Array) -> Array:
    """GELU with erf, as `nn.functional.gelu` after each of Whisper's convolutions (not configurable)."""
    return jax.nn.gelu(x, approximate=False)


@final
@dataclasses.dataclass(frozen=True)
class WhisperConfig:
    """The hyperparameters of a Whisper model, as read from a Hugging Face config.json.

    ```python
    c = WhisperConfig.from_hf({"d_model": 32, "encoder_attention_heads": 4, ...})
    c.frames          # 2 * max_source_positions: the input_features' length
    ```
    """

    vocab_size: int
    num_mel_bins: int
    d_model: int
    encoder_layers: int
    encoder_attention_heads: int
    encoder_ffn_dim: int
    decoder_layers: int
    decoder_attention_heads: int
    decoder_ffn_dim: int
    max_source_positions: int
    max_target_positions: int
    activation_function: str = "gelu"
    tie_word_embeddings: bool = True
    decoder_start_token_id: int | None = 50257

    @property
    def frames(self) -> int:
        """The length `input_features` must have: the convolutions halve it to `max_source_positions`."""
        return self.max_source_positions * CONV_STRIDES[0] * CONV_STRIDES[1]

    @classmethod
    def from_hf(cls, config: dict) -> WhisperConfig:
        """Build from a Hugging Face `config.json` dict; raises `ConfigError` if unsupported."""
        check_model_type(config, ("whisper",), "port.models.whisper", "whisper")
        Whisper.FIELDS.check(config)
        d_model = get(config, "d_model", int, 384)
        for heads_key in ("encoder_attention_heads", "decoder_attention_heads"):
            heads = get(config, heads_key, int, 6)
            if d_model % heads != 0:
                raise ConfigError(f"config.json: 'd_model' ({d_model}) must be divisible by {heads_key!r} ({heads})")
        start = config.get("decoder_start_token_id", 50257)
        if start is not None and (not isinstance(start, int) or isinstance(start, bool) or start < 0):
            raise ConfigError(f"config.json: 'decoder_start_token_id' must be a token id, got {start!r}")
        # transformers 5.24 computes `embed_scale` from `scale_embedding` but never applies it:
        # read and checked, it changes nothing, as there.
        get(config, "scale_embedding", bool, False)
        return cls(
            vocab_size=get(config, "vocab_size", int, 51865),
            num_mel_bins=get(config, "num_mel_bins", int, 80),
            d_model=d_model,
            encoder_layers=get(config, "encoder_layers", int, 4, maximum=MAX_LAYERS),
            encoder_attention_heads=get(config, "encoder_attention_heads", int, 6),
            encoder_ffn_dim=get(config, "encoder_ffn_dim", int, 1536),
            decoder_layers=get(config, "decoder_layers", int, 4, maximum=MAX_LAYERS),
            decoder_attention_heads=get(config, "decoder_attention_heads", int, 6),
            decoder_ffn_dim=get(config, "decoder_ffn_dim", int, 1536),
            max_source_positions=get(config, "max_source_positions", int, 1500),
            max_target_positions=get(config, "max_target_positions", int, 448),
            activation_function=activation(config, "activation_function", "gelu"),
            tie_word_embeddings=get(config, "tie_word_embeddings", bool, True),
            decoder_start_token_id=start,
        )


def check_features(input_features: Any, config: WhisperConfig) -> bool:
    """Check floating `input_features` of `(batch, num_mel_bins, frames)` (or without the batch
    axis) with exactly `config.frames` frames; return whether batched.

    Raises `ValueError` for another shape (one line naming the shape it must have),
    `TypeError` for a non-floating dtype. Static shapes only: works under `jax.jit`.

    ```python
    check_features(jnp.zeros((2, 80, 3000)), config)   # True (Whisper large-v3: 128 mel bins)
    ```
    """
    shape = tuple(jnp.shape(input_features))
    expected = f"(batch, {config.num_mel_bins}, {config.frames}) or ({config.num_mel_bins}, {config.frames})"
    reason = "(num_mel_bins, 2 * max_source_positions)"
    if len(shape) not in FEATURE_SHAPES or shape[-2:] != (config.num_mel_bins, config.frames):
        raise ValueError(f"`input_features` must have shape {expected} {reason}, got {shape}")
    dtype = jnp.result_type(input_features)
    if not jnp.issubdtype(dtype, jnp.floating):
        raise TypeError(f"`input_features` must have a floating dtype, got {dtype}")
    return len(shape) == 3


def without_key_bias(attn: Attention) -> Attention:
    """`attn` without the key bias: Whisper's `k_proj` has none, its q, v and output projections do."""
    return eqx.tree_at(lambda a: a.bk, attn, None)


def whisper_attention(heads: int, embd: int, dtype: Any, key: PRNGKeyArray) -> Attention:
    """One of Whisper's attentions: `heads` of `embd // heads`, biases but on the keys."""
    attn = Attention(
        heads=heads, kv_heads=heads, head_dim=embd // heads, embd=embd, dtype=dtype, key=key, qkv_bias=True, o_bias=True
    )
    return without_key_bias(attn)


def cross_kv(attn: Attention, encoded: Float[Array, "batch keys embed"]) -> KV:
    """The cross-attention keys and values of the encoder's output, `[batch, keys, heads, head_dim]` each."""
    keys = jnp.einsum("bte,hde->bthd", encoded, attn.wk)
    values = jnp.einsum("bte,hde->bthd", encoded, attn.wv)
    return keys, values if attn.bv is None else values + attn.bv


def cross_attend(
    attn: Attention, x: Float[Array, "batch seq embed"], kv: KV, mask: Bool[Array, "batch seq keys"]
) -> Float[Array, "batch seq embed"]:
    """Attention of the decoder's `x` over the encoder's keys and values `kv` (from `cross_kv`)."""
    q = jnp.einsum("bte,hde->bthd", x, attn.wq)
    q = q if attn.bq is None else q + attn.bq
    out = attend(q, kv[0].astype(q.dtype), kv[1].astype(q.dtype), mask, scale=attn.scale)
    y = jnp.einsum("bthd,ehd->bte", out, attn.wo)
    return y if attn.bo is None else y + attn.bo


@final
class EncoderLayer(eqx.Module):
    """One pre-LayerNorm encoder layer: `x + attn(self_attn_layer_norm(x))`, then `x + mlp(final_layer_norm(x))`."""

    attn_norm: LayerNorm
    attn: Attention
    mlp_norm: LayerNorm
    mlp: MLP

    def __init__(self, config: WhisperConfig, dtype: Any, *, key: PRNGKeyArray):
        kattn, kmlp = jax.random.split(key)
        c, e = config, config.d_model
        self.attn_norm = LayerNorm(e, eps=LAYER_NORM_EPS, dtype=dtype)
        self.attn = whisper_attention(c.encoder_attention_heads, e, dtype, kattn)
        self.mlp_norm = LayerNorm(e, eps=LAYER_NORM_EPS, dtype=dtype)
        self.mlp = MLP(embd=e, inner=c.encoder_ffn_dim, activation=c.activation_function, dtype=dtype, key=kmlp)

    def __call__(
        self, x: Float[Array, "batch seq embed"], mask: Bool[Array, "batch seq keys"]
    ) -> Float[Array, "batch seq embed"]:
        h, _ = self.attn(self.attn_norm(x), mask)
        x = x + h
        return x + self.mlp(self.mlp_norm(x))


@final
class DecoderLayer(eqx.Module):
    """One pre-LayerNorm decoder layer: causal self-attention, cross-attention over the encoder's
    output (`encoder_attn`), then the MLP, each added to the residual stream."""

    attn_norm: LayerNorm
    attn: Attention
    cross_norm: LayerNorm
    cross: Attention
    mlp_norm: LayerNorm
    mlp: MLP

    def __init__(self, config: WhisperConfig, dtype: Any, *, key: PRNGKeyArray):
        kattn, kcross, kmlp = jax.random.split(key, 3)
        c, e = config, config.d_model
        self.attn_norm = LayerNorm(e, eps=LAYER_NORM_EPS, dtype=dtype)
        self.attn = whisper_attention(c.decoder_attention_heads, e, dtype, kattn)
        self.cross_norm = LayerNorm(e, eps=LAYER_NORM_EPS, dtype=dtype)
        self.cross = whisper_attention(c.decoder_attention_heads, e, dtype, kcross)
        self.mlp_norm = LayerNorm(e, eps=LAYER_NORM_EPS, dtype=dtype)
        self.mlp = MLP(embd=e, inner=c.decoder_ffn_dim, activation=c.activation_function, dtype=dtype, key=kmlp)

    def __call__(
        self,
        x: Float[Array, "batch seq embed"],
        mask: Bool[Array, "batch seq keys"],
        encoded: KV,
        *,
        kv: KV | None = None,
        index: Array | None = None,
    ) -> tuple[Float[Array, "batch seq embed"], KV | None]:
        """`encoded`: this layer's cross-attention keys and values (`cross_kv`); `kv`/`index` its cache."""
        h, kv = self.attn(self.attn_norm(x), mask, kv=kv, index=index)
        x = x + h
        everywhere = jnp.ones((*x.shape[:2], encoded[0].shape[1]), bool)  # no encoder mask in Whisper
        x = x + cross_attend(self.cross, self.cross_norm(x), encoded, everywhere)
        return x + self.mlp(self.mlp_norm(x)), kv


@final
class Whisper(eqx.Module):
    """Whisper's encoder-decoder; `__call__` returns the logits of the decoder's tokens.

    The convolutions keep the checkpoint's Conv1d layout (out, in, 3); `encoder_layers` and
    `decoder_layers` are stacked. `lm_head` is None when tied to `embed_tokens`.
    """

    input_kind: ClassVar[str] = "input_features"  # what `port verify` feeds it
    FIELDS: ClassVar[ConfigFields] = ConfigFields(
        "port.models.whisper.Whisper",
        read=(
            "vocab_size", "num_mel_bins", "d_model", "encoder_layers", "encoder_attention_heads",
            "encoder_ffn_dim", "decoder_layers", "decoder_attention_heads", "decoder_ffn_dim",
            "max_source_positions", "max_target_positions", "activation_function", "tie_word_embeddings",
            "scale_embedding",  # read; transformers 5.24 never applies the scale it computes from it
            # training only: layer drop and SpecAugment run in transformers' training mode alone,
            # and the initialisation's spread; port's modules are for a checkpoint's numbers
            "encoder_layerdrop", "decoder_layerdrop", "init_std", "apply_spec_augment", "mask_time_prob",
            "mask_time_length", "mask_time_min_masks", "mask_feature_prob", "mask_feature_length",
            "mask_feature_min_masks", "activation_dropout",
            # generation and heads port does not build: suppressed tokens (a logits processor),
            # timestamps' filter, WhisperForAudioClassification's pooling
            "suppress_tokens", "begin_suppress_tokens", "median_filter_width", "use_weighted_layer_sum",
            "classifier_proj_size",
        ),
        fixed={"is_encoder_decoder": (True,)},
    )  # fmt: skip

    conv1_weight: Float[Array, "embed mels kernel"]
    conv1_bias: Float[Array, " embed"]
    conv2_weight: Float[Array, "embed_out embed kernel"]
    conv2_bias: Float[Array, " embed_out"]
    encoder_positions: Float[Array, "positions embed"]
    encoder_layers: EncoderLayer
    encoder_norm: LayerNorm
    embed_tokens: Float[Array, "vocab embed"]
    lm_head: Float[Array, "vocab embed"] | None
    decoder_positions: Float[Array, "positions embed"]
    decoder_layers: DecoderLayer
    decoder_norm: LayerNorm
    config: WhisperConfig = eqx.field(static=True)

    def __init__(self, config: WhisperConfig, *, key: PRNGKeyArray, dtype: Any = jnp.float32):
        kc1, kc2, kpos, kenc, kemb, kdpos, kdec = jax.random.split(key, 7)
        c, e = config, config.d_model
        self.conv1_weight = normal(kc1, (e, c.num_mel_bins, 3), dtype)
        self.conv1_bias = jnp.zeros((e,), dtype)
        self.conv2_weight = normal(kc2, (e, e, 3), dtype)
        self.conv2_bias = jnp.zeros((e,), dtype)
        self.encoder_positions = normal(kpos, (c.max_source_positions, e), dtype)
        self.encoder_layers = stacked(lambda k: EncoderLayer(c, dtype, key=k), kenc, c.encoder_layers)
        self.encoder_norm = LayerNorm(e, eps=LAYER_NORM_EPS, dtype=dtype)
        self.embed_tokens, self.lm_head = embeddings(
            kemb, vocab=c.vocab_size, embd=e, dtype=dtype, tied=c.tie_word_embeddings
        )
        self.decoder_positions = normal(kdpos, (c.max_target_positions, e), dtype)
        self.decoder_layers = stacked(lambda k: DecoderLayer(c, dtype, key=k), kdec, c.decoder_layers)
        self.decoder_norm = LayerNorm(e, eps=LAYER_NORM_EPS, dtype=dtype)
        self.config = config

    @classmethod
    def from_config(cls, config: dict, *, key: PRNGKeyArray, dtype: Any = jnp.float32) -> Whisper:
        """Randomly initialise from a Hugging Face `config.json` dict."""
        return cls(WhisperConfig.from_hf(config), key=key, dtype=dtype)

    @property
    def decoder_start_token_id(self) -> int:
        """config.json's `decoder_start_token_id`: the first decoder token (`<|startoftranscript|>`)."""
        start = self.config.decoder_start_token_id
        if start is None:
            raise ValueError("config.json sets no `decoder_start_token_id`: give `decoder_input_ids`")
        return start

    def __call__(
        self,
        input_features: ArrayLike,  # floating (batch, num_mel_bins, frames) or unbatched; checked here
        decoder_input_ids: ArrayLike,  # integer (batch, seq) or (seq,); checked by `prepare`
        *,
        decoder_attention_mask: Any = None,
        dtype: Any = None,
        remat: Any = None,
    ) -> Float[Array, "*batch seq vocab"]:
        """The logits `(batch, seq, vocab)` of `decoder_input_ids` given the audio's `input_features`.

        **Arguments:**

        - `input_features`: floating `(batch, num_mel_bins, 2 * max_source_positions)`, or
          without the batch axis (then `decoder_input_ids` has none either).
        - `decoder_input_ids`: integer `(batch, seq)` or `(seq,)`, `seq` up to
          `max_target_positions`.
        - `decoder_attention_mask`: `decoder_input_ids`' shape, 0 on padding (keys not
          attended to; positions still count from the first token, as in transformers).
        - `dtype`: the compute dtype (bfloat16 compute on float32 parameters).
        - `remat`: rematerialise each layer in the backward pass (`port.nn.scan`).

        `ValueError` for a bad shape, `TypeError` for a bad dtype; one line each, raised
        while tracing.

        ```python
        logits = model(jnp.zeros((2, 80, 3000)), jnp.zeros((2, 4), jnp.int32))   # (2, 4, vocab)
        ```
        """
        batched = check_features(input_features, self.config)
        tokens = prepare(
            decoder_input_ids,
            attention_mask=decoder_attention_mask,
            limit=("max_target_positions", self.config.max_target_positions),
        )
        if tokens.batched != batched:
            raise ValueError(
                "`input_features` and `decoder_input_ids` must both have a batch axis or both have none, "
                f"got shapes {tuple(jnp.shape(input_features))} and {tuple(jnp.shape(decoder_input_ids))}"
            )
        batch = jnp.shape(input_features)[0] if batched else 1
        if batch != tokens.ids.shape[0]:
            raise ValueError(
                f"`input_features` has a batch of {batch}, but `decoder_input_ids` has {tokens.ids.shape[0]}"
            )
        (encoded,) = batch_first(batched, self.encode(input_features, dtype=dtype, remat=remat))
        model = cast(self, dtype)

        def layer(block: DecoderLayer, x: Array) -> tuple[Array, None]:
            x, _ = block(x, tokens.mask, cross_kv(block.cross, encoded))
            return x, None

        x, _ = scan(layer, model._decoder_inputs(tokens.ids, 0), model.decoder_layers, remat=remat)
        return tokens.output(head(model.decoder_norm(x), model.embed_tokens, model.lm_head))

    def encode(
        self, input_features: ArrayLike, *, attention_mask: Any = None, dtype: Any = None, remat: Any = None
    ) -> Float[Array, "*batch positions embed"]:
        """The encoder's last hidden state `(batch, max_source_positions, d_model)`.

        **Arguments:** `input_features` as `__call__` takes them; `attention_mask` must be None
        (Whisper's encoder takes none: `ValueError` otherwise); `dtype`, `remat` as `__call__`'s.
        The result is in the compute dtype; without the batch axis, `(positions, d_model)`.

        ```python
        encoded = model.encode(jnp.zeros((2, 80, 3000)))   # (2, 1500, d_model)
        ```
        """
        if attention_mask is not None:
            raise ValueError("`attention_mask`: Whisper's encoder takes no mask (every frame is attended to)")
        batched = check_features(input_features, self.config)
        model = cast(self, dtype)
        (features,) = batch_first(batched, jnp.asarray(input_features).astype(model.conv1_weight.dtype))
        x = exact_gelu(_conv1d(features, model.conv1_weight, model.conv1_bias, CONV_STRIDES[0]))
        x = exact_gelu(_conv1d(x, model.conv2_weight, model.conv2_bias, CONV_STRIDES[1]))
        x = jnp.swapaxes(x, 1, 2) + jax.lax.stop_gradient(model.encoder_positions)  # frozen, as in transformers
        batch, seq = x.shape[:2]
        mask = jnp.ones((batch, seq, seq), bool)
        x, _ = scan(lambda block, x: (block(x, mask), None), x, model.encoder_layers, remat=remat)
        x = model.encoder_norm(x)
        return x if batched else x[0]

    def init_cache(
        self, batch: int, length: int, encoded: Float[Array, "batch keys embed"], *, attention_mask: Any = None
    ) -> Cache:
        """An empty decoder cache of `length` slots for `batch` sequences, with every decoder
        layer's cross-attention keys and values of `encoded` (`encode`'s output) computed once.

        `Cache.keys`/`values` are the self-attention buffers `[layers, batch, length, heads,
        head_dim]`, in `encoded`'s dtype; `Cache.states["cross"]` the cross-attention keys and
        values `[layers, batch, positions, heads, head_dim]`. `ValueError` (one line) for a
        `length` past `max_target_positions`, an `encoded` of another batch, or a mask.

        ```python
        cache = model.init_cache(2, 36, model.encode(features))
        ```
        """
        c = self.config
        if attention_mask is not None:
            raise ValueError("`attention_mask`: Whisper's encoder takes no mask (every frame is attended to)")
        if isinstance(length, int) and length > c.max_target_positions:
            raise ValueError(
                f"`length` {length} exceeds max_target_positions ({c.max_target_positions}): "
                "the decoder has no positions past it"
            )
        encoded = jnp.asarray(encoded)
        if encoded.ndim != 3 or encoded.shape[0] != batch or encoded.shape[2] != c.d_model:
            raise ValueError(
                f"`encoded` must have shape (batch, positions, d_model) = ({batch}, positions, {c.d_model}), "
                f"got {encoded.shape}"
            )
        model = cast(self, encoded.dtype)
        _, (keys, values) = scan(
            lambda block, carry: (carry, cross_kv(block.cross, encoded)), None, model.decoder_layers
        )
        heads = c.decoder_attention_heads
        shape = (c.decoder_layers, batch, length, heads, c.d_model // heads)
        empty = jnp.zeros(shape, encoded.dtype)
        return Cache.of(empty, empty, {"cross": (keys, values)}, batch=batch, length=length)

    def decode(
        self, decoder_input_ids: ArrayLike, *, cache: Cache, dtype: Any = None
    ) -> tuple[Float[Array, "*batch seq vocab"], Cache]:
        """Decoder steps on a cache from `init_cache`: the logits of `decoder_input_ids`
        (`(batch, seq)`, the tokens after those the cache holds) and the cache holding them too.

        ```python
        logits, cache = model.decode(prompt, cache=cache)           # prompt: (batch, 4)
        logits, cache = model.decode(next_ids[:, None], cache=cache)
        ```
        """
        if not isinstance(cache, Cache) or not isinstance(cache.states, dict) or "cross" not in cache.states:
            raise TypeError("`cache` must be a port.nn.Cache from Whisper's init_cache (it holds the encoder's keys)")
        tokens = prepare(decoder_input_ids, cache=cache)
        marked = tokens.cache
        assert marked is not None and tokens.index is not None, "prepare marks the cache it is given"
        model = cast(self, dtype)

        def layer(block: DecoderLayer, x: Array, kv: KV, encoded: KV) -> tuple[Array, KV | None]:
            return block(x, tokens.mask, encoded, kv=kv, index=tokens.index)

        x, (keys, values) = scan(
            layer,
            model._decoder_inputs(tokens.ids, tokens.index),
            model.decoder_layers,
            (marked.keys, marked.values),
            marked.states["cross"],
        )
        logits = head(model.decoder_norm(x), model.embed_tokens, model.lm_head)
        return tokens.output(logits, keys, values, marked.states)

    def _decoder_inputs(self, ids: Int[Array, "batch seq"], start: Int[Array, ""] | int) -> Array:
        """Token embeddings plus the learned positions `start, start + 1, ...` (transformers' forward's)."""
        positions = start + jnp.arange(ids.shape[1])
        return self.embed_tokens[ids] + self.decoder_positions[positions]


def _conv1d(
    x: Float[Array, "batch _in frames"],
    weight: Float[Array, "out _in kernel"],
    bias: Float[Array, " out"],
    stride: int,
) -> Float[Array, "batch out _frames"]:
    """torch's `Conv1d(kernel_size=3, padding=1, stride=stride)` of `x`, weights in its (out, in, 3) layout."""
    y = jax.lax.conv_general_dilated(x, weight, (stride,), [(1, 1)], dimension_numbers=("NCH", "OIH", "NCH"))
    return y + bias[:, None]
