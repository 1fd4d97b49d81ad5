"""port.nn, the library of layers: each piece against transformers or a plain reference, and its errors.

The families' own tests (and tests/test_decoders.py) check the layers in place; here
each is checked alone: YaRN's frequencies, soft-capped and sink attention against the
formula, masks and positions, the cache's and generate's refusals, a decode step that
compiles once, remat's names.
"""

import functools

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import port
from port.models.llama import Llama, LlamaConfig
from port.nn import Cache, attend, cast, generate, prepare, read_rope, rms_norm, scan

from helpers import LLAMA_CONFIG, transformers_or_skip

SMALL = {**LLAMA_CONFIG, "model_type": "llama", "num_hidden_layers": 2}


@pytest.mark.parametrize(
    "rope",
    [
        dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=32),
        dict(
            rope_type="yarn",
            rope_theta=500000.0,
            factor=8.0,
            original_max_position_embeddings=16,
            beta_fast=16.0,
            beta_slow=2.0,
            mscale=1.0,
            mscale_all_dim=0.5,
        ),
    ],
    ids=["yarn", "yarn-mscale"],
)
def test_yarn_matches_transformers(rope):
    """inv_freq and the attention factor of transformers' YaRN (Qwen2's rotary embedding)."""
    transformers = transformers_or_skip()
    config = {**LLAMA_CONFIG, "model_type": "qwen2", "head_dim": 64, "rope_parameters": rope}
    theirs = transformers.models.qwen2.modeling_qwen2.Qwen2RotaryEmbedding(transformers.Qwen2Config(**config))
    ours = LlamaConfig.from_hf(config).rope
    np.testing.assert_allclose(ours.inv_freq(), theirs.inv_freq.numpy(), rtol=1e-6)
    assert ours.attention_factor == pytest.approx(theirs.attention_scaling, rel=1e-9)
    assert ours.attention_factor != 1.0


def test_unsupported_rope_is_one_line_naming_the_key():
    with pytest.raises(port.ConfigError, match=r"config.json: rope_parameters: rope type 'dynamic' is not supported"):
        read_rope(
            {"rope_parameters": {"rope_type": "dynamic", "factor": 2.0}},
            64,
            supported=("default",),
            max_position_embeddings=128,
        )


def _qkv(seed=0, heads=4, kv_heads=2, seq=5, dim=8):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((2, seq, heads, dim)).astype(np.float32)
    k = rng.standard_normal((2, seq, kv_heads, dim)).astype(np.float32)
    v = rng.standard_normal((2, seq, kv_heads, dim)).astype(np.float32)
    mask = np.tril(np.ones((seq, seq), bool))[None].repeat(2, 0)
    mask[1, :, 0] = False  # a padded first key in the second sequence
    mask[1, 0, 0] = True
    return q, k, v, mask


def _reference(q, k, v, mask, scale, softcap=None, sinks=None):
    """Plain NumPy attention with grouped kv heads, soft-capping and sinks, as transformers' eager code."""
    groups = q.shape[2] // k.shape[2]
    k, v = np.repeat(k, groups, axis=2), np.repeat(v, groups, axis=2)
    scores = np.einsum("bthd,bshd->bhts", q, k) * scale
    if softcap is not None:
        scores = np.tanh(scores / softcap) * softcap
    scores = np.where(mask[:, None], scores, -np.inf)
    if sinks is not None:
        scores = np.concatenate([scores, np.broadcast_to(sinks[None, :, None, None], scores.shape[:-1] + (1,))], -1)
    weights = np.exp(scores - scores.max(-1, keepdims=True))
    weights = weights / weights.sum(-1, keepdims=True)
    if sinks is not None:
        weights = weights[..., :-1]
    return np.einsum("bhts,bshd->bthd", weights, v)


@pytest.mark.parametrize("softcap, sinks", [(None, None), (2.0, None), (None, True), (3.0, True)])
def test_attend_matches_the_formula(softcap, sinks):
    q, k, v, mask = _qkv()
    sink = np.array([0.5, -1.0, 2.0, 0.0], np.float32) if sinks else None
    ours = attend(
        jnp.asarray(q),
        jnp.asarray(k),
        jnp.asarray(v),
        jnp.asarray(mask),
        scale=0.3,
        softcap=softcap,
        sinks=None if sink is None else jnp.asarray(sink),
    )
    np.testing.assert_allclose(np.asarray(ours), _reference(q, k, v, mask, 0.3, softcap, sink), atol=1e-5)


