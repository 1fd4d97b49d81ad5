"""T5, mT5 and UMT5 in Equinox: the encoder (`T5Encoder`), the encoder-decoder (`T5`), and it headless (`T5Model`).

Built from `port.nn`: its `Attention` (no biases, no 1/sqrt(d) scaling, `d_kv` x heads
need not be `d_model`), `rms_norm` (T5's layer norm: no mean, no bias, the variance in
float32), `attend` with an additive bias, `scan`, `head` and the `Cache`. What is T5's own
is here: the relative position buckets (bidirectional in the encoder, causal in the
decoder; one table in the first layer shared by every layer in T5 and mT5, a table per
layer in UMT5), the feed-forward (`wo(act(wi x))`, or gated `wo(act(wi_0 x) * wi_1 x)`
for `feed_forward_proj = "gated-gelu"`), cross-attention in every decoder layer, and the
output head (tied to `shared` unless the checkpoint holds an `lm_head.weight`; the
decoder's output multiplied by `d_model**-0.5` first where transformers does:
`scale_decoder_outputs`, by default `tie_word_embeddings` not false, in T5 and UMT5,
never in mT5). Dropout is not run.

`T5Encoder` is `T5EncoderModel` (a checkpoint of one, or the encoder of a full
checkpoint loaded with `mapping="t5_encoder"`, `"umt5_encoder"`); `T5` is
`T5ForConditionalGeneration` (and the mT5 and UMT5 ones), whose `encode`, `init_cache`,
`decode` and `decoder_start_token_id` are what greedy generation runs; `T5Model` is
`T5Model`, the decoder's last hidden state without a head (`mapping="t5_model"`,
`"umt5_model"`). All keep the embedding table `shared` and the stacks under the same paths.

Example:
    ```python
    import equinox as eqx
    import jax
    import jax.numpy as jnp
    from port.models.t5 import T5, T5Encoder

    config = {"model_type": "t5", "vocab_size": 100, "d_model": 32, "d_kv": 8, "d_ff": 64,
              "num_layers": 2, "num_heads": 4, "relative_attention_num_buckets": 8,
              "relative_attention_max_distance": 16, "decoder_start_token_id": 0}
    encoder = T5Encoder.from_config(config, key=jax.random.key(0))
    ids = jnp.zeros((2, 8), dtype=jnp.int32)
    mask = jnp.ones((2, 8), dtype=jnp.int32)   # 1 = attend, 0 = padding (left or right)
    hidden = eqx.filter_jit(encoder)(ids, attention_mask=mask)    # (2, 8, 32)

    model = T5.from_config(config, key=jax.random.key(0))
    targets = jnp.zeros((2, 5), dtype=jnp.int32)
    logits = model(ids, targets, attention_mask=mask)             # (2, 5, 100)
    # bfloat16 compute on float32 parameters, each layer recomputed in the backward pass:
    logits = model(ids, targets, attention_mask=mask, dtype=jnp.bfloat16, remat=True)

    # Greedy decoding by hand (port.nn.generate runs the same steps):
    encoded = model.encode(ids, attention_mask=mask)              # (2, 8, 32)
    cache = model.init_cache(2, 6, encoded, attention_mask=mask)
    start = jnp.full((2, 1), model.decoder_start_token_id)
    logits, cache = model.decode(start, cache=cache)              # (2, 1, 100)
    logits, cache = model.decode(logits[:, -1].argmax(-1)[:, None], cache=cache)
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
from jaxtyping import Array, Bool, Float, Int, PRNGKeyArray

from port._errors import ConfigError
from port._text import quoted
from port.nn import Attention, Cache, attend, cast, head, linear, normal, prepare, rms_norm, scan, stacked
from port.nn._tokens import Tokens
from port.nn.config import ACTIVATIONS, MAX_LAYERS, ConfigFields, check_model_type, get

MODEL_TYPES = ("t5", "mt5", "umt5")
"""The model types this module runs; UMT5 keeps a relative position table in every layer."""

CROSS = "cross"
"""The key of `Cache.states` holding the cross-attention keys, values and encoder mask."""


def feed_forward(config: dict) -> tuple[bool, str]:
    """Whether the feed-forward is gated, and its activation, as transformers derives them from
    `feed_forward_proj` ("relu", "gated-gelu" -> gelu_new, "gated-silu", ...), config.json's
    `is_gated_act` and `dense_act_fn` overriding them where present."""
    proj = config.get("feed_forward_proj", "relu")
    parts = proj.split("-") if isinstance(proj, str) else []
    if not parts or len(parts) > 2 or (len(parts) == 2 and parts[0] != "gated"):
        raise ConfigError(
            f"config.json: 'feed_forward_proj' {quoted(proj)} must be an activation or 'gated-' and one "
            "(e.g. 'relu', 'gated-gelu')"
        )
    gated, act = len(parts) == 2, "gelu_new" if proj == "gated-gelu" else parts[-1]
    gated = get(config, "is_gated_act", bool, gated)
    act = config.get("dense_act_fn") or act
    if act not in ACTIVATIONS:
        raise ConfigError(
            f"config.json: the feed-forward's activation {quoted(act)} is not supported "
            f"(supported: {', '.join(sorted(ACTIVATIONS))})"
        )
    return gated, act


def token_id(config: dict, key: str, vocab: int, default: int) -> int:
    """config.json's `key`, a token id below `vocab` (absent or null: `default`)."""
    value = config.get(key)
    if value is None:
        return default
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < vocab:
        raise ConfigError(f"config.json: {key!r} must be a token id below 'vocab_size' ({vocab}), got {quoted(value)}")
    return value


