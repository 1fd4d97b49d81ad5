"""Measure output parity of port's models against `transformers`, per family and mesh.

    python bench/parity.py [--cases gpt2,llama-gqa,...] [--meshes 1x1,2x2,4x2,8x1] [--dtype bfloat16]
    python bench/parity.py --cases 2026 --meshes 1x1,4x2,data=2,expert=2,model=2
    python bench/parity.py --cases encoders-and-dense --meshes 1x1,4x2
    python bench/parity.py --cases issue38 --meshes 1x1,4x2 [--dtype bfloat16]

Each case writes a random-init checkpoint with `transformers` (float32) into a
temporary directory and runs `port.verify` on it: convert onto the mesh, run the
jitted JAX model and the PyTorch model on the same random token ids [2, 16], and
take the largest absolute difference of the logits (the last hidden state for BERT
and ViT, whose inputs are random pixel values [2, channels, height, width]).

`--cases encoders-and-dense` runs issue 35's: RoBERTa, XLM-R, DistilBERT (sinusoidal),
ModernBERT (global and local layers), Gemma 3, Gemma 4 (dense with shared keys and values,
and MoE), OLMo 2, OLMo 3, SmolLM3 and Ministral 3, as tests/test_decoders.py configures them.

`--cases issue38` runs issue 38's encoder-decoders and towers: T5's encoder alone, T5 (tied
head), UMT5 and mT5 (gated-GeLU, untied), Whisper (logits for random `input_features` and
decoder ids), CLIP and SigLIP dual models (`logits_per_image`), CLIP's vision tower, SigLIP 2
with NaFlex images (a full grid and a smaller padded one), DINOv2 and DINOv2 with registers
and SwiGLU (last hidden state).

`--cases 2026` runs the 2026 families (Qwen3-MoE with a dense layer among MoE layers,
DeepSeek-V3 with and without `q_lora_rank` and group-limited routing, gpt-oss, Llama 4,
Qwen3-Next). A mesh with an `expert` axis (`data=2,expert=2,model=2`) loads with the
shipped mapping's `experts` rule moved to that axis. `--dtype bfloat16` casts the
parameters and runs the reference in bfloat16 too (`port verify --dtype`).
"""

import argparse
import dataclasses
import tempfile

import jax

jax.config.update("jax_num_cpu_devices", 8)

import torch  # noqa: E402
import transformers  # noqa: E402

import port  # noqa: E402

SMALL = dict(initializer_range=0.2, bos_token_id=0, eos_token_id=0)
LLAMA = dict(
    vocab_size=101,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    **SMALL,
)
LLAMA3 = dict(
    rope_type="llama3",
    rope_theta=10000.0,
    factor=8.0,
    low_freq_factor=1.0,
    high_freq_factor=4.0,
    original_max_position_embeddings=8,
)
BERT_SMALL = dict(
    vocab_size=101,
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    intermediate_size=128,
    initializer_range=0.2,
)
DEEPSEEK = dict(
    LLAMA,
    hidden_size=48,
    intermediate_size=72,
    moe_intermediate_size=20,
    num_hidden_layers=3,
    num_key_value_heads=4,
    n_routed_experts=8,
    num_experts_per_tok=3,
    n_group=4,
    topk_group=2,
    first_k_dense_replace=1,
    q_lora_rank=24,
    kv_lora_rank=16,
    qk_nope_head_dim=8,
    qk_rope_head_dim=6,
    v_head_dim=10,
    routed_scaling_factor=1.7,
    n_shared_experts=2,
    rope_parameters=dict(
        rope_type="yarn",
        rope_theta=10000.0,
        factor=4.0,
        original_max_position_embeddings=16,
        mscale=0.9,
        mscale_all_dim=1.0,
    ),
)
T5_SMALL = dict(vocab_size=101, d_model=64, d_kv=16, d_ff=128, num_layers=2, num_heads=4,
                relative_attention_num_buckets=8, relative_attention_max_distance=16, decoder_start_token_id=0)  # fmt: skip
CLIP_TEXT = dict(vocab_size=101, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 max_position_embeddings=32)  # fmt: skip
CLIP_VISION = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, image_size=32,
                   patch_size=8)  # fmt: skip
