"""bench/plan.py's shape source: the tensors a checkpoint holds, from transformers' own model of a config.

`transformers_shapes(config)` must give what the Hub holds: the keys and shapes `save_pretrained`
writes (tied weights dropped, MoE experts one key each), the multimodal prefixes of the Hub's
checkpoints, and, for the models the benchmark adds, the published parameter counts.
"""

import math

import pytest

from helpers import LLAMA_CONFIG, REPO, read_header, run_port, script_module, transformers_or_skip

PLAN = script_module(REPO / "bench" / "plan.py")

TINY_QWEN3_MOE = {
    "architectures": ["Qwen3MoeForCausalLM"],
    "model_type": "qwen3_moe",
    "vocab_size": 101,
    "hidden_size": 32,
    "intermediate_size": 64,
    "moe_intermediate_size": 16,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 8,
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "tie_word_embeddings": False,
}
TINY_LLAMA_TIED = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "tie_word_embeddings": True} | (
    LLAMA_CONFIG
)


def saved_shapes(config: dict, directory) -> dict[str, list[int]]:
    """The keys and shapes of the checkpoint transformers' `save_pretrained` writes for `config`."""
    transformers_or_skip()
    PLAN.transformers_model(config).save_pretrained(directory)
    shapes = {}
    for path in sorted(directory.glob("*.safetensors")):
        shapes |= {key: list(info.shape) for key, info in read_header(path).items()}
    return shapes


@pytest.mark.parametrize("config", [TINY_LLAMA_TIED, TINY_QWEN3_MOE], ids=["llama-tied", "qwen3-moe"])
def test_shapes_are_what_save_pretrained_writes(config, tmp_path):
    shapes = PLAN.transformers_shapes(config)
    assert shapes == saved_shapes(config, tmp_path)
    assert ("lm_head.weight" in shapes) == (not config["tie_word_embeddings"])
    if config is TINY_QWEN3_MOE:  # transformers fuses the experts in memory, the checkpoint holds one key each
        assert shapes["model.layers.1.mlp.experts.3.down_proj.weight"] == [32, 16]


def test_shapes_have_the_hubs_multimodal_prefixes():
    """google/gemma-3-27b-it holds `language_model.model.*` and `vision_tower.vision_model.*`
    (transformers 5 loads them as `model.language_model.*` and `model.vision_tower.*`); its head
    is tied to the embeddings, so absent."""
    transformers_or_skip()
    config = PLAN.GEMMA3_27B | {
        "text_config": PLAN.GEMMA3_27B["text_config"] | {"num_hidden_layers": 2, "vocab_size": 64},
        "vision_config": PLAN.GEMMA3_27B["vision_config"] | {"num_hidden_layers": 1},
    }
    shapes = PLAN.transformers_shapes(config)
    prefixes = {key.split(".layers.")[0].split(".")[0] for key in shapes}
    assert prefixes == {"language_model", "vision_tower", "multi_modal_projector"}, prefixes
    assert shapes["language_model.model.embed_tokens.weight"] == [64, 5376]
    assert shapes["language_model.model.layers.1.self_attn.k_proj.weight"] == [16 * 128, 5376]
    assert shapes["vision_tower.vision_model.encoder.layers.0.mlp.fc1.weight"] == [4304, 1152]
    assert not any("lm_head" in key for key in shapes)


def test_a_dual_models_shapes_keep_its_towers_prefixes(tmp_path):
    """SiglipModel's checkpoint holds `text_model.*` and `vision_model.*`: `fresh_shapes` is what
    `save_pretrained` writes (reverting transformers' conversion mapping, which renames standalone
    towers' checkpoints, would double the prefixes)."""
    transformers_or_skip()
    small = {"hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 4, "num_hidden_layers": 1}
    config = PLAN.SIGLIP2_SO400M_384 | {
        "text_config": PLAN.SIGLIP2_SO400M_384["text_config"] | small | {"vocab_size": 64, "projection_size": 32},
        "vision_config": PLAN.SIGLIP2_SO400M_384["vision_config"] | small | {"image_size": 28},
    }
    shapes = PLAN.fresh_shapes(config)
    assert shapes == saved_shapes(config, tmp_path)
    assert {key.split(".")[0] for key in shapes} == {"text_model", "vision_model", "logit_scale", "logit_bias"}
    assert shapes["text_model.embeddings.token_embedding.weight"] == [64, 32]


# Each added model's parameters as published (the model card's rounded figure, or exact).
PUBLISHED = {
    "gemma3-27b": (27.4e9, 0.05e9),
    "gemma4-31b": (31_273_088_876, 0),  # the safetensors' parameter count of google/gemma-4-31B-it
    "olmo2-32b": (32.2e9, 0.05e9),
    "modernbert-large": (396e6, 1e6),
    "xlm-roberta-large": (561e6, 1e6),
    "glm4.6": (355e9, 2e9),  # zai-org/GLM-4.6: "355B" with its MTP layer
    "minimax-m2": (230e9, 2e9),  # MiniMaxAI/MiniMax-M2: "230B"
    "deepseek-v32": (685e9, 1e9),  # deepseek-ai/DeepSeek-V3.2-Exp: "685B" with its MTP layer
    "dinov2-giant": (1.1e9, 0.05e9),  # facebook/dinov2-giant: ViT-g/14, "1.1B"
    "umt5-xxl": (13e9, 0.1e9),  # google/umt5-xxl: mT5-XXL's "13B" sizes, the untied head included
    "whisper-large-v3": (1550e6, 10e6),  # openai/whisper-large-v3: "1550M"
}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_each_added_model_has_its_published_size(name):
    transformers_or_skip()
    _, config, shapes_of, _, _ = PLAN.MODELS[name]
    count = sum(math.prod(shape) for shape in shapes_of(config).values())
    published, tolerance = PUBLISHED[name]
    assert abs(count - published) <= tolerance, f"{name}: {count:,} parameters, published {published:,.0f}"


@pytest.mark.slow
def test_port_plans_a_sparse_checkpoint_of_transformers_shapes(tmp_path):
    """A model under 5 GB is one file, model.safetensors, without an index, as `save_pretrained`
    writes it; `port plan` reads its header and plans every tensor."""
    transformers_or_skip()
    shapes = PLAN.transformers_shapes(TINY_LLAMA_TIED)
    size, files = PLAN.write_sparse_checkpoint(tmp_path / "m", TINY_LLAMA_TIED, shapes, None)
    assert files == 1 and sorted(p.name for p in (tmp_path / "m").iterdir()) == ["config.json", "model.safetensors"]
    assert size == (tmp_path / "m" / "model.safetensors").stat().st_size
    result = run_port("plan", tmp_path / "m", "--mesh", "1x1")
    assert result.returncode == 0, result.stderr
    data = 2 * sum(math.prod(shape) for shape in shapes.values())  # bfloat16: every byte is planned once
    assert f"; {data / 1e3:.1f} KB to read" in result.stdout.splitlines()[-1], result.stdout[-500:]
