"""Qwen3-Next: port's `Qwen3Next` (hybrid Gated DeltaNet / gated full attention, MoE with a
gated shared expert), converted by the shipped mapping, against `transformers`.

A tiny random `Qwen3NextForCausalLM` (4 layers, three linear to one full; 2 key heads
serving 4 value heads; norms, A_log and dt_bias perturbed) written by `save_pretrained`
and loaded by `port.load` gives transformers' logits (torch's fallback delta rule and
conv) on one device, on 4x2 and with the experts on an `expert` axis, in float32 and
bfloat16; the chunked and recurrent delta rules agree; `port.export` gives back the
checkpoint bit for bit; `port plan` of Qwen3-Next-80B-A3B's real shape reads no tensor byte.

Gradients, padding, packing, remat, bfloat16 compute, the 4x2 train step and greedy generation
are tests/test_decoders.py's contract, which runs it on this family as on every decoder.
"""

import dataclasses
import json
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import port
from port._errors import ConfigError
from port.models.qwen3_next import Qwen3NextConfig
from port.nn._deltanet import chunk_gated_delta_rule, recurrent_gated_delta_rule

from helpers import (
    VOCAB,
    logits,
    perturbed,
    run_port,
    run_port_measured,
    torch_logits,
    transformers_or_skip,
    write_sparse_checkpoint,
)

CONFIG = dict(
    vocab_size=VOCAB,
    hidden_size=48,
    intermediate_size=56,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=8,
    linear_value_head_dim=12,
    num_experts=6,
    num_experts_per_tok=2,
    moe_intermediate_size=24,
    shared_expert_intermediate_size=40,
    initializer_range=0.2,
    max_position_embeddings=64,
)
IDS = np.random.default_rng(0).integers(0, VOCAB, (2, 16))
MAPPINGS = Path(__file__).resolve().parents[1] / "mappings"
# This random model amplifies float32 rounding (its Gated DeltaNet layers, perturbed decays):
# transformers' own float32 logits are 8.1e-3 from its float64 ones (values up to ~6), port's
# float32 logits 7.2e-4 (1x1). So the reference is transformers' model run in float64, and
# port's float32 logits must be within 2e-3 of it, on every mesh.
ATOL = 2e-3


def torch_qwen3_next(dtype=None):
    transformers = transformers_or_skip()
    import torch

    torch.manual_seed(0)
    config = transformers.Qwen3NextConfig(**CONFIG)
    config._attn_implementation = "eager"
    config._experts_implementation = "eager"  # runs in float64 too (torch's grouped_mm does not)
    model = transformers.Qwen3NextForCausalLM(config)
    model = perturbed(model, lambda n: "norm" in n or n.endswith(("A_log", "dt_bias")), 0.2)
    return model if dtype is None else model.to(getattr(torch, dtype))


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """The float32 model saved by save_pretrained, and transformers' logits (in float64)."""
    model = torch_qwen3_next()
    directory = tmp_path_factory.mktemp("qwen3_next")
    model.save_pretrained(directory)
    return directory, torch_logits(model.double(), IDS)


@pytest.fixture(scope="module")
def loaded(checkpoint):
    return port.load(checkpoint[0])


def test_layers_are_grouped_by_kind(loaded):
    assert loaded.layer_groups == {"linear": (0, 1, 2), "full": (3,)}
    assert loaded.linear.attn.wv.shape == (3, 4, 12, 48) and loaded.full.attn.wg.shape == (1, 4, 16, 48)


@pytest.mark.parametrize("mesh_spec", ["1x1", "4x2"])
def test_logits_match_transformers(checkpoint, loaded, mesh_spec):
    directory, expected = checkpoint
    model = loaded if mesh_spec == "1x1" else port.load(directory, mesh=port.make_mesh(mesh_spec))
    ours = np.asarray(logits(model, IDS))
    assert ours.shape == (2, 16, VOCAB)
    np.testing.assert_allclose(ours, expected, atol=ATOL, rtol=0)
    if mesh_spec == "4x2":
        assert model.linear.attn.wq.sharding.spec == P(None, "model", None, "data")
        assert model.linear.mlp.experts.gate.sharding.spec == P(None, "model", None, "data")
        assert model.full.attn.wg.sharding.spec == P(None, "model", None, "data")


