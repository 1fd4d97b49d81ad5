"""Measure logit parity of port's GPT-2 against transformers' GPT2LMHeadModel, per mesh.

    python bench/parity.py [--size tiny|small] [--meshes 1x1,2x2,4x2,8x1]

Writes a random-init checkpoint with `transformers` (float32) into a temporary
directory, converts it with `port.load` on each mesh, and prints the largest
absolute difference of the logits on the same random input ids.
"""

import argparse
import tempfile

import jax

jax.config.update("jax_num_cpu_devices", 8)

import equinox as eqx  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
from transformers import GPT2Config, GPT2LMHeadModel  # noqa: E402

import port  # noqa: E402

CONFIGS = {
    "tiny": dict(vocab_size=101, n_positions=32, n_embd=64, n_layer=2, n_head=4, initializer_range=0.2),
    "small": dict(vocab_size=50257, n_positions=1024, n_embd=768, n_layer=12, n_head=12),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="tiny", choices=sorted(CONFIGS))
    parser.add_argument("--meshes", default="1x1,2x2,4x2,8x1")
    args = parser.parse_args()
    torch.manual_seed(0)
    config = GPT2Config(**CONFIGS[args.size], bos_token_id=0, eos_token_id=0)
    config._attn_implementation = "eager"
    model = GPT2LMHeadModel(config).eval()
    ids = np.random.default_rng(0).integers(0, config.vocab_size, (2, 32))
    with torch.no_grad():
        expected = model(torch.tensor(ids)).logits.numpy()
    forward = eqx.filter_jit(lambda m, x: m(x))
    with tempfile.TemporaryDirectory() as directory:
        model.save_pretrained(directory)
        print(f"GPT-2 {args.size}: {sum(p.numel() for p in model.transformer.parameters()) / 1e6:.1f}M params, "
              f"max |logit| {np.abs(expected).max():.3f}")
        print("| mesh | max abs error |")
        print("|---|---|")
        for mesh in args.meshes.split(","):
            converted = port.load(directory, mesh=port.make_mesh(mesh))
            error = np.abs(np.asarray(forward(converted, ids)) - expected).max()
            print(f"| {mesh} | {error:.2e} |")


if __name__ == "__main__":
    main()
