"""GLM-4.5 / 4.6 / 4.7 (`glm4_moe`): port's `Glm4Moe`, converted by the shipped mapping, against `transformers`.

Tiny random `Glm4MoeForCausalLM`s written by `save_pretrained` (one tensor per expert) and
loaded by `port.load`: the logits are transformers' on one device, on 4x2 and with the
experts on an `expert` axis, in float32 and bfloat16. The "glm" case is the released
models' shape: partial rotary (the default factor 0.5 of a `head_dim` of 16, not hidden /
heads), per-head q/k RMSNorm (`use_qk_norm`), q/k/v biases, one dense layer before two MoE
layers with group-limited sigmoid routing (4 groups, 2 open), two shared experts, a
`routed_scaling_factor` of 1.7 and a perturbed `e_score_correction_bias` (shown to matter);
the "plain" case has none of the options, a quarter of each head rotating and one group.
`port.export` gives back the checkpoint bit for bit, the multi-token-prediction layer is
ignored by the mapping's rule, and a config.json port cannot run fails in one line before
any tensor byte is read.

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
from port._errors import ConfigError, PlanError
from port.models.glm4_moe import Glm4Moe, read_config

from helpers import VOCAB, logits, one_line, perturbed, run_port, saved_once, torch_logits, transformers_or_skip

MAPPINGS = Path(__file__).resolve().parents[1] / "mappings"
CONFIG = dict(
    vocab_size=VOCAB,
    hidden_size=48,
    head_dim=16,
    intermediate_size=72,
    moe_intermediate_size=20,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    n_routed_experts=8,
    num_experts_per_tok=3,
    n_group=4,
    topk_group=2,
    first_k_dense_replace=1,
    n_shared_experts=2,
    routed_scaling_factor=1.7,
    attention_bias=True,
    use_qk_norm=True,
    max_position_embeddings=64,
    initializer_range=0.2,
    rms_norm_eps=1e-5,
    bos_token_id=0,
    eos_token_id=2,
    pad_token_id=0,
)
PLAIN = dict(
    CONFIG,
    attention_bias=False,
    use_qk_norm=False,
    n_group=1,
    topk_group=1,
    rope_parameters=dict(rope_type="default", rope_theta=1e6, partial_rotary_factor=0.25),
)
# name: (config, dtype, torch seed). The bfloat16 case's seed keeps every token's routing 0.013 or more
# from a tie (the 3rd and 4th open experts' scores, the 2nd and 3rd groups'): seed 0's 0.003, at one
# token, flipped on 4x2 under bfloat16's rounding (that token's logits 0.5 off, the rest within noise).
CASES = {"glm": (CONFIG, None, 0), "plain": (PLAIN, None, 0), "glm-bf16": (CONFIG, "bfloat16", 2)}
IDS = np.random.default_rng(0).integers(3, VOCAB, (2, 16))
EXPERT_MESH = "data=2,expert=2,model=2"


def torch_glm(name):
    """The case's seeded `Glm4MoeForCausalLM`, eager, norms, biases and the selection bias perturbed."""
    transformers = transformers_or_skip()
    import torch

    values, dtype, seed = CASES[name]
    torch.manual_seed(seed)
    config = transformers.Glm4MoeConfig(**values)
    config._attn_implementation = "eager"
    config._experts_implementation = "eager"  # torch's grouped_mm wants 16-byte strides in bfloat16
    model = perturbed(transformers.Glm4MoeForCausalLM(config), lambda n: "norm" in n or "bias" in n, 0.2)
    with torch.no_grad():
        for layer in model.model.layers[config.first_k_dense_replace :]:
            bias = layer.mlp.gate.e_score_correction_bias
            bias.add_(0.3 * torch.randn_like(bias))
    return model if dtype is None else model.to(getattr(torch, dtype))


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """get(name): (its save_pretrained directory, the PyTorch model, its logits), one build per case."""
    return saved_once(tmp_path_factory, torch_glm, IDS)


