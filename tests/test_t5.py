"""T5, mT5 and UMT5 (`port.models.t5`), converted by the shipped mappings, against `transformers`.

Three tiny seeded checkpoints written by `save_pretrained`: T5 (ReLU, the head tied to
`shared` and scaled by `d_model**-0.5`, one relative position table shared by every
layer), UMT5 (gated-GeLU, a table per layer, an untied head) and mT5 (gated-GeLU, an
untied head, no scaling); d_kv x heads is not d_model. For each: the encoder's last
hidden state (the encoder of the full checkpoint, loaded with `mapping="t5_encoder"`)
and the full model's logits on a batch padded on the right and on the left, on meshes
1x1 and 4x2; bfloat16 compute as near as transformers' own; gradients of the
sequence-to-sequence loss equal to PyTorch's for every parameter; greedy generation
token for token equal to transformers' `generate`; export round trips bit for bit, the
encoder of a full checkpoint exported as `T5EncoderModel`; `port verify` and the config
refusals through the command line.
"""

import copy
import json
import shutil

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file

import port
from port._errors import ConfigError
from port.models.t5 import T5, T5Encoder, T5Model, relative_buckets
from port.nn import attend, generate, seq2seq_loss

from helpers import one_line, perturbed, run_port, transformers_or_skip

VOCAB = 100
CONFIG = dict(
    vocab_size=VOCAB,
    d_model=32,
    d_kv=12,  # 4 heads of 12: 48, not d_model
    d_ff=64,
    num_layers=2,
    num_heads=4,
    relative_attention_num_buckets=8,
    relative_attention_max_distance=16,
    decoder_start_token_id=0,
    pad_token_id=0,
    eos_token_id=1,
)
# name: (config class, full model class, encoder class, overrides, whether the head is untied)
CASES = {
    "t5": ("T5Config", "T5ForConditionalGeneration", "T5EncoderModel", dict(feed_forward_proj="relu"), False),
    "umt5": ("UMT5Config", "UMT5ForConditionalGeneration", "UMT5EncoderModel", {}, True),
    "mt5": ("MT5Config", "MT5ForConditionalGeneration", "MT5EncoderModel", dict(num_decoder_layers=3), True),
}
ENCODER_MAPPING = {"t5": "t5_encoder", "umt5": "umt5_encoder", "mt5": "t5_encoder"}


def batch():
    """Encoder ids (4 x 14: whole, right-padded, left-padded, 3 real tokens), their mask, decoder
    ids (4 x 7, the second right-padded) and their mask."""
    rng = np.random.default_rng(0)
    ids = rng.integers(2, VOCAB, (4, 14))
    mask = np.ones_like(ids)
    mask[1, 9:] = 0
    mask[2, :6] = 0
    mask[3, 3:] = 0
    ids = np.where(mask == 1, ids, 0)
    dec = rng.integers(2, VOCAB, (4, 7))
    dec[:, 0] = 0  # the start token
    dec_mask = np.ones_like(dec)
    dec_mask[1, 5:] = 0
    return ids, mask, dec, dec_mask


def torch_t5(name):
    """The case's seeded transformers model (eval mode, norms perturbed, an untied head where asked)."""
    transformers = transformers_or_skip()
    import torch

    config_class, full, _, overrides, untied = CASES[name]
    config = getattr(transformers, config_class)(**{**CONFIG, **overrides})
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = perturbed(getattr(transformers, full)(config), lambda n: "layer_norm" in n, 0.3)
    if untied:
        with torch.no_grad():
            model.lm_head.weight = torch.nn.Parameter(torch.randn_like(model.shared.weight))
    return model


