"""Gemma 4: port's model, converted by the shipped `mappings/gemma4.toml`, against `transformers`.

Three checkpoints, each written by `save_pretrained`: a dense `Gemma4ForCausalLM` (biases,
per-layer embeddings, global layers whose one key/value head serves keys and values
(`attention_k_eq_v`), its last two layers reusing the keys and values of the first two
(`num_kv_shared_layers`) with MLPs twice as wide, a final soft-cap that clips), a mixture-of-experts one (experts beside
the MLP, a global layer amid local ones), and the language model of a
`Gemma4ForConditionalGeneration` (model_type gemma4: `text_config`, keys under
`model.language_model.`, a vision tower port ignores). Every checkpoint has local layers
(heads of 12, window 4 under 11 tokens) and global ones (heads of 16, proportional RoPE),
norms, router scales and `layer_scalar` perturbed. Parity in float32 and bfloat16 on 1x1
and 4x2; `port.export` back into transformers bit for bit; the wrapper's language model
exported as a text-only checkpoint; the global layers' sizes read as Gemma4TextConfig
resolves them; one-line errors for what the module does not run. The tests that build a
`transformers` model skip without PyTorch.
"""

import json
from pathlib import Path

import numpy as np
import pytest

import port
from port._errors import ConfigError
from port.models.gemma4 import Gemma4Config

from helpers import loaded_once, logits, one_line, perturbed, run_port, saved_once, torch_logits, transformers_or_skip

TEXT = dict(
    vocab_size=97,
    hidden_size=48,
    intermediate_size=80,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=12,
    global_head_dim=16,
    sliding_window=4,
    max_position_embeddings=64,
    initializer_range=0.2,
    rope_parameters={
        "sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
        "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.5, "rope_theta": 1000.0},
    },
)
CONFIGS = {
    "dense": dict(
        TEXT,
        num_hidden_layers=4,
        attention_bias=True,
        attention_k_eq_v=True,
        num_global_key_value_heads=1,
        layer_types=["sliding_attention", "full_attention"] * 2,
        num_kv_shared_layers=2,
        use_double_wide_mlp=True,
        hidden_size_per_layer_input=8,
        vocab_size_per_layer_input=97,
        final_logit_softcapping=3.0,
    ),
    "moe": dict(
        TEXT,
        layer_types=["sliding_attention", "full_attention", "full_attention"],
        hidden_size_per_layer_input=0,
        enable_moe_block=True,
        num_experts=4,
        top_k_experts=2,
        moe_intermediate_size=24,
    ),
}
VISION = dict(
    hidden_size=16,
    intermediate_size=32,
    num_hidden_layers=1,
    num_attention_heads=2,
    num_key_value_heads=2,
    head_dim=8,
    patch_size=4,
    position_embedding_size=64,
)
IDS = np.random.default_rng(0).integers(3, 97, (2, 11)).astype(np.int32)
MESHES = ["1x1", "4x2"]
MAPPING = Path(__file__).resolve().parents[1] / "mappings" / "gemma4.toml"


def torch_gemma4(name: str, dtype: str | None = None):
    """A seeded `Gemma4ForCausalLM` ("dense", "moe") or `Gemma4ForConditionalGeneration` ("wrapper",
    the dense text config), eager attention, norms, biases, router scales and layer scalars perturbed."""
    transformers = transformers_or_skip()
    import torch

    torch.manual_seed(0)
    if name == "wrapper":
        config = transformers.Gemma4Config(text_config=CONFIGS["dense"], vision_config=VISION)
        config.text_config._attn_implementation = "eager"
        model = transformers.Gemma4ForConditionalGeneration(config)
    else:
        config = transformers.Gemma4TextConfig(**CONFIGS[name])
        config._attn_implementation = "eager"
        config._experts_implementation = "eager"
        model = transformers.Gemma4ForCausalLM(config)
    noisy = ("norm", "bias", "scale")
    model = perturbed(model, lambda key: any(n in key for n in noisy), 0.2)
    with torch.no_grad():
        for key, buffer in model.named_buffers():
            if key.endswith("layer_scalar"):
                buffer.uniform_(0.5, 1.5)
    return model if dtype is None else model.to(getattr(torch, dtype))


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """get(name): (directory written by save_pretrained, the model, its float32 logits on IDS)."""
    return saved_once(tmp_path_factory, torch_gemma4, IDS)


