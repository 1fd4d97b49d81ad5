"""`scaffold` drafts the optional entries a family's variants need, not only the variant in front of it.

A module's leaves annotated `X | None` (Llama's attention biases, an untied `lm_head`) that
this checkpoint's config.json leaves None get `optional = "model"` entries, their keys
guessed from their weights' (a bias) or their paths (a head): scaffolded from a tied Qwen3
without biases, they are the shipped `qwen3.toml`'s, and the draft loads the checkpoint.
"""

from pathlib import Path

import numpy as np
import pytest

import port
from port.authoring import scaffold

from helpers import logits, run_port, saved_once, torch_llama

ROOT = Path(__file__).resolve().parents[1]
QWEN3 = dict(num_attention_heads=6, num_key_value_heads=2, head_dim=12, tie_word_embeddings=True)
OPTIONAL = ("blocks.attn.bq", "blocks.attn.bk", "blocks.attn.bv", "blocks.attn.bo", "lm_head")
IDS = np.random.default_rng(0).integers(0, 101, (2, 9))


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    """A tied Qwen3 without attention biases, written by save_pretrained, and its logits."""
    return saved_once(tmp_path_factory, lambda _: torch_llama("Qwen3", **QWEN3), IDS)("tied")


def params_by_path(mapping) -> dict:
    return {p.path: p for p in mapping.params}


def test_a_qwen3_without_biases_gets_the_shipped_optional_entries(qwen3, tmp_path):
    directory, _, expected = qwen3
    text = scaffold(directory, None, "port.models.llama:Llama")
    assert "5 optional, for leaves this config.json leaves None" in text
    assert "# CHECK: optional: blocks.attn.bq is None with this config.json; its key guessed from its weight's" in text
    drafted = params_by_path(port.parse_mapping(text, "draft.toml"))
    shipped = params_by_path(port.load_mapping(ROOT / "mappings" / "qwen3.toml"))
    optional = {path for path, p in drafted.items() if p.optional}
    assert optional == set(OPTIONAL)
    for path in OPTIONAL:
        assert drafted[path] == shipped[path], path
    draft = tmp_path / "draft.toml"
    draft.write_text(text)
    model = port.load(directory, mapping=draft)
    assert model.blocks.attn.bq is None and model.lm_head is None
    assert np.abs(np.asarray(logits(model, IDS)) - expected).max() <= 1e-4


def test_a_qwen2_gets_the_o_proj_bias_it_lacks(tmp_path):
    """Qwen2 has q/k/v biases and no o_proj bias: the draft has llama.toml's entry for it."""
    torch_llama("Qwen2").save_pretrained(tmp_path / "qwen2")
    text = scaffold(tmp_path / "qwen2", None, "port.models.llama:Llama")
    assert "(and 1 optional, for leaves this config.json leaves None)" in text
    drafted = params_by_path(port.parse_mapping(text, "draft.toml"))
    shipped = params_by_path(port.load_mapping(ROOT / "mappings" / "llama.toml"))
    assert {path for path, p in drafted.items() if p.optional} == {"blocks.attn.bo"}
    assert drafted["blocks.attn.bo"] == shipped["blocks.attn.bo"]
    assert drafted["blocks.attn.bq"].key == shipped["blocks.attn.bq"].key


@pytest.mark.slow
def test_port_scaffold_writes_the_optional_entries(qwen3, tmp_path):
    directory, *_ = qwen3
    out = tmp_path / "draft.toml"
    result = run_port("scaffold", directory, "--module", "port.models.llama:Llama", "--out", out)
    assert result.returncode == 0, result.stderr
    text = out.read_text()
    assert text.count('optional = "model"') == len(OPTIONAL)
    assert 'key = "layers.{layer}.self_attn.o_proj.bias"\npath = "blocks.attn.bo"\noptional = "model"' in text
    assert 'key = "lm_head.weight"\npath = "lm_head"\noptional = "model"' in text
