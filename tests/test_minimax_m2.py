"""MiniMax-M2 (`minimax_m2`): port's `Moe`, converted by the shipped mapping, against `transformers`.

Tiny random `MiniMaxM2ForCausalLM`s written by `save_pretrained` (Mixtral's one tensor per
expert, the router's `e_score_correction_bias`, q/k norms over the whole projection) and
loaded by `port.load`: the logits are transformers' on one device, on 4x2 and with the
experts on an `expert` axis, in float32 and bfloat16; the legacy `rotary_dim` (8 of a head of
16) and, where config.json gives both, `partial_rotary_factor` winning over it under YaRN; a
perturbed selection bias (shown to matter, as the partial rotary is). `port.export` gives back
the checkpoint bit for bit, and config.json fields the module does not run (the Hub's
`use_qk_norm`, `scoring_func`, ...) are refused in one line before any tensor byte is read.

Gradients, padding, packing, remat, bfloat16 compute, the 4x2 train step and greedy generation
are tests/test_decoders.py's contract, which runs it on this family as on every decoder.
"""

import copy
import dataclasses
import json
import shutil
from pathlib import Path

import equinox as eqx
import jax
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import port
from port._errors import ConfigError
from port.models.moe import Moe, read_config
from port.nn import Rope

from helpers import (
    VOCAB,
    error_of,
    expert_mapping,
    loaded_once,
    logits,
    one_line,
    perturbed,
    run_port,
    saved_once,
    torch_logits,
    transformers_or_skip,
)

MAPPINGS = Path(__file__).resolve().parents[1] / "mappings"
EXPERT_MESH = "data=2,expert=2,model=2"
# 6 query heads of 16 on 2 kv heads, RoPE on 8 dims of each; top 3 of 8 experts of 20.
CONFIG = dict(
    vocab_size=VOCAB,
    hidden_size=48,
    intermediate_size=20,
    num_hidden_layers=2,
    num_attention_heads=6,
    num_key_value_heads=2,
    head_dim=16,
    num_local_experts=8,
    num_experts_per_tok=3,
    rotary_dim=8,
    max_position_embeddings=64,
    initializer_range=0.2,
    rms_norm_eps=1e-5,
    bos_token_id=0,
    eos_token_id=2,
    pad_token_id=0,
)
YARN = dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=16)
CASES = {
    "rotary-dim": CONFIG,
    # partial_rotary_factor (4 of 16 dims) wins over rotary_dim (8), as in MiniMaxM2Config
    "yarn-partial": dict(CONFIG, rope_parameters=dict(YARN, partial_rotary_factor=0.25)),
}
IDS = np.random.default_rng(0).integers(3, VOCAB, (2, 16))


def torch_minimax(name, dtype=None):
    """The case's seeded `MiniMaxM2ForCausalLM`, eager attention, norms and the selection bias perturbed."""
    transformers = transformers_or_skip()
    import torch

    torch.manual_seed(0)
    config = transformers.MiniMaxM2Config(**CASES[name])
    config._attn_implementation = "eager"
    config._experts_implementation = "eager"  # torch's grouped_mm wants 16-byte strides in bfloat16
    model = perturbed(transformers.MiniMaxM2ForCausalLM(config), lambda n: "norm" in n, 0.2)
    with torch.no_grad():
        for layer in model.model.layers:
            bias = layer.mlp.e_score_correction_bias
            bias.add_(0.3 * torch.randn_like(bias))
    return model if dtype is None else model.to(getattr(torch, dtype))


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """get(name): (its save_pretrained directory, the PyTorch model, its logits), one build per case."""
    return saved_once(tmp_path_factory, torch_minimax, IDS)


@pytest.fixture(scope="module")
def loaded(checkpoints):
    """get(name, mesh): the case loaded by port.load on `mesh` (one load per pair)."""
    return loaded_once(checkpoints)


# ---------------------------------------------------------------- parity


def test_save_pretrained_writes_mixtral_keys_the_selection_bias_and_projection_norms(checkpoints):
    from safetensors import safe_open

    directory, _, _ = checkpoints("rotary-dim")
    with safe_open(directory / "model.safetensors", "np") as f:
        assert f.get_slice("model.layers.1.block_sparse_moe.experts.7.w1.weight").get_shape() == [20, 48]
        assert f.get_slice("model.layers.1.block_sparse_moe.e_score_correction_bias").get_shape() == [8]
        assert f.get_slice("model.layers.0.self_attn.q_norm.weight").get_shape() == [96]
        assert f.get_slice("model.layers.0.self_attn.k_norm.weight").get_shape() == [32]
    assert json.loads((directory / "config.json").read_text())["rotary_dim"] == 8


