"""Targets port did not write (issue 34): the Flax NNX Llama of `examples/nnx_llama`, a Linen-style
dict of parameters, an Equinox module that keeps its layers in a list.

One transformers Llama checkpoint a dtype (float32, bfloat16), loaded into each target on
1x1 and 4x2: logits equal to transformers', the shardings the rules give, each device's
block read from exactly its region, a restore onto another mesh and an export back to the
checkpoint's bytes. The mappings are `examples/nnx_llama/llama.toml` and `LINEN_MAPPING`
below (paths with `/`, kernels stored (in, out) as Linen's `nn.Dense` keeps them). Bad
input (a factory that raises or returns the wrong thing, a path not in the module, a layer
count that disagrees with config.json, `axes = "module"` on a leaf with no annotation, no
Flax) is one line naming the thing, and through the installed `port` exit 1 with no traceback.
"""

import importlib
import json
import math
import re
import shutil
import sys
from pathlib import Path
from typing import ClassVar

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P
from safetensors.numpy import load_file

import port
import port._place
import port._sources._local
from port._errors import MappingError, PlanError
from port._targets import leaves

from helpers import (
    INPUT_IDS,
    element_bytes,
    hooked,
    one_line,
    place_on,
    run_port,
    saved_once,
    torch_llama,
    write_checkpoint,
)

nnx = pytest.importorskip("flax.nnx")

REPO = Path(__file__).resolve().parents[1]
NNX_EXAMPLE = REPO / "examples" / "nnx_llama"
NNX_MAPPING = NNX_EXAMPLE / "llama.toml"
MESHES = ("1x1", "4x2")
DTYPES = ("float32", "bfloat16")
KINDS = ("nnx", "linen")

# ---------------------------------------------------------------- a Linen-style dict of parameters


def linen_shapes(config):
    """The parameter tree a Linen Llama's `init` makes (`nn.Dense` kernels are (in, out)), as
    `jax.ShapeDtypeStruct`s: `{"params": {"embed": ..., "layers_0": ..., "norm": ..., "lm_head": ...}}`."""
    e, v, m = config["hidden_size"], config["vocab_size"], config["intermediate_size"]
    d = config.get("head_dim") or e // config["num_attention_heads"]
    q, kv = config["num_attention_heads"] * d, config["num_key_value_heads"] * d

    def shape(*dims):
        return jax.ShapeDtypeStruct(dims, jnp.float32)

    def dense(n_in, n_out):
        return {"kernel": shape(n_in, n_out)}

    layer = {
        "attn_norm": {"scale": shape(e)},
        "attn": {"q": dense(e, q), "k": dense(e, kv), "v": dense(e, kv), "o": dense(q, e)},
        "mlp_norm": {"scale": shape(e)},
        "mlp": {"gate": dense(e, m), "up": dense(e, m), "down": dense(m, e)},
    }
    layers = {f"layers_{i}": layer for i in range(config["num_hidden_layers"])}
    return {
        "params": {"embed": {"embedding": shape(v, e)}, **layers, "norm": {"scale": shape(e)}, "lm_head": dense(e, v)}
    }


LINEN_KERNELS = {  # checkpoint module -> (path under layers_{layer}, logical axes of the (in, out) kernel)
    "self_attn.q_proj": ("attn/q", "embed", "heads"),
    "self_attn.k_proj": ("attn/k", "embed", "kv_heads"),
    "self_attn.v_proj": ("attn/v", "embed", "kv_heads"),
    "self_attn.o_proj": ("attn/o", "heads", "embed"),
    "mlp.gate_proj": ("mlp/gate", "embed", "mlp"),
    "mlp.up_proj": ("mlp/up", "embed", "mlp"),
    "mlp.down_proj": ("mlp/down", "mlp", "embed"),
}
LINEN_MAPPING = """
model = "test_targets:linen_shapes"
model_types = ["llama"]
prefixes = ["model."]
ignore = ["rotary_emb.inv_freq", "layers.*.self_attn.rotary_emb.inv_freq"]

[rules]
vocab = "model"
embed = "data"
heads = "model"
kv_heads = "model"
mlp = "model"

[[params]]
key = "embed_tokens.weight"
path = "params/embed/embedding"
axes = ["vocab", "embed"]

[[params]]
key = "layers.{layer}.input_layernorm.weight"
path = "params/layers_{layer}/attn_norm/scale"
axes = ["embed"]

[[params]]
key = "layers.{layer}.post_attention_layernorm.weight"
path = "params/layers_{layer}/mlp_norm/scale"
axes = ["embed"]

[[params]]
key = "norm.weight"
path = "params/norm/scale"
axes = ["embed"]

[[params]]
key = "lm_head.weight"
path = "params/lm_head/kernel"
transforms = [{ transpose = [1, 0] }]
axes = ["embed", "vocab"]
""" + "".join(
    f"""
[[params]]
key = "layers.{{layer}}.{module}.weight"
path = "params/layers_{{layer}}/{path}/kernel"
transforms = [{{ transpose = [1, 0] }}]
axes = ["{a}", "{b}"]
"""
    for module, (path, a, b) in LINEN_KERNELS.items()
)


