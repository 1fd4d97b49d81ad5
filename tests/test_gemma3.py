"""Gemma 3: port's model, converted by the shipped `mappings/gemma3.toml`, against `transformers`.

Two checkpoints: a `Gemma3ForCausalLM` (model_type gemma3_text) and the language model of a
`Gemma3ForConditionalGeneration` (model_type gemma3: `text_config`, keys under
`language_model.model.`, a vision tower port ignores), each written by `save_pretrained`.
The text config exercises every feature: per-head (1 + w) q/k norms (perturbed, as every
norm), local layers with their own RoPE base and global ones with linear scaling, a window
of 4 under 12 tokens, the pattern of local and global layers, `query_pre_attn_scalar`
unlike head_dim, a final soft-cap that clips, GQA, and an `attn_logit_softcapping` that
transformers' Gemma 3 keeps but does not apply (nor does port). Parity in float32 and bfloat16 on 1x1 and 4x2;
`port.export` back into transformers bit for bit; a wrapper's language model exported as a
text-only checkpoint (`[export.gemma3]`); transformers 4's config keys read as transformers
5 reads them; one-line errors. The tests that build a `transformers` model skip without
PyTorch.
"""

import json
from pathlib import Path

import numpy as np
import pytest

import port
from port._errors import ConfigError
from port.models.gemma import GemmaConfig

from helpers import loaded_once, logits, one_line, perturbed, run_port, saved_once, torch_logits, transformers_or_skip

TEXT = dict(
    vocab_size=100,
    hidden_size=48,
    intermediate_size=80,
    num_hidden_layers=3,
    num_attention_heads=6,
    num_key_value_heads=2,
    head_dim=16,  # not hidden / heads
    query_pre_attn_scalar=24,  # not head_dim
    sliding_window=4,
    layer_types=["sliding_attention", "full_attention", "sliding_attention"],
    rope_parameters={
        "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 100.0},
        "sliding_attention": {"rope_type": "default", "rope_theta": 10.0},
    },
    attn_logit_softcapping=3.0,  # ignored by Gemma3Attention: parity says port ignores it too
    final_logit_softcapping=8.0,
    initializer_range=0.2,
    max_position_embeddings=64,
)
# The wrapper's language model: its head applies no final soft-cap (transformers' does not).
WRAPPED = {k: v for k, v in TEXT.items() if k != "final_logit_softcapping"}
VISION = dict(
    hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=2, image_size=16, patch_size=4
)
IDS = np.random.default_rng(0).integers(0, 100, (2, 12))  # 12 tokens: 3 windows of 4
MESHES = ("1x1", "4x2")
MAPPING = Path(__file__).resolve().parents[1] / "mappings" / "gemma3.toml"


def torch_gemma3(name: str, dtype=None, **changes):
    """A seeded `Gemma3ForCausalLM` ("text") or `Gemma3ForConditionalGeneration` ("wrapper"), eager
    attention, its norms perturbed (zero-initialised, a scale of 1 + 0) so that `1 + w` matters."""
    transformers = transformers_or_skip()
    import torch

    torch.manual_seed(0)
    if name == "text":
        config = transformers.Gemma3TextConfig(**{**TEXT, **changes})
        config._attn_implementation = "eager"
        model = transformers.Gemma3ForCausalLM(config)
    else:
        config = transformers.Gemma3Config(
            text_config={**WRAPPED, **changes}, vision_config=VISION, mm_tokens_per_image=4
        )
        config._attn_implementation = "eager"
        config.text_config._attn_implementation = "eager"
        model = transformers.Gemma3ForConditionalGeneration(config)
    model = perturbed(model, lambda n: "norm" in n, 0.2)
    return model if dtype is None else model.to(getattr(torch, dtype))


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """get(name): (directory written by save_pretrained, the model, its float32 logits); name is
    "text", "wrapper", or either with "-bf16" (the same weights in bfloat16)."""

    def build(name):
        base, _, bf16 = name.partition("-")
        return torch_gemma3(base, "bfloat16" if bf16 else None)

    return saved_once(tmp_path_factory, build, IDS)