@pytest.fixture(scope="module")
def loaded(checkpoints):
    return loaded_once(checkpoints)


def diff(model, expected: np.ndarray) -> float:
    """The largest |port logit - expected logit| on IDS."""
    return float(np.abs(np.asarray(logits(model, IDS)).astype(np.float32) - expected).max())


# ---------------------------------------------------------------- parity


@pytest.mark.parametrize("mesh", MESHES)
@pytest.mark.parametrize("name", ["dense", "moe", "wrapper"])
def test_logits_match_transformers(checkpoints, loaded, name, mesh):
    """float32 logits within 1e-4 of transformers' (measured: at most 2e-5), the global layers'
    heads of their own size, stacks by kind."""
    model = loaded(name, mesh)
    assert diff(model, checkpoints(name).logits) < 1e-4
    shared = {"sliding": (0,), "full": (1,), "shared_sliding": (2,), "shared_full": (3,)}
    assert model.layer_groups == (shared if name != "moe" else {"sliding": (0,), "full": (1, 2)})
    assert model.full.attn.wq.shape[-2:] == (16, 48) and model.sliding.attn.wq.shape[-2:] == (12, 48)
    assert (model.full.attn.wv is None) == (name != "moe")  # attention_k_eq_v: keys are the values
    if name != "moe":  # the last two layers reuse layers 0's and 1's keys and values, MLPs twice as wide
        assert model.shared_full.attn.wk is None and model.shared_sliding.attn.wv is None
        assert model.shared_full.mlp.up.shape[-2] == 2 * model.full.mlp.up.shape[-2]
    assert (model.per_layer_embed is None) == (name == "moe") and (model.full.moe is None) == (name != "moe")


@pytest.mark.parametrize("mesh", MESHES)
@pytest.mark.parametrize("name", ["dense", "moe"])
def test_bfloat16_logits_are_as_close_as_transformers_own(tmp_path, name, mesh):
    """A bfloat16 checkpoint computes in bfloat16 within twice transformers' own bfloat16 rounding of
    its float32 logits (bfloat16's 8 bits round each op; the order of operations differs)."""
    import torch

    model = torch_gemma4(name)
    reference = torch_logits(model, IDS)
    model = model.to(torch.bfloat16)
    model.save_pretrained(tmp_path)
    expected = torch_logits(model, IDS)
    rounding = np.abs(expected - reference).max()
    ours = np.asarray(logits(port.load(tmp_path, mesh=mesh), IDS)).astype(np.float32)
    assert np.abs(ours - expected).max() <= 2 * rounding
    assert np.abs(ours - reference).max() <= 2 * rounding


def torch_variant(name: str, model, **changes):
    """`model`'s weights in a transformers model built from its config with `changes`."""
    transformers = transformers_or_skip()
    config = transformers.Gemma4TextConfig(**{**CONFIGS[name], **changes})
    config._attn_implementation = "eager"
    config._experts_implementation = "eager"
    variant = transformers.Gemma4ForCausalLM(config).eval()
    variant.load_state_dict(model.state_dict())
    return variant


FULL_ROPE = {"rope_type": "proportional", "partial_rotary_factor": 1.0, "rope_theta": 1000.0}


@pytest.mark.parametrize(
    "name, change",
    [
        ("dense", dict(final_logit_softcapping=None)),
        ("dense", dict(sliding_window=64)),  # longer than the input: no window
        ("moe", dict(sliding_window=64)),
        ("dense", dict(rope_parameters={**TEXT["rope_parameters"], "full_attention": FULL_ROPE})),
        ("dense", dict(rope_parameters={**TEXT["rope_parameters"], "sliding_attention": FULL_ROPE})),
        ("moe", dict(top_k_experts=1)),
    ],
    ids=["no-final-cap", "no-window", "moe-no-window", "global-rope-whole", "local-rope-base", "moe-top-1"],
)
def test_the_case_is_sensitive_to_each_feature(checkpoints, name, change):
    """Each feature matters here: transformers' logits move by > 1e-2 without it, 100 times the
    parity tolerance, so port's (within 1e-4) must implement it."""
    _, model, expected = checkpoints(name)
    assert np.abs(torch_logits(torch_variant(name, model, **change), IDS) - expected).max() > 1e-2