@final
@dataclasses.dataclass(frozen=True)
class T5Config:
    """The hyperparameters of a T5, mT5 or UMT5 model, as read from a Hugging Face config.json."""

    vocab_size: int
    d_model: int
    d_kv: int
    d_ff: int
    num_layers: int
    num_decoder_layers: int
    num_heads: int
    num_buckets: int
    max_distance: int
    eps: float
    gated: bool
    activation: str
    per_layer_bias: bool  # UMT5: a relative position table in every layer
    scale_output: bool  # the decoder's output times d_model**-0.5 before the head
    decoder_start_token_id: int

    @classmethod
    def from_hf(cls, config: dict, fields: ConfigFields) -> T5Config:
        """Build from a `config.json` dict after `fields.check`; raises `ConfigError` if unsupported."""
        fields.check(config)
        model_type = check_model_type(config, MODEL_TYPES, fields.module, default="t5")
        layers = get(config, "num_layers", int, 6, maximum=MAX_LAYERS)
        vocab = get(config, "vocab_size", int, 32128)
        buckets = get(config, "relative_attention_num_buckets", int, 32)
        if buckets < 4:
            raise ConfigError(f"config.json: 'relative_attention_num_buckets' ({buckets}) must be at least 4")
        distance = get(config, "relative_attention_max_distance", int, 128)
        if distance <= buckets // 2:
            raise ConfigError(
                f"config.json: 'relative_attention_max_distance' ({distance}) must exceed half of "
                f"'relative_attention_num_buckets' ({buckets})"
            )
        gated, act = feed_forward(config)
        tied = get(config, "tie_word_embeddings", bool, True)
        scale = model_type != "mt5" and get(config, "scale_decoder_outputs", bool, tied)
        pad = config.get("pad_token_id")  # T5 starts decoding with its pad id where no start id is given
        pad = pad if isinstance(pad, int) and not isinstance(pad, bool) and 0 <= pad < vocab else 0
        return cls(
            vocab_size=vocab,
            d_model=get(config, "d_model", int, 512),
            d_kv=get(config, "d_kv", int, 64),
            d_ff=get(config, "d_ff", int, 2048),
            num_layers=layers,
            num_decoder_layers=get(config, "num_decoder_layers", int, layers, maximum=MAX_LAYERS),
            num_heads=get(config, "num_heads", int, 8),
            num_buckets=buckets,
            max_distance=distance,
            eps=get(config, "layer_norm_epsilon", float, 1e-6),
            gated=gated,
            activation=act,
            per_layer_bias=model_type == "umt5",
            scale_output=scale,
            decoder_start_token_id=token_id(config, "decoder_start_token_id", vocab, pad),
        )