def linen_forward(params, ids, cfg, rope):
    """The Llama forward pass on the dict of parameters (the example's `LlamaConfig` and `rope`)."""
    p = params["params"]

    def norm(x, scale):
        x32 = x.astype(jnp.float32)
        normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + cfg.norm_eps)
        return (normed * scale.astype(jnp.float32)).astype(x.dtype)

    b, t = ids.shape
    positions = jnp.broadcast_to(jnp.arange(t), (b, t))
    causal = jnp.tril(jnp.ones((t, t), bool))
    x = p["embed"]["embedding"][ids]
    for i in range(cfg.n_layers):
        layer = p[f"layers_{i}"]
        attn, mlp = layer["attn"], layer["mlp"]
        h = norm(x, layer["attn_norm"]["scale"])
        q = rope((h @ attn["q"]["kernel"]).reshape(b, t, cfg.n_heads, cfg.head_dim), positions, cfg.rope_theta)
        k = rope((h @ attn["k"]["kernel"]).reshape(b, t, cfg.n_kv_heads, cfg.head_dim), positions, cfg.rope_theta)
        v = (h @ attn["v"]["kernel"]).reshape(b, t, cfg.n_kv_heads, cfg.head_dim)
        repeat = cfg.n_heads // cfg.n_kv_heads
        k, v = jnp.repeat(k, repeat, axis=2), jnp.repeat(v, repeat, axis=2)
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k).astype(jnp.float32) / jnp.sqrt(cfg.head_dim)
        weights = jax.nn.softmax(jnp.where(causal, scores, jnp.finfo(jnp.float32).min), axis=-1).astype(v.dtype)
        x = x + jnp.einsum("bhqk,bkhd->bqhd", weights, v).reshape(b, t, -1) @ attn["o"]["kernel"]
        h = norm(x, layer["mlp_norm"]["scale"])
        x = x + (jax.nn.silu(h @ mlp["gate"]["kernel"]) * (h @ mlp["up"]["kernel"])) @ mlp["down"]["kernel"]
    return norm(x, p["norm"]["scale"]) @ p["lm_head"]["kernel"]


# ---------------------------------------------------------------- fixtures: one checkpoint a dtype, one load a case


@pytest.fixture(scope="module")
def llama():
    """The example's module `llama` (examples/nnx_llama/llama.py), importable as the mapping names it."""
    sys.path.insert(0, str(NNX_EXAMPLE))
    try:
        yield importlib.import_module("llama")
    finally:
        sys.path.remove(str(NNX_EXAMPLE))


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """get(dtype): a transformers Llama written by save_pretrained in that dtype, and its logits."""
    return saved_once(tmp_path_factory, lambda dtype: torch_llama(dtype=None if dtype == "float32" else dtype))


@pytest.fixture(scope="module")
def loads(checkpoints, llama):
    """get(kind, mesh, dtype): the checkpoint of `dtype` loaded into the `kind` target on `mesh`, once."""
    made = {}

    def get(kind, mesh, dtype):
        if (kind, mesh, dtype) not in made:
            directory = checkpoints(dtype).directory
            if kind == "nnx":
                made[kind, mesh, dtype] = port.load(directory, mesh, mapping=NNX_MAPPING)
            else:
                shapes = linen_shapes(port.open_checkpoint(directory).config)
                mapping = port.parse_mapping(LINEN_MAPPING, "linen.toml")
                made[kind, mesh, dtype] = port.load(directory, mesh, mapping=mapping, skeleton=shapes)
        return made[kind, mesh, dtype]

    return get


