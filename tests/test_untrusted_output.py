"""Issue 32 rows 4, 7 and 8: a port output is untrusted on every command that reads it (`port
info`, `port plan DIR`, `port export`, and `port.restore` / `port.export` in Python). It imports
nothing it names but port's own models (none at all with `--module`), every count and size its
metadata declares is bounded before anything is printed, built or allocated by it, a failed
plan's listing is capped, and `--json` is strict JSON of the documented schema.
"""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import port
from port._sources._checkpoint import MAX_NBYTES, MAX_RANK

from helpers import one_line, port_env, run_port

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "tiny-gpt2"
GPT2_MODEL = 'model = "port.models.gpt2:GPT2"'
HUGE = int("9" * 4000)  # a 4,000-digit dimension: under Python's int-string limit (4300), so JSON reads it


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """The tiny GPT-2 converted once (its sources recorded, so `port export` can write it back)."""
    out = tmp_path_factory.mktemp("converted") / "out"
    port.convert(EXAMPLE, out=out)
    return out


def crafted(converted: Path, directory: Path, change) -> Path:
    """A copy of the converted output at `directory`, its port/metadata edited by `change(meta)`."""
    shutil.copytree(converted, directory)
    meta = json.loads((directory / "port" / "metadata").read_text())
    change(meta)
    (directory / "port" / "metadata").write_text(json.dumps(meta))
    return directory


def strict_json(text: str):
    """`text` parsed as strict JSON: NaN, Infinity and -Infinity refused."""

    def refuse(constant):
        raise ValueError(f"{constant} is not JSON")

    return json.loads(text, parse_constant=refuse)


def refused_everywhere(out: Path, commands, *substrings: str) -> None:
    """Every command (`port COMMAND out ARGS`) refuses the output in one line holding `substrings`
    and the metadata's path, exit 1, printing nothing on stdout."""
    for command, *args in commands:
        result = run_port(command, out, *args)
        line = one_line(result, f"{out}/port/metadata: ", *substrings)
        assert result.stdout == "", (command, args, result.stdout[:300])
        assert len(line) < 1000, line


# ---------------------------------------------------------------- row 4: an output's word imports nothing


EVIL = """
import os
from pathlib import Path
Path(os.environ["PORT_TEST_MARKER"]).write_text("evil ran")
from port.models.gpt2 import GPT2 as Model
"""


@pytest.fixture
def evil(tmp_path):
    """`evil.py`, on PYTHONPATH of the commands run with `env`: importing it writes `marker`."""
    modules = tmp_path / "modules"
    modules.mkdir()
    (modules / "evil.py").write_text(EVIL)
    marker = tmp_path / "imported"
    path = os.pathsep.join(filter(None, [str(modules), os.environ.get("PYTHONPATH")]))
    return {"PYTHONPATH": path, "PORT_TEST_MARKER": str(marker)}, marker, modules


def naming_evil(converted: Path, directory: Path) -> Path:
    return crafted(
        converted, directory, lambda m: m.update(mapping=m["mapping"].replace(GPT2_MODEL, 'model = "evil:Model"'))
    )


@pytest.mark.slow
def test_an_output_naming_another_module_never_imports_it(converted, tmp_path, evil):
    """info and plan describe it, export refuses it in one line; export --module uses the class
    given, importing neither the module the output names nor anything else it names."""
    env, marker, _ = evil
    out = naming_evil(converted, tmp_path / "out")
    for command in (["info"], ["info", "--json"], ["plan"], ["plan", "--json"]):
        result = run_port(command[0], out, *command[1:], env=env)
        assert result.returncode == 0, result.stderr
        assert "evil:Model" in result.stdout
    one_line(
        run_port("export", out, "--out", tmp_path / "hf", env=env),
        "port/metadata: model 'evil:Model' is not one of port's models",
        out=tmp_path / "hf",
    )
    result = run_port("export", out, "--out", tmp_path / "hf", "--module", "port.models.gpt2:GPT2", env=env)
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "hf" / "model.safetensors").is_file()
    assert not marker.exists()
    subprocess.run([sys.executable, "-c", "import evil"], env=port_env(env), check=True)
    assert marker.read_text() == "evil ran"  # it does run when imported: the checks above are not vacuous


def test_exporting_a_restored_output_imports_nothing_it_names(converted, tmp_path, evil, monkeypatch):
    """`port.export(port.restore(DIR, model=GPT2), HF, DIR)`: the model is checked against its own
    class, not the one DIR names."""
    from port.models.gpt2 import GPT2

    _, marker, modules = evil
    out = naming_evil(converted, tmp_path / "out")
    monkeypatch.syspath_prepend(str(modules))
    monkeypatch.setenv("PORT_TEST_MARKER", str(marker))
    monkeypatch.delitem(sys.modules, "evil", raising=False)
    port.export(port.restore(out, model=GPT2), tmp_path / "hf", out)
    assert (tmp_path / "hf" / "model.safetensors").is_file()
    assert not marker.exists() and "evil" not in sys.modules
    with pytest.raises(port.OutputError, match="model 'evil:Model' is not one of port's models"):
        port.export({"wte": np.zeros(1)}, tmp_path / "hf2", out)  # no model class to check against
    assert not marker.exists() and "evil" not in sys.modules


# ---------------------------------------------------------------- rows 7 and 8: every count and size bounded