@pytest.fixture(scope="module")
def loaded(checkpoints):
    return loaded_once(checkpoints)


def diff(model, expected: np.ndarray) -> float:
    return float(np.abs(np.asarray(logits(model, IDS)).astype(np.float32) - expected).max())


# ---------------------------------------------------------------- parity


@pytest.mark.parametrize("mesh", MESHES)
@pytest.mark.parametrize("name", ["text", "wrapper"])
def test_logits_match_transformers(checkpoints, loaded, name, mesh):
    """float32 logits within 1e-4 of transformers' (a wrapper's: its language model's)."""
    expected = checkpoints(name).logits
    model = loaded(name, mesh)
    error = diff(model, expected)
    print(f"gemma3 {name} float32 {mesh}: max |logit diff| {error:.2e} (logits up to {np.abs(expected).max():.1f})")
    assert error < 1e-4
    assert model.config.local_rope is not None and model.blocks.attn.q_norm is not None
    assert model.config.sliding_layers == (True, False, True)


@pytest.mark.parametrize("mesh", MESHES)
@pytest.mark.parametrize("name", ["text", "wrapper"])
def test_bfloat16_logits_are_as_close_as_transformers_own(checkpoints, loaded, name, mesh):
    """A bfloat16 checkpoint computes in bfloat16 within twice transformers' own bfloat16 error
    (its bfloat16 logits against its float32 ones on the same weights), of both."""
    reference = checkpoints(name).logits
    expected = checkpoints(f"{name}-bf16").logits
    rounding = np.abs(expected - reference).max()
    model = loaded(f"{name}-bf16", mesh)
    assert model.embed.dtype.name == "bfloat16"
    error = diff(model, expected)
    print(f"gemma3 {name} bfloat16 {mesh}: max |logit diff| {error:.3f} (transformers' own {rounding:.3f})")
    assert error <= 2 * rounding and diff(model, reference) <= 2 * rounding


@pytest.mark.parametrize(
    "change",
    [
        dict(
            rope_parameters={
                **TEXT["rope_parameters"],
                "sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
            }
        ),
        dict(
            rope_parameters={**TEXT["rope_parameters"], "full_attention": {"rope_type": "default", "rope_theta": 100.0}}
        ),
        dict(sliding_window=5),
        dict(layer_types=["sliding_attention", "sliding_attention", "full_attention"]),
        dict(query_pre_attn_scalar=16),
        dict(final_logit_softcapping=None),
    ],
    ids=["local-theta", "no-linear-scaling", "window-5", "other-pattern", "head-dim-scale", "no-cap"],
)
def test_the_case_is_sensitive_to_each_feature(checkpoints, change):
    """Without each feature transformers' logits move by > 1e-2, 100 times the parity tolerance."""
    transformers = transformers_or_skip()
    _, model, expected = checkpoints("text")
    config = transformers.Gemma3TextConfig(**{**TEXT, **change})
    config._attn_implementation = "eager"
    variant = transformers.Gemma3ForCausalLM(config).eval()
    variant.load_state_dict(model.state_dict())
    assert np.abs(torch_logits(variant, IDS) - expected).max() > 1e-2


def test_q_k_norms_matter(checkpoints, loaded):
    """port's q/k norms are read: zeroing them (a scale of 1) moves port's logits by > 1e-2."""
    import equinox as eqx
    import jax.numpy as jnp

    model = loaded("text", "1x1")
    plain = eqx.tree_at(
        lambda m: (m.blocks.attn.q_norm, m.blocks.attn.k_norm),
        model,
        (jnp.zeros_like(model.blocks.attn.q_norm), jnp.zeros_like(model.blocks.attn.k_norm)),
    )
    assert diff(plain, checkpoints("text").logits) > 1e-2


# ---------------------------------------------------------------- the wrapper and export


@pytest.mark.slow
def test_plan_lists_the_vision_tower_as_ignored(checkpoints):
    directory = checkpoints("wrapper").directory
    result = run_port("plan", directory, "--mesh", "1x1")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "ignored: vision_tower." in result.stdout and "ignored: multi_modal_projector." in result.stdout


