"""OLMo 2, OLMo 3 and SmolLM3: port's Llama module with their switches, converted by the shipped
`mappings/olmo2.toml` (both OLMos) and `mappings/llama.toml` (SmolLM3).

What each case exercises, beyond Llama:

- `olmo2`: norms after the attention and the MLP (`Block(norms="post")`), q/k RMSNorm over
  the whole projection (`Attention(qk_norm="projection")`), every RMSNorm applying its
  weight in float32 (`rms_norm(float32_scale=True)`), attention biases.
- `olmo3`: OLMo 2's layout with sliding-window layers by `layer_types` (window 4, shorter
  than the 12 tokens), the sliding layers with their own RoPE base (`run_layers(sliding_rope=)`).
- `smollm3`: layers without RoPE (`no_rope_layers`, `run_layers(rope_layers=)`), sliding
  windows on those layers (its default `layer_types`), a tied head and its default base 2e6.

Parity on meshes 1x1 and 4x2 in float32 and bfloat16, the export round trip through
`from_pretrained`, the features' own effect, and config errors as one line.
"""

import dataclasses
import json
import time

import equinox as eqx
import jax
import ml_dtypes
import numpy as np
import pytest

import port
from port._errors import ConfigError
from port.models.llama import Llama, LlamaConfig

from helpers import (
    LLAMA_CONFIG,
    REPO,
    VOCAB,
    logits,
    one_line,
    perturbed,
    run_port,
    run_port_measured,
    saved_once,
    torch_logits,
    transformers_or_skip,
    write_sparse_checkpoint,
)

# name: (transformers' class prefix, config overrides on LLAMA_CONFIG)
FAMILIES = {
    "olmo2": ("Olmo2", dict(attention_bias=True)),
    "olmo3": (
        "Olmo3",
        dict(
            num_hidden_layers=4,
            sliding_window=4,
            rope_parameters={
                "full_attention": {"rope_type": "default", "rope_theta": 500000.0},
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            },
        ),
    ),
    "smollm3": (
        "SmolLM3",
        dict(num_hidden_layers=4, no_rope_layers=[1, 0, 1, 0], use_sliding_window=True, sliding_window=4),
    ),
}
MESHES = ("1x1", "4x2")
IDS = np.random.default_rng(0).integers(0, VOCAB, (2, 12))


def torch_model(family: str, dtype=None):
    """A seeded `{Family}ForCausalLM` of the small config, norms and biases perturbed; skips without PyTorch."""
    transformers = transformers_or_skip()
    import torch

    prefix, overrides = FAMILIES[family]
    torch.manual_seed(0)
    config = getattr(transformers, f"{prefix}Config")(**{**LLAMA_CONFIG, **overrides})
    config._attn_implementation = "eager"
    model = getattr(transformers, f"{prefix}ForCausalLM")(config)
    model = perturbed(model, lambda name: name.endswith("bias") or "norm" in name, 0.2)
    return model if dtype is None else model.to(getattr(torch, dtype))


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """get(family): (directory written by save_pretrained, the torch model, its logits); built once."""
    return saved_once(tmp_path_factory, torch_model, IDS)


def max_diff(model, expected) -> float:
    ours = np.asarray(logits(model, IDS)).astype(np.float32)
    assert ours.shape == expected.shape
    return float(np.abs(ours - expected).max())


# ---------------------------------------------------------------- parity


@pytest.mark.parametrize("family, mesh", [(f, m) for f in FAMILIES for m in MESHES])
def test_logits_match_transformers(checkpoints, family, mesh):
    directory, _, expected = checkpoints(family)
    model = port.load(directory, mesh=port.make_mesh(mesh))
    assert max_diff(model, expected) <= 1e-4
    blocks, c = model.blocks, model.config
    if family.startswith("olmo"):
        assert blocks.attn_norm is None and blocks.mlp_norm is None
        assert blocks.post_attn_norm is not None and blocks.post_mlp_norm is not None
        layers = c.num_hidden_layers
        assert blocks.attn.q_norm.shape == (layers, 4, 16) and blocks.attn.k_norm.shape == (layers, 2, 16)
    else:
        assert blocks.post_attn_norm is None and c.rope_layers == (True, False, True, False)
        assert c.sliding_layers == (False, True, False, True) and model.lm_head is None
    if family == "olmo3":
        assert c.sliding_layers == (True, True, True, False) and c.sliding_rope is not None