# ---------------------------------------------------------------- the wrapper and export


@pytest.mark.slow
def test_plan_lists_the_vision_tower_as_ignored(checkpoints):
    result = run_port("plan", checkpoints("wrapper").directory, "--mesh", "1x1")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "ignored: model.vision_tower." in result.stdout and "ignored: model.embed_vision." in result.stdout


@pytest.mark.parametrize("name", ["dense", "moe"])
def test_export_round_trip_is_bit_identical(checkpoints, loaded, name, tmp_path):
    """port.load on 4x2 -> port.export -> from_pretrained: no missing or unexpected key, same weights
    (the fused experts and the layer scalars included)."""
    import torch

    transformers = transformers_or_skip()
    source = checkpoints(name).directory
    out = port.export(loaded(name, "4x2"), tmp_path / "hf", source).out
    exported, info = transformers.Gemma4ForCausalLM.from_pretrained(out, output_loading_info=True)
    for what in ("missing_keys", "unexpected_keys", "mismatched_keys", "error_msgs"):
        assert not info[what], f"{what}: {info[what]}"
    theirs = transformers.Gemma4ForCausalLM.from_pretrained(source)
    assert exported.state_dict().keys() == theirs.state_dict().keys()
    for key, value in theirs.state_dict().items():
        assert exported.state_dict()[key].dtype == value.dtype and torch.equal(exported.state_dict()[key], value), key


def test_a_wrappers_language_model_exports_as_a_text_only_checkpoint(checkpoints, loaded, tmp_path):
    """gemma4 -> port.export: config.json is the text config (gemma4_text, Gemma4ForCausalLM), the keys
    the text-only class's, each tensor the source's bytes; transformers' Auto class loads it with no
    missing or unexpected key and computes port's logits; port reads it back as gemma4_text."""
    from safetensors.numpy import load_file

    transformers = transformers_or_skip()
    source = checkpoints("wrapper").directory
    model = loaded("wrapper", "4x2")
    out = port.export(model, tmp_path / "hf", source).out
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "gemma4_text" and config["architectures"] == ["Gemma4ForCausalLM"]
    written, read = load_file(out / "model.safetensors"), load_file(source / "model.safetensors")
    prefix = "model.language_model."
    text = {"model." + k[len(prefix) :]: v for k, v in read.items() if k.startswith(prefix)}
    assert written.keys() == text.keys()
    for key, value in text.items():
        assert written[key].dtype == value.dtype and written[key].tobytes() == value.tobytes(), key
    exported, info = transformers.AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert type(exported).__name__ == "Gemma4ForCausalLM"
    for what in ("missing_keys", "unexpected_keys", "mismatched_keys", "error_msgs"):
        assert not info[what], f"{what}: {info[what]}"
    exported.config._attn_implementation = "eager"
    np.testing.assert_allclose(torch_logits(exported, IDS), np.asarray(logits(model, IDS)), atol=1e-4, rtol=0)
    assert diff(port.load(out), checkpoints("wrapper").logits) < 1e-4


# ---------------------------------------------------------------- the config


def small(**changes) -> dict:
    """The dense config as transformers writes it (`per_layer_config`, not `global_head_dim`), changed."""
    transformers = transformers_or_skip()
    return {**transformers.Gemma4TextConfig(**CONFIGS["dense"]).to_dict(), **changes}