def test_attend_without_softcap_or_sinks_is_dot_product_attention():
    """The common case goes through jax.nn.dot_product_attention (cuDNN on GPUs), not written-out scores."""
    q, k, v, mask = _qkv()
    jaxpr = str(jax.make_jaxpr(lambda *a: attend(*a, scale=0.3))(q, k, v, mask))
    written = str(jax.make_jaxpr(lambda *a: attend(*a, scale=0.3, softcap=2.0))(q, k, v, mask))
    assert "tanh" not in jaxpr and "tanh" in written
    ref = jax.nn.dot_product_attention(q, k, v, mask=mask[:, None], scale=0.3)
    np.testing.assert_array_equal(np.asarray(attend(q, k, v, mask, scale=0.3)), np.asarray(ref))


def test_positions_follow_the_mask_and_restart_per_segment():
    mask = np.array([[0, 0, 1, 1, 1], [1, 1, 1, 0, 0]])
    tokens = prepare(np.zeros((2, 5), np.int32), attention_mask=mask)
    np.testing.assert_array_equal(tokens.positions, [[0, 0, 0, 1, 2], [0, 1, 2, 0, 0]])
    assert not bool(tokens.mask[0, 4, 1]) and bool(tokens.mask[0, 4, 2]) and not bool(tokens.mask[1, 1, 2])
    packed = prepare(np.zeros((1, 6), np.int32), segment_ids=np.array([[3, 3, 3, 7, 7, 9]]))
    np.testing.assert_array_equal(packed.positions, [[0, 1, 2, 0, 1, 0]])
    assert not bool(packed.mask[0, 3, 2]) and bool(packed.mask[0, 4, 3])
    window = prepare(np.zeros((1, 6), np.int32), window=2)
    np.testing.assert_array_equal(np.asarray(window.sliding[0, 5]), [0, 0, 0, 0, 1, 1])


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        (
            dict(attention_mask=np.ones((2, 4))),
            ValueError,
            r"`attention_mask` must have shape \(batch, seq\) = \(2, 5\)",
        ),
        (dict(positions=np.zeros((2, 5), np.float32)), TypeError, r"`positions` must have an integer dtype"),
        (dict(segment_ids=np.zeros((5,), np.int32)), ValueError, r"`segment_ids` must have shape"),
        (
            dict(segment_ids=np.zeros((2, 5), np.int32), cache="cache"),
            ValueError,
            r"`segment_ids` cannot be used with `cache`",
        ),
        (dict(cache="short"), ValueError, r"`cache` has 4 slots, too few for 5 tokens"),
        (dict(cache="batch"), ValueError, r"`cache` holds a batch of 3, but `input_ids` has 2"),
    ],
)
def test_bad_inputs_are_one_line_naming_the_argument(kwargs, error, message):
    caches = {
        "cache": Cache.empty(layers=1, batch=2, length=8, kv_heads=1, head_dim=2, dtype=jnp.float32),
        "short": Cache.empty(layers=1, batch=2, length=4, kv_heads=1, head_dim=2, dtype=jnp.float32),
        "batch": Cache.empty(layers=1, batch=3, length=8, kv_heads=1, head_dim=2, dtype=jnp.float32),
    }
    if "cache" in kwargs:
        kwargs = {**kwargs, "cache": caches[kwargs["cache"]]}
    with pytest.raises(error, match=message):
        prepare(np.zeros((2, 5), np.int32), **kwargs)


@pytest.fixture(scope="module")
def llama():
    return Llama.from_config(SMALL, key=jax.random.key(0))


def test_model_call_checks_before_compiling(llama):
    with pytest.raises(ValueError, match=r"`attention_mask` must have shape"):
        jax.jit(lambda ids, mask: llama(ids, attention_mask=mask))(np.zeros((2, 5), np.int32), np.ones((2, 6)))
    with pytest.raises(ValueError, match=r"`remat` 'some' is not one of"):
        llama(np.zeros((1, 3), np.int32), remat="some")
    with pytest.raises(TypeError, match=r"`dtype` must be a floating dtype"):
        llama(np.zeros((1, 3), np.int32), dtype=jnp.int32)


