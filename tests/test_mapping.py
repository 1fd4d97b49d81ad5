"""Mapping files: parsing errors, the shipped files in the wheel, a user's own module, and files that are
not what a mapping is (a FIFO, not UTF-8, nested deep, a `model` that is not a class): one line each."""

import os
import re
import zipfile
from pathlib import Path

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import port
import port._mapping
import port._transforms

from helpers import one_line, run_port, write_checkpoint

ROOT = Path(__file__).parents[1]


@pytest.mark.parametrize(
    "text, message",
    [
        ("model = ", "invalid TOML"),
        ('model = "x"\n[[params]]\nkey="a"\npath="b"\naxes=[]', "'model' must be"),
        ('model = "m:C"\nfoo = 1', "unknown key 'foo'"),
        ('model = "m:C"', r"no \[\[params\]\]"),
        ('model = "m:C"\n[[params]]\nkey="a"\npath="b"', "'axes' must be"),
        ('model = "m:C"\n[[params]]\nkey="a"\npath="b"\naxes=[]\ntransforms=[{rotate=1}]', "unknown transform"),
        (
            'model = "m:C"\n[[params]]\nkey="a"\npath="b"\naxes=[]\noptional="sometimes"',
            r"params\[0\] \(a\): 'optional' must be \"model\", \"checkpoint\", true \(either\) or false",
        ),
        ('model = "m:C"\n[[params]]\nkey="a"\npath="b"\naxes=[]\ntransforms=[{cast="float12"}]', "unknown dtype"),
        (
            'model = "m:C"\n[[params]]\nkey="a"\npath="b"\naxes=[]\ntransforms=[{transpose=[1,0], cast="int8"}]',
            r"params\[0\] \(a\): each transform is a one-key table",
        ),
        (
            'model = "m:C"\n[[params]]\nkey="a"\npath="b"\naxes=[]\ntransforms=[{transpose=[true]}]',
            r"params\[0\] \(a\): transpose takes a permutation such as \[1, 0\]",
        ),
        (
            'model = "m:C"\n[[params]]\nkey="a"\npath="b"\naxes=[]\ntransforms=[{reshape=[1.5]}]',
            r"params\[0\] \(a\): reshape takes a list of sizes, -1 or config names",
        ),
        (
            'model = "m:C"\n[[params]]\nkey="a"\npath="b"\naxes=[]\ntransforms=[{split={axis=0,index=0}}]',
            r"params\[0\] \(a\): split needs exactly one of 'parts' or 'sizes'",
        ),
        (
            'model = "m:C"\n[[params]]\nkey="a"\npath="b"\naxes=[]\ntransforms=[{rotate=1}]',
            r"params\[0\] \(a\): rotate: unknown transform \(expected transpose, reshape, split, cast or stride\)",
        ),
        (
            'model = "m:C"\n[[params]]\nkey="a"\npath="b"\naxes=[]\n[[params]]\nkey="c"\npath="b"\naxes=[]',
            "path 'b' is filled by both",
        ),
        ('model = "m:C"\nconfig = 3\n[[params]]\nkey="a"\npath="b"\naxes=[]', "'config' must be the config.json key"),
        (
            'model = "m:C"\nmodel_types = ["t5"]\narchitectures = { mt5 = ["MT5EncoderModel"] }\n'
            '[[params]]\nkey="a"\npath="b"\naxes=[]',
            r"architectures.mt5: 'mt5' is not one of the mapping's model_types",
        ),
        (
            'model = "m:C"\nmodel_types = ["t5"]\narchitectures = { t5 = "T5EncoderModel" }\n'
            '[[params]]\nkey="a"\npath="b"\naxes=[]',
            r"architectures.t5 must be a non-empty list of class names",
        ),
    ],
)
def test_malformed_mappings(text, message):
    with pytest.raises(port.PortError, match=message) as info:
        port.parse_mapping(text, "bad.toml")
    assert str(info.value).startswith("bad.toml: ") and "\n" not in str(info.value)


def test_shipped_mapping_is_found_by_model_type():
    assert port.mapping_for({"model_type": "gpt2"}).model == "port.models.gpt2:GPT2"
    with pytest.raises(port.PortError, match="model_type 'bert-ish' has no mapping"):
        port.mapping_for({"model_type": "bert-ish"})