@pytest.fixture(scope="module")
def forward(checkpoints, llama):
    """forward(kind, model): its logits for INPUT_IDS, float32 NumPy (each kind's function compiled once)."""
    cfg = llama.LlamaConfig.from_hf(json.loads((checkpoints("float32").directory / "config.json").read_text()))
    nnx_call = nnx.jit(lambda m, ids: m(ids))
    linen_call = jax.jit(lambda params, ids: linen_forward(params, ids, cfg, llama.rope))

    def run(kind, model):
        out = nnx_call(model, INPUT_IDS) if kind == "nnx" else linen_call(model, INPUT_IDS)
        return np.asarray(out, np.float32)

    return run


def linen_mapping():
    return port.parse_mapping(LINEN_MAPPING, "linen.toml")


def mapping_of(kind):
    return NNX_MAPPING if kind == "nnx" else linen_mapping()


# ---------------------------------------------------------------- parity, shardings, reads


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mesh", MESHES)
@pytest.mark.parametrize("kind", KINDS)
def test_logits_equal_transformers(checkpoints, loads, forward, kind, mesh, dtype):
    """float32: within 1e-4; a bfloat16 checkpoint stays bfloat16 and its logits are within 5% of
    the logits' range of transformers' bfloat16 model (bfloat16 keeps 8 bits of mantissa)."""
    expected = checkpoints(dtype).logits
    model = loads(kind, mesh, dtype)
    assert {a.dtype for a in leaves(model).values()} == {jnp.dtype(dtype)}
    difference = np.abs(forward(kind, model) - expected).max()
    if dtype == "float32":
        assert difference < 1e-4
    else:
        assert difference < 0.05 * np.abs(expected).max()


NNX_SPECS = {
    "embed.embedding": P(None, "data"),  # vocab 101 not divisible by model=2: replicated on it
    "layers.1.attn.q_proj.kernel": P("data", "model"),
    "layers.0.attn.k_proj.kernel": P("data", "model"),
    "layers.1.mlp.down_proj.kernel": P("model", "data"),
    "layers.0.attn_norm.scale": P("data"),
    "lm_head.kernel": P("data", None),
}
LINEN_SPECS = {
    "params.embed.embedding": P(None, "data"),
    "params.layers_1.attn.q.kernel": P("data", "model"),
    "params.layers_0.attn.k.kernel": P("data", "model"),
    "params.layers_1.mlp.down.kernel": P("model", "data"),
    "params.layers_0.attn_norm.scale": P("data"),
    "params.lm_head.kernel": P("data", None),
}


def spec_of(array):
    """The array's PartitionSpec, one entry a dimension (`P("data")` of a matrix is `P("data", None)`)."""
    spec = tuple(array.sharding.spec)
    return P(*spec, *[None] * (array.ndim - len(spec)))


@pytest.mark.parametrize("kind", KINDS)
def test_leaves_have_the_shardings_the_rules_give(loads, kind):
    """On 4x2: the module's own annotations (`axes = "module"`) or the mapping's axes, through [rules]."""
    found = leaves(loads(kind, "4x2", "float32"))
    specs = NNX_SPECS if kind == "nnx" else LINEN_SPECS
    for path, spec in specs.items():
        assert spec_of(found[path]) == spec, path
        assert dict(found[path].sharding.mesh.shape) == {"data": 4, "model": 2}
    assert len(found) == 21  # 2 layers x 9, the embedding, the norm, the head: no other leaf