def test_logits_match_transformers_with_experts_on_an_expert_axis(checkpoint):
    from jax.sharding import NamedSharding

    directory, expected = checkpoint
    shipped = port.load_mapping(MAPPINGS / "qwen3_next.toml")
    mapping = dataclasses.replace(shipped, rules={**shipped.rules, "experts": ("expert",)})
    mesh = port.make_mesh("data=2,expert=2,model=2")
    model = port.load(directory, mesh=mesh, mapping=mapping)
    for mlp in (model.linear.mlp, model.full.mlp):
        assert mlp.experts.gate.sharding.spec == P(None, "expert", "model", "data")
    rows = jax.device_put(IDS, NamedSharding(mesh, P("data", None)))
    np.testing.assert_allclose(np.asarray(logits(model, rows)), expected, atol=ATOL, rtol=0)


def test_bfloat16_logits(tmp_path, checkpoint):
    """A bfloat16 checkpoint stays bfloat16; ours is no farther from transformers' bfloat16
    logits than twice transformers' own bfloat16-vs-float32 distance."""
    _, exact = checkpoint
    model = torch_qwen3_next("bfloat16")
    model.save_pretrained(tmp_path)
    theirs = torch_logits(model, IDS)
    ours = logits(port.load(tmp_path), IDS)
    assert ours.dtype == jnp.bfloat16
    ours = np.asarray(ours.astype(jnp.float32))
    budget = 2 * np.abs(theirs - exact).max()
    assert np.abs(ours - theirs).max() <= budget, (np.abs(ours - theirs).max(), budget)


def test_chunked_and_recurrent_rules_agree():
    """Several chunks (a ragged last one), grouped heads, a carried initial state."""
    keys = jax.random.split(jax.random.key(0), 6)
    q, k = jax.random.normal(keys[0], (2, 11, 2, 8)), jax.random.normal(keys[1], (2, 11, 2, 8))
    v = jax.random.normal(keys[2], (2, 11, 4, 6))
    g = -3 * jax.random.uniform(keys[3], (2, 11, 4))
    beta = jax.random.uniform(keys[4], (2, 11, 4))
    state = jax.random.normal(keys[5], (2, 4, 8, 6))
    chunked = jax.jit(lambda *a: chunk_gated_delta_rule(*a, chunk_size=4, initial_state=state))
    out, final = chunked(q, k, v, g, beta)
    ref, ref_final = jax.jit(lambda *a: recurrent_gated_delta_rule(*a, initial_state=state))(q, k, v, g, beta)
    np.testing.assert_allclose(out, ref, atol=1e-5)
    np.testing.assert_allclose(final, ref_final, atol=1e-5)
    assert np.abs(np.asarray(ref)).max() > 0.1


def test_segment_ids_are_refused(loaded):
    with pytest.raises(ValueError, match="segment_ids"):
        loaded(IDS, segment_ids=np.zeros_like(IDS))


def test_export_round_trip(checkpoint, tmp_path):
    """Loaded on 4x2, exported, read by from_pretrained: no missing or unexpected key, every
    tensor bit-identical to the source."""
    from safetensors.numpy import load_file

    transformers = transformers_or_skip()
    import torch

    directory, _ = checkpoint
    out = port.export(port.load(directory, mesh="4x2"), tmp_path / "hf", directory).out
    source, written = load_file(directory / "model.safetensors"), load_file(out / "model.safetensors")
    assert written.keys() == source.keys()
    for key, value in source.items():
        assert written[key].dtype == value.dtype and written[key].tobytes() == value.tobytes(), key
    original = transformers.AutoModelForCausalLM.from_pretrained(directory)
    exported, info = transformers.AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    for what in ("missing_keys", "unexpected_keys", "mismatched_keys", "error_msgs"):
        assert not info[what], f"{what}: {info[what]}"
    theirs = original.state_dict()
    for key, value in exported.state_dict().items():
        assert torch.equal(value, theirs[key]), key


# ---------------------------------------------------------------- config errors


