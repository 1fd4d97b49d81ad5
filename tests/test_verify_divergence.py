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
from port.authoring import Suspect

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
        r"of model\.layers\.0\.self_attn, \S+ of its max \|reference\| \S+ \(its inputs agree to \S+\)",
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
        + r"max abs difference \S+ in the input of model\.layers\.0\.self_attn, \S+ of its max \|reference\| \S+ "
        r"\(its inputs agree to \S+\)",
        named,
    )
    as_json = run_port("verify", checkpoint, "--mapping", mapping, "--json")
    assert as_json.returncode == 1, as_json.stderr
    found = json.loads(as_json.stdout)["first_divergence"]
    assert found["modules"] == [{"module": "model.layers.0.input_layernorm", "path": "blocks.mlp_norm", "layer": 0}]
    assert found["observed"] == "the input of model.layers.0.self_attn" and found["max_abs_difference"] > 0.1
    assert found["inputs_max_abs_difference"] < 1e-5 and found["compared"] >= 1
    assert found["relative_difference"] == found["max_abs_difference"] / found["max_abs_reference"]


# Issue 39 row 5: a difference judged against its own scale, and by how it grows.

OLMO2_AS_WRITTEN = '''"""OLMo 2 as an author might write it: `per_head`, the q/k norms over each head rather than the
whole projection; `wrong_eps`, the blocks' (post) norms with epsilon 1e-2."""
import dataclasses

import equinox as eqx
import jax
import jax.numpy as jnp

from port.models.llama import Llama
from port.nn import Attention, apply_rope


class PerHeadAttention(Attention):
    def project(self, x, cos, sin):
        def linear(w, b, norm):
            y = jnp.einsum("bte,hde->bthd", x, w) + (0 if b is None else b)
            return y if norm is None else norm * y * jax.lax.rsqrt(jnp.mean(y * y, -1, keepdims=True) + self.norm_eps)

        q, k = linear(self.wq, self.bq, self.q_norm), linear(self.wk, self.bk, self.k_norm)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), linear(self.wv, self.bv, None)


def _as(cls, module, **changed):
    copy = object.__new__(cls)
    for field in dataclasses.fields(module):
        object.__setattr__(copy, field.name, changed.get(field.name, getattr(module, field.name)))
    return copy


def per_head(config):
    model = Llama.from_config(config, key=jax.random.key(0))
    return eqx.tree_at(lambda m: m.blocks.attn, model, _as(PerHeadAttention, model.blocks.attn))


def wrong_eps(config):
    model = Llama.from_config(config, key=jax.random.key(0))
    return eqx.tree_at(lambda m: m.blocks, model, _as(type(model.blocks), model.blocks, eps=1e-2))
'''


@pytest.fixture(scope="module")
def olmo2(tmp_path_factory):
    """A small OLMo 2 checkpoint with transformers' default init (std 0.02: the attention's output
    is of size 1e-3, its post-norm's of size 1), norms perturbed; the module file above, and a
    mapping for each of its builders."""
    transformers_or_skip()
    root = tmp_path_factory.mktemp("olmo2")
    torch_llama("Olmo2", initializer_range=0.02).save_pretrained(root / "checkpoint")
    (root / "olmo2_as_written.py").write_text(OLMO2_AS_WRITTEN)
    text = (SHIPPED / "olmo2.toml").read_text()
    for builder in ("per_head", "wrong_eps"):
        written = text.replace('"port.models.llama:Llama"', f'"olmo2_as_written:{builder}"')
        assert written != text
        (root / f"{builder}.toml").write_text(written)
    return root


def test_a_per_head_qk_norm_is_named_not_the_post_norm_that_scales_it_up(olmo2, monkeypatch):
    """The case an author hit: the attention's output differs by 3.8e-05, under the tolerance
    next to 1 but 3% of its own size; OLMo 2's post-norm scales it to size 1. Judged against
    its own scale, the attention is named, not `post_attention_layernorm`."""
    monkeypatch.syspath_prepend(str(olmo2))
    result = port.verify(olmo2 / "checkpoint", "1x1", mapping=olmo2 / "per_head.toml")
    found = result.first_divergence
    assert result.max_abs_diff > result.tolerance
    assert found.modules == (Suspect("model.layers.0.self_attn", "blocks.attn", 0),)
    assert found.observed == "the output of model.layers.0.self_attn" and found.inputs_max_abs_diff == 0
    assert found.max_abs_diff < 1e-4 < 1e-2 < found.relative_diff  # under the tolerance, not under its own scale
    assert found.max_abs_diff / found.max_abs_reference == found.relative_diff
    assert f", {found.relative_diff:.2g} of its max |reference| {found.max_abs_reference:.3g} (" in str(found)


def test_a_wrong_epsilon_of_the_post_norm_is_still_named(olmo2, monkeypatch):
    """The fault genuinely in OLMo 2's post-norm (its epsilon, 1e-2 on an attention output of
    mean square 1e-6): the attention agrees, and the norm after it is named."""
    monkeypatch.syspath_prepend(str(olmo2))
    found = port.verify(olmo2 / "checkpoint", "1x1", mapping=olmo2 / "wrong_eps.toml").first_divergence
    assert found.modules == (Suspect("model.layers.0.post_attention_layernorm", "blocks.post_attn_norm", 0),)
    assert found.observed == "the input of model.layers.0.mlp" and found.inputs_max_abs_diff < 1e-9
    right = port.verify(olmo2 / "checkpoint", "1x1", locate=True)
    assert right.max_abs_diff <= right.tolerance and right.first_divergence is None


def test_a_difference_under_the_tolerance_that_grows_is_named_where_it_started(tmp_path):
    """Layer 0's output projection off by a relative 3e-05 (noise), searched with a bound of
    4e-05: under it at every module of layer 0, the difference grows through layer 1 beyond it.
    Where it started, an order of magnitude up from nothing, is named: layer 0's attention, not
    the layer 1 module where it first shows."""
    import equinox as eqx
    import jax
    import torch
    import transformers

    from port.authoring._divergence import first_divergence

    directory = tmp_path / "checkpoint"
    torch_llama("Olmo2").save_pretrained(directory)  # std 0.2: the layers amplify a difference
    with port.open_checkpoint(directory) as ckpt:
        mapping = port.mapping_for(ckpt.config)
        conversion = port.convert(ckpt, port.skeleton(mapping, ckpt.config), mapping, "1x1")
    wo = conversion.model.blocks.attn.wo
    noise = 1 + 3e-5 * jax.random.normal(jax.random.key(1), wo.shape[1:])
    model = eqx.tree_at(lambda m: m.blocks.attn.wo, conversion.model, wo.at[0].mul(noise))
    reference = transformers.AutoModelForCausalLM.from_pretrained(directory, attn_implementation="eager").eval()
    ids = np.random.default_rng(0).integers(0, 101, (2, 8))

    def call_reference():
        with torch.no_grad():
            return reference(torch.tensor(ids)).logits.numpy()

    def call_model(m):
        return np.asarray(eqx.filter_jit(lambda m, x: m(x))(m, ids))

    with jax.default_matmul_precision("highest"):
        theirs, ours = call_reference(), call_model(model)
        logits = (float(np.abs(ours - theirs).max()), float(np.abs(theirs).max()))
        found = first_divergence(model, conversion.plan, mapping, reference, call_model, call_reference, logits, 4e-5)
    assert found.modules == (Suspect("model.layers.0.self_attn", "blocks.attn", 0),)
    assert found.observed == "the output of model.layers.0.self_attn" and found.inputs_max_abs_diff == 0
    assert 1e-5 < found.relative_diff < 4e-5  # under the bound where it started
