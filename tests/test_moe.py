"""Mixtral and Qwen2-MoE: port's `Moe`, converted by the shipped mappings, against `transformers`.

Parity goes through the converter: each `*ForCausalLM` written by `save_pretrained`
(which in transformers 5 writes one tensor per expert, as the Hub's checkpoints hold
them), loaded by `port.load`, gives the same logits on one device and sharded, with
the experts on `model`. A device holding some experts reads exactly their bytes; the
cases are sensitive to what they test (renormalising the top k, the shared expert and
its gate, the window); experts the `model` axis does not divide leave it to their hidden
dim; bfloat16 stays bfloat16; `port.export` gives back a checkpoint
`transformers` loads bit for bit; and `port plan` on Mixtral-8x7B's real sizes (a
sparse file, never read) reports the bytes per device. The tests that build a
`transformers` model skip without PyTorch.

Gradients, padding, packing, remat, bfloat16 compute, the 4x2 train step and greedy generation
are tests/test_decoders.py's contract, which runs it on these families as on every decoder.
"""

import dataclasses
import json
import re
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
from port._text import size_text
from port.models.moe import Moe, read_config
from port.nn import MoE, route

from helpers import (
    VOCAB,
    assert_blocks_read_exactly,
    equations,
    logits,
    perturbed,
    place_on,
    run_port_measured,
    saved_once,
    torch_logits,
    transformers_or_skip,
    write_sparse_checkpoint,
)

# Small and awkward: 6 query heads on 2 kv heads (groups of 3), top 2 of 6 experts,
# expert, shared-expert and vocab sizes unlike each other and the hidden size.
COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=48,
    num_hidden_layers=2,
    num_attention_heads=6,
    num_key_value_heads=2,
    max_position_embeddings=64,
    initializer_range=0.2,
    num_experts_per_tok=2,
)
MIXTRAL = dict(COMMON, intermediate_size=40, num_local_experts=6)
QWEN2_MOE = dict(
    COMMON,
    num_experts=6,
    intermediate_size=56,
    moe_intermediate_size=24,
    shared_expert_intermediate_size=40,
)
QWEN3_MOE = dict(
    COMMON, num_experts=6, intermediate_size=56, moe_intermediate_size=24, head_dim=12, norm_topk_prob=True
)
# name: (architecture, config)
CASES = {
    "mixtral": ("Mixtral", MIXTRAL),
    "mixtral-sliding": ("Mixtral", dict(MIXTRAL, sliding_window=4)),
    "qwen2-moe": ("Qwen2Moe", dict(QWEN2_MOE, norm_topk_prob=False)),
    "qwen2-moe-norm": ("Qwen2Moe", dict(QWEN2_MOE, norm_topk_prob=True)),
    # As a transformers 4 config.json: no layer_types, so port works out which layers slide
    # (Qwen2-MoE's rule: even layers below max_window_layers; here layer 0 only).
    "qwen2-moe-sliding": ("Qwen2Moe", dict(QWEN2_MOE, use_sliding_window=True, sliding_window=4, max_window_layers=1)),
    # Layer 0 dense (decoder_sparse_step 2), layer 1 sparse: the two stacks of `layer_groups`.
    "qwen2-moe-dense": ("Qwen2Moe", dict(QWEN2_MOE, decoder_sparse_step=2, norm_topk_prob=True)),
    # Qwen3's attention (head_dim 12, not 48 / 6); layer 1 of 3 dense (mlp_only_layers), a
    # window of 4 on every layer, q/k/v/o biases.
    "qwen3-moe": (
        "Qwen3Moe",
        dict(
            QWEN3_MOE,
            num_hidden_layers=3,
            mlp_only_layers=[1],
            use_sliding_window=True,
            sliding_window=4,
            attention_bias=True,
        ),
    ),
}
# Every family on every mesh, each compile a new (config, mesh): 7 compiles in all.
PARITY = [
    ("mixtral", "1x1"),
    ("mixtral", "4x2"),
    ("mixtral", "8x1"),
    ("qwen2-moe", "4x2"),
    ("qwen2-moe-norm", "8x1"),
    ("qwen2-moe-sliding", "1x1"),
    ("mixtral-sliding", "4x2"),
    ("qwen2-moe-dense", "4x2"),
    ("qwen3-moe", "1x1"),
    ("qwen3-moe", "4x2"),
]
IDS = np.random.default_rng(0).integers(0, VOCAB, (2, 16))
MAPPINGS = Path(__file__).resolve().parents[1] / "mappings"


def ids(name):
    """16 tokens; the first 12 of them for the sliding-window cases (a window of 4 in either length)."""
    return IDS[:, :12] if "sliding" in name or name == "qwen3-moe" else IDS