@pytest.mark.parametrize("kind", KINDS)
def test_each_device_block_reads_exactly_its_region(checkpoints, llama, key_reads, kind):
    """On 4x2: each distinct block's source region read once (the transposed kernels too),
    nothing else, each byte of the checkpoint once in all."""
    mesh = port.make_mesh("4x2")
    mapping = port.load_mapping(NNX_MAPPING) if kind == "nnx" else linen_mapping()
    recipe, total, infos = place_on(checkpoints("float32").directory, mesh, mapping)
    blocks = {}
    for parts, files in key_reads:
        wanted = set().union(*(element_bytes(infos[part.key], part.region) for part in parts))
        assert len(files) == len(set(files.tolist())) and set(files.tolist()) == wanted, parts[0].key
        for part in parts:
            blocks.setdefault(part.leaf.path, []).append(part.region)
    for leaf in recipe.leaves:  # one region a distinct block, each read once, however many devices hold it
        assert len(blocks[leaf.path]) == len(set(blocks[leaf.path])) == len(leaf.shards(mesh.shape)), leaf.path
    assert total == recipe.read_bytes == sum(i.nbytes for i in infos.values())
    assert {p.leaf.path for parts, _ in key_reads for p in parts if p.source is None} >= {  # staged: transposed
        "layers.0.attn.q_proj.kernel" if kind == "nnx" else "params.layers_0.attn.q.kernel"
    }


def test_a_large_staged_tensor_is_read_in_bands_of_its_rows(checkpoints, loads, llama, key_reads, monkeypatch):
    """A transposed tensor larger than BAND_BYTES is staged in bands of its source rows of about
    STAGED_BYTES (the blocks beside one another read together): every byte of the checkpoint
    read once, no job staging much more than that, the same leaves bit for bit."""
    monkeypatch.setattr(port._place, "BAND_BYTES", 4096)
    monkeypatch.setattr(port._place, "STAGED_BYTES", 4096)
    mesh = port.make_mesh("4x2")
    directory = checkpoints("float32").directory
    model = port.load(directory, mesh, mapping=NNX_MAPPING)
    read = [offset for _, files in key_reads for offset in files.tolist()]
    with port.open_checkpoint(directory) as ckpt:
        every = set().union(*(element_bytes(info, tuple((0, n) for n in info.shape)) for info in ckpt.tensors.values()))
    assert len(read) == len(set(read)) and set(read) == every
    jobs = {}
    for parts, _ in key_reads:
        jobs[parts[0].key] = jobs.get(parts[0].key, 0) + 1
        staged = sum(math.prod(b - a for a, b in p.region) * 4 for p in parts if p.source is None)
        row = max(math.prod(b - a for a, b in p.region[1:]) * 4 for p in parts)
        assert staged <= 4096 + len(parts) * row, parts[0].key  # a band is whole rows
    assert jobs["lm_head.weight"] > 1 and jobs["model.layers.0.self_attn.q_proj.weight"] > 1
    ours, theirs = leaves(model), leaves(loads("nnx", "4x2", "float32"))
    assert all(np.array_equal(np.asarray(ours[p]), np.asarray(theirs[p])) for p in theirs)


# ---------------------------------------------------------------- restore, export


@pytest.mark.parametrize("kind", KINDS)
def test_restore_onto_another_mesh_gives_the_same_leaves(checkpoints, loads, llama, tmp_path, kind):
    """Converted on 4x2 and saved; restored onto 2x4 through the factory: every leaf bit for bit,
    sharded by the same logical axes on the new mesh."""
    directory = checkpoints("float32").directory
    out = tmp_path / "out"
    if kind == "nnx":
        port.convert(directory, mapping=NNX_MAPPING, mesh="4x2", out=out)
        restored = port.restore(out, "2x4", model=llama.build)
    else:
        port.convert(directory, linen_shapes(port.open_checkpoint(directory).config), linen_mapping(), "4x2", out=out)
        restored = port.restore(out, "2x4", model=linen_shapes)
    assert type(restored) is type(loads(kind, "4x2", "float32"))
    ours, theirs = leaves(restored), leaves(loads(kind, "4x2", "float32"))
    assert ours.keys() == theirs.keys()
    for path, array in ours.items():
        assert array.dtype == theirs[path].dtype
        assert np.array_equal(np.asarray(array).view(np.uint8), np.asarray(theirs[path]).view(np.uint8)), path
    specs = NNX_SPECS if kind == "nnx" else LINEN_SPECS
    for path, spec in specs.items():
        assert spec_of(ours[path]) == spec and dict(ours[path].sharding.mesh.shape) == {"data": 2, "model": 4}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", KINDS)
