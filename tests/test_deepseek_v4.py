"""DeepSeek-V4 (`deepseek_v4`): port's `DeepseekV4`, converted by the shipped mapping, against `transformers`.

A tiny random `DeepseekV4ForCausalLM` written by `save_pretrained` (DeepSeek's own key names)
and loaded by `port.load`, with every `layer_types` value (a sliding layer, a compressed sparse
layer whose indexer keeps 3 of up to 8 entries, a heavily compressed layer) and both MLP kinds
(a hash-routed layer, two routed ones), 3 hyper-connection streams and 2 output groups; the
norms, sinks, gates' position biases, hyper-connection biases and scales, selection biases and
hash table perturbed: logits equal transformers' on one device, on 4x2 and with the experts on
an `expert` axis, in float32 and bfloat16; `port.export` gives the checkpoint back bit for bit;
a field the module does not run, or a malformed schedule, is refused in one line before any
tensor byte is read; packed sequences are refused in one line; a cached prefill and decode
steps give the full forward's logits; a decoding step's compressed sparse attention costs
(XLA's cost analysis) what its `index_topk` gathered entries do, not what every entry would.

Gradients, padding, positions, remat, bfloat16 compute and the 4x2 train step are
tests/test_decoders.py's contract, which runs it on this family as on every decoder.
"""

import copy
import json
import shutil
from pathlib import Path

import equinox as eqx
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import port
from port._errors import ConfigError
from port.models.deepseek_v4 import DeepseekV4, DeepseekV4Config

from helpers import (
    VOCAB,
    error_of,
    expert_mapping,
    loaded_once,
    logits,
    one_line,
    perturbed,
    run_port,
    saved_once,
    torch_logits,
    transformers_or_skip,
)

MAPPINGS = Path(__file__).resolve().parents[1] / "mappings"
EXPERT_MESH = "data=2,expert=2,model=2"
# 4 query heads of 16 (8 rotated) on one shared key/value head; CSA every 2 tokens (8 entries
# for 16 tokens, the indexer keeps 3), HCA every 4; a window of 4; top 2 of 4 experts of 32.
CONFIG = dict(
    vocab_size=VOCAB,
    hidden_size=48,
    moe_intermediate_size=32,
    num_hidden_layers=3,
    num_attention_heads=4,
    head_dim=16,
    q_lora_rank=24,
    partial_rotary_factor=0.5,
    num_experts_per_tok=2,
    n_routed_experts=4,
    layer_types=["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"],
    mlp_layer_types=["hash_moe", "moe", "moe"],
    compress_rates={"compressed_sparse_attention": 2, "heavily_compressed_attention": 4},
    hc_mult=3,
    hc_sinkhorn_iters=4,
    sliding_window=4,
    o_groups=2,
    o_lora_rank=12,
    index_n_heads=2,
    index_head_dim=8,
    index_topk=3,
    swiglu_limit=0.5,
    routed_scaling_factor=1.7,
    max_position_embeddings=64,
    initializer_range=0.2,
    bos_token_id=0,
    eos_token_id=2,
    pad_token_id=0,
)
IDS = np.random.default_rng(0).integers(3, VOCAB, (2, 16))
PERTURBED = ("norm", "sinks", "position_bias", "base", "scale", "e_score_correction_bias")


def torch_v4(name="tiny", dtype=None):
    """The seeded `DeepseekV4ForCausalLM`, eager attention and experts, `PERTURBED` parameters
    noised and a random hash table."""
    transformers = transformers_or_skip()
    import torch

    torch.manual_seed(0)
    config = transformers.DeepseekV4Config(**CONFIG)
    config._attn_implementation = "eager"
    config._experts_implementation = "eager"
    model = perturbed(transformers.DeepseekV4ForCausalLM(config), lambda n: any(p in n for p in PERTURBED), 0.3)
    with torch.no_grad():
        for layer in model.model.layers:
            if layer.mlp.is_hash:
                table = layer.mlp.gate.tid2eid
                table.copy_(torch.stack([torch.randperm(4)[:2] for _ in range(table.shape[0])]))
            else:
                layer.mlp.gate.e_score_correction_bias.add_(0.3 * torch.randn(4))
    return model if dtype is None else model.to(getattr(torch, dtype))


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """get(name): (its save_pretrained directory, the PyTorch model, its logits), built once."""
    return saved_once(tmp_path_factory, torch_v4, IDS)