NEOX = dict(
    vocab_size=101,
    hidden_size=60,
    intermediate_size=120,
    num_hidden_layers=2,
    num_attention_heads=5,
    max_position_embeddings=64,
    **SMALL,
)
CASES = {
    "gpt2": (
        transformers.GPT2LMHeadModel,
        transformers.GPT2Config,
        dict(vocab_size=101, n_positions=32, n_embd=64, n_layer=2, n_head=4, **SMALL),
    ),
    "gpt2-small-124M": (transformers.GPT2LMHeadModel, transformers.GPT2Config, dict(bos_token_id=0, eos_token_id=0)),
    "llama-gqa-untied": (transformers.LlamaForCausalLM, transformers.LlamaConfig, LLAMA),
    "llama-tied-llama3-rope": (
        transformers.LlamaForCausalLM,
        transformers.LlamaConfig,
        dict(LLAMA, tie_word_embeddings=True, rope_parameters=LLAMA3),
    ),
    "mistral": (transformers.MistralForCausalLM, transformers.MistralConfig, dict(LLAMA, sliding_window=4)),
    "qwen2-biases": (transformers.Qwen2ForCausalLM, transformers.Qwen2Config, LLAMA),
    "bert": (transformers.BertModel, transformers.BertConfig, dict(BERT_SMALL, max_position_embeddings=32)),
    "gemma-gqa3-bias": (
        transformers.GemmaForCausalLM,
        transformers.GemmaConfig,
        dict(
            LLAMA,
            hidden_size=48,
            intermediate_size=96,
            num_attention_heads=3,
            num_key_value_heads=1,
            head_dim=32,
            attention_bias=True,
        ),
    ),
    "gemma2-softcap-window": (
        transformers.Gemma2ForCausalLM,
        transformers.Gemma2Config,
        dict(
            LLAMA,
            hidden_size=48,
            intermediate_size=96,
            num_attention_heads=6,
            num_key_value_heads=2,
            head_dim=16,
            query_pre_attn_scalar=24,
            sliding_window=4,
            attn_logit_softcapping=2.0,
            final_logit_softcapping=5.0,
        ),
    ),
    "qwen3-gqa3-untied": (
        transformers.Qwen3ForCausalLM,
        transformers.Qwen3Config,
        dict(LLAMA, num_attention_heads=6, num_key_value_heads=2, head_dim=12),
    ),
    "phi3-gqa3": (
        transformers.Phi3ForCausalLM,
        transformers.Phi3Config,
        dict(LLAMA, pad_token_id=None, hidden_size=48, num_attention_heads=6, num_key_value_heads=2),
    ),
    "mixtral-top2-of-6": (
        transformers.MixtralForCausalLM,
        transformers.MixtralConfig,
        dict(LLAMA, num_local_experts=6, num_experts_per_tok=2),
    ),
    "qwen2-moe-shared": (
        transformers.Qwen2MoeForCausalLM,
        transformers.Qwen2MoeConfig,
        dict(
            LLAMA,
            num_experts=6,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=48,
            norm_topk_prob=False,
        ),
    ),
    "gpt-neox-parallel-rotary0.25": (
        transformers.GPTNeoXForCausalLM,
        transformers.GPTNeoXConfig,
        dict(NEOX, rotary_pct=0.25),
    ),
    "gpt-neox-sequential-rotary0.5-tied": (
        transformers.GPTNeoXForCausalLM,
        transformers.GPTNeoXConfig,
        dict(NEOX, rotary_pct=0.5, use_parallel_residual=False, tie_word_embeddings=True),
    ),
    "vit": (
        transformers.ViTModel,
        transformers.ViTConfig,
        dict(
            hidden_size=48,
            num_hidden_layers=2,
            num_attention_heads=3,
            intermediate_size=80,
            image_size=16,
            patch_size=4,
            initializer_range=0.2,
        ),
    ),
    # 2026's families: sizes unlike each other, every feature the family adds switched on.
    "qwen3-moe-dense-layer": (
        transformers.Qwen3MoeForCausalLM,
        transformers.Qwen3MoeConfig,
        dict(
            LLAMA,
            num_hidden_layers=3,
            num_attention_heads=6,
            head_dim=12,
            num_experts=6,
            num_experts_per_tok=2,
            moe_intermediate_size=24,
            norm_topk_prob=True,
            mlp_only_layers=[1],
        ),
    ),
    "deepseek-v3-lora-groups": (transformers.DeepseekV3ForCausalLM, transformers.DeepseekV3Config, DEEPSEEK),
    "deepseek-v3-no-lora": (
        transformers.DeepseekV3ForCausalLM,
        transformers.DeepseekV3Config,
        dict(DEEPSEEK, q_lora_rank=None),
    ),
    "gpt-oss-sinks-window": (
        transformers.GptOssForCausalLM,
        transformers.GptOssConfig,
        dict(
            LLAMA,
            hidden_size=48,
            intermediate_size=40,
            num_hidden_layers=3,
            num_attention_heads=6,
            head_dim=8,
            num_local_experts=4,
            num_experts_per_tok=2,
            sliding_window=4,
            swiglu_limit=1.5,
            rope_parameters=dict(
                rope_type="yarn",
                rope_theta=150000.0,
                factor=4.0,
                beta_fast=32.0,
                beta_slow=1.0,
                truncate=False,
                original_max_position_embeddings=16,
            ),
        ),
    ),
    "llama4-nope-chunked": (
        transformers.Llama4ForCausalLM,
        transformers.Llama4TextConfig,
        dict(
            LLAMA,
            hidden_size=48,
            num_hidden_layers=4,
            num_attention_heads=6,
            head_dim=8,
            intermediate_size_mlp=64,
            num_local_experts=4,
            num_experts_per_tok=1,
            interleave_moe_layer_step=2,
            no_rope_layers=[1, 1, 0, 1],
            attention_chunk_size=4,
            floor_scale=2,
            attn_scale=0.5,
        ),
    ),
    "qwen3-next-hybrid": (
        transformers.Qwen3NextForCausalLM,
        transformers.Qwen3NextConfig,
        dict(
            LLAMA,
            hidden_size=48,
            num_hidden_layers=4,
            num_attention_heads=4,
            head_dim=16,
            linear_num_key_heads=2,
            linear_num_value_heads=4,
            linear_key_head_dim=8,
            linear_value_head_dim=12,
            num_experts=6,
            num_experts_per_tok=2,
            moe_intermediate_size=24,
            shared_expert_intermediate_size=40,
        ),
    ),
    # The encoders and dense decoders of issue 35 (`--cases encoders-and-dense`).
    "roberta": (
        transformers.RobertaModel,
        transformers.RobertaConfig,
        dict(BERT_SMALL, pad_token_id=1, max_position_embeddings=40),
    ),
    "xlm-roberta": (
        transformers.XLMRobertaModel,
        transformers.XLMRobertaConfig,
        dict(BERT_SMALL, pad_token_id=1, max_position_embeddings=40),
    ),
    "distilbert-sinusoidal": (
        transformers.DistilBertModel,
        transformers.DistilBertConfig,
        dict(vocab_size=101, dim=64, hidden_dim=128, n_layers=2, n_heads=4, max_position_embeddings=32,
             sinusoidal_pos_embds=True, initializer_range=0.2, pad_token_id=0),
    ),
    "modernbert-global-local": (
        transformers.ModernBertModel,
        transformers.ModernBertConfig,
        dict(vocab_size=101, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
             max_position_embeddings=64, local_attention=4, global_attn_every_n_layers=2, initializer_range=0.2,
             pad_token_id=0, bos_token_id=0, eos_token_id=0, cls_token_id=0, sep_token_id=0),
    ),
    "gemma3-local-global": (
        transformers.Gemma3ForCausalLM,
        transformers.Gemma3TextConfig,
        dict(LLAMA, num_hidden_layers=3, head_dim=16, query_pre_attn_scalar=24, sliding_window=4,
             layer_types=["sliding_attention", "full_attention", "sliding_attention"],
             rope_parameters={"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1000.0},
                              "sliding_attention": {"rope_type": "default", "rope_theta": 100.0}},
             final_logit_softcapping=5.0),
    ),
    "gemma4-dense-shared-kv": (
        transformers.Gemma4ForCausalLM,
        transformers.Gemma4TextConfig,
        dict(LLAMA, num_hidden_layers=4, head_dim=8, global_head_dim=16, num_global_key_value_heads=1,
             attention_k_eq_v=True, sliding_window=4, layer_types=["sliding_attention", "full_attention"] * 2,
             num_kv_shared_layers=2, use_double_wide_mlp=True, hidden_size_per_layer_input=8,
             vocab_size_per_layer_input=101, final_logit_softcapping=5.0),
    ),
    "gemma4-moe": (
        transformers.Gemma4ForCausalLM,
        transformers.Gemma4TextConfig,
        dict(LLAMA, num_hidden_layers=3, head_dim=8, global_head_dim=16, sliding_window=4,
             layer_types=["sliding_attention", "full_attention", "full_attention"], hidden_size_per_layer_input=0,
             enable_moe_block=True, num_experts=4, top_k_experts=2, moe_intermediate_size=24),
    ),
    "olmo2-bias": (transformers.Olmo2ForCausalLM, transformers.Olmo2Config, dict(LLAMA, attention_bias=True)),
    "olmo3-sliding": (
        transformers.Olmo3ForCausalLM,
        transformers.Olmo3Config,
        dict(LLAMA, num_hidden_layers=3, sliding_window=4,
             layer_types=["sliding_attention", "sliding_attention", "full_attention"],
             rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 500000.0},
                              "sliding_attention": {"rope_type": "default", "rope_theta": 100.0}}),
    ),
    "smollm3-nope": (
        transformers.SmolLM3ForCausalLM,
        transformers.SmolLM3Config,
        dict(LLAMA, num_hidden_layers=3, no_rope_layers=[1, 0, 1], use_sliding_window=True, sliding_window=4, pad_token_id=0),
    ),
    "ministral3-yarn-scaled": (
        transformers.Ministral3ForCausalLM,
        transformers.Ministral3Config,
        dict(LLAMA, head_dim=8, rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 2.0,
             "original_max_position_embeddings": 4, "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0,
             "mscale_all_dim": 1.0, "llama_4_scaling_beta": 0.5}),
    ),
    # Issue 38: encoder-decoders and towers (port verify draws their inputs: decoder ids, features, images).
    "t5-encoder": (transformers.T5EncoderModel, transformers.T5Config, T5_SMALL),
    "t5-tied": (transformers.T5ForConditionalGeneration, transformers.T5Config, T5_SMALL),
    "umt5-gated-untied": (transformers.UMT5ForConditionalGeneration, transformers.UMT5Config,
                          dict(T5_SMALL, feed_forward_proj="gated-gelu", tie_word_embeddings=False)),
    "mt5-gated": (transformers.MT5ForConditionalGeneration, transformers.MT5Config,
                  dict(T5_SMALL, feed_forward_proj="gated-gelu", tie_word_embeddings=False)),
    "whisper": (transformers.WhisperForConditionalGeneration, transformers.WhisperConfig,
                dict(vocab_size=101, d_model=64, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
                     decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128, num_mel_bins=16,
                     max_source_positions=16, max_target_positions=32, pad_token_id=0, bos_token_id=1,
                     eos_token_id=2, decoder_start_token_id=1)),
    "clip": (transformers.CLIPModel, transformers.CLIPConfig,
             dict(text_config=CLIP_TEXT, vision_config=CLIP_VISION, projection_dim=32)),
    "clip-vision": (transformers.CLIPVisionModel, transformers.CLIPVisionConfig, CLIP_VISION),
    "siglip": (transformers.SiglipModel, transformers.SiglipConfig,
               dict(text_config=dict(CLIP_TEXT, hidden_act="gelu_pytorch_tanh"),
                    vision_config=dict(CLIP_VISION, hidden_act="gelu_pytorch_tanh"))),
    "siglip2-naflex": (transformers.Siglip2Model, transformers.Siglip2Config,
                       dict(text_config=dict(CLIP_TEXT, hidden_act="gelu_pytorch_tanh"),
                            vision_config=dict(CLIP_VISION, hidden_act="gelu_pytorch_tanh", num_patches=16,
                                               image_size=None))),
    "dinov2": (transformers.Dinov2Model, transformers.Dinov2Config,
               dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, mlp_ratio=2, image_size=32,
                    patch_size=8, layerscale_value=0.5)),
    "dinov2-registers-swiglu": (transformers.Dinov2WithRegistersModel, transformers.Dinov2WithRegistersConfig,
                                dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, mlp_ratio=2,
                                     image_size=32, patch_size=8, num_register_tokens=2, use_swiglu_ffn=True,
                                     layerscale_value=0.5)),
}  # fmt: skip
ISSUE_38 = ["t5-encoder", "t5-tied", "umt5-gated-untied", "mt5-gated", "whisper", "clip", "clip-vision", "siglip",
            "siglip2-naflex", "dinov2", "dinov2-registers-swiglu"]  # fmt: skip
