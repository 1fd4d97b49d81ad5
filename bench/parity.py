"""Measure output parity of port's models against `transformers`, per family and mesh.

    python bench/parity.py [--cases gpt2,llama-gqa,...] [--meshes 1x1,2x2,4x2,8x1] [--gpt2-small]

Each case writes a random-init checkpoint with `transformers` (float32) into a
temporary directory and runs `port.verify` on it: convert onto the mesh, run the
jitted JAX model and the PyTorch model on the same random token ids [2, 16], and
take the largest absolute difference of the logits (the last hidden state for BERT
and ViT, whose inputs are random pixel values [2, channels, height, width]).
"""

import argparse
import tempfile

import jax

jax.config.update("jax_num_cpu_devices", 8)

import torch  # noqa: E402
import transformers  # noqa: E402

import port  # noqa: E402

SMALL = dict(initializer_range=0.2, bos_token_id=0, eos_token_id=0)
LLAMA = dict(vocab_size=101, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, **SMALL)
LLAMA3 = dict(rope_type="llama3", rope_theta=10000.0, factor=8.0, low_freq_factor=1.0,
              high_freq_factor=4.0, original_max_position_embeddings=8)
NEOX = dict(vocab_size=101, hidden_size=60, intermediate_size=120, num_hidden_layers=2, num_attention_heads=5,
            max_position_embeddings=64, **SMALL)
CASES = {
    "gpt2": (transformers.GPT2LMHeadModel, transformers.GPT2Config,
             dict(vocab_size=101, n_positions=32, n_embd=64, n_layer=2, n_head=4, **SMALL)),
    "gpt2-small-124M": (transformers.GPT2LMHeadModel, transformers.GPT2Config, dict(bos_token_id=0, eos_token_id=0)),
    "llama-gqa-untied": (transformers.LlamaForCausalLM, transformers.LlamaConfig, LLAMA),
    "llama-tied-llama3-rope": (transformers.LlamaForCausalLM, transformers.LlamaConfig,
                               dict(LLAMA, tie_word_embeddings=True, rope_parameters=LLAMA3)),
    "mistral": (transformers.MistralForCausalLM, transformers.MistralConfig, dict(LLAMA, sliding_window=4)),
    "qwen2-biases": (transformers.Qwen2ForCausalLM, transformers.Qwen2Config, LLAMA),
    "bert": (transformers.BertModel, transformers.BertConfig,
             dict(vocab_size=101, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                  intermediate_size=128, max_position_embeddings=32, initializer_range=0.2)),
    "gemma-gqa3-bias": (transformers.GemmaForCausalLM, transformers.GemmaConfig,
                        dict(LLAMA, hidden_size=48, intermediate_size=96, num_attention_heads=3,
                             num_key_value_heads=1, head_dim=32, attention_bias=True)),
    "gemma2-softcap-window": (transformers.Gemma2ForCausalLM, transformers.Gemma2Config,
                              dict(LLAMA, hidden_size=48, intermediate_size=96, num_attention_heads=6,
                                   num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=24,
                                   sliding_window=4, attn_logit_softcapping=2.0, final_logit_softcapping=5.0)),
    "qwen3-gqa3-untied": (transformers.Qwen3ForCausalLM, transformers.Qwen3Config,
                          dict(LLAMA, num_attention_heads=6, num_key_value_heads=2, head_dim=12)),
    "phi3-gqa3": (transformers.Phi3ForCausalLM, transformers.Phi3Config,
                  dict(LLAMA, pad_token_id=None, hidden_size=48, num_attention_heads=6, num_key_value_heads=2)),
    "mixtral-top2-of-6": (transformers.MixtralForCausalLM, transformers.MixtralConfig,
                          dict(LLAMA, num_local_experts=6, num_experts_per_tok=2)),
    "qwen2-moe-shared": (transformers.Qwen2MoeForCausalLM, transformers.Qwen2MoeConfig,
                         dict(LLAMA, num_experts=6, num_experts_per_tok=2, moe_intermediate_size=32,
                              shared_expert_intermediate_size=48, norm_topk_prob=False)),
    "gpt-neox-parallel-rotary0.25": (transformers.GPTNeoXForCausalLM, transformers.GPTNeoXConfig,
                                     dict(NEOX, rotary_pct=0.25)),
    "gpt-neox-sequential-rotary0.5-tied": (transformers.GPTNeoXForCausalLM, transformers.GPTNeoXConfig,
                                           dict(NEOX, rotary_pct=0.5, use_parallel_residual=False,
                                                tie_word_embeddings=True)),
    "vit": (transformers.ViTModel, transformers.ViTConfig,
            dict(hidden_size=48, num_hidden_layers=2, num_attention_heads=3, intermediate_size=80,
                 image_size=16, patch_size=4, initializer_range=0.2)),
}
DEFAULT = [c for c in CASES if c != "gpt2-small-124M"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default=",".join(DEFAULT), help=f"from {', '.join(CASES)}")
    parser.add_argument("--meshes", default="1x1,2x2,4x2,8x1")
    args = parser.parse_args()
    transformers.logging.set_verbosity_error()
    meshes = args.meshes.split(",")
    print("| case | params | max abs reference | " + " | ".join(f"error {m}" for m in meshes) + " |")
    print("|---|---|---|" + "---|" * len(meshes))
    for case in args.cases.split(","):
        cls, config_cls, overrides = CASES[case]
        torch.manual_seed(0)
        model = cls(config_cls(**overrides)).eval()
        params = sum(p.numel() for name, p in model.named_parameters() if "lm_head" not in name or
                     not model.config.tie_word_embeddings)
        with tempfile.TemporaryDirectory() as directory:
            model.save_pretrained(directory)
            results = [port.verify(directory, port.make_mesh(m)) for m in meshes]
        row = " | ".join(f"{r.max_abs_diff:.2e}" for r in results)
        print(f"| {case} | {params / 1e6:.2f}M | {results[0].max_abs_reference:.3g} | {row} |", flush=True)


if __name__ == "__main__":
    main()