def relative_buckets(
    relative: Int[Array, "seq keys"], *, bidirectional: bool, num_buckets: int, max_distance: int
) -> Int[Array, "seq keys"]:
    """T5's bucket of each relative position (key slot minus query slot), as transformers'
    `_relative_position_bucket`: exact buckets for small distances, logarithmic ones up to
    `max_distance`, the last bucket beyond; half the buckets for keys after the query when
    `bidirectional`, else keys after the query share bucket 0.

    ```python
    relative_buckets(jnp.arange(-3, 4)[None], bidirectional=True, num_buckets=8, max_distance=16)
    # [[2, 2, 1, 0, 5, 6, 6]]
    ```
    """
    buckets = jnp.zeros_like(relative)
    if bidirectional:
        num_buckets //= 2
        buckets = buckets + (relative > 0).astype(relative.dtype) * num_buckets
        distance = jnp.abs(relative)
    else:
        distance = -jnp.minimum(relative, 0)
    exact = num_buckets // 2
    scaled = jnp.log(jnp.maximum(distance, 1).astype(jnp.float32) / exact) / math.log(max_distance / exact)
    large = jnp.minimum(exact + (scaled * (num_buckets - exact)).astype(relative.dtype), num_buckets - 1)
    return buckets + jnp.where(distance < exact, distance, large)


def position_bias(table: Float[Array, "buckets heads"], buckets: Int[Array, "seq keys"]) -> Array:
    """The additive score bias `[1, heads, seq, keys]` of a relative position `table` for `buckets`."""
    return jnp.transpose(table[buckets], (2, 0, 1))[None]


@final
class FeedForward(eqx.Module):
    """T5's feed-forward without biases: `wo(act(wi x))`, or gated `wo(act(wi_0 x) * wi_1 x)`.

    The leaves are transformers' (`DenseReluDense.wi`, `wi_0`, `wi_1`, `wo`), torch `Linear`
    layouts; `wi` is None when gated, `wi_0` and `wi_1` when not.
    """

    wi: Float[Array, "mlp embed"] | None
    wi_0: Float[Array, "mlp embed"] | None
    wi_1: Float[Array, "mlp embed"] | None
    wo: Float[Array, "embed mlp"]
    activation: str = eqx.field(static=True)

    def __init__(self, config: T5Config, dtype: Any, *, key: PRNGKeyArray):
        k0, k1, ko = jax.random.split(key, 3)
        shape = (config.d_ff, config.d_model)
        self.wi = None if config.gated else normal(k0, shape, dtype)
        self.wi_0 = normal(k0, shape, dtype) if config.gated else None
        self.wi_1 = normal(k1, shape, dtype) if config.gated else None
        self.wo = normal(ko, (config.d_model, config.d_ff), dtype)
        self.activation = config.activation

    def __call__(self, x: Float[Array, "... embed"]) -> Float[Array, "... embed"]:
        act = ACTIVATIONS[self.activation]
        if self.wi_0 is not None and self.wi_1 is not None:
            h = act(linear(x, self.wi_0, None)) * linear(x, self.wi_1, None)
        else:
            assert self.wi is not None, "a feed-forward has wi or wi_0 and wi_1"
            h = act(linear(x, self.wi, None))
        return linear(h, self.wo, None)


def attention(config: T5Config, dtype: Any, key: PRNGKeyArray) -> Attention:
    """T5's attention: no biases, no score scaling."""
    h, d = config.num_heads, config.d_kv
    return Attention(heads=h, kv_heads=h, head_dim=d, embd=config.d_model, dtype=dtype, key=key, scale=1.0)


