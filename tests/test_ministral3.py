"""Ministral 3 and the language model of Mistral 3 checkpoints: port's Llama module, converted by
the shipped `mappings/ministral3.toml`.

Ministral 3 is Mistral with YaRN and its queries scaled by position after RoPE (`1 + beta *
log(1 + floor(position / original_max_position_embeddings))`): the tiny config's original
length of 4 and beta of 0.5 make that scale change three times over the 12 tokens. A
`Mistral3ForConditionalGeneration` (a tiny Pixtral vision tower, ignored) holds a Ministral
3 (or a Mistral) as `text_config`, its keys under `model.language_model.`.
"""

import dataclasses
import json

import equinox as eqx
import jax
import ml_dtypes
import numpy as np
import pytest

import port
from port._errors import ConfigError
from port.models.llama import Llama, LlamaConfig

from helpers import (
    LLAMA_CONFIG,
    VOCAB,
    logits,
    one_line,
    perturbed,
    run_port,
    saved_once,
    torch_logits,
    transformers_or_skip,
)

ROPE = {
    "rope_type": "yarn",
    "rope_theta": 10000.0,
    "factor": 2.0,
    "original_max_position_embeddings": 4,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "mscale": 1.0,
    "mscale_all_dim": 1.0,
    "llama_4_scaling_beta": 0.5,
}
TEXT = dict(LLAMA_CONFIG, head_dim=16, rope_parameters=ROPE)
VISION = dict(
    hidden_size=16, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2, image_size=32, patch_size=8
)
IDS = np.random.default_rng(0).integers(0, VOCAB, (2, 12))
CASES = ("ministral3", "mistral3", "mistral3-mistral")


def torch_model(name: str):
    """A seeded Ministral3ForCausalLM, or a Mistral3ForConditionalGeneration around a Ministral 3
    (or a Mistral: `mistral3-mistral`); skips without PyTorch."""
    transformers = transformers_or_skip()
    import torch

    torch.manual_seed(0)
    if name == "ministral3":
        config = transformers.Ministral3Config(**TEXT)
        config._attn_implementation = "eager"
        model = transformers.Ministral3ForCausalLM(config)
    else:
        text = (
            {"model_type": "mistral", **LLAMA_CONFIG}
            if name == "mistral3-mistral"
            else {"model_type": "ministral3", **TEXT}
        )
        config = transformers.Mistral3Config(text_config=text, vision_config=VISION)
        config._attn_implementation = config.text_config._attn_implementation = "eager"
        model = transformers.Mistral3ForConditionalGeneration(config)
    return perturbed(model, lambda n: "norm" in n, 0.2)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    return saved_once(tmp_path_factory, torch_model, IDS)


@pytest.mark.parametrize("name, mesh", [(n, m) for n in CASES for m in ("1x1", "4x2")])
def test_logits_match_transformers(checkpoints, name, mesh):
    directory, _, expected = checkpoints(name)
    model = port.load(directory, mesh=mesh)
    assert np.abs(np.asarray(logits(model, IDS)) - expected).max() <= 1e-4
    assert (model.config.query_scale is None) == (name == "mistral3-mistral")


def test_the_query_scale_matters(checkpoints):
    directory, _, expected = checkpoints("ministral3")
    model = port.load(directory)
    skeleton = eqx.filter_eval_shape(Llama, dataclasses.replace(model.config, query_scale=None), key=jax.random.key(0))
    unscaled = jax.tree.unflatten(jax.tree.structure(skeleton), jax.tree.leaves(model))
    assert np.abs(np.asarray(logits(unscaled, IDS)) - expected).max() > 1e-2


@pytest.mark.parametrize("mesh", ["1x1", "4x2"])
def test_bfloat16_end_to_end(tmp_path, mesh):
    """Within twice transformers' own bfloat16 error (see tests/test_gemma.py)."""
    import torch

    model = torch_model("ministral3")
    reference = torch_logits(model, IDS)
    model = model.to(torch.bfloat16)
    model.save_pretrained(tmp_path)
    expected = torch_logits(model, IDS)
    rounding = np.abs(expected - reference).max()
    ours = port.load(tmp_path, mesh=mesh)
    out = logits(ours, IDS)
    assert out.dtype == np.dtype(ml_dtypes.bfloat16)
    out = np.asarray(out).astype(np.float32)
    assert np.abs(out - expected).max() <= 2 * rounding and np.abs(out - reference).max() <= 2 * rounding


def test_export_round_trip(checkpoints, tmp_path):
    """port.load on 4x2 -> port.export -> from_pretrained: the source's tensors bit for bit."""
    import torch
    from safetensors.numpy import load_file

    transformers = transformers_or_skip()
    directory, original, _ = checkpoints("ministral3")
    out = port.export(port.load(directory, mesh="4x2"), tmp_path / "hf", directory).out
    source, exported = load_file(directory / "model.safetensors"), load_file(out / "model.safetensors")
    assert exported.keys() == source.keys()
    for key, value in source.items():
        assert exported[key].dtype == value.dtype and exported[key].tobytes() == value.tobytes(), key
    back, info = transformers.Ministral3ForCausalLM.from_pretrained(out, output_loading_info=True)
    for what in ("missing_keys", "unexpected_keys", "mismatched_keys", "error_msgs"):
        assert not info[what], f"{what}: {info[what]}"
    assert all(torch.equal(back.state_dict()[k], v) for k, v in original.state_dict().items())


