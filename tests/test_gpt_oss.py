"""gpt-oss: port's `GptOss`, converted by mappings/gpt_oss.toml, against `transformers`.

A seeded `GptOssForCausalLM` (eager attention and experts; norms, biases and sinks
perturbed so they matter) written by `save_pretrained`, with the experts fused as the
Hub's bfloat16 checkpoints hold them (`experts.gate_up_proj`, gate and up interleaved
column by column): its logits on 1x1, 4x2 and `data=2,expert=2,model=2` (experts on
`expert`), in float32 and bfloat16 (the tolerance `port verify` uses); sliding layers
(window 4) between full ones on 12 tokens; each device reading only its
experts and, for the experts' hidden dim, only the span of its interleaved columns;
`port export` back to the fused layout bit for bit; `port plan` of gpt-oss-120b's real
shape over a sparse file; one-line errors for configs that contradict the tensors.

Gradients, padding, packing, remat, bfloat16 compute, the 4x2 train step and greedy generation
are tests/test_decoders.py's contract, which runs it on this family as on every decoder.
"""

import dataclasses
import json
import re
import time
from collections import Counter
from pathlib import Path

import equinox as eqx
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import port
from port._errors import ConfigError
from port.models.gpt_oss import GptOss, GptOssConfig
from port.nn._mlp import clamped_swiglu

from helpers import (
    VOCAB,
    element_bytes,
    logits,
    one_line,
    perturbed,
    place_on,
    read_offsets,
    recorded_reads,
    run_port,
    run_port_measured,
    torch_logits,
    transformers_or_skip,
    write_sparse_checkpoint,
)

MAPPINGS = Path(__file__).resolve().parents[1] / "mappings"
# 3 layers (sliding, full, sliding), a window of 4 on 12 tokens; top 2 of 4 experts; YaRN
# (truncate false) with a short original context so its ramp matters; a low swiglu_limit
# so the clamps bite.
CONFIG = dict(
    vocab_size=VOCAB,
    hidden_size=48,
    intermediate_size=40,
    num_hidden_layers=3,
    num_attention_heads=6,
    num_key_value_heads=2,
    head_dim=8,
    num_local_experts=4,
    num_experts_per_tok=2,
    sliding_window=4,
    max_position_embeddings=64,
    initializer_range=0.2,
    swiglu_limit=1.5,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
    rope_parameters=dict(
        rope_type="yarn",
        rope_theta=150000.0,
        factor=4.0,
        beta_fast=32.0,
        beta_slow=1.0,
        truncate=False,
        original_max_position_embeddings=16,
    ),
)
IDS = np.random.default_rng(0).integers(3, VOCAB, (2, 12))


def torch_gpt_oss(dtype=None, **overrides):
    """The seeded `GptOssForCausalLM` (CONFIG with `overrides`), eager, norms/biases/sinks perturbed;
    skips without PyTorch."""
    transformers = transformers_or_skip()
    import torch

    torch.manual_seed(0)
    config = transformers.GptOssConfig(**{**CONFIG, **overrides})
    config._attn_implementation = "eager"
    config._experts_implementation = "eager"
    model = transformers.GptOssForCausalLM(config)
    model = perturbed(model, lambda n: "norm" in n or n.endswith(("bias", "sinks")), 0.2)
    return model if dtype is None else model.to(getattr(torch, dtype))


