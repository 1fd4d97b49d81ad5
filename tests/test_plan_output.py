"""Issue 24 rows 8 and 9: a port output planned onto another mesh (`port plan DIR`, from its
metadata alone), `--json` and `--report` on `port convert` and `port export`, and the version of
port recorded in every output, report and export."""

import json
import math
import re
import shutil
import struct
from pathlib import Path

import pytest

import port
from port._errors import OutputError
from port._output import read_output, restore_plan

from helpers import one_line, run_port

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "tiny-gpt2"


def documented_fields(schema: str) -> list[str]:
    """The fields docs/cli.md's table lists for `schema`, in order (as tests/test_cli_usage.py reads them)."""
    section = (REPO / "docs" / "cli.md").read_text().split(f"`{schema}`", 1)[1].split("\n## ", 1)[0]
    rows = [row for row in section.splitlines() if row.startswith("| `")]
    return [name for row in rows for name in re.findall(r"`(\w+)`", row.split("|")[1])]


@pytest.fixture(scope="module")
def output(tmp_path_factory):
    """The tiny GPT-2 converted on a 2x2 mesh, and a partial output of it (`include`)."""
    root = tmp_path_factory.mktemp("outputs")
    port.convert(EXAMPLE, mesh="2x2", out=root / "out")
    port.convert(EXAMPLE, mesh="2x2", out=root / "part", include=["wte", "blocks.attn"])
    return root


def edited(output, tmp_path, change):
    """A copy of the output whose port/metadata `change(meta)` edited."""
    copy = tmp_path / "copy"
    shutil.copytree(output / "out", copy)
    meta = json.loads((copy / "port" / "metadata").read_text())
    change(meta)
    (copy / "port" / "metadata").write_text(json.dumps(meta))
    return copy


# ---------------------------------------------------------------- the plan of a restore, in Python


@pytest.mark.parametrize("mesh", ["2x4", "8x1", "data=2,model=2,expert=2"])
def test_the_restore_plan_is_how_restore_places_each_leaf(output, mesh):
    """Each leaf's spec and bytes per device, from the metadata alone, are those of the arrays
    `port.restore` then builds on that mesh."""
    placement = restore_plan(output / "out", mesh)
    model = port.restore(output / "out", mesh)
    arrays = {path: array for path, array in port._skeleton.leaves(model).items() if hasattr(array, "sharding")}
    assert [leaf.path for leaf in placement.leaves] == list(arrays)
    for leaf in placement.leaves:
        array = arrays[leaf.path]
        assert tuple(array.sharding.spec) == tuple(leaf.spec), leaf.path
        assert leaf.device_bytes == array.addressable_shards[0].data.nbytes, leaf.path
    assert placement.device_bytes == sum(a.addressable_shards[0].data.nbytes for a in arrays.values())
    assert placement.read_bytes == sum(a.nbytes for a in arrays.values()) == 678144
    assert placement.params == 169536 and placement.absent == () and placement.excluded == ()
    wte = placement.leaves[0]
    assert wte.path == "wte" and wte.axes == ("vocab", "embed")
    model = port.mesh_shape(mesh)["model"]
    assert wte.notes == (() if model == 1 else (f"vocab 1021 not divisible by model={model}: replicated on model",))


def test_the_restore_plan_of_a_partial_output_names_what_it_left_out(output):
    placement = restore_plan(read_output(output / "part"), "2x2")
    assert [leaf.path for leaf in placement.leaves][:2] == ["wte", "blocks.attn.wq"]
    assert "wpe" in placement.excluded and "ln_f.weight" in placement.excluded
    assert not [p for p in placement.excluded if p == "wte" or p.startswith("blocks.attn.")]


def test_a_mesh_the_rules_do_not_fit_is_refused(output):
    with pytest.raises(OutputError) as refused:
        restore_plan(output / "out", "data=2,expert=2")
    assert str(refused.value) == (
        f"{output / 'out'}/port/metadata: mapping rules.vocab names mesh axis 'model', which the mesh "
        "(data, expert) does not have"
    )


# ---------------------------------------------------------------- port's version in the output


def test_an_output_records_the_port_that_wrote_it(output, tmp_path):
    assert read_output(output / "out").port_version == port.__version__
    older = edited(output, tmp_path, lambda meta: meta.pop("port_version"))  # written before it was recorded
    assert read_output(older).port_version is None
    assert port.restore(older).wte.shape == (1021, 64)


@pytest.mark.parametrize("value", [7, "", "1" * 101, "0.1\x1b[2J", "0.1\u00e9", None])
def test_a_port_version_not_a_short_plain_string_is_refused(output, tmp_path, value):
    bad = edited(output, tmp_path, lambda meta: meta.update(port_version=value))
    with pytest.raises(OutputError, match="'port_version' must be a version string of at most 100 characters"):
        read_output(bad)


# ---------------------------------------------------------------- the command line


