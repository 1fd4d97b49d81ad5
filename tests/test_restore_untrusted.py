"""`port.restore` of an untrusted output: it imports nothing the output names but port's
own models, checks every field and size before reading an array, and turns every
corrupt, truncated, foreign or half-deleted output into one `PortError` line naming
the directory (and the leaf), with nothing on stderr.
"""

import json
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
from helpers import INPUT_IDS, port_env
from port._errors import OutputError
from port.models.gpt2 import GPT2

GPT2_MODEL = 'model = "port.models.gpt2:GPT2"'


@pytest.fixture(scope="module")
def good(gpt2_checkpoints, tmp_path_factory):
    """A GPT-2 output written from a 4x2 mesh, and its logits."""
    directories, _ = gpt2_checkpoints
    out = tmp_path_factory.mktemp("good") / "gpt2"
    with port.open_checkpoint(directories["lm"]) as ckpt:
        model = port.load(directories["lm"], mesh="4x2")
        port.save(model, out, port.mapping_for(ckpt.config), ckpt.config)
    return out, logits(model)


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


@eqx.filter_jit
def forward(model, ids):
    return model(ids)


def logits(model):
    return np.asarray(forward(model, INPUT_IDS))


# 1. Nothing an output names is imported, but port's own models.


@pytest.fixture
def evil(tmp_path, monkeypatch):
    """`evil.py` in the working directory and on sys.path; importing it writes `imported`."""
    (tmp_path / "evil.py").write_text(textwrap.dedent("""
        from pathlib import Path
        Path(__file__).with_name("imported").write_text("evil ran")
        from port.models.gpt2 import GPT2 as Model
        Ref = Model
    """))
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
        "no other module an output names; pass the class: port.restore(directory, mesh, model=YourModel)"
    )
    assert not evil.exists() and "evil" not in sys.modules
    proves_importable(evil)


@pytest.mark.parametrize("spec", [
    "os:system", "port._restore:restore", "port.models._config:MISSING", "port.models.gpt2.evil:Model",
    "port.models.evil:Model", "port.models.gpt2:_normal", "port.models.gpt2:jax", "port.models.gpt2:GPT2Config",
    "port.models.gpt2:GPT2\\nport: done",
])
def test_only_model_classes_of_port_models_are_imported(out, capfd, spec):
    edit(out, lambda m: m.update(mapping=m["mapping"].replace(GPT2_MODEL, f'model = "{spec}"')))
    refused(out, capfd, "port/metadata: model ")


def test_a_class_passed_is_used_and_nothing_is_imported(out, evil, good, capfd):
    """With `model`, the class the output names is neither imported nor compared: the leaves are."""
    edit(out, lambda m: m.update(mapping=m["mapping"].replace(GPT2_MODEL, 'model = "evil:Model"')))
    model = port.restore(out, "2x4", model=GPT2)
    assert type(model) is GPT2 and np.abs(logits(model) - good[1]).max() < 1e-5
    assert not evil.exists() and "evil" not in sys.modules
    expected = r"^`model`: expected a class with from_config\(config, \*, key\), got 'port"
    with pytest.raises(port.PortError, match=expected):
        port.restore(out, "2x4", model="port.models.gpt2:GPT2")
    proves_importable(evil)


def test_the_mapping_reference_is_never_imported(out, evil, good):
    edit(out, lambda m: m.update(mapping=m["mapping"].replace("transformers:GPT2LMHeadModel", "evil:Ref")))
    model = port.restore(out, "1x1")
    assert np.abs(logits(model) - good[1]).max() < 1e-5
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
        out, capfd, "port/metadata: leaf 'extra' of WithExtra built from its config is missing, and the mapping "
        "does not mark it optional", model=WithExtra,
    )


# 2. port/metadata: every field, and its agreement with the skeleton and the stored arrays.


def leaf(name, **fields):
    return lambda m: m["leaves"][name].update(fields)


@pytest.mark.parametrize("change, expected", [
    (lambda m: m.update(format=1), "port/metadata: format 1 is not 2"),
    (lambda m: m.update(format="2"), "port/metadata: format '2' is not 2"),
    (lambda m: m.update(format=True), "port/metadata: format True is not 2"),
    (lambda m: m.update(format=2.0), "port/metadata: format 2.0 is not 2"),
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
    (lambda m: m.update(mapping='model = "port.models.gpt2:GPT2"\nrules = [1]\n'), "port/metadata: mapping: [rules] must be a table"),
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
    (lambda m: m["leaves"].update(foo=m["leaves"]["wte"]), "leaf 'foo' has no entry in the output's mapping"),
    (lambda m: m["leaves"].pop("wpe"), "params: holds array 'wpe', which port/metadata does not list"),
    (lambda m: m.update(mapping=m["mapping"].replace('embed = "data"', 'embed = "tensor"')),
     "port/metadata: mapping rules.embed names mesh axis 'tensor', which the mesh (data, model) does not have"),
])
def test_port_metadata_is_checked_field_by_field(out, capfd, change, expected):
    refused(edit(out, change), capfd, expected)


