"""Llama, Mistral and Qwen2 checkpoints written by `transformers` convert with the same logits."""

import equinox as eqx
import ml_dtypes
import numpy as np
import pytest
import torch
import transformers
from jax.sharding import PartitionSpec as P

import port
from test_llama_model import CASES, SEQ, _hf_model

IDS = np.random.default_rng(0).integers(0, 101, (2, SEQ))
FAMILY = ["llama-gqa", "llama-tied-llama3rope", "mistral-sliding", "qwen2-bias", "llama-attn-mlp-bias"]


@eqx.filter_jit
def logits(model, ids):
    return model(ids)


def torch_logits(model):
    with torch.no_grad():
        return model(torch.tensor(IDS)).logits.float().numpy()


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """Each case saved by save_pretrained, with its PyTorch logits (one build per case)."""
    made = {}

    def get(name):
        if name not in made:
            cls, config_cls, overrides = CASES[name]
            model = _hf_model(cls, config_cls, **overrides)
            directory = tmp_path_factory.mktemp(name)
            model.save_pretrained(directory)
            made[name] = directory, torch_logits(model)
        return made[name]

    return get


@pytest.mark.parametrize("mesh_spec", ["1x1", "4x2"])
@pytest.mark.parametrize("name", FAMILY)
def test_logits_match_transformers(checkpoints, name, mesh_spec):
    directory, expected = checkpoints(name)
    mesh = port.make_mesh(mesh_spec)
    model = port.load(directory, mesh=mesh)
    assert np.abs(np.asarray(logits(model, IDS)) - expected).max() < 1e-4
    assert model.blocks.attn.wq.sharding.spec == P(None, "model", None, "data")
    assert model.blocks.mlp.gate.sharding.spec == P(None, "model", "data")
    tied = CASES[name][2].get("tie_word_embeddings", False)
    assert (model.lm_head is None) == tied
    biased = name.startswith("qwen2") or "bias" in name
    assert (model.blocks.attn.bq is None) != biased


def test_fewer_kv_heads_than_the_model_axis_are_replicated(tmp_path):
    model = _hf_model(transformers.LlamaForCausalLM, transformers.LlamaConfig, num_key_value_heads=1)
    model.save_pretrained(tmp_path)
    with port.open_checkpoint(tmp_path) as ckpt:
        mapping = port.mapping_for(ckpt.config)
        recipe = port.plan(port.skeleton(mapping, ckpt.config), mapping, ckpt.tensors, ckpt.config,
                           {"data": 4, "model": 2})
    wk = next(leaf for leaf in recipe.leaves if leaf.path == "blocks.attn.wk")
    assert wk.spec == P(None, None, None, "data")
    assert wk.notes == ("kv_heads 1 not divisible by model=2: replicated on model",)
    converted = port.load(tmp_path, mesh=port.make_mesh("4x2"))
    assert np.abs(np.asarray(logits(converted, IDS)) - torch_logits(model)).max() < 1e-4


def test_bfloat16_stays_bfloat16(tmp_path):
    model = _hf_model(transformers.LlamaForCausalLM, transformers.LlamaConfig, dtype=torch.bfloat16)
    model.save_pretrained(tmp_path)
    with port.open_checkpoint(tmp_path) as ckpt:
        mapping = port.mapping_for(ckpt.config)
        recipe = port.plan(port.skeleton(mapping, ckpt.config), mapping, ckpt.tensors, ckpt.config,
                           {"data": 4, "model": 2})
    bf16 = np.dtype(ml_dtypes.bfloat16)
    assert all(leaf.source_dtype == leaf.dtype == bf16 and "cast" not in str(leaf.chain) for leaf in recipe.leaves)
    converted = port.load(tmp_path, mesh=port.make_mesh("4x2"))
    assert all(x.dtype == bf16 for x in port._skeleton.leaves(eqx.filter(converted, eqx.is_array)).values())
    ours = logits(converted, IDS)
    assert ours.dtype == bf16
    expected = torch_logits(model)
    assert np.abs(np.asarray(ours).astype(np.float32) - expected).max() < 0.05 * np.abs(expected).max()