def placed_reading_exactly(directory, mesh, mapping=None):
    """Place the checkpoint on `mesh`, recording every positioned read; check that the bytes read
    are, as a multiset, those of the distinct source regions of every distinct block of every
    leaf (each region read once: gate's and up's blocks on one device share the region of their
    interleaved columns of `gate_up_proj`; nothing else read). Returns the plan."""
    with recorded_reads() as calls:
        recipe, total, infos = place_on(directory, mesh, mapping)
    files, _ = read_offsets(calls)
    regions = set()
    for leaf in recipe.leaves:
        for box in leaf.shards(mesh.shape):
            region, keys = leaf.source_region(box)
            regions.update((key, region) for key in keys)
    wanted = Counter()
    for key, region in regions:
        wanted.update(element_bytes(infos[key], region))
    assert Counter(files.tolist()) == wanted
    assert total == recipe.read_bytes == sum(wanted.values())
    return recipe, infos


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """(the PyTorch model, its save_pretrained directory, its logits on IDS, port's model on 4x2)."""
    model = torch_gpt_oss()
    directory = tmp_path_factory.mktemp("gpt_oss")
    model.save_pretrained(directory)
    return model, directory, torch_logits(model, IDS), port.load(directory, mesh="4x2")


@pytest.fixture(scope="module")
def single(checkpoint):
    """port's model of the checkpoint on one device."""
    return port.load(checkpoint[1])


def test_save_pretrained_writes_fused_interleaved_experts(checkpoint):
    from safetensors import safe_open

    _, directory, _, _ = checkpoint
    e, h, i = CONFIG["num_local_experts"], CONFIG["hidden_size"], CONFIG["intermediate_size"]
    with safe_open(directory / "model.safetensors", "np") as f:
        shapes = {k: f.get_slice(k).get_shape() for k in f.keys()}
    layer = "model.layers.1."
    assert shapes[layer + "mlp.experts.gate_up_proj"] == [e, h, 2 * i]
    assert shapes[layer + "mlp.experts.gate_up_proj_bias"] == [e, 2 * i]
    assert shapes[layer + "mlp.experts.down_proj"] == [e, i, h]
    assert shapes[layer + "mlp.experts.down_proj_bias"] == [e, h]
    assert shapes[layer + "mlp.router.weight"] == [e, h] and shapes[layer + "mlp.router.bias"] == [e]
    assert shapes[layer + "self_attn.sinks"] == [CONFIG["num_attention_heads"]]


# ---------------------------------------------------------------- parity


def test_logits_match_transformers_1x1(checkpoint, single):
    _, _, expected, _ = checkpoint
    model = single
    assert model.config.sliding_layers == (True, False, True) and model.config.rope.truncate is False
    ours = np.asarray(logits(model, IDS))
    assert ours.shape == (*IDS.shape, VOCAB) and ours.dtype == np.float32
    np.testing.assert_allclose(ours, expected, atol=1e-4 * max(1.0, np.abs(expected).max()), rtol=0)


def test_logits_match_transformers_4x2(checkpoint):
    _, _, expected, model = checkpoint
    ours = np.asarray(logits(model, IDS))
    np.testing.assert_allclose(ours, expected, atol=1e-4 * max(1.0, np.abs(expected).max()), rtol=0)
    blocks = model.blocks
    # 4 experts fill `model` (2 each), so the experts' hidden dim is not on it.
    for leaf in (blocks.mlp.experts.gate, blocks.mlp.experts.up):
        assert leaf.sharding.spec == P(None, "model", None, "data")
    assert blocks.mlp.experts.down.sharding.spec == P(None, "model", "data", None)
    assert blocks.mlp.experts.bgate.sharding.spec == P(None, "model", None)
    assert blocks.mlp.router_bias.sharding.spec == P(None, "model")
    assert blocks.attn.sinks.sharding.spec == P(None, "model")
    assert blocks.attn.bo.sharding.spec == P(None, "data")


