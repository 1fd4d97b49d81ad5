"""Mixtral and Qwen2-MoE (Llama attention, sparse mixture-of-experts MLP) as one Equinox model.

`Moe` is port's Llama (`port.models.llama`) with the SwiGLU MLP of every block replaced by
a `SparseMoe`: a router (`gate`), a softmax over the experts, the top `num_experts_per_tok`
of them per token, and the experts themselves stacked on an axis after the layers'
(`blocks.mlp.experts.gate` is [layers, experts, intermediate, embed]). Two `model_type`s:

- "mixtral": the top-k weights are renormalised to sum to 1 (and stay float32, as in
  transformers); no attention biases; an optional sliding window on every layer.
- "qwen2_moe": renormalised only when `norm_topk_prob`; q/k/v biases (`qkv_bias`); a
  shared expert (a SwiGLU MLP of `shared_expert_intermediate_size`) added to every token,
  scaled by `sigmoid(shared_expert_gate(x))`. Dense layers (`mlp_only_layers`,
  `decoder_sparse_step` > 1) would make the layers heterogeneous: refused.

Every expert is computed for every token and weighted by the routing weights, which are
zero outside the top k: exact, simple, and sharded on the experts axis with no gather,
at `num_experts / num_experts_per_tok` times the MLP compute of a sparse dispatch.

Example:
    ```python
    import equinox as eqx
    import jax
    import jax.numpy as jnp
    from port.models.moe import Moe

    config = {"model_type": "mixtral", "vocab_size": 32000, "hidden_size": 4096,
              "intermediate_size": 14336, "num_hidden_layers": 32,
              "num_attention_heads": 32, "num_key_value_heads": 8,
              "num_local_experts": 8, "num_experts_per_tok": 2}
    # Shapes only, no memory allocated (e.g. before loading a checkpoint):
    abstract = eqx.filter_eval_shape(Moe.from_config, config, key=jax.random.key(0))
    # abstract.blocks.mlp.experts.gate.shape == (32, 8, 14336, 4096)

    small = {**config, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
             "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 100}
    model = Moe.from_config(small, key=jax.random.key(0))
    logits = eqx.filter_jit(model)(jnp.zeros((1, 8), dtype=jnp.int32))  # (1, 8, 100)
    ```
"""

from __future__ import annotations

import dataclasses
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, PRNGKeyArray

from port._console import quoted
from port._errors import ConfigError
from port.models._config import MAX_LAYERS, get
from port.models.llama import MLP, Attention, Block, Llama, LlamaConfig, _normal

MODEL_TYPES = ("mixtral", "qwen2_moe")

# transformers' config class defaults, used where config.json omits a key (as port's Llama,
# a null num_key_value_heads means one kv head per query head).
_MIXTRAL_DEFAULTS: dict[str, Any] = {
    "num_local_experts": 8, "num_experts_per_tok": 2, "rms_norm_eps": 1e-5,
    "rope_theta": 1e6, "sliding_window": None,
}
_QWEN2_MOE_DEFAULTS: dict[str, Any] = {
    "num_experts": 60, "num_experts_per_tok": 4, "moe_intermediate_size": 1408,
    "shared_expert_intermediate_size": 5632, "norm_topk_prob": False, "qkv_bias": True,
    "decoder_sparse_step": 1, "num_key_value_heads": 16, "max_window_layers": 28,
}


@dataclasses.dataclass(frozen=True)
class MoeConfig(LlamaConfig):
    """A `LlamaConfig` (attention, norms, RoPE) plus the mixture of experts.

    `moe_intermediate_size` is each routed expert's hidden size; `shared_intermediate_size`
    the shared expert's, or None without one. `weights_in_input_dtype`: the top-k weights
    are cast to the activations' dtype before weighting (Qwen2-MoE) rather than kept
    float32 (Mixtral); the same in float32.
    """

    num_experts: int = 8
    num_experts_per_tok: int = 2
    moe_intermediate_size: int = 14336
    norm_topk_prob: bool = True
    shared_intermediate_size: int | None = None
    weights_in_input_dtype: bool = False

    @classmethod
    def from_hf(cls, config: dict) -> MoeConfig:
        """Build from a Hugging Face `config.json` dict; raises `ConfigError` if unsupported.

        ```python
        c = MoeConfig.from_hf({"model_type": "qwen2_moe", "vocab_size": 101, "hidden_size": 48,
                               "intermediate_size": 56, "num_hidden_layers": 2,
                               "num_attention_heads": 6, "num_key_value_heads": 2, "num_experts": 6})
        c.num_experts, c.num_experts_per_tok, c.shared_intermediate_size   # (6, 4, 5632)
        ```
        """
        model_type = config.get("model_type")
        if model_type not in MODEL_TYPES:
            raise ConfigError(
                f"config.json: 'model_type' {quoted(model_type)} is not supported by "
                f"port.models.moe (supported: {', '.join(MODEL_TYPES)})"
            )
        if model_type == "mixtral":
            attention, moe = _mixtral(config)
        else:
            attention, moe = _qwen2_moe(config)
        if moe["num_experts_per_tok"] > moe["num_experts"]:
            key = "num_local_experts" if model_type == "mixtral" else "num_experts"
            raise ConfigError(
                f"config.json: 'num_experts_per_tok' ({moe['num_experts_per_tok']}) is more than "
                f"{key!r} ({moe['num_experts']})"
            )
        base = {f.name: getattr(attention, f.name) for f in dataclasses.fields(LlamaConfig)}
        return cls(**{**base, "model_type": model_type, **moe})


