"""Gemma and Gemma 2: port's model, converted by the shipped `mappings/gemma*.toml`, against `transformers`.

Parity goes through the converter: each `*ForCausalLM` written by `save_pretrained`,
loaded by `port.load` on three meshes, gives transformers' logits. The configs are
chosen to be awkward: GQA ratio 3, an odd head count (replicated on a `model` axis of
2, and the plan says so), head_dim unrelated to hidden / heads, a sliding window shorter
than the input, and soft-caps small enough to clip (the tests check that removing one
breaks parity). Also: Gemma 2 in bfloat16 end to end, a round trip through
`port.export` back into transformers, the plan of the full-size Gemma-2-9B reading no
tensor, and one-line errors for bad config values. The tests that build a
`transformers` model skip without PyTorch.
"""

import math

import equinox as eqx
import jax
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import port
from port._errors import ConfigError
from port._text import size_text
from port.models.gemma import GemmaConfig

from helpers import (
    logits,
    perturbed,
    recorded_reads,
    run_port,
    saved_once,
    torch_logits,
    transformers_or_skip,
    write_sparse_checkpoint,
)

COMMON = dict(
    hidden_size=48,
    intermediate_size=96,
    initializer_range=0.2,
    max_position_embeddings=64,
    pad_token_id=None,
    bos_token_id=0,
    eos_token_id=0,
)
# family: (transformers architecture, config). Gemma: 3 heads on 1 kv head (GQA 3, odd
# heads: replicated on model=2), head_dim 32 (hidden / heads is 16), biases, vocab 101
# (replicated on model=2). Gemma 2: 6 heads on 2 kv heads, head_dim 16 (not 8),
# query_pre_attn_scalar 24 (not head_dim), window 4 < 12 tokens in layers 0 and 2,
# soft-caps that clip, vocab 100 (sharded on model=2).
FAMILIES = {
    "gemma": (
        "Gemma",
        dict(
            COMMON,
            vocab_size=101,
            num_hidden_layers=2,
            num_attention_heads=3,
            num_key_value_heads=1,
            head_dim=32,
            attention_bias=True,
            rms_norm_eps=1e-5,
        ),
    ),
    "gemma2": (
        "Gemma2",
        dict(
            COMMON,
            vocab_size=100,
            num_hidden_layers=3,
            num_attention_heads=6,
            num_key_value_heads=2,
            head_dim=16,
            query_pre_attn_scalar=24,
            sliding_window=4,
            attn_logit_softcapping=2.0,
            final_logit_softcapping=5.0,
        ),
    ),
}
MESHES = ("1x1", "4x2", "8x1")
IDS = np.random.default_rng(0).integers(0, 100, (2, 12))  # 12 tokens: 3 windows of 4

