"""DeepSeek-V3.2 (`deepseek_v32`) and GLM-5 (`glm_moe_dsa`): port's `DeepseekV32`, converted by the
shipped mapping, against `transformers`.

Tiny random checkpoints written by `save_pretrained` (one tensor per expert), loaded by
`port.load`: the logits are transformers' on one device, on 4x2 and with the experts on an
`expert` axis, in float32 and bfloat16. Each keeps `index_topk` 5 of 16 positions (so the
indexer's selection decides the logits: shown by breaking it), a dense layer among MoE
layers (`mlp_layer_types`), DeepSeek-V3's group routing and YaRN. GLM-5's indexer rotates
interleaved pairs. `port.export` gives back the checkpoint bit for bit; a config field the
module does not run is refused in one line before any tensor byte is read; the sparse
attention's compiled cost (XLA's cost analysis) follows `index_topk`, not the cache length.

Gradients, padding, packing, remat, bfloat16 compute, the 4x2 train step and greedy
generation with the cache are tests/test_decoders.py's contract.
"""

import dataclasses
import json
import shutil
from pathlib import Path

import equinox as eqx
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import port
from port._errors import ConfigError
from port.models.deepseek_v32 import DeepseekV32, DeepseekV32Config

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
CONFIG = dict(
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
    mlp_layer_types=["sparse", "dense", "sparse"],
    q_lora_rank=24,
    kv_lora_rank=16,
    qk_nope_head_dim=8,
    qk_rope_head_dim=6,
    v_head_dim=10,
    index_topk=5,
    index_head_dim=16,
    index_n_heads=8,
    routed_scaling_factor=1.7,
    n_shared_experts=2,
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
        mscale=0.9,
        mscale_all_dim=1.0,
        beta_fast=32,
        beta_slow=1,
    ),
)
CLASSES = {"deepseek_v32": "DeepseekV32", "glm_moe_dsa": "GlmMoeDsa"}
IDS = np.random.default_rng(0).integers(3, VOCAB, (2, 16))


def torch_model(name, dtype=None, **change):
    """The seeded `{DeepseekV32,GlmMoeDsa}ForCausalLM`, eager attention, norms and the selection bias perturbed."""
    transformers = transformers_or_skip()
    import torch

    torch.manual_seed(0)
    config = getattr(transformers, CLASSES[name] + "Config")(**{**CONFIG, **change})
    config._attn_implementation = "eager"
    config._experts_implementation = "eager"
    model = perturbed(getattr(transformers, CLASSES[name] + "ForCausalLM")(config), lambda n: "norm" in n, 0.2)
    with torch.no_grad():
        for layer in model.model.layers:
            if hasattr(layer.mlp, "gate"):
                bias = layer.mlp.gate.e_score_correction_bias
                bias.add_(0.3 * torch.randn_like(bias))
    return model if dtype is None else model.to(getattr(torch, dtype))


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """get(name): (its save_pretrained directory, the PyTorch model, its logits), one build per case."""
    return saved_once(tmp_path_factory, torch_model, IDS)


@pytest.fixture(scope="module")
def loaded(checkpoints):
    return loaded_once(checkpoints)


# ---------------------------------------------------------------- parity


@pytest.mark.parametrize("mesh", ["1x1", "4x2"])
@pytest.mark.parametrize("name", list(CLASSES))
def test_logits_match_transformers(checkpoints, loaded, name, mesh):
    _, _, expected = checkpoints(name)
    model = loaded(name, mesh)
    assert model.config.kinds == ("moe", "dense", "moe") and model.config.interleave_index == (name == "glm_moe_dsa")
    ours = np.asarray(logits(model, IDS))
    print(f"{name} float32 on {mesh}: max |ours - transformers| {np.abs(ours - expected).max():.3g}")
    np.testing.assert_allclose(ours, expected, atol=1e-4, rtol=0)