FULL = 'model = "m:Full"\nmodel_types = ["pair"]\narchitectures = { pair = ["PairModel"] }\n'
TOWER = (
    'model = "m:Tower"\nmodel_types = ["pair_vision", "pair"]\nconfig = "vision_config"\n'
    'architectures = { pair = ["PairVisionModel"], pair_vision = ["PairVisionModel"] }\n'
)
ENTRY = '[[params]]\nkey="a"\npath="b"\naxes=[]\n'


def test_several_mappings_of_one_model_type_are_chosen_by_the_class_config_json_names(tmp_path, monkeypatch):
    """Shipped mappings listing one model_type (a dual model and its tower): the one whose
    `architectures` name config.json's class, else the first by file name; by name, any."""
    (tmp_path / "pair.toml").write_text(FULL + ENTRY)
    (tmp_path / "pair_vision.toml").write_text(TOWER + ENTRY)
    monkeypatch.setattr(port._mapping, "shipped_mappings", lambda: sorted(tmp_path.glob("*.toml")))
    pick = lambda **config: port.mapping_for({"model_type": "pair", **config}).model  # noqa: E731
    assert pick(architectures=["PairModel"]) == "m:Full"
    assert pick(architectures=["PairVisionModel"]) == "m:Tower"
    assert pick() == pick(architectures=["SomethingElse"]) == "m:Full"
    assert port.mapping_for({"model_type": "pair"}, "pair_vision").model == "m:Tower"
    tower = type("Tower", (), {"__module__": "m"})  # a model at hand (an export's): its own mapping first
    assert port.mapping_for({"model_type": "pair", "architectures": ["PairModel"]}, built=tower).model == "m:Tower"
    assert port.load_mapping("pair_vision").source == str(tmp_path / "pair_vision.toml")
    with pytest.raises(port.MappingError, match=r"^pair_visio: no such mapping file, nor a shipped mapping of that "):
        port.load_mapping("pair_visio")


def test_a_tower_is_built_from_and_written_as_its_own_config():
    """`config` names the dual model's key holding the tower's config; an export writes that,
    saying the tower's class; a standalone tower's config.json is its own."""
    tower = port.parse_mapping(TOWER + ENTRY, "tower.toml")
    dual = {
        "model_type": "pair",
        "architectures": ["PairModel"],
        "dtype": "float32",
        "text_config": {"model_type": "pair_text", "hidden_size": 8},
        "vision_config": {"model_type": "pair_vision", "hidden_size": 4},
    }
    assert tower.model_config(dual) == {"model_type": "pair_vision", "hidden_size": 4}
    assert port.mapping_for(dual, tower, keys=["vision_model.a", "text_model.a"]) is tower  # not fitted as a wrapper
    assert tower.written_config(dual) == {
        "model_type": "pair_vision",
        "hidden_size": 4,
        "dtype": "float32",
        "architectures": ["PairVisionModel"],
    }
    alone = {"model_type": "pair_vision", "architectures": ["Other"], "hidden_size": 4}
    assert tower.model_config(alone) is alone
    assert tower.written_config(alone) == alone | {"architectures": ["PairVisionModel"]}
    assert port.parse_mapping('model = "m:C"\n' + ENTRY, "plain.toml").written_config(alone) is None


def test_wheel_carries_the_mappings(tmp_path):
    from hatchling.builders.wheel import WheelBuilder

    (wheel,) = WheelBuilder(str(ROOT)).build(directory=str(tmp_path), versions=["standard"])
    names = zipfile.ZipFile(wheel).namelist()
    assert "port/mappings/gpt2.toml" in names
    assert "port/models/gpt2.py" in names


class Tiny(eqx.Module):
    """A user's own module: nothing port ships knows about it."""

    up: jax.Array
    down: jax.Array
    scale: jax.Array

    def __init__(self, hidden: int, inner: int, *, key):
        self.up = jnp.zeros((inner, hidden))
        self.down = jnp.zeros((hidden, inner))
        self.scale = jnp.zeros((2, hidden))