@pytest.fixture(scope="module")
def loaded(checkpoints):
    """get(name, mesh): the case loaded by port.load on `mesh` (one load per pair); the expert
    mesh with the shipped mapping's experts on its `expert` axis."""
    made = {}

    def get(name, mesh):
        if (name, mesh) not in made:
            directory = checkpoints(name).directory
            if mesh == EXPERT_MESH:
                shipped = port.load_mapping(MAPPINGS / "glm4_moe.toml")
                mapping = dataclasses.replace(shipped, rules={**shipped.rules, "experts": ("expert",)})
                made[name, mesh] = port.load(directory, mesh=port.make_mesh(mesh), mapping=mapping)
            else:
                made[name, mesh] = port.load(directory, mesh=mesh)
        return made[name, mesh]

    return get


def ours_on(model, mesh):
    """The model's logits for `IDS`, float32, the rows on `data` of a named mesh."""
    ids = IDS
    if mesh == EXPERT_MESH:
        ids = jax.device_put(IDS, NamedSharding(model.embed.sharding.mesh, P("data", None)))
    return np.asarray(logits(model, ids)).astype(np.float32)


def recipe_for(directory, mesh_shape, mapping=None):
    """The plan for the checkpoint at `directory` (headers only), and the bytes read making it."""
    with port.open_checkpoint(directory) as ckpt:
        mapping = port.mapping_for(ckpt.config) if mapping is None else mapping
        try:
            return port.plan(port.skeleton(mapping, ckpt.config), mapping, ckpt.tensors, ckpt.config, mesh_shape)
        finally:
            assert ckpt.bytes_read == 0


# ---------------------------------------------------------------- parity


def test_the_config_reads_partial_rotary_qk_norm_biases_and_routing():
    llama, experts = read_config({**CONFIG, "model_type": "glm4_moe"})
    assert (llama.head_dim, llama.rope.rotary_dim, llama.qk_norm, llama.qkv_bias, llama.o_bias) == (
        16,
        8,
        "head",
        True,
        False,
    )
    assert experts.kinds == ("dense", "moe", "moe") and (experts.n_group, experts.topk_group) == (4, 2)
    llama, experts = read_config({**PLAIN, "model_type": "glm4_moe"})
    assert (llama.rope.rotary_dim, llama.rope.theta, llama.qk_norm, llama.qkv_bias) == (4, 1e6, None, False)


@pytest.mark.parametrize("name, mesh", [("glm", "1x1"), ("glm", "4x2"), ("glm", EXPERT_MESH), ("plain", "1x1")])
def test_logits_match_transformers(checkpoints, loaded, name, mesh):
    _, _, expected = checkpoints(name)
    model = loaded(name, mesh)
    assert model.layer_groups == {"dense": (0,), "moe": (1, 2)}
    ours = ours_on(model, mesh)
    assert ours.shape == (*IDS.shape, VOCAB)
    print(f"{name} float32 on {mesh}: max |ours - transformers| {np.abs(ours - expected).max():.3g}")
    np.testing.assert_allclose(ours, expected, atol=1e-4, rtol=0)
    assert (model.moe.attn.q_norm is None) == (model.dense.attn.bq is None) == (name == "plain")
    moe = model.moe.mlp
    if mesh == "4x2":
        assert moe.experts.gate.sharding.spec == P(None, "model", None, "data")
        assert moe.shared.down.sharding.spec == P(None, "data", "model")
        assert model.dense.attn.wk.sharding.spec == P(None, "model", None, "data")
    if mesh == EXPERT_MESH:
        assert moe.experts.gate.sharding.spec == P(None, "expert", "model", "data")
        assert moe.selection_bias.sharding.spec == P(None, "expert")


@pytest.mark.parametrize("mesh", ["1x1", "4x2", EXPERT_MESH])
def test_bfloat16_matches_transformers(checkpoints, loaded, mesh):
    """A bfloat16 checkpoint stays bfloat16 (the router's float32 weight and bias, which
    transformers keeps float32, stay float32), near transformers' own bfloat16 logits."""
    _, torch_lm, expected = checkpoints("glm-bf16")
    model = loaded("glm-bf16", mesh)
    bf16 = np.dtype(ml_dtypes.bfloat16)
    assert model.moe.attn.wq.dtype == model.moe.mlp.experts.gate.dtype == model.embed.dtype == bf16
    ours = ours_on(model, mesh)
    bf16_noise = np.abs(expected - torch_logits(torch_lm.float(), IDS)).max()  # the same weights in float32
    torch_lm.bfloat16()
    error = np.abs(ours - expected).max()
    print(
        f"bfloat16 on {mesh}: max |ours - transformers| {error:.3g}, transformers' own bfloat16 noise {bf16_noise:.3g}"
    )
    assert error <= 2 * bf16_noise and error < 0.05 * np.abs(expected).max(), (error, bf16_noise)