@pytest.fixture(scope="module")
def loaded(checkpoints):
    """get(name, mesh): the checkpoint loaded by port.load on `mesh` (one load per pair)."""
    return loaded_once(checkpoints)


# ---------------------------------------------------------------- parity


def test_save_pretrained_writes_deepseek_names(checkpoints):
    from safetensors import safe_open

    directory, _, _ = checkpoints("tiny")
    with safe_open(directory / "model.safetensors", "np") as f:
        keys = set(f.keys())
        assert f.get_slice("model.layers.0.ffn.gate.tid2eid").get_dtype() == "I64"
        assert f.get_slice("model.layers.1.attn.indexer.compressor.ape").get_shape() == [2, 16]
        assert f.get_slice("model.layers.2.attn.compressor.ape").get_shape() == [4, 16]
        assert f.get_slice("model.layers.1.attn.wo_a.weight").get_shape() == [24, 32]
    assert "model.layers.0.attn.compressor.wkv.weight" not in keys and "head.weight" in keys


@pytest.mark.parametrize("mesh", ["1x1", "4x2"])
def test_logits_match_transformers(checkpoints, loaded, mesh):
    _, _, expected = checkpoints("tiny")
    model = loaded("tiny", mesh)
    assert isinstance(model, DeepseekV4)
    assert model.layer_groups == {"sliding_hash": (0,), "csa_moe": (1,), "hca_moe": (2,)}
    ours = logits(model, IDS)
    assert ours.shape == (*IDS.shape, VOCAB) and ours.dtype == np.float32
    print(f"float32 on {mesh}: max |ours - transformers| {error_of(ours, expected):.3g}")
    np.testing.assert_allclose(np.asarray(ours), expected, atol=1e-4, rtol=0)
    if mesh == "4x2":
        assert model.csa_moe.mlp.experts.gate.sharding.spec == P(None, "model", None, "data")
        assert model.csa_moe.attn.wq_b.sharding.spec == P(None, "model", None, None)
        assert model.csa_moe.attn.wo_a.sharding.spec == P(None, "model", None, None)  # o_groups


def with_field(module, name, value):
    """A copy of the Equinox `module` with its (static) field `name` set to `value`."""
    module = copy.copy(module)
    object.__setattr__(module, name, value)
    return module


def test_each_mechanism_matters(checkpoints, loaded):
    """Parity depends on the indexer's choice (keeping every entry differs), the hash table,
    the selection bias, the sinks and the hyper-connections' mixing."""
    _, _, expected = checkpoints("tiny")
    model = loaded("tiny", "1x1")
    indexer = model.csa_moe.attn.indexer
    changed = [
        eqx.tree_at(lambda m: m.csa_moe.attn.indexer, model, with_field(indexer, "topk", 8)),
        eqx.tree_at(lambda m: m.sliding_hash.tid2eid, model, replace_fn=lambda t: (t + 1) % 4),
        eqx.tree_at(lambda m: m.hca_moe.mlp.selection_bias, model, replace_fn=lambda b: 0 * b),
        eqx.tree_at(lambda m: m.hca_moe.attn.sinks, model, replace_fn=lambda s: 0 * s - 30),
        eqx.tree_at(lambda m: m.csa_moe.ffn_hc.base, model, replace_fn=lambda b: 0 * b),
    ]
    for variant in changed:
        assert error_of(logits(variant, IDS), expected) > 1e-3


