"""Whisper: port's encoder-decoder, converted by the shipped `mappings/whisper.toml`, against transformers.

Tiny seeded checkpoints written by `save_pretrained`: `WhisperForConditionalGeneration`
with the head tied (keys under `model.`, no `proj_out.weight` saved), the same with an
untied head, 2 encoder heads and `gelu_new`, and the bare `WhisperModel` (no prefix).
Loaded by `port.load` onto meshes 1x1 and 4x2, each gives transformers' logits for the
same `input_features` and `decoder_input_ids` (a decoder padding mask included);
bfloat16 compute is as near float32 as transformers' own bfloat16 model; the gradient of
`port.nn.seq2seq_loss` is PyTorch's for `labels=` by checkpoint name; greedy
`port.generate` from the features and Whisper's forced prompt is transformers' token for
token; `port export` writes the checkpoint back bit for bit; `port verify` draws features
and decoder ids through the command line; bad features and configs are one line.
"""

import copy
import json
import math
import re
import shutil

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file

import port
from port._errors import ConfigError
from port.models.whisper import Whisper, WhisperConfig
from port.nn import generate, seq2seq_loss

from helpers import one_line, perturbed, run_port, transformers_or_skip, write_sparse_checkpoint

VOCAB = 100
START, LANGUAGE, TASK, NO_TIMESTAMPS, EOS, PAD = 98, 90, 91, 92, 99, 97
PROMPT = [START, LANGUAGE, TASK, NO_TIMESTAMPS]  # Whisper's forced decoder prompt, ids of the tiny vocabulary
CONFIG = dict(
    vocab_size=VOCAB,
    num_mel_bins=8,
    d_model=32,
    encoder_layers=2,
    encoder_attention_heads=4,
    encoder_ffn_dim=64,
    decoder_layers=2,
    decoder_attention_heads=4,
    decoder_ffn_dim=64,
    max_source_positions=16,  # input_features of 32 frames
    max_target_positions=48,
    decoder_start_token_id=START,
    eos_token_id=EOS,
    bos_token_id=EOS,
    pad_token_id=PAD,
    suppress_tokens=None,
    begin_suppress_tokens=None,
    init_std=0.2,
)
# name: (the transformers class that writes the checkpoint, config overrides)
CASES = {
    "tied": ("WhisperForConditionalGeneration", {}),
    "untied": (
        "WhisperForConditionalGeneration",
        dict(tie_word_embeddings=False, encoder_attention_heads=2, activation_function="gelu_new"),
    ),
    "bare": ("WhisperModel", {}),  # keys without `model.`; the logits are its states times the embeddings
}
PARITY = [("tied", "1x1"), ("untied", "4x2"), ("bare", "1x1")]


def inputs():
    """Features for a batch of 2, and 6 decoder ids each: the forced prompt then text tokens,
    the second sequence's last 2 padding under its mask."""
    rng = np.random.default_rng(0)
    features = rng.standard_normal((2, CONFIG["num_mel_bins"], 2 * CONFIG["max_source_positions"]), np.float32)
    ids = np.array([PROMPT + [5, 6], PROMPT + [7, PAD]])
    mask = np.array([[1] * 6, [1] * 5 + [0]])
    return features, ids, mask


def torch_whisper(class_name, **overrides):
    transformers = transformers_or_skip()
    import torch

    config = transformers.WhisperConfig(**{**CONFIG, **overrides})
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = getattr(transformers, class_name)(config).eval()
    return perturbed(model, lambda name: "layer_norm" in name or name.endswith("bias"), 0.3)


def torch_logits(model, features, ids, mask):
    """transformers' logits (the bare model's: its last state times the token embeddings)."""
    import torch

    dtype = next(model.parameters()).dtype
    with torch.no_grad():
        out = model(
            torch.from_numpy(features).to(dtype),
            decoder_input_ids=torch.from_numpy(ids),
            decoder_attention_mask=torch.tensor(mask),
        )
        logits = out.logits if hasattr(out, "logits") else out.last_hidden_state @ model.decoder.embed_tokens.weight.T
    return logits.float().numpy()


@pytest.fixture(scope="module")
def twins(tmp_path_factory):
    """get(case): (torch model, checkpoint directory), written once."""
    made = {}

    def get(case):
        if case not in made:
            class_name, overrides = CASES[case]
            model = torch_whisper(class_name, **overrides)
            directory = tmp_path_factory.mktemp(case)
            model.save_pretrained(directory)
            made[case] = model, directory
        return made[case]

    return get