def with_config(model, **changes):
    """A copy of `model` whose (static) `config` has `changes`."""
    model = copy.copy(model)
    object.__setattr__(model, "config", dataclasses.replace(model.config, **changes))
    return model


def test_the_selection_bias_the_qk_norm_and_the_rotary_split_matter(checkpoints, loaded):
    """Parity depends on `e_score_correction_bias` (which experts are chosen), on the per-head
    q/k norms' weights and on how much of each head rotates."""
    _, _, expected = checkpoints("glm")
    model = loaded("glm", "1x1")
    rope = model.config.rope
    for changed in (
        eqx.tree_at(lambda m: m.moe.mlp.selection_bias, model, replace_fn=lambda b: 0 * b),
        eqx.tree_at(lambda m: m.dense.attn.k_norm, model, replace_fn=lambda w: 0 * w + 1),
        with_config(model, rope=dataclasses.replace(rope, rotary_dim=16)),
    ):
        assert np.abs(ours_on(changed, "1x1") - expected).max() > 1e-2


# ---------------------------------------------------------------- export


def test_export_round_trip(checkpoints, loaded, tmp_path):
    """port.load on 4x2, port.export, transformers from_pretrained: no missing or unexpected
    key, every tensor byte for byte the source's."""
    from safetensors.numpy import load_file

    transformers = transformers_or_skip()
    import torch

    directory, torch_lm, _ = checkpoints("glm")
    out = port.export(loaded("glm", "4x2"), tmp_path / "hf", directory).out
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


# ---------------------------------------------------------------- the multi-token-prediction layer


def with_mtp_layer(source: Path, directory: Path) -> Path:
    """The checkpoint at `source` with a layer 3 appended, as the released checkpoints store
    their multi-token-prediction layer (`model.layers.{num_hidden_layers}.*`)."""
    from safetensors.numpy import load_file, save_file

    tensors = load_file(source / "model.safetensors")
    extra = {k.replace("layers.2.", "layers.3."): v for k, v in tensors.items() if k.startswith("model.layers.2.")}
    h = tensors["model.norm.weight"].shape[0]
    extra |= {
        "model.layers.3.enorm.weight": np.ones(h, np.float32),
        "model.layers.3.hnorm.weight": np.ones(h, np.float32),
        "model.layers.3.eh_proj.weight": np.zeros((h, 2 * h), np.float32),
        "model.layers.3.shared_head.norm.weight": np.ones(h, np.float32),
    }
    directory.mkdir()
    shutil.copy(source / "config.json", directory / "config.json")
    save_file(tensors | extra, directory / "model.safetensors", metadata={"format": "pt"})
    return directory


@pytest.mark.slow
def test_the_mtp_layer_is_ignored_by_the_mappings_rule(checkpoints, tmp_path):
    directory = with_mtp_layer(checkpoints("glm").directory, tmp_path / "mtp")
    recipe = recipe_for(directory, {"data": 4, "model": 2})
    [(rule, resolved, keys)] = recipe.ignored_by_rule
    assert (rule, resolved) == ("layers.{num_hidden_layers}.*", "layers.3.*")
    assert keys and all(k.startswith("model.layers.3.") for k in keys)
    result = run_port("plan", directory, "--mesh", "4x2")
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"ignored: layers.3.* ({len(keys)} tensors, by the mapping's ignore" in result.stdout, result.stdout
    shipped = port.load_mapping(MAPPINGS / "glm4_moe.toml")
    bare = dataclasses.replace(shipped, ignore=tuple(p for p in shipped.ignore if "{" not in p))
    with pytest.raises(PlanError, match=r"tensor 'model\.layers\.3\.[a-z_.]+' is of layer 3, beyond the model's 3"):
        recipe_for(directory, {"data": 4, "model": 2}, bare)