def test_export_writes_the_checkpoint_back_bit_for_bit(checkpoints, loads, tmp_path, kind, dtype):
    directory = checkpoints(dtype).directory
    port.export(loads(kind, "4x2", dtype), tmp_path / "hf", directory, mapping=mapping_of(kind))
    source, written = load_file(directory / "model.safetensors"), load_file(tmp_path / "hf" / "model.safetensors")
    assert written.keys() == source.keys()
    for key, tensor in source.items():
        assert written[key].dtype == tensor.dtype and written[key].shape == tensor.shape, key
        assert written[key].tobytes() == tensor.tobytes(), key


# ---------------------------------------------------------------- an Equinox module with its layers in a list


class ListLayer(eqx.Module):
    w: jax.Array  # [in, out]: the checkpoint's (out, in) transposed
    b: jax.Array


class ListNet(eqx.Module):
    layers: list[ListLayer]
    head: jax.Array


def list_net(config):
    """A factory: an Equinox module whose layers are a plain list (leaves `layers.0.w`, `layers.1.w`, ...)."""
    d, n = config["hidden_size"], config["num_hidden_layers"]
    layers = [ListLayer(jnp.zeros((d, 2 * d)), jnp.zeros(2 * d)) for _ in range(n)]
    return ListNet(layers, jnp.zeros((config["vocab_size"], d)))


LIST_MAPPING = """
model = "test_targets:list_net"

[rules]
embed = "data"
mlp = "model"

[[params]]
key = "h.{layer}.fc.weight"
path = "layers.{layer}.w"
transforms = [{ transpose = [1, 0] }]
axes = ["embed", "mlp"]

[[params]]
key = "h.{layer}.fc.bias"
path = "layers.{layer}.b"
axes = ["mlp"]

[[params]]
key = "wte.weight"
path = "head"
axes = ["", "embed"]  # "": not sharded
"""
LIST_CONFIG = {"model_type": "listnet", "hidden_size": 8, "num_hidden_layers": 3, "vocab_size": 12}


def list_checkpoint(directory):
    rng = np.random.default_rng(0)
    d = LIST_CONFIG["hidden_size"]
    tensors = {"wte.weight": rng.standard_normal((12, d), np.float32)}
    for i in range(LIST_CONFIG["num_hidden_layers"]):
        tensors[f"h.{i}.fc.weight"] = rng.standard_normal((2 * d, d), np.float32)
        tensors[f"h.{i}.fc.bias"] = rng.standard_normal(2 * d, np.float32)
    return write_checkpoint(directory, tensors, LIST_CONFIG), tensors


def test_an_equinox_module_with_layers_in_a_list(tmp_path):
    """`{layer}` in the path: one leaf per layer, each the checkpoint's layer exactly, sharded."""
    directory, tensors = list_checkpoint(tmp_path / "ckpt")
    model = port.load(directory, "4x2", mapping=port.parse_mapping(LIST_MAPPING, "list.toml"))
    assert isinstance(model, ListNet) and isinstance(model.layers, list) and len(model.layers) == 3
    for i, layer in enumerate(model.layers):
        assert np.array_equal(np.asarray(layer.w), tensors[f"h.{i}.fc.weight"].T)
        assert np.array_equal(np.asarray(layer.b), tensors[f"h.{i}.fc.bias"])
        assert layer.w.sharding.spec == P("data", "model") and layer.b.sharding.spec == P("model")
    assert np.array_equal(np.asarray(model.head), tensors["wte.weight"])


def test_layers_in_a_list_cut_to_a_range_of_the_checkpoints(tmp_path):
    """`layers=range(1, 3)`: the list built from the config cut to two layers holds layers 1 and 2."""
    directory, tensors = list_checkpoint(tmp_path / "ckpt")
    mapping = port.parse_mapping(LIST_MAPPING, "list.toml")
    model = port.load(directory, "4x2", mapping=mapping, layers=range(1, 3))
    assert len(model.layers) == 2
    for row, layer in zip((1, 2), model.layers):
        assert np.array_equal(np.asarray(layer.w), tensors[f"h.{row}.fc.weight"].T)