def torch_moe(name, dtype=None):
    """The case's seeded `{arch}ForCausalLM`, norms and biases perturbed; skips without PyTorch."""
    transformers = transformers_or_skip()
    import torch

    arch, config = CASES[name]
    torch.manual_seed(0)
    config = getattr(transformers, f"{arch}Config")(**config)
    config._attn_implementation = "eager"
    config._experts_implementation = "eager"  # torch's grouped_mm needs 16-byte strides
    model = getattr(transformers, f"{arch}ForCausalLM")(config)
    model = perturbed(model, lambda param_name: "norm" in param_name or param_name.endswith("bias"), 0.2)
    return model if dtype is None else model.to(getattr(torch, dtype))


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """get(name): the case saved by save_pretrained, its torch model and PyTorch logits (one build per case)."""

    def written(name, directory):
        if name == "qwen2-moe-sliding":
            config = json.loads((directory / "config.json").read_text())
            del config["layer_types"]
            (directory / "config.json").write_text(json.dumps(config))

    return saved_once(tmp_path_factory, torch_moe, ids, written)


def recipe_for(directory, mesh_shape, dtype=None):
    """The plan of the shipped mapping for the checkpoint at `directory` (reads headers only)."""
    with port.open_checkpoint(directory) as ckpt:
        mapping = port.mapping_for(ckpt.config)
        return port.plan(port.skeleton(mapping, ckpt.config), mapping, ckpt.tensors, ckpt.config, mesh_shape, dtype)


# ---------------------------------------------------------------- what save_pretrained writes


@pytest.mark.parametrize(
    "name, expert_key",
    [
        ("mixtral", "model.layers.{}.block_sparse_moe.experts.{}.w1.weight"),
        ("qwen2-moe", "model.layers.{}.mlp.experts.{}.gate_proj.weight"),
    ],
)
def test_save_pretrained_writes_one_tensor_per_expert(checkpoints, name, expert_key):
    """transformers 5 fuses experts in memory (`experts.gate_up_proj`) but saves them per expert,
    as the Hub's checkpoints hold them: the mappings read `{expert}` keys."""
    from safetensors import safe_open

    directory, _, _ = checkpoints(name)
    with safe_open(directory / "model.safetensors", "np") as f:
        keys = set(f.keys())
        config = json.loads((directory / "config.json").read_text())
        experts = config.get("num_local_experts", config.get("num_experts"))
        inter = config.get("moe_intermediate_size", config["intermediate_size"])
        for layer in range(2):
            for expert in range(experts):
                key = expert_key.format(layer, expert)
                assert f.get_slice(key).get_shape() == [inter, config["hidden_size"]]
    assert not any("gate_up_proj" in k for k in keys)


# ---------------------------------------------------------------- parity


@pytest.mark.parametrize("name, mesh_spec", PARITY)
def test_logits_match_transformers(checkpoints, name, mesh_spec):
    directory, _, expected = checkpoints(name)
    model = port.load(directory, mesh=port.make_mesh(mesh_spec))
    ours = logits(model, ids(name))
    assert ours.shape == (*ids(name).shape, VOCAB) and ours.dtype == np.float32
    np.testing.assert_allclose(np.asarray(ours), expected, atol=1e-4, rtol=0)
    if mesh_spec == "1x1":
        return
    blocks = model.blocks
    # Experts on `model` (6 experts divide 2 and 1), so the experts' hidden dim is not.
    for leaf in (blocks.mlp.experts.gate, blocks.mlp.experts.up):
        assert leaf.sharding.spec == P(None, "model", None, "data")
    assert blocks.mlp.experts.down.sharding.spec == P(None, "model", "data", None)
    assert blocks.mlp.router.sharding.spec == P(None, "model", "data")
    assert blocks.attn.wq.sharding.spec == P(None, "model", None, "data")
    assert blocks.attn.wk.sharding.spec == P(None, "model", None, "data")
    qwen = name.startswith("qwen2")
    assert (blocks.mlp.shared is not None) == qwen
    assert (blocks.attn.bq is not None) == (qwen or name == "qwen3-moe")
    dense = [i for i, kind in enumerate(model.moe.kinds) if kind == "dense"]
    assert dense == {"qwen2-moe-dense": [0], "qwen3-moe": [1]}.get(name, [])
    if dense:  # the dense layers' own stack, sharded as a dense model's
        assert model.dense.mlp.gate.shape[0] == len(dense) and blocks.mlp.router.shape[0] == len(model.moe.kinds) - 1
        assert model.dense.mlp.gate.sharding.spec == P(None, "model", "data")
        assert model.dense.mlp.down.sharding.spec == P(None, "data", "model")
        assert model.dense.attn.wq.sharding.spec == P(None, "model", None, "data")
    else:
        assert model.dense is None and model.layer_groups == {}
    if qwen:
        assert blocks.mlp.shared.gate.sharding.spec == P(None, "model", "data")
        assert blocks.mlp.shared_gate.sharding.spec == P(None, "data")
        assert blocks.attn.bq.sharding.spec == P(None, "model", None)