MAPPING = """
model = "unused:Unused"
prefixes = ["net."]
ignore = ["*.num_batches_tracked"]

[rules]
hidden = "data"
inner = "model"
layers = []

[[params]]
key = "fc1.weight"
path = "up"
axes = ["inner", "hidden"]

[[params]]
key = "fc2.weight"
path = "down"
transforms = [{ transpose = [1, 0] }, { cast = "float32" }]
axes = ["hidden", "inner"]

[[params]]
key = "norms.{layer}.scale"
path = "scale"
axes = ["layers", "hidden"]
"""


def test_convert_into_a_users_own_skeleton(tmp_path):
    rng = np.random.default_rng(0)
    tensors = {
        "net.fc1.weight": rng.standard_normal((8, 4)).astype(np.float32),
        "net.fc2.weight": rng.standard_normal((8, 4)).astype(np.float16),
        "net.norms.0.scale": rng.standard_normal(4).astype(np.float32),
        "net.norms.1.scale": rng.standard_normal(4).astype(np.float32),
        "net.bn.num_batches_tracked": np.array(3, np.int64),
    }
    write_checkpoint(tmp_path / "ckpt", tensors, {"model_type": "tiny"})
    (tmp_path / "tiny.toml").write_text(MAPPING)
    skeleton = eqx.filter_eval_shape(Tiny, 4, 8, key=jax.random.key(0))
    model = port.convert(tmp_path / "ckpt", skeleton, tmp_path / "tiny.toml", port.make_mesh("2x2")).model
    np.testing.assert_array_equal(np.asarray(model.up), tensors["net.fc1.weight"])
    np.testing.assert_array_equal(np.asarray(model.down), tensors["net.fc2.weight"].T.astype(np.float32))
    np.testing.assert_array_equal(
        np.asarray(model.scale), np.stack([tensors["net.norms.0.scale"], tensors["net.norms.1.scale"]])
    )
    assert model.up.sharding.spec == P("model", "data")
    assert model.down.sharding.spec == P("data", "model")
    assert model.scale.sharding.spec == P(None, "data")


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda m: m.replace('path = "scale"', 'path = "nope"'), "path 'nope' is not a leaf"),
        (lambda m: m.replace('hidden = "data"', 'hidden = "fsdp"'), "mesh axis 'fsdp'"),
        (lambda m: m.replace("layers = []", ""), "logical axis 'layers' has no rule"),
        (lambda m: m.replace("{ transpose = [1, 0] }, ", ""), "shape mismatch"),
        (lambda m: m.replace('key = "fc1.weight"', 'key = "fc9.weight"'), "no key in the checkpoint matches"),
    ],
)
def test_plan_problems_name_their_entry(tmp_path, change, message):
    tensors = {
        "fc1.weight": np.zeros((8, 4), np.float32),
        "fc2.weight": np.zeros((8, 4), np.float32),
        "norms.0.scale": np.zeros(4, np.float32),
        "norms.1.scale": np.zeros(4, np.float32),
    }
    write_checkpoint(tmp_path / "ckpt", tensors, {"model_type": "tiny"})
    mapping = port.parse_mapping(change(MAPPING), "tiny.toml")
    skeleton = eqx.filter_eval_shape(Tiny, 4, 8, key=jax.random.key(0))
    with port.open_checkpoint(tmp_path / "ckpt") as ckpt, pytest.raises(port.PortError, match=message) as info:
        port.plan(skeleton, mapping, ckpt.tensors, ckpt.config, {"data": 2, "model": 2})
    assert str(info.value).startswith("tiny.toml: ")


def test_rules_and_transforms_of_the_wrong_type_are_one_line():
    entry = '[[params]]\nkey = "wte.weight"\npath = "wte"\naxes = ["vocab", "embed"]\n'
    head = 'model = "port.models.gpt2:GPT2"\n'
    with pytest.raises(port.PortError, match=r"bad.toml: \[rules\] must be a table"):
        port.parse_mapping(head + "rules = 3\n" + entry, "bad.toml")
    with pytest.raises(port.PortError, match=r"bad.toml: params\[0\] \(wte.weight\): 'transforms' must be a list"):
        port.parse_mapping(head + entry + 'transforms = "transpose"\n', "bad.toml")