class GroupNet(eqx.Module):
    """Two lists of layers of two kinds: `layer_groups` says which checkpoint layers each holds."""

    layer_groups: ClassVar[dict[str, tuple[int, ...]]] = {"first": (0,), "rest": (1, 2)}
    first: list[ListLayer]
    rest: list[ListLayer]
    head: jax.Array


def group_net(config):
    d = config["hidden_size"]
    layer = lambda: ListLayer(jnp.zeros((d, 2 * d)), jnp.zeros(2 * d))  # noqa: E731
    return GroupNet([layer()], [layer(), layer()], jnp.zeros((config["vocab_size"], d)))


def test_layer_groups_fill_lists_of_layers_from_their_layers(tmp_path):
    """A `{layer}` path under a layer group's prefix: list index i holds the group's i-th checkpoint layer."""
    directory, tensors = list_checkpoint(tmp_path / "ckpt")
    entries = LIST_MAPPING.split("[[params]]")
    text = entries[0].replace("test_targets:list_net", "test_targets:group_net")
    for group in ("first", "rest"):
        text += "".join("[[params]]" + e.replace('"layers.{layer}', f'"{group}.{{layer}}') for e in entries[1:3])
    text += "[[params]]" + entries[3]
    model = port.load(directory, "4x2", mapping=port.parse_mapping(text, "groups.toml"))
    assert [len(model.first), len(model.rest)] == [1, 2]
    for layer, i in zip([*model.first, *model.rest], (0, 1, 2)):
        assert np.array_equal(np.asarray(layer.w), tensors[f"h.{i}.fc.weight"].T)
        assert np.array_equal(np.asarray(layer.b), tensors[f"h.{i}.fc.bias"])


# ---------------------------------------------------------------- an NNX class with state of its own


class Scaled(nnx.Module):
    """An NNX class named by a mapping (`cls(config, rngs=...)`), with dropout: an RNG stream of its own."""

    def __init__(self, config, *, rngs):
        self.w = nnx.Param(jnp.zeros((config["hidden_size"], 4)), out_sharding=("embed", None))
        self.dropout = nnx.Dropout(0.5, rngs=rngs)


SCALED_MAPPING = """
model = "test_targets:Scaled"

[rules]
embed = "data"

[[params]]
key = "w"
path = "w"
axes = "module"
"""


def test_an_nnx_class_keeps_the_state_its_constructor_gives(tmp_path):
    """The dropout's RNG key and count are not in the checkpoint: they are the constructor's
    (`Scaled(config, rngs=nnx.Rngs(0))`), replicated on the mesh; `w` follows its annotation."""
    w = np.arange(32, dtype=np.float32).reshape(8, 4)
    directory = write_checkpoint(tmp_path / "ckpt", {"w": w}, {"hidden_size": 8})
    model = port.load(directory, "4x2", mapping=port.parse_mapping(SCALED_MAPPING, "scaled.toml"))
    assert isinstance(model, Scaled)
    assert np.array_equal(np.asarray(model.w[...]), w) and model.w[...].sharding.spec == P("data", None)
    with nnx.use_eager_sharding(False):
        expected = leaves(Scaled({"hidden_size": 8}, rngs=nnx.Rngs(0)))
    own = {p: a for p, a in leaves(model).items() if p != "w"}
    assert own.keys() == expected.keys() - {"w"} == {"dropout.rngs.key", "dropout.rngs.count"}
    for path, array in own.items():
        assert array.sharding.spec == P() and len(array.sharding.device_set) == 8, path
        assert np.array_equal(raw(array), raw(expected[path])), path


def raw(array):
    """An array's values as NumPy; a PRNG key's as its key data."""
    return np.asarray(jax.random.key_data(array) if jnp.issubdtype(array.dtype, jax.dtypes.prng_key) else array)


# ---------------------------------------------------------------- bad input, in Python


def factory_raising(config):
    raise ValueError(f"no size {config['hidden_size']} here")


def factory_of_a_number(config):
    return 3


def factory_of_a_string(config):
    return "llama"


def factory_of_numpy(config):
    return {"w": np.zeros(3, np.float32)}


MADE_BEFORE = jnp.zeros(3)


def factory_of_arrays_made_before(config):
    return {"w": MADE_BEFORE}


