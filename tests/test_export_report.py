"""`port.export`'s `ExportReport`: every figure `port export` prints, a Python caller gets.

The report's figures are checked against the files on disk (names, sizes, the tensors
their headers hold, the bytes those take); the report stands for the directory where
`export`'s old return value, a path, stood; and the command line's `--json` document and
summary line are the report's figures (the time and the peak host memory the whole
command's). examples/tiny-gpt2 throughout: no PyTorch needed.
"""

import dataclasses
import json
import math
import os
import struct
from pathlib import Path

import pytest

import port
from port._text import size_text

from helpers import run_port

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "tiny-gpt2"
ITEMSIZE = {"F32": 4, "BF16": 2}


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """examples/tiny-gpt2 as a `port convert` output."""
    out = tmp_path_factory.mktemp("report") / "jax"
    port.convert(EXAMPLE, out=out)
    return out


@pytest.fixture(scope="module")
def model(converted):
    """The output restored onto a 2x2 mesh, exported in several ways below."""
    return port.restore(converted, "2x2")


def headers(directory: Path) -> dict[str, dict]:
    """The tensors the safetensors files in `directory` hold, by key, as their headers say."""
    found = {}
    for path in directory.glob("*.safetensors"):
        with open(path, "rb") as f:
            header = json.loads(f.read(struct.unpack("<Q", f.read(8))[0]))
        header.pop("__metadata__")
        found.update(header)
    return found


@pytest.mark.parametrize("dtype", [None, "bfloat16"])
def test_the_report_says_what_is_on_disk(converted, model, dtype, tmp_path):
    out = tmp_path / "hf"
    report = port.export(model, out, converted, max_shard_size="200KB", dtype=dtype)
    assert isinstance(report, port.ExportReport) and report.out == out.resolve()
    files = sorted(p.name for p in out.iterdir() if p.name.endswith(".safetensors"))
    assert len(files) > 1 and report.files == tuple(files)
    assert report.bytes == sum((out / name).stat().st_size for name in files)
    tensors = headers(out)
    data = sum(math.prod(t["shape"]) * ITEMSIZE[t["dtype"]] for t in tensors.values())
    assert report.tensors == len(tensors) == 28
    assert (
        report.bytes_written
        == data
        == json.loads((out / "model.safetensors.index.json").read_text())["metadata"]["total_size"]
    )
    assert report.params == sum(math.prod(t["shape"]) for t in tensors.values()) == port.restore_plan(converted).params
    assert report.bytes_held == 678144  # every distinct block of the 2x2 mesh, all in this one process
    assert (report.process, report.num_processes, report.mesh) == (0, 1, {"data": 2, "model": 2})
    assert (report.dtype, report.quantize, report.port_version) == (dtype, None, port.__version__)
    assert report.seconds > 0 and report.peak_host_bytes > 0
    assert {t["dtype"] for t in tensors.values()} == {"F32" if dtype is None else "BF16"}


def test_the_report_stands_for_the_directory(converted, model, tmp_path):
    """`os.fspath` and `str` give the directory: a caller that took export's path keeps working."""
    report = port.export(model, tmp_path / "hf", converted)
    assert os.fspath(report) == str(report) == str(tmp_path / "hf") and Path(report) == report.out
    assert isinstance(report, os.PathLike)
    with port.open_checkpoint(report) as ckpt:
        assert len(ckpt.tensors) == report.tensors
    assert "bytes_written=" in repr(report)  # the figures, where a path is not asked for
    with pytest.raises(dataclasses.FrozenInstanceError):
        report.bytes = 0  # pyright: ignore[reportAttributeAccessIssue]
    document = report.to_json()
    assert json.loads(json.dumps(document)) == document
    assert document == {f.name: getattr(report, f.name) for f in dataclasses.fields(report)} | {
        "out": str(report.out),
        "files": list(report.files),
    }


@pytest.mark.slow
def test_the_command_line_prints_the_report(converted, model, tmp_path):
    """`port export --json` and its summary line: the report's figures, as the same export in Python gives them."""
    report = port.export(model, tmp_path / "api", converted, max_shard_size="200KB")
    printed = run_port(
        "export", converted, "--out", tmp_path / "cli", "--mesh", "2x2", "--max-shard-size", "200KB", "--json"
    )
    assert printed.returncode == 0, printed.stderr
    document = json.loads(printed.stdout)
    figures = report.to_json()
    same = ("process", "num_processes", "mesh", "dtype", "quantize", "files", "bytes", "tensors", "params")
    assert {k: document[k] for k in same} == {k: figures[k] for k in same}
    assert document["bytes_read"] == report.bytes_held and document["bytes_written"] == report.bytes_written
    assert document["out"] == str(tmp_path / "cli") and document["port_version"] == report.port_version
    for name in report.files:
        assert (tmp_path / "cli" / name).read_bytes() == (tmp_path / "api" / name).read_bytes(), name

    said = run_port("export", converted, "--out", tmp_path / "line", "--mesh", "2x2", "--max-shard-size", "200KB")
    assert said.returncode == 0, said.stderr
    assert said.stderr.strip().splitlines()[-1] == (
        f"port: exported {converted}: {len(report.files)} safetensors files, "
        f"{size_text(report.bytes)} -> {tmp_path / 'line'}"
    )
    assert report.bytes == sum((tmp_path / "line" / n).stat().st_size for n in report.files)
