"""Phi-3: port's Llama module, fed from fused `qkv_proj` and `gate_up_proj` by the shipped `mappings/phi3.toml`.

Parity goes through the converter: each `Phi3ForCausalLM` written by `save_pretrained`,
loaded by `port.load` onto a mesh, gives the logits of `transformers`. The config has 6
query heads and 2 kv heads, so the fused q/k/v rows are cut unequally (48, 16, 16 rows
of hidden 48); RoPE covers "longrope" (the 128k variants: short and long factors, an
attention factor) and a partial rotary dimension (Phi-4-mini). Each device reads only its
own heads' rows of the fused tensor; the export rebuilds the fused tensors bit for bit;
`port plan` on the full-size Phi-3-mini reads no tensor byte. The tests that build a
`transformers` model skip without PyTorch.
"""

import dataclasses

import equinox as eqx
import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import port
from port._errors import PortError
from port._text import count_text, size_text
from port.models.llama import Llama, LlamaConfig

from helpers import (
    LLAMA_CONFIG,
    VOCAB,
    element_bytes,
    hooked,
    logits,
    place_on,
    run_port,
    saved_once,
    torch_llama,
    torch_logits,
    transformers_or_skip,
    write_sparse_checkpoint,
)

HEADS, KV, HEAD_DIM, HIDDEN, MLP = 6, 2, 8, 48, 128
PHI3 = dict(hidden_size=HIDDEN, num_attention_heads=HEADS, num_key_value_heads=KV)
LONGROPE = dict(
    rope_type="longrope",
    rope_theta=10000.0,
    short_factor=[1.0, 1.3, 1.9, 2.6],
    long_factor=[2.0, 4.5, 9.0, 16.0],  # head_dim // 2 each
)
# name: config overrides (on LLAMA_CONFIG, then PHI3)
CASES = {
    "gqa": {},
    # 12 tokens are past the original 8: long factors; 6 are not: short factors.
    "longrope": dict(original_max_position_embeddings=8, rope_parameters=LONGROPE),
    "partial-tied-sliding": dict(
        tie_word_embeddings=True,
        sliding_window=4,
        rope_parameters=dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.5),
    ),
}
MESHES = ("1x1", "4x2", "8x1")
IDS = np.random.default_rng(0).integers(0, VOCAB, (2, 12))
SHORT = IDS[:, :6]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """get(name): (directory written by save_pretrained, the torch model, its logits for IDS)."""
    return saved_once(tmp_path_factory, lambda name: torch_llama("Phi3", **PHI3, **CASES[name]), IDS)


def max_diff(model, expected, ids=IDS) -> float:
    ours = np.asarray(logits(model, ids))
    assert ours.shape == expected.shape and ours.dtype == np.float32
    return float(np.abs(ours - expected).max())


def with_config(model: Llama, **changes) -> Llama:
    """The same weights under a changed (static) config (RoPE fields go to its `rope`)."""
    rope = {
        k: changes.pop(k) for k in ("long_factor", "short_factor", "attention_factor", "rotary_dim") if k in changes
    }
    if rope:
        changes["rope"] = dataclasses.replace(model.config.rope, **rope)
    config = dataclasses.replace(model.config, **changes)
    skeleton = eqx.filter_eval_shape(Llama, config, key=jax.random.key(0))
    return jax.tree.unflatten(jax.tree.structure(skeleton), jax.tree.leaves(model))


# ---------------------------------------------------------------- parity and layout


@pytest.mark.parametrize(
    "name, mesh", [("gqa", m) for m in MESHES] + [("longrope", "4x2"), ("partial-tied-sliding", "4x2")]
)
def test_logits_match_transformers(checkpoints, name, mesh):
    directory, torch_model, expected = checkpoints(name)
    model = port.load(directory, mesh=port.make_mesh(mesh))
    assert max_diff(model, expected) <= 1e-4
    if name == "longrope":  # within the original context: the short factors
        assert max_diff(model, torch_logits(torch_model, SHORT), SHORT) <= 1e-4
    attn, mlp = model.blocks.attn, model.blocks.mlp
    assert attn.wq.shape == (2, HEADS, HEAD_DIM, HIDDEN) and attn.wk.shape == attn.wv.shape == (2, KV, HEAD_DIM, HIDDEN)
    assert mlp.gate.shape == mlp.up.shape == (2, MLP, HIDDEN)
    # Heads (6), kv heads (2) and the MLP (128) split on `model`, embed (48) on `data`;
    # vocab 101 only where `model` has size 1 (else replicated, as the plan notes).
    vocab = None if mesh == "4x2" else "model"
    for w in (attn.wq, attn.wk, attn.wv):
        assert w.sharding.spec == P(None, "model", None, "data")
    assert mlp.gate.sharding.spec == mlp.up.sharding.spec == P(None, "model", "data")
    assert mlp.down.sharding.spec == P(None, "data", "model")
    assert model.embed.sharding.spec == P(vocab, "data")
    assert (model.lm_head is None) == ("tied" in name)
    if model.lm_head is not None:
        assert model.lm_head.sharding.spec == P(vocab, "data")
    assert all(b is None for b in (attn.bq, attn.bk, attn.bv, attn.bo, attn.q_norm, mlp.bgate))