@pytest.mark.parametrize("family, mesh", [(f, m) for f in FAMILIES for m in MESHES])
def test_bfloat16_end_to_end(family, mesh, tmp_path):
    """A bfloat16 checkpoint loads as bfloat16 and computes in it, within twice transformers'
    own bfloat16 error (its bfloat16 logits against its float32 ones on the same weights) of
    both (see tests/test_gemma.py for why that is the tolerance)."""
    import torch

    model = torch_model(family)
    reference = torch_logits(model, IDS)
    model = model.to(torch.bfloat16)
    model.save_pretrained(tmp_path)
    expected = torch_logits(model, IDS)
    rounding = np.abs(expected - reference).max()
    ours = port.load(tmp_path, mesh=mesh)
    bf16 = np.dtype(ml_dtypes.bfloat16)
    assert all(x.dtype == bf16 for x in jax.tree.leaves(eqx.filter(ours, eqx.is_array)))
    out = logits(ours, IDS)
    assert out.dtype == bf16
    out = np.asarray(out).astype(np.float32)
    assert np.abs(out - expected).max() <= 2 * rounding
    assert np.abs(out - reference).max() <= 2 * rounding


def with_config(model: Llama, **changes) -> Llama:
    """The same weights under a changed (static) config."""
    config = dataclasses.replace(model.config, **changes)
    skeleton = eqx.filter_eval_shape(Llama, config, key=jax.random.key(0))
    return jax.tree.unflatten(jax.tree.structure(skeleton), jax.tree.leaves(model))


@pytest.mark.parametrize(
    "family, changes",
    [
        ("olmo2", dict(float32_scale=False)),
        ("olmo2", dict(qk_norm="head")),
        ("olmo3", dict(sliding_rope=None)),
        ("olmo3", dict(sliding_window=None)),
        ("smollm3", dict(rope_layers=None)),
    ],
    ids=["olmo2-cast-first", "olmo2-per-head", "olmo3-one-rope", "olmo3-no-window", "smollm3-rope-everywhere"],
)
def test_ignoring_a_feature_breaks_parity(checkpoints, family, changes):
    """Each switch the family turns on matters on these weights (in float32 for all but the
    norm's scale, which shows in bfloat16 only: there, the weights and inputs are bfloat16)."""
    directory, _, expected = checkpoints(family)
    model = port.load(directory)
    if "qk_norm" in changes:  # per head: the same weights, one norm row per head
        model = eqx.tree_at(
            lambda m: (m.blocks.attn.q_norm, m.blocks.attn.k_norm),
            model,
            (model.blocks.attn.q_norm[:, 0], model.blocks.attn.k_norm[:, 0]),
        )
    if "float32_scale" in changes:
        model = jax.tree.map(lambda a: a.astype(jax.numpy.bfloat16) if eqx.is_array(a) else a, model)
        right = np.asarray(logits(model, IDS)).astype(np.float32)
        wrong = np.asarray(logits(with_config(model, **changes), IDS)).astype(np.float32)
        assert np.abs(right - wrong).max() > 0
        return
    assert max_diff(with_config(model, **changes), expected) > 1e-2


# ---------------------------------------------------------------- the way back


@pytest.mark.parametrize("family", FAMILIES)
def test_export_round_trip(checkpoints, family, tmp_path):
    """port.load on 4x2 -> port.export -> from_pretrained: the source file's tensors bit for bit,
    no missing or unexpected key, the original model's weights."""
    import torch
    from safetensors.numpy import load_file

    transformers = transformers_or_skip()
    directory, original, _ = checkpoints(family)
    model = port.load(directory, mesh=port.make_mesh("4x2"))
    out = port.export(model, tmp_path / "hf", directory).out
    source, exported = load_file(directory / "model.safetensors"), load_file(out / "model.safetensors")
    assert exported.keys() == source.keys()
    for key, value in source.items():
        assert exported[key].dtype == value.dtype and exported[key].tobytes() == value.tobytes(), key
    cls = getattr(transformers, f"{FAMILIES[family][0]}ForCausalLM")
    back, info = cls.from_pretrained(out, output_loading_info=True)
    for what in ("missing_keys", "unexpected_keys", "mismatched_keys", "error_msgs"):
        assert not info[what], f"{what}: {info[what]}"
    ours, theirs = back.state_dict(), original.state_dict()
    assert ours.keys() == theirs.keys()
    assert all(torch.equal(ours[k], theirs[k]) for k in theirs)


# ---------------------------------------------------------------- the config


def small(model_type: str, **overrides) -> dict:
    return {**LLAMA_CONFIG, "model_type": model_type, **overrides}


def test_defaults_follow_transformers():
    """What config.json may leave out: SmolLM3's base 2e6, tied head and NoPE every 4th layer;
    OLMo 3's base 5e5, window 4096 on three layers of four; OLMo 2's epsilon 1e-5."""
    smol = LlamaConfig.from_hf(small("smollm3", num_hidden_layers=8))
    assert smol.rope.theta == 2e6 and smol.tie_word_embeddings
    assert smol.rope_layers == (True, True, True, False) * 2 and smol.sliding_window is None
    olmo3 = LlamaConfig.from_hf(small("olmo3", num_hidden_layers=4))
    assert olmo3.rope.theta == 5e5 and olmo3.sliding_rope is None
    assert olmo3.sliding_window == 4096 and olmo3.sliding_layers == (True, True, True, False)
    olmo2 = LlamaConfig.from_hf(small("olmo2"))
    assert olmo2.rms_norm_eps == 1e-5 and olmo2.norms == "post" and olmo2.qk_norm == "projection"