@pytest.mark.parametrize("text, expected", [
    (b"", "port/metadata: not valid JSON (Expecting value"),
    (b"[1, 2]", "port/metadata: expected a JSON object, got list"),
    (b"[" * 100_000 + b"]" * 100_000, "port/metadata: not valid JSON (nested too deeply)"),
    (b'{"format": 1, "config": {"x": "\xff"}}', "port/metadata: not valid JSON ("),
    (b'{"format": 1' + b"0" * 5000 + b"}", "port/metadata: not valid JSON ("),
])
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


@pytest.mark.parametrize("change, expected", [
    # port/metadata's shape disagrees with the skeleton built from its config
    (leaf("wte", shape=[100, 64]), "port/metadata: leaf 'wte' is float32[100,64] but float32[101,64] in GPT2 built"),
    (leaf("wte", dtype="int32"), "port/metadata: leaf 'wte' is int32[101,64] but float32[101,64] in GPT2 built"),
    # the config disagrees with the leaves
    (lambda m: m["config"].update(n_layer=3), "leaf 'blocks.ln_1.weight' is float32[2,64] but float32[3,64]"),
    (lambda m: m["config"].update(n_head=5), "port/metadata: config: "),
    (lambda m: m["config"].pop("n_embd"), "port/metadata: config: required key 'n_embd' is missing"),
    # port/metadata and its config agree with each other, not with the stored arrays
    (lambda m: (m["config"].update(vocab_size=100), m["leaves"]["wte"].update(shape=[100, 64])),
     "params: leaf 'wte': stored as float32[101,64] but port/metadata says float32[100,64]"),
    (leaf("wpe", dtype="bfloat16"),
     "params: leaf 'wpe': stored as float32[32,64] but port/metadata says bfloat16[32,64]"),
])
def test_port_metadata_must_agree_with_the_model_and_the_arrays(out, capfd, change, expected):
    refused(edit(out, change), capfd, expected)


def test_sizes_are_bounded_before_anything_is_built(out, capfd):
    """Shapes larger than the bytes stored, and config values larger than the values stored."""
    meta = json.loads((out / "port" / "metadata").read_text())
    total = sum(np.prod(leaf["shape"]) for leaf in meta["leaves"].values())
    edit(out, leaf("wte", shape=[10**9, 64]))
    declared = (total + (10**9 - 101) * 64) * 4
    refused(out, capfd, f"port/metadata: declares {declared} bytes of arrays but {out}/params holds only")
    edit(out, leaf("wte", shape=[101, 64]))
    edit(out, lambda m: m["config"].update(n_embd=10**12))
    refused(
        out, capfd, "port/metadata: config 'n_embd' is 1000000000000, more than the 1048576 values the output holds"
    )
    edit(out, lambda m: m["config"].update(n_embd=64, rope_scaling={"factor": [1, -(10**30)]}))
    refused(out, capfd, "port/metadata: config 'rope_scaling.factor[1]' is")
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


def test_the_declared_size_check_counts_what_the_model_holds(good):
    """The byte bound is not vacuous: the good output declares close to all it stores."""
    directory = good[0]
    stored = sum(f.stat().st_size for f in (directory / "params").rglob("*") if f.is_file())
    meta = json.loads((directory / "port" / "metadata").read_text())
    declared = sum(np.prod(leaf["shape"]) * 4 for leaf in meta["leaves"].values())
    assert 0.8 * stored < declared < stored


# 3. Corrupt, truncated, foreign and half-deleted outputs.


def data_files(out: Path) -> list[Path]:
    return sorted((out / "params").glob("ocdbt.process_*/d/*"), key=lambda f: f.stat().st_size)


def truncate(path: Path, size: int) -> None:
    with open(path, "r+b") as f:
        f.truncate(size)


@pytest.mark.parametrize("damage, expected", [
    (lambda out: shutil.rmtree(out / "params"), "params: missing or not a directory (an incomplete port output)"),
    (lambda out: (out / "params" / "_METADATA").unlink(), "params/_METADATA: missing (Orbax's metadata)"),
    (lambda out: (out / "params" / "_METADATA").write_text("{"), "params/_METADATA: not valid JSON"),
    (lambda out: (out / "params" / "_METADATA").write_text("[]"), "params/_METADATA: not Orbax's PyTree metadata"),
    (lambda out: (out / "params" / "manifest.ocdbt").unlink(), "params: leaf 'wte': cannot be opened (NOT_FOUND"),
    (lambda out: truncate(out / "params" / "manifest.ocdbt", 20), "params: leaf 'wte': cannot be opened ("),
    (lambda out: shutil.rmtree(out / "params" / "d"), "params: leaf 'wte': cannot be opened (NOT_FOUND"),
    (lambda out: shutil.rmtree(out / "params" / "ocdbt.process_0"), "params: leaf 'wte': cannot be read ("),
    (lambda out: data_files(out)[-1].unlink(), "params: leaf '"),
    (lambda out: truncate(data_files(out)[-1], 1000), "params: leaf '"),
    (lambda out: truncate(data_files(out)[-1], 0), "params: leaf '"),
    (lambda out: os.mkfifo(out / "params" / "d" / "fifo"), "params/d/fifo: not a regular file"),
    (lambda out: (out / "params" / "link").symlink_to(out / "params" / "d"), "params/link: a symbolic link to a dir"),
    (lambda out: (out / "params" / "dangling").symlink_to(out / "nowhere"), "params/dangling: cannot be read"),
])
def test_a_damaged_output_is_one_line(out, capfd, damage, expected):
    damage(out)
    refused(out, capfd, expected)


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


