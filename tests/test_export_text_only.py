"""`port export` of a multimodal checkpoint's language model writes a text-only checkpoint.

A mapping's `[export.<model_type>]` says, for a wrapper model type it loads the language
model of, which text config, `model_type`, `architectures` and key prefixes the export
writes. Each shipped wrapper (Llama 4, Qwen3.5 dense and MoE; Gemma 3's in
tests/test_gemma3.py): a tiny `*ForConditionalGeneration` written by `save_pretrained`,
`port.load`, `port.export`, then transformers' `AutoModelForCausalLM` loads the text-only
class with no missing or unexpected key and computes port's logits. And the table's own
errors, one line naming the mapping file.
"""

import json

import numpy as np
import pytest
from test_llama4 import CONFIG as LLAMA4
from test_qwen3_next import QWEN3_5_TEXT

import port

from helpers import logits, perturbed, torch_logits, transformers_or_skip

IDS = np.random.default_rng(0).integers(3, 97, (2, 11))
LLAMA4_VISION = dict(
    hidden_size=16,
    num_hidden_layers=1,
    num_attention_heads=2,
    intermediate_size=32,
    image_size=28,
    patch_size=14,
    vision_output_dim=16,
    projector_input_dim=16,
    projector_output_dim=16,
)
QWEN3_5_VISION = dict(depth=1, hidden_size=16, intermediate_size=16, num_heads=2, out_hidden_size=48)
QWEN3_5_MOE = dict(num_experts=6, num_experts_per_tok=2, moe_intermediate_size=24, shared_expert_intermediate_size=40)
# name: (transformers config class, its text config, its vision config, the text-only class and model_type)
WRAPPERS = {
    "llama4": ("Llama4", LLAMA4, LLAMA4_VISION, "Llama4ForCausalLM", "llama4_text"),
    "qwen3_5": ("Qwen3_5", QWEN3_5_TEXT, QWEN3_5_VISION, "Qwen3_5ForCausalLM", "qwen3_5_text"),
    "qwen3_5_moe": ("Qwen3_5Moe", {**QWEN3_5_TEXT, **QWEN3_5_MOE}, QWEN3_5_VISION, "Qwen3_5MoeForCausalLM", "qwen3_5_moe_text"),
}  # fmt: skip


def torch_wrapper(name: str):
    """The seeded tiny `*ForConditionalGeneration` of `name`, eager attention, norms perturbed."""
    transformers = transformers_or_skip()
    import torch

    arch, text, vision, _, _ = WRAPPERS[name]
    torch.manual_seed(0)
    config = getattr(transformers, f"{arch}Config")(text_config=text, vision_config=vision)
    config._attn_implementation = config.text_config._attn_implementation = "eager"
    model = getattr(transformers, f"{arch}ForConditionalGeneration")(config)
    return perturbed(model, lambda n: "norm" in n or n.endswith(("A_log", "dt_bias")), 0.2)


@pytest.mark.slow
@pytest.mark.parametrize("name", WRAPPERS)
def test_a_wrappers_language_model_exports_text_only(name, tmp_path):
    transformers = transformers_or_skip()
    _, _, _, text_class, text_type = WRAPPERS[name]
    source = tmp_path / "source"
    torch_wrapper(name).save_pretrained(source)
    model = port.load(source, mesh="4x2")
    out = port.export(model, tmp_path / "hf", source).out
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == text_type and config["architectures"] == [text_class]
    assert "vision_config" not in config and "text_config" not in config
    exported, info = transformers.AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert type(exported).__name__ == text_class
    for what in ("missing_keys", "unexpected_keys", "mismatched_keys", "error_msgs"):
        assert not info[what], f"{what}: {info[what]}"
    exported.config._attn_implementation = "eager"
    ours = np.asarray(logits(model, IDS))
    np.testing.assert_allclose(torch_logits(exported, IDS), ours, atol=2e-3 * max(1.0, np.abs(ours).max()), rtol=0)


# ---------------------------------------------------------------- the table's errors

TOP = 'model = "port.models.gemma:Gemma"\nmodel_types = ["gemma3_text", "gemma3"]\n'
PARAM = '\n[[params]]\nkey = "norm.weight"\npath = "norm"\naxes = ["embed"]\n'
GOOD = 'config = "text_config"\nmodel_type = "gemma3_text"\narchitectures = ["Gemma3ForCausalLM"]\n'


BY_TYPE = (
    "(without model_type when architectures is a table by the text config's model_type; "
    "prefixes may be left to port, which derives them from the checkpoint's keys)"
)


