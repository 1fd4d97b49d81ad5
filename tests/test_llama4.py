"""Llama 4's language model: port's `Llama4`, converted by mappings/llama4.toml, against `transformers`.

One tiny seeded `Llama4ForCausalLM` exercises every feature at once: 4 layers, MoE on
every second (dense SwiGLU layers between, `intermediate_size_mlp`), 4 experts, top 2,
the shared expert, a NoPE layer (layer 2) among RoPE layers, attention chunks of 3
tokens (shorter than every sequence here), L2 q/k norm on the RoPE layers, attention
temperature tuning on the NoPE layer with `floor_scale` 2 (so it changes the scores
from the second token on), llama3 RoPE scaling and perturbed norms. Saved by
`save_pretrained`, loaded by `port.load`, it gives transformers' logits (eager attention)
on 1x1, 4x2 and `data=2,expert=2,model=2` with the experts on `expert`, in float32 and
bfloat16; `port.export` gives back the checkpoint bit for bit; the multimodal
checkpoint's text half loads with its vision tensors ignored; and `port plan` of
Llama-4-Scout's text shape over a sparse file reads no tensor.

Gradients, padding, packing, remat, bfloat16 compute, the 4x2 train step and greedy generation
are tests/test_decoders.py's contract, which runs it on this family as on every decoder.
"""

import dataclasses
import json
import re
import time
from pathlib import Path

import equinox as eqx
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from test_moe import recipe_for

import port
from port._errors import ConfigError
from port._text import size_text
from port.models.llama4 import Llama4Config, chunk_mask, rotate_pairs
from port.nn import prepare

from helpers import (
    logits,
    perturbed,
    run_port,
    run_port_measured,
    torch_logits,
    transformers_or_skip,
    write_sparse_checkpoint,
)

VOCAB = 97
CONFIG = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=24,
    intermediate_size_mlp=40,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    num_local_experts=4,
    num_experts_per_tok=2,
    interleave_moe_layer_step=2,
    attention_chunk_size=3,
    no_rope_layers=[1, 1, 0, 1],
    use_qk_norm=True,
    attn_temperature_tuning=True,
    floor_scale=2,
    attn_scale=0.5,
    max_position_embeddings=64,
    initializer_range=0.2,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
    rope_parameters=dict(
        rope_type="llama3",
        rope_theta=10000.0,
        factor=8.0,
        low_freq_factor=1.0,
        high_freq_factor=4.0,
        original_max_position_embeddings=16,
    ),
)
IDS = np.random.default_rng(0).integers(3, VOCAB, (2, 11))
MAPPING = Path(__file__).resolve().parents[1] / "mappings" / "llama4.toml"


def torch_llama4(dtype=None):
    """The seeded `Llama4ForCausalLM` of `CONFIG`, eager attention, norms perturbed; skips without PyTorch."""
    transformers = transformers_or_skip()
    import torch

    torch.manual_seed(0)
    config = transformers.Llama4TextConfig(**CONFIG)
    config._attn_implementation = "eager"
    model = perturbed(transformers.Llama4ForCausalLM(config), lambda name: "norm" in name, 0.2)
    return model if dtype is None else model.to(getattr(torch, dtype))


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """(the PyTorch model, its save_pretrained directory, its logits for IDS, port's model on 1x1)."""
    model = torch_llama4()
    directory = tmp_path_factory.mktemp("llama4")
    model.save_pretrained(directory)
    return model, directory, torch_logits(model, IDS), port.load(directory)


# ---------------------------------------------------------------- layout and config


def test_save_pretrained_writes_fused_experts_and_two_layer_kinds(checkpoint):
    """transformers 5.x writes the experts fused (gate_up_proj [experts, hidden, 2 x inter],
    down_proj [experts, inter, hidden]) and the dense layers' MLP as feed_forward.*_proj;
    port puts layers 1 and 3 in `moe`, 0 and 2 in `dense`."""
    from safetensors import safe_open

    _, directory, _, model = checkpoint
    with safe_open(directory / "model.safetensors", "np") as f:
        shapes = {key: f.get_slice(key).get_shape() for key in f.keys()}
    assert shapes["model.layers.1.feed_forward.experts.gate_up_proj"] == [4, 32, 48]
    assert shapes["model.layers.1.feed_forward.experts.down_proj"] == [4, 24, 32]
    assert shapes["model.layers.0.feed_forward.gate_proj.weight"] == [40, 32]
    assert not any(k.startswith("model.layers.0.feed_forward.experts") for k in shapes)
    assert model.layer_groups == {"dense": (0, 2), "moe": (1, 3)}
    assert model.moe.mlp.experts.gate.shape == (2, 4, 24, 32) and model.dense.mlp.gate.shape == (2, 40, 32)


