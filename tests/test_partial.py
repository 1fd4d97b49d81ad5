"""Partial loads: `include` (some leaves), `layers` (a range of stacked layers), `strict=False` (a model of your own)."""

import json
import math

import jax
import numpy as np
import pytest

import port
from port._skeleton import leaves

from helpers import (
    INPUT_IDS,
    logits,
    read_offsets,
    recorded_reads,
    run_port,
    torch_llama,
    torch_logits,
    write_checkpoint,
)


def nbytes(info):
    return math.prod(info.shape) * info.dtype.itemsize


def key_bytes(directory, wanted):
    """Bytes of the checkpoint's tensors whose keys `wanted` accepts."""
    with port.open_checkpoint(directory) as ckpt:
        return sum(nbytes(info) for key, info in ckpt.tensors.items() if wanted(key))


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    model = torch_llama()
    directory = tmp_path_factory.mktemp("llama") / "ckpt"
    model.save_pretrained(directory)
    return directory, model


def test_load_include_reads_only_the_included_leaves(gpt2_checkpoints):
    directories, _ = gpt2_checkpoints
    full = port.load(directories["lm"], mesh="2x2")
    with recorded_reads() as calls:
        run = port.convert(directories["lm"], mesh="2x2", include=["wte", "blocks.attn.*"])
    model = run.model
    assert model.wpe is None and model.ln_f.weight is None and model.blocks.mlp.w_fc is None
    for path in ("wte", "blocks.attn.wq", "blocks.attn.bo"):
        ours, theirs = leaves(model)[path], leaves(full)[path]
        assert ours.sharding == theirs.sharding
        np.testing.assert_array_equal(np.asarray(ours), np.asarray(theirs))
    expected = key_bytes(directories["lm"], lambda k: k.endswith("wte.weight") or (".attn.c_" in k))
    files, _ = read_offsets(calls)
    assert run.report.bytes_read == run.plan.read_bytes == expected == len(files)
    assert set(run.plan.excluded) == set(leaves(full)) - {p.path for p in run.plan.leaves}
    # a dotted prefix, and a load through the short form
    blocks = port.load(directories["lm"], include=["blocks"])
    assert blocks.wte is None and blocks.blocks.ln_2.bias is not None
    with pytest.raises(port.PortError, match=r"^include 'blocks.atn': matches no leaf of port.models.gpt2:GPT2"):
        port.load(directories["lm"], include=["wte", "blocks.atn"])


def test_restore_include(llama_dir, tmp_path):
    directory, _ = llama_dir
    run = port.convert(directory, mesh="2x2", out=tmp_path / "out")
    model = port.restore(tmp_path / "out", "4x2", include=["embed", "blocks.mlp"])
    assert model.lm_head is None and model.norm is None and model.blocks.attn.wq is None
    for path in ("embed", "blocks.mlp.gate", "blocks.mlp.down"):
        np.testing.assert_array_equal(np.asarray(leaves(model)[path]), np.asarray(leaves(run.model)[path]))
    assert dict(model.embed.sharding.mesh.shape) == {"data": 4, "model": 2}
    with pytest.raises(port.PortError, match="include 'head': matches no leaf of the output"):
        port.restore(tmp_path / "out", include=["head"])


@pytest.mark.slow
def test_cli_convert_include_restores_with_the_rest_none(gpt2_checkpoints, tmp_path):
    directories, _ = gpt2_checkpoints
    out = tmp_path / "out"
    result = run_port("convert", directories["lm"], "--mesh", "2x2", "--out", out, "--include", "wte,blocks")
    assert result.returncode == 0, result.stderr
    assert json.loads((out / "port" / "metadata").read_text())["include"] == ["wte", "blocks"]
    full = port.load(directories["lm"])
    model = port.restore(out, "2x2")
    assert model.wpe is None and model.ln_f.weight is None and model.ln_f.bias is None
    np.testing.assert_array_equal(np.asarray(model.blocks.mlp.w_fc), np.asarray(full.blocks.mlp.w_fc))
    np.testing.assert_array_equal(np.asarray(model.wte), np.asarray(full.wte))
    mlp = port.restore(out, include=["blocks.mlp"])
    assert mlp.wte is None and mlp.blocks.attn.wq is None and mlp.blocks.mlp.b_proj is not None
    with pytest.raises(port.PortError, match="include 'wpe': matches no leaf of the output"):
        port.restore(out, include=["wpe"])
    bad = run_port("convert", directories["lm"], "--out", tmp_path / "bad", "--include", "wte,nothing")
    assert bad.returncode == 1 and "include 'nothing': matches no leaf" in bad.stderr
    assert not (tmp_path / "bad").exists()
    # An export writes the whole checkpoint: a partial output is refused in one line, nothing written.
    exported = run_port("export", out, "--out", tmp_path / "hf")
    assert exported.returncode == 1 and "Traceback" not in exported.stderr, exported.stderr
    assert exported.stderr.strip().splitlines() == [exported.stderr.strip()]
    assert "model leaf 'ln_f.bias' is None (a partial load" in exported.stderr  # the first, sorted
    assert not (tmp_path / "hf").exists()