@pytest.mark.parametrize(
    "name, ids, change",
    [
        ("longrope", "long", dict(long_factor=tuple(LONGROPE["short_factor"]))),  # long factors used
        ("longrope", "short", dict(short_factor=tuple(LONGROPE["long_factor"]))),  # short ones used
        ("longrope", "long", dict(attention_factor=1.0)),
        ("partial-tied-sliding", "long", dict(rotary_dim=8)),
        ("partial-tied-sliding", "long", dict(sliding_window=None)),
    ],
    ids=["long-factors", "short-factors", "attention-factor", "full-rotary", "no-window"],
)
def test_ignoring_a_feature_breaks_parity(checkpoints, name, ids, change):
    """The cases above are sensitive to each part of longrope, to the partial rotary and the window."""
    directory, torch_model, expected = checkpoints(name)
    if ids == "short":
        expected = torch_logits(torch_model, SHORT)
    model = with_config(port.load(directory), **change)
    assert max_diff(model, expected, IDS if ids == "long" else SHORT) > 1e-2


# ---------------------------------------------------------------- each device reads its own heads


def test_each_block_reads_only_its_rows_of_the_fused_tensors(checkpoints, reads):
    """On 4x2 a block of wq/wk/wv holding heads [a, b) and embed columns [c, d) reads exactly
    rows [(start + a) * head_dim, (start + b) * head_dim) and those columns of every layer's
    qkv_proj, start being 0 for q, 6 for k and 8 for v; gate and up likewise in gate_up_proj.
    Every byte of the checkpoint is read once, as the plan says."""
    directory, _, _ = checkpoints("gqa")
    first = {
        "blocks.attn.wq": (0, HEAD_DIM),
        "blocks.attn.wk": (HEADS, HEAD_DIM),
        "blocks.attn.wv": (HEADS + KV, HEAD_DIM),
        "blocks.mlp.gate": (0, 1),
        "blocks.mlp.up": (MLP, 1),
    }
    fused = {"attn": "self_attn.qkv_proj", "mlp": "mlp.gate_up_proj"}
    mesh = port.make_mesh("4x2")
    recipe, total, infos = place_on(directory, mesh)
    per_block, elsewhere = reads()
    checked = 0
    for leaf, box, files in per_block:
        if leaf.path not in first:
            continue
        start, rows = first[leaf.path]
        (l0, l1), (a, b), *_, (c, d) = box
        key = f"model.layers.{{}}.{fused[leaf.path.split('.')[1]]}.weight"
        wanted = set().union(
            *(
                element_bytes(infos[key.format(layer)], (((start + a) * rows, (start + b) * rows), (c, d)))
                for layer in range(l0, l1)
            )
        )
        assert len(files) == len(set(files.tolist())) == len(wanted), f"{leaf.path} {box}: a byte read twice"
        assert set(files.tolist()) == wanted, f"{leaf.path} {box}: read outside its heads"
        checked += 1
    assert checked == 5 * 8  # five leaves, 2 x 4 distinct blocks each
    assert total == recipe.read_bytes == sum(i.nbytes for i in infos.values())
    assert len(elsewhere) == 0 and sum(len(f) for _, _, f in per_block) == total  # straight into the blocks


# ---------------------------------------------------------------- the way back


