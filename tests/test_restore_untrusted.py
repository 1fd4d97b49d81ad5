"""`port.restore` of an untrusted output: it imports nothing the output names but port's
own models, checks every field and size before reading an array, and turns every
corrupt, truncated, foreign or half-deleted output into one `PortError` line naming
the directory (and the leaf), with nothing on stderr.
"""

import itertools
import json
import math
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import port
from port._errors import OutputError
from port.models.gpt2 import GPT2

from helpers import INPUT_IDS, logits, one_line, port_env, run_port

GPT2_MODEL = 'model = "port.models.gpt2:GPT2"'


@pytest.fixture(scope="module")
def good(gpt2_checkpoints, tmp_path_factory):
    """A GPT-2 output written from a 4x2 mesh, and its logits."""
    directories, _ = gpt2_checkpoints
    out = tmp_path_factory.mktemp("good") / "gpt2"
    with port.open_checkpoint(directories["lm"]) as ckpt:
        model = port.load(directories["lm"], mesh="4x2")
        port.save(model, out, port.mapping_for(ckpt.config), ckpt.config)
    return out, np.asarray(logits(model, INPUT_IDS))


@pytest.fixture
def out(good, tmp_path):
    """A copy of the good output, to damage."""
    return Path(shutil.copytree(good[0], tmp_path / "out"))


def edit(out: Path, change) -> Path:
    """Apply `change` to the output's port/metadata (a dict), in place."""
    meta = json.loads((out / "port" / "metadata").read_text())
    change(meta)
    (out / "port" / "metadata").write_text(json.dumps(meta))
    return out


def refused(out, capfd, *substrings, mesh="2x4", **kwargs) -> str:
    """`restore` raises one OutputError line naming `out` and `substrings`, printing nothing."""
    capfd.readouterr()
    with pytest.raises(OutputError) as caught:
        port.restore(out, mesh, **kwargs)
    message = str(caught.value)
    assert "\n" not in message and str(out) in message, message
    for s in substrings:
        assert s in message, f"{s!r} not in {message!r}"
    captured = capfd.readouterr()
    assert captured.err == "" and captured.out == "", captured
    return message


# 1. Nothing an output names is imported, but port's own models.


@pytest.fixture
def evil(tmp_path, monkeypatch):
    """`evil.py` in the working directory and on sys.path; importing it writes `imported`."""
    (tmp_path / "evil.py").write_text(
        textwrap.dedent("""
        from pathlib import Path
        Path(__file__).with_name("imported").write_text("evil ran")
        from port.models.gpt2 import GPT2 as Model
        Ref = Model
    """)
    )
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield tmp_path / "imported"
    sys.modules.pop("evil", None)


def proves_importable(marker: Path) -> None:
    """`evil` does run when imported: the assertions that it was not are not vacuous."""
    import importlib

    importlib.import_module("evil")
    assert marker.read_text() == "evil ran"


def test_an_output_naming_another_module_is_refused_without_importing_it(out, evil, capfd):
    edit(out, lambda m: m.update(mapping=m["mapping"].replace(GPT2_MODEL, 'model = "evil:Model"')))
    message = refused(out, capfd, "port/metadata: model 'evil:Model' is not one of port's models", "model=")
    assert message == (
        f"{out}/port/metadata: model 'evil:Model' is not one of port's models (port.models.*), and restore imports "
        "no other module an output names; name the class: `port export DIR --module evil:Model` on the command "
        "line, port.restore(directory, mesh, model=YourModel) in Python"
    )
    assert not evil.exists() and "evil" not in sys.modules
    proves_importable(evil)


@pytest.mark.parametrize(
    "spec",
    [
        "os:system",
        "port._output:restore",
        "port.nn.config:MISSING",
        "port.models.gpt2.evil:Model",
        "port.models.evil:Model",
        "port.models.gpt2:_normal",
        "port.models.gpt2:jax",
        "port.models.gpt2:GPT2Config",
        "port.models.gpt2:GPT2\\nport: done",
    ],
)
def test_only_model_classes_of_port_models_are_imported(out, capfd, spec):
    edit(out, lambda m: m.update(mapping=m["mapping"].replace(GPT2_MODEL, f'model = "{spec}"')))
    refused(out, capfd, "port/metadata: model ")


def test_a_class_passed_is_used_and_nothing_is_imported(out, evil, good, capfd):
    """With `model`, the class the output names is neither imported nor compared: the leaves are."""
    edit(out, lambda m: m.update(mapping=m["mapping"].replace(GPT2_MODEL, 'model = "evil:Model"')))
    model = port.restore(out, "2x4", model=GPT2)
    assert type(model) is GPT2 and np.abs(logits(model, INPUT_IDS) - good[1]).max() < 1e-5
    assert not evil.exists() and "evil" not in sys.modules
    expected = r"^`model`: expected a class with from_config\(config, \*, key\), got 'port"
    with pytest.raises(port.PortError, match=expected):
        port.restore(out, "2x4", model="port.models.gpt2:GPT2")
    proves_importable(evil)


def test_the_mapping_reference_is_never_imported(out, evil, good):
    edit(out, lambda m: m.update(mapping=m["mapping"].replace("transformers:GPT2LMHeadModel", "evil:Ref")))
    model = port.restore(out, "1x1")
    assert np.abs(logits(model, INPUT_IDS) - good[1]).max() < 1e-5
    assert not evil.exists() and "evil" not in sys.modules
    proves_importable(evil)


class NoPositions(eqx.Module):
    """A module with `wte` only: `wpe` of a GPT-2 output is not one of its leaves."""

    wte: jax.Array

    @classmethod
    def from_config(cls, config, *, key):
        return cls(jnp.zeros((config["vocab_size"], config["n_embd"])))


class WithExtra(GPT2):
    """GPT-2 with one more leaf, which no output of GPT-2 holds."""

    extra: jax.Array

    def __init__(self, config, *, key, dtype=jnp.float32):
        super().__init__(config, key=key, dtype=dtype)
        self.extra = jnp.zeros(3)


def test_a_class_whose_leaves_differ_is_refused(out, capfd):
    refused(
        out, capfd, "port/metadata: leaf 'wpe' is not a leaf of NoPositions built from its config", model=NoPositions
    )
    refused(
        out,
        capfd,
        "port/metadata: leaf 'extra' of WithExtra built from its config is missing, and the mapping "
        "does not mark it optional",
        model=WithExtra,
    )


# 2. port/metadata: every field, and its agreement with the skeleton and the stored arrays.


def leaf(name, **fields):
    return lambda m: m["leaves"][name].update(fields)


