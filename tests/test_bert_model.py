"""Parity of the Equinox BERT encoder against transformers' BertModel."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

from port._errors import PortError
from port.models.bert import Bert, BertConfig

SMALL = dict(
    vocab_size=101,
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    intermediate_size=128,
    max_position_embeddings=32,
)
# BERT's default init (std 0.02) makes e.g. exact vs tanh GELU indistinguishable at
# 1e-4; std 0.2 plus perturbed LayerNorms makes every tested option matter.
HF_EXTRA = dict(initializer_range=0.2)
BATCH, SEQ = 2, 16


def _hf_model(**overrides) -> transformers.BertModel:
    torch.manual_seed(0)
    config = transformers.BertConfig(**SMALL, **HF_EXTRA, **overrides)
    config._attn_implementation = "eager"
    model = transformers.BertModel(config)
    # Non-trivial biases and LayerNorm params so that every mapping is exercised.
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("bias") or "LayerNorm" in name:
                param.add_(0.3 * torch.randn_like(param))
    return model.eval()


def _to_eqx(hf: transformers.BertModel) -> Bert:
    cfg = BertConfig.from_hf(hf.config.to_dict())
    sd = {k: v.detach().numpy() for k, v in hf.state_dict().items()}
    n, d, e = cfg.num_attention_heads, cfg.head_dim, cfg.hidden_size

    def one(key):
        return jnp.asarray(sd[key])

    def stack(suffix, fn=lambda a: a):
        return jnp.asarray(
            np.stack([fn(sd[f"encoder.layer.{i}.{suffix}"]) for i in range(cfg.num_hidden_layers)])
        )

    def heads_out(w):  # torch Linear (out = N*D, in = E) -> [N, D, E]
        return w.reshape(n, d, e)

    leaves = {
        lambda m: m.word_embeddings: one("embeddings.word_embeddings.weight"),
        lambda m: m.position_embeddings: one("embeddings.position_embeddings.weight"),
        lambda m: m.token_type_embeddings: one("embeddings.token_type_embeddings.weight"),
        lambda m: m.embed_norm.weight: one("embeddings.LayerNorm.weight"),
        lambda m: m.embed_norm.bias: one("embeddings.LayerNorm.bias"),
        lambda m: m.layers.attn.wq: stack("attention.self.query.weight", heads_out),
        lambda m: m.layers.attn.wk: stack("attention.self.key.weight", heads_out),
        lambda m: m.layers.attn.wv: stack("attention.self.value.weight", heads_out),
        lambda m: m.layers.attn.bq: stack("attention.self.query.bias", lambda b: b.reshape(n, d)),
        lambda m: m.layers.attn.bk: stack("attention.self.key.bias", lambda b: b.reshape(n, d)),
        lambda m: m.layers.attn.bv: stack("attention.self.value.bias", lambda b: b.reshape(n, d)),
        # output dense: torch Linear (out = E, in = N*D) -> [E, N, D]
        lambda m: m.layers.attn.wo: stack("attention.output.dense.weight", lambda w: w.reshape(e, n, d)),
        lambda m: m.layers.attn.bo: stack("attention.output.dense.bias"),
        lambda m: m.layers.attn_norm.weight: stack("attention.output.LayerNorm.weight"),
        lambda m: m.layers.attn_norm.bias: stack("attention.output.LayerNorm.bias"),
        lambda m: m.layers.mlp.fc.weight: stack("intermediate.dense.weight"),
        lambda m: m.layers.mlp.fc.bias: stack("intermediate.dense.bias"),
        lambda m: m.layers.mlp.proj.weight: stack("output.dense.weight"),
        lambda m: m.layers.mlp.proj.bias: stack("output.dense.bias"),
        lambda m: m.layers.mlp_norm.weight: stack("output.LayerNorm.weight"),
        lambda m: m.layers.mlp_norm.bias: stack("output.LayerNorm.bias"),
        lambda m: m.pooler.weight: one("pooler.dense.weight"),
        lambda m: m.pooler.bias: one("pooler.dense.bias"),
    }
    model = Bert.from_config(hf.config.to_dict(), key=jax.random.key(0))
    for where, value in leaves.items():
        assert where(model).shape == value.shape
        model = eqx.tree_at(where, model, value)
    return model


def _inputs(with_mask: bool):
    rng = np.random.default_rng(0)
    ids = rng.integers(0, SMALL["vocab_size"], size=(BATCH, SEQ))
    if not with_mask:
        return ids, None, None
    types = rng.integers(0, 2, size=(BATCH, SEQ))
    mask = np.ones((BATCH, SEQ), dtype=np.int64)
    mask[1, SEQ - 5 :] = 0  # padding at the end of the second sequence
    return ids, mask, types


def _run_both(hf, model, ids, mask, types):
    as_torch = lambda a: None if a is None else torch.from_numpy(a)
    as_jax = lambda a: None if a is None else jnp.asarray(a, dtype=jnp.int32)
    with torch.no_grad():
        out = hf(as_torch(ids), attention_mask=as_torch(mask), token_type_ids=as_torch(types))
    hidden = eqx.filter_jit(model)(as_jax(ids), as_jax(mask), as_jax(types))
    return out, hidden


@pytest.mark.parametrize(
    "overrides, with_mask",
    [
        (dict(hidden_act="gelu"), False),
        (dict(hidden_act="gelu"), True),
        (dict(hidden_act="gelu_new", layer_norm_eps=1e-3), True),
    ],
    ids=["gelu", "gelu-mask-types", "gelu_new-eps1e-3"],
)
def test_hidden_state_matches_transformers(overrides, with_mask):
    hf = _hf_model(**overrides)
    model = _to_eqx(hf)
    ids, mask, types = _inputs(with_mask)
    out, hidden = _run_both(hf, model, ids, mask, types)
    expected = out.last_hidden_state.numpy()
    actual = np.asarray(hidden)
    assert actual.shape == (BATCH, SEQ, SMALL["hidden_size"])
    # All positions, padded ones included: transformers masks keys only, so padded
    # queries still get a well-defined output that we reproduce.
    np.testing.assert_allclose(actual, expected, atol=1e-4, rtol=0)


def test_pooled_matches_transformers():
    hf = _hf_model(hidden_act="gelu")
    model = _to_eqx(hf)
    out, hidden = _run_both(hf, model, *_inputs(with_mask=True))
    pooled = np.asarray(eqx.filter_jit(Bert.pooled)(model, hidden))
    assert pooled.shape == (BATCH, SMALL["hidden_size"])
    np.testing.assert_allclose(pooled, out.pooler_output.numpy(), atol=1e-4, rtol=0)


def test_pooled_without_pooler_raises():
    model = Bert.from_config(SMALL, key=jax.random.key(0))
    model = eqx.tree_at(lambda m: m.pooler, model, None, is_leaf=lambda x: x is None)
    hidden = jnp.zeros((1, 4, SMALL["hidden_size"]))
    with pytest.raises(PortError, match="pooler"):
        model.pooled(hidden)


def test_stacked_field_shapes():
    model = eqx.filter_eval_shape(Bert.from_config, SMALL, key=jax.random.key(0))
    assert model.word_embeddings.shape == (101, 64)
    assert model.position_embeddings.shape == (32, 64)
    assert model.token_type_embeddings.shape == (2, 64)
    assert model.embed_norm.weight.shape == (64,)
    assert model.layers.attn.wq.shape == (2, 4, 16, 64)
    assert model.layers.attn.bq.shape == (2, 4, 16)
    assert model.layers.attn.wo.shape == (2, 64, 4, 16)
    assert model.layers.attn.bo.shape == (2, 64)
    assert model.layers.attn_norm.weight.shape == (2, 64)
    assert model.layers.mlp.fc.weight.shape == (2, 128, 64)
    assert model.layers.mlp.proj.weight.shape == (2, 64, 128)
    assert model.layers.mlp_norm.bias.shape == (2, 64)
    assert model.pooler.weight.shape == (64, 64)
    assert model.config.layer_norm_eps == 1e-12


def test_config_rejects_relative_position_embeddings():
    with pytest.raises(PortError, match="position_embedding_type"):
        BertConfig.from_hf({**SMALL, "position_embedding_type": "relative_key"})


def test_config_rejects_unknown_activation():
    with pytest.raises(PortError, match="hidden_act"):
        BertConfig.from_hf({**SMALL, "hidden_act": "mish"})


def test_config_rejects_decoder():
    with pytest.raises(PortError, match="is_decoder"):
        BertConfig.from_hf({**SMALL, "is_decoder": True})