def test_export_round_trip_is_bit_identical(checkpoints, loaded, tmp_path):
    """gemma3_text: port.load on 4x2 -> port.export -> from_pretrained: no missing or unexpected key, same weights."""
    import torch

    transformers = transformers_or_skip()
    source = checkpoints("text").directory
    out = port.export(loaded("text", "4x2"), tmp_path / "hf", source).out
    exported, info = transformers.Gemma3ForCausalLM.from_pretrained(out, output_loading_info=True)
    for what in ("missing_keys", "unexpected_keys", "mismatched_keys", "error_msgs"):
        assert not info[what], f"{what}: {info[what]}"
    theirs = transformers.Gemma3ForCausalLM.from_pretrained(source).state_dict()
    ours = exported.state_dict()
    assert ours.keys() == theirs.keys()
    for key, value in theirs.items():
        assert ours[key].dtype == value.dtype and torch.equal(ours[key], value), key


def test_a_wrappers_language_model_exports_as_a_text_only_checkpoint(checkpoints, loaded, tmp_path):
    """gemma3 -> port.export: config.json is the text config (gemma3_text, Gemma3ForCausalLM), the keys
    the text-only class's, each tensor the source's bytes; transformers' Auto class loads it with no
    missing or unexpected key (no vision tower initialised at random) and computes port's logits."""
    from safetensors.numpy import load_file

    transformers = transformers_or_skip()
    source = checkpoints("wrapper").directory
    model = loaded("wrapper", "4x2")
    out = port.export(model, tmp_path / "hf", source).out
    config = json.loads((out / "config.json").read_text())
    wrapper = json.loads((source / "config.json").read_text())
    assert config["model_type"] == "gemma3_text" and config["architectures"] == ["Gemma3ForCausalLM"]
    assert {
        k: v for k, v in config.items() if k not in ("model_type", "architectures", "dtype", "transformers_version")
    } == {k: v for k, v in wrapper["text_config"].items() if k != "model_type"}
    written, read = load_file(out / "model.safetensors"), load_file(source / "model.safetensors")
    text = {k.replace("language_model.model.", "model."): v for k, v in read.items() if k.startswith("language_model.")}
    assert written.keys() == text.keys()
    for key, value in text.items():
        assert written[key].dtype == value.dtype and written[key].tobytes() == value.tobytes(), key
    exported, info = transformers.AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert type(exported).__name__ == "Gemma3ForCausalLM"
    for what in ("missing_keys", "unexpected_keys", "mismatched_keys", "error_msgs"):
        assert not info[what], f"{what}: {info[what]}"
    exported.config._attn_implementation = "eager"
    np.testing.assert_allclose(torch_logits(exported, IDS), np.asarray(logits(model, IDS)), atol=1e-4, rtol=0)
    again = port.load(out)  # and port reads it back as gemma3_text
    assert again.config.model_type == "gemma3_text" and diff(again, checkpoints("wrapper").logits) < 1e-4


def test_the_wrapper_classs_own_key_names_load_and_export_too(checkpoints, tmp_path):
    """Keys as Gemma3ForConditionalGeneration names its modules (`model.language_model.`,
    `model.vision_tower.`, `model.multi_modal_projector.`): the same model, exported text-only."""
    import shutil

    from safetensors.numpy import load_file, save_file

    source = checkpoints("wrapper").directory
    renamed = tmp_path / "renamed"
    renamed.mkdir()
    shutil.copy(source / "config.json", renamed / "config.json")
    tensors = load_file(source / "model.safetensors")
    new = {
        k.replace("language_model.model.", "model.language_model.", 1)
        if k.startswith("language_model.")
        else "model." + k: v
        for k, v in tensors.items()
    }
    assert any(k.startswith("model.vision_tower.") for k in new)
    save_file(new, renamed / "model.safetensors", metadata={"format": "pt"})
    model = port.load(renamed)
    assert diff(model, checkpoints("wrapper").logits) < 1e-4
    out = port.export(model, tmp_path / "hf", renamed).out
    written = load_file(out / "model.safetensors")
    assert written.keys() == {k.replace("language_model.", "", 1) for k in new if k.startswith("model.language_model.")}


