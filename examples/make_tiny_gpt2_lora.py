"""Write the tiny LoRA adapter for the tiny GPT-2 (examples/tiny-gpt2-lora), as PEFT saves one.

`adapter_config.json` and `adapter_model.safetensors` in the layout
`PeftModel.save_pretrained` writes (keys `base_model.model.<module>.lora_A.weight` [r, in]
and `lora_B.weight` [out, r], GPT-2's `Conv1D` modules with `fan_in_fan_out`), rank 4 on
every `c_fc` and `c_proj`, random factors from a fixed seed (both non-zero, so the adapter
changes the model), made with NumPy only:

    python examples/make_tiny_gpt2_lora.py [OUT_DIR]
"""

import json
import sys
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

RANK, ALPHA = 4, 8
CONFIG = {
    "peft_type": "LORA",
    "task_type": "CAUSAL_LM",
    "base_model_name_or_path": None,
    "r": RANK,
    "lora_alpha": ALPHA,
    "lora_dropout": 0.0,
    "target_modules": ["c_fc", "c_proj"],
    "fan_in_fan_out": True,
    "bias": "none",
    "use_rslora": False,
    "use_dora": False,
    "modules_to_save": None,
    "rank_pattern": {},
    "alpha_pattern": {},
    "init_lora_weights": True,
    "inference_mode": True,
}


def tensors(embd: int = 64, layers: int = 2, seed: int = 1) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    normal = lambda *shape: (0.05 * rng.standard_normal(shape)).astype(np.float32)  # noqa: E731
    out = {}
    for i in range(layers):
        for module, (n_in, n_out) in {
            "attn.c_proj": (embd, embd),
            "mlp.c_fc": (embd, 4 * embd),
            "mlp.c_proj": (4 * embd, embd),
        }.items():
            key = f"base_model.model.transformer.h.{i}.{module}"
            out[f"{key}.lora_A.weight"] = normal(RANK, n_in)
            out[f"{key}.lora_B.weight"] = normal(n_out, RANK)
    return out


def main(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "adapter_config.json").write_text(json.dumps(CONFIG, indent=2) + "\n")
    save_file(tensors(), out / "adapter_model.safetensors", metadata={"format": "pt"})


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).parent / "tiny-gpt2-lora")