def factory_of_fewer_layers(config):
    return list_net({**config, "num_hidden_layers": config["num_hidden_layers"] - 1})


def class_unannotated(config, *, rngs=None):
    return Unannotated(config, rngs=nnx.Rngs(0))


class Unannotated(nnx.Module):
    def __init__(self, config, *, rngs):
        self.w = nnx.Param(jnp.zeros((config["hidden_size"], 4)))


@pytest.mark.parametrize(
    "factory, message",
    [
        ("factory_raising", "model test_targets:factory_raising raised ValueError: no size 8 here (test_targets.py:"),
        ("factory_of_a_number", "model test_targets:factory_of_a_number returned a int with no arrays"),
        ("factory_of_a_string", "model test_targets:factory_of_a_string returned a str with no arrays"),
        ("factory_of_numpy", "factory test_targets:factory_of_numpy returned real arrays (at 'w')"),
        ("factory_of_arrays_made_before", "factory test_targets:factory_of_arrays_made_before returned real arrays"),
    ],
)
def test_a_factory_port_cannot_use_is_named(tmp_path, factory, message):
    directory, _ = list_checkpoint(tmp_path / "ckpt")
    mapping = port.parse_mapping(LIST_MAPPING.replace("list_net", factory), "list.toml")
    with pytest.raises(MappingError) as error:
        port.load(directory, mapping=mapping)
    assert message in str(error.value) and "\n" not in str(error.value)


def test_a_layer_count_unlike_the_configs_is_named(tmp_path):
    directory, _ = list_checkpoint(tmp_path / "ckpt")
    mapping = port.parse_mapping(LIST_MAPPING.replace("list_net", "factory_of_fewer_layers"), "list.toml")
    with pytest.raises(PlanError) as error:
        port.load(directory, mapping=mapping)
    assert (
        "list.toml: entry 'h.{layer}.fc.weight': path 'layers.{layer}.w' has 2 layers in "
        "test_targets:factory_of_fewer_layers, but config.json gives 3" in error.value.problems
    )


def test_a_path_not_in_the_nnx_state_is_named(checkpoints, llama):
    text = NNX_MAPPING.read_text().replace('path = "norm.scale"', 'path = "final_norm.scale"')
    with pytest.raises(PlanError) as error:
        port.load(checkpoints("float32").directory, mapping=port.parse_mapping(text, "llama.toml"))
    assert "llama.toml: entry 'norm.weight': path 'final_norm.scale' is not a leaf of llama:build" in (
        error.value.problems
    )


def test_module_axes_on_a_leaf_the_module_does_not_annotate(tmp_path):
    directory = write_checkpoint(tmp_path / "ckpt", {"w": np.zeros((8, 4), np.float32)}, {"hidden_size": 8})
    mapping = port.parse_mapping(SCALED_MAPPING.replace("Scaled", "class_unannotated"), "plain.toml")
    with pytest.raises(PlanError) as error:
        port.load(directory, mapping=mapping)
    (problem,) = error.value.problems
    assert problem.startswith("plain.toml: entry 'w': axes = \"module\", but test_targets:class_unannotated")
    assert "'w'" in problem and "\n" not in problem


# ---------------------------------------------------------------- through the installed `port`

BAD_FACTORIES = """
def raises(config):
    raise ValueError("no size " + str(config["hidden_size"]) + " here")


def text(config):
    return "llama"
"""


@pytest.fixture
def beside(tmp_path):
    """A working directory holding the example's llama.py and a module of bad factories, as a user's would."""
    shutil.copy(NNX_EXAMPLE / "llama.py", tmp_path / "llama.py")
    (tmp_path / "bad.py").write_text(BAD_FACTORIES)
    return tmp_path