@pytest.mark.parametrize("bad", [0, -1, 2.5, True])
def test_generate_refuses_max_new_tokens_below_one(llama, bad):
    with pytest.raises(ValueError, match=r"`max_new_tokens` must be a positive integer"):
        generate(llama, np.ones((1, 3), np.int32), max_new_tokens=bad)


def test_generate_refuses_a_mask_of_another_shape_and_a_model_without_cache(llama):
    with pytest.raises(ValueError, match=r"`attention_mask` must have shape"):
        generate(llama, np.ones((2, 3), np.int32), max_new_tokens=2, attention_mask=np.ones((2, 4)))
    with pytest.raises(TypeError, match=r"`model` must be a port decoder with init_cache"):
        generate(lambda ids: ids, np.ones((1, 3), np.int32), max_new_tokens=2)
    with pytest.raises(TypeError, match=r"`decoder_input_ids` is for an encoder-decoder; Llama is a decoder"):
        generate(llama, np.ones((1, 3), np.int32), max_new_tokens=2, decoder_input_ids=np.ones((1, 1), np.int32))


def test_seq2seq_loss_is_transformers_cross_entropy_skipping_minus_100():
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(0)
    logits = rng.standard_normal((2, 5, 11)).astype(np.float32)
    labels = rng.integers(0, 11, (2, 5))
    labels[0, 3:] = -100
    theirs = torch.nn.functional.cross_entropy(torch.tensor(logits).reshape(-1, 11), torch.tensor(labels).reshape(-1))
    assert abs(float(port.nn.seq2seq_loss(logits, labels)) - float(theirs)) < 1e-6
    assert float(port.nn.seq2seq_loss(logits[0], labels[0])) == pytest.approx(
        float(torch.nn.functional.cross_entropy(torch.tensor(logits[0]), torch.tensor(labels[0]))), abs=1e-6
    )


def test_a_full_cache_is_an_error_not_a_silent_overwrite(llama):
    cache = llama.init_cache(1, 4)
    _, cache = llama(np.ones((1, 3), np.int32), cache=cache)
    _, cache = llama(np.ones((1, 1), np.int32), cache=cache)
    with pytest.raises(Exception, match="`cache` is full"):
        llama(np.ones((1, 1), np.int32), cache=cache)[0].block_until_ready()


def test_decode_step_compiles_once_whatever_the_length(llama):
    """8 or 24 new tokens (after a first run, which compiles the shape-independent pieces): the
    same number of compilations, so nothing compiles per generated token."""
    counts = []
    for new in (4, 8, 24):
        events = []

        def listener(name, *_, **__):
            return events.append(name) if name.endswith("backend_compile_duration") else None

        jax.monitoring.register_event_duration_secs_listener(listener)
        try:
            generate(
                llama,
                np.ones((2, 5), np.int32) + np.arange(5),
                max_new_tokens=new,
                attention_mask=np.array([[1] * 5, [0, 0, 1, 1, 1]]),
            )
        finally:
            jax.monitoring.unregister_event_duration_listener(listener)
        counts.append(len(events))
    assert counts[2] == counts[1] and counts[1] <= 12, counts


def test_cached_decoding_equals_the_full_forward(llama):
    """Prefill 6 tokens then 3 single steps: each step's logits equal the full sequence's."""
    ids = np.random.default_rng(0).integers(3, 90, (2, 9)).astype(np.int32)
    full = np.asarray(llama(ids))
    cache = llama.init_cache(2, 12)
    out, cache = llama(ids[:, :6], cache=cache)
    np.testing.assert_allclose(np.asarray(out), full[:, :6], atol=1e-5)
    for t in range(6, 9):
        out, cache = llama(ids[:, t : t + 1], cache=cache)
        np.testing.assert_allclose(np.asarray(out[:, 0]), full[:, t], atol=1e-5)
    assert int(cache.length) == 9 and list(np.asarray(cache.next_position)) == [9, 9]