@pytest.fixture(scope="module")
def twins(tmp_path_factory):
    """get(name): (the PyTorch model, its checkpoint directory, its outputs on `batch()`), each made once."""
    made = {}

    def get(name):
        if name not in made:
            import torch

            model = torch_t5(name)
            directory = tmp_path_factory.mktemp(name)
            model.save_pretrained(directory)
            ids, mask, dec, dec_mask = map(torch.tensor, batch())
            with torch.no_grad():
                out = model(input_ids=ids, attention_mask=mask, decoder_input_ids=dec, decoder_attention_mask=dec_mask)
            made[name] = model, directory, (out.encoder_last_hidden_state.numpy(), out.logits.numpy())
        return made[name]

    return get


@pytest.fixture(scope="module")
def loaded(twins):
    """get(name, mesh, encoder=False): port.load of the case's full checkpoint (the encoder alone
    with `encoder`), one load each."""
    made = {}

    def get(name, mesh, encoder=False):
        if (name, mesh, encoder) not in made:
            mapping = ENCODER_MAPPING[name] if encoder else None
            made[name, mesh, encoder] = port.load(twins(name)[1], mesh=port.make_mesh(mesh), mapping=mapping)
        return made[name, mesh, encoder]

    return get


@eqx.filter_jit
def encoded(model, ids, mask, dtype=None):
    return model(ids, attention_mask=mask, dtype=dtype)


@eqx.filter_jit
def logits(model, ids, mask, dec, dec_mask, dtype=None):
    return model(ids, dec, attention_mask=mask, decoder_attention_mask=dec_mask, dtype=dtype)


# ---------------------------------------------------------------- parity


@pytest.mark.parametrize("name, mesh", [("t5", "1x1"), ("t5", "4x2"), ("umt5", "4x2"), ("mt5", "1x1")])
def test_encoder_of_a_full_checkpoint_matches_transformers(twins, loaded, name, mesh):
    """`mapping="t5_encoder"` on a full checkpoint: a T5Encoder, its output the full model's encoder's."""
    _, _, (hidden, _) = twins(name)
    ids, mask, _, _ = batch()
    model = loaded(name, mesh, encoder=True)
    assert isinstance(model, T5Encoder)
    ours = np.asarray(encoded(model, ids, mask))
    assert ours.shape == hidden.shape == (4, 14, 32)
    assert np.abs(ours - hidden).max() < 1e-4


@pytest.mark.parametrize("name, mesh", [("t5", "1x1"), ("t5", "4x2"), ("umt5", "4x2"), ("mt5", "4x2")])
def test_logits_match_transformers(twins, loaded, name, mesh):
    """The full model on a padded batch: the encoder's mask on its keys and the cross-attention's,
    the decoder's padding with the causal mask; the head tied and scaled (T5) or not."""
    _, _, (_, expected) = twins(name)
    model = loaded(name, mesh)
    assert isinstance(model, T5)
    assert (model.lm_head is None) == (not CASES[name][4])
    assert model.config.scale_output == (name != "mt5")
    if name == "umt5":
        assert model.encoder.relative_bias is None and model.encoder.layers.relative_bias is not None
    ours = np.asarray(logits(model, *batch()))
    assert ours.shape == expected.shape == (4, 7, VOCAB)
    assert np.abs(ours - expected).max() < 1e-4 * max(1.0, np.abs(expected).max())


def test_bfloat16_within_transformers_own_error(twins, loaded):
    """dtype=bfloat16 on float32 parameters: logits off transformers' float32 ones by no more than
    1.5 times transformers' own bfloat16 model's, over the real decoder tokens."""
    import torch

    model, _, (_, full) = twins("t5")
    ids, mask, dec, dec_mask = batch()
    half = logits(loaded("t5", "1x1"), ids, mask, dec, dec_mask, jnp.bfloat16)
    assert half.dtype == jnp.bfloat16
    with torch.no_grad():
        theirs = copy.deepcopy(model).to(torch.bfloat16)(
            input_ids=torch.tensor(ids),
            attention_mask=torch.tensor(mask),
            decoder_input_ids=torch.tensor(dec),
            decoder_attention_mask=torch.tensor(dec_mask),
        )
    real = dec_mask == 1
    theirs_error = np.abs(theirs.logits.float().numpy()[real] - full[real]).max()
    assert np.abs(np.asarray(half, np.float32)[real] - full[real]).max() <= 1.5 * theirs_error