def _with_defaults(config: dict, defaults: dict[str, Any]) -> dict:
    """`config` with `defaults` for the keys it lacks."""
    return {**defaults, **config}


def _mixtral(config: dict) -> tuple[LlamaConfig, dict[str, Any]]:
    """Mixtral's attention is Mistral's (no biases, an optional sliding window on every layer)."""
    filled = _with_defaults(config, _MIXTRAL_DEFAULTS)  # no window unless given (Mistral: 4096)
    attention = LlamaConfig.from_hf({**filled, "model_type": "mistral"})
    moe = dict(
        num_experts=get(filled, "num_local_experts", int),
        num_experts_per_tok=get(filled, "num_experts_per_tok", int),
        moe_intermediate_size=attention.intermediate_size,
        norm_topk_prob=True,
        shared_intermediate_size=None,
        weights_in_input_dtype=False,
    )
    return attention, moe


def _qwen2_moe(config: dict) -> tuple[LlamaConfig, dict[str, Any]]:
    """Qwen2-MoE's attention is Qwen2's, with q/k/v biases as `qkv_bias` says."""
    filled = _with_defaults(config, _QWEN2_MOE_DEFAULTS)
    layers = get(filled, "num_hidden_layers", int, maximum=MAX_LAYERS)
    if get(filled, "use_sliding_window", bool, False) and filled.get("layer_types") is None:
        # Qwen2MoeConfig: every other layer (0, 2, ...) below max_window_layers slides.
        first = filled["max_window_layers"]
        if not isinstance(first, int) or isinstance(first, bool) or first < 0:
            raise ConfigError(
                f"config.json: 'max_window_layers' must be a non-negative integer, got {quoted(first)}"
            )
        filled["layer_types"] = [
            "sliding_attention" if i % 2 == 0 and i < first else "full_attention" for i in range(layers)
        ]
    attention = LlamaConfig.from_hf({**filled, "model_type": "qwen2"})
    attention = dataclasses.replace(attention, qkv_bias=get(filled, "qkv_bias", bool))
    _refuse_dense_layers(filled, layers)
    moe = dict(
        num_experts=get(filled, "num_experts", int),
        num_experts_per_tok=get(filled, "num_experts_per_tok", int),
        moe_intermediate_size=get(filled, "moe_intermediate_size", int),
        norm_topk_prob=get(filled, "norm_topk_prob", bool),
        shared_intermediate_size=get(filled, "shared_expert_intermediate_size", int),
        weights_in_input_dtype=True,
    )
    return attention, moe


def _refuse_dense_layers(config: dict, layers: int) -> None:
    """Refuse `mlp_only_layers` / `decoder_sparse_step` that give some layer a dense MLP.

    transformers makes layer i sparse when i is not in `mlp_only_layers` and
    `(i + 1) % decoder_sparse_step == 0`; port stacks the layers, so all must be sparse.
    """
    step = get(config, "decoder_sparse_step", int)
    only = config.get("mlp_only_layers") or []
    if not isinstance(only, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in only):
        raise ConfigError(f"config.json: 'mlp_only_layers' must be a list of layer indices, got {quoted(only)}")
    listed = sorted(i for i in set(only) if 0 <= i < layers)
    if listed:
        raise ConfigError(
            f"config.json: 'mlp_only_layers' {listed} gives layers {listed} a dense MLP: "
            "port.models.moe needs a sparse MoE MLP in every layer"
        )
    dense = [i for i in range(layers) if (i + 1) % step]
    if dense:
        raise ConfigError(
            f"config.json: 'decoder_sparse_step' {step} gives layers {dense} a dense MLP: "
            "port.models.moe needs a sparse MoE MLP in every layer (decoder_sparse_step 1)"
        )