@pytest.mark.parametrize("name", list(CLASSES))
def test_the_selection_matters(checkpoints, loaded, name):
    """With every position kept (`index_topk` 16) or the indexer's RoPE laid out the other
    way, the logits are no longer transformers': the selection of 5 decides them."""
    _, _, expected = checkpoints(name)
    model = loaded(name, "1x1")
    for changed in (
        dataclasses.replace(model.config, index_topk=16),
        dataclasses.replace(model.config, interleave_index=not model.config.interleave_index),
    ):
        shape = eqx.filter_eval_shape(DeepseekV32, changed, key=jax.random.key(0))
        rebuilt = jax.tree.unflatten(jax.tree.structure(shape), jax.tree.leaves(model))  # the same weights
        assert np.abs(np.asarray(logits(rebuilt, IDS)) - expected).max() > 1e-2


def test_logits_match_transformers_with_experts_on_an_expert_axis(checkpoints):
    """The shipped mapping with `experts = "expert"` on a `data=2,expert=2,model=2` mesh."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    for name in CLASSES:
        directory, _, expected = checkpoints(name)
        shipped = port.load_mapping(MAPPINGS / "deepseek_v32.toml")
        mapping = dataclasses.replace(shipped, rules={**shipped.rules, "experts": ("expert",)})
        mesh = port.make_mesh("data=2,expert=2,model=2")
        model = port.load(directory, mesh=mesh, mapping=mapping)
        assert model.moe.mlp.experts.gate.sharding.spec == P(None, "expert", "model", "data")
        rows = jax.device_put(IDS, NamedSharding(mesh, P("data", None)))
        ours = np.asarray(logits(model, rows))
        print(
            f"{name} float32 on data=2,expert=2,model=2: max |ours - transformers| {np.abs(ours - expected).max():.3g}"
        )
        np.testing.assert_allclose(ours, expected, atol=1e-4, rtol=0)


@pytest.mark.parametrize("mesh", ["1x1", "4x2", "data=2,expert=2,model=2"])
@pytest.mark.parametrize("name", list(CLASSES))
def test_bfloat16_end_to_end(tmp_path, name, mesh):
    """A bfloat16 checkpoint stays bfloat16, as near transformers' own bfloat16 logits as those
    are to the same weights' float32 logits (twice that at most, and on the mean). Every
    position kept (`index_topk` 16): the indexer's choice is discrete, and bfloat16 rounding
    flips near-tied positions wherever its reduction order differs (in transformers too: its
    own bfloat16 logits then move up to 0.65 from its float32 ones), so the selection is held
    to transformers' in float32 above and the numerics of every layer here."""
    model = torch_model(name, dtype="bfloat16", index_topk=IDS.shape[1])
    model.save_pretrained(tmp_path)
    ours = port.load(tmp_path, mesh=mesh if "=" not in mesh else port.make_mesh(mesh))
    assert ours.moe.attn.indexer.wq.dtype == ours.embed.dtype == np.dtype(ml_dtypes.bfloat16)
    out = np.asarray(logits(ours, IDS)).astype(np.float32)
    expected = torch_logits(model, IDS)
    exact = torch_logits(model.float(), IDS)
    noise, error = np.abs(expected - exact), np.abs(out - expected)
    print(
        f"{name} bfloat16 on {mesh}: max |ours - transformers| {error.max():.3g} (mean {error.mean():.3g}), "
        f"transformers' own noise {noise.max():.3g} (mean {noise.mean():.3g})"
    )
    assert error.max() <= 2 * noise.max() and error.mean() <= 2 * noise.mean(), (error.max(), noise.max())


# ---------------------------------------------------------------- export


@pytest.mark.parametrize("name", list(CLASSES))
def test_export_round_trip(checkpoints, loaded, tmp_path, name):
    """port.load on 4x2, port.export, transformers from_pretrained: no missing or unexpected
    key, every tensor byte for byte the source's."""
    from safetensors.numpy import load_file

    transformers = transformers_or_skip()
    import torch

    directory, torch_lm, _ = checkpoints(name)
    out = port.export(loaded(name, "4x2"), tmp_path / "hf", directory).out
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


# ---------------------------------------------------------------- bad config


