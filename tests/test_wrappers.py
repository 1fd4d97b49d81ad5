"""A multimodal wrapper's language model, loaded by its text model's mapping: one mechanism.

A checkpoint whose config.json `model_type` no mapping serves but whose `text_config`'s one
does (Kimi K2.5: `kimi_k25` around a `deepseek_v3`) loads its language model by that
mapping (`port.mapping_for(config, keys=...)`): the key prefixes and the towers to ignore
derived from the checkpoint's keys, the model built from the `text_config`, and `port
export` writing a text-only checkpoint of the text model type. Here a tiny
`Kimi_K25ForConditionalGeneration` (tiny vision tower too) in the Hub's layout
(`language_model.model.layers...`, `language_model.lm_head.weight`, `vision_tower.*`,
`mm_projector.*`) and in the class's own (`model.language_model.layers...`,
`lm_head.weight`, `model.vision_tower.*`), against transformers; and the one-line refusals.
"""

import json
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file
from test_deepseek_v3 import CONFIG as DEEPSEEK_V3

import port

from helpers import VOCAB, loaded_once, logits, one_line, perturbed, run_port, torch_logits, transformers_or_skip

IDS = np.random.default_rng(0).integers(3, VOCAB, (2, 16))
MAPPINGS = Path(__file__).resolve().parents[1] / "mappings"
KIMI_VISION = dict(
    hidden_size=16,
    intermediate_size=32,
    num_hidden_layers=1,
    num_attention_heads=2,
    patch_size=2,
    pos_emb_height=4,
    pos_emb_width=4,
    pos_emb_time=2,
)
# transformers 5.24's save_pretrained writes Kimi K2.5's language model layers as `blocks`
# (its load-time `blocks` -> `layers` rename reversed over every key); the Hub's checkpoints,
# which transformers loads, keep DeepSeek-V3's `layers`. Each layout: how a saved key is renamed.
LAYOUTS = {
    "hub": {"language_model.model.blocks.": "language_model.model.layers."},
    "own": {
        "language_model.model.blocks.": "model.language_model.layers.",
        "language_model.model.": "model.language_model.",
        "language_model.lm_head.": "lm_head.",
    },
}


def torch_kimi(dtype=None):
    """A seeded tiny `Kimi_K25ForConditionalGeneration`: DeepSeek-V3's test text config (latent
    attention, dense and MoE layers, grouped routing), an untied head, norms and the
    selection bias perturbed; eager attention and experts."""
    transformers = transformers_or_skip()
    import torch

    torch.manual_seed(0)
    text = dict(DEEPSEEK_V3, model_type="deepseek_v3")
    config = transformers.Kimi_K25Config(
        text_config=text, vision_config=KIMI_VISION, projection_hidden_size=16, tie_word_embeddings=False
    )
    config.text_config._attn_implementation = "eager"
    config.text_config._experts_implementation = "eager"
    model = perturbed(transformers.Kimi_K25ForConditionalGeneration(config), lambda n: "norm" in n, 0.2).eval()
    with torch.no_grad():
        for layer in model.model.language_model.layers[text["first_k_dense_replace"] :]:
            bias = layer.mlp.gate.e_score_correction_bias
            bias.add_(0.3 * torch.randn_like(bias))
    return model if dtype is None else model.to(getattr(torch, dtype))


def write_layout(saved: Path, directory: Path, layout: str) -> Path:
    """`saved` (a save_pretrained directory) rewritten into `directory` with its keys in `layout`."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text((saved / "config.json").read_text())
    renames = LAYOUTS[layout]

    def renamed(key):
        return next((new + key[len(old) :] for old, new in renames.items() if key.startswith(old)), key)

    tensors = load_file(saved / "model.safetensors")
    save_file({renamed(k): v for k, v in tensors.items()}, directory / "model.safetensors", metadata={"format": "pt"})
    return directory


@pytest.fixture(scope="module")
def kimi(tmp_path_factory):
    """(the torch model, its logits, {layout: the checkpoint directory}), written once."""
    model = torch_kimi()
    saved = tmp_path_factory.mktemp("kimi-saved")
    model.save_pretrained(saved)
    made = {name: write_layout(saved, tmp_path_factory.mktemp(f"kimi-{name}"), name) for name in LAYOUTS}
    return model, torch_logits(model, IDS), made


@pytest.fixture(scope="module")
def loaded(kimi):
    """get(layout, mesh): the layout's checkpoint loaded by port.load on `mesh` (one load per pair)."""
    return loaded_once(lambda name: type("Saved", (), {"directory": kimi[2][name]}))


