"""`port.save` / `port restore`: an Orbax output loads onto any mesh with the same logits."""

from pathlib import Path

import equinox as eqx
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import port
from helpers import INPUT_IDS


@eqx.filter_jit
def logits(model, ids):
    return model(ids)


@pytest.fixture(scope="module")
def saved(gpt2_checkpoints, tmp_path_factory):
    directories, expected = gpt2_checkpoints
    out = tmp_path_factory.mktemp("out") / "gpt2"
    with port.open_checkpoint(directories["sharded"]) as ckpt:
        mapping = port.mapping_for(ckpt.config)
        model = port.load(directories["sharded"], mesh=port.make_mesh("4x2"))
        port.save(model, out, mapping, ckpt.config)
    return out, np.asarray(logits(model, INPUT_IDS)), expected


@pytest.mark.parametrize("mesh_spec", ["2x4", "1x1", "8x1"])
def test_restore_on_another_mesh(saved, mesh_spec):
    out, written_logits, expected = saved
    mesh = port.make_mesh(mesh_spec)
    model = port.restore(out, mesh)
    ours = np.asarray(logits(model, INPUT_IDS))
    assert np.abs(ours - written_logits).max() < 1e-5
    assert np.abs(ours - expected).max() < 1e-4
    assert model.blocks.attn.wq.sharding.mesh.shape == mesh.shape
    assert model.blocks.attn.wq.sharding.spec == P(None, "data", "model", None)
    # vocab 101 is divisible by model=1 but not by model=4
    assert model.wte.sharding.spec == (P(None, "data") if mesh_spec == "2x4" else P("model", "data"))


def test_save_refuses_an_existing_directory(saved):
    out, _, _ = saved
    model = port.restore(out, port.make_mesh("1x1"))
    with pytest.raises(port.PortError, match="already exists"):
        port.save(model, out, port.mapping_for({"model_type": "gpt2"}), {"model_type": "gpt2"})


def test_restore_of_something_else(tmp_path):
    with pytest.raises(port.PortError, match="not a port output"):
        port.restore(tmp_path, port.make_mesh("1x1"))


def test_restore_takes_a_mesh_as_load_does(saved):
    """A spec string, a Mesh, or nothing (one device), exactly as `port.load`."""
    out, written_logits, _ = saved
    by_spec = port.restore(out, mesh="2x4")
    assert dict(by_spec.blocks.attn.wq.sharding.mesh.shape) == {"data": 2, "model": 4}
    single = port.restore(out)
    assert len(single.blocks.attn.wq.sharding.device_set) == 1
    for model in (by_spec, single):
        assert np.abs(np.asarray(logits(model, INPUT_IDS)) - written_logits).max() < 1e-5
    with pytest.raises(port.PortError, match="`mesh`: expected a jax.sharding.Mesh"):
        port.restore(out, mesh=8)


def test_force_in_python_replaces_only_a_port_output(saved, tmp_path):
    out, _, _ = saved
    model = port.restore(out)
    mapping, config = port.mapping_for({"model_type": "gpt2"}), {"model_type": "gpt2"}
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep")
    with pytest.raises(port.PortError, match="not a port output"):
        port.save(model, mine, mapping, config, force=True)
    assert (mine / "notes.txt").read_text() == "keep"
    copy = tmp_path / "copy"
    port.save(model, copy, mapping, config)
    port.save(model, copy, mapping, config, force=True)
    assert sorted(p.name for p in copy.iterdir()) == ["_CHECKPOINT_METADATA", "commit_success.txt", "params", "port"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["copy", "mine"]


def test_named_mesh_of_any_rank(tmp_path):
    """`--mesh data=2,expert=2,model=2` converts and restores; an axis no rule names replicates."""
    from helpers import run_port

    out = tmp_path / "out"
    example = Path(__file__).resolve().parents[1] / "examples" / "tiny-gpt2"
    result = run_port("convert", example, "--mesh", "data=2,expert=2,model=2", "--out", out)
    assert result.returncode == 0, result.stderr
    assert "onto mesh data=2,expert=2,model=2" in result.stderr
    model = port.restore(out, mesh="data=2,expert=2,model=2")
    assert dict(model.blocks.attn.wq.sharding.mesh.shape) == {"data": 2, "expert": 2, "model": 2}
    assert model.blocks.attn.wq.sharding.spec == P(None, "data", "model", None)
    assert len(model.blocks.attn.wq.sharding.device_set) == 8
    with pytest.raises(port.PortError, match="axis 'data' named twice"):
        port.make_mesh("data=2,data=2")