# ---------------------------------------------------------------- bad input, in one line

# zai-org/GLM-4.6's config.json, as the Hub holds it (the values bench/plan.py plans).
GLM_4_6 = {
    "architectures": ["Glm4MoeForCausalLM"],
    "model_type": "glm4_moe",
    "vocab_size": 151552,
    "hidden_size": 5120,
    "head_dim": 128,
    "intermediate_size": 12288,
    "moe_intermediate_size": 1536,
    "num_hidden_layers": 92,
    "num_nextn_predict_layers": 1,
    "num_attention_heads": 96,
    "num_key_value_heads": 8,
    "n_routed_experts": 160,
    "n_shared_experts": 1,
    "num_experts_per_tok": 8,
    "n_group": 1,
    "topk_group": 1,
    "first_k_dense_replace": 3,
    "norm_topk_prob": True,
    "routed_scaling_factor": 2.5,
    "partial_rotary_factor": 0.5,
    "rope_theta": 1000000,
    "rope_scaling": None,
    "use_qk_norm": True,
    "attention_bias": True,
    "hidden_act": "silu",
    "max_position_embeddings": 202752,
    "rms_norm_eps": 1e-05,
    "tie_word_embeddings": False,
}


def test_glm_4_6_shapes():
    abstract = eqx.filter_eval_shape(Glm4Moe.from_config, GLM_4_6, key=jax.random.key(0))
    assert abstract.layer_groups["dense"] == (0, 1, 2) and abstract.config.rope.rotary_dim == 64
    assert abstract.moe.mlp.experts.gate.shape == (89, 160, 1536, 5120)
    assert abstract.dense.attn.wq.shape == (3, 96, 128, 5120) and abstract.dense.attn.bk.shape == (3, 8, 128)
    assert abstract.moe.mlp.shared.gate.shape == (89, 1536, 5120) and abstract.moe.mlp.shared_gate is None


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(first_k_dense_replace=4), "'first_k_dense_replace' (4) is beyond the 3 layers ('num_hidden_layers')"),
        (dict(n_group=3), "'n_group' (3) must divide 'n_routed_experts' (8)"),
        (dict(topk_group=5), "'topk_group' (5) is more than 'n_group' (4)"),
        (dict(num_key_value_heads=3), "'num_key_value_heads' (3) must divide 'num_attention_heads' (4)"),
        (dict(partial_rotary_factor=0.1), "'partial_rotary_factor' 0.1 of head_dim 16 gives 1 rotary dimensions"),
        (dict(rope_parameters=dict(rope_type="dynamic", factor=2.0)), "rope type 'dynamic' is not supported"),
        (dict(use_qk_norm="yes"), "'use_qk_norm'"),
    ],
)
def test_config_refuses_in_one_line(change, message):
    with pytest.raises(ConfigError) as error:
        read_config({**CONFIG, "model_type": "glm4_moe", **change})
    assert message in str(error.value) and "\n" not in str(error.value)


@pytest.mark.slow
def test_the_command_line_refuses_a_config_it_cannot_run_before_reading_a_tensor(checkpoints, tmp_path):
    """`port plan` on a checkpoint whose config.json asks for dynamic RoPE: exit 1, one line
    naming the key; `port convert` the same, nothing written."""
    source = checkpoints("glm").directory
    directory = tmp_path / "dynamic"
    directory.mkdir()
    (directory / "model.safetensors").symlink_to(source / "model.safetensors")
    config = json.loads((source / "config.json").read_text())
    rope = {**config["rope_parameters"], "rope_type": "dynamic", "factor": 2.0}
    (directory / "config.json").write_text(json.dumps({**config, "rope_parameters": rope}))
    one_line(run_port("plan", directory, "--mesh", "1x1"), "rope_parameters: rope type 'dynamic' is not supported")
    out = tmp_path / "out"
    one_line(run_port("convert", directory, "--out", out, "--mesh", "1x1"), "rope type 'dynamic'", out=out)