def test_config_names_resolve_per_entry():
    text = (
        'model = "m:C"\n[[params]]\nkey = "h.{layer}.w"\npath = "w"\naxes = []\n'
        'transforms = [{ split = { axis = 0, sizes = ["n_embd", 4], index = 0 } }, { reshape = ["n_head", -1] }]\n'
    )
    (param,) = port.parse_mapping(text).params
    assert param.transforms == (
        port._transforms.Split(0, 0, sizes=("n_embd", 4)),
        port._transforms.Reshape(("n_head", -1)),
    )
    assert param.build({"n_embd": 8, "n_head": 2}) == [
        port._transforms.Split(0, 0, sizes=(8, 4)),
        port._transforms.Reshape((2, -1)),
    ]
    with pytest.raises(port.PortError, match=r"^mapping entry 'h.\{layer\}.w': config.json has no integer 'n_head'$"):
        param.build({"n_embd": 8})


# ---------------------------------------------------------------- untrusted mapping files (issue 21, rows 12 and 13)


GPT2 = ROOT / "mappings" / "gpt2.toml"
EXAMPLE = ROOT / "examples" / "tiny-gpt2"


def gpt2_with_model(path: Path, model: str) -> Path:
    """The shipped GPT-2 mapping, its `model` changed to `model`, written to `path`."""
    text = GPT2.read_text()
    assert 'model = "port.models.gpt2:GPT2"\n' in text
    path.write_text(text.replace('model = "port.models.gpt2:GPT2"\n', f'model = "{model}"\n', 1))
    return path


def nested(arrays: int) -> str:
    """A mapping whose (unknown) top-level key `x` holds `arrays` arrays nested in each other."""
    return "x = " + "[" * arrays + "]" * arrays + "\n" + GPT2.read_text()


def mapping_refused(path: Path, expected: str, model_class: bool = False) -> None:
    """Loading the mapping at `path` (and importing its model class) is one MappingError line: the file,
    then `expected`."""
    with pytest.raises(port.MappingError) as info:
        mapping = port.load_mapping(path)
        if model_class:
            mapping.model_class()
    message = str(info.value)
    assert message == f"{path}: {expected}", message


@pytest.mark.parametrize(
    "write, expected",
    [
        (
            lambda p: p.write_bytes(GPT2.read_bytes().replace(b"#", b"# caf\xe9", 1)),
            "not UTF-8 text (byte 5 is 0xe9); a mapping is a TOML file",
        ),
        (
            lambda p: p.write_text(nested(100_000)),
            f"invalid TOML: tables and arrays nested more than {port._mapping.MAX_NESTING} deep",
        ),
        (
            lambda p: p.write_text(nested(port._mapping.MAX_NESTING)),
            f"invalid TOML: tables and arrays nested more than {port._mapping.MAX_NESTING} deep",
        ),
        (
            lambda p: p.write_text(nested(port._mapping.MAX_NESTING - 1)),  # the top table and 31 arrays: read
            "unknown key 'x' (expected aliases, architectures, config, export, ignore, model, model_types, params, prefixes, reference, rules, tied)",
        ),
        (lambda p: os.mkfifo(p), "not a regular file (a FIFO); a mapping is a TOML file"),
        (lambda p: p.mkdir(), "not a regular file (a directory); a mapping is a TOML file"),
        (lambda p: None, "cannot read mapping file (No such file or directory)"),
    ],
    ids=[
        "not UTF-8",
        "nested a million deep",
        "nested one too deep",
        "nested just enough",
        "FIFO",
        "directory",
        "missing",
    ],
)
def test_a_mapping_file_that_is_not_toml_text_is_one_line(tmp_path, write, expected):
    path = tmp_path / "bad.toml"
    write(path)
    mapping_refused(path, expected)


def test_a_mapping_file_is_bounded_before_it_is_read(tmp_path, monkeypatch):
    monkeypatch.setattr(port._mapping, "MAX_MAPPING_BYTES", 100)
    path = tmp_path / "big.toml"
    path.write_text(GPT2.read_text())
    mapping_refused(path, f"a mapping file of {path.stat().st_size} bytes, more than port reads (100)")


