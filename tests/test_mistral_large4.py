"""Mistral Large 4 (`mistral_large4`): port's `MistralLarge4`, converted by the shipped mapping, against `transformers`.

Tiny random `MistralLarge4ForConditionalGeneration`s written by `save_pretrained` (Mistral's
own key names, one tensor per expert, a one-layer vision tower the mapping ignores) and
loaded by `port.load`: the logits are transformers' on one device, on 4x2 and with the
experts on an `expert` axis, in float32 and bfloat16. The case has a dense layer before
two MoE layers (the last a NoPE layer), group-limited softmax routing (4 groups, 2 open, top 3), two shared experts,
a `routed_scaling_factor` of 1.5, LeRoPE's `alpha`, the queries' scale by position and the
norms perturbed (each shown to matter), YaRN and the logits' soft cap; sparse attention
keeps 3 keys per query of sequences of 8 (`index_topk`, shown to matter). `port.export`
gives back the language model's tensors bit for bit, and the
options the module does not run are refused in one line before any tensor byte is read.
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
from jax.sharding import PartitionSpec as P

import port
from port._errors import ConfigError
from port.models.mistral_large4 import MistralLarge4, MistralLarge4Config

from helpers import (
    VOCAB,
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
SEQ = 8
TOP_K = 3  # each query attends to 3 of up to 8 keys
TEXT = dict(
    vocab_size=VOCAB,
    hidden_size=48,
    intermediate_size=72,
    moe_intermediate_size=20,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=4,
    n_routed_experts=8,
    num_experts_per_tok=3,
    n_group=4,
    topk_group=2,
    n_shared_experts=2,
    routed_scaling_factor=1.5,
    first_k_dense_replace=1,
    kv_lora_rank=16,
    qk_nope_head_dim=8,
    qk_rope_head_dim=6,
    v_head_dim=10,
    index_topk=TOP_K,
    index_head_dim=8,
    index_n_heads=8,  # a key scores exactly 0 (a tie) only when all 8 ReLUs are 0
    no_rope_layers=[1, 1, 0],  # the last layer NoPE
    max_position_embeddings=64,
    initializer_range=0.2,
    rms_norm_eps=1e-5,
    bos_token_id=0,
    eos_token_id=2,
    pad_token_id=0,
    rope_parameters=dict(
        rope_type="yarn",
        rope_theta=10000.0,
        factor=4.0,
        original_max_position_embeddings=16,
        beta_fast=32.0,
        beta_slow=1.0,
        attention_factor=1.0,
    ),
    final_logit_softcapping=3.0,
)
# bfloat16 flips the indexer's top-k choice (transformers' own bfloat16 logits differ from its
# float32 ones by more than 1 there): bfloat16 parity is shown where every key is kept.
CASES = {"base": TEXT, "all-keys": dict(TEXT, index_topk=SEQ)}
VISION = dict(
    hidden_size=16, intermediate_size=24, num_hidden_layers=1, num_attention_heads=2, image_size=28, patch_size=14
)
IDS = np.random.default_rng(0).integers(3, VOCAB, (2, SEQ))


def torch_mistral_large4(name, dtype=None):
    """The seeded `MistralLarge4ForConditionalGeneration`, eager attention and experts, with
    the norms, LeRoPE's alpha and the queries' scale by position perturbed."""
    transformers = transformers_or_skip()
    import torch

    torch.manual_seed(0)
    config = transformers.MistralLarge4Config(text_config=dict(CASES[name]), vision_config=dict(VISION))
    config._attn_implementation = "eager"
    config.text_config._attn_implementation = "eager"
    config.text_config._experts_implementation = "eager"
    model = transformers.MistralLarge4ForConditionalGeneration(config)
    model = perturbed(model, lambda n: "norm" in n or "softmax_scaling" in n or "rotary_emb.alpha" in n, 0.3)
    return model if dtype is None else model.to(getattr(torch, dtype))


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """get(name): (its save_pretrained directory, the PyTorch model, its logits)."""
    return saved_once(tmp_path_factory, torch_mistral_large4, IDS)


@pytest.fixture(scope="module")
def loaded(checkpoints):
    """get(name, mesh): the case loaded by port.load on `mesh` (one load per pair)."""
    return loaded_once(checkpoints)


# ---------------------------------------------------------------- parity


def test_save_pretrained_writes_mistrals_own_key_names(checkpoints):
    from safetensors import safe_open

    directory, _, _ = checkpoints("base")
    with safe_open(directory / "model.safetensors", "np") as f:
        keys = set(f.keys())
        assert f.get_slice("layers.1.experts.7.w1.weight").get_shape() == [20, 48]
        assert f.get_slice("layers.0.attention.wkv_a_with_mqa.weight").get_shape() == [16 + 6, 48]
        assert f.get_slice("lerope.alpha").get_shape() == [3]
        assert f.get_slice("layers.2.attention.indexer.wq_b.weight").get_shape() == [8 * 8, 48]
    assert {"tok_embeddings.weight", "output.weight", "layers.2.attention.ssmax_scaling.s"} <= keys
    assert any(k.startswith("vision_encoder.") for k in keys)


@pytest.mark.parametrize("mesh", ["1x1", "4x2"])
def test_logits_match_transformers(checkpoints, loaded, mesh):
    _, _, expected = checkpoints("base")
    model = loaded("base", mesh)
    assert model.layer_groups == {"dense": (0,), "moe": (1,), "dense_nope": (), "moe_nope": (2,)}
    assert model.dense_nope is None and model.moe_nope.attn.mla.wk_rope.shape == (1, 0, 48)
    ours = np.asarray(logits(model, IDS))
    assert ours.shape == (*IDS.shape, VOCAB) and ours.dtype == np.float32
    print(f"float32 on {mesh}: max |ours - transformers| {np.abs(ours - expected).max():.3g}")
    np.testing.assert_allclose(ours, expected, atol=1e-4, rtol=0)
    assert np.abs(ours).max() <= 3.0  # the soft cap
    if mesh == "4x2":
        moe = model.moe.mlp
        assert moe.experts.gate.sharding.spec == P(None, "model", None, "data")
        assert moe.router.sharding.spec == P(None, "model", "data")
        assert model.moe.attn.mla.wk_b.sharding.spec == P(None, "model", None, None)
        assert model.moe.attn.q_scale_slope.sharding.spec == P(None, "model")


def with_field(module, name, value):
    """A copy of the Equinox `module` with its (static) field `name` set to `value`."""
    module = copy.copy(module)
    object.__setattr__(module, name, value)
    return module


def test_lerope_the_query_scale_and_the_routing_matter(checkpoints, loaded):
    """Parity depends on LeRoPE's alpha, the queries' scale by position, the scaling factor,
    the soft cap, the sparse selection and the indexer's own query scale."""
    _, _, expected = checkpoints("base")
    model = loaded("base", "1x1")
    config = dataclasses.replace(model.config, softcap=None)
    for changed in (
        eqx.tree_at(lambda m: m.rope_alpha, model, replace_fn=lambda a: 0 * a),
        eqx.tree_at(lambda m: m.moe.attn.q_scale_slope, model, replace_fn=lambda s: 0 * s),
        eqx.tree_at(lambda m: m.moe.mlp, model, replace_fn=lambda mlp: with_field(mlp, "scale", 1.0)),
        with_field(model, "config", config),
        eqx.tree_at(lambda m: m.moe.attn.indexer, model, replace_fn=lambda i: with_field(i, "top_k", SEQ)),
        eqx.tree_at(lambda m: m.moe.attn.indexer.q_scale_slope, model, replace_fn=lambda s: 0 * s),
    ):
        assert np.abs(np.asarray(logits(changed, IDS)) - expected).max() > 1e-2


