"""Mixtral and Qwen2-MoE: port's Llama with a routed mixture of experts in every block.

Only what is new in these families lives here: reading their config.json into a
`MoeConfig` (a `LlamaConfig`, attention, norms and RoPE, plus the experts) whose `mlp`
builds each block's feed-forward as a `port.nn.MoE`. Its router picks the top
`num_experts_per_tok` experts of each token and only those run, as grouped matmuls over
the (token, expert) pairs sorted by expert: the cost follows top-k, not the expert
count. The experts are stacked on an axis after the layers' (`blocks.mlp.experts.gate`
is [layers, experts, intermediate, embed]). Two `model_type`s:

- "mixtral": softmax routing, the top-k weights renormalised to sum to 1 and kept
  float32 when weighting the experts' outputs (as transformers); no attention biases; an
  optional sliding window on every layer.
- "qwen2_moe": renormalised only when `norm_topk_prob`, the weights cast to the
  activations' dtype; q/k/v biases (`qkv_bias`); a shared expert (a SwiGLU MLP of
  `shared_expert_intermediate_size`) added to every token, scaled by
  `sigmoid(shared_expert_gate . x)`. Dense layers (`mlp_only_layers`,
  `decoder_sparse_step` > 1) would make the layers heterogeneous: refused.

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

import jax.numpy as jnp
from jaxtyping import PRNGKeyArray

from port._console import quoted
from port._errors import ConfigError
from port.models._config import MAX_LAYERS, check_model_type, get
from port.models.llama import Llama, LlamaConfig
from port.nn import MoE

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
        model_type = check_model_type(config, MODEL_TYPES, "port.models.moe")
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

    def mlp(self, dtype: Any, key: PRNGKeyArray) -> MoE:
        """The feed-forward of one block: a `port.nn.MoE` routed as transformers routes it.

        **Arguments:** `dtype` (of the parameters), `key` (their initialisation).

        ```python
        moe = MoeConfig.from_hf(config).mlp(jnp.float32, jax.random.key(0))
        y = moe(x)   # x: [..., hidden_size]
        ```
        """
        return MoE(
            embd=self.hidden_size, inner=self.moe_intermediate_size, experts=self.num_experts,
            top_k=self.num_experts_per_tok, activation=self.hidden_act, dtype=dtype, key=key,
            scoring="softmax", renormalise=self.norm_topk_prob,
            shared_inner=self.shared_intermediate_size, shared_gate=self.shared_intermediate_size is not None,
            weights_in_input_dtype=self.weights_in_input_dtype,
        )


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


class Moe(Llama):
    """Mixtral / Qwen2-MoE causal LM: port's `Llama` whose blocks' `mlp` is a `port.nn.MoE`.

    Everything but the config is Llama's (call it as a `Llama`: masks, positions,
    segments, the cache, `dtype`, `remat`); `config` is a `MoeConfig`.

    ```python
    model = Moe.from_config(config, key=jax.random.key(0))
    logits = model(ids)                      # (batch, seq, vocab)
    ```
    """

    @classmethod
    def from_config(cls, config: dict, *, key: PRNGKeyArray, dtype: Any = jnp.float32) -> Moe:
        """Randomly initialise from a Hugging Face `config.json` dict (model_type mixtral or qwen2_moe).

        **Arguments:** `config` (the config.json dict), `key`, `dtype` (of the parameters).
        """
        return cls(MoeConfig.from_hf(config), key=key, dtype=dtype)