@pytest.mark.slow
def test_port_plan_of_an_output_plans_its_restore(output):
    out = output / "out"
    text = run_port("plan", out, "--mesh", "2x4")
    assert text.returncode == 0, text.stderr
    lines = text.stdout.splitlines()
    assert lines[0] == f"{out} -> port.models.gpt2:GPT2 on mesh 2x4, restored from a port output"
    assert lines[1] == f"mapping: {REPO / 'mappings' / 'gpt2.toml'} (kept in the output)"
    assert lines[3].split() == ["target", "shape", "spec", "per", "device"]
    assert lines[4].split() == ["wte", "f32[1021,64]", "(-,", "data)", "130.7", "KB"]
    assert lines[5:7] == ["  axes: vocab, embed", "  note: vocab 1021 not divisible by model=4: replicated on model"]
    assert lines[-1] == "169.5K params in 20 leaves; 678.1 KB to read, 190.7 KB per device"

    planned = run_port("plan", out, "--mesh", "2x4", "--json")
    assert planned.returncode == 0, planned.stderr
    document = json.loads(planned.stdout)
    assert list(document) == documented_fields("port.plan/1")
    placement = restore_plan(out, "2x4")
    assert document["kind"] == "restore" and document["model"] == str(out)
    assert document["mesh"] == {"data": 2, "model": 4} and document["ignored"] == document["tied"] == []
    assert (document["params"], document["read_bytes"], document["bytes_per_device"]) == (
        placement.params,
        placement.read_bytes,
        placement.device_bytes,
    )
    assert document["leaves"][4] == {
        "path": "blocks.attn.wq",
        "shape": [2, 64, 4, 16],
        "dtype": "float32",
        "spec": [None, "data", "model", None],
        "bytes_per_device": 2 * 64 * 4 * 16 * 4 // 8,
        "source": "params/blocks.attn.wq",
        "stack": [],
        "transforms": "-",
        "notes": [],
    }

    one_line(
        run_port("plan", out, "--mesh", "data=2,expert=2"),
        "--mesh data=2,expert=2: ",
        "rules.vocab names mesh axis 'model', which the mesh (data, expert) does not have",
    )
    one_line(
        run_port("plan", out, "--dtype", "bfloat16"),
        f"--dtype bfloat16: {out} is a port output, restored in the dtypes it was written in",
    )


@pytest.mark.slow
def test_convert_and_export_print_and_report_their_summary_as_json(tmp_path):
    """`--json` prints the object `--report` writes, in docs/cli.md's fields, instead of the summary
    line; the version of port is in it, in the output's metadata and in each exported file."""
    out, hf = tmp_path / "out", tmp_path / "hf"
    converted = run_port("convert", EXAMPLE, "--mesh", "2x2", "--out", out, "--json", "--report", tmp_path / "c.json")
    assert converted.returncode == 0, converted.stderr
    document = json.loads(converted.stdout)
    assert document == json.loads((tmp_path / "c.json").read_text())
    assert list(document) == documented_fields("port.convert/1")
    assert document["schema"] == "port.convert/1" and document["port_version"] == port.__version__
    assert document["out"] == str(out) and document["mesh"] == {"data": 2, "model": 2}
    assert document["params"] == 169536 and document["bytes_read"] == 678144
    assert "converted" not in converted.stderr

    info = run_port("info", out)
    assert f"written by: port {port.__version__}" in info.stdout.splitlines(), info.stdout + info.stderr

    exported = run_port("export", out, "--out", hf, "--mesh", "2x2", "--json", "--report", tmp_path / "e.json")
    assert exported.returncode == 0, exported.stderr
    document = json.loads(exported.stdout)
    assert document == json.loads((tmp_path / "e.json").read_text())
    assert list(document) == documented_fields("port.export/1")
    assert "exported" not in exported.stderr
    size = (hf / "model.safetensors").stat().st_size
    with open(hf / "model.safetensors", "rb") as f:
        header = json.loads(f.read(struct.unpack("<Q", f.read(8))[0]))
    metadata = header.pop("__metadata__")
    assert metadata == {"format": "pt", "producer": "port", "port_version": port.__version__}
    written = sum(math.prod(t["shape"]) * 4 for t in header.values())
    assert {k: document[k] for k in ("schema", "directory", "out", "files", "bytes", "tensors", "params")} == {
        "schema": "port.export/1",
        "directory": str(out),
        "out": str(hf),
        "files": ["model.safetensors"],
        "bytes": size,
        "tensors": len(header),
        "params": 169536,
    }
    assert document["bytes_read"] == 678144 and document["bytes_written"] == written == 678144
    assert document["port_version"] == port.__version__ and document["peak_host_bytes"] > 0

    # The report is written as convert's is: not inside --out; --force replaces only a report port wrote.
    one_line(
        run_port("export", out, "--out", tmp_path / "hf2", "--report", tmp_path / "hf2" / "e.json"),
        f"--report {tmp_path / 'hf2' / 'e.json'}: inside --out {tmp_path / 'hf2'}, which port replaces",
        out=tmp_path / "hf2",
    )
    (tmp_path / "notes.json").write_text("{}")
    one_line(
        run_port("export", out, "--out", tmp_path / "hf3", "--report", tmp_path / "notes.json", "--force"),
        "--report",
        "not a run report port wrote; --force replaces only those",
        out=tmp_path / "hf3",
    )
    assert (tmp_path / "notes.json").read_text() == "{}"
    again = run_port("export", out, "--out", hf, "--report", tmp_path / "e.json", "--force")
    assert again.returncode == 0 and "exported" in again.stderr, again.stderr
    assert json.loads((tmp_path / "e.json").read_text())["schema"] == "port.export/1"
