"""Model inputs: (batch, seq) or unbatched (seq,) ids, and one clear line for anything else.

Every shipped model takes `input_ids` with or without the batch axis; unbatched ids give
the batched output of a batch of one, and match transformers. A bad rank, dtype or mask
shape raises naming the argument and the shape it must have, also under `filter_jit`.
The checks on inputs read shapes only: they run on randomly initialised modules,
without PyTorch; the comparisons with transformers use port's conversion of its model.
"""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from port.models.bert import Bert
from port.models.gpt2 import GPT2
from port.models.llama import Llama

from helpers import (
    BERT_CONFIG,
    GPT2_CONFIG,
    LLAMA_CONFIG,
    VOCAB,
    converted,
    torch_bert,
    torch_gpt2,
    torch_llama,
)

SEQ = 12
BUILD = {
    "gpt2": (GPT2, GPT2_CONFIG, torch_gpt2),
    "llama": (Llama, LLAMA_CONFIG, torch_llama),
    "bert": (Bert, BERT_CONFIG, lambda: torch_bert(hidden_act="gelu")),
}


@pytest.fixture(scope="module")
def models():
    """get(name): the family's module of its small config, filled with seeded noise (no init, no PyTorch)."""
    made = {}

    def get(name):
        if name not in made:
            cls, config, _ = BUILD[name]
            skeleton = eqx.filter_eval_shape(cls.from_config, config, key=jax.random.key(0))
            rng = np.random.default_rng(0)
            made[name] = jax.tree.map(lambda s: jnp.asarray(0.2 * rng.standard_normal(s.shape), s.dtype), skeleton)
        return made[name]

    return get


@pytest.fixture(scope="module")
def twins(tmp_path_factory):
    """get(name): the family's transformers model and port's conversion of it (one build per family)."""
    made = {}

    def get(name):
        if name not in made:
            hf = BUILD[name][2]()
            made[name] = hf, converted(hf, tmp_path_factory.mktemp(name))
        return made[name]

    return get


def _ids(shape=(SEQ,), seed=0) -> jnp.ndarray:
    return jnp.asarray(np.random.default_rng(seed).integers(0, VOCAB, shape), jnp.int32)


def _torch(hf, ids, **extra):
    """transformers' output for one unbatched sequence (it always wants a batch axis)."""
    import torch

    args = {k: torch.from_numpy(np.asarray(v, np.int64))[None] for k, v in extra.items()}
    with torch.no_grad():
        out = hf(torch.from_numpy(np.asarray(ids, np.int64))[None], **args)
    if hasattr(out, "pooler_output"):
        return out.last_hidden_state[0].numpy(), out.pooler_output[0].numpy()
    return out.logits[0].float().numpy(), None


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_unbatched_logits(twins, name):
    hf, model = twins(name)
    ids = _ids()
    run = eqx.filter_jit(model)
    unbatched, batched = run(ids), run(ids[None])
    assert unbatched.shape == (SEQ, VOCAB) and batched.shape == (1, SEQ, VOCAB)
    np.testing.assert_allclose(unbatched, batched[0], atol=1e-6, rtol=0)
    expected, _ = _torch(hf, ids)
    np.testing.assert_allclose(unbatched, expected, atol=1e-4, rtol=0)


def test_unbatched_bert_with_mask_and_types(twins):
    hf, model = twins("bert")
    ids, types = _ids(), _ids(seed=1) % 2
    mask = jnp.ones((SEQ,), jnp.int32).at[SEQ - 4 :].set(0)  # padding at the end
    run = eqx.filter_jit(model)
    unbatched = run(ids, attention_mask=mask, token_type_ids=types)
    batched = run(ids[None], attention_mask=mask[None], token_type_ids=types[None])
    assert unbatched.shape == (SEQ, 64) and batched.shape == (1, SEQ, 64)
    np.testing.assert_allclose(unbatched, batched[0], atol=1e-6, rtol=0)
    pooled = eqx.filter_jit(model.pooled)(unbatched)
    assert pooled.shape == (64,)
    np.testing.assert_allclose(pooled, model.pooled(batched)[0], atol=1e-6, rtol=0)
    hidden, expected_pooled = _torch(hf, ids, attention_mask=mask, token_type_ids=types)
    np.testing.assert_allclose(unbatched, hidden, atol=1e-4, rtol=0)
    np.testing.assert_allclose(pooled, expected_pooled, atol=1e-4, rtol=0)
    # Without mask and types: all attended, all type 0, as in transformers.
    np.testing.assert_allclose(run(ids), _torch(hf, ids)[0], atol=1e-4, rtol=0)


