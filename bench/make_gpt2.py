"""Write GPT-2 checkpoints of the real sizes with random weights (no download).

    python bench/make_gpt2.py small /tmp/gpt2-small [--dtype bfloat16] [--shards 4]

Sizes: small (124M), medium (355M), large (774M); tiny (0.2M) for the benchmarks' smoke runs. The layout is what
`GPT2LMHeadModel.save_pretrained` writes: `transformer.` keys, tied head absent; with `--shards N`,
N files of about equal size and their `model.safetensors.index.json`, as `max_shard_size` gives.
"""

import argparse
import importlib.util
import json
from pathlib import Path

import ml_dtypes
import numpy as np
from safetensors.numpy import save_file

SIZES = {
    "tiny": dict(n_embd=64, n_layer=2, n_head=4, vocab_size=1021, n_positions=128),  # the benchmarks' smoke runs
    "small": dict(n_embd=768, n_layer=12, n_head=12),
    "medium": dict(n_embd=1024, n_layer=24, n_head=16),
    "large": dict(n_embd=1280, n_layer=36, n_head=20),
}

_spec = importlib.util.spec_from_file_location(
    "make_tiny_gpt2", Path(__file__).parents[1] / "examples" / "make_tiny_gpt2.py"
)
_tiny = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_tiny)


def config(size: str) -> dict:
    return {
        **_tiny.CONFIG,
        "vocab_size": 50257,
        "n_positions": 1024,
        "bos_token_id": 50256,
        "eos_token_id": 50256,
        **SIZES[size],
    }


def write(size: str, out: Path, dtype: str = "float32", shards: int = 1) -> Path:
    cfg = config(size)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    target = ml_dtypes.bfloat16 if dtype == "bfloat16" else np.dtype(dtype)
    tensors = {k: v.astype(target) for k, v in _tiny.tensors(cfg).items()}
    save_shards(tensors, out, shards)
    return out


def save_shards(tensors: dict, out: Path, shards: int = 1) -> None:
    """`tensors` in `out/model.safetensors`, or in `shards` files of about equal size (keys in
    order) with their index, as `save_pretrained(max_shard_size=...)` writes them."""
    if shards == 1:
        save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
        return
    total = sum(v.nbytes for v in tensors.values())
    groups, size = [[]], 0
    for key, value in tensors.items():
        if size >= total * len(groups) / shards and len(groups) < shards:
            groups.append([])
        groups[-1].append(key)
        size += value.nbytes
    weight_map = {}
    for i, keys in enumerate(groups):
        name = f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
        save_file({k: tensors[k] for k in keys}, out / name, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(keys, name))
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("size", choices=sorted(SIZES))
    parser.add_argument("out", type=Path)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--shards", type=int, default=1, help="files to write (with an index) instead of one")
    args = parser.parse_args()
    write(args.size, args.out, args.dtype, args.shards)