@pytest.mark.parametrize(
    "change, words",
    [
        (dict(layer_types=["linear_attention"] * 3), "'layer_types' must list 4"),
        (dict(layer_types=["linear_attention"] * 3 + ["sliding_attention"]), "'layer_types'"),
        (dict(num_experts_per_tok=8), "'num_experts_per_tok' (8) is more than 'num_experts' (6)"),
        (dict(mlp_only_layers=[1]), "'mlp_only_layers'"),
        (dict(linear_num_value_heads=3), "'linear_num_value_heads' (3) must be a multiple"),
    ],
)
def test_config_errors_are_one_line(change, words):
    with pytest.raises(ConfigError) as e:
        Qwen3NextConfig.from_hf({"model_type": "qwen3_next", **CONFIG, **change})
    assert words in str(e.value) and "\n" not in str(e.value)


def test_expert_count_must_match_the_tensors(checkpoint, tmp_path):
    import shutil

    directory, _ = checkpoint
    shutil.copytree(directory, tmp_path / "c")
    config = json.loads((tmp_path / "c" / "config.json").read_text())
    (tmp_path / "c" / "config.json").write_text(json.dumps({**config, "num_experts": 4}))
    with pytest.raises(port.PortError) as e:
        port.load(tmp_path / "c")
    assert "mlp.gate.weight': shape mismatch" in str(e.value) and "\n" not in str(e.value)


# ---------------------------------------------------------------- Qwen3-Next-80B-A3B, planned only

# Qwen/Qwen3-Next-80B-A3B-Instruct's config.json (the keys port reads).
QWEN3_NEXT_80B = {
    "architectures": ["Qwen3NextForCausalLM"],
    "model_type": "qwen3_next",
    "vocab_size": 151936,
    "hidden_size": 2048,
    "intermediate_size": 5120,
    "num_hidden_layers": 48,
    "num_attention_heads": 16,
    "num_key_value_heads": 2,
    "head_dim": 256,
    "hidden_act": "silu",
    "max_position_embeddings": 262144,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000000,
    "partial_rotary_factor": 0.25,
    "full_attention_interval": 4,
    "linear_conv_kernel_dim": 4,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "linear_num_key_heads": 16,
    "linear_num_value_heads": 32,
    "num_experts": 512,
    "num_experts_per_tok": 10,
    "moe_intermediate_size": 512,
    "shared_expert_intermediate_size": 512,
    "norm_topk_prob": True,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
}


def qwen3_next_shapes(c):
    h, v = c["hidden_size"], c["vocab_size"]
    hd, heads, kv = c["head_dim"], c["num_attention_heads"], c["num_key_value_heads"]
    nk, nv = c["linear_num_key_heads"], c["linear_num_value_heads"]
    dk, dv = c["linear_key_head_dim"], c["linear_value_head_dim"]
    inter, shared, experts = c["moe_intermediate_size"], c["shared_expert_intermediate_size"], c["num_experts"]
    shapes = {"model.embed_tokens.weight": [v, h], "model.norm.weight": [h], "lm_head.weight": [v, h]}
    for i in range(c["num_hidden_layers"]):
        layer = f"model.layers.{i}."
        shapes.update({layer + "input_layernorm.weight": [h], layer + "post_attention_layernorm.weight": [h]})
        if (i + 1) % c["full_attention_interval"]:
            a = layer + "linear_attn."
            shapes.update(
                {
                    a + "in_proj_qkvz.weight": [2 * nk * dk + 2 * nv * dv, h],
                    a + "in_proj_ba.weight": [2 * nv, h],
                    a + "conv1d.weight": [2 * nk * dk + nv * dv, 1, c["linear_conv_kernel_dim"]],
                    a + "dt_bias": [nv],
                    a + "A_log": [nv],
                    a + "norm.weight": [dv],
                    a + "out_proj.weight": [h, nv * dv],
                }
            )
        else:
            a = layer + "self_attn."
            shapes.update(
                {
                    a + "q_proj.weight": [2 * heads * hd, h],
                    a + "k_proj.weight": [kv * hd, h],
                    a + "v_proj.weight": [kv * hd, h],
                    a + "o_proj.weight": [h, heads * hd],
                    a + "q_norm.weight": [hd],
                    a + "k_norm.weight": [hd],
                }
            )
        m = layer + "mlp."
        shapes.update(
            {
                m + "gate.weight": [experts, h],
                m + "shared_expert_gate.weight": [1, h],
                m + "shared_expert.gate_proj.weight": [shared, h],
                m + "shared_expert.up_proj.weight": [shared, h],
                m + "shared_expert.down_proj.weight": [h, shared],
            }
        )
        for e in range(experts):
            shapes.update(
                {
                    f"{m}experts.{e}.gate_proj.weight": [inter, h],
                    f"{m}experts.{e}.up_proj.weight": [inter, h],
                    f"{m}experts.{e}.down_proj.weight": [h, inter],
                }
            )
    return shapes


