"""ModernBERT: port's encoder, converted by the shipped `mappings/modernbert.toml`, against transformers.

What the encoder contract (`tests/test_encoders.py`: eager attention on 1x1 and 4x2, bfloat16
compute, gradients, the export round trip) does not cover. A tiny seeded `ModernBertModel`
(3 layers: global, local, global; a local window of 2 on either side against 12 tokens; a
rotary base per layer type; norms perturbed so that no weight is 1) written by
`save_pretrained` and loaded by `port.load`: the last hidden state equals transformers' under
its SDPA attention as well as eager on a padded batch, on meshes 1x1 and 4x2; the window and
the bases shown to matter; a bfloat16 checkpoint; gradients with every layer recomputed;
every bias; a `ModernBertForMaskedLM` checkpoint; the local window against transformers' mask
functions; older configs' keys; bad configs refused in one line; ModernBERT-large planned.
Skips without PyTorch.
"""

import json

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import port
from port._errors import ConfigError
from port.models.modernbert import ModernBert, ModernBertConfig
from port.nn import local_window, prepare

from helpers import REPO, one_line, perturbed, run_port, transformers_or_skip, write_sparse_checkpoint

VOCAB = 97
CONFIG = dict(
    vocab_size=VOCAB,
    hidden_size=48,
    intermediate_size=80,
    num_hidden_layers=3,
    num_attention_heads=4,
    local_attention=4,  # a local layer sees 2 slots on either side
    layer_types=["full_attention", "sliding_attention", "full_attention"],
    rope_parameters={
        "full_attention": {"rope_type": "default", "rope_theta": 1000.0},
        "sliding_attention": {"rope_type": "default", "rope_theta": 50.0},
    },
    max_position_embeddings=64,
    initializer_range=0.2,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
    cls_token_id=1,
    sep_token_id=2,
)
IDS = np.random.default_rng(0).integers(3, VOCAB, (2, 12))
MASK = np.ones((2, 12), np.int64)
MASK[1, 8:] = 0  # the second row right-padded
REAL = MASK.astype(bool)
IMPLEMENTATIONS = ("eager", "sdpa")


def torch_modernbert(dtype=None, **overrides):
    """A seeded `ModernBertModel` of `CONFIG` (norms and biases perturbed)."""
    transformers = transformers_or_skip()
    import torch

    config = transformers.ModernBertConfig(**{**CONFIG, **overrides})
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = transformers.ModernBertModel(config).eval()
    model = perturbed(model, lambda name: "norm" in name or name.endswith("bias"), 0.3)
    return model if dtype is None else model.to(getattr(torch, dtype))


def hidden(model, implementation="eager", ids=IDS, mask=MASK):
    """transformers' last hidden state under `implementation`, as float32 NumPy."""
    import torch

    model.config._attn_implementation = implementation
    try:
        with torch.no_grad():
            out = model(torch.tensor(ids), attention_mask=torch.tensor(mask)).last_hidden_state
    finally:
        model.config._attn_implementation = "eager"
    return out.float().numpy()


@eqx.filter_jit
def run(model, ids, mask, dtype=None):
    return model(ids, attention_mask=mask, dtype=dtype)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """The float32 model, its directory, and transformers' hidden states by implementation."""
    model = torch_modernbert()
    directory = tmp_path_factory.mktemp("modernbert")
    model.save_pretrained(directory)
    return model, directory, {i: hidden(model, i) for i in IMPLEMENTATIONS}


# ---------------------------------------------------------------- parity


@pytest.mark.parametrize("mesh_spec", ["1x1", "4x2"])
def test_hidden_states_match_transformers(checkpoint, mesh_spec):
    """Eager attention: every position, padded queries included (they attend to the real keys
    in their window). SDPA: the real positions (its padded rows are its own)."""
    _, directory, expected = checkpoint
    ours = port.load(directory, mesh=port.make_mesh(mesh_spec))
    out = np.asarray(run(ours, IDS, MASK))
    assert out.shape == (2, 12, 48)
    assert np.abs(out - expected["eager"]).max() < 1e-4
    assert np.abs(out - expected["sdpa"])[REAL].max() < 1e-4
    assert ours.layers.attn.wq.sharding.spec == P(None, "model", None, "data")
    assert ours.layers.mlp.gate.sharding.spec == P(None, "model", "data")
    assert ours.attn_norms.weight.shape == (2, 48)