def test_scan_remat_names_and_cast():
    blocks = jnp.ones((3, 2))
    for remat in (None, True, "full", "dots", jax.checkpoint_policies.nothing_saveable):
        x, _ = scan(lambda b, h: (h + b, None), jnp.zeros(2), blocks, remat=remat)
        np.testing.assert_array_equal(x, [3.0, 3.0])
    with pytest.raises(TypeError, match="`remat` must be"):
        scan(lambda b, h: (h, None), jnp.zeros(2), blocks, remat=3)
    tree = {"w": jnp.ones(2), "i": jnp.ones(2, jnp.int32)}
    half = cast(tree, jnp.bfloat16)
    assert half["w"].dtype == jnp.bfloat16 and half["i"].dtype == jnp.int32


def test_run_layers_gives_local_layers_their_own_window_and_rope():
    """`sliding` picks, per layer, the windowed mask and (with `sliding_rope`) the local RoPE."""
    import equinox as eqx

    from port.nn import run_layers

    class Probe(eqx.Module):
        w: jax.Array

        def __call__(self, x, mask, *, cos, sin, kv, index, layer):
            return x + self.w * 0 + mask.sum() + 100 * cos.sum(), kv

    tokens = prepare(np.zeros((1, 4), np.int32), window=2)
    ones, twos = jnp.ones((1, 4, 2)), 2 * jnp.ones((1, 4, 2))
    x, _ = run_layers(
        Probe(jnp.zeros((2, 1))),
        jnp.zeros((1, 4, 1)),
        tokens,
        cos=ones,
        sin=ones,
        sliding=(False, True),
        sliding_rope=(twos, twos),
    )
    # layer 0: causal mask (10 pairs), cos sum 8; layer 1: window 2 (7 pairs), cos sum 16
    np.testing.assert_allclose(np.asarray(x)[0, 0, 0], 10 + 800 + 7 + 1600)


def test_remat_keeps_less_for_the_backward_pass(llama):
    """remat=True: the compiled gradient's temporary memory (XLA's own accounting) shrinks."""
    import equinox as eqx

    from port.nn import next_token_loss

    ids = np.ones((4, 64), np.int32)

    def temp(remat):
        grad = eqx.filter_grad(lambda m: next_token_loss(m(ids, remat=remat), ids))
        compiled = jax.jit(lambda p: grad(eqx.combine(p, static))).lower(params).compile()
        return compiled.memory_analysis().temp_size_in_bytes

    params, static = eqx.partition(llama, eqx.is_array)
    assert temp(True) < 0.8 * temp(None)


# ---------------------------------------------------------------- layers of several kinds


@pytest.fixture(scope="module")
def mistral4():
    """A 4-layer Mistral (window 3) whose layers run_groups regroups in every test below."""
    config = {**LLAMA_CONFIG, "model_type": "mistral", "num_hidden_layers": 4, "sliding_window": 3}
    return Llama.from_config(config, key=jax.random.key(1))


@functools.partial(jax.jit, static_argnums=(1,), static_argnames=("remat",))
def regrouped(model, kinds, ids, cache=None, remat=None):
    """`model`'s layers split into one stack per kind of `kinds`, run by run_groups."""
    import equinox as eqx

    from port.nn import head, rms_norm, run_groups

    params, static = eqx.partition(model.blocks, eqx.is_array)
    groups = {
        kind: eqx.combine(
            jax.tree.map(lambda a: a[np.array([i for i, k in enumerate(kinds) if k == kind])], params), static
        )
        for kind in dict.fromkeys(kinds)
    }
    c = model.config
    tokens = prepare(ids, cache=cache, window=c.sliding_window)
    x = model.embed[tokens.ids]
    cos, sin = c.rope.angles(tokens.positions, x.dtype)
    x, parts = run_groups(groups, kinds, x, tokens, cos=cos, sin=sin, sliding=c.sliding_layers, remat=remat)
    return tokens.output(head(rms_norm(x, model.norm, c.rms_norm_eps), model.embed, model.lm_head), *parts)