@pytest.mark.slow
def test_port_export_of_a_converted_wrapper_is_text_only(checkpoints, tmp_path):
    """`port convert` of a gemma3 checkpoint, then `port export` of the output: a Gemma3ForCausalLM checkpoint."""
    source = checkpoints("wrapper").directory
    result = run_port("convert", source, "--out", tmp_path / "jax")
    assert result.returncode == 0, result.stdout + result.stderr
    result = run_port("export", tmp_path / "jax", "--out", tmp_path / "hf")
    assert result.returncode == 0, result.stdout + result.stderr
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["model_type"] == "gemma3_text" and config["architectures"] == ["Gemma3ForCausalLM"]


@pytest.mark.slow
def test_port_verify_of_a_wrapper_draws_ids_from_its_text_config(checkpoints):
    """`port verify` of a gemma3 checkpoint (no top-level vocab_size): ids from `text_config`'s
    vocabulary, port's language model against transformers' wrapper, ok."""
    result = run_port("verify", checkpoints("wrapper").directory)
    assert result.returncode == 0, result.stdout + result.stderr
    assert ": ok (tolerance " in result.stdout, result.stdout
    assert "vs AutoModelForCausalLM.logits (float32 [2, 16, 100]" in result.stdout


# ---------------------------------------------------------------- the config


def test_transformers_4_configs_read_as_transformers_5_reads_them():
    """The released configs' keys (rope_theta, rope_local_base_freq, rope_scaling on the global layers
    only, sliding_window_pattern, no layer_types): the same RoPE and local layers as Gemma3TextConfig."""
    transformers = transformers_or_skip()
    legacy = {k: v for k, v in TEXT.items() if k not in ("rope_parameters", "layer_types")} | dict(
        num_hidden_layers=8,
        rope_theta=1000.0,
        rope_local_base_freq=20.0,
        rope_scaling={"rope_type": "linear", "factor": 8.0},
        sliding_window_pattern=3,
    )
    theirs = transformers.Gemma3TextConfig(**legacy)
    ours = GemmaConfig.from_hf({"model_type": "gemma3_text", **legacy})
    assert ours.sliding_layers == tuple(t == "sliding_attention" for t in theirs.layer_types)
    assert ours.sliding_layers == (True, True, False, True, True, False, True, True)
    full, local = theirs.rope_parameters["full_attention"], theirs.rope_parameters["sliding_attention"]
    assert (ours.rope.kind, ours.rope.theta, ours.rope.factor) == (full["rope_type"], full["rope_theta"], 8.0)
    assert (
        (ours.local_rope.kind, ours.local_rope.theta) == (local["rope_type"], local["rope_theta"]) == ("default", 20.0)
    )
    bare = GemmaConfig.from_hf({"model_type": "gemma3_text", **TEXT} | {"rope_parameters": None, "layer_types": None})
    assert (bare.rope.theta, bare.local_rope.theta) == (1e6, 1e4)  # Gemma3TextConfig.default_theta
    assert bare.sliding_layers == (True, True, True)  # five local layers in six


def test_absent_fields_are_gemma3_text_configs_defaults():
    """A released config leaves out what Gemma3TextConfig defaults (gemma-3-27b-it: vocab_size): read as it reads them."""
    transformers = transformers_or_skip()
    theirs = transformers.Gemma3TextConfig()
    ours = GemmaConfig.from_hf({"model_type": "gemma3_text"})
    for name in (
        "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
        "num_key_value_heads", "head_dim", "query_pre_attn_scalar", "sliding_window", "rms_norm_eps",
        "final_logit_softcapping", "tie_word_embeddings", "attention_bias",
    ):  # fmt: skip
        assert getattr(ours, name) == getattr(theirs, name), name
    assert ours.sliding_layers == tuple(t == "sliding_attention" for t in theirs.layer_types)
    assert ours.hidden_act == theirs.hidden_activation


UNTYPED = {k: v for k, v in TEXT.items() if k != "layer_types"}  # the pattern decides