def test_the_local_window_and_bases_are_what_transformers_runs(checkpoint):
    """The local layer's window and the per-type bases matter: the same
    weights under a config that changes any of them no longer match (the parity is not vacuous)."""
    _, directory, expected = checkpoint
    ours = port.load(directory)
    for change in (
        dict(local_attention=8),
        dict(layer_types=["full_attention"] * 3),
        dict(rope_parameters={"full_attention": {"rope_theta": 1000.0}, "sliding_attention": {"rope_theta": 1000.0}}),
    ):
        config = dict(CONFIG, model_type="modernbert", **change)
        other = ModernBert.from_config(config, key=jax.random.key(0))
        other = eqx.tree_at(jax.tree.leaves, other, jax.tree.leaves(ours))
        assert np.abs(np.asarray(run(other, IDS, MASK)) - expected["eager"])[REAL].max() > 1e-3, change


def test_padding_changes_nothing_for_the_real_tokens(checkpoint):
    """The real tokens' outputs do not depend on what the padded slots hold."""
    _, directory, _ = checkpoint
    ours = port.load(directory)
    other = IDS.copy()
    other[1, 8:] = 5
    a, b = np.asarray(run(ours, IDS, MASK)), np.asarray(run(ours, other, MASK))
    np.testing.assert_array_equal(a[REAL], b[REAL])
    np.testing.assert_allclose(np.asarray(ours(IDS[0], MASK[0])), a[0], atol=1e-5, rtol=0)


@pytest.mark.parametrize("mesh_spec", ["1x1", "4x2"])
def test_bfloat16_checkpoint_matches_transformers(checkpoint, tmp_path, mesh_spec):
    """A bfloat16 checkpoint loaded as it is (bfloat16 compute on float32 parameters is the
    encoder contract's): as near transformers' bfloat16 model, and its float32 one, as twice the
    distance between those two."""
    import copy

    import torch

    torch_model, _, expected = checkpoint
    half = copy.deepcopy(torch_model).to(torch.bfloat16)
    half.save_pretrained(tmp_path)
    theirs = hidden(half)
    rounding = np.abs(theirs - expected["eager"])[REAL].max()
    loaded = port.load(tmp_path, mesh=port.make_mesh(mesh_spec))
    assert loaded.layers.attn.wq.dtype == jnp.bfloat16
    out = run(loaded, IDS, MASK)
    assert out.dtype == jnp.bfloat16
    out = np.asarray(out, np.float32)
    assert np.abs(out - theirs)[REAL].max() <= 2 * rounding
    assert np.abs(out - expected["eager"])[REAL].max() <= 2 * rounding


def test_every_bias_and_the_tanh_gelu_match_transformers(tmp_path):
    """attention_bias, mlp_bias and norm_bias: the optional leaves filled, the parity kept."""
    model = torch_modernbert(attention_bias=True, mlp_bias=True, norm_bias=True, hidden_activation="gelu_new")
    model.save_pretrained(tmp_path)
    ours = port.load(tmp_path, mesh=port.make_mesh("4x2"))
    assert ours.layers.attn.bq.shape == (3, 4, 12) and ours.layers.mlp.bgate.shape == (3, 80)
    assert ours.attn_norms.bias.shape == (2, 48) and ours.final_norm.bias is not None
    np.testing.assert_allclose(np.asarray(run(ours, IDS, MASK)), hidden(model), atol=1e-4, rtol=0)


def test_masked_lm_checkpoint_loads_its_encoder(checkpoint, tmp_path):
    """`ModernBertForMaskedLM`: keys under `model.`, the head and decoder ignored."""
    base, _, expected = checkpoint
    lm = transformers_or_skip().ModernBertForMaskedLM(base.config).eval()
    lm.model.load_state_dict(base.state_dict())
    lm.save_pretrained(tmp_path)
    with port.open_checkpoint(tmp_path) as ckpt:
        mapping = port.mapping_for(ckpt.config)
        recipe = port.plan(
            port.skeleton(mapping, ckpt.config), mapping, ckpt.tensors, ckpt.config, {"data": 1, "model": 1}
        )
    assert recipe.ignored and all(k.startswith(("head.", "decoder.")) for k in recipe.ignored)
    out = np.asarray(run(port.load(tmp_path), IDS, MASK))
    assert np.abs(out - expected["eager"]).max() < 1e-4


@pytest.mark.parametrize("radius", [0, 2, 11])
def test_local_window_is_transformers_bidirectional_sliding_window(radius):
    """`port.nn`'s local window: transformers' bidirectional sliding-window mask function (keys within
    `radius` slots either side) and its padding mask, on a padded batch."""
    import torch

    transformers_or_skip()
    from transformers import masking_utils

    window = masking_utils.sliding_window_bidirectional_mask_function(radius)
    padding = masking_utils.padding_mask_function(torch.tensor(MASK).bool())
    b, q, k = torch.arange(2)[:, None, None], torch.arange(12)[None, :, None], torch.arange(12)[None, None, :]
    theirs = (window(b, 0, q, k) & padding(b, 0, q, k)).numpy()
    tokens = local_window(prepare(IDS, attention_mask=MASK, causal=False), radius)
    np.testing.assert_array_equal(np.asarray(tokens.sliding), theirs)
    np.testing.assert_array_equal(np.asarray(tokens.mask), np.broadcast_to(REAL[:, None, :], (2, 12, 12)))