@eqx.filter_jit
@eqx.filter_value_and_grad
def loss_and_grads(model, ids, mask, dec, labels):
    return seq2seq_loss(model(ids, dec, attention_mask=mask), labels)


def shift_right(labels):
    """transformers' `_shift_right`: the start token (0) first, -100 replaced by the pad id (0)."""
    shifted = np.zeros_like(labels)
    shifted[:, 1:] = labels[:, :-1]
    return np.where(shifted == -100, 0, shifted)


@pytest.mark.parametrize("name", ["t5", "umt5"])
def test_gradients_of_the_seq2seq_loss_match_pytorch(twins, name, tmp_path):
    """jax.grad of seq2seq_loss (labels with -100 on some slots) equals PyTorch's backward of
    `model(..., labels=labels).loss` for every parameter, by checkpoint name (through port.export)."""
    import torch

    model, directory, _ = twins(name)
    ids, mask, labels, _ = batch()
    labels[1, 5:] = -100
    labels[3, 2:] = -100
    model.zero_grad()
    loss = model(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask), labels=torch.tensor(labels)).loss
    loss.backward()
    ours = port.load(directory)
    dec = shift_right(labels)

    value, grads = loss_and_grads(ours, ids, mask, dec, labels)
    assert float(value) == pytest.approx(loss.item(), rel=1e-5)
    exported = load_file(port.export(grads, tmp_path / "grads", directory).out / "model.safetensors")
    theirs = {k: p.grad.numpy() for k, p in model.named_parameters() if p.grad is not None}
    assert set(theirs) == set(exported), set(theirs) ^ set(exported)
    largest = max(np.abs(g).max() for g in theirs.values())
    for key, grad in theirs.items():
        np.testing.assert_allclose(
            exported[key], grad, atol=1e-4 * np.abs(grad).max() + 1e-6 * largest, rtol=0, err_msg=key
        )


@pytest.mark.parametrize("name", ["t5", "umt5"])
def test_greedy_generation_matches_transformers(twins, loaded, name):
    """port.nn.generate on a padded batch of inputs of different lengths: transformers'
    `generate(do_sample=False, max_new_tokens=32)` token for token (pad after eos)."""
    import torch

    model, _, _ = twins(name)
    ids, mask, _, _ = batch()
    with torch.no_grad():
        theirs = model.generate(
            input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask), do_sample=False, max_new_tokens=32
        ).numpy()
    ours = np.asarray(generate(loaded(name, "1x1"), ids, attention_mask=mask, max_new_tokens=32, eos_token_id=1))
    assert ours.shape == (4, 33)
    assert (ours[:, 0] == 0).all()  # the decoder start token
    np.testing.assert_array_equal(ours[:, : theirs.shape[1]], theirs)
    assert (ours[:, theirs.shape[1] :] == 0).all()  # transformers stops once every sequence ended


def test_decoding_step_by_step_equals_the_whole_call(loaded):
    """The cache's decode, a token at a time, gives the logits of one call over the whole target."""
    model = loaded("t5", "1x1")
    ids, mask, dec, _ = batch()
    whole = np.asarray(logits(model, ids, mask, dec, None))
    cache = model.init_cache(4, 7, model.encode(ids, attention_mask=mask), attention_mask=mask)
    decode = eqx.filter_jit(lambda model, ids, cache: model.decode(ids, cache=cache))
    first, cache = decode(model, dec[:, :3], cache)
    steps = [np.asarray(first)]
    for t in range(3, 7):
        step, cache = decode(model, dec[:, t : t + 1], cache)
        steps.append(np.asarray(step))
    assert np.abs(np.concatenate(steps, axis=1) - whole).max() < 1e-4


# ---------------------------------------------------------------- export