@pytest.fixture(scope="module")
def loaded(twins):
    made = {}

    def get(case, mesh):
        if (case, mesh) not in made:
            made[case, mesh] = port.load(twins(case)[1], mesh=port.make_mesh(mesh))
        return made[case, mesh]

    return get


run = eqx.filter_jit(lambda model, f, i, m, dtype=None: model(f, i, decoder_attention_mask=m, dtype=dtype))


# ---------------------------------------------------------------- parity


@pytest.mark.parametrize("case, mesh", PARITY)
def test_logits_match_transformers(twins, loaded, case, mesh):
    model, directory = twins(case)
    features, ids, mask = inputs()
    ours = loaded(case, mesh)
    theirs = torch_logits(model, features, ids, mask)
    logits = np.asarray(run(ours, features, ids, mask))
    assert logits.shape == theirs.shape == (2, 6, VOCAB)
    assert np.abs(logits - theirs).max() <= 1e-4
    assert (ours.lm_head is None) == (case != "untied")
    if mesh == "4x2":
        assert ours.decoder_layers.attn.wq.sharding.spec == jax.sharding.PartitionSpec(None, "model", None, "data")
        assert ours.conv1_weight.sharding.spec == jax.sharding.PartitionSpec("data", None, None)


def test_unbatched_call_and_the_cache_give_the_same_logits(twins, loaded):
    """Without the batch axis: the batch of one. Decoding on a cache, the prompt then one token at
    a time: the logits of the whole call."""
    model, _ = twins("tied")
    features, ids, mask = inputs()
    ours = loaded("tied", "1x1")
    whole = np.asarray(run(ours, features, ids, None))
    single = np.asarray(run(ours, features[0], ids[0], None))
    np.testing.assert_allclose(single, whole[0], rtol=0, atol=1e-5)
    decode = eqx.filter_jit(lambda model, ids, cache: model.decode(ids, cache=cache))
    cache = eqx.filter_jit(lambda model, f: model.init_cache(2, 8, model.encode(f)))(ours, features)
    first, cache = decode(ours, ids[:, :4], cache)
    steps = [first]
    for t in (4, 5):
        logits, cache = decode(ours, ids[:, t : t + 1], cache)
        steps.append(logits)
    np.testing.assert_allclose(np.concatenate(steps, axis=1), whole, rtol=0, atol=1e-5)
    assert int(cache.length) == 6 and cache.states["cross"][0].shape == (2, 2, 16, 4, 8)


def test_bfloat16_compute_within_transformers_own_error(twins, loaded):
    """dtype=bfloat16 on float32 parameters: logits off transformers' float32 ones by no more than
    1.5 times what transformers' own bfloat16 model is."""
    import torch

    model, _ = twins("untied")
    features, ids, mask = inputs()
    half = run(loaded("untied", "4x2"), features, ids, mask, jnp.bfloat16)
    assert half.dtype == jnp.bfloat16
    full = torch_logits(model, features, ids, mask)
    theirs = torch_logits(copy.deepcopy(model).to(torch.bfloat16), features, ids, mask)
    ours = np.asarray(half, np.float32)
    assert np.abs(ours - full).max() <= 1.5 * np.abs(theirs - full).max()


def test_gradients_match_pytorch(twins, loaded, tmp_path):
    """jax.grad of port.nn.seq2seq_loss (each layer rematerialised) equals PyTorch's backward of
    `labels=`'s loss for every parameter, by checkpoint name (through port.export); the encoder's sinusoidal positions are
    frozen in both (transformers: requires_grad False; port: a zero gradient)."""
    import torch

    model, directory = twins("tied")
    features, ids, _ = inputs()
    labels = np.concatenate([ids[:, 1:], np.array([[EOS], [-100]])], axis=1)
    model.zero_grad()
    out = model(torch.from_numpy(features), decoder_input_ids=torch.from_numpy(ids), labels=torch.from_numpy(labels))
    out.loss.backward()
    ours = loaded("tied", "1x1")
    loss = lambda m: seq2seq_loss(m(features, ids, remat=True), labels)  # noqa: E731
    value, grads = eqx.filter_jit(eqx.filter_value_and_grad(loss))(ours)
    assert float(value) == pytest.approx(out.loss.item(), rel=1e-5)
    assert not np.asarray(grads.encoder_positions).any()
    port.export(grads, tmp_path / "grads", directory)
    exported = load_file(tmp_path / "grads" / "model.safetensors")
    theirs = {k: p.grad.numpy() for k, p in model.named_parameters() if p.grad is not None}
    assert "model.encoder.embed_positions.weight" not in theirs
    assert len(theirs) == len(exported) - 1 and set(theirs) <= set(exported)
    largest = max(np.abs(grad).max() for grad in theirs.values())
    for key, grad in theirs.items():
        np.testing.assert_allclose(
            exported[key], grad, atol=1e-4 * np.abs(grad).max() + 1e-6 * largest, rtol=0, err_msg=key
        )


