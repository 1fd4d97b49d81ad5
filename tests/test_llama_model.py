"""Parity of the Equinox Llama/Mistral/Qwen2 against transformers' *ForCausalLM."""

import dataclasses

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from jax.sharding import NamedSharding, PartitionSpec

from port._errors import PortError
from port.models.llama import Llama, LlamaConfig

VOCAB = 101
SMALL = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
    # The default init (std 0.02) makes most mistakes invisible; 0.2 does not.
    initializer_range=0.2, bos_token_id=0, eos_token_id=0, pad_token_id=None,
)
LLAMA3_ROPE = dict(
    rope_type="llama3", rope_theta=10000.0, factor=8.0, low_freq_factor=1.0,
    high_freq_factor=4.0, original_max_position_embeddings=16,  # < SEQ: scaling matters
)
SEQ = 16


def _hf_model(cls, config_cls, dtype=torch.float32, **overrides):
    torch.manual_seed(0)
    config = config_cls(**{**SMALL, **overrides})
    config._attn_implementation = "eager"
    model = cls(config)
    with torch.no_grad():  # non-trivial norms and biases, so every mapping matters
        for name, param in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                param.add_(0.2 * torch.randn_like(param))
    return model.to(dtype).eval()


def _to_eqx(hf, dtype=jnp.float32) -> Llama:
    config = hf.config.to_dict()
    cfg = LlamaConfig.from_hf(config)
    sd = {k: v.detach().float().numpy() for k, v in hf.state_dict().items()}
    h, kv, d, e = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.hidden_size

    def stack(suffix, shape=None):
        arrays = [sd[f"model.layers.{i}.{suffix}"] for i in range(cfg.num_hidden_layers)]
        return np.stack([a if shape is None else a.reshape(shape) for a in arrays])

    leaves = {
        lambda m: m.embed: sd["model.embed_tokens.weight"],
        lambda m: m.norm: sd["model.norm.weight"],
        lambda m: m.blocks.attn_norm: stack("input_layernorm.weight"),
        lambda m: m.blocks.mlp_norm: stack("post_attention_layernorm.weight"),
        # torch Linear weights are (out, in): reshape only, no transposes.
        lambda m: m.blocks.attn.wq: stack("self_attn.q_proj.weight", (h, d, e)),
        lambda m: m.blocks.attn.wk: stack("self_attn.k_proj.weight", (kv, d, e)),
        lambda m: m.blocks.attn.wv: stack("self_attn.v_proj.weight", (kv, d, e)),
        lambda m: m.blocks.attn.wo: stack("self_attn.o_proj.weight", (e, h, d)),
        lambda m: m.blocks.mlp.gate: stack("mlp.gate_proj.weight"),
        lambda m: m.blocks.mlp.up: stack("mlp.up_proj.weight"),
        lambda m: m.blocks.mlp.down: stack("mlp.down_proj.weight"),
    }
    if not cfg.tie_word_embeddings:
        leaves[lambda m: m.lm_head] = sd["lm_head.weight"]
    biases = {
        "self_attn.q_proj.bias": (lambda m: m.blocks.attn.bq, (h, d)),
        "self_attn.k_proj.bias": (lambda m: m.blocks.attn.bk, (kv, d)),
        "self_attn.v_proj.bias": (lambda m: m.blocks.attn.bv, (kv, d)),
        "self_attn.o_proj.bias": (lambda m: m.blocks.attn.bo, None),
        "mlp.gate_proj.bias": (lambda m: m.blocks.mlp.bgate, None),
        "mlp.up_proj.bias": (lambda m: m.blocks.mlp.bup, None),
        "mlp.down_proj.bias": (lambda m: m.blocks.mlp.bdown, None),
    }
    model = Llama.from_config(config, key=jax.random.key(0), dtype=dtype)
    for suffix, (where, shape) in biases.items():
        present = f"model.layers.0.{suffix}" in sd
        assert (where(model) is not None) == present, suffix  # None when absent
        if present:
            leaves[where] = stack(suffix, shape)
    assert len(jax.tree.leaves(model)) == len(leaves)  # every leaf is loaded
    for where, value in leaves.items():
        assert where(model).shape == value.shape
        model = eqx.tree_at(where, model, jnp.asarray(value, dtype=dtype))
    return model


def _ids(seq=SEQ):
    return np.random.default_rng(0).integers(0, VOCAB, size=(2, seq))