# google/gemma-2-9b-it's config.json (the base model's differs only in torch_dtype).
GEMMA2_9B = {
    "architectures": ["Gemma2ForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "attn_logit_softcapping": 50.0,
    "bos_token_id": 2,
    "cache_implementation": "hybrid",
    "eos_token_id": 1,
    "final_logit_softcapping": 30.0,
    "head_dim": 256,
    "hidden_act": "gelu_pytorch_tanh",
    "hidden_activation": "gelu_pytorch_tanh",
    "hidden_size": 3584,
    "initializer_range": 0.02,
    "intermediate_size": 14336,
    "max_position_embeddings": 8192,
    "model_type": "gemma2",
    "num_attention_heads": 16,
    "num_hidden_layers": 42,
    "num_key_value_heads": 8,
    "pad_token_id": 0,
    "query_pre_attn_scalar": 256,
    "rms_norm_eps": 1e-06,
    "rope_theta": 10000.0,
    "sliding_window": 4096,
    "sliding_window_size": 4096,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.42.0.dev0",
    "use_cache": True,
    "vocab_size": 256000,
}


def torch_gemma(family: str, dtype: str | None = None, **overrides):
    """A seeded `GemmaForCausalLM` / `Gemma2ForCausalLM` of the family's config, eager attention.

    Norms (zero-initialised: a scale of 1 + 0) and biases get noise, so that `1 + w`
    and the biases matter. `torch_gemma("gemma2", tie_word_embeddings=False)`.
    """
    transformers = transformers_or_skip()
    import torch

    arch, config = FAMILIES[family]
    torch.manual_seed(0)
    hf_config = getattr(transformers, f"{arch}Config")(**{**config, **overrides})
    hf_config._attn_implementation = "eager"
    model = getattr(transformers, f"{arch}ForCausalLM")(hf_config)
    model = perturbed(model, lambda name: "norm" in name or name.endswith("bias"), 0.2)
    return model if dtype is None else model.to(getattr(torch, dtype))


def max_diff(model, expected: np.ndarray) -> float:
    """The largest |port logit - expected logit| on `IDS`."""
    return float(np.abs(np.asarray(logits(model, IDS)).astype(np.float32) - expected).max())


def expected_spec(mesh: str, *dims: tuple[int, str | None]) -> P:
    """The spec of a leaf whose dims are (size, mesh axis its rule names): an axis that does not
    divide its size is replicated. `expected_spec("4x2", (3, "model"))` is `P(None)`."""
    sizes = dict(zip(("data", "model"), map(int, mesh.split("x"))))
    return P(*(axis if axis is not None and n % sizes[axis] == 0 else None for n, axis in dims))


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """get(family): (directory written by save_pretrained, the model, its PyTorch float32 logits)."""
    return saved_once(tmp_path_factory, torch_gemma, IDS)


@pytest.fixture(scope="module")
def loaded(checkpoints):
    """get(family, mesh): port.load of the family's checkpoint on the mesh (one load each)."""
    made = {}

    def get(family, mesh):
        if (family, mesh) not in made:
            made[family, mesh] = port.load(checkpoints(family).directory, mesh=mesh)
        return made[family, mesh]

    return get


# ---------------------------------------------------------------- parity


@pytest.mark.parametrize("mesh", MESHES)
@pytest.mark.parametrize("family", FAMILIES)
def test_logits_match_transformers(checkpoints, loaded, family, mesh):
    """float32 logits within 1e-4 of transformers', sharded as the rules say where the mesh divides."""
    expected = checkpoints(family).logits
    config = FAMILIES[family][1]
    model = loaded(family, mesh)
    out = logits(model, IDS)
    assert out.shape == (*IDS.shape, config["vocab_size"]) and out.dtype == np.float32
    np.testing.assert_allclose(np.asarray(out), expected, atol=1e-4, rtol=0)

    e, v, i = config["hidden_size"], config["vocab_size"], config["intermediate_size"]
    h, kv, d, n = (config[k] for k in ("num_attention_heads", "num_key_value_heads", "head_dim", "num_hidden_layers"))
    attn = model.blocks.attn
    assert attn.wq.sharding.spec == expected_spec(mesh, (n, None), (h, "model"), (d, None), (e, "data"))
    assert attn.wk.sharding.spec == expected_spec(mesh, (n, None), (kv, "model"), (d, None), (e, "data"))
    assert attn.wo.sharding.spec == expected_spec(mesh, (n, None), (e, "data"), (h, "model"), (d, None))
    assert model.blocks.mlp.down.sharding.spec == expected_spec(mesh, (n, None), (e, "data"), (i, "model"))
    assert model.embed.sharding.spec == expected_spec(mesh, (v, "model"), (e, "data"))
    assert model.lm_head is None  # tied: save_pretrained wrote no lm_head.weight
    assert (attn.bq is None) != config.get("attention_bias", False)
    assert (model.blocks.post_mlp_norm is None) == (family == "gemma")


def test_the_plan_replicates_what_the_mesh_does_not_divide(checkpoints):
    """Gemma's 3 heads, 1 kv head and 101-token vocab on model=2: replicated, with a note each."""
    with port.open_checkpoint(checkpoints("gemma").directory) as ckpt:
        mapping = port.mapping_for(ckpt.config)
        recipe = port.plan(
            port.skeleton(mapping, ckpt.config), mapping, ckpt.tensors, ckpt.config, {"data": 4, "model": 2}
        )
    notes = {leaf.path: leaf.notes for leaf in recipe.leaves}
    assert notes["blocks.attn.wq"] == ("heads 3 not divisible by model=2: replicated on model",)
    assert notes["blocks.attn.wk"] == ("kv_heads 1 not divisible by model=2: replicated on model",)
    assert notes["embed"] == ("vocab 101 not divisible by model=2: replicated on model",)
    assert notes["blocks.mlp.gate"] == ()
    assert "lm_head" not in notes and recipe.tied == ()  # tied, and save_pretrained wrote no copy


def torch_variant(family: str, model, **changes):
    """`model`'s weights in a transformers model built from its config with `changes`."""
    transformers = transformers_or_skip()
    arch, config = FAMILIES[family]
    hf_config = getattr(transformers, f"{arch}Config")(**{**config, **changes})
    hf_config._attn_implementation = "eager"
    variant = getattr(transformers, f"{arch}ForCausalLM")(hf_config).eval()
    variant.load_state_dict(model.state_dict())
    return variant


@pytest.mark.parametrize(
    "change",
    [
        dict(attn_logit_softcapping=None),
        dict(final_logit_softcapping=None),
        dict(sliding_window=64),  # longer than the input: no window
        dict(sliding_window=3),  # off by one either way
        dict(sliding_window=5),
        dict(layer_types=["sliding_attention"] * 3),
        dict(query_pre_attn_scalar=16),  # head_dim: Gemma's scale
    ],
    ids=["no-attn-cap", "no-final-cap", "no-window", "window-3", "window-5", "window-everywhere", "head-dim-scale"],
)
def test_the_gemma2_case_is_sensitive_to_each_feature(checkpoints, change):
    """Each cap clips, and the window, its layers and the scale matter: transformers' logits move by
    > 1e-2 without them, 100 times the parity tolerance, so port's (within 1e-4) must implement them."""
    _, model, expected = checkpoints("gemma2")
    assert np.abs(torch_logits(torch_variant("gemma2", model, **change), IDS) - expected).max() > 1e-2


def test_final_soft_cap_bounds_the_logits(checkpoints, loaded):
    cap = FAMILIES["gemma2"][1]["final_logit_softcapping"]
    out = np.asarray(logits(loaded("gemma2", "1x1"), IDS))
    assert 0.5 * cap < np.abs(out).max() < cap


# ---------------------------------------------------------------- bfloat16


def test_gemma2_bfloat16_end_to_end(tmp_path):
    """A bfloat16 checkpoint loads as bfloat16 and computes in it, as close to transformers' bfloat16
    logits as those are to its float32 ones.

    bfloat16 keeps 8 significant bits: each op rounds at ~0.4% of its values, and how
    that adds up over 3 layers depends on the order of operations, which differs
    (XLA's einsums vs torch's matmuls). So the tolerance is transformers' own bfloat16
    error, measured against its float32 logits on the same weights: port's bfloat16
    logits must be within twice that of both transformers' bfloat16 and float32 logits
    (measured: 0.068 and 0.091 vs 0.063, on logits up to 3.8).
    """
    import torch

    model = torch_gemma("gemma2", tie_word_embeddings=False)  # an untied head: lm_head in the file
    reference = torch_logits(model, IDS)
    model = model.to(torch.bfloat16)
    model.save_pretrained(tmp_path)
    expected = torch_logits(model, IDS)
    rounding = np.abs(expected - reference).max()

    ours = port.load(tmp_path, mesh="4x2")
    bf16 = np.dtype(ml_dtypes.bfloat16)
    assert all(x.dtype == bf16 for x in jax.tree.leaves(eqx.filter(ours, eqx.is_array)))
    assert ours.lm_head is not None
    out = logits(ours, IDS)
    assert out.dtype == bf16
    out = np.asarray(out).astype(np.float32)
    assert np.abs(out - expected).max() <= 2 * rounding
    assert np.abs(out - reference).max() <= 2 * rounding


# ---------------------------------------------------------------- export


@pytest.mark.parametrize("family", FAMILIES)
def test_export_round_trip_is_bit_identical(checkpoints, loaded, family, tmp_path):
    """port.load on 4x2 -> port.export -> from_pretrained: no missing or unexpected key, same weights."""
    import torch

    transformers = transformers_or_skip()
    source = checkpoints(family).directory
    out = port.export(loaded(family, "4x2"), tmp_path / "hf", source).out
    cls = getattr(transformers, f"{FAMILIES[family][0]}ForCausalLM")
    exported, info = cls.from_pretrained(out, output_loading_info=True)
    for what in ("missing_keys", "unexpected_keys", "mismatched_keys", "error_msgs"):
        assert not info[what], f"{what}: {info[what]}"
    ours, theirs = exported.state_dict(), cls.from_pretrained(source).state_dict()
    assert ours.keys() == theirs.keys()
    for key, value in theirs.items():
        assert ours[key].dtype == value.dtype and torch.equal(ours[key], value), key


# ---------------------------------------------------------------- the full-size plan


def gemma2_9b_tensors(config: dict) -> dict[str, list[int]]:
    """Every tensor of Gemma2ForCausalLM.save_pretrained for `config`, by key: its shape."""
    e, i, v = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    q, kv = config["num_attention_heads"] * config["head_dim"], config["num_key_value_heads"] * config["head_dim"]
    shapes = {"model.embed_tokens.weight": [v, e], "model.norm.weight": [e]}
    for layer in range(config["num_hidden_layers"]):
        p = f"model.layers.{layer}."
        shapes |= {
            p + "input_layernorm.weight": [e],
            p + "post_attention_layernorm.weight": [e],
            p + "pre_feedforward_layernorm.weight": [e],
            p + "post_feedforward_layernorm.weight": [e],
            p + "self_attn.q_proj.weight": [q, e],
            p + "self_attn.k_proj.weight": [kv, e],
            p + "self_attn.v_proj.weight": [kv, e],
            p + "self_attn.o_proj.weight": [e, q],
            p + "mlp.gate_proj.weight": [i, e],
            p + "mlp.up_proj.weight": [i, e],
            p + "mlp.down_proj.weight": [e, i],
        }
    return shapes


@pytest.mark.slow
def test_plan_of_the_full_size_gemma2_9b_reads_no_tensor(tmp_path):
    """`port plan` on Gemma-2-9B's real shapes (18.5 GB of bfloat16, a sparse file): every leaf
    sharded 8 ways on 4x2 but the norms (4 ways, on data), no tensor byte read."""
    shapes = gemma2_9b_tensors(GEMMA2_9B)
    directory = tmp_path / "gemma-2-9b"
    write_sparse_checkpoint(directory, GEMMA2_9B, shapes)
    params = sum(math.prod(s) for s in shapes.values())
    data = 2 * params  # the tensors' bytes: bfloat16
    per_device = sum(2 * math.prod(s) // (4 if len(s) == 1 else 8) for s in shapes.values())
    assert round(params / 1e9, 2) == 9.24

    with recorded_reads() as calls, port.open_checkpoint(directory) as ckpt:
        mapping = port.mapping_for(ckpt.config)
        skeleton = port.skeleton(mapping, ckpt.config)
        recipe = port.plan(skeleton, mapping, ckpt.tensors, ckpt.config, {"data": 4, "model": 2})
    assert calls == []  # in this process: not one positioned read of tensor bytes
    leaves = port._skeleton.leaves(skeleton)
    assert {leaf.path for leaf in recipe.leaves} == set(leaves)
    assert recipe.read_bytes == data and recipe.device_bytes == per_device
    wq = next(leaf for leaf in recipe.leaves if leaf.path == "blocks.attn.wq")
    assert wq.shape == (42, 16, 256, 3584) and wq.spec == P(None, "model", None, "data")

    result = run_port("plan", directory, "--mesh", "4x2")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "note:" not in result.stdout  # every dimension divides its mesh axis
    summary = result.stdout.strip().splitlines()[-1]
    assert summary == (
        f"9.24B params in {len(leaves)} leaves; {size_text(data)} to read, {size_text(per_device)} per device"
    )


# ---------------------------------------------------------------- the config


def small(family: str, **changes) -> dict:
    return {"model_type": family, **FAMILIES[family][1], **changes}


def test_config_defaults_follow_transformers():
    """Absent keys read as transformers' config classes fill them in."""
    transformers = transformers_or_skip()
    absent = (
        "sliding_window",
        "attn_logit_softcapping",
        "final_logit_softcapping",
        "query_pre_attn_scalar",
        "head_dim",
        "num_key_value_heads",
    )
    # 8 heads: the default 4 kv heads must divide them
    bare = {k: v for k, v in FAMILIES["gemma2"][1].items() if k not in absent} | dict(
        num_attention_heads=8, num_hidden_layers=5
    )
    ours = GemmaConfig.from_hf({"model_type": "gemma2", **bare})
    theirs = transformers.Gemma2Config(**bare)
    assert ours.sliding_layers == tuple(t == "sliding_attention" for t in theirs.layer_types)
    for name in (
        "sliding_window",
        "attn_logit_softcapping",
        "final_logit_softcapping",
        "query_pre_attn_scalar",
        "head_dim",
        "num_key_value_heads",
        "tie_word_embeddings",
    ):
        assert getattr(ours, name) == getattr(theirs, name), name
    assert ours.hidden_act == theirs.hidden_activation == "gelu_pytorch_tanh"
    # Gemma's released configs say "gelu", which transformers reads as the tanh approximation.
    assert GemmaConfig.from_hf(small("gemma", hidden_act="gelu")).hidden_act == "gelu_pytorch_tanh"
    assert GemmaConfig.from_hf(small("gemma")).query_pre_attn_scalar is None  # Gemma: head_dim**-0.5
    # null turns a Gemma 2 feature off
    off = GemmaConfig.from_hf(small("gemma2", final_logit_softcapping=None, sliding_window=None))
    assert off.final_logit_softcapping is None and off.sliding_layers == (False,) * 3


@pytest.mark.parametrize(
    "family, change, match",
    [
        ("gemma2", dict(attn_logit_softcapping=-1.0), "'attn_logit_softcapping' must be a positive number"),
        ("gemma2", dict(query_pre_attn_scalar=0), "'query_pre_attn_scalar' must be a positive number"),
        ("gemma2", dict(sliding_window=2.5), "'sliding_window' must be a positive integer"),
        ("gemma2", dict(layer_types=["sliding_attention"]), "'layer_types' must list 3 of"),
        ("gemma2", dict(hidden_activation="gelu_bogus"), "'hidden_activation' 'gelu_bogus' is not supported"),
        ("gemma", dict(num_key_value_heads=2), r"'num_key_value_heads' \(2\) must divide"),
        ("gemma", dict(rope_parameters=dict(rope_type="linear", factor=2.0)), "rope type 'linear'"),
        ("gemma", dict(head_dim="32"), "'head_dim' must be a positive integer"),
        ("gemma", dict(use_bidirectional_attention=True), "use_bidirectional_attention"),
        ("gemma", dict(model_type="gemma3n"), "'model_type' 'gemma3n' is not supported"),
    ],
)
def test_bad_config_values_are_one_line_errors(family, change, match):
    with pytest.raises(ConfigError, match=match) as info:
        GemmaConfig.from_hf(small(family, **change))
    message = str(info.value)
    assert message.startswith("config.json: ") and "\n" not in message
