"""GPT-2: port's model, converted by the shipped `mappings/gpt2.toml`, against `transformers`.

Parity goes through the converter: a `GPT2LMHeadModel` (or `GPT2Model`) written by
`save_pretrained`, loaded by `port`, gives the same logits on meshes of every shape,
in every dtype. The tests that build a `transformers` model skip without PyTorch.
"""

import equinox as eqx
import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import port
from port._errors import PortError
from port.models.gpt2 import GPT2, GPT2Config

from helpers import GPT2_CONFIG, INPUT_IDS, VOCAB, converted, logits, torch_gpt2, torch_logits, transformers_or_skip


def convert(directory, mesh, dtype=None):
    """The model and its plan, step by step as `port.convert` takes them."""
    with port.open_checkpoint(directory) as ckpt:
        mapping = port.mapping_for(ckpt.config)
        skeleton = port.skeleton(mapping, ckpt.config)
        recipe = port.plan(skeleton, mapping, ckpt.tensors, ckpt.config, mesh.shape, dtype)
        return port.fill(skeleton, port.place(recipe, ckpt, mesh)), recipe


# ---------------------------------------------------------------- parity


@pytest.mark.parametrize("mesh_spec", ["1x1", "2x2", "4x2", "8x1"])
@pytest.mark.parametrize("layout", ["lm", "base", "sharded"])
def test_logits_match_transformers(gpt2_checkpoints, layout, mesh_spec):
    """Each layout `save_pretrained` writes (tied LM head, bare GPT2Model, sharded with an index)."""
    directories, expected = gpt2_checkpoints
    mesh = port.make_mesh(mesh_spec)
    model, recipe = convert(directories[layout], mesh)
    ours = np.asarray(logits(model, INPUT_IDS))
    assert ours.shape == (*INPUT_IDS.shape, VOCAB)
    assert np.abs(ours - expected).max() < 1e-4
    arrays = port._skeleton.leaves(model)
    assert set(arrays) == {leaf.path for leaf in recipe.leaves}
    for leaf in recipe.leaves:
        assert arrays[leaf.path].sharding == NamedSharding(mesh, leaf.spec), leaf.path
        assert arrays[leaf.path].dtype == np.float32


def test_config_options_match_transformers(tmp_path):
    """Exact GELU, another epsilon, attention scaled by layer: read from config.json as transformers
    reads them (undoing any one moves these logits by over ten times the tolerance; the defaults are above)."""
    model = torch_gpt2(activation_function="gelu", layer_norm_epsilon=1e-3, scale_attn_by_inverse_layer_idx=True)
    ours = np.asarray(logits(converted(model, tmp_path), INPUT_IDS))
    np.testing.assert_allclose(ours, torch_logits(model), atol=1e-4, rtol=0)


def test_megatron_and_fsdp_layout_on_4x2(gpt2_checkpoints):
    directories, _ = gpt2_checkpoints
    model = port.load(directories["lm"], mesh=port.make_mesh("4x2"))
    specs = {
        "wte": P(None, "data"),  # vocab 101 is not divisible by model=2
        "wpe": P(None, "data"),
        "blocks.attn.wq": P(None, "data", "model", None),
        "blocks.attn.bq": P(None, "model", None),
        "blocks.attn.wo": P(None, "model", None, "data"),
        "blocks.mlp.w_fc": P(None, "data", "model"),
        "blocks.mlp.w_proj": P(None, "model", "data"),
        "ln_f.weight": P("data"),
    }
    arrays = port._skeleton.leaves(model)
    for path, spec in specs.items():
        assert arrays[path].sharding.spec == spec, path
    # Shard shapes: wq [layers, embed/4, heads/2, head_dim]
    assert arrays["blocks.attn.wq"].addressable_shards[0].data.shape == (2, 16, 2, 16)


def test_bfloat16_checkpoint_stays_bfloat16(tmp_path):
    transformers_or_skip()
    import ml_dtypes
    import torch

    model = torch_gpt2(seed=1).to(torch.bfloat16)
    model.save_pretrained(tmp_path)
    mesh = port.make_mesh("4x2")
    ours, recipe = convert(tmp_path, mesh)
    for leaf in recipe.leaves:  # no cast anywhere: bfloat16 bytes go straight to the device
        assert leaf.source_dtype == leaf.dtype == np.dtype(ml_dtypes.bfloat16)
        assert "cast" not in str(leaf.chain)
    ours = np.asarray(logits(ours, INPUT_IDS)).astype(np.float32)
    expected = torch_logits(model)
    scale = np.abs(expected).max()
    assert np.abs(ours - expected).max() < 0.05 * scale


@pytest.mark.parametrize("source, target", [("float16", "float32"), ("float32", "bfloat16")])
def test_dtype_conversion(tmp_path, source, target):
    transformers_or_skip()
    import torch

    model = torch_gpt2(seed=2).to(getattr(torch, source))
    model.save_pretrained(tmp_path)
    mesh = port.make_mesh("2x2")
    ours, recipe = convert(tmp_path, mesh, dtype=target)
    assert all(leaf.dtype.name == target and leaf.source_dtype.name == source for leaf in recipe.leaves)
    assert all(str(leaf.chain).endswith(f"cast({target})") for leaf in recipe.leaves)
    ours = np.asarray(logits(ours, INPUT_IDS)).astype(np.float32)
    expected = torch_logits(model.float())
    tolerance = 1e-4 if target == "float32" else 0.05 * np.abs(expected).max()
    assert np.abs(ours - expected).max() < tolerance


# ---------------------------------------------------------------- the module and its config


def test_stacked_field_shapes():
    model = eqx.filter_eval_shape(GPT2.from_config, GPT2_CONFIG, key=jax.random.key(0))
    assert model.blocks.attn.wq.shape == (2, 64, 4, 16)
    assert model.blocks.attn.wo.shape == (2, 4, 16, 64)
    assert model.blocks.mlp.w_fc.shape == (2, 64, 256)
    assert model.blocks.ln_1.weight.shape == (2, 64)
    assert model.ln_f.weight.shape == (64,)


def test_config_rejects_unknown_activation():
    with pytest.raises(PortError, match="activation_function"):
        GPT2Config.from_hf({**GPT2_CONFIG, "activation_function": "mish"})


def test_config_rejects_missing_n_embd():
    config = {k: v for k, v in GPT2_CONFIG.items() if k != "n_embd"}
    with pytest.raises(PortError, match="n_embd"):
        GPT2Config.from_hf(config)