@pytest.mark.slow
@pytest.mark.parametrize(
    "change, expected",
    [
        (lambda m: m["leaves"]["wte"].update(shape=[HUGE, 64]), "leaf 'wte': float32 shape [9999"),
        (
            lambda m: m["sources"].update(big={"shape": [2, HUGE], "dtype": "float16"}),
            "source 'big': float16 shape [2, 9999",
        ),
    ],
    ids=["leaf", "source"],
)
def test_a_4000_digit_dimension_is_one_line_on_every_command(converted, tmp_path, change, expected):
    out = crafted(converted, tmp_path / "out", change)
    commands = [["info"], ["info", "--json"], ["plan", "--json"], ["export", "--out", tmp_path / "hf"]]
    refused_everywhere(out, commands, expected, f"is too large (more than {MAX_NBYTES} bytes)")
    assert not (tmp_path / "hf").exists()


def unmapped(**leaves):
    """Leaves the output's mapping has no entry for (as a `strict=False` conversion keeps): replicated."""
    return lambda m: m["leaves"].update(
        {name: {"shape": shape, "dtype": "float32", "axes": [None] * len(shape)} for name, shape in leaves.items()}
    )


@pytest.mark.slow
@pytest.mark.parametrize(
    "change, expected",
    [
        # a rank-1,000,000 leaf made `port info` print 110 MB and `port plan` hold 600 MB
        (unmapped(deep=[1] * 1_000_000), f"leaf 'deep': 'shape' has 1000000 dimensions (at most {MAX_RANK})"),
        (
            unmapped(deep=[1] * (MAX_RANK + 1)),
            f"leaf 'deep': 'shape' has {MAX_RANK + 1} dimensions (at most {MAX_RANK})",
        ),
        (
            lambda m: m["sources"].update(deep={"shape": [1] * (MAX_RANK + 1), "dtype": "float32"}),
            f"source 'deep': 'shape' has {MAX_RANK + 1} dimensions (at most {MAX_RANK})",
        ),
        (unmapped(**{"x" * 1001: [1]}), "is not a dotted module path of at most 1000 characters"),
        (unmapped(a=[2**60], b=[2**60]), f"its leaves take more than {MAX_NBYTES} bytes together"),
        (
            lambda m: m["sources"].update({k: {"shape": [2**60], "dtype": "float32"} for k in ("p", "q")}),
            f"its source tensors take more than {MAX_NBYTES} bytes together",
        ),
        (
            lambda m: m["leaves"]["wte"].update(quantized="\x1b[2J" + "x" * 2000),
            "leaf 'wte': 'quantized' must be a printable string of at most 1000 characters",
        ),
        (lambda m: m["leaves"]["wte"].update(stored=1), "leaf 'wte' must be an object with exactly shape, dtype"),
    ],
    ids=["rank-1000000", "rank", "source-rank", "name", "leaves-total", "sources-total", "quantized", "field"],
)
def test_sizes_and_counts_in_the_metadata_are_bounded(converted, tmp_path, change, expected):
    out = crafted(converted, tmp_path / "out", change)
    refused_everywhere(out, [["info"], ["plan"]], expected)


def test_more_leaves_than_an_output_holds_are_refused_read_and_never_written(converted, tmp_path, monkeypatch):
    """`MAX_LEAVES`, one bound for the reader and the writer (lowered here: the metadata's own size
    bound keeps a real file from reaching it)."""
    import port._output._read
    import port._output._save

    monkeypatch.setattr(port._output._read, "MAX_LEAVES", 10)
    monkeypatch.setattr(port._output._save, "MAX_LEAVES", 10)
    count = len(json.loads((converted / "port" / "metadata").read_text())["leaves"])
    with pytest.raises(port.OutputError) as caught:
        port.restore(converted)
    assert str(caught.value) == (
        f"{converted}/port/metadata: 'leaves' lists {count} leaves, more than an output holds (10 at most)"
    )
    with pytest.raises(port.OutputError) as caught:
        port.convert(EXAMPLE, out=tmp_path / "out")
    assert str(caught.value) == (
        f"out={tmp_path / 'out'}: port/metadata would record {count} leaves, more than restore reads back "
        "(10 at most); the output is not written"
    )
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow
def test_a_failed_export_lists_at_most_1000_problems(converted, tmp_path):
    """5,000 source tensors the mapping does not use (700,000 printed 86 MB): the first 1000 listed,
    the rest counted, one error line."""
    out = crafted(
        converted,
        tmp_path / "out",
        lambda m: m["sources"].update({f"x{i}": {"shape": [1], "dtype": "bool"} for i in range(5000)}),
    )
    result = run_port("export", out, "--out", tmp_path / "hf")
    one_line(result, "tensor 'x0' is not used by the mapping", "(and 4999 more problems: the first 1000 listed above)")
    lines = result.stdout.splitlines()
    assert len(lines) == 1001 and lines[-1] == "... and 4000 more problems", lines[-3:]
    assert len(result.stdout) < 200_000
    assert not (tmp_path / "hf").exists()


@pytest.mark.slow
@pytest.mark.parametrize(
    "model_type", [float("nan"), float("inf"), {"a": [1]}, ["gpt2"], 2], ids=["nan", "inf", "object", "list", "int"]
)
def test_json_is_strict_and_of_the_documented_types(converted, tmp_path, model_type):
    """`model_type` is copied from the output's config, which may hold anything JSON (or Python's
    json) allows: `port info --json` prints it only as the string or null docs/cli.md says."""
    out = crafted(converted, tmp_path / "out", lambda m: m["config"].update(model_type=model_type))
    result = run_port("info", out, "--json")
    assert result.returncode == 0, result.stderr
    document = strict_json(result.stdout)
    assert document["model_type"] is None
    assert all(isinstance(document[k], str) for k in ("schema", "directory", "class", "mapping"))
    result = run_port("info", out)
    assert result.returncode == 0 and "model_type" not in result.stdout, result.stdout