ENCODERS_AND_DENSE = [
    "roberta",
    "xlm-roberta",
    "distilbert-sinusoidal",
    "modernbert-global-local",
    "gemma3-local-global",
    "gemma4-dense-shared-kv",
    "gemma4-moe",
    "olmo2-bias",
    "olmo3-sliding",
    "smollm3-nope",
    "ministral3-yarn-scaled",
]
NEW_2026 = [
    "qwen3-moe-dense-layer",
    "deepseek-v3-lora-groups",
    "deepseek-v3-no-lora",
    "gpt-oss-sinks-window",
    "llama4-nope-chunked",
    "qwen3-next-hybrid",
]
DEFAULT = [c for c in CASES if c != "gpt2-small-124M" and c not in NEW_2026 + ENCODERS_AND_DENSE + ISSUE_38]


def split_meshes(text: str) -> list[str]:
    """ "1x1,4x2,data=2,expert=2,model=2" -> ["1x1", "4x2", "data=2,expert=2,model=2"]."""
    meshes: list[str] = []
    for part in text.split(","):
        if "=" in part and meshes and "=" in meshes[-1]:
            meshes[-1] += "," + part
        else:
            meshes.append(part)
    return meshes


def mapping_for(directory: str, mesh: str) -> port.Mapping | None:
    """The shipped mapping, with `experts` on the mesh's `expert` axis when it has one."""
    if "expert" not in mesh:
        return None
    with port.open_checkpoint(directory) as ckpt:
        shipped = port.mapping_for(ckpt.config)
    return dataclasses.replace(shipped, rules={**shipped.rules, "experts": ("expert",)})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--cases",
        default=",".join(DEFAULT),
        help=f"'2026', 'encoders-and-dense', 'issue38', 'all' (every group), or from {', '.join(CASES)}",
    )
    parser.add_argument(
        "--meshes",
        default="1x1,2x2,4x2,8x1",
        help="comma-separated; a named mesh such as data=2,expert=2,model=2 counts as one",
    )
    parser.add_argument("--dtype", default=None, help="e.g. bfloat16 (default: the checkpoint's float32)")
    args = parser.parse_args()
    transformers.logging.set_verbosity_error()
    meshes = split_meshes(args.meshes)
    groups = {"2026": NEW_2026, "encoders-and-dense": ENCODERS_AND_DENSE, "issue38": ISSUE_38}
    cases = {**groups, "all": DEFAULT + NEW_2026 + ENCODERS_AND_DENSE + ISSUE_38}.get(args.cases) or args.cases.split(
        ","
    )
    print("| case | params | max abs reference | " + " | ".join(f"error {m}" for m in meshes) + " |")
    print("|---|---|---|" + "---|" * len(meshes))
    for case in cases:
        try:
            row(case, meshes, args.dtype)
        except Exception as e:  # one case's failure (a missing class in an older transformers) is its row
            print(
                f"| {case} | failed: {type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''} |", flush=True
            )


def row(case: str, meshes: list[str], dtype: str | None) -> None:
    """Verify one case on every mesh and print its table row."""
    cls, config_cls, overrides = CASES[case]
    torch.manual_seed(0)
    config = config_cls(**overrides)
    config._attn_implementation = "eager"
    config._experts_implementation = "eager"  # torch's grouped_mm wants 16-byte strides in bfloat16
    model = cls(config).eval()
    params = sum(
        p.numel()
        for name, p in model.named_parameters()
        if "lm_head" not in name or not model.config.tie_word_embeddings
    )
    with tempfile.TemporaryDirectory() as directory:
        model.save_pretrained(directory)
        results = [
            port.verify(directory, port.make_mesh(m), mapping=mapping_for(directory, m), dtype=dtype) for m in meshes
        ]
    # In 16 bits the bound is port verify's: 2e-2 of the largest |logit|, and at least twice
    # the reference's own distance from its float32 run.
    cells = " | ".join(
        f"{r.max_abs_diff:.2e}" + ("" if dtype is None else f" (bound {r.tolerance:.2e})") for r in results
    )
    print(f"| {case} | {params / 1e6:.2f}M | {results[0].max_abs_reference:.3g} | {cells} |", flush=True)


if __name__ == "__main__":
    main()
