"""Write a BERT checkpoint of the real base size with random weights (no download): many small tensors.

    python bench/make_bert.py base /tmp/bert-base

Sizes: base (110M parameters, 199 tensors), tiny (the benchmarks' smoke runs). The keys are
what `BertModel.save_pretrained` writes (`embeddings.`, `encoder.layer.N.`, `pooler.`).
"""

import argparse
import json
from pathlib import Path

import numpy as np
from make_gpt2 import save_shards

SIZES = {
    "tiny": dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=37, vocab_size=99),
    "base": dict(
        hidden_size=768, num_hidden_layers=12, num_attention_heads=12, intermediate_size=3072, vocab_size=30522
    ),
}


def config(size: str) -> dict:
    return {
        "model_type": "bert",
        "architectures": ["BertModel"],
        "hidden_act": "gelu",
        "hidden_dropout_prob": 0.1,
        "attention_probs_dropout_prob": 0.1,
        "max_position_embeddings": 512,
        "type_vocab_size": 2,
        "initializer_range": 0.02,
        "layer_norm_eps": 1e-12,
        "pad_token_id": 0,
        "position_embedding_type": "absolute",
        **SIZES[size],
    }


def shapes(cfg: dict) -> dict[str, tuple[int, ...]]:
    """Every tensor's key and shape, in `BertModel`'s order."""
    h, inner = cfg["hidden_size"], cfg["intermediate_size"]
    out = {
        "embeddings.word_embeddings.weight": (cfg["vocab_size"], h),
        "embeddings.position_embeddings.weight": (cfg["max_position_embeddings"], h),
        "embeddings.token_type_embeddings.weight": (cfg["type_vocab_size"], h),
        "embeddings.LayerNorm.weight": (h,),
        "embeddings.LayerNorm.bias": (h,),
    }
    for i in range(cfg["num_hidden_layers"]):
        layer = f"encoder.layer.{i}."
        for name in ("attention.self.query", "attention.self.key", "attention.self.value", "attention.output.dense"):
            out |= {f"{layer}{name}.weight": (h, h), f"{layer}{name}.bias": (h,)}
        out |= {
            f"{layer}attention.output.LayerNorm.weight": (h,),
            f"{layer}attention.output.LayerNorm.bias": (h,),
            f"{layer}intermediate.dense.weight": (inner, h),
            f"{layer}intermediate.dense.bias": (inner,),
            f"{layer}output.dense.weight": (h, inner),
            f"{layer}output.dense.bias": (h,),
            f"{layer}output.LayerNorm.weight": (h,),
            f"{layer}output.LayerNorm.bias": (h,),
        }
    return out | {"pooler.dense.weight": (h, h), "pooler.dense.bias": (h,)}


def write(size: str, out: Path, shards: int = 1) -> Path:
    cfg = config(size)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    rng = np.random.default_rng(0)
    tensors = {k: (rng.standard_normal(s, np.float32) * 0.02) for k, s in shapes(cfg).items()}
    save_shards(tensors, out, shards)
    return out


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("size", choices=sorted(SIZES))
    parser.add_argument("out", type=Path)
    parser.add_argument("--shards", type=int, default=1, help="files to write (with an index) instead of one")
    args = parser.parse_args()
    write(args.size, args.out, args.shards)
