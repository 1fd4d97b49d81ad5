"""Write the tiny GPT-2 checkpoint used by the offline quickstart (examples/tiny-gpt2).

A Hugging Face layout (`config.json`, `model.safetensors`, keys with the
`transformer.` prefix, as `GPT2LMHeadModel.save_pretrained` writes them) with
random weights from a fixed seed, made with NumPy only:

    python examples/make_tiny_gpt2.py [OUT_DIR]
"""

import json
import sys
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

CONFIG = {
    "model_type": "gpt2",
    "architectures": ["GPT2LMHeadModel"],
    "vocab_size": 1021,
    "n_positions": 64,
    "n_embd": 64,
    "n_layer": 2,
    "n_head": 4,
    "n_inner": None,
    "activation_function": "gelu_new",
    "layer_norm_epsilon": 1e-5,
    "tie_word_embeddings": True,
    "scale_attn_weights": True,
    "bos_token_id": 0,
    "eos_token_id": 0,
}


def tensors(config: dict, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    e, v, p = config["n_embd"], config["vocab_size"], config["n_positions"]
    normal = lambda *shape: (0.02 * rng.standard_normal(shape)).astype(np.float32)  # noqa: E731
    out = {"transformer.wte.weight": normal(v, e), "transformer.wpe.weight": normal(p, e)}
    for i in range(config["n_layer"]):
        h = f"transformer.h.{i}."
        out |= {
            h + "ln_1.weight": np.ones(e, np.float32),
            h + "ln_1.bias": np.zeros(e, np.float32),
            h + "attn.c_attn.weight": normal(e, 3 * e),
            h + "attn.c_attn.bias": np.zeros(3 * e, np.float32),
            h + "attn.c_proj.weight": normal(e, e),
            h + "attn.c_proj.bias": np.zeros(e, np.float32),
            h + "ln_2.weight": np.ones(e, np.float32),
            h + "ln_2.bias": np.zeros(e, np.float32),
            h + "mlp.c_fc.weight": normal(e, 4 * e),
            h + "mlp.c_fc.bias": np.zeros(4 * e, np.float32),
            h + "mlp.c_proj.weight": normal(4 * e, e),
            h + "mlp.c_proj.bias": np.zeros(e, np.float32),
        }
    out |= {"transformer.ln_f.weight": np.ones(e, np.float32), "transformer.ln_f.bias": np.zeros(e, np.float32)}
    return out


def main(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(CONFIG, indent=2) + "\n")
    save_file(tensors(CONFIG), out / "model.safetensors", metadata={"format": "pt"})


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).parent / "tiny-gpt2")