@pytest.mark.slow
def test_cli_convert_layers_writes_a_model_of_those_layers(gpt2_checkpoints, tmp_path):
    """`port convert --layers 1:2`: the output holds layer 1 as layer 0, its config says 1 layer;
    a bad range is one line naming the flag, nothing written."""
    directories, _ = gpt2_checkpoints
    out = tmp_path / "out"
    result = run_port("convert", directories["lm"], "--mesh", "2x2", "--out", out, "--layers", "1:2")
    assert result.returncode == 0, result.stderr
    assert json.loads((out / "port" / "metadata").read_text())["config"]["n_layer"] == 1
    model, full = port.restore(out, "2x2"), port.load(directories["lm"])
    assert model.blocks.mlp.w_fc.shape[0] == 1
    np.testing.assert_array_equal(np.asarray(model.blocks.mlp.w_fc[0]), np.asarray(full.blocks.mlp.w_fc[1]))
    np.testing.assert_array_equal(np.asarray(model.wte), np.asarray(full.wte))
    layers = full.blocks.mlp.w_fc.shape[0]
    for flag, expected in [
        ("3", "--layers '3': expected START:STOP"),
        ("2:1", "--layers '2:1': expected START:STOP"),
        (f"0:{layers + 5}", f"--layers 0:{layers + 5}: outside the checkpoint's {layers} layers"),
    ]:
        bad = run_port("convert", directories["lm"], "--out", tmp_path / "bad", "--layers", flag)
        assert bad.returncode == 1 and "Traceback" not in bad.stderr, bad.stderr
        lines = bad.stderr.strip().splitlines()
        assert lines[-1].startswith("port: error: ") and expected in lines[-1], bad.stderr
        assert all(line.startswith("port: ") for line in lines), bad.stderr
        assert not (tmp_path / "bad").exists()


def test_strict_false_keeps_the_models_own_leaves(llama_dir, tmp_path):
    """A concrete Llama whose lm_head the mapping does not name, a checkpoint with a key it does not use."""
    directory, torch_model = llama_dir
    tensors = {k: v.detach().numpy() for k, v in torch_model.state_dict().items()}
    tensors["score.weight"] = np.ones((3, 64), np.float32)
    checkpoint = write_checkpoint(tmp_path / "extra", tensors, json.loads((directory / "config.json").read_text()))
    mapping = port.mapping_for({"model_type": "llama"})
    no_head = port.parse_mapping(_without_entry(mapping.text, "lm_head"), "no-head.toml")
    assert "lm_head" not in {p.path for p in no_head.params}
    cls = mapping.model_class()
    mine = cls.from_config(json.loads((directory / "config.json").read_text()), key=jax.random.key(7))
    with pytest.raises(port.PlanError):
        port.convert(checkpoint, mine, no_head, "2x2")  # strict: both are errors
    run = port.convert(checkpoint, mine, no_head, "2x2", strict=False, out=tmp_path / "kept")
    assert run.report.kept == ("lm_head",) and run.plan.kept == ("lm_head",)
    # Saved with the rest; restored replicated (the output's mapping names no axes for it).
    restored = port.restore(tmp_path / "kept", "2x2")
    np.testing.assert_array_equal(np.asarray(restored.lm_head), np.asarray(mine.lm_head))
    assert restored.lm_head.sharding.is_fully_replicated and len(restored.lm_head.sharding.device_set) == 4
    np.testing.assert_array_equal(np.asarray(restored.embed), tensors["model.embed_tokens.weight"])
    assert run.report.unused == ("score.weight",)  # lm_head.weight is the mapping's tied key: accepted as before
    np.testing.assert_array_equal(np.asarray(run.model.lm_head), np.asarray(mine.lm_head))
    assert run.model.lm_head.sharding.spec == jax.sharding.PartitionSpec()  # no mapping entry: replicated
    assert len(run.model.lm_head.sharding.device_set) == 4
    np.testing.assert_array_equal(np.asarray(run.model.embed), tensors["model.embed_tokens.weight"])
    # the shipped mapping, a checkpoint lacking lm_head.weight: kept, and sharded by its entry's axes
    del tensors["lm_head.weight"]
    lacking = write_checkpoint(tmp_path / "lacking", tensors, json.loads((directory / "config.json").read_text()))
    run = port.convert(lacking, mine, mapping, "2x2", strict=False)
    assert run.report.kept == ("lm_head",) and run.report.unused == ("score.weight",)
    np.testing.assert_array_equal(np.asarray(run.model.lm_head), np.asarray(mine.lm_head))
    assert run.model.lm_head.sharding.spec == port.convert(directory, mesh="2x2").model.lm_head.sharding.spec
    skel = port.skeleton(mapping, json.loads((directory / "config.json").read_text()))
    with pytest.raises(port.PortError, match="leaf 'lm_head' is not filled from the checkpoint"):
        port.convert(lacking, skel, mapping, "2x2", strict=False)