def test_the_mapping_is_the_text_models_fitted_to_the_wrappers_keys(kimi):
    """deepseek_v3.toml, its prefixes the ones the language model's keys are under, every other
    group of keys ignored; a plan that reads no tensor byte and lists the towers it ignores."""
    expected = {
        # transformers writes the projector's pre-norm as `model.mm_projector.pre_norm.*`
        "hub": (("language_model.model.", "language_model."), ("mm_projector.*", "model.*", "vision_tower.*")),
        "own": (("model.language_model.",), ("mm_projector.*", "model.mm_projector.*", "vision_tower.*")),
    }
    for layout, (prefixes, towers) in expected.items():
        with port.open_checkpoint(kimi[2][layout]) as ckpt:
            mapping = port.mapping_for(ckpt.config, keys=ckpt.tensors)
            assert Path(mapping.source).name == "deepseek_v3.toml"
            assert mapping.prefixes == prefixes
            assert mapping.ignore[-len(towers) :] == towers
            skeleton = port.skeleton(mapping, ckpt.config)
            recipe = port.plan(skeleton, mapping, ckpt.tensors, ckpt.config, {"data": 1, "model": 1})
            assert ckpt.bytes_read == 0
            towers_keys = {k for k in ckpt.tensors if not k.startswith(prefixes[0]) and "lm_head" not in k}
        assert towers_keys and set(recipe.ignored) == towers_keys


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("mesh", ["1x1", "4x2"])
def test_logits_match_the_wrappers_language_model(kimi, loaded, layout, mesh):
    """The language model port loads computes the wrapper's logits (text only), float32."""
    ours = np.asarray(logits(loaded(layout, mesh), IDS))
    error = np.abs(ours - kimi[1]).max()
    print(f"kimi_k25 {layout} float32 on {mesh}: max |ours - transformers| {error:.3g}")
    np.testing.assert_allclose(ours, kimi[1], atol=1e-4, rtol=0)


def test_logits_match_with_experts_on_an_expert_axis(kimi):
    """On `data=2,expert=2,model=2` with the experts on the expert axis."""
    import dataclasses

    directory = kimi[2]["hub"]
    with port.open_checkpoint(directory) as ckpt:
        fitted = port.mapping_for(ckpt.config, keys=ckpt.tensors)
    mapping = dataclasses.replace(fitted, rules={**fitted.rules, "experts": ("expert",)})
    model = port.load(directory, mesh=port.make_mesh("data=2,expert=2,model=2"), mapping=mapping)
    ours = np.asarray(logits(model, IDS))
    error = np.abs(ours - kimi[1]).max()
    print(f"kimi_k25 float32 on data=2,expert=2,model=2: max |ours - transformers| {error:.3g}")
    np.testing.assert_allclose(ours, kimi[1], atol=1e-4, rtol=0)


def test_bfloat16_end_to_end(tmp_path):
    """A bfloat16 wrapper's language model stays bfloat16, near transformers' own bfloat16 logits."""
    model = torch_kimi(dtype="bfloat16")
    model.save_pretrained(tmp_path / "saved")
    directory = write_layout(tmp_path / "saved", tmp_path / "hub", "hub")
    ours = port.load(directory, mesh="4x2")
    assert ours.embed.dtype == np.dtype(ml_dtypes.bfloat16)
    out = np.asarray(logits(ours, IDS)).astype(np.float32)
    expected, exact = torch_logits(model, IDS), torch_logits(model.float(), IDS)
    noise, error = np.abs(expected - exact).max(), np.abs(out - expected).max()
    print(f"kimi_k25 bfloat16 on 4x2: max |ours - transformers| {error:.3g}, transformers' own noise {noise:.3g}")
    assert error <= 2 * noise and error < 0.05 * np.abs(expected).max(), (error, noise)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_export_writes_a_text_only_deepseek_v3(kimi, loaded, layout, tmp_path):
    """`port.export` writes the language model as a deepseek_v3 checkpoint (keys under `model.`,
    the head `lm_head.weight`, no vision tensor), byte for byte the wrapper's tensors, which
    transformers' AutoModelForCausalLM loads with no missing or unexpected key and the same logits."""
    transformers = transformers_or_skip()
    directory = kimi[2][layout]
    out = port.export(loaded(layout, "4x2"), tmp_path / "hf", directory).out
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "deepseek_v3" and config["tie_word_embeddings"] is False
    assert "vision_config" not in config and config["num_hidden_layers"] == DEEPSEEK_V3["num_hidden_layers"]
    written, source = load_file(out / "model.safetensors"), load_file(directory / "model.safetensors")
    prefix = "language_model.model." if layout == "hub" else "model.language_model."
    head = "language_model.lm_head.weight" if layout == "hub" else "lm_head.weight"
    text = {"model." + k[len(prefix) :]: v for k, v in source.items() if k.startswith(prefix)} | {
        "lm_head.weight": source[head]
    }
    assert written.keys() == text.keys()
    for key, value in text.items():
        assert written[key].dtype == value.dtype and written[key].tobytes() == value.tobytes(), key
    exported, info = transformers.AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    for what in ("missing_keys", "unexpected_keys", "mismatched_keys", "error_msgs"):
        assert not info[what], f"{what}: {info[what]}"
    assert type(exported).__name__ == "DeepseekV3ForCausalLM"
    np.testing.assert_allclose(torch_logits(exported.eval(), IDS), kimi[1], atol=1e-5, rtol=0)