def test_experts_split_gate_first(checkpoint):
    """gate is the first half of gate_up_proj's last axis, up the second (transformers' chunk)."""
    torch_lm, _, _, model = checkpoint
    fused = torch_lm.model.layers[3].feed_forward.experts.gate_up_proj.detach().numpy()
    np.testing.assert_array_equal(np.asarray(model.moe.mlp.experts.gate[1]), fused[..., :24].transpose(0, 2, 1))
    np.testing.assert_array_equal(np.asarray(model.moe.mlp.experts.up[1]), fused[..., 24:].transpose(0, 2, 1))


def test_config_follows_transformers():
    """Which layers are MoE, NoPE and chunked: transformers' rules, from the same config.json."""
    transformers = transformers_or_skip()
    for overrides in [
        {},
        dict(interleave_moe_layer_step=1),
        dict(moe_layers=[0, 2]),
        dict(no_rope_layers=None),
        dict(attention_chunk_size=None),
    ]:
        hf = transformers.Llama4TextConfig(
            **{
                **CONFIG,
                **overrides,
                "num_hidden_layers": 8,
                "no_rope_layers": overrides.get("no_rope_layers", [1, 1, 0, 1] * 2),
            }
        )
        ours = Llama4Config.from_hf(hf.to_dict())
        assert ours.moe_layers == tuple(hf.moe_layers)
        assert ours.rope_layers == tuple(bool(f) for f in hf.no_rope_layers)
        assert ours.chunked_layers == tuple(t == "chunked_attention" for t in hf.layer_types)
        del_types = {k: v for k, v in hf.to_dict().items() if k != "layer_types"}
        assert Llama4Config.from_hf(del_types).chunked_layers == ours.chunked_layers


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(no_rope_layers=[1, 0, 1]), "'no_rope_layers' must give 0 or 1 for each of the 4 layers"),
        (dict(no_rope_layers=[1, 2, 1, 1]), "'no_rope_layers' must give 0 or 1"),
        (dict(moe_layers=[1, 4]), "'moe_layers' must list distinct layers below 'num_hidden_layers' (4)"),
        (dict(num_experts_per_tok=5), "'num_experts_per_tok' (5) is more than 'num_local_experts' (4)"),
        (dict(layer_types=["full_attention"] * 3), "'layer_types' must list 4 of"),
        (dict(attention_chunk_size=None, layer_types=["chunked_attention"] * 4), "'attention_chunk_size' is null"),
        (dict(attention_chunk_size=0), "'attention_chunk_size' must be a positive integer"),
        (dict(num_key_value_heads=3), "'num_key_value_heads' (3) must divide"),
        (dict(hidden_act="gelu"), "'hidden_act' 'gelu' is not supported"),
        (dict(rope_parameters=dict(rope_type="dynamic", factor=2.0)), "rope type 'dynamic' is not supported"),
        (dict(model_type="llama4", text_config=None), "'text_config' must be a dict"),
    ],
)
def test_config_contradictions_raise_one_line(change, message):
    config = {**CONFIG, "model_type": "llama4_text", **change}
    with pytest.raises(ConfigError) as error:
        Llama4Config.from_hf(config)
    assert message in str(error.value) and "\n" not in str(error.value)


def test_expert_count_contradicting_the_tensors_is_refused_before_reading(checkpoint, tmp_path):
    """config.json saying 8 experts over tensors of 4: the plan names the tensor and both shapes."""
    _, directory, _, _ = checkpoint
    other = tmp_path / "eight"
    other.mkdir()
    (other / "model.safetensors").symlink_to(directory / "model.safetensors")
    config = json.loads((directory / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**config, "num_local_experts": 8}))
    with pytest.raises(port.PlanError) as error:
        port.load(other)
    text = str(error.value)
    assert "router.weight" in text or "gate_up_proj" in text, text
    assert "\n" not in text.strip().splitlines()[0]


