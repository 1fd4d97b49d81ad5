"""BERT: port's encoder, converted by the shipped `mappings/bert.toml`, against `transformers` BertModel.

Parity goes through the converter: a `BertModel` (or `BertForMaskedLM`) written by
`save_pretrained`, under each key layout checkpoints use, loaded by `port`, gives the
same hidden states and pooled output. The tests that build a `transformers` model
skip without PyTorch.
"""

import json

import equinox as eqx
import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P
from safetensors.numpy import load_file, save_file

import port
from port._errors import PortError
from port.models.bert import Bert

from helpers import BERT_CONFIG, REPO, cli, converted, one_line, run_port, torch_bert, transformers_or_skip

IDS = np.random.default_rng(1).integers(0, 101, (2, 12))
TYPES = np.random.default_rng(2).integers(0, 2, (2, 12))
MASK = np.ones((2, 12), np.int64)
MASK[1, 9:] = 0  # padding at the end of the second sequence


def expected(model):
    """transformers' last hidden state and pooled output (None without a pooler)."""
    import torch

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
    "legacy": lambda k: (
        "bert." + k.replace("LayerNorm.weight", "LayerNorm.gamma").replace("LayerNorm.bias", "LayerNorm.beta")
    ),
}


# ---------------------------------------------------------------- parity


@pytest.mark.parametrize("mesh_spec", ["1x1", "4x2"])
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_hidden_states_match_transformers(tmp_path, layout, mesh_spec):
    """All positions, padded ones included: transformers masks keys only, so padded
    queries still get a well-defined output that port reproduces."""
    model = torch_bert(hidden_act="gelu")
    model.save_pretrained(tmp_path)
    rewrite(tmp_path, LAYOUTS[layout])
    hidden, pooled = expected(model)
    ours = port.load(tmp_path, mesh=port.make_mesh(mesh_spec))
    ours_hidden, ours_pooled = run(ours, IDS, MASK, TYPES)
    assert ours_hidden.shape == (*IDS.shape, 64) and ours_pooled.shape == (2, 64)
    assert np.abs(np.asarray(ours_hidden) - hidden).max() < 1e-4
    assert np.abs(np.asarray(ours_pooled) - pooled).max() < 1e-4
    assert ours.layers.attn.wq.sharding.spec == P(None, "model", None, "data")
    assert ours.layers.mlp.up.sharding.spec == P(None, "model", "data")


def test_tanh_gelu_and_another_epsilon_match_transformers(tmp_path):
    """`hidden_act` and `layer_norm_eps` come from config.json, as in transformers."""
    model = torch_bert(hidden_act="gelu_new", layer_norm_eps=1e-3)
    hidden, pooled = expected(model)
    ours_hidden, ours_pooled = run(converted(model, tmp_path), IDS, MASK, TYPES)
    np.testing.assert_allclose(np.asarray(ours_hidden), hidden, atol=1e-4, rtol=0)
    np.testing.assert_allclose(np.asarray(ours_pooled), pooled, atol=1e-4, rtol=0)


def test_masked_lm_checkpoint_without_pooler(tmp_path):
    """A BertForMaskedLM checkpoint: `cls.*` heads ignored, no pooler -> pooler None."""
    base = torch_bert(pooler=False, layer_norm_eps=1e-3)
    lm = transformers_or_skip().BertForMaskedLM(base.config).eval()
    lm.bert.load_state_dict(base.state_dict())
    lm.save_pretrained(tmp_path)
    hidden, _ = expected(base)
    with port.open_checkpoint(tmp_path) as ckpt:
        assert any(k.startswith("cls.") for k in ckpt.tensors)
        mapping = port.mapping_for(ckpt.config)
        recipe = port.plan(
            port.skeleton(mapping, ckpt.config), mapping, ckpt.tensors, ckpt.config, {"data": 2, "model": 2}
        )
    assert recipe.empty == ("pooler.weight", "pooler.bias")
    assert all(k.startswith("cls.") for k in recipe.ignored)
    ours = port.load(tmp_path, mesh=port.make_mesh("2x2"))
    assert ours.pooler.weight is None
    ours_hidden, _ = run(ours, IDS, MASK, TYPES)
    assert np.abs(np.asarray(ours_hidden) - hidden).max() < 1e-4
    with pytest.raises(ValueError, match="no pooler"):
        ours.pooled(ours_hidden)


@pytest.mark.slow
def test_convert_and_restore_a_checkpoint_without_pooler(tmp_path):
    model = torch_bert(pooler=False)
    model.save_pretrained(tmp_path / "bert")
    code, output = cli("convert", tmp_path / "bert", "--mesh", "2x2", "--out", tmp_path / "out")
    assert code == 0, output
    restored = port.restore(tmp_path / "out", port.make_mesh("1x1"))
    assert restored.pooler.weight is None and restored.pooler.bias is None
    hidden, _ = expected(model)
    ours, _ = run(restored, IDS, MASK, TYPES)
    assert np.abs(np.asarray(ours) - hidden).max() < 1e-4


# ---------------------------------------------------------------- the module and its config


