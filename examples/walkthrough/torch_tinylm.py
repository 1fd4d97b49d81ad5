"""TinyLM in PyTorch: an architecture port does not ship, for the walkthrough.

A pre-LayerNorm causal transformer with a fused `qkv` projection, exact GELU and
a tied LM head. `save_pretrained` writes `config.json` and `model.safetensors`
like a Hugging Face checkpoint; `from_pretrained` reads them back, so `port verify`
can use it as the reference.

    python torch_tinylm.py tinylm-checkpoint     # writes a random checkpoint there
"""

import json
import math
import sys
from pathlib import Path
from types import SimpleNamespace

import torch
from safetensors.torch import load_file, save_file
from torch import nn

CONFIG = {
    "model_type": "tinylm",
    "vocab_size": 97,
    "hidden_size": 48,
    "num_heads": 4,
    "num_layers": 3,
    "max_positions": 64,
    "layer_norm_eps": 1e-5,
}


class Block(nn.Module):
    def __init__(self, config: dict):
        super().__init__()
        e, eps = config["hidden_size"], config["layer_norm_eps"]
        self.heads = config["num_heads"]
        self.norm1 = nn.LayerNorm(e, eps=eps)
        self.qkv = nn.Linear(e, 3 * e)  # rows: all q, then all k, then all v
        self.out = nn.Linear(e, e)
        self.norm2 = nn.LayerNorm(e, eps=eps)
        self.ff1 = nn.Linear(e, 4 * e)
        self.ff2 = nn.Linear(4 * e, e)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, e = x.shape
        q, k, v = self.qkv(self.norm1(x)).split(e, dim=-1)
        q, k, v = (t.view(b, s, self.heads, -1).transpose(1, 2) for t in (q, k, v))
        scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
        causal = torch.ones(s, s, dtype=torch.bool).tril()
        attn = scores.masked_fill(~causal, float("-inf")).softmax(-1) @ v
        x = x + self.out(attn.transpose(1, 2).reshape(b, s, e))
        return x + self.ff2(nn.functional.gelu(self.ff1(self.norm2(x))))


class TinyLM(nn.Module):
    def __init__(self, config: dict):
        super().__init__()
        self.config = config
        self.embed = nn.Embedding(config["vocab_size"], config["hidden_size"])
        self.pos = nn.Embedding(config["max_positions"], config["hidden_size"])
        self.blocks = nn.ModuleList(Block(config) for _ in range(config["num_layers"]))
        self.norm = nn.LayerNorm(config["hidden_size"], eps=config["layer_norm_eps"])

    def forward(self, input_ids: torch.Tensor) -> SimpleNamespace:
        x = self.embed(input_ids) + self.pos(torch.arange(input_ids.shape[1]))
        for block in self.blocks:
            x = block(x)
        return SimpleNamespace(logits=self.norm(x) @ self.embed.weight.T)

    def save_pretrained(self, directory) -> None:
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        (directory / "config.json").write_text(json.dumps(self.config, indent=2))
        save_file({k: v.contiguous() for k, v in self.state_dict().items()}, directory / "model.safetensors")

    @classmethod
    def from_pretrained(cls, directory, dtype=torch.float32, **unused) -> "TinyLM":
        directory = Path(directory)
        model = cls(json.loads((directory / "config.json").read_text()))
        model.load_state_dict(load_file(directory / "model.safetensors"))
        return model.to(dtype).eval()


if __name__ == "__main__":
    torch.manual_seed(0)
    TinyLM(CONFIG).save_pretrained(sys.argv[1] if len(sys.argv) > 1 else "tinylm-checkpoint")