def test_a_converted_language_model_restores_and_exports(kimi, tmp_path):
    """`port.convert(out=...)` keeps the wrapper's config.json; `port.restore` builds the language
    model from its text_config, with the same logits, and exports it text-only from the output."""
    directory = kimi[2]["own"]
    port.convert(directory, mesh="2x2", out=tmp_path / "out")
    restored = port.restore(tmp_path / "out", "4x2")
    np.testing.assert_allclose(np.asarray(logits(restored, IDS)), kimi[1], atol=1e-4, rtol=0)
    out = port.export(restored, tmp_path / "hf", tmp_path / "out").out
    assert json.loads((out / "config.json").read_text())["model_type"] == "deepseek_v3"
    assert "lm_head.weight" in load_file(out / "model.safetensors")


@pytest.mark.parametrize("name", ["gemma3", "llama4", "qwen3_5", "qwen3_5_moe", "ministral3"])
def test_the_shipped_wrappers_write_no_wrapper_prefix(name):
    """The wrappers port already read (tests/test_gemma3.py, test_llama4.py, test_qwen3_next.py,
    test_ministral3.py, test_export_text_only.py load and export them) write only their text
    model's own prefix: the wrapper's prefixes, towers and export renames are derived."""
    mapping = port.load_mapping(MAPPINGS / f"{name}.toml")
    assert mapping.prefixes == ("model.",)
    assert not [p for p in mapping.ignore if p.split(".")[0] in ("vision_tower", "vision_model", "visual")]
    assert mapping.export and all(not entry.prefixes for entry in mapping.export.values())


def test_a_shipped_wrappers_prefixes_are_derived_from_its_keys():
    """Gemma 3 in either layout: the derived prefixes, towers and export renames."""
    config = {"model_type": "gemma3", "text_config": {"model_type": "gemma3_text"}}
    hub = ["language_model.model.embed_tokens.weight", "language_model.model.layers.0.mlp.up_proj.weight"]
    hub += ["language_model.lm_head.weight", "vision_tower.vision_model.x.weight", "multi_modal_projector.w"]
    own = ["model.language_model.embed_tokens.weight", "model.language_model.layers.0.mlp.up_proj.weight"]
    own += ["lm_head.weight", "model.vision_tower.vision_model.x.weight", "model.multi_modal_projector.w"]
    for keys, prefixes, towers, renames in [
        (
            hub,
            ("language_model.model.", "language_model."),
            ("multi_modal_projector.*", "vision_tower.*"),
            (("language_model.model.", "model."), ("language_model.", "")),
        ),
        (
            own,
            ("model.language_model.",),
            ("model.multi_modal_projector.*", "model.vision_tower.*"),
            (("model.language_model.", "model."),),
        ),
    ]:
        mapping = port.mapping_for(config, keys=keys)
        assert Path(mapping.source).name == "gemma3.toml"
        assert mapping.prefixes == prefixes and mapping.ignore[-len(towers) :] == towers
        export = mapping.export["gemma3"]
        assert export.prefixes == renames and export.architectures == ("Gemma3ForCausalLM",)
        assert port.mapping_for(config, mapping, keys=keys) == mapping  # fitted once


# ---------------------------------------------------------------- bad input


def with_config(source: Path, directory: Path, change) -> Path:
    """A copy of the checkpoint at `source` in `directory`, its config.json changed by `change(config)`."""
    directory.mkdir()
    (directory / "model.safetensors").symlink_to(source / "model.safetensors")
    config = json.loads((source / "config.json").read_text())
    change(config)
    (directory / "config.json").write_text(json.dumps(config))
    return directory


@pytest.mark.slow
def test_a_wrapper_of_an_unknown_text_model_type_is_refused_naming_both(kimi, tmp_path):
    def unknown(config):
        config["text_config"]["model_type"] = "not_a_model"

    directory = with_config(kimi[2]["hub"], tmp_path / "ckpt", unknown)
    line = one_line(run_port("plan", str(directory)), "model_type 'kimi_k25' has no mapping", "'not_a_model'")
    assert "text_config" in line


@pytest.mark.slow
def test_the_language_model_under_two_prefixes_is_refused(kimi, tmp_path):
    """Keys of the language model under both the Hub's and the class's prefixes: one line naming both."""
    hub, own = (load_file(kimi[2][name] / "model.safetensors") for name in ("hub", "own"))
    directory = tmp_path / "both"
    directory.mkdir()
    (directory / "config.json").write_text((kimi[2]["hub"] / "config.json").read_text())
    both = hub | {k: v for k, v in own.items() if k.startswith("model.language_model.")}
    save_file(both, directory / "model.safetensors", metadata={"format": "pt"})
    result = run_port("plan", str(directory))
    one_line(result, "found under two prefixes", "'language_model.model.'", "'model.language_model.'")


@pytest.mark.slow
def test_a_text_config_field_the_model_does_not_honour_is_refused(kimi, tmp_path):
    """The text model's own declaration (DeepseekV3.FIELDS) checks the wrapper's text_config:
    one line naming the field, before any tensor byte is read."""

    def softmax(config):
        config["text_config"]["scoring_func"] = "softmax"

    directory = with_config(kimi[2]["hub"], tmp_path / "ckpt", softmax)
    one_line(run_port("convert", str(directory), "--out", str(tmp_path / "out")), "scoring_func", "'softmax'")
