"""RoBERTa and XLM-R: what is new over BERT, against transformers (the shared contract is tests/test_encoders.py).

Positions from the ids past the padding id (transformers' own function), a masked-LM
checkpoint (`roberta.` keys, `lm_head.*` ignored, no pooler), the pooler, the longest
sequence the position table allows, and the configs the module refuses.
"""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import port
from port._errors import PortError
from port.models.roberta import Roberta, positions

from helpers import BERT_CONFIG, perturbed, transformers_or_skip

CONFIG = dict(BERT_CONFIG, type_vocab_size=1, layer_norm_eps=1e-5, initializer_range=0.2)  # 32 positions, pad 1


def torch_roberta(pooler=True, **overrides):
    """A seeded RobertaModel of the small config, perturbed norms and biases; skips without PyTorch."""
    transformers = transformers_or_skip()
    import torch

    config = transformers.RobertaConfig(**{**CONFIG, **overrides})
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = transformers.RobertaModel(config, add_pooling_layer=pooler)
    return perturbed(model, lambda n: "LayerNorm" in n or n.endswith("bias"), 0.3)


def padded_ids(pad):
    """Three rows of 10: right padding, left padding, a padding id amid real tokens (unmasked)."""
    ids = np.random.default_rng(0).integers(4, 101, (3, 10))
    ids[0, 7:] = pad
    ids[1, :3] = pad
    ids[2, 4] = pad
    return ids, (ids != pad).astype(np.int64) | (np.arange(10) == 4)


@pytest.mark.parametrize("pad", [0, 1, 3])
def test_positions_are_transformers(pad):
    import torch

    transformers = transformers_or_skip()
    ids, _ = padded_ids(pad)
    theirs = transformers.models.roberta.modeling_roberta.RobertaEmbeddings.create_position_ids_from_input_ids(
        torch.tensor(ids), pad
    ).numpy()
    np.testing.assert_array_equal(np.asarray(positions(jnp.asarray(ids), pad)), theirs)
    np.testing.assert_array_equal(np.asarray(positions(jnp.asarray(ids[0]), pad)), theirs[0])  # unbatched


def test_masked_lm_checkpoint_pooler_and_positions(tmp_path):
    """RobertaForMaskedLM's checkpoint (`roberta.` keys, `lm_head.*` listed as ignored, no pooler)
    gives the encoder's states; the base model's pooler output too; a padding id amid real tokens
    keeps the padding position, as in transformers (the mask plays no part in positions)."""
    import torch

    transformers = transformers_or_skip()
    base = torch_roberta()
    lm = transformers.RobertaForMaskedLM(base.config).eval()
    lm.roberta.load_state_dict({k: v for k, v in base.state_dict().items() if not k.startswith("pooler.")})
    lm.save_pretrained(tmp_path / "lm")
    base.save_pretrained(tmp_path / "base")
    ids, mask = padded_ids(1)
    with torch.no_grad():
        out = base(torch.tensor(ids), attention_mask=torch.tensor(mask))
    with port.open_checkpoint(tmp_path / "lm") as ckpt:
        mapping = port.mapping_for(ckpt.config)
        recipe = port.plan(
            port.skeleton(mapping, ckpt.config), mapping, ckpt.tensors, ckpt.config, {"data": 1, "model": 1}
        )
    assert recipe.empty == ("bert.pooler.weight", "bert.pooler.bias")
    assert recipe.ignored and all(k.startswith("lm_head.") for k in recipe.ignored)
    for directory in ("lm", "base"):
        ours = port.load(tmp_path / directory, mesh=port.make_mesh("1x1"))
        hidden = eqx.filter_jit(lambda m, i, k: m(i, attention_mask=k))(ours, ids, mask)
        assert np.abs(np.asarray(hidden) - out.last_hidden_state.numpy()).max() < 1e-4
    assert np.abs(np.asarray(ours.pooled(hidden)) - out.pooler_output.numpy()).max() < 1e-4


def test_longest_sequence_is_the_table_past_the_padding_id():
    """32 positions, padding id 1: 30 tokens (positions 2..31) run, 31 are refused by name."""
    model = eqx.filter_eval_shape(Roberta.from_config, {"model_type": "roberta", **CONFIG}, key=jax.random.key(0))
    assert eqx.filter_eval_shape(model, np.ones((2, 30), np.int32)).shape == (2, 30, 64)
    with pytest.raises(
        ValueError, match=r"sequence length 31 exceeds max_position_embeddings - pad_token_id - 1 \(30\)"
    ):
        eqx.filter_eval_shape(model, np.ones((2, 31), np.int32))


@pytest.mark.parametrize(
    "change, line",
    [
        (dict(pad_token_id=None), "config.json: 'pad_token_id' must be an integer from 0 to 30"),
        (dict(pad_token_id=31), "config.json: 'pad_token_id' must be an integer from 0 to 30"),
        (dict(model_type="bert"), "config.json: 'model_type' 'bert' is not supported by port.models.roberta.Roberta"),
        (dict(is_decoder=True), "config.json: is_decoder true is not supported by port.models.roberta.Roberta"),
        (
            dict(position_embedding_type="relative_key_query"),
            "config.json: position_embedding_type 'relative_key_query' is not supported by port.models.roberta.Roberta",
        ),
    ],
)
def test_config_refused_in_one_line(change, line):
    with pytest.raises(PortError) as raised:
        Roberta.from_config({"model_type": "roberta", **CONFIG, **change}, key=jax.random.key(0))
    assert str(raised.value).startswith(line) and "\n" not in str(raised.value), raised.value