def test_logits_match_transformers_with_experts_on_an_expert_axis(checkpoints):
    """The shipped mapping with `experts = "expert"` on a `data=2,expert=2,model=2` mesh."""
    directory, _, expected = checkpoints("tiny")
    mesh = port.make_mesh(EXPERT_MESH)
    model = port.load(directory, mesh=mesh, mapping=expert_mapping(MAPPINGS / "deepseek_v4.toml"))
    assert model.hca_moe.mlp.experts.gate.sharding.spec == P(None, "expert", "model", "data")
    assert model.sliding_hash.mlp.router.sharding.spec == P(None, "expert", "data")
    ours = logits(model, jax.device_put(IDS, NamedSharding(mesh, P("data", None))))
    print(f"float32 on {EXPERT_MESH}: max |ours - transformers| {error_of(ours, expected):.3g}")
    np.testing.assert_allclose(np.asarray(ours), expected, atol=1e-4, rtol=0)


def test_bfloat16_end_to_end_on_each_mesh(tmp_path):
    """A bfloat16 checkpoint (transformers keeps the hyper-connections, norms, sinks and
    position biases in float32) near transformers' own bfloat16 logits on 1x1, 4x2 and the
    expert mesh: within twice their distance from the same weights run in float32, at worst
    and on average. (bfloat16 flips this tiny model's discrete choices, experts and indexed
    entries: transformers' own worst distance is a fifth of the largest logit.)"""
    model = torch_v4(dtype="bfloat16")
    model.save_pretrained(tmp_path)
    expected = torch_logits(model, IDS)
    noise = np.abs(expected - torch_logits(model.float(), IDS))
    bf16_noise = noise.max()
    bf16 = np.dtype(ml_dtypes.bfloat16)
    for mesh, mapping in (
        ("1x1", None),
        ("4x2", None),
        (port.make_mesh(EXPERT_MESH), expert_mapping(MAPPINGS / "deepseek_v4.toml")),
    ):
        ours = port.load(tmp_path, mesh=mesh, mapping=mapping)
        assert ours.hca_moe.mlp.experts.gate.dtype == ours.embed.dtype == bf16
        out = logits(ours, IDS)
        assert out.dtype == bf16
        error = error_of(out, expected)
        mean = float(np.abs(np.asarray(out).astype(np.float32) - expected).mean())
        shown = mesh if isinstance(mesh, str) else EXPERT_MESH
        print(
            f"bfloat16 on {shown}: max |ours - transformers| {error:.3g} (mean {mean:.3g}), transformers' own noise {bf16_noise:.3g} (mean {noise.mean():.3g})"
        )
        assert error <= 2 * bf16_noise and mean <= 2 * noise.mean(), (shown, error, bf16_noise)


@pytest.mark.parametrize("prompt", [1, 5])
def test_a_cached_prefill_and_decode_steps_equal_the_full_forward(loaded, prompt):
    """A prompt through the cache, then one token per compiled step: every step's logits are
    the full sequence's (CSA windows of 2, HCA windows of 4 finished across steps, the
    indexer picking among entries made in earlier calls)."""
    model = loaded("tiny", "1x1")
    ids = jnp.asarray(IDS)
    full = np.asarray(model(ids))
    prefill = eqx.filter_jit(lambda m, prompt_ids, c: m(prompt_ids, cache=c))
    logits, cache = prefill(model, ids[:, :prompt], model.init_cache(batch=2, length=IDS.shape[1]))
    traces = []
    step = eqx.filter_jit(lambda m, token, c: (traces.append(1), m(token, cache=c))[1])
    steps = [logits]
    for i in range(prompt, IDS.shape[1]):
        logits, cache = step(model, ids[:, i : i + 1], cache)
        steps.append(logits)
    error = error_of(jnp.concatenate(steps, axis=1), full)
    print(f"cached (prompt of {prompt}) vs full forward: max |logit diff| {error:.3g}")
    assert error < 1e-4 * np.abs(full).max()
    assert len(traces) == 1  # the decode step traced once: the cache's shapes do not change


def test_packed_sequences_are_refused_in_one_line(loaded):
    model = loaded("tiny", "1x1")
    with pytest.raises(ValueError, match="`segment_ids` is not supported") as error:
        model(jnp.asarray(IDS), segment_ids=jnp.zeros(IDS.shape, jnp.int32))
    assert "\n" not in str(error.value)