@final
class Layer(eqx.Module):
    """One pre-norm T5 block: self-attention, cross-attention (decoder layers), feed-forward,
    each `x + f(norm(x))`; UMT5's own relative position table in `relative_bias`."""

    attn: Attention
    attn_norm: Float[Array, " embed"]
    cross: Attention | None
    cross_norm: Float[Array, " embed"] | None
    mlp: FeedForward
    mlp_norm: Float[Array, " embed"]
    relative_bias: Float[Array, "buckets heads"] | None
    eps: float = eqx.field(static=True)

    def __init__(self, config: T5Config, dtype: Any, *, decoder: bool, key: PRNGKeyArray):
        kattn, kcross, kmlp, kbias = jax.random.split(key, 4)
        ones = jnp.ones((config.d_model,), dtype)
        self.attn, self.attn_norm = attention(config, dtype, kattn), ones
        self.cross = attention(config, dtype, kcross) if decoder else None
        self.cross_norm = ones if decoder else None
        self.mlp, self.mlp_norm = FeedForward(config, dtype, key=kmlp), ones
        table = (config.num_buckets, config.num_heads)
        self.relative_bias = normal(kbias, table, dtype) if config.per_layer_bias else None
        self.eps = config.eps

    def cross_kv(self, encoded: Float[Array, "batch source embed"]) -> tuple[Array, Array]:
        """The cross-attention keys and values of the encoder's output, `[batch, src, heads, d_kv]` each."""
        assert self.cross is not None, "an encoder layer has no cross-attention"
        k = jnp.einsum("bse,hde->bshd", encoded, self.cross.wk)
        return k, jnp.einsum("bse,hde->bshd", encoded, self.cross.wv)

    def __call__(
        self,
        x: Float[Array, "batch seq embed"],
        mask: Bool[Array, "batch seq keys"],
        bias: Float[Array, "1 heads seq keys"],
        *,
        kv: Any = None,
        index: Any = None,
        cross: tuple[Array, Array] | None = None,
        cross_mask: Bool[Array, "batch seq source"] | None = None,
    ) -> tuple[Float[Array, "batch seq embed"], Any]:
        y, kv = self.attn(rms_norm(x, self.attn_norm, self.eps), mask, kv=kv, index=index, bias=bias.astype(x.dtype))
        x = x + y
        if self.cross is not None and self.cross_norm is not None:
            assert cross is not None and cross_mask is not None, "a decoder layer attends to the encoder's output"
            q = jnp.einsum("bte,hde->bthd", rms_norm(x, self.cross_norm, self.eps), self.cross.wq)
            keys, values = (c.astype(q.dtype) for c in cross)
            out = attend(q, keys, values, cross_mask, scale=1.0)
            x = x + jnp.einsum("bthd,ehd->bte", out, self.cross.wo)
        return x + self.mlp(rms_norm(x, self.mlp_norm, self.eps)), kv


@final
class Stack(eqx.Module):
    """The encoder's or the decoder's layers (stacked), T5's shared relative position table
    (`relative_bias`, None in UMT5, whose layers hold their own) and the final norm."""

    layers: Layer
    relative_bias: Float[Array, "buckets heads"] | None
    final_norm: Float[Array, " embed"]
    config: T5Config = eqx.field(static=True)
    decoder: bool = eqx.field(static=True)

    def __init__(self, config: T5Config, dtype: Any, *, decoder: bool, key: PRNGKeyArray):
        klayers, kbias = jax.random.split(key)
        count = config.num_decoder_layers if decoder else config.num_layers
        self.layers = stacked(lambda k: Layer(config, dtype, decoder=decoder, key=k), klayers, count)
        table = (config.num_buckets, config.num_heads)
        self.relative_bias = None if config.per_layer_bias else normal(kbias, table, dtype)
        self.final_norm = jnp.ones((config.d_model,), dtype)
        self.config, self.decoder = config, decoder

    def cross_kv(self, encoded: Float[Array, "batch source embed"]) -> tuple[Array, Array]:
        """Every decoder layer's cross-attention keys and values, `[layers, batch, src, heads, d_kv]` each."""
        _, kv = scan(lambda layer, carry: (carry, layer.cross_kv(encoded)), None, self.layers)
        return kv

    def __call__(
        self,
        x: Float[Array, "batch seq embed"],
        mask: Bool[Array, "batch seq keys"],
        query_slots: Int[Array, " seq"],
        key_slots: Int[Array, " keys"],
        *,
        kv: Any = None,
        index: Any = None,
        cross: Any = None,
        cross_mask: Bool[Array, "batch seq source"] | None = None,
        remat: Any = None,
    ) -> tuple[Float[Array, "batch seq embed"], Any]:
        c = self.config
        buckets = relative_buckets(
            key_slots[None, :] - query_slots[:, None],
            bidirectional=not self.decoder,
            num_buckets=c.num_buckets,
            max_distance=c.max_distance,
        )
        shared = None if self.relative_bias is None else position_bias(self.relative_bias, buckets)

        def step(layer: Layer, x: Array, kv: Any, cross: Any) -> tuple[Array, Any]:
            table = layer.relative_bias
            bias = shared if table is None else position_bias(table, buckets)
            assert bias is not None, "T5 shares one relative position table; UMT5 has one per layer"
            return layer(x, mask, bias, kv=kv, index=index, cross=cross, cross_mask=cross_mask)

        x, kv = scan(step, x, self.layers, kv, cross, remat=remat)
        return rms_norm(x, self.final_norm, c.eps), kv