@pytest.mark.parametrize("name, mesh", [("rotary-dim", "1x1"), ("rotary-dim", "4x2"), ("yarn-partial", "1x1")])
def test_logits_match_transformers(checkpoints, loaded, name, mesh):
    _, _, expected = checkpoints(name)
    model = loaded(name, mesh)
    assert isinstance(model, Moe) and model.blocks is not None and model.layer_groups == {}
    assert model.config.rope.rotary_dim == (8 if name == "rotary-dim" else 4)
    ours = logits(model, IDS)
    assert ours.shape == (*IDS.shape, VOCAB) and ours.dtype == np.float32
    print(f"{name} on {mesh}: max |ours - transformers| {error_of(ours, expected):.3g}")
    np.testing.assert_allclose(np.asarray(ours), expected, atol=1e-4, rtol=0)
    if mesh == "4x2":
        mlp, attn = model.blocks.mlp, model.blocks.attn
        assert mlp.experts.gate.sharding.spec == P(None, "model", None, "data")
        assert mlp.selection_bias.sharding.spec == P(None, "model")
        assert attn.q_norm.sharding.spec == P(None, "model", None)
        assert attn.k_norm.sharding.spec == P(None, "model", None)


def with_field(module, name, value):
    """A copy of the Equinox `module` with its (static) field `name` set to `value`."""
    module = copy.copy(module)
    object.__setattr__(module, name, value)
    return module


def test_the_selection_bias_and_the_partial_rotary_matter(checkpoints, loaded):
    """Parity depends on `e_score_correction_bias` (which experts are chosen) and on rotating
    only `rotary_dim` dimensions of each head."""
    _, _, expected = checkpoints("rotary-dim")
    model = loaded("rotary-dim", "1x1")
    full = dataclasses.replace(model.config, rope=Rope(theta=model.config.rope.theta, rotary_dim=16))
    for changed in (
        eqx.tree_at(lambda m: m.blocks.mlp.selection_bias, model, replace_fn=lambda b: 0 * b),
        with_field(model, "config", full),
    ):
        assert error_of(logits(changed, IDS), expected) > 1e-2


def test_logits_match_transformers_with_experts_on_an_expert_axis(checkpoints):
    """The shipped mapping with `experts = "expert"` on a `data=2,expert=2,model=2` mesh."""
    directory, _, expected = checkpoints("rotary-dim")
    mesh = port.make_mesh(EXPERT_MESH)
    model = port.load(directory, mesh=mesh, mapping=expert_mapping(MAPPINGS / "minimax_m2.toml"))
    mlp = model.blocks.mlp
    assert mlp.experts.gate.sharding.spec == P(None, "expert", "model", "data")
    assert mlp.experts.down.sharding.spec == P(None, "expert", "data", "model")
    assert mlp.selection_bias.sharding.spec == P(None, "expert")
    ours = logits(model, jax.device_put(IDS, NamedSharding(mesh, P("data", None))))
    print(f"rotary-dim on {EXPERT_MESH}: max |ours - transformers| {error_of(ours, expected):.3g}")
    np.testing.assert_allclose(np.asarray(ours), expected, atol=1e-4, rtol=0)


def test_bfloat16_end_to_end_on_each_mesh(tmp_path):
    """A bfloat16 checkpoint stays bfloat16 on 1x1, 4x2 and the expert mesh, near transformers'
    own bfloat16 logits (within twice their distance from the same weights run in float32)."""
    model = torch_minimax("rotary-dim", dtype="bfloat16")
    model.save_pretrained(tmp_path)
    expected = torch_logits(model, IDS)
    bf16_noise = np.abs(expected - torch_logits(model.float(), IDS)).max()
    bf16 = np.dtype(ml_dtypes.bfloat16)
    for mesh, mapping in (
        ("1x1", None),
        ("4x2", None),
        (port.make_mesh(EXPERT_MESH), expert_mapping(MAPPINGS / "minimax_m2.toml")),
    ):
        ours = port.load(tmp_path, mesh=mesh, mapping=mapping)
        assert ours.blocks.mlp.experts.gate.dtype == ours.blocks.attn.q_norm.dtype == ours.embed.dtype == bf16
        out = logits(ours, IDS)
        assert out.dtype == bf16
        error = error_of(out, expected)
        shown = mesh if isinstance(mesh, str) else EXPERT_MESH
        print(f"bfloat16 on {shown}: max |ours - transformers| {error:.3g}, transformers' own noise {bf16_noise:.3g}")
        assert error <= 2 * bf16_noise and error < 0.05 * np.abs(expected).max(), (shown, error, bf16_noise)


# ---------------------------------------------------------------- export


def test_export_round_trip(checkpoints, loaded, tmp_path):
    """port.load on 4x2, port.export, transformers from_pretrained: no missing or unexpected
    key, every tensor byte for byte the source's."""
    from safetensors.numpy import load_file

    transformers = transformers_or_skip()
    import torch

    directory, torch_lm, _ = checkpoints("rotary-dim")
    out = port.export(loaded("rotary-dim", "4x2"), tmp_path / "hf", directory).out
    source, written = load_file(directory / "model.safetensors"), load_file(out / "model.safetensors")
    assert written.keys() == source.keys()
    for key, value in source.items():
        assert written[key].dtype == value.dtype and written[key].tobytes() == value.tobytes(), key
    exported, info = transformers.AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    for what in ("missing_keys", "unexpected_keys", "mismatched_keys", "error_msgs"):
        assert not info[what], f"{what}: {info[what]}"
    ours, theirs = exported.state_dict(), torch_lm.state_dict()
    assert ours.keys() == theirs.keys()
    for key, value in theirs.items():
        assert torch.equal(ours[key], value), key