@pytest.mark.parametrize("name", ["t5", "umt5"])
def test_export_round_trip(twins, loaded, name, tmp_path):
    """port.load on 4x2 -> port.export: the checkpoint's tensors bit for bit (no `lm_head.weight` for a
    tied head), read back by from_pretrained with no key missing or unexpected."""
    model, directory, _ = twins(name)
    out = port.export(loaded(name, "4x2"), tmp_path / "hf", directory).out
    source, exported = load_file(directory / "model.safetensors"), load_file(out / "model.safetensors")
    assert exported.keys() == source.keys()
    assert ("lm_head.weight" in source) == CASES[name][4]
    for key, value in source.items():
        assert exported[key].dtype == value.dtype and exported[key].tobytes() == value.tobytes(), key
    back, info = type(model).from_pretrained(out, output_loading_info=True)
    for what in ("missing_keys", "unexpected_keys", "mismatched_keys", "error_msgs"):
        assert not info[what], f"{what}: {info[what]}"
    assert json.loads((out / "config.json").read_text())["architectures"] == [CASES[name][1]]


@pytest.mark.parametrize("name", ["t5", "mt5"])
def test_encoder_of_a_full_checkpoint_exports_as_the_encoder_class(twins, loaded, name, tmp_path):
    """The encoder loaded from a full checkpoint exports the encoder's tensors only, config.json
    saying the encoder class, which from_pretrained loads with no key missing or unexpected, and
    which loads back (the mapping chosen by `architectures`) to the same bytes."""
    transformers = transformers_or_skip()
    _, directory, (hidden, _) = twins(name)
    out = port.export(
        loaded(name, "4x2", encoder=True), tmp_path / "encoder", directory
    ).out  # the mapping: the model's
    written = json.loads((out / "config.json").read_text())
    encoder_class = CASES[name][2]
    assert written["architectures"] == [encoder_class] and written["model_type"] == name
    source, exported = load_file(directory / "model.safetensors"), load_file(out / "model.safetensors")
    assert set(exported) == {k for k in source if k.startswith("encoder.") or k == "shared.weight"}
    assert all(exported[k].tobytes() == source[k].tobytes() for k in exported)
    back, info = getattr(transformers, encoder_class).from_pretrained(out, output_loading_info=True)
    for what in ("missing_keys", "unexpected_keys", "mismatched_keys", "error_msgs"):
        assert not info[what], f"{what}: {info[what]}"
    again = port.load(out)  # no mapping= : config.json's architectures choose t5_encoder
    assert isinstance(again, T5Encoder)
    assert np.abs(np.asarray(encoded(again, *batch()[:2])) - hidden).max() < 1e-4


def test_a_model_without_a_head(tmp_path):
    """A `T5Model` checkpoint (config.json's architectures choose `t5_model`) gives the decoder's last
    hidden state on 4x2, and exports back bit for bit as `T5Model`, no key missing or unexpected."""
    transformers = transformers_or_skip()
    import torch

    config = transformers.T5Config(**CONFIG, feed_forward_proj="gated-gelu", num_decoder_layers=1)
    config._attn_implementation = "eager"
    torch.manual_seed(2)
    model = perturbed(transformers.T5Model(config), lambda n: "layer_norm" in n, 0.3)
    model.save_pretrained(tmp_path / "bare")
    ids, mask, dec, dec_mask = batch()
    with torch.no_grad():
        expected = model(*map(torch.tensor, (ids, mask, dec, dec_mask))).last_hidden_state.numpy()
    ours = port.load(tmp_path / "bare", mesh=port.make_mesh("4x2"))
    assert isinstance(ours, T5Model)
    assert np.abs(np.asarray(logits(ours, ids, mask, dec, dec_mask)) - expected).max() < 1e-4
    out = port.export(ours, tmp_path / "hf", tmp_path / "bare").out
    source, exported = load_file(tmp_path / "bare" / "model.safetensors"), load_file(out / "model.safetensors")
    assert exported.keys() == source.keys() and all(exported[k].tobytes() == source[k].tobytes() for k in source)
    assert json.loads((out / "config.json").read_text())["architectures"] == ["T5Model"]
    _, info = transformers.T5Model.from_pretrained(out, output_loading_info=True)
    for what in ("missing_keys", "unexpected_keys", "mismatched_keys", "error_msgs"):
        assert not info[what], f"{what}: {info[what]}"