def encode(shared: Array, stack: Stack, tokens: Tokens, remat: Any) -> Float[Array, "batch seq embed"]:
    """The encoder's last hidden state for prepared (bidirectional) `tokens`."""
    slots = jnp.arange(tokens.ids.shape[1])
    x, _ = stack(shared[tokens.ids], tokens.mask, slots, slots, remat=remat)
    return x


_COMMON = (
    "vocab_size",
    "d_model",
    "d_kv",
    "d_ff",
    "num_layers",
    "num_heads",
    "relative_attention_num_buckets",
    "relative_attention_max_distance",
    "layer_norm_epsilon",
    "feed_forward_proj",
    "dense_act_fn",
    "is_gated_act",
    "dropout_rate",  # training only: port runs without dropout
    "is_encoder_decoder",  # which module runs is the mapping's choice, not this field's
    "tie_word_embeddings",  # the head: `lm_head.weight` when the checkpoint has one, else `shared`
    "scale_decoder_outputs",
    "num_decoder_layers",
)

ENCODER_FIELDS = ConfigFields(
    "port.models.t5.T5Encoder",
    read=_COMMON,  # the decoder's and the head's fields describe parts the encoder does not build
    fixed={"is_decoder": (False,)},
)

FIELDS = ConfigFields(
    "port.models.t5.T5",
    read=(*_COMMON, "is_decoder"),  # transformers sets is_decoder per stack, whatever config.json says
)

MODEL_FIELDS = dataclasses.replace(FIELDS, module="port.models.t5.T5Model")


def _unbatched(tokens: Tokens, other: Tokens, names: tuple[str, str]) -> None:
    """`ValueError` unless two inputs agree on having a batch axis and on its size."""
    a, b = tokens.ids.shape[0], other.ids.shape[0]
    if tokens.batched != other.batched or a != b:
        raise ValueError(
            f"`{names[0]}` and `{names[1]}` must both have a batch axis of one size or both have none, "
            f"got shapes {tuple(tokens.ids.shape) if tokens.batched else tokens.ids.shape[1:]} and "
            f"{tuple(other.ids.shape) if other.batched else other.ids.shape[1:]}"
        )


def decoded(
    shared: Array, encoder: Stack, decoder: Stack, input_ids: Any, decoder_input_ids: Any, masks: tuple, remat: Any
) -> tuple[Tokens, Float[Array, "batch seq embed"]]:
    """The decoder's last hidden state (final norm applied) for `decoder_input_ids` given
    `input_ids`, and the decoder's prepared tokens; `masks` the encoder's and the decoder's
    attention masks (None: no padding)."""
    source = prepare(input_ids, attention_mask=masks[0], causal=False)
    target = prepare(decoder_input_ids, attention_mask=masks[1])
    _unbatched(source, target, ("input_ids", "decoder_input_ids"))
    encoded = encode(shared, encoder, source, remat)
    batch, seq = target.ids.shape
    cross_mask = jnp.broadcast_to(source.mask[:, :1, :], (batch, seq, source.ids.shape[1]))
    slots = jnp.arange(seq)
    cross = decoder.cross_kv(encoded)
    x, _ = decoder(shared[target.ids], target.mask, slots, slots, cross=cross, cross_mask=cross_mask, remat=remat)
    return target, x


