"""GPT-NeoX / Pythia: port's model, converted by the shipped `mappings/gpt_neox.toml`, against `transformers`.

Parity goes through the converter: each `GPTNeoXForCausalLM` written by `save_pretrained`,
loaded by `port`, gives the same logits on every mesh, and the cases are sensitive to what
they test (partial rotary, the residual layout, theta, the epsilon). The fused
`query_key_value` stays fused per head, so a device reads exactly its heads' rows; the
export goes back bit for bit; the full-size Pythia-1.4B plans without a tensor byte read.
The tests that build a `transformers` model skip without PyTorch.
"""

import dataclasses
import json
import math
import re

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import port
from port._errors import PortError
from port.models.gpt_neox import GPTNeoX, GPTNeoXConfig
from port.nn import Rope

from helpers import (
    VOCAB,
    assert_blocks_read_exactly,
    hooked,
    logits,
    perturbed,
    place_on,
    run_port,
    saved_once,
    transformers_or_skip,
    write_sparse_checkpoint,
)

BASE = dict(
    vocab_size=VOCAB,
    num_hidden_layers=2,
    max_position_embeddings=64,
    initializer_range=0.2,
    bos_token_id=0,
    eos_token_id=0,
)
# name: config overrides (transformers 4 names: rotary_pct, rotary_emb_base; transformers 5 writes
# them into rope_parameters). Head dims 12, 8 and 12: 0.25 x 12 rotates 3 dims, rounded up to 4.
CASES = {
    "parallel-pct25-5heads": dict(hidden_size=60, num_attention_heads=5, intermediate_size=72, rotary_pct=0.25),
    "sequential-pct50-6heads-tied": dict(
        hidden_size=48,
        num_attention_heads=6,
        intermediate_size=80,
        rotary_pct=0.5,
        rotary_emb_base=500,
        use_parallel_residual=False,
        tie_word_embeddings=True,
        layer_norm_eps=1e-3,
    ),
    "parallel-pct50-3heads-nobias": dict(
        hidden_size=36,
        num_attention_heads=3,
        intermediate_size=56,
        rotary_pct=0.5,
        attention_bias=False,
    ),
}
# Each case where its layout matters: 5 and 3 heads replicate on model=2, 6 heads split 3 + 3.
PARITY = [
    ("parallel-pct25-5heads", "1x1"),
    ("parallel-pct25-5heads", "4x2"),
    ("parallel-pct25-5heads", "8x1"),
    ("sequential-pct50-6heads-tied", "4x2"),
    ("sequential-pct50-6heads-tied", "8x1"),
    ("parallel-pct50-3heads-nobias", "4x2"),
]
IDS = np.random.default_rng(0).integers(0, VOCAB, (2, 16))


def torch_neox(**overrides):
    """A seeded `GPTNeoXForCausalLM`, eager attention, norms and biases perturbed; skips without PyTorch."""
    transformers = transformers_or_skip()
    import torch

    torch.manual_seed(0)
    config = transformers.GPTNeoXConfig(**{**BASE, **overrides})
    config._attn_implementation = "eager"
    return perturbed(transformers.GPTNeoXForCausalLM(config), lambda name: name.endswith("bias") or "norm" in name, 0.2)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """get(name): the case saved by save_pretrained, its torch model and PyTorch logits (one build per case)."""
    return saved_once(tmp_path_factory, lambda name: torch_neox(**CASES[name]), IDS)


# ---------------------------------------------------------------- parity


@pytest.mark.parametrize("name, mesh_spec", PARITY)
def test_logits_match_transformers(checkpoints, name, mesh_spec):
    directory, _, expected = checkpoints(name)
    model = port.load(directory, mesh=port.make_mesh(mesh_spec))
    ours = logits(model, IDS)
    assert ours.shape == (*IDS.shape, VOCAB) and ours.dtype == np.float32
    assert np.abs(np.asarray(ours) - expected).max() <= 1e-4
    overrides = CASES[name]
    assert (model.lm_head is None) == overrides.get("tie_word_embeddings", False)
    assert (model.blocks.attn.bqkv is None) == (overrides.get("attention_bias") is False)


