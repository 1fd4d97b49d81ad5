"""Benchmark: `port plan` on today's largest open models, from sparse checkpoints.

    python bench/plan.py [--models deepseek-v3,qwen3-235b,...] [--meshes 8x8,32x16] [--repeats 3]
                         [--quick] [--breakdown] [--keep DIR] [--out docs/plan.md]

For each model a checkpoint of its real shapes is written to a temporary directory:
config.json as the Hub's (reconstructed where noted), and bfloat16 safetensors shards in
the Hub's key layout, each with a real header and data that is a hole (`os.truncate`: no
byte allocated, so a 1.3 TB checkpoint takes a few MB of disk), plus the
`model.safetensors.index.json` that lists them (one file: `model.safetensors`, no index).
The key names and shapes come from transformers itself (`transformers_shapes`: the config's
architecture built on the meta device, its state dict as `save_pretrained` writes it in the
checkpoint's original layout: tied weights dropped, per-expert keys, multimodal prefixes), so a
new model needs only its config.json; DeepSeek-V3 and Qwen3-Next keep hand-written shapes for
their multi-token-prediction layers, which transformers does not build.

Then the real command line, `python -m port plan DIR --mesh M`, runs `--repeats` times on each mesh (the model's own, or
each of `--meshes`), each in a fresh wrapper process (`--measure`), which reports:

  seconds      wall time of the whole command (the supervisor, its worker, imports and
               all), from the wrapper's Popen to the exit; the table shows the best run.
  maxrss       `getrusage(RUSAGE_CHILDREN).ru_maxrss` of the wrapper: the largest peak
               resident set among its waited-for descendants, so the worker's (the
               supervisor waits for it). Shared libraries' pages included.
  RssAnon      the worker's peak anonymous resident memory, `/proc/<worker>/status`
               sampled every 2 ms by a thread of the wrapper (the worker is the
               supervisor's child), and its VmHWM read last (the peak RSS the kernel keeps).
  params, read, per device   the plan's own figures, from `port plan`'s last line (bytes
               to read: the sum of every device block's source region, replicas read once).
  tensors      the tensors in the checkpoint (every shard's header).

Models (bfloat16 copies of the weights, but for deepseek-v3-fp8):

  deepseek-v3   deepseek-ai/DeepSeek-V3, 671B, 61 layers + the MTP layer 61, 256 experts, mesh 32x16
  deepseek-v3-fp8  the same as the Hub publishes it: FP8 e4m3 weights, each with its float32
                `weight_scale_inv` (one scale per 128x128 block: ceil(M/128) x ceil(N/128)) and
                config.json's `quantization_config`; embeddings, head, norms and the routers'
                gates bfloat16, `e_score_correction_bias` float32; 163 files, mesh 32x16
  deepseek-v32  deepseek-ai/DeepSeek-V3.2-Exp, 685B: DeepSeek-V3's layers and MTP layer, each with its
                lightning indexer (64 heads of 128, top 2048), 163 files, mesh 32x16
  glm5          zai-org/GLM-5, 78 layers + the MTP layer 78, 256 experts, indexer 32 heads of 128, mesh 32x16
  qwen3-235b    Qwen/Qwen3-235B-A22B, 94 layers, 128 experts, mesh 8x8
  gpt-oss-120b  openai/gpt-oss-120b (a bf16 copy: fused `mlp.experts.gate_up_proj`), mesh 8x8
  llama4-scout  meta-llama/Llama-4-Scout-17B-16E, the Hub's multimodal layout
                (`language_model.model.*`, its vision tower `vision_model.*`), mesh 8x8
  qwen3-next    Qwen/Qwen3-Next-80B-A3B-Instruct, 48 layers, 512 experts, its `mtp.*` layer, mesh 8x8
  gemma3-27b    google/gemma-3-27b-it, the Hub's multimodal layout (`language_model.model.*`, its
                SigLIP tower `vision_tower.vision_model.*`, `multi_modal_projector.*`), head tied,
                12 files, mesh 8x8
  gemma4-31b    google/gemma-4-31B-it, the largest Gemma 4 (`model.language_model.*`,
                `model.vision_tower.*`), reconstructed: see GEMMA4_31B, mesh 8x8
  olmo2-32b     allenai/OLMo-2-0325-32B, 64 layers, mesh 8x8
  minimax-m2    MiniMaxAI/MiniMax-M2 (a bf16 copy), 62 layers, 256 experts, mesh 32x16
  glm4.6        zai-org/GLM-4.6, 355B, 92 layers + the MTP layer 92, 160 experts, mesh 32x16
  kimi-k25      moonshotai/Kimi-K2.5 (a bf16 copy), DeepSeek-V3's text model with 384 experts and
                64 heads under `language_model.model.*`, its vision tower `vision_tower.*`, mesh 32x16
  mistral-large4  transformers' MistralLarge4 at its config's defaults (Mistral-Large-4-1T-A52B's sizes:
                72 layers, every 4th NoPE, 128 experts, sparse attention keeping 2048), Mistral's own
                key names, its Pixtral tower `vision_encoder.*`, mesh 32x16
  deepseek-v4-pro  DeepSeek-V4-Pro as transformers' DeepseekV4Config describes it (a bf16 copy: 61 layers,
                384 experts, CSA / HCA layers, hash-routed first 3; see DEEPSEEK_V4_PRO), mesh 32x16
  modernbert-large  answerdotai/ModernBERT-large (ModernBertForMaskedLM), one file, mesh 2x2
  xlm-roberta-large  FacebookAI/xlm-roberta-large (XLMRobertaForMaskedLM), one file, mesh 2x2
  dinov2-giant  facebook/dinov2-giant (Dinov2Model: SwiGLU, 40 layers of 1536), one file, mesh 2x2
  t5-xxl-encoder  google/t5-v1_1-xxl's encoder alone (T5EncoderModel, as diffusion pipelines ship it:
                `shared.weight` and `encoder.*`), reconstructed, mesh 4x2
  umt5-xxl      google/umt5-xxl (UMT5ForConditionalGeneration, its untied `lm_head.weight`), reconstructed,
                mesh 4x2
  whisper-large-v3  openai/whisper-large-v3 (WhisperForConditionalGeneration, head tied), reconstructed,
                mesh 2x2
  siglip2-so400m  google/siglip2-so400m-patch14-384 (the dual SiglipModel: both So400m towers),
                reconstructed, mesh 2x2
  siglip2-so400m-naflex  google/siglip2-so400m-patch16-naflex (the dual Siglip2Model, NaFlex),
                reconstructed, mesh 2x2

`--quick` plans one model (qwen3-235b) once: a smoke check. `--breakdown` adds, per model, the
worker's memory stage by stage, in one fresh process calling port's library the way
`port plan` does: the interpreter, `import jax, equinox`, `import port`, the headers
(`open_checkpoint`), mapping + skeleton, the plan (`port.authoring.check`), the printed table.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import resource
import struct
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import _measure

# ---------------------------------------------------------------------------- the models' config.json

# deepseek-ai/DeepSeek-V3's config.json, its FP8 `quantization_config` left out (a bfloat16 copy).
DEEPSEEK_V3 = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "model_type": "deepseek_v3",
    "vocab_size": 129280,
    "hidden_size": 7168,
    "intermediate_size": 18432,
    "moe_intermediate_size": 2048,
    "num_hidden_layers": 61,
    "num_nextn_predict_layers": 1,
    "num_attention_heads": 128,
    "num_key_value_heads": 128,
    "n_shared_experts": 1,
    "n_routed_experts": 256,
    "routed_scaling_factor": 2.5,
    "kv_lora_rank": 512,
    "q_lora_rank": 1536,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "qk_nope_head_dim": 128,
    "topk_method": "noaux_tc",
    "n_group": 8,
    "topk_group": 4,
    "num_experts_per_tok": 8,
    "first_k_dense_replace": 3,
    "norm_topk_prob": True,
    "scoring_func": "sigmoid",
    "hidden_act": "silu",
    "max_position_embeddings": 163840,
    "rms_norm_eps": 1e-06,
    "rope_theta": 10000,
    "rope_scaling": {
        "beta_fast": 32,
        "beta_slow": 1,
        "factor": 40,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
        "original_max_position_embeddings": 4096,
        "type": "yarn",
    },
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "attention_bias": False,
    "bos_token_id": 0,
    "eos_token_id": 1,
}

# deepseek-ai/DeepSeek-V3's config.json as the Hub has it: FP8 with 128x128 block scales.
DEEPSEEK_V3_FP8 = DEEPSEEK_V3 | {
    "quantization_config": {
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "quant_method": "fp8",
        "weight_block_size": [128, 128],
    }
}

# Qwen/Qwen3-235B-A22B's config.json.
QWEN3_235B = {
    "architectures": ["Qwen3MoeForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 151643,
    "decoder_sparse_step": 1,
    "eos_token_id": 151645,
    "head_dim": 128,
    "hidden_act": "silu",
    "hidden_size": 4096,
    "initializer_range": 0.02,
    "intermediate_size": 12288,
    "max_position_embeddings": 40960,
    "max_window_layers": 94,
    "mlp_only_layers": [],
    "model_type": "qwen3_moe",
    "moe_intermediate_size": 1536,
    "norm_topk_prob": True,
    "num_attention_heads": 64,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "num_hidden_layers": 94,
    "num_key_value_heads": 4,
    "output_router_logits": False,
    "rms_norm_eps": 1e-06,
    "rope_scaling": None,
    "rope_theta": 1000000.0,
    "router_aux_loss_coef": 0.001,
    "sliding_window": None,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.51.0",
    "use_cache": True,
    "use_sliding_window": False,
    "vocab_size": 151936,
}

# openai/gpt-oss-120b's config.json, without its MXFP4 `quantization_config` (a bfloat16 copy
# of the weights, in the same names).
GPT_OSS_120B = {
    "architectures": ["GptOssForCausalLM"],
    "attention_bias": True,
    "attention_dropout": 0.0,
    "eos_token_id": 200002,
    "experts_per_token": 4,
    "head_dim": 64,
    "hidden_act": "silu",
    "hidden_size": 2880,
    "initial_context_length": 4096,
    "initializer_range": 0.02,
    "intermediate_size": 2880,
    "layer_types": ["sliding_attention", "full_attention"] * 18,
    "max_position_embeddings": 131072,
    "model_type": "gpt_oss",
    "num_attention_heads": 64,
    "num_experts_per_tok": 4,
    "num_hidden_layers": 36,
    "num_key_value_heads": 8,
    "num_local_experts": 128,
    "output_router_logits": False,
    "pad_token_id": 199999,
    "rms_norm_eps": 1e-05,
    "rope_scaling": {
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "factor": 32.0,
        "original_max_position_embeddings": 4096,
        "rope_type": "yarn",
        "truncate": False,
    },
    "rope_theta": 150000,
    "router_aux_loss_coef": 0.9,
    "sliding_window": 128,
    "swiglu_limit": 7.0,
    "tie_word_embeddings": False,
    "transformers_version": "4.55.0.dev0",
    "use_cache": True,
    "vocab_size": 201088,
}

# meta-llama/Llama-4-Scout-17B-16E's config.json (Llama4ForConditionalGeneration: the text model
# under `text_config`, a vision tower), reconstructed from the published sizes and
# transformers' Llama4Config defaults.
SCOUT = {
    "architectures": ["Llama4ForConditionalGeneration"],
    "model_type": "llama4",
    "boi_token_index": 200080,
    "eoi_token_index": 200081,
    "image_token_index": 200092,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.51.0.dev0",
    "text_config": {
        "model_type": "llama4_text",
        "attention_bias": False,
        "attention_chunk_size": 8192,
        "attention_dropout": 0.0,
        "bos_token_id": 200000,
        "eos_token_id": [200001, 200007, 200008],
        "pad_token_id": 200018,
        "head_dim": 128,
        "hidden_act": "silu",
        "hidden_size": 5120,
        "initializer_range": 0.02,
        "interleave_moe_layer_step": 1,
        "intermediate_size": 8192,
        "intermediate_size_mlp": 16384,
        "max_position_embeddings": 10485760,
        "moe_layers": list(range(48)),
        "no_rope_layers": [int((i + 1) % 4 != 0) for i in range(48)],
        "num_attention_heads": 40,
        "num_experts_per_tok": 1,
        "num_hidden_layers": 48,
        "num_key_value_heads": 8,
        "num_local_experts": 16,
        "output_router_logits": False,
        "rms_norm_eps": 1e-05,
        "rope_scaling": {
            "factor": 16.0,
            "high_freq_factor": 1.0,
            "low_freq_factor": 1.0,
            "original_max_position_embeddings": 8192,
            "rope_type": "llama3",
        },
        "rope_theta": 500000.0,
        "router_aux_loss_coef": 0.001,
        "router_jitter_noise": 0.0,
        "torch_dtype": "bfloat16",
        "use_cache": True,
        "use_qk_norm": True,
        "vocab_size": 202048,
    },
    "vision_config": {
        "model_type": "llama4_vision_model",
        "attention_dropout": 0.0,
        "hidden_act": "gelu",
        "hidden_size": 1408,
        "image_size": 336,
        "initializer_range": 0.02,
        "intermediate_size": 5632,
        "multi_modal_projector_bias": False,
        "norm_eps": 1e-05,
        "num_attention_heads": 16,
        "num_channels": 3,
        "num_hidden_layers": 34,
        "patch_size": 14,
        "pixel_shuffle_ratio": 0.5,
        "projector_dropout": 0.0,
        "projector_input_dim": 4096,
        "projector_output_dim": 4096,
        "rope_theta": 10000,
        "vision_feature_layer": -1,
        "vision_feature_select_strategy": "default",
        "vision_output_dim": 4096,
    },
}

# Qwen/Qwen3-Next-80B-A3B-Instruct's config.json.
QWEN3_NEXT_80B = {
    "architectures": ["Qwen3NextForCausalLM"],
    "model_type": "qwen3_next",
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 151643,
    "eos_token_id": 151645,
    "vocab_size": 151936,
    "hidden_size": 2048,
    "intermediate_size": 5120,
    "num_hidden_layers": 48,
    "num_attention_heads": 16,
    "num_key_value_heads": 2,
    "head_dim": 256,
    "hidden_act": "silu",
    "initializer_range": 0.02,
    "max_position_embeddings": 262144,
    "rms_norm_eps": 1e-6,
    "rope_scaling": None,
    "rope_theta": 10000000,
    "partial_rotary_factor": 0.25,
    "full_attention_interval": 4,
    "linear_conv_kernel_dim": 4,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "linear_num_key_heads": 16,
    "linear_num_value_heads": 32,
    "num_experts": 512,
    "num_experts_per_tok": 10,
    "moe_intermediate_size": 512,
    "shared_expert_intermediate_size": 512,
    "norm_topk_prob": True,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "output_router_logits": False,
    "router_aux_loss_coef": 0.001,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.57.0.dev0",
    "use_cache": True,
    "use_sliding_window": False,
}


# google/gemma-3-27b-it's config.json (Gemma3ForConditionalGeneration: the text model under
# `text_config`, its SigLIP vision tower under `vision_config`); the rest are transformers'
# Gemma3 defaults: vocab 262208, rope_theta 1e6 (global) and 10000 (local), 5 local : 1 global.
GEMMA3_27B = {
    "architectures": ["Gemma3ForConditionalGeneration"],
    "model_type": "gemma3",
    "boi_token_index": 255999,
    "eoi_token_index": 256000,
    "eos_token_id": [1, 106],
    "image_token_index": 262144,
    "initializer_range": 0.02,
    "mm_tokens_per_image": 256,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.50.0.dev0",
    "text_config": {
        "model_type": "gemma3_text",
        "head_dim": 128,
        "hidden_size": 5376,
        "intermediate_size": 21504,
        "num_attention_heads": 32,
        "num_hidden_layers": 62,
        "num_key_value_heads": 16,
        "query_pre_attn_scalar": 168,
        "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
        "sliding_window": 1024,
    },
    "vision_config": {
        "model_type": "siglip_vision_model",
        "hidden_size": 1152,
        "image_size": 896,
        "intermediate_size": 4304,
        "num_attention_heads": 16,
        "num_hidden_layers": 27,
        "patch_size": 14,
        "vision_use_head": False,
    },
}

# google/gemma-4-31B-it, the largest Gemma 4 (dense; transformers' configuration_gemma4.py states
# no sizes but its default, gemma-4-e2b, and names gemma-4-26B-A4B, the MoE, which is smaller):
# reconstructed from the published sizes, its text model with K = V on the global layers (4 KV
# heads of 512, the 5 local of every 6 16 of 256) and no per-layer embeddings, the vision tower
# of about 550M. Its tensors count 31,273,088,876 parameters, the published checkpoint's.
GEMMA4_31B = {
    "architectures": ["Gemma4ForConditionalGeneration"],
    "model_type": "gemma4",
    "audio_config": None,
    "tie_word_embeddings": True,
    "dtype": "bfloat16",
    "text_config": {
        "model_type": "gemma4_text",
        "attention_k_eq_v": True,
        "enable_moe_block": False,
        "final_logit_softcapping": 30.0,
        "global_head_dim": 512,
        "head_dim": 256,
        "hidden_activation": "gelu_pytorch_tanh",
        "hidden_size": 5376,
        "hidden_size_per_layer_input": 0,
        "intermediate_size": 21504,
        "layer_types": (["sliding_attention"] * 5 + ["full_attention"]) * 10,
        "max_position_embeddings": 262144,
        "num_attention_heads": 32,
        "num_global_key_value_heads": 4,
        "num_hidden_layers": 60,
        "num_key_value_heads": 16,
        "num_kv_shared_layers": 0,
        "rms_norm_eps": 1e-06,
        "rope_parameters": {
            "full_attention": {"partial_rotary_factor": 0.25, "rope_theta": 1000000.0, "rope_type": "proportional"},
            "sliding_attention": {"rope_theta": 10000.0, "rope_type": "default"},
        },
        "sliding_window": 1024,
        "tie_word_embeddings": True,
        "use_double_wide_mlp": False,
        "vocab_size": 262144,
        "vocab_size_per_layer_input": 262144,
    },
    "vision_config": {
        "model_type": "gemma4_vision",
        "head_dim": 72,
        "hidden_size": 1152,
        "intermediate_size": 4304,
        "num_attention_heads": 16,
        "num_hidden_layers": 27,
        "num_key_value_heads": 16,
        "patch_size": 16,
        "pooling_kernel_size": 3,
        "position_embedding_size": 10240,
        "rms_norm_eps": 1e-06,
        "rope_parameters": {"rope_theta": 100.0, "rope_type": "default"},
        "standardize": True,
    },
}

# allenai/OLMo-2-0325-32B's config.json.
OLMO2_32B = {
    "architectures": ["Olmo2ForCausalLM"],
    "model_type": "olmo2",
    "attention_bias": False,
    "attention_dropout": 0.0,
    "eos_token_id": 100257,
    "pad_token_id": 100277,
    "hidden_act": "silu",
    "hidden_size": 5120,
    "initializer_range": 0.02,
    "intermediate_size": 27648,
    "max_position_embeddings": 4096,
    "num_attention_heads": 40,
    "num_hidden_layers": 64,
    "num_key_value_heads": 8,
    "rms_norm_eps": 1e-06,
    "rope_scaling": None,
    "rope_theta": 500000,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "use_cache": True,
    "vocab_size": 100352,
}

# answerdotai/ModernBERT-large's config.json (ModernBertForMaskedLM, the decoder tied to the
# token embeddings; float32 on the Hub, a bfloat16 copy here).
MODERNBERT_LARGE = {
    "architectures": ["ModernBertForMaskedLM"],
    "model_type": "modernbert",
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 50281,
    "cls_token_id": 50281,
    "eos_token_id": 50282,
    "sep_token_id": 50282,
    "pad_token_id": 50283,
    "classifier_activation": "gelu",
    "classifier_bias": False,
    "classifier_pooling": "mean",
    "decoder_bias": True,
    "global_attn_every_n_layers": 3,
    "global_rope_theta": 160000.0,
    "hidden_activation": "gelu",
    "hidden_size": 1024,
    "initializer_range": 0.02,
    "intermediate_size": 2624,
    "local_attention": 128,
    "local_rope_theta": 10000.0,
    "max_position_embeddings": 8192,
    "mlp_bias": False,
    "norm_bias": False,
    "norm_eps": 1e-05,
    "num_attention_heads": 16,
    "num_hidden_layers": 28,
    "tie_word_embeddings": True,
    "torch_dtype": "float32",
    "vocab_size": 50368,
}

# FacebookAI/xlm-roberta-large's config.json (XLMRobertaForMaskedLM: `roberta.` and `lm_head.`,
# the decoder tied to the word embeddings; float32 on the Hub, a bfloat16 copy here).
XLM_R_LARGE = {
    "architectures": ["XLMRobertaForMaskedLM"],
    "model_type": "xlm-roberta",
    "attention_probs_dropout_prob": 0.1,
    "bos_token_id": 0,
    "eos_token_id": 2,
    "pad_token_id": 1,
    "hidden_act": "gelu",
    "hidden_dropout_prob": 0.1,
    "hidden_size": 1024,
    "initializer_range": 0.02,
    "intermediate_size": 4096,
    "layer_norm_eps": 1e-05,
    "max_position_embeddings": 514,
    "num_attention_heads": 16,
    "num_hidden_layers": 24,
    "position_embedding_type": "absolute",
    "type_vocab_size": 1,
    "vocab_size": 250002,
}

# facebook/dinov2-giant's config.json (float32 on the Hub, a bfloat16 copy here).
DINOV2_GIANT = {
    "architectures": ["Dinov2Model"],
    "model_type": "dinov2",
    "attention_probs_dropout_prob": 0.0,
    "drop_path_rate": 0.0,
    "hidden_act": "gelu",
    "hidden_dropout_prob": 0.0,
    "hidden_size": 1536,
    "image_size": 518,
    "initializer_range": 0.02,
    "layer_norm_eps": 1e-06,
    "layerscale_value": 1.0,
    "mlp_ratio": 4,
    "num_attention_heads": 24,
    "num_channels": 3,
    "num_hidden_layers": 40,
    "patch_size": 14,
    "qkv_bias": True,
    "use_swiglu_ffn": True,
}

# google/t5-v1_1-xxl's config.json, reconstructed from its published sizes (T5 v1.1: gated GELU,
# untied head), saved as its encoder alone (`T5EncoderModel`, as diffusion pipelines ship it:
# `shared.weight` and `encoder.*`).
T5_V1_1_XXL_ENCODER = {
    "architectures": ["T5EncoderModel"],
    "model_type": "t5",
    "d_ff": 10240,
    "d_kv": 64,
    "d_model": 4096,
    "decoder_start_token_id": 0,
    "dropout_rate": 0.1,
    "eos_token_id": 1,
    "feed_forward_proj": "gated-gelu",
    "initializer_factor": 1.0,
    "is_encoder_decoder": True,
    "layer_norm_epsilon": 1e-06,
    "num_decoder_layers": 24,
    "num_heads": 64,
    "num_layers": 24,
    "pad_token_id": 0,
    "relative_attention_max_distance": 128,
    "relative_attention_num_buckets": 32,
    "tie_word_embeddings": False,
    "vocab_size": 32128,
}

# google/umt5-xxl's config.json, reconstructed (UMT5: a relative position bias in every layer,
# gated GELU, untied head, the 256k multilingual vocabulary).
UMT5_XXL = {
    **T5_V1_1_XXL_ENCODER,  # T5-v1.1-XXL's sizes
    "architectures": ["UMT5ForConditionalGeneration"],
    "model_type": "umt5",
    "scalable_attention": True,
    "vocab_size": 256384,
}

# openai/whisper-large-v3's config.json, reconstructed (128 mel bins, the 51,866-token vocabulary;
# `proj_out` tied to the decoder's token embeddings, so not in the checkpoint).
WHISPER_LARGE_V3 = {
    "architectures": ["WhisperForConditionalGeneration"],
    "model_type": "whisper",
    "activation_function": "gelu",
    "bos_token_id": 50257,
    "d_model": 1280,
    "decoder_attention_heads": 20,
    "decoder_ffn_dim": 5120,
    "decoder_layers": 32,
    "decoder_start_token_id": 50258,
    "encoder_attention_heads": 20,
    "encoder_ffn_dim": 5120,
    "encoder_layers": 32,
    "eos_token_id": 50257,
    "max_source_positions": 1500,
    "max_target_positions": 448,
    "num_hidden_layers": 32,
    "num_mel_bins": 128,
    "pad_token_id": 50256,
    "scale_embedding": False,
    "tie_word_embeddings": True,
    "vocab_size": 51866,
}

# google/siglip2-so400m-patch14-384's config.json, reconstructed: the fixed-resolution SigLIP 2
# checkpoints are `SiglipModel`s (model_type siglip) with Gemma's 256k vocabulary; both towers
# are So400m (27 layers of 1152, 16 heads, MLP 4304), text sequences of 64.
SIGLIP2_SO400M_384 = {
    "architectures": ["SiglipModel"],
    "model_type": "siglip",
    "initializer_factor": 1.0,
    "text_config": {
        "model_type": "siglip_text_model",
        "hidden_size": 1152,
        "intermediate_size": 4304,
        "max_position_embeddings": 64,
        "num_attention_heads": 16,
        "num_hidden_layers": 27,
        "projection_size": 1152,
        "vocab_size": 256000,
    },
    "vision_config": {
        "model_type": "siglip_vision_model",
        "hidden_size": 1152,
        "image_size": 384,
        "intermediate_size": 4304,
        "num_attention_heads": 16,
        "num_hidden_layers": 27,
        "patch_size": 14,
    },
}

# google/siglip2-so400m-patch16-naflex's config.json, reconstructed: the variable-resolution
# `Siglip2Model` (model_type siglip2): the So400m towers, a Linear patch embedding of 16 x 16 x 3
# pixels and a 16 x 16 position table (num_patches 256) resized per image.
SIGLIP2_SO400M_NAFLEX = {
    "architectures": ["Siglip2Model"],
    "model_type": "siglip2",
    "initializer_factor": 1.0,
    "text_config": {**SIGLIP2_SO400M_384["text_config"], "model_type": "siglip2_text_model"},
    "vision_config": {
        "model_type": "siglip2_vision_model",
        "hidden_size": 1152,
        "intermediate_size": 4304,
        "num_attention_heads": 16,
        "num_hidden_layers": 27,
        "num_patches": 256,
        "patch_size": 16,
    },
}


# deepseek-ai/DeepSeek-V3.2-Exp's config.json: DeepSeek-V3's (sure: the same sizes, FP8 left out as
# above) and its sparse attention (sure: index_n_heads 64, index_head_dim 128, index_topk 2048).
DEEPSEEK_V32 = {
    **DEEPSEEK_V3,
    "architectures": ["DeepseekV32ForCausalLM"],
    "model_type": "deepseek_v32",
    "index_n_heads": 64,
    "index_head_dim": 128,
    "index_topk": 2048,
}

# zai-org/GLM-5's config.json, from memory, checked against GlmMoeDsaConfig's fields (whose defaults
# are these sizes). Sure: 78 layers + one MTP layer, hidden 6144, 64 heads, q/kv latents 2048/512,
# qk 192 + 64, v 256, 256 experts of 2048 (8 active, 1 shared), 3 dense layers of 12288, vocab
# 154880, the indexer's 32 heads of 128 and top 2048. Unsure: rope_theta (1e6), rms_norm_eps (1e-5),
# routed_scaling_factor (2.5), max_position_embeddings (202752): none changes a tensor's shape.
GLM5 = {
    "architectures": ["GlmMoeDsaForCausalLM"],
    "model_type": "glm_moe_dsa",
    "vocab_size": 154880,
    "hidden_size": 6144,
    "intermediate_size": 12288,
    "moe_intermediate_size": 2048,
    "num_hidden_layers": 78,
    "num_nextn_predict_layers": 1,
    "num_attention_heads": 64,
    "num_key_value_heads": 64,
    "n_shared_experts": 1,
    "n_routed_experts": 256,
    "routed_scaling_factor": 2.5,
    "kv_lora_rank": 512,
    "q_lora_rank": 2048,
    "qk_rope_head_dim": 64,
    "v_head_dim": 256,
    "qk_nope_head_dim": 192,
    "n_group": 1,
    "topk_group": 1,
    "num_experts_per_tok": 8,
    "first_k_dense_replace": 3,
    "norm_topk_prob": True,
    "hidden_act": "silu",
    "max_position_embeddings": 202752,
    "rms_norm_eps": 1e-05,
    "rope_theta": 1000000,
    "index_topk": 2048,
    "index_head_dim": 128,
    "index_n_heads": 32,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "attention_bias": False,
    "bos_token_id": 0,
    "eos_token_id": 1,
}

# MiniMaxAI/MiniMax-M2's config.json, without its FP8 `quantization_config` and `auto_map` (a
# bfloat16 copy). Sure: the sizes (hidden 3072, 62 layers, 48 heads, 8 kv heads, head_dim 128,
# 256 experts of 1536, 8 per token, vocab 200064), rotary_dim 64, rope_theta 5e6, use_qk_norm,
# qk_norm_type, scoring_func, use_routing_bias; from memory: attn_type_list (all 1), the MTP
# fields (transformers builds no MTP layer, and none is written here).
MINIMAX_M2 = {
    "architectures": ["MiniMaxM2ForCausalLM"],
    "model_type": "minimax_m2",
    "attn_type_list": [1] * 62,
    "head_dim": 128,
    "hidden_act": "silu",
    "hidden_size": 3072,
    "intermediate_size": 1536,
    "max_position_embeddings": 196608,
    "mtp_transformer_layers": 1,
    "num_attention_heads": 48,
    "num_experts_per_tok": 8,
    "num_hidden_layers": 62,
    "num_key_value_heads": 8,
    "num_local_experts": 256,
    "num_mtp_modules": 3,
    "qk_norm_type": "per_layer",
    "rms_norm_eps": 1e-06,
    "rope_theta": 5000000,
    "rotary_dim": 64,
    "scoring_func": "sigmoid",
    "shared_intermediate_size": 0,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "use_mtp": True,
    "use_qk_norm": True,
    "use_routing_bias": True,
    "vocab_size": 200064,
}

# moonshotai/Kimi-K2.5's config.json (Kimi_K25ForConditionalGeneration: DeepSeek-V3's text model
# under `text_config`, a MoonViT vision tower and its projector), a bfloat16 copy: the Hub's
# routed experts are INT4 (compressed-tensors), its `quantization_config` left out. Sure: Kimi K2's
# text sizes (hidden 7168, 61 layers, the first dense, 64 heads, q/kv latents 1536/512, qk 128 + 64,
# v 128, 384 experts of 2048, 8 per token, one shared, one expert group, vocab 163840, untied head).
# From memory: routed_scaling_factor 2.827, rope_theta 50000, the YaRN factor 64 over 4096,
# max_position_embeddings 262144, the token ids; the vision tower and projector are transformers'
# Kimi_K25 defaults (1152 wide, 27 layers; none of them is read). No MTP layer is written.
KIMI_K25 = {
    "architectures": ["Kimi_K25ForConditionalGeneration"],
    "model_type": "kimi_k25",
    "text_config": {
        "model_type": "deepseek_v3",
        "vocab_size": 163840,
        "hidden_size": 7168,
        "intermediate_size": 18432,
        "moe_intermediate_size": 2048,
        "num_hidden_layers": 61,
        "num_nextn_predict_layers": 0,
        "num_attention_heads": 64,
        "num_key_value_heads": 64,
        "n_shared_experts": 1,
        "n_routed_experts": 384,
        "routed_scaling_factor": 2.827,
        "kv_lora_rank": 512,
        "q_lora_rank": 1536,
        "qk_rope_head_dim": 64,
        "v_head_dim": 128,
        "qk_nope_head_dim": 128,
        "topk_method": "noaux_tc",
        "n_group": 1,
        "topk_group": 1,
        "num_experts_per_tok": 8,
        "first_k_dense_replace": 1,
        "norm_topk_prob": True,
        "scoring_func": "sigmoid",
        "hidden_act": "silu",
        "max_position_embeddings": 262144,
        "rms_norm_eps": 1e-05,
        "rope_parameters": {
            "rope_type": "yarn",
            "rope_theta": 50000.0,
            "factor": 64.0,
            "original_max_position_embeddings": 4096,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
        },
        "tie_word_embeddings": False,
        "attention_bias": False,
        "bos_token_id": 163584,
        "eos_token_id": 163585,
    },
    "vision_config": {"model_type": "kimi_k25_vision"},
    "tie_word_embeddings": False,
    "dtype": "bfloat16",
}


# Mistral Large 4 (transformers' `mistral_large4`, MistralLarge4ForConditionalGeneration: the class
# transformers ships for the Mistral Large line's DeepSeek-sparse-attention checkpoints). Sure: the
# sizes are MistralLarge4TextConfig's defaults, which its docstring gives for
# mistralai/Mistral-Large-4-1T-A52B (72 layers, hidden 6144, 64 heads, 128 experts top 4 of 6144,
# one shared, the first layer dense, kv_lora_rank 512, indexer 32 heads of 128 keeping 2048, vocab
# 204800), and the Pixtral tower MistralLarge4Config builds by default. Not sure: that a Hub
# checkpoint ships these exact values (Mistral-Large-3-675B-Instruct-2512's own config.json, a
# DeepSeek-V3 text model with a q_lora_rank, is not this class). Every 4th layer NoPE, as the
# default config makes it.
MISTRAL_LARGE4 = {
    "architectures": ["MistralLarge4ForConditionalGeneration"],
    "model_type": "mistral_large4",
    "text_config": {"model_type": "mistral_large4_text"},
    "tie_word_embeddings": False,
    "dtype": "bfloat16",
}

# ---------------------------------------------------------------------------- the Hub's key layouts


def transformers_model(config: dict):
    """The model of config.json `config` as transformers builds it (class `architectures[0]`,
    randomly initialised, on torch's default device: `with torch.device("meta")` for shapes only)."""
    import transformers

    transformers.logging.set_verbosity_error()
    fields = {k: v for k, v in config.items() if k != "model_type"}
    hf_config = transformers.AutoConfig.for_model(config["model_type"], **fields)
    model_class = getattr(transformers, config["architectures"][0])
    if not (isinstance(model_class, type) and issubclass(model_class, transformers.PreTrainedModel)):
        raise ValueError(f"architectures[0] {config['architectures'][0]!r} is not a transformers model class")
    return model_class(hf_config)


def transformers_shapes(config: dict) -> dict[str, list[int]]:
    """Every tensor of `config`'s model as the Hub holds it, and its shape, from transformers itself.

    The class `config["architectures"][0]` is built on the meta device (shapes, no memory); its
    state dict loses what `save_pretrained` drops (a tied weight: the key its `_tied_weights_keys`
    name, e.g. `lm_head.weight` beside `embed_tokens.weight`) and gets back the layout transformers
    converts on load (per-expert keys its MoE classes fuse, the multimodal prefixes such as
    `language_model.model.` and `vision_tower.vision_model.`): its conversion mapping reverted as
    for a model loaded from such a checkpoint. A new model needs only its config.json."""
    import torch
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import revert_weight_conversion
    from transformers.modeling_utils import remove_tied_weights_from_state_dict

    with torch.device("meta"):
        model = transformers_model(config)
    model._weight_conversions = get_model_conversion_mapping(model, add_legacy=False)  # pyright: ignore[reportArgumentType]
    state = remove_tied_weights_from_state_dict(model.state_dict(), model)
    return {key: list(tensor.shape) for key, tensor in revert_weight_conversion(model, state).items()}


def _experts(shapes, prefix, count, inner, hidden):
    """Per-expert SwiGLU keys `{prefix}{e}.gate_proj.weight` ... (Qwen-MoE, DeepSeek layout)."""
    for e in range(count):
        shapes.update(
            {
                f"{prefix}{e}.gate_proj.weight": [inner, hidden],
                f"{prefix}{e}.up_proj.weight": [inner, hidden],
                f"{prefix}{e}.down_proj.weight": [hidden, inner],
            }
        )


def deepseek_v3_shapes(c):
    """Every tensor of DeepSeek-V3 (bfloat16) and its shape, the MTP layer `model.layers.61.*` after the last."""
    h, v, heads = c["hidden_size"], c["vocab_size"], c["num_attention_heads"]
    qk, rope, kv = c["qk_nope_head_dim"] + c["qk_rope_head_dim"], c["qk_rope_head_dim"], c["kv_lora_rank"]
    inter, moe, experts = c["intermediate_size"], c["moe_intermediate_size"], c["n_routed_experts"]
    shapes = {"model.embed_tokens.weight": [v, h]}
    layers = c["num_hidden_layers"]
    for i in range(layers + c["num_nextn_predict_layers"]):
        p = f"model.layers.{i}."
        if i >= layers:  # the multi-token-prediction layer's own tensors
            shapes.update(
                {
                    p + "embed_tokens.weight": [v, h],
                    p + "enorm.weight": [h],
                    p + "hnorm.weight": [h],
                    p + "eh_proj.weight": [h, 2 * h],
                }
            )
        shapes.update(
            {
                p + "input_layernorm.weight": [h],
                p + "post_attention_layernorm.weight": [h],
                p + "self_attn.q_a_proj.weight": [c["q_lora_rank"], h],
                p + "self_attn.q_a_layernorm.weight": [c["q_lora_rank"]],
                p + "self_attn.q_b_proj.weight": [heads * qk, c["q_lora_rank"]],
                p + "self_attn.kv_a_proj_with_mqa.weight": [kv + rope, h],
                p + "self_attn.kv_a_layernorm.weight": [kv],
                p + "self_attn.kv_b_proj.weight": [heads * (c["qk_nope_head_dim"] + c["v_head_dim"]), kv],
                p + "self_attn.o_proj.weight": [h, heads * c["v_head_dim"]],
            }
        )
        if i < c["first_k_dense_replace"]:
            shapes.update(
                {
                    p + "mlp.gate_proj.weight": [inter, h],
                    p + "mlp.up_proj.weight": [inter, h],
                    p + "mlp.down_proj.weight": [h, inter],
                }
            )
        else:
            shapes.update({p + "mlp.gate.weight": [experts, h], p + "mlp.gate.e_score_correction_bias": [experts]})
            _experts(shapes, p + "mlp.experts.", experts, moe, h)
            n = moe * c["n_shared_experts"]
            shapes.update(
                {
                    p + "mlp.shared_experts.gate_proj.weight": [n, h],
                    p + "mlp.shared_experts.up_proj.weight": [n, h],
                    p + "mlp.shared_experts.down_proj.weight": [h, n],
                }
            )
        if i >= layers:
            shapes.update({p + "shared_head.norm.weight": [h], p + "shared_head.head.weight": [v, h]})
    shapes.update({"model.norm.weight": [h], "lm_head.weight": [v, h]})
    return shapes


BLOCK = 128
UNQUANTIZED = ("embed_tokens.weight", "lm_head.weight", "shared_head.head.weight", "mlp.gate.weight")
"""DeepSeek-V3's 2-D weights its FP8 checkpoint keeps in bfloat16: embeddings, heads, the routers' gates."""


def kimi_k25_shapes(c):
    """Kimi K2.5's tensors as the Hub holds them: transformers' (`transformers_shapes`), whose
    reverted `blocks` -> `layers` rename (meant for the vision tower's `vision_tower.encoder.blocks`)
    also turns the language model's layers into `blocks`; the Hub keeps DeepSeek-V3's `layers`."""
    old, new = "language_model.model.blocks.", "language_model.model.layers."
    return {(new + k[len(old) :] if k.startswith(old) else k): s for k, s in transformers_shapes(c).items()}


def deepseek_v3_fp8_shapes(c):
    """DeepSeek-V3's tensors as its FP8 checkpoint holds them, each (dtype, shape): every 2-D weight
    but the embeddings, heads and gates in F8_E4M3 with its F32 `weight_scale_inv` (a scale per
    128x128 block) after it, `e_score_correction_bias` F32, the rest BF16."""
    shapes = {}
    for key, shape in deepseek_v3_shapes(c).items():
        if len(shape) != 2 or key.endswith(UNQUANTIZED):
            shapes[key] = ("F32" if key.endswith("e_score_correction_bias") else "BF16", shape)
            continue
        shapes[key] = ("F8_E4M3", shape)
        shapes[key + "_scale_inv"] = ("F32", [-(-n // BLOCK) for n in shape])
    return shapes


def deepseek_v32_shapes(c):
    """DeepSeek-V3's tensors (`deepseek_v3_shapes`, the MTP layer included) and each layer's
    lightning indexer: `wq_b`, `wk`, `k_norm` (weight and bias), `weights_proj`."""
    shapes = deepseek_v3_shapes(c)
    h, heads, dim = c["hidden_size"], c["index_n_heads"], c["index_head_dim"]
    for i in range(c["num_hidden_layers"] + c["num_nextn_predict_layers"]):
        p = f"model.layers.{i}.self_attn.indexer."
        shapes.update(
            {
                p + "wq_b.weight": [heads * dim, c["q_lora_rank"]],
                p + "wk.weight": [dim, h],
                p + "k_norm.weight": [dim],
                p + "k_norm.bias": [dim],
                p + "weights_proj.weight": [heads, h],
            }
        )
    return shapes


def qwen3_next_shapes(c):
    """Every tensor of Qwen3-Next and its shape, with the Hub's multi-token-prediction layer `mtp.*`."""
    h, v = c["hidden_size"], c["vocab_size"]
    hd, heads, kv = c["head_dim"], c["num_attention_heads"], c["num_key_value_heads"]
    nk, nv = c["linear_num_key_heads"], c["linear_num_value_heads"]
    dk, dv = c["linear_key_head_dim"], c["linear_value_head_dim"]
    inter, shared, experts = c["moe_intermediate_size"], c["shared_expert_intermediate_size"], c["num_experts"]

    def layer(shapes, p, full):
        shapes.update({p + "input_layernorm.weight": [h], p + "post_attention_layernorm.weight": [h]})
        if full:
            a = p + "self_attn."
            shapes.update(
                {
                    a + "q_proj.weight": [2 * heads * hd, h],
                    a + "k_proj.weight": [kv * hd, h],
                    a + "v_proj.weight": [kv * hd, h],
                    a + "o_proj.weight": [h, heads * hd],
                    a + "q_norm.weight": [hd],
                    a + "k_norm.weight": [hd],
                }
            )
        else:
            a = p + "linear_attn."
            shapes.update(
                {
                    a + "in_proj_qkvz.weight": [2 * nk * dk + 2 * nv * dv, h],
                    a + "in_proj_ba.weight": [2 * nv, h],
                    a + "conv1d.weight": [2 * nk * dk + nv * dv, 1, c["linear_conv_kernel_dim"]],
                    a + "dt_bias": [nv],
                    a + "A_log": [nv],
                    a + "norm.weight": [dv],
                    a + "out_proj.weight": [h, nv * dv],
                }
            )
        m = p + "mlp."
        shapes.update(
            {
                m + "gate.weight": [experts, h],
                m + "shared_expert_gate.weight": [1, h],
                m + "shared_expert.gate_proj.weight": [shared, h],
                m + "shared_expert.up_proj.weight": [shared, h],
                m + "shared_expert.down_proj.weight": [h, shared],
            }
        )
        _experts(shapes, m + "experts.", experts, inter, h)

    shapes = {"model.embed_tokens.weight": [v, h]}
    for i in range(c["num_hidden_layers"]):
        layer(shapes, f"model.layers.{i}.", (i + 1) % c["full_attention_interval"] == 0)
    shapes.update({"model.norm.weight": [h], "lm_head.weight": [v, h]})
    shapes.update(
        {
            "mtp.fc.weight": [h, 2 * h],
            "mtp.norm.weight": [h],
            "mtp.pre_fc_norm_embedding.weight": [h],
            "mtp.pre_fc_norm_hidden.weight": [h],
        }
    )
    layer(shapes, "mtp.layers.0.", True)
    return shapes


# zai-org/GLM-4.6's config.json (a bfloat16 checkpoint). Sure: hidden 5120, 92 layers, 96 heads of
# head_dim 128, 8 kv heads, 160 experts of 1536, 8 per token, one shared expert, the first 3 layers
# dense (intermediate 12288), partial_rotary_factor 0.5, use_qk_norm, attention_bias, vocab 151552,
# one MTP layer (`model.layers.92.*`); from memory: routed_scaling_factor 2.5, rope_theta 1e6,
# max_position_embeddings 202752, one expert group, the token ids.
GLM_4_6 = {
    "architectures": ["Glm4MoeForCausalLM"],
    "model_type": "glm4_moe",
    "attention_bias": True,
    "eos_token_id": [151329, 151336, 151338],
    "first_k_dense_replace": 3,
    "head_dim": 128,
    "hidden_act": "silu",
    "hidden_size": 5120,
    "intermediate_size": 12288,
    "max_position_embeddings": 202752,
    "moe_intermediate_size": 1536,
    "n_group": 1,
    "n_routed_experts": 160,
    "n_shared_experts": 1,
    "norm_topk_prob": True,
    "num_attention_heads": 96,
    "num_experts_per_tok": 8,
    "num_hidden_layers": 92,
    "num_key_value_heads": 8,
    "num_nextn_predict_layers": 1,
    "pad_token_id": 151329,
    "partial_rotary_factor": 0.5,
    "rms_norm_eps": 1e-05,
    "rope_scaling": None,
    "rope_theta": 1000000,
    "routed_scaling_factor": 2.5,
    "tie_word_embeddings": False,
    "topk_group": 1,
    "torch_dtype": "bfloat16",
    "use_qk_norm": True,
    "vocab_size": 151552,
}


def glm4_moe_shapes(c):
    """GLM-4.5/4.6's tensors: transformers' (`transformers_shapes`), and the MTP layer the Hub stores
    after the last (`model.layers.{num_hidden_layers}.*`: a copy of a MoE layer, with `enorm`, `hnorm`,
    `eh_proj` and `shared_head.norm`), which transformers does not build."""
    shapes = transformers_shapes(c)
    last, mtp, h = c["num_hidden_layers"] - 1, c["num_hidden_layers"], c["hidden_size"]
    old, new = f"model.layers.{last}.", f"model.layers.{mtp}."
    shapes.update({new + k[len(old) :]: s for k, s in shapes.items() if k.startswith(old)})
    shapes.update({new + k: [h] for k in ("enorm.weight", "hnorm.weight", "shared_head.norm.weight")})
    shapes[new + "eh_proj.weight"] = [h, 2 * h]
    return shapes


# DeepSeek-V4's largest, V4-Pro, as transformers' DeepseekV4Config describes it: sure (its docstring)
# of hidden_size 7168, 128 heads of 512, o_groups 16 of o_lora_rank 1024, and of the V4 family's
# shared values (one key/value head, 64 of 512 rotated, sliding window 128, compress rates 4 / 128,
# 4 hyper-connection streams, 20 Sinkhorn iterations, 6 experts a token, 3 hash-routed layers,
# sqrtsoftplus scoring, SwiGLU limit 10, indexer 64 heads of 128); not sure of 61 layers, 384 experts
# of 3072, q_lora_rank 1536 and index_topk 1024 (from memory of the release: 1.6T parameters, which
# these give), nor of its layer schedule (transformers' default: two HCA layers, then HCA and CSA
# in turn). A bfloat16 copy; the hash tables int64 as transformers writes them.
DEEPSEEK_V4_PRO = {
    "architectures": ["DeepseekV4ForCausalLM"],
    "model_type": "deepseek_v4",
    "vocab_size": 129280,
    "hidden_size": 7168,
    "moe_intermediate_size": 3072,
    "num_hidden_layers": 61,
    "num_attention_heads": 128,
    "num_key_value_heads": 1,
    "head_dim": 512,
    "q_lora_rank": 1536,
    "partial_rotary_factor": 0.125,
    "n_routed_experts": 384,
    "num_experts_per_tok": 6,
    "n_shared_experts": 1,
    "scoring_func": "sqrtsoftplus",
    "routed_scaling_factor": 2.5,
    "o_groups": 16,
    "o_lora_rank": 1024,
    "index_n_heads": 64,
    "index_head_dim": 128,
    "index_topk": 1024,
    "sliding_window": 128,
    "compress_rates": {"compressed_sparse_attention": 4, "heavily_compressed_attention": 128},
    "hc_mult": 4,
    "hc_sinkhorn_iters": 20,
    "swiglu_limit": 10.0,
    "max_position_embeddings": 1048576,
    "rope_theta": 10000.0,
    "compress_rope_theta": 160000.0,
    "rope_parameters": {"rope_type": "yarn", "factor": 16.0, "original_max_position_embeddings": 65536},
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
}


def deepseek_v4_shapes(c):
    """transformers' tensors of DeepSeek-V4 (`transformers_shapes`), its hash tables `gate.tid2eid` int64."""
    shapes = transformers_shapes(c)
    return {k: ("I64", s) if k.endswith(".tid2eid") else s for k, s in shapes.items()}


def untied_t5_shapes(c):
    """transformers' tensors of a T5-family encoder-decoder (`transformers_shapes`) and the untied
    `lm_head.weight` the Hub's T5 v1.1 / mT5 / UMT5 checkpoints hold: transformers 5 ties the head to
    `shared` whatever `tie_word_embeddings` says, so its state dict drops the head."""
    return transformers_shapes(c) | {"lm_head.weight": [c["vocab_size"], c["d_model"]]}


def fresh_shapes(config: dict) -> dict[str, list[int]]:
    """The tensors `save_pretrained` writes for a freshly built model (no conversion to revert): for a
    dual model (SiglipModel) whose conversion mapping only renames standalone towers' checkpoints
    (`PrefixChange` of `text_model.`), which `transformers_shapes`' revert would wrongly apply."""
    import torch
    from transformers.modeling_utils import remove_tied_weights_from_state_dict

    with torch.device("meta"):
        model = transformers_model(config)
    state = remove_tied_weights_from_state_dict(model.state_dict(), model)
    return {key: list(tensor.shape) for key, tensor in state.items()}


# name: (what, config.json, its tensors, mesh, shard files as on the Hub; None: at most 5 GB each,
# and one file named model.safetensors, without an index, as `save_pretrained` writes it)
MODELS = {
    "deepseek-v3": ("DeepSeek-V3 671B", DEEPSEEK_V3, deepseek_v3_shapes, "32x16", 163),
    "deepseek-v3-fp8": ("DeepSeek-V3 671B FP8", DEEPSEEK_V3_FP8, deepseek_v3_fp8_shapes, "32x16", 163),
    "deepseek-v32": ("DeepSeek-V3.2-Exp 685B", DEEPSEEK_V32, deepseek_v32_shapes, "32x16", 163),
    "glm5": ("GLM-5", GLM5, deepseek_v32_shapes, "32x16", None),
    "qwen3-235b": ("Qwen3-235B-A22B", QWEN3_235B, transformers_shapes, "8x8", 118),
    "gpt-oss-120b": ("gpt-oss-120b (bf16)", GPT_OSS_120B, transformers_shapes, "8x8", None),
    "llama4-scout": ("Llama-4-Scout-17B-16E", SCOUT, transformers_shapes, "8x8", 50),
    "qwen3-next": ("Qwen3-Next-80B-A3B", QWEN3_NEXT_80B, qwen3_next_shapes, "8x8", 41),
    "gemma3-27b": ("Gemma-3-27B-it", GEMMA3_27B, transformers_shapes, "8x8", 12),
    "gemma4-31b": ("Gemma-4-31B-it", GEMMA4_31B, transformers_shapes, "8x8", None),
    "olmo2-32b": ("OLMo-2-0325-32B", OLMO2_32B, transformers_shapes, "8x8", None),
    "minimax-m2": ("MiniMax-M2 230B", MINIMAX_M2, transformers_shapes, "32x16", None),
    "glm4.6": ("GLM-4.6 355B", GLM_4_6, glm4_moe_shapes, "32x16", None),
    "kimi-k25": ("Kimi-K2.5 (bf16)", KIMI_K25, kimi_k25_shapes, "32x16", None),
    "deepseek-v4-pro": ("DeepSeek-V4-Pro (bf16)", DEEPSEEK_V4_PRO, deepseek_v4_shapes, "32x16", None),
    "mistral-large4": ("Mistral-Large-4-1T-A52B", MISTRAL_LARGE4, transformers_shapes, "32x16", None),
    "modernbert-large": ("ModernBERT-large", MODERNBERT_LARGE, transformers_shapes, "2x2", None),
    "xlm-roberta-large": ("XLM-RoBERTa-large", XLM_R_LARGE, transformers_shapes, "2x2", None),
    "dinov2-giant": ("DINOv2-giant", DINOV2_GIANT, transformers_shapes, "2x2", None),
    "t5-xxl-encoder": ("T5-v1.1-XXL encoder", T5_V1_1_XXL_ENCODER, transformers_shapes, "4x2", None),
    "umt5-xxl": ("UMT5-XXL", UMT5_XXL, untied_t5_shapes, "4x2", None),
    "whisper-large-v3": ("Whisper-large-v3", WHISPER_LARGE_V3, transformers_shapes, "2x2", None),
    "siglip2-so400m": ("SigLIP 2 So400m/14-384", SIGLIP2_SO400M_384, fresh_shapes, "2x2", None),
    "siglip2-so400m-naflex": ("SigLIP 2 So400m/16 NaFlex", SIGLIP2_SO400M_NAFLEX, fresh_shapes, "2x2", None),
}
QUICK = "qwen3-235b"


# ---------------------------------------------------------------------------- the sparse checkpoint


ITEMSIZE = {"BF16": 2, "F32": 4, "F8_E4M3": 1, "I64": 8}


def write_sparse_checkpoint(directory: Path, config: dict, shapes: dict, shards: int | None) -> tuple[int, int]:
    """config.json, `shards` safetensors files (consecutive keys, about equal bytes; None: at most
    5 GB each) whose data is a hole, and model.safetensors.index.json (one file: model.safetensors,
    no index). -> (bytes, files). Each key's tensor is of its shape in `shapes`, bfloat16, or of
    (dtype, shape)."""
    directory.mkdir(parents=True)
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    typed = {key: entry if isinstance(entry[0], str) else ("BF16", entry) for key, entry in shapes.items()}
    sizes = {key: ITEMSIZE[dtype] * math.prod(shape) for key, (dtype, shape) in typed.items()}
    total = sum(sizes.values())
    shards = shards or max(1, math.ceil(total / 5e9))
    groups: list[list[str]] = [[] for _ in range(shards)]
    done = 0
    for key, n in sizes.items():  # a key goes to the shard its first byte falls in
        groups[min(shards - 1, done * shards // total)].append(key)
        done += n
    groups = [g for g in groups if g]
    width = 6 if len(groups) > 99 and config["model_type"] == "deepseek_v3" else 5  # DeepSeek's -of-000163
    weight_map, on_disk = {}, 0
    for number, keys in enumerate(groups, 1):
        name = f"model-{number:05d}-of-{len(groups):0{width}d}.safetensors" if len(groups) > 1 else "model.safetensors"
        header, offset = {"__metadata__": {"format": "pt"}}, 0
        for key in keys:
            dtype, shape = typed[key]
            header[key] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + sizes[key]]}
            offset += sizes[key]
            weight_map[key] = name
        text = json.dumps(header, separators=(",", ":")).encode()
        text += b" " * (-len(text) % 8)
        path = directory / name
        path.write_bytes(struct.pack("<Q", len(text)) + text)
        os.truncate(path, 8 + len(text) + offset)
        on_disk += 8 + len(text) + offset
    if len(groups) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (directory / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    return on_disk, len(groups)


# ---------------------------------------------------------------------------- one run, in a fresh wrapper


def _status(pid: int) -> dict[str, int]:
    """RssAnon, VmRSS and VmHWM of `pid` in bytes ({} once it has gone)."""
    out = {}
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                name, _, value = line.partition(":")
                if name in ("RssAnon", "VmRSS", "VmHWM"):
                    out[name] = int(value.split()[0]) * 1024
    except (OSError, ValueError):
        return {}
    return out


def _children(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(p) for p in f.read().split()]
    except OSError:
        return []


def measure(spec: dict) -> dict:
    """Run `port plan` once; runs in a fresh process, so RUSAGE_CHILDREN covers only this run."""
    command = [sys.executable, "-m", "port", "plan", spec["dir"], "--mesh", spec["mesh"], *spec.get("args", [])]
    peaks = {"worker": 0, "anon": 0, "hwm": 0, "supervisor_anon": 0}
    finished = threading.Event()
    start = time.perf_counter()
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def sample():  # a thread: the wrapper runs no Python of its own meanwhile (communicate waits)
        worker = None
        while not finished.wait(0.002):
            peaks["supervisor_anon"] = max(peaks["supervisor_anon"], _status(process.pid).get("RssAnon", 0))
            if worker is None:
                found = _children(process.pid)
                worker = found[0] if found else None
                peaks["worker"] = worker or 0
                continue
            status = _status(worker)
            if status:
                peaks["anon"] = max(peaks["anon"], status.get("RssAnon", 0))
                peaks["hwm"] = max(peaks["hwm"], status.get("VmHWM", 0))

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    out, err = process.communicate()
    seconds = time.perf_counter() - start
    finished.set()
    sampler.join()
    if process.returncode != 0:
        return {
            "error": (err.strip().splitlines() or [f"exit {process.returncode}"])[-1][:300],
            "returncode": process.returncode,
            "seconds": seconds,
        }
    last = out.strip().splitlines()[-1]
    found = re.search(
        r"^([\d.]+[KMB]?) params in \d+ leaves; ([\d.]+ [KMGT]?B) to read, ([\d.]+ [KMGT]?B) per device", last
    )
    return {
        "seconds": seconds,
        "maxrss": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024,
        "anon": peaks["anon"],
        "hwm": peaks["hwm"],
        "supervisor_anon": peaks["supervisor_anon"],
        "worker_seen": bool(peaks["worker"]),
        "last": last,
        "params": found.group(1) if found else "?",
        "read": found.group(2) if found else "?",
        "per_device": found.group(3) if found else "?",
        "stderr": err.strip()[-300:],
    }


def stages(spec: dict) -> dict:
    """The memory of `port plan`'s work stage by stage (VmHWM and RssAnon after each), in this fresh process."""
    out, clock = [], [time.perf_counter()]

    def mark(what: str) -> None:
        now = _status(os.getpid())
        out.append([what, now["VmHWM"], now["RssAnon"], time.perf_counter() - clock[0]])
        clock[0] = time.perf_counter()

    mark("interpreter")
    import equinox  # noqa: F401
    import jax  # noqa: F401

    mark("import jax, equinox")
    import port
    import port._cli
    import port._commands
    import port.authoring

    mark("import port")
    with port.open_checkpoint(spec["dir"]) as ckpt:
        mark("headers (open_checkpoint)")
        mapping = port.mapping_for(ckpt.config)
        port.skeleton(mapping, ckpt.config)
        mark("mapping + skeleton")
        recipe = port.authoring.check(mapping, ckpt, spec["mesh"], None)
        mark("plan (authoring.check)")
    port._commands.plan_text(recipe, [], 80)
    mark("plan_text")
    return {"stages": out}


# ---------------------------------------------------------------------------- the table


def mib(n: float) -> str:
    return f"{n / 2**20:,.0f} MiB" if n else "-"


def bench(name: str, repeats: int, root: Path, meshes: list[str] | None = None) -> list[list[str]]:
    """Write model `name`'s sparse checkpoint under `root`, plan it `repeats` times on each of
    `meshes` (default: the model's own): a table row per mesh."""
    what, config, shapes_of, own, shards = MODELS[name]
    shapes = shapes_of(config)
    directory = root / name
    clock = time.perf_counter()
    size, files = write_sparse_checkpoint(directory, config, shapes, shards)
    print(
        f"{what}: wrote {len(shapes):,} tensors in {files} sparse files ({size / 1e12:.2f} TB apparent) "
        f"in {time.perf_counter() - clock:.1f} s",
        file=sys.stderr,
        flush=True,
    )
    return [row_of(what, directory, mesh, repeats, len(shapes), size, files) for mesh in meshes or [own]]


def row_of(what: str, directory: Path, mesh: str, repeats: int, tensors: int, size: int, files: int) -> list[str]:
    """The table row of `repeats` runs of `port plan` of `directory` on `mesh`."""
    runs = []
    for _ in range(repeats):
        result = _measure.isolated(__file__, {"dir": str(directory), "mesh": mesh}, timeout=600)
        if isinstance(result, str):
            result = {"error": result}
        runs.append(result)
        shown = result.get("error") or (
            f"{result['seconds']:.2f} s, maxrss {mib(result['maxrss'])}, RssAnon {mib(result['anon'])}"
        )
        print(f"  {what} on {mesh}: {shown}", file=sys.stderr, flush=True)
    good = [r for r in runs if "error" not in r]
    if not good:
        return [what, mesh, f"{tensors:,}", f"{files}", f"FAILED: {runs[-1]['error']}"]
    best = min(good, key=lambda r: r["seconds"])
    row = [
        what,
        mesh,
        f"{tensors:,}",
        f"{files}",
        f"{size / 1e9:,.0f} GB",
        f"{best['seconds']:.2f}",
        mib(max(r["maxrss"] for r in good)),
        mib(max(r["anon"] for r in good)),
        best["params"],
        best["read"],
        best["per_device"],
    ]
    if len(good) < len(runs):
        row[-1] += f" ({len(runs) - len(good)} of {len(runs)} runs failed: {runs[-1].get('error')})"
    return row


def breakdown(name: str, root: Path) -> str:
    what, _, _, mesh, _ = MODELS[name]
    result = _measure.isolated(__file__, {"dir": str(root / name), "mesh": mesh, "stages": True}, timeout=600)
    if isinstance(result, str):
        return f"{what}: breakdown failed: {result}"
    rows = [[stage, mib(hwm), mib(anon), f"{seconds:.2f}"] for stage, hwm, anon, seconds in result["stages"]]
    return f"#### {what} on {mesh}, stage by stage (one process)\n\n" + _measure.markdown(
        ["after", "VmHWM (peak RSS so far)", "RssAnon", "seconds"], rows
    )


HEADER = [
    "model",
    "mesh",
    "tensors",
    "files",
    "checkpoint (sparse)",
    "seconds (best)",
    "peak RSS (maxrss)",
    "peak RssAnon (worker)",
    "plan: params",
    "plan: to read",
    "plan: per device",
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(MODELS), help="comma-separated, of: " + ", ".join(MODELS))
    parser.add_argument("--meshes", help="comma-separated meshes (8x8,32x16): each model on each (default: its own)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help=f"{QUICK} once: a smoke check")
    parser.add_argument("--keep", type=Path, help="write the checkpoints here (kept) instead of a temp dir")
    parser.add_argument("--breakdown", action="store_true", help="also the memory stage by stage, per model")
    parser.add_argument("--out", type=Path, help="also write the table as Markdown here")
    parser.add_argument("--measure", help=argparse.SUPPRESS)  # one run, in the wrapper process
    args = parser.parse_args()
    if args.measure:
        spec = json.loads(args.measure)
        print(json.dumps(stages(spec) if spec.get("stages") else measure(spec)))
        return
    names = [QUICK] if args.quick else [n.strip() for n in args.models.split(",") if n.strip()]
    unknown = [n for n in names if n not in MODELS]
    if unknown:
        parser.error(f"unknown model {unknown[0]!r}: one of {', '.join(MODELS)}")
    repeats = 1 if args.quick else args.repeats
    meshes = [m.strip() for m in args.meshes.split(",") if m.strip()] if args.meshes else None
    rows, stage_tables = [], []
    with tempfile.TemporaryDirectory(prefix="port-plan-bench-") as temp:
        root = args.keep or Path(temp)
        for name in names:
            rows += bench(name, repeats, root, meshes)
            if args.breakdown:
                stage_tables.append(breakdown(name, root))
    title = f"`port plan` from sparse checkpoints, best of {repeats} (seconds), largest of {repeats} (memory)"
    section = "\n\n".join([f"### {title}\n\n" + _measure.markdown(HEADER, rows), *stage_tables])
    print(section)
    if args.out:
        notes = [
            (
                "Each run is `python -m port plan DIR --mesh M` in a fresh wrapper process: maxrss is "
                "`getrusage(RUSAGE_CHILDREN)` there (the worker's peak RSS, shared libraries included), "
                "RssAnon the worker's anonymous memory sampled every 2 ms."
            )
        ]
        _measure.write(args.out, "Planning the largest open models", "plan.py", [section], notes)


if __name__ == "__main__":
    main()
