"""`port check` lists every problem with its entry; `port verify` compares with PyTorch."""

import pytest

import port

from helpers import VOCAB, run_port
from helpers import cli as run

GPT2 = (port._mapping.shipped_mappings()[0].parent / "gpt2.toml").read_text()


def test_check_passes_the_shipped_mapping(gpt2_checkpoints):
    directories, _ = gpt2_checkpoints
    code, output = run("check", port._mapping.shipped_mappings()[0].parent / "gpt2.toml", directories["lm"])
    assert code == 0 and ": ok: 20 leaves" in output


def test_check_lists_every_problem_with_its_entry(gpt2_checkpoints, tmp_path):
    directories, _ = gpt2_checkpoints
    broken = (
        GPT2.replace('path = "wpe"', 'path = "wpe_typo"')  # unknown module path
        .replace('key = "ln_f.bias"', 'key = "ln_final.bias"')  # pattern matching nothing
        .replace('transforms = [{ reshape = ["n_head", -1, "n_embd"] }]', "transforms = []")
    )
    mapping = tmp_path / "broken.toml"
    mapping.write_text(broken)
    code, output = run("check", mapping, directories["lm"])
    assert code == 1
    lines = output.strip().splitlines()
    expected = [
        f"{mapping}: entry 'wpe.weight': path 'wpe_typo' is not a leaf of port.models.gpt2:GPT2",
        f"{mapping}: entry 'h.{{layer}}.attn.c_proj.weight': shape mismatch: 2 layers of "
        "'transformer.h.0.attn.c_proj.weight' is [64, 64] but 'blocks.attn.wo' is [2, 4, 16, 64]",
        f"{mapping}: entry 'ln_final.bias': missing tensor: no key in the checkpoint matches",
        f"{mapping}: leaf 'wpe' of port.models.gpt2:GPT2 has no mapping entry",
        f"model.safetensors: tensor 'transformer.ln_f.bias' is not used by the mapping {mapping} "
        "(map it, or add it to ignore)",
        f"model.safetensors: tensor 'transformer.wpe.weight' is not used by the mapping {mapping} "
        "(map it, or add it to ignore)",
        f"port: error: {mapping}: 6 problems with {directories['lm']}",
    ]
    assert lines == expected
    # the no-rule problem: the wpe entry already fails on its path, so break a valid one instead
    mapping.write_text(GPT2.replace('axes = ["positions", "embed"]', 'axes = ["positionz", "embed"]'))
    code, output = run("check", mapping, directories["lm"])
    assert code == 1 and "entry 'wpe.weight': logical axis 'positionz' has no rule in [rules]" in output
    assert output.strip().splitlines()[-1].endswith("1 problem with " + str(directories["lm"]))


def test_check_returns_the_plan_for_any_form_of_mesh(gpt2_checkpoints):
    directories, _ = gpt2_checkpoints
    shipped = port._mapping.shipped_mappings()[0].parent / "gpt2.toml"
    with port.open_checkpoint(directories["sharded"]) as ckpt:  # an opened checkpoint: used, not read
        recipe = port.check(shipped, ckpt, mesh="4x2")
        assert ckpt.bytes_read == 0
    assert isinstance(recipe, port.Plan) and len(recipe.leaves) == 20
    assert recipe.mesh_shape == {"data": 4, "model": 2}
    specs = [leaf.spec for leaf in recipe.leaves]
    parsed = port.load_mapping(shipped)
    for mesh in ("data=4,model=2", {"data": 4, "model": 2}, port.make_mesh("4x2")):
        again = port.check(parsed, directories["sharded"], mesh)
        assert [leaf.spec for leaf in again.leaves] == specs and again.mesh_shape == recipe.mesh_shape
    assert port.check(shipped, directories["lm"]).mesh_shape == {"data": 1, "model": 1}  # default: 1x1
    for bad in ("4y2", {"data": 0}, {"data": "2"}, 8):
        with pytest.raises(port.PortError, match="mesh"):
            port.check(shipped, directories["lm"], bad)


def test_check_raises_every_problem(gpt2_checkpoints, tmp_path):
    directories, _ = gpt2_checkpoints
    mapping = tmp_path / "broken.toml"
    mapping.write_text(GPT2.replace('path = "wpe"', 'path = "wpe_typo"').replace("embed = ", "embedz = "))
    with pytest.raises(port.PlanError) as caught:
        port.check(mapping, directories["lm"], "data=2,model=2")
    problems = caught.value.problems
    assert problems[0] == f"{mapping}: entry 'wte.weight': logical axis 'embed' has no rule in [rules]"
    assert f"{mapping}: entry 'wpe.weight': path 'wpe_typo' is not a leaf of port.models.gpt2:GPT2" in problems
    assert f"{mapping}: leaf 'wpe' of port.models.gpt2:GPT2 has no mapping entry" in problems
    assert (
        str(caught.value) == f"{problems[0]} (and {len(problems) - 1} more problem{'s' if len(problems) > 2 else ''})"
    )
    with pytest.raises(port.PlanError, match=r"rules.vocab names mesh axis 'model', which the mesh \(x, y\)"):
        port.check(port._mapping.shipped_mappings()[0].parent / "gpt2.toml", directories["lm"], {"x": 1, "y": 1})


