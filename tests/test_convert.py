"""`port.convert`: the one chain of steps, its report and its progress, as the CLI prints them."""

import json
from pathlib import Path

import numpy as np
import pytest

import port

from helpers import run_port

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "tiny-gpt2"


def test_convert_returns_the_model_the_plan_and_the_report(tmp_path):
    seen = []
    run = port.convert(EXAMPLE, mesh="2x2", out=tmp_path / "out", progress=seen.append)
    assert isinstance(run, port.Conversion)
    assert run.model.blocks.attn.wq.sharding.mesh.shape == {"data": 2, "model": 2}
    assert len(run.plan.leaves) == 20 and run.report.params == run.plan.params == 169_536
    assert (
        run.report.bytes_read
        == run.plan.read_bytes
        == (EXAMPLE / "model.safetensors").stat().st_size
        - 8
        - (int.from_bytes((EXAMPLE / "model.safetensors").read_bytes()[:8], "little"))
    )
    assert sorted(run.report.device_bytes) == ["0", "1", "2", "3"]
    # float32: each device holds at most every parameter, and every parameter is held at least once
    assert all(0 < b <= 4 * run.report.params for b in run.report.device_bytes.values())
    assert sum(run.report.device_bytes.values()) >= 4 * run.report.params
    assert run.report.out == str(tmp_path / "out") and run.report.peak_host_bytes > 0
    # progress: a start, one event per leaf while reading and placing, then the write
    reads = [p for p in seen if p.phase == "read"]
    assert [p.leaves_done for p in reads] == list(range(21))
    assert reads[-1].done == run.report.bytes_read == reads[-1].total
    assert [(p.phase, p.done == p.total) for p in seen[-2:]] == [("write", False), ("write", True)]
    restored = port.restore(tmp_path / "out", "2x2")
    np.testing.assert_array_equal(np.asarray(restored.wte), np.asarray(run.model.wte))


@pytest.mark.slow
def test_the_cli_report_is_the_library_report(tmp_path):
    result = run_port("convert", EXAMPLE, "--mesh", "2x2", "--out", tmp_path / "out", "--report", tmp_path / "r.json")
    assert result.returncode == 0, result.stderr
    written = json.loads((tmp_path / "r.json").read_text())
    library = port.convert(EXAMPLE, mesh="2x2").report.to_json()
    assert set(written) == set(library) | {"schema", "model"}
    for key in ("params", "bytes_read", "device_bytes", "mesh", "num_processes", "process", "dtype"):
        assert written[key] == library[key], key
    assert 0 < written["seconds"] < 120 and written["peak_host_bytes"] > 0


def test_load_is_convert_without_output():
    model = port.load(EXAMPLE, mesh="2x2")
    again = port.convert(EXAMPLE, mesh="2x2").model
    np.testing.assert_array_equal(np.asarray(model.blocks.attn.wq), np.asarray(again.blocks.attn.wq))


def test_a_mesh_whose_blocks_outgrow_host_memory_is_refused_before_reading(tmp_path, monkeypatch):
    """On CPU devices every block is host memory: the plan's bytes per device times this process's
    devices is checked against what the host has available, before any tensor byte is read."""
    import port._memory

    with port.open_checkpoint(EXAMPLE) as ckpt:
        device_bytes = port.plan(
            port.skeleton(port.mapping_for(ckpt.config), ckpt.config),
            port.mapping_for(ckpt.config),
            ckpt.tensors,
            ckpt.config,
            {"data": 4, "model": 2},
        ).device_bytes
        monkeypatch.setattr(port._memory, "available_host_bytes", lambda: 8 * device_bytes - 1)
        try:
            port.convert(ckpt, mesh="4x2", out=tmp_path / "out")
        except port.PlanError as e:
            message = str(e)
        else:
            raise AssertionError("converted")
        assert ckpt.bytes_read == 0
    assert message.startswith("mesh=data=4,model=2: its blocks take ") and "(8 CPU devices x " in message
    assert message.endswith("available; use fewer devices, or shard what is replicated") and "\n" not in message
    assert list(tmp_path.iterdir()) == []
    monkeypatch.setattr(port._memory, "available_host_bytes", lambda: 8 * device_bytes)
    assert port.convert(EXAMPLE, mesh="4x2").report.bytes_read > 0  # exactly enough is enough


def test_restoring_onto_a_mesh_whose_blocks_outgrow_host_memory_is_refused_before_reading(tmp_path, monkeypatch):
    """The same check in `port.restore`: what the output's leaves take on this mesh's devices."""
    import port._memory
    import port._sources._local

    port.convert(EXAMPLE, mesh="2x2", out=tmp_path / "out")
    monkeypatch.setattr(port._memory, "available_host_bytes", lambda: 1000)
    read = []
    real = port._sources._local.LocalCheckpoint.read_into
    monkeypatch.setattr(
        port._sources._local.LocalCheckpoint, "read_into", lambda *a, **k: read.append(a) or real(*a, **k)
    )
    try:
        port.restore(tmp_path / "out", "4x2")
    except port.PlanError as e:
        message = str(e)
    else:
        raise AssertionError("restored")
    assert message.startswith("mesh data=4,model=2: its blocks take ") and "(8 CPU devices x " in message
    assert read == []