@final
class T5Encoder(eqx.Module):
    """T5's encoder (`T5EncoderModel`); `__call__` returns the last hidden state. `encoder.layers` is stacked."""

    FIELDS: ClassVar[ConfigFields] = ENCODER_FIELDS

    shared: Float[Array, "vocab embed"]
    encoder: Stack
    config: T5Config = eqx.field(static=True)

    def __init__(self, config: T5Config, *, key: PRNGKeyArray, dtype: Any = jnp.float32):
        kshared, kencoder = jax.random.split(key)
        self.shared = normal(kshared, (config.vocab_size, config.d_model), dtype)
        self.encoder = Stack(config, dtype, decoder=False, key=kencoder)
        self.config = config

    @classmethod
    def from_config(cls, config: dict, *, key: PRNGKeyArray, dtype: Any = jnp.float32) -> T5Encoder:
        """Randomly initialise from a Hugging Face `config.json` dict."""
        return cls(T5Config.from_hf(config, cls.FIELDS), key=key, dtype=dtype)

    def __call__(
        self,
        input_ids: ArrayLike,  # integer (batch, seq) or (seq,): checked by `prepare`, which names it
        *,
        attention_mask: Any = None,
        dtype: Any = None,
        remat: Any = None,
    ) -> Float[Array, "*batch seq embed"]:
        """The last hidden state `[batch, seq, d_model]` (`[seq, d_model]` for `(seq,)` ids).

        **Arguments:**

        - `input_ids`: integer `(batch, seq)`, or `(seq,)` (run as a batch of one).
        - `attention_mask`: `input_ids`' shape; nonzero/True to attend, 0 for padding (left
          or right; relative positions count slots, as in transformers). Padded queries
          still get an output.
        - `dtype`: the compute dtype (bfloat16 compute on float32 parameters).
        - `remat`: rematerialise each layer in the backward pass (`port.nn.scan`).

        Raises `ValueError` / `TypeError` naming the argument for a bad shape or dtype.

        ```python
        hidden = encoder(jnp.zeros((2, 8), jnp.int32), attention_mask=jnp.ones((2, 8)))  # (2, 8, d_model)
        ```
        """
        tokens = prepare(input_ids, attention_mask=attention_mask, causal=False)
        model = cast(self, dtype)
        return tokens.output(encode(model.shared, model.encoder, tokens, remat))


