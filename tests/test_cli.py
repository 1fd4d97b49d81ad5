"""The `port` command line, run as a user runs it: the `port` entry point in a subprocess.

Bad input must end with one line on stderr (`port: error: ...`) naming the file,
key or flag and the problem, exit status 1, no traceback, and no output
directory (nor the hidden temporary sibling the converter writes first).
"""

import json
import os
from pathlib import Path

import pytest

from helpers import one_line, run_port, script_module

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "tiny-gpt2"
GPT2_MAPPING = REPO / "mappings" / "gpt2.toml"

TINY = script_module(REPO / "examples" / "make_tiny_gpt2.py")


def run_cli(*args, env=None, cwd=None):
    """The real `port` entry point in a subprocess, offline, without this process's device settings."""
    return run_port(*args, env=env, cwd=cwd, timeout=120)


def convert_fails(model, tmp_path, *substrings, extra=(), env=None):
    out = tmp_path / "out"
    result = run_cli("convert", model, "--mesh", "4x2", "--out", out, *extra, env=env)
    one_line(result, *substrings, out=out)
    return result


# ---------------------------------------------------------------- bad input


@pytest.mark.slow
def test_missing_tensor(tiny, tmp_path):
    model = tiny(drop={"transformer.h.1.mlp.c_fc.weight"})
    convert_fails(model, tmp_path, "h.1.mlp.c_fc.weight", "missing")


@pytest.mark.slow
def test_extra_tensor(tiny, tmp_path):
    import numpy as np

    model = tiny(add={"transformer.h.0.attn.extra.weight": np.zeros((2, 2), np.float32)})
    convert_fails(model, tmp_path, "transformer.h.0.attn.extra.weight", "not used")


@pytest.mark.slow
def test_shape_mismatch(tiny, tmp_path):
    import numpy as np

    wpe = np.zeros((TINY.CONFIG["n_positions"] + 1, TINY.CONFIG["n_embd"]), np.float32)
    model = tiny(add={"transformer.wpe.weight": wpe})
    convert_fails(model, tmp_path, "shape mismatch", "transformer.wpe.weight", "[65, 64]")


@pytest.mark.slow
def test_truncated_safetensors(tiny, tmp_path):
    model = tiny()
    path = model / "model.safetensors"
    os.truncate(path, path.stat().st_size - 100)
    convert_fails(model, tmp_path, "model.safetensors", "truncated")


@pytest.mark.slow
def test_corrupt_header(tiny, tmp_path):
    model = tiny()
    with open(model / "model.safetensors", "r+b") as f:
        f.seek(8)
        f.write(b"not json")
    convert_fails(model, tmp_path, "model.safetensors", "corrupt header")


@pytest.mark.slow
def test_unknown_model_type(tiny, tmp_path):
    model = tiny(config={"model_type": "not-a-model"})
    convert_fails(model, tmp_path, "model_type", "not-a-model")


@pytest.mark.slow
def test_invalid_toml_mapping(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text('model = "port.models.gpt2:GPT2"\n[[params]\nkey = \n')
    convert_fails(EXAMPLE, tmp_path, "bad.toml", "invalid TOML", extra=("--mapping", bad))


@pytest.mark.slow
def test_unknown_transform_in_mapping(tmp_path):
    text = GPT2_MAPPING.read_text()
    old = '{ reshape = ["n_head", -1, "n_embd"] }'
    assert old in text
    bad = tmp_path / "rotating.toml"
    bad.write_text(text.replace(old, "{ rotate = 1 }"))
    convert_fails(EXAMPLE, tmp_path, "rotating.toml", "rotate", "unknown transform", extra=("--mapping", bad))


@pytest.mark.slow
def test_mesh_needs_more_devices(tmp_path):
    env = {"XLA_FLAGS": "--xla_force_host_platform_device_count=4"}
    convert_fails(EXAMPLE, tmp_path, "--mesh 4x2", "needs 8 devices", env=env)


@pytest.mark.slow
def test_malformed_mesh(tmp_path):
    out = tmp_path / "out"
    result = run_cli("convert", EXAMPLE, "--mesh", "4xq", "--out", out)
    one_line(result, "--mesh", "4xq", out=out)


@pytest.mark.slow
def test_no_such_directory(tmp_path):
    convert_fails("/nonexistent/dir", tmp_path, "/nonexistent/dir", "no such directory")


@pytest.mark.slow
def test_repo_id_not_cached_offline(tmp_path):
    env = {"HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf-home")}
    convert_fails("nobody/no-such-model", tmp_path, "nobody/no-such-model", "Hugging Face cache", env=env)


# ---------------------------------------------------------------- success


def test_plan_never_reads_a_tensor(gpt2_checkpoints, monkeypatch, capsys):
    """Tensor bytes are only ever read through Checkpoint.read_into (preadv); `port plan` must never call it."""
    import port._cli
    import port._source

    def no_reads(*args):
        raise AssertionError("port plan read tensor data")

    monkeypatch.setattr(port._source.Checkpoint, "read_into", no_reads)
    monkeypatch.setattr(port._source, "_preadv", no_reads)
    directories, _ = gpt2_checkpoints
    assert port._cli.run(["plan", str(directories["sharded"]), "--mesh", "4x2"]) == 0
    printed = capsys.readouterr().out
    assert "blocks.attn.wq" in printed
    index = json.loads((directories["sharded"] / "model.safetensors.index.json").read_text())
    if "lm_head.weight" in index["weight_map"]:
        assert "tied: lm_head.weight" in printed
    else:  # transformers does not save a tied lm_head
        assert "tied:" not in printed
