"""Issue 24 row 2: a failing `port verify` names the first module whose result differs from the reference's.

Each case breaks one thing on purpose (two mapping entries swapped, a layer's weights changed
after converting, a hard-coded epsilon in an author's module) and checks that exactly that
module and layer is named; a correct model, searched all the same, has nothing named.
"""

import json
import re

import numpy as np
import pytest

import port
from port.authoring._divergence import Suspect

from helpers import REPO, run_port, torch_gpt2, torch_llama, transformers_or_skip

SHIPPED = REPO / "mappings"
WALKTHROUGH = REPO / "examples" / "walkthrough"


def swapped(text: str, a: str, b: str) -> str:
    """A mapping's text with the paths `a` and `b` exchanged wherever they start a path."""
    return text.replace(f'path = "{a}', 'path = "\0').replace(f'path = "{b}', f'path = "{a}').replace("\0", b)


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """A small Llama checkpoint (norms perturbed: swapping them matters), and a mapping with the
    entries of its two norms swapped (`input_layernorm` fills `blocks.mlp_norm`, and back)."""
    transformers_or_skip()
    root = tmp_path_factory.mktemp("llama")
    torch_llama().save_pretrained(root / "checkpoint")
    text = (SHIPPED / "llama.toml").read_text()
    (root / "swapped.toml").write_text(swapped(text, "blocks.attn_norm", "blocks.mlp_norm"))
    return root


def test_swapped_norms_of_a_llama_are_named(llama):
    result = port.verify(llama / "checkpoint", "2x2", mapping=llama / "swapped.toml")
    assert result.max_abs_diff > result.tolerance
    found = result.first_divergence
    assert found.modules == (Suspect("model.layers.0.input_layernorm", "blocks.mlp_norm", 0),)
    assert found.observed == "the input of model.layers.0.self_attn"
    assert found.max_abs_diff > 0.1 and found.inputs_max_abs_diff < 1e-5  # the layer's input still agrees
    assert re.fullmatch(
        r"model\.layers\.0\.input_layernorm -> blocks\.mlp_norm \(layer 0\): max abs difference \S+ in the input "
        r"of model\.layers\.0\.self_attn \(its inputs agree to \S+\)",
        str(found),
    )


def test_a_search_beyond_memory_is_refused(llama, monkeypatch):
    """The search keeps each module's input and output: past the memory available it stops and says so."""
    import port.authoring._verify as verifying

    available = iter([None, None, 10_000])  # the labels and the run unchecked; the search given 10 KB
    monkeypatch.setattr(verifying, "available_host_bytes", lambda: next(available))
    with pytest.raises(port.PortError, match=r"^batch=2 and length=16: finding the first divergence .* 10.0 KB avail"):
        port.verify(llama / "checkpoint", "1x1", mapping=llama / "swapped.toml")


def test_a_correct_model_has_nothing_named_even_when_searched(llama):
    result = port.verify(llama / "checkpoint", "1x1", padding="left", locate=True)
    assert result.max_abs_diff <= result.tolerance and result.first_divergence is None
    with pytest.raises(port.PortError, match=r"^tolerance=-1: expected a number >= 0$"):
        port.verify(llama / "checkpoint", tolerance=-1)


def test_the_layer_named_is_the_one_that_differs(llama):
    """One layer's MLP changed after converting: the second layer of the scan is named, by its
    output (the MLP's input, and everything before, agrees)."""
    import equinox as eqx
    import jax
    import torch
    import transformers

    from port.authoring._divergence import first_divergence

    directory = llama / "checkpoint"
    with port.open_checkpoint(directory) as ckpt:
        mapping = port.mapping_for(ckpt.config)
        conversion = port.convert(ckpt, port.skeleton(mapping, ckpt.config), mapping, "1x1")
    model = eqx.tree_at(lambda m: m.blocks.mlp.down, conversion.model, conversion.model.blocks.mlp.down.at[1].mul(2))
    reference = transformers.AutoModelForCausalLM.from_pretrained(directory, attn_implementation="eager").eval()
    ids = np.random.default_rng(0).integers(0, 101, (2, 8))

    def call_reference():
        with torch.no_grad():
            return reference(torch.tensor(ids)).logits.numpy()

    theirs = call_reference()
    ours = np.asarray(eqx.filter_jit(lambda m, x: m(x))(model, ids))
    logits = (float(np.abs(ours - theirs).max()), float(np.abs(theirs).max()))
    with jax.default_matmul_precision("highest"):
        found = first_divergence(
            model, conversion.plan, mapping, reference, lambda m: eqx.filter_jit(lambda m, x: m(x))(m, ids),
            call_reference, logits, 1e-4,
        )  # fmt: skip
    assert found.modules == (Suspect("model.layers.1.mlp", "blocks.mlp", 1),)
    assert found.observed == "the output of model.layers.1.mlp"