@final
class T5(eqx.Module):
    """T5's encoder-decoder (`T5ForConditionalGeneration`); `__call__` returns the logits.

    `encoder` and `decoder` are `Stack`s (layers stacked); `lm_head` is None where the head
    is tied to `shared` (the checkpoint holds no `lm_head.weight`).
    """

    FIELDS: ClassVar[ConfigFields] = FIELDS

    shared: Float[Array, "vocab embed"]
    encoder: Stack
    decoder: Stack
    lm_head: Float[Array, "vocab embed"] | None
    config: T5Config = eqx.field(static=True)

    def __init__(self, config: T5Config, *, key: PRNGKeyArray, dtype: Any = jnp.float32):
        kshared, kencoder, kdecoder, khead = jax.random.split(key, 4)
        self.shared = normal(kshared, (config.vocab_size, config.d_model), dtype)
        self.encoder = Stack(config, dtype, decoder=False, key=kencoder)
        self.decoder = Stack(config, dtype, decoder=True, key=kdecoder)
        self.lm_head = normal(khead, (config.vocab_size, config.d_model), dtype)
        self.config = config

    @classmethod
    def from_config(cls, config: dict, *, key: PRNGKeyArray, dtype: Any = jnp.float32) -> T5:
        """Randomly initialise from a Hugging Face `config.json` dict (an untied head; a checkpoint
        without `lm_head.weight` loads it as None, tied to `shared`)."""
        return cls(T5Config.from_hf(config, cls.FIELDS), key=key, dtype=dtype)

    @property
    def decoder_start_token_id(self) -> int:
        """The first decoder token of generation: config.json's `decoder_start_token_id` (else its pad id, else 0)."""
        return self.config.decoder_start_token_id

    def logits(self, x: Float[Array, "batch seq embed"]) -> Float[Array, "batch seq vocab"]:
        """The head on the decoder's last hidden state (scaled by `d_model**-0.5` where T5 does)."""
        if self.config.scale_output:
            x = x * jnp.asarray(self.config.d_model**-0.5, x.dtype)
        return head(x, self.shared, self.lm_head)

    def encode(
        self, input_ids: ArrayLike, *, attention_mask: Any = None, dtype: Any = None, remat: Any = None
    ) -> Float[Array, "*batch seq embed"]:
        """The encoder's last hidden state, as `T5Encoder.__call__` gives it.

        ```python
        encoded = model.encode(ids, attention_mask=mask)        # ids: [2, 8] -> [2, 8, d_model]
        ```
        """
        tokens = prepare(input_ids, attention_mask=attention_mask, causal=False)
        model = cast(self, dtype)
        return tokens.output(encode(model.shared, model.encoder, tokens, remat))

    def __call__(
        self,
        input_ids: ArrayLike,  # integer (batch, src) or (src,): checked by `prepare`, which names it
        decoder_input_ids: ArrayLike,  # integer (batch, tgt) or (tgt,), as `input_ids`
        *,
        attention_mask: Any = None,
        decoder_attention_mask: Any = None,
        dtype: Any = None,
        remat: Any = None,
    ) -> Float[Array, "*batch seq vocab"]:
        """The logits `[batch, tgt, vocab]` of `decoder_input_ids` given `input_ids`.

        **Arguments:**

        - `input_ids`: the encoder's integer `(batch, src)`, or `(src,)`.
        - `decoder_input_ids`: the decoder's integer `(batch, tgt)` (the labels shifted
          right after `decoder_start_token_id`), or `(tgt,)` with `(src,)` inputs.
        - `attention_mask`: `input_ids`' shape, 0 on padding (the encoder's keys and the
          cross-attention's).
        - `decoder_attention_mask`: `decoder_input_ids`' shape, 0 on padding (with the
          causal mask).
        - `dtype`, `remat`: as `T5Encoder.__call__`.

        Raises `ValueError` / `TypeError` naming the argument for a bad shape or dtype, or
        two inputs of different batch sizes.

        ```python
        logits = model(ids, targets, attention_mask=mask)     # [2, 8], [2, 5] -> [2, 5, vocab]
        ```
        """
        masks = (attention_mask, decoder_attention_mask)
        model = cast(self, dtype)
        target, x = decoded(model.shared, model.encoder, model.decoder, input_ids, decoder_input_ids, masks, remat)
        return target.output(model.logits(x))

    def init_cache(
        self,
        batch: int,
        length: int,
        encoded: Float[ArrayLike, "batch source embed"],
        *,
        attention_mask: Any = None,
        dtype: Any = None,
    ) -> Cache:
        """An empty decoder cache of `length` slots for `batch` sequences, holding the
        cross-attention keys and values of `encoded` (computed once, here).

        **Arguments:**

        - `batch`, `length`: the batch size and the decoder tokens to come (start tokens
          and new ones).
        - `encoded`: the encoder's output `[batch, src, d_model]` (`encode`).
        - `attention_mask`: `[batch, src]`, the encoder's padding mask (None: none).
        - `dtype`: the cache's dtype (default: `encoded`'s).

        **Returns:** a `Cache` whose `states["cross"]` is `(keys, values, mask)`: keys and
        values `[layers, batch, src, heads, d_kv]`, the mask `[batch, src]`.

        ```python
        cache = model.init_cache(2, 33, model.encode(ids, attention_mask=mask), attention_mask=mask)
        ```
        """
        encoded = jnp.asarray(encoded)
        if encoded.ndim != 3 or encoded.shape[0] != batch or encoded.shape[2] != self.config.d_model:
            raise ValueError(
                f"`encoded` must have shape (batch, src, d_model) = ({batch}, src, {self.config.d_model}), "
                f"got {tuple(encoded.shape)}"
            )
        src = encoded.shape[1]
        if attention_mask is None:
            mask = jnp.ones((batch, src), bool)
        else:
            if tuple(jnp.shape(attention_mask)) != (batch, src):
                raise ValueError(
                    f"`attention_mask` must have shape (batch, src) = ({batch}, {src}) like `encoded`, "
                    f"got {tuple(jnp.shape(attention_mask))}"
                )
            mask = jnp.asarray(attention_mask) != 0
        dtype = encoded.dtype if dtype is None else dtype
        keys, values = cast(self.decoder, dtype).cross_kv(encoded.astype(dtype))
        c = self.config
        shape = (c.num_decoder_layers, batch, length, c.num_heads, c.d_kv)
        return Cache.of(
            jnp.zeros(shape, dtype), jnp.zeros(shape, dtype), {CROSS: (keys, values, mask)}, batch=batch, length=length
        )

    def decode(
        self, decoder_input_ids: ArrayLike, *, cache: Cache, dtype: Any = None
    ) -> tuple[Float[Array, "*batch seq vocab"], Cache]:
        """The logits of `decoder_input_ids` at the cache's next slots, and the cache holding them.

        **Arguments:**

        - `decoder_input_ids`: integer `(batch, seq)` (start tokens, then one token a step).
        - `cache`: from `init_cache`, or the previous `decode`.
        - `dtype`: the compute dtype.

        ```python
        logits, cache = model.decode(jnp.zeros((2, 1), jnp.int32), cache=cache)   # [2, 1, vocab]
        ```
        """
        if not isinstance(cache, Cache) or not isinstance(cache.states, dict) or CROSS not in cache.states:
            raise TypeError("`cache` must be a port.nn.Cache from T5.init_cache (it holds the encoder's keys)")
        tokens = prepare(decoder_input_ids, cache=cache)
        assert tokens.cache is not None and tokens.index is not None, "prepare marks the cache's slots"
        model = cast(self, dtype)
        keys, values, source = cache.states[CROSS]
        seq = tokens.ids.shape[1]
        cross_mask = jnp.broadcast_to(source[:, None, :], (source.shape[0], seq, source.shape[1]))
        x, (keys_out, values_out) = model.decoder(
            model.shared[tokens.ids],
            tokens.mask,
            tokens.index + jnp.arange(seq),
            jnp.arange(cache.size),
            kv=(cache.keys, cache.values),
            index=tokens.index,
            cross=(keys, values),
            cross_mask=cross_mask,
        )
        return tokens.output(model.logits(x), keys_out, values_out, cache.states)


