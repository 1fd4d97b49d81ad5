"""Qwen3: port's Llama module with per-head q/k RMSNorm, converted by the shipped `mappings/qwen3.toml`.

Parity goes through the converter: each `Qwen3ForCausalLM` written by `save_pretrained`,
loaded by `port.load` onto a mesh, gives the logits of `transformers`. The config is
awkward on purpose: 6 query heads sharing 2 kv heads (groups of 3), and an explicit
head_dim of 12 that is not hidden_size / heads (64 / 6). The q/k norms are required
leaves: a Qwen3 checkpoint without them, or a Llama one with them, is refused. The
tests that build a `transformers` model skip without PyTorch.
"""

import dataclasses
import json
import shutil

import equinox as eqx
import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import port
from port._errors import PlanError, PortError
from port.models.llama import Llama, LlamaConfig

from helpers import LLAMA_CONFIG, VOCAB, logits, saved_once, torch_llama, transformers_or_skip

QWEN3 = dict(num_attention_heads=6, num_key_value_heads=2, head_dim=12)  # hidden 64 != 6 x 12
# name: config overrides (on LLAMA_CONFIG, then QWEN3)
CASES = {
    "untied": {},
    "tied-bias": dict(tie_word_embeddings=True, attention_bias=True),
    "sliding": dict(use_sliding_window=True, sliding_window=4, max_window_layers=1),
}
MESHES = ("1x1", "4x2", "8x1")
IDS = np.random.default_rng(0).integers(0, VOCAB, (2, 12))


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """get(name): (directory written by save_pretrained, the torch model, its logits); built once."""
    return saved_once(tmp_path_factory, lambda name: torch_llama("Qwen3", **QWEN3, **CASES[name]), IDS)


def max_diff(model, expected) -> float:
    ours = np.asarray(logits(model, IDS))
    assert ours.shape == expected.shape and ours.dtype == np.float32
    return float(np.abs(ours - expected).max())


# ---------------------------------------------------------------- parity and layout


@pytest.mark.parametrize("name, mesh", [(n, m) for n in ("untied", "tied-bias") for m in MESHES] + [("sliding", "4x2")])
def test_logits_match_transformers(checkpoints, name, mesh):
    directory, _, expected = checkpoints(name)
    model = port.load(directory, mesh=port.make_mesh(mesh))
    assert max_diff(model, expected) <= 1e-4
    attn = model.blocks.attn
    assert attn.wq.shape == (2, 6, 12, 64) and attn.wk.shape == (2, 2, 12, 64)
    assert attn.q_norm.shape == attn.k_norm.shape == (2, 12)
    # Heads (6) and kv heads (2) split on `model`, embed (64) on `data`, on every mesh here;
    # vocab 101 only where `model` has size 1 (else replicated, as the plan notes).
    vocab = None if mesh == "4x2" else "model"
    assert attn.wq.sharding.spec == attn.wk.sharding.spec == P(None, "model", None, "data")
    assert attn.wo.sharding.spec == P(None, "data", "model", None)
    assert attn.q_norm.sharding.spec == attn.k_norm.sharding.spec == P(None, None)
    assert model.blocks.mlp.gate.sharding.spec == P(None, "model", "data")
    assert model.embed.sharding.spec == P(vocab, "data")
    tied = name == "tied-bias"
    assert (model.lm_head is None) == tied
    if not tied:
        assert model.lm_head.sharding.spec == P(vocab, "data")
    biased = name == "tied-bias"
    assert all((b is None) != biased for b in (attn.bq, attn.bk, attn.bv, attn.bo))
    if biased:
        assert attn.bk.sharding.spec == P(None, "model", None) and attn.bo.sharding.spec == P(None, "data")
    assert model.blocks.mlp.bgate is None and model.blocks.mlp.bdown is None


def without_qk_norm(model: Llama) -> Llama:
    return eqx.tree_at(
        lambda m: (m.blocks.attn.q_norm, m.blocks.attn.k_norm),
        model,
        replace=(None, None),
        is_leaf=lambda x: x is None,
    )


def with_config(model: Llama, **changes) -> Llama:
    """The same weights under a changed (static) config."""
    config = dataclasses.replace(model.config, **changes)
    skeleton = eqx.filter_eval_shape(Llama, config, key=jax.random.key(0))
    return jax.tree.unflatten(jax.tree.structure(skeleton), jax.tree.leaves(model))


@pytest.mark.parametrize(
    "name, change",
    [("untied", without_qk_norm), ("sliding", lambda m: with_config(m, sliding_window=None))],
    ids=["no-qk-norm", "no-window"],
)
def test_ignoring_a_feature_breaks_parity(checkpoints, name, change):
    """The cases above are sensitive to the q/k norms and to the window of layer 1."""
    directory, _, expected = checkpoints(name)
    assert max_diff(change(port.load(directory)), expected) > 1e-2


