"""Sampling in `port.generate` (port/nn/_sampling.py): each processor against transformers', and generation.

Processor by processor, on random float32 logits with ties, `-inf` entries and underflowing
ones: equal to transformers' logits processor of the same name (repetition penalty with a
per-row ignored prefix, temperature, top-k, top-p, min-p, and the chain in transformers'
order). Then `port.generate` on a tiny Llama converted from transformers: several EOS ids
with per-row stops and the repetition penalty, greedy, token for token against
transformers' `generate`; T5 likewise; a sampled generation reproducible with its key,
top-k 1 equal to greedy, the first token's frequencies those of softmax(logits / T), the
decode step compiled once, and the arguments' one-line refusals.
"""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import port
from port.nn import apply_temperature, keep_min_p, keep_top_k, keep_top_p, penalize_repetition, process_logits

from helpers import converted, torch_llama, transformers_or_skip

VOCAB = 37
UNTIED = [1, 2, 4, 5]  # the rows of `awkward_logits` without ties


def awkward_logits(seed=0, batch=6):
    """[batch, VOCAB] float32: ties (a row of them), -inf entries, logits whose probability underflows to 0."""
    rng = np.random.default_rng(seed)
    logits = (3 * rng.standard_normal((batch, VOCAB))).astype(np.float32)
    logits[0, :6] = logits[0, 6]  # ties with a middling value
    logits[1, ::5] = -np.inf
    logits[2, 3:9] = -200.0  # exp underflows: probability 0
    logits[3] = np.round(logits[3])  # many ties
    return logits


def assert_processed_equal(ours, expected):
    """The same tokens filtered (-inf), the rest equal to 1e-6 (relative): XLA's float32
    division on CPU is not always correctly rounded (1 ulp from PyTorch's)."""
    ours, expected = np.asarray(ours), np.asarray(expected)
    np.testing.assert_array_equal(np.isneginf(ours), np.isneginf(expected))
    np.testing.assert_allclose(ours, expected, rtol=1e-6, atol=0)


def assert_same_up_to_ties(ours, expected, logits):
    """Which of tied logits a filter keeps at its cut is the sort's choice (PyTorch's sort and
    topk are not stable): the same number kept, the same kept values, and a token kept by one
    and not the other only where its logit is tied with another's."""
    ours, expected = np.asarray(ours), np.asarray(expected)
    for row, (a, b, x) in enumerate(zip(ours, expected, logits)):
        np.testing.assert_array_equal(np.sort(a[np.isfinite(a)]), np.sort(b[np.isfinite(b)]), err_msg=f"row {row}")
        for token in np.flatnonzero(np.isneginf(a) != np.isneginf(b)):
            assert (x == x[token]).sum() > 1, f"row {row}, token {token}: kept by one, not tied"


def torch_processed(processor, logits, tokens=None):
    import torch

    ids = torch.zeros((logits.shape[0], 1), dtype=torch.long) if tokens is None else torch.tensor(tokens)
    return processor(ids, torch.tensor(logits)).numpy()


def test_repetition_penalty_is_transformers():
    """Penalties above and below 1, repeated tokens counted once, a per-row ignored prefix
    (transformers' `prompt_ignore_length`, left padding), ids at or above vocab skipped."""
    transformers_or_skip()
    import torch
    from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

    logits = awkward_logits()
    tokens = np.random.default_rng(1).integers(0, VOCAB + 3, (6, 12))
    tokens[:, 6:] = tokens[:, :6]  # repeats
    ignored = np.array([0, 3, 0, 11, 5, 12])
    counted = np.arange(12) >= ignored[:, None]
    for penalty in (1.3, 0.6):
        theirs = RepetitionPenaltyLogitsProcessor(penalty, prompt_ignore_length=torch.tensor(ignored))
        expected = torch_processed(theirs, logits, tokens)
        ours = np.asarray(penalize_repetition(jnp.asarray(logits), jnp.asarray(tokens), penalty, counted=counted))
        assert_processed_equal(ours, expected)
        assert not np.array_equal(ours, logits)
    every = torch_processed(RepetitionPenaltyLogitsProcessor(1.3), logits, tokens)
    assert_processed_equal(penalize_repetition(jnp.asarray(logits), tokens, 1.3), every)