def test_the_global_layers_sizes_are_read_as_gemma4_text_config_resolves_them():
    """`per_layer_config` (written by transformers 5) wins; without it `global_head_dim` (default
    512) and, only with `attention_k_eq_v`, `num_global_key_value_heads`; the last layer is global
    and the defaults are Gemma4TextConfig's (5 local layers to 1 global, proportional RoPE on a
    quarter of the global head, bases 1e4 and 1e6)."""
    written = small()
    global_layer = {"head_dim": 16, "num_key_value_heads": 1}
    assert written["per_layer_config"] == {"1": global_layer, "3": global_layer}
    c = Gemma4Config.from_hf(written)
    assert (c.full_head_dim, c.full_kv_heads, c.head_dim, c.num_key_value_heads) == (16, 1, 12, 2)
    legacy = {k: v for k, v in written.items() if k != "per_layer_config"}
    legacy |= {"global_head_dim": 16, "num_global_key_value_heads": 1}
    assert Gemma4Config.from_hf(legacy).sizes("full") == (1, 16)
    assert Gemma4Config.from_hf({**legacy, "attention_k_eq_v": False}).sizes("full") == (2, 16)
    padded = Gemma4Config.from_hf(
        small(num_hidden_layers=12, layer_types=None, num_kv_shared_layers=0, per_layer_config={"05": {}, "11": {}})
    )
    assert padded.kinds == (*("sliding",) * 5, "full") * 2 and padded.full_head_dim == 12  # "05": layer 5
    c = Gemma4Config.from_hf({"model_type": "gemma4_text", "num_hidden_layers": 7})
    assert c.kinds == ("sliding",) * 5 + ("full", "full") and c.full_head_dim == 512 and c.head_dim == 256
    assert (c.local_rope.theta, c.local_rope.rotated, c.full_rope.theta, c.full_rope.rotated) == (1e4, 128, 1e6, 64)
    assert c.hidden_size_per_layer_input == 256 and c.num_experts is None and c.tie_word_embeddings
    forced = {**written, "layer_types": ["sliding_attention"] * 4, "per_layer_config": None, "num_kv_shared_layers": 0}
    assert Gemma4Config.from_hf(forced).kinds == ("sliding", "sliding", "sliding", "full")
    shared = Gemma4Config.from_hf({**written, "num_kv_shared_layers": 1})
    assert shared.kinds == ("sliding", "full", "sliding", "shared_full")


@pytest.mark.parametrize(
    "change, match",
    [
        (dict(num_kv_shared_layers=3), "'num_kv_shared_layers' (3) must leave a layer of every type"),
        (dict(num_kv_shared_layers=4), "'num_kv_shared_layers' (4) must leave a layer of every type"),
        (dict(use_bidirectional_attention="all"), "use_bidirectional_attention 'all' is not supported"),
        (dict(per_layer_config={"0": {"head_dim": 16}}), "'per_layer_config.0' changes a sliding layer"),
        (dict(per_layer_config={"2": {"sliding_window": 8}}), "'per_layer_config.2' may set only head_dim"),
        (dict(per_layer_config={"9": {"head_dim": 16}}), "'per_layer_config' names no layer: '9'"),
        (
            dict(
                layer_types=["sliding_attention", *["full_attention"] * 3],
                per_layer_config={"1": {"head_dim": 16}},
            ),
            "'per_layer_config' gives global layers different sizes",
        ),
        (
            dict(per_layer_config={"1": {"num_key_value_heads": 3}, "3": {"num_key_value_heads": 3}}),
            "global layers' 3 key/value heads must divide",
        ),
        (
            dict(rope_parameters={**TEXT["rope_parameters"], "full_attention": {"rope_type": "yarn"}}),
            "rope_parameters.full_attention: rope type 'yarn' is not supported",
        ),
        (
            dict(rope_parameters={"full_attention": FULL_ROPE}),
            "'rope_parameters' must be a dict for 'sliding_attention'",
        ),
        (dict(enable_moe_block=True, num_experts=2, top_k_experts=3), "'top_k_experts' (3) is more than"),
        (dict(layer_types=["full_attention"]), "'layer_types' must list 4 of"),
        (dict(hidden_activation="gelu_bogus"), "'hidden_activation' 'gelu_bogus' is not supported"),
        (dict(model_type="gemma3n_text"), "'model_type' 'gemma3n_text' is not supported"),
        (dict(model_type="gemma4", text_config=None), "'text_config' must be a dict"),
        (dict(model_type="gemma4", text_config={"use_bidirectional_attention": "all"}), "use_bidirectional_attention"),
    ],
)
def test_bad_config_values_are_one_line_errors(change, match):
    with pytest.raises(ConfigError) as info:
        Gemma4Config.from_hf(small(**change))
    message = str(info.value)
    assert message.startswith("config.json: ") and "\n" not in message and match in message, message