def test_logits_match_transformers_with_experts_on_an_expert_axis(checkpoints):
    from jax.sharding import NamedSharding

    directory, _, expected = checkpoints("base")
    shipped = port.load_mapping(MAPPINGS / "mistral_large4.toml")
    mapping = dataclasses.replace(shipped, rules={**shipped.rules, "experts": ("expert",)})
    mesh = port.make_mesh("data=2,expert=2,model=2")
    model = port.load(directory, mesh=mesh, mapping=mapping)
    assert model.moe.mlp.experts.gate.sharding.spec == P(None, "expert", "model", "data")
    rows = jax.device_put(IDS, NamedSharding(mesh, P("data", None)))
    ours = np.asarray(logits(model, rows))
    print(f"float32 on data=2,expert=2,model=2: max |ours - transformers| {np.abs(ours - expected).max():.3g}")
    np.testing.assert_allclose(ours, expected, atol=1e-4, rtol=0)


@pytest.fixture(scope="module")
def bfloat16(tmp_path_factory):
    """The all-keys case in bfloat16: its directory, transformers' logits loaded in bfloat16
    (as `from_pretrained(dtype=torch.bfloat16)` keeps LeRoPE and the router in float32) and
    their own noise (against the same weights in float32)."""
    transformers = transformers_or_skip()
    import torch

    directory = tmp_path_factory.mktemp("bf16")
    torch_mistral_large4("all-keys", dtype="bfloat16").save_pretrained(directory)

    def reference(dtype):
        model = transformers.MistralLarge4ForConditionalGeneration.from_pretrained(
            directory, dtype=dtype, attn_implementation="eager", experts_implementation="eager"
        )
        return torch_logits(model.eval(), IDS)

    expected = reference(torch.bfloat16)
    return directory, expected, np.abs(expected - reference(torch.float32)).max()


