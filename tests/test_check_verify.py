"""`port check` lists every problem with its entry; `port verify` compares with PyTorch."""

import port
from conftest import VOCAB, cli as run, run_port

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


def test_verify_reports_the_difference(gpt2_checkpoints):
    directories, _ = gpt2_checkpoints
    code, output = run("verify", directories["sharded"], "--mesh", "4x2")
    assert code == 0, output
    assert f"vs GPT2LMHeadModel.logits (float32 [2, 16, {VOCAB}]" in output and ": ok (tolerance" in output
    difference = float(output.split("max abs difference ")[1].split()[0])
    assert difference < 1e-4


def test_verify_fails_beyond_the_tolerance(gpt2_checkpoints):
    directories, _ = gpt2_checkpoints
    code, output = run("verify", directories["lm"], "--tolerance", "1e-12")
    assert code == 1 and "FAILED" in output


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