# ---------------------------------------------------------------- the command line


@pytest.fixture(scope="module")
def encoder_checkpoint(tmp_path_factory):
    """A `T5EncoderModel` checkpoint (bare `encoder.` keys and `shared`)."""
    transformers = transformers_or_skip()
    import torch

    config = transformers.T5Config(**CONFIG, feed_forward_proj="gated-gelu")
    torch.manual_seed(1)
    model = perturbed(transformers.T5EncoderModel(config), lambda n: "layer_norm" in n, 0.3)
    directory = tmp_path_factory.mktemp("t5-encoder")
    model.save_pretrained(directory)
    return directory


@pytest.mark.slow
def test_verify_an_encoder_and_a_full_checkpoint_on_4x2(twins, encoder_checkpoint):
    """`port verify --mesh 4x2` through the installed command: a T5EncoderModel checkpoint against
    its last hidden state, a full UMT5 against its logits (decoder ids drawn by verify)."""
    for directory, reference in (
        (encoder_checkpoint, "AutoModelForTextEncoding.last_hidden_state"),  # T5EncoderModel for t5
        (twins("umt5")[1], "AutoModelForSeq2SeqLM.logits"),
    ):
        result = run_port("verify", directory, "--mesh", "4x2")
        output = result.stdout + result.stderr
        assert result.returncode == 0, output
        assert f"vs {reference}" in output and ": ok (tolerance" in output, output
        assert float(output.split("max abs difference ")[1].split()[0]) <= 1e-4


def with_config(source, target, **changes):
    """A copy of the checkpoint `source` at `target` whose config.json has `changes`."""
    shutil.copytree(source, target)
    config = json.loads((target / "config.json").read_text())
    (target / "config.json").write_text(json.dumps({**config, **changes}))
    return target


@pytest.mark.slow
@pytest.mark.parametrize(
    "which, changes, message",
    [
        ("encoder", dict(is_decoder=True), "is_decoder true is not supported by port.models.t5.T5Encoder"),
        ("encoder", dict(feed_forward_proj="gated-gelu-tanh"), "'feed_forward_proj' 'gated-gelu-tanh' must be"),
        ("full", dict(num_decoder_layers=3), "missing tensor 'decoder.block.2.layer.0.SelfAttention.q.weight'"),
    ],
)
def test_config_refusals_are_one_line(twins, encoder_checkpoint, tmp_path, which, changes, message):
    """`port plan` of a config.json the module cannot run, or that contradicts the tensors: one line."""
    source = encoder_checkpoint if which == "encoder" else twins("t5")[1]
    directory = with_config(source, tmp_path / "bad", **changes)
    one_line(run_port("plan", directory), message)


# ---------------------------------------------------------------- the module


def test_relative_buckets_are_transformers():
    """Bidirectional (encoder) and causal (decoder) buckets of distances -200..200, T5's defaults
    and the tests' small ones, equal to transformers' `_relative_position_bucket`."""
    transformers_or_skip()
    import torch
    from transformers.models.t5.modeling_t5 import T5Attention

    relative = np.arange(-200, 201)[None]
    for buckets, distance in ((32, 128), (8, 16)):
        for bidirectional in (True, False):
            theirs = T5Attention._relative_position_bucket(
                torch.tensor(relative), bidirectional=bidirectional, num_buckets=buckets, max_distance=distance
            ).numpy()
            ours = relative_buckets(
                jnp.asarray(relative), bidirectional=bidirectional, num_buckets=buckets, max_distance=distance
            )
            np.testing.assert_array_equal(np.asarray(ours), theirs)