@pytest.mark.parametrize("read_ahead", [None, 0])
def test_every_data_file_deleted_or_cut_is_one_line_naming_a_leaf(good, tmp_path, capfd, monkeypatch, read_ahead):
    """Or, for a file of the process's own tree that the merged root no longer reads, the same model."""
    if read_ahead is not None:
        monkeypatch.setattr(port._restore, "READ_AHEAD_BYTES", read_ahead)
    expected = logits(port.restore(good[0], "1x1"))
    refusals = []
    for i in range(len(data_files(good[0]))):
        for cut in (None, 0, 7):
            out = Path(shutil.copytree(good[0], tmp_path / f"out{i}-{cut}"))
            victim = data_files(out)[i]
            victim.unlink() if cut is None else truncate(victim, cut)
            try:
                model = port.restore(out, "1x1")
            except port.PortError:
                refusals.append(i)
                refused(out, capfd, f"{out}/params: leaf '", "cannot be read (")
            else:
                np.testing.assert_array_equal(logits(model), expected)
    assert refusals.count(len(data_files(good[0])) - 1) == 3  # the largest file holds the arrays


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
        expected = "holds array 'x'" if what == "orbax" else "not stored as port writes them"
    capfd.readouterr()
    refused(out, capfd, expected)


def test_an_output_of_an_earlier_port_is_refused_with_what_to_do(good, tmp_path, capfd):
    """Format 1 (`port.json` beside `params/`): one line saying to convert again, nothing read."""
    out = tmp_path / "old"
    out.mkdir()
    shutil.copytree(good[0] / "params", out / "params")
    meta = json.loads((good[0] / "port" / "metadata").read_text())
    (out / "port.json").write_text(json.dumps(meta | {"format": 1}))
    message = refused(out, capfd, "written by an earlier port (format 1, port.json)")
    assert message.endswith("this port reads format 2: convert the checkpoint again"), message


def test_a_bad_output_leaves_stderr_clean_to_the_end(good, tmp_path):
    """In a fresh process, failed reads print nothing, not even after restore has returned."""
    outs = []
    for name, damage in [("no-root", lambda out: shutil.rmtree(out / "params" / "d")),
                         ("no-data", lambda out: shutil.rmtree(out / "params" / "ocdbt.process_0")),
                         ("cut", lambda out: truncate(data_files(out)[-1], 1000))]:
        out = Path(shutil.copytree(good[0], tmp_path / name))
        damage(out)
        outs.append(str(out))
    code = textwrap.dedent(f"""
        import time, port
        for out in {outs!r}:
            try:
                port.restore(out, "1x1")
            except port.PortError as e:
                print("refused:", e)
        time.sleep(1)
    """)
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=port_env(), timeout=120)
    assert result.returncode == 0 and result.stderr == "", result.stderr
    lines = result.stdout.splitlines()
    assert len(lines) == 3 and all(line.startswith("refused: ") for line in lines), result.stdout


# 5. Good outputs: exactly what Orbax itself restores, any dtype, any mesh.


def test_an_output_of_links_to_files_restores(good, tmp_path):
    """As the Hugging Face cache stores a download: every file a symbolic link to a blob."""
    blobs, out = tmp_path / "blobs", tmp_path / "snapshot"
    shutil.copytree(good[0], blobs)
    out.mkdir()
    for path in sorted(blobs.rglob("*")):
        target = out / path.relative_to(blobs)
        target.mkdir(parents=True, exist_ok=True) if path.is_dir() else target.symlink_to(path)
    model = port.restore(out, "2x4")
    assert np.abs(logits(model) - good[1]).max() < 1e-5


@pytest.mark.parametrize("read_ahead", [None, 0, 20_000])
def test_restore_reads_what_orbax_restores_bit_for_bit(good, monkeypatch, read_ahead):
    """Whatever the reads in flight: all leaves at once, one at a time, a few."""
    import orbax.checkpoint as ocp

    if read_ahead is not None:
        monkeypatch.setattr(port._restore, "READ_AHEAD_BYTES", read_ahead)
    ours = port.restore(good[0], "2x4")
    theirs = ocp.StandardCheckpointer().restore(good[0] / "params")
    flat = {".".join(str(getattr(k, "key", k)) for k in path): a
            for path, a in jax.tree_util.tree_flatten_with_path(theirs)[0]}
    mine = {p: a for p, a in port._skeleton.leaves(ours).items() if isinstance(a, jax.Array)}
    assert set(mine) == set(flat)
    for path, array in mine.items():
        assert array.dtype == flat[path].dtype
        np.testing.assert_array_equal(np.asarray(array), np.asarray(flat[path]), err_msg=path)


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
    assert metadata["format"] == 2 and set(metadata["leaves"]) == set(mine)


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
