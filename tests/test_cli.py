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
    import port._sources._local

    def no_reads(*args):
        raise AssertionError("port plan read tensor data")

    monkeypatch.setattr(port._sources._local.LocalCheckpoint, "read_into", no_reads)
    monkeypatch.setattr(port._sources._local, "_preadv", no_reads)
    directories, _ = gpt2_checkpoints
    assert port._cli.run(["plan", str(directories["sharded"]), "--mesh", "4x2"]) == 0
    printed = capsys.readouterr().out
    assert "blocks.attn.wq" in printed
    index = json.loads((directories["sharded"] / "model.safetensors.index.json").read_text())
    if "lm_head.weight" in index["weight_map"]:
        assert "tied: lm_head.weight" in printed
    else:  # transformers does not save a tied lm_head
        assert "tied:" not in printed


# ---------------------------------------------------------------- the library's parameters, as flags


@pytest.mark.parametrize(
    "message, shown",
    [
        ("mesh='2x3': expected DATAxMODEL", "--mesh '2x3': expected DATAxMODEL"),  # at the start
        (
            "out=/tmp/x: needs 3.1 GB, only 1.0 GB free on its file system",
            "--out /tmp/x: needs 3.1 GB, only 1.0 GB free on its file system",
        ),
        (
            "start every process with the same coordinator= and num_processes=2, process_id=0 to 1",  # mid-sentence
            "start every process with the same --coordinator and --num-processes 2, --process-id 0 to 1",
        ),
        ("no coordinator answered within 3 s (timeout=3)", "no coordinator answered within 3 s (--timeout 3)"),
        ("waiting up to 5 s (timeout=) for process 0 to end", "waiting up to 5 s (--timeout) for process 0 to end"),
        (
            "processes disagree on dtype=: process 0 has no dtype=, process 1 has bfloat16",
            "processes disagree on --dtype: process 0 has no --dtype, process 1 has bfloat16",
        ),
        ("give one with mapping=", "give one with --mapping"),
        ("max_shard_size='5XB': expected", "--max-shard-size '5XB': expected"),
        ("processes disagree on checkpoint=: ...", "processes disagree on MODEL: ..."),
        # quoted (untrusted) text is left alone, in either quotes, with escaped quotes inside
        ("tensor 'h.0.mesh=1' is not used", "tensor 'h.0.mesh=1' is not used"),
        ('tensor "it\'s mesh=1" is not used; mesh=2', 'tensor "it\'s mesh=1" is not used; --mesh 2'),
        ("key 'a\\' mesh=1' and out=x", "key 'a\\' mesh=1' and --out x"),
        # an apostrophe is no quote: what follows it is still translated
        (
            "the coordinator's port; choose another coordinator= port",
            "the coordinator's port; choose another --coordinator port",
        ),
        # only at a word start, and only port's own parameters
        ("mesh=data=4,model=2: its blocks take", "--mesh data=4,model=2: its blocks take"),
        ("expected named axes such as data=2,expert=2,model=2", "expected named axes such as data=2,expert=2,model=2"),
        ("/tmp/mesh=2/out=3 and strict=False", "/tmp/mesh=2/out=3 and strict=False"),
        ("--out /tmp/x: already exists (use --force)", "--out /tmp/x: already exists (use --force)"),
    ],
)
def test_library_messages_name_flags_on_the_command_line(message, shown):
    from port._flags import with_flags

    assert with_flags(message) == shown


def test_the_runtimes_messages_read_on_the_command_line_as_they_always_did():
    """The library names parameters; what `port` prints is the text its flags always gave."""
    from port._flags import with_flags
    from port._runtime import _MISSING, _disagreement, _not_joined

    assert with_flags(_not_joined("127.0.0.1:9", 2, 0, 5)) == (
        "--coordinator 127.0.0.1:9: not all 2 processes joined within 5 s (--timeout 5); start every process "
        "with the same --coordinator and --num-processes 2, --process-id 0 to 1"
    )
    assert with_flags(_disagreement("force", {0: True, 1: False, 2: True})) == (
        "processes disagree on --force: processes 0, 2 have --force, process 1 has no --force"
    )
    assert with_flags(_disagreement("mapping", {0: "gpt2.toml", 1: _MISSING})) == (
        "processes disagree on --mapping: process 0 has gpt2.toml, process 1 has no --mapping"
    )
    assert with_flags(_disagreement("mesh", {0: "data=4,model=2", 1: "data=2,model=4"})) == (
        "processes disagree on --mesh: process 0 has data=4,model=2, process 1 has data=2,model=4"
    )