@final
class T5Model(eqx.Module):
    """T5's encoder-decoder without a head (`T5Model`); `__call__` returns the decoder's last hidden state."""

    FIELDS: ClassVar[ConfigFields] = MODEL_FIELDS

    shared: Float[Array, "vocab embed"]
    encoder: Stack
    decoder: Stack
    config: T5Config = eqx.field(static=True)

    def __init__(self, config: T5Config, *, key: PRNGKeyArray, dtype: Any = jnp.float32):
        kshared, kencoder, kdecoder = jax.random.split(key, 3)
        self.shared = normal(kshared, (config.vocab_size, config.d_model), dtype)
        self.encoder = Stack(config, dtype, decoder=False, key=kencoder)
        self.decoder = Stack(config, dtype, decoder=True, key=kdecoder)
        self.config = config

    @classmethod
    def from_config(cls, config: dict, *, key: PRNGKeyArray, dtype: Any = jnp.float32) -> T5Model:
        """Randomly initialise from a Hugging Face `config.json` dict."""
        return cls(T5Config.from_hf(config, cls.FIELDS), key=key, dtype=dtype)

    def __call__(
        self,
        input_ids: ArrayLike,  # integer (batch, src) or (src,): checked by `prepare`, which names it
        decoder_input_ids: ArrayLike,  # integer (batch, tgt) or (tgt,), as `input_ids`
        *,
        attention_mask: Any = None,
        decoder_attention_mask: Any = None,
        dtype: Any = None,
        remat: Any = None,
    ) -> Float[Array, "*batch seq embed"]:
        """The decoder's last hidden state `[batch, tgt, d_model]`; the arguments are `T5.__call__`'s.

        ```python
        hidden = model(ids, targets, attention_mask=mask)     # [2, 8], [2, 5] -> [2, 5, d_model]
        ```
        """
        masks = (attention_mask, decoder_attention_mask)
        model = cast(self, dtype)
        target, x = decoded(model.shared, model.encoder, model.decoder, input_ids, decoder_input_ids, masks, remat)
        return target.output(x)