def test_attend_adds_the_bias_before_the_mask():
    """port.nn.attend's `bias`: softmax(q k * scale + bias) over the keys the mask allows, as written out."""
    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.normal(size=(2, 5, 4, 8)), jnp.float32) for _ in range(3))
    bias = jnp.asarray(rng.normal(size=(1, 4, 5, 5)), jnp.float32)
    mask = jnp.asarray(rng.random((2, 5, 5)) < 0.7).at[:, :, 0].set(True)
    scores = jnp.einsum("bthd,bshd->bhts", q, k) * 0.5 + bias
    weights = jax.nn.softmax(jnp.where(mask[:, None], scores, -jnp.inf), axis=-1)
    expected = jnp.einsum("bhts,bshd->bthd", weights, v)
    np.testing.assert_allclose(attend(q, k, v, mask, scale=0.5, bias=bias), expected, atol=1e-5, rtol=0)
    assert not np.allclose(attend(q, k, v, mask, scale=0.5), expected, atol=1e-3)


def test_config_reading():
    """The feed-forward from feed_forward_proj (config.json's dense_act_fn / is_gated_act win, as in
    transformers); the scaling from scale_decoder_outputs, else tie_word_embeddings, never in mT5."""
    shapes = eqx.filter_eval_shape(T5.from_config, {**CONFIG, "feed_forward_proj": "gated-gelu"}, key=jax.random.key(0))
    assert shapes.config.gated and shapes.config.activation == "gelu_new"
    assert shapes.encoder.layers.mlp.wi is None and shapes.encoder.layers.mlp.wi_0.shape == (2, 64, 32)
    assert shapes.decoder.layers.cross.wq.shape == (2, 4, 12, 32)
    assert shapes.encoder.relative_bias.shape == (8, 4) and shapes.encoder.layers.relative_bias is None
    read = _read
    assert read(feed_forward_proj="gated-gelu", dense_act_fn="relu", is_gated_act=False)[:2] == (False, "relu")
    assert read(feed_forward_proj="gated-silu")[:2] == (True, "silu")
    assert read(tie_word_embeddings=False)[2] is False
    assert read(tie_word_embeddings=True, scale_decoder_outputs=False)[2] is False
    assert read(model_type="mt5", tie_word_embeddings=True)[2] is False
    assert read()[2] is True
    for changes, message in (
        (dict(model_type="bart"), "'model_type' 'bart' is not supported by port.models.t5.T5"),
        (dict(dense_act_fn="mish"), "the feed-forward's activation 'mish' is not supported"),
        (dict(relative_attention_num_buckets=2), r"'relative_attention_num_buckets' \(2\) must be at least 4"),
        (dict(relative_attention_max_distance=4), r"'relative_attention_max_distance' \(4\) must exceed half"),
        (dict(decoder_start_token_id=100), r"'decoder_start_token_id' must be a token id below 'vocab_size' \(100\)"),
    ):
        with pytest.raises(ConfigError, match=message) as caught:
            _read(**changes)
        assert "\n" not in str(caught.value)


def _read(**changes):
    """(gated, activation, scaled) of the config with `changes`."""
    from port.models.t5 import FIELDS, T5Config

    config = T5Config.from_hf({**CONFIG, **changes}, FIELDS)
    return config.gated, config.activation, config.scale_output


def test_bad_inputs_are_one_line(loaded):
    model = loaded("t5", "1x1")
    ids, mask, dec, _ = batch()
    with pytest.raises(ValueError, match="`input_ids` and `decoder_input_ids` must both have a batch axis") as caught:
        model(ids, dec[:2], attention_mask=mask)
    assert "\n" not in str(caught.value)
    with pytest.raises(ValueError, match=r"`encoded` must have shape \(batch, src, d_model\) = \(2, src, 32\)"):
        model.init_cache(2, 8, np.zeros((4, 14, 32), np.float32))
    with pytest.raises(TypeError, match="from T5.init_cache"):
        model.decode(
            dec, cache=port.nn.Cache.empty(layers=2, batch=4, length=8, kv_heads=4, head_dim=12, dtype=jnp.float32)
        )
