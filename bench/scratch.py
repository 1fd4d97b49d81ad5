"""Benchmark: a model trained from scratch, exported to Hugging Face, against transformers' logits.

    python bench/scratch.py [--models llama,gpt2] [--steps 20] [--out FILE]

For each model a tiny config (hidden 64, 2 layers, vocabulary 101) builds port's module
with `from_config` (no checkpoint anywhere), which trains `--steps` SGD steps of
`port.nn.next_token_loss` on random tokens; `port.export(model, out, config=config)` then
writes it, each tensor's name, shape and dtype derived from the mapping, the config and
the leaves (`port._export._derive`). transformers' `AutoModelForCausalLM.from_pretrained`
loads the directory; the table gives its missing and unexpected keys, the loss before and
after training, and the largest difference of its logits from the JAX model's on the same
tokens. transformers is imported here only; port does not depend on it.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _measure import markdown  # noqa: E402

VOCAB = 101
CONFIGS = {
    "llama": dict(
        model_type="llama",
        architectures=["LlamaForCausalLM"],
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    ),
    "gpt2": dict(
        model_type="gpt2",
        architectures=["GPT2LMHeadModel"],
        vocab_size=VOCAB,
        n_positions=64,
        n_embd=64,
        n_layer=2,
        n_head=4,
        bos_token_id=0,
        eos_token_id=0,
    ),
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="llama,gpt2")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--out", type=Path, default=None, help="also write the table here")
    args = parser.parse_args(argv)

    import equinox as eqx
    import jax
    import jax.numpy as jnp
    import torch
    import transformers

    import port
    import port.nn
    from port._mapping import mapping_for

    rng = np.random.default_rng(0)
    batch = jnp.asarray(rng.integers(0, VOCAB, (8, 32)))
    probe = rng.integers(0, VOCAB, (2, 16))
    rows = []
    for name in args.models.split(","):
        config = CONFIGS[name]
        build = mapping_for(config).model_object()
        model = build.from_config(config, key=jax.random.key(0))

        @eqx.filter_jit
        def step(model, ids):
            loss, grads = eqx.filter_value_and_grad(lambda m: port.nn.next_token_loss(m(ids), ids))(model)
            return eqx.apply_updates(model, jax.tree.map(lambda g: -0.5 * g, grads)), loss

        first = last = float("nan")
        for i in range(args.steps):
            model, loss = step(model, batch)
            first, last = (float(loss), float(loss)) if i == 0 else (first, float(loss))
        ours = np.asarray(eqx.filter_jit(lambda m, ids: m(ids))(model, jnp.asarray(probe)))
        with tempfile.TemporaryDirectory() as tmp:
            report = port.export(model, Path(tmp) / "hf", config=config)
            hf, info = transformers.AutoModelForCausalLM.from_pretrained(
                report.out, output_loading_info=True, dtype=torch.float32
            )
            with torch.no_grad():
                theirs = hf.eval()(torch.from_numpy(probe)).logits.numpy()
        rows.append(
            [
                name,
                f"{report.tensors}",
                f"{len(info['missing_keys'])} / {len(info['unexpected_keys'])}",
                f"{first:.4f} -> {last:.4f}",
                f"{np.abs(theirs).max():.3g}",
                f"{np.abs(theirs - ours).max():.3g}",
            ]
        )
    header = ["model", "tensors", "missing / unexpected keys", "loss first -> last", "max abs logit", "max abs diff"]
    table = markdown(header, rows)
    print(table)
    if args.out is not None:
        args.out.write_text(table + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