@pytest.mark.parametrize("name", ["mistral3", "mistral3-mistral"])
def test_a_mistral3_language_model_exports_as_its_text_only_class(checkpoints, tmp_path, name):
    """port export of a mistral3 checkpoint's language model: config.json is the text config under
    its own model_type and class (Ministral 3 or Mistral), the head tied as the wrapper said;
    transformers loads it with nothing missing or unexpected and computes port's logits."""
    import torch

    transformers = transformers_or_skip()
    directory, _, expected = checkpoints(name)
    model = port.load(directory)
    out = port.export(model, tmp_path / "hf", directory).out
    config = json.loads((out / "config.json").read_text())
    kind, cls = ("ministral3", "Ministral3ForCausalLM") if name == "mistral3" else ("mistral", "MistralForCausalLM")
    assert (config["model_type"], config["architectures"]) == (kind, [cls])
    assert config["tie_word_embeddings"] is (model.lm_head is None)
    back, info = getattr(transformers, cls).from_pretrained(out, output_loading_info=True)
    for what in ("missing_keys", "unexpected_keys", "mismatched_keys", "error_msgs"):
        assert not info[what], f"{what}: {info[what]}"
    back.config._attn_implementation = "eager"
    with torch.no_grad():
        theirs = back(torch.tensor(IDS)).logits.numpy()
    assert np.abs(theirs - expected).max() <= 1e-4


@pytest.mark.parametrize(
    "config, message",
    [
        (
            dict(
                TEXT,
                model_type="ministral3",
                rope_parameters={k: v for k, v in ROPE.items() if k != "llama_4_scaling_beta"},
            ),
            "config.json: required key 'rope_parameters.llama_4_scaling_beta' is missing",
        ),
        (
            dict(TEXT, model_type="ministral3", rope_parameters=dict(ROPE, llama_4_scaling_beta="big")),
            "config.json: 'rope_parameters.llama_4_scaling_beta' must be a number >= 0, got 'big'",
        ),
        (
            {"model_type": "mistral3", "text_config": dict(LLAMA_CONFIG, model_type="qwen2")},
            "config.json: text_config's 'model_type' 'qwen2' is not supported by port.models.llama in a mistral3 "
            "checkpoint (supported: mistral, ministral3)",
        ),
        ({"model_type": "mistral3", "text_config": None}, "config.json: 'text_config' must be a dict, got None"),
    ],
    ids=["no-beta", "bad-beta", "text-type", "no-text-config"],
)
def test_bad_config_is_one_line(config, message):
    with pytest.raises(ConfigError) as raised:
        LlamaConfig.from_hf(config)
    assert str(raised.value) == message


@pytest.mark.slow
def test_port_plan_lists_the_vision_tower_as_ignored_and_refuses_a_bad_scale(checkpoints, tmp_path):
    """`port plan` of a Mistral 3 checkpoint: its language model's leaves, the vision tower and
    projector as ignored; a Ministral 3 config without its query scale's beta: one line."""
    directory, _, _ = checkpoints("mistral3")
    result = run_port("plan", directory, "--mesh", "1x1")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "blocks.attn.wq" in result.stdout
    assert "ignored: vision_tower.patch_conv.weight" in result.stdout
    assert "ignored: multi_modal_projector.linear_1.weight" in result.stdout
    source, _, _ = checkpoints("ministral3")
    bad = tmp_path / "bad"
    bad.mkdir()
    config = json.loads((source / "config.json").read_text())
    config["rope_parameters"].pop("llama_4_scaling_beta")
    (bad / "config.json").write_text(json.dumps(config))
    (bad / "model.safetensors").symlink_to(source / "model.safetensors")
    one_line(
        run_port("plan", bad, "--mesh", "1x1"),
        "config.json: required key 'rope_parameters.llama_4_scaling_beta' is missing",
    )


def test_a_null_head_dim_is_hidden_over_heads():
    """`head_dim: null` is hidden_size / num_attention_heads, as Ministral3Config's post-init computes
    it (transformers 5.24's strict field refuses the null before that, so it cannot be compared);
    absent, transformers' default, 128."""
    transformers = transformers_or_skip()
    config = dict(TEXT, model_type="ministral3", head_dim=None)
    assert LlamaConfig.from_hf(config).head_dim == LLAMA_CONFIG["hidden_size"] // LLAMA_CONFIG["num_attention_heads"]
    absent = {k: v for k, v in config.items() if k != "head_dim"}
    assert LlamaConfig.from_hf(absent).head_dim == transformers.Ministral3Config(**absent).head_dim == 128
