"""`port.save` / `port restore`: an Orbax output loads onto any mesh with the same logits."""

import contextlib
import os
from pathlib import Path

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import port

from helpers import INPUT_IDS, logits


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


@pytest.mark.slow
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


def _chunk_files(out: Path, leaves=None) -> dict[str, int]:
    """The chunk files of an output (every file of a leaf's directory but its `.zarray`), by path, with sizes."""
    found = {}
    for folder in (out / "params").iterdir():
        if folder.is_dir() and (leaves is None or folder.name in leaves):
            found.update({str(f): f.stat().st_size for f in folder.iterdir() if f.name != ".zarray"})
    return found


@contextlib.contextmanager
def _bytes_read():
    """Per file, how many times each of its bytes was read by `port._sources._local._preadv` within the block."""
    import port._sources._local

    counts, real = {}, port._sources._local._preadv

    def preadv(fd, iov, offset):
        got = real(fd, iov, offset)
        name = os.readlink(f"/proc/self/fd/{fd}")
        size = os.fstat(fd).st_size
        counts.setdefault(name, np.zeros(size, np.int64))[offset : offset + got] += 1
        return got

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(port._sources._local, "_preadv", preadv)
        yield counts


@pytest.mark.parametrize("mesh_spec", ["4x2", "2x4", "1x1", "8x1"])
def test_restore_reads_every_chunk_byte_once(saved, mesh_spec):
    """On the mesh it was saved from or any other: each device's block reads only the chunk
    bytes it covers, every byte of the arrays is read exactly once, nothing else is."""
    out, written_logits, _ = saved
    with _bytes_read() as counts:
        model = port.restore(out, mesh_spec)
    chunks = _chunk_files(out)
    assert set(counts) == set(chunks)
    for name, count in counts.items():
        assert count.size == chunks[name] and (count == 1).all(), name
    assert np.abs(np.asarray(logits(model, INPUT_IDS)) - written_logits).max() < 1e-5


def test_restore_include_reads_only_the_included_chunks(saved):
    out, _, _ = saved
    with _bytes_read() as counts:
        model = port.restore(out, "2x4", include=["wte", "blocks.attn.*"])
    included = {p for p in os.listdir(out / "params") if p == "wte" or p.startswith("blocks.attn.")}
    assert len(included) == 9
    chunks = _chunk_files(out, included)
    assert set(counts) == set(chunks)
    assert all((count == 1).all() for count in counts.values())
    assert model.wpe is None and model.blocks.mlp.w_fc is None and model.wte is not None


def test_convert_reports_the_write_as_it_goes(gpt2_checkpoints, tmp_path):
    """Chunks are written while the next leaves are placed; once placing is over, `progress`
    gets phase "write" for what is left, up to every byte of the output's arrays; `save`
    reports each chunk file as it is written."""
    directories, _ = gpt2_checkpoints
    events = []
    run = port.convert(directories["sharded"], mesh="4x2", out=tmp_path / "out", progress=events.append)
    phases = [e.phase for e in events]
    assert phases == sorted(phases, key=["read", "write"].index) and phases[-1] == "write"
    writes = [e for e in events if e.phase == "write"]
    total = sum(_chunk_files(tmp_path / "out").values())
    assert total == sum(a.nbytes for a in jax.tree.leaves(run.model))
    assert {e.total for e in writes} == {total} and writes[-1].done == total
    assert all(a.done <= b.done for a, b in zip(writes, writes[1:]))
    assert writes[-1].leaves_done == writes[-1].leaves == len(run.plan.leaves)
    assert all(a.leaves_done <= b.leaves_done for a, b in zip(writes, writes[1:]))  # leaves as they are written

    saved = []
    with port.open_checkpoint(directories["sharded"]) as ckpt:
        port.save(
            run.model,
            tmp_path / "again",
            port.mapping_for(ckpt.config),
            ckpt.config,
            progress=lambda done, total: saved.append((done, total)),
        )
    assert saved[-1] == (total, total) and len(saved) >= len(_chunk_files(tmp_path / "out"))
    assert all(d <= t for d, t in saved) and all(a[0] <= b[0] and a[1] <= b[1] for a, b in zip(saved, saved[1:]))


@pytest.mark.parametrize("key", ["..", "a/b", "x y"])
def test_save_refuses_a_leaf_not_named_by_a_module_path(tmp_path, key):
    """A leaf's name is its directory in params/: one restore could not read back, or one
    that would climb out of it, is refused in one line, nothing left behind."""
    import jax.numpy as jnp

    mapping, config = port.mapping_for({"model_type": "gpt2"}), {"model_type": "gpt2"}
    with pytest.raises(port.PortError, match=r"leaf '.*' is not named by a dotted module path$"):
        port.save({"fine": jnp.ones(3), key: jnp.ones(3)}, tmp_path / "out", mapping, config)
    assert list(tmp_path.iterdir()) == []