def wrapper_config(**text) -> dict:
    return {"model_type": "gemma3", "text_config": {"model_type": "gemma3_text", **WRAPPED, **text}}


@pytest.mark.parametrize(
    "config, match",
    [
        (wrapper_config(final_logit_softcapping=30.0), "text_config.final_logit_softcapping 30.0 is not supported"),
        (wrapper_config(use_bidirectional_attention=True), "use_bidirectional_attention true is not supported"),
        ({"model_type": "gemma3", "text_config": [1]}, "'text_config' must be a dict"),
        (
            {
                "model_type": "gemma3_text",
                **TEXT,
                "rope_parameters": {"full_attention": {"rope_type": "dynamic", "factor": 2.0}},
            },
            "rope_parameters.full_attention: rope type 'dynamic' is not supported",
        ),
        ({"model_type": "gemma3_text", **TEXT, "layer_types": ["full_attention"]}, "'layer_types' must list 3 of"),
        (
            {"model_type": "gemma3_text", **UNTYPED, "sliding_window_pattern": 0},
            "'sliding_window_pattern' must be a positive",
        ),
    ],
    ids=["wrapper-final-cap", "bidirectional", "text-config", "dynamic-rope", "layer-types", "pattern"],
)
def test_bad_configs_are_one_line_errors(config, match):
    with pytest.raises(ConfigError) as info:
        GemmaConfig.from_hf(config)
    message = str(info.value)
    assert message.startswith("config.json: ") and "\n" not in message and match in message, message


@pytest.mark.slow
def test_port_check_refuses_a_wrapper_whose_head_would_soft_cap(checkpoints, tmp_path):
    """`port check` reads the config first: one line, no tensor byte read."""
    import shutil

    directory = tmp_path / "capped"
    shutil.copytree(checkpoints("wrapper").directory, directory)
    config = json.loads((directory / "config.json").read_text())
    config["text_config"]["final_logit_softcapping"] = 30.0
    (directory / "config.json").write_text(json.dumps(config))
    one_line(
        run_port("check", MAPPING, directory),
        "final_logit_softcapping 30.0 is not supported by port.models.gemma.Gemma",
    )


# ---------------------------------------------------------------- the full-size plan

# google/gemma-3-27b-it's config.json (transformers 4's keys, as released; the vision tower's sizes).
GEMMA3_27B = {
    "architectures": ["Gemma3ForConditionalGeneration"],
    "boi_token_index": 255999,
    "eoi_token_index": 256000,
    "eos_token_id": [1, 106],
    "image_token_index": 262144,
    "initializer_range": 0.02,
    "mm_tokens_per_image": 256,
    "model_type": "gemma3",
    "text_config": {
        "head_dim": 128,
        "hidden_size": 5376,
        "intermediate_size": 21504,
        "model_type": "gemma3_text",
        "num_attention_heads": 32,
        "num_hidden_layers": 62,
        "num_key_value_heads": 16,
        "query_pre_attn_scalar": 168,
        "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
        "sliding_window": 1024,
    },
    "torch_dtype": "bfloat16",
    "transformers_version": "4.50.0.dev0",
    "vision_config": {
        "hidden_size": 1152,
        "image_size": 896,
        "intermediate_size": 4304,
        "model_type": "siglip_vision_model",
        "num_attention_heads": 16,
        "num_hidden_layers": 27,
        "patch_size": 14,
        "vision_use_head": False,
    },
}