def test_chunk_mask_and_adjacent_pair_rope():
    """The chunk mask is causal within chunks of positions (left padding shifts the chunks
    with the sequence); rotate_pairs is transformers' complex product."""
    tokens = prepare(jnp.zeros((2, 5), jnp.int32), attention_mask=jnp.array([[1] * 5, [0, 1, 1, 1, 1]]))
    mask = np.asarray(chunk_mask(tokens, 2)).astype(int)
    assert mask[0].tolist() == [[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [0, 0, 1, 0, 0], [0, 0, 1, 1, 0], [0, 0, 0, 0, 1]]
    assert mask[1, 1:, 1:].tolist() == mask[0, :4, :4].tolist() and mask[1, :, 0].sum() == 0
    x = np.random.default_rng(0).normal(size=(1, 3, 2, 8)).astype(np.float32)
    angles = np.random.default_rng(1).normal(size=(1, 3, 4)).astype(np.float32)
    cos, sin = np.cos(np.concatenate([angles] * 2, -1)), np.sin(np.concatenate([angles] * 2, -1))
    expected = (x[..., 0::2] + 1j * x[..., 1::2]) * np.exp(1j * angles)[:, :, None]
    expected = np.stack([expected.real, expected.imag], -1).reshape(x.shape)
    np.testing.assert_allclose(np.asarray(rotate_pairs(jnp.asarray(x), cos, sin)), expected, atol=1e-5)


# ---------------------------------------------------------------- logits


@pytest.mark.parametrize("mesh", ["1x1", "4x2"])
def test_logits_match_transformers(checkpoint, mesh):
    _, directory, expected, single = checkpoint
    model = single if mesh == "1x1" else port.load(directory, mesh=mesh)
    ours = np.asarray(logits(model, IDS))
    error = np.abs(ours - expected).max()
    print(f"llama4 float32 {mesh}: max abs logits diff {error:.2e} (logits up to {np.abs(expected).max():.2f})")
    np.testing.assert_allclose(ours, expected, atol=1e-4, rtol=0)


@pytest.mark.parametrize(
    "change",
    [
        dict(attention_chunk_size=None),
        dict(no_rope_layers=[1, 1, 1, 1]),
        dict(use_qk_norm=False),
        dict(attn_temperature_tuning=False),
        dict(interleave_moe_layer_step=1),
    ],
)
def test_every_feature_matters(checkpoint, change):
    """transformers with any one feature changed (no chunks, no NoPE layer, no qk norm, no
    temperature, MoE everywhere) moves the logits far past the parity tolerance: a port
    model that ignored that feature would fail test_logits_match_transformers."""
    _, _, expected, _ = checkpoint
    transformers = transformers_or_skip()
    import torch

    torch.manual_seed(0)
    config = transformers.Llama4TextConfig(**{**CONFIG, **change})
    config._attn_implementation = "eager"
    other = perturbed(transformers.Llama4ForCausalLM(config), lambda name: "norm" in name, 0.2)
    assert np.abs(torch_logits(other, IDS) - expected).max() > 1e-2


def test_logits_match_transformers_with_experts_on_an_expert_axis(checkpoint):
    """`experts = "expert"` on `data=2,expert=2,model=2`: each device holds 2 of the 4 experts,
    and the batch rows are on `data`; the logits are transformers'."""
    _, directory, expected, _ = checkpoint
    shipped = port.load_mapping(MAPPING)
    mapping = dataclasses.replace(shipped, rules={**shipped.rules, "experts": ("expert",)})
    mesh = port.make_mesh("data=2,expert=2,model=2")
    model = port.load(directory, mesh=mesh, mapping=mapping)
    experts = model.moe.mlp.experts
    assert experts.gate.sharding.spec == P(None, "expert", "model", "data")
    assert experts.down.sharding.spec == P(None, "expert", "data", "model")
    rows = jax.device_put(IDS, NamedSharding(mesh, P("data", None)))
    ours = np.asarray(logits(model, rows))
    error = np.abs(ours - expected).max()
    print(f"llama4 float32 data=2,expert=2,model=2: max abs logits diff {error:.2e}")
    np.testing.assert_allclose(ours, expected, atol=1e-4, rtol=0)


def decided_tokens(model, ids=IDS):
    """Tokens whose experts bfloat16 rounding cannot change: in every MoE layer, transformers'
    router logit of the k-th chosen expert beats the next by more than 2 bfloat16 ulps of the
    token's largest router logit (a dot product's rounding scales with its largest terms)."""
    import torch

    margins = []
    hooks = [
        layer.feed_forward.router.register_forward_hook(
            lambda module, args, out: margins.append(out[1].float().numpy())
        )
        for layer in model.model.layers
        if layer.is_moe_layer
    ]
    with torch.no_grad():
        model(torch.tensor(ids))
    for hook in hooks:
        hook.remove()
    k = CONFIG["num_experts_per_tok"]
    decided = np.ones(ids.size, bool)
    for router_logits in margins:
        top = -np.sort(-router_logits, axis=-1)
        ulp = 2.0 ** (np.floor(np.log2(np.abs(router_logits).max(axis=-1) + 1e-30)) - 7)
        decided &= top[:, k - 1] - top[:, k] > 2 * ulp
    return decided.reshape(ids.shape)


@pytest.fixture(scope="module")
def bfloat16(tmp_path_factory):
    """(the bfloat16 checkpoint, transformers' bfloat16 logits, the same weights' float32 logits,
    the decided tokens)."""
    model = torch_llama4(dtype="bfloat16")
    directory = tmp_path_factory.mktemp("llama4-bf16")
    model.save_pretrained(directory)
    expected, decided = torch_logits(model, IDS), decided_tokens(model)
    return directory, expected, torch_logits(model.float(), IDS), decided  # .float(): in place, last


@pytest.mark.parametrize("mesh", ["1x1", "4x2"])
def test_bfloat16_end_to_end(bfloat16, mesh):
    """A bfloat16 checkpoint stays bfloat16 and lands near transformers' bfloat16 logits: no farther
    than twice transformers' own bfloat16 rounding, within 5% of the logits' range, on every token
    whose experts rounding cannot change (top-k of bfloat16 router logits within an ulp of each
    other is a coin toss that sharded sums may call either way; the others are most tokens)."""
    directory, expected, exact, decided = bfloat16
    ours = port.load(directory, mesh=mesh)
    bf16 = np.dtype(ml_dtypes.bfloat16)
    assert all(x.dtype == bf16 for x in jax.tree.leaves(eqx.filter(ours, eqx.is_array)))
    out = logits(ours, IDS)
    assert out.dtype == bf16
    assert decided.mean() > 0.75, decided
    noise = np.abs(expected - exact)[decided].max()
    error = np.abs(np.asarray(out).astype(np.float32) - expected)[decided].max()
    print(
        f"llama4 bfloat16 {mesh}: max abs logits diff {error:.3f} on {decided.sum()} of {decided.size} tokens "
        f"(transformers' own bf16 noise {noise:.3f})"
    )
    assert error <= 2 * noise and error < 0.05 * np.abs(expected).max(), (error, noise)


# ---------------------------------------------------------------- export and the multimodal layout


def test_export_round_trip(checkpoint, tmp_path):
    """port.load on 4x2, port.export, transformers from_pretrained: no missing or unexpected key,
    every tensor byte for byte the source's (the fused experts rebuilt from gate and up)."""
    from safetensors.numpy import load_file

    transformers = transformers_or_skip()
    import torch

    torch_lm, directory, _, _ = checkpoint
    out = port.export(port.load(directory, mesh="4x2"), tmp_path / "hf", directory).out
    source, written = load_file(directory / "model.safetensors"), load_file(out / "model.safetensors")
    assert written.keys() == source.keys()
    for key, value in source.items():
        assert written[key].dtype == value.dtype and written[key].tobytes() == value.tobytes(), key
    exported, info = transformers.AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    for what in ("missing_keys", "unexpected_keys", "mismatched_keys", "error_msgs"):
        assert not info[what], f"{what}: {info[what]}"
    theirs = torch_lm.state_dict()
    for key, value in exported.state_dict().items():
        assert torch.equal(value, theirs[key]), key


@pytest.mark.slow
def test_multimodal_checkpoint_loads_its_language_model(tmp_path):
    """A `Llama4ForConditionalGeneration` checkpoint (model_type llama4, `text_config`, keys under
    `language_model.`): port loads the language model, the vision tower and projector are
    ignored and `port plan` lists them; the logits are its language model's."""
    transformers = transformers_or_skip()
    import torch

    torch.manual_seed(0)
    vision = dict(
        hidden_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=32,
        image_size=28,
        patch_size=14,
        vision_output_dim=16,
        projector_input_dim=16,
        projector_output_dim=16,
    )
    config = transformers.Llama4Config(text_config=CONFIG, vision_config=vision)
    config.text_config._attn_implementation = "eager"
    model = perturbed(transformers.Llama4ForConditionalGeneration(config), lambda name: "norm" in name, 0.2)
    model.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["model_type"] == "llama4"
    expected = torch_logits(model.language_model, IDS)
    recipe = recipe_for(tmp_path, {"data": 1, "model": 1})
    assert recipe.ignored and all(k.startswith(("vision_model.", "multi_modal_projector.")) for k in recipe.ignored)
    assert any(k.startswith("vision_model.") for k in recipe.ignored)
    ours = np.asarray(logits(port.load(tmp_path), IDS))
    np.testing.assert_allclose(ours, expected, atol=1e-4, rtol=0)
    result = run_port("plan", tmp_path, "--mesh", "1x1")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "vision_model." in result.stdout, result.stdout


# ---------------------------------------------------------------- Llama-4-Scout, planned only

# meta-llama/Llama-4-Scout-17B-16E's text_config (as transformers 5 writes it).
SCOUT = {
    "model_type": "llama4_text",
    "vocab_size": 202048,
    "hidden_size": 5120,
    "intermediate_size": 8192,
    "intermediate_size_mlp": 16384,
    "num_hidden_layers": 48,
    "num_attention_heads": 40,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "num_local_experts": 16,
    "num_experts_per_tok": 1,
    "interleave_moe_layer_step": 1,
    "attention_chunk_size": 8192,
    "use_qk_norm": True,
    "no_rope_layers": [int((i + 1) % 4 != 0) for i in range(48)],
    "rms_norm_eps": 1e-5,
    "rope_parameters": {
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 16.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 1.0,
        "original_max_position_embeddings": 8192,
    },
    "max_position_embeddings": 10485760,
    "tie_word_embeddings": False,
}


def scout_shapes(c):
    """Every tensor of a Llama4ForCausalLM checkpoint of config `c` (all layers MoE) and its shape."""
    h, inter, e, v = c["hidden_size"], c["intermediate_size"], c["num_local_experts"], c["vocab_size"]
    q, kv = c["num_attention_heads"] * c["head_dim"], c["num_key_value_heads"] * c["head_dim"]
    shapes = {"model.embed_tokens.weight": [v, h], "model.norm.weight": [h], "lm_head.weight": [v, h]}
    for i in range(c["num_hidden_layers"]):
        layer = f"model.layers.{i}."
        shapes.update(
            {
                layer + "input_layernorm.weight": [h],
                layer + "post_attention_layernorm.weight": [h],
                layer + "self_attn.q_proj.weight": [q, h],
                layer + "self_attn.k_proj.weight": [kv, h],
                layer + "self_attn.v_proj.weight": [kv, h],
                layer + "self_attn.o_proj.weight": [h, q],
                layer + "feed_forward.router.weight": [e, h],
                layer + "feed_forward.experts.gate_up_proj": [e, h, 2 * inter],
                layer + "feed_forward.experts.down_proj": [e, inter, h],
                layer + "feed_forward.shared_expert.gate_proj.weight": [inter, h],
                layer + "feed_forward.shared_expert.up_proj.weight": [inter, h],
                layer + "feed_forward.shared_expert.down_proj.weight": [h, inter],
            }
        )
    return shapes


@pytest.mark.slow
def test_plan_llama4_scout_reads_no_tensor(tmp_path):
    """`port plan` on Llama-4-Scout's text sizes (a ~215 GB sparse file): exit 0 in seconds, the
    experts on `model` x `data`, the dense group absent, under 1 GB read and peak resident."""
    shapes = scout_shapes(SCOUT)
    size = write_sparse_checkpoint(tmp_path / "scout", SCOUT, shapes)
    assert size > 200e9
    start = time.perf_counter()
    result, rchar, peak = run_port_measured(tmp_path, "plan", tmp_path / "scout", "--mesh", "4x2")
    seconds = time.perf_counter() - start
    assert result.returncode == 0, result.stdout + result.stderr
    print(f"port plan Llama-4-Scout text: {seconds:.1f} s, peak RSS {peak / 2**20:.0f} MiB, read {rchar} bytes")
    assert rchar < 1e9 and peak < 1e9, (rchar, peak)
    recipe = recipe_for(tmp_path / "scout", {"data": 4, "model": 2})
    total = sum(2 * int(np.prod(s)) for s in shapes.values())
    assert recipe.nbytes == total
    assert f"{size_text(recipe.read_bytes)} to read, {size_text(recipe.device_bytes)} per device" in result.stdout
    row = rf"^moe\.mlp\.experts\.gate +{re.escape('bf16[48,16,8192,5120]')} +{re.escape('(-, model, -, data)')} "
    assert re.search(row, result.stdout, re.MULTILINE), result.stdout
    assert not any(leaf.path.startswith("dense.") for leaf in recipe.leaves)