# ---------------------------------------------------------------- the cost follows index_topk


def decode_flops(length: int, top_k: int | None) -> float:
    """XLA's FLOPs for one decoding step of one compressed sparse layer (CSA every 4 slots)
    over a cache of `length` slots; `top_k` None: the same layer without compressed entries
    (a sliding one), whose cost the difference leaves out."""
    from port.nn._compressed import CompressedAttention

    attn = CompressedAttention(
        heads=16, head_dim=64, embd=256, q_rank=64, groups=2, group_rank=32, rate=None if top_k is None else 4,
        overlap=True, index=None if top_k is None else {"heads": 4, "dim": 32, "topk": top_k}, eps=1e-6,
        dtype=jnp.float32, key=jax.random.key(0),
    )  # fmt: skip
    x, mask, positions = jnp.zeros((1, 1, 256)), jnp.ones((1, 1, length), bool), jnp.full((1, 1), length - 1)
    rope = (jnp.ones((1, 1, 8)), jnp.zeros((1, 1, 8)))
    angles = lambda p: (jnp.ones((*p.shape, 8)), jnp.zeros((*p.shape, 8)))  # noqa: E731
    keys, state = jnp.zeros((1, length, 64)), attn.empty_state(1, length, jnp.float32)
    start = jnp.int32(length - 1)
    step = jax.jit(lambda a, x, k, s: a.cached(x, mask, positions, rope, angles, k, s, start)[0])
    return float(step.lower(attn, x, keys, state).compile().cost_analysis()["flops"])


def test_the_compressed_sparse_attention_cost_follows_index_topk():
    """The compressed entries' share of a decoding step (the layer's FLOPs less a sliding
    layer's over the same cache) grows from 2048 to 8192 cached slots (512 to 2048 entries)
    with the same `index_topk` only by the indexer's scores of every entry: much less than
    attending to every entry (`index_topk` = the entries) grows."""
    sliding = {n: decode_flops(n, None) for n in (2048, 8192)}
    rows = {(n, k): decode_flops(n, k) - sliding[n] for n, k in ((2048, 64), (8192, 64), (2048, 512), (8192, 2048))}
    for (n, k), flops in rows.items():
        print(
            f"compressed sparse decode step: slots {n}, index_topk {k}: {flops:.4g} FLOPs (+ sliding {sliding[n]:.4g})"
        )
    assert rows[8192, 64] < 0.2 * rows[8192, 2048]
    assert rows[8192, 64] - rows[2048, 64] < 0.15 * (rows[8192, 2048] - rows[2048, 512])


# ---------------------------------------------------------------- export


def test_export_round_trip(checkpoints, loaded, tmp_path):
    """port.load on 4x2, port.export, transformers from_pretrained: no missing or unexpected
    key, every tensor byte for byte the source's (the int64 hash table included)."""
    from safetensors.numpy import load_file

    transformers = transformers_or_skip()
    import torch

    directory, torch_lm, _ = checkpoints("tiny")
    out = port.export(loaded("tiny", "4x2"), tmp_path / "hf", directory).out
    source, written = load_file(directory / "model.safetensors"), load_file(out / "model.safetensors")
    assert written.keys() == source.keys()
    for key, value in source.items():
        assert written[key].dtype == value.dtype and written[key].tobytes() == value.tobytes(), key
    exported, info = transformers.AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    for what in ("missing_keys", "unexpected_keys", "mismatched_keys", "error_msgs"):
        assert not info[what], f"{what}: {info[what]}"
    ours, theirs = exported.state_dict(), torch_lm.state_dict()
    assert ours.keys() == theirs.keys()
    for key, value in theirs.items():
        assert torch.equal(ours[key], value), key


