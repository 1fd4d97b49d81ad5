"""docs/adding-an-architecture.md as a test: scaffold, edit, check, verify an architecture port does not ship."""

import importlib
from pathlib import Path

import equinox as eqx
import numpy as np
import pytest
import torch

import port
from conftest import cli

WALKTHROUGH = Path(__file__).parents[1] / "examples" / "walkthrough"


@pytest.fixture
def walkthrough(monkeypatch, tmp_path):
    """Work where the user's modules live, as the doc does; a TinyLM checkpoint saved by PyTorch."""
    monkeypatch.chdir(WALKTHROUGH)
    monkeypatch.syspath_prepend(str(WALKTHROUGH))
    torch_tinylm = importlib.import_module("torch_tinylm")
    torch.manual_seed(0)
    reference = torch_tinylm.TinyLM(torch_tinylm.CONFIG).eval()
    reference.save_pretrained(tmp_path / "tinylm")
    return tmp_path, reference


def test_scaffold_edit_check_verify(walkthrough):
    tmp_path, reference = walkthrough
    checkpoint, draft, mapping = tmp_path / "tinylm", tmp_path / "draft.toml", tmp_path / "tinylm.toml"

    # 1. Draft: everything pairs but the fused qkv, which is drafted in comments.
    code, output = cli("scaffold", checkpoint, "--module", "tinylm:TinyLM", "--out", draft)
    assert code == 0, output
    text = draft.read_text()
    assert "14 entries paired, 6 source keys unpaired (2 patterns), 6 leaves unfilled" in text
    assert "# TODO: name this axis: dim64" in text

    # The draft as it stands fails the check, naming what is left to do.
    code, output = cli("check", draft, checkpoint)
    assert code == 1
    assert "leaf 'blocks.wq' of tinylm:TinyLM has no mapping entry" in output
    assert "tensor 'blocks.0.qkv.weight' is not used" in output

    # 2. The edits the doc describes.
    edit_draft = importlib.import_module("edit_draft")
    mapping.write_text(edit_draft.edit(text))
    shipped = port.load_mapping(WALKTHROUGH / "tinylm.toml")
    edited = port.load_mapping(mapping)
    assert (edited.params, edited.rules, edited.reference) == (shipped.params, shipped.rules, shipped.reference)

    # 3. Check: no problems, no tensor data read.
    code, output = cli("check", mapping, checkpoint, "--mesh", "4x2")
    assert code == 0 and "ok: 20 leaves" in output, output

    # 4. Verify against the PyTorch model.
    code, output = cli("verify", checkpoint, "--mapping", mapping, "--mesh", "4x2")
    assert code == 0 and "vs TinyLM.logits (float32 [2, 16, 97]" in output, output

    # And parity by hand, on two meshes, with the converter as it ships.
    ids = np.random.default_rng(3).integers(0, 97, (2, 20))
    with torch.no_grad():
        expected = reference(torch.tensor(ids)).logits.numpy()
    tinylm = importlib.import_module("tinylm")
    for mesh in ("1x1", "4x2"):
        model = port.load(checkpoint, mesh=port.make_mesh(mesh), mapping=mapping)
        assert isinstance(model, tinylm.TinyLM)
        ours = np.asarray(eqx.filter_jit(lambda m, x: m(x))(model, ids))
        assert np.abs(ours - expected).max() < 1e-4
