"""Each kind of bad input raises its own `PortError` subclass, so callers can tell them apart.

The CLI's one-line contract is the base class's; these check the kinds from Python,
on the tiny GPT-2 of `examples/` (the `tiny` fixture), changed one way at a time.
"""

import json
from pathlib import Path

import pytest

import port

GPT2 = Path(__file__).resolve().parents[1] / "mappings" / "gpt2.toml"


def test_every_kind_is_a_port_error():
    kinds = [port.CheckpointError, port.MappingError, port.ConfigError, port.PlanError, port.OutputError, port.RunError]
    assert all(issubclass(kind, port.PortError) for kind in kinds)
    assert len(set(kinds)) == len(kinds)


def test_a_corrupt_header_is_a_checkpoint_error(tiny):
    model = tiny()
    data = bytearray((model / "model.safetensors").read_bytes())
    data[8:9] = b"["  # the header's JSON no longer parses
    (model / "model.safetensors").write_bytes(bytes(data))
    with pytest.raises(port.CheckpointError, match="model.safetensors"):
        port.load(model)


def test_a_broken_mapping_is_a_mapping_error(tiny, tmp_path):
    model = tiny()
    bad = tmp_path / "bad.toml"
    bad.write_text(GPT2.read_text().replace("[params]", "[params", 1))
    with pytest.raises(port.MappingError, match="bad.toml: invalid TOML"):
        port.load(model, mapping=bad)


def test_a_config_the_model_cannot_build_is_a_config_error(tiny):
    model = tiny()
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps(config | {"n_head": "four"}))
    with pytest.raises(port.ConfigError, match="n_head"):
        port.load(model)


def test_a_plan_error_lists_every_problem(tiny, tmp_path):
    model = tiny()
    text = GPT2.read_text()
    # two entries that name keys the checkpoint does not have
    bad = tmp_path / "renamed.toml"
    bad.write_text(text.replace('"wte.weight"', '"wte.weights"').replace('"wpe.weight"', '"wpe.weights"'))
    with pytest.raises(port.PlanError) as caught:
        port.load(model, mapping=bad)
    problems = caught.value.problems
    assert len(problems) >= 2, problems
    assert any("wte.weights" in p for p in problems) and any("wpe.weights" in p for p in problems), problems
    assert str(caught.value).startswith(problems[0])
    assert f"(and {len(problems) - 1} more problem{'s' if len(problems) > 2 else ''})" in str(caught.value)


def test_an_output_that_exists_is_an_output_error(tiny, tmp_path):
    model = tiny()
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(port.OutputError, match="already exists"):
        port.convert(model, out=out)


def test_agreement_outside_a_run_is_a_no_op_and_the_store_needs_one():
    port.agree({"--mesh": "1x1"})  # one process: nothing to agree with
    from port._runtime import _store

    with pytest.raises(port.RunError, match="port.initialize"):
        _store()


@pytest.mark.parametrize(
    "call, python",
    [
        (lambda: port.mesh_shape("2x3x"), "mesh='2x3x': expected DATAxMODEL"),
        (lambda: port.initialize("nohost", 2, 0), "coordinator='nohost': expected HOST:PORT"),
        (lambda: port.initialize("h:1", 2, 5), "process_id=5: expected 0 <= I < num_processes=2"),
        (lambda: port.initialize("h:1", 2, 0, timeout=-1), "timeout=-1: expected a positive number of seconds"),
        (lambda: port.initialize("h:1", 2), "a multi-process run needs all of coordinator=HOST:PORT, num_processes=N"),
    ],
)
def test_python_callers_read_parameter_names(call, python):
    """Issue 23 row 3: the library's messages name its parameters (the command line shows flags)."""
    with pytest.raises(port.PortError) as caught:
        call()
    assert str(caught.value).startswith(python) and "--" not in str(caught.value), str(caught.value)