@pytest.mark.parametrize("mesh", ["1x1", "4x2", "data=2,expert=2,model=2"])
def test_bfloat16_end_to_end(bfloat16, mesh):
    """A bfloat16 checkpoint stays bfloat16, near transformers' own bfloat16 logits (every key kept)."""
    directory, expected, noise = bfloat16
    ours = port.load(directory, mesh=port.make_mesh(mesh) if "=" in mesh else mesh)
    bf16 = np.dtype(ml_dtypes.bfloat16)
    assert ours.moe.attn.mla.wq.dtype == ours.moe.mlp.experts.gate.dtype == ours.embed.dtype == bf16
    out = np.asarray(logits(ours, IDS)).astype(np.float32)
    error = np.abs(out - expected).max()
    print(f"bfloat16 on {mesh}: max |ours - transformers| {error:.3g}, transformers' own bfloat16 noise {noise:.3g}")
    # The experts a token is routed to may flip in bfloat16 (4x2's sums run in another order).
    assert error <= 4 * noise, (error, noise)


# ---------------------------------------------------------------- export


def test_export_round_trip(checkpoints, loaded, tmp_path):
    """port.load on 4x2, port.export: every language-model tensor byte for byte the source's."""
    from safetensors.numpy import load_file

    directory, _, _ = checkpoints("base")
    out = port.export(loaded("base", "4x2"), tmp_path / "hf", directory).out
    source, written = load_file(directory / "model.safetensors"), load_file(out / "model.safetensors")
    ignored = ("vision_encoder.", "patch_merger.", "pre_mm_projector_norm.", "vision_language_adapter.")
    language = {k: v for k, v in source.items() if not k.startswith(ignored)}
    assert written.keys() == language.keys()
    for key, value in language.items():
        assert written[key].dtype == value.dtype and written[key].tobytes() == value.tobytes(), key


# ---------------------------------------------------------------- refusals, in one line


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(no_rope_layers=[1, 1, 2]), "'no_rope_layers' must be a list of at least 3 0 or 1"),
        (dict(kv_source_layers=[0, 0, 2]), "'kv_source_layers' [0, 0, 2] is not supported"),
        (dict(indexer_types=["full", "shared", "full"]), "an indexer shared across layers ('shared')"),
        (dict(layer_types=["full_attention"] * 3), "only 'indexed_attention' layers are supported"),
        (dict(attention_bias=True), "attention_bias true is not supported"),
        (dict(num_key_value_heads=2), "'num_key_value_heads' (2) must equal 'num_attention_heads' (4)"),
        (dict(n_group=3), "'n_group' (3) must divide 'n_routed_experts' (8)"),
        (dict(mlp_layer_types=["dense", "moe", "sparse"]), "'mlp_layer_types' must be a list of 3 'dense' or 'sparse'"),
        (dict(rope_parameters=dict(rope_type="dynamic", factor=2.0)), "rope type 'dynamic' is not supported"),
    ],
)
def test_config_refuses_in_one_line(change, message):
    wrapper = {"model_type": "mistral_large4", "text_config": {**TEXT, "model_type": "mistral_large4_text", **change}}
    with pytest.raises(ConfigError) as error:
        MistralLarge4Config.from_hf(wrapper)
    assert message in str(error.value) and "\n" not in str(error.value), str(error.value)


@pytest.mark.slow
def test_port_plan_refuses_a_shared_latent_cache_in_one_line(checkpoints, tmp_path):
    source, _, _ = checkpoints("base")
    shutil.copytree(source, tmp_path / "bad")
    config = json.loads((source / "config.json").read_text())
    config["text_config"]["kv_source_layers"] = [0, 0, 2]
    (tmp_path / "bad" / "config.json").write_text(json.dumps(config))
    result = run_port("plan", tmp_path / "bad", "--mesh", "4x2")
    line = one_line(result)
    assert result.returncode != 0 and "'kv_source_layers' [0, 0, 2] is not supported" in line, line


@pytest.mark.slow
def test_port_plan_loads_the_wrappers_language_model_and_lists_the_towers_ignored(checkpoints):
    """The wrapper (`mistral_large4`) loads its language model, keys at the top level; the
    vision encoder and the projector are ignored and listed."""
    directory, _, _ = checkpoints("base")
    result = run_port("plan", directory, "--mesh", "4x2")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "port.models.mistral_large4:MistralLarge4" in result.stdout
    for ignored in ("vision_encoder.patch_conv.weight", "patch_merger.merging_layer.weight", "pre_mm_projector_norm"):
        assert f"ignored: {ignored}" in result.stdout, result.stdout


def test_mlp_layer_types_pick_the_stacks():
    text = {**TEXT, "model_type": "mistral_large4_text", "mlp_layer_types": ["sparse", "dense", "sparse"]}
    c = MistralLarge4Config.from_hf(text)
    assert c.kinds == ("moe", "dense", "moe_nope") and c.softcap == 3.0 and not c.tie_word_embeddings
    abstract = eqx.filter_eval_shape(MistralLarge4, c, key=jax.random.key(0))
    assert abstract.moe.mlp.experts.gate.shape == (1, 8, 20, 48) and abstract.rope_alpha.shape == (3,)
    # A NoPE layer's keys and queries are all non-rotary: 8 + 6 of them.
    assert abstract.moe_nope.attn.mla.wk_b.shape == (1, 4, 14, 16) and abstract.moe.attn.mla.wk_b.shape == (1, 4, 8, 16)