# ---------------------------------------------------------------- config.json


# MiniMaxAI/MiniMax-M2's config.json (its FP8 quantization_config and auto_map left out).
MINIMAX_M2 = {
    "architectures": ["MiniMaxM2ForCausalLM"],
    "model_type": "minimax_m2",
    "attn_type_list": [1] * 62,
    "head_dim": 128,
    "hidden_act": "silu",
    "hidden_size": 3072,
    "intermediate_size": 1536,
    "max_position_embeddings": 196608,
    "num_attention_heads": 48,
    "num_experts_per_tok": 8,
    "num_hidden_layers": 62,
    "num_key_value_heads": 8,
    "num_local_experts": 256,
    "qk_norm_type": "per_layer",
    "rms_norm_eps": 1e-06,
    "rope_theta": 5000000,
    "rotary_dim": 64,
    "scoring_func": "sigmoid",
    "shared_intermediate_size": 0,
    "tie_word_embeddings": False,
    "use_qk_norm": True,
    "use_routing_bias": True,
    "vocab_size": 200064,
}


def test_the_hub_config_reads_as_transformers_runs_it():
    llama, moe = read_config(MINIMAX_M2)
    assert (llama.rope.rotary_dim, llama.rope.theta, llama.qk_norm, llama.sliding_window) == (
        64,
        5e6,
        "projection",
        None,
    )
    assert (moe.num_experts, moe.num_experts_per_tok, moe.scoring, moe.selection_bias) == (256, 8, "sigmoid", True)
    abstract = eqx.filter_eval_shape(Moe, llama, moe, key=jax.random.key(0))
    assert abstract.blocks.mlp.experts.gate.shape == (62, 256, 1536, 3072)
    assert abstract.blocks.attn.q_norm.shape == (62, 48, 128) and abstract.blocks.attn.k_norm.shape == (62, 8, 128)
    assert abstract.blocks.mlp.selection_bias.shape == (62, 256) and abstract.blocks.mlp.shared is None


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(use_qk_norm=False), "use_qk_norm false is not supported by port.models.moe.Moe (supported: true)"),
        (dict(qk_norm_type="per_head"), "qk_norm_type 'per_head' is not supported by port.models.moe.Moe"),
        (dict(scoring_func="softmax"), "scoring_func 'softmax' is not supported by port.models.moe.Moe"),
        (dict(use_routing_bias=False), "use_routing_bias false is not supported by port.models.moe.Moe"),
        (dict(shared_intermediate_size=512), "shared_intermediate_size 512 is not supported by port.models.moe.Moe"),
        (dict(sliding_window=4096), "sliding_window 4096 is not supported by port.models.moe.Moe for minimax_m2"),
        (dict(attn_type_list=[1] * 61 + [0]), "'attn_type_list' must list only 1 (softmax attention"),
        (dict(rotary_dim=0), "'rotary_dim' must be a positive integer"),
        (dict(rotary_dim=63), "'partial_rotary_factor' 0.4921875 of head_dim 128 gives 63 rotary dimensions"),
        (dict(num_experts_per_tok=300), "'num_experts_per_tok' (300) is more than 'num_local_experts' (256)"),
    ],
)
def test_config_refuses_in_one_line(change, message):
    with pytest.raises(ConfigError) as error:
        read_config({**MINIMAX_M2, **change})
    assert message in str(error.value) and "\n" not in str(error.value)


def test_a_refused_field_reads_no_tensor_byte(checkpoints, tmp_path):
    """The checkpoint's mapping and skeleton refuse config.json from its headers alone."""
    source, _, _ = checkpoints("rotary-dim")
    bad = shutil.copytree(source, tmp_path / "bad")
    config = json.loads((source / "config.json").read_text()) | {"scoring_func": "softmax"}
    (bad / "config.json").write_text(json.dumps(config))
    with port.open_checkpoint(bad) as ckpt:
        with pytest.raises(ConfigError, match="scoring_func 'softmax' is not supported"):
            port.skeleton(port.mapping_for(ckpt.config), ckpt.config)
        assert ckpt.bytes_read == 0


@pytest.mark.slow
def test_port_convert_refuses_a_field_the_module_does_not_run(checkpoints, tmp_path):
    """`port convert` of a MiniMax-M2 whose config.json has no q/k norm: one line, nothing written."""
    source, _, _ = checkpoints("rotary-dim")
    bad = shutil.copytree(source, tmp_path / "bad")
    config = json.loads((source / "config.json").read_text()) | {"use_qk_norm": False}
    (bad / "config.json").write_text(json.dumps(config))
    out = tmp_path / "out"
    line = "config.json: use_qk_norm false is not supported by port.models.moe.Moe (supported: true)"
    one_line(run_port("convert", bad, "--out", out), line, out=out)
