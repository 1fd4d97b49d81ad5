"""Parity of the Equinox GPT-2 against transformers' GPT2LMHeadModel."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

from port._errors import PortError
from port.models.gpt2 import GPT2, GPT2Config

SMALL = dict(vocab_size=101, n_positions=32, n_embd=64, n_layer=2, n_head=4)
# GPT-2's default init (std 0.02) gives such small activations that e.g. exact vs tanh
# GELU differ by < 1e-5 in the logits; std 0.2 makes every tested option matter.
HF_EXTRA = dict(initializer_range=0.2, bos_token_id=0, eos_token_id=0)


def _hf_model(**overrides) -> transformers.GPT2LMHeadModel:
    torch.manual_seed(0)
    config = transformers.GPT2Config(**SMALL, **HF_EXTRA, **overrides)
    config._attn_implementation = "eager"
    model = transformers.GPT2LMHeadModel(config)
    # Non-trivial biases and LayerNorm params so that every mapping is exercised.
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("bias") or ".ln_" in name:
                param.add_(0.1 * torch.randn_like(param))
    return model.eval()


def _to_eqx(hf: transformers.GPT2LMHeadModel) -> GPT2:
    cfg = GPT2Config.from_hf(hf.config.to_dict())
    sd = {k: v.detach().numpy() for k, v in hf.state_dict().items()}
    h, d, e = cfg.n_head, cfg.head_dim, cfg.n_embd

    def stack(fn):
        return jnp.asarray(np.stack([fn(f"transformer.h.{i}.") for i in range(cfg.n_layer)]))

    def qkv_weight(j):  # c_attn is Conv1D [in, 3*out]
        return stack(lambda p: sd[p + "attn.c_attn.weight"][:, j * e : (j + 1) * e].reshape(e, h, d))

    def qkv_bias(j):
        return stack(lambda p: sd[p + "attn.c_attn.bias"][j * e : (j + 1) * e].reshape(h, d))

    leaves = {
        lambda m: m.wte: jnp.asarray(sd["transformer.wte.weight"]),
        lambda m: m.wpe: jnp.asarray(sd["transformer.wpe.weight"]),
        lambda m: m.ln_f.weight: jnp.asarray(sd["transformer.ln_f.weight"]),
        lambda m: m.ln_f.bias: jnp.asarray(sd["transformer.ln_f.bias"]),
        lambda m: m.blocks.ln_1.weight: stack(lambda p: sd[p + "ln_1.weight"]),
        lambda m: m.blocks.ln_1.bias: stack(lambda p: sd[p + "ln_1.bias"]),
        lambda m: m.blocks.ln_2.weight: stack(lambda p: sd[p + "ln_2.weight"]),
        lambda m: m.blocks.ln_2.bias: stack(lambda p: sd[p + "ln_2.bias"]),
        lambda m: m.blocks.attn.wq: qkv_weight(0),
        lambda m: m.blocks.attn.wk: qkv_weight(1),
        lambda m: m.blocks.attn.wv: qkv_weight(2),
        lambda m: m.blocks.attn.bq: qkv_bias(0),
        lambda m: m.blocks.attn.bk: qkv_bias(1),
        lambda m: m.blocks.attn.bv: qkv_bias(2),
        # c_proj is Conv1D [in = H*D, out = E]
        lambda m: m.blocks.attn.wo: stack(lambda p: sd[p + "attn.c_proj.weight"].reshape(h, d, e)),
        lambda m: m.blocks.attn.bo: stack(lambda p: sd[p + "attn.c_proj.bias"]),
        lambda m: m.blocks.mlp.w_fc: stack(lambda p: sd[p + "mlp.c_fc.weight"]),
        lambda m: m.blocks.mlp.b_fc: stack(lambda p: sd[p + "mlp.c_fc.bias"]),
        lambda m: m.blocks.mlp.w_proj: stack(lambda p: sd[p + "mlp.c_proj.weight"]),
        lambda m: m.blocks.mlp.b_proj: stack(lambda p: sd[p + "mlp.c_proj.bias"]),
    }
    model = GPT2.from_config(hf.config.to_dict(), key=jax.random.key(0))
    for where, value in leaves.items():
        assert where(model).shape == value.shape
        model = eqx.tree_at(where, model, value)
    return model


@pytest.mark.parametrize(
    "overrides",
    [
        dict(activation_function="gelu_new"),
        dict(activation_function="gelu", layer_norm_epsilon=1e-3),
        dict(activation_function="gelu_new", scale_attn_by_inverse_layer_idx=True),
    ],
    ids=["gelu_new", "gelu-eps1e-3", "inverse_layer_idx"],
)
def test_logits_match_transformers(overrides):
    hf = _hf_model(**overrides)
    model = _to_eqx(hf)
    ids = np.random.default_rng(0).integers(0, SMALL["vocab_size"], size=(2, 16))
    with torch.no_grad():
        expected = hf(torch.from_numpy(ids)).logits.numpy()
    actual = np.asarray(eqx.filter_jit(model)(jnp.asarray(ids, dtype=jnp.int32)))
    assert actual.shape == (2, 16, SMALL["vocab_size"])
    np.testing.assert_allclose(actual, expected, atol=1e-4, rtol=0)


def test_stacked_field_shapes():
    model = eqx.filter_eval_shape(GPT2.from_config, SMALL, key=jax.random.key(0))
    assert model.blocks.attn.wq.shape == (2, 64, 4, 16)
    assert model.blocks.attn.wo.shape == (2, 4, 16, 64)
    assert model.blocks.mlp.w_fc.shape == (2, 64, 256)
    assert model.blocks.ln_1.weight.shape == (2, 64)
    assert model.ln_f.weight.shape == (64,)


def test_config_rejects_unknown_activation():
    with pytest.raises(PortError, match="activation_function"):
        GPT2Config.from_hf({**SMALL, "activation_function": "mish"})


def test_config_rejects_missing_n_embd():
    config = {k: v for k, v in SMALL.items() if k != "n_embd"}
    with pytest.raises(PortError, match="n_embd"):
        GPT2Config.from_hf(config)