def with_config(model: GPTNeoX, **changes) -> GPTNeoX:
    """The same weights under a changed (static) config."""
    config = dataclasses.replace(model.config, **changes)
    skeleton = eqx.filter_eval_shape(GPTNeoX, config, key=jax.random.key(0))
    return jax.tree.unflatten(jax.tree.structure(skeleton), jax.tree.leaves(model))


# What the cases' config.json give: head_dim 12 x 0.25 = 3 (4 rotated); head_dim 8 x 0.5 = 4, base 500.
LOADED_ROPE = {
    "parallel-pct25-5heads": Rope(theta=10000.0, rotary_dim=3),
    "sequential-pct50-6heads-tied": Rope(theta=500.0, rotary_dim=4),
}


@pytest.mark.parametrize(
    "name, change",
    [
        ("parallel-pct25-5heads", dict(rope=Rope(theta=10000.0, rotary_dim=12))),
        ("parallel-pct25-5heads", dict(rope=Rope(theta=10000.0, rotary_dim=2))),  # 2 rotated dims, not 3 -> 4
        ("parallel-pct25-5heads", dict(rope=Rope(theta=10000.0, rotary_dim=4))),  # 4 rotated, inv_freq over 4, not 3
        ("parallel-pct25-5heads", dict(rope=Rope(theta=10000.0, rotary_dim=0))),  # no rotation at all
        ("parallel-pct25-5heads", dict(use_parallel_residual=False)),
        ("sequential-pct50-6heads-tied", dict(rope=Rope(theta=10000.0, rotary_dim=4))),
        ("sequential-pct50-6heads-tied", dict(layer_norm_eps=1e-5)),
    ],
    ids=[
        "full-rotary",
        "even-rotary",
        "odd-dim-rounded-before-inv-freq",
        "no-rotary",
        "sequential",
        "wrong-theta",
        "wrong-eps",
    ],
)
def test_ignoring_a_feature_breaks_parity(checkpoints, name, change):
    """The parity cases above are sensitive to the rotary dims (and to odd ones rounded up only after
    inv_freq is computed over them), the residual layout, theta and the eps."""
    directory, _, expected = checkpoints(name)
    loaded = port.load(directory)
    assert loaded.config.rope == LOADED_ROPE[name]
    model = with_config(loaded, **change)
    assert np.abs(np.asarray(logits(model, IDS)) - expected).max() > 1e-2


# ---------------------------------------------------------------- layout and bytes


def test_shardings_on_4x2(checkpoints):
    """Heads and the MLP on `model`, embed on `data`; 5 heads are replicated on model=2, and the plan says so."""
    directory, _, _ = checkpoints("sequential-pct50-6heads-tied")  # 6 heads, embed 48, vocab 101
    model = port.load(directory, mesh=port.make_mesh("4x2"))
    specs = {
        "embed": P(None, "data"),  # vocab 101 is not divisible by model=2
        "blocks.attn_norm.weight": P(None, "data"),
        "blocks.attn_norm.bias": P(None, "data"),
        "blocks.attn.wqkv": P(None, "model", None, None, "data"),
        "blocks.attn.bqkv": P(None, "model", None, None),
        "blocks.attn.wo": P(None, "data", "model", None),
        "blocks.attn.bo": P(None, "data"),
        "blocks.mlp_norm.weight": P(None, "data"),
        "blocks.mlp_norm.bias": P(None, "data"),
        "blocks.mlp.up": P(None, "model", "data"),
        "blocks.mlp.bup": P(None, "model"),
        "blocks.mlp.down": P(None, "data", "model"),
        "blocks.mlp.bdown": P(None, "data"),
        "norm.weight": P("data"),
        "norm.bias": P("data"),
    }
    arrays = port._skeleton.leaves(eqx.filter(model, eqx.is_array))
    assert {path: a.sharding.spec for path, a in arrays.items()} == specs
    assert arrays["blocks.attn.wqkv"].addressable_shards[0].data.shape == (2, 3, 3, 8, 12)

    directory, _, _ = checkpoints("parallel-pct25-5heads")  # 5 heads, embed 60
    with port.open_checkpoint(directory) as ckpt:
        mapping = port.mapping_for(ckpt.config)
        recipe = port.plan(
            port.skeleton(mapping, ckpt.config), mapping, ckpt.tensors, ckpt.config, {"data": 4, "model": 2}
        )
    wqkv = next(leaf for leaf in recipe.leaves if leaf.path == "blocks.attn.wqkv")
    assert wqkv.spec == P(None, None, None, None, "data")
    assert wqkv.notes == ("heads 5 not divisible by model=2: replicated on model",)
    lm_head = next(leaf for leaf in recipe.leaves if leaf.path == "lm_head")
    assert lm_head.keys == ("embed_out.weight",) and lm_head.spec == P(None, "data")