# ---------------------------------------------------------------- config.json


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(mlp_bias=True), "mlp_bias true is not supported by port.models.deepseek_v4.DeepseekV4"),
        (dict(scoring_func="softmax"), "'scoring_func' 'softmax' is not supported by port.models.deepseek_v4"),
        (dict(layer_types=["sliding_attention"] * 2), "'layer_types' must list one of"),
        (dict(mlp_layer_types=["dense"] * 3), "'mlp_layer_types' must list one of"),
        (dict(compress_rates={"full_attention": 2}), "'compress_rates' must map"),
        (dict(o_groups=5), "'o_groups' (5) must divide the 64 features of all heads"),
        (dict(num_experts_per_tok=5), "'num_experts_per_tok' (5) is more than 'n_routed_experts' (4)"),
        (dict(rope_parameters={"rope_type": "llama3", "factor": 8.0}), "rope type 'llama3' is not supported"),
    ],
)
def test_config_refuses_in_one_line(change, message):
    with pytest.raises(ConfigError) as error:
        DeepseekV4Config.from_hf({"model_type": "deepseek_v4", **CONFIG, **change})
    assert message in str(error.value) and "\n" not in str(error.value)


def test_an_older_configs_names_are_read_as_transformers_reads_them():
    """A config.json in DeepSeek-V4's older names (`compress_ratios` one per layer and one for
    the MTP layer, `compress_rate_csa` / `_hca`, `num_hash_layers`, `qk_rope_head_dim`) gives
    the schedule, rates and rotary size transformers' `DeepseekV4Config` derives from it."""
    transformers = transformers_or_skip()
    legacy = {k: v for k, v in CONFIG.items() if k not in ("layer_types", "mlp_layer_types", "compress_rates")}
    del legacy["partial_rotary_factor"]
    legacy.update(compress_ratios=[128, 4, 0, 4], compress_rate_csa=2, compress_rate_hca=4, num_hash_layers=2,
                  qk_rope_head_dim=4)  # fmt: skip
    theirs = transformers.DeepseekV4Config(**legacy)
    ours = DeepseekV4Config.from_hf({"model_type": "deepseek_v4", **legacy})
    assert list(ours.layer_types) == theirs.layer_types == [
        "heavily_compressed_attention", "compressed_sparse_attention", "sliding_attention"
    ]  # fmt: skip
    assert list(ours.mlp_layer_types) == theirs.mlp_layer_types == ["hash_moe", "hash_moe", "moe"]
    assert dict(ours.compress_rates) == theirs.compress_rates
    assert ours.compress_rope.rotary_dim == theirs.qk_rope_head_dim == 4
    with pytest.raises(ConfigError, match="'compress_ratios' must list 0, 4 or 128"):
        DeepseekV4Config.from_hf({"model_type": "deepseek_v4", **legacy, "compress_ratios": [8, 4, 0]})


def test_a_refused_field_reads_no_tensor_byte(checkpoints, tmp_path):
    """The checkpoint's mapping and skeleton refuse config.json from its headers alone."""
    source, _, _ = checkpoints("tiny")
    bad = shutil.copytree(source, tmp_path / "bad")
    config = json.loads((source / "config.json").read_text()) | {"mlp_bias": True}
    (bad / "config.json").write_text(json.dumps(config))
    with port.open_checkpoint(bad) as ckpt:
        with pytest.raises(ConfigError, match="mlp_bias true is not supported"):
            port.skeleton(port.mapping_for(ckpt.config), ckpt.config)
        assert ckpt.bytes_read == 0


@pytest.mark.slow
def test_port_convert_refuses_a_field_the_module_does_not_run(checkpoints, tmp_path):
    """`port convert` of a DeepSeek-V4 whose shared expert has biases: one line, nothing written."""
    source, _, _ = checkpoints("tiny")
    bad = shutil.copytree(source, tmp_path / "bad")
    config = json.loads((source / "config.json").read_text()) | {"mlp_bias": True}
    (bad / "config.json").write_text(json.dumps(config))
    out = tmp_path / "out"
    line = "config.json: mlp_bias true is not supported by port.models.deepseek_v4.DeepseekV4 (supported: false)"
    one_line(run_port("convert", bad, "--out", out), line, out=out)