def test_sinks_clamps_biases_and_window_matter(checkpoint, single):
    """Each of what is new moves the logits far above the tolerance: zero sinks, zero router
    or expert biases, no window (every layer full), no clamp (a limit far above the activations)."""
    _, _, expected, _ = checkpoint
    model = single
    for where in (
        lambda m: m.blocks.attn.sinks,
        lambda m: m.blocks.mlp.router_bias,
        lambda m: m.blocks.mlp.experts.bup,
    ):
        changed = eqx.tree_at(where, model, replace_fn=lambda x: 0 * x)
        assert np.abs(np.asarray(logits(changed, IDS)) - expected).max() > 1e-2
    full = dataclasses.replace(model.config, sliding_layers=(False,) * 3)
    unclamped = dataclasses.replace(model.config, swiglu_limit=1e6)
    for config in (full, unclamped):
        skeleton = eqx.filter_eval_shape(GptOss, config, key=jax.random.key(0))
        changed = jax.tree.unflatten(jax.tree.structure(skeleton), jax.tree.leaves(model))
        assert np.abs(np.asarray(logits(changed, IDS)) - expected).max() > 1e-2


def test_clamped_swiglu_is_transformers_apply_gate():
    """`clamped_swiglu` of the de-interleaved gate/up equals `GptOssExperts._apply_gate`, values
    beyond the limit on both sides included."""
    transformers = transformers_or_skip()
    import torch

    experts = transformers.models.gpt_oss.modeling_gpt_oss.GptOssExperts(
        transformers.GptOssConfig(hidden_size=8, intermediate_size=16, num_local_experts=2)
    )
    gate_up = torch.randn(5, 32, generator=torch.Generator().manual_seed(0)) * 10
    expected = experts._apply_gate(gate_up).numpy()
    x = jnp.asarray(gate_up.numpy())
    ours = clamped_swiglu(x[:, ::2], x[:, 1::2], alpha=experts.alpha, limit=experts.limit)
    assert np.abs(gate_up.numpy()).max() > 2 * experts.limit
    np.testing.assert_allclose(np.asarray(ours), expected, rtol=1e-6, atol=1e-6)


