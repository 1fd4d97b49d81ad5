"""Logits of the converted, sharded JAX model match `transformers` GPT2LMHeadModel."""

import equinox as eqx
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import port
from conftest import INPUT_IDS, torch_gpt2, torch_logits

MESHES = ["1x1", "2x2", "4x2", "8x1"]


@eqx.filter_jit
def logits(model, ids):
    return model(ids)


def convert(directory, mesh, dtype=None):
    with port.open_checkpoint(directory) as ckpt:
        mapping = port.mapping_for(ckpt.config)
        skeleton = port.skeleton(mapping, ckpt.config)
        recipe = port.plan(skeleton, mapping, ckpt.tensors, ckpt.config, mesh.shape, dtype)
        return port.fill(skeleton, port.place(recipe, ckpt, mesh)), recipe


@pytest.mark.parametrize("mesh_spec", MESHES)
@pytest.mark.parametrize("layout", ["lm", "base", "sharded"])
def test_logits_match_transformers(gpt2_checkpoints, layout, mesh_spec):
    directories, expected = gpt2_checkpoints
    mesh = port.make_mesh(mesh_spec)
    model, recipe = convert(directories[layout], mesh)
    assert np.abs(np.asarray(logits(model, INPUT_IDS)) - expected).max() < 1e-4
    arrays = port._skeleton.leaves(model)
    assert set(arrays) == {leaf.path for leaf in recipe.leaves}
    for leaf in recipe.leaves:
        assert arrays[leaf.path].sharding == NamedSharding(mesh, leaf.spec), leaf.path
        assert arrays[leaf.path].dtype == np.float32


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


def test_plan_says_vocab_is_replicated(gpt2_checkpoints):
    directories, _ = gpt2_checkpoints
    with port.open_checkpoint(directories["lm"]) as ckpt:
        mapping = port.mapping_for(ckpt.config)
        recipe = port.plan(port.skeleton(mapping, ckpt.config), mapping, ckpt.tensors, ckpt.config,
                           {"data": 4, "model": 2})
    wte = next(leaf for leaf in recipe.leaves if leaf.path == "wte")
    assert wte.notes == ("vocab 101 not divisible by model=2: replicated on model",)
    assert wte.device_bytes == 101 * 16 * 4


def test_bfloat16_checkpoint_stays_bfloat16(tmp_path):
    import ml_dtypes
    import torch

    model = torch_gpt2(seed=1).to(torch.bfloat16)
    model.save_pretrained(tmp_path)
    mesh = port.make_mesh("4x2")
    converted, recipe = convert(tmp_path, mesh)
    for leaf in recipe.leaves:  # no cast anywhere: bfloat16 bytes go straight to the device
        assert leaf.source_dtype == leaf.dtype == np.dtype(ml_dtypes.bfloat16)
        assert "cast" not in str(leaf.chain)
    ours = np.asarray(logits(converted, INPUT_IDS)).astype(np.float32)
    expected = torch_logits(model)
    scale = np.abs(expected).max()
    assert np.abs(ours - expected).max() < 0.05 * scale


@pytest.mark.parametrize("source, target", [("float16", "float32"), ("float32", "bfloat16")])
def test_dtype_conversion(tmp_path, source, target):
    import torch

    model = torch_gpt2(seed=2).to(getattr(torch, source))
    model.save_pretrained(tmp_path)
    mesh = port.make_mesh("2x2")
    converted, recipe = convert(tmp_path, mesh, dtype=target)
    assert all(leaf.dtype.name == target and leaf.source_dtype.name == source for leaf in recipe.leaves)
    assert all(str(leaf.chain).endswith(f"cast({target})") for leaf in recipe.leaves)
    ours = np.asarray(logits(converted, INPUT_IDS)).astype(np.float32)
    expected = torch_logits(model.float())
    tolerance = 1e-4 if target == "float32" else 0.05 * np.abs(expected).max()
    assert np.abs(ours - expected).max() < tolerance