@pytest.mark.parametrize("temperature", [0.7, 1.6])
def test_temperature_is_transformers(temperature):
    transformers_or_skip()
    from transformers.generation.logits_process import TemperatureLogitsWarper

    logits = awkward_logits()
    expected = torch_processed(TemperatureLogitsWarper(temperature), logits)
    assert_processed_equal(apply_temperature(jnp.asarray(logits), temperature), expected)


@pytest.mark.parametrize("top_k", [1, 5, 20, VOCAB, VOCAB + 30])
def test_top_k_is_transformers(top_k):
    """Ties with the k-th are kept; k above the vocabulary keeps all."""
    transformers_or_skip()
    from transformers.generation.logits_process import TopKLogitsWarper

    logits = awkward_logits()
    expected = torch_processed(TopKLogitsWarper(top_k), logits)
    ours = np.asarray(keep_top_k(jnp.asarray(logits), top_k))
    assert_processed_equal(ours, expected)
    if top_k == 5:
        assert (np.isfinite(ours).sum(-1) >= 5).all() and (np.isfinite(ours).sum(-1)[3] > 5)  # ties kept


@pytest.mark.parametrize("top_p", [0.0, 0.3, 0.9, 0.999, 1.0])
def test_top_p_is_transformers(top_p):
    """top_p 1 still drops the tokens of probability 0 (transformers' processor does; its
    `generate` skips the processor at 1, and so does `process_logits`)."""
    transformers_or_skip()
    from transformers.generation.logits_process import TopPLogitsWarper

    logits = awkward_logits()
    for keep in (1, 3):
        expected = torch_processed(TopPLogitsWarper(top_p, min_tokens_to_keep=keep), logits)
        ours = np.asarray(keep_top_p(jnp.asarray(logits), top_p, min_tokens_to_keep=keep))
        assert_same_up_to_ties(ours, expected, logits)
        assert_processed_equal(ours[UNTIED], expected[UNTIED])
        assert (np.isfinite(ours).sum(-1) >= keep).all()
        if top_p == 1.0:
            assert np.isneginf(ours[2, 3:9]).all() and np.isfinite(ours[2, 9:]).all()  # probability 0 dropped


@pytest.mark.parametrize("min_p", [0.0, 0.05, 0.3, 1.0])
def test_min_p_is_transformers(min_p):
    transformers_or_skip()
    from transformers.generation.logits_process import MinPLogitsWarper

    logits = awkward_logits()
    for keep in (1, 4):
        expected = torch_processed(MinPLogitsWarper(min_p, min_tokens_to_keep=keep), logits)
        ours = np.asarray(keep_min_p(jnp.asarray(logits), min_p, min_tokens_to_keep=keep))
        assert_same_up_to_ties(ours, expected, logits)
        assert_processed_equal(ours[UNTIED], expected[UNTIED])