@pytest.mark.parametrize("name", ["gqa", "partial-tied-sliding"])
def test_export_rebuilds_the_fused_tensors(checkpoints, name, tmp_path):
    """port.load on 4x2 -> port.export -> from_pretrained: qkv_proj and gate_up_proj concatenated back
    from wq/wk/wv and gate/up bit for bit; no missing or unexpected key; the original model's weights."""
    import torch
    from safetensors.numpy import load_file

    transformers = transformers_or_skip()
    directory, original, _ = checkpoints(name)
    model = port.load(directory, mesh=port.make_mesh("4x2"))
    out = port.export(model, tmp_path / "hf", directory).out
    source, exported = load_file(directory / "model.safetensors"), load_file(out / "model.safetensors")
    assert exported.keys() == source.keys()
    assert exported["model.layers.1.self_attn.qkv_proj.weight"].shape == ((HEADS + 2 * KV) * HEAD_DIM, HIDDEN)
    for key, value in source.items():
        assert exported[key].dtype == value.dtype and exported[key].tobytes() == value.tobytes(), key
    back, info = transformers.Phi3ForCausalLM.from_pretrained(out, output_loading_info=True)
    for what in ("missing_keys", "unexpected_keys", "mismatched_keys", "error_msgs"):
        assert not info[what], f"{what}: {info[what]}"
    ours, theirs = back.state_dict(), original.state_dict()
    assert ours.keys() == theirs.keys()
    assert all(torch.equal(ours[k], theirs[k]) for k in theirs)


# ---------------------------------------------------------------- port plan at full size

# microsoft/Phi-3-mini-4k-instruct's config.json.
PHI3_MINI = {
    "architectures": ["Phi3ForCausalLM"],
    "attention_dropout": 0.0,
    "bos_token_id": 1,
    "embd_pdrop": 0.0,
    "eos_token_id": 32000,
    "hidden_act": "silu",
    "hidden_size": 3072,
    "initializer_range": 0.02,
    "intermediate_size": 8192,
    "max_position_embeddings": 4096,
    "model_type": "phi3",
    "num_attention_heads": 32,
    "num_hidden_layers": 32,
    "num_key_value_heads": 32,
    "original_max_position_embeddings": 4096,
    "pad_token_id": 32000,
    "resid_pdrop": 0.0,
    "rms_norm_eps": 1e-05,
    "rope_scaling": None,
    "rope_theta": 10000.0,
    "sliding_window": 2047,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "use_cache": True,
    "vocab_size": 32064,
}
NO_READS = """
import pathlib, os
import port._sources._local

def refuse(*args, **kwargs):
    raise RuntimeError("port plan read tensor data")

port._sources._local._preadv = refuse
port._sources._local.LocalCheckpoint.read_into = refuse
pathlib.Path(os.environ["PORT_TEST_NO_READS"]).touch()
"""