@eqx.filter_jit
def summed_grad(model, ids, kinds=None, remat=None):
    """The gradient of the logits' sum: through `regrouped` by `kinds`, or the model's own call."""
    run = (lambda m: m(ids)) if kinds is None else (lambda m: regrouped(m, kinds, ids, remat=remat))
    return eqx.filter_grad(lambda m: run(m).astype(jnp.float32).sum())(model)


# (kinds, how run_groups runs them): a pattern repeated, runs, one kind.
KINDS = [("abab", "one scan over 2 repeats"), ("aaab", "two scans"), ("abbb", "two scans"), ("aaaa", "run_layers")]


@pytest.mark.parametrize("kinds", [k for k, _ in KINDS])
def test_run_groups_equals_one_stack(mistral4, kinds):
    """The same layers, regrouped by kind, give the model's logits; so does the gradient
    (through the pattern's scan with remat, and through runs)."""
    ids = np.random.default_rng(0).integers(0, LLAMA_CONFIG["vocab_size"], (2, 9)).astype(np.int32)
    np.testing.assert_allclose(regrouped(mistral4, tuple(kinds), ids), mistral4(ids), atol=1e-6, rtol=0)
    if kinds not in ("abab", "aaab"):
        return
    ours = summed_grad(mistral4, ids, tuple(kinds), remat=kinds == "abab")
    theirs = summed_grad(mistral4, ids)  # compiled once for both cases
    for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(theirs)):
        # Float32 sums in another order: within 1e-5 of the leaf's largest entry (up to ~40 here).
        np.testing.assert_allclose(a, b, atol=1e-5 * float(np.abs(b).max()) + 1e-7, rtol=0)


@pytest.mark.parametrize("kinds, per_kind", [("abab", False), ("aabb", True)], ids=["one-buffer", "buffers-by-kind"])
def test_run_groups_decodes_with_either_cache_layout(mistral4, kinds, per_kind):
    """Prefill then one token at a time, through a cache over every layer or one per kind:
    the logits of the whole sequence at once."""
    kinds = tuple(kinds)
    ids = np.random.default_rng(1).integers(0, LLAMA_CONFIG["vocab_size"], (2, 9)).astype(np.int32)
    layers, kv_heads, head_dim = mistral4.cache_sizes
    if per_kind:
        zeros = lambda n: jnp.zeros((n, 2, 12, kv_heads, head_dim))  # noqa: E731
        cache = Cache.of(
            {k: zeros(kinds.count(k)) for k in "ab"}, {k: zeros(kinds.count(k)) for k in "ab"}, batch=2, length=12
        )
    else:
        cache = mistral4.init_cache(2, 12)
    out, cache = regrouped(mistral4, kinds, ids[:, :5], cache)
    steps = [out]
    for t in range(5, 9):
        out, cache = regrouped(mistral4, kinds, ids[:, t : t + 1], cache)
        steps.append(out)
    np.testing.assert_allclose(jnp.concatenate(steps, axis=1), mistral4(ids), atol=1e-5, rtol=0)
    assert isinstance(cache.keys, dict) == per_kind


def test_run_groups_refuses_a_kind_without_blocks_or_cache(mistral4):
    ids = np.zeros((1, 3), np.int32)
    with pytest.raises(ValueError, match="layer kind 'b' has layers but no blocks"):
        from port.nn import run_groups

        run_groups({"a": mistral4.blocks, "b": None}, ("a", "b"), jnp.zeros((1, 3, 48)), prepare(ids))
    zeros = jnp.zeros((4, 1, 8, 2, 8))
    cache = Cache.of({"a": zeros}, {"a": zeros}, batch=1, length=8)
    with pytest.raises(ValueError, match="the cache holds nothing for layer kind 'b'"):
        regrouped(mistral4, ("a", "b", "a", "b"), ids, cache)


