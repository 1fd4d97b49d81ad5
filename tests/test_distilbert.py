"""DistilBERT: what is new over BERT, against transformers (the shared contract is tests/test_encoders.py).

A masked-LM checkpoint (`distilbert.` keys, the `vocab_*` head ignored), the sinusoidal
position table a config asks for, and the configs the module refuses.
"""

import equinox as eqx
import jax
import numpy as np
import pytest

import port
from port._errors import PortError
from port.models.distilbert import DistilBert

from helpers import perturbed, transformers_or_skip

CONFIG = dict(vocab_size=101, dim=64, n_layers=2, n_heads=4, hidden_dim=128, max_position_embeddings=32)


def test_masked_lm_checkpoint(tmp_path):
    """DistilBertForMaskedLM's checkpoint: `distilbert.` keys, its head listed as ignored, the
    encoder's states for a padded batch, GELU and all."""
    import torch

    transformers = transformers_or_skip()
    config = transformers.DistilBertConfig(**CONFIG, initializer_range=0.2)
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    lm = perturbed(transformers.DistilBertForMaskedLM(config), lambda n: "norm" in n or n.endswith("bias"), 0.3)
    lm.save_pretrained(tmp_path)
    ids = np.random.default_rng(0).integers(1, 101, (2, 12))
    mask = np.ones_like(ids)
    mask[1, 7:] = 0
    with torch.no_grad():
        theirs = lm.distilbert(torch.tensor(ids), attention_mask=torch.tensor(mask)).last_hidden_state.numpy()
    with port.open_checkpoint(tmp_path) as ckpt:
        mapping = port.mapping_for(ckpt.config)
        recipe = port.plan(
            port.skeleton(mapping, ckpt.config), mapping, ckpt.tensors, ckpt.config, {"data": 1, "model": 1}
        )
    assert sorted({k.split(".")[0] for k in recipe.ignored}) == [
        "vocab_layer_norm",
        "vocab_projector",
        "vocab_transform",
    ]
    ours = port.load(tmp_path, mesh=port.make_mesh("2x2"))
    hidden = eqx.filter_jit(lambda m, i, k: m(i, attention_mask=k))(ours, ids, mask)
    assert np.abs(np.asarray(hidden) - theirs).max() < 1e-4


def test_sinusoidal_positions_are_transformers_table():
    """`sinusoidal_pos_embds`: the model starts from transformers' sine/cosine table (computed in
    float32 here, float64 there), not a random one; learned positions do not."""
    transformers = transformers_or_skip()
    theirs = transformers.DistilBertModel(transformers.DistilBertConfig(**CONFIG, sinusoidal_pos_embds=True))
    table = theirs.embeddings.position_embeddings.weight.detach().numpy()
    config = {"model_type": "distilbert", **CONFIG}
    sinusoidal = DistilBert.from_config({**config, "sinusoidal_pos_embds": True}, key=jax.random.key(0))
    learned = DistilBert.from_config(config, key=jax.random.key(0))
    np.testing.assert_allclose(np.asarray(sinusoidal.bert.position_embeddings), table, atol=2e-6, rtol=0)
    assert np.abs(np.asarray(learned.bert.position_embeddings) - table).max() > 0.1


def test_no_token_types_and_no_pooler():
    model = eqx.filter_eval_shape(DistilBert.from_config, {"model_type": "distilbert", **CONFIG}, key=jax.random.key(0))
    assert model.bert.token_type_embeddings is None and model.bert.pooler is None
    with pytest.raises(ValueError, match="no token type embeddings"):
        model.bert(np.ones((1, 4), np.int32), token_type_ids=np.zeros((1, 4), np.int32))


@pytest.mark.parametrize(
    "change, line",
    [
        (dict(dim=66), "config.json: 'dim' (66) must be divisible by 'n_heads' (4)"),
        (dict(activation="mish"), "config.json: 'activation' 'mish' is not supported"),
        (dict(n_layers=0), "config.json: 'n_layers' must be a positive integer"),
        (
            dict(model_type="bert"),
            "config.json: 'model_type' 'bert' is not supported by port.models.distilbert.DistilBert",
        ),
        (
            dict(is_encoder_decoder=True),
            "config.json: is_encoder_decoder true is not supported by port.models.distilbert",
        ),
    ],
)
def test_config_refused_in_one_line(change, line):
    with pytest.raises(PortError) as raised:
        DistilBert.from_config({"model_type": "distilbert", **CONFIG, **change}, key=jax.random.key(0))
    assert str(raised.value).startswith(line) and "\n" not in str(raised.value), raised.value
