"""Llama, Mistral and Qwen2: port's model, converted by the shipped `mappings/llama.toml`, against `transformers`.

Parity goes through the converter: each `*ForCausalLM` written by `save_pretrained`,
loaded by `port`, gives the same logits; and the cases are sensitive to what they
test (RoPE scaling, the sliding window, the epsilon). The tests that build a
`transformers` model skip without PyTorch.
"""

import dataclasses
import re

import equinox as eqx
import jax
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import port
from port._errors import PortError
from port.models.llama import Llama, LlamaConfig

from helpers import LLAMA_CONFIG, VOCAB, logits, saved_once, torch_llama, torch_logits, transformers_or_skip

LLAMA3_ROPE = dict(
    rope_type="llama3",
    rope_theta=10000.0,
    factor=8.0,
    low_freq_factor=1.0,
    high_freq_factor=4.0,
    original_max_position_embeddings=16,  # < 16 tokens: scaling matters
)
# name: (architecture, config overrides)
CASES = {
    "llama-gqa": ("Llama", {}),
    "llama-tied-llama3rope": ("Llama", dict(tie_word_embeddings=True, rope_parameters=LLAMA3_ROPE)),
    "llama-linear-rope": ("Llama", dict(rope_parameters=dict(rope_type="linear", rope_theta=500.0, factor=4.0))),
    "mistral-sliding": ("Mistral", dict(sliding_window=4)),
    "qwen2-bias": ("Qwen2", {}),
    "qwen2-yarn": (
        "Qwen2",
        dict(
            rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=8)
        ),
    ),
    "qwen2-sliding-layer1": ("Qwen2", dict(use_sliding_window=True, sliding_window=4, max_window_layers=1)),
    "llama-attn-mlp-bias": ("Llama", dict(attention_bias=True, mlp_bias=True, rms_norm_eps=1e-2)),
}


def ids(name):
    """16 tokens, 12 for the sliding-window cases (a window of 4 in either length)."""
    return np.random.default_rng(0).integers(0, VOCAB, (2, 12 if "sliding" in name else 16))


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """get(name): the case saved by save_pretrained, its torch model and PyTorch logits (one build per case)."""
    return saved_once(tmp_path_factory, lambda name: torch_llama(CASES[name][0], **CASES[name][1]), ids)


# ---------------------------------------------------------------- parity


@pytest.mark.parametrize("name, mesh_spec", [(name, "4x2") for name in CASES] + [("llama-gqa", "1x1")])
def test_logits_match_transformers(checkpoints, name, mesh_spec):
    """Every case sharded on 4x2 (what a case changes is numerics, not layout); one on one device."""
    directory, _, expected = checkpoints(name)
    model = port.load(directory, mesh=port.make_mesh(mesh_spec))
    ours = logits(model, ids(name))
    assert ours.shape == (*ids(name).shape, VOCAB) and ours.dtype == np.float32
    np.testing.assert_allclose(np.asarray(ours), expected, atol=1e-4, rtol=0)
    assert model.blocks.attn.wq.sharding.spec == P(None, "model", None, "data")
    assert model.blocks.mlp.gate.sharding.spec == P(None, "model", "data")
    tied = CASES[name][1].get("tie_word_embeddings", False)
    assert (model.lm_head is None) == tied
    biased = name.startswith("qwen2") or "bias" in name
    assert (model.blocks.attn.bq is None) != biased


def with_config(model: Llama, **changes) -> Llama:
    """The same weights under a changed (static) config."""
    if "rope_type" in changes:
        changes["rope"] = dataclasses.replace(model.config.rope, kind=changes.pop("rope_type"))
    config = dataclasses.replace(model.config, **changes)
    skeleton = eqx.filter_eval_shape(Llama, config, key=jax.random.key(0))
    return jax.tree.unflatten(jax.tree.structure(skeleton), jax.tree.leaves(model))


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
    ids=["no-llama3-scaling", "no-window", "window-3", "window-5", "no-qwen2-window", "wrong-eps"],
)
def test_ignoring_a_feature_breaks_parity(checkpoints, name, change):
    """The parity cases above are sensitive to RoPE scaling, the window and the eps."""
    directory, _, expected = checkpoints(name)
    model = with_config(port.load(directory), **change)
    assert np.abs(np.asarray(logits(model, ids(name))) - expected).max() > 1e-2