@pytest.mark.slow
def test_plan_of_phi3_mini_at_full_size(tmp_path):
    """`port plan --mesh 4x2` on Phi-3-mini's config.json and a header for every tensor (the shapes
    transformers builds, on the meta device): exit 0, bytes per device as the mesh divides each
    tensor, and no tensor byte read (the subprocess refuses any)."""
    import torch

    transformers = transformers_or_skip()
    with torch.device("meta"):
        reference = transformers.Phi3ForCausalLM(transformers.Phi3Config(**PHI3_MINI))
    shapes = {k: tuple(v.shape) for k, v in reference.state_dict().items()}
    write_sparse_checkpoint(tmp_path / "phi-3-mini", PHI3_MINI, shapes)
    marker = tmp_path / "no-reads-installed"
    env = hooked(tmp_path / "site", NO_READS) | {"PORT_TEST_NO_READS": str(marker)}
    result = run_port("plan", tmp_path / "phi-3-mini", "--mesh", "4x2", env=env)
    assert result.returncode == 0, result.stdout + result.stderr
    assert marker.exists()  # the refusal of reads was in force
    # 4x2: every weight dimension divides (vocab 32064, 3072, 8192, 32 heads): 1/8 per device;
    # the norms [embed] only on `data`: 1/4.
    per_device = sum(2 * np.prod(s) // (4 if len(s) == 1 else 8) for s in shapes.values())
    params = sum(int(np.prod(s)) for s in shapes.values())
    data = 2 * params  # the tensors' bytes: bfloat16
    lines = result.stdout.splitlines()
    assert lines[-1] == (
        f"{count_text(params)} params in 12 leaves; {size_text(data)} to read, {size_text(per_device)} per device"
    )
    text = " ".join(result.stdout.split())
    for index, leaf in enumerate(("wq", "wk", "wv")):  # 32 heads of 96 each, cut from one qkv_proj
        assert (
            f"blocks.attn.{leaf} bf16[32,32,96,3072] (-, model, -, data) {size_text(2 * 32 * 32 * 96 * 3072 // 8)} "
            "from layers.{layer}.self_attn.qkv_proj.weight x32 > reshape[-1, 96, 3072] > "
            f"split(axis=0, sizes=[32, 32, 32], index={index})"
        ) in text


# ---------------------------------------------------------------- the config


def phi3_config(**changes) -> dict:
    return {**LLAMA_CONFIG, **PHI3, "model_type": "phi3", **changes}


def test_longrope_matches_transformers_at_128k_sizes():
    """Phi-3-mini-128k's RoPE (head_dim 96, 48 factors each, 131072 / 4096 positions, the v4 key
    rope_scaling): the inverse frequencies and attention factor of transformers'
    Phi3RotaryEmbedding, short up to 4096 tokens and long past them. The v5 key
    rope_parameters and the old type name "su" read the same."""
    import torch

    transformers = transformers_or_skip()
    rng = np.random.default_rng(0)
    factors = {"short_factor": (1 + rng.random(48)).tolist(), "long_factor": (1 + 9 * rng.random(48)).tolist()}
    config = {**PHI3_MINI, "max_position_embeddings": 131072, "rope_scaling": {"type": "longrope", **factors}}
    ours = LlamaConfig.from_hf(config)
    rotary = transformers.models.phi3.modeling_phi3.Phi3RotaryEmbedding(transformers.Phi3Config(**config))
    for seq in (4096, 4097):
        rotary(torch.zeros(1, dtype=torch.float32), torch.arange(seq)[None])
        np.testing.assert_allclose(
            ours.rope.inv_freq(long=seq > 4096), rotary.inv_freq.numpy(), rtol=1e-6
        )  # float32 pow: an ulp
    assert not np.array_equal(ours.rope.inv_freq(long=False), ours.rope.inv_freq(long=True))
    assert (
        ours.rope.attention_factor == pytest.approx(rotary.attention_scaling, rel=1e-12)
        and ours.rope.attention_factor > 1
    )
    v5 = {
        **config,
        "rope_scaling": None,
        "rope_parameters": {"rope_type": "longrope", "rope_theta": 10000.0, **factors},
    }
    su = {**config, "rope_scaling": {"type": "su", **factors}}
    assert LlamaConfig.from_hf(v5) == LlamaConfig.from_hf(su) == ours


@pytest.mark.parametrize(
    "change, match",
    [
        (dict(rope_scaling=dict(type="linear", factor=2.0)), r"config.json: rope_scaling: rope type 'linear'"),
        (
            dict(rope_parameters={**LONGROPE, "short_factor": [1.0]}),
            r"config.json: 'rope_parameters.short_factor' must list 4",
        ),
        (dict(rope_parameters={**LONGROPE, "long_factor": None}), r"rope_parameters.long_factor"),
        (dict(partial_rotary_factor=0.375), r"config.json: 'partial_rotary_factor' 0.375 of head_dim 8 gives 3"),
    ],
)
def test_config_rejects_unsupported(change, match):
    with pytest.raises(PortError, match=match):
        LlamaConfig.from_hf(phi3_config(**change))


def test_config_defaults_follow_phi3config():
    """Where config.json is silent: Phi3Config's eps (1e-5), one kv head per head, no window,
    original context 4096, head_dim hidden / heads; partial rotary as rope_parameters says."""
    transformers = transformers_or_skip()
    base = {k: v for k, v in LLAMA_CONFIG.items() if k != "num_key_value_heads"}
    theirs = transformers.Phi3Config(**base)
    ours = LlamaConfig.from_hf({**base, "model_type": "phi3"})
    assert ours.rms_norm_eps == theirs.rms_norm_eps == 1e-5
    assert ours.num_key_value_heads == theirs.num_key_value_heads == 4
    assert ours.sliding_window is None and theirs.sliding_window is None
    assert ours.head_dim == theirs.hidden_size // theirs.num_attention_heads
    assert not (ours.qkv_bias or ours.o_bias or ours.mlp_bias or ours.qk_norm)
    partial = LlamaConfig.from_hf(
        phi3_config(rope_parameters={"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.75})
    )
    assert partial.rope.rotary_dim == 6 and partial.rope.inv_freq().shape == (3,)