@pytest.mark.slow
def test_plan_check_and_verify_an_nnx_mapping(checkpoints, beside):
    directory = checkpoints("float32").directory
    module = ("--module", "llama:build")
    result = run_port("plan", directory, "--mapping", NNX_MAPPING, "--mesh", "4x2", *module, cwd=beside)
    assert result.returncode == 0, result.stderr
    assert "from layers.1.self_attn.q_proj.weight > transpose[1, 0]" in result.stdout
    assert re.search(r"^layers\.1\.attn\.q_proj\.kernel +f32\[64,64\] +\(data, model\)", result.stdout, re.M)
    assert "87.0K params in 21 leaves" in result.stdout
    result = run_port("check", NNX_MAPPING, directory, "--mesh", "4x2", *module, cwd=beside)
    assert result.returncode == 0 and ": ok: 21 leaves from" in result.stdout, result.stdout + result.stderr
    result = run_port("verify", directory, "--mapping", NNX_MAPPING, "--mesh", "4x2", *module, cwd=beside)
    assert result.returncode == 0 and "vs LlamaForCausalLM.logits" in result.stdout, result.stdout + result.stderr
    assert float(result.stdout.split("max abs difference ")[1].split()[0]) < 1e-4


@pytest.mark.slow
def test_convert_and_export_an_nnx_target(checkpoints, beside):
    """`port convert --module llama:build`, then `port export OUT --module llama:build`: the source's bytes."""
    directory = checkpoints("bfloat16").directory
    out, hf = beside / "llama-jax", beside / "llama-hf"
    module = ("--module", "llama:build")
    result = run_port(
        "convert", directory, "--mapping", NNX_MAPPING, "--mesh", "4x2", "--out", out, *module, cwd=beside
    )
    assert result.returncode == 0, result.stderr
    result = run_port("export", out, "--out", hf, *module, cwd=beside)
    assert result.returncode == 0, result.stderr
    source, written = load_file(directory / "model.safetensors"), load_file(hf / "model.safetensors")
    assert written.keys() == source.keys()
    assert all(written[k].dtype == v.dtype and written[k].tobytes() == v.tobytes() for k, v in source.items())


@pytest.mark.slow
@pytest.mark.parametrize(
    "model, change, message",
    [
        ("bad:raises", None, "model bad:raises raised ValueError: no size 64 here (bad.py:3)"),
        ("bad:text", None, "model bad:text returned a str with no arrays: expected a module or a pytree of arrays"),
        (
            "llama:build",
            ('path = "norm.scale"', 'path = "final_norm.scale"'),
            "entry 'norm.weight': path 'final_norm.scale' is not a leaf of llama:build",
        ),
    ],
    ids=["raises", "string", "path"],
)
def test_bad_targets_are_one_line_on_the_command_line(checkpoints, beside, model, change, message):
    text = NNX_MAPPING.read_text().replace('model = "llama:build"', f'model = "{model}"')
    if change is not None:
        text = text.replace(*change)
    (beside / "mapping.toml").write_text(text)
    out = beside / "out"
    directory = checkpoints("float32").directory
    result = run_port("convert", directory, "--mapping", "mapping.toml", "--out", out, "--module", model, cwd=beside)
    one_line(result, message, out=out)


@pytest.mark.slow
def test_an_nnx_mapping_without_flax_says_which_extra_to_install(checkpoints, beside, tmp_path_factory):
    """Flax cannot be imported (a `sitecustomize` hides it in every process of the run)."""
    env = hooked(tmp_path_factory.mktemp("no-flax"), "import sys\nsys.modules['flax'] = None\n")
    directory = checkpoints("float32").directory
    result = run_port("plan", directory, "--mapping", NNX_MAPPING, "--module", "llama:build", env=env, cwd=beside)
    line = one_line(result, "llama.toml: model 'llama:build' cannot be imported")
    assert line.endswith("it needs Flax: install port's flax extra (pip install 'port[flax]')")


@pytest.mark.slow
def test_a_factory_whose_own_import_fails_is_told_as_it_is(checkpoints, beside):
    """mine.py, named by --module, imports llama.py beside it, which the command line does not import
    (only the module --module names): the line says llama is missing, and no hint that mine.py was not named."""
    (beside / "mine.py").write_text("import llama\n\n\ndef build(config):\n    return llama.build(config)\n")
    text = NNX_MAPPING.read_text().replace('model = "llama:build"', 'model = "mine:build"')
    (beside / "mapping.toml").write_text(text)
    result = run_port(
        "plan", checkpoints("float32").directory, "--mapping", "mapping.toml", "--module", "mine:build", cwd=beside
    )
    line = one_line(result, "mapping.toml: model 'mine:build' cannot be imported (No module named 'llama')")
    assert "imported only when named" not in line