@pytest.mark.parametrize(
    "change, expected",
    [
        (lambda m: m.update(format=1), "port/metadata: format 1 is not 3, the one this port reads"),
        (lambda m: m.update(format=4), "port/metadata: format 4 is not 3, the one this port reads"),
        (lambda m: m.update(format="3"), "port/metadata: format '3' is not 3"),
        (lambda m: m.update(format="2"), "port/metadata: format '2' is not 3"),
        (lambda m: m.update(format=True), "port/metadata: format True is not 3"),
        (lambda m: m.update(format=3.0), "port/metadata: format 3.0 is not 3"),
        (lambda m: m.update(format=2.0), "port/metadata: format 2.0 is not 3"),
        (lambda m: m.update(format=None), "port/metadata: format None is not 3"),
        (lambda m: m.pop("format"), "port/metadata: missing field 'format'"),
        (lambda m: m.pop("config"), "port/metadata: missing field 'config'"),
        (lambda m: m.update(extra=1), "port/metadata: unknown field 'extra'"),
        (lambda m: m.update({"a\nb": 1}), "port/metadata: unknown field 'a\\nb'"),
        (lambda m: m.update(mapping=["x"]), "port/metadata: 'mapping' must be a JSON string"),
        (lambda m: m.update(mapping_source=None), "port/metadata: 'mapping_source' must be a JSON string"),
        (lambda m: m.update(config=[1]), "port/metadata: 'config' must be a JSON object"),
        (lambda m: m.update(leaves=[]), "port/metadata: 'leaves' must be a JSON object"),
        (lambda m: m.update(leaves={}), "port/metadata: 'leaves' is empty"),
        (lambda m: m.update(mapping="model = "), "port/metadata: mapping: invalid TOML"),
        (lambda m: m.update(mapping="bogus = 1\n" + m["mapping"]), "port/metadata: mapping: unknown key 'bogus'"),
        (lambda m: m.update(mapping=m["mapping"].replace("[rules]", "rules = [1]\n[other]")), "port/metadata: mapping"),
        (
            lambda m: m.update(mapping='model = "port.models.gpt2:GPT2"\nrules = [1]\n'),
            "port/metadata: mapping: [rules] must be a table",
        ),
        (leaf("wte", shape=[101, -64]), "leaf 'wte': 'shape' must be a list of non-negative integers"),
        (leaf("wte", shape=[101, 64.0]), "leaf 'wte': 'shape' must be a list of non-negative integers"),
        (leaf("wte", shape=[101, True]), "leaf 'wte': 'shape' must be a list of non-negative integers"),
        (leaf("wte", shape="101x64"), "leaf 'wte': 'shape' must be a list of non-negative integers"),
        (leaf("wte", dtype="complex64"), "leaf 'wte': dtype 'complex64' is not one of"),
        (leaf("wte", dtype=["float32"]), "leaf 'wte': dtype ['float32'] is not one of"),
        (leaf("wte", dtype="float64"), "leaf 'wte': JAX holds float64 only with jax_enable_x64 set"),
        (leaf("wte", axes=["vocab"]), "leaf 'wte': 1 axes for a 2-d shape"),
        (leaf("wte", axes=["vocab", 3]), "leaf 'wte': 'axes' must be a list of logical axis names or null"),
        (leaf("wte", axes=["embed", "vocab"]), "leaf 'wte': axes ['embed', 'vocab'] differ from its mapping entry's"),
        (leaf("wte", extra=1), "leaf 'wte' must be an object with exactly shape, dtype, axes"),
        (lambda m: m["leaves"].update({"wte\nport: ok": m["leaves"]["wte"]}), "leaf name 'wte\\nport: ok' is not a"),
        (
            lambda m: m["leaves"].update(foo=m["leaves"]["wte"]),
            "leaf 'foo' has no entry in the output's mapping, yet names",
        ),
        (
            lambda m: m["leaves"].update(foo=dict(m["leaves"]["wte"], axes=[None, None])),
            "params: has no array 'foo', which",
        ),
        (lambda m: m["leaves"].pop("wpe"), "params: holds array 'wpe', which port/metadata does not list"),
        (
            lambda m: m.update(mapping=m["mapping"].replace('embed = "data"', 'embed = "tensor"')),
            "port/metadata: mapping rules.embed names mesh axis 'tensor', which the mesh (data, model) does not have",
        ),
    ],
)
def test_port_metadata_is_checked_field_by_field(out, capfd, change, expected):
    refused(edit(out, change), capfd, expected)


@pytest.mark.parametrize(
    "text, expected",
    [
        (b"", "port/metadata: not valid JSON (Expecting value"),
        (b"[1, 2]", "port/metadata: expected a JSON object, got list"),
        (b"[" * 100_000 + b"]" * 100_000, "port/metadata: not valid JSON (nested too deeply)"),
        (b'{"format": 1, "config": {"x": "\xff"}}', "port/metadata: not valid JSON ("),
        (b'{"format": 1' + b"0" * 5000 + b"}", "port/metadata: not valid JSON ("),
    ],
)
def test_port_metadata_that_is_not_json_is_refused(out, capfd, text, expected):
    (out / "port" / "metadata").write_bytes(text)
    refused(out, capfd, expected)


def test_port_metadata_is_never_read_whole_nor_waited_on(out, capfd):
    """A huge file is refused by its size; a FIFO or a directory is refused, not read."""
    with open(out / "port" / "metadata", "r+b") as f:
        f.truncate(8 << 30)  # sparse: 8 GB that take no disk
    refused(out, capfd, f"port/metadata: {8 << 30} bytes, more than port's metadata ever holds")
    (out / "port" / "metadata").unlink()
    os.mkfifo(out / "port" / "metadata")
    refused(out, capfd, "port/metadata: not a regular file")
    (out / "port" / "metadata").unlink()
    (out / "port" / "metadata").mkdir()
    refused(out, capfd, "port/metadata: not a regular file")


def zarray(out: Path, name: str, **fields) -> Path:
    """Update leaf `name`'s `.zarray` (a field set to ... is removed), in place."""
    path = out / "params" / name / ".zarray"
    meta = json.loads(path.read_text())
    meta.update(fields)
    path.write_text(json.dumps({k: v for k, v in meta.items() if v is not ...}))
    return out