# ---------------------------------------------------------------- generation


def test_greedy_generation_equals_transformers(twins, loaded):
    """32 new tokens for a batch of 2 from the features and the forced prompt, token for token
    transformers' greedy generate. WhisperForConditionalGeneration.generate (WhisperGenerationMixin)
    wants a real generation_config (languages, tasks, timestamps); `GenerationMixin.generate` is the
    plain greedy loop it builds on, run here on the same prompt with an explicit GenerationConfig."""
    import torch
    from transformers import GenerationConfig, GenerationMixin

    model, _ = twins("untied")
    features, ids, _ = inputs()
    prompt = ids[:, :4]
    settings = GenerationConfig(
        do_sample=False, max_new_tokens=32, eos_token_id=EOS, pad_token_id=PAD, decoder_start_token_id=START
    )
    with torch.no_grad():
        theirs = GenerationMixin.generate(
            model, torch.from_numpy(features), decoder_input_ids=torch.from_numpy(prompt), generation_config=settings
        ).numpy()
    ours = generate(
        loaded("untied", "4x2"),
        features,
        max_new_tokens=32,
        decoder_input_ids=prompt,
        eos_token_id=EOS,
        pad_token_id=PAD,
    )
    assert theirs.shape == (2, 36)
    np.testing.assert_array_equal(np.asarray(ours), theirs)
    assert len(set(theirs[:, 4:].ravel().tolist())) > 2  # the tokens vary: not one repeated id


# ---------------------------------------------------------------- port export and port verify


@pytest.mark.parametrize("case, mesh", [("tied", "1x1"), ("untied", "4x2")])
def test_export_round_trip(twins, loaded, case, mesh, tmp_path):
    """port.load on 4x2 -> port.export -> from_pretrained: the source's tensors bit for bit, no
    key missing, unexpected or mismatched; config.json names WhisperForConditionalGeneration."""
    import torch

    transformers = transformers_or_skip()
    model, directory = twins(case)
    out = port.export(loaded(case, mesh), tmp_path / "hf", directory).out
    source, exported = load_file(directory / "model.safetensors"), load_file(out / "model.safetensors")
    assert exported.keys() == source.keys()
    assert ("proj_out.weight" in source) == (case == "untied")
    for key, value in source.items():
        assert exported[key].dtype == value.dtype and exported[key].tobytes() == value.tobytes(), key
    assert json.loads((out / "config.json").read_text())["architectures"] == ["WhisperForConditionalGeneration"]
    back, info = transformers.WhisperForConditionalGeneration.from_pretrained(out, output_loading_info=True)
    for what in ("missing_keys", "unexpected_keys", "mismatched_keys", "error_msgs"):
        assert not info[what], f"{what}: {info[what]}"
    ours, theirs = back.state_dict(), model.state_dict()
    assert ours.keys() == theirs.keys()
    assert all(torch.equal(ours[k], theirs[k]) for k in theirs)


@pytest.mark.slow
def test_verify_draws_features_and_decoder_ids(twins):
    """Through the command line on 4x2: verify draws input_features (2 x 8 x 32) and decoder ids,
    and compares with WhisperForConditionalGeneration's logits."""
    _, directory = twins("untied")
    result = run_port("verify", directory, "--mesh", "4x2")
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    assert "vs WhisperForConditionalGeneration.logits (float32 [2, " in output and ": ok (tolerance" in output
    assert float(output.split("max abs difference ")[1].split()[0]) <= 1e-4


def test_verify_in_bfloat16_and_round_trip(twins):
    """port verify in bfloat16 (the reference's features cast to its dtype, as its convolution needs)
    within its tolerance; --roundtrip's export bit for bit."""
    _, directory = twins("tied")
    result = port.verify(directory, "1x1", dtype="bfloat16")
    assert result.dtype == "bfloat16" and result.reference_error is not None and result.reference_error > 0
    assert result.max_abs_diff <= result.tolerance, (result.max_abs_diff, result.reference_error)
    exact = port.verify(directory, "1x1", roundtrip=True).roundtrip
    assert exact is not None and exact.exact and exact.same == 89 and not exact.not_written


# ---------------------------------------------------------------- bad input and bad configs


@pytest.fixture(scope="module")
def zeros_model():
    shapes = eqx.filter_eval_shape(Whisper.from_config, CONFIG, key=jax.random.key(0))
    return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)