def routing_weights(
    logits: Float[Array, "seq experts"], top_k: int, renormalise: bool
) -> Float[Array, "seq experts"]:
    """Each token's weight for each expert: the softmax (in float32), zero outside the top k.

    As transformers' routers: softmax of the router logits in float32, the `top_k`
    largest, divided by their sum when `renormalise`.

    ```python
    routing_weights(jnp.array([[0.0, 1.0, 2.0]]), 2, True)   # [[0, 0.269, 0.731]]
    ```
    """
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    top, index = jax.lax.top_k(probs, top_k)
    if renormalise:
        top = top / top.sum(axis=-1, keepdims=True)
    chosen = jax.nn.one_hot(index, probs.shape[-1], dtype=top.dtype)  # [seq, k, experts]
    return (chosen * top[..., None]).sum(axis=-2)  # one nonzero term per entry: exact


class SparseMoe(eqx.Module):
    """Top-k routed SwiGLU experts, plus an optional sigmoid-gated shared expert.

    `experts` is a llama `MLP` whose arrays are stacked on a leading experts axis.
    """

    router: Float[Array, "experts embd"]
    experts: MLP
    shared: MLP | None
    shared_gate: Float[Array, " embd"] | None
    top_k: int = eqx.field(static=True)
    renormalise: bool = eqx.field(static=True)
    weights_in_input_dtype: bool = eqx.field(static=True)

    def __init__(self, config: MoeConfig, dtype: Any, *, key: PRNGKeyArray):
        krouter, kexperts, kshared, kgate = jax.random.split(key, 4)
        e = config.hidden_size
        self.router = _normal(krouter, (config.num_experts, e), dtype)
        expert = dataclasses.replace(config, intermediate_size=config.moe_intermediate_size, mlp_bias=False)
        self.experts = eqx.filter_vmap(lambda k: MLP(expert, dtype, key=k))(
            jax.random.split(kexperts, config.num_experts)
        )
        if config.shared_intermediate_size is None:
            self.shared, self.shared_gate = None, None
        else:
            shared = dataclasses.replace(config, intermediate_size=config.shared_intermediate_size, mlp_bias=False)
            self.shared = MLP(shared, dtype, key=kshared)
            self.shared_gate = _normal(kgate, (e,), dtype)
        self.top_k = config.num_experts_per_tok
        self.renormalise = config.norm_topk_prob
        self.weights_in_input_dtype = config.weights_in_input_dtype

    def __call__(self, x: Float[Array, "seq embd"]) -> Float[Array, "seq embd"]:
        weights = routing_weights(jnp.einsum("te,xe->tx", x, self.router), self.top_k, self.renormalise)
        if self.weights_in_input_dtype:
            weights = weights.astype(x.dtype)
        each = eqx.filter_vmap(lambda mlp: mlp(x))(self.experts)  # [experts, seq, embd]
        # Weighted in the weights' dtype, then cast, as transformers does per expert.
        y = (each * weights.T[:, :, None]).astype(x.dtype).sum(axis=0)
        if self.shared is not None:
            gate = jax.nn.sigmoid(jnp.einsum("te,e->t", x, self.shared_gate))
            y = y + gate[:, None] * self.shared(x)
        return y


class MoeBlock(Block):
    """A llama `Block` whose MLP is a `SparseMoe`."""

    mlp: SparseMoe

    def __init__(self, config: MoeConfig, dtype: Any, *, key: PRNGKeyArray):
        kattn, kmlp = jax.random.split(key)
        self.attn_norm = jnp.ones((config.hidden_size,), dtype)
        self.attn = Attention(config, dtype, key=kattn)
        self.mlp_norm = jnp.ones((config.hidden_size,), dtype)
        self.mlp = SparseMoe(config, dtype, key=kmlp)


class Moe(Llama):
    """Mixtral / Qwen2-MoE causal LM: port's `Llama` with `MoeBlock`s, stacked over layers."""

    blocks: MoeBlock
    config: MoeConfig = eqx.field(static=True)

    def __init__(self, config: MoeConfig, *, key: PRNGKeyArray, dtype: Any = jnp.float32):
        kembed, kblocks, khead = jax.random.split(key, 3)
        self.embed = _normal(kembed, (config.vocab_size, config.hidden_size), dtype)
        make_block = lambda k: MoeBlock(config, dtype, key=k)
        self.blocks = eqx.filter_vmap(make_block)(jax.random.split(kblocks, config.num_hidden_layers))
        self.norm = jnp.ones((config.hidden_size,), dtype)
        self.lm_head = (
            None
            if config.tie_word_embeddings
            else _normal(khead, (config.vocab_size, config.hidden_size), dtype)
        )
        self.config = config

    @classmethod
    def from_config(cls, config: dict, *, key: PRNGKeyArray, dtype: Any = jnp.float32) -> Moe:
        """Randomly initialise from a Hugging Face `config.json` dict (model_type mixtral or qwen2_moe)."""
        return cls(MoeConfig.from_hf(config), key=key, dtype=dtype)
