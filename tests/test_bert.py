"""BERT checkpoints written by `transformers` convert to port's Bert with the same hidden states."""

import equinox as eqx
import numpy as np
import pytest
import torch
from jax.sharding import PartitionSpec as P
from safetensors.numpy import load_file, save_file

import port
from conftest import cli

IDS = np.random.default_rng(1).integers(0, 101, (2, 12))
TYPES = np.random.default_rng(2).integers(0, 2, (2, 12))
MASK = np.ones((2, 12), np.int64)
MASK[1, 9:] = 0


def torch_bert(pooler=True, **overrides):
    from transformers import BertConfig, BertModel

    config = BertConfig(
        vocab_size=101, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
        max_position_embeddings=32, initializer_range=0.2, **overrides,
    )
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = BertModel(config, add_pooling_layer=pooler).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "LayerNorm" in name or name.endswith("bias"):
                p.add_(0.3 * torch.randn_like(p))
    return model


def expected(model):
    with torch.no_grad():
        out = model(torch.tensor(IDS), attention_mask=torch.tensor(MASK), token_type_ids=torch.tensor(TYPES))
    return out.last_hidden_state.numpy(), None if out.pooler_output is None else out.pooler_output.numpy()


@eqx.filter_jit
def run(model, ids, mask, types):
    hidden = model(ids, attention_mask=mask, token_type_ids=types)
    return hidden, (model.pooled(hidden) if model.pooler.weight is not None else None)


def rewrite(directory, rename):
    """Re-save a checkpoint with renamed keys (a `bert.` prefix, legacy gamma/beta)."""
    tensors = load_file(directory / "model.safetensors")
    save_file({rename(k): v for k, v in tensors.items()}, directory / "model.safetensors")


LAYOUTS = {
    "plain": lambda k: k,
    "prefixed": lambda k: "bert." + k,
    "legacy": lambda k: "bert." + k.replace("LayerNorm.weight", "LayerNorm.gamma").replace("LayerNorm.bias", "LayerNorm.beta"),
}


@pytest.mark.parametrize("mesh_spec", ["1x1", "4x2"])
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_hidden_states_match_transformers(tmp_path, layout, mesh_spec):
    model = torch_bert(hidden_act="gelu")
    model.save_pretrained(tmp_path)
    rewrite(tmp_path, LAYOUTS[layout])
    hidden, pooled = expected(model)
    converted = port.load(tmp_path, mesh=port.make_mesh(mesh_spec))
    ours_hidden, ours_pooled = run(converted, IDS, MASK, TYPES)
    assert np.abs(np.asarray(ours_hidden) - hidden).max() < 1e-4
    assert np.abs(np.asarray(ours_pooled) - pooled).max() < 1e-4
    assert converted.layers.attn.wq.sharding.spec == P(None, "model", None, "data")
    assert converted.layers.mlp.fc.weight.sharding.spec == P(None, "model", "data")


def test_masked_lm_checkpoint_without_pooler(tmp_path):
    """A BertForMaskedLM checkpoint: `cls.*` heads ignored, no pooler -> pooler None."""
    from transformers import BertForMaskedLM

    base = torch_bert(pooler=False, layer_norm_eps=1e-3)
    lm = BertForMaskedLM(base.config).eval()
    lm.bert.load_state_dict(base.state_dict())
    lm.save_pretrained(tmp_path)
    hidden, _ = expected(base)
    with port.open_checkpoint(tmp_path) as ckpt:
        assert any(k.startswith("cls.") for k in ckpt.tensors)
        mapping = port.mapping_for(ckpt.config)
        recipe = port.plan(port.skeleton(mapping, ckpt.config), mapping, ckpt.tensors, ckpt.config, {"data": 2, "model": 2})
    assert recipe.empty == ("pooler.weight", "pooler.bias")
    assert all(k.startswith("cls.") for k in recipe.ignored)
    converted = port.load(tmp_path, mesh=port.make_mesh("2x2"))
    assert converted.pooler.weight is None
    ours, _ = run(converted, IDS, MASK, TYPES)
    assert np.abs(np.asarray(ours) - hidden).max() < 1e-4
    with pytest.raises(port.PortError, match="no pooler"):
        converted.pooled(ours)


def test_convert_and_restore_a_checkpoint_without_pooler(tmp_path):
    torch_bert(pooler=False).save_pretrained(tmp_path / "bert")
    code, output = cli("convert", tmp_path / "bert", "--mesh", "2x2", "--out", tmp_path / "out")
    assert code == 0, output
    restored = port.restore(tmp_path / "out", port.make_mesh("1x1"))
    assert restored.pooler.weight is None and restored.pooler.bias is None
    hidden, _ = expected(torch_bert(pooler=False))
    ours, _ = run(restored, IDS, MASK, TYPES)
    assert np.abs(np.asarray(ours) - hidden).max() < 1e-4