@pytest.mark.parametrize("lost", ["lm_head.weight", "model.layers.1.self_attn.k_proj.bias"])
def test_a_leaf_the_config_asks_for_is_required(tmp_path, lost):
    """An untied head, or a bias the config has, is `optional = "model"`: when the module holds the
    leaf the checkpoint must have the key; it never becomes None (a head silently tied, a bias dropped)."""
    from safetensors.numpy import load_file, save_file

    torch_llama("Qwen2").save_pretrained(tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    del tensors[lost]
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    pattern = lost.removeprefix("model.").replace(".1.", ".{layer}.")
    with pytest.raises(PortError, match=f"entry '{re.escape(pattern)}': missing tensor"):
        port.load(tmp_path)


def test_fewer_kv_heads_than_the_model_axis_are_replicated(tmp_path):
    model = torch_llama(num_key_value_heads=1)
    model.save_pretrained(tmp_path)
    with port.open_checkpoint(tmp_path) as ckpt:
        mapping = port.mapping_for(ckpt.config)
        recipe = port.plan(
            port.skeleton(mapping, ckpt.config), mapping, ckpt.tensors, ckpt.config, {"data": 4, "model": 2}
        )
    wk = next(leaf for leaf in recipe.leaves if leaf.path == "blocks.attn.wk")
    assert wk.spec == P(None, None, None, "data")
    assert wk.notes == ("kv_heads 1 not divisible by model=2: replicated on model",)
    ours = port.load(tmp_path, mesh=port.make_mesh("4x2"))
    assert np.abs(np.asarray(logits(ours, ids("gqa"))) - torch_logits(model, ids("gqa"))).max() < 1e-4


def test_bfloat16_stays_bfloat16(tmp_path):
    model = torch_llama(dtype="bfloat16")
    model.save_pretrained(tmp_path)
    with port.open_checkpoint(tmp_path) as ckpt:
        mapping = port.mapping_for(ckpt.config)
        recipe = port.plan(
            port.skeleton(mapping, ckpt.config), mapping, ckpt.tensors, ckpt.config, {"data": 4, "model": 2}
        )
    bf16 = np.dtype(ml_dtypes.bfloat16)
    assert all(leaf.source_dtype == leaf.dtype == bf16 and "cast" not in str(leaf.chain) for leaf in recipe.leaves)
    ours = port.load(tmp_path, mesh=port.make_mesh("4x2"))
    assert all(x.dtype == bf16 for x in port._skeleton.leaves(eqx.filter(ours, eqx.is_array)).values())
    out = logits(ours, ids("gqa"))
    assert out.dtype == bf16
    # bfloat16 keeps 8 bits of mantissa; allow 5% of the logits' range.
    expected = torch_logits(model, ids("gqa"))
    assert np.abs(np.asarray(out).astype(np.float32) - expected).max() < 0.05 * np.abs(expected).max()


# ---------------------------------------------------------------- the module and its config


def test_abstract_model_shapes():
    config = {**LLAMA_CONFIG, "model_type": "qwen2", "head_dim": 8}
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
        Llama.from_config, {**LLAMA_CONFIG, "tie_word_embeddings": True}, key=jax.random.key(0)
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
    transformers = transformers_or_skip()
    hf_config = transformers.LlamaConfig(**{**LLAMA_CONFIG, "head_dim": 128, "rope_parameters": rope})
    hf_inv_freq = transformers.models.llama.modeling_llama.LlamaRotaryEmbedding(hf_config).inv_freq.numpy()
    v5 = LlamaConfig.from_hf({**LLAMA_CONFIG, "head_dim": 128, "rope_parameters": rope})
    # transformers 4 wrote a top-level rope_theta and rope_scaling (often with legacy "type").
    scaling = {k: v for k, v in rope.items() if k not in ("rope_type", "rope_theta")}
    scaling = {**scaling, "type": rope["rope_type"]} if rope["rope_type"] != "default" else None
    v4 = LlamaConfig.from_hf(
        {**LLAMA_CONFIG, "head_dim": 128, "rope_theta": rope["rope_theta"], "rope_scaling": scaling}
    )
    assert v4 == v5
    np.testing.assert_allclose(v5.rope.inv_freq(), hf_inv_freq, rtol=1e-6)


@pytest.mark.parametrize(
    "change, match",
    [
        (dict(hidden_act="gelu"), "hidden_act"),
        (dict(rope_parameters=dict(rope_type="dynamic", factor=2.0)), "dynamic"),
        (dict(rope_scaling=dict(type="dynamic", factor=2.0)), "dynamic"),
        (dict(num_key_value_heads=3), "num_key_value_heads"),
        (dict(rope_parameters=dict(rope_type="llama3", factor=8.0)), "low_freq_factor"),
        (dict(model_type="gpt2"), "model_type"),
    ],
)
def test_config_rejects_unsupported(change, match):
    with pytest.raises(PortError, match=match):
        LlamaConfig.from_hf({**LLAMA_CONFIG, **change})


def test_config_defaults_follow_transformers():
    base = {k: v for k, v in LLAMA_CONFIG.items() if k != "num_key_value_heads"}
    assert LlamaConfig.from_hf(base).num_key_value_heads == 4
    assert LlamaConfig.from_hf({**base, "head_dim": None}).head_dim == 16
    mistral = LlamaConfig.from_hf({**LLAMA_CONFIG, "model_type": "mistral"})
    assert mistral.sliding_window == 4096 and not mistral.qkv_bias  # MistralConfig default
    qwen2 = LlamaConfig.from_hf({**LLAMA_CONFIG, "model_type": "qwen2", "sliding_window": 4})
    assert qwen2.sliding_window is None  # only with use_sliding_window
    assert qwen2.qkv_bias and not qwen2.o_bias