def store(out: Path, name: str, shape: list, chunks: list, dtype: str = "<f4", itemsize: int = 4) -> None:
    """Replace leaf `name`'s stored array by a zarr array of `shape` in `chunks`, every chunk a file of zeros."""
    folder = out / "params" / name
    shutil.rmtree(folder)
    folder.mkdir()
    zarray_fields = {
        "chunks": chunks,
        "compressor": None,
        "dimension_separator": ".",
        "dtype": dtype,
        "fill_value": None,
        "filters": None,
        "order": "C",
        "shape": shape,
        "zarr_format": 2,
    }
    (folder / ".zarray").write_text(json.dumps(zarray_fields))
    for index in itertools.product(*(range(-(-n // c)) for n, c in zip(shape, chunks))):
        (folder / ".".join(map(str, index))).write_bytes(bytes(math.prod(chunks) * itemsize))


@pytest.mark.parametrize(
    "change, stored, expected",
    [
        # port/metadata's shape disagrees with the skeleton built from its config (the arrays agree with it)
        (
            leaf("wte", shape=[100, 64]),
            lambda out: store(out, "wte", [100, 64], [100, 16]),
            "port/metadata: leaf 'wte' is float32[100,64] but float32[101,64] in GPT2 built",
        ),
        (
            leaf("wte", dtype="int32"),
            lambda out: zarray(out, "wte", dtype="<i4"),
            "port/metadata: leaf 'wte' is int32[101,64] but float32[101,64] in GPT2 built",
        ),
        # the config disagrees with the leaves
        (lambda m: m["config"].update(n_layer=3), None, "leaf 'blocks.ln_1.weight' is float32[2,64] but float32[3,64]"),
        (
            lambda m: m["config"].update(vocab_size=100),
            None,
            "port/metadata: leaf 'wte' is float32[101,64] but float32[100,64] in GPT2 built",
        ),
        (lambda m: m["config"].update(n_head=5), None, "port/metadata: config: "),
        (lambda m: m["config"].pop("n_embd"), None, "port/metadata: config: required key 'n_embd' is missing"),
        # port/metadata and its config agree with each other, not with the stored arrays
        (
            lambda m: (m["config"].update(vocab_size=100), m["leaves"]["wte"].update(shape=[100, 64])),
            None,
            "params/wte/.zarray: shape [101, 64] but port/metadata says float32[100,64]",
        ),
        (leaf("wpe", dtype="bfloat16"), None, "params/wpe/.zarray: dtype '<f4' but port/metadata says bfloat16[32,64]"),
        # port/metadata and the .zarray agree, not the chunk files
        (
            leaf("wpe", dtype="bfloat16"),
            lambda out: zarray(out, "wpe", dtype="bfloat16"),
            "params/wpe/0.0: 2048 bytes, but a chunk of leaf 'wpe' (bfloat16[32,16]) is 1024",
        ),
        (
            lambda m: (m["config"].update(vocab_size=100), m["leaves"]["wte"].update(shape=[100, 64])),
            lambda out: zarray(out, "wte", shape=[100, 64], chunks=[100, 16]),
            "params/wte/0.0: 6464 bytes, but a chunk of leaf 'wte' (float32[100,16]) is 6400",
        ),
    ],
)
def test_port_metadata_must_agree_with_the_model_and_the_arrays(out, capfd, change, stored, expected):
    if stored is not None:
        stored(out)
    refused(edit(out, change), capfd, expected)


def test_sizes_are_bounded_before_anything_is_built(out, capfd, monkeypatch):
    """Shapes larger than the bytes stored, and config values larger than the values stored."""
    monkeypatch.setattr(Recorder, "built", [])
    edit(out, leaf("wte", shape=[10**9, 64]))
    refused(out, capfd, f"{out}/params/wte/.zarray: shape [101, 64] but port/metadata says float32[1000000000,64]")
    zarray(out, "wte", shape=[10**9, 64])  # chunks [101, 16]: ~40 million chunk files
    refused(out, capfd, f"{out}/params: more than 1000000 chunk files; not an output port wrote", model=Recorder)
    zarray(out, "wte", chunks=[10**9, 16])  # four chunk files of 64 GB each: the files are 6464 bytes
    refused(
        out,
        capfd,
        f"{out}/params/wte/0.0: 6464 bytes, but a chunk of leaf 'wte' (float32[1000000000,16]) is 64000000000",
        model=Recorder,
    )
    assert Recorder.built == []
    edit(out, leaf("wte", shape=[101, 64]))
    zarray(out, "wte", shape=[101, 64], chunks=[101, 16])
    edit(out, lambda m: m["config"].update(n_embd=10**12))
    refused(
        out, capfd, "port/metadata: config 'n_embd' is 1000000000000, more than the 1048576 values the output holds"
    )
    edit(out, lambda m: m["config"].update(n_embd=64, rope_scaling={"factor": [1, -(10**30)]}))
    refused(out, capfd, "port/metadata: config 'rope_scaling.factor[1]' is")
    edit(out, lambda m: m["config"].pop("rope_scaling"))
    with open(out / "params" / "wte" / ".zarray", "r+b") as f:
        f.truncate(1 << 30)
    refused(out, capfd, f"params/wte/.zarray: {1 << 30} bytes, more than zarr's metadata of the array ever holds")
    with open(out / "params" / "_METADATA", "r+b") as f:
        f.truncate(1 << 30)
    refused(out, capfd, f"params/_METADATA: {1 << 30} bytes, more than Orbax's metadata ever holds")


class Recorder:
    """Records every config it is built from; builds nothing."""

    built: list = []

    @classmethod
    def from_config(cls, config, *, key):
        cls.built.append(config)
        return cls()


def test_config_values_are_bounded_before_the_model_is_built(out, capfd):
    edit(out, lambda m: m["config"].update(n_positions=10**13))
    refused(out, capfd, "port/metadata: config 'n_positions' is 10000000000000, more than", model=Recorder)
    assert Recorder.built == []
    edit(out, lambda m: m["config"].update(n_positions=32))
    refused(out, capfd, "port/metadata: leaf 'wte' is not a leaf of Recorder built from its config", model=Recorder)
    assert len(Recorder.built) == 1 and Recorder.built[0]["n_positions"] == 32


def test_the_chunk_files_are_exactly_the_declared_bytes(good):
    """The size checks are not vacuous: each leaf's directory holds its `.zarray` and exactly the
    chunk files of its chunk grid, and they hold exactly the bytes port/metadata declares (the
    model's dimensions divide the saving mesh: no padding)."""
    directory = good[0]
    meta = json.loads((directory / "port" / "metadata").read_text())
    assert {p.name for p in (directory / "params").iterdir() if p.is_dir()} == set(meta["leaves"])
    for name, info in meta["leaves"].items():
        chunks = json.loads((directory / "params" / name / ".zarray").read_text())["chunks"]
        grid = itertools.product(*(range(-(-n // c)) for n, c in zip(info["shape"], chunks)))
        names = {".".join(map(str, index)) for index in grid}
        assert {p.name for p in (directory / "params" / name).iterdir()} == names | {".zarray"}, name
        assert len(names) > 1, name  # chunked by the blocks of the 4x2 mesh
    stored = sum(f.stat().st_size for f in data_files(directory))
    declared = sum(np.prod(leaf["shape"]) * 4 for leaf in meta["leaves"].values())
    assert stored == declared


# 3. Corrupt, truncated, foreign and half-deleted outputs.


def data_files(out: Path) -> list[Path]:
    """The chunk files of every leaf (every file of a leaf's directory but its `.zarray`)."""
    return sorted(f for f in (out / "params").glob("*/*") if f.name != ".zarray")


def truncate(path: Path, size: int) -> None:
    with open(path, "r+b") as f:
        f.truncate(size)


def metadata(out: Path, **fields) -> None:
    """Update params/_METADATA (Orbax's; a field set to ... is removed), in place."""
    path = out / "params" / "_METADATA"
    meta = json.loads(path.read_text())
    meta.update(fields)
    path.write_text(json.dumps({k: v for k, v in meta.items() if v is not ...}))


def replace(path: Path, make) -> None:
    """Replace the file at `path` by what `make(path)` creates there."""
    path.unlink()
    make(path)


def move_aside(out: Path, name: str) -> None:
    """Move leaf `name`'s directory out of params/ and put a symbolic link to it in its place."""
    shutil.move(out / "params" / name, out / "aside")
    (out / "params" / name).symlink_to(out / "aside", target_is_directory=True)


def nest(chunk: Path) -> None:
    """Move chunk `0.1` to `0/1`, where a reader splitting chunk names by '/' would find it."""
    chunk.with_name("0").mkdir()
    chunk.rename(chunk.with_name("0") / "1")


WTE = "params/wte/0.1"  # a chunk of the first leaf read: 101 rows by 16 columns of float32
LINK = "a symbolic link, not a regular file of the output: refused"
NOT_C = "not stored in C order with '.'-separated chunk names, as port stores arrays"


@pytest.mark.parametrize(
    "damage, expected",
    [
        # params/ and Orbax's params/_METADATA
        (lambda out: shutil.rmtree(out / "params"), "params: missing or not a directory (an incomplete port output)"),
        (lambda out: (out / "params" / "_METADATA").unlink(), "params/_METADATA: missing (Orbax's metadata)"),
        (lambda out: (out / "params" / "_METADATA").write_text("{"), "params/_METADATA: not valid JSON ("),
        (lambda out: (out / "params" / "_METADATA").write_text("[]"), "params/_METADATA: not Orbax's PyTree metadata"),
        (
            lambda out: metadata(out, use_ocdbt=True),
            "params/_METADATA: arrays not stored as port writes them (zarr chunk files, no OCDBT)",
        ),
        (lambda out: metadata(out, use_ocdbt=...), "params/_METADATA: arrays not stored as port writes them"),
        (lambda out: metadata(out, use_ocdbt=0), "params/_METADATA: arrays not stored as port writes them"),
        (lambda out: metadata(out, use_zarr3=True), "params/_METADATA: arrays not stored as port writes them"),
        # a leaf's directory
        (
            lambda out: shutil.rmtree(out / "params" / "wte"),
            "params/wte: missing or not a directory (leaf 'wte' of port/metadata)",
        ),
        (
            lambda out: (shutil.rmtree(out / "params" / "wpe"), (out / "params" / "wpe").write_text("x")),
            "params/wpe: missing or not a directory (leaf 'wpe' of port/metadata)",
        ),
        (
            lambda out: move_aside(out, "blocks.mlp.w_fc"),
            "params/blocks.mlp.w_fc: a symbolic link, not a directory of the output: refused",
        ),
        # a leaf's .zarray
        (
            lambda out: (out / "params" / "wte" / ".zarray").unlink(),
            "params/wte/.zarray: missing (zarr's metadata of the array)",
        ),
        (lambda out: (out / "params" / "wte" / ".zarray").write_text("{"), "params/wte/.zarray: not valid JSON ("),
        (
            lambda out: (out / "params" / "wte" / ".zarray").write_text("[2]"),
            "params/wte/.zarray: not zarr format 2 metadata",
        ),
        (
            lambda out: replace(out / "params" / "wte" / ".zarray", os.mkfifo),
            "params/wte/.zarray: not a regular file (zarr's metadata of the array)",
        ),
        (
            lambda out: replace(out / "params" / "wte" / ".zarray", Path.mkdir),
            "params/wte/.zarray: not a regular file (zarr's metadata of the array)",
        ),
        (lambda out: zarray(out, "wte", zarr_format=3), "params/wte/.zarray: not zarr format 2 metadata"),
        (lambda out: zarray(out, "wte", zarr_format=2.0), "params/wte/.zarray: not zarr format 2 metadata"),
        (lambda out: zarray(out, "wte", zarr_format="2"), "params/wte/.zarray: not zarr format 2 metadata"),
        (lambda out: zarray(out, "wte", zarr_format=...), "params/wte/.zarray: not zarr format 2 metadata"),
        (
            lambda out: zarray(out, "wte", shape=[100, 64]),
            "params/wte/.zarray: shape [100, 64] but port/metadata says float32[101,64]",
        ),
        (
            lambda out: zarray(out, "wte", shape=[64, 101]),
            "params/wte/.zarray: shape [64, 101] but port/metadata says float32[101,64]",
        ),
        (
            lambda out: zarray(out, "wte", shape=...),
            "params/wte/.zarray: shape None but port/metadata says float32[101,64]",
        ),
        (
            lambda out: zarray(out, "wte", dtype="<f8"),
            "params/wte/.zarray: dtype '<f8' but port/metadata says float32[101,64]",
        ),
        (
            lambda out: zarray(out, "wte", dtype=">f4"),
            "params/wte/.zarray: dtype '>f4' but port/metadata says float32[101,64]",
        ),
        (
            lambda out: zarray(out, "wte", dtype="<i4"),
            "params/wte/.zarray: dtype '<i4' but port/metadata says float32[101,64]",
        ),
        (
            lambda out: zarray(out, "wte", dtype="bfloat16"),
            "params/wte/.zarray: dtype 'bfloat16' but port/metadata says float32[101,64]",
        ),
        (
            lambda out: zarray(out, "wte", compressor={"id": "zstd", "level": 1}),
            "params/wte/.zarray: stored compressed or filtered; port stores arrays uncompressed",
        ),
        (
            lambda out: zarray(out, "wte", filters=[{"id": "delta", "dtype": "<f4"}]),
            "params/wte/.zarray: stored compressed or filtered; port stores arrays uncompressed",
        ),
        (lambda out: zarray(out, "wte", filters=[]), "params/wte/.zarray: stored compressed or filtered"),
        (lambda out: zarray(out, "wte", order="F"), f"params/wte/.zarray: {NOT_C}"),
        (lambda out: zarray(out, "wte", order=...), f"params/wte/.zarray: {NOT_C}"),
        (lambda out: zarray(out, "wte", dimension_separator="/"), f"params/wte/.zarray: {NOT_C}"),
        (
            lambda out: zarray(out, "wte", chunks=[0, 16]),
            "params/wte/.zarray: chunks [0, 16] are not a chunk shape for float32[101,64]",
        ),
        (
            lambda out: zarray(out, "wte", chunks=[102, 16]),
            "params/wte/.zarray: chunks [102, 16] are not a chunk shape for float32[101,64]",
        ),
        (
            lambda out: zarray(out, "wte", chunks=[101, 65]),
            "params/wte/.zarray: chunks [101, 65] are not a chunk shape for float32[101,64]",
        ),
        (lambda out: zarray(out, "wte", chunks=[101]), "params/wte/.zarray: chunks [101] are not a chunk shape for"),
        (
            lambda out: zarray(out, "wte", chunks=[101, 16, 1]),
            "params/wte/.zarray: chunks [101, 16, 1] are not a chunk",
        ),
        (lambda out: zarray(out, "wte", chunks=[101, 16.0]), "params/wte/.zarray: chunks [101, 16.0] are not a chunk"),
        (lambda out: zarray(out, "wte", chunks=[101, True]), "params/wte/.zarray: chunks [101, True] are not a chunk"),
        (lambda out: zarray(out, "wte", chunks="101,16"), "params/wte/.zarray: chunks '101,16' are not a chunk shape"),
        (lambda out: zarray(out, "wte", chunks=...), "params/wte/.zarray: chunks None are not a chunk shape"),
        # a valid chunk shape that is not the one the chunk files were written in
        (
            lambda out: zarray(out, "wte", chunks=[101, 32]),
            "params/wte/0.0: 6464 bytes, but a chunk of leaf 'wte' (float32[101,32]) is 12928",
        ),
        (
            lambda out: zarray(out, "wte", chunks=[101, 8]),
            "params/wte/0.0: 6464 bytes, but a chunk of leaf 'wte' (float32[101,8]) is 3232",
        ),
        (
            lambda out: zarray(out, "wte", chunks=[50, 16]),
            "params/wte/0.0: 6464 bytes, but a chunk of leaf 'wte' (float32[50,16]) is 3200",
        ),
        # a chunk file
        (lambda out: (out / WTE).unlink(), f"{WTE}: missing (a chunk of leaf 'wte')"),
        (
            lambda out: truncate(out / WTE, 6463),
            f"{WTE}: 6463 bytes, but a chunk of leaf 'wte' (float32[101,16]) is 6464",
        ),
        (lambda out: truncate(out / WTE, 0), f"{WTE}: 0 bytes, but a chunk of leaf 'wte' (float32[101,16]) is 6464"),
        (
            lambda out: truncate(out / WTE, 6465),
            f"{WTE}: 6465 bytes, but a chunk of leaf 'wte' (float32[101,16]) is 6464",
        ),
        (lambda out: truncate(out / WTE, 1 << 40), f"{WTE}: {1 << 40} bytes, but a chunk of leaf 'wte'"),  # sparse
        (lambda out: replace(out / WTE, os.mkfifo), f"{WTE}: not a regular file (a chunk of leaf 'wte')"),
        (lambda out: replace(out / WTE, Path.mkdir), f"{WTE}: not a regular file (a chunk of leaf 'wte')"),
        (
            lambda out: replace(out / WTE, lambda p: p.symlink_to(out / "params")),
            f"{WTE}: {LINK} (a chunk of leaf 'wte')",
        ),
        (
            lambda out: replace(out / WTE, lambda p: p.symlink_to(out / "nowhere")),
            f"{WTE}: {LINK} (a chunk of leaf 'wte')",
        ),
        (lambda out: replace(out / WTE, lambda p: p.symlink_to(p)), f"{WTE}: {LINK} (a chunk of leaf 'wte')"),
        (lambda out: replace(out / WTE, lambda p: p.symlink_to("/dev/zero")), f"{WTE}: {LINK} (a chunk of leaf 'wte')"),
        (lambda out: replace(out / WTE, lambda p: p.symlink_to("0.0")), f"{WTE}: {LINK} (a chunk of leaf 'wte')"),
        (
            lambda out: (out / "params" / "wte" / "0.1").rename(out / "params" / "wte" / "1.0"),
            f"{WTE}: missing (a chunk of leaf 'wte')",
        ),
        (lambda out: nest(out / WTE), f"{WTE}: missing (a chunk of leaf 'wte')"),
        (
            lambda out: (out / "params" / "ln_f.bias" / "3").unlink(),
            "params/ln_f.bias/3: missing (a chunk of leaf 'ln_f.bias')",
        ),
        (
            lambda out: (out / "params" / "blocks.attn.wo" / "0.1.0.3").unlink(),
            "params/blocks.attn.wo/0.1.0.3: missing (a chunk of leaf 'blocks.attn.wo')",
        ),
    ],
)
def test_a_damaged_output_is_one_line(out, capfd, monkeypatch, damage, expected):
    """Each refused by one line starting with the file at fault, before the model is built or an array read."""
    calls = []
    monkeypatch.setattr(port._output._restore, "_build", lambda *args: calls.append("_build"))
    monkeypatch.setattr(port._output._restore, "_read_arrays", lambda *args: calls.append("_read_arrays"))
    damage(out)
    message = refused(out, capfd, expected)
    assert message.startswith(f"{out}/{expected}"), message
    assert calls == []


def _declare_none(out: Path, leaf: str) -> None:
    """Mark `leaf` in params/_METADATA as Orbax marks an absent (None) leaf."""
    meta = json.loads((out / "params" / "_METADATA").read_text())
    for entry in meta["tree_metadata"].values():
        if ".".join(k["key"] for k in entry["key_metadata"]) == leaf:
            entry["value_metadata"]["value_type"] = "None"
    (out / "params" / "_METADATA").write_text(json.dumps(meta))


def test_a_listed_leaf_stored_as_none_is_refused(out, capfd):
    _declare_none(out, "wte")  # Orbax's mark for an absent leaf, on one port/metadata lists
    refused(out, capfd, "params: has no array 'wte', which port/metadata lists")


def test_every_chunk_file_deleted_cut_grown_or_replaced_is_one_line_naming_it(good, tmp_path, capfd, monkeypatch):
    """No redundancy in format 3: every chunk file of every leaf is needed, and checked before anything is read."""
    out = Path(shutil.copytree(good[0], tmp_path / "out"))
    expected_logits = np.asarray(logits(port.restore(out, "1x1"), INPUT_IDS))
    reads = []
    monkeypatch.setattr(port._output._restore, "_read_arrays", lambda *args: reads.append(args))
    chunks = data_files(out)
    assert len(chunks) == 96 and len({f.parent for f in chunks}) == 20
    for victim in chunks:
        data, size, name = victim.read_bytes(), victim.stat().st_size, victim.parent.name
        where = f"{victim}: "
        for damage, expected in [
            (lambda: victim.unlink(), f"{where}missing (a chunk of leaf '{name}')"),
            (lambda: truncate(victim, 0), f"{where}0 bytes, but a chunk of leaf '{name}' ("),
            (lambda: truncate(victim, 7), f"{where}7 bytes, but a chunk of leaf '{name}' ("),
            (lambda: truncate(victim, size - 1), f"{where}{size - 1} bytes, but a chunk of leaf '{name}' ("),
            (lambda: truncate(victim, size + 1), f"{where}{size + 1} bytes, but a chunk of leaf '{name}' ("),
            (lambda: replace(victim, os.mkfifo), f"{where}not a regular file (a chunk of leaf '{name}')"),
        ]:
            damage()
            message = refused(out, capfd, mesh="1x1")
            assert message.startswith(expected), message
            if "bytes, but" in expected:
                assert message.endswith(f") is {size}"), message
            victim.unlink(missing_ok=True)
            victim.write_bytes(data)
    assert reads == []
    monkeypatch.undo()
    np.testing.assert_array_equal(
        np.asarray(logits(port.restore(out, "1x1"), INPUT_IDS)), expected_logits
    )  # every file put back as it was


def _cut(victim: Path) -> None:
    truncate(victim, victim.stat().st_size // 2)


def _swap(victim: Path) -> None:
    """The same bytes in a new file renamed over it: a different file from the one checked."""
    new = victim.with_name("new")
    new.write_bytes(victim.read_bytes())
    new.replace(victim)


def _secret(path: Path, size: int) -> Path:
    """A file of `size` bytes that is no part of any output (another user's key, say)."""
    path.write_bytes((b"not yours " * (size // 10 + 1))[:size])
    return path


def _link_elsewhere(victim: Path) -> None:
    """The chunk replaced by a link to a file of its very size outside the output."""
    secret = _secret(victim.parents[3] / f"secret-{victim.name}", victim.stat().st_size)
    replace(victim, lambda p: p.symlink_to(secret))


@pytest.mark.parametrize("read_ahead", [None, 0])
@pytest.mark.parametrize("chunk", ["wte/0.1", "blocks.mlp.w_proj/0.1.0", "ln_f.bias/3"])
@pytest.mark.parametrize(
    "damage, reason",
    [
        (lambda f: truncate(f, 0), "truncated since"),
        (_cut, "truncated since"),
        (lambda f: f.unlink(), "cannot read: No such file or directory"),
        (lambda f: replace(f, os.mkfifo), "not a regular file"),
        (_swap, "changed since"),
        (_link_elsewhere, LINK),
    ],
)
def test_a_chunk_damaged_after_the_checks_is_one_line(out, capfd, monkeypatch, read_ahead, chunk, damage, reason):
    """A chunk cut short, removed or replaced between the checks and the reads: the file that
    is read is the very file checked, or the leaf cannot be read."""
    if read_ahead is not None:
        monkeypatch.setattr(port._output._restore, "READ_AHEAD_BYTES", read_ahead)
    real, opened = port._output._restore._open_arrays, []

    def open_then_damage(output):
        result = real(output)
        opened.append(output.directory)
        damage(out / "params" / chunk)
        return result

    monkeypatch.setattr(port._output._restore, "_open_arrays", open_then_damage)
    leaf, name = chunk.split("/")
    message = refused(out, capfd, mesh="1x1")
    assert message.startswith(f"{out}/params: leaf '{leaf}': cannot be read ({name}: {reason}"), message
    assert opened == [out]


# Links: nothing below an output's directory is reached through a symbolic link, so a tampered
# output cannot make restore, or `port export` after it, read a file from elsewhere (issue 21).


@pytest.mark.slow
@pytest.mark.parametrize("target", ["outside", "another chunk"])
def test_a_chunk_linked_to_a_file_of_its_size_is_refused_and_never_exported(out, tmp_path, capfd, target):
    """The link's target has exactly the chunk's size, so every size check would pass: restore
    refuses the link in one line, and `port export` exits 1 with that line, writing nothing."""
    victim = out / WTE
    size = victim.stat().st_size
    secret = _secret(tmp_path / "secret", size) if target == "outside" else victim.with_name("0.0")
    assert secret.stat().st_size == size and not secret.is_symlink()
    replace(victim, lambda p: p.symlink_to(secret))
    message = refused(out, capfd)
    assert message == f"{out}/{WTE}: {LINK} (a chunk of leaf 'wte')"
    if target == "outside":
        line = one_line(run_port("export", out, "--out", tmp_path / "hf"), f"{out}/{WTE}: {LINK}")
        assert line == f"port: error: {message}"
        assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "secret"]  # no hf, no hidden partial


@pytest.mark.slow
@pytest.mark.parametrize("name", ["port", "params", "params/wte", "params/blocks.attn.wq"])
def test_a_directory_of_the_output_linked_in_is_refused(out, tmp_path, capfd, name):
    """The output's own files, moved aside and linked back in by their directory: refused, naming the link."""
    shutil.move(out / name, tmp_path / "aside")
    (out / name).symlink_to(tmp_path / "aside", target_is_directory=True)
    message = refused(out, capfd)
    assert message == f"{out}/{name}: a symbolic link, not a directory of the output: refused"
    if name == "params/wte":
        assert one_line(run_port("export", out, "--out", tmp_path / "hf"), message) == f"port: error: {message}"
        assert sorted(p.name for p in tmp_path.iterdir()) == ["aside", "out"]


@pytest.mark.parametrize("name", ["params", "params/wte"])
def test_a_directory_linked_in_after_the_checks_is_not_followed(out, tmp_path, capfd, monkeypatch, name):
    """Between the checks and the reads, a directory is moved aside and linked back: the very
    files checked, yet not read through the link (each read opens every step with O_NOFOLLOW)."""
    real = port._output._restore._open_arrays

    def open_then_link(output):
        result = real(output)
        shutil.move(out / name, tmp_path / "aside")
        (out / name).symlink_to(tmp_path / "aside", target_is_directory=True)
        return result

    monkeypatch.setattr(port._output._restore, "_open_arrays", open_then_link)
    message = refused(out, capfd, mesh="1x1")
    assert message == (
        f"{out}/params: leaf 'wte': cannot be read ({out}/{name}: a symbolic link, not a directory of the output: "
        "refused)"
    )


def test_an_output_in_the_hub_cache_restores_and_links_elsewhere_are_refused(good, tmp_path, capfd):
    """An output downloaded into the Hugging Face cache: every file of its snapshot a symbolic link
    to a blob of the repo. Those links are followed, and restore gives the same model; a link of
    the snapshot that leads anywhere but the repo's `blobs/` is refused, named."""
    repo = tmp_path / "hub" / "models--someone--gpt2-jax"
    blobs, out = repo / "blobs", repo / "snapshots" / "0123abcd"
    blobs.mkdir(parents=True)
    files = [p for p in sorted(good[0].rglob("*")) if p.is_file()]
    for i, path in enumerate(files):
        shutil.copyfile(path, blobs / f"{i:040x}")
        target = out / path.relative_to(good[0])
        target.parent.mkdir(parents=True, exist_ok=True)
        target.symlink_to(os.path.relpath(blobs / f"{i:040x}", target.parent))
    model = port.restore(out, "2x4")
    assert np.abs(logits(model, INPUT_IDS) - good[1]).max() < 1e-5
    chunk = out / "params" / "wte" / "0.0"
    elsewhere = tmp_path / "elsewhere"
    shutil.copyfile(chunk, elsewhere)  # a file of the right size, outside the cache repo's blobs
    chunk.unlink()
    chunk.symlink_to(elsewhere)
    assert refused(out, capfd) == f"{chunk}: {LINK} (a chunk of leaf 'wte')"


def test_open_regular_follows_no_link_below_an_output(out, tmp_path):
    """The helper itself: a file reached through no link opens; a link at any step is one OutputError."""
    from port._files import open_regular

    fd, st = open_regular(out / WTE, output=out)
    os.close(fd)
    assert st.st_size == (out / WTE).stat().st_size
    outside = tmp_path / "elsewhere"
    outside.symlink_to(out, target_is_directory=True)  # the output itself may be named through a link
    fd, _ = open_regular(outside / WTE, output=outside)
    os.close(fd)
    replace(out / "params" / "wte" / "0.0", lambda p: p.symlink_to("0.1"))
    with pytest.raises(OutputError, match=f"^0.0: {LINK}$"):
        open_regular(out / "params" / "wte" / "0.0", output=out)
    with pytest.raises(OutputError, match=r"^0\.1: not a file inside the output "):
        open_regular(out / WTE, output=out / "port")
    shutil.move(out / "params" / "wpe", tmp_path / "wpe")
    (out / "params" / "wpe").symlink_to(tmp_path / "wpe", target_is_directory=True)
    with pytest.raises(OutputError) as caught:
        open_regular(out / "params" / "wpe" / "0.0", output=out)
    assert str(caught.value) == f"{out}/params/wpe: a symbolic link, not a directory of the output: refused"


@pytest.mark.parametrize("dtype", [["<f4"], {"name": "<f4"}])
def test_a_zarray_dtype_that_is_not_a_string_is_one_line(out, capfd, dtype):
    zarray(out, "wte", dtype=dtype)
    refused(out, capfd, f"{out}/params/wte/.zarray: dtype {dtype!r} but port/metadata says float32[101,64]")


@pytest.mark.parametrize("what", ["empty", "file", "missing", "orbax", "orbax-no-ocdbt"])
def test_something_else_is_not_a_port_output(good, tmp_path, capfd, what):
    import orbax.checkpoint as ocp

    out = tmp_path / "other"
    if what == "empty":
        out.mkdir()
        expected = "not a port output (no port/metadata)"
    elif what == "file":
        out.write_text("x")
        expected = "not a port output (a file, not a directory)"
    elif what == "missing":
        expected = "does not exist"
    else:  # another Orbax checkpoint beside port's metadata
        out.mkdir()
        shutil.copytree(good[0] / "port", out / "port")
        handler = ocp.PyTreeCheckpointHandler(use_ocdbt=what == "orbax")
        with ocp.Checkpointer(handler) as checkpointer:
            checkpointer.save(out / "params", args=ocp.args.PyTreeSave({"x": jnp.ones(3)}))
        if what == "orbax":
            expected = "params/_METADATA: arrays not stored as port writes them (zarr chunk files, no OCDBT)"
        else:
            expected = "params: holds array 'x', which port/metadata does not list"
    capfd.readouterr()
    refused(out, capfd, expected)


def test_an_output_of_an_earlier_port_is_refused(good, tmp_path, capfd):
    """Format 1 (`port.json` beside `params/`): not a port output this port reads, one line, nothing read."""
    out = tmp_path / "old"
    out.mkdir()
    shutil.copytree(good[0] / "params", out / "params")
    meta = json.loads((good[0] / "port" / "metadata").read_text())
    (out / "port.json").write_text(json.dumps(meta | {"format": 1}))
    message = refused(out, capfd)
    assert message == f"{out}: not a port output (no port/metadata)", message


@pytest.mark.slow
@pytest.mark.parametrize("params", ["port's", "ocdbt", "none"])
def test_an_output_of_another_format_is_refused_in_one_line(good, tmp_path, capfd, params):
    """Format 2 (the arrays in an OCDBT database), or any format but 3: one line, before params/ is looked at."""
    import orbax.checkpoint as ocp

    out = tmp_path / "old"
    shutil.copytree(good[0], out)
    if params != "port's":
        shutil.rmtree(out / "params")
    if params == "ocdbt":  # as format 2 stored them
        with ocp.Checkpointer(ocp.PyTreeCheckpointHandler(use_ocdbt=True)) as checkpointer:
            checkpointer.save(out / "params", args=ocp.args.PyTreeSave({"wte": jnp.ones((101, 64))}))
    edit(out, lambda m: m.update(format=2))
    message = refused(out, capfd)
    assert message == f"{out}/port/metadata: format 2 is not 3, the one this port reads", message
    if params == "port's":  # the command line reading it (`port export`): the same line, exit 1, nothing written
        one_line(run_port("export", out, "--out", tmp_path / "hf"), "format 2 is not 3, the one this port reads")
        assert not (tmp_path / "hf").exists()


@pytest.mark.slow
def test_a_bad_output_leaves_stderr_clean_to_the_end(good, tmp_path):
    """In a fresh process, failed checks and failed reads print nothing, not even after restore has returned."""
    outs = []
    for name, damage in [
        ("no-zarray", lambda out: (out / "params" / "wte" / ".zarray").unlink()),
        ("no-chunk", lambda out: (out / "params" / "wpe" / "0.3").unlink()),
        ("cut", lambda out: truncate(out / "params" / "blocks.mlp.w_fc" / "0.0.1", 1000)),
        ("late-0", lambda out: None),
        ("late-1", lambda out: None),
    ]:
        out = Path(shutil.copytree(good[0], tmp_path / name))
        damage(out)
        outs.append(str(out))
    code = textwrap.dedent(f"""
        import os, time, port, port._output._restore
        real = port._output._restore._open_arrays
        def open_then_cut(output):  # a chunk cut short after the checks, as another process might
            result = real(output)
            if output.directory.name.startswith("late"):
                os.truncate(output.directory / "params" / "wte" / "0.1", 100)
            return result
        port._output._restore._open_arrays = open_then_cut
        for out in {outs!r}:
            port._output._restore.READ_AHEAD_BYTES = 0 if out.endswith("1") else 1 << 30
            try:
                port.restore(out, "1x1")
            except port.PortError as e:
                print("refused:", e)
        time.sleep(1)
    """)
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=port_env(), timeout=120)
    assert result.returncode == 0 and result.stderr == "", result.stderr
    lines = result.stdout.splitlines()
    assert len(lines) == 5 and all(line.startswith("refused: ") for line in lines), result.stdout
    assert [line.split(":")[1].strip() for line in lines] == [
        f"{outs[0]}/params/wte/.zarray",
        f"{outs[1]}/params/wpe/0.3",
        f"{outs[2]}/params/blocks.mlp.w_fc/0.0.1",
        f"{outs[3]}/params",
        f"{outs[4]}/params",
    ], result.stdout
    assert all("leaf 'wte': cannot be read (0.1: truncated since" in line for line in lines[3:]), result.stdout


# 5. Good outputs: exactly what Orbax itself restores, any dtype, any mesh.


def test_stray_files_are_never_opened(good, tmp_path):
    """Only the files the checks name are opened: a FIFO beside them (which would block a reader) is not."""
    out = Path(shutil.copytree(good[0], tmp_path / "out"))
    for fifo in [
        out / "params" / "fifo",
        out / "params" / "wte" / "0.4",
        out / "params" / "wte" / "1.0",
        out / "params" / "wpe" / ".zattrs",
        out / "port" / "fifo",
    ]:
        os.mkfifo(fifo)
    model = port.restore(out, "2x4")
    assert np.abs(logits(model, INPUT_IDS) - good[1]).max() < 1e-5


def rechunk(out: Path, name: str, array: np.ndarray, chunks: tuple) -> None:
    """Store `array` as leaf `name` in `chunks`, as zarr does: edge chunks full size, padded (here with NaN bytes)."""
    folder = out / "params" / name
    shutil.rmtree(folder)
    folder.mkdir()
    zarray_fields = {
        "chunks": list(chunks),
        "compressor": None,
        "dimension_separator": ".",
        "dtype": "<f4",
        "fill_value": None,
        "filters": None,
        "order": "C",
        "shape": list(array.shape),
        "zarr_format": 2,
    }
    (folder / ".zarray").write_text(json.dumps(zarray_fields))
    for index in itertools.product(*(range(-(-n // c)) for n, c in zip(array.shape, chunks))):
        piece = array[tuple(slice(i * c, (i + 1) * c) for i, c in zip(index, chunks))]
        chunk = np.full(chunks, np.nan, np.float32)
        chunk[tuple(slice(0, n) for n in piece.shape)] = piece
        (folder / ".".join(map(str, index))).write_bytes(chunk.tobytes())


def test_an_output_chunked_otherwise_restores_the_same(good, tmp_path):
    """Chunks that are not the blocks of any mesh, edge chunks padded: each block reads only its
    values, never the padding; stock Orbax reads the same arrays from the same files."""
    import orbax.checkpoint as ocp

    out = Path(shutil.copytree(good[0], tmp_path / "out"))
    before = {
        p: np.asarray(a) for p, a in port._skeleton.leaves(port.restore(out, "1x1")).items() if isinstance(a, jax.Array)
    }
    rechunk(out, "wte", before["wte"], (50, 64))  # three chunks, the last 49 rows of padding
    rechunk(out, "blocks.attn.wq", before["blocks.attn.wq"], (1, 48, 3, 16))  # padded along two axes
    assert len(data_files(out)) == 96 - 4 - 8 + 3 + 8
    for mesh in ["2x4", "8x1", "1x1"]:
        after = {p: a for p, a in port._skeleton.leaves(port.restore(out, mesh)).items() if isinstance(a, jax.Array)}
        assert set(after) == set(before)
        for path, array in after.items():
            np.testing.assert_array_equal(np.asarray(array), before[path], err_msg=f"{mesh} {path}")
    theirs = ocp.StandardCheckpointer().restore(out / "params")
    np.testing.assert_array_equal(np.asarray(theirs["wte"]), before["wte"])
    np.testing.assert_array_equal(np.asarray(theirs["blocks"]["attn"]["wq"]), before["blocks.attn.wq"])


@pytest.mark.parametrize("read_ahead", [None, 0, 20_000])
def test_restore_reads_what_orbax_restores_bit_for_bit(good, monkeypatch, read_ahead):
    """Whatever the reads in flight: all leaves at once, one at a time, a few."""
    import orbax.checkpoint as ocp

    if read_ahead is not None:
        monkeypatch.setattr(port._output._restore, "READ_AHEAD_BYTES", read_ahead)
    ours = port.restore(good[0], "2x4")
    theirs = ocp.StandardCheckpointer().restore(good[0] / "params")
    flat = {
        ".".join(str(getattr(k, "key", k)) for k in path): a
        for path, a in jax.tree_util.tree_flatten_with_path(theirs)[0]
    }
    mine = {p: a for p, a in port._skeleton.leaves(ours).items() if isinstance(a, jax.Array)}
    assert set(mine) == set(flat)
    for path, array in mine.items():
        assert array.dtype == flat[path].dtype
        np.testing.assert_array_equal(np.asarray(array), np.asarray(flat[path]), err_msg=path)


@pytest.mark.slow
def test_stock_orbax_restores_the_output_without_port(good, tmp_path):
    """An ordinary Orbax checkpoint: a process that never imports port restores both items with
    Orbax's own CompositeCheckpointHandler; the arrays equal port's, the metadata is plain JSON."""
    code = textwrap.dedent(f"""
        import json, sys
        import jax
        jax.config.update("jax_num_cpu_devices", 8)  # the arrays come back on the mesh they were saved from
        import numpy as np
        import orbax.checkpoint as ocp

        restored = ocp.Checkpointer(ocp.CompositeCheckpointHandler()).restore({str(good[0])!r})
        flat = {{".".join(k.key for k in path): np.asarray(a)
                 for path, a in jax.tree_util.tree_flatten_with_path(restored["params"])[0]}}
        np.savez({str(tmp_path / "arrays.npz")!r}, **flat)
        with open({str(tmp_path / "port.json")!r}, "w") as f:
            json.dump(restored["port"], f)
        assert not [name for name in sys.modules if name.split(".")[0] == "port"]
    """)
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=port_env(), timeout=120)
    assert result.returncode == 0, result.stderr
    theirs = np.load(tmp_path / "arrays.npz")
    mine = {p: a for p, a in port._skeleton.leaves(port.restore(good[0], "1x1")).items() if isinstance(a, jax.Array)}
    assert set(theirs.files) == set(mine)
    for path, array in mine.items():
        assert theirs[path].dtype == array.dtype, path
        np.testing.assert_array_equal(theirs[path], np.asarray(array), err_msg=path)
    metadata = json.loads((tmp_path / "port.json").read_text())
    assert metadata == json.loads((good[0] / "port" / "metadata").read_text())
    assert metadata["format"] == 3 and set(metadata["leaves"]) == set(mine)


def test_a_bfloat16_output_restores_as_bfloat16(gpt2_checkpoints, tmp_path):
    directories, _ = gpt2_checkpoints
    with port.open_checkpoint(directories["lm"]) as ckpt:
        model = port.load(directories["lm"], mesh="4x2", dtype="bfloat16")
        port.save(model, tmp_path / "bf16", port.mapping_for(ckpt.config), ckpt.config)
    restored = port.restore(tmp_path / "bf16", "8x1")
    assert restored.wte.dtype == jnp.bfloat16
    assert restored.blocks.attn.wq.sharding.spec == jax.sharding.PartitionSpec(None, "data", "model", None)
    for a, b in zip(jax.tree_util.tree_leaves(model), jax.tree_util.tree_leaves(restored)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