# ---------------------------------------------------------------- the q/k norms are not optional


def rewrite(source, target, drop=(), config=None):
    """A copy of checkpoint `source` at `target` without the tensors `drop` picks, config.json updated."""
    from safetensors.numpy import load_file, save_file

    target.mkdir()
    tensors = {k: v for k, v in load_file(source / "model.safetensors").items() if not drop(k)}
    save_file(tensors, target / "model.safetensors", metadata={"format": "pt"})
    shutil.copy(source / "config.json", target / "config.json")
    if config:
        data = json.loads((target / "config.json").read_text())
        (target / "config.json").write_text(json.dumps({**data, **config}))
    return target


def test_a_qwen3_checkpoint_without_q_norm_is_refused(checkpoints, tmp_path):
    directory, _, _ = checkpoints("untied")
    broken = rewrite(directory, tmp_path / "no-q-norm", drop=lambda k: "q_norm" in k)
    with pytest.raises(PortError, match="q_norm"):
        port.load(broken)


def test_a_llama_checkpoint_holding_q_norm_is_refused(checkpoints, tmp_path):
    """Labelled llama, it is read by llama.toml, which has no entry for q_norm: not silently dropped."""
    directory, _, _ = checkpoints("untied")
    relabelled = rewrite(directory, tmp_path / "llama", drop=lambda k: False, config={"model_type": "llama"})
    with pytest.raises(PlanError) as refused:
        port.load(relabelled)
    unused = sorted(p.split("'")[1] for p in refused.value.problems)
    assert unused == sorted(f"model.layers.{i}.self_attn.{n}_norm.weight" for i in (0, 1) for n in "qk")


# ---------------------------------------------------------------- the way back


@pytest.mark.parametrize("name", ["untied", "tied-bias"])
def test_export_round_trip(checkpoints, name, tmp_path):
    """port.load on 4x2 -> port.export -> from_pretrained: no missing or unexpected key, the same
    tensors bit for bit as the source file and as the original model."""
    import torch
    from safetensors.numpy import load_file

    transformers = transformers_or_skip()
    directory, original, _ = checkpoints(name)
    model = port.load(directory, mesh=port.make_mesh("4x2"))
    out = port.export(model, tmp_path / "hf", directory).out
    source, exported = load_file(directory / "model.safetensors"), load_file(out / "model.safetensors")
    assert exported.keys() == source.keys()
    for key, value in source.items():
        assert exported[key].dtype == value.dtype and exported[key].tobytes() == value.tobytes(), key
    back, info = transformers.Qwen3ForCausalLM.from_pretrained(out, output_loading_info=True)
    for what in ("missing_keys", "unexpected_keys", "mismatched_keys", "error_msgs"):
        assert not info[what], f"{what}: {info[what]}"
    ours, theirs = back.state_dict(), original.state_dict()
    assert ours.keys() == theirs.keys()
    assert all(torch.equal(ours[k], theirs[k]) for k in theirs)


# ---------------------------------------------------------------- the config


def test_config_follows_qwen3config():
    """Defaults where config.json is silent are Qwen3Config's: head_dim 128 (not hidden / heads),
    32 kv heads, no biases, no window without use_sliding_window; the norms always."""
    transformers = transformers_or_skip()
    base = {k: v for k, v in LLAMA_CONFIG.items() if k != "num_key_value_heads"} | {"num_attention_heads": 32}
    theirs = transformers.Qwen3Config(**base)
    ours = LlamaConfig.from_hf({**base, "model_type": "qwen3"})
    assert ours.head_dim == theirs.head_dim == 128
    assert ours.num_key_value_heads == theirs.num_key_value_heads
    assert ours.qk_norm and not (ours.qkv_bias or ours.o_bias or ours.mlp_bias)
    assert ours.sliding_window is None and theirs.sliding_window is None
    model = eqx.filter_eval_shape(Llama.from_config, {**base, "model_type": "qwen3"}, key=jax.random.key(0))
    assert model.blocks.attn.q_norm.shape == (2, 128)
    llama = eqx.filter_eval_shape(Llama.from_config, LLAMA_CONFIG, key=jax.random.key(0))
    assert llama.blocks.attn.q_norm is None and llama.blocks.attn.k_norm is None


def test_partial_rotary_is_refused_for_qwen3():
    with pytest.raises(PortError, match="config.json: 'partial_rotary_factor' 0.5"):
        LlamaConfig.from_hf({**LLAMA_CONFIG, **QWEN3, "model_type": "qwen3", "partial_rotary_factor": 0.5})