def gemma3_27b_tensors(config: dict) -> dict[str, list[int]]:
    """Every tensor of google/gemma-3-27b-it by key: its shape (the language model's, the SigLIP
    tower's and the projector's, as the released checkpoint names them)."""
    text, vision = config["text_config"], config["vision_config"]
    e, i, v, d = text["hidden_size"], text["intermediate_size"], 262208, text["head_dim"]
    q, kv = text["num_attention_heads"] * d, text["num_key_value_heads"] * d
    shapes = {"language_model.model.embed_tokens.weight": [v, e], "language_model.model.norm.weight": [e]}
    for layer in range(text["num_hidden_layers"]):
        p = f"language_model.model.layers.{layer}."
        shapes |= {
            p + "input_layernorm.weight": [e],
            p + "post_attention_layernorm.weight": [e],
            p + "pre_feedforward_layernorm.weight": [e],
            p + "post_feedforward_layernorm.weight": [e],
            p + "self_attn.q_proj.weight": [q, e],
            p + "self_attn.k_proj.weight": [kv, e],
            p + "self_attn.v_proj.weight": [kv, e],
            p + "self_attn.o_proj.weight": [e, q],
            p + "self_attn.q_norm.weight": [d],
            p + "self_attn.k_norm.weight": [d],
            p + "mlp.gate_proj.weight": [i, e],
            p + "mlp.up_proj.weight": [i, e],
            p + "mlp.down_proj.weight": [e, i],
        }
    h, m, patch = vision["hidden_size"], vision["intermediate_size"], vision["patch_size"]
    tower = "vision_tower.vision_model."
    shapes |= {
        tower + "embeddings.patch_embedding.weight": [h, 3, patch, patch],
        tower + "embeddings.patch_embedding.bias": [h],
        tower + "embeddings.position_embedding.weight": [(vision["image_size"] // patch) ** 2, h],
        tower + "post_layernorm.weight": [h],
        tower + "post_layernorm.bias": [h],
        "multi_modal_projector.mm_input_projection_weight": [h, e],
        "multi_modal_projector.mm_soft_emb_norm.weight": [h],
    }
    for layer in range(vision["num_hidden_layers"]):
        p = f"{tower}encoder.layers.{layer}."
        for name in ("q_proj", "k_proj", "v_proj", "out_proj"):
            shapes |= {p + f"self_attn.{name}.weight": [h, h], p + f"self_attn.{name}.bias": [h]}
        shapes |= {p + "mlp.fc1.weight": [m, h], p + "mlp.fc1.bias": [m], p + "mlp.fc2.weight": [h, m]}
        shapes |= {p + "mlp.fc2.bias": [h], p + "layer_norm1.weight": [h], p + "layer_norm1.bias": [h]}
        shapes |= {p + "layer_norm2.weight": [h], p + "layer_norm2.bias": [h]}
    return shapes


@pytest.mark.slow
def test_plan_of_the_full_size_gemma3_27b_reads_no_tensor(tmp_path):
    """`port plan` on Gemma-3-27B's real shapes (a sparse file): its language model's 27B
    parameters planned on 4x2, the vision tower and projector listed as ignored, no tensor read."""
    import time

    from port._skeleton import leaves

    from helpers import recorded_reads, write_sparse_checkpoint

    shapes = gemma3_27b_tensors(GEMMA3_27B)
    directory = tmp_path / "gemma-3-27b-it"
    write_sparse_checkpoint(directory, GEMMA3_27B, shapes)
    text = {k: s for k, s in shapes.items() if k.startswith("language_model.")}
    params = sum(int(np.prod(s)) for s in text.values())
    assert round(params / 1e9, 1) == 27.0

    with recorded_reads() as calls, port.open_checkpoint(directory) as ckpt:
        mapping = port.mapping_for(ckpt.config)
        skeleton = port.skeleton(mapping, ckpt.config)
        recipe = port.plan(skeleton, mapping, ckpt.tensors, ckpt.config, {"data": 4, "model": 2})
    assert calls == []
    assert {leaf.path for leaf in recipe.leaves} == set(leaves(skeleton))
    assert set(recipe.ignored) == shapes.keys() - text.keys()
    assert recipe.read_bytes == 2 * params
    assert skeleton.config.sliding_layers == tuple(bool((i + 1) % 6) for i in range(62))
    assert (skeleton.config.rope.kind, skeleton.config.rope.factor) == ("linear", 8.0)

    start = time.perf_counter()
    result = run_port("plan", directory, "--mesh", "4x2")
    took = time.perf_counter() - start
    assert result.returncode == 0, result.stdout + result.stderr
    assert "ignored: vision_tower.vision_model." in result.stdout
    assert result.stdout.strip().splitlines()[-1].startswith("27.01B params")
    print(f"port plan of Gemma-3-27B (4x2): {took:.2f} s")