def test_stacked_field_shapes():
    model = eqx.filter_eval_shape(Bert.from_config, BERT_CONFIG, key=jax.random.key(0))
    assert model.word_embeddings.shape == (101, 64)
    assert model.position_embeddings.shape == (32, 64)
    assert model.token_type_embeddings.shape == (2, 64)
    assert model.embed_norm.weight.shape == (64,)
    assert model.layers.attn.wq.shape == (2, 4, 16, 64)
    assert model.layers.attn.bq.shape == (2, 4, 16)
    assert model.layers.attn.wo.shape == (2, 64, 4, 16)
    assert model.layers.attn.bo.shape == (2, 64)
    assert model.layers.attn_norm.weight.shape == (2, 64)
    assert model.layers.mlp.up.shape == (2, 128, 64)
    assert model.layers.mlp.down.shape == (2, 64, 128)
    assert model.layers.mlp_norm.bias.shape == (2, 64)
    assert model.pooler.weight.shape == (64, 64)
    assert model.config.layer_norm_eps == 1e-12


@pytest.mark.parametrize(
    "change, match",
    [
        (
            dict(position_embedding_type="relative_key"),
            "config.json: position_embedding_type 'relative_key' is not supported by port.models.bert.Bert "
            "(supported: 'absolute')",
        ),
        (dict(hidden_act="mish"), "config.json: 'hidden_act' 'mish' is not supported"),
        (dict(is_decoder=True), "config.json: is_decoder true is not supported by port.models.bert.Bert"),
        (dict(add_cross_attention=True), "config.json: add_cross_attention true is not supported"),
        (
            dict(model_type="roberta"),
            "config.json: 'model_type' 'roberta' is not supported by port.models.bert.Bert (supported: bert)",
        ),
        (dict(hidden_size=66), "config.json: 'hidden_size' (66) must be divisible by 'num_attention_heads' (4)"),
    ],
)
def test_config_rejects_unsupported(change, match):
    with pytest.raises(PortError) as raised:
        Bert.from_config({**BERT_CONFIG, **change}, key=jax.random.key(0))
    assert str(raised.value).startswith(match), raised.value


def test_position_ids_pick_the_position_rows(tmp_path):
    """`position_ids` (transformers' argument of the same name) choose the rows of the position
    table: the same states as transformers given them, and not those of the default 0, 1, ..."""
    import torch

    model = torch_bert()
    positions = np.random.default_rng(3).integers(0, 32, IDS.shape)
    with torch.no_grad():
        theirs = model(
            torch.tensor(IDS), attention_mask=torch.tensor(MASK), token_type_ids=torch.tensor(TYPES),
            position_ids=torch.tensor(positions),
        ).last_hidden_state.numpy()  # fmt: skip
    ours = converted(model, tmp_path)
    hidden = eqx.filter_jit(lambda m, p: m(IDS, MASK, TYPES, position_ids=p))(ours, positions)
    assert np.abs(np.asarray(hidden) - theirs).max() < 1e-4
    assert np.abs(np.asarray(run(ours, IDS, MASK, TYPES)[0]) - theirs).max() > 1e-2


# ---------------------------------------------------------------- the command line


def bert_checkpoint(directory, **config):
    """A small BertModel checkpoint whose config.json is changed by `config`, its tensors unread."""
    torch_bert().save_pretrained(directory)
    path = directory / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **config}))
    return directory


@pytest.mark.slow
def test_port_check_refuses_relative_positions(tmp_path):
    """The issue's line, from `port check` and `port convert` alike, before any tensor is read: the
    tensor data is overwritten with garbage, and nothing is left where the output would go."""
    directory = bert_checkpoint(tmp_path / "bert", position_embedding_type="relative_key")
    garble(directory / "model.safetensors")
    expected = (
        "port: error: config.json: position_embedding_type 'relative_key' is not supported by "
        "port.models.bert.Bert (supported: 'absolute')"
    )
    assert one_line(run_port("check", REPO / "mappings" / "bert.toml", directory)) == expected
    assert one_line(run_port("convert", directory, "--out", tmp_path / "out"), out=tmp_path / "out") == expected


@pytest.mark.slow
def test_port_check_refuses_a_roberta_checkpoint_with_the_bert_mapping(tmp_path):
    """RoBERTa's positions are not BERT's: the BERT mapping's module refuses its model type at
    `port check` (it used to say ok, and only `port verify` found the states off)."""
    transformers = transformers_or_skip()
    config = transformers.RobertaConfig(**BERT_CONFIG, type_vocab_size=1)
    transformers.RobertaModel(config).save_pretrained(tmp_path / "roberta")
    garble(tmp_path / "roberta" / "model.safetensors")
    one_line(
        run_port("check", REPO / "mappings" / "bert.toml", tmp_path / "roberta"),
        "config.json: 'model_type' 'roberta' is not supported by port.models.bert.Bert (supported: bert)",
    )


def garble(path):
    """Overwrite a safetensors file's tensor data (not its header) with NaN bytes: a read of any
    tensor would give NaN, so a check that passes or fails on the config has read none."""
    header = 8 + int.from_bytes(path.read_bytes()[:8], "little")
    data = bytearray(path.read_bytes())
    data[header:] = b"\xff" * (len(data) - header)
    path.write_bytes(bytes(data))