@pytest.mark.slow
@pytest.mark.parametrize("command", ["check", "plan"])
def test_the_command_line_refuses_bidirectional_attention_before_reading_a_tensor(checkpoints, tmp_path, command):
    """A checkpoint whose config.json sets `use_bidirectional_attention` "all" (every token sees every
    other): `port check` and `port plan` exit 1 with one line naming the field and its value."""
    source = checkpoints("dense").directory
    directory = tmp_path / "shared"
    directory.mkdir()
    (directory / "model.safetensors").symlink_to(source / "model.safetensors")
    config = json.loads((source / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**config, "use_bidirectional_attention": "all"}))
    args = [MAPPING, directory] if command == "check" else [directory, "--mesh", "1x1"]
    line = one_line(run_port(command, *args), "config.json: use_bidirectional_attention 'all' is not supported")
    assert "port.models.gemma4.Gemma4 (supported: null, 'vision')" in line


# ---------------------------------------------------------------- Gemma-4-31B, planned only

# Gemma-4-31B's language model as its model card and published conversions describe it (60
# layers, 5 local to 1 global, hidden 5376, 32 query heads; local: 16 key/value heads of 256,
# window 1024; global: 4 heads of 512 serving keys and values; MLP 21504; vocab 262144;
# soft-cap 30; no per-layer embeddings): 30.70B parameters, the card's 30.7B.
GEMMA4_31B = dict(
    vocab_size=262144,
    hidden_size=5376,
    intermediate_size=21504,
    num_hidden_layers=60,
    num_attention_heads=32,
    num_key_value_heads=16,
    head_dim=256,
    global_head_dim=512,
    num_global_key_value_heads=4,
    attention_k_eq_v=True,
    sliding_window=1024,
    hidden_size_per_layer_input=0,
    final_logit_softcapping=30.0,
    max_position_embeddings=262144,
)


@pytest.mark.slow
def test_plan_of_a_gemma4_31b_shaped_checkpoint_reads_no_tensor(tmp_path):
    """`port plan` on 61 GB of bfloat16 (a sparse file; its tensors' names and shapes those of
    transformers' Gemma4ForCausalLM of GEMMA4_31B, built on the meta device): every leaf filled,
    the global layers' heads of their own size, no tensor byte read."""
    import math

    import torch
    from jax.sharding import PartitionSpec as P

    from helpers import recorded_reads, write_sparse_checkpoint

    transformers = transformers_or_skip()
    config = transformers.Gemma4TextConfig(**GEMMA4_31B)
    with torch.device("meta"):
        shapes = {k: list(t.shape) for k, t in transformers.Gemma4ForCausalLM(config).state_dict().items()}
    del shapes["lm_head.weight"]  # tied: save_pretrained writes no copy
    directory = tmp_path / "gemma-4-31b"
    write_sparse_checkpoint(directory, config.to_dict(), shapes)
    params = sum(math.prod(s) for s in shapes.values())
    assert round(params / 1e9, 2) == 30.70

    with recorded_reads() as calls, port.open_checkpoint(directory) as ckpt:
        mapping = port.mapping_for(ckpt.config)
        skeleton = port.skeleton(mapping, ckpt.config)
        recipe = port.plan(skeleton, mapping, ckpt.tensors, ckpt.config, {"data": 4, "model": 2})
    assert calls == []
    assert {leaf.path for leaf in recipe.leaves} == set(port._skeleton.leaves(skeleton))
    assert recipe.read_bytes == 2 * params
    wq = {leaf.path: leaf for leaf in recipe.leaves}
    assert wq["full.attn.wq"].shape == (10, 32, 512, 5376) and wq["sliding.attn.wk"].shape == (50, 16, 256, 5376)
    assert wq["full.attn.wk"].spec == P(None, "model", None, "data") and "full.attn.wv" not in wq

    result = run_port("plan", directory, "--mesh", "4x2")
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.strip().splitlines()[-1].startswith("30.70B params in ")