@pytest.mark.parametrize(
    "norms, plus_one, float32_scale",
    [("pre", False, False), ("pre", True, False), ("post", False, True), ("sandwich", True, False)],
    ids=["pre", "pre-plus-one", "post-float32", "sandwich"],
)
def test_block_is_the_residual_formula(norms, plus_one, float32_scale):
    """Block: x + post(attn(pre(x))), then + post(mlp(pre(x))), with the norms its layout
    has (weights starting at 1, or at 0 for `(1 + w)` norms) and the attention's keys and
    values handed back."""
    from port.nn import Attention, Block, GatedMLP, rms_norm

    k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
    attn = Attention(heads=4, kv_heads=2, head_dim=8, embd=24, dtype=jnp.float32, key=k1)
    mlp = GatedMLP(embd=24, inner=40, activation="silu", dtype=jnp.float32, key=k2)
    block = Block(
        attn, mlp, embd=24, eps=1e-5, dtype=jnp.float32, norms=norms, plus_one=plus_one, float32_scale=float32_scale
    )
    names = ("attn_norm", "post_attn_norm", "mlp_norm", "post_mlp_norm")
    present = [n for n in names if getattr(block, n) is not None]
    assert (
        present
        == {
            "pre": ["attn_norm", "mlp_norm"],
            "post": ["post_attn_norm", "post_mlp_norm"],
            "sandwich": list(names),
        }[norms]
    )
    assert all(float(getattr(block, n)[0]) == (0.0 if plus_one else 1.0) for n in present)
    block = eqx.tree_at(
        lambda b: tuple(getattr(b, n) for n in present),
        block,
        tuple(jax.random.normal(jax.random.fold_in(k3, i), (24,)) for i in range(len(present))),
    )

    def norm(x, name):
        w = getattr(block, name)
        return x if w is None else rms_norm(x, w, 1e-5, plus_one=plus_one, float32_scale=float32_scale)

    x = jax.random.normal(jax.random.fold_in(k3, 9), (2, 5, 24))
    mask = prepare(np.ones((2, 5), np.int32)).mask
    y, kv = block(x, mask, cos=None, sin=None, kv=None, index=None)
    h, kv_attn = attn(norm(x, "attn_norm"), mask)
    expected = x + norm(h, "post_attn_norm")
    expected = expected + norm(mlp(norm(expected, "mlp_norm")), "post_mlp_norm")
    np.testing.assert_allclose(y, expected, atol=1e-6, rtol=0)
    for a, b in zip(jax.tree.leaves(kv), jax.tree.leaves(kv_attn)):
        np.testing.assert_array_equal(a, b)


def test_rms_norm_float32_scale_is_olmo2s():
    """`float32_scale`: OLMo 2's RMSNorm, the weight applied in float32 before the cast to
    bfloat16 (Llama's casts first: the two differ in the last bit)."""
    torch = pytest.importorskip("torch")
    transformers = transformers_or_skip()
    norm = transformers.models.olmo2.modeling_olmo2.Olmo2RMSNorm(64, eps=1e-6).to(torch.bfloat16)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(64) * 3)
    x = torch.randn(4, 64).to(torch.bfloat16)
    theirs = norm(x).detach().float().numpy()
    weight = jnp.asarray(norm.weight.detach().float().numpy(), jnp.bfloat16)
    xs = jnp.asarray(x.float().numpy(), jnp.bfloat16)
    ours = np.asarray(rms_norm(xs, weight, 1e-6, float32_scale=True).astype(jnp.float32))
    np.testing.assert_array_equal(ours, theirs)
    cast_first = np.asarray(rms_norm(xs, weight, 1e-6).astype(jnp.float32))
    assert not np.array_equal(cast_first, theirs)


def test_attention_norms_the_whole_projection():
    """qk_norm="projection" (OLMo 2): one RMSNorm over every head's queries (and keys),
    leaves `[heads, head_dim]`, against transformers' Olmo2Attention's q_norm/k_norm."""
    from port.nn import Attention

    attn = Attention(
        heads=4, kv_heads=2, head_dim=8, embd=24, dtype=jnp.float32, key=jax.random.key(0), qk_norm="projection"
    )
    assert attn.q_norm is not None and attn.k_norm is not None
    assert attn.q_norm.shape == (4, 8) and attn.k_norm.shape == (2, 8)
    attn = eqx.tree_at(lambda a: a.q_norm, attn, jax.random.normal(jax.random.key(1), (4, 8)))
    x = jax.random.normal(jax.random.key(2), (1, 3, 24))
    q, _, _ = attn.project(x, None, None)
    raw = jnp.einsum("bte,hde->bthd", x, attn.wq).reshape(1, 3, 32)
    expected = rms_norm(raw, attn.q_norm.reshape(32), 1e-6).reshape(1, 3, 4, 8)
    np.testing.assert_allclose(q, expected, atol=1e-6, rtol=0)
    per_head = rms_norm(raw.reshape(1, 3, 4, 8), jnp.ones(8), 1e-6) * attn.q_norm  # each head alone
    assert not np.allclose(q, per_head, atol=1e-3)