def test_a_device_reads_exactly_its_heads_rows(checkpoints, reads):
    """On 4x2, the block of heads h0..h1 and embed columns e0..e1 reads rows h0*3*D .. h1*3*D of
    query_key_value (q, k and v of those heads, interleaved), those columns, each byte once, straight
    into the block; every source byte is read once in all."""
    directory, _, _ = checkpoints("sequential-pct50-6heads-tied")
    mesh = port.make_mesh("4x2")
    recipe, total, infos = place_on(directory, mesh)
    per_block, elsewhere = reads()
    assert_blocks_read_exactly(per_block, recipe, infos, mesh.shape)
    assert len(elsewhere) == 0  # no staging: a reshape only, read straight into the block

    heads, head_dim, embed = 6, 8, 48
    qkv_blocks = [(leaf, box, files) for leaf, box, files in per_block if leaf.path == "blocks.attn.wqkv"]
    assert len(qkv_blocks) == 8  # 2 head groups x 4 embed groups, each read once
    for leaf, box, files in qkv_blocks:
        layers, (h0, h1), qkv, dims, (e0, e1) = box
        assert (layers, qkv, dims, h1 - h0, e1 - e0) == ((0, 2), (0, 3), (0, head_dim), heads // 2, embed // 4)
        region, keys = leaf.source_region(box)
        assert region == ((h0 * 3 * head_dim, h1 * 3 * head_dim), (e0, e1))
        assert keys == tuple(f"gpt_neox.layers.{layer}.attention.query_key_value.weight" for layer in range(2))
        rows = set()
        for key in keys:
            info = infos[key]
            inside = files[(files >= info.offset) & (files < info.offset + info.nbytes)]
            offsets = (inside - info.offset) // info.dtype.itemsize
            rows |= set((offsets // embed).tolist())
            assert set((offsets % embed).tolist()) == set(range(e0, e1))
        assert rows == set(range(h0 * 3 * head_dim, h1 * 3 * head_dim))
    assert total == recipe.read_bytes == sum(i.nbytes for i in infos.values())


# ---------------------------------------------------------------- the way back


@pytest.mark.parametrize("name", ["parallel-pct25-5heads", "sequential-pct50-6heads-tied"])
def test_export_round_trip(checkpoints, name, tmp_path):
    """4x2 -> port.export -> from_pretrained: no missing or unexpected key, every weight bit for bit,
    the source's keys (`embed_out.weight` for an untied head) and bytes."""
    import torch
    from safetensors.numpy import load_file

    transformers = transformers_or_skip()
    directory, original, _ = checkpoints(name)
    out = port.export(port.load(directory, mesh="4x2"), tmp_path / "hf", directory).out
    exported, info = transformers.GPTNeoXForCausalLM.from_pretrained(out, output_loading_info=True)
    for what in ("missing_keys", "unexpected_keys", "mismatched_keys", "error_msgs"):
        assert not info[what], f"{what}: {info[what]}"
    ours, theirs = exported.state_dict(), original.state_dict()
    assert ours.keys() == theirs.keys()
    for key, value in theirs.items():
        assert ours[key].dtype == value.dtype and torch.equal(ours[key], value), key
    source, written = load_file(directory / "model.safetensors"), load_file(out / "model.safetensors")
    assert written.keys() == source.keys()
    assert all(written[k].tobytes() == source[k].tobytes() for k in source)


def test_legacy_checkpoint_with_buffers_and_lm_head_key(checkpoints, tmp_path):
    """Old Pythia files hold causal-mask and rotary buffers (ignored); a state_dict saved as is names
    the head `lm_head.weight` (aliased to `embed_out.weight`). Same logits."""
    import torch
    from safetensors.torch import save_file

    directory, model, expected = checkpoints("parallel-pct25-5heads")
    tensors = {k: v.contiguous() for k, v in model.state_dict().items()}
    assert "lm_head.weight" in tensors
    for layer in range(2):
        prefix = f"gpt_neox.layers.{layer}.attention."
        tensors[prefix + "bias"] = torch.tril(torch.ones(64, 64, dtype=torch.bool)).view(1, 1, 64, 64)
        tensors[prefix + "masked_bias"] = torch.tensor(-1e9)
        tensors[prefix + "rotary_emb.inv_freq"] = torch.ones(2)
    legacy = tmp_path / "legacy"
    legacy.mkdir()
    save_file(tensors, legacy / "model.safetensors", metadata={"format": "pt"})
    (legacy / "config.json").write_text((directory / "config.json").read_text())
    with port.open_checkpoint(legacy) as ckpt:
        mapping = port.mapping_for(ckpt.config)
        recipe = port.plan(
            port.skeleton(mapping, ckpt.config), mapping, ckpt.tensors, ckpt.config, {"data": 1, "model": 1}
        )
    assert len(recipe.ignored) == 6 and not recipe.tied
    assert next(leaf for leaf in recipe.leaves if leaf.path == "lm_head").keys == ("lm_head.weight",)
    ours = logits(port.load(legacy, mesh="4x2"), IDS)
    assert np.abs(np.asarray(ours) - expected).max() <= 1e-4


# ---------------------------------------------------------------- full size: Pythia-1.4B


PYTHIA_1_4B = {  # EleutherAI/pythia-1.4b config.json
    "architectures": ["GPTNeoXForCausalLM"],
    "bos_token_id": 0,
    "eos_token_id": 0,
    "hidden_act": "gelu",
    "hidden_size": 2048,
    "initializer_range": 0.02,
    "intermediate_size": 8192,
    "layer_norm_eps": 1e-05,
    "max_position_embeddings": 2048,
    "model_type": "gpt_neox",
    "num_attention_heads": 16,
    "num_hidden_layers": 24,
    "rotary_emb_base": 10000,
    "rotary_pct": 0.25,
    "tie_word_embeddings": False,
    "torch_dtype": "float16",
    "transformers_version": "4.24.0",
    "use_cache": True,
    "use_parallel_residual": True,
    "vocab_size": 50304,
}

# Put on PYTHONPATH of the `port` processes: records every read of tensor bytes (port._sources._local._preadv,
# the one place they come from) into a file per process.
READ_RECORDER = """
import importlib.abc, importlib.util, json, os, sys

class _Recorder(importlib.abc.MetaPathFinder):
    reads, wrapped = [], False

    def find_spec(self, name, path, target=None):
        if name != "port._sources._local":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            real = module._preadv

            def _preadv(fd, iov, offset):
                _Recorder.reads.append(offset)
                return real(fd, iov, offset)

            module._preadv, _Recorder.wrapped = _preadv, True

        spec.loader.exec_module = exec_module
        return spec

sys.meta_path.insert(0, _Recorder())

import atexit
atexit.register(lambda: open(os.path.join(os.environ["READS_DIR"], str(os.getpid())), "w").write(
    json.dumps({"wrapped": _Recorder.wrapped, "reads": _Recorder.reads})))
"""


def pythia_checkpoint(directory):
    """Pythia-1.4B's config.json and a float16 model.safetensors with every tensor of the original file
    (buffers included), its data a sparse hole of the right size. Returns the header entries."""
    E, I, V, n = 2048, 8192, 50304, 2048
    shapes = {
        "gpt_neox.embed_in.weight": ("F16", [V, E]),
        "embed_out.weight": ("F16", [V, E]),
        "gpt_neox.final_layer_norm.weight": ("F16", [E]),
        "gpt_neox.final_layer_norm.bias": ("F16", [E]),
    }
    for layer in range(24):
        p = f"gpt_neox.layers.{layer}."
        for norm in ("input_layernorm", "post_attention_layernorm"):
            shapes |= {f"{p}{norm}.weight": ("F16", [E]), f"{p}{norm}.bias": ("F16", [E])}
        shapes |= {
            p + "attention.query_key_value.weight": ("F16", [3 * E, E]),
            p + "attention.query_key_value.bias": ("F16", [3 * E]),
            p + "attention.dense.weight": ("F16", [E, E]),
            p + "attention.dense.bias": ("F16", [E]),
            p + "mlp.dense_h_to_4h.weight": ("F16", [I, E]),
            p + "mlp.dense_h_to_4h.bias": ("F16", [I]),
            p + "mlp.dense_4h_to_h.weight": ("F16", [E, I]),
            p + "mlp.dense_4h_to_h.bias": ("F16", [E]),
            p + "attention.bias": ("BOOL", [1, 1, n, n]),
            p + "attention.masked_bias": ("F32", []),
            p + "attention.rotary_emb.inv_freq": ("F32", [16]),
        }
    write_sparse_checkpoint(directory, PYTHIA_1_4B, dict(sorted(shapes.items())))
    return shapes


@pytest.mark.slow
def test_plan_full_size_pythia_1_4b(tmp_path):
    """`port plan --mesh 4x2` on Pythia-1.4B's real sizes: exit 0, every weight sharded 8 ways (norms and
    biases 4 or 2), the bytes per device those shardings give, buffers ignored, no tensor byte read."""
    shapes = pythia_checkpoint(tmp_path / "pythia-1.4b")
    (tmp_path / "reads").mkdir()
    env = hooked(tmp_path / "recorder", READ_RECORDER) | {"READS_DIR": str(tmp_path / "reads")}
    result = run_port("plan", tmp_path / "pythia-1.4b", "--mesh", "4x2", env=env)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    assert "Traceback" not in output

    # Per device: matrices on data x model (8), q/k/v and MLP biases on model (2), the rest on data (4).
    def share(key):
        if key.endswith(("attention.bias", "masked_bias", "inv_freq")):
            return 0
        if key.endswith("weight") and len(shapes[key][1]) == 2:
            return 1 / 8
        return 1 / 2 if key.endswith(("query_key_value.bias", "dense_h_to_4h.bias")) else 1 / 4

    per_device = sum(2 * math.prod(shape) * share(key) for key, (_, shape) in shapes.items())
    params = sum(math.prod(shape) for key, (_, shape) in shapes.items() if share(key))
    summary = output.strip().splitlines()[-1]
    found = re.fullmatch(r"([\d.]+)B params in 16 leaves; ([\d.]+) GB to read, ([\d.]+) MB per device", summary)
    assert found, summary
    assert float(found[1]) == round(params / 1e9, 2)
    assert float(found[2]) == round(2 * params / 1e9, 1)
    assert float(found[3]) == round(per_device / 1e6, 1)
    assert re.search(r"blocks\.attn\.wqkv\s+f16\[24,16,3,128,2048\]\s+\(-, model, -, -, data\)", output)
    assert output.count("ignored: ") == 3  # 24 layers of each buffer, one line per pattern
    assert "ignored: gpt_neox.layers.*.attention.rotary_emb.inv_freq (24 tensors)" in output
    processes = [json.loads(p.read_text()) for p in (tmp_path / "reads").iterdir()]
    assert any(p["wrapped"] for p in processes)  # the recorder saw port._sources._local load...
    assert all(p["reads"] == [] for p in processes)  # ...and no tensor byte was read


# ---------------------------------------------------------------- the module and its config


def test_abstract_model_shapes():
    config = {**BASE, **CASES["parallel-pct25-5heads"], "model_type": "gpt_neox"}
    model = eqx.filter_eval_shape(GPTNeoX.from_config, config, key=jax.random.key(0))
    attn, mlp = model.blocks.attn, model.blocks.mlp
    assert attn.wqkv.shape == (2, 5, 3, 12, 60) and attn.bqkv.shape == (2, 5, 3, 12)
    assert attn.wo.shape == (2, 60, 5, 12) and attn.bo.shape == (2, 60)
    assert mlp.up.shape == (2, 72, 60) and mlp.down.shape == (2, 60, 72) and mlp.bup.shape == (2, 72)
    assert model.blocks.attn_norm.bias.shape == (2, 60) and model.norm.weight.shape == (60,)
    assert model.lm_head.shape == (VOCAB, 60) and model.embed.shape == (VOCAB, 60)
    bare = eqx.filter_eval_shape(
        GPTNeoX.from_config, {**config, "attention_bias": False, "tie_word_embeddings": True}, key=jax.random.key(0)
    )
    assert bare.lm_head is None and bare.blocks.attn.bqkv is None and bare.blocks.attn.bo is None


@pytest.mark.parametrize(
    "head_dim, pct, theta", [(12, 0.25, 10000.0), (8, 0.5, 500.0), (128, 0.25, 10000.0), (12, 0.0, 10000.0)]
)
def test_config_v4_and_v5_agree_and_inv_freq_matches_transformers(head_dim, pct, theta):
    """transformers 4 wrote rotary_pct / rotary_emb_base; transformers 5 writes rope_parameters. The
    inverse frequencies, cos and sin are transformers' (3 rotary dims: over 3, rounded up to 4; 0: none)."""
    transformers = transformers_or_skip()
    import torch

    sizes = dict(
        hidden_size=2 * head_dim, num_attention_heads=2, intermediate_size=8, num_hidden_layers=1, vocab_size=8
    )
    v4 = GPTNeoXConfig.from_hf({**sizes, "rotary_pct": pct, "rotary_emb_base": theta})
    hf = transformers.GPTNeoXConfig(**sizes, rotary_pct=pct, rotary_emb_base=theta)
    v5 = GPTNeoXConfig.from_hf(json.loads(hf.to_json_string()))
    assert v4 == v5 and v5.rope == Rope(theta=theta, rotary_dim=int(head_dim * pct))
    rotary = transformers.models.gpt_neox.modeling_gpt_neox.GPTNeoXRotaryEmbedding(hf)
    np.testing.assert_array_equal(v5.rope.inv_freq(), rotary.inv_freq.numpy())
    positions = np.arange(7)[None]
    cos, sin = rotary(torch.zeros(1, 7, 2 * head_dim), torch.tensor(positions))
    ours = v5.rope.angles(jnp.asarray(positions), jnp.float32)
    np.testing.assert_allclose(np.asarray(ours[0]), cos.numpy(), atol=1e-6, rtol=0)
    np.testing.assert_allclose(np.asarray(ours[1]), sin.numpy(), atol=1e-6, rtol=0)


def test_config_defaults_follow_transformers():
    config = GPTNeoXConfig.from_hf(
        dict(hidden_size=64, num_attention_heads=4, intermediate_size=8, num_hidden_layers=1, vocab_size=8)
    )
    assert (config.rope, config.layer_norm_eps) == (Rope(theta=10000.0, rotary_dim=4), 1e-5)
    assert config.use_parallel_residual and config.attention_bias and not config.tie_word_embeddings
    assert config.hidden_act == "gelu"


@pytest.mark.parametrize(
    "change, match",
    [
        (dict(rope_parameters=dict(rope_type="linear", factor=2.0)), "'linear' is not supported"),
        (dict(rope_scaling=dict(type="dynamic", factor=2.0)), "'dynamic' is not supported"),
        (dict(rotary_pct=1.5), "'rotary_pct' must be a number from 0 to 1"),
        (dict(num_attention_heads=7), "'hidden_size' \\(60\\) must be divisible"),
        (dict(head_dim=20), "'head_dim' 20 is not supported"),
        (dict(hidden_act="mish"), "hidden_act"),
        (dict(use_parallel_residual="yes"), "use_parallel_residual"),
        (dict(model_type="gpt2"), "model_type"),
    ],
)
def test_config_rejects_unsupported(change, match):
    config = {**BASE, **CASES["parallel-pct25-5heads"], **change}
    with pytest.raises(PortError, match=match) as error:
        GPTNeoXConfig.from_hf(config)
    assert "\n" not in str(error.value)