@pytest.mark.parametrize(
    "model, expected",
    [
        (".gpt2:GPT2", "model '.gpt2:GPT2': expected module:Class, such as port.models.gpt2:GPT2"),
        ("port..gpt2:GPT2", "model 'port..gpt2:GPT2': expected module:Class, such as port.models.gpt2:GPT2"),
        ("os:sep", "model 'os:sep' is a str, not a class (expected module:Class, such as port.models.gpt2:GPT2)"),
        (
            "port.models.gpt2:GPT2.from_config",
            (
                "model 'port.models.gpt2:GPT2.from_config' is a method, not a class "
                "(expected module:Class, such as port.models.gpt2:GPT2)"
            ),
        ),
        (
            "collections:OrderedDict",
            "model 'collections:OrderedDict' is not a model class: it has no from_config(config, *, key)",
        ),
        (
            "port.models.gpt2:Nope",
            ("model 'port.models.gpt2:Nope' cannot be imported (module 'port.models.gpt2' has no attribute 'Nope')"),
        ),
    ],
    ids=["relative", "empty part", "a str", "a method", "no from_config", "missing"],
)
def test_a_model_that_is_not_a_class_is_one_line(tmp_path, model, expected):
    path = gpt2_with_model(tmp_path / "bad.toml", model)
    mapping_refused(path, expected, model_class=True)
    with pytest.raises(port.MappingError, match="^" + re.escape(f"{path}: {expected}") + "$"):
        port.load(EXAMPLE, mapping=path)


@pytest.mark.slow
@pytest.mark.parametrize("command", ["plan", "check"])
def test_a_fifo_as_the_mapping_is_refused_through_the_command(tmp_path, command):
    fifo = tmp_path / "mapping.toml"
    os.mkfifo(fifo)
    args = ("plan", EXAMPLE, "--mapping", fifo) if command == "plan" else ("check", fifo, EXAMPLE)
    one_line(run_port(*args, timeout=120), f"{fifo}: not a regular file (a FIFO); a mapping is a TOML file")


@pytest.mark.slow
@pytest.mark.parametrize(
    "write, expected",
    [
        (lambda p: gpt2_with_model(p, "this:s"), "model 'this:s' is a str, not a class"),  # importing `this` prints
        (lambda p: gpt2_with_model(p, ".gpt2:GPT2"), "model '.gpt2:GPT2': expected module:Class"),
        (lambda p: p.write_text(nested(100_000)), "invalid TOML: tables and arrays nested more than"),
        (lambda p: p.write_bytes(b'model = "caf\xe9"\n'), "not UTF-8 text (byte 12 is 0xe9)"),
    ],
    ids=["this:s", "relative", "deep", "not UTF-8"],
)
def test_bad_mappings_are_one_line_through_the_command(tmp_path, write, expected):
    path = tmp_path / "bad.toml"
    write(path)
    one_line(run_port("plan", EXAMPLE, "--mapping", path, timeout=120), f"{path}: {expected}")


def test_a_leaf_without_elements_is_replicated():
    """A leaf with an empty axis (Mistral Large 4's NoPE layers' rotary key, [layers, 0, embed])
    has nothing to divide: replicated whatever its axes' rules, said in its notes; a leaf with
    elements is sharded by the same rules."""
    from port._plan import partition

    rules, mesh = {"embed": ("data",), "heads": ("model",)}, {"data": 4, "model": 2}
    spec, notes = partition((3, 0, 8), ("layers", "heads", "embed"), rules, mesh)
    assert spec == P(None, None, None) and notes == ("no elements: replicated",)
    assert partition((3, 2, 8), ("layers", "heads", "embed"), rules, mesh) == (P(None, "model", "data"), ())


@pytest.mark.slow
def test_the_command_line_takes_a_shipped_mapping_by_name():
    """`--mapping gpt2` names mappings/gpt2.toml; a name that is neither a file nor a shipped
    mapping is one line listing the shipped ones."""
    ok = run_port("plan", EXAMPLE, "--mapping", "gpt2")
    assert ok.returncode == 0 and "mappings/gpt2.toml" in ok.stdout + ok.stderr, ok.stdout + ok.stderr
    line = one_line(run_port("plan", EXAMPLE, "--mapping", "gtp2"), "gtp2: no such mapping file, nor a shipped mapping")
    assert "t5_encoder" in line and "clip_vision" in line