@pytest.mark.parametrize(
    "config, message",
    [
        (
            small("smollm3", no_rope_layers=[1, 0, 1]),
            "config.json: 'no_rope_layers' must list 2 of 0 or 1, got [1, 0, 1]",
        ),
        (
            small("olmo3", layer_types=["sliding_attention", "chunked"]),
            "config.json: 'layer_types' must list 2 of ('full_attention', 'sliding_attention'), got",
        ),
        (
            small("olmo3", rope_parameters={"full_attention": {"rope_type": "dynamic", "factor": 2.0}}),
            "config.json: rope_parameters",
        ),
    ],
    ids=["no-rope-layers", "layer-types", "rope-type"],
)
def test_bad_config_is_one_line(config, message):
    with pytest.raises(ConfigError) as raised:
        LlamaConfig.from_hf(config)
    assert str(raised.value).startswith(message) and "\n" not in str(raised.value)


@pytest.mark.slow
def test_port_check_and_convert_refuse_a_bad_layer_list(checkpoints, tmp_path):
    """`port check` of the shipped mapping passes an OLMo 3 checkpoint; with a `layer_types` of
    the wrong length, it and `port convert` give one line before any tensor is read."""
    directory, _, _ = checkpoints("olmo3")
    result = run_port("check", REPO / "mappings" / "olmo2.toml", directory)
    assert result.returncode == 0 and ": ok: " in result.stdout, result.stdout + result.stderr
    bad = tmp_path / "bad"
    bad.mkdir()
    config = json.loads((directory / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps({**config, "layer_types": ["full_attention"]}))
    (bad / "model.safetensors").symlink_to(directory / "model.safetensors")
    line = "config.json: 'layer_types' must list 4 of"
    one_line(run_port("check", REPO / "mappings" / "olmo2.toml", bad), line)
    one_line(run_port("convert", bad, "--out", tmp_path / "out"), line, out=tmp_path / "out")


# ---------------------------------------------------------------- a real model's plan

OLMO2_32B = {
    "model_type": "olmo2",
    "architectures": ["Olmo2ForCausalLM"],
    "vocab_size": 100352,
    "hidden_size": 5120,
    "intermediate_size": 27648,
    "num_hidden_layers": 64,
    "num_attention_heads": 40,
    "num_key_value_heads": 8,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-6,
    "rope_theta": 500000,
    "tie_word_embeddings": False,
}


def olmo2_shapes(c: dict) -> dict:
    """Olmo2ForCausalLM's tensors for config `c`."""
    h, v, inter = c["hidden_size"], c["vocab_size"], c["intermediate_size"]
    head = h // c["num_attention_heads"]
    q, kv = c["num_attention_heads"] * head, c["num_key_value_heads"] * head
    shapes = {"model.embed_tokens.weight": [v, h], "model.norm.weight": [h], "lm_head.weight": [v, h]}
    for i in range(c["num_hidden_layers"]):
        layer = f"model.layers.{i}."
        shapes |= {
            layer + "self_attn.q_proj.weight": [q, h],
            layer + "self_attn.k_proj.weight": [kv, h],
            layer + "self_attn.v_proj.weight": [kv, h],
            layer + "self_attn.o_proj.weight": [h, q],
            layer + "self_attn.q_norm.weight": [q],
            layer + "self_attn.k_norm.weight": [kv],
            layer + "post_attention_layernorm.weight": [h],
            layer + "mlp.gate_proj.weight": [inter, h],
            layer + "mlp.up_proj.weight": [inter, h],
            layer + "mlp.down_proj.weight": [h, inter],
            layer + "post_feedforward_layernorm.weight": [h],
        }
    return shapes


@pytest.mark.slow
def test_plan_olmo2_32b_reads_no_tensor(tmp_path):
    """`port plan` on OLMo-2-0325-32B's real sizes (a ~64 GB sparse file): exit 0, the q/k norms
    sharded with the heads, well under 1 GB read and of peak RSS in either process."""
    size = write_sparse_checkpoint(tmp_path / "olmo2", OLMO2_32B, olmo2_shapes(OLMO2_32B))
    assert size > 60e9
    start = time.perf_counter()
    result, rchar, peak = run_port_measured(tmp_path, "plan", tmp_path / "olmo2", "--mesh", "4x2")
    took = time.perf_counter() - start
    assert result.returncode == 0, result.stdout + result.stderr
    assert "blocks.attn.q_norm" in result.stdout and "blocks.post_mlp_norm" in result.stdout
    assert rchar < 1e9 and peak < 1e9, (rchar, peak)
    print(f"port plan of OLMo-2-0325-32B: {took:.1f} s, peak RSS {peak / 2**20:.0f} MiB")