def test_run_layers_skips_rotary_on_the_layers_rope_layers_marks():
    """rope_layers=(True, False, True): the middle layer runs as if given no cos/sin (a NoPE
    layer, SmolLM3), bit for bit; the others rotate."""
    from port.nn import Attention, Block, GatedMLP, Rope, run_layers, stacked

    def make(key):
        k1, k2 = jax.random.split(key)
        attn = Attention(heads=2, kv_heads=1, head_dim=8, embd=16, dtype=jnp.float32, key=k1)
        mlp = GatedMLP(embd=16, inner=24, activation="silu", dtype=jnp.float32, key=k2)
        return Block(attn, mlp, embd=16, eps=1e-6, dtype=jnp.float32)

    blocks = stacked(make, jax.random.key(0), 3)
    # Sharper scores than the initialisation's, so that rotating or not shows.
    blocks = eqx.tree_at(lambda b: (b.attn.wq, b.attn.wk), blocks, (blocks.attn.wq * 30, blocks.attn.wk * 30))
    tokens = prepare(np.zeros((2, 5), np.int32))
    x = jax.random.normal(jax.random.key(1), (2, 5, 16))
    cos, sin = Rope(theta=10000.0, rotary_dim=8).angles(tokens.positions, jnp.float32)
    y, _ = run_layers(blocks, x, tokens, cos=cos, sin=sin, rope_layers=(True, False, True))
    expected = x
    for i, rotates in enumerate((True, False, True)):
        block = jax.tree.map(lambda a, i=i: a[i] if eqx.is_array(a) else a, blocks)
        expected, _ = block(
            expected, tokens.mask, cos=cos if rotates else None, sin=sin if rotates else None, kv=None, index=None
        )
    np.testing.assert_allclose(y, expected, atol=1e-5, rtol=0)
    everywhere, _ = run_layers(blocks, x, tokens, cos=cos, sin=sin)
    assert np.abs(everywhere - expected).max() > 1e-2


def test_attention_q_scale_multiplies_each_query():
    """`q_scale` [batch, seq]: a factor per query after RoPE (Ministral 3); a constant 2 is the
    attention with twice the score scale, and a factor of 1 on some queries leaves those rows."""
    from port.nn import Attention, Rope

    attn = Attention(heads=4, kv_heads=2, head_dim=8, embd=24, dtype=jnp.float32, key=jax.random.key(0))
    x = jax.random.normal(jax.random.key(1), (2, 5, 24)) * 5
    tokens = prepare(np.ones((2, 5), np.int32))
    cos, sin = Rope(theta=10000.0, rotary_dim=8).angles(tokens.positions, jnp.float32)
    doubled, _ = attn(x, tokens.mask, cos=cos, sin=sin, q_scale=jnp.full((2, 5), 2.0))
    q, k, v = attn.project(x, cos, sin)
    sharper = jnp.einsum("bthd,ehd->bte", attend(q, k, v, tokens.mask, scale=attn.scale * 2), attn.wo)
    np.testing.assert_allclose(doubled, sharper, atol=1e-5, rtol=0)
    plain, _ = attn(x, tokens.mask, cos=cos, sin=sin)
    mixed, _ = attn(x, tokens.mask, cos=cos, sin=sin, q_scale=jnp.asarray([[1.0, 1.0, 2.0, 2.0, 2.0]] * 2))
    np.testing.assert_allclose(mixed[:, :2], plain[:, :2], atol=1e-6, rtol=0)
    np.testing.assert_allclose(mixed[:, 2:], doubled[:, 2:], atol=1e-6, rtol=0)
    assert np.abs(doubled - plain).max() > 1e-3