def test_a_counterpart_in_the_wrong_place_is_not_compared(tmp_path):
    """GPT-2 with the entries of `ln_1` and `ln_2` swapped: the mapping pairs the reference's
    `h.0.ln_1` with port's `blocks.ln_2`, which runs after the attention; that pair is not
    compared, and `h.0.ln_1` is named by the attention's input that follows it."""
    torch_gpt2().save_pretrained(tmp_path / "checkpoint")
    text = (SHIPPED / "gpt2.toml").read_text()
    (tmp_path / "swapped.toml").write_text(swapped(text, "blocks.ln_1.", "blocks.ln_2."))
    found = port.verify(tmp_path / "checkpoint", "1x1", mapping=tmp_path / "swapped.toml").first_divergence
    assert found.modules == (Suspect("transformer.h.0.ln_1", "blocks.ln_2", 0),)
    assert found.observed == "the input of transformer.h.0.attn"


def test_an_authors_module_with_a_hard_coded_epsilon(tmp_path, monkeypatch):
    """The walkthrough's TinyLM (a family port does not ship), its Equinox module with the
    layers' epsilon written into the code rather than read from config.json: its first norm is named."""
    transformers_or_skip()
    import torch

    monkeypatch.syspath_prepend(str(WALKTHROUGH))
    monkeypatch.syspath_prepend(str(tmp_path))
    from torch_tinylm import CONFIG, TinyLM

    torch.manual_seed(0)
    TinyLM(CONFIG).save_pretrained(tmp_path / "checkpoint")
    module = (WALKTHROUGH / "tinylm.py").read_text()
    wrong = module.replace('config["num_heads"], config["layer_norm_eps"]', 'config["num_heads"], 1e-2')
    assert wrong != module
    (tmp_path / "tinylm_wrong_eps.py").write_text(wrong)
    mapping = (WALKTHROUGH / "tinylm.toml").read_text().replace('"tinylm:TinyLM"', '"tinylm_wrong_eps:TinyLM"')
    (tmp_path / "wrong_eps.toml").write_text(mapping)
    result = port.verify(tmp_path / "checkpoint", "1x1", mapping=tmp_path / "wrong_eps.toml")
    found = result.first_divergence
    assert result.max_abs_diff > result.tolerance
    assert found.modules == (Suspect("blocks.0.norm1", "blocks.norm1", 0),)
    assert found.observed == "the output of blocks.0.norm1" and found.inputs_max_abs_diff < 1e-5
    right = port.verify(tmp_path / "checkpoint", "1x1", mapping=WALKTHROUGH / "tinylm.toml", locate=True)
    assert right.first_divergence is None


@pytest.mark.slow
def test_port_verify_prints_and_reports_the_first_divergence(llama):
    checkpoint, mapping = llama / "checkpoint", llama / "swapped.toml"
    result = run_port("verify", checkpoint, "--mapping", mapping)
    assert result.returncode == 1, result.stdout + result.stderr
    verdict, named = result.stdout.strip().splitlines()
    assert ": FAILED (tolerance " in verdict and result.stderr == ""
    assert re.fullmatch(
        re.escape(f"{checkpoint}: first divergence: model.layers.0.input_layernorm -> blocks.mlp_norm (layer 0): ")
        + r"max abs difference \S+ in the input of model\.layers\.0\.self_attn \(its inputs agree to \S+\)",
        named,
    )
    as_json = run_port("verify", checkpoint, "--mapping", mapping, "--json")
    assert as_json.returncode == 1, as_json.stderr
    found = json.loads(as_json.stdout)["first_divergence"]
    assert found["modules"] == [{"module": "model.layers.0.input_layernorm", "path": "blocks.mlp_norm", "layer": 0}]
    assert found["observed"] == "the input of model.layers.0.self_attn" and found["max_abs_difference"] > 0.1
    assert found["inputs_max_abs_difference"] < 1e-5 and found["compared"] >= 1
