"""Write Llama-shaped bfloat16 checkpoints with random weights, streamed to disk (no download, no torch model).

    python bench/make_llama.py 2b /tmp/llama-2b [--shards 4]

Sizes: 2b (hidden 2048, SwiGLU 5632, 32/4 heads, 42 layers, vocab 32000: 1.98B parameters, 3.96 GB),
4b (hidden 4096, SwiGLU 11008, 32/8 heads, 21 layers: 3.98B parameters, 7.96 GB, the GPU step of
bench/device.sh), tiny for the smoke runs. The layout is `LlamaForCausalLM.save_pretrained`'s:
`model.` keys, an untied `lm_head.weight`, `--shards N` files of about equal size with their
`model.safetensors.index.json`. Each file is written tensor by tensor (its header first), so memory
stays at one tensor; the values are random bfloat16 bits with exponents kept small (finite, |x| < 2).
"""

from __future__ import annotations

import argparse
import json
import math
import struct
from pathlib import Path

import numpy as np

SIZES = {
    "tiny": dict(
        hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2
    ),
    "2b": dict(
        hidden_size=2048, intermediate_size=5632, num_hidden_layers=42, num_attention_heads=32, num_key_value_heads=4
    ),
    "4b": dict(
        hidden_size=4096, intermediate_size=11008, num_hidden_layers=21, num_attention_heads=32, num_key_value_heads=8
    ),
}


def config(size: str) -> dict:
    return {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": 1024 if size == "tiny" else 32000,
        "max_position_embeddings": 2048,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "hidden_act": "silu",
        "torch_dtype": "bfloat16",
        **SIZES[size],
    }


def shapes(cfg: dict) -> dict[str, tuple[int, ...]]:
    """Every tensor's shape, in the order `save_pretrained` writes them."""
    e, f, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    kv = e // cfg["num_attention_heads"] * cfg["num_key_value_heads"]
    out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (v, e)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        out |= {
            p + "input_layernorm.weight": (e,),
            p + "self_attn.q_proj.weight": (e, e),
            p + "self_attn.k_proj.weight": (kv, e),
            p + "self_attn.v_proj.weight": (kv, e),
            p + "self_attn.o_proj.weight": (e, e),
            p + "post_attention_layernorm.weight": (e,),
            p + "mlp.gate_proj.weight": (f, e),
            p + "mlp.up_proj.weight": (f, e),
            p + "mlp.down_proj.weight": (e, f),
        }
    return out | {"model.norm.weight": (e,), "lm_head.weight": (v, e)}


def _random_bf16(n: int, rng: np.random.Generator) -> np.ndarray:
    bits = rng.integers(0, 1 << 16, n, dtype=np.uint16)
    bits &= 0x83FF  # the sign, the exponent's low 3 bits, the mantissa
    bits |= 0x3C00  # exponents 120..127: 2**-7 <= |x| < 2
    return bits


def _write_file(path: Path, names: list[str], every: dict[str, tuple[int, ...]], rng: np.random.Generator) -> None:
    header: dict = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name in names:
        nbytes = math.prod(every[name]) * 2
        header[name] = {"dtype": "BF16", "shape": list(every[name]), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the data section 8-byte aligned, as safetensors writes it
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text)
        for name in names:
            f.write(_random_bf16(math.prod(every[name]), rng).data)


def write(size: str, out: Path, shards: int = 1, seed: int = 0) -> Path:
    """A random `size` checkpoint in `out` (config.json, safetensors files, the index when `shards` > 1)."""
    cfg = config(size)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    every = shapes(cfg)
    rng = np.random.default_rng(seed)
    if shards == 1:
        _write_file(out / "model.safetensors", list(every), every, rng)
        return out
    total = sum(math.prod(s) * 2 for s in every.values())
    groups: list[list[str]] = [[]]
    size_so_far = 0
    for name, shape in every.items():
        if size_so_far >= total * len(groups) / shards and len(groups) < shards:
            groups.append([])
        groups[-1].append(name)
        size_so_far += math.prod(shape) * 2
    weight_map = {}
    for i, names in enumerate(groups):
        file = f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
        _write_file(out / file, names, every, rng)
        weight_map |= dict.fromkeys(names, file)
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return out


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("size", choices=sorted(SIZES))
    parser.add_argument("out", type=Path)
    parser.add_argument("--shards", type=int, default=1, help="files to write (with an index) instead of one")
    args = parser.parse_args()
    write(args.size, args.out, args.shards)