@pytest.mark.slow
def test_plan_qwen3_next_80b_reads_no_tensor(tmp_path):
    """`port plan` on Qwen3-Next-80B-A3B's real sizes (~160 GB sparse file, 73k expert tensors):
    exit 0, the expert and DeltaNet leaves sharded, well under 1 GB read and well under 1 GB of
    peak RSS in either process (the worker's, JAX included, about 250 MB)."""
    shapes = qwen3_next_shapes(QWEN3_NEXT_80B)
    size = write_sparse_checkpoint(tmp_path / "q", QWEN3_NEXT_80B, shapes)
    assert size > 150e9
    start = time.perf_counter()
    result, rchar, peak = run_port_measured(tmp_path, "plan", tmp_path / "q", "--mesh", "4x2")
    took = time.perf_counter() - start
    assert result.returncode == 0, result.stdout + result.stderr
    assert "linear.mlp.experts.gate" in result.stdout and "linear.attn.wq" in result.stdout
    assert rchar < 1e9 and peak < 1e9, (rchar, peak)
    print(f"port plan of Qwen3-Next-80B-A3B: {took:.1f} s, peak RSS {peak / 2**20:.0f} MiB")


# ---------------------------------------------------------------- Qwen3.5's language model

QWEN3_5_TEXT = {k: v for k, v in CONFIG.items() if not k.startswith(("num_experts", "moe_", "shared_"))}


@pytest.mark.parametrize(
    "arch, extra",
    [
        ("Qwen3_5", {}),
        (
            "Qwen3_5Moe",
            dict(num_experts=6, num_experts_per_tok=2, moe_intermediate_size=24, shared_expert_intermediate_size=40),
        ),
    ],
)
def test_qwen3_5_language_model_matches_transformers(tmp_path, arch, extra):
    """The released layout: a `{arch}ForConditionalGeneration` (a tiny vision tower, ignored),
    `text_config` nesting, keys under `model.language_model.`, separate DeltaNet projections;
    text-only logits on 4x2 equal transformers'."""
    transformers = transformers_or_skip()
    import torch

    torch.manual_seed(0)
    vision = dict(depth=1, hidden_size=16, intermediate_size=16, num_heads=2, out_hidden_size=48)
    config = getattr(transformers, f"{arch}Config")(text_config={**QWEN3_5_TEXT, **extra}, vision_config=vision)
    config._attn_implementation = config.text_config._attn_implementation = "eager"
    model = getattr(transformers, f"{arch}ForConditionalGeneration")(config)
    model = perturbed(model, lambda n: "norm" in n or n.endswith(("A_log", "dt_bias")), 0.2)
    model.save_pretrained(tmp_path)
    with torch.no_grad():
        expected = model(input_ids=torch.tensor(IDS)).logits.float().numpy()
    ours = port.load(tmp_path, mesh="4x2")
    assert ours.layer_groups == {"linear": (0, 1, 2), "full": (3,)}
    np.testing.assert_allclose(np.asarray(logits(ours, IDS)), expected, atol=ATOL, rtol=0)


TEXT_ONLY = {
    "qwen3_5_text": ("Qwen3_5", {}),
    "qwen3_5_moe_text": (
        "Qwen3_5Moe",
        dict(num_experts=6, num_experts_per_tok=2, moe_intermediate_size=24, shared_expert_intermediate_size=40),
    ),
}