@pytest.mark.parametrize(
    "shape, dtype, error, match",
    [
        ((2, 8, 30), jnp.float32, ValueError, r"must have shape \(batch, 8, 32\) or \(8, 32\) .*got \(2, 8, 30\)"),
        ((2, 9, 32), jnp.float32, ValueError, r"\(num_mel_bins, 2 \* max_source_positions\), got \(2, 9, 32\)"),
        ((1, 2, 8, 32), jnp.float32, ValueError, r"got \(1, 2, 8, 32\)"),
        ((2, 8, 32), jnp.int32, TypeError, "`input_features` must have a floating dtype, got int32"),
    ],
)
def test_bad_features_are_one_line(zeros_model, shape, dtype, error, match):
    ids = jnp.zeros((2, 3), jnp.int32)
    for call in (zeros_model, eqx.filter_jit(zeros_model.__call__)):  # eager and under filter_jit
        with pytest.raises(error, match=match) as caught:
            call(jnp.zeros(shape, dtype), ids)
        assert "\n" not in str(caught.value)


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda m, f: m(f, jnp.zeros((3,), jnp.int32)), "both have a batch axis or both have none"),
        (lambda m, f: m(f, jnp.zeros((3, 2), jnp.int32)), "`input_features` has a batch of 2, but"),
        (lambda m, f: m(f, jnp.zeros((2, 49), jnp.int32)), "sequence length 49 exceeds max_target_positions"),
        (lambda m, f: m.encode(f, attention_mask=jnp.ones((2, 32))), "Whisper's encoder takes no mask"),
        (lambda m, f: m.init_cache(2, 49, jnp.zeros((2, 16, 32))), "`length` 49 exceeds max_target_positions \\(48\\)"),
        (lambda m, f: m.init_cache(3, 8, jnp.zeros((2, 16, 32))), "`encoded` must have shape"),
    ],
)
def test_bad_calls_are_one_line(zeros_model, call, match):
    with pytest.raises(ValueError, match=match) as caught:
        call(zeros_model, jnp.zeros((2, 8, 32)))
    assert "\n" not in str(caught.value)


@pytest.mark.parametrize(
    "change, match",
    [
        (dict(d_model=30), "'d_model' \\(30\\) must be divisible by 'encoder_attention_heads' \\(4\\)"),
        (dict(activation_function="mish"), "'activation_function'"),
        (dict(is_encoder_decoder=False), "is_encoder_decoder false is not supported by port.models.whisper.Whisper"),
        (dict(decoder_start_token_id="x"), "'decoder_start_token_id' must be a token id"),
        (dict(model_type="bart"), "'model_type' 'bart' is not supported by port.models.whisper"),
    ],
)
def test_config_rejects_unsupported(change, match):
    with pytest.raises(ConfigError, match=match) as caught:
        WhisperConfig.from_hf({**CONFIG, **change})
    assert "\n" not in str(caught.value)


def test_training_only_fields_change_nothing():
    """SpecAugment, layer drop and scale_embedding (computed, never applied by transformers 5.24)."""
    plain = WhisperConfig.from_hf(CONFIG)
    changed = dict(apply_spec_augment=True, mask_time_prob=0.5, encoder_layerdrop=0.1, scale_embedding=True)
    assert WhisperConfig.from_hf({**CONFIG, **changed}) == plain
    assert plain.frames == 32 and plain.decoder_start_token_id == START