def _without_entry(text, path):
    """A mapping's text without the [[params]] entry for `path`."""
    parts = text.split("[[params]]")
    return "[[params]]".join(p for p in parts if f'path = "{path}"\n' not in p)


def test_layers_gpt2_matches_a_truncated_transformers_model(gpt2_checkpoints):
    from helpers import torch_gpt2

    directories, _ = gpt2_checkpoints
    with recorded_reads() as calls:
        run = port.convert(directories["lm"], mesh="2x2", layers=range(1, 2))
    full = port.load(directories["lm"], mesh="2x2")
    model = run.model
    assert model.config.n_layer == 1 and model.blocks.attn.wq.shape[0] == 1
    for path, leaf in leaves(model).items():
        want = np.asarray(leaves(full)[path])
        np.testing.assert_array_equal(np.asarray(leaf), want[1:2] if path.startswith("blocks.") else want)
    # only layer 1's tensors (and the rest) are read
    layer0 = key_bytes(directories["lm"], lambda k: k.startswith("transformer.h.0.") and not k.endswith(".attn.bias"))
    files, _ = read_offsets(calls)
    assert run.report.bytes_read == len(files) == port.convert(directories["lm"], mesh="2x2").report.bytes_read - layer0
    torch_model = torch_gpt2()  # the same seed as the fixture's
    torch_model.transformer.h = type(torch_model.transformer.h)(list(torch_model.transformer.h)[1:2])
    torch_model.config.n_layer = 1
    torch_model.config.use_cache = False
    expected = torch_logits(torch_model)
    assert np.abs(np.asarray(logits(model, INPUT_IDS)) - expected).max() < 1e-4


def test_layers_llama_saves_its_layer_count(llama_dir, tmp_path):
    directory, _ = llama_dir
    full = port.load(directory)
    run = port.convert(directory, layers=range(1, 2), include=["blocks"], out=tmp_path / "out")
    assert run.model.config.num_hidden_layers == 1 and run.model.embed is None
    assert run.report.bytes_read == key_bytes(directory, lambda k: k.startswith("model.layers.1."))
    meta = json.loads((tmp_path / "out" / "port" / "metadata").read_text())
    assert meta["config"]["num_hidden_layers"] == 1 and meta["include"] == ["blocks"]
    restored = port.restore(tmp_path / "out")
    assert restored.config.num_hidden_layers == 1 and restored.lm_head is None
    np.testing.assert_array_equal(np.asarray(restored.blocks.mlp.up), np.asarray(full.blocks.mlp.up)[1:2])
    for bad, message in ((range(1, 3), "outside the checkpoint's 2 layers"), (range(0, 2, 2), "contiguous")):
        with pytest.raises(port.PortError, match=f"^layers=range.*{message}"):
            port.load(directory, layers=bad)