def test_architectures_by_the_text_config_s_model_type(tmp_path):
    """A wrapper holding several kinds of language model (Mistral 3): the written model_type and class
    are the text config's own; a text model type the table does not name is one line."""
    path = tmp_path / "m.toml"
    table = (
        '[export.gemma3]\nconfig = "text_config"\n'
        'architectures = { gemma3_text = ["Gemma3ForCausalLM"], other = ["OtherForCausalLM"] }\nprefixes = {}\n'
    )
    path.write_text(TOP + table + PARAM)
    entry = port.load_mapping(path).export["gemma3"]
    assert entry.written({"model_type": "other"}) == ("other", ["OtherForCausalLM"])
    with pytest.raises(port.ConfigError) as info:
        entry.written({"model_type": "qwen2"})
    assert str(info.value) == (
        "config.json: text_config's 'model_type' 'qwen2' has no text-only class to export as "
        "(the mapping names: gemma3_text, other)"
    )


@pytest.mark.parametrize(
    "table, expected",
    [
        ("[export.gemma3]\n" + GOOD + 'prefixes = { "language_model.model." = "model." }\n', None),
        ("[export.llama4]\n" + GOOD + "prefixes = {}\n", "export.llama4: 'llama4' is not one of the mapping's model_types"),
        ("[export.gemma3]\n" + GOOD, None),  # prefixes derived from the checkpoint's keys
        ("[export.gemma3]\n" + GOOD.replace('model_type = "gemma3_text"\n', ""), "export.gemma3 must be a table of exactly architectures, config, model_type, prefixes " + BY_TYPE),
        ("[export.gemma3]\n" + GOOD.replace('["Gemma3ForCausalLM"]', '{ gemma3_text = ["Gemma3ForCausalLM"] }') + "prefixes = {}\n", "export.gemma3 must be a table of exactly architectures, config, model_type, prefixes " + BY_TYPE),
        ('[export.gemma3]\nconfig = "text_config"\narchitectures = {}\nprefixes = {}\n', "export.gemma3.architectures must name at least one text model_type"),
        ('[export.gemma3]\nconfig = "text_config"\narchitectures = { gemma3_text = "Gemma3ForCausalLM" }\nprefixes = {}\n', "export.gemma3.architectures.gemma3_text must be a non-empty list of class names"),
        ("[export.gemma3]\n" + GOOD.replace('"text_config"', "3") + "prefixes = {}\n", "export.gemma3.config must be a non-empty string"),
        ("[export.gemma3]\n" + GOOD.replace('["Gemma3ForCausalLM"]', "[]") + "prefixes = {}\n", "export.gemma3.architectures must be a non-empty list of class names"),
        ("[export.gemma3]\n" + GOOD + 'prefixes = { "model." = 1 }\n', 'export.gemma3.prefixes must be a table of "wrapper prefix" = "text-only prefix"'),
        ('export = "gemma3"\n', "[export] must be a table of model_type = { config, model_type, architectures, prefixes }"),
    ],
    ids=["good", "not-a-model-type", "derived-prefixes", "missing-field", "by-type-with-model-type", "by-type-empty", "by-type-not-a-list", "config", "architectures", "prefixes", "not-a-table"],
)  # fmt: skip
def test_the_export_table_is_checked_when_the_mapping_is_read(tmp_path, table, expected):
    path = tmp_path / "m.toml"
    path.write_text(TOP + table + PARAM)
    if expected is None:
        entry = port.load_mapping(path).export["gemma3"]
        if not entry.prefixes:  # left to port: derived from a checkpoint's keys (tests/test_wrappers.py)
            assert entry.key("language_model.model.norm.weight") == "language_model.model.norm.weight"
            return
        assert entry.key("language_model.model.norm.weight") == "model.norm.weight"
        assert entry.key("lm_head.weight") == "lm_head.weight"  # no prefix matches: as it is
        return
    with pytest.raises(port.MappingError) as info:
        port.load_mapping(path)
    assert str(info.value) == f"{path}: {expected}"


def test_two_keys_one_name_is_refused_before_writing(tmp_path):
    """A prefix table that would write two tensors under one name: a PlanError, nothing written."""
    from port._export import Inverse
    from port._export._safetensors import OutTensor

    tensors = tuple(OutTensor(k, (2,), np.dtype("float32")) for k in ("a.norm.weight", "b.norm.weight"))
    inverse = Inverse(tensors, {t.key: () for t in tensors}, {t.key: np.dtype("float32") for t in tensors})
    with pytest.raises(
        port.PlanError, match="'a.norm.weight' and 'b.norm.weight' would both be written as 'norm.weight'"
    ):
        inverse.renamed(lambda k: k.split(".", 1)[1], "m.toml")