@pytest.mark.parametrize(
    "name, other",
    [("qwen2-moe-norm", "qwen2-moe"), ("mixtral-sliding", "mixtral"), ("qwen2-moe-sliding", "qwen2-moe")],
    ids=["norm_topk_prob", "mixtral-window", "qwen2-moe-window"],
)
def test_the_cases_differ_only_by_what_they_test(checkpoints, name, other):
    """Each pair holds the same weights (one seed, one set of shapes) and differs in one
    config value; transformers' logits differ far above the tolerance, so parity with
    both shows port follows the value (renormalising the top k; the sliding window)."""
    from safetensors.numpy import load_file

    (first, _, expected), (second, _, reference) = checkpoints(name), checkpoints(other)
    a, b = load_file(first / "model.safetensors"), load_file(second / "model.safetensors")
    assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)
    assert np.abs(expected - reference[:, : expected.shape[1]]).max() > 1e-2


def test_the_shared_expert_matters(checkpoints):
    """Qwen2-MoE's parity depends on the shared expert and on its sigmoid gate."""
    directory, _, expected = checkpoints("qwen2-moe")
    model = port.load(directory, mesh="4x2")  # as in the parity test: the compiled model is reused
    for where in (
        lambda m: m.blocks.mlp.shared.down,  # no shared expert
        lambda m: m.blocks.mlp.shared_gate,
    ):  # its gate 0.5 instead of sigmoid(g . x)
        changed = eqx.tree_at(where, model, replace_fn=lambda x: 0 * x)
        assert np.abs(np.asarray(logits(changed, ids("qwen2-moe"))) - expected).max() > 1e-2


def torch_routes(name):
    """The experts transformers' router picks for each token of `ids(name)`: [layers, batch, seq, k]."""
    import torch

    model = torch_moe(name)
    chosen = []
    hooks = [
        layer.mlp.gate.register_forward_hook(lambda module, args, out: chosen.append(out[2].numpy()))
        for layer in model.model.layers
        if hasattr(layer.mlp, "gate") and hasattr(layer.mlp, "experts")
    ]
    with torch.no_grad():
        model(torch.tensor(ids(name)))
    for hook in hooks:
        hook.remove()
    batch, seq = ids(name).shape
    return np.stack([c.reshape(batch, seq, -1) for c in chosen])