def test_process_logits_is_transformers_chain_in_its_order():
    """`process_logits` = transformers' `LogitsProcessorList` as `_get_logits_processor` builds
    it for sampling: penalty, temperature, top-k, top-p, min-p (bfloat16 logits processed in
    float32, as `generate` casts them); the values but top-k's may be traced."""
    transformers_or_skip()
    import torch
    from transformers.generation.logits_process import (
        LogitsProcessorList,
        MinPLogitsWarper,
        RepetitionPenaltyLogitsProcessor,
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    logits = awkward_logits(seed=2)
    tokens = np.random.default_rng(3).integers(0, VOCAB, (6, 9))
    chain = LogitsProcessorList(
        [
            RepetitionPenaltyLogitsProcessor(1.2),
            TemperatureLogitsWarper(0.8),
            TopKLogitsWarper(12),
            TopPLogitsWarper(0.8),
            MinPLogitsWarper(0.1),
        ]
    )
    expected = chain(torch.tensor(tokens), torch.tensor(logits))
    settings = dict(repetition_penalty=1.2, temperature=0.8, top_k=12, top_p=0.8, min_p=0.1)
    ours = process_logits(jnp.asarray(logits), jnp.asarray(tokens), **settings)
    assert_processed_equal(ours, expected.numpy())
    del settings["top_k"]  # a Python integer, static
    traced = jax.jit(lambda x, t, s: process_logits(x, t, top_k=12, **s))(logits, tokens, settings)
    assert_processed_equal(traced, expected.numpy())
    assert process_logits(jnp.asarray(logits, jnp.bfloat16)).dtype == jnp.float32
    untied = chain(torch.tensor(tokens[UNTIED]), torch.tensor(logits[UNTIED])).numpy()  # top-p on the top-k alone
    assert_processed_equal(process_logits(logits[UNTIED], tokens[UNTIED], top_k=12, **settings), untied)


# ------------------------------------------------------------------ generation


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """(transformers' tiny Llama, the same converted by port): large init, perturbed norms."""
    torch_lm = torch_llama()
    torch_lm.generation_config.eos_token_id = None
    return torch_lm, converted(torch_lm, tmp_path_factory.mktemp("llama"))


def prompts():
    """Two prompts, the second left-padded (9 and 4 tokens), and their mask."""
    ids = np.random.default_rng(3).integers(3, 101, (2, 9)).astype(np.int32)
    mask = np.ones_like(ids)
    mask[1, :5] = 0
    return np.where(mask == 1, ids, 0), mask


def transformers_generate(torch_lm, ids, mask, **settings):
    import torch

    with torch.no_grad():
        return torch_lm.generate(
            torch.tensor(ids).long(), attention_mask=torch.tensor(mask), do_sample=False, pad_token_id=0, **settings
        ).numpy()


def test_several_eos_ids_stop_each_row_as_transformers(llama):
    """Each row stops at its first token among the eos ids and is padded after, whatever the
    other row does; transformers stops once both have, so its output is port's cut there."""
    torch_lm, model = llama
    ids, mask = prompts()
    free = np.asarray(port.generate(model, ids, max_new_tokens=24, attention_mask=mask))[:, 9:]
    assert len(set(free.ravel().tolist())) > 8  # varied tokens, not one repeated
    eos = [int(free[0, 4]), int(free[1, 11])]
    assert eos[0] != eos[1]
    theirs = transformers_generate(torch_lm, ids, mask, max_new_tokens=24, eos_token_id=eos)
    ours = np.asarray(port.generate(model, ids, max_new_tokens=24, attention_mask=mask, eos_token_id=eos))
    stops = [int(np.flatnonzero(np.isin(free[row], eos))[0]) for row in range(2)]
    assert stops[0] != stops[1] and max(stops) < 23  # rows stop at different steps, both early
    assert theirs.shape == (2, 9 + max(stops) + 1)
    assert ours.shape == (2, 9 + 24)
    np.testing.assert_array_equal(ours[:, : theirs.shape[1]], theirs)
    assert (ours[:, theirs.shape[1] :] == 0).all()
    for row, stop in enumerate(stops):
        assert (ours[row, 9 + stop + 1 :] == 0).all() and (ours[row, 9 : 9 + stop + 1] == free[row, : stop + 1]).all()


def test_repetition_penalty_greedy_is_transformers(llama):
    """Greedy with the penalty, a left-padded prompt: transformers' tokens, token for token (the
    prompt counts, its left padding does not), and not the tokens without the penalty."""
    torch_lm, model = llama
    ids, mask = prompts()
    theirs = transformers_generate(torch_lm, ids, mask, max_new_tokens=24, repetition_penalty=1.5)
    ours = np.asarray(port.generate(model, ids, max_new_tokens=24, attention_mask=mask, repetition_penalty=1.5))
    np.testing.assert_array_equal(ours, theirs)
    plain = np.asarray(port.generate(model, ids, max_new_tokens=24, attention_mask=mask))
    assert (plain != ours).any()


def test_a_sample_is_reproducible_with_its_key_and_top_k_1_is_greedy(llama):
    _, model = llama
    ids, mask = prompts()
    settings = dict(max_new_tokens=16, attention_mask=mask, temperature=0.9, top_p=0.95, min_p=0.02)
    first = np.asarray(port.generate(model, ids, key=jax.random.key(0), **settings))
    again = np.asarray(port.generate(model, ids, key=jax.random.key(0), **settings))
    other = np.asarray(port.generate(model, ids, key=jax.random.key(1), **settings))
    np.testing.assert_array_equal(first, again)
    assert (first[:, 9:] != other[:, 9:]).any()
    greedy = np.asarray(port.generate(model, ids, max_new_tokens=16, attention_mask=mask))
    top1 = port.generate(model, ids, max_new_tokens=16, attention_mask=mask, key=jax.random.key(2), top_k=1)
    np.testing.assert_array_equal(np.asarray(top1), greedy)
    assert (first[:, 9:] != greedy[:, 9:]).any()


@pytest.mark.slow
def test_the_decode_step_compiles_once(llama):
    """A sampled generation of 11 or of 29 tokens compiles the same programs (after a first run,
    which compiles the shape-independent pieces): the cache, prefill, the state, the first
    pick and the decode step, not one per token; another key and temperature compile nothing."""
    _, model = llama
    ids, mask = prompts()

    def compiles(new, key, temperature):
        events = []

        def listener(name, *_, **__):
            return events.append(name) if name.endswith("backend_compile_duration") else None

        jax.monitoring.register_event_duration_secs_listener(listener)
        try:
            port.generate(
                model,
                ids,
                max_new_tokens=new,
                attention_mask=mask,
                key=jax.random.key(key),
                temperature=temperature,
                top_k=20,
                top_p=0.9,
                repetition_penalty=1.1,
                eos_token_id=[1, 2],
            )
        finally:
            jax.monitoring.unregister_event_duration_listener(listener)
        return len(events)

    compiles(5, 0, 0.7)  # lengths no other test here uses: nothing of theirs is compiled yet
    short, long = compiles(11, 0, 0.7), compiles(29, 0, 0.7)
    assert short == long <= 8, (short, long)
    assert compiles(29, 5, 1.3) == 0


class Fixed(eqx.Module):
    """A decoder whose logits are `logits` at every slot, whatever the ids: the sampler alone."""

    logits: jax.Array

    def init_cache(self, batch, length):
        return port.nn.Cache.empty(layers=1, batch=batch, length=length, kv_heads=1, head_dim=1, dtype=jnp.float32)

    def __call__(self, ids, *, attention_mask=None, cache=None):
        return jnp.broadcast_to(self.logits, (*ids.shape, self.logits.shape[0])), cache


@pytest.mark.parametrize(
    "settings, kept",
    [(dict(temperature=0.5), 5), (dict(temperature=2.0, top_k=3), 3), (dict(top_p=0.6), 2)],
    ids=["temperature", "top-k", "top-p"],
)
def test_first_token_frequencies_are_the_processed_softmax(settings, kept):
    """One generate over 20000 rows of a model whose logits are fixed: the first token's
    frequencies within 0.015 (over 4 standard deviations) of softmax(processed logits)."""
    logits = jnp.array([1.0, 2.0, 0.5, -1.0, 1.5])
    rows = 20000
    out = port.generate(
        Fixed(logits), np.ones((rows, 2), np.int32), max_new_tokens=1, key=jax.random.key(7), **settings
    )
    frequencies = np.bincount(np.asarray(out)[:, 2], minlength=5) / rows
    expected = np.asarray(jax.nn.softmax(process_logits(logits[None], **settings)[0]))
    assert (expected > 0).sum() == kept
    np.testing.assert_allclose(frequencies, expected, atol=0.015)
    assert (frequencies[expected == 0] == 0).all()


@pytest.mark.slow
def test_t5_takes_the_same_processors(tmp_path):
    """An encoder-decoder: greedy with the repetition penalty and two eos ids is transformers'
    (the decoder's start token counted, as transformers does; cut where it stops), and a
    sample is reproducible with its key."""
    import torch
    from test_t5 import batch, torch_t5

    torch_lm = torch_t5("t5")
    model = converted(torch_lm, tmp_path)
    ids, mask, _, _ = batch()
    settings = dict(do_sample=False, max_new_tokens=20, repetition_penalty=1.4, pad_token_id=0)
    with torch.no_grad():
        free = torch_lm.generate(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask), **settings).numpy()
        eos = [1, *(int(free[row, 3 + 2 * row]) for row in range(4))]  # every row stops by its 9th token
        theirs = torch_lm.generate(
            input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask), eos_token_id=eos, **settings
        ).numpy()
    ours = np.asarray(
        port.generate(model, ids, max_new_tokens=20, attention_mask=mask, repetition_penalty=1.4, eos_token_id=eos)
    )
    assert theirs.shape[1] < 21 and (ours[0, 4:] == 0).all()  # transformers stopped early; row 0 by its 3rd token
    np.testing.assert_array_equal(ours[:, : theirs.shape[1]], theirs)
    assert (ours[:, theirs.shape[1] :] == 0).all()
    sampled = dict(max_new_tokens=20, attention_mask=mask, eos_token_id=eos, temperature=1.5)
    first = np.asarray(port.generate(model, ids, key=jax.random.key(0), **sampled))
    np.testing.assert_array_equal(first, np.asarray(port.generate(model, ids, key=jax.random.key(0), **sampled)))
    assert (first != np.asarray(port.generate(model, ids, key=jax.random.key(1), **sampled))).any()