# ---------------------------------------------------------------- training


@eqx.filter_jit
def loss_and_grads(model, ids, mask, weights):
    """The mean of `hidden . weights` over the real tokens, and its gradients, each layer recomputed."""

    def loss(m):
        per_token = jnp.einsum("bte,e->bt", m(ids, attention_mask=mask, remat=True), weights)
        return jnp.sum(per_token * mask) / jnp.sum(mask)

    return eqx.filter_value_and_grad(loss)(model)


def test_gradients_with_remat_match_pytorch(checkpoint, tmp_path):
    """With every layer recomputed (`remat=True`; the encoder contract holds the plain pass),
    jax.grad equals PyTorch's backward for every parameter, by its checkpoint name through
    `port.export`, within 1e-4 of its largest entry."""
    import torch

    torch_model, directory, _ = checkpoint
    weights = np.random.default_rng(3).normal(size=48).astype(np.float32)
    torch_model.zero_grad()
    out = torch_model(torch.tensor(IDS), attention_mask=torch.tensor(MASK)).last_hidden_state
    mask = torch.tensor(MASK, dtype=torch.float32)
    torch_loss = (torch.einsum("bte,e->bt", out, torch.tensor(weights)) * mask).sum() / mask.sum()
    torch_loss.backward()
    loss, grads = loss_and_grads(port.load(directory), IDS, MASK, weights)
    assert float(loss) == pytest.approx(torch_loss.item(), rel=1e-5)
    port.export(grads, tmp_path / "grads", directory)
    ours = transformers_or_skip().ModernBertModel.from_pretrained(tmp_path / "grads").state_dict()
    theirs = {k: p.grad.numpy() for k, p in torch_model.named_parameters() if p.grad is not None}
    assert theirs and set(theirs) <= set(ours)
    for key, grad in theirs.items():
        np.testing.assert_allclose(ours[key].numpy(), grad, atol=1e-4 * np.abs(grad).max() + 1e-9, rtol=0, err_msg=key)


# ---------------------------------------------------------------- the config


def test_config_follows_transformers_defaults_and_older_keys():
    """An (almost) empty config means what ModernBertConfig means (every third layer global from
    the first, bases 160000 / 10000, a window of 128); transformers 4's keys
    (`global_attn_every_n_layers`, `global_rope_theta`, `local_rope_theta`) mean what they meant."""
    transformers = transformers_or_skip()
    sizes = dict(vocab_size=64, hidden_size=32, intermediate_size=16, num_hidden_layers=7, num_attention_heads=4)
    theirs = transformers.ModernBertConfig(**sizes)
    ours = ModernBertConfig.from_hf({"model_type": "modernbert", **sizes})
    assert ours == ModernBertConfig.from_hf(theirs.to_dict())
    assert ours.sliding_layers == tuple(t == "sliding_attention" for t in theirs.layer_types)
    assert (ours.global_rope.theta, ours.local_rope.theta, ours.radius) == (160000.0, 10000.0, 64)
    old = dict(sizes, global_attn_every_n_layers=2, global_rope_theta=5000.0, local_rope_theta=30.0)
    theirs = transformers.ModernBertConfig(**old)
    ours = ModernBertConfig.from_hf({"model_type": "modernbert", **old})
    assert ours == ModernBertConfig.from_hf(theirs.to_dict())
    assert ours.sliding_layers == (False, True, False, True, False, True, False)
    assert (ours.global_rope.theta, ours.local_rope.theta) == (5000.0, 30.0)


@pytest.mark.parametrize(
    "change, message",
    [
        ({"model_type": "bert"}, "'model_type' 'bert' is not supported by port.models.modernbert.ModernBert"),
        ({"layer_types": ["full_attention"]}, "'layer_types' must list 3 of"),
        ({"hidden_activation": "mish"}, "'hidden_activation' 'mish' is not supported"),
        ({"hidden_size": 50}, "'hidden_size' (50) must be divisible by 'num_attention_heads' (4)"),
        ({"norm_bias": "yes"}, "'norm_bias' must be a boolean"),
        ({"local_attention": 0}, "'local_attention' must be a positive integer"),
        ({"global_rope_theta": "big", "rope_parameters": None}, "'global_rope_theta' must be a positive number"),
        (
            {"rope_parameters": {"full_attention": {"rope_type": "dynamic", "factor": 2.0}}},
            "rope_parameters.full_attention: rope type 'dynamic' is not supported",
        ),
    ],
)
def test_config_refuses_in_one_line(change, message):
    with pytest.raises(ConfigError) as error:
        ModernBertConfig.from_hf({**CONFIG, "model_type": "modernbert", **change})
    assert message in str(error.value) and "\n" not in str(error.value)


