"""`{expert}` in a mapping key: experts stacked on their own axis (inside `{layer}`), read slice-aware.

A small module with the shapes of a mixture-of-experts layer, and a checkpoint that
stores every expert of every layer as its own tensor, as Mixtral and Qwen2-MoE do.
"""

import json
import textwrap

import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import port
from port._errors import MappingError, PlanError

from helpers import assert_blocks_read_exactly, place_on, run_port, write_checkpoint

LAYERS, EXPERTS, EMBED, MLP = 2, 4, 6, 8

MODULE = '''
import equinox as eqx
import jax.numpy as jnp


class Experts(eqx.Module):
    """w1: [layers, experts, mlp, embed]; router: [layers, experts, embed]; scale: [experts, embed]."""

    w1: jnp.ndarray
    router: jnp.ndarray
    scale: jnp.ndarray

    @classmethod
    def from_config(cls, config, *, key):
        l, e, d, m = (config[k] for k in ("num_hidden_layers", "num_local_experts", "hidden_size",
                                          "intermediate_size"))
        return cls(jnp.zeros((l, e, m, d)), jnp.zeros((l, e, d)), jnp.zeros((e, d)))
'''

MAPPING = """
model = "expertmodel:Experts"
model_types = ["experts"]
prefixes = ["model."]

[rules]
layers = []
experts = "expert"
embed = "data"
mlp = "model"

[[params]]
key = "layers.{layer}.experts.{expert}.w1.weight"
path = "w1"
axes = ["layers", "experts", "mlp", "embed"]

[[params]]
key = "layers.{layer}.gate.weight"
path = "router"
axes = ["layers", "experts", "embed"]

[[params]]
key = "scales.{expert}"
path = "scale"
axes = ["experts", "embed"]
"""

CONFIG = {
    "model_type": "experts",
    "num_hidden_layers": LAYERS,
    "num_local_experts": EXPERTS,
    "hidden_size": EMBED,
    "intermediate_size": MLP,
}


def tensors(seed=0):
    rng = np.random.default_rng(seed)
    found = {}
    for layer in range(LAYERS):
        for expert in range(EXPERTS):
            found[f"model.layers.{layer}.experts.{expert}.w1.weight"] = rng.standard_normal((MLP, EMBED), np.float32)
        found[f"model.layers.{layer}.gate.weight"] = rng.standard_normal((EXPERTS, EMBED), np.float32)
    for expert in range(EXPERTS):
        found[f"model.scales.{expert}"] = rng.standard_normal(EMBED, np.float32)
    return found


@pytest.fixture
def workspace(tmp_path, monkeypatch):
    (tmp_path / "expertmodel.py").write_text(textwrap.dedent(MODULE))
    (tmp_path / "experts.toml").write_text(MAPPING)
    monkeypatch.syspath_prepend(str(tmp_path))
    source = tensors()
    write_checkpoint(tmp_path / "ckpt", source, CONFIG)
    return tmp_path, source


def expected(source):
    w1 = np.stack(
        [np.stack([source[f"model.layers.{l}.experts.{e}.w1.weight"] for e in range(EXPERTS)]) for l in range(LAYERS)]
    )
    router = np.stack([source[f"model.layers.{l}.gate.weight"] for l in range(LAYERS)])
    scale = np.stack([source[f"model.scales.{e}"] for e in range(EXPERTS)])
    return {"w1": w1, "router": router, "scale": scale}


@pytest.mark.parametrize("mesh", ["data=1,expert=1,model=1", "data=2,expert=2,model=2", "data=1,expert=4,model=2"])
def test_experts_stack_after_the_layers(workspace, mesh):
    root, source = workspace
    model = port.load(root / "ckpt", mapping=root / "experts.toml", mesh=mesh)
    for name, value in expected(source).items():
        np.testing.assert_array_equal(np.asarray(getattr(model, name)), value, err_msg=name)
    if mesh != "data=1,expert=1,model=1":
        assert model.w1.sharding.spec == P(None, "expert", "model", "data")
        assert model.router.sharding.spec == P(None, "expert", "data")
        assert model.scale.sharding.spec == P("expert", "data")