RANK = r"`input_ids` must have shape \(batch, seq\) or \(seq,\), got "


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("name", ["gpt2", "llama", "bert"])
@pytest.mark.parametrize(
    "ids, error, match",
    [
        (jnp.zeros((), jnp.int32), ValueError, RANK + r"\(\)"),
        (jnp.zeros((2, 3, 4), jnp.int32), ValueError, RANK + r"\(2, 3, 4\)"),
        (jnp.zeros((8,), jnp.float32), TypeError, "`input_ids` must have an integer dtype, got float32"),
        (jnp.zeros((2, 8), jnp.bool_), TypeError, "`input_ids` must have an integer dtype, got bool"),
    ],
    ids=["0d", "3d", "float", "bool"],
)
def test_bad_input_ids_raise(models, name, jit, ids, error, match):
    model = models(name)
    with pytest.raises(error, match=match):
        (eqx.filter_jit(model) if jit else model)(ids)


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize(
    "ids_shape, kwargs, error, match",
    [
        (
            (2, 8),
            dict(attention_mask=jnp.ones((8,), jnp.int32)),
            ValueError,
            r"`attention_mask` must have shape \(batch, seq\) = \(2, 8\) like `input_ids`, got \(8,\)",
        ),
        (
            (8,),
            dict(attention_mask=jnp.ones((1, 8), jnp.int32)),
            ValueError,
            r"`attention_mask` must have shape \(seq,\) = \(8,\) like `input_ids`, got \(1, 8\)",
        ),
        (
            (2, 8),
            dict(token_type_ids=jnp.zeros((2, 7), jnp.int32)),
            ValueError,
            r"`token_type_ids` must have shape \(batch, seq\) = \(2, 8\) like `input_ids`, got \(2, 7\)",
        ),
        (
            (8,),
            dict(token_type_ids=jnp.zeros((8,), jnp.float32)),
            TypeError,
            "`token_type_ids` must have an integer dtype, got float32",
        ),
    ],
    ids=["batched-ids-1d-mask", "unbatched-ids-2d-mask", "short-types", "float-types"],
)
def test_bert_mismatched_masks_raise(models, jit, ids_shape, kwargs, error, match):
    model = models("bert")
    with pytest.raises(error, match=match):
        (eqx.filter_jit(model) if jit else model)(jnp.zeros(ids_shape, jnp.int32), **kwargs)


def test_bert_accepts_bool_and_float_masks(models):
    model = models("bert")
    ids = _ids()
    mask = jnp.ones((SEQ,), jnp.int32).at[SEQ - 4 :].set(0)

    @eqx.filter_jit
    def run(model, ids, mask):
        return [model(ids, attention_mask=mask.astype(t)) for t in (jnp.int32, jnp.bool_, jnp.float32)]

    expected, *others = run(model, ids, mask)
    for other in others:
        np.testing.assert_array_equal(other, expected)


@pytest.mark.parametrize("shape", [(33,), (2, 33)], ids=["unbatched", "batched"])
@pytest.mark.parametrize("name, key", [("gpt2", "n_positions"), ("bert", "max_position_embeddings")])
def test_too_long_sequence_raises(models, name, key, shape):
    model = models(name)  # both have 32 positions
    with pytest.raises(ValueError, match=f"`input_ids`: sequence length 33 exceeds {key} \\(32\\)"):
        eqx.filter_jit(model)(jnp.zeros(shape, jnp.int32))


def test_bert_pooled_rejects_bad_rank(models):
    model = models("bert")
    with pytest.raises(ValueError, match=r"`hidden` must have shape .* got \(64,\)"):
        model.pooled(jnp.zeros((64,)))