def test_logits_match_transformers_with_experts_on_an_expert_axis(checkpoint):
    """`experts = "expert"` on `data=2,expert=2,model=2`: each device holds 2 of the 4 experts,
    half their hidden dim (`model`) and one batch row; the logits are transformers'. A block of
    the gate and the same block of up read, once for both, only their interleaved columns of
    `gate_up_proj`: I of the 2I columns, for experts 2-3 only their rows."""
    from jax.sharding import NamedSharding

    _, directory, expected, _ = checkpoint
    shipped = port.load_mapping(MAPPINGS / "gpt_oss.toml")
    mapping = dataclasses.replace(shipped, rules={**shipped.rules, "experts": ("expert",)})
    mesh = port.make_mesh("data=2,expert=2,model=2")
    recipe, infos = placed_reading_exactly(directory, mesh, mapping)
    gate = next(leaf for leaf in recipe.leaves if leaf.path == "blocks.mlp.experts.gate")
    layers, experts, inter, hidden = gate.shape
    boxes = gate.shards(mesh.shape)
    assert len(boxes) == 8 and all(b[1][1] - b[1][0] == experts // 2 and b[2][1] - b[2][0] == inter // 2 for b in boxes)
    for box in boxes:
        region, keys = gate.source_region(box)
        (a, b) = box[2]
        assert region == (box[1], box[3], (2 * a, 2 * b))  # its and up's columns: 2 * 20 of 80
        read = sum(len(element_bytes(infos[k], region)) for k in keys)
        assert read == layers * (experts // 2) * (hidden // 2) * inter * 4

    model = port.load(directory, mesh=mesh, mapping=mapping)
    mlp = model.blocks.mlp
    assert mlp.experts.gate.sharding.spec == P(None, "expert", "model", "data")
    assert mlp.experts.bgate.sharding.spec == P(None, "expert", "model")
    rows = jax.device_put(IDS, NamedSharding(mesh, P("data", None)))
    ours = np.asarray(logits(model, rows))
    np.testing.assert_allclose(ours, expected, atol=1e-4 * max(1.0, np.abs(expected).max()), rtol=0)


def test_bfloat16_end_to_end(tmp_path):
    """A bfloat16 checkpoint stays bfloat16 to the logits, within `port verify`'s bound:
    2e-2 of the largest logit, or twice transformers' own bfloat16 error if larger."""
    model = torch_gpt_oss(dtype="bfloat16")
    model.save_pretrained(tmp_path)
    ours = port.load(tmp_path, mesh="4x2")
    bf16 = np.dtype(ml_dtypes.bfloat16)
    assert all(x.dtype == bf16 for x in jax.tree.leaves(eqx.filter(ours, eqx.is_array)))
    out = logits(ours, IDS)
    assert out.dtype == bf16
    expected = torch_logits(model, IDS)
    exact = torch_logits(model.float(), IDS)  # the same bfloat16 weights, in float32
    error = np.abs(np.asarray(out).astype(np.float32) - expected).max()
    bound = max(2e-2 * max(1.0, np.abs(expected).max()), 2 * np.abs(expected - exact).max())
    print(f"bfloat16 4x2: max |logits diff| {error:.4g}, bound {bound:.4g}")
    assert error <= bound, (error, bound)


# ---------------------------------------------------------------- reading, export


def test_each_device_block_reads_exactly_its_experts(checkpoint):
    """On 4x2 the 4 experts go 2 to a `model` column: the second column's blocks of the gate read
    experts 2-3 of `gate_up_proj` in every layer, in their `data` quarter of the hidden dim."""
    _, directory, _, _ = checkpoint
    mesh = port.make_mesh("4x2")
    recipe, _ = placed_reading_exactly(directory, mesh)
    gate = next(leaf for leaf in recipe.leaves if leaf.path == "blocks.mlp.experts.gate")
    layers, _, inter, hidden = gate.shape
    boxes = sorted(gate.shards(mesh.shape))
    assert boxes[-1] == ((0, layers), (2, 4), (0, inter), (hidden * 3 // 4, hidden))
    assert gate.box_keys(boxes[-1]) == tuple(f"model.layers.{i}.mlp.experts.gate_up_proj" for i in range(layers))
    region, _ = gate.source_region(boxes[-1])
    assert region == ((2, 4), (hidden * 3 // 4, hidden), (0, 2 * inter))


def test_export_round_trip(checkpoint, tmp_path):
    """port.export from 4x2 writes the checkpoint's own fused tensors byte for byte (gate and up
    interleaved back), and transformers loads them with no missing or unexpected key."""
    from safetensors.numpy import load_file

    transformers = transformers_or_skip()
    import torch

    _, directory, _, model = checkpoint
    out = port.export(model, tmp_path / "hf", directory).out
    source, written = load_file(directory / "model.safetensors"), load_file(out / "model.safetensors")
    assert written.keys() == source.keys()
    for key, value in source.items():
        assert written[key].dtype == value.dtype and written[key].tobytes() == value.tobytes(), key
    original = transformers.AutoModelForCausalLM.from_pretrained(directory)
    exported, info = transformers.AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    for what in ("missing_keys", "unexpected_keys", "mismatched_keys", "error_msgs"):
        assert not info[what], f"{what}: {info[what]}"
    ours, theirs = exported.state_dict(), original.state_dict()
    assert ours.keys() == theirs.keys()
    for key, value in theirs.items():
        assert ours[key].dtype == value.dtype and torch.equal(ours[key], value), key


# ---------------------------------------------------------------- gpt-oss-120b, planned only

# openai/gpt-oss-120b's config.json, without its MXFP4 `quantization_config` (a bfloat16
# copy of the weights, in the same names).
GPT_OSS_120B = {
    "architectures": ["GptOssForCausalLM"],
    "attention_bias": True,
    "attention_dropout": 0.0,
    "eos_token_id": 200002,
    "experts_per_token": 4,
    "head_dim": 64,
    "hidden_act": "silu",
    "hidden_size": 2880,
    "initial_context_length": 4096,
    "initializer_range": 0.02,
    "intermediate_size": 2880,
    "layer_types": ["sliding_attention", "full_attention"] * 18,
    "max_position_embeddings": 131072,
    "model_type": "gpt_oss",
    "num_attention_heads": 64,
    "num_experts_per_tok": 4,
    "num_hidden_layers": 36,
    "num_key_value_heads": 8,
    "num_local_experts": 128,
    "output_router_logits": False,
    "pad_token_id": 199999,
    "rms_norm_eps": 1e-05,
    "rope_scaling": {
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "factor": 32.0,
        "original_max_position_embeddings": 4096,
        "rope_type": "yarn",
        "truncate": False,
    },
    "rope_theta": 150000,
    "router_aux_loss_coef": 0.9,
    "sliding_window": 128,
    "swiglu_limit": 7.0,
    "tie_word_embeddings": False,
    "transformers_version": "4.55.0.dev0",
    "use_cache": True,
    "vocab_size": 201088,
}


def gpt_oss_shapes(config):
    """Every tensor of a gpt-oss checkpoint and its shape, in the Hub's (bfloat16) key layout."""
    h, i, v = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    e, heads, kv, d = (
        config[k] for k in ("num_local_experts", "num_attention_heads", "num_key_value_heads", "head_dim")
    )
    shapes = {"model.embed_tokens.weight": [v, h], "model.norm.weight": [h], "lm_head.weight": [v, h]}
    for n in range(config["num_hidden_layers"]):
        layer = f"model.layers.{n}."
        for name, shape in {
            "input_layernorm.weight": [h],
            "post_attention_layernorm.weight": [h],
            "self_attn.q_proj.weight": [heads * d, h],
            "self_attn.q_proj.bias": [heads * d],
            "self_attn.k_proj.weight": [kv * d, h],
            "self_attn.k_proj.bias": [kv * d],
            "self_attn.v_proj.weight": [kv * d, h],
            "self_attn.v_proj.bias": [kv * d],
            "self_attn.o_proj.weight": [h, heads * d],
            "self_attn.o_proj.bias": [h],
            "self_attn.sinks": [heads],
            "mlp.router.weight": [e, h],
            "mlp.router.bias": [e],
            "mlp.experts.gate_up_proj": [e, h, 2 * i],
            "mlp.experts.gate_up_proj_bias": [e, 2 * i],
            "mlp.experts.down_proj": [e, i, h],
            "mlp.experts.down_proj_bias": [e, h],
        }.items():
            shapes[layer + name] = shape
    return shapes


@pytest.mark.slow
def test_plan_gpt_oss_120b_reads_no_tensor(tmp_path):
    """`port plan` on gpt-oss-120b's real sizes (a ~234 GB sparse bfloat16 file): exit 0, the expert
    leaves on `model` x `data`, the bytes per device port's plan computes, and the process reads
    under 1 GB (no tensor byte) and peaks well under 1 GB of memory."""
    shapes = gpt_oss_shapes(GPT_OSS_120B)
    file_size = write_sparse_checkpoint(tmp_path / "gpt-oss-120b", GPT_OSS_120B, shapes)
    assert file_size > 230e9
    start = time.perf_counter()
    result, rchar, peak = run_port_measured(tmp_path, "plan", tmp_path / "gpt-oss-120b", "--mesh", "4x2")
    seconds = time.perf_counter() - start
    assert result.returncode == 0, result.stdout + result.stderr
    c = GPT_OSS_120B
    stacked = f"{c['num_hidden_layers']},{c['num_local_experts']}"
    for leaf, shape, spec in [
        ("gate", "2880,2880", "(-, model, -, data)"),
        ("up", "2880,2880", "(-, model, -, data)"),
        ("down", "2880,2880", "(-, model, data, -)"),
    ]:
        row = rf"^blocks\.mlp\.experts\.{leaf} +{re.escape(f'bf16[{stacked},{shape}]')} +{re.escape(spec)} "
        assert re.search(row, result.stdout, re.MULTILINE), result.stdout
    print(f"port plan gpt-oss-120b: {seconds:.1f} s, peak RSS {peak / 2**20:.0f} MiB, read {rchar / 2**20:.1f} MiB")
    assert rchar < 1e9 and peak < 1e9, (rchar, peak)


# ---------------------------------------------------------------- errors


@pytest.mark.slow
def test_a_config_that_contradicts_the_tensors_fails_in_one_line(checkpoint, tmp_path):
    _, directory, _, _ = checkpoint
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "model.safetensors").symlink_to(directory / "model.safetensors")
    config = json.loads((directory / "config.json").read_text())
    (broken / "config.json").write_text(json.dumps({**config, "num_local_experts": 6}))
    one_line(run_port("plan", broken), "shape mismatch", "mlp.router.weight' is [4, 48]", "[3, 6, 48]")


@pytest.mark.parametrize(
    "change, message",
    [
        ({"num_experts_per_tok": 5}, "'num_experts_per_tok' (5) is more than 'num_local_experts' (4)"),
        ({"layer_types": ["full_attention"]}, "'layer_types' must list 3 of"),
        ({"swiglu_limit": -1.0}, "'swiglu_limit' must be a positive number"),
        ({"rope_parameters": {"rope_type": "llama3", "factor": 8.0}}, "rope type 'llama3' is not supported"),
        ({"num_key_value_heads": 4}, "'num_key_value_heads' (4) must divide 'num_attention_heads' (6)"),
    ],
)
def test_config_refuses_in_one_line(change, message):
    with pytest.raises(ConfigError) as error:
        GptOssConfig.from_hf({**CONFIG, "model_type": "gpt_oss", **change})
    assert message in str(error.value) and "\n" not in str(error.value)


def test_config_defaults_follow_transformers():
    """An (almost) empty config.json means what GptOssConfig means: yarn x32 on base 150000, even
    layers sliding by 128, experts 128 top-4, swiglu 1.702 / 7.0, biased attention."""
    transformers = transformers_or_skip()
    theirs = transformers.GptOssConfig(
        vocab_size=64, hidden_size=32, intermediate_size=16, num_hidden_layers=4, num_attention_heads=16
    )
    ours = GptOssConfig.from_hf(
        {
            "model_type": "gpt_oss",
            "vocab_size": 64,
            "hidden_size": 32,
            "intermediate_size": 16,
            "num_hidden_layers": 4,
            "num_attention_heads": 16,
        }
    )
    assert ours.sliding_layers == tuple(t == "sliding_attention" for t in theirs.layer_types)
    assert (ours.sliding_window, ours.num_experts, ours.num_experts_per_tok) == (
        theirs.sliding_window,
        theirs.num_local_experts,
        theirs.num_experts_per_tok,
    )
    assert (ours.swiglu_alpha, ours.swiglu_limit, ours.attention_bias) == (
        theirs.swiglu_alpha,
        theirs.swiglu_limit,
        theirs.attention_bias,
    )
    assert (ours.num_key_value_heads, ours.head_dim) == (theirs.num_key_value_heads, theirs.head_dim)
    rope = theirs.rope_parameters
    assert (ours.rope.kind, ours.rope.theta, ours.rope.factor, ours.rope.truncate) == (
        rope["rope_type"],
        rope["rope_theta"],
        rope["factor"],
        rope["truncate"],
    )


def test_abstract_model_shapes():
    abstract = eqx.filter_eval_shape(
        GptOss.from_config, {**GPT_OSS_120B, "num_hidden_layers": 2, "layer_types": None}, key=jax.random.key(0)
    )
    mlp = abstract.blocks.mlp
    assert mlp.experts.gate.shape == mlp.experts.up.shape == (2, 128, 2880, 2880)
    assert mlp.experts.bgate.shape == (2, 128, 2880) and mlp.router_bias.shape == (2, 128)
    assert abstract.blocks.attn.sinks.shape == (2, 64) and abstract.blocks.attn.bo.shape == (2, 2880)
