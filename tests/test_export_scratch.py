"""Export of a model trained from scratch: no source checkpoint, the tensors derived (`_export._derive`).

The rule is checked against transformers itself: for each family, the derived keys and shapes
are those `save_pretrained` writes for the same config (its model built on the meta device).
A from-scratch Llama and GPT-2 (fused q/k/v), perturbed off their init, exported with
`port.export(model, out, config=config)` and through `port.save` then `port export`, load in
transformers with no missing or unexpected key and give the JAX model's logits. Where the
inverse of a transform is ambiguous (DINOv2's `cls_token` reshape), the export is refused in
one line naming the mapping's entry and the transform, and nothing is written.
"""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import port
from port._export._derive import derive

from helpers import (
    BERT_CONFIG,
    GPT2_CONFIG,
    INPUT_IDS,
    LLAMA_CONFIG,
    REPO,
    one_line,
    run_port,
    script_module,
    transformers_or_skip,
)

PLAN = script_module(REPO / "bench" / "plan.py")

LLAMA = {"model_type": "llama", "tie_word_embeddings": False} | LLAMA_CONFIG
GPT2 = {"model_type": "gpt2"} | GPT2_CONFIG
DECODER = dict(LLAMA_CONFIG, head_dim=16, pad_token_id=None)
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
FAMILIES = {  # config.json of a tiny model of each family, `architectures` the class transformers builds
    "llama": {"architectures": ["LlamaForCausalLM"]} | LLAMA,
    "llama-tied": {"architectures": ["LlamaForCausalLM"]} | LLAMA | {"tie_word_embeddings": True},
    "gpt2": {"architectures": ["GPT2LMHeadModel"]} | GPT2,
    "qwen3": {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3"} | DECODER,
    "qwen3_moe": {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe"} | DECODER | MOE,
    "mixtral": {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "num_local_experts": 4} | DECODER,
    "gemma3_text": {"architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text"} | DECODER,
    "phi3": {"architectures": ["Phi3ForCausalLM"], "model_type": "phi3", "tie_word_embeddings": False}
    | LLAMA_CONFIG
    | {"pad_token_id": None},
    "gpt_neox": {"architectures": ["GPTNeoXForCausalLM"], "model_type": "gpt_neox", "tie_word_embeddings": False}
    | LLAMA_CONFIG,
    "bert": {"architectures": ["BertModel"], "model_type": "bert"} | BERT_CONFIG,
    "deepseek_v3": {
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "deepseek_v3",
        "first_k_dense_replace": 1,
        "n_routed_experts": 4,
        "n_shared_experts": 1,
        "num_experts_per_tok": 2,
        "n_group": 1,
        "topk_group": 1,
        "q_lora_rank": 32,
        "kv_lora_rank": 16,
        "qk_nope_head_dim": 8,
        "qk_rope_head_dim": 8,
        "v_head_dim": 8,
        "moe_intermediate_size": 32,
    }
    | LLAMA_CONFIG
    | {"num_key_value_heads": 4, "pad_token_id": None},
}
DINOV2 = {"model_type": "dinov2", "hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2}
DINOV2 |= {"intermediate_size": 64, "image_size": 28, "patch_size": 14}


@pytest.mark.parametrize("family", FAMILIES)
def test_derived_tensors_are_what_save_pretrained_writes(family):
    """Keys and shapes derived from port's module of the config equal transformers' state dict
    as `save_pretrained` writes it (tied weights dropped, experts one key each)."""
    transformers_or_skip()
    config = FAMILIES[family]
    mapping = port.mapping_for(config)
    derived = derive(port.skeleton(mapping, config), mapping, config)
    assert {key: list(shape) for key, (shape, _) in derived.items()} == PLAN.transformers_shapes(config)


def test_an_ambiguous_reshape_is_refused_naming_the_entry_and_the_transform():
    mapping = port.mapping_for(DINOV2)
    with pytest.raises(port.PlanError) as e:
        derive(port.skeleton(mapping, DINOV2), mapping, DINOV2)
    assert "dinov2.toml: entry 'embeddings.cls_token'" in str(e.value)
    assert '{ reshape = ["hidden_size"] }' in str(e.value)
    assert "\n" not in str(e.value)


def test_a_bfloat16_model_derives_bfloat16_tensors():
    """The dtype is the leaf's: a model trained in bfloat16 writes bfloat16."""
    mapping = port.mapping_for(LLAMA)
    model = jax.tree.map(lambda leaf: jax.ShapeDtypeStruct(leaf.shape, jnp.bfloat16), port.skeleton(mapping, LLAMA))
    dtypes = {d.name for _, d in derive(model, mapping, LLAMA).values()}
    assert dtypes == {"bfloat16"}


def test_derived_tensors_that_do_not_plan_back_are_refused_as_a_derivation_bug(monkeypatch, tmp_path):
    import port._export._export as export_module

    model = port.skeleton(port.mapping_for(LLAMA), LLAMA)
    wrong = derive(model, port.mapping_for(LLAMA), LLAMA)
    wrong["model.norm.weight"] = ((65,), wrong["model.norm.weight"][1])
    monkeypatch.setattr(export_module, "derive", lambda *args: wrong)
    with pytest.raises(port.PlanError, match=r"^the tensors derived from the model do not plan back to it") as e:
        port.export(model, tmp_path / "hf", config=LLAMA)
    assert "entry 'norm.weight': shape mismatch: 'model.norm.weight' is [65]" in str(e.value)
    assert not (tmp_path / "hf").exists()


def test_an_export_without_a_source_needs_the_config(tmp_path):
    model = port.skeleton(port.mapping_for(LLAMA), LLAMA)
    with pytest.raises(port.PortError, match=r"^`config`: a model exported without a `source`"):
        port.export(model, tmp_path / "hf")
    assert not (tmp_path / "hf").exists()


def trained(build, config: dict):
    """`build.from_config(config)`, then every floating leaf moved by noise: not transformers' init
    (built and moved in one compiled call, for speed)."""

    @eqx.filter_jit
    def make(key):
        model = build.from_config(config, key=key)
        leaves, tree = jax.tree.flatten(model)
        keys = jax.random.split(jax.random.key(1), len(leaves))
        moved = [
            leaf + 0.05 * jax.random.normal(k, leaf.shape, leaf.dtype)
            if isinstance(leaf, jax.Array) and jnp.issubdtype(leaf.dtype, jnp.floating)
            else leaf
            for leaf, k in zip(leaves, keys)
        ]
        return jax.tree.unflatten(tree, moved)

    return make(jax.random.key(0))


@pytest.fixture(scope="module")
def scratch():
    """A from-scratch Llama and GPT-2, each with its config and its logits on `INPUT_IDS`."""
    from port.models.gpt2 import GPT2 as GPT2Model
    from port.models.llama import Llama

    made = {}
    for name, build, config in (("llama", Llama, LLAMA), ("gpt2", GPT2Model, GPT2)):
        model = trained(build, config)
        made[name] = (model, config, np.asarray(eqx.filter_jit(build.__call__)(model, jnp.asarray(INPUT_IDS))))
    return made


def assert_transformers_matches(directory, logits):
    """transformers loads `directory` with no key missing, unexpected or mismatched, and gives `logits`."""
    transformers = transformers_or_skip()
    import torch

    model, info = transformers.AutoModelForCausalLM.from_pretrained(
        directory, output_loading_info=True, dtype=torch.float32
    )
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    with torch.no_grad():
        theirs = model.eval()(torch.tensor(INPUT_IDS)).logits.numpy()
    assert np.abs(theirs - logits).max() < 1e-4, np.abs(theirs - logits).max()


@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_a_model_trained_from_scratch_exports_to_transformers(scratch, name, tmp_path):
    model, config, logits = scratch[name]
    port.export(model, tmp_path / "hf", config=config)
    assert_transformers_matches(tmp_path / "hf", logits)


@pytest.mark.slow
def test_port_export_of_a_saved_from_scratch_model(scratch, tmp_path):
    """`port.save(model, dir, config=config)` records no source tensors; `port export DIR` derives them."""
    model, config, logits = scratch["llama"]
    port.save(model, tmp_path / "jax", config=config)
    result = run_port("export", tmp_path / "jax", "--out", tmp_path / "hf")
    assert result.returncode == 0, result.stdout + result.stderr
    assert_transformers_matches(tmp_path / "hf", logits)


@pytest.mark.slow
def test_port_export_refuses_an_ambiguous_reshape_in_one_line(tmp_path):
    from port.models.dinov2 import DINOv2

    port.save(DINOv2.from_config(DINOV2, key=jax.random.key(0)), tmp_path / "jax", config=DINOV2)
    result = run_port("export", tmp_path / "jax", "--out", tmp_path / "hf")
    one_line(result, "entry 'embeddings.cls_token'", '{ reshape = ["hidden_size"] }', out=tmp_path / "hf")


def test_an_encoder_decoder_trained_from_scratch_exports_to_transformers(tmp_path):
    """A T5 from scratch (its own head, written beside `shared`), both stacks and the relative
    position tables derived; transformers' `T5ForConditionalGeneration` gives its logits."""
    transformers = transformers_or_skip()
    import torch

    from port.models.t5 import T5

    config = {
        "model_type": "t5",
        "architectures": ["T5ForConditionalGeneration"],
        "vocab_size": 64,
        "d_model": 32,
        "d_kv": 8,
        "d_ff": 64,
        "num_layers": 2,
        "num_heads": 4,
        "relative_attention_num_buckets": 8,
        "relative_attention_max_distance": 16,
        "feed_forward_proj": "gated-gelu",
        "tie_word_embeddings": False,
        "decoder_start_token_id": 0,
        "pad_token_id": 0,
    }
    model = trained(T5, config)
    ids, decoder_ids = INPUT_IDS[:, :7] % 64, INPUT_IDS[:, 7:12] % 64
    ours = np.asarray(eqx.filter_jit(T5.__call__)(model, jnp.asarray(ids), jnp.asarray(decoder_ids)))
    port.export(model, tmp_path / "hf", config=config)
    hf, info = transformers.T5ForConditionalGeneration.from_pretrained(tmp_path / "hf", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    with torch.no_grad():
        theirs = hf.eval()(input_ids=torch.tensor(ids), decoder_input_ids=torch.tensor(decoder_ids)).logits.numpy()
    assert np.abs(theirs - ours).max() < 1e-4, np.abs(theirs - ours).max()