def broken(checkpoint, tmp_path, **change):
    """The checkpoint's tensors beside a config.json with `change` applied."""
    _, directory, _ = checkpoint
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "model.safetensors").symlink_to(directory / "model.safetensors")
    config = json.loads((directory / "config.json").read_text())
    (broken / "config.json").write_text(json.dumps({**config, **change}))
    return broken


@pytest.mark.slow
def test_port_check_refuses_a_bad_config_in_one_line(checkpoint, tmp_path):
    """`port check` names the field before reading a tensor."""
    directory = broken(checkpoint, tmp_path, hidden_activation="mish")
    one_line(
        run_port("check", REPO / "mappings" / "modernbert.toml", directory),
        "config.json: 'hidden_activation' 'mish' is not supported",
    )


@pytest.mark.slow
def test_a_config_that_contradicts_the_tensors_fails_in_one_line(checkpoint, tmp_path):
    """Biases the config promises and the checkpoint lacks: a missing tensor, named."""
    directory = broken(checkpoint, tmp_path, attention_bias=True)
    one_line(run_port("plan", directory), "missing tensor", "layers.{layer}.attn.Wqkv.bias")


# ---------------------------------------------------------------- the real model's shape

MODERNBERT_LARGE = {
    "model_type": "modernbert", "architectures": ["ModernBertForMaskedLM"], "vocab_size": 50368,
    "hidden_size": 1024, "intermediate_size": 2624, "num_hidden_layers": 28, "num_attention_heads": 16,
    "global_attn_every_n_layers": 3, "local_attention": 128, "global_rope_theta": 160000.0,
    "local_rope_theta": 10000.0, "max_position_embeddings": 8192, "norm_eps": 1e-5, "norm_bias": False,
    "attention_bias": False, "mlp_bias": False, "hidden_activation": "gelu", "pad_token_id": 50283,
}  # fmt: skip


def modernbert_shapes(config: dict) -> dict:
    """The tensor shapes of a `ModernBertForMaskedLM` checkpoint of `config`."""
    h, inter, vocab = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    shapes = {
        "model.embeddings.tok_embeddings.weight": [vocab, h],
        "model.embeddings.norm.weight": [h],
        "model.final_norm.weight": [h],
        "head.dense.weight": [h, h],
        "head.norm.weight": [h],
        "decoder.bias": [vocab],
    }
    for i in range(config["num_hidden_layers"]):
        layer = f"model.layers.{i}."
        if i:
            shapes[layer + "attn_norm.weight"] = [h]
        shapes |= {
            layer + "attn.Wqkv.weight": [3 * h, h],
            layer + "attn.Wo.weight": [h, h],
            layer + "mlp_norm.weight": [h],
            layer + "mlp.Wi.weight": [2 * inter, h],
            layer + "mlp.Wo.weight": [h, inter],
        }
    return shapes


@pytest.mark.slow
def test_plan_modernbert_large(tmp_path):
    """`port plan` of ModernBERT-large's shape (its config.json, a sparse file): exit 0, the
    layers and the 27 attention norms stacked and sharded, the head ignored."""
    import time

    write_sparse_checkpoint(tmp_path / "large", MODERNBERT_LARGE, modernbert_shapes(MODERNBERT_LARGE), "F32")
    start = time.perf_counter()
    result = run_port("plan", tmp_path / "large", "--mesh", "4x2")
    took = time.perf_counter() - start
    assert result.returncode == 0, result.stdout + result.stderr
    assert "f32[28,16,64,1024]" in result.stdout and "f32[27,1024]" in result.stdout, result.stdout
    print(f"port plan of ModernBERT-large: {took:.1f} s")


def test_abstract_build_of_the_real_config():
    model = eqx.filter_eval_shape(ModernBert.from_config, MODERNBERT_LARGE, key=jax.random.key(0))
    assert model.layers.attn.wq.shape == (28, 16, 64, 1024)
    assert model.attn_norms.weight.shape == (27, 1024) and model.attn_norms.bias is None
    assert model.layer_groups["attn_norms"] == tuple(range(1, 28))