def test_verify_reports_the_difference(gpt2_checkpoints):
    directories, _ = gpt2_checkpoints
    code, output = run("verify", directories["sharded"], "--mesh", "4x2")
    assert code == 0, output
    assert f"vs GPT2LMHeadModel.logits (float32 [2, 16, {VOCAB}]" in output and ": ok (tolerance" in output
    difference = float(output.split("max abs difference ")[1].split()[0])
    assert difference < 1e-4


@pytest.mark.slow
def test_verify_without_pytorch_says_how_to_install(gpt2_checkpoints, tmp_path):
    directories, _ = gpt2_checkpoints
    hidden = tmp_path / "no-torch"
    (hidden / "torch").mkdir(parents=True)  # first on the path: `import torch` raises ImportError
    (hidden / "torch" / "__init__.py").write_text("raise ImportError('no torch in this test')\n")
    result = run_port("verify", directories["lm"], env={"PYTHONPATH": str(hidden)})
    assert result.returncode == 1
    assert result.stderr.strip().splitlines() == [
        "port: error: port verify needs PyTorch and transformers: pip install torch --index-url "
        "https://download.pytorch.org/whl/cpu && pip install transformers"
    ]


QK_MODULE = '''
import equinox as eqx
import jax.numpy as jnp


class QK(eqx.Module):
    """Keeps q and k of a fused qkv, and drops v: it cannot be written back."""

    q: jnp.ndarray
    k: jnp.ndarray

    @classmethod
    def from_config(cls, config, *, key):
        return cls(jnp.zeros((4, 4)), jnp.zeros((4, 4)))
'''

QK_MAPPING = """
model = "qkmodel:QK"
model_types = ["qk"]

[rules]
embed = []
heads = "model"

[[params]]
key = "qkv"
path = "q"
axes = ["embed", "heads"]
transforms = [{ split = { axis = 1, parts = 3, index = 0 } }]

[[params]]
key = "qkv"
path = "k"
axes = ["embed", "heads"]
transforms = [{ split = { axis = 1, parts = 3, index = 1 } }]
"""


@pytest.mark.slow
def test_check_names_the_entry_that_cannot_be_walked_back(tmp_path):
    import numpy as np

    from helpers import write_checkpoint

    (tmp_path / "qkmodel.py").write_text(QK_MODULE)
    (tmp_path / "qk.toml").write_text(QK_MAPPING)
    write_checkpoint(tmp_path / "ckpt", {"qkv": np.zeros((4, 12), np.float32)}, {"model_type": "qk"})
    result = run_port("check", "qk.toml", "ckpt", "--module", "qkmodel:QK", cwd=tmp_path)
    assert result.returncode == 1, result.stdout + result.stderr
    assert result.stdout.strip().splitlines() == [
        "qk.toml: entry 'qkv': the fused tensor 'qkv' has 3 parts but the entries keep only [0, 1]; "
        "without part [2] it cannot be written back"
    ]
    assert result.stderr.strip() == "port: error: qk.toml: 1 problem with ckpt"


def test_a_round_trip_names_the_tensors_that_differ(tmp_path):
    """`verify(roundtrip=True)`'s comparison: a model whose leaf was changed after converting
    exports that tensor otherwise, and the round trip names it (and only it, for each layer)."""
    from pathlib import Path

    import equinox as eqx

    from port.authoring._verify import _roundtrip

    example = Path(__file__).resolve().parents[1] / "examples" / "tiny-gpt2"
    with port.open_checkpoint(example) as ckpt:
        mapping = port.mapping_for(ckpt.config)
        model = port.load(ckpt, mesh="1x1")
        exact = _roundtrip(model, ckpt, mapping)
        changed = _roundtrip(eqx.tree_at(lambda m: m.ln_f.weight, model, model.ln_f.weight + 1), ckpt, mapping)
    assert exact.exact and exact.same == len(ckpt.tensors) and exact.not_written == ()
    assert not changed.exact and changed.differing == ("transformer.ln_f.weight",) and changed.same == exact.same - 1


def test_verify_draws_every_input_a_call_takes_without_a_default():
    """Besides its first input, verify gives both models each input the module's call cannot do
    without: an encoder-decoder's decoder ids, a dual model's images; Whisper's features have the
    one length its encoder takes; a dual model's images are its vision config's size."""
    from port.authoring._verify import also_taken, draw

    class Seq2Seq:
        def __call__(self, input_ids, decoder_input_ids, *, attention_mask=None, decoder_attention_mask=None): ...

    class Dual:
        def __call__(self, input_ids, pixel_values, attention_mask=None): ...

    assert also_taken(Seq2Seq.__call__, "input_ids") == ["decoder_input_ids"]
    assert also_taken(Dual.__call__, "input_ids") == ["pixel_values"]
    whisper = {"num_mel_bins": 8, "max_source_positions": 16, "vocab_size": 50, "max_target_positions": 6}
    assert draw("input_features", whisper, 2, 16).shape == (2, 8, 32)
    ids = draw("decoder_input_ids", whisper, 2, 16)
    assert ids.shape == (2, 6) and ids.max() < 50
    dual = {"text_config": {"vocab_size": 30}, "vision_config": {"image_size": 12, "num_channels": 3}}
    assert draw("pixel_values", dual, 2, 16).shape == (2, 3, 12, 12)
    assert draw("input_ids", dual, 2, 5).shape == (2, 5)
    with pytest.raises(port.PortError, match=r"config.json: 'num_mel_bins' must be a positive integer"):
        draw("input_features", {"max_source_positions": 4}, 2, 16)