@pytest.fixture(scope="module")
def text_only(tmp_path_factory):
    """get(model_type): a `{arch}ForCausalLM` (the text-only class: config.json without
    `text_config`, keys under `model.`) written by save_pretrained, the model, its float32 logits."""
    made = {}

    def get(model_type):
        if model_type not in made:
            transformers = transformers_or_skip()
            import torch

            arch, extra = TEXT_ONLY[model_type]
            torch.manual_seed(0)
            config = getattr(transformers, f"{arch}TextConfig")(**QWEN3_5_TEXT, **extra)
            config._attn_implementation = "eager"
            model = getattr(transformers, f"{arch}ForCausalLM")(config)
            model = perturbed(model, lambda n: "norm" in n or n.endswith(("A_log", "dt_bias")), 0.2)
            directory = tmp_path_factory.mktemp(model_type)
            model.save_pretrained(directory)
            assert json.loads((directory / "config.json").read_text())["model_type"] == model_type
            made[model_type] = directory, model, torch_logits(model, IDS)
        return made[model_type]

    return get


@pytest.mark.parametrize("model_type, mesh", [(t, m) for t in TEXT_ONLY for m in ("1x1", "4x2")])
def test_text_only_qwen3_5_matches_transformers(text_only, model_type, mesh):
    """Qwen3.5's text-only checkpoints (`Qwen3_5ForCausalLM`, `Qwen3_5MoeForCausalLM`) load
    through the shipped Qwen3.5 mappings and give transformers' float32 logits."""
    directory, _, expected = text_only(model_type)
    ours = port.load(directory, mesh=mesh)
    assert ours.layer_groups == {"linear": (0, 1, 2), "full": (3,)}
    np.testing.assert_allclose(np.asarray(logits(ours, IDS)), expected, atol=ATOL, rtol=0)


@pytest.mark.parametrize("model_type", TEXT_ONLY)
def test_text_only_qwen3_5_bfloat16(tmp_path, text_only, model_type):
    """In bfloat16 (weights and compute) within twice transformers' own bfloat16 error."""
    import torch

    directory, model, reference = text_only(model_type)
    model = type(model).from_pretrained(directory, dtype=torch.bfloat16)
    model.config._attn_implementation = "eager"
    model.save_pretrained(tmp_path)
    expected = torch_logits(model, IDS)
    rounding = np.abs(expected - reference).max()
    ours = port.load(tmp_path, mesh="4x2")
    out = logits(ours, IDS)
    assert out.dtype == jnp.bfloat16
    out = np.asarray(out).astype(np.float32)
    assert np.abs(out - expected).max() <= 2 * rounding and np.abs(out - reference).max() <= 2 * rounding


@pytest.mark.parametrize("model_type", TEXT_ONLY)
def test_text_only_qwen3_5_export_round_trip(tmp_path, text_only, model_type):
    """port.load on 4x2 -> port.export -> from_pretrained: the source's tensors bit for bit."""
    import torch
    from safetensors.numpy import load_file

    directory, original, _ = text_only(model_type)
    out = port.export(port.load(directory, mesh="4x2"), tmp_path / "hf", directory).out
    source, exported = load_file(directory / "model.safetensors"), load_file(out / "model.safetensors")
    assert exported.keys() == source.keys()
    for key, value in source.items():
        assert exported[key].dtype == value.dtype and exported[key].tobytes() == value.tobytes(), key
    back, info = type(original).from_pretrained(out, output_loading_info=True)
    for what in ("missing_keys", "unexpected_keys", "mismatched_keys", "error_msgs"):
        assert not info[what], f"{what}: {info[what]}"
    assert all(torch.equal(back.state_dict()[k], v) for k, v in original.state_dict().items())


@pytest.mark.slow
def test_port_plan_takes_a_text_only_qwen3_5_checkpoint(text_only):
    """`port plan` of a Qwen3_5ForCausalLM checkpoint (model_type qwen3_5_text) finds the shipped
    Qwen3.5 mapping (it used to answer: no mapping for model_type)."""
    directory, _, _ = text_only("qwen3_5_text")
    result = run_port("plan", directory, "--mesh", "1x1")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "linear.attn.wq" in result.stdout and "full.attn.wq" in result.stdout