@pytest.mark.parametrize("name, mapping_file", [("mixtral", "mixtral.toml"), ("qwen3-moe", "qwen3_moe.toml")])
def test_logits_match_transformers_with_experts_on_an_expert_axis(checkpoints, name, mapping_file):
    """The shipped mapping with `experts = "expert"` on a `data=2,expert=2,model=2` mesh: each
    device holds 3 of the 6 experts (their hidden dim halved on `model`) and one row of the
    batch (on `data`); every row sends tokens, in every sparse layer, to experts of both halves,
    so to experts only other devices hold. The logits are transformers'."""
    from jax.sharding import NamedSharding

    directory, _, expected = checkpoints(name)
    shipped = port.load_mapping(MAPPINGS / mapping_file)
    mapping = dataclasses.replace(shipped, rules={**shipped.rules, "experts": ("expert",)})
    mesh = port.make_mesh("data=2,expert=2,model=2")
    model = port.load(directory, mesh=mesh, mapping=mapping)
    mlp = model.blocks.mlp
    assert mlp.experts.gate.sharding.spec == mlp.experts.up.sharding.spec == P(None, "expert", "model", "data")
    assert mlp.experts.down.sharding.spec == P(None, "expert", "data", "model")
    assert mlp.router.sharding.spec == P(None, "expert", "data")
    routes = torch_routes(name)
    half = 6 // mesh.shape["expert"]
    assert all({int(e) // half for e in row.ravel()} == {0, 1} for layer in routes for row in layer)
    rows = jax.device_put(ids(name), NamedSharding(mesh, P("data", None)))
    ours = logits(model, rows)
    np.testing.assert_allclose(np.asarray(ours), expected, atol=1e-4, rtol=0)


# ---------------------------------------------------------------- reading


@pytest.mark.parametrize("name", ["mixtral", "qwen2-moe"])
def test_each_device_block_reads_exactly_its_experts(checkpoints, name, reads):
    """On 4x2 the 6 experts of each layer go 3 to a `model` column: a block of an expert leaf
    reads those 3 experts' tensors of every layer, each only in its `data` quarter, and
    nothing of the other 3."""
    directory, _, _ = checkpoints(name)
    mesh = port.make_mesh("4x2")
    recipe, total, infos = place_on(directory, mesh)
    per_block, elsewhere = reads()
    assert_blocks_read_exactly(per_block, recipe, infos, mesh.shape)
    assert total == recipe.read_bytes == sum(i.nbytes for i in infos.values()) and len(elsewhere) == 0
    gate = next(leaf for leaf in recipe.leaves if leaf.path == "blocks.mlp.experts.gate")
    layers, experts, inter, embed = gate.shape
    boxes = sorted(box for leaf, box, _ in per_block if leaf is gate)
    assert boxes == [
        ((0, layers), (e, e + experts // 2), (0, inter), (d, d + embed // 4))
        for e in (0, experts // 2)
        for d in range(0, embed, embed // 4)
    ]
    second = gate.box_keys(boxes[-1])  # experts 3-5, every layer
    with port.open_checkpoint(directory) as ckpt:
        mapping = port.mapping_for(ckpt.config)
    pattern = mapping.params[[p.path for p in mapping.params].index(gate.path)]
    assert second == tuple(
        "model." + pattern.key_at((layer, e)) for layer in range(layers) for e in range(experts // 2, experts)
    )
    for leaf, box, files in per_block:
        if leaf is gate and box == boxes[-1]:
            assert files.size == layers * (experts // 2) * inter * (embed // 4) * gate.source_dtype.itemsize


# ---------------------------------------------------------------- bfloat16


@pytest.mark.parametrize("name", ["mixtral", "qwen3-moe"])
def test_bfloat16_end_to_end(tmp_path, name):
    """A bfloat16 Mixtral (Qwen3-MoE) stays bfloat16 from file to logits, near transformers' own bfloat16.

    The tolerance is measured, not guessed: bfloat16 rounding (8 bits of mantissa) moves
    transformers' own logits away from its float32 ones by some amount; ours must be no
    farther from transformers' bfloat16 than twice that (two independent bfloat16
    computations, each about that far from the exact result), and within 5% of the
    logits' range.
    """
    model = torch_moe(name, dtype="bfloat16")
    model.save_pretrained(tmp_path)
    recipe = recipe_for(tmp_path, {"data": 4, "model": 2})
    bf16 = np.dtype(ml_dtypes.bfloat16)
    assert all(leaf.source_dtype == leaf.dtype == bf16 and "cast" not in str(leaf.chain) for leaf in recipe.leaves)
    ours = port.load(tmp_path, mesh=port.make_mesh("4x2"))
    assert all(x.dtype == bf16 for x in jax.tree.leaves(eqx.filter(ours, eqx.is_array)))
    out = logits(ours, ids(name))
    assert out.dtype == bf16
    expected = torch_logits(model, ids(name))
    exact = torch_logits(model.float(), ids(name))  # the same bfloat16 weights, in float32
    bf16_noise = np.abs(expected - exact).max()
    error = np.abs(np.asarray(out).astype(np.float32) - expected).max()
    assert error <= 2 * bf16_noise and error < 0.05 * np.abs(expected).max(), (error, bf16_noise)


# ---------------------------------------------------------------- export


@pytest.mark.parametrize("name, mesh", [("mixtral", "4x2"), ("qwen2-moe-norm", "8x1"), ("qwen3-moe", "4x2")])
def test_export_round_trip(checkpoints, name, mesh, tmp_path):
    """port.load on a mesh, port.export, transformers from_pretrained: no missing or unexpected
    key, every parameter equal to loading the original; the files hold the source's tensors
    byte for byte, one per expert."""
    from safetensors.numpy import load_file

    transformers = transformers_or_skip()
    import torch

    directory, _, _ = checkpoints(name)
    model = port.load(directory, mesh=mesh)
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


# ---------------------------------------------------------------- Mixtral-8x7B, planned only

# mistralai/Mixtral-8x7B-v0.1's config.json.
MIXTRAL_8X7B = {
    "architectures": ["MixtralForCausalLM"],
    "attention_dropout": 0.0,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "hidden_act": "silu",
    "hidden_size": 4096,
    "initializer_range": 0.02,
    "intermediate_size": 14336,
    "max_position_embeddings": 32768,
    "model_type": "mixtral",
    "num_attention_heads": 32,
    "num_experts_per_tok": 2,
    "num_hidden_layers": 32,
    "num_key_value_heads": 8,
    "num_local_experts": 8,
    "output_router_logits": False,
    "rms_norm_eps": 1e-05,
    "rope_theta": 1000000.0,
    "router_aux_loss_coef": 0.02,
    "sliding_window": None,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.36.0.dev0",
    "use_cache": True,
    "vocab_size": 32000,
}


def mixtral_shapes(config):
    """Every tensor of a Mixtral checkpoint and its shape, in the Hub's key layout."""
    h, inter, v = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    kv = config["num_key_value_heads"] * h // config["num_attention_heads"]
    shapes = {"model.embed_tokens.weight": [v, h], "model.norm.weight": [h], "lm_head.weight": [v, h]}
    for i in range(config["num_hidden_layers"]):
        layer = f"model.layers.{i}."
        shapes.update(
            {
                layer + "input_layernorm.weight": [h],
                layer + "post_attention_layernorm.weight": [h],
                layer + "self_attn.q_proj.weight": [h, h],
                layer + "self_attn.k_proj.weight": [kv, h],
                layer + "self_attn.v_proj.weight": [kv, h],
                layer + "self_attn.o_proj.weight": [h, h],
                layer + "block_sparse_moe.gate.weight": [config["num_local_experts"], h],
            }
        )
        for e in range(config["num_local_experts"]):
            expert = f"{layer}block_sparse_moe.experts.{e}."
            shapes.update(
                {expert + "w1.weight": [inter, h], expert + "w2.weight": [h, inter], expert + "w3.weight": [inter, h]}
            )
    return shapes


@pytest.mark.slow
def test_plan_mixtral_8x7b_reads_no_tensor(tmp_path):
    """`port plan` on Mixtral-8x7B's real sizes (46.7B bfloat16 params, a 93 GB sparse file):
    exit 0, every expert leaf sharded on `model` x `data`, the bytes per device port's own
    plan computes (an eighth of the model, but for the small replicated norms), and the
    process reads under 1 GB in all (about 1% of the file; port reads by pread/preadv only,
    which /proc/self/io counts): no tensor byte."""
    shapes = mixtral_shapes(MIXTRAL_8X7B)
    file_size = write_sparse_checkpoint(tmp_path / "mixtral", MIXTRAL_8X7B, shapes)
    assert file_size > 90e9
    result, rchar, peak = run_port_measured(tmp_path, "plan", tmp_path / "mixtral", "--mesh", "4x2")
    assert result.returncode == 0, result.stdout + result.stderr
    recipe = recipe_for(tmp_path / "mixtral", {"data": 4, "model": 2})
    total = sum(2 * int(np.prod(s)) for s in shapes.values())
    assert recipe.nbytes == total and recipe.params == total // 2
    assert total / 8 <= recipe.device_bytes < total / 8 * 1.001
    assert f"{size_text(recipe.read_bytes)} to read, {size_text(recipe.device_bytes)} per device" in result.stdout
    c = MIXTRAL_8X7B
    stacked = f"{c['num_hidden_layers']},{c['num_local_experts']}"
    inter, hidden = c["intermediate_size"], c["hidden_size"]
    for leaf, shape, spec in [
        ("gate", f"{inter},{hidden}", "(-, model, -, data)"),
        ("down", f"{hidden},{inter}", "(-, model, data, -)"),
    ]:
        row = rf"^blocks\.mlp\.experts\.{leaf} +{re.escape(f'bf16[{stacked},{shape}]')} +{re.escape(spec)} "
        assert re.search(row, result.stdout, re.M), result.stdout
    assert "layers.{layer}.block_sparse_moe.experts.{expert}.w1.weight x32 x8" in result.stdout
    assert rchar < 1e9 and peak < 1e9, (rchar, peak)


def test_experts_the_model_axis_does_not_divide_leave_it_to_the_expert_hidden_dim(tmp_path):
    """3 experts on model=2: the experts axis is replicated, and the experts' hidden dim takes
    `model` instead (planned from headers only)."""
    config = dict(MIXTRAL, model_type="mixtral", num_local_experts=3)
    write_sparse_checkpoint(tmp_path / "three", config, mixtral_shapes(config))
    leaves = {leaf.path: leaf for leaf in recipe_for(tmp_path / "three", {"data": 4, "model": 2}).leaves}
    gate, down = leaves["blocks.mlp.experts.gate"], leaves["blocks.mlp.experts.down"]
    assert gate.spec == P(None, None, "model", "data") and down.spec == P(None, None, "data", "model")
    assert gate.notes == ("experts 3 not divisible by model=2: replicated on model",)


# ---------------------------------------------------------------- the module and its config


def numpy_route(
    logits, top_k, *, scoring="softmax", renormalise=True, selection_bias=None, groups=1, top_groups=1, scale=1.0
):
    """transformers' routers, in plain NumPy: Mixtral / Qwen2-MoE (softmax) and DeepSeek-V3's
    `DeepseekV3TopkRouter` (sigmoid, a selection bias, group-limited choice, a routed scale).

    Returns `(weights, experts)`, each token's row sorted by expert (the order of a top-k is
    not part of the result)."""
    logits = np.asarray(logits, np.float32)
    if scoring == "softmax":
        scores = np.exp(logits - logits.max(-1, keepdims=True))
        scores /= scores.sum(-1, keepdims=True)
    else:
        scores = 1 / (1 + np.exp(-logits))
    choice = scores if selection_bias is None else scores + np.asarray(selection_bias, np.float32)
    tokens, experts = choice.shape
    if groups > 1:
        per_group = choice.reshape(tokens, groups, experts // groups)
        group_scores = np.sort(per_group, -1)[..., -2:].sum(-1)  # each group's two best
        best = np.argsort(-group_scores, -1, kind="stable")[:, :top_groups]
        allowed = np.zeros((tokens, groups), bool)
        np.put_along_axis(allowed, best, True, -1)
        choice = np.where(np.repeat(allowed, experts // groups, -1), choice, -np.inf)
    chosen = np.sort(np.argsort(-choice, -1, kind="stable")[:, :top_k], -1)
    weights = np.take_along_axis(scores, chosen, -1)
    if renormalise:
        weights = weights / (weights.sum(-1, keepdims=True) + (1e-20 if scoring == "sigmoid" else 0))
    return weights * np.float32(scale), chosen


def by_expert(weights, experts):
    """`route`'s result with each token's row sorted by expert."""
    weights, experts = np.asarray(weights), np.asarray(experts)
    order = np.argsort(experts, -1)
    return np.take_along_axis(weights, order, -1), np.take_along_axis(experts, order, -1)


@pytest.mark.parametrize("renormalise", [False, True])
def test_route_softmax_is_transformers_router(renormalise):
    """Mixtral / Qwen2-MoE: softmax in float32 (bfloat16 logits included), the top k, renormalised
    on request; weights come back float32, best first."""
    logits = np.random.default_rng(0).standard_normal((16, 6)).astype(np.float32)
    for dtype in (np.float32, ml_dtypes.bfloat16):
        given = logits.astype(dtype)
        weights, experts = route(given, 2, renormalise=renormalise)
        assert weights.dtype == np.float32 and experts.shape == (16, 2)
        assert np.all(np.diff(np.asarray(weights), axis=-1) <= 0)
        expected_weights, expected_experts = numpy_route(given.astype(np.float32), 2, renormalise=renormalise)
        ours_weights, ours_experts = by_expert(weights, experts)
        np.testing.assert_array_equal(ours_experts, expected_experts)
        np.testing.assert_allclose(ours_weights, expected_weights, rtol=1e-6)
    total = np.asarray(weights).sum(-1)
    assert np.allclose(total, 1) if renormalise else np.all(total < 1 - 1e-3)


# DeepSeek-V3-shaped: 16 experts in 4 groups, the best 2 groups open, top 4 of their 8.
SIGMOID = {"scoring": "sigmoid", "groups": 4, "top_groups": 2}


def deepseek_case(seed=1, tokens=64, experts=16):
    rng = np.random.default_rng(seed)
    logits = rng.standard_normal((tokens, experts)).astype(np.float32)
    bias = rng.uniform(0.0, 0.5, experts).astype(np.float32)  # scores + bias > 0 everywhere
    return logits, bias


def test_route_sigmoid_group_limited_with_selection_bias_matches_numpy():
    """Sigmoid scores; the bias chooses but does not weigh; only experts of the 2 best groups
    (by the sum of their two best biased scores) may be chosen; renormalised."""
    logits, bias = deepseek_case()
    weights, experts = route(logits, 4, renormalise=True, selection_bias=bias, **SIGMOID)
    expected_weights, expected_experts = numpy_route(logits, 4, renormalise=True, selection_bias=bias, **SIGMOID)
    ours_weights, ours_experts = by_expert(weights, experts)
    np.testing.assert_array_equal(ours_experts, expected_experts)
    np.testing.assert_allclose(ours_weights, expected_weights, rtol=1e-6)
    np.testing.assert_allclose(ours_weights.sum(-1), 1, rtol=1e-6)
    # Every chosen expert lies in at most 2 groups of 4.
    assert max(len(set(row // 4)) for row in ours_experts) <= 2
    # The case is sensitive to each feature: without the groups, or without the bias, other
    # experts win for some tokens; the weights are the unbiased scores.
    free = numpy_route(logits, 4, scoring="sigmoid", selection_bias=bias)[1]
    unbiased = numpy_route(logits, 4, **SIGMOID)[1]
    assert (free != expected_experts).any(axis=-1).sum() > 5
    assert (unbiased != expected_experts).any(axis=-1).sum() > 5
    raw, _ = numpy_route(logits, 4, renormalise=False, selection_bias=bias, **SIGMOID)
    scores = 1 / (1 + np.exp(-logits))
    np.testing.assert_allclose(raw, np.take_along_axis(scores, expected_experts, -1), rtol=1e-6)


def test_route_scale_multiplies_the_weights():
    """`scale` (DeepSeek's routed_scaling_factor) multiplies the renormalised weights: each
    token's weights sum to it; the experts chosen do not change."""
    logits, bias = deepseek_case(seed=2)
    weights, experts = route(logits, 4, selection_bias=bias, scale=2.5, **SIGMOID)
    expected_weights, expected_experts = numpy_route(logits, 4, selection_bias=bias, scale=2.5, **SIGMOID)
    ours_weights, ours_experts = by_expert(weights, experts)
    np.testing.assert_array_equal(ours_experts, expected_experts)
    np.testing.assert_allclose(ours_weights, expected_weights, rtol=1e-6)
    np.testing.assert_allclose(ours_weights.sum(-1), 2.5, rtol=1e-6)
    unscaled, same = route(logits, 4, selection_bias=bias, **SIGMOID)
    np.testing.assert_array_equal(np.asarray(same), np.asarray(experts))
    np.testing.assert_allclose(np.asarray(weights), 2.5 * np.asarray(unscaled), rtol=1e-6)


def test_route_group_limited_with_negative_biased_scores():
    """A bias below -sigmoid(logit) makes the open group's scores negative: transformers still
    chooses inside the open group (the closed ones are -inf)."""
    logits = np.zeros((1, 4), np.float32)  # every score 0.5
    bias = np.array([-0.6, -0.7, -0.9, -0.9], np.float32)  # biased: -0.1, -0.2 | -0.4, -0.4
    weights, experts = route(logits, 2, scoring="sigmoid", selection_bias=bias, groups=2, top_groups=1)
    _, expected_experts = numpy_route(logits, 2, scoring="sigmoid", selection_bias=bias, groups=2, top_groups=1)
    assert expected_experts.tolist() == [[0, 1]]
    np.testing.assert_array_equal(by_expert(weights, experts)[1], expected_experts)


def test_config_defaults_follow_transformers():
    """Absent keys take transformers' config class defaults, which differ from Mistral's and Qwen2's."""
    base = {k: v for k, v in MIXTRAL.items() if k not in ("num_local_experts", "num_experts_per_tok")}
    mixtral, experts = read_config({**base, "model_type": "mixtral"})
    assert (experts.num_experts, experts.num_experts_per_tok, experts.norm_topk_prob) == (8, 2, True)
    assert mixtral.rms_norm_eps == 1e-5 and mixtral.rope.theta == 1e6 and mixtral.sliding_window is None
    assert not mixtral.qkv_bias and experts.shared_intermediate_size is None
    assert experts.moe_intermediate_size == MIXTRAL["intermediate_size"] and mixtral.model_type == "mixtral"
    qwen, experts = read_config(
        {
            "model_type": "qwen2_moe",
            **{k: QWEN2_MOE[k] for k in ("vocab_size", "intermediate_size", "num_hidden_layers")},
            "hidden_size": 64,
            "num_attention_heads": 16,
        }
    )
    assert (experts.num_experts, experts.num_experts_per_tok, experts.norm_topk_prob) == (60, 4, False)
    assert (experts.moe_intermediate_size, experts.shared_intermediate_size) == (1408, 5632)
    assert qwen.qkv_bias and qwen.num_key_value_heads == 16 and qwen.rms_norm_eps == 1e-6
    assert not read_config({**QWEN2_MOE, "model_type": "qwen2_moe", "qkv_bias": False})[0].qkv_bias


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(mlp_only_layers=[1, "2"]), "config.json: 'mlp_only_layers' must be a list of layer indices"),
        (dict(decoder_sparse_step=0), "config.json: 'decoder_sparse_step' must be a positive integer"),
        (dict(num_experts_per_tok=7), "config.json: 'num_experts_per_tok' (7) is more than 'num_experts' (6)"),
        (dict(num_experts=0), "config.json: 'num_experts' must be a positive integer"),
        (dict(model_type="qwen3_next"), "config.json: 'model_type' 'qwen3_next' is not supported"),
    ],
)
def test_config_refuses_in_one_line(change, message):
    """A config port cannot read is refused in one line naming the key."""
    with pytest.raises(ConfigError) as raised:
        read_config({**QWEN2_MOE, "model_type": "qwen2_moe", **change})
    assert str(raised.value).startswith(message) and "\n" not in str(raised.value)


def test_mlp_only_layers_beyond_the_model_change_nothing():
    """transformers only consults mlp_only_layers for layers that exist."""
    _, experts = read_config({**QWEN2_MOE, "model_type": "qwen2_moe", "mlp_only_layers": [5]})
    assert experts.num_experts == 6 and experts.kinds == ("blocks", "blocks")


@pytest.mark.parametrize("model_type", ["qwen2_moe", "qwen3_moe"])
def test_dense_layers_as_transformers_places_them(model_type):
    """Layer i is sparse unless listed in mlp_only_layers or (i + 1) % decoder_sparse_step != 0
    (transformers' Qwen2MoeDecoderLayer / Qwen3MoeDecoderLayer); the model stacks each kind apart."""
    base = {**QWEN3_MOE, "model_type": model_type, "num_hidden_layers": 6}
    _, experts = read_config({**base, "decoder_sparse_step": 2, "mlp_only_layers": [3]})
    assert experts.kinds == ("dense", "blocks", "dense", "dense", "dense", "blocks")
    model = eqx.filter_eval_shape(Moe.from_config, {**base, "mlp_only_layers": [0, 4]}, key=jax.random.key(0))
    assert model.layer_groups == {"blocks": (1, 2, 3, 5), "dense": (0, 4)}
    assert model.blocks.mlp.router.shape == (4, 6, 48) and model.dense.mlp.gate.shape == (2, 56, 48)


def test_abstract_model_shapes():
    model = eqx.filter_eval_shape(Moe.from_config, {**MIXTRAL_8X7B}, key=jax.random.key(0))
    mlp = model.blocks.mlp
    assert mlp.router.shape == (32, 8, 4096)
    assert mlp.experts.gate.shape == mlp.experts.up.shape == (32, 8, 14336, 4096)
    assert mlp.experts.down.shape == (32, 8, 4096, 14336)
    assert mlp.shared is None and mlp.shared_gate is None and mlp.top_k == 2
    assert model.blocks.attn.wk.shape == (32, 8, 128, 4096)


# ---------------------------------------------------------------- the cost follows top-k


def jaxpr_of(module, x, grad=False):
    """The jaxpr of `module(x)`, or of the gradient of its sum (parameters and input)."""
    params, static = eqx.partition(module, lambda a: isinstance(a, (jax.Array, jax.ShapeDtypeStruct)))

    def run(p, x):
        return eqx.combine(p, static)(x)

    if grad:
        run = jax.grad(lambda p, x: eqx.combine(p, static)(x).astype(np.float32).sum(), argnums=(0, 1))
    return jax.make_jaxpr(run)(params, x).jaxpr


@pytest.mark.parametrize("name", ["mixtral", "qwen2-moe"])
def test_no_expert_runs_on_every_token(name):
    """The MoE layer of each family, forward and backward: the experts run as grouped matmuls
    (ragged_dot_general) on the tokens x top_k (token, expert) rows, and no matmul has an
    output with both an experts and a tokens axis but the router's [tokens, experts] logits
    (a dense dispatch would have [experts, tokens, ...])."""
    arch, config = CASES[name]
    llama, c = read_config({**config, "model_type": "mixtral" if arch == "Mixtral" else "qwen2_moe"})
    moe = c.mlp(llama, jnp.float32, jax.random.key(0))
    assert isinstance(moe, MoE) and (moe.shared_gate is not None) == (arch == "Qwen2Moe")
    x = jnp.ones((3, 7, llama.hidden_size))
    tokens, experts, rows = 21, c.num_experts, 21 * c.num_experts_per_tok
    sizes = {tokens, experts, rows, llama.hidden_size, c.moe_intermediate_size, c.shared_intermediate_size}
    assert len(sizes - {None}) == 5 + (arch == "Qwen2Moe")  # every axis recognisable by its size
    for grad in (False, True):
        eqns = list(equations(jaxpr_of(moe, x, grad)))
        ragged = [e for e in eqns if e.primitive.name == "ragged_dot_general"]
        assert len(ragged) == (9 if grad else 3)
        for e in ragged:
            assert rows in e.invars[0].aval.shape and e.invars[2].aval.shape == (experts,)
        for e in eqns:
            if e.primitive.name in ("dot_general", "ragged_dot_general"):
                shape = e.outvars[0].aval.shape
                if experts in shape and (tokens in shape or rows in shape):
                    assert e.primitive.name == "dot_general" and shape == (tokens, experts), (e, shape)
        assert (
            sum(e.primitive.name == "dot_general" and e.outvars[0].aval.shape == (tokens, experts) for e in eqns) == 1
        )  # the router


def test_mixtral_top_2_sends_a_quarter_of_the_rows_of_top_8(monkeypatch, capsys):
    """Mixtral-8x7B's MoE layer (8 experts) at top-2 and at top-8: the (token, expert) rows entering
    the grouped matmuls, and the group sizes, are 4x fewer at top-2. Reports XLA's cost analysis
    of both on Mixtral's real sizes (compiled from shapes only: on CPU ragged_dot is costed as
    a dense matmul per group, so the figures are reported, not compared)."""
    import port.nn._moe

    llama, config = read_config(MIXTRAL_8X7B)
    # Small widths, Mixtral's routing, run eagerly to see the group sizes.
    small, narrow = dataclasses.replace(config, moe_intermediate_size=96), dataclasses.replace(llama, hidden_size=64)
    x = jax.random.normal(jax.random.key(1), (2, 16, 64))
    seen = {}
    real_grouped = port.nn._moe.grouped

    def grouped(h, w, sizes):
        seen.setdefault(k, []).append((h.shape[0], np.asarray(sizes)))
        return real_grouped(h, w, sizes)

    monkeypatch.setattr(port.nn._moe, "grouped", grouped)
    for k in (2, 8):
        moe = dataclasses.replace(small, num_experts_per_tok=k).mlp(narrow, jnp.float32, jax.random.key(0))
        moe(x)
        assert len(seen[k]) == 3  # gate, up, down
        for rows, sizes in seen[k]:
            assert rows == 32 * k and sizes.shape == (8,) and sizes.sum() == rows
    assert seen[8][0][0] == 4 * seen[2][0][0]
    np.testing.assert_array_equal(seen[8][0][1], np.full(8, 32))  # top-8 of 8: every expert, every token
    assert (seen[2][0][1] < 32).all()
    monkeypatch.undo()

    x = jax.ShapeDtypeStruct((2, 256, llama.hidden_size), jnp.bfloat16)
    rows, flops = {}, {}
    for k in (2, 8):
        moe = eqx.filter_eval_shape(
            dataclasses.replace(config, num_experts_per_tok=k).mlp, llama, jnp.bfloat16, jax.random.key(0)
        )
        ragged = [e for e in equations(jaxpr_of(moe, x)) if e.primitive.name == "ragged_dot_general"]
        rows[k] = {e.invars[0].aval.shape[0] for e in ragged}
        params, static = eqx.partition(moe, lambda a: isinstance(a, jax.ShapeDtypeStruct))
        compiled = jax.jit(lambda p, x, static=static: eqx.combine(p, static)(x)).lower(params, x).compile()
        cost = compiled.cost_analysis()
        flops[k] = (cost[0] if isinstance(cost, list) else cost)["flops"]
    assert rows == {2: {512 * 2}, 8: {512 * 8}}
    with capsys.disabled():
        print(
            f"\nMixtral-8x7B MoE layer, 512 tokens, bfloat16, XLA cost_analysis on {jax.default_backend()}: "
            f"top-2 {flops[2]:.4g} flops, top-8 {flops[8]:.4g} flops (ratio {flops[8] / flops[2]:.3g})"
        )
