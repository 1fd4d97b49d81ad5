"""port.nn.LoRA alone: the merged weight against the formula in every layout, DoRA's rescaling,
the trainable filter, and the layer loop merging each layer's adapters (no family code).

Parity with PEFT (gradients, every decoder family) is tests/test_lora_training.py's;
reading and writing PEFT adapters is tests/test_adapters*.py's.
"""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import port.nn as pnn
from port.models.llama import Llama

from helpers import LLAMA_CONFIG

SMALL = {**LLAMA_CONFIG, "model_type": "llama", "num_hidden_layers": 2}


def _random(node: pnn.LoRA, seed: int = 0) -> pnn.LoRA:
    """`node` with a random `b` (a fresh adapter's is zero, so its product would be too)."""
    return eqx.tree_at(lambda n: n.b, node, jax.random.normal(jax.random.key(seed), node.b.shape))


@pytest.mark.parametrize("transposed", [False, True])
def test_the_merged_weight_is_base_plus_the_scaled_product_in_the_leafs_layout(transposed):
    # A leaf [layers=2, heads=3, head_dim=4, embed=5] (inputs: embed) or [2, 5, 3, 4] (transposed).
    base = jax.random.normal(jax.random.key(1), (2, 5, 3, 4) if transposed else (2, 3, 4, 5))
    node = _random(
        pnn.LoRA.attach(base, inputs=1, rank=2, scale=1.5, key=jax.random.key(2), stack=1, transposed=transposed)
    )
    assert node.a.shape == (2, 2, 5) and node.b.shape == (2, 3, 4, 2) and node.rank == 2 and node.stack == 1
    a, b = np.asarray(node.a), np.asarray(node.b).reshape(2, 12, 2)
    torch_delta = 1.5 * np.einsum("lor,lri->loi", b, a)  # PEFT's [out, in] per layer
    expected = torch_delta.reshape(2, 3, 4, 5)
    if transposed:
        expected = expected.transpose(0, 3, 1, 2)
    np.testing.assert_allclose(np.asarray(node.merged()), np.asarray(base) + expected, rtol=1e-6, atol=1e-6)


def test_a_fresh_adapter_changes_nothing_and_keeps_the_dtype():
    base = jax.random.normal(jax.random.key(1), (6, 4), jnp.bfloat16)
    node = pnn.LoRA.attach(base, inputs=1, rank=2, scale=2.0, key=jax.random.key(0))
    assert node.a.dtype == jnp.float32 and node.merged().dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(node.merged()), np.asarray(base))
    bound = 1 / np.sqrt(4)  # PEFT's kaiming_uniform_(a=sqrt(5)): +-1/sqrt(fan_in)
    assert float(jnp.abs(node.a).max()) <= bound


def test_dora_rescales_each_output_to_its_magnitude():
    base = jax.random.normal(jax.random.key(1), (6, 4))
    node = _random(pnn.LoRA.attach(base, inputs=1, rank=2, scale=2.0, key=jax.random.key(0), dora=True))
    np.testing.assert_allclose(np.asarray(node.magnitude), np.linalg.norm(np.asarray(base), axis=1), rtol=1e-6)
    w = np.asarray(base) + np.asarray(node.delta())
    expected = np.asarray(node.magnitude)[:, None] * w / np.linalg.norm(w, axis=1, keepdims=True)
    np.testing.assert_allclose(np.asarray(node.merged()), expected, rtol=1e-5, atol=1e-6)


def test_a_leaf_without_inputs_or_outputs_is_refused():
    with pytest.raises(ValueError, match="inputs and outputs"):
        pnn.LoRA.attach(jnp.zeros((4, 4)), inputs=2, rank=2, scale=1.0, key=jax.random.key(0))


@pytest.fixture(scope="module")
def adapted():
    model = Llama.from_config(SMALL, key=jax.random.key(0))
    wq, wo = (
        model.blocks.attn.wq,
        model.blocks.attn.wo,
    )  # [layers, heads, head_dim, embed], [layers, embed, heads, head_dim]
    q = _random(pnn.LoRA.attach(wq, inputs=1, rank=4, scale=2.0, key=jax.random.key(1), stack=1), 2)
    o = _random(pnn.LoRA.attach(wo, inputs=2, rank=4, scale=2.0, key=jax.random.key(3), stack=1, dora=True), 4)
    return model, eqx.tree_at(lambda m: (m.blocks.attn.wq, m.blocks.attn.wo), model, (q, o))


def test_the_layer_loop_merges_each_layers_adapters(adapted):
    model, with_lora = adapted
    ids = jnp.arange(12).reshape(2, 6) % SMALL["vocab_size"]
    out = with_lora(ids)
    np.testing.assert_allclose(np.asarray(out), np.asarray(pnn.merged(with_lora)(ids)), rtol=1e-5, atol=1e-5)
    assert float(jnp.abs(out - model(ids)).max()) > 1e-3  # the adapters are used


def test_only_the_adapters_are_trainable_and_remat_changes_no_gradient(adapted):
    _, with_lora = adapted
    params, frozen = eqx.partition(with_lora, pnn.trainable(with_lora))
    leaves = jax.tree.leaves(params)
    assert len(leaves) == 5  # wq's a and b; wo's a, b and magnitude
    ids = jnp.arange(12).reshape(2, 6) % SMALL["vocab_size"]

    def loss(p, remat):
        return jnp.mean(eqx.combine(p, frozen)(ids, remat=remat) ** 2)

    plain, rematerialised = (eqx.filter_grad(loss)(params, r) for r in (None, "full"))
    for g, h in zip(jax.tree.leaves(plain), jax.tree.leaves(rematerialised)):
        assert float(jnp.abs(g).max()) > 0
        np.testing.assert_allclose(np.asarray(g), np.asarray(h), rtol=1e-5, atol=1e-7)