def _logits(hf, model, ids):
    with torch.no_grad():
        expected = hf(torch.from_numpy(ids)).logits.float().numpy()
    actual = eqx.filter_jit(model)(jnp.asarray(ids, dtype=jnp.int32))
    return expected, actual


def _with_config(model: Llama, **changes) -> Llama:
    """The same weights under a changed (static) config."""
    config = dataclasses.replace(model.config, **changes)
    skeleton = eqx.filter_eval_shape(Llama, config, key=jax.random.key(0))
    return jax.tree.unflatten(jax.tree.structure(skeleton), jax.tree.leaves(model))


CASES = {
    "llama-gqa": (transformers.LlamaForCausalLM, transformers.LlamaConfig, {}),
    "llama-tied-llama3rope": (
        transformers.LlamaForCausalLM, transformers.LlamaConfig,
        dict(tie_word_embeddings=True, rope_parameters=LLAMA3_ROPE),
    ),
    "llama-linear-rope": (
        transformers.LlamaForCausalLM, transformers.LlamaConfig,
        dict(rope_parameters=dict(rope_type="linear", rope_theta=500.0, factor=4.0)),
    ),
    "mistral-sliding": (
        transformers.MistralForCausalLM, transformers.MistralConfig,
        dict(sliding_window=4),
    ),
    "qwen2-bias": (transformers.Qwen2ForCausalLM, transformers.Qwen2Config, {}),
    "qwen2-sliding-layer1": (
        transformers.Qwen2ForCausalLM, transformers.Qwen2Config,
        dict(use_sliding_window=True, sliding_window=4, max_window_layers=1),
    ),
    "llama-attn-mlp-bias": (
        transformers.LlamaForCausalLM, transformers.LlamaConfig,
        dict(attention_bias=True, mlp_bias=True, rms_norm_eps=1e-2),
    ),
}


@pytest.mark.parametrize("name", list(CASES))
def test_logits_match_transformers(name):
    cls, config_cls, overrides = CASES[name]
    hf = _hf_model(cls, config_cls, **overrides)
    model = _to_eqx(hf)
    ids = _ids(12 if "sliding" in name else SEQ)
    expected, actual = _logits(hf, model, ids)
    assert actual.shape == (*ids.shape, VOCAB) and actual.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(actual), expected, atol=1e-4, rtol=0)


@pytest.mark.parametrize(
    "name, change",
    [
        ("llama-tied-llama3rope", dict(rope_type="default")),
        ("mistral-sliding", dict(sliding_window=None)),
        ("mistral-sliding", dict(sliding_window=3)),  # off by one either way
        ("mistral-sliding", dict(sliding_window=5)),
        ("qwen2-sliding-layer1", dict(sliding_layers=(False, False))),
        ("llama-attn-mlp-bias", dict(rms_norm_eps=1e-6)),
    ],
    ids=["no-llama3-scaling", "no-window", "window-3", "window-5", "no-qwen2-window",
         "wrong-eps"],
)
def test_ignoring_a_feature_breaks_parity(name, change):
    """The parity cases above are sensitive to RoPE scaling, the window and the eps."""
    cls, config_cls, overrides = CASES[name]
    hf = _hf_model(cls, config_cls, **overrides)
    model = _with_config(_to_eqx(hf), **change)
    expected, actual = _logits(hf, model, _ids(12 if "sliding" in name else SEQ))
    assert np.abs(np.asarray(actual) - expected).max() > 1e-2


def test_bfloat16_logits_match_transformers():
    hf = _hf_model(transformers.LlamaForCausalLM, transformers.LlamaConfig, torch.bfloat16)
    model = _to_eqx(hf, dtype=jnp.bfloat16)
    assert model.blocks.attn.wq.dtype == jnp.bfloat16
    expected, actual = _logits(hf, model, _ids())
    assert actual.dtype == jnp.bfloat16
    # bfloat16 keeps 8 bits of mantissa; allow 5% of the logits' range.
    diff = np.abs(np.asarray(actual, dtype=np.float32) - expected).max()
    assert diff < 0.05 * np.abs(expected).max()