@pytest.mark.parametrize(
    "arguments, error, message",
    [
        (dict(temperature=0.7), ValueError, r"`temperature` is for sampling: pass `key`"),
        (dict(top_p=0.9), ValueError, r"`top_p` is for sampling: pass `key`"),
        (dict(key=0), TypeError, r"`key` must be one jax.random key"),
        (dict(key=jax.random.split(jax.random.key(0))), TypeError, r"`key` must be one jax.random key"),
        (dict(key=jax.random.key(0), temperature=0.0), ValueError, r"`temperature` must be a number in \(0, inf\)"),
        (dict(key=jax.random.key(0), top_p=1.5), ValueError, r"`top_p` must be a number in \[0, 1\]"),
        (dict(key=jax.random.key(0), min_p=-0.1), ValueError, r"`min_p` must be a number in \[0, 1\]"),
        (dict(key=jax.random.key(0), top_k=-1), ValueError, r"`top_k` must be a non-negative integer"),
        (dict(key=jax.random.key(0), top_k=2.5), ValueError, r"`top_k` must be a non-negative integer"),
        (dict(repetition_penalty=0), ValueError, r"`repetition_penalty` must be a number in \(0, inf\)"),
        (dict(eos_token_id=[]), ValueError, r"`eos_token_id` must be a token id or a non-empty list"),
        (dict(eos_token_id=[2, -1]), ValueError, r"`eos_token_id` must be a token id \(a non-negative integer\)"),
        (dict(pad_token_id=None), ValueError, r"`pad_token_id` must be a token id"),
    ],
)
def test_generate_refuses_bad_sampling_arguments_in_one_line(arguments, error, message):
    """Before anything is compiled or the model is called (a model that is not one)."""
    with pytest.raises(error, match=message) as refused:
        port.generate(object(), np.ones((1, 3), np.int32), max_new_tokens=2, **arguments)
    assert "\n" not in str(refused.value)