@pytest.mark.parametrize(
    "name, change, message",
    [
        ("glm_moe_dsa", dict(indexer_types=["full", "shared", "full"]), "'indexer_types' layer 1 \"shared\""),
        ("glm_moe_dsa", dict(index_topk_freq=2), "'indexer_types' layer 2 \"shared\""),
        ("deepseek_v32", dict(layer_types=["full_attention"] * 3), "'layer_types' ['full_attention'"),
        ("deepseek_v32", dict(mlp_layer_types=["dense", "moe", "dense"]), "'mlp_layer_types' must list"),
        ("deepseek_v32", dict(q_lora_rank=None), "required key 'q_lora_rank' is missing"),
        ("deepseek_v32", dict(index_head_dim=4), "'qk_rope_head_dim' (6) is more than 'index_head_dim' (4)"),
        ("deepseek_v32", dict(index_topk=0), "'index_topk' must be a positive integer"),
    ],
)
def test_config_refuses_in_one_line(name, change, message):
    with pytest.raises(ConfigError) as raised:
        DeepseekV32Config.from_hf({"model_type": name, **CONFIG, **change})
    assert "\n" not in str(raised.value) and message in str(raised.value), str(raised.value)


@pytest.mark.slow
def test_port_refuses_shared_indexer_layers(checkpoints, tmp_path):
    """`port check`, `port plan` and `port convert` of a GLM-5 whose config asks for shared
    indexer layers: one line naming the field and the module, nothing written."""
    directory = tmp_path / "glm"
    shutil.copytree(checkpoints("glm_moe_dsa").directory, directory)
    config = json.loads((directory / "config.json").read_text())
    config["indexer_types"] = ["full", "full", "shared"]
    (directory / "config.json").write_text(json.dumps(config))
    line = (
        "config.json: 'indexer_types' layer 2 \"shared\" (reusing an earlier layer's top-k) "
        'is not supported by port.models.deepseek_v32 (supported: every layer "full")'
    )
    one_line(run_port("check", MAPPINGS / "deepseek_v32.toml", directory), line)
    one_line(run_port("plan", directory), line)
    out = tmp_path / "out"
    one_line(run_port("convert", directory, "--out", out), line, out=out)


# ---------------------------------------------------------------- the cost follows index_topk


def decode_flops(length: int, top_k: int) -> float:
    """XLA's FLOPs for one decoding step of one sparse attention layer over a cache of `length`."""
    from port.nn import Indexer, LatentAttention, SparseLatentAttention

    k1, k2 = jax.random.split(jax.random.key(0))
    mla = LatentAttention(
        heads=16, embd=512, q_rank=256, kv_rank=256, nope_dim=64, rope_dim=32, v_dim=64, dtype=jnp.float32, key=k1
    )
    indexer = Indexer(heads=4, dim=64, q_rank=256, embd=512, rope_dim=32, top_k=top_k, dtype=jnp.float32, key=k2)
    attn = SparseLatentAttention(mla, indexer)
    x = jnp.zeros((1, 1, 512))
    mask = jnp.ones((1, 1, length), bool)
    cos, sin = jnp.ones((1, 1, 16)), jnp.zeros((1, 1, 16))
    kv = (jnp.zeros((1, length, 1, 256)), jnp.zeros((1, length, 1, 32 + 64)))
    step = jax.jit(lambda a, x, kv: a(x, mask, cos=cos, sin=sin, kv=kv, index=jnp.int32(0))[0])
    return float(step.lower(attn, x, kv).compile().cost_analysis()["flops"])


def test_the_sparse_attention_cost_follows_index_topk():
    """A decoding step over 8192 cached keys costs about what one over 2048 does with the same
    `index_topk` (only the small indexer scores every key), and much less than attending to
    every key (`index_topk` = the cache)."""
    rows = {(n, k): decode_flops(n, k) for n, k in ((2048, 256), (8192, 256), (2048, 2048), (8192, 8192))}
    for (n, k), flops in rows.items():
        print(f"sparse attention decode step: keys {n}, index_topk {k}: {flops:.4g} FLOPs")
    indexer_share = rows[8192, 256] - rows[2048, 256]
    assert rows[8192, 256] < 0.2 * rows[8192, 8192]
    assert indexer_share < 0.25 * (rows[8192, 8192] - rows[2048, 2048])