def test_sharded_params_give_the_same_logits():
    hf = _hf_model(transformers.LlamaForCausalLM, transformers.LlamaConfig)
    model = _to_eqx(hf)
    devices = np.array(jax.devices())
    mesh = jax.sharding.Mesh(devices, ("model",))

    def shard(x):  # the first axis that splits evenly, else replicated
        axis = next((i for i, n in enumerate(x.shape) if n % len(devices) == 0), None)
        spec = [None] * x.ndim
        if axis is not None:
            spec[axis] = "model"
        return jax.device_put(x, NamedSharding(mesh, PartitionSpec(*spec)))

    sharded = jax.tree.map(shard, model)
    ids = jnp.asarray(_ids(), dtype=jnp.int32)
    expected = eqx.filter_jit(model)(ids)
    np.testing.assert_allclose(eqx.filter_jit(sharded)(ids), expected, atol=1e-5, rtol=0)


def test_abstract_model_shapes():
    config = {**SMALL, "model_type": "qwen2", "head_dim": 8}
    model = eqx.filter_eval_shape(Llama.from_config, config, key=jax.random.key(0))
    attn, mlp = model.blocks.attn, model.blocks.mlp
    assert attn.wq.shape == (2, 4, 8, 64) and attn.wk.shape == (2, 2, 8, 64)
    assert attn.wo.shape == (2, 64, 4, 8)
    assert attn.bq.shape == (2, 4, 8) and attn.bv.shape == (2, 2, 8) and attn.bo is None
    assert mlp.gate.shape == (2, 128, 64) and mlp.down.shape == (2, 64, 128)
    assert mlp.bgate is None and mlp.bup is None and mlp.bdown is None
    assert model.blocks.attn_norm.shape == (2, 64) and model.norm.shape == (64,)
    assert model.lm_head.shape == (VOCAB, 64)
    tied = eqx.filter_eval_shape(
        Llama.from_config, {**SMALL, "tie_word_embeddings": True}, key=jax.random.key(0)
    )
    assert tied.lm_head is None


@pytest.mark.parametrize(
    "rope",
    [
        dict(rope_type="default", rope_theta=500000.0),
        dict(rope_type="linear", rope_theta=10000.0, factor=4.0),
        {**LLAMA3_ROPE, "original_max_position_embeddings": 8192, "rope_theta": 500000.0},
    ],
    ids=lambda rope: rope["rope_type"],
)
def test_inv_freq_matches_transformers_v4_and_v5_configs(rope):
    hf_config = transformers.LlamaConfig(**{**SMALL, "head_dim": 128, "rope_parameters": rope})
    hf_inv_freq = transformers.models.llama.modeling_llama.LlamaRotaryEmbedding(
        hf_config
    ).inv_freq.numpy()
    v5 = LlamaConfig.from_hf({**SMALL, "head_dim": 128, "rope_parameters": rope})
    # transformers 4 wrote a top-level rope_theta and rope_scaling (often with legacy "type").
    scaling = {k: v for k, v in rope.items() if k not in ("rope_type", "rope_theta")}
    scaling = {**scaling, "type": rope["rope_type"]} if rope["rope_type"] != "default" else None
    v4 = LlamaConfig.from_hf(
        {**SMALL, "head_dim": 128, "rope_theta": rope["rope_theta"], "rope_scaling": scaling}
    )
    assert v4 == v5
    np.testing.assert_allclose(v5.inv_freq(), hf_inv_freq, rtol=1e-6)


@pytest.mark.parametrize(
    "change, match",
    [
        (dict(hidden_act="gelu"), "hidden_act"),
        (dict(rope_parameters=dict(rope_type="yarn", factor=2.0)), "yarn"),
        (dict(rope_scaling=dict(type="dynamic", factor=2.0)), "dynamic"),
        (dict(num_key_value_heads=3), "num_key_value_heads"),
        (dict(rope_parameters=dict(rope_type="llama3", factor=8.0)), "low_freq_factor"),
        (dict(model_type="gpt2"), "model_type"),
    ],
)
def test_config_rejects_unsupported(change, match):
    with pytest.raises(PortError, match=match):
        LlamaConfig.from_hf({**SMALL, **change})


def test_config_defaults_follow_transformers():
    base = {k: v for k, v in SMALL.items() if k != "num_key_value_heads"}
    assert LlamaConfig.from_hf(base).num_key_value_heads == 4
    assert LlamaConfig.from_hf({**base, "head_dim": None}).head_dim == 16
    mistral = LlamaConfig.from_hf({**SMALL, "model_type": "mistral"})
    assert mistral.sliding_window == 4096 and not mistral.qkv_bias  # MistralConfig default
    qwen2 = LlamaConfig.from_hf({**SMALL, "model_type": "qwen2", "sliding_window": 4})
    assert qwen2.sliding_window is None  # only with use_sliding_window
    assert qwen2.qkv_bias and not qwen2.o_bias