@pytest.mark.slow
@pytest.mark.parametrize(
    "change, words",
    [
        (dict(activation_function="mish"), ["config.json", "'activation_function' 'mish' is not supported"]),
        (dict(max_source_positions=8), ["encoder.embed_positions.weight"]),  # the checkpoint's table has 16
    ],
)
def test_convert_refuses_a_bad_config_in_one_line(twins, tmp_path, change, words):
    """`port convert` on a config.json the module cannot run, or that contradicts the tensors: one
    line, exit 1, nothing written."""
    _, directory = twins("tied")
    bad = tmp_path / "bad"
    shutil.copytree(directory, bad)
    config = json.loads((bad / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps({**config, **change}))
    out = tmp_path / "out"
    one_line(run_port("convert", bad, "--out", out), *words, out=out)


# ---------------------------------------------------------------- full size: Whisper large-v3, planned


WHISPER_LARGE_V3 = {  # openai/whisper-large-v3 config.json (the fields a load reads, and its sizes)
    "architectures": ["WhisperForConditionalGeneration"],
    "activation_function": "gelu",
    "apply_spec_augment": False,
    "begin_suppress_tokens": [220, 50257],
    "bos_token_id": 50257,
    "d_model": 1280,
    "decoder_attention_heads": 20,
    "decoder_ffn_dim": 5120,
    "decoder_layers": 32,
    "decoder_start_token_id": 50258,
    "encoder_attention_heads": 20,
    "encoder_ffn_dim": 5120,
    "encoder_layers": 32,
    "eos_token_id": 50257,
    "is_encoder_decoder": True,
    "mask_time_prob": 0.05,
    "max_length": 448,
    "max_source_positions": 1500,
    "max_target_positions": 448,
    "model_type": "whisper",
    "num_hidden_layers": 32,
    "num_mel_bins": 128,
    "pad_token_id": 50256,
    "scale_embedding": False,
    "torch_dtype": "float16",
    "vocab_size": 51866,
}


def whisper_shapes(config: dict) -> dict[str, list[int]]:
    """Every tensor of a WhisperForConditionalGeneration of `config`'s sizes (tied: no proj_out)."""
    E, V, M = config["d_model"], config["vocab_size"], config["num_mel_bins"]
    shapes = {
        "model.encoder.conv1.weight": [E, M, 3],
        "model.encoder.conv1.bias": [E],
        "model.encoder.conv2.weight": [E, E, 3],
        "model.encoder.conv2.bias": [E],
        "model.encoder.embed_positions.weight": [config["max_source_positions"], E],
        "model.encoder.layer_norm.weight": [E],
        "model.encoder.layer_norm.bias": [E],
        "model.decoder.embed_tokens.weight": [V, E],
        "model.decoder.embed_positions.weight": [config["max_target_positions"], E],
        "model.decoder.layer_norm.weight": [E],
        "model.decoder.layer_norm.bias": [E],
    }
    for side, attentions in (("encoder", ("self_attn",)), ("decoder", ("self_attn", "encoder_attn"))):
        ffn = config[f"{side}_ffn_dim"]
        for layer in range(config[f"{side}_layers"]):
            prefix = f"model.{side}.layers.{layer}."
            for attn in attentions:
                for proj in ("q_proj", "k_proj", "v_proj", "out_proj"):
                    shapes[f"{prefix}{attn}.{proj}.weight"] = [E, E]
                    if proj != "k_proj":
                        shapes[f"{prefix}{attn}.{proj}.bias"] = [E]
            for norm in (*(f"{a}_layer_norm" for a in attentions), "final_layer_norm"):
                shapes[f"{prefix}{norm}.weight"] = shapes[f"{prefix}{norm}.bias"] = [E]
            shapes.update({f"{prefix}fc1.weight": [ffn, E], f"{prefix}fc1.bias": [ffn]})
            shapes.update({f"{prefix}fc2.weight": [E, ffn], f"{prefix}fc2.bias": [E]})
    return shapes


@pytest.mark.slow
def test_plan_full_size_whisper_large_v3(tmp_path):
    """`port plan --mesh 4x2` on Whisper large-v3's real sizes (float16): exit 0, every tensor
    planned (1.54B parameters), the bytes per device the rules give, the convolutions and attention
    sharded as they say."""
    shapes = whisper_shapes(WHISPER_LARGE_V3)
    write_sparse_checkpoint(tmp_path / "large-v3", WHISPER_LARGE_V3, shapes, dtype="F16")
    result = run_port("plan", tmp_path / "large-v3", "--mesh", "4x2")
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    assert "Traceback" not in output
    params = sum(math.prod(shape) for shape in shapes.values())
    assert 1.54e9 < params < 1.55e9  # Whisper large-v3's published size
    summary = output.strip().splitlines()[-1]
    found = re.fullmatch(r"([\d.]+)B params in 50 leaves; ([\d.]+) GB to read, ([\d.]+) MB per device", summary)
    assert found, summary
    assert float(found[1]) == round(params / 1e9, 2) and float(found[2]) == round(2 * params / 1e9, 1)

    def share(key, shape):  # of a tensor on each of the 8 devices: embed on data (4), heads, mlp, vocab on model (2)
        if key.endswith("conv2.bias"):
            return 1  # embed_out: replicated
        if key.endswith(("q_proj.bias", "v_proj.bias", "fc1.bias")):
            return 1 / 2
        if len(shape) == 2 and not key.endswith("embed_positions.weight"):
            return 1 / 8
        return 1 / 4

    per_device = sum(2 * math.prod(shape) * share(key, shape) for key, shape in shapes.items())
    assert float(found[3]) == round(per_device / 1e6, 1)
    assert re.search(r"decoder_layers\.cross\.wq\s+f16\[32,20,64,1280\]\s+\(-, model, -, data\)", output), output
    assert re.search(r"conv1_weight\s+f16\[1280,128,3\]\s+\(data, -, -\)", output), output