def test_each_device_block_reads_only_its_experts(workspace, reads):
    """Under a mesh that shards experts 4 ways, a block of w1 holding experts 2-3 of layer 1
    reads those experts' tensors' regions, and no byte of another's."""
    root, _ = workspace
    mesh = port.make_mesh("data=2,expert=4,model=1")
    mapping = port.load_mapping(root / "experts.toml")
    recipe, total, infos = place_on(root / "ckpt", mesh, mapping)
    per_block, elsewhere = reads()
    assert_blocks_read_exactly(per_block, recipe, infos, mesh.shape)  # each block: exactly its regions
    w1 = sorted(box for leaf, box, _ in per_block if leaf.path == "w1")
    assert w1 == [((0, LAYERS), (e, e + 1), (0, MLP), (d, d + EMBED // 2)) for e in range(4) for d in (0, EMBED // 2)]
    w1_keys = {box: leaf.box_keys(box) for leaf, box, _ in per_block if leaf.path == "w1"}
    assert w1_keys[w1[5]] == tuple(f"model.layers.{l}.experts.2.w1.weight" for l in range(LAYERS))
    assert total == recipe.read_bytes == sum(i.nbytes for i in infos.values()) and len(elsewhere) == 0


@pytest.mark.slow
def test_the_plan_names_a_missing_expert_and_one_beyond_the_model(workspace):
    root, source = workspace
    del source["model.layers.1.experts.3.w1.weight"]
    write_checkpoint(root / "missing", source, CONFIG)
    result = run_port(
        "plan",
        root / "missing",
        "--mapping",
        root / "experts.toml",
        "--mesh",
        "data=1,expert=1,model=1",
        "--module",
        "expertmodel:Experts",
        cwd=root,
    )
    assert result.returncode == 1
    assert (
        "missing tensor 'layers.1.experts.3.w1.weight' (2 layers x 4 experts expected)" in result.stdout + result.stderr
    )
    extra = tensors()
    extra["model.scales.4"] = np.zeros(EMBED, np.float32)
    write_checkpoint(root / "extra", extra, CONFIG)
    mapping = port.load_mapping(root / "experts.toml")
    with (
        port.open_checkpoint(root / "extra") as ckpt,
        pytest.raises(PlanError, match="'model.scales.4' is beyond the model's 4 experts"),
    ):
        port.plan(
            port.skeleton(mapping, ckpt.config),
            mapping,
            ckpt.tensors,
            ckpt.config,
            {"data": 1, "expert": 1, "model": 1},
        )


@pytest.mark.slow
def test_the_plan_table_shows_the_stack(workspace):
    root, _ = workspace
    args = (
        "plan",
        root / "ckpt",
        "--mapping",
        root / "experts.toml",
        "--mesh",
        "data=2,expert=4,model=1",
        "--module",
        "expertmodel:Experts",
    )
    result = run_port(*args, cwd=root)
    assert "layers.{layer}.experts.{expert}.w1.weight x2 x4" in result.stdout, result.stdout + result.stderr
    import json

    leaves = json.loads(run_port(*args, "--json", cwd=root).stdout)["leaves"]
    assert {"source": "layers.{layer}.experts.{expert}.w1.weight", "stack": [2, 4]}.items() <= next(
        leaf for leaf in leaves if leaf["source"].endswith("w1.weight")
    ).items()


def test_a_placeholder_twice_is_refused():
    text = MAPPING.replace("scales.{expert}", "scales.{expert}.{expert}")
    with pytest.raises(MappingError, match=r"'\{expert\}' appears more than once in the key"):
        port.parse_mapping(text, "experts.toml")


def test_export_writes_every_expert_back(workspace):
    from safetensors.numpy import load_file

    root, source = workspace
    model = port.load(root / "ckpt", mapping=root / "experts.toml", mesh="data=2,expert=2,model=2")
    out = port.export(model, root / "hf", root / "ckpt", mapping=root / "experts.toml").out
    written = load_file(out / "model.safetensors")
    assert written.keys() == source.keys()
    for key, value in source.items():
        assert written[key].tobytes() == value.tobytes(), key
    assert json.loads((out / "config.json").read_text()) == CONFIG
