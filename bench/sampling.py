"""Benchmark: port's logits processors against transformers' on the same logits.

    python bench/sampling.py [--batch 64] [--vocab 1000] [--seed 0] [--out FILE]

Random float32 logits `[batch, vocab]` (normal, scale 3, a few `-inf` entries, a few ties)
and random previous tokens go through each of port's processors (`port.nn`) and
transformers' processor of the same name (`generation/logits_process.py`), and through
the whole chain in transformers' order. Per row of the table: whether both keep the same
tokens (the rest set to `-inf`), and the largest relative difference of the kept logits.
transformers is imported here only; port does not depend on it.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _measure import markdown  # noqa: E402


def _compare(ours: np.ndarray, theirs: np.ndarray) -> tuple[bool, float]:
    """Whether the same entries are kept (finite), and the largest relative difference of those."""
    kept = np.isfinite(theirs)
    same = bool(np.array_equal(kept, np.isfinite(ours)))
    if not kept.any():
        return same, 0.0
    a, b = ours[kept].astype(np.float64), theirs[kept].astype(np.float64)
    return same, float(np.max(np.abs(a - b) / np.maximum(np.abs(b), 1e-30)))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--vocab", type=int, default=1000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=None, help="also write the table here")
    args = parser.parse_args(argv)

    import torch
    from transformers.generation import logits_process as hf

    import port.nn as pnn

    rng = np.random.default_rng(args.seed)
    logits = (3 * rng.standard_normal((args.batch, args.vocab))).astype(np.float32)
    logits[:, 1] = logits[:, 2]  # ties
    logits[rng.random(logits.shape) < 0.01] = -np.inf
    tokens = rng.integers(0, args.vocab, (args.batch, 12))
    t_logits, t_tokens = torch.from_numpy(logits), torch.from_numpy(tokens)

    def theirs(*processors) -> np.ndarray:
        out = t_logits.clone()
        for p in processors:
            out = p(t_tokens, out)
        return out.numpy()

    cases = [
        (
            "repetition penalty 1.3",
            pnn.penalize_repetition(logits, tokens, 1.3),
            theirs(hf.RepetitionPenaltyLogitsProcessor(1.3)),
        ),
        ("temperature 0.7", pnn.apply_temperature(logits, 0.7), theirs(hf.TemperatureLogitsWarper(0.7))),
        ("top-k 50", pnn.keep_top_k(logits, 50), theirs(hf.TopKLogitsWarper(50))),
        ("top-p 0.9", pnn.keep_top_p(logits, 0.9), theirs(hf.TopPLogitsWarper(0.9))),
        ("min-p 0.05", pnn.keep_min_p(logits, 0.05), theirs(hf.MinPLogitsWarper(0.05))),
        (
            "chain: penalty 1.3, temperature 0.7, top-k 50, top-p 0.9, min-p 0.05",
            pnn.process_logits(
                logits, tokens, repetition_penalty=1.3, temperature=0.7, top_k=50, top_p=0.9, min_p=0.05
            ),
            theirs(
                hf.RepetitionPenaltyLogitsProcessor(1.3),
                hf.TemperatureLogitsWarper(0.7),
                hf.TopKLogitsWarper(50),
                hf.TopPLogitsWarper(0.9),
                hf.MinPLogitsWarper(0.05),
            ),
        ),
    ]
    rows = []
    for name, ours, reference in cases:
        same, rel = _compare(np.asarray(ours), reference)
        rows.append([name, "yes" if same else "NO", f"{rel:.3g}"])
    table = markdown(["processor", "same tokens kept", "largest relative difference"], rows)
    heading = f"Logits {args.batch} x {args.vocab}, float32, seed {args.seed}\n\n"
    print(heading + table)
    if args.out is not None:
        args.out.write_text(heading + table + "\n")
    return 0 if all(r[1] == "yes" for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
